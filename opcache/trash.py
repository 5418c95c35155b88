"""The trash: folders set aside to be deleted, and deleted off the caller's path.

Taking entries out of the cache is one rename each into a trash folder; the
deletion itself (every file, then every folder: a third of a millisecond per
entry on a slow disk) runs in a detached process that holds the trash
folder's lock.  Neither a compile that trims a chip folder nor ``opcache age``
waits for it.  A trash folder whose lock nobody holds was left by a deleter
that died (or could not start); ``sweep`` deletes it.  Where folders cannot
be locked (NFS turns ``flock`` into byte-range locks, which need a file open
for writing), there are no deleters: callers delete in place.

Run as ``python -m opcache.trash FD FOLDER`` by ``delete_later``.
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


def new_folder(trash_dir: Path, label: str, modes: fsutil.Modes) -> tuple[Path, int] | None:
    """A fresh trash folder and the descriptor holding its lock.

    None where folders cannot be locked: the caller deletes in place then.
    """
    for _ in range(_ATTEMPTS):
        path = trash_dir / fsutil.unique_name(label)
        os.mkdir(path, modes.dir_bits)
        fsutil.fix_new_dir(path, modes)  # a group-shared cache's members sweep each other's
        try:
            fd = os.open(path, fsutil.DIR_FLAGS)
        except FileNotFoundError:
            continue  # a sweep took it before we could lock it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.rmdir(path)
            return None
        if os.fstat(fd).st_nlink:
            return path, fd
        os.close(fd)  # a sweep deleted it between our mkdir and our lock
    raise OSError(errno.EAGAIN, "cannot make a trash folder that stays", str(trash_dir))


def delete_later(path: Path, fd: int) -> None:
    """Delete the trash folder ``path`` (locked by ``fd``) from a detached process.

    The process inherits the lock, so no ``sweep`` deletes the folder under it.
    Where no Python can be started for it, the folder is deleted here and now.
    ``fd`` is closed either way.
    """
    try:
        try:
            os.rmdir(path)  # nothing was put in it: no process needed
            return
        except OSError:
            pass
        if not _spawn_deleter(path, fd):
            fsutil.remove_tree(path)
    finally:
        os.close(fd)


def _spawn_deleter(path: Path, fd: int) -> bool:
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
                [sys.executable, "-m", "opcache.trash", str(fd), str(path)],
                pass_fds=(fd,),
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
        log.debug("cannot start a deleter for %s (%s): deleting it now", path, e)
        return False
    return True


def sweep(trash_dir: Path) -> int:
    """Delete what is in the trash and no deleter holds; returns how many folders."""
    try:
        names = os.listdir(trash_dir)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if name.startswith(".nfs"):
            continue  # NFS removes these itself when the last reader closes
        path = trash_dir / name
        try:
            fd = os.open(path, fsutil.DIR_FLAGS)
        except OSError:
            with contextlib.suppress(OSError):
                fsutil.remove_tree(path)  # a file or a link: remove_tree unlinks it
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
            fsutil.remove_tree(path)
            removed += 1
        except OSError as e:
            log.debug("cannot delete %s: %s", path, e)
        finally:
            os.close(fd)
    return removed


def _main(argv: list[str]) -> None:
    fd, folder = int(argv[0]), argv[1]
    with contextlib.suppress(OSError):
        os.nice(10)  # the compiles that go on matter more
    try:
        fsutil.remove_tree(folder)
    finally:
        os.close(fd)


if __name__ == "__main__":
    _main(sys.argv[1:])
