"""OpCache: the operator compile cache that compile tools call in-process.

This is where CANN's rules meet the store: modes (enable / force / disable),
debug bypasses, single-flight compiles, access stamps and aging, stats, and
the promise that the cache never fails a compile.
"""

from __future__ import annotations

import _thread  # threading's primitives, without importing threading on wrap's start-up
import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from . import fsutil, locks, stats, trust
from ._log import get_logger
from .aging import MIN_IDLE_SECONDS, STAMP_GRANULARITY, ChipAging, age_chip
from .errors import CompileError
from .ini import ensure_ini_file
from .key import compute_key
from .request import CompileResult, OpRequest, check_soc_version, is_plain_name
from .settings import INI_NAME, Settings
from .storage.entry import MANIFEST, CorruptEntry, Entry, make_manifest
from .storage.local import LocalStore, Workdir, new_build_folder, remove_abandoned

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    import threading
    from typing import Any

    from .compilers.protocol import Compiler
    from .explain import Explanation
    from .remote_tier import RemoteTier
    from .request import Status
    from .shared_work import OutDirs
    from .storage import Claim

log = get_logger(__name__)

LOCK_TIMEOUT_SECONDS = 600.0
UNUSABLE = "not stored: the cache is unusable"
# A hit's file, made with the mode open(path, "wb") gives.  O_NONBLOCK: a FIFO
# in its place must not hang the open; no O_TRUNC before it is known to be ours.
_OUT_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_EUID = os.geteuid()
# How long a read of a chip's size counters stands in for them after a store.
_USED_FRESH_SECONDS = 2.0
# The session `opcache wrap` names when none is set: a build, that is a run of
# force compiles of a chip with no pause longer than BUILD_GAP_SECONDS between
# them, whatever processes they run in (make, ninja and scripts start compile
# commands in ways no process tree tells apart).
BUILD_SESSION = "opcache:build"
BUILD_GAP_SECONDS = 600.0
# Compiles run in <out_dir>/.opcache-build.<host>.<pid>.<random>, locked while they run.
_BUILD_LABEL = ".opcache-build"

