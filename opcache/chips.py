"""A chip folder's life on the compile path: its first touch, ``force``'s clear
once per session, and aging after stores.

The first compile of a chip in an OpCache prepares its folder: the cache's
root and ``op_cache.ini`` are made, ``force`` clears the chip (once per compile
session, whatever processes the session runs in), and the upkeep runs:
leftovers of dead writers go (once per OpCache) and an aging pass runs if the
folder is over its limit.  An OpCache made for one compile that most likely
hits (``opcache wrap``) leaves the upkeep to the chip's first local miss: a hit
adds nothing to clean or age.  After each store, the folder is aged again when
its used bytes reach the limit.  None of
it ever fails a compile: a failure is reported (``on_error``) and the compile
goes on.  The aging rule itself is ``aging.py``'s.
"""

from __future__ import annotations

import _thread  # threading's primitives, without importing threading on wrap's start-up
import os
import time
from collections.abc import Callable

from . import fsutil
from ._log import get_logger
from .aging import MIN_IDLE_SECONDS, ChipAging, age_chip
from .ini import ensure_ini_file, folder_with_cann_files, toolkit_versions
from .settings import INI_NAME

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from .settings import Settings
    from .stats import StatsRecorder
    from .storage.local import LocalStore

log = get_logger(__name__)

# The session `opcache wrap` names when none is set: a build, that is a run of
# force compiles of a chip with no pause longer than BUILD_GAP_SECONDS between
# them, whatever processes they run in (make, ninja and scripts start compile
# commands in ways no process tree tells apart).
BUILD_SESSION = "opcache:build"
BUILD_GAP_SECONDS = 600.0
# How long a read of a chip's size counters stands in for them after a store.
_USED_FRESH_SECONDS = 2.0

Progress = Callable[[int], None]
# How a failure of the cache folder is reported: (kind, message, chip).
OnError = Callable[[str, str, str], None]


class ChipFolders:
    """The chip folders of one OpCache: which are ready, which unusable, when
    each is next worth aging.  Thread-safe.

    ``session`` names the compile session ``force`` clears each chip once in
    (None: this object is the session); ``clock`` stamps and decides aging.
    """

    def __init__(
        self,
        settings: Settings,
        store: LocalStore,
        recorder: StatsRecorder,
        *,
        session: str | None,
        clock: Callable[[], float],
        on_error: OnError,
        upkeep_at_miss: bool = False,
    ) -> None:
        self._settings = settings
        self._upkeep_at_miss = upkeep_at_miss
        self._store = store
        self._stats = recorder
        self._session = session
        self._clock = clock
        self._on_error = on_error
        self._mutex = _thread.allocate_lock()
        self._ready: set[str] = set()
        self._kept: set[str] = set()  # chips whose upkeep ran
        self._unusable: set[str] = set()
        self._next_aging: dict[str, float] = {}
        self._used_seen: dict[str, tuple[int, float]] = {}  # chip -> (bytes, when read)

    def ready(self, soc: str) -> bool:
        """First touch of a chip folder: op_cache.ini, ``force``'s wipe, the upkeep
        (unless ``upkeep_at_miss``).

        False when the chip's cache must not be used: ``force`` could not wipe
        it, so what is there may be exactly what the user wanted gone.
        Other threads wait until the first touch is done.
        """
        with self._mutex:
            if soc in self._ready:
                return soc not in self._unusable
            try:
                if not self._ready:
                    # Nothing made, nor op_cache.ini written, through another user's
                    # link on the root's way (UntrustedFolder: the compile goes on).
                    self._store.check_root()
                    # The root gets the cache's folder mode (0750), not mkdir's default.
                    fsutil.makedirs(self._store.root, self._store.modes)
                    self._ensure_ini()
                if self._settings.mode == "force" and self._force_clear(soc):
                    log.info("force: cleared the cache of %s", soc)
            except OSError as e:
                self._on_error("write", f"cannot prepare the cache at {self._store.root}: {e}", soc)
                if self._settings.mode == "force":
                    self._unusable.add(soc)
            self._ready.add(soc)
        if not self._upkeep_at_miss:
            self.upkeep(soc)
        return soc not in self._unusable

    def upkeep(self, soc: str) -> None:
        """Once per chip: leftovers of dead writers go (the first time of all chips),
        then an aging pass.  Never fails a compile."""
        with self._mutex:
            if soc in self._kept:
                return
            first = not self._kept
            self._kept.add(soc)
            if first:
                try:
                    self._store.clean_leftovers(time.time())
                except OSError as e:
                    self._on_error(
                        "write", f"cannot prepare the cache at {self._store.root}: {e}", soc
                    )
        self._age_safely(soc)

    def clear(self, soc: str, *, only_in_a_cache: bool = False) -> bool:
        """Delete a chip's entries and their explanations; True if there was a folder
        (``only_in_a_cache``: see ``LocalStore.clear_chip``)."""
        from . import explain

        explain.forget(self._store, soc)
        return self._store.clear_chip(soc, only_in_a_cache=only_in_a_cache)

    def _ensure_ini(self) -> None:
        """op_cache.ini where CANN keeps it, when missing: with the installed toolkit's
        versions, as CANN writes them.  Where there is no toolkit, or its versions
        cannot be read, none is made (CANN makes its own): without its versions CANN
        would take the file for one it must not touch, and never again wipe a chip
        folder when the toolkit changes (nor read its size keys), should a toolkit be
        installed later.  Nor where CANN's files of unknown versions are (which its
        first compile wipes: an ini would tell it they are these)."""
        path = self._settings.root / INI_NAME
        if os.path.lexists(path):
            return
        toolkit = self._settings.toolkit_env  # (the given environment's, not os.environ's)
        versions = toolkit_versions(dict(toolkit))
        if versions is None:
            log.debug("no %s made: no toolkit whose versions can be read", path)
            return
        if folder_with_cann_files(self._settings.root) is not None:
            # CANN's first compile wipes files of unknown versions: an ini would keep them.
            log.debug("no %s made: CANN's files of unknown versions are there", path)
            return
        ensure_ini_file(path, self._store.modes, versions)

    def _force_clear(self, soc: str) -> bool:
        """``force``'s clear of a chip, once per session; True if there was one to clear."""
        if self._session is None:
            return self.clear(soc)
        # As ascii() spells it, any session is one line, told apart from every other.
        session = ascii(self._session).encode()
        # Locked: processes of one session that start together clear once, and
        # none clears after another has begun to store.
        with self._store.locked(f"{soc}.force"):
            now = time.time()
            same = self._noted(self._store.read_note("force", soc), session, now)
            cleared = False if same else self.clear(soc)
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

    def after_store(self, soc: str, size: int) -> None:
        """A store added ``size`` bytes to the chip: age it if that reached the limit."""
        max_bytes = self._settings.max_bytes
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
            self._age_safely(soc)

    def _age_safely(self, soc: str) -> None:
        """Aging on the compile path: a failure is a warning, never a failed compile."""
        try:
            self.age(soc)
        except OSError as e:
            self._on_error("write", f"cannot age the cache of {soc}: {e}", soc)

    def age(
        self, soc: str, *, dry_run: bool = False, progress: Progress | None = None
    ) -> ChipAging:
        """One aging pass over the chip's folder (``aging.age_chip``), counted and noted."""
        now = self._clock()

        def evicted(size: int) -> None:
            self._stats.add(soc, "evicted_entries")
            self._stats.add(soc, "evicted_bytes", size)

        report = age_chip(
            self._store,
            soc,
            max_bytes=self._settings.max_bytes,
            ratio=self._settings.remain_cache_size_ratio,
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
