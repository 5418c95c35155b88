"""``opcache server``: wrap hits served by a warm process, for a small C client.

A wrap hit in a new Python is mostly the interpreter's and opcache's start-up.
The client (``_client/opcache_client.c``, built by ``opcache masquerade
--client``) sends its command line, current folder, umask, environment and
standard descriptors over a Unix socket to this server, which has opcache
imported already.  Workers forked from it take calls one after another; for
each, the worker becomes the client's stand-in (its folder, umask,
environment, descriptors, opcache's per-process caches emptied) and runs
the very command line ``opcache`` would run (``cli.main``), with one
difference: where that would do more than a hit (run a program: a miss, an
uncacheable or disabled compile, the preprocessor; count an uncacheable
compile; note a configuration warning as shown), it stops with
``wrap.NotServed`` before anything is done, and the client runs ``opcache``
itself, which then does it all as always.  So a served hit is the Python
path's hit, checks and all, and everything else is the Python path.  As the
program does, a worker tries the command's memo first (``quickhit``), and its
full hits of C compiles leave one (``quickmemo``); after a call served from a
memo, or that wrote one, it writes the client's own (``quickmemo.client_memo``),
from which the client serves the next such call alone.  A call's outputs go to
their place while its client waits: once the client is gone (a Ctrl-C ends it at
once, and the build goes on), the worker renames nothing more (``_audit``).

The socket lives in ``$XDG_RUNTIME_DIR/opcache-<uid>`` (``/tmp`` without it): a
folder of this user's, mode 0700, never reached through a link; the client
and the server refuse one that is not, and talk only to a peer of their own
uid (``SO_PEERCRED``).  One server per user, install and start-up environment
(``socket_name``: the client's tag and a digest of ``STARTUP_ENVIRONMENT``'s
values, which the server is started with); it exits when idle for
``OPCACHE_SERVER_IDLE`` seconds (default 600), and when opcache's own files
change under it (an upgrade).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from . import __version__, _log, fsutil, quickhit, quickmemo, stats
from ._log import get_logger
from .key import digest
from .masquerade import find_compiler

TYPE_CHECKING = False  # typing's, without importing typing
if TYPE_CHECKING:
    import ctypes

log = get_logger(__name__)

PROTOCOL = b"opcache-serve 4"
TAKEN = b"T"  # a worker's first word on a call, with its pid: the client sends it only then
ALIVE = b"."  # then, until the reply: a client that hears none for 10 s kills the worker
ALIVE_SECONDS = 1.0
CLIENT_NAME = "opcache-client"
CLIENT_SOURCE = Path(__file__).parent / "_client" / "opcache_client.c"
ENV_IDLE = "OPCACHE_SERVER_IDLE"
IDLE_SECONDS = 600.0
REQUEST_TIMEOUT = 30.0  # a client that connects and never says anything
MAX_WORKERS = 2 * (os.cpu_count() or 1)  # calls beyond wait for one (the CPU is the bound)
CALLS_PER_WORKER = 500  # then a fresh one: whatever a call leaks is bounded
_IDLE, _BUSY, _UPGRADED = 0, 1, 2  # what a worker tells the server
# The variables that decide which opcache (and which Python) the program loads: the
# user site-packages' HOME and the Python start-up variables the client starts a server
# with (opcache_client.c's SERVER_ENV, in its order).  Each set of values has a server of
# its own (``socket_name``); a call whose values differ from the server's own all the same
# (a server started by hand) would run another install: not served, and no client memo.
STARTUP_ENVIRONMENT = (
    b"HOME",
    b"PYTHONPATH",
    b"PYTHONHOME",
    b"PYTHONNOUSERSITE",
    b"PYTHONUSERBASE",
    b"PYTHONPLATLIBDIR",
    b"PYTHONSAFEPATH",
    b"PYTHONDONTWRITEBYTECODE",
    b"PYTHONPYCACHEPREFIX",
    b"PYTHONUTF8",
)
_started_with: dict[bytes, bytes | None] = {}  # the server's own STARTUP_ENVIRONMENT
_stale: list[bool] = []  # opcache's files changed since this process loaded them
_hooked: list[bool] = []  # the audit hook is installed (once a process: it cannot be removed)


def client_tag(program: str) -> str:
    """The socket name of a client that falls back on ``program``: this install and protocol."""
    return "s" + digest(b"\0".join((os.fsencode(program), __version__.encode(), PROTOCOL)))[:16]


def socket_name(program: str, environb: Mapping[bytes, bytes]) -> str:
    """The socket of the server for a client that falls back on ``program`` and has
    ``environb``: its tag, and the XXH64 of its STARTUP_ENVIRONMENT, each ``NAME=value``
    (``NAME`` when unset) ending in a NUL (``opcache_client.c``'s ``socket_name``)."""
    import xxhash

    startup = b"".join(
        name + (b"" if (value := environb.get(name)) is None else b"=" + value) + b"\0"
        for name in STARTUP_ENVIRONMENT
    )
    return f"{client_tag(program)}-{xxhash.xxh64_hexdigest(startup)}.sock"


def idle_seconds(environ: Mapping[str, str]) -> float:
    """``OPCACHE_SERVER_IDLE`` in seconds (a positive number), else the default."""
    value = environ.get(ENV_IDLE, "")
    if re.fullmatch(r"[0-9]{1,7}(\.[0-9]{1,3})?", value) and float(value) > 0:
        return float(value)
    return IDLE_SECONDS


# -- the client ------------------------------------------------------------------


def build_client(
    folder: Path, program: str, environ: Mapping[str, str], dir_fd: int | None = None
) -> str:
    """Build the client into ``folder`` with the machine's C compiler; its path.

    ``dir_fd``: ``folder`` as the caller opened it, judged (``masquerade.open_links_folder``),
    else it is opened here, not through a link.  The client is built in a private
    temporary folder and written into ``folder`` through that descriptor (a new
    file, renamed into place): nothing goes where ``folder``'s name may lead now.

    OSError, its message a sentence, when there is no C compiler or the build
    fails: the caller links to ``opcache`` itself instead.
    """
    import subprocess
    import tempfile

    if any(c in program for c in '"\\\n'):
        raise OSError(f"the path of opcache cannot go in a C string: {program!r}")
    compiler = next(
        (found for cc in ("cc", "gcc", "clang") if (found := find_compiler(cc, environ))), None
    )
    if compiler is None:
        raise OSError("no C compiler (cc, gcc, clang) on PATH to build opcache's client")
    with tempfile.TemporaryDirectory(prefix="opcache-client-") as private:
        built = os.path.join(private, CLIENT_NAME)
        command = [compiler, "-O2", *client_defines(program), "-o", built, str(CLIENT_SOURCE)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
        except subprocess.TimeoutExpired:
            raise OSError(f"{compiler} took over 120 s to build opcache's client") from None
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise OSError(f"{compiler} could not build opcache's client: {said}")
        with open(built, "rb") as f:
            data = f.read()
    fd = dir_fd
    if fd is None:
        flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(folder, flags)
    building = fsutil.unique_name(f".{CLIENT_NAME}")
    try:
        # (0777 less the umask, as the linker makes a program)
        out = os.open(
            building, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o777, dir_fd=fd
        )
        try:
            with open(out, "wb", closefd=False) as f:
                f.write(data)
        finally:
            os.close(out)
        os.replace(building, CLIENT_NAME, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(building, dir_fd=fd)
        if dir_fd is None:
            os.close(fd)
    return str(folder / CLIENT_NAME)


def client_defines(program: str) -> list[str]:
    """The client's build flags: the ``opcache`` it falls back on, its tag, and the
    variables a memo's name leaves out (``quickhit.UNKEYED_ENVIRONMENT``)."""
    unkeyed = "".join(f"{os.fsdecode(name)}\\0" for name in quickhit.UNKEYED_ENVIRONMENT)
    return [
        f'-DOPCACHE_PROGRAM="{program}"',
        f'-DOPCACHE_TAG="{client_tag(program)}"',
        f'-DOPCACHE_UNKEYED="{unkeyed}"',
    ]


# -- the server ------------------------------------------------------------------


def serve(socket_path: str, idle: float, program: Callable[[list[str]], int]) -> int:
    """Serve on ``socket_path`` until idle for ``idle`` seconds; the exit status.

    ``program`` runs a command line as ``opcache`` does (``cli.main``): the
    workers run each call's with it.

    Another server already on this socket: 0 at once.  A folder that is not
    this user's own: an error (1), nothing made or removed in it.
    """
    folder, name = os.path.split(os.path.abspath(socket_path))
    if not name.endswith(".sock") or "/" in name:
        raise OSError(f"{socket_path}: a server's socket is named <tag>.sock")
    dir_fd = quickhit.open_own_folder(folder, True)  # (a folder another user made first: refused)
    lock_name = name[:-5] + ".lock"
    lock = _lock(lock_name, dir_fd)
    if lock is None:
        return 0  # another server serves it
    files = _warm_up()  # (before the socket answers: a call sees opcache's files as loaded)
    _started_with.update((name, os.environb.get(name)) for name in STARTUP_ENVIRONMENT)
    os.chdir("/")  # (for minutes: a folder of a build would stay busy, even once deleted)
    # Objects made so far are never collected: a worker's collections skip them,
    # and so do not copy the pages they sit in (fork shares them until written).
    gc.collect()
    gc.freeze()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)  # a server gone before it could clean up
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"/proc/self/fd/{dir_fd}/{name}")  # (a folder's path may be long)
    bound = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    listener.listen(128)
    os.ftruncate(lock, 0)
    os.write(lock, f"{os.getpid()}\n".encode())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    me = os.getpid()
    said, tell = os.pipe()  # workers say there (pid, state) as they take a call or end one
    workers: dict[int, bool] = {}  # pid -> busy
    last = time.monotonic()
    try:
        while time.monotonic() - last < idle:
            if all(workers.values()) and len(workers) < MAX_WORKERS:
                # Forked before the call comes: neither the fork nor the worker's
                # first copies of the server's pages are part of a call.
                pid = os.fork()
                if pid == 0:
                    # A worker may outlive the server (busy with a call when it was
                    # killed): it neither holds the lock (a new server could not start)
                    # nor ever runs the server's cleanup below (its socket, its workers),
                    # whatever it raises (its word to a server gone: EPIPE).
                    try:
                        os.close(said)
                        os.close(lock)
                        # (the client's tag: the name's first part, the memos' names hold it)
                        tag = name[:-5].partition("-")[0]
                        _work(listener, tell, files, me, program, tag)
                    finally:
                        os._exit(1)
                workers[pid] = False
            if select.select([said], [], [], min(idle, 1.0))[0]:
                states = dict(struct.iter_unpack("=ib", os.read(said, 4096)))
                workers.update((pid, state == _BUSY) for pid, state in states.items())
                last = time.monotonic()
                if _UPGRADED in states.values():
                    break  # a new server has to load it (that call fell back)
            for pid in _reaped():
                workers.pop(pid, None)
    finally:
        for pid, busy in workers.items():
            if not busy:
                os.kill(pid, signal.SIGKILL)  # (waiting in accept; a busy one ends its call)
        # Only the socket this server made: a name it no longer holds is another's.
        _unlink_if(name, dir_fd, bound)
        listener.close()
        # Its lock file too, still held: a server starting meanwhile that locked
        # the file before it went takes the lock again on its own (``_lock``).
        _unlink_if(lock_name, dir_fd, os.fstat(lock))
    return 0


def _lock(name: str, dir_fd: int) -> int | None:
    """The server's lock file ``name`` in the folder open as ``dir_fd``, held; None
    when another server holds it.  A server removes its lock file as it ends,
    while still holding it: a lock taken on a file removed meanwhile is no
    server's, and is taken again on the file now of that name."""
    import fcntl

    while True:
        lock = os.open(
            name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
        )
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            return None
        held = os.fstat(lock)
        try:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev):
            return lock
        os.close(lock)


