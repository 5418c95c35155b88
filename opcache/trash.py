"""The trash: folders set aside to be deleted, and deleted off the caller's path.

Taking entries out of the cache is one rename each into a trash folder; the
deletion itself (every file, then every folder: a third of a millisecond per
entry on a slow disk) runs in a detached process that holds the trash
folder's lock.  Neither a compile that trims a chip folder nor ``opcache age``
waits for it.  A trash folder whose lock nobody holds was left by a deleter
that died (or could not start); ``sweep`` deletes it.  Where folders cannot
be locked (NFS turns ``flock`` into byte-range locks, which need a file open
for writing), there are no deleters: callers delete in place.

Run as ``python -m opcache.trash FD TRASH_FD NAME`` by ``delete_later``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
from pathlib import Path

from . import fsutil
from ._log import get_logger

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    import subprocess

log = get_logger(__name__)

_ATTEMPTS = 8
# Running deleters, kept so that they are reaped (no zombies in a long-lived
# program) and not reported as abandoned.
_deleters: list[subprocess.Popen[bytes]] = []


def new_folder(trash_fd: int, label: str, modes: fsutil.Modes) -> tuple[str, int] | None:
    """A fresh folder in the trash (open as ``trash_fd``): its name, and the
    descriptor holding its lock.

    None where folders cannot be locked: the caller deletes in place then.
    """
    for _ in range(_ATTEMPTS):
        name = fsutil.unique_name(label)
        try:
            fd = fsutil.make_folder(name, modes.dir_bits, trash_fd)
        except FileExistsError:
            continue  # not ours
        except FileNotFoundError:
            continue  # a sweep took it before we could lock it
        if fd is None:
            continue  # a member put another folder in its place: left as it is
        # A group-shared cache's members sweep each other's.
        fsutil.fix_new_folder(fd, modes)
        try:
            # Never waited for: another member may open and lock a folder the
            # moment it exists, and hold it as long as it likes.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # Someone else's now: a sweep deletes it once they let it go.
            os.close(fd)
            continue
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=trash_fd)
            return None
        if os.fstat(fd).st_nlink:
            return name, fd
        os.close(fd)  # a sweep deleted it between our mkdir and our lock
    raise OSError(errno.EAGAIN, "cannot make a trash folder that stays")


def delete_later(trash_fd: int, name: str, fd: int) -> None:
    """Delete the trash folder ``name`` (locked by ``fd``) from a detached process.

    The process inherits the lock, so no ``sweep`` deletes the folder under it.
    Where no Python can be started for it, the folder is deleted here and now.
    ``fd`` is closed either way (``trash_fd`` stays the caller's).
    """
    try:
        try:
            os.rmdir(name, dir_fd=trash_fd)  # nothing was put in it: no process needed
            return
        except OSError:
            pass
        if not _spawn_deleter(trash_fd, name, fd):
            fsutil.remove_folder(fd, name, trash_fd, ours=True)
    finally:
        os.close(fd)


def _spawn_deleter(trash_fd: int, name: str, fd: int) -> bool:
    # An embedding program's sys.executable may be anything but a Python.
    if not os.path.basename(sys.executable or "").startswith("python"):
        return False
    import subprocess  # only when something was trimmed or cleared

    _deleters[:] = [p for p in _deleters if p.poll() is None]
    package_parent = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    try:
        _deleters.append(
            subprocess.Popen(
                # Handles, not paths: the deleter deletes in the folders this
                # process opened, wherever a link now in their place leads.
                [sys.executable, "-m", "opcache.trash", str(fd), str(trash_fd), name],
                pass_fds=(fd, trash_fd),
                env=env,
                # Not the caller's folder: an "opcache" folder there would be
                # imported instead, and the folder would be kept busy.
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a build tool's Ctrl-C or exit does not stop it
            )
        )
    except OSError as e:
        log.debug("cannot start a deleter for the trash folder %s (%s): deleting it now", name, e)
        return False
    return True


def sweep(trash_fd: int) -> int:
    """Delete what is in the trash (open as ``trash_fd``) and no deleter holds;
    returns how many folders."""
    try:
        names = os.listdir(trash_fd)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if name.startswith(".nfs"):
            continue  # NFS removes these itself when the last reader closes
        try:
            fd = os.open(name, fsutil.DIR_FLAGS, dir_fd=trash_fd)
        except OSError:
            with contextlib.suppress(OSError):
                fsutil.remove_tree(name, trash_fd)  # a file or a link: removed itself
                removed += 1
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a deleter is at work on it
        except OSError:
            pass  # folders cannot be locked here, so no deleter can be at work
        try:
            fsutil.remove_folder(fd, name, trash_fd)
            removed += 1
        except OSError as e:
            log.debug("cannot delete the trash folder %s: %s", name, e)
        finally:
            os.close(fd)
    return removed


def _main(argv: list[str]) -> None:
    fd, trash_fd, name = int(argv[0]), int(argv[1]), argv[2]
    with contextlib.suppress(OSError):
        os.nice(10)  # the compiles that go on matter more
    try:
        fsutil.remove_folder(fd, name, trash_fd, ours=True)  # (new_folder's, its lock held)
    finally:
        os.close(fd)
        os.close(trash_fd)


if __name__ == "__main__":
    _main(sys.argv[1:])
