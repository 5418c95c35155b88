"""Hit, miss, store, bypass... counters, kept per chip and summed on demand.

A process counts in memory and adds its counts to the on-disk counter files
(``counters.CounterFiles``) from a background thread every few seconds, at
``close()`` and at exit, so a hit costs no file write.
"""

from __future__ import annotations

import _thread  # threading's primitives: threading loads only with the writer thread
import atexit
import os
import sys
from collections.abc import Callable

from ._log import get_logger
from .counters import CounterFiles
from .errors import sentence

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    import threading
    from typing import Any

log = get_logger(__name__)

ACTIVITY = (
    "hits",
    "misses",
    # Misses of a key compiled and given to the cache (explain.py): a new key
    # for an operator with an entry stored, and an operator never seen.
    "misses_new_key",
    "misses_never_seen",
    "stores",
    "bypasses",
    "uncacheable",
    "corrupt",
    # Entries not served, local or remote: a file their compile read beyond the key
    # changed since (storage/entry.py's "reads").
    "stale",
    "evicted_entries",
    "evicted_bytes",
    "errors",
    "time_saved_seconds",
    # The remote tier (remote_tier.py): asked after a local miss.
    "remote_hits",
    "remote_misses",
    "remote_stores",
    "remote_errors",
    "remote_corrupt",
    "remote_bytes_down",
    "remote_bytes_up",
)
MISSES_NEW_KEY = "misses_new_key"
MISSES_NEVER_SEEN = "misses_never_seen"
STALE_READS = "stale"
BYPASS_PREFIX = "bypass:"
UNCACHEABLE_PREFIX = "uncacheable:"
REMOTE_ERROR_PREFIX = "remote_error:"  # + the URL that failed (its password masked)
FLUSH_SECONDS = 2.0


class StatsRecorder:
    """A process's not-yet-written counts, per chip.

    ``files(soc)`` gives the chip's on-disk counters (``counters.CounterFiles``).
    A background thread writes them every ``flush_seconds``; with None, only
    ``close()`` and the exit hooks do (a process that compiles once and leaves
    need not start a thread).
    """

    def __init__(
        self,
        files: Callable[[str], CounterFiles],
        *,
        flush_seconds: float | None = FLUSH_SECONDS,
    ) -> None:
        self.files = files
        self._flush_seconds = flush_seconds
        self._pending: dict[str, dict[str, float]] = {}
        self._lock = _thread.allocate_lock()
        self._wake: threading.Event | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._registered = False
        self._failed: OSError | None = None  # why the last write failed
        # Told of counts given up at close (the owner's one warning about its cache).
        self.on_lost: Callable[[str], None] = log.warning

    def add(self, soc: str, name: str, amount: float = 1) -> None:
        """Count ``amount`` of ``name`` for a chip (in memory; written soon)."""
        self.add_counts(soc, {name: amount})

    def add_counts(self, soc: str, counts: dict[str, float]) -> None:
        """Count each of ``counts`` for a chip, under one lock (a remote look's several)."""
        with self._lock:
            chip = self._pending.setdefault(soc, {})
            for name, amount in counts.items():
                chip[name] = chip.get(name, 0) + amount
            if self._thread is None:
                self._start()

    def _start(self) -> None:
        # (the lock held) Registered for the exit hooks; the writer thread, if any.
        if not self._registered:
            self._registered = True
            _register(self)
        if not self._closed and self._flush_seconds is not None:
            import threading

            self._wake = threading.Event()
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
                self._failed = e
                with self._lock:
                    chip = self._pending.setdefault(soc, {})
                    for name, value in counts.items():
                        chip[name] = chip.get(name, 0) + value

    def _run(self) -> None:
        assert self._wake is not None
        while not self._closed:
            self._wake.wait(self._flush_seconds)
            if self._pending:
                self.flush()

    def close(self) -> None:
        """Write what is pending and stop the background writer."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None and self._wake is not None:
            self._wake.set()
            if thread.ident != _thread.get_ident():
                thread.join(timeout=10)
        if _deferred is not None:
            _deferred.append(self)  # (written by write_deferred)
            return
        self._write_and_forget()

    def _write_and_forget(self) -> None:
        self.flush()
        with self._lock:
            lost, self._pending = self._pending, {}  # counts that could not be written
        if lost:
            why = sentence(self._failed) if self._failed else "unknown error"
            chips = ", ".join(sorted(lost))
            said = f"cannot write the counts of {chips} ({why})"
            self.on_lost(f"{said}: opcache stats will not show them")
        with _hooks:
            _recorders.discard(self)

    def _forget_after_fork(self) -> None:
        # The parent writes its own counts; a forked child must not write them
        # again, and its copy of the writer thread does not exist.
        self._pending = {}
        self._thread = None
        self._lock = _thread.allocate_lock()


# Recorders closed while writes are deferred, to write (opcache server's workers).
_deferred: list[StatsRecorder] | None = None


def defer_writes() -> None:
    """From now on, what a recorder has at ``close()`` is written by ``write_deferred()``.

    For ``opcache server``'s workers: the client has its reply before the
    counts of its hit are written, a moment later.
    """
    global _deferred
    if _deferred is None:
        _deferred = []


def write_deferred() -> None:
    """Write the counts of the recorders closed since the last call."""
    while _deferred:
        _deferred.pop()._write_and_forget()


# Every recorder of this process that counted and is not closed, flushed at exit
# by hooks installed once.  Held strongly: an OpCache dropped without close()
# still has its counts written at exit.
_recorders: set[StatsRecorder] = set()
_hooks = _thread.allocate_lock()
_installed = False


def _register(recorder: StatsRecorder) -> None:
    global _installed
    with _hooks:
        _recorders.add(recorder)
        if _installed:
            return
        _installed = True
        atexit.register(_close_all)
        os.register_at_fork(after_in_child=_after_fork_in_child)
        # multiprocessing's children leave through os._exit, skipping atexit;
        # they run their Finalize callbacks first.  (A process that never
        # imported multiprocessing is no such child, and need not pay for it.)
        if "multiprocessing" in sys.modules:
            import multiprocessing.util as mp_util

            mp_util.Finalize(None, _close_all, exitpriority=0)
            # A forked child's registry is cleared at its start: register again there.
            mp_util.register_after_fork(_recorders, _finalize_in_child)


def _close_all(*_: object) -> None:
    for recorder in list(_recorders):
        recorder.close()


def _after_fork_in_child() -> None:
    for recorder in list(_recorders):
        recorder._forget_after_fork()


def _finalize_in_child(_: object) -> None:
    import multiprocessing.util as mp_util

    mp_util.Finalize(None, _close_all, exitpriority=0)


def chip_report(activity: dict[str, float], entries: int, size: int) -> dict[str, Any]:
    """The stats of one chip as ``opcache stats --json`` shows them."""
    report: dict[str, Any] = {"entries": entries, "bytes": size}
    for name in ACTIVITY:
        report[name] = activity.get(name, 0)
    report["bypasses"] = sum(v for n, v in activity.items() if n.startswith(BYPASS_PREFIX))
    report["bypass_reasons"] = _by_prefix(activity, BYPASS_PREFIX)
    report["uncacheable"] = sum(v for n, v in activity.items() if n.startswith(UNCACHEABLE_PREFIX))
    report["uncacheable_reasons"] = _by_prefix(activity, UNCACHEABLE_PREFIX)
    report["remote_errors_by_url"] = _by_prefix(activity, REMOTE_ERROR_PREFIX)
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