def _unlink_if(name: str, dir_fd: int, made: os.stat_result) -> None:
    """Remove ``name`` from the folder open as ``dir_fd`` if it is still the file
    ``made`` (a name this server no longer holds is another's)."""
    with contextlib.suppress(FileNotFoundError):
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (now.st_ino, now.st_dev) == (made.st_ino, made.st_dev):
            os.unlink(name, dir_fd=dir_fd)


def _reaped() -> set[int]:
    """The workers that ended since the last call (no zombies left)."""
    ended = set()
    with contextlib.suppress(ChildProcessError):
        while (pid := os.waitpid(-1, os.WNOHANG)[0]) != 0:
            ended.add(pid)
    return ended


_PR_SET_PDEATHSIG = 1


_libc: list = []  # the C library, loaded once (a CDLL made at each call cost it 0.1-0.3 ms)


def _c_library() -> ctypes.CDLL:
    if not _libc:
        import ctypes

        _libc.append(ctypes.CDLL(None))
    return _libc[0]


def _prctl(option: int, value: int) -> None:
    _c_library().prctl(option, value)


def _warm_up() -> dict[str, tuple[int, int, int]]:
    """Import what a wrap hit uses (each worker starts with it); opcache's files as loaded."""
    _c_library()  # (loaded once, before the workers: prctl in each of them)
    import atexit  # noqa: F401  (the worker's exit)
    import logging  # noqa: F401  (-v, and any warning)

    import platformdirs  # noqa: F401  (configuration warnings' notes)

    from . import readset, remote_tier, stats, wrap  # noqa: F401
    from .compilers import cc  # noqa: F401

    with contextlib.suppress(ImportError):
        import redis  # noqa: F401  (a remote hit's client library, where installed)
    return _opcache_files()


