"""Where entries are kept: the local folder, and a remote behind it.

The cache decides which tier to ask and when (``flow.py`` for one key,
``remote_tier.py`` for the remote's part); a storage back-end only knows
bytes, by chip and key.  What an entry is, and how every read of one is
checked, is ``entry.py``'s.

- ``local.py``: the cache folder (``LocalStore``), ``get`` / ``put`` /
  ``touch`` / ``discard`` and the folder's own housekeeping.
- a remote (``redis.py``, Redis or Valkey) is a ``Remote`` (``remote.py``):
  see its docstring for what a kind must provide and what it may add.  Every failure of the
  server or the network is a ``RemoteError``; the cache turns it into a
  warning and a back-off, never a failed compile.

The kinds: ``redis.py`` (``redis://``, ``rediss://``, ``unix://``),
``redis_cluster.py`` (``redis+cluster://``, ``rediss+cluster://``),
``folder.py`` (``file://``, a shared folder), ``http.py`` (``http://``,
``https://``); ``tiers.py`` puts several in order.

Adding another kind of remote (S3...) is one new module here with a
``Remote`` subclass (imported from ``remote.py``) and a ``connect(settings)``
function that returns one, plus its URL scheme in ``settings.REMOTE_KINDS``.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from ..settings import RemoteSettings
    from .local import LocalStore
    from .remote import (
        UNCLAIMED,
        Claim,
        Fetched,  # noqa: F401  (for the kinds' annotations)
        Remote,
        RemoteCorrupt,
        RemoteError,
    )

__all__ = ["UNCLAIMED", "Claim", "Remote", "RemoteCorrupt", "RemoteError", "open_remote"]

# The remote's classes load with the first remote (``remote.py``): every wrap
# hit imports this package (for ``entry.py``), and few have a remote.
_REMOTE_NAMES = frozenset(("UNCLAIMED", "Claim", "Remote", "RemoteCorrupt", "RemoteError"))


def __getattr__(name: str) -> object:
    if name not in _REMOTE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import remote

    value = getattr(remote, name)
    globals()[name] = value
    return value


def open_remote(settings: RemoteSettings, notes: LocalStore | None = None) -> Remote:
    """The remote ``settings`` names (RemoteError when its library is missing):
    one kind's, or the tiers several URLs name (``tiers.py``), whose pauses are
    shared through ``notes`` (the cache folder's bookkeeping) when given."""
    tiers = settings.tiers()
    if len(tiers) > 1:
        from .tiers import Tiers

        return Tiers(settings, tiers, notes)
    from .remote import connect

    return connect(tiers[0])
