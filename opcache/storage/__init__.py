"""Where entries are kept: the local folder, and a remote behind it.

The cache (``cache.py``) decides which tier to ask and when; a storage
back-end only knows bytes, by chip and key.  What an entry is, and how every
read of one is checked, is ``entry.py``'s.

- ``local.py``: the cache folder (``LocalStore``), ``get`` / ``put`` /
  ``touch`` / ``discard`` and the folder's own housekeeping.
- a remote (``redis.py``, Redis or Valkey) is a ``Remote``: ``get``,
  ``get_many`` and ``watch`` return entries already checked like a local read
  (``RemoteCorrupt`` otherwise), ``put`` stores one (manifest and files),
  ``discard`` drops one, ``claim`` takes a key for one compile in the whole
  cluster, and ``usage`` / ``clear`` act on this cache's keys only.  Every
  failure of the server or the network is a ``RemoteError``; the cache turns
  it into a warning and a back-off, never a failed compile.

Adding another kind of remote (a shared folder, S3...) is one new module here
with a class that has ``Remote``'s methods and a ``connect(settings)``
function, plus its URL scheme in ``_KINDS``.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from typing import Protocol

    from ..settings import RemoteSettings
    from .entry import Entry

    # A value fetched and checked: (the entry, its manifest's bytes, the value's
    # size on the wire, which is what ``remote_bytes_down`` counts).
    Fetched = tuple[Entry, bytes, int]

    class Claim(Protocol):
        """A key taken for one compile in the cluster, until ``release``.

        ``owned`` is False for a claim that could not be taken but need not be
        waited for (a read-only client): the compile goes on unclaimed.
        """

        owned: bool

        def release(self) -> None: ...

    class Remote(Protocol):
        read_only: bool
        max_entry_bytes: int

        def get(self, soc: str, key: str) -> tuple[Entry, bytes] | None:
            """(the checked entry, its manifest's bytes), or None when absent."""

        def get_many(self, soc: str, keys: list[str]) -> dict[str, Fetched | RemoteCorrupt]:
            """The entries of ``keys`` that are there, by key, in few round trips
            (a bad value as its RemoteCorrupt)."""

        def watch(
            self, soc: str, keys: list[str]
        ) -> tuple[dict[str, Fetched | RemoteCorrupt], set[str]]:
            """(``get_many``'s answer, the keys a claim is held on), in one round trip:
            how a client waits for keys others compile."""

        def put(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
            """Store an entry; returns the bytes sent (0 when it was not sent)."""

        def discard(self, soc: str, key: str) -> None: ...

        def claim(self, soc: str, key: str, seconds: float) -> Claim | None:
            """The key for one compile in the cluster, or None when another
            client holds it.  A claim lasts ``seconds`` past its holder's death."""

        def claimed(self, soc: str, key: str) -> bool:
            """Whether a claim on ``key`` is held."""

        def usage(self, soc: str | None = None) -> dict[str, object]: ...

        def clear(self, soc: str | None = None) -> int: ...

        def close(self) -> None: ...


class RemoteError(Exception):
    """The remote failed: down, too slow, refused the credentials or a command.

    A remote raises nothing else for a failure of its server, network or client
    library (the cache still treats anything else as one, never failing a compile).
    """


class RemoteCorrupt(Exception):
    """A value fetched from the remote is not a whole, valid entry of its key."""

    size = 0  # the value's bytes on the wire


# URL scheme -> the module (in this package) that opens it.
_KINDS = {"redis": "redis", "rediss": "redis", "unix": "redis"}


def schemes() -> list[str]:
    """The URL schemes a remote can have."""
    return sorted(_KINDS)


def open_remote(settings: RemoteSettings) -> Remote:
    """The remote ``settings`` names (RemoteError when its library is missing)."""
    scheme = settings.url.partition(":")[0]
    module = importlib.import_module(f".{_KINDS[scheme]}", __name__)
    return module.connect(settings)
