"""Aging: CANN's rule for trimming a chip folder that outgrew its limit.

When a chip folder's used bytes reach ``max``, whole entries are deleted in
ascending order of last access until ``used - max * ratio / 100`` bytes are
gone, never one used in the last 30 minutes.  One process trims a folder at a
time (the others skip, they do not wait), and compiling never waits for it.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable

import xxhash

from ._log import get_logger
from .settings import AGE_SECONDS
from .storage.cann_names import is_cann_chip, is_cann_index
from .storage.local import LocalStore

log = get_logger(__name__)

# Access stamps are written at most once a minute, so a stamp may be up to a
# minute older than the last access: keep that much more to never delete an
# entry used within AGE_SECONDS.
STAMP_GRANULARITY = 60
MIN_IDLE_SECONDS = AGE_SECONDS + STAMP_GRANULARITY
# The oldest entries a trim holds at once, each packed into one integer (stamp
# in microseconds, key, bytes: about 70 bytes, 35 MB in all); a trim of more
# walks the chip folder again for the next oldest.  Sorting the whole walk
# held every entry as objects (230 MB at a million); this keeps the memory
# flat in the entry count, and a trim of half a million entries (half of a
# million-entry folder, at the default ratio of 50) walks once.
CANDIDATES = 500_000
# A chip whose entries are named by CANN's kernels (a shared folder's, pushed by
# ``opcache cann push``): its names packed as their 128-bit hash, and the names
# of a batch found by a second walk, held with it (about 200 bytes an entry).
NAMED_CANDIDATES = 100_000
_KEY_BITS = 128
_SIZE_BITS = 64


class ChipAging:
    """What one aging pass over one chip folder did (or would do, on a dry run)."""

    def __init__(self, soc: str, used_bytes: int, entries: int) -> None:
        self.soc = soc
        self.bytes_before = used_bytes
        self.bytes_after = used_bytes
        self.entries_before = entries
        self.removed_entries = 0
        self.freed_bytes = 0
        self.skipped: str | None = None  # why no pass ran although the folder is over its limit
        self.errors = 0  # entries that could not be removed (the pass went on without them)
        # The stamp of the oldest entry kept for being young: nothing can age before
        # it is MIN_IDLE_SECONDS old, so no walk is worth doing before then.
        self.oldest_kept: float | None = None

    def as_dict(self) -> dict[str, object]:
        return dict(vars(self))


def age_chip(
    store: LocalStore,
    soc: str,
    *,
    max_bytes: int | None,
    ratio: int,
    now: float,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
    on_evict: Callable[[int], None] | None = None,
) -> ChipAging:
    """One aging pass over one chip folder; cheap (no walk) when under the limit."""
    entries, used = store.used(soc)
    report = ChipAging(soc, used, entries)
    if max_bytes is None or used < max_bytes:
        return report
    with contextlib.ExitStack() as held:
        # Through a handle on the locks folder, never through a link at the lock
        # file's name (which filelock before 3.20.1 followed, truncating and
        # chmodding its target: CVE-2025-68146).
        try:
            held.enter_context(store.locked(f"{soc}.cleanup", timeout=0))
        except BlockingIOError:
            report.skipped = "another process is trimming this chip folder"
            return report
        _trim(store, soc, used - max_bytes * ratio // 100, now, dry_run, report, progress, on_evict)
    report.bytes_after = used - report.freed_bytes
    return report


def _trim(
    store: LocalStore,
    soc: str,
    to_free: int,
    now: float,
    dry_run: bool,
    report: ChipAging,
    progress: Callable[[int], None] | None,
    on_evict: Callable[[int], None] | None,
) -> None:
    removing = contextlib.nullcontext(None) if dry_run else store.discarding(soc, later=True)
    with removing as remove:
        after: int | None = None
        while True:
            walk = _Walk(store, soc, now, after, dry_run)
            batch = walk.oldest(progress)
            names = walk.names(batch)
            for packed in batch:
                if report.freed_bytes >= to_free:
                    return
                stamp, number, size = _unpack(packed)
                key = names.get(number) if names is not None else f"{number:032x}"
                if key is None:  # (renamed or removed since the first walk)
                    continue
                # A hit since the walk moves the stamp: that entry is in use again.
                # (An entry with no manifest has stamp 0.0 and goes first.)
                if _micros(store.stamp(soc, key) or 0.0) != stamp:
                    continue
                if remove is not None:
                    try:
                        size = remove(key)
                    except OSError as e:
                        log.warning("cannot remove %s/%s while aging: %s", soc, key, e)
                        report.errors += 1
                        continue
                    if size is None:
                        continue
                    if on_evict:
                        on_evict(size)
                log.debug("aged out %s/%s (%d bytes)", soc, key, size)
                report.removed_entries += 1
                report.freed_bytes += size
            if len(batch) < walk.most:
                if report.freed_bytes < to_free:
                    report.oldest_kept = walk.oldest_young  # the rest are too young
                return
            after = batch[-1] >> _SIZE_BITS


class _Walk:
    """One walk of a chip folder for the oldest entries old enough to age."""

    def __init__(
        self, store: LocalStore, soc: str, now: float, after: int | None, sizes: bool
    ) -> None:
        self.store, self.soc, self.now, self.after, self.sizes = store, soc, now, after, sizes
        # Entries named by CANN's kernels, not by keys.
        self.named = is_cann_chip(soc)
        self.most = NAMED_CANDIDATES if self.named else CANDIDATES
        # The stamp of the oldest entry too young to age, once walked.
        self.oldest_young: float | None = None

    def oldest(self, progress: Callable[[int], None] | None) -> list[int]:
        """The ``most`` oldest entries old enough to age (packed, oldest first) and,
        if an earlier walk's batch ended at ``after``, past it in (stamp, key) order.

        A part of CANN's index in a named chip never ages: a push writes it
        again only when its rows change, so the least recently written is often
        one every pull still reads.
        """
        newest_first: list[int] = []  # negated: the newest candidate on top of the heap
        for info in self.store.scan(self.soc, progress, sizes=self.sizes):
            if self.named and is_cann_index(info.key):
                continue
            if self.now - info.stamp < MIN_IDLE_SECONDS:
                if self.oldest_young is None or info.stamp < self.oldest_young:
                    self.oldest_young = info.stamp
                continue
            packed = _pack(info.stamp, self._number(info.key), info.size)
            if self.after is not None and packed >> _SIZE_BITS <= self.after:
                continue
            if len(newest_first) < self.most:
                heapq.heappush(newest_first, -packed)
            elif -packed > newest_first[0]:
                heapq.heapreplace(newest_first, -packed)
        newest_first.sort(reverse=True)  # oldest first, still negated
        for i, packed in enumerate(newest_first):  # in place: never two lists at once
            newest_first[i] = -packed
        return newest_first

    def names(self, batch: list[int]) -> dict[int, str] | None:
        """In a named chip, the names of the batch's entries by their number (one more
        walk); None where the number is the key."""
        if not self.named or not batch:
            return None
        wanted = {(packed >> _SIZE_BITS) & _KEY_MASK for packed in batch}
        names = {}
        for info in self.store.scan(self.soc):
            number = self._number(info.key)
            if number in wanted:
                names[number] = info.key
        return names

    def _number(self, key: str) -> int:
        if self.named:
            return xxhash.xxh3_128_intdigest(key.encode("utf-8", "surrogateescape"))
        return int(key, 16)


def _micros(stamp: float) -> int:
    return round(stamp * 1_000_000)


_KEY_MASK = (1 << _KEY_BITS) - 1


def _pack(stamp: float, number: int, size: int) -> int:
    """An entry as one integer that orders as (stamp, key): far smaller than a tuple."""
    return (((_micros(stamp) << _KEY_BITS) | number) << _SIZE_BITS) | size


def _unpack(packed: int) -> tuple[int, int, int]:
    """(stamp in microseconds, the key's number, bytes) of a packed entry."""
    number = (packed >> _SIZE_BITS) & _KEY_MASK
    return packed >> (_KEY_BITS + _SIZE_BITS), number, packed & ((1 << _SIZE_BITS) - 1)