Progress = Callable[[int], None]


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
        self.entries = 0  # after the check
        self.bytes = 0
        self.counted_entries = counted_entries  # what the counters said before
        self.counted_bytes = counted_bytes

    def as_dict(self) -> dict[str, int]:
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
        return sum(c.errors for c in self.chips.values())

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
    """

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        lock_timeout: float = LOCK_TIMEOUT_SECONDS,
        stats_seconds: float | None = stats.FLUSH_SECONDS,
        session: str | None = None,
    ) -> None:
        self.settings = settings
        self._session = session if session is not None else settings.session
        self._clock = clock
        self._lock_timeout = lock_timeout
        self._store = LocalStore(settings.root, modes=fsutil.modes_for(settings.shared_group))
        self._stats = stats.StatsRecorder(self._store.stats_files, flush_seconds=stats_seconds)
        self._mutex = _thread.allocate_lock()
        self._prepare_mutex = _thread.allocate_lock()
        self._ready_chips: set[str] = set()
        self._unusable_chips: set[str] = set()
        self._next_aging: dict[str, float] = {}
        self._used_seen: dict[str, tuple[int, float]] = {}  # chip -> (bytes, when read)
        self._warned: set[str] = set()
        self._fingerprints: dict[int, tuple[Compiler, str]] = {}
        # Threads inside compile(), and whether the cache folder failed them yet.
        self._compiling: dict[int, bool] = {}
        self._remote: RemoteTier | None = None
        # Remote hits whose local copy is still to be made, by (chip, key).
        self._backfills: dict[tuple[str, str], tuple[Entry, bytes]] = {}
        self._backfiller: threading.Thread | None = None
        if settings.remote is not None and settings.mode != "disable":
            from .remote_tier import RemoteTier  # only with a remote: not on wrap's start-up

            self._remote = RemoteTier(settings.remote, self._store, self._stats)

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
        out = Path(out_dir)
        plain = self._uncached(request)
        if plain is not None:
            return self._compile_plain(request, compiler, out, started, *plain)
        with self._one_error_per_compile(request.soc_version):
            return self._compile_cached(request, compiler, out, started)

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

        return compile_many(self, requests, compiler, out_dirs, jobs, on_result)

    def _uncached(self, request: OpRequest) -> tuple[Status, str | None] | None:
        """(status, reason) when the mode or a debug option keeps the cache out; else None."""
        if self.settings.mode == "disable":
            return "disabled", None
        reason = self.settings.bypass_reason(request.op_name, request.op_type)
        if reason is not None:
            return "bypass", reason
        return None

    def _compile_plain(
        self,
        request: OpRequest,
        compiler: Compiler,
        out: Path,
        started: float,
        status: Status,
        reason: str | None,
        key: str = "",
    ) -> CompileResult:
        """A compile that keeps the cache out: a mode, a debug option, an unusable cache."""
        files = _compile_uncached(request, compiler, out)
        if status == "bypass":
            self._stats.add(request.soc_version, stats.BYPASS_PREFIX + str(reason))
            op = request.op_type  # (a wrapped C compile has no op_name)
            name = f"{request.op_name} ({op})" if request.op_name else op
            log.debug("bypassing the cache for %s: %s", name, reason)
        elif status == "miss":
            self._stats.add(request.soc_version, "misses")
        return CompileResult(status, key, files, time.perf_counter() - started, reason)

    @contextlib.contextmanager
    def _one_error_per_compile(self, soc: str) -> Iterator[None]:
        """One compile that meets a broken cache at every step (read, lock, store)
        is one error in stats, not three."""
        me = _thread.get_ident()
        outer = self._compiling.get(me)  # a compiler that compiles through the cache itself
        self._compiling[me] = False
        try:
            yield
        finally:
            if self._compiling.pop(me):
                self._stats.add(soc, "errors")
            if outer is not None:
                self._compiling[me] = outer

    def _compile_cached(
        self, request: OpRequest, compiler: Compiler, out: Path, started: float
    ) -> CompileResult:
        soc = request.soc_version
        fingerprint = self._fingerprint(compiler)
        key, inputs = compute_key(request, compiler.name, fingerprint)
        if not self._prepare_chip(soc):
            return self._compile_plain(request, compiler, out, started, "miss", UNUSABLE, key)
        entry = self._lookup(soc, key)
        if entry is not None:
            return self._hit(entry, soc, out, started, "local")
        if self._remote is not None:
            copying = self._backfills.get((soc, key))
            if copying is not None:  # a remote hit of a moment ago, on its way to the folder
                return self._hit(copying[0], soc, out, started, "local")
            got = self._remote.fetch(soc, key)
            if got is not None:
                return self._hit(self._backfill_later(soc, key, *got), soc, out, started, "remote")
        filled = self._fill(self._acquire(soc, key), request, compiler, key, inputs, out)
        if filled.entry is not None:
            return self._hit(filled.entry, soc, out, started, filled.tier)
        self._stats.add(soc, "misses")
        seconds = time.perf_counter() - started
        return CompileResult("miss", key, filled.files, seconds, filled.note)

    def _hit(self, entry: Entry, soc: str, out: Path, started: float, tier: str) -> CompileResult:
        files = _deliver(out, entry.files)
        self._record_hit(soc, entry)
        seconds = time.perf_counter() - started
        saved = entry.compile_seconds
        return CompileResult("hit", entry.key, files, seconds, saved_seconds=saved, tier=tier)

    def _backfill(self, soc: str, key: str, entry: Entry, manifest: bytes) -> Entry:
        """A remote's entry, stored in the cache folder too, as a local hit then sees it.

        A cache folder that cannot take it only warns: the entry is served.
        """
        try:
            stored = self._store.put(soc, key, manifest, entry.files, now=self._clock())
        except OSError as e:
            self._cache_error("write", f"cannot store in the cache at {self._store.root}: {e}", soc)
        else:
            if stored is not None:
                self._after_store(soc, stored)
        return Entry(key, entry.files, entry.compile_seconds, self._clock())

    def _fill(
        self,
        lock: locks.KeyLock | None,
        request: OpRequest,
        compiler: Compiler,
        key: str,
        inputs: dict,
        out: Path,
        claim: Claim | None = None,
    ) -> _Filled:
        """With the key's lock held (or none to be had): the entry, if another process
        stored it meanwhile, else this process's compile.  Releases the lock.

        With a remote, the compile is claimed in the whole cluster first (or
        ``claim`` was taken already): while another client of the remote
        compiles the key, this waits for its entry, up to ``lock_timeout``.
        """
        soc = request.soc_version
        stored = None
        try:
            # Another process may have stored it since our first look,
            # whether we waited for its lock or it was done before we came.
            entry = self._lookup(soc, key) if lock else None
            if entry is not None:
                return _Filled(entry, "local")
            if claim is None and self._remote is not None:
                entry, claim = self._claim_or_wait(soc, key)
                if entry is not None:
                    return _Filled(entry, "remote")
            if lock and lock.waited and not lock.inherited:
                # Its compile failed (or could not be stored): compile here, but
                # let the other waiters do the same at once instead of one after
                # another.  (Its holder died instead: one compile, the lock kept.)
                lock.release()
            files, note, stored, artifacts = self._compile_and_store(
                request, compiler, key, inputs, out
            )
        finally:
            if claim is not None:
                claim.release()
            if lock:
                lock.release()
        if stored is not None:
            self._after_store(soc, stored)  # not under the key's lock
        return _Filled(None, "", files, note, artifacts)

    def _claim_or_wait(self, soc: str, key: str) -> tuple[Entry | None, Claim]:
        """(the remote's entry, once another client stored it) or (None, this compile's claim)."""
        from .remote_tier import UNCLAIMED

        deadline = time.monotonic() + self._lock_timeout
        delay = 0.02
        looked = True  # (just before the local lock was taken)
        while True:
            entry, claim = self._remote_step(soc, key, look_first=not looked)
            looked = False
            if entry is not None or claim is not None:
                return entry, claim or UNCLAIMED
            if time.monotonic() >= deadline:
                log.warning(
                    "waited %.3g s for another machine compiling %s/%s; compiling it here too",
                    self._lock_timeout,
                    soc,
                    key,
                )
                return None, UNCLAIMED
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _backfill_later(self, soc: str, key: str, entry: Entry, manifest: bytes) -> Entry:
        """``_backfill`` in a background thread: a remote hit does not wait for its local
        copy.  (Under a key's lock, where others wait to find the copy, it is done
        at once instead.)  ``close()`` waits for the copies still to be made."""
        import threading  # only on a remote hit: not on wrap's start-up

        hit = Entry(key, entry.files, entry.compile_seconds, self._clock())
        with self._mutex:
            self._backfills[(soc, key)] = (hit, manifest)
            if self._backfiller is None:
                self._backfiller = threading.Thread(
                    target=self._backfill_all, name="opcache-backfill", daemon=True
                )
                self._backfiller.start()
        return hit

    def _backfill_all(self) -> None:
        while True:
            with self._mutex:
                if not self._backfills:
                    self._backfiller = None
                    return
                (soc, key), got = next(iter(self._backfills.items()))
            self._backfill(soc, key, *got)
            with self._mutex:  # (a hit meanwhile took it from here rather than the remote)
                del self._backfills[(soc, key)]

    def _remote_step(
        self, soc: str, key: str, *, look_first: bool
    ) -> tuple[Entry | None, Claim | None]:
        """One turn at the remote for a key missing here: (its entry, backfilled),
        (None, a claim to compile it under), or (None, None) while another client
        compiles it.  ``look_first`` when time has passed since the last look."""
        assert self._remote is not None
        got = self._remote.fetch(soc, key, again=True) if look_first else None
        if got is None:
            claim = self._remote.claim(soc, key)
            if claim is None or not claim.owned:
                return None, claim
            # Claimed: but its last holder may have stored it and let go just
            # before, so one more look, as after taking the local lock.
            got = self._remote.fetch(soc, key, again=True)
            if got is None:
                return None, claim
            claim.release()
        return self._backfill(soc, key, *got), None

    def _fingerprint(self, compiler: Compiler) -> str:
        known = self._fingerprints.get(id(compiler))
        if known is None or known[0] is not compiler:
            known = (compiler, compiler.fingerprint())
            self._fingerprints[id(compiler)] = known
        return known[1]

    def _acquire(self, soc: str, key: str) -> locks.KeyLock | None:
        """The key's single-flight lock, held; None to compile without it."""
        try:
            lock = locks.KeyLock(self._store.lock_path(soc, key), self._store.modes)
            if lock.acquire(self._lock_timeout):
                return lock
            log.warning(
                "waited %.3g s for another process compiling %s/%s; compiling it here too",
                self._lock_timeout,
                soc,
                key,
            )
        except OSError as e:
            self._cache_error("lock", f"cannot lock {soc}/{key}: {e}", soc)
        return None

    def _lookup(self, soc: str, key: str) -> Entry | None:
        try:
            return self._store.get(soc, key)
        except CorruptEntry as e:
            log.warning("corrupt cache entry %s/%s removed: %s", soc, key, e)
            self._stats.add(soc, "corrupt")
            try:
                self._store.discard(soc, key)
            except OSError as err:
                self._cache_error("write", f"cannot remove a corrupt entry: {err}", soc)
        except OSError as e:
            self._cache_error("read", f"cannot read the cache at {self._store.root}: {e}", soc)
        return None

    def _record_hit(self, soc: str, entry: Entry) -> None:
        self._stats.add(soc, "hits")
        self._stats.add(soc, "time_saved_seconds", entry.compile_seconds)
        if not self.settings.aging_enabled:
            return  # CANN: with aging off, a hit writes nothing
        now = self._clock()
        if now - entry.stamp >= STAMP_GRANULARITY:
            try:
                self._store.touch(soc, entry.key, now)
            except OSError as e:
                self._cache_error("stamp", f"cannot record an access: {e}", soc)

    def _compile_and_store(
        self, request: OpRequest, compiler: Compiler, key: str, inputs: dict, out: Path
    ) -> tuple[dict[str, Path], str | None, int | None, dict[str, bytes]]:
        """(files in ``out``, why not stored, bytes stored, the files' bytes).

        The compiler works beside ``out_dir``, never in the cache: a full or
        broken cache disk can fail the store, not the compile.
        """
        soc = request.soc_version
        try:
            compile_started = time.perf_counter()
            files, artifacts = _compile_into(request, compiler, out)
        except CompileError:
            self._stats.add(soc, "compile_errors")
            raise
        seconds = time.perf_counter() - compile_started
        # A compiler whose compile ran before its key was known (wrap's traced opc) says how long.
        seconds = getattr(compiler, "compile_seconds", None) or seconds
        if MANIFEST in artifacts:
            self._warn_once("manifest-name", f"an artifact named {MANIFEST} cannot be cached")
            return files, f"not stored: an artifact is named {MANIFEST}", None, artifacts
        self._explain_miss(request, key, inputs, getattr(compiler, "explain_names", None))
        manifest = make_manifest(key, artifacts, seconds, inputs, self._clock())
        if self._remote is not None:
            self._remote.store(soc, key, manifest, artifacts)
        try:
            size = self._store.put(soc, key, manifest, artifacts, now=self._clock())
        except OSError as e:
            self._cache_error("write", f"cannot store in the cache at {self._store.root}: {e}", soc)
            return files, "not stored: the cache is not writable", None, artifacts
        if size is not None:
            self._stats.add(soc, "stores")
        return files, None, size, artifacts

    def _explain_miss(self, request: OpRequest, key: str, inputs: dict, names: dict | None) -> None:
        """Note the key's parts (and the compiler's ``explain_names``) for ``opcache
        explain``, and count the miss as a new key of an operator seen before or as
        one never seen."""
        from . import explain  # on a miss only: not on a hit's start-up

        seen = explain.record(self._store, request, key, inputs, now=self._clock(), names=names)
        if seen is not None:
            self._stats.add(
                request.soc_version, stats.MISSES_NEW_KEY if seen else stats.MISSES_NEVER_SEEN
            )

    def explain(
        self, request: OpRequest, compiler: Compiler, *, reads_changed: Sequence[str] = ()
    ) -> Explanation:
        """Why ``request`` would miss: its key's parts and those that differ from the
        nearest stored entry of its operator and chip (``explain.Explanation``);
        ``reads_changed``, files its last compile read that changed, are named too."""
        from . import explain

        return explain.explain(self._store, request, compiler, reads_changed=reads_changed)

    # -- chip folders and aging ---------------------------------------------

    def _prepare_chip(self, soc: str) -> bool:
        """First touch of a chip folder: op_cache.ini, ``force``'s wipe, an aging pass.

        False when the chip's cache must not be used: ``force`` could not wipe
        it, so what is there may be exactly what the user wanted gone.
        Other threads of this OpCache wait until the first touch is done.
        """
        with self._prepare_mutex:
            if soc in self._ready_chips:
                return soc not in self._unusable_chips
            first = not self._ready_chips
            try:
                if first:
                    # The root gets the cache's folder mode (0750), not mkdir's default.
                    fsutil.makedirs(self._store.root, self._store.modes)
                    ensure_ini_file(self.settings.root / INI_NAME, self._store.modes)
                    self._store.clean_leftovers(time.time())
                if self.settings.mode == "force" and self._force_clear(soc):
                    log.info("force: cleared the cache of %s", soc)
            except OSError as e:
                self._cache_error(
                    "write", f"cannot prepare the cache at {self._store.root}: {e}", soc
                )
                if self.settings.mode == "force":
                    self._unusable_chips.add(soc)
            self._ready_chips.add(soc)
        self._age_chip_safely(soc)
        return soc not in self._unusable_chips

    def _force_clear(self, soc: str) -> bool:
        """``force``'s clear of a chip, once per session; True if there was one to clear."""
        if self._session is None:
            return self._clear_chip(soc)
        # As ascii() spells it, any session is one line, told apart from every other.
        session = ascii(self._session).encode()
        # Locked: processes of one session that start together clear once, and
        # none clears after another has begun to store.
        with self._store.locked(f"{soc}.force"):
            now = time.time()
            same = self._noted(self._store.read_note("force", soc), session, now)
            cleared = False if same else self._clear_chip(soc)
            if not same or self._session == BUILD_SESSION:  # (a build's clock runs on)
                self._store.write_note(session + b"\n" + str(now).encode(), "force", soc)
        return cleared

    def _noted(self, note: bytes | None, session: bytes, now: float) -> bool:
        """Whether the force note ``note`` says this session cleared the chip already.

        A note that is not the session as ``ascii()`` spells it and a time, one a
        line, is another session's.
        """
        noted, _, when = (note or b"").partition(b"\n")
        if noted != session:
            return False
        if self._session != BUILD_SESSION:
            return True
        try:
            age = now - float(when)
        except ValueError:
            return False
        # A time far ahead (inf, a garbled number) would make one build last forever.
        return -BUILD_GAP_SECONDS < age < BUILD_GAP_SECONDS

    def _after_store(self, soc: str, size: int) -> None:
        max_bytes = self.settings.max_bytes
        if max_bytes is None:
            return
        # The counters are sixteen files: read them again only when what was
        # read lately, plus what this process stored since, nears the limit.
        now = time.monotonic()
        seen, when = self._used_seen.get(soc, (0, -_USED_FRESH_SECONDS))
        if now - when < _USED_FRESH_SECONDS and seen + size < max_bytes:
            self._used_seen[soc] = (seen + size, when)
            return
        try:
            _, used = self._store.used(soc)
        except OSError:
            return
        self._used_seen[soc] = (used, now)
        if used < max_bytes:
            return
        crossed = used - size < max_bytes
        # While everything is young, another walk cannot free anything before
        # the oldest entry ages: wait for that instead of walking again.
        if crossed or self._clock() >= self._next_aging.get(soc, 0.0):
            self._age_chip_safely(soc)

    def _age_chip_safely(self, soc: str) -> None:
        """Aging on the compile path: a failure is a warning, never a failed compile."""
        try:
            self._age_chip(soc)
        except OSError as e:
            self._cache_error("write", f"cannot age the cache of {soc}: {e}", soc)

    def _age_chip(
        self, soc: str, *, dry_run: bool = False, progress: Progress | None = None
    ) -> ChipAging:
        now = self._clock()

        def evicted(size: int) -> None:
            self._stats.add(soc, "evicted_entries")
            self._stats.add(soc, "evicted_bytes", size)

        report = age_chip(
            self._store,
            soc,
            max_bytes=self.settings.max_bytes,
            ratio=self.settings.remain_cache_size_ratio,
            now=now,
            dry_run=dry_run,
            progress=progress,
            on_evict=evicted,
        )
        if report.oldest_kept is not None:
            self._next_aging[soc] = report.oldest_kept + MIN_IDLE_SECONDS
        if report.removed_entries and not dry_run:
            from . import explain

            explain.prune(self._store, soc)
            log.info(
                "aged %s: entries removed: %d, bytes freed: %d",
                soc,
                report.removed_entries,
                report.freed_bytes,
            )
        return report

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
            report.chips[soc] = self._age_chip(soc, dry_run=dry_run, progress=progress)
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
        for info in self._store.scan(soc, progress, sizes=True):
            chip.checked += 1
            try:
                self._store.get(soc, info.key)
            except CorruptEntry as e:
                log.warning("corrupt cache entry %s/%s removed: %s", soc, info.key, e)
                chip.corrupt += 1
                self._stats.add(soc, "corrupt")
                try:
                    self._store.discard(soc, info.key)
                except OSError as err:
                    log.warning("cannot remove %s/%s: %s", soc, info.key, err)
                    chip.errors += 1
                continue
            except OSError as e:
                log.warning("cannot check %s/%s: %s", soc, info.key, e)
                chip.errors += 1
            chip.entries += 1
            chip.bytes += info.size
        self._store.set_used(soc, chip.entries, chip.bytes)

    def clear(self, soc_version: str | None = None) -> list[str]:
        """Delete every entry (of one chip, or of all); returns the chips cleared."""
        return [soc for soc in self._chips(soc_version) if self._clear_chip(soc)]

    def _clear_chip(self, soc: str) -> bool:
        """Delete a chip's entries and their explanations; True if there was a folder."""
        from . import explain

        explain.forget(self._store, soc)
        return self._store.clear_chip(soc)

    def stats(self, soc_version: str | None = None) -> dict[str, Any]:
        """Counters and sizes per chip and in total (see docs/how-it-works.md, 'Stats')."""
        self._stats.flush()
        socs = set(self._chips(soc_version))
        if soc_version is None:
            with contextlib.suppress(OSError):
                socs.update(n for n in os.listdir(self._store.stats_dir) if not n.startswith("."))
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

    def close(self) -> None:
        """Make the local copies of remote hits still pending, write the pending stats,
        let go of the remote; maintenance calls still work after."""
        backfiller = self._backfiller
        if backfiller is not None:
            backfiller.join()
        self._stats.close()
        if self._remote is not None:
            self._remote.close()

    def __enter__(self) -> OpCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- warnings ---------------------------------------------------------------

    def _cache_error(self, kind: str, message: str, soc: str) -> None:
        """Count a failure of the cache folder (``kind``: lock, read, write...).

        The warning is logged once per OpCache whatever the kind: an unwritable
        cache fails the lock, the store and the stats at once, and the user
        needs to hear about it once.  Later ones go to the debug log.
        """
        me = _thread.get_ident()
        if me in self._compiling:
            self._compiling[me] = True
        else:
            self._stats.add(soc, "errors")
        self._warn_once("cache", f"{message} (the compile goes on without the cache)")

    def _warn_once(self, kind: str, message: str) -> None:
        with self._mutex:
            if kind in self._warned:
                log.debug("%s", message)
                return
            self._warned.add(kind)
        # The topic, not the message (which names a key): opcache wrap shows it once an hour.
        log.warning("%s", message, topic=f"{kind} {self._store.root}")


