"""File locks: single-flight compiles, and short critical sections.

Single-flight: one compile per key at a time, across threads and processes.

Each key being compiled has a lock file held with ``flock``, which the
operating system releases when its holder dies, so a crashed compiler never
blocks anyone.  The holder deletes the file before releasing it, so lock files
do not pile up; a waiter that wins the lock on a file that was deleted (or
replaced) meanwhile notices by comparing inodes and tries again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from . import fsutil, trust

_POLL_FIRST = 0.002
_POLL_MAX = 0.05
# How long a critical section (``flocked``) waits for a lock others hold.  Its
# holders keep it for milliseconds, but a recount by ``opcache verify`` holds
# the counting lock for its whole walk, and anyone who can open a lock file
# (the group, in a group-shared cache) can hold it forever: past this, the
# caller gives up (a compile is then not stored, with a warning) rather than
# hang every compile.
LOCK_WAIT_SECONDS = 10.0
# Lock files (device, inode) a wait of this process gave up on: the next wait for
# one is a single try, until a try takes it.  Without this, a member holding the
# 16 size-counter shards cost an aging pass 10 s a removal past the first 64
# (349 entries: 48 minutes), and an import 10 s an entry.
_stuck: set[tuple[int, int]] = set()

# Descriptors of the locks this process holds.  A forked child gets copies,
# and a copy keeps the lock held after the parent lets go: the child drops its
# copies at once (exec'd children never get them: they are close-on-exec).
_held: set[int] = set()


def _drop_inherited_locks() -> None:
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class KeyLock:
    """An exclusive, deletable lock file.  Not reentrant.

    ``open_dir``, when given, opens the lock file's folder (made if missing)
    one level at a time from a trusted handle, never through a link, and
    trusts it; each try calls it.  Without it the folder is opened by path,
    which guards its last level alone.
    """

    def __init__(
        self,
        path: Path,
        modes: fsutil.Modes = fsutil.PRIVATE,
        *,
        open_dir: Callable[[], int] | None = None,
    ) -> None:
        self.path = path
        self._modes = modes
        self._open_dir = open_dir
        self._fd: int | None = None
        self._dir_fd: int | None = None  # the lock file's folder, while held
        self.waited = False  # True once acquire() found it held by someone else
        # True when the lock was won on a file already there: its last holder
        # died without letting go (a holder that lets go deletes the file).
        self.inherited = False

    def acquire(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the lock; True if it is now held."""
        if self._open_dir is None:
            fsutil.makedirs(self.path.parent, self._modes)

        def attempt() -> bool:
            if self._try_once():
                return True
            self.waited = True
            return False

        return _poll(attempt, timeout)

    def try_acquire(self) -> bool:
        """Take the lock if no one holds it, without waiting; True if it is now held."""
        # A second try: the first may have found the folder missing, or the file
        # of a holder that let go just then.
        if self._try_once() or self._try_once():
            return True
        self.waited = True
        return False

    def _try_once(self) -> bool:
        # Everything through one handle on the folder, opened without following
        # a link: a folder swapped for a link meanwhile cannot lead the lock
        # file, or its deletion at release, anywhere else.  Opened anew at each
        # try: a wait may last minutes, and a folder above may be swapped for a
        # link in the meantime.
        if self._open_dir is not None:
            try:
                dir_fd = self._open_dir()
            except FileNotFoundError:
                return False  # (deleted just as it was made: the next try makes it again)
            return self._lock_or_close(dir_fd)
        try:
            dir_fd = os.open(self.path.parent, fsutil.DIR_FLAGS)
        except FileNotFoundError:
            fsutil.makedirs(self.path.parent, self._modes)
            return False
        except OSError as e:
            if e.errno in (errno.ENOTDIR, errno.ELOOP):
                raise trust.UntrustedFolder(f"{self.path.parent} is a link or a file") from None
            raise
        try:
            trust.check(os.fstat(dir_fd), self._modes, self.path.parent)
        except BaseException:
            os.close(dir_fd)
            raise
        return self._lock_or_close(dir_fd)

    def _lock_or_close(self, dir_fd: int) -> bool:
        try:
            if self._lock_in(dir_fd):
                self._dir_fd = dir_fd
                return True
        except BaseException:
            os.close(dir_fd)
            raise
        os.close(dir_fd)
        return False

    def _lock_in(self, dir_fd: int) -> bool:
        name = self.path.name
        existed = fsutil.lexists(name, dir_fd)
        try:
            fd = _open_lock_file(name, self._modes, dir_fd)
        except FileNotFoundError:
            return False  # (the folder was deleted: the next try makes it again)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        try:
            current = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is None or (current.st_ino, current.st_dev) != (held.st_ino, held.st_dev):
            os.close(fd)  # we locked a file its holder had already deleted
            return False
        self._fd = fd
        self.inherited = existed
        _held.add(fd)
        return True

    def release(self) -> None:
        """Delete the lock file (if it is still the one held) and let the next waiter in."""
        dir_fd, self._dir_fd = self._dir_fd, None
        try:
            if self._fd is None or self._fd not in _held:
                self._fd = None  # never held, or dropped in a forked child
                return
            with contextlib.suppress(OSError):
                # Only the file held: one removed under us may have been made anew by a
                # waiter, which holds it now (deleting it let a third process in).
                mine = os.fstat(self._fd)
                there = os.stat(self.path.name, dir_fd=dir_fd, follow_symlinks=False)
                if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                    os.unlink(self.path.name, dir_fd=dir_fd)
            _held.discard(self._fd)
            os.close(self._fd)
            self._fd = None
        finally:
            if dir_fd is not None:
                os.close(dir_fd)


