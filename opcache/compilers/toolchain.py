"""What the compiler plug-ins share: kernel names, tool identity, running a tool."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .. import fsutil
from .._log import get_logger
from ..errors import CompileError
from ..key import canonical_json, digest, request_parts
from ..keyed_env import ENV_KEY_ENV
from ..request import OpRequest

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    import subprocess
    import weakref

    from ..storage.local import LocalStore

log = get_logger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_]")
_STDERR_TAIL = 2000
_SIGINT = 2  # signal.SIGINT, without importing signal on `opcache wrap`'s start-up
_HEX = b"0123456789abcdef"
_TOO_NEW_SECONDS = 2.0
_identities: dict[tuple[str, int, int, int, int, int], str] = {}
# Per compiler object, the identities of its tools when it last asked (tool_changed);
# made at the first ask: weakref costs `opcache wrap`'s start-up half a millisecond.
_tools_seen: weakref.WeakKeyDictionary[object, tuple] | None = None


def kernel_name(request: OpRequest) -> str:
    """``<op_type>_<16 hex>``: from the request's key inputs, never from op_name."""
    digest_of_parts = digest(canonical_json(request_parts(request)))
    return f"{_UNSAFE.sub('_', request.op_type)}_{digest_of_parts[:16]}"


def file_identity(path: str | os.PathLike[str], notes: LocalStore | None = None) -> str:
    """Size, mtime and XXH3 digest of a file.

    The digest is memoised in the process, and in the cache ``notes``, by
    device, inode, size, mtime and ctime: a process per compile (``opcache
    wrap``) then does not hash a 1 MB compiler each time.  Any write or rename
    moves ctime, and no one can set it back: a tool replaced by one of the same
    size and mtime (tar, ``rsync -t``) is hashed again.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    memo = (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if memo not in _identities:
        _identities[memo] = _digest_of(real, st, notes)
    return f"{real}:{st.st_size}:{st.st_mtime_ns}:{_identities[memo]}"


def tool_changed(owner: object, *paths: str | os.PathLike[str]) -> bool:
    """Whether a file at ``paths`` is another file, or was written, since ``owner``
    (a compiler) last asked; True the first time.

    One stat a path, so a compiler may ask at every compile and take its
    fingerprint again only then: a tool upgraded in place under a long-lived
    compiler object gets new keys, not the old version's entries.
    """
    global _tools_seen
    if _tools_seen is None:
        import weakref

        _tools_seen = weakref.WeakKeyDictionary()
    now = tuple(_stamp(path) for path in paths)
    if _tools_seen.get(owner) == now:
        return False
    _tools_seen[owner] = now
    return True


def _stamp(path: str | os.PathLike[str]) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _digest_of(real: str, st: os.stat_result, notes: LocalStore | None) -> str:
    stamp = digest(
        f"{real}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}".encode()
    )
    known = notes.read_note("tools", stamp) if notes else None
    if known is not None and len(known) == len(stamp) and not known.translate(None, _HEX):
        return known.decode()
    # Read as every input is (fsutil.read_input_stat): a FIFO in a tool's or a tuning
    # bank file's place (swapped in after it was looked at) is refused, not waited on.
    data, _ = fsutil.read_input_stat(real)
    found = digest(data)
    after = os.stat(real)
    # As ccache does: a file changed while read, or within the clock's
    # resolution of now, may change again unseen; do not remember it.
    unchanged = (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
    )
    if notes and unchanged and time.time() - after.st_ctime_ns / 1e9 > _TOO_NEW_SECONDS:
        with contextlib.suppress(OSError):  # hashed again next time
            notes.write_note(found.encode(), "tools", stamp)
    return found


def is_script(path: str) -> bool:
    """Whether ``path`` is a ``#!`` script (False if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def which(
    name: str, environ: Mapping[str, str], *, skip: Callable[[str], bool] | None = None
) -> str | None:
    """The executable ``name`` as the given environment's PATH finds it.

    ``skip(candidate)`` true passes a candidate over (opcache itself, when it
    stands in for a compiler).  Written out rather than ``shutil.which`` to
    keep shutil off the start-up of ``opcache wrap``.
    """
    if os.sep in name:
        folders = [""]
    else:
        folders = [f or "." for f in environ.get("PATH", os.defpath).split(os.pathsep)]
    for folder in folders:
        candidate = os.path.join(folder, name)
        runnable = os.path.isfile(candidate) and os.access(candidate, os.X_OK)
        if runnable and (skip is None or not skip(candidate)):
            return candidate
    return None


def environment_key(environ: Mapping[str, str], names: Sequence[str]) -> str:
    """The values of ``names`` and of the variables ``OPCACHE_KEY_ENV`` names, for a
    key: a repr (text even for bytes of no encoding)."""
    return repr([[n, environ.get(n)] for n in (*names, *user_key_names(environ))])


def user_key_names(environ: Mapping[str, str]) -> list[str]:
    """The variables ``OPCACHE_KEY_ENV`` names (spaces, commas or colons between)."""
    return [n for n in re.split(r"[\s,:]+", environ.get(ENV_KEY_ENV, "")) if n]


def run_tool(
    argv: Sequence[str],
    *,
    cwd: Path | None = None,
    environ: Mapping[str, str] | None = None,
    what: str,
) -> subprocess.CompletedProcess[bytes]:
    """Run a compiler; CompileError with the command line and stderr's tail on failure,
    KeyboardInterrupt when a Ctrl-C killed it."""
    import subprocess

    try:
        done = subprocess.run(
            list(argv),
            cwd=cwd,
            env=None if environ is None else dict(environ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
    except OSError as e:
        raise CompileError(f"{what}: cannot run {argv[0]}: {e.strerror or e}") from None
    check_tool(argv, done.returncode, done.stderr, what)
    return done


def check_tool(argv: Sequence[str], status: int, stderr: bytes, what: str) -> None:
    """What a compiler's run that ended with ``status`` means: CompileError with the
    command line and stderr's tail on failure, KeyboardInterrupt when a Ctrl-C
    killed it; its warnings logged."""
    if status == -_SIGINT:
        # The user's Ctrl-C reached the compiler (its process group's): stop, as make does.
        raise KeyboardInterrupt
    if status != 0:
        import subprocess

        tail = stderr.decode(errors="replace")[-_STDERR_TAIL:].strip()
        raise CompileError(
            f"{what} failed with exit status {status}: {subprocess.list2cmdline(argv)}"
            + (f"\n{tail}" if tail else "")
        )
    said = stderr.decode(errors="replace").strip()
    if said:  # warnings: shown with -v (the tool's stderr would be lost otherwise)
        log.info("%s said:\n%s", what, said)
