"""The remote tier as the cache uses it: the order of its steps, what is counted,
and what a failure costs.

The cache asks the remote only after a local miss.  A remote hit is served at
once and copied into the cache folder in the background (``look``); a key
missing there too is claimed in the whole cluster before it is compiled, or
waited for while another client compiles it (``claim_or_wait``, one turn of
which is ``step``); what another client stored is copied into the cache
folder (``backfill``).  Everything here keeps a remote from hurting a compile:

- a failure (down, timeout, refused credentials, or anything the client
  library raises) is counted (``remote_errors``, and by the URL that failed),
  said once in a warning, and pauses the remote: it is skipped for 10 s, then
  tried again; each failure in a row doubles the pause, up to 5 minutes.  The
  pause is written in the cache folder's bookkeeping too, under a digest of
  the remote's URL (never its password), so that the short processes of a
  build (``opcache wrap``, one per compile command) skip a dead server instead
  of each waiting for it, while a corrected URL is tried at once;
- a value that fails its checks is counted (``remote_corrupt``, once however
  often this process fetches it), never served, and replaced by the
  compile's own entry;
- hits, misses, stores and the bytes each way (as sent, compressed) are
  counted per chip.
"""

from __future__ import annotations

import _thread  # threading's primitives, without importing threading on wrap's start-up
import contextlib
import os
import signal
import time
from collections.abc import Callable

from ._log import get_logger
from .readset import CHANGED, MOVED, reads_now
from .stats import REMOTE_ERROR_PREFIX, STALE_READS
from .storage import UNCLAIMED, RemoteCorrupt, open_remote
from .storage.entry import Entry, with_reads
from .storage.remote import Backoff

TYPE_CHECKING = False
if TYPE_CHECKING:
    import threading

    from .settings import RemoteSettings
    from .stats import StatsRecorder
    from .storage import Claim, Fetched, Remote
    from .storage.local import LocalStore

log = get_logger(__name__)

# How the cache folder keeps a remote's entries: (chip, [(key, manifest, files)...]).
Keep = Callable[[str, list[tuple[str, bytes, dict[str, bytes]]]], None]

# How long a claim outlives its holder's death (renewed while it lives).
CLAIM_SECONDS = 10.0
_LOOKED_KEPT = 10_000  # look times remembered before the stale ones are dropped
# A claim refused again after this many polls found no claim of the key held: the
# name holds what is no claim of opcache's (another program's key, a proxy's answer),
# and the key is compiled unclaimed rather than waited for until lock_timeout.
_REFUSED_UNSEEN = 2
_REFUSED_KEPT = 200_000  # keys so counted at once (past it, counted anew: a batch's keys)
# How long a key seen claimed by another client is waited for without a claim
# of its own being tried (a poll looks at it meanwhile).
_PEEK_FRESH = 0.5
# How long the copier lets a remote hit it was woken for be delivered before it
# starts its copy (and competes with the delivery for the interpreter).
_COPY_AFTER = 0.001