def _opcache_files() -> dict[str, tuple[int, int, int]]:
    """opcache's files as loaded, each with its identity now (an upgrade changes them)."""
    return {path: _identity(path) for path in quickhit.opcache_files()}


def _upgraded(files: dict[str, tuple[int, int, int]]) -> bool:
    """Whether a module file loaded at the start changed since.  Only those: a call may
    load more (explain, trash), from the files there now."""
    return any(_identity(path) != was for path, was in files.items())


def _identity(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0)  # (gone: an upgrade that removed it)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


# -- a worker ----------------------------------------------------------------------


def _work(
    listener: socket.socket,
    tell: int,
    files: dict,
    server: int,
    program: Callable[[list[str]], int],
    tag: str,
) -> None:
    """A worker: serve calls one after another, saying when it is busy; never returns.

    One process serves many calls: a fork per call would copy, at each call,
    the hundreds of the server's pages a hit writes to (reference counts).
    Whatever a call changes in the process is set anew for the next
    (``_serve``); the caches opcache keeps for one process's life are emptied.
    """
    import logging

    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    stats.defer_writes()
    alive = _Alive()
    for _ in range(CALLS_PER_WORKER):
        _die_with_the_server(True, server)
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        _die_with_the_server(False)  # (a call taken is served to its end)
        os.write(tell, struct.pack("=ib", os.getpid(), _BUSY))
        try:
            conn.settimeout(REQUEST_TIMEOUT)
            conn.sendall(TAKEN + struct.pack("=i", os.getpid()))
        except OSError:  # the client waited too long and runs opcache itself: no call
            reply = b""
        else:
            alive.call = (conn, time.monotonic())
            _caller[:] = [conn]  # (no rename once it is gone: _audit)
            try:
                reply = _answer(conn, files, program, tag)
            except BaseException as e:  # the client runs opcache itself: it says what is wrong
                # (or it is gone, killed by a Ctrl-C: _CallerGone, nothing more put in place)
                log.debug("opcache server: call dropped: %r", e)
                os._exit(1)  # (and a call that went wrong half way leaves nothing behind)
            finally:
                _caller.clear()
                alive.end()  # (its bytes come before the reply, never inside it)
        try:
            conn.settimeout(None)
            conn.sendall(reply)
        except OSError:
            pass  # the client left (it was killed): nothing to tell it
        finally:
            conn.close()  # (the client reads up to the end: it is done now)
            # Nothing of the client kept: its descriptors (a pipe make waits on), its folder.
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            stats.write_deferred()  # (in the client's folder still: a cache named relatively)
            _write_client_memo()
            os.chdir("/")
            logging.getLogger("opcache").handlers.clear()
        if _stale:  # an upgrade: this process's modules are old
            os.write(tell, struct.pack("=ib", os.getpid(), _UPGRADED))
            os._exit(0)
        os.write(tell, struct.pack("=ib", os.getpid(), _IDLE))
    os._exit(0)


