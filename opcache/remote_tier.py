"""The remote tier as the cache uses it: what is counted, and what a failure costs.

The cache asks the remote only after a local miss (``cache.py`` decides the
order).  Everything here keeps a remote from hurting a compile:

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

import hashlib
import time

from ._log import get_logger
from .stats import REMOTE_ERROR_PREFIX
from .storage import UNCLAIMED, RemoteCorrupt, open_remote

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .settings import RemoteSettings
    from .stats import StatsRecorder
    from .storage import Claim, Fetched, Remote
    from .storage.entry import Entry
    from .storage.local import LocalStore

log = get_logger(__name__)

# How long a claim outlives its holder's death (renewed while it lives).
CLAIM_SECONDS = 10.0
FIRST_PAUSE = 10.0
LAST_PAUSE = 300.0
_PAUSE_NOTE = "remote-pause-"  # + a digest of the URL
_NOTE_FRESH_SECONDS = 1.0


class RemoteTier:
    """One remote, for one OpCache: connected on first use, paused after failures."""

    def __init__(self, settings: RemoteSettings, notes: LocalStore, stats: StatsRecorder) -> None:
        self.settings = settings
        self._notes = notes
        self._stats = stats
        self._remote: Remote | None = None
        self._paused_until = 0.0
        self._pause = FIRST_PAUSE
        self._warned = False
        self._noted, self._noted_at = 0.0, -_NOTE_FRESH_SECONDS  # another process's pause
        url = settings.shown_url  # (the password masked: never in a file name or a count)
        self._pause_note = _PAUSE_NOTE + hashlib.sha256(url.encode()).hexdigest()[:16]
        self._corrupt: set[tuple[str, str]] = set()  # keys whose bad value was counted

    # -- what the cache asks ---------------------------------------------------------

    def fetch(self, soc: str, key: str, *, again: bool = False) -> tuple[Entry, bytes] | None:
        """The remote's entry of ``key`` (checked), or None: absent, bad or unreachable.

        ``again``: a key this process looked for before, whose miss was counted.
        """
        return self.fetch_many(soc, [key], again=again).get(key)

    def fetch_many(
        self, soc: str, keys: list[str], *, again: bool = False
    ) -> dict[str, tuple[Entry, bytes]]:
        """The remote's entries of ``keys`` that are there and sound, in few round trips."""
        remote = self._usable()
        if remote is None or not keys:
            return {}
        try:
            got = remote.get_many(soc, keys)
        except Exception as e:  # (any: see the module's docstring)
            self._failed(e, soc)
            return {}
        self._recovered()
        sound = self._sound(soc, got)
        if not again:
            self._stats.add(soc, "remote_misses", len(keys) - len(sound))
        return sound

    def _sound(
        self, soc: str, got: dict[str, Fetched | RemoteCorrupt]
    ) -> dict[str, tuple[Entry, bytes]]:
        """The values that passed their checks, counted; the others counted as corrupt
        (a value looked at again, after a claim, is not counted again)."""
        sound = {}
        for key, value in got.items():
            if isinstance(value, RemoteCorrupt):
                self._stats.add(soc, "remote_bytes_down", value.size)
                if (soc, key) in self._corrupt:
                    log.debug("corrupt remote entry %s/%s, still: %s", soc, key, value)
                    continue
                self._corrupt.add((soc, key))
                log.warning("corrupt remote entry %s/%s not used: %s", soc, key, value)
                self._stats.add(soc, "remote_corrupt")
                continue
            entry, manifest, size = value
            sound[key] = entry, manifest
            self._stats.add(soc, "remote_bytes_down", size)
        self._stats.add(soc, "remote_hits", len(sound))
        return sound

    def poll(self, soc: str, keys: list[str]) -> tuple[dict[str, tuple[Entry, bytes]], set[str]]:
        """For keys other clients compile: (the entries now there, the keys still
        claimed), in one round trip.  An unreachable remote claims nothing: the
        keys are compiled here."""
        remote = self._usable()
        if remote is None:
            return {}, set()
        try:
            got, claimed = remote.watch(soc, keys)
        except Exception as e:
            self._failed(e, soc)
            return {}, set()
        self._recovered()
        return self._sound(soc, got), claimed

    def claim(self, soc: str, key: str) -> Claim | None:
        """The key for this process's compile (``owned`` False: compile unclaimed),
        or None when another client of the remote is compiling it."""
        remote = self._usable()
        if remote is None:
            return UNCLAIMED
        try:
            claim = remote.claim(soc, key, CLAIM_SECONDS)
        except Exception as e:
            self._failed(e, soc)
            return UNCLAIMED
        self._recovered()
        return claim

    def store(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> None:
        """Send a compile's entry to the remote (not when read-only or too big)."""
        remote = self._usable()
        if remote is None or remote.read_only:
            return
        try:
            sent = remote.put(soc, key, manifest, files)
        except Exception as e:
            self._failed(e, soc)
            return
        self._recovered()
        if sent:
            self._corrupt.discard((soc, key))  # replaced: a bad value there now is a new one
            self._stats.add(soc, "remote_stores")
            self._stats.add(soc, "remote_bytes_up", sent)

    def close(self) -> None:
        if self._remote is not None:
            try:
                self._remote.close()
            except Exception as e:
                log.debug("cannot close the remote: %s", e)
            self._remote = None

    # -- failures ---------------------------------------------------------------------

    def _usable(self) -> Remote | None:
        now = time.time()
        if now < self._paused_until or now < self._pause_noted():
            return None
        if self._remote is None:
            try:
                self._remote = open_remote(self.settings)
            except Exception as e:
                self._failed(e, None)
                return None
        return self._remote

    def _failed(self, error: Exception, soc: str | None) -> None:
        if soc is not None:
            self._stats.add(soc, "remote_errors")
            self._stats.add(soc, REMOTE_ERROR_PREFIX + self.settings.shown_url)
        until = time.time() + self._pause
        self._paused_until = until
        message = f"the remote cache is not used for {self._pause:.0f} s: {error}"
        self._pause = min(self._pause * 2, LAST_PAUSE)
        if self._warned:
            log.debug("%s", message)
        else:
            self._warned = True
            log.warning("%s", message)
        try:
            self._notes.write_note(f"{until:.3f}".encode(), self._pause_note)
        except OSError as e:
            log.debug("cannot record the remote's pause: %s", e)

    def _recovered(self) -> None:
        self._pause = FIRST_PAUSE

    def _pause_noted(self) -> float:
        """Until when another process found the remote failing (0.0: it did not)."""
        if self._paused_until:
            return 0.0  # this process has its own record, and tried again since
        now = time.monotonic()
        if now - self._noted_at >= _NOTE_FRESH_SECONDS:  # a file read, not one per call
            note = self._notes.read_note(self._pause_note)
            try:
                self._noted = float(note) if note else 0.0
            except ValueError:
                self._noted = 0.0
            self._noted_at = now
        return self._noted