class _Filled:
    """What ``_fill`` came to: an entry (and its tier), or a compile's files."""

    __slots__ = ("artifacts", "entry", "files", "note", "tier")

    def __init__(
        self,
        entry: Entry | None,
        tier: str,
        files: dict[str, Path] | None = None,
        note: str | None = None,
        artifacts: dict[str, bytes] | None = None,
    ) -> None:
        self.entry = entry
        self.tier = tier
        self.files = files or {}
        self.note = note
        self.artifacts = artifacts or {}


def _deliver(out: Path, files: dict[str, bytes]) -> dict[str, Path]:
    """Write a hit's ``files`` into ``out``.

    A name that is free, or holds a file of this user's with no other name, is
    written in place.  Anything else there (a link or a file with other links
    someone put in a folder others write to, another user's file, a FIFO) is
    replaced as a miss replaces it, never written through (``_replace_into``).
    """
    paths = {}
    others = {}
    for name, data in files.items():
        fd = _open_own(out, name)
        if fd is None:
            others[name] = data
            continue
        try:
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        paths[name] = out / name
    if others:
        paths.update(_replace_into(out, others))
    return paths


def _open_own(out: Path, name: str) -> int | None:
    """``out/name`` open for writing if it was free or is this user's own file with
    no other name, else None."""
    path = out / name
    # os.open, not open(): no isatty, lseek and fstat for each file of every hit.
    try:
        try:
            fd = os.open(path, _OUT_FLAGS, 0o666)
        except FileNotFoundError:  # (asked only then: a stat per hit on a slow disk)
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, _OUT_FLAGS, 0o666)
    except OSError as e:
        # A link; a FIFO nobody reads; a file we may not write (a rename still replaces it).
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EACCES):
            return None
        raise
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == _EUID:
        return fd
    os.close(fd)
    return None


