"""The masquerade: links named like a compiler that run opcache, and the real compiler past them.

A link named ``gcc`` (or ``cc``, ``x86_64-linux-gnu-gcc-12``, ``bisheng``, ``opc``...) that
points at the ``opcache`` executable, first on PATH, sends every call of that
compiler through ``opcache wrap``.  opcache then runs the real compiler, found
on PATH past:

- every entry that resolves to opcache itself or to another compiler cache
  (ccache, sccache), whose links would only lead back to a compiler cache;
- whatever an opcache further up already ran.  opcache marks the environment
  of every compiler it runs (``OPCACHE_RAN``: the real paths run so far), and
  an opcache started below a marked one (through a wrapper it cannot
  recognise: a script, distcc) runs the compiler directly, without caching
  the same compile twice.

Each pass adds a path to the mark and never runs a marked path, so no chain
of wrappers can loop.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .compilers.toolchain import is_script, which

MARKER = "OPCACHE_RAN"
OPC_NAMES = ("opc", "asc_opc")  # asc_opc: the current CANN's name, called as opc is
OP_COMPILER_NAMES = ("op_compiler",)
# cc, gcc, clang, c++, g++, clang++, with a target prefix and a version suffix.
_CC_NAME = re.compile(r"(.*-)?(cc|gcc|clang|c\+\+|g\+\+|clang\+\+)(-[0-9.]+)?")
# CANN's device compilers, C-family drivers (ccec_compiler/bin): bisheng, the
# older ccec, and bishengcc, the ASC language's compiler in asc-devkit's first
# CMake support (CMakeDetermineASCCompiler.cmake).
ASCEND_CC_NAMES = ("bisheng", "ccec", "bishengcc")
# Executables (by the name of what they resolve to) that are a compiler cache, never a compiler.
# (opcache-client: opcache's own, server.py; its links are opcache's)
_WRAPPERS = frozenset(("opcache", "opcache-client", "ccache", "sccache"))
_real_paths: dict[str, str] = {}  # each resolved once per process: a wrap hit asks twice


def compiler_kind(executable: str) -> str | None:
    """'opc', 'op_compiler', 'cc' or None, from the executable's file name."""
    name = os.path.basename(executable)
    if name in OPC_NAMES:
        return "opc"
    if name in OP_COMPILER_NAMES:
        return "op_compiler"
    if _CC_NAME.fullmatch(name) or name in ASCEND_CC_NAMES:
        return "cc"
    return None


def reentered(environ: Mapping[str, str]) -> bool:
    """True when an opcache further up runs this process's compile already."""
    return bool(environ.get(MARKER))


def find_compiler(executable: str, environ: Mapping[str, str]) -> str | None:
    """The compiler ``executable`` names, past opcache, compiler caches and marked paths.

    A bare name is looked up on PATH, passing those over.  A path is taken as
    it is, unless it is one of those (a masquerade link, as opcache was
    started): then the compiler is the next of that name found later on PATH
    than the path's folder.  What came before that folder on PATH is what
    found the link, wrappers included.
    """
    ran = frozenset(_ran(environ))

    def passed_over(candidate: str) -> bool:
        real = _real_path(candidate)
        return os.path.basename(real) in _WRAPPERS or real in ran or real == _real_path(sys.argv[0])

    if os.sep not in executable:
        return which(executable, environ, skip=passed_over)
    if not passed_over(executable):
        return executable
    path = environ.get("PATH", os.defpath).split(os.pathsep)
    places = [os.path.abspath(p or ".") for p in path]
    folder = os.path.abspath(os.path.dirname(executable))
    name = os.path.basename(executable)
    if folder in places:
        # After the link's folder first; else before it (CC=~/bin/gcc with that
        # folder at PATH's end): never the link's own folder again.
        at = places.index(folder)
        for part in (path[at + 1 :], path[:at]):
            found = which(name, {"PATH": os.pathsep.join(part)}, skip=passed_over)
            if found is not None:
                return found
        return None
    return which(name, {"PATH": os.pathsep.join(path)}, skip=passed_over)


def compiler_environ(environ: Mapping[str, str], compiler: str) -> dict[str, str]:
    """The environment to run ``compiler`` in: ``environ``, marked as run by opcache."""
    ran = [*_ran(environ), _real_path(compiler)]
    return {**environ, MARKER: os.pathsep.join(ran)}


def _real_path(path: str) -> str:
    if path not in _real_paths:
        _real_paths[path] = os.path.realpath(path)
    return _real_paths[path]


def _ran(environ: Mapping[str, str]) -> list[str]:
    return [p for p in environ.get(MARKER, "").split(os.pathsep) if p]


