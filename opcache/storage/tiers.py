"""Several remotes in order: ``OPCACHE_REMOTE="redis://team:6379/0 http://site/opcache"``.

The URLs are separated by spaces, nearest (fastest) first.  A look-up asks
each tier in turn for the keys still missing; a hit from a farther tier is
stored into every nearer tier that may be written (the backfill), so that the
next machine of the team finds it near.  A store goes to every tier that may
be written.  Each tier is read-only or not on its own: ``read_only`` for all,
or ``?read_only=true`` on one tier's URL.  A bad value in one tier is looked
for in the next; it is reported (``RemoteCorrupt``) only when no tier has a
sound one.

A tier that fails is skipped for 10 s, then tried again (each failure in a
row doubles the pause, up to 5 minutes), with one warning: the other tiers
go on.  The pause is written in the cache folder's bookkeeping as the whole
remote's is (``Backoff``), so that the short processes of a build skip a dead
tier too instead of each waiting for it.  Only when every tier asked fails is
it the remote's failure (``RemoteError``, which the cache counts and pauses on).

Claims, and waiting for a key another client compiles, are the nearest
tier's (a team's Redis has them; with a shared folder or an HTTP server
first, there are none).
"""

from __future__ import annotations

from .._log import get_logger
from .remote import UNCLAIMED, Backoff, Claim, Remote, RemoteCorrupt, RemoteError, connect

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..settings import RemoteSettings
    from .local import LocalStore
    from .remote import Fetched

log = get_logger(__name__)


class _Tier:
    """One tier: connected on first use, paused after a failure."""

    def __init__(self, settings: RemoteSettings, notes: LocalStore | None) -> None:
        self.settings = settings
        self.remote: Remote | None = None
        url = settings.shown_url
        self.backoff = Backoff(f"the remote tier {url}", notes, url)

    def usable(self) -> Remote | None:
        if self.backoff.paused():
            return None
        if self.remote is None:
            try:
                self.remote = connect(self.settings)
            except Exception as e:  # (any: a tier never fails a compile)
                self.backoff.failed(e)
        return self.remote


