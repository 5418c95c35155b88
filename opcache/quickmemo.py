"""Writing a quick hit's memo (``quickhit.py``): what a full hit of a C compile consulted.

``Recorder`` notes, while ``wrap.run`` serves a full hit, every path the process
looks up, opens to read or lists (through ``os`` and ``open``), with its stat
identity as it was then; ``write_memo`` then records those identities
(``quickhit``'s format), the entry and its artifacts' digests, unless one
moved meanwhile or one recorded file (or link) is racy: its mtime or ctime
within RACY_SECONDS of the run's start (git's rule: a file changed in the
same clock tick as it was read could change again unseen).  Kept apart from
``quickhit``, which every ``opcache`` run imports first: only a full hit needs
this.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys

from . import fsutil, quickhit
from .quickhit import (
    CLIENT_FORMAT,
    FOLDER,
    FOLDER_FLAGS,
    FORMAT,
    MAX_MEMO,
    NO_SIZE,
    READ,
    Memo,
    Miss,
    count_line,
    identity,
    memo_name,
    opcache_files,
    open_own_folder,
    open_same,
    runtime_folder,
)

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from collections.abc import Callable

RACY_SECONDS = 2.0  # a file changed this close to the run that read it gets no memo
MAX_MEMOS = 20_000  # then the folder is emptied (each memo is only a shortcut; two a command)
MEMO_DAYS = 7  # a memo not rewritten for this long goes at a cleaning
CLEAN_ONE_IN = 64  # a memo write cleans the folder about once in this many
_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT
# In an ``opcache server`` worker: when the call it serves started (cli's rule for
# the program; a served full hit leaves a memo as the program's does).
serving: list[float] = []


class Recorder:
    """While active, notes every path the process looks up, opens to read, or lists.

    Through ``os`` and ``open``: what opcache's code calls (Python's own imports
    go past them, and are not inputs of a hit).  ``warned``: a warning was
    logged meanwhile, or the user database was asked (a home, a group's id: NSS may
    read more than files): then no memo.
    """

    def __init__(self) -> None:
        # (path, follow), in order -> its identity and, followed, the link's own, taken
        # as the path was first consulted: a memo certifies what the hit saw, not what
        # is there once it is done (a header made, a link re-pointed, in between).
        self.looked: dict[tuple[str, bool], tuple[tuple[int, ...], tuple[int, ...]]] = {}
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
        if (text, follow) not in self.looked:
            self.looked[text, follow] = _seen(text, follow)
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


_NUMBERS = b"\0".join([b"%d"] * 7)  # a check's identity, as a memo holds it


def _seen(path: str, follow: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A path's identity now, and its own (the link's, if it is one and followed).

    Its own first: followed, a path that is not a link is that same file, and one that
    cannot be looked up fails as it would followed (the same folders are searched), so
    only a link costs a second ``stat``.
    """
    raw = os.fsencode(path)
    own = identity(raw, False, False)
    if follow and own[0] >= 0 and stat.S_ISLNK(own[2]):
        return identity(raw, True, False), own
    return own, own


def _as_recorded(seen: tuple[int, ...], folder_only: bool) -> tuple[int, ...]:
    """``identity(path, follow, folder_only)`` of a path whose full identity was ``seen``."""
    if folder_only and seen[0] >= 0 and stat.S_ISDIR(seen[2]):
        return (*seen[:4], NO_SIZE, 0, 0)
    return seen


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
        data = b"\0".join([FORMAT, *fields, b"end"])
        if len(data) > MAX_MEMO:
            return False  # (never read: not rewritten at every full hit either)
        put(runtime_folder(os.environ), memo_name(words, os.environb, cwd, umask), data)
        quickhit.last_memo[:] = [data]
        return True
    except OSError:
        return False


