"""The quick hit: a C compile's hit served from a memo checked by stat identity.

A wrap hit in a new Python costs its imports (pathlib, re, json, opcache's
modules) and its checks (settings, the compiler's identity, the header list
and every header's digest, the entry).  When a full hit of a C compile is
done (``wrap.run``), every file it consulted, or looked for and did not find,
was noted as it ran (``Recorder``: the ``os`` and ``open`` calls it made), and
the memo keeps each one's stat identity: device, inode, mode, owner, and for a
file (or a folder that was listed) its size, mtime and ctime; for a path that
was missing, the error.  The next run of the same command (``serve``: its
argv, working folder, umask, user and environment give the memo's name)
checks each with one ``stat`` or ``lstat``, reads the entry's artifacts
(checked against the entry's manifest digests), writes the outputs as the
full hit writes them, replays stdout and stderr, counts the hit and stamps
the entry's access: all before importing more than ``os``, ``stat``, ``sys``
and ``xxhash``.  Anything else (no memo, one identity moved, an error) gives
None and the full path runs as always.

Safe as git's index is (its "racy" rule): a file changed after it was
recorded has another ctime (the kernel sets it on every write; ``utime``
cannot set it back).  A file changed within the same clock tick as it was
recorded could keep its times, so no memo is written while any recorded
file's mtime or ctime is within ``RACY_SECONDS`` of the full run's start.
Memos are not written for a run that keyed the clock, warned, was verbose,
or in ``force``/``disable`` mode.  They live in this user's runtime folder
(``$XDG_RUNTIME_DIR/opcache-<uid>/quick``, 0700, the server's), each naming
the cache folder it serves from; ``opcache clear`` removes the entries they
point at, so every memo misses after it.
"""

from __future__ import annotations

import os
import stat
import sys

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

FORMAT = b"opcache-quick 1"
FOLDER = "quick"
RACY_SECONDS = 2.0  # a file changed this close to the run that read it gets no memo
MAX_MEMO = 1 << 20
MAX_MEMOS = 10_000  # then the folder is emptied (each memo is only a shortcut)
MEMO_DAYS = 7  # a memo not rewritten for this long goes at a cleaning
CLEAN_ONE_IN = 64  # a memo write cleans the folder about once in this many
# Variables no compiler and no part of opcache reads, that change from one build
# (or one make level) to the next: left out of a memo's name.  (test_quickhit
# checks that settings.py, keyed_env.py and the compilers read none of them.)
UNKEYED_ENVIRONMENT = (
    b"MAKEFLAGS",
    b"MFLAGS",
    b"MAKE_TERMOUT",
    b"MAKE_TERMERR",
    b"_",
    b"OLDPWD",
    b"SHLVL",
)
# Not inputs of a hit: the kernel's views of this process.
_NOT_INPUTS = ("/proc/", "/dev/fd/")
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT
_NO_SIZE = -1  # a folder not listed: its entries changing does not matter


def runtime_folder(environ: Mapping[str, str]) -> str:
    """This user's runtime folder of opcache (server sockets, memos): never another's."""
    base = environ.get("XDG_RUNTIME_DIR", "")
    return os.path.join(base if base.startswith("/") else "/tmp", f"opcache-{os.getuid()}")


def open_own_folder(folder: str, make: bool) -> int:
    """``folder`` (made 0700 if missing and ``make``), opened without following a link.

    OSError (trust.UntrustedFolder-like, a sentence) unless it is this user's
    and no one else can enter it: a folder another user made first is not used.
    """
    if make:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            make = False  # (there already: checked below as any other)
    fd = os.open(folder, _FOLDER)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        mode = stat.S_IMODE(st.st_mode)
        raise PermissionError(f"{folder} is not yours alone (owner uid {st.st_uid}, mode {mode:o})")
    return fd


def memo_name(words: list[str], environb: Mapping[bytes, bytes], cwd: bytes, umask: int) -> str:
    """The memo of a command: its words, folder, umask, user and environment (all but
    ``UNKEYED_ENVIRONMENT``), the machine's name and the Python it runs in."""
    import xxhash

    env = sorted(
        name + b"=" + value for name, value in environb.items() if name not in UNKEYED_ENVIRONMENT
    )
    fields = [
        FORMAT,
        os.fsencode(sys.executable),
        sys.version.encode(),
        cwd,
        b"%o %d %d" % (umask, os.getuid(), os.getgid()),
        os.uname().nodename.encode(),  # (the cache folder's name may hold it)
        b"%d" % len(words),
        *(os.fsencode(word) for word in words),
        *env,
    ]
    return "m" + xxhash.xxh3_128_hexdigest(b"\0".join(fields))