class Tiers(Remote):
    """Remotes in order, nearest first (see the module's docstring)."""

    def __init__(
        self,
        settings: RemoteSettings,
        tiers: list[RemoteSettings],
        notes: LocalStore | None = None,
    ) -> None:
        super().__init__(settings)
        self._tiers = [_Tier(tier, notes) for tier in tiers]
        self.read_only = all(tier.read_only for tier in tiers)

    def get_many(self, soc: str, keys: list[str]) -> dict[str, Fetched | RemoteCorrupt]:
        return self._look(soc, keys, {}, 0)

    def _look(
        self, soc: str, keys: list[str], found: dict[str, Fetched | RemoteCorrupt], start: int
    ) -> dict[str, Fetched | RemoteCorrupt]:
        """``found`` (the answer of the tiers before ``start``) completed from the tiers
        from ``start`` on; hits backfilled into the nearer tiers."""
        sound = {k: v for k, v in found.items() if not isinstance(v, RemoteCorrupt)}
        bad = {k: v for k, v in found.items() if isinstance(v, RemoteCorrupt)}
        asked = failed = 0
        for at in range(start, len(self._tiers)):
            missing = [key for key in keys if key not in sound]
            if not missing:
                break
            tier = self._tiers[at]
            remote = tier.usable()
            if remote is None:
                continue
            asked += 1
            try:
                got = remote.get_many(soc, missing)
            except Exception as e:
                tier.backoff.failed(e)
                failed += 1
                continue
            tier.backoff.recovered()
            for key, value in got.items():
                if isinstance(value, RemoteCorrupt):
                    bad.setdefault(key, value)
                else:
                    sound[key] = value
                    bad.pop(key, None)
                    self._backfill(soc, key, value, at)
        if asked and failed == asked and not sound and start == 0:
            raise RemoteError(f"{self.where}: no tier answered")
        return {**bad, **sound}

    def have_many(self, soc: str, keys: list[str]) -> set[str]:
        """The keys some tier holds (each tier asked for the ones still not found)."""
        found: set[str] = set()
        asked = failed = 0
        for tier in self._tiers:
            missing = [key for key in keys if key not in found]
            remote = tier.usable() if missing else None
            if remote is None:
                continue
            asked += 1
            try:
                found |= remote.have_many(soc, missing)
            except Exception as e:
                tier.backoff.failed(e)
                failed += 1
        if asked and failed == asked:
            raise RemoteError(f"{self.where}: no tier answered")
        return found

    def _backfill(self, soc: str, key: str, value: Fetched, at: int) -> None:
        """Store a hit of tier ``at`` into the nearer tiers that may be written."""
        entry, manifest, _ = value
        for tier in self._tiers[:at]:
            remote = tier.usable()
            if remote is None or remote.read_only:
                continue
            try:
                remote.put(soc, key, manifest, entry.files)
            except Exception as e:
                tier.backoff.failed(e)

    def put(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
        """Store into every tier that may be written; the bytes sent, all tiers summed."""
        return self._put(soc, key, manifest, files, replace=False)

    def replace(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
        """Each tier's ``replace``; the bytes sent, all tiers summed."""
        return self._put(soc, key, manifest, files, replace=True)

    def _put(
        self, soc: str, key: str, manifest: bytes, files: dict[str, bytes], *, replace: bool
    ) -> int:
        sent = tried = failed = 0
        for tier in self._tiers:
            remote = tier.usable()
            if remote is None or remote.read_only:
                continue
            tried += 1
            try:
                store = remote.replace if replace else remote.put
                sent += store(soc, key, manifest, files)
            except Exception as e:
                tier.backoff.failed(e)
                failed += 1
                continue
            tier.backoff.recovered()
        if tried and failed == tried:
            raise RemoteError(f"{self.where}: no tier took the entry")
        return sent

    def discard(self, soc: str, key: str) -> None:
        for tier in self._tiers:
            remote = tier.usable()
            if remote is not None and not remote.read_only:
                try:
                    remote.discard(soc, key)
                except Exception as e:
                    tier.backoff.failed(e)

    # -- claims: the nearest tier's ------------------------------------------------------

    def claim(self, soc: str, key: str, seconds: float) -> Claim | None:
        nearest = self._tiers[0]
        remote = nearest.usable()
        if remote is None:
            return UNCLAIMED
        try:
            return remote.claim(soc, key, seconds)
        except Exception as e:
            nearest.backoff.failed(e)
            return UNCLAIMED

    def claimed(self, soc: str, key: str) -> bool:
        nearest = self._tiers[0]
        remote = nearest.usable()
        if remote is None:
            return False
        try:
            return remote.claimed(soc, key)
        except Exception as e:
            nearest.backoff.failed(e)
            return False

    def peek_claims(self, soc: str, keys: list[str]) -> set[str]:
        nearest = self._tiers[0]
        remote = nearest.usable()
        if remote is None:
            return set()
        try:
            return remote.peek_claims(soc, keys)
        except Exception as e:
            nearest.backoff.failed(e)
            return set()

    def watch(
        self, soc: str, keys: list[str]
    ) -> tuple[dict[str, Fetched | RemoteCorrupt], set[str]]:
        """The nearest tier's entries and claims in its one round trip, then the
        other tiers for the keys it lacks."""
        nearest = self._tiers[0]
        remote = nearest.usable()
        if remote is None:
            return self._look(soc, keys, {}, 1), set()
        try:
            found, claimed = remote.watch(soc, keys)
        except Exception as e:
            nearest.backoff.failed(e)
            return self._look(soc, keys, {}, 1), set()
        nearest.backoff.recovered()
        return self._look(soc, keys, found, 1), claimed

    # -- maintenance: every tier ---------------------------------------------------------

    def usage(self, soc: str | None = None) -> dict[str, object]:
        """Each tier's usage (``tiers``, by URL), and the chips of all summed."""
        chips: dict[str, dict[str, int]] = {}
        each: dict[str, object] = {}
        for tier in self._tiers:
            remote = tier.usable()
            if remote is None:
                each[tier.settings.shown_url] = {"error": "not reachable"}
                continue
            try:
                usage = remote.usage(soc)
            except RemoteError as e:
                each[tier.settings.shown_url] = {"error": str(e)}
                continue
            each[tier.settings.shown_url] = usage
            for chip, row in usage["chips"].items():  # type: ignore[attr-defined]
                total = chips.setdefault(chip, {"entries": 0, "bytes": 0})
                total["entries"] += row["entries"]
                total["bytes"] += row["bytes"]
        first = next((u for u in each.values() if "used_memory" in u), {})  # type: ignore[operator]
        return {
            "chips": dict(sorted(chips.items())),
            "tiers": each,
            **{k: first.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy")},  # type: ignore[attr-defined]
        }

    def clear(self, soc: str | None = None) -> int:
        """Clear every tier that may be written and can be cleared; entries removed, summed."""
        if self.read_only:
            raise RemoteError(f"{self.where}: the remote is read-only here")
        removed, errors = 0, []
        for tier in self._tiers:
            remote = tier.usable()
            if remote is None:
                errors.append(RemoteError(f"{tier.settings.shown_url}: not reachable"))
            elif not remote.read_only:
                try:
                    removed += remote.clear(soc)
                except RemoteError as e:  # (an HTTP server cannot list: not supported)
                    errors.append(e)
        if errors:
            raise RemoteError("; ".join(map(str, errors)) + f" ({removed} entries removed)")
        return removed

    def warm_up(self) -> None:
        """Connect every tier now (one that fails is paused, as at any other use)."""
        for tier in self._tiers:
            remote = tier.usable()
            if remote is not None:
                try:
                    remote.warm_up()
                except Exception as e:
                    tier.backoff.failed(e)

    def close(self) -> None:
        for tier in self._tiers:
            if tier.remote is not None:
                try:
                    tier.remote.close()
                except Exception as e:
                    log.debug("cannot close %s: %s", tier.settings.shown_url, e)
                tier.remote = None