def _memo_fields(recorder: Recorder, hit: Hit, started: float) -> list[bytes] | None:
    from .counters import QUICK_COUNTS
    from .storage.entry import MANIFEST, parse_manifest

    entry = f"{hit.root}/{hit.soc}/{hit.key[:2]}/{hit.key}"
    counters = f"{hit.root}/.opcache/stats/{hit.soc}"
    skip = {os.path.abspath(target) for target in hit.outputs.values()}
    staging = f"/.opcache-wrap.{os.getpid()}."  # (this run's: fsutil.unique_name's form)
    racy = int((started - RACY_SECONDS) * 1e9)
    remote = _nonlocal_devices(_mount_table())
    fields: list[bytes] = []
    looked = [(path, True, None) for path in opcache_files()]
    looked += [(path, follow, seen) for (path, follow), seen in recorder.looked.items()]
    inside = (entry + "/", counters + "/")
    for path, follow, seen in looked:
        full = os.path.abspath(path)
        if full in skip or full == entry or full.startswith(inside) or staging in full:
            continue
        folder_only = full not in recorder.listed
        found = _seen(path, follow)
        now = [_as_recorded(one, folder_only) for one in found]
        # (as seen to the last field, it is as recorded too: the common case, told at once)
        if (
            seen is not None
            and seen != found
            and [_as_recorded(one, folder_only) for one in seen] != now
        ):
            return None  # it moved since the hit consulted it: the object may be the old one's
        want = now[0]
        for got in now:
            if got[0] >= 0 and got[4] != NO_SIZE and max(got[5], got[6]) >= racy:
                # Racy (a link itself too): it may change again within the times it was
                # read with.  (A folder not listed keeps no times: what is looked up in
                # it is recorded on its own.)
                return None
        if want[0] in remote:
            return None  # its client caches attributes: a stat may not see a change yet
        # (the 7 numbers as one element: joined by NULs, the same bytes as 7 of them)
        fields += [b"c", os.fsencode(path), b"1" if follow else b"0", _NUMBERS % want]
    fd = os.open(entry, FOLDER_FLAGS)
    try:
        st = os.fstat(fd)
        fields += [b"e", os.fsencode(entry), b"%d" % st.st_dev, b"%d" % st.st_ino]
        fields += [MANIFEST.encode(), repr(hit.stamp_every).encode()]
        manifest = os.open(MANIFEST, READ, dir_fd=fd)
        try:
            raw = os.read(manifest, 16 << 20)
        finally:
            os.close(manifest)
    finally:
        os.close(fd)
    described = parse_manifest(raw, hit.key)
    if described["modes"]:
        return None  # (a quick hit writes each output with the bits a new file gets)
    artifacts = {name: (size, want) for name, size, want in described["artifacts"]}
    for name, target in hit.outputs.items():
        if name not in artifacts:
            return None
        size, want = artifacts[name]
        path = os.fsencode(fsutil.absolute(target))  # (its .. as the kernel takes it)
        # The folder the hit wrote it in, as the compiler reaches it (links followed): a
        # quick hit writes there only while the path still leads to that folder.
        place = os.stat(path.rpartition(b"/")[0] or b"/")
        fields += [b"o", path, name.encode(), b"%d" % size, want.encode()]
        fields += [b"%d" % place.st_dev, b"%d" % place.st_ino]
    for number, name in enumerate(hit.streams, 1):
        if name in artifacts:
            size, want = artifacts[name]
            fields += [b"s", b"%d" % number, name.encode(), b"%d" % size, want.encode()]
    st = os.stat(counters, follow_symlinks=False)
    fields += [b"n", os.fsencode(counters), b"%d" % st.st_dev, b"%d" % st.st_ino]
    fields += [b"%d" % hit.file_mode, repr(float(hit.saved)).encode(), QUICK_COUNTS.encode()]
    return fields


