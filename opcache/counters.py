"""Counters on disk that many processes update without a global lock.

A counter folder holds ``SHARDS`` small JSON files; a process adds its deltas to
the shard of its pid under that shard's lock, so writers rarely meet, and a
reader sums the shards.  Each shard is replaced by rename, so a writer killed
mid-update leaves the old values, never a torn file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path

from . import fsutil
from ._log import get_logger
from .locks import flocked

log = get_logger(__name__)

SHARDS = 16
Counts = dict[str, float]


class CounterFiles:
    """The sharded counter files in ``folder`` (created on the first write)."""

    def __init__(self, folder: Path, *, modes: fsutil.Modes = fsutil.PRIVATE) -> None:
        self.folder = folder
        self._modes = modes

    def _shard(self, index: int) -> Path:
        return self.folder / f"{index:02d}.json"

    def _lock(self, index: int) -> AbstractContextManager[None]:
        return flocked(self.folder / f"{index:02d}.lock", self._modes)

    def add(self, deltas: Mapping[str, float]) -> None:
        """Add ``deltas`` to the counters; raises OSError if the folder is unwritable."""
        deltas = {name: value for name, value in deltas.items() if value}
        if not deltas:
            return
        index = os.getpid() % SHARDS
        if not os.path.isdir(self.folder):
            fsutil.makedirs(self.folder, self._modes)
        with self._lock(index):
            counts = _read(self._shard(index))
            for name, value in deltas.items():
                counts[name] = counts.get(name, 0) + value
            self._write(index, counts)

    def totals(self) -> Counts:
        """The sum of every shard (missing or unreadable shards count as zero)."""
        total: Counts = {}
        for index in range(SHARDS):
            for name, value in _read(self._shard(index)).items():
                total[name] = total.get(name, 0) + value
        return total

    def reset(
        self, values: Mapping[str, float] | None = None, *, keep: tuple[str, ...] = ()
    ) -> None:
        """Set the counters to ``values`` (zero when None), except the names in ``keep``.

        The shards are locked one after another, so a concurrent ``add`` lands
        either before its shard is reset or after, never half.
        """
        fsutil.makedirs(self.folder, self._modes)
        for index in range(SHARDS):
            path = self._shard(index)
            if index and not path.exists():
                continue  # an add that creates it now lands after the reset: right
            with self._lock(index):
                kept = {name: v for name, v in _read(path).items() if name in keep}
                if index == 0 and values:
                    kept.update((n, v) for n, v in values.items() if n not in keep)
                self._write(index, kept)

    def _write(self, index: int, counts: Counts) -> None:
        data = json.dumps(counts, sort_keys=True, separators=(",", ":")).encode()
        fsutil.write_atomic(self._shard(index), data, self._modes)


def _read(path: Path) -> Counts:
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.debug("cannot read counters %s: %s", path, e)
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        log.warning("ignoring the damaged counter file %s", path)
        return {}
    return {
        str(name): value
        for name, value in data.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }
