"""A shared folder as the remote tier: ``file:///mnt/share/opcache``.

The folder is a cache root like the local one, kept by the same code
(``LocalStore``): the same layout and entry format, every read checked whole
(manifest checksum, each artifact's size and digest), nothing reached through
a link, FIFOs and devices never opened for a read that could block, every
folder and file held to the trust rule.  An entry is built in the folder's
own ``.opcache/tmp`` and renamed into place, one ``rename`` on the server: a
writer killed mid-store leaves a build folder no reader looks in (removed by
``opcache remote clear``, or ``opcache age`` run on the folder), never a half
entry.  That is all NFSv4 (close-to-open consistency, atomic rename in one
folder) is relied on for; no lock is needed for an entry to be whole.

Who may share it: the folder's owner alone, or, when the folder is setgid
and group-writable for a group this user is in (``chmod 2770``, ``chgrp
team``), that group, as ``OPCACHE_SHARED_GROUP`` makes a local cache shared.

A folder that is not there is an error, never created: an unmounted share
would otherwise fill the local disk unseen.

A folder this user may not write (a read-only mount, one it may only read) is
read-only from its first refused store, with one warning, as an HTTP server's
403 makes that remote: its entries are still read.

No claims: each machine compiles the cold keys it misses (``flock`` on NFS
holds across hosts on Linux, but a lock of a client that lost its lease is
dropped by the server under it, and a claim must not be wrong quietly).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

from .. import fsutil, trust
from .._log import get_logger
from ..errors import sentence
from . import Remote, RemoteCorrupt, RemoteError
from .entry import CorruptEntry
from .local import LocalStore

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..settings import RemoteSettings
    from . import Fetched

log = get_logger(__name__)

# What a store meets where this user may not write: a read-only mount, a folder it
# may read and not write, one whose owner alone may change it.
_REFUSED = frozenset((errno.EROFS, errno.EACCES, errno.EPERM))


def connect(settings: RemoteSettings) -> FolderRemote:
    """The shared folder ``settings.url`` (``file:///path``) names.

    Reached as a cache root is (``trust.resolve_root``): through links of this
    user's or root's only.  Another user's link on the way (a member's, swapped
    for the team's folder, leading to a folder of this user's) is refused: its
    target's modes would make that folder this user's private cache here.
    """
    path = unquote(urlsplit(settings.url).path)
    walk = trust.resolve_root(path)
    if walk.problem is not None:
        raise RemoteError(f"{settings.shown_url}: {walk.problem}")
    # The folder's modes as that walk saw them (its last lstat), not a second look.
    st = walk.folders[-1][1] if walk.folders else None
    if st is None:
        try:
            st = os.stat(walk.path, follow_symlinks=False)  # (what is wrong, said)
        except OSError as e:
            raise RemoteError(
                f"{settings.shown_url}: {e.strerror} (mount it or create it)"
            ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise RemoteError(f"{settings.shown_url}: not a folder")
    return FolderRemote(settings, LocalStore(Path(walk.path), modes=_modes(st)))


def _modes(st: os.stat_result) -> fsutil.Modes:
    """Group-shared modes when the folder is setgid, group-writable and of one of our
    groups; private ones otherwise.  ``st`` is the folder's own ``lstat``, reached
    through no other user's link (``connect``)."""
    shared = st.st_mode & stat.S_ISGID and st.st_mode & stat.S_IWGRP
    if shared and st.st_gid in (os.getegid(), *os.getgroups()):
        return fsutil.group_shared(st.st_gid)
    return fsutil.PRIVATE