def opcache_executable() -> str | None:
    """The ``opcache`` program links point at: beside this Python, else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "opcache")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return which("opcache", os.environ)


def open_links_folder(folder: Path) -> int:
    """``folder``, made if missing, opened as the place of the links (and of the client
    they may run): its descriptor, to write in through, never its name again.

    A build runs whatever is in it first on PATH: a link (which whoever made it can
    point elsewhere), or a folder that is not the user's own (or root's) or that
    others may write, is refused, an OSError whose message is a sentence, before
    anything is written there.  Judged on the folder opened (without following a
    link), not on its name: the folder written in is the folder judged.
    """
    import errno
    import stat

    from . import fsutil, trust

    above = _replaceable_above(folder)  # (before anything is made there)
    if above is not None:
        raise OSError(
            f"{above}: another user could rename {folder} away and put a folder of"
            " theirs in its place, which PATH names: the compilers on PATH must be"
            " yours alone"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise FileExistsError(f"{folder} is there and is not a folder") from None
    except OSError as e:
        raise OSError(f"cannot make the folder {folder}: {e.strerror or e}") from None
    # (O_PATH: a folder its owner may write but not list, 0311, takes links all the same)
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(folder, flags)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(f"cannot open the folder {folder}: {e.strerror or e}") from None
        fd = -1
    try:
        # (else, ELOOP or ENOTDIR: a link, or a file put there since)
        st = os.fstat(fd) if fd >= 0 else os.lstat(folder)
        why = "a link" if stat.S_ISLNK(st.st_mode) else trust.problem(st, fsutil.PRIVATE)
        if why is None and not stat.S_ISDIR(st.st_mode):
            why = "not a folder"
        if why is not None:
            raise OSError(f"{folder} is {why}: the compilers on PATH must be yours alone")
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def _replaceable_above(folder: Path) -> str | None:
    """A folder above ``folder`` in which someone else may rename it (and why), or None.

    PATH names the folder of the links: whoever may rename in a folder on its way
    (its owner, or anyone who may write it, unless it is sticky) can put another
    folder in its place.  Root's and this user's folders, and sticky ones (/tmp),
    are safe; a group-writable one is safe only for the user's private group.
    """
    import stat

    from . import trust

    me = os.geteuid()
    given = os.path.abspath(folder).split("/")
    for end in range(2, len(given)):  # (a link on the way: whoever made it re-points it)
        prefix = "/".join(given[:end])
        try:
            st = os.lstat(prefix)
        except FileNotFoundError:
            break  # (made by this user, below)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (me, 0):
            return f"{prefix} is a link of another user's"
    path = os.path.realpath(folder)
    while (parent := os.path.dirname(path)) != path:
        path = parent
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue  # (made by this user)
        if st.st_uid not in (me, 0):
            return f"{path} is another user's"
        if st.st_mode & stat.S_ISVTX:
            continue  # (only its owner, or root, renames another's entry)
        if st.st_mode & stat.S_IWOTH:
            return f"{path} is writable by others"
        if st.st_mode & stat.S_IWGRP and not trust.private_group(me, st.st_gid):
            return f"{path} is writable by its group"
    return None


def make_links(
    folder: Path, environ: Mapping[str, str], target: str, dir_fd: int | None = None
) -> list[tuple[str, str]]:
    """Link in ``folder`` every compiler name found on PATH to ``target`` (opcache).

    Returns (name, what happened) for each name, sorted.  Idempotent: a link
    that is already opcache's is kept, and any other file is left alone.
    Scripts named like a C compiler (``c89-gcc``) are passed over: a cache
    would know the script, not the compiler it runs.  CANN's tools (``opc``,
    ``asc_opc``, ``op_compiler``) are scripts themselves, and linked.  OSError, its message a
    sentence, when the folder is refused (``open_links_folder``) or a link cannot be made.
    ``dir_fd``: the folder as ``open_links_folder`` opened it (else it is opened here).
    """
    fd = open_links_folder(folder) if dir_fd is None else dir_fd
    try:
        return _make_links(folder, fd, environ, target)
    finally:
        if dir_fd is None:
            os.close(fd)


def _make_links(
    folder: Path, fd: int, environ: Mapping[str, str], target: str
) -> list[tuple[str, str]]:
    from . import fsutil

    here = os.fstat(fd)
    found: dict[str, str] = {}
    for place in environ.get("PATH", os.defpath).split(os.pathsep):
        try:
            st = os.stat(place or ".")
            if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
                continue
            names = sorted(os.listdir(place or "."))
        except OSError:
            continue
        for name in names:
            path = os.path.join(place or ".", name)
            if name in found or not compiler_kind(name) or not os.access(path, os.X_OK):
                continue
            if os.path.isfile(path) and find_compiler(path, environ) == path:
                found[name] = path  # not a compiler cache's link, nor opcache's
    # (a link to opcache itself, or to its client there: either is opcache's)
    inside = f"/proc/self/fd/{fd}"  # (the folder opened, whatever its name leads to now)
    ours = {
        os.path.realpath(p)
        for p in (target, opcache_executable() or target, f"{inside}/opcache-client")
    }
    report = []
    for name, real in sorted(found.items()):
        if fsutil.lexists(name, fd):
            mine = os.path.realpath(f"{inside}/{name}") in ours
            report.append(
                (
                    name,
                    "kept: already a link to opcache"
                    if mine
                    else "left alone: not a link to opcache",
                )
            )
        elif is_script(real) and compiler_kind(name) == "cc":
            report.append((name, f"passed over: {real} is a script, not a compiler"))
        else:
            try:
                os.symlink(target, name, dir_fd=fd)
            except OSError as e:
                raise OSError(f"cannot make the link {folder / name}: {e.strerror or e}") from None
            report.append((name, f"made, wraps {real}"))
    return report


def exit_status(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128+N when killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run_plain(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run the compiler as it is, uncached: its exit status (127 if it cannot be run)."""
    import subprocess

    try:
        return exit_status(subprocess.run(list(argv), env=dict(env), check=False).returncode)
    except OSError as e:
        print(f"opcache: error: cannot run {argv[0]}: {e.strerror or e}", file=sys.stderr)
        return 127