# -- the quick path ------------------------------------------------------------------


class _Miss(Exception):
    """The memo does not hold, or cannot be used: the full path runs."""


def serve(words: list[str]) -> int | None:
    """Serve ``words`` (the command line, ``sys.argv``'s form) from its memo: the exit
    status, or None (nothing done) when there is no memo or it does not hold."""
    try:
        return _serve(words)
    except (_Miss, OSError, ValueError, IndexError):
        return None


def _serve(words: list[str]) -> int:
    cwd = os.getcwdb()
    umask = os.umask(0o077)
    os.umask(umask)
    name = memo_name(words, os.environb, cwd, umask)
    folder = open_own_folder(os.path.join(runtime_folder(os.environ), FOLDER), False)
    try:
        fd = os.open(name, _READ, dir_fd=folder)
    finally:
        os.close(folder)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > MAX_MEMO:
            raise _Miss
        data = os.read(fd, st.st_size + 1)
    finally:
        os.close(fd)
    fields = data.split(b"\0")
    if fields[0] != FORMAT or fields[-1] != b"end":
        raise _Miss
    return _Memo(fields[1:-1]).serve()


class _Memo:
    def __init__(self, fields: list[bytes]) -> None:
        self.checks: list[tuple[bytes, bool, tuple[int, ...]]] = []
        self.outputs: list[tuple[bytes, bytes, int, str]] = []  # target, artifact, size, digest
        self.streams: list[tuple[int, bytes, int, str]] = []  # 1 or 2, artifact, size, digest
        at = 0
        while at < len(fields):
            tag = fields[at]
            if tag == b"c":
                path, follow = fields[at + 1], fields[at + 2] == b"1"
                self.checks.append((path, follow, tuple(map(int, fields[at + 3 : at + 10]))))
                at += 10
            elif tag == b"e":
                self.entry = fields[at + 1]
                self.entry_id = (int(fields[at + 2]), int(fields[at + 3]))
                self.manifest = fields[at + 4]
                self.stamp_every = float(fields[at + 5])  # <0: aging off, no stamp
                at += 6
            elif tag == b"o":
                size = int(fields[at + 3])
                self.outputs.append((fields[at + 1], fields[at + 2], size, fields[at + 4].decode()))
                at += 5
            elif tag == b"s":
                size = int(fields[at + 3])
                self.streams.append(
                    (int(fields[at + 1]), fields[at + 2], size, fields[at + 4].decode())
                )
                at += 5
            elif tag == b"n":
                self.counters = fields[at + 1]
                self.counters_id = (int(fields[at + 2]), int(fields[at + 3]))
                self.counters_mode = int(fields[at + 4])
                self.saved = float(fields[at + 5])
                self.appended = fields[at + 6]
                at += 7
            else:
                raise _Miss
        if not self.outputs:
            raise _Miss

    def serve(self) -> int:
        for path, follow, want in self.checks:
            if _identity(path, follow, want[4] == _NO_SIZE) != want:
                raise _Miss
        entry = _open_same(self.entry, self.entry_id)
        try:
            outputs = [(target, self._artifact(entry, *rest)) for target, *rest in self.outputs]
            streams = [(number, self._artifact(entry, *rest)) for number, *rest in self.streams]
            if any(b"\x1b[" in data for _, data in streams):
                raise _Miss  # (colour taken out where it cannot show: the full path's work)
            for target, _ in outputs:
                try:
                    st = os.lstat(target)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    raise _Miss  # (the full path says why it is uncacheable)
            self._count()
            self._stamp(entry)
        finally:
            os.close(entry)
        _write_outputs(outputs)
        for number, data in sorted(streams):
            stream = sys.stdout if number == 1 else sys.stderr
            if data and stream is not None:
                stream.flush()
                stream.buffer.write(data)
                stream.buffer.flush()
        return 0

    @staticmethod
    def _artifact(entry: int, name: bytes, size: int, want: str) -> bytes:
        import xxhash

        fd = os.open(name, _READ, dir_fd=entry)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise _Miss
            chunks, left = [], size
            while left > 0:
                chunk = os.read(fd, left)
                if not chunk:
                    raise _Miss
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if xxhash.xxh3_128_hexdigest(data) != want:
            raise _Miss
        return data

    def _count(self) -> None:
        """One hit (and the time it saved) on the chip's counters, as one appended line."""
        folder = _open_same(self.counters, self.counters_id)
        try:
            line = b"hits=1 time_saved_seconds=%r\n" % self.saved
            fd = os.open(
                self.appended, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _READ, 0o600, dir_fd=folder
            )
        finally:
            os.close(folder)
        try:
            import fcntl

            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size >= MAX_MEMO:
                raise _Miss  # (the next full-path count folds it into the shards)
            # Shared: a fold (CounterFiles) takes it exclusively once it has renamed the
            # file, so an append either lands before the fold reads or is not made.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            if os.fstat(fd).st_nlink == 0:
                raise _Miss
            if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != self.counters_mode:
                os.fchmod(fd, self.counters_mode)
            os.write(fd, line)
        finally:
            os.close(fd)

    def _stamp(self, entry: int) -> None:
        """The entry's access, as a full hit stamps it (aging must see the use)."""
        if self.stamp_every < 0:
            return
        import time

        now, manifest = time.time(), self.manifest
        if now - os.stat(manifest, dir_fd=entry, follow_symlinks=False).st_mtime < self.stamp_every:
            return
        try:
            os.utime(manifest, (now, now), dir_fd=entry, follow_symlinks=False)
        except PermissionError:  # (another member's entry in a shared cache: "now" needs less)
            os.utime(manifest, dir_fd=entry, follow_symlinks=False)