class FolderRemote(Remote):
    """The remote tier on a shared folder (see the module's docstring)."""

    def __init__(self, settings: RemoteSettings, store: LocalStore) -> None:
        super().__init__(settings)
        self._store = store
        store.max_entry_bytes = self.max_entry_bytes  # (others' entries: read no bigger)
        self._corrupt: set[tuple[str, str]] = set()  # keys whose entry failed its checks

    def get_many(self, soc: str, keys: list[str]) -> dict[str, Fetched | RemoteCorrupt]:
        found: dict[str, Fetched | RemoteCorrupt] = {}
        for key in keys:
            try:
                got = self._store.get_with_manifest(soc, key)
            except CorruptEntry as e:
                found[key] = RemoteCorrupt(str(e), maybe_sound=e.maybe_sound)
                self._corrupt.add((soc, key))
                continue
            except OSError as e:  # unreadable, untrusted, the mount gone
                raise RemoteError(f"{self.where}: {sentence(e)}") from None
            if got is not None:
                entry, manifest = got
                found[key] = entry, manifest, len(manifest) + sum(map(len, entry.files.values()))
                self._touch(soc, key)
        return found

    def _touch(self, soc: str, key: str) -> None:
        """Stamp a hit, so that ``opcache age`` run on the folder keeps what is used."""
        if self.read_only:
            return
        try:
            self._store.touch(soc, key, time.time())
        except OSError as e:  # another member's entry, a read-only mount: it ages sooner
            log.debug("cannot stamp %s/%s in %s: %s", soc, key, self.where, e)

    def put(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
        size = len(manifest) + sum(map(len, files.values()))
        if self.read_only or size > self.max_entry_bytes:
            return 0
        try:
            if (soc, key) in self._corrupt:
                # A damaged entry stands in the name for good: it goes (to the folder's
                # trash), so that the compile's own replaces it, as on the other remotes.
                self._store.discard(soc, key)
                self._corrupt.discard((soc, key))
            stored = self._store.put(soc, key, manifest, files, now=time.time())
        except OSError as e:
            if self._refused_writes(e):
                return 0
            raise RemoteError(f"{self.where}: cannot store {soc}/{key}: {e}") from None
        return size if stored is not None else 0  # None: another machine's stands

    def discard(self, soc: str, key: str) -> None:
        if self.read_only:
            return
        try:
            self._store.discard(soc, key)
        except OSError as e:
            if not self._refused_writes(e):
                raise RemoteError(f"{self.where}: cannot remove {soc}/{key}: {e}") from None

    def _refused_writes(self, error: OSError) -> bool:
        """Whether ``error`` says that this user may not write the folder (a read-only
        mount, a folder of someone else's): the remote turns read-only, with one
        warning, as an HTTP server's 403 makes it, and its entries are still read.
        (A RemoteError would pause it, reads too, for every process of the machine.)"""
        if error.errno not in _REFUSED:
            return False
        if not self.read_only:
            self.read_only = True
            log.warning("%s: cannot write (%s): only reading it from now on", self.where, error)
        return True

    def _chips(self, soc: str | None) -> list[str]:
        """``soc``, or every chip folder; OSError when the folder cannot be listed (the
        store's list reads that as no chip: a remote of another user's, said empty)."""
        if soc:
            return [soc]
        os.listdir(self._store.root)
        return self._store.chips()

    def usage(self, soc: str | None = None) -> dict[str, object]:
        """Entries and bytes per chip, by a walk of the folder (its counters are
        per-host estimates on a shared mount)."""
        chips = {}
        try:
            for chip in self._chips(soc):
                infos = list(self._store.scan(chip, sizes=True))
                if infos:
                    chips[chip] = {"entries": len(infos), "bytes": sum(i.size for i in infos)}
        except OSError as e:
            raise RemoteError(f"{self.where}: {sentence(e)}") from None
        return {"chips": chips, "used_memory": None, "maxmemory": None, "maxmemory_policy": None}

    def clear(self, soc: str | None = None) -> int:
        """Remove this cache's entries (of one chip): each chip folder is renamed
        into the folder's trash at once and deleted in the background."""
        if self.read_only:
            raise RemoteError(f"{self.where}: the remote is read-only here")
        removed = 0
        try:
            self._store.clean_leftovers(time.time())
            for chip in self._chips(soc):
                count = sum(1 for _ in self._store.scan(chip))
                if self._store.clear_chip(chip, only_in_a_cache=True):
                    removed += count
        except OSError as e:
            raise RemoteError(f"{self.where}: {sentence(e)}") from None
        return removed