class _Alive:
    """A worker's one thread that tells the client of a call running for a second or more,
    about once a second, that it still runs (the client kills a silent worker).  One per
    worker, not per call: a thread started and joined at every call cost each its CPU."""

    def __init__(self) -> None:
        self.call: tuple[socket.socket, float] | None = None  # the connection, since when
        self._sending = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def end(self) -> None:
        """The call is over: once this returns, nothing more is sent on its connection."""
        with self._sending:
            self.call = None

    def _run(self) -> None:
        while True:
            time.sleep(ALIVE_SECONDS)
            with self._sending:
                call = self.call
                if call is None or time.monotonic() - call[1] < ALIVE_SECONDS:
                    continue
                try:
                    call[0].sendall(ALIVE)
                except OSError:
                    self.call = None  # (the client left: nothing more to tell it)


def _die_with_the_server(die: bool, server: int = 0) -> None:
    """Whether this worker ends when the server does (SIGKILLed, it cannot end the idle ones)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL if die else 0)
    if die and os.getppid() != server:  # (the server ended before that)
        os._exit(0)


def _answer(
    conn: socket.socket, files: dict, program: Callable[[list[str]], int], tag: str
) -> bytes:
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.getuid() or not _sees_what_we_see(pid) or not _is_as_we_are(pid):
        return b"N"
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    try:
        if len(head) != 4 or len(fds) != 3:
            return b"N"
        data = _receive(conn, struct.unpack("=I", head)[0])
        fields = data.split(b"\0")
        if fields[0] != PROTOCOL or fields[-1] != b"":
            return b"N"
        if _upgraded(files):  # the modules here are old (_work ends)
            _stale.append(True)
            return b"N"
        # (a client that found no memo of its own that holds wants one: "1")
        wants_memo, umask, cwd, argc = (
            fields[1] == b"1",
            int(fields[2], 8),
            fields[3],
            int(fields[4]),
        )
        argv, env = fields[5 : 5 + argc], fields[5 + argc : -1]
        return _serve(pid, argv, env, cwd, umask, fds, program, tag if wants_memo else None)
    finally:
        for fd in fds:
            if fd > 2:
                os.close(fd)


def _receive(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the client left mid-request")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _sees_what_we_see(pid: int) -> bool:
    """Whether the client sees the files this worker sees: the same mount namespace
    and root (a container sharing /tmp with the host does not)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt") and (
            _same_file(f"/proc/{pid}/root", "/")
        )
    except OSError:  # (pid 0: a client in another pid namespace)
        return False