# File systems whose stat shows a change as soon as it is made.  Any other kind (NFS's
# client caches attributes up to actimeo, virtiofs, sshfs and other FUSE mounts, SMB...)
# may show a file as it was while an open reads what it is now: no memo there.  Nor on
# read-only images (squashfs, erofs, iso9660, cramfs): their times, sizes and inode
# numbers come from the image, so another image mounted in its place (the same loop
# device) can give every recorded identity back.
LOCAL_FILE_SYSTEMS = frozenset(
    (
        *("ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "jfs", "nilfs2"),
        *("reiserfs", "tmpfs", "ramfs", "overlay", "vfat", "exfat"),
        *("ntfs3", "proc", "sysfs", "devtmpfs", "devpts"),
    )
)


def _mount_table() -> str:
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _nonlocal_devices(mountinfo: str) -> set[int]:
    """The devices (``st_dev``) in a ``/proc/self/mountinfo`` text of file systems not in
    LOCAL_FILE_SYSTEMS (a network's, a FUSE mount's...)."""
    found = set()
    for line in mountinfo.splitlines():
        words, _, after = line.partition(" - ")
        fields = words.split()
        kind = after.split()[:1]
        if len(fields) < 3 or not kind or kind[0] in LOCAL_FILE_SYSTEMS:
            continue
        major, _, minor = fields[2].partition(":")
        if major.isdigit() and minor.isdigit():
            found.add(os.makedev(int(major), int(minor)))
    return found


def client_memo(memo: bytes) -> bytes | None:
    """The C client's memo (``opcache_client.c`` reads it) of ``memo``, a Python memo that
    holds (just served from or written): None where the client would not serve it.

    The same records, but each artifact's xxh64 (read now, and checked against the
    manifest's digest first) in place of that digest, the count as the line to
    append, and one more check: the server's Python (the memo is the work of the
    opcache it runs, and its name holds no Python, which the client does not know).
    The checks are taken as they are, unparsed: the client checks each field itself,
    and none can be racy (each was older than the racy window when the memo was
    written, and holds still).
    """
    import time

    import xxhash

    fields = memo.split(b"\0")
    try:
        parsed = Memo(fields[1:-1])
        if fields[0] != FORMAT or fields[-1] != b"end":
            return None
        python = os.fsencode(sys.executable)
        want = identity(python, True, False)
        if want[0] >= 0 and max(want[5], want[6]) >= int((time.time() - RACY_SECONDS) * 1e9):
            return None  # (the Python just installed: it may change again unseen)
        checks = fields[1 : 1 + parsed.checks_end]
        out = [CLIENT_FORMAT, *checks, b"c", python, b"1", *(b"%d" % n for n in want)]
        entry = open_same(parsed.entry, parsed.entry_id)
        try:
            out += [b"e", parsed.entry, *(b"%d" % n for n in parsed.entry_id), parsed.manifest]
            out.append(repr(parsed.stamp_every).encode())
            # The streams first: small, and one with colour ends it before the outputs
            # are read and hashed for nothing.
            for number, name, size, want in parsed.streams:
                data = Memo.artifact(entry, name, size, want)
                if b"\x1b[" in data:
                    return None  # (the client leaves colour to the Python path, as quickhit)
                out += [b"s", b"%d" % number, name, b"%d" % size]
                out.append(xxhash.xxh64_hexdigest(data).encode())
            for target, name, size, want, folder in parsed.outputs:
                data = Memo.artifact(entry, name, size, want)
                out += [b"o", target, name, b"%d" % size, xxhash.xxh64_hexdigest(data).encode()]
                out += [b"%d" % number for number in folder]
        finally:
            os.close(entry)
        out += [b"n", parsed.counters, *(b"%d" % n for n in parsed.counters_id)]
        out += [b"%d" % parsed.counters_mode, parsed.appended, count_line(parsed.saved)]
    except (Miss, OSError, ValueError, IndexError, AttributeError):
        return None
    data = b"\0".join([*out, b"end"])
    return data if len(data) <= MAX_MEMO else None


def put(folder: str, name: str, data: bytes) -> None:
    """Write the memo ``name`` in the runtime ``folder`` (``runtime_folder``): made anew and
    renamed over, in its 0700 folder of memos."""
    os.close(open_own_folder(folder, True))  # (the server's folder: made or checked)
    fd = open_own_folder(os.path.join(folder, FOLDER), True)
    try:
        temp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}"
        out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        try:
            try:
                if os.write(out, data) != len(data):
                    raise OSError(errno.ENOSPC, "a memo written short")  # (a full folder)
            finally:
                os.close(out)
            os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=fd)  # (a full folder would keep one a call: none)
            raise
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