class RemoteTier:
    """One remote, for one OpCache: opened by ``open`` or on first use, paused after
    failures.

    ``keep`` stores a remote's entry in the cache folder (a failure there only
    reported); ``clock`` stamps the hits; ``lock_timeout`` bounds a wait for
    another client's compile.
    """

    def __init__(
        self,
        settings: RemoteSettings,
        notes: LocalStore,
        stats: StatsRecorder,
        *,
        keep: Keep,
        clock: Callable[[], float],
        lock_timeout: float,
    ) -> None:
        self.settings = settings
        self._notes = notes
        self._stats = stats
        self._keep = keep
        self._clock = clock
        self._lock_timeout = lock_timeout
        self._mutex = _thread.allocate_lock()
        # Remote hits whose local copy is still to be made, by chip and key.
        self._backfills: dict[str, dict[str, Fetched]] = {}
        # The thread that makes them, started at the first remote hit and woken at
        # each, until close() (started again in a forked child, which has none).
        self._copier: threading.Thread | None = None
        self._copier_pid = 0
        # Released to wake the copier (a plain lock: a hit runs nothing but its
        # release, where an Event's set runs a Condition's Python).
        self._wake = _thread.allocate_lock()
        self._stopping = False
        self._unwoken = False  # copies waiting for their caller's copy_pending
        self._copied: threading.Condition | None = None  # (on _mutex) no copy pending
        self._remote: Remote | None = None
        self._backoff = Backoff("the remote cache", notes, settings.shown_url)
        self._corrupt: set[tuple[str, str]] = set()  # keys whose bad value was counted
        # Keys whose value is of a compile that read files that differ here (``_sound``).
        self._stale: set[tuple[str, str]] = set()
        # When keys were last found missing, by (chip, key) (time.monotonic()).
        self._looked: dict[tuple[str, str], float] = {}
        # When keys were last found claimed by another client (``peek_claims``).
        self._held_elsewhere: dict[tuple[str, str], float] = {}
        # Keys whose claim the remote refused, by how many polls since found none held.
        self._refused: dict[tuple[str, str], int] = {}
        self._uncounted = False  # open() failed, with no chip to count it under yet

    def open(self) -> None:
        """Import the remote's client library, make its client and connect now,
        rather than in the first local miss (a failure pauses the remote, as any
        other)."""
        remote = self._usable()
        if remote is None:
            return
        try:
            remote.warm_up()
        except Exception as e:
            self._failed(e, None)
            self._uncounted = True

    # -- the order of the steps --------------------------------------------------------

    def look(self, soc: str, key: str) -> tuple[Entry, str] | None:
        """A local miss's turn at the remote: (the entry, its tier) or None.

        A remote hit does not wait for its local copy, made by the copier
        thread (``close`` waits for the copies still to be made); a hit on a
        copy still on its way counts as local.
        """
        chip = self._backfills.get(soc)
        copying = None if chip is None else chip.get(key)
        if copying is not None:  # a remote hit of a moment ago, on its way to the folder
            # (stamped now: its copy will be, so the hit has no access to record)
            entry = copying[0]
            stamped = Entry(
                key, entry.files, entry.compile_seconds, self._clock(), entry.modes, entry.reads
            )
            return stamped, "local"
        got = self.fetch(soc, key)
        if got is None:
            return None
        self.backfill_later(soc, {key: got})
        return got[0], "remote"

    def claim_or_wait(self, soc: str, key: str) -> tuple[Entry | None, Claim]:
        """(the remote's entry, once another client stored it) or (None, this compile's
        claim).  Called with the key's local lock just taken: the remote was looked
        at just before it."""
        deadline = time.monotonic() + self._lock_timeout
        delay = 0.02
        entry, claim = self.step(soc, key, look_first=False)
        while entry is None and claim is None:
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
            # The entry and its claim in one look: a key still claimed costs no claim
            # refused, and one whose compile failed (no longer claimed, though its
            # claim's key refuses a claim for a while) is compiled here at once.
            found, claimed = self.poll(soc, [key])
            got = found.get(key)
            if got is not None:
                return self.backfill(soc, key, got[0], got[1]), UNCLAIMED
            if key not in claimed:
                entry, claim = self.step(soc, key, look_first=False)
        return entry, claim or UNCLAIMED

    def step(self, soc: str, key: str, *, look_first: bool) -> tuple[Entry | None, Claim | None]:
        """One turn at the remote for a key missing here: (its entry, backfilled),
        (None, a claim to compile it under), or (None, None) while another client
        compiles it.  ``look_first`` when time has passed since the last look."""
        got = self.fetch(soc, key, again=True) if look_first else None
        if got is None:
            seen = self._held_elsewhere.pop((soc, key), None)
            if not look_first and seen is not None and time.monotonic() - seen < _PEEK_FRESH:
                return None, None  # claimed by another a moment ago: not worth a claim
            claim = self.claim(soc, key)
            if claim is None or not claim.owned:
                return None, claim
            # Claimed: but its last holder may have stored it and let go just
            # before, so one more look, as after taking the local lock; unless
            # the last look was so recent that such a holder's claim, marked
            # stored, would still have refused ours.
            looked = self._looked.pop((soc, key), None)
            recent = looked is not None and time.monotonic() - looked < CLAIM_SECONDS / 2
            if claim.marks_stored and recent:
                return None, claim
            got = self.fetch(soc, key, again=True)
            if got is None:
                return None, claim
            claim.stored()  # (released, it would tell the waiters its compile failed)
        return self.backfill(soc, key, got[0], got[1]), None

    def backfill(self, soc: str, key: str, entry: Entry, manifest: bytes) -> Entry:
        """A remote's entry, kept in the cache folder too, as a local hit then sees it
        (a folder that cannot take it only warns: the entry is served).

        The entries served here are the remote's as fetched (no access stamp):
        their local copy is stamped when made, and ``KeyFlow.hit`` stamps no
        remote hit."""
        self._keep(soc, [(key, manifest, entry.files)])
        return entry

    def backfill_many(self, soc: str, found: dict[str, Fetched]) -> dict[str, Entry]:
        """``backfill`` of several entries, kept in the cache folder in one batch."""
        self._keep(soc, [(key, got[1], got[0].files) for key, got in found.items()])
        return {key: got[0] for key, got in found.items()}

    def backfill_later(self, soc: str, found: dict[str, Fetched], *, wake: bool = True) -> None:
        """``backfill_many`` by the copier thread, the entries served meanwhile.
        (Under a key's lock, where others wait to find the copy, it is done at
        once instead.)  ``wake`` False: the caller serves a batch of hits first,
        then wakes the copier (``copy_pending``), which would otherwise share
        the interpreter with those deliveries."""
        pid = os.getpid()
        if self._copier_pid not in (0, pid):
            # A child forked from a process whose copier it lacks, which may have
            # held the lock at the fork.
            self._mutex, self._copier_pid = _thread.allocate_lock(), 0
        with self._mutex:
            self._backfills.setdefault(soc, {}).update(found)
            if self._copier_pid != pid:
                self._start_copier()
            if wake:
                self._signal()
            else:
                self._unwoken = True

    def copy_pending(self) -> None:
        """Wake the copier for the copies ``backfill_later(wake=False)`` left to make."""
        with self._mutex:
            if self._unwoken and self._copier_pid == os.getpid():
                self._signal()

    def _signal(self) -> None:
        """Wake the copier (``_mutex`` held: ``_wake`` is released only under it, so
        it cannot be released by another between the check and the release)."""
        self._unwoken = False
        if self._wake.locked():  # (else a wake is pending already)
            self._wake.release()

    def _start_copier(self) -> None:
        """Start the copier (``_mutex`` held): one thread for the OpCache's life, as
        a thread started per hit cost a single hit more than its own work."""
        import atexit
        import threading  # only on a remote hit: not on wrap's start-up
        import weakref

        self._wake, self._stopping = _thread.allocate_lock(), False
        self._wake.acquire()
        self._copied = threading.Condition(self._mutex)
        # A daemon, whose idle wait does not hold up the interpreter's exit; the
        # exit waits for its copies instead, so an OpCache never closed still
        # makes them (and leaves no temp folder).  Waited for where threads are
        # joined: at the interpreter's exit, and at a multiprocessing child's,
        # which then leaves through os._exit, past atexit.
        self._copier = threading.Thread(target=self._copy_all, name="opcache-backfill", daemon=True)
        self._copier_pid = os.getpid()
        self._copier.start()
        tier = weakref.ref(self)  # (a closed tier is not kept for the exit)

        def at_exit() -> None:
            alive = tier()
            if alive is not None:
                alive._stop_copier()

        atexit.register(at_exit)  # (the only one run where the CLI leaves by os._exit)
        with contextlib.suppress(AttributeError, RuntimeError):  # (none; its exit under way)
            threading._register_atexit(at_exit)  # type: ignore[attr-defined]  # (as futures')

    def _copy_all(self) -> None:
        """The copier: whenever woken, the copies still to be made, a chip's at a time
        in one batch each; it ends once told to stop and none is left."""
        wake = self._wake
        assert self._copied is not None
        while True:
            wake.acquire()
            if not self._stopping:
                time.sleep(_COPY_AFTER)
            while True:
                with self._mutex:
                    if not self._backfills:
                        self._copied.notify_all()
                        break
                    soc, chip = next(iter(self._backfills.items()))
                    batch = list(chip.items())
                try:
                    self._keep(soc, [(key, got[1], got[0].files) for key, got in batch])
                except Exception as e:  # (keep reports a folder's failures: this is a bug's)
                    log.warning("cannot copy remote hits into the cache folder: %s", e)
                with self._mutex:  # (a hit meanwhile took them from here rather than the remote)
                    for key, _ in batch:
                        del chip[key]
                    if not chip:
                        del self._backfills[soc]
            if self._stopping:
                return

    def wait_for_copies(self) -> None:
        """Return once the local copies of the remote hits served so far are made."""
        if self._copied is not None and self._copier_pid == os.getpid():
            with self._copied:
                if self._unwoken:  # (copies a batch left to make after its deliveries)
                    self._signal()
                self._copied.wait_for(lambda: not self._backfills)

    def _stop_copier(self) -> None:
        """Let the copier make the copies still to be made, and end.  A Ctrl-C is held
        off meanwhile, raised once the copies are made (as wrap holds it while
        removing its staging folder)."""
        copier = self._copier
        if copier is None or self._copier_pid != os.getpid():
            return
        with self._mutex:
            self._stopping = True
            self._signal()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            copier.join()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        with self._mutex:
            self._copier, self._copier_pid = None, 0

    # -- what the cache asks ---------------------------------------------------------

    def fetch(self, soc: str, key: str, *, again: bool = False) -> Fetched | None:
        """The remote's entry of ``key`` (checked), or None: absent, bad or unreachable.

        ``again``: a key this process looked for before, whose miss was counted.
        """
        return self.fetch_many(soc, [key], again=again).get(key)

    def fetch_many(self, soc: str, keys: list[str], *, again: bool = False) -> dict[str, Fetched]:
        """The remote's entries of ``keys`` that are there and sound, in few round trips
        (each as fetched: the entry, its manifest's bytes, its size on the wire)."""
        remote = self._usable(soc)
        if remote is None or not keys:
            return {}
        asked = time.monotonic()
        try:
            got = remote.get_many(soc, keys)
        except Exception as e:  # (any: see the module's docstring)
            self._failed(e, soc)
            return {}
        self._recovered()
        sound = self._sound(soc, got, None if again else len(keys))
        self._note_looked(soc, keys, sound, asked)
        return sound

    def _sound(
        self,
        soc: str,
        got: dict[str, Fetched | RemoteCorrupt],
        asked: int | None = None,
    ) -> dict[str, Fetched]:
        """The values that passed their checks, counted; the others counted as corrupt
        (a value looked at again, after a claim, is not counted again); of ``asked``
        keys, those not sound counted as misses.  The counts in one update (a
        single hit took the recorder's lock three times)."""
        sound = {}
        down = corrupt = stale = 0  # (counted once: a batch of hits added it a key at a time)
        for key, value in got.items():
            if not isinstance(value, RemoteCorrupt) and value[0].reads is not None:
                now = reads_now(value[0].reads)
                if now is None:
                    bad = RemoteCorrupt("the manifest gives a bad read set")
                    bad.size = value[2]
                    value = bad
                elif now == MOVED:
                    # The same files, with other times here (another machine's entry): the
                    # local copy keeps this machine's, or each hit would hash them again.
                    value = (value[0], with_reads(value[1], value[0].reads), value[2])
                elif now == CHANGED:
                    # (compiled here, and the entry of what this machine read stored over it)
                    log.info("remote entry %s/%s not used: a file it read differs here", soc, key)
                    down += value[2]
                    if (soc, key) not in self._stale:  # (once, however often it is looked at)
                        stale += 1
                        self._stale.add((soc, key))
                    continue
            if isinstance(value, RemoteCorrupt):
                down += value.size
                if (soc, key) in self._corrupt:
                    log.debug("corrupt remote entry %s/%s, still: %s", soc, key, value)
                    continue
                self._corrupt.add((soc, key))
                log.warning("corrupt remote entry %s/%s not used: %s", soc, key, value)
                corrupt += 1
                continue
            sound[key] = value
            down += value[2]
        counts: dict[str, float] = {"remote_hits": len(sound)} if sound else {}
        if down:
            counts["remote_bytes_down"] = down
        if corrupt:
            counts["remote_corrupt"] = corrupt
        if stale:
            counts[STALE_READS] = stale
        if asked is not None and asked > len(sound):
            counts["remote_misses"] = asked - len(sound)
        if counts:
            self._stats.add_counts(soc, counts)
        return sound

    def poll(self, soc: str, keys: list[str]) -> tuple[dict[str, Fetched], set[str]]:
        """For keys other clients compile: (the entries now there, the keys still
        claimed), in one round trip.  An unreachable remote claims nothing: the
        keys are compiled here."""
        remote = self._usable(soc)
        if remote is None:
            return {}, set()
        asked = time.monotonic()
        try:
            got, claimed = remote.watch(soc, keys)
        except Exception as e:
            self._failed(e, soc)
            return {}, set()
        self._recovered()
        sound = self._sound(soc, got)
        self._note_looked(soc, keys, sound, asked)
        refused = self._refused
        for key in keys:
            if (soc, key) not in refused:
                continue
            if key in sound:
                del refused[(soc, key)]  # (settled: its holder stored it)
            elif key not in claimed:
                refused[(soc, key)] += 1
        return sound, claimed

    def _note_looked(self, soc: str, keys: list[str], found: dict, asked: float) -> None:
        """Remember when the keys not ``found`` were looked for (``asked``, before the
        question left), for ``step``."""
        looked = self._looked
        if len(looked) > _LOOKED_KEPT:  # (keys settled otherwise, a local compile's)
            old = asked - CLAIM_SECONDS
            # (list(): one step under the GIL, while other threads add and pop)
            for name in [name for name, when in list(looked.items()) if when < old]:
                looked.pop(name, None)
        for key in keys:
            if key not in found:
                looked[(soc, key)] = asked

    def peek_claims(self, soc: str, keys: list[str]) -> None:
        """Look, in one round trip, which of ``keys`` other clients hold: ``step``
        then waits for those without a claim refused of its own (a round trip
        each).  A key seen claimed whose holder gives up unstored is only waited
        for until the next poll, which finds it unclaimed."""
        remote = self._usable(soc)
        if remote is None or not keys:
            return
        asked = time.monotonic()
        try:
            held = remote.peek_claims(soc, keys)
        except Exception as e:
            self._failed(e, soc)
            return
        self._recovered()
        seen = self._held_elsewhere
        if len(seen) > _LOOKED_KEPT:
            seen.clear()  # (the keys of batches gone: a peek is only worth a moment)
        for key in held:
            seen[(soc, key)] = asked

    def claim(self, soc: str, key: str) -> Claim | None:
        """The key for this process's compile (``owned`` False: compile unclaimed),
        or None when another client of the remote is compiling it."""
        remote = self._usable(soc)
        if remote is None:
            return UNCLAIMED
        try:
            claim = remote.claim(soc, key, CLAIM_SECONDS)
        except Exception as e:
            self._failed(e, soc)
            return UNCLAIMED
        self._recovered()
        refused = self._refused
        if claim is not None:
            refused.pop((soc, key), None)
        elif refused.get((soc, key), 0) >= _REFUSED_UNSEEN:
            del refused[(soc, key)]
            log.warning(
                "the remote refuses a claim of %s/%s, yet no look finds one held (is "
                "another program's key at its claim's name?): compiling it here unclaimed",
                soc,
                key,
            )
            return UNCLAIMED
        else:
            if len(refused) > _REFUSED_KEPT:
                refused.clear()  # (the keys of batches gone, mostly: settled otherwise)
            refused.setdefault((soc, key), 0)
        return claim

    def store(
        self, soc: str, key: str, manifest: bytes, files: dict[str, bytes], claim: Claim | None
    ) -> None:
        """Send a compile's entry to the remote (not when read-only or too big); once
        sent, let its ``claim`` go as stored (``Claim.stored``)."""
        remote = self._usable(soc)
        if remote is None or remote.read_only:
            return
        stale = (soc, key) in self._stale
        try:
            if stale:  # (an entry of files that differ here stands there: this one over it)
                sent = remote.replace(soc, key, manifest, files)
                if sent and claim is not None:
                    claim.stored()
            else:
                sent = remote.put_claimed(soc, key, manifest, files, claim)
        except Exception as e:
            self._failed(e, soc)
            return
        self._recovered()
        if sent and stale:
            self._stale.discard((soc, key))
        if sent and claim is not None:
            self._corrupt.discard((soc, key))  # replaced: a bad value there now is a new one
            self._stats.add(soc, "remote_stores")
            self._stats.add(soc, "remote_bytes_up", sent)

    def close(self) -> None:
        """Make the local copies of remote hits still pending, then let go of the remote."""
        try:
            self._stop_copier()
        finally:
            if self._remote is not None:
                try:
                    self._remote.close()
                except Exception as e:
                    log.debug("cannot close the remote: %s", e)
                self._remote = None

    # -- failures ---------------------------------------------------------------------

    def _usable(self, soc: str | None = None) -> Remote | None:
        """The remote, or None while it is paused; the first use for a chip counts
        a failure of ``open``'s, which had none to count it under."""
        if self._uncounted and soc is not None:
            self._uncounted = False
            self._count_failure(soc)
        if self._backoff.paused():
            return None
        if self._remote is None:
            try:
                self._remote = open_remote(self.settings, self._notes)
            except Exception as e:
                self._failed(e, soc)
                # (a client that connects as it is made, a cluster's, fails in ``open``)
                self._uncounted = soc is None
                return None
        return self._remote

    def _failed(self, error: Exception, soc: str | None) -> None:
        if soc is not None:
            self._count_failure(soc)
        self._backoff.failed(error)

    def _count_failure(self, soc: str) -> None:
        self._stats.add(soc, "remote_errors")
        self._stats.add(soc, REMOTE_ERROR_PREFIX + self.settings.shown_url)

    def _recovered(self) -> None:
        self._backoff.recovered()
