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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CompileError, ConfigError
from ..key import digest
from ..keyed_env import CC_KEY_ENVIRONMENT, CC_SIDE_OUTPUT_ENVIRONMENT
from ..request import OpRequest
from .toolchain import file_identity, kernel_name, run_tool, which

C_SOURCES = (".c", ".cc", ".cpp", ".cxx", ".C", ".s", ".S")
CANDIDATES = ("cc", "gcc", "clang")
_MACRO_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


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

    @classmethod
    def usable(cls, environ: Mapping[str, str]) -> tuple[bool, str]:
        try:
            argv = find_cc(environ)
        except ConfigError as e:
            return False, str(e)
        return (True, argv[0]) if argv else (False, "no C compiler (CC, cc, gcc, clang)")

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            version = subprocess.run(
                [*self.argv, "--version"], capture_output=True, check=False, env=self._environ
            ).stdout
            # The variables that change gcc's output; the epoch dates the clock macros.
            names = (*CC_KEY_ENVIRONMENT, "SOURCE_DATE_EPOCH")
            keyed = [(name, self._environ[name]) for name in names if name in self._environ]
            self._fingerprint = "|".join(
                [*self.argv[1:], file_identity(self.argv[0]), digest(version), repr(keyed)]
            )
        return self._fingerprint

    def compile(self, request: OpRequest, workdir: Path) -> None:
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
        with tempfile.TemporaryDirectory(prefix="opcache-cc-") as src:
            for name, data in sources.items():
                Path(src, name).write_bytes(data)
                os.utime(Path(src, name), (stamp, stamp))
            # Relative names and a fixed cwd keep temp paths out of the object file.
            argv = [*self.argv, *self._flags(request), "-c", main[0], "-o", str(obj)]
            run_tool(
                argv,
                cwd=Path(src),
                environ=self._compile_environ(epoch),
                what=f"cc {request.op_type}",
            )
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
