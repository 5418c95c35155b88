"""Small filesystem helpers every part of the cache shares.

Files are created 0640 and folders 0750, narrowed further by the user's
umask, never widened; a group-shared cache uses 0660 and 2770 exactly.
Writes that others may read appear whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import time
from pathlib import Path

from ._record import Record


class Modes(Record):
    """Permission bits for what the cache creates, and the group that shares it.

    A private cache narrows its bits by the user's umask.  A group-shared cache
    (``group`` set) uses its bits exactly, whatever the umask, and gives every
    folder to the group: a team's cache is useless if one member's umask 022
    makes the others unable to write (ccache's issue #710).
    """

    __slots__ = _fields = ("file", "dir", "group")
    file: int
    dir: int
    group: int | None

    def __init__(self, file: int, dir: int, group: int | None = None) -> None:
        self._init(locals())

    @property
    def file_bits(self) -> int:
        return self.file if self.group is not None else masked(self.file)

    @property
    def dir_bits(self) -> int:
        return self.dir if self.group is not None else masked(self.dir)


PRIVATE = Modes(file=0o640, dir=0o750)


def group_shared(gid: int) -> Modes:
    """Folders 2770 (setgid: new files join the group) and files 0660, for ``gid``."""
    return Modes(file=0o660, dir=0o2770, group=gid)


def modes_for(shared_group: int | None) -> Modes:
    """The modes of a private cache, or of one shared by the group ``shared_group``."""
    return PRIVATE if shared_group is None else group_shared(shared_group)


# Errors that mean "someone else removed it first", including NFS's stale handles.
GONE = (errno.ENOENT, errno.ESTALE, errno.ENOTDIR)
# A folder opened for *at() calls, never through a link at its last step.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def umask_now() -> int:
    """The process's umask (read, not set: no race with other threads where /proc is)."""
    try:
        with open("/proc/self/status", "rb") as f:  # bytes: no codec to import
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    # No /proc: the classic read-by-setting, racy only against other threads doing the same.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = umask_now()  # (flow reads it again at each miss)


def masked(mode: int) -> int:
    """``mode`` narrowed by the user's umask (setgid kept for shared folders)."""
    return mode & ~UMASK & 0o7777


def absolute(path: str | os.PathLike[str]) -> str:
    """``path`` from the root, its ``..`` left for the kernel to resolve: through a
    link, ``sub/..`` is not ``.``, so folding it by text (``os.path.abspath``) may
    name another file than the compiler writes."""
    return os.path.join(os.getcwd(), path)


def makedirs(path: Path, modes: Modes) -> None:
    """Create ``path`` and missing parents with the cache's folder mode."""
    since = time.time_ns()
    try:
        os.mkdir(path, modes.dir_bits)
    except FileExistsError:
        return
    except FileNotFoundError:
        makedirs(path.parent, modes)
        try:
            os.mkdir(path, modes.dir_bits)
        except FileExistsError:
            return
    if modes.group is None:
        return
    with contextlib.suppress(OSError):
        fd = open_made(path, since=since)
        if fd is not None:
            try:
                fix_new_folder(fd, modes)
            finally:
                os.close(fd)


def make_folder(
    path: Path | str, bits: int, dir_fd: int | None = None, *, warn: bool = True
) -> int | None:
    """Make the folder ``path`` (relative to ``dir_fd`` if given) and open it: a handle on
    that very folder (``open_made``), or None if another was put in its place first.

    FileExistsError if the name is taken.  What is done to a folder made for
    opcache's own work (its group and bits set, its removal) goes through the
    handle: whoever may write beside it may rename it away and put another
    folder (one of yours from beside it) under its name at any moment.
    ``bits`` with the sticky bit (``MARK``): the folder keeps it, and it tells
    the folder made from one put in its place without listing it.  ``warn``:
    False where the caller reports a None itself.
    """
    since = time.time_ns()
    os.mkdir(path, bits, dir_fd=dir_fd)
    return open_made(path, dir_fd, since=since, marked=bool(bits & MARK), warn=warn)


# The sticky bit, which mkdir keeps: on a private folder it changes nothing (only
# its owner may write in it anyway), and no folder of yours has it unless you set it.
MARK = stat.S_ISVTX


def open_made(
    path: Path | str,
    dir_fd: int | None = None,
    *,
    since: int,
    marked: bool = False,
    warn: bool = True,
) -> int | None:
    """A handle on the folder this process made at ``path`` at ``since``
    (``time.time_ns()`` taken before the mkdir), or None (a warning said so)
    when what is there now is not it; FileNotFoundError if it is gone.

    mkdir tells nothing of what it made, so the folder opened (never through a
    link) is taken for it only if it is this user's and, made with ``MARK``
    (``marked``), has it and was written since (no listing: a wrap hit's
    staging folder), or else is empty or holds only what was made or moved
    there since (another process of the cache's filling a chip folder both
    made at once).  A folder someone who may write beside it renamed into its
    place between the mkdir and the open is another user's, or holds what was
    there before: it is left alone.  (An empty folder of yours would pass:
    nothing is in it to lose or to show.)
    """
    try:
        fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        swapped(path, dir_fd, warn)  # a link or a file in its place
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid():
            # (its mtime, not its ctime, which a rename moves)
            if marked and st.st_mode & MARK and _changed_since(st.st_mtime_ns, st, since):
                return fd
            # (without the mark: a file system that drops the sticky bit, or no mark asked)
            names = os.listdir(fd)
            fresh = _changed_since(st.st_mtime_ns, st, since)
            if not names or (fresh and _all_since(fd, names, since)):
                return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    swapped(path, dir_fd, warn)
    return None


def _all_since(fd: int, names: list[str], since: int) -> bool:
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not written_since(st, since):
            return False
    return True


def swapped(path: Path | str, dir_fd: int | None, warn: bool = True) -> None:
    """Say (a warning, else at debug level) that a folder this process made has another
    folder in its place."""
    from ._log import get_logger  # (only when it happens)

    log = get_logger(__name__)
    (log.warning if warn else log.debug)(
        "%s is not the folder opcache made there: another was put in its place, "
        "left as it is (someone who may write in the folder above renamed it)",
        shown_path(path, dir_fd),
    )


def fix_new_folder(fd: int, modes: Modes) -> None:
    """Give the folder open as ``fd``, one this process just made (``make_folder``),
    its group and exact bits (group-shared only): through the handle, never by a
    name another folder may have been put under meanwhile."""
    if modes.group is None:
        return
    with contextlib.suppress(OSError):
        os.fchown(fd, -1, modes.group)
        # mkdir applies the umask and may drop setgid: set the bits exactly.
        os.fchmod(fd, modes.dir_bits)


def unique_name(label: str) -> str:
    """``label`` made unique among concurrent writers (cheaper than tempfile)."""
    return f"{label}.{os.getpid()}.{os.urandom(4).hex()}"


_TEMP = re.compile(r"\..+\.[0-9]+\.[0-9a-f]{8}")


def is_temp_name(name: str) -> bool:
    """True for the temp file names ``write_atomic`` uses (``.<name>.<pid>.<hex>``)."""
    return bool(_TEMP.fullmatch(name))


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the file open as ``fd``."""
    written = os.write(fd, data)
    if written < len(data):  # (a short write: the rest, in as many as it takes)
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view) :]


def write_atomic(path: Path | str, data: bytes, modes: Modes, *, dir_fd: int | None = None) -> None:
    """Write ``data`` to ``path`` (relative to ``dir_fd`` if given) through a temp file
    and a rename."""
    head, name = os.path.split(path)
    tmp = os.path.join(head, unique_name(f".{name}"))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, modes.file_bits, dir_fd=dir_fd)
    try:
        try:
            # Exact in a group-shared cache, whatever the umask; a private one's
            # are the umask's, as the open made them.
            if modes.group is not None:
                os.fchmod(fd, modes.file_bits)
            write_all(fd, data)  # (not a file object: its fstat, ioctl and lseek)
        finally:
            os.close(fd)
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


# Times remove_folder starts over when a folder it walks is moved meanwhile.
_RESTARTS = 8


def remove_tree(path: Path | str, dir_fd: int | None = None, *, ours: bool = False) -> int:
    """Delete a folder tree without following links, tolerating parts that vanish.

    ``path`` is relative to ``dir_fd`` when given.  Returns the bytes of the
    regular files it deleted.  A link is removed itself, never what it points
    at, and so is a folder swapped for a link while the walk goes on: every
    folder is opened without following a link and emptied through that handle,
    never through a path that could lead elsewhere.  A ``.nfsXXXX`` file (an
    NFS client's placeholder for a file still open elsewhere) can keep a
    folder from going; that folder is left for a later pass.
    """
    fd = _open_subfolder(path, dir_fd)
    if fd is None:
        return 0
    try:
        return remove_folder(fd, path, dir_fd, ours=ours)
    finally:
        os.close(fd)


def remove_folder(
    fd: int, path: Path | str, dir_fd: int | None = None, *, ours: bool = False
) -> int:
    """Delete what is in the folder open as ``fd``, then its name ``path`` (relative to
    ``dir_fd`` if given) if that is empty now; returns the bytes of the files deleted.

    Walked with a list, not recursion, and with one folder open at a time, so
    that no depth (a planted folder thousands of levels deep) runs out of
    stack or descriptors.  Each step up opens ``..`` and checks it is the
    folder come down from: if a folder was moved meanwhile (out of the tree,
    or to lead elsewhere), the walk starts again from ``fd``.

    A folder is emptied only if whoever could have put it where it is could
    have emptied it too (``_may_empty``), else left as it is: a member of a
    group-shared cache who moves another member's private folder in (from a
    team folder both write) must not get it deleted by someone who can.
    ``ours``: the folder is one the caller made, or proved its own through
    ``fd``: only what is in it is judged so.  The name ``path`` is removed at
    the end only if it still holds the folder ``fd`` is.
    """
    size = 0
    top = os.fstat(fd)
    if not ours:
        try:
            above = os.fstat(dir_fd) if dir_fd is not None else os.stat(_parent(path))
        except OSError:
            above = None
        if above is not None and not (_may_empty(top, above) or _moved_by_its_owner(top)):
            _left(path)
            return 0
    cur = os.dup(fd)
    # Per level from the top: its name in the level above, the identity of that
    # level, and the subfolders still to delete (None: not listed yet).
    levels: list[tuple[str, tuple[int, int], list[str] | None]] = [("", (0, 0), None)]
    restarts = 0
    try:
        while True:
            name, above, pending = levels[-1]
            if pending is None:
                size, pending = _remove_files(cur, size)
                levels[-1] = (name, above, pending)
            if pending:
                sub = pending.pop()
                child = _open_subfolder(sub, cur)
                if child is not None:
                    here = os.fstat(cur)
                    if not _may_empty(os.fstat(child), here):
                        os.close(child)
                        _left(sub)
                        continue
                    levels.append((sub, _identity(here), None))
                    os.close(cur)
                    cur = child
                continue
            levels.pop()
            if not levels:
                break
            up = os.open("..", DIR_FLAGS, dir_fd=cur)
            os.close(cur)
            cur = up
            if _identity(os.fstat(cur)) != above:
                restarts += 1
                if restarts > _RESTARTS:
                    raise OSError(errno.ESTALE, "folders keep moving while being deleted", name)
                os.close(cur)
                cur = os.dup(fd)
                levels = [("", (0, 0), None)]
                continue
            _rmdir(name, cur)
    finally:
        os.close(cur)
    # By name (a folder cannot be removed through a handle), and only if the name
    # still holds the folder emptied: another may have been put in its place.
    if _still_there(path, dir_fd, top):
        _rmdir(path, dir_fd)
    return size


def remove_made(path: Path | str, fd: int, dir_fd: int | None = None) -> bool:
    """Delete the folder this process made at ``path`` (relative to ``dir_fd`` if given)
    and holds open as ``fd`` (``make_folder``), if the name still holds it; False
    (a warning said so) if another folder is in its place, which is left as it is.

    Emptied through ``fd`` (``remove_folder``), where only what is in it is
    judged.  A name that holds nothing any more (the folder was published
    under another, or removed) is left as it is too.
    """
    try:
        there = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as e:
        if e.errno in GONE:
            return True
        raise
    if _identity(there) != _identity(os.fstat(fd)):
        swapped(path, dir_fd)
        return False
    # (between that look and this rmdir, microseconds, an empty folder put in
    # its place would go: there is no removing a folder through a handle)
    try:
        os.rmdir(path, dir_fd=dir_fd)  # (left empty, as a hit leaves it: one call)
    except OSError as e:
        if e.errno not in GONE:
            remove_folder(fd, path, dir_fd, ours=True)
    return True


def holds(path: Path | str, fd: int, dir_fd: int | None = None) -> bool:
    """Whether the name ``path`` (relative to ``dir_fd`` if given) still holds the
    folder open as ``fd``, not one put in its place."""
    return _holds(path, dir_fd, os.fstat(fd)) is True


def _holds(path: Path | str, dir_fd: int | None, folder: os.stat_result) -> bool | None:
    """Whether the name still holds ``folder``; None when it holds nothing (gone)."""
    try:
        there = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return _identity(there) == _identity(folder)


def _still_there(path: Path | str, dir_fd: int | None, folder: os.stat_result) -> bool:
    there = _holds(path, dir_fd, folder)
    if there is False:
        _left(path, "another folder is in its place")
    return there is True


def _may_empty(folder: os.stat_result, parent: os.stat_result) -> bool:
    """Whether everyone who may write in ``parent`` (and so put ``folder`` there, by a
    rename from elsewhere) may also empty ``folder``: anyone, where anyone writes
    ``parent``; its group, where its group does; else its owner, who owns ``folder``
    too.  A sticky folder is never taken for one others may empty."""
    if folder.st_mode & stat.S_ISVTX:
        return folder.st_uid == parent.st_uid and not parent.st_mode & 0o022
    anyone = folder.st_mode & 0o003 == 0o003
    if parent.st_mode & 0o002:
        return anyone
    if parent.st_mode & 0o020:
        group = folder.st_gid == parent.st_gid and folder.st_mode & 0o030 == 0o030
        return anyone or group
    # Its owner alone writes it: that owner (or root) put the folder there.
    return anyone or folder.st_uid == parent.st_uid or parent.st_uid in (0, os.geteuid())


def _moved_by_its_owner(folder: os.stat_result) -> bool:
    """A folder of this user's (or root's) that no one else may write: moved into the
    folder it is in from another only by its owner or root (a rename to another
    folder writes its ``..``).  Only for a folder found where it is, never for one
    below it, which moves with its parent.

    It tells where the folder was put, not under what name: a rename within one
    folder needs no write permission on the folder renamed, so anyone who may
    write where it is may have given it its name.  Whatever a caller picks by
    its name in a folder others write (a build folder in an out_dir) needs
    other proof that it is opcache's (``local._abandoned``'s mark)."""
    return folder.st_uid in (os.geteuid(), 0) and not folder.st_mode & 0o022


def _parent(path: Path | str) -> str:
    return os.path.dirname(os.path.normpath(path)) or "."


def _left(name: Path | str, why: str = "whoever could put it there could not empty it") -> None:
    from ._log import get_logger  # (only when something is left)

    get_logger(__name__).debug("not deleting %s: %s", name, why)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _remove_files(fd: int, size: int) -> tuple[int, list[str]]:
    """Delete all but the subfolders of the folder open as ``fd``: (``size`` plus
    the bytes of the files deleted, the subfolders' names)."""
    with os.scandir(fd) as listed:
        entries = list(listed)
    folders = []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            folders.append(entry.name)
            continue
        try:
            if entry.is_file(follow_symlinks=False):
                size += entry.stat(follow_symlinks=False).st_size
        except OSError:
            pass
        _unlink(entry.name, fd)
    return size, folders


def _open_subfolder(name: Path | str, parent_fd: int | None) -> int | None:
    """The folder ``name`` opened without following a link; None if it is gone, or
    is a file or a link (then removed itself, never its target)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            _unlink(name, parent_fd)
        elif e.errno not in GONE:
            raise
        return None


def _rmdir(path: Path | str, dir_fd: int | None) -> None:
    try:
        os.rmdir(path, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (*GONE, errno.ENOTEMPTY, errno.EBUSY):
            raise


def _unlink(path: Path | str, dir_fd: int | None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (*GONE, errno.EBUSY):
            raise


def lexists(name: str, dir_fd: int) -> bool:
    """Whether anything (a link too) is named ``name`` in the folder open as ``dir_fd``."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def shown_path(path: Path | str, dir_fd: int | None) -> str:
    """``path`` as a message names it: whole, though it was opened relative to
    ``dir_fd`` (``06.lock: Permission denied`` says not where)."""
    if dir_fd is None or os.path.isabs(path):
        return os.fspath(path)
    try:
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    except OSError:
        return os.fspath(path)


def read_input(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """The bytes of a file a compile or a setting names, read as a program would read
    them: through links (``limit``: at most that many and one more, to tell a
    longer file).

    OSError for anything but a regular file: a FIFO would hang the read (and
    steal the compiler's input), a device such as /dev/zero never ends.
    """
    return read_input_stat(path, limit)[0]


def read_input_stat(
    path: str | os.PathLike[str], limit: int | None = None
) -> tuple[bytes, os.stat_result]:
    """``read_input``'s bytes, and the file's fstat taken before they were read: a
    write after it, even of the same bytes, moves its ctime (``written_since``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: no wait
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            folder = stat.S_ISDIR(st.st_mode)  # (IsADirectoryError, as open() gives)
            why = (errno.EISDIR, "is a folder") if folder else (errno.EINVAL, "not a regular file")
            raise OSError(*why, os.fspath(path))
        left = float("inf") if limit is None else limit + 1
        chunks = []
        while left > 0 and (chunk := os.read(fd, int(min(left, max(st.st_size + 1, 1 << 16))))):
            chunks.append(chunk)  # (one read, mostly)
            left -= len(chunk)
        return b"".join(chunks), st
    except MemoryError:
        raise OSError(errno.EFBIG, "too large to read", os.fspath(path)) from None
    finally:
        os.close(fd)


# File times come from the kernel's coarse clock, up to a tick (10 ms at HZ=100)
# behind time.time_ns(); some file systems keep whole seconds (FAT's mtime: even ones).
CLOCK_LAG_NS = 10_000_000
_SECONDS_LAG_NS = 2_000_000_000


def written_since(st: os.stat_result, started_ns: int) -> bool:
    """Whether the file ``st`` describes may have been written (or renamed, or its
    mode changed) at or after ``started_ns`` (``time.time_ns()``): its mtime or
    ctime is that late, give or take what the file system's times can tell
    apart."""
    return _changed_since(max(st.st_mtime_ns, st.st_ctime_ns), st, started_ns)


def _changed_since(time_ns: int, st: os.stat_result, started_ns: int) -> bool:
    """Whether ``time_ns``, one of ``st``'s times, is at or after ``started_ns``, give or
    take what the file system's times can tell apart."""
    second = 1_000_000_000
    whole = not st.st_mtime_ns % second and not st.st_ctime_ns % second
    lag = _SECONDS_LAG_NS if whole else CLOCK_LAG_NS
    return time_ns >= started_ns - lag


def open_regular(
    path: Path | str, flags: int = os.O_RDONLY, mode: int = 0o666, *, dir_fd: int | None = None
) -> tuple[int, os.stat_result]:
    """(fd, fstat) of ``path``, opened only if it is a regular file; OSError otherwise.

    For a file anyone else could have put there: a link is never followed
    (ELOOP), and a FIFO or a device neither blocks the open (O_NONBLOCK, which
    a regular file ignores) nor is kept (EINVAL, "not a regular file").  The
    error names the whole path.
    """
    try:
        return _open_regular(path, flags, mode, dir_fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror, shown_path(path, dir_fd)) from None


def _open_regular(
    path: Path | str, flags: int, mode: int, dir_fd: int | None
) -> tuple[int, os.stat_result]:
    """``open_regular``, its error not naming the path: one that is expected is not
    worth the look at the folder's name a message takes."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if flags & os.O_CREAT:
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
    else:  # (no mode: pyfakefs, in the tests, chmods any file opened with one)
        fd = os.open(path, flags, dir_fd=dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd, st


def made_or_opened(
    path: Path | str, flags: int, mode: int, *, dir_fd: int | None = None
) -> tuple[int, os.stat_result, bool]:
    """``open_regular`` of ``path``, made if missing: (fd, fstat, whether this call made
    it).  Only a file made here may be chmodded: one already there may be another's,
    or a file of ours another user moved in under the name (a secret, 0600), which a
    chmod would open to the group."""
    flags &= ~os.O_CREAT
    try:
        for _ in range(3):
            try:  # (there already, most times: one open)
                fd, st = _open_regular(path, flags, mode, dir_fd)
                return fd, st, False
            except FileNotFoundError:
                pass
            try:
                fd, st = _open_regular(path, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd)
                return fd, st, True
            except FileExistsError:  # (a link too: O_EXCL never follows one)
                continue  # made between the two opens: opened as it is
    except OSError as e:
        raise OSError(e.errno, e.strerror, shown_path(path, dir_fd)) from None
    raise OSError(errno.EAGAIN, "made and removed again and again", shown_path(path, dir_fd))
