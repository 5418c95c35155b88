"""Counters on disk that many processes update without a global lock.

A counter folder holds ``SHARDS`` small JSON files (``NN.count``: not ``.json``,
as CANN's aging takes any ``*.json`` below a chip folder, where a chip's size
counters are, for a kernel to age); a process adds its deltas to
the shard of its pid under that shard's lock, so writers rarely meet, and a
reader sums the shards.  Each shard is replaced by rename, so a writer killed
mid-update leaves the old values, never a torn file.

A quick hit (``quickhit.py``), which imports none of this, appends its counts
as a line to the folder's ``appended`` file instead; a reader adds them, and
the next ``add`` past FOLD_BYTES folds them into its shard.

Every file is reached through one handle on the folder, opened by the owner of
the counters without following links: a folder or a shard swapped for a link
never leads a read or a write elsewhere, and a FIFO or a device in a shard's
place is neither waited on nor read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from . import _json, fsutil
from ._log import get_logger
from .locks import flocked

log = get_logger(__name__)

SHARDS = 16
Counts = dict[str, float]
# O_NONBLOCK: opening a FIFO planted as a shard must not wait for a writer.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_SHARD = 1 << 20
# A count past it is planted, not made: sums and float() of it must not overflow.
_MAX_COUNT = 1 << 63
FOLD_BYTES = 64 << 10  # appended counts past this go into a shard at the next add
QUICK_COUNTS = "appended"  # lines of counts a quick hit appends (quickhit.py)


class CounterFiles:
    """The sharded counter files in ``folder`` (created on the first write).

    ``open_folder(write)``, if given, opens the folder instead: it returns a
    handle (closed here after each use) on the folder, made if missing when
    ``write``; it raises FileNotFoundError when there is none, and OSError
    (such as trust.UntrustedFolder) when it may not be used.
    """

    def __init__(
        self,
        folder: Path,
        *,
        modes: fsutil.Modes = fsutil.PRIVATE,
        open_folder: Callable[[bool], int] | None = None,
    ) -> None:
        self.folder = folder
        self._modes = modes
        self._open_folder = open_folder or self._open_path

    def _open_path(self, write: bool) -> int:
        if write:
            fsutil.makedirs(self.folder, self._modes)
        return os.open(self.folder, fsutil.DIR_FLAGS)

    def add(self, deltas: Mapping[str, float]) -> None:
        """Add ``deltas`` to the counters; raises OSError if the folder is unwritable."""
        deltas = {name: value for name, value in deltas.items() if value}
        if not deltas:
            return
        index = os.getpid() % SHARDS
        fd = self._open_folder(True)
        try:
            with (
                flocked(_lock_name(index), self._modes, dir_fd=fd),
                self._with_legacy(index, fd) as counts,
            ):
                if _size(QUICK_COUNTS, fd) >= FOLD_BYTES:
                    for name, value in self._take_appended(fd, give_back=True).items():
                        counts[name] = counts.get(name, 0) + value
                for name, value in deltas.items():
                    counts[name] = counts.get(name, 0) + value
                self._write(index, counts, fd)
        finally:
            os.close(fd)

    def totals(self) -> Counts:
        """The sum of every shard (missing or unreadable shards, or folders, count as zero)."""
        try:
            fd = self._open_folder(False)
        except FileNotFoundError:
            return {}
        except OSError as e:
            log.debug("cannot read counters in %s: %s", self.folder, e)
            return {}
        total: Counts = {}
        try:
            # A shard before its legacy name: a writer renaming one into the other
            # meanwhile is missed once (read as less), never counted twice.
            names = [_shard_name(i) for i in range(SHARDS)] + [
                _legacy_name(i) for i in range(SHARDS)
            ]
            there = _listed(fd)  # (only those there opened: most folders hold few)
            shards = [self._read(name, fd) for name in names if name in there]
            for counts in [*shards, self._read_appended(QUICK_COUNTS, fd)]:
                for name, value in counts.items():
                    total[name] = total.get(name, 0) + value
        finally:
            os.close(fd)
        return total

    def reset(
        self, values: Mapping[str, float] | None = None, *, keep: tuple[str, ...] = ()
    ) -> None:
        """Set the counters to ``values`` (zero when None), except the names in ``keep``.

        Every shard's lock is taken before any is written: a lock that cannot be
        had (another user's file, a full disk) raises OSError with every count
        as it was, not half of them zeroed.  A concurrent ``add`` lands either
        before the reset or after it.
        """
        fd = self._open_folder(True)
        try:
            with contextlib.ExitStack() as held:
                there = _listed(fd)
                present = []
                for index in range(SHARDS):
                    if index and not {_shard_name(index), _legacy_name(index)} & there:
                        continue  # an add that creates it now lands after the reset: right
                    held.enter_context(flocked(_lock_name(index), self._modes, dir_fd=fd))
                    present.append(index)
                kept = [
                    {
                        n: v
                        for n, v in held.enter_context(self._with_legacy(i, fd, there)).items()
                        if n in keep
                    }
                    for i in present
                ]
                for n, v in self._take_appended(fd).items():
                    if n in keep:
                        kept[0][n] = kept[0].get(n, 0) + v
                if values:
                    kept[0].update((n, v) for n, v in values.items() if n not in keep)
                for index, counts in zip(present, kept, strict=True):
                    self._write(index, counts, fd)
        finally:
            os.close(fd)

    def _read(self, name: str, dir_fd: int) -> Counts:
        # A shard is written whole, then renamed into place: its size is all
        # there is, and a read allocates what it asks for.
        raw = self._read_bytes(name, dir_fd, 1)
        if raw is None:
            return {}
        try:
            data = _json.loads(raw)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            log.warning("ignoring the damaged counter file %s/%s", self.folder, name)
            return {}
        return {
            str(key): value
            for key, value in data.items()
            if isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and abs(value) < _MAX_COUNT
        }

    @contextlib.contextmanager
    def _with_legacy(
        self, index: int, dir_fd: int, there: set[str] | None = None
    ) -> Iterator[Counts]:
        """Shard ``index``'s counts, with its legacy ``NN.json`` (made before 2026-11-28,
        or by an older opcache sharing the folder) folded in, for the block to write
        back under the shard's lock.  ``totals`` reads a shard before its legacy
        name, and the legacy file is renamed (into the shard's name, or aside until
        the block is done), never copied: no reader sums it twice.  A block that
        fails (a full disk) gives it its name back; a writer killed in the block
        loses it, which ``verify`` recounts.  ``there``: the folder's names."""
        legacy, shard = _legacy_name(index), _shard_name(index)
        aside = None
        if (there is None or legacy in there) and _regular(legacy, dir_fd):
            try:
                if not fsutil.lexists(shard, dir_fd):  # (made only under this lock)
                    os.rename(legacy, shard, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                else:
                    aside = fsutil.unique_name(f".{legacy}")
                    os.rename(legacy, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError:
                aside = None
        counts = self._read(shard, dir_fd)
        if aside is not None:
            for name, value in self._read(aside, dir_fd).items():
                counts[name] = counts.get(name, 0) + value
        try:
            yield counts
        except BaseException:
            if aside is not None:
                with contextlib.suppress(OSError):
                    os.rename(aside, legacy, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            raise
        if aside is not None:
            with contextlib.suppress(OSError):
                os.unlink(aside, dir_fd=dir_fd)

    def _take_appended(self, dir_fd: int, give_back: bool = False) -> Counts:
        """The quick hits' appended counts, taken out of the folder (the caller keeps them).

        Renamed first, so new appends start a new file; then locked exclusively:
        an append that opened the old name before the rename holds a shared
        lock while it writes (and gives up if it finds the file locked or gone).
        ``give_back``: a file still locked after the wait is left for the next fold.
        """
        import fcntl
        import time

        taken = fsutil.unique_name(f".{QUICK_COUNTS}")
        try:
            os.rename(QUICK_COUNTS, taken, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except FileNotFoundError:
            return {}
        try:
            fd = os.open(taken, _READ_FLAGS, dir_fd=dir_fd)
        except OSError:
            fd = None
        if fd is not None and not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)  # (a folder planted in its place: set aside as it is, not read)
            return {}
        try:
            for _ in range(1000):  # an append holds it for a write: never a second
                try:
                    if fd is not None:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.001)
            else:
                # A quick hit stopped in its write (^Z, swapped out): its line would be
                # lost once the file is read and unlinked.
                if give_back:
                    try:
                        os.link(taken, QUICK_COUNTS, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                        return {}
                    except OSError:
                        pass  # (appends began anew meanwhile: read it now after all)
            return self._read_appended(taken, dir_fd)
        finally:
            if fd is not None:
                os.unlink(taken, dir_fd=dir_fd)
                os.close(fd)

    def _read_appended(self, name: str, dir_fd: int) -> Counts:
        """The sum of the lines ``name=value ...`` a quick hit appends."""
        raw = self._read_bytes(name, dir_fd, 0)
        if raw is None:
            return {}
        total: Counts = {}
        for line in raw.split(b"\n")[:-1]:  # (a last line without its end: not written yet)
            for word in line.split():
                key, _, value = word.partition(b"=")
                try:
                    number = float(value)
                except ValueError:
                    continue
                if math.isfinite(number) and 0 <= number < _MAX_COUNT:
                    total[key.decode(errors="replace")] = (
                        total.get(key.decode(errors="replace"), 0) + number
                    )
        return total

    def _read_bytes(self, name: str, dir_fd: int, beyond: int) -> bytes | None:
        """A counter file's bytes (asking for its size and ``beyond`` more), or
        None where it is missing, a link, not a regular file or unreadable."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                log.warning("ignoring the counter file %s/%s: it is a link", self.folder, name)
            else:
                log.debug("cannot read counters %s/%s: %s", self.folder, name, e)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                log.warning(
                    "ignoring the counter file %s/%s: not a regular file", self.folder, name
                )
                return None
            return os.read(fd, min(st.st_size + beyond, _MAX_SHARD))
        except OSError as e:
            log.debug("cannot read counters %s/%s: %s", self.folder, name, e)
            return None
        finally:
            os.close(fd)

    def _write(self, index: int, counts: Counts, dir_fd: int) -> None:
        data = json.dumps(counts, sort_keys=True, separators=(",", ":")).encode()
        name = _shard_name(index)
        try:
            fsutil.write_atomic(name, data, self._modes, dir_fd=dir_fd)
        except OSError as e:
            # A full disk has no block for the new copy, but the shard has its
            # own: rewritten in place (under its lock), a count made on a full
            # disk is kept, not lost.  Only then: a writer killed mid-write, or
            # a reader meeting it, could see a torn file (read as zero, warned).
            if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not _overwrite(name, data, dir_fd):
                raise


def _size(name: str, dir_fd: int) -> int:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
    except OSError:
        return 0


def _shard_name(index: int) -> str:
    return f"{index:02d}.count"


def _legacy_name(index: int) -> str:
    return f"{index:02d}.json"


def _regular(name: str, dir_fd: int) -> bool:
    """Whether ``name`` is a regular file (a link or a folder planted there: left as it is)."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _listed(dir_fd: int) -> set[str]:
    """The names in the folder open as ``dir_fd``; every shard's names when it
    cannot be listed (each then looked for)."""
    try:
        return set(os.listdir(dir_fd))
    except OSError:
        return {f(i) for i in range(SHARDS) for f in (_shard_name, _legacy_name)}


def _lock_name(index: int) -> str:
    return f"{index:02d}.lock"


def _overwrite(name: str, data: bytes, dir_fd: int) -> bool:
    """Write ``data`` over the shard ``name`` in the blocks it has; False if they are
    too few, or the shard is not a regular file with no other name."""
    try:
        fd = os.open(
            name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        # A hard link another member of a shared cache made to a file elsewhere
        # would be written through: a replace (what a disk with room does) only
        # ever drops the name.
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or len(data) > st.st_blocks * 512:
            return False
        # Spaces after the JSON (which its parser skips) cover a longer old text.
        os.pwrite(fd, data.ljust(st.st_size), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