def _identity(path: bytes, follow: bool, folder_only: bool) -> tuple[int, ...]:
    """What a memo records of a path: its stat identity, or the error looking it up gave."""
    try:
        st = os.stat(path, follow_symlinks=follow)
    except OSError as e:
        return (-(e.errno or 1), 0, 0, 0, 0, 0, 0)
    if folder_only and stat.S_ISDIR(st.st_mode):
        return (st.st_dev, st.st_ino, st.st_mode, st.st_uid, _NO_SIZE, 0, 0)
    return (
        st.st_dev,
        st.st_ino,
        st.st_mode,
        st.st_uid,
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
    )


def _open_same(path: bytes, identity: tuple[int, int]) -> int:
    """The folder at ``path``, opened without following a link, if it is still the one
    the full path used (the same device and inode)."""
    fd = os.open(path, _FOLDER)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != identity:
        os.close(fd)
        raise _Miss
    return fd


def _write_outputs(outputs: list[tuple[bytes, bytes]]) -> None:
    """Each output as the full path writes it: a new file (0666 less the umask) renamed
    over the target.  A Ctrl-C waits until none is half made."""
    import _signal

    held = _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})
    try:
        for target, data in outputs:
            folder, _, _ = target.rpartition(b"/")
            temp = b"%s/.opcache-wrap.%d.%s" % (folder, os.getpid(), os.urandom(4).hex().encode())
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except BaseException:
                os.close(fd)
                os.unlink(temp)
                raise
            os.close(fd)
            os.replace(temp, target)
    finally:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, held)


# -- recording a full hit ------------------------------------------------------------


