"""The machine's C compiler as an operator compiler.

Compiles the request's C source into ``<kernel>.o`` and describes it in
``<kernel>.json`` (with the object's sha256, as CANN's kernel descriptions do).
Shapes, dtypes and attrs reach the source as ``-D`` defines; options become
flags.  On machines without Ascend hardware this back-end gives the demo, the
tests and the benchmarks real compiles.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import readset
from ..errors import CompileError, ConfigError
from ..key import digest
from ..keyed_env import (
    CC_ARGUMENT_ENVIRONMENT,
    CC_INCLUDE_ENVIRONMENT,
    CC_KEY_ENVIRONMENT,
    CC_PROGRAM_ENVIRONMENT,
    CC_SIDE_OUTPUT_ENVIRONMENT,
)
from ..request import OpRequest
from ..storage.entry import READS_CHECKED
from . import cc_driver
from .toolchain import file_identity, kernel_name, run_tool, tool_changed, which

C_SOURCES = (".c", ".cc", ".cpp", ".cxx", ".C", ".s", ".S")
CANDIDATES = ("cc", "gcc", "clang")
_MACRO_UNSAFE = re.compile(r"[^A-Za-z0-9_]")
# The programs a compile (-c) may run: gcc's compilers proper and the assembler
# (clang answers with names it never runs, which are then found nowhere).
_PROGRAMS = ("cc1", "cc1plus", "as")
# Flags by which the driver reads files or runs programs that no dependency list
# names (programs and specs from -B folders, another root for the system headers,
# a plugin, a program run around each tool, a profile), or by which the object
# names a file beside it (coverage data): what they read is not in the key.
_UNKEYED_FLAGS = (
    "-B", "-specs", "--specs", "--sysroot", "-isysroot", "-iplugindir", "-fplugin",
    "-wrapper", "-fprofile-", "-fauto-profile", "--coverage", "-ftest-coverage",
)  # fmt: skip


def find_cc(environ: Mapping[str, str]) -> list[str] | None:
    """``CC`` (which may carry arguments), else the first of cc, gcc, clang on PATH.

    Raises ConfigError for a ``CC`` that is no command line.
    """
    if environ.get("CC"):
        argv = command_line(environ["CC"], "CC", variable="CC")
        found = which(argv[0], environ)
        return [found, *argv[1:]] if found else None
    for name in CANDIDATES:
        found = which(name, environ)
        if found:
            return [found]
    return None


def command_line(text: str, setting: str, *, variable: str | None = None) -> list[str]:
    """A compiler and its arguments, split as a shell would; ConfigError if there are none."""
    try:
        argv = shlex.split(text)
    except ValueError as e:  # an unclosed quote
        raise ConfigError(
            f"{setting}={text!r} is not a command line: {e}", variable=variable
        ) from None
    if not argv:
        raise ConfigError(f"{setting}={text!r} names no compiler", variable=variable)
    return argv


class CcCompiler:
    """A real C compiler behind the cache.

    Options of a request: ``flags`` (a list of extra compiler flags, e.g.
    ``["-O3"]``; ``-O2`` when none sets the level); every other option becomes
    ``-DOPT_<NAME>=<value>``.
    """

    name = "cc"

    def __init__(self, cc: str | None = None, *, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        argv = command_line(cc, "cc") if cc else find_cc(env)
        if not argv:
            raise ConfigError(
                f"cc: no C compiler found: CC={env['CC']!r} is not on PATH"
                if env.get("CC")
                else "cc: no C compiler found: CC is unset and none of cc, gcc, clang is on PATH"
            )
        self.argv = argv
        self._environ = dict(env)
        self._fingerprint: str | None = None
        self._toolchain: _Toolchain | None = None
        # Looked at (a stat each) at every compile: the driver, the programs it runs and
        # its include folders (a package upgrade renames files into them).
        self._watched: list[str] = [argv[0]]

    @classmethod
    def usable(cls, environ: Mapping[str, str]) -> tuple[bool, str]:
        try:
            argv = find_cc(environ)
        except ConfigError as e:
            return False, str(e)
        return (True, argv[0]) if argv else (False, "no C compiler (CC, cc, gcc, clang)")

    checks_its_tools = True  # (KeyFlow asks the fingerprint at every compile)

    def fingerprint(self) -> str:
        if self._fingerprint is None or tool_changed(self, *self._watched):
            version = subprocess.run(
                [*self.argv, "--version"], capture_output=True, check=False, env=self._environ
            ).stdout
            # The variables that change gcc's output; the epoch dates the clock macros.
            names = (*CC_KEY_ENVIRONMENT, "SOURCE_DATE_EPOCH")
            keyed = [(name, self._environ[name]) for name in names if name in self._environ]
            self._toolchain = _Toolchain(self.argv[0], self._environ)
            self._fingerprint = "|".join(
                [
                    *self.argv[1:],
                    file_identity(self.argv[0]),
                    digest(version),
                    repr(keyed),
                    self._toolchain.identity(),
                    READS_CHECKED,
                ]
            )
            self._watched = [self.argv[0], *self._toolchain.watched()]
            tool_changed(self, *self._watched)  # (as the fingerprint found them)
        return self._fingerprint

    def compile(self, request: OpRequest, workdir: Path) -> str | readset.ReadSet:
        """Compile into ``workdir``; return why the object must not be stored, if it
        read anything the key does not hold, else the system headers it read, which
        a hit checks (see ``_unkeyed_read``)."""
        self.fingerprint()  # (what the compile's reads are checked against)
        assert self._toolchain is not None
        workdir = Path(os.path.abspath(workdir))  # the tool runs in another folder
        sources = request.source_bytes
        main = [name for name in sources if name.endswith(C_SOURCES)]
        if len(main) != 1:
            raise CompileError(
                f"cc: {request.op_type}: needs exactly one C source ({', '.join(C_SOURCES)}), "
                f"got {sorted(sources) or 'none'}"
            )
        kernel = kernel_name(request)
        obj = workdir / f"{kernel}.o"
        # The clock macros (__DATE__, __TIME__, __TIMESTAMP__) from the epoch, as
        # the fingerprint holds it: a kernel is the same whenever it is compiled.
        epoch = self._environ.get("SOURCE_DATE_EPOCH") or "0"
        stamp = int(epoch) if epoch.isdigit() else 0  # (gcc itself refuses a bad one)
        flags = self._flags(request)
        # The sources go one level down in a private folder: `#include "../x.h"`
        # then finds nothing of others' (in $TMPDIR) but opcache's own.
        with tempfile.TemporaryDirectory(prefix="opcache-cc-") as private:
            src = os.path.join(private, "src")
            os.mkdir(src)
            for name, data in sources.items():
                Path(src, name).write_bytes(data)
                os.utime(Path(src, name), (stamp, stamp))
            # The compiler lists every file its preprocessor read as it compiles (no
            # second run, the same object); a .s source is not preprocessed.
            deps = os.path.join(private, "deps")
            listed = [] if main[0].endswith(".s") else ["-MD", "-MF", deps, "-MT", "o"]
            # Relative names and a fixed cwd keep temp paths out of the object file.
            argv = [*self.argv, *flags, "-c", main[0], "-o", str(obj), *listed]
            started_ns = time.time_ns()
            run_tool(
                argv,
                cwd=Path(src),
                environ=self._compile_environ(epoch),
                what=f"cc {request.op_type}",
            )
            said = self._unkeyed_read(flags, sources, src, deps if listed else None, started_ns)
        description = {
            "kernelName": kernel,
            "opType": request.op_type,
            "socVersion": request.soc_version,
            "binFileName": obj.name,
            "sha256": hashlib.sha256(obj.read_bytes()).hexdigest(),
            "inputs": list(request.inputs),
            "outputs": list(request.outputs),
        }
        (workdir / f"{kernel}.json").write_text(json.dumps(description, indent=2, sort_keys=True))
        return said

    def _unkeyed_read(
        self,
        flags: list[str],
        sources: Mapping[str, bytes],
        src: str,
        deps: str | None,
        started_ns: int,
    ) -> str | readset.ReadSet:
        """Why the compile just run (from ``started_ns``) may have read what the key
        does not hold, else the read set of the system headers it read.

        The key holds the request's sources and the fingerprint.  Whatever
        else the compile read (a header through -I, -include, CPATH, a
        relative path out of the private folder) is named by the dependency
        list ``deps`` and refused, unless it is a system header of the
        toolchain's own folders, which the fingerprint covers as they were
        when it was taken, and the entry's read set as they are now (a hit of
        a long-lived compiler object checks them).  What no such
        list names (the programs run, specs files, files flags or assembler
        directives name) is refused by the flags, the environment and the
        programs found, checked again now against the fingerprint's.
        """
        toolchain = self._toolchain
        assert toolchain is not None
        for name in (*CC_PROGRAM_ENVIRONMENT, *CC_ARGUMENT_ENVIRONMENT):
            if self._environ.get(name):
                return f"cc: {name} is set (the programs or flags it adds are not keyed)"
        flags = [*self.argv[1:], *flags]  # (CC may carry flags too)
        for flag in flags:
            if flag.startswith("@") or ",@" in flag:
                return "cc: response files are not supported"
            if flag.startswith("-M"):
                return f"cc: {flag}: the dependency list is opcache's own (what a compile read)"
            if flag.startswith(_UNKEYED_FLAGS):
                return f"cc: {flag} reads or names files the key does not hold"
        for name, data in sources.items():
            directives = cc_driver.directives_in(data)
            if directives:
                why = cc_driver.FILE_DIRECTIVES[directives[0]]
                return f"cc: a {directives[0]} directive in {name} {why}"
        changed = toolchain.changed()
        if changed:
            return changed
        if deps is None:
            read: list[str] = []
        else:
            try:
                with open(deps, encoding="utf-8", errors="surrogateescape") as f:
                    read = cc_driver.make_prerequisites(f.read())
            except OSError as e:
                return f"cc: the compile listed no files read ({e.strerror})"
        own = {os.path.realpath(os.path.join(src, name)) for name in sources}
        read_here = [os.path.realpath(os.path.join(src, name)) for name in read]
        for path in read_here:
            outside = None if path in own else toolchain.outside(path)
            if outside:
                return outside
        known = own.union(read_here)
        for flag in flags:
            for word in [flag, *re.split("[=,]", flag)[1:]]:
                named = os.path.realpath(os.path.join(src, word)) if word else ""
                if named and named not in known and os.path.isfile(named):
                    return f"cc: {flag} names {named}, which the key does not hold"
        # The system headers, as the compile named them (through their links): a hit
        # is served only while each is as it is now (an edit in place, which moves
        # no folder the fingerprint holds, included).
        # (each by its real folder: `#include "../../usr/include/x.h"` names the private
        # folder, gone after the compile, in its path)
        headers = [readset.real_folder(os.path.join(src, name)) for name in read]
        headers = [path for path in headers if os.path.realpath(path) not in own]
        try:
            return readset.of_files(headers, started_ns)
        except readset.Unprovable as e:
            return f"cc: {e}"

    def _compile_environ(self, epoch: str) -> dict[str, str]:
        # A dependency file the environment asks for would be written by a miss only.
        env = {k: v for k, v in self._environ.items() if k not in CC_SIDE_OUTPUT_ENVIRONMENT}
        return {**env, "SOURCE_DATE_EPOCH": epoch}

    def _flags(self, request: OpRequest) -> list[str]:
        options = dict(request.options)
        extra = options.pop("flags", [])
        flags = [extra] if isinstance(extra, str) else [str(f) for f in extra]
        if not any(f.startswith("-O") for f in flags):
            flags.insert(0, "-O2")
        defines = [f"-DOP_TYPE={_macro(request.op_type)}", f"-DKERNEL_NAME={kernel_name(request)}"]
        for kind, tensors in (("IN", request.inputs), ("OUT", request.outputs)):
            defines.append(f"-D{kind}_COUNT={len(tensors)}")
            for i, tensor in enumerate(tensors):
                defines += _tensor_defines(f"{kind}{i}", tensor)
        for name, value in sorted(request.attrs.items()):
            defines.append(f"-DATTR_{_macro(name).upper()}={_value(value)}")
        for name, value in sorted(options.items()):
            defines.append(f"-DOPT_{_macro(name).upper()}={_value(value)}")
        return flags + defines


class _Toolchain:
    """What a compile may read beside its sources and the driver: the programs it
    runs, specs files, the system headers of its default include folders.

    Probed once per compiler (a handful of driver runs and one walk of the
    include folders' tree, folders only) for the fingerprint, and checked
    again, cheaply, after each compile: a miss that ran another assembler or
    read a header of a folder changed since is not stored.  The folders'
    identities (inode, mtime, ctime) catch what a package upgrade does: dpkg
    and rpm put each file in place by a rename, which moves its folder's times.
    A header rewritten in place (its folder untouched) is not caught.
    """

    def __init__(self, cc: str, environ: Mapping[str, str]) -> None:
        self._environ = environ
        said = self._says(cc, "-print-search-dirs")
        self._searched = said is not None
        search_dirs = cc_driver.search_dirs(said) if said is not None else {}
        self._specs = cc_driver.specs_places(search_dirs)
        # A program the driver names bare is looked for in its own folders, then PATH.
        programs = cc_driver.search_folders(search_dirs, "programs")
        path = os.pathsep.join([*programs, environ.get("PATH", os.defpath)])
        self._programs = {
            name: (self._says(cc, f"-print-prog-name={name}") or "").strip() for name in _PROGRAMS
        }
        self._path = {"PATH": path}
        self._found = self._programs_found()
        # The driver's own list: without the variables that add to it, and in English.
        env = {k: v for k, v in environ.items() if k not in CC_INCLUDE_ENVIRONMENT}
        env["LC_ALL"] = "C"
        roots: list[str] = []
        for language in ("c", "c++"):
            listing = [cc, "-E", "-v", "-x", language, os.devnull, "-o", os.devnull]
            done = subprocess.run(listing, capture_output=True, env=env, check=False)
            if done.returncode == 0:
                roots += cc_driver.search_list(done.stderr.decode(errors="surrogateescape"))[1]
        self._roots = list(dict.fromkeys(os.path.realpath(root) for root in roots))
        self._folders = {
            folder: _folder_identity(folder)
            for root in self._roots
            for folder, _, _ in os.walk(root)
        }

    def _says(self, cc: str, flag: str) -> str | None:
        done = subprocess.run([cc, flag], capture_output=True, env=dict(self._environ), check=False)
        return done.stdout.decode(errors="surrogateescape") if done.returncode == 0 else None

    def _programs_found(self) -> dict[str, str]:
        found = {}
        for name, place in self._places().items():
            found[name] = file_identity(place) if place and os.path.isfile(place) else ""
        return found

    def _places(self) -> dict[str, str | None]:
        """Where each program the driver runs is found (None: nowhere)."""
        return {
            name: said if os.sep in said else which(said, self._path) if said else None
            for name, said in self._programs.items()
        }

    def watched(self) -> list[str]:
        """The programs found and the default include folders: what a stat per compile
        tells changed (``tool_changed``); a folder below those is checked at a miss."""
        return [*(place for place in self._places().values() if place), *self._roots]

    def _specs_found(self) -> list[str]:
        return [place for place in self._specs if os.path.lexists(place)]

    def identity(self) -> str:
        """The toolchain as the fingerprint holds it."""
        folders = sorted(self._folders.items())
        return digest(repr((self._found, self._specs_found(), self._roots, folders)).encode())

    def changed(self) -> str | None:
        """Why what the fingerprint holds of the programs and specs no longer holds."""
        if not self._searched:
            return "cc: -print-search-dirs failed: where the driver looks for specs is unknown"
        specs = self._specs_found()
        if specs:
            return f"cc: gcc may read the specs file {specs[0]} (not keyed)"
        for name, found in self._programs_found().items():
            if found != self._found[name]:
                return f"cc: the {name} the compiler runs changed since its fingerprint was taken"
        return None

    def outside(self, path: str) -> str | None:
        """Why a file the compile read (a real path, not a source) is not covered, or None."""
        folder = os.path.dirname(path)
        known = self._folders.get(folder)
        if known is None:
            return f"cc: it read {path}, no source of the request nor a system header (not keyed)"
        if _folder_identity(folder) != known:
            return f"cc: the system header folder {folder} changed since the fingerprint was taken"
        return None


def _folder_identity(folder: str) -> tuple[int, int, int]:
    try:
        st = os.stat(folder)
    except OSError:
        return (0, 0, 0)
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def _tensor_defines(prefix: str, tensor: Mapping[str, Any]) -> list[str]:
    shape = [int(d) for d in tensor.get("shape", [])]
    size = 1
    for dim in shape:
        size *= max(dim, 0)
    out = [
        f"-D{prefix}_NDIM={len(shape)}",
        f"-D{prefix}_SIZE={size}",
        f"-D{prefix}_SHAPE={{{','.join(map(str, shape))}}}",
    ]
    if "dtype" in tensor:
        out.append(f"-D{prefix}_DTYPE_{_macro(str(tensor['dtype'])).upper()}=1")
    if "format" in tensor:
        out.append(f"-D{prefix}_FORMAT_{_macro(str(tensor['format'])).upper()}=1")
    return out


def _macro(text: str) -> str:
    return _MACRO_UNSAFE.sub("_", text)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return value
    return json.dumps(value if isinstance(value, str) else json.dumps(value, sort_keys=True))