def _is_as_we_are(pid: int) -> bool:
    """Whether the client has this worker's group ids (real, effective, saved, file
    system's; supplementary), effective capabilities, file size limit and host name
    (UTS namespace): the worker checks paths, writes outputs, and names the client's
    memo, with its own (a caller after newgrp, sg or setpriv, root without
    CAP_DAC_OVERRIDE, one under ``ulimit -f``, runs opcache itself, with its own)."""
    try:
        if not _own_ids:
            _own_ids.append(_ids("/proc/self"))  # (a worker's never change)
        return _ids(f"/proc/{pid}") == _own_ids[0]
    except (OSError, ValueError):
        return False


_own_ids: list[tuple[object, ...]] = []


def _ids(process: str) -> tuple[object, ...]:
    """A process's group ids, effective capabilities, file size limit and UTS
    namespace, from its /proc folder."""
    status = quickhit.proc_status(process)
    gids, groups = _status_line(status, b"Gid"), _status_line(status, b"Groups")
    capabilities = _status_line(status, b"CapEff").strip()
    with open(f"{process}/limits", "rb") as f:
        size_limit = next((line for line in f if line.startswith(b"Max file size")), b"")
    return (
        gids.split(),
        sorted(set(groups.split())),
        capabilities,
        size_limit.split(),
        os.readlink(f"{process}/ns/uts"),
    )