class Recorder:
    """While active, notes every path the process looks up, opens to read, or lists.

    Through ``os`` and ``open``: what opcache's code calls (Python's own imports
    go past them, and are not inputs of a hit).  ``warned``: a warning was
    logged meanwhile, or the user database was asked (a home, a group's id: NSS may
    read more than files): then no memo.
    """

    def __init__(self) -> None:
        self.looked: dict[tuple[str, bool], None] = {}  # (path, follow), in order
        self.listed: set[str] = set()
        self.warned = False
        self._undo: list[tuple[object, str, object]] = []

    def _note(self, path: object, dir_fd: int | None, follow: bool) -> str | None:
        if isinstance(path, int):
            path, dir_fd = "", path  # (a descriptor: the file it names, if a folder)
        try:
            text = os.fsdecode(os.fspath(path))  # type: ignore[arg-type]
            if dir_fd is not None:
                text = os.path.join(_original_readlink(f"/proc/self/fd/{dir_fd}"), text)
        except (TypeError, ValueError, OSError):
            return None
        text = text.rstrip("/") or "/"
        self.looked.setdefault((text, follow), None)
        return text

    def __enter__(self) -> Recorder:
        import builtins
        import io

        from . import _log

        note = self._note
        real = {name: getattr(os, name) for name in _PATCHED}

        def stat_(path, *, dir_fd=None, follow_symlinks=True):  # type: ignore[no-untyped-def]
            note(path, dir_fd, follow_symlinks)
            return real["stat"](path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)

        def lstat_(path, *, dir_fd=None):  # type: ignore[no-untyped-def]
            note(path, dir_fd, False)
            return real["lstat"](path, dir_fd=dir_fd)

        def open_(path, flags, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
            if not flags & _WRITES:
                note(path, dir_fd, not flags & os.O_NOFOLLOW)
            return real["open"](path, flags, mode, dir_fd=dir_fd)

        def access_(path, mode, *, dir_fd=None, effective_ids=False, follow_symlinks=True):  # type: ignore[no-untyped-def]
            follow = follow_symlinks
            note(path, dir_fd, follow)
            return real["access"](
                path,
                mode,
                dir_fd=dir_fd,
                effective_ids=effective_ids,
                follow_symlinks=follow_symlinks,
            )

        def readlink_(path, *, dir_fd=None):  # type: ignore[no-untyped-def]
            note(path, dir_fd, False)
            return real["readlink"](path, dir_fd=dir_fd)

        def lister(name: str) -> Callable[..., object]:
            def list_(path="."):  # type: ignore[no-untyped-def]
                listed = note(path, None, True)
                if listed is not None:
                    self.listed.add(os.path.abspath(listed))
                return real[name](path)

            return list_

        def file_open(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
            if not isinstance(file, int) and not set("wax+") & set(mode):
                note(file, None, True)
            return io_open(file, mode, *args, **kwargs)

        warning = _log.Logger.warning

        def warning_(logger, msg, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.warned = True
            return warning(logger, msg, *args, **kwargs)

        def unseen(function: Callable[..., object]) -> Callable[..., object]:
            def call(*args, **kwargs):  # type: ignore[no-untyped-def]
                self.warned = True  # (the user database, through NSS: not files it can check)
                return function(*args, **kwargs)

            return call

        import grp
        import pwd

        io_open = io.open
        patches: list[tuple[object, str, object]] = [
            (os, "stat", stat_),
            (os, "lstat", lstat_),
            (os, "open", open_),
            (os, "access", access_),
            (os, "readlink", readlink_),
            (os, "listdir", lister("listdir")),
            (os, "scandir", lister("scandir")),
            (builtins, "open", file_open),
            (io, "open", file_open),
            (_log.Logger, "warning", warning_),
            *((pwd, name, unseen(getattr(pwd, name))) for name in ("getpwuid", "getpwnam")),
            *((grp, name, unseen(getattr(grp, name))) for name in ("getgrgid", "getgrnam")),
        ]
        for owner, name, value in patches:
            self._undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            owner, name, value = self._undo.pop()
            setattr(owner, name, value)


_PATCHED = ("stat", "lstat", "open", "access", "readlink", "listdir", "scandir")
_original_readlink = os.readlink


class Hit:
    """What a full hit of a C compile gives a memo (``wrap`` fills it in)."""

    def __init__(
        self,
        root: str,
        soc: str,
        key: str,
        outputs: dict[str, str],
        stamp_every: float,
        saved: float,
        file_mode: int,
        streams: tuple[str, str],
    ) -> None:
        self.root = root
        self.soc = soc
        self.key = key
        self.outputs = outputs  # artifact name -> absolute target path
        self.stamp_every = stamp_every  # <0: aging off
        self.saved = saved
        self.file_mode = file_mode
        self.streams = streams  # the artifacts of the saved stdout and stderr


def write_memo(words: list[str], recorder: Recorder, hit: Hit, started: float) -> bool:
    """Write the memo of a full hit that ``recorder`` watched; False when it may not have
    one (a racy file, a path it cannot place, an entry that moved).  Never raises OSError."""
    try:
        fields = _memo_fields(recorder, hit, started)
        if fields is None:
            return False
        cwd = os.getcwdb()
        umask = os.umask(0o077)
        os.umask(umask)
        name = memo_name(words, os.environb, cwd, umask)
        _put(name, b"\0".join([FORMAT, *fields, b"end"]))
        return True
    except OSError:
        return False


def _memo_fields(recorder: Recorder, hit: Hit, started: float) -> list[bytes] | None:
    from .counters import QUICK_COUNTS
    from .storage.entry import MANIFEST, parse_manifest

    entry = f"{hit.root}/{hit.soc}/{hit.key[:2]}/{hit.key}"
    counters = f"{hit.root}/.opcache/stats/{hit.soc}"
    skip = {os.path.abspath(target) for target in hit.outputs.values()}
    racy = int((started - RACY_SECONDS) * 1e9)
    fields: list[bytes] = []
    for path, follow in _opcache_files() + list(recorder.looked):
        full = os.path.abspath(path)
        if (
            full in skip
            or full == entry
            or _under(full, (entry, counters))
            or full.startswith(_NOT_INPUTS)
            or "/.opcache-wrap." in full
        ):
            continue
        want = _identity(os.fsencode(path), follow, full not in recorder.listed)
        if want[0] >= 0 and want[4] != _NO_SIZE and max(want[5], want[6]) >= racy:
            return None  # racy: it may change again within the times it was read with
        fields += [b"c", os.fsencode(path), b"1" if follow else b"0", *(b"%d" % n for n in want)]
    fd = os.open(entry, _FOLDER)
    try:
        st = os.fstat(fd)
        fields += [b"e", os.fsencode(entry), b"%d" % st.st_dev, b"%d" % st.st_ino]
        fields += [MANIFEST.encode(), repr(hit.stamp_every).encode()]
        manifest = os.open(MANIFEST, _READ, dir_fd=fd)
        try:
            raw = os.read(manifest, 16 << 20)
        finally:
            os.close(manifest)
    finally:
        os.close(fd)
    artifacts = {
        name: (size, want) for name, size, want in parse_manifest(raw, hit.key)["artifacts"]
    }
    for name, target in hit.outputs.items():
        if name not in artifacts:
            return None
        size, want = artifacts[name]
        fields += [b"o", os.fsencode(os.path.abspath(target)), name.encode(), b"%d" % size]
        fields.append(want.encode())
    for number, name in enumerate(hit.streams, 1):
        if name in artifacts:
            size, want = artifacts[name]
            fields += [b"s", b"%d" % number, name.encode(), b"%d" % size, want.encode()]
    st = os.stat(counters, follow_symlinks=False)
    fields += [b"n", os.fsencode(counters), b"%d" % st.st_dev, b"%d" % st.st_ino]
    fields += [b"%d" % hit.file_mode, repr(float(hit.saved)).encode(), QUICK_COUNTS.encode()]
    return fields


def _under(path: str, folders: Iterable[str]) -> bool:
    return any(path.startswith(folder + "/") for folder in folders)


def _opcache_files() -> list[tuple[str, bool]]:
    """opcache's own modules: an upgrade (or an edit) makes every memo miss."""
    return sorted(
        (module.__file__, True)
        for name, module in list(sys.modules.items())
        if name.split(".")[0] == "opcache" and getattr(module, "__file__", None)
    )


def _put(name: str, data: bytes) -> None:
    folder = runtime_folder(os.environ)
    os.close(open_own_folder(folder, True))  # (the server's folder: made or checked)
    fd = open_own_folder(os.path.join(folder, FOLDER), True)
    try:
        temp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}"
        out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        try:
            os.write(out, data)
        finally:
            os.close(out)
        os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
        if os.urandom(1)[0] < 256 // CLEAN_ONE_IN:
            _clean(fd)
    finally:
        os.close(fd)


def _clean(fd: int) -> None:
    """Bound the memos: those not rewritten for MEMO_DAYS go; past MAX_MEMOS, all go."""
    import time

    old = time.time() - MEMO_DAYS * 86400
    names = os.listdir(fd)
    for name in names:
        try:
            if (
                len(names) > MAX_MEMOS
                or os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime < old
            ):
                os.unlink(name, dir_fd=fd)
        except OSError:
            pass