def _poll(attempt: Callable[[], bool], timeout: float) -> bool:
    """Call ``attempt`` until it returns True or ``timeout`` seconds are up; whether it did."""
    deadline = time.monotonic() + timeout
    delay = _POLL_FIRST
    while not attempt():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, _POLL_MAX)
    return True


@contextlib.contextmanager
def flocked(
    path: Path | str,
    modes: fsutil.Modes = fsutil.PRIVATE,
    *,
    shared: bool = False,
    dir_fd: int | None = None,
    timeout: float | None = None,
) -> Iterator[None]:
    """Hold ``flock`` on the (kept) file ``path`` for a critical section.

    Exclusive, or ``shared`` with other shared holders.  ``path`` is relative
    to ``dir_fd`` when given.  Waits up to ``timeout`` seconds (by default
    ``LOCK_WAIT_SECONDS``, read at each call) for other holders, then raises
    BlockingIOError.  The operating system releases the lock of a process
    that dies.
    """
    fd = _open_lock_file(path, modes, dir_fd)
    try:
        flock_within(fd, path, shared=shared, timeout=timeout)
    except BaseException:
        os.close(fd)
        raise
    _held.add(fd)
    try:
        yield
    finally:
        if fd in _held:  # (a forked child has closed it already)
            _held.discard(fd)
            os.close(fd)


def flock_within(
    fd: int, path: Path | str, *, shared: bool = False, timeout: float | None = None
) -> None:
    """``flock`` the open file ``fd`` (named ``path``, for the error), exclusive or
    ``shared``, waiting up to ``timeout`` seconds (by default ``LOCK_WAIT_SECONDS``,
    read at each call) for other holders, then raising BlockingIOError; only one
    try for a lock file a wait of this process gave up on (``_stuck``)."""
    wait = LOCK_WAIT_SECONDS if timeout is None else timeout
    operation = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    st = os.fstat(fd)
    ident = (st.st_dev, st.st_ino)
    if ident in _stuck:
        wait = 0.0

    def attempt() -> bool:
        try:
            fcntl.flock(fd, operation)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    if not _poll(attempt, wait):
        _stuck.add(ident)
        held = "still holds" if wait == 0.0 else f"held for over {wait:g} s"
        raise BlockingIOError(errno.EWOULDBLOCK, f"another process {held} the lock {path}")
    _stuck.discard(ident)


def _open_lock_file(path: Path | str, modes: fsutil.Modes, dir_fd: int | None = None) -> int:
    """Open (or make) a lock file others of a group-shared cache can open too.

    Never through a link, and never a FIFO or a device planted in its place:
    O_NONBLOCK keeps such an open from waiting, and only a regular file is kept.
    """
    try:
        fd, st, made = fsutil.made_or_opened(path, os.O_RDWR, modes.file_bits, dir_fd=dir_fd)
    except OSError as e:
        shown = fsutil.shown_path(path, dir_fd)
        if e.errno == errno.ELOOP:
            raise trust.UntrustedFolder(f"the lock file {shown} is a link") from None
        if e.errno == errno.EINVAL:
            raise trust.UntrustedFolder(f"the lock file {shown} is not a regular file") from None
        raise
    # Only a file made here: one there already may be a file of ours another member
    # moved in (a secret, 0600), which the chmod would open to the group.
    if made and modes.group is not None and st.st_mode & 0o7777 != modes.file_bits:
        with contextlib.suppress(OSError):
            os.fchmod(fd, modes.file_bits)  # the umask narrowed what we made
    return fd


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine with this id runs (someone else's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True