def _replace_into(out: Path, files: dict[str, bytes]) -> dict[str, Path]:
    """Put ``files`` into ``out`` as a miss puts its compile's: written in a build
    folder of its own, then moved in (``_move_out``)."""
    build = new_build_folder(out, _BUILD_LABEL, 0o700)
    try:
        for name, data in files.items():
            with open(os.open(name, _NEW_FLAGS, 0o666, dir_fd=build.fd), "wb") as f:
                f.write(data)
        return {name: _move_out(build, name, out) for name in files}
    finally:
        build.close()


def _move_out(build: Workdir, name: str, out: Path) -> Path:
    """Move the file ``name`` of ``build`` into ``out``, the folder it was made in.

    A rename: whatever had that name in ``out`` (a link someone put there in a
    folder others write to, a file with other names) is replaced, never
    written through.
    """
    os.replace(name, name, src_dir_fd=build.fd, dst_dir_fd=build.parent_fd)
    return out / name


def _compile_into(
    request: OpRequest, compiler: Compiler, out: Path
) -> tuple[dict[str, Path], dict[str, bytes]]:
    """Compile in a private folder beside ``out`` and move the artifacts into ``out``.

    Returns (artifact paths in ``out``, their bytes).  The artifacts are the
    plain files the compiler wrote; folders and links it left are dropped.
    Build folders that killed compiles left in ``out`` go first; a failed
    compile leaves no ``out`` it created.
    """
    made = _missing_folders(out)
    if made:
        out.mkdir(parents=True, exist_ok=True)
    else:
        remove_abandoned(out, time.time(), _BUILD_LABEL)
    build = new_build_folder(out, _BUILD_LABEL, 0o700)
    try:
        compiler.compile(request, build.path)
        files, artifacts = {}, {}
        for entry in os.scandir(build.path):
            if entry.is_file(follow_symlinks=False) and is_plain_name(entry.name):
                with open(entry.path, "rb") as f:
                    artifacts[entry.name] = f.read()
                files[entry.name] = _move_out(build, entry.name, out)
            else:
                log.debug("ignoring %s: not a plain file", entry.path)
    except BaseException:
        build.close()
        for folder in made:  # deepest first; one not empty holds something else now
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    build.close()
    return files, artifacts


def _missing_folders(out: Path) -> list[Path]:
    """``out`` and its parents that do not exist yet, deepest first."""
    missing = []
    folder = Path(os.path.abspath(out))
    while not folder.is_dir() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _compile_uncached(request: OpRequest, compiler: Compiler, out: Path) -> dict[str, Path]:
    """Compile into ``out`` without touching the cache folder."""
    return _compile_into(request, compiler, out)[0]
