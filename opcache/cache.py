"""OpCache: the operator compile cache that compile tools call in-process.

This is where CANN's rules meet the store: modes (enable / force / disable),
debug bypasses, single-flight compiles, access stamps and aging, stats, and
the promise that the cache never fails a compile.  ``OpCache`` is the public
face: ``compile`` and ``compile_many`` (``shared_work.py``) order the steps of
one key (``flow.py``), over a chip folder's life (``chips.py``) and the remote
tier (``remote_tier.py``); the maintenance calls (age, verify, clear, stats)
are here.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Sequence

from . import fsutil, stats, trust
from ._log import get_logger

# (BUILD_SESSION and BUILD_GAP_SECONDS: where wrap and the tests import them)
from .chips import BUILD_GAP_SECONDS as BUILD_GAP_SECONDS
from .chips import BUILD_SESSION as BUILD_SESSION
from .chips import ChipFolders, Progress
from .errors import sentence
from .flow import UNUSABLE, CacheErrors, KeyFlow, out_path
from .key import compute_key
from .request import CompileResult, OpRequest, check_soc_version
from .storage.entry import CorruptEntry
from .storage.local import LocalStore

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from typing import Any

    from .aging import ChipAging
    from .compilers.protocol import Compiler
    from .explain import Explanation
    from .settings import Settings
    from .shared_work import OutDirs

log = get_logger(__name__)

LOCK_TIMEOUT_SECONDS = 600.0


class AgingReport:
    """One aging pass: what each chip folder lost, and the totals."""

    def __init__(self) -> None:
        self.chips: dict[str, ChipAging] = {}
        self.leftovers_removed = 0

    @property
    def removed_entries(self) -> int:
        return sum(c.removed_entries for c in self.chips.values())

    @property
    def freed_bytes(self) -> int:
        return sum(c.freed_bytes for c in self.chips.values())

    @property
    def errors(self) -> int:
        return sum(c.errors for c in self.chips.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "removed_entries": self.removed_entries,
            "freed_bytes": self.freed_bytes,
            "errors": self.errors,
            "leftovers_removed": self.leftovers_removed,
            "chips": {soc: chip.as_dict() for soc, chip in self.chips.items()},
        }


class ChipVerify:
    """What a full check found in one chip folder."""

    def __init__(self, counted_entries: int = 0, counted_bytes: int = 0) -> None:
        self.checked = 0
        self.corrupt = 0  # removed
        self.errors = 0  # entries that could not be read or removed
        self.unread = 0  # buckets that could not be read: their entries not checked
        self.unsized = 0  # entries whose bytes could not be read: the counters kept
        self.unwritten = ""  # why the counters could not be set to what was found
        self.entries = 0  # after the check
        self.bytes = 0
        self.counted_entries = counted_entries  # what the counters said before
        self.counted_bytes = counted_bytes

    def as_dict(self) -> dict[str, int | str]:
        return dict(vars(self))


class VerifyReport:
    """A full check: entries read and verified, corrupt ones removed, sizes recounted."""

    def __init__(self) -> None:
        self.chips: dict[str, ChipVerify] = {}
        self.leftovers_removed = 0

    @property
    def corrupt(self) -> int:
        return sum(c.corrupt for c in self.chips.values())

    @property
    def errors(self) -> int:
        """Entries that could not be checked or removed, folders not read, and
        counters that could not be set."""
        return sum(c.errors + c.unread + bool(c.unwritten) for c in self.chips.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "corrupt": self.corrupt,
            "errors": self.errors,
            "leftovers_removed": self.leftovers_removed,
            "chips": {soc: chip.as_dict() for soc, chip in self.chips.items()},
        }


class OpCache:
    """A compile cache over the folder ``settings`` names.

    ``clock`` (seconds since the epoch) stamps every access and decides every
    aging question.  ``lock_timeout`` bounds how long a process waits for
    another one compiling the same operator before compiling it itself.
    Stats are counted in memory and written every ``stats_seconds`` by a
    background thread, or with None only at ``close()`` and exit (for a short
    process, as ``opcache wrap``).  Usable as a context manager.

    In ``force`` mode each chip is cleared once per compile session, at its
    first touch, and the cache then behaves as ``enable``.  The session is
    this OpCache, unless one is named: ``session`` (else ``settings.session``,
    from ``OPCACHE_SESSION``).  OpCaches in any process that name the same
    session clear each chip once between them: the first to touch it clears
    it, the others use what the first stored.  ``opcache wrap``, which runs
    once per compile command, names ``BUILD_SESSION``: a build is then a run
    of force compiles with no pause longer than ``BUILD_GAP_SECONDS``.

    What compiles need is made ready here, so that no compile waits for it:
    a remote tier, if set, is opened (its client library imported, its client
    made), and the modules of a miss and of ``compile_many`` are imported
    (where bytecode is not written, as ``PYTHONDONTWRITEBYTECODE`` has it in
    many containers, an import compiles its module: 10-15 ms each, in every
    rank).  ``eager=False`` leaves each to its first use, for a process that
    most likely ends on a local hit (``opcache wrap``).  So does
    ``upkeep_at_miss=True`` with a chip folder's upkeep (leftovers of dead
    writers removed, an aging pass), which otherwise runs at the chip's first
    touch.  (``open_remote=``, this parameter's earlier name, is still taken,
    with a DeprecationWarning.)
    """

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        lock_timeout: float = LOCK_TIMEOUT_SECONDS,
        stats_seconds: float | None = stats.FLUSH_SECONDS,
        session: str | None = None,
        eager: bool = True,
        upkeep_at_miss: bool = False,
        open_remote: bool | None = None,
    ) -> None:
        if open_remote is not None:  # (its name before eager: callers of it still run)
            import warnings

            warnings.warn(
                "OpCache(open_remote=...) is now OpCache(eager=...)",
                DeprecationWarning,
                stacklevel=2,
            )
            eager = open_remote
        self.settings = settings
        self._clock = clock
        self._store = LocalStore(settings.root, modes=fsutil.modes_for(settings.shared_group))
        self._stats = stats.StatsRecorder(self._store.stats_files, flush_seconds=stats_seconds)
        errors = CacheErrors(self._stats, self._store.root)
        # (an unwritable cache fails the stats with the rest: one warning for all)
        self._stats.on_lost = lambda message: errors.warn_once("cache", message)
        self._folders = ChipFolders(
            settings,
            self._store,
            self._stats,
            session=session if session is not None else settings.session,
            clock=clock,
            on_error=errors.report,
            upkeep_at_miss=upkeep_at_miss,
        )
        self._flow = KeyFlow(
            settings,
            self._store,
            self._stats,
            self._folders,
            errors,
            lock_timeout=lock_timeout,
            clock=clock,
        )
        if eager:
            # A miss's note, a batch's threads, the deleter of a chip's upkeep.
            from . import explain, shared_work, trash  # noqa: F401

            if self._flow.remote is not None:
                self._flow.remote.open()

    # -- compiling -----------------------------------------------------------

    def compile(
        self, request: OpRequest, compiler: Compiler, out_dir: str | os.PathLike[str]
    ) -> CompileResult:
        """Compile ``request`` (or reuse a cached compile) into ``out_dir``.

        Raises CompileError when the compiler fails; nothing is stored then.  A
        cache that cannot be read or written never fails the call: the compile
        runs, a warning is logged once, and stats count the error.
        """
        started = time.perf_counter()
        out = out_path(out_dir)
        flow = self._flow
        plain = flow.bypass(request)
        if plain is not None:
            return flow.plain(request, compiler, out, started, *plain)
        soc = request.soc_version
        with flow.one_error(soc):
            key, inputs = compute_key(request, compiler.name, flow.fingerprint(compiler))
            if not flow.chip_ready(soc):
                return flow.plain(request, compiler, out, started, "miss", UNUSABLE, key)
            entry = flow.look(soc, key)
            if entry is not None:
                return flow.hit(entry, soc, out, started, "local")
            self._folders.upkeep(soc)
            if flow.remote is not None:
                found = flow.remote.look(soc, key)
                if found is not None:
                    return flow.hit(found[0], soc, out, started, found[1])
            filled = flow.fill(flow.acquire(soc, key), request, compiler, key, inputs, out)
            if filled.entry is not None:
                return flow.hit(filled.entry, soc, out, started, filled.tier)
            return flow.missed(filled, soc, key, started)

    def compile_many(
        self,
        requests: Sequence[OpRequest],
        compiler: Compiler,
        out_dirs: OutDirs,
        *,
        jobs: int | None = None,
        on_result: Callable[[int, CompileResult], None] | None = None,
    ) -> list[CompileResult]:
        """Compile many operators, sharing the work with every process that needs them.

        ``out_dirs`` is a sequence of output folders, one per request, or a
        function from a request to its folder.  Every hit is delivered at
        once; missing keys no other process is compiling are claimed and
        compiled here, ``jobs`` at a time (default: the cores this process may
        use), in an order of this process's own; then the keys others were
        compiling are collected as they finish, and any whose compile failed
        or whose process died is compiled here.  So ranks that start on the
        same operators together compile each of them once, in parallel.

        Returns one result per request, in the order of ``requests``.  A
        failed compile does not stop the others: its result has status
        ``"error"`` and the exception (usually a ``CompileError``) in
        ``error``.  Requests that share a key are compiled once.  Modes,
        bypasses, stats and the promise that the cache never fails a compile
        hold as for ``compile``.  Thread-safe, as ``compile`` is.  ``on_result(index,
        result)`` is called as each request is done (from the thread that did it),
        for progress.
        """
        from .shared_work import compile_many  # threads: not on `opcache wrap`'s start-up

        return compile_many(self._flow, requests, compiler, out_dirs, jobs, on_result)

    def explain(
        self, request: OpRequest, compiler: Compiler, *, reads_changed: Sequence[str] = ()
    ) -> Explanation:
        """Why ``request`` would miss: its key's parts and those that differ from the
        nearest stored entry of its operator and chip (``explain.Explanation``);
        ``reads_changed``, files its last compile read that changed, are named too."""
        from . import explain

        return explain.explain(self._store, request, compiler, reads_changed=reads_changed)

    # -- maintenance ----------------------------------------------------------

    def _chips(self, soc_version: str | None) -> list[str]:
        if soc_version is None:
            return self._store.chips()
        path = self._store.chip_dir(check_soc_version(soc_version))
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return [soc_version]  # no folder, but maybe its stats: nothing to act on
        # Maintenance renames, empties or recounts it: only a chip folder of ours.
        if not stat.S_ISDIR(st.st_mode):
            problem: str | None = "a link or a file, not a folder"
        else:
            problem = trust.problem(st, self._store.modes)
        if problem:
            raise trust.UntrustedFolder(f"{path} is not a chip folder ({problem}): left alone")
        return [soc_version]

    def age(
        self,
        soc_version: str | None = None,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
    ) -> AgingReport:
        """One aging pass per chip folder (or one chip); also drops leftovers of dead writers."""
        report = AgingReport()
        for soc in self._chips(soc_version):
            report.chips[soc] = self._folders.age(soc, dry_run=dry_run, progress=progress)
        if not dry_run:
            report.leftovers_removed = self._store.clean_leftovers(self._clock())
        return report

    def verify(
        self, soc_version: str | None = None, *, progress: Progress | None = None
    ) -> VerifyReport:
        """Read and check every entry, remove corrupt ones and leftovers, recount sizes.

        One walk per chip.  An entry that cannot be read or removed is counted
        in ``errors`` and the walk goes on.
        """
        report = VerifyReport()
        for soc in self._chips(soc_version):
            # The counters are read under the lock that holds off stores and
            # removals: read before it, a store in between looked like a wrong count.
            with self._store.counting_paused(soc):
                chip = ChipVerify(*self._store.used(soc))
                self._verify_chip(soc, chip, progress)
            report.chips[soc] = chip
        report.leftovers_removed = self._store.clean_leftovers(self._clock())
        return report

    def _verify_chip(self, soc: str, chip: ChipVerify, progress: Progress | None) -> None:
        unread: list[str] = []
        for key, size, problem in self._store.check_each(soc, progress, unread):
            chip.checked += 1
            if isinstance(problem, CorruptEntry):
                log.warning("corrupt cache entry %s/%s removed: %s", soc, key, problem)
                chip.corrupt += 1
                self._stats.add(soc, "corrupt")
                try:
                    self._store.discard(soc, key)
                except OSError as err:
                    log.warning("cannot remove %s/%s: %s", soc, key, err)
                    chip.errors += 1
                    chip.unsized += 1  # (still there, and not counted)
                continue
            if problem is not None:
                log.warning("cannot check %s/%s: %s", soc, key, problem)
                chip.errors += 1
            if size is None:
                chip.unsized += 1
                size = 0
            chip.entries += 1
            chip.bytes += size
        chip.unread = len(unread)
        if unread or chip.unsized:
            # Entries the walk could not see or size are in the counters, rightly: kept.
            log.warning("the counters of %s are left as they were: it was not all read", soc)
            return
        try:
            self._store.set_used(soc, chip.entries, chip.bytes)
        except OSError as e:
            chip.unwritten = sentence(e)
            log.warning("the counters of %s are left as they were: %s", soc, chip.unwritten)

    def clear(self, soc_version: str | None = None) -> list[str]:
        """Delete every entry (of one chip, or of all); returns the chips cleared.

        Only in a folder that holds a cache: its ``.opcache`` folder, trusted
        (FileNotFoundError, UntrustedFolder; ``LocalStore.clear_chip``).
        """
        chips = self._chips(soc_version)
        return [soc for soc in chips if self._folders.clear(soc, only_in_a_cache=True)]

    def stats(self, soc_version: str | None = None) -> dict[str, Any]:
        """Counters and sizes per chip and in total (see docs/how-it-works.md, 'Stats')."""
        self._stats.flush()
        socs = set(self._chips(soc_version))
        if soc_version is None:
            socs.update(self._store.stats_chips())
        chips = {}
        for soc in sorted(socs):
            entries, size = self._store.used(soc)
            activity = self._store.stats_files(soc, create=False).totals()
            chips[soc] = stats.chip_report(activity, entries, size)
        return stats.total_report(chips)

    def zero_stats(self, soc_version: str | None = None) -> None:
        """Set the hit, miss, ... counters to zero (entries and bytes stay)."""
        self._stats.flush()
        for soc in self.stats(soc_version)["chips"]:
            self._store.stats_files(soc).reset()

    def record_uncacheable(self, soc_version: str, reason: str) -> None:
        """Count a compile that ran without the cache because it could not be keyed."""
        self._stats.add(check_soc_version(soc_version), stats.UNCACHEABLE_PREFIX + reason)

    def _unserved(self, result: CompileResult, soc_version: str) -> None:
        """Take back the count of a hit whose outputs the caller (``opcache wrap``) could
        not put in place and then compiled without the cache: an error instead."""
        soc = check_soc_version(soc_version)
        self._stats.add_counts(soc, {"hits": -1, "time_saved_seconds": -result.saved_seconds})
        self._stats.add(soc, "errors")

    def close(self) -> None:
        """Make the local copies of remote hits still pending, write the pending stats,
        let go of the remote; maintenance calls still work after."""
        if self._flow.remote is not None:
            self._flow.remote.close()
        self._stats.close()

    def __enter__(self) -> OpCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
