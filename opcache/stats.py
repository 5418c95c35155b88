"""Hit, miss, store, bypass... counters, kept per chip and summed on demand.

A process counts in memory and adds its counts to the on-disk counter files
(``counters.CounterFiles``) from a background thread every few seconds, at
``close()`` and at exit, so a hit costs no file write.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

from . import fsutil
from .counters import CounterFiles

log = logging.getLogger(__name__)

ACTIVITY = (
    "hits",
    "misses",
    "stores",
    "bypasses",
    "uncacheable",
    "corrupt",
    "evicted_entries",
    "evicted_bytes",
    "errors",
    "time_saved_seconds",
)
BYPASS_PREFIX = "bypass:"
UNCACHEABLE_PREFIX = "uncacheable:"
FLUSH_SECONDS = 2.0


class StatsRecorder:
    """A process's not-yet-written counts, per chip."""

    def __init__(
        self, stats_dir: Path, *, modes: fsutil.Modes, flush_seconds: float = FLUSH_SECONDS
    ) -> None:
        self._dir = stats_dir
        self._modes = modes
        self._flush_seconds = flush_seconds
        self._pending: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        ref = weakref.ref(self)
        _flush_on_exit(ref)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))

    def files(self, soc: str) -> CounterFiles:
        return CounterFiles(self._dir / soc, modes=self._modes)

    def add(self, soc: str, name: str, amount: float = 1) -> None:
        """Count ``amount`` of ``name`` for a chip (in memory; written soon)."""
        with self._lock:
            chip = self._pending.setdefault(soc, {})
            chip[name] = chip.get(name, 0) + amount
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="opcache-stats", daemon=True)
                self._thread.start()

    def flush(self) -> None:
        """Write the pending counts now; on failure they are kept for the next try."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for soc, counts in pending.items():
            try:
                self.files(soc).add(counts)
            except OSError as e:
                log.debug("cannot write stats for %s: %s", soc, e)
                with self._lock:
                    chip = self._pending.setdefault(soc, {})
                    for name, value in counts.items():
                        chip[name] = chip.get(name, 0) + value

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._flush_seconds)
            if self._pending:
                self.flush()

    def close(self) -> None:
        """Write what is pending and stop the background writer."""
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        self.flush()
        with self._lock:
            self._pending.clear()  # counts that could not be written are given up


def _flush_on_exit(ref: weakref.ref[StatsRecorder]) -> None:
    atexit.register(_flush_at_exit, ref)
    # multiprocessing's children leave through os._exit, skipping atexit; they
    # run their Finalize callbacks first.  (A process that never imported
    # multiprocessing is no such child, and need not pay for the import.)
    if "multiprocessing" in sys.modules:
        import multiprocessing.util

        multiprocessing.util.Finalize(None, _flush_at_exit, args=(ref,), exitpriority=0)


def _flush_at_exit(ref: weakref.ref[StatsRecorder]) -> None:
    recorder = ref()
    if recorder is not None and not recorder._closed:
        recorder.close()


def _forget_in_child(ref: weakref.ref[StatsRecorder]) -> None:
    # The parent writes its own counts; a forked child must not write them again,
    # and its copy of the writer thread does not exist.
    recorder = ref()
    if recorder is not None:
        recorder._pending = {}
        recorder._thread = None
        recorder._lock = threading.Lock()
        _flush_on_exit(ref)  # a multiprocessing child starts with no Finalize callbacks


def chip_report(activity: dict[str, float], entries: int, size: int) -> dict[str, Any]:
    """The stats of one chip as ``opcache stats --json`` shows them."""
    report: dict[str, Any] = {"entries": entries, "bytes": size}
    for name in ACTIVITY:
        report[name] = activity.get(name, 0)
    report["bypasses"] = sum(v for n, v in activity.items() if n.startswith(BYPASS_PREFIX))
    report["bypass_reasons"] = _by_prefix(activity, BYPASS_PREFIX)
    report["uncacheable"] = sum(v for n, v in activity.items() if n.startswith(UNCACHEABLE_PREFIX))
    report["uncacheable_reasons"] = _by_prefix(activity, UNCACHEABLE_PREFIX)
    for name, value in report.items():
        if isinstance(value, float) and name != "time_saved_seconds" and value.is_integer():
            report[name] = int(value)
    return report


def _by_prefix(activity: dict[str, float], prefix: str) -> dict[str, int]:
    return {n[len(prefix) :]: int(v) for n, v in sorted(activity.items()) if n.startswith(prefix)}


def total_report(chips: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Chip reports summed, with the chips themselves under ``chips``."""
    total: dict[str, Any] = chip_report({}, 0, 0)
    for chip in chips.values():
        for name, value in chip.items():
            if isinstance(value, dict):
                for reason, count in value.items():
                    total[name][reason] = total[name].get(reason, 0) + count
            else:
                total[name] += value
    total["chips"] = chips
    return total