def _status_line(status: bytes, name: bytes) -> bytes:
    """The value of the line ``name`` of a /proc status file (ValueError if none)."""
    start = status.index(b"\n" + name + b":") + len(name) + 2
    end = status.find(b"\n", start)
    return status[start : end if end >= 0 else len(status)]


def _same_file(a: str, b: str) -> bool:
    one, two = os.stat(a), os.stat(b)
    return (one.st_dev, one.st_ino) == (two.st_dev, two.st_ino)


def _serve(
    pid: int,
    argv: list[bytes],
    env: list[bytes],
    cwd: bytes,
    umask: int,
    fds: list[int],
    program: Callable[[list[str]], int],
    tag: str | None,
) -> bytes:
    """Become the client and run its command line: the reply (served, or b"N").

    ``tag``: the client's, when it wants its memo (``quickmemo.client_memo``) of this call.
    """
    import atexit
    import logging

    from . import masquerade, wrap

    given = _environment(env)
    if argv[1:2] != [b"wrap"] or any(
        given.get(name) != _started_with.get(name) for name in STARTUP_ENVIRONMENT
    ):
        return b"N"  # (another opcache, or Python, than this server's: the client runs it)
    os.chdir(cwd)
    if not _same_file(f"/proc/{pid}/cwd", "."):  # (its folder, not one of that name)
        return b"N"
    os.umask(umask)
    fsutil.UMASK = umask  # read once at import: the server's, not the client's
    os.environb.clear()
    os.environb.update(given)  # (as it came: the compiler's, as the program's own, cli.main)
    time.tzset()  # (local time is read from TZ only here: __DATE__'s key is the client's)
    for number, fd in enumerate(fds):
        os.dup2(fd, number)  # (the client's terminal decides colour, as for opcache)
    sys.argv = [os.fsdecode(word) for word in argv]
    said: list[tuple[int, bytes]] = []
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_Said(1, said)), "utf-8", "strict")
    sys.stderr = io.TextIOWrapper(
        io.BufferedWriter(_Said(2, said)), "utf-8", "backslashreplace", line_buffering=True
    )
    # The server's own logging (its stderr, its level, the hook that sets them on
    # first use) is not the client's: cli.main sets the client's.
    _log._hooks.clear()
    logging.getLogger("opcache").handlers.clear()
    logging.getLogger("opcache").setLevel(logging.NOTSET)
    masquerade._real_paths.clear()  # (a compiler's path may lead elsewhere now)
    wrap.serve_hits_only()
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked.append(True)
    quickmemo.serving[:] = [time.time()]
    quickhit.last_memo.clear()
    # The client's memo (if it wants one) is named by the call as it came (its own
    # environment), as the client names it: before anything of the call runs.
    memo = None
    if tag is not None:
        # (from the folder the client sent, which it hashed; no /proc, or a name it
        # cannot take: no memo, never a call dropped)
        with contextlib.suppress(OSError, ValueError):
            name = quickhit.client_memo_name(tag, sys.argv, given, cwd, umask)
            memo = (quickhit.runtime_folder(os.environ), name)
    try:
        # A memo's quick hit first (quickhit.py), as the program tries it; then the full hit.
        status = quickhit.serve(sys.argv)
        if status is None:
            status = program(sys.argv[1:])
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except wrap.NotServed:
        return b"N"
    if status == 0 and quickhit.last_memo and memo is not None:
        # The C client serves the next such call itself (written once the reply is sent).
        _client_memo[:] = [(*memo, quickhit.last_memo[0])]
    out = [b"S", struct.pack("=i", status)]
    for stream, data in said:
        out += [bytes((stream,)), struct.pack("=I", len(data)), data]
    return b"".join([*out, b"\0", struct.pack("=I", 0)])


_client_memo: list[tuple[str, str, bytes]] = []  # the call's: runtime folder, name, Python memo


def _write_client_memo() -> None:
    """The C client's memo of the call just served (``_serve``), if it is to have one."""
    if not _client_memo:
        return
    folder, name, memo = _client_memo.pop()
    data = quickmemo.client_memo(memo)
    if data is not None:
        with contextlib.suppress(OSError):
            quickmemo.put(folder, name, data)


def _environment(env: list[bytes]) -> dict[bytes, bytes]:
    """The client's environment as its own ``getenv`` and ``os.environ`` see it.

    A name given twice (``execve`` allows it) has its first value there, as
    glibc's ``getenv`` (the compiler's) and CPython take it: the last one
    would key another environment than the compiler's.  An entry without a
    name (``=x``) cannot be set and is read by no one opcache keys: left out.
    """
    found: dict[bytes, bytes] = {}
    for entry in env:
        name, eq, value = entry.partition(b"=")
        if name and eq:
            found.setdefault(name, value)
    return found


class _Said(io.RawIOBase):
    """A stream whose writes are kept, in order with the other stream's, for the reply."""

    def __init__(self, stream: int, said: list[tuple[int, bytes]]) -> None:
        super().__init__()
        self._stream = stream
        self._said = said

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._said.append((self._stream, bytes(data)))
        return len(data)


_caller: list[socket.socket] = []  # the connection of the call served, until its reply


class _CallerGone(BaseException):
    """The client of the call went away (killed: a Ctrl-C) before an output was put in
    place.  Not an Exception: no handler on the way may take it for a failure and go on
    (the worker drops the call, leaving nothing of it behind: ``_work``)."""


def _audit(event: str, args: tuple) -> None:
    """A worker's audit hook.  A rename (``os.rename``, ``os.replace``: how every output
    goes to its place) once the call's client is gone: the call ends there.  The shell
    has its status (130 after a Ctrl-C) and the build may have gone on: the caller's
    files are its own again (a newer object, written meanwhile, must stay).  Checked as
    the rename starts, the last moment Python has; a rename already under way when the
    client goes still lands.  Running a program is more than a hit: the client runs
    opcache itself."""
    if event == "os.rename":
        if _caller and _hung_up(_caller[0]):
            raise _CallerGone(f"the client left before {args[1]!r} was put in place")
        return
    if event in (
        "subprocess.Popen",
        "os.posix_spawn",
        "os.exec",
        "os.spawn",
        "os.system",
        "os.fork",
        "os.forkpty",
    ):
        from .wrap import NotServed

        raise NotServed(event)


def _hung_up(conn: socket.socket) -> bool:
    """Whether the client at the other end of ``conn`` is gone (its end closed: it ended,
    killed or not; it sends nothing after its request, and closes nothing before it ends)."""
    poller = select.poll()
    poller.register(conn, select.POLLRDHUP)  # (POLLHUP and POLLERR come unasked)
    return bool(poller.poll(0))
