"""Where entries live on disk: layout, atomic publishing, verified reads.

Layout under the cache root (``settings.root``)::

    op_cache.ini
    <soc>/<k0k1>/<key>/MANIFEST     one entry: its manifest and its artifacts
    <soc>/<k0k1>/<key>/<artifact>
    <soc>/_size/                    entry and byte counters of the chip folder
    .opcache/tmp/                   entries being built (same filesystem: rename)
    .opcache/trash/                 entries and chip folders being deleted
    .opcache/locks/<soc>/<key>      single-flight locks
    .opcache/stats/<soc>/           hit / miss / ... counters
    .opcache/direct/, tools/        wrap's notes: header lists, compiler digests

Entries are fanned out over 256 folders by the key's first two hex digits.
An entry is built in ``tmp`` and renamed into place, so a reader sees nothing
or a whole entry.  Deletion renames into ``trash`` first for the same reason,
and the trash is deleted in the background (``trash.py``).
Every read checks the manifest's own checksum and every artifact's size and
XXH3 digest (``entry.py``); nothing below the root is reached through a
symbolic link.

This module knows bytes and folders, not modes or aging: that is the cache's.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import fcntl
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import xxhash

from .. import fsutil, locks, trust
from .._log import get_logger
from .._record import Record
from ..counters import QUICK_COUNTS, CounterFiles
from ..request import is_plain_name, is_soc_version
from .cann_names import is_cann_chip
from .entry import (
    MANIFEST,
    MAX_MANIFEST,
    CorruptEntry,
    Entry,
    check_artifact,
    parse_manifest,
)

log = get_logger(__name__)

BOOKKEEPING = ".opcache"
SIZE_FOLDER = "_size"
_KEY = re.compile(r"[0-9a-f]{32}")
_BUCKET = re.compile(r"[0-9a-f]{2}")
# Build and trash folders are named <label>.<host>.<pid>.<random>: no dots in the host.
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", os.uname().nodename) or "host"
# O_NONBLOCK: a FIFO (or device) planted in an entry must not hang the open.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
# A folder a caller names (an out_dir, a build folder's parent), opened as named.
_ROOT_FLAGS = fsutil.DIR_FLAGS & ~os.O_NOFOLLOW
# An unlocked build folder of another host (whose locks may not reach us) gets
# this long; one of this host, whose locks do, a minute.
TMP_GRACE_SECONDS = 6 * 3600
STALE_LOCAL_SECONDS = 60
# Removals counted in one counter update while trimming.
_COUNT_EVERY = 64
# What a check reads of an artifact at once.
_CHUNK = 1 << 20
# Entries in one trash folder, deleted by one deleter process.
TRASH_FOLDER_ENTRIES = 50_000
# Times a store starts over when force or clear deletes the chip folder under it.
_PUBLISH_ATTEMPTS = 8
# Said of a folder made whose name holds another (left as it is) by the time it is opened.
_NOT_MADE = "is not the folder opcache made there: another was put in its place, left as it is"


# (root, chip) -> the thread whose recount holds that chip's counting lock.
_WALKERS: dict[tuple[Path, str], int] = {}
# A forked child holds no lock, whatever its parent's thread was doing.
os.register_at_fork(after_in_child=_WALKERS.clear)


class EntryInfo(Record):
    """An entry found by a scan: its key, when it was last used, its bytes if asked."""

    __slots__ = _fields = ("key", "stamp", "size")
    key: str
    stamp: float
    size: int

    def __init__(self, key: str, stamp: float, size: int = 0) -> None:
        self._init(locals())


def is_key(name: str) -> bool:
    return bool(_KEY.fullmatch(name))


class LocalStore:
    """The entries of one cache root on the local (or a mounted) filesystem."""

    def __init__(self, root: Path, *, modes: fsutil.Modes = fsutil.PRIVATE) -> None:
        # Resolved once, each link on the way judged by the same walk (the lstat
        # calls realpath makes): the root may be reached through links of this
        # user's or root's, never through another user's (then it is refused:
        # _root_refused); nothing below it may be a link.
        walk = trust.resolve_root(root)
        self.root = Path(walk.path)
        self._root_refused = walk.problem
        self.modes = modes
        # An entry whose manifest says more is corrupt, its artifacts never read
        # (a shared folder's remote sets it: held to its size cap as any remote is).
        self.max_entry_bytes: int | None = None
        # False for maintenance, which works only in a cache opcache stored in: a
        # folder put in the root's place since the command checked it (renames in a
        # team folder) gets no .opcache, and nothing of its is worked on.
        self.makes_bookkeeping = True
        book = self.root / BOOKKEEPING
        self.tmp_dir = book / "tmp"
        self.trash_dir = book / "trash"
        self.locks_dir = book / "locks"
        self.stats_dir = book / "stats"
        self._verified: set[Path] = set()
        self._only_owner: bool | None = None  # (see _owner_only)
        self._root_trusted = False  # (see _check_root)

    # -- paths ---------------------------------------------------------------

    def chip_dir(self, soc: str) -> Path:
        return self.root / soc

    def entry_dir(self, soc: str, key: str) -> Path:
        return self.root / soc / key[:2] / key

    def lock_path(self, soc: str, key: str) -> Path:
        """Where the single-flight lock of a key lives (its folder made and checked).

        Checked at every call, not once per process: a long-lived process must
        not make or delete lock files wherever a link swapped in since leads.
        """
        os.close(self.open_folder("locks", soc))
        return self.locks_dir / soc / key

    def stats_files(self, soc: str, *, create: bool = True) -> CounterFiles:
        """A chip's hit / miss / ... counters (their folder made on a write, if ``create``).

        Like the size counters (``sizes``), read without the trust rule (they
        are numbers to show, and root's cron may show a user's), but never
        through a link; written only in trusted folders.
        """

        def open_folder(write: bool) -> int:
            return self.open_folder("stats", soc, create=write and create, trusted=write)

        return CounterFiles(self.stats_dir / soc, modes=self.modes, open_folder=open_folder)

    def stats_chips(self) -> list[str]:
        """The chips ``.opcache/stats`` holds counters of (none if it cannot be listed).

        Read without the trust rule, as ``stats_files`` reads, but listed
        through a handle opened without following a link at any level: a
        link there would show another folder's names.
        """
        try:
            fd = self.open_folder("stats", create=False, trusted=False)
        except OSError:
            return []
        try:
            return [n for n in _names(fd) if is_soc_version(n)]
        finally:
            os.close(fd)

    def sizes(self, soc: str, chip_fd: int | None = None) -> CounterFiles:
        """The chip's entry and byte counters (in its folder, or the one open as ``chip_fd``)."""

        def open_folder(write: bool) -> int:
            return self._open_sizes(soc, chip_fd, create=write, trusted=write)

        return CounterFiles(
            self.chip_dir(soc) / SIZE_FOLDER, modes=self.modes, open_folder=open_folder
        )

    def _open_sizes(
        self, soc: str, chip_fd: int | None, *, create: bool, trusted: bool = True
    ) -> int:
        where = self.chip_dir(soc)
        if chip_fd is not None:
            return self._open_dir(SIZE_FOLDER, chip_fd, where, create=create, trusted=trusted)
        chip_fd = self._open_chip(soc, create=create, trusted=trusted)
        try:
            return self._open_dir(SIZE_FOLDER, chip_fd, where, create=create, trusted=trusted)
        finally:
            os.close(chip_fd)

    def open_folder(
        self, *parts: str, create: bool = True, trusted: bool = True, deleting: bool = False
    ) -> int:
        """A handle on ``<root>/.opcache/<parts>``, each level made if missing (with
        ``create``), opened without following a link and (if ``trusted``) trusted.

        Writers put lock files, counters, builds and trash here, and cleaning
        deletes in them: a link, or a folder others can write, would let them
        redirect what we write or delete (UntrustedFolder).  FileNotFoundError
        when a level is missing and not ``create``.  ``deleting``: the root is
        reached as ``_open_root`` reaches it to delete in.
        """
        try:
            fd = self._open_root(trusted, deleting=deleting)
        except FileNotFoundError:
            if not create:
                raise
            fsutil.makedirs(self.root, self.modes)
            fd = self._open_root(trusted, deleting=deleting)
        try:
            return self._open_below(fd, parts, create=create, trusted=trusted)
        finally:
            os.close(fd)

    def _open_below(
        self, root_fd: int, parts: tuple[str, ...], *, create: bool, trusted: bool = True
    ) -> int:
        """``open_folder``'s walk down from the root open as ``root_fd`` (left open)."""
        fd, where = root_fd, self.root
        try:
            for part in (BOOKKEEPING, *parts):
                made = create and (part != BOOKKEEPING or self.makes_bookkeeping)
                try:
                    child = self._open_dir(part, fd, where, create=made, trusted=trusted)
                except FileNotFoundError:
                    if made or part != BOOKKEEPING:
                        raise
                    raise FileNotFoundError(
                        errno.ENOENT,
                        f"no cache in {self.root}: it holds no {BOOKKEEPING} folder (moved away?)",
                    ) from None
                if fd != root_fd:
                    os.close(fd)
                fd, where = child, where / part
        except BaseException:
            if fd != root_fd:
                os.close(fd)
            raise
        return fd

    def folder(self, *parts: str) -> Path:
        """``<root>/.opcache/<parts>`` for callers that need a path, checked as
        ``open_folder`` checks it.

        Checked once per process: a trusted parent keeps its children in place.
        """
        path = self.root.joinpath(BOOKKEEPING, *parts)
        if path not in self._verified:
            os.close(self.open_folder(*parts))
            self._verified.add(path)
        return path

    def used(self, soc: str) -> tuple[int, int]:
        """(entries, bytes) of a chip folder, from its counters: no walk."""
        totals = self.sizes(soc).totals()
        return int(totals.get("entries", 0)), int(totals.get("bytes", 0))

    def read_note(self, *parts: str) -> bytes | None:
        """A small record under ``.opcache/<parts>``; None if absent or untrusted."""
        try:
            dir_fd = self.open_folder(*parts[:-1], create=False)
        except OSError:
            return None
        try:
            return self._note_in(dir_fd, parts[-1])
        finally:
            os.close(dir_fd)

    def _note_in(self, dir_fd: int, name: str) -> bytes | None:
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or trust.problem(st, self.modes):
                return None
            # The file's size, not the limit: a read allocates what it asks for.
            return os.read(fd, min(st.st_size + 1, MAX_MANIFEST))
        finally:
            os.close(fd)

    def write_note(self, data: bytes, *parts: str) -> None:
        """Replace the record under ``.opcache/<parts>`` whole (OSError if it cannot)."""
        dir_fd = self.open_folder(*parts[:-1])
        try:
            fsutil.write_atomic(parts[-1], data, self.modes, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def update_note(self, update: Callable[[bytes | None], bytes], *parts: str) -> None:
        """Replace the record under ``.opcache/<parts>`` whole with ``update(what it
        holds, as read_note reads it)``, read and written through one handle on its
        folder (OSError if it cannot be written).  The write replaces the file
        whole, but the read and the write are two steps: callers that may race
        hold a lock around it."""
        dir_fd = self.open_folder(*parts[:-1])
        try:
            data = update(self._note_in(dir_fd, parts[-1]))
            fsutil.write_atomic(parts[-1], data, self.modes, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def chips(self) -> list[str]:
        """The chip folders present under the root (real folders, not links, named as
        a soc_version may be, or as the chips of CANN's kernels pushed into a shared
        folder, ``is_cann_chip``: ``lost+found`` or ``notes by alice`` is no chip);
        none when the root cannot be listed or may not be used (another user's
        link on its way: the command that asked says why)."""
        try:
            root_fd = self._open_root(trusted=False)
        except OSError:
            return []
        try:
            return self._chips_in(root_fd)
        finally:
            os.close(root_fd)

    def _chips_in(self, root_fd: int) -> list[str]:
        """``chips`` of the root open as ``root_fd``."""
        chips = []
        for name in sorted(_names(root_fd)):
            if name.startswith(".") or not _is_real_dir(name, root_fd):
                continue
            if is_soc_version(name) or is_cann_chip(name):
                chips.append(name)
            else:
                # Someone else's: maintenance clears, ages and counts chips only.
                log.debug("%s is named as no chip: left alone", self.root / name)
        return chips

    # -- reading -------------------------------------------------------------

    def get(self, soc: str, key: str) -> Entry | None:
        """The verified entry, None if absent; CorruptEntry if it cannot be trusted.

        Raises UntrustedFolder when a folder or file on the way fails the trust
        rule (``trust.py``): nothing is read from it.  (A key with nothing at its
        entry's path, whatever the folders on the way, is a plain miss.)
        """
        got = self.get_with_manifest(soc, key)
        return None if got is None else got[0]

    def get_with_manifest(self, soc: str, key: str) -> tuple[Entry, bytes] | None:
        """``get``'s entry and its manifest's bytes (a shared folder's remote sends
        both on, as every remote does)."""
        # Nothing at the entry's path is a miss, told by one system call where
        # the folders opened one by one without links took seven, before every
        # remote look or compile.  Only a name that is absent answers so: what
        # is there is read the careful way, nothing is read through a link.
        # Only in a private cache whose root only its owner can write: the path's
        # lookup follows a link at the chip or bucket level, which then only its
        # owner can put there; where others may (a group's cache, a shared folder
        # remote, a root others write to) one to a mount that never answers would
        # hang every look.
        if self._owner_only():
            try:
                os.lstat(f"{self.root}/{soc}/{key[:2]}/{key}")
            except FileNotFoundError:
                return None
            except OSError:
                pass  # (the careful way says what is wrong)
        bucket_fd = self._open_bucket(soc, key)
        if bucket_fd is None:
            return None
        try:
            return self._get_in(bucket_fd, soc, key)
        finally:
            os.close(bucket_fd)

    def _owner_only(self) -> bool:
        """Whether only this user (or root) can put anything in the cache: a private
        cache whose root passes the private trust rule (looked at once)."""
        if self._only_owner is None:
            if self._root_refused is not None:
                return False
            try:
                st = os.stat(self.root)
            except OSError:
                return False  # (not there yet: asked again next time)
            private = self.modes.group is None
            self._only_owner = private and trust.problem(st, fsutil.PRIVATE) is None
        return self._only_owner

    @contextlib.contextmanager
    def reading(self, soc: str) -> Iterator[Callable[[str], Entry | None]]:
        """``get`` of many keys of one chip in a row (a batch's first look): the chip
        folder and each bucket opened and trusted once while it lasts, not once
        per key.  Each entry is still opened without links, trusted and checked
        whole, as ``get`` does.  For a moment's use: a chip folder that force or
        clear renames away meanwhile is only noticed at the next ``reading``.
        """
        folders: dict[str, int | None] = {}  # "" the chip folder, else a bucket

        def get(key: str) -> Entry | None:
            if "" not in folders:
                folders[""] = self._open_chip_if_there(soc)
            chip_fd = folders[""]
            if chip_fd is None:
                return None
            bucket = key[:2]
            if bucket not in folders:
                folders[bucket] = self._open_bucket_if_there(chip_fd, soc, bucket)
            bucket_fd = folders[bucket]
            got = None if bucket_fd is None else self._get_in(bucket_fd, soc, key)
            return None if got is None else got[0]

        try:
            yield get
        finally:
            for fd in folders.values():
                if fd is not None:
                    os.close(fd)

    def _open_bucket(self, soc: str, key: str) -> int | None:
        """The bucket folder of ``key`` (its chip folder's and its own trusted), or None."""
        chip_fd = self._open_chip_if_there(soc)
        if chip_fd is None:
            return None
        try:
            return self._open_bucket_if_there(chip_fd, soc, key[:2])
        finally:
            os.close(chip_fd)

    def _open_bucket_if_there(self, chip_fd: int, soc: str, bucket: str) -> int | None:
        """A bucket folder of the chip folder open as ``chip_fd`` (trusted), or None."""
        try:
            return self._open_dir(bucket, chip_fd, f"{self.root}/{soc}", create=False)
        except OSError as e:
            if e.errno in fsutil.GONE:
                return None
            raise

    def _get_in(self, bucket_fd: int, soc: str, key: str) -> tuple[Entry, bytes] | None:
        """``get_with_manifest`` of ``key`` in its bucket, open as ``bucket_fd``."""
        entry_fd = self._open_entry_in(bucket_fd, soc, key)
        if entry_fd is None:
            return None
        try:
            return self._read_entry(key, entry_fd)
        except CorruptEntry:
            # Removed by someone else while we read (the entry, or the whole chip
            # folder by force / clear, renamed aside then deleted): a plain miss.
            if not _still_linked(self.entry_dir(soc, key), entry_fd):
                return None
            raise
        except OSError as e:
            if e.errno in fsutil.GONE:
                return None  # deleted under us, or an NFS handle gone stale
            raise
        finally:
            os.close(entry_fd)

    def _open_entry(self, soc: str, key: str) -> tuple[int, int] | None:
        """File descriptors of the bucket and entry folders, opened without links.

        Every folder below the root must pass the trust rule (UntrustedFolder).
        """
        bucket_fd = self._open_bucket(soc, key)
        if bucket_fd is None:
            return None
        try:
            entry_fd = self._open_entry_in(bucket_fd, soc, key)
        except BaseException:
            os.close(bucket_fd)
            raise
        if entry_fd is None:
            os.close(bucket_fd)
            return None
        return bucket_fd, entry_fd

    def _open_entry_in(self, bucket_fd: int, soc: str, key: str) -> int | None:
        """The entry folder of ``key`` in its bucket (open as ``bucket_fd``), opened
        without a link and trusted (UntrustedFolder); None if it is not there.

        CorruptEntry when a link or a file stands in the entry's place.
        """
        try:
            entry_fd = os.open(key, fsutil.DIR_FLAGS, dir_fd=bucket_fd)
        except OSError as e:
            # O_DIRECTORY | O_NOFOLLOW on a link gives ENOTDIR (or ELOOP): tell a
            # link or a file in the entry's place from an entry that is not there.
            if e.errno in (errno.ENOTDIR, errno.ELOOP) and fsutil.lexists(key, bucket_fd):
                raise CorruptEntry("the entry is not a folder (a link or a file)") from None
            if e.errno in fsutil.GONE:
                return None
            raise
        return self._trusted(entry_fd, f"{self.root}/{soc}/{key[:2]}", key)

    def _read_entry(self, key: str, entry_fd: int) -> tuple[Entry, bytes]:
        raw, mtime, manifest = self._manifest(key, entry_fd)
        files = {}
        for name, size, want in manifest["artifacts"]:
            # One byte more than the manifest says: a longer file is caught too.
            files[name] = check_artifact(
                name, size, want, self._read_file(entry_fd, name, size + 1)[0]
            )
        seconds, modes, reads = manifest["compile_seconds"], manifest["modes"], manifest["reads"]
        return Entry(key, files, seconds, mtime, modes, reads), raw

    def _check_entry(self, key: str, entry_fd: int) -> int:
        """The bytes ``put`` counted for a sound entry (its manifest and artifacts), each
        artifact's digest taken a chunk at a time as it is read; CorruptEntry if it is
        not sound.  For ``verify``: memory flat in an artifact's size (a member's
        sparse file of 64 GiB, which its manifest says, costs a read, not 64 GiB)."""
        raw, _, manifest = self._manifest(key, entry_fd)
        total = len(raw)
        for name, size, want in manifest["artifacts"]:
            fd, _ = self._open_file(entry_fd, name)
            try:
                hasher = xxhash.xxh3_128()
                got = 0
                while got <= size:  # (a byte more than the manifest says: a longer file)
                    chunk = os.read(fd, min(size + 1 - got, _CHUNK))
                    if not chunk:
                        break
                    hasher.update(chunk)
                    got += len(chunk)
            finally:
                os.close(fd)
            if got != size:
                raise CorruptEntry(f"{name}: {got} bytes, the manifest says {size}")
            if hasher.hexdigest() != want:
                raise CorruptEntry(f"{name}: its digest does not match the manifest")
            total += size
        return total

    def _manifest(self, key: str, entry_fd: int) -> tuple[bytes, float, dict]:
        """(bytes, mtime, parsed) of an entry's manifest; CorruptEntry (maybe sound) when
        it says more bytes than ``max_entry_bytes``, before any artifact is read."""
        raw, mtime = self._read_file(entry_fd, MANIFEST, MAX_MANIFEST)
        manifest = parse_manifest(raw, key)
        if self.max_entry_bytes is not None:
            size = len(raw) + sum(size for _, size, _ in manifest["artifacts"])
            if size > self.max_entry_bytes:
                raise CorruptEntry(
                    f"the manifest says {size} bytes, over {self.max_entry_bytes}", maybe_sound=True
                )
        return raw, mtime, manifest

    def _open_file(self, dir_fd: int, name: str) -> tuple[int, os.stat_result]:
        """(a descriptor, its fstat) of a regular, trusted file in an entry."""
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOENT, errno.EISDIR, errno.ENXIO):
                raise CorruptEntry(f"{name}: {e.strerror}") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptEntry(f"{name}: not a regular file")
            trust.check(st, self.modes, f"the cache file {name}")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _read_file(self, dir_fd: int, name: str, limit: int) -> tuple[bytes, float]:
        """(up to ``limit`` bytes, mtime) of a regular, trusted file in an entry."""
        fd, st = self._open_file(dir_fd, name)
        try:
            chunks = []
            remaining = limit
            # What the file holds, and a byte more to see a longer one: a read
            # allocates what it asks for (4 MB a manifest, asking up to the limit).
            step = min(st.st_size + 1, 1 << 22)
            while remaining > 0:
                asked = min(remaining, step)
                chunk = os.read(fd, asked)
                if not chunk:
                    break
                chunks.append(chunk)
                remaining -= len(chunk)
                if len(chunk) < asked and limit - remaining >= st.st_size:
                    break  # short, with all fstat counted: the end (no read of b"" to say so)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks), st.st_mtime
        finally:
            os.close(fd)

    def stamp(self, soc: str, key: str) -> float | None:
        """The entry's last recorded access, or None if it is gone."""
        try:
            # Text, not Path: a trim asks this of every entry it removes.
            path = f"{self.root}/{soc}/{key[:2]}/{key}/{MANIFEST}"
            return os.stat(path, follow_symlinks=False).st_mtime
        except OSError:
            return None

    def touch(self, soc: str, key: str, when: float) -> None:
        """Record an access at ``when`` (the manifest's mtime holds it: atime is unreliable).

        An entry removed meanwhile (aged, cleared) is simply not stamped.
        """
        fds = self._open_entry(soc, key)
        if fds is None:
            return
        try:
            os.utime(MANIFEST, (when, when), dir_fd=fds[1], follow_symlinks=False)
        except PermissionError:
            # Setting a time needs ownership; in a group-shared cache another
            # member may own the entry. "Now" needs only write access.
            os.utime(MANIFEST, dir_fd=fds[1], follow_symlinks=False)
        except OSError as e:
            if e.errno not in fsutil.GONE:
                raise
        finally:
            os.close(fds[0])
            os.close(fds[1])

    def scan(
        self,
        soc: str,
        progress: Callable[[int], None] | None = None,
        *,
        sizes: bool = False,
    ) -> Iterator[EntryInfo]:
        """Every entry of a chip folder with its stamp (and its bytes if ``sizes``).

        Walks through folder handles and never through a link; a bucket that
        fails the trust rule is skipped with a warning.
        """
        for bucket_fd, key in self._entry_names(soc, progress):
            yield EntryInfo(key, *_entry_facts(bucket_fd, key, sizes))

    def check_each(
        self,
        soc: str,
        progress: Callable[[int], None] | None = None,
        unread: list[str] | None = None,
    ) -> Iterator[tuple[str, int | None, OSError | CorruptEntry | None]]:
        """Every entry of a chip folder read and checked as ``get`` checks it, in one
        walk: (key, its bytes, None) for a sound entry, (key, 0, CorruptEntry) for
        one to remove, (key, the bytes of its files or None when they cannot be
        listed, OSError) for one that could not be checked.  An entry gone
        meanwhile (force, clear) is left out.

        Each folder and file is opened, and its metadata read, once: a walk for
        sizes followed by a ``get`` of each read everything twice.  Buckets that
        cannot be read are warned about and added to ``unread``.
        """
        for bucket_fd, key in self._entry_names(soc, progress, unread):
            checked = self._check_in(bucket_fd, soc, key)
            if checked is not None:
                yield checked

    def _check_in(
        self, bucket_fd: int, soc: str, key: str
    ) -> tuple[str, int | None, OSError | CorruptEntry | None] | None:
        try:
            entry_fd = self._open_entry_in(bucket_fd, soc, key)
        except CorruptEntry as e:
            return key, 0, e
        except OSError as e:
            with contextlib.suppress(OSError):
                return key, _folder_bytes(key, bucket_fd), e
            return key, None, e
        if entry_fd is None:
            return None
        try:
            size = self._check_entry(key, entry_fd)
        except CorruptEntry as e:
            if not _still_linked(self.entry_dir(soc, key), entry_fd):
                return None
            return key, 0, e
        except OSError as e:
            if e.errno in fsutil.GONE:
                return None
            with contextlib.suppress(OSError):
                return key, _files_bytes(entry_fd), e
            return key, None, e
        finally:
            os.close(entry_fd)
        return key, size, None

    def _entry_names(
        self,
        soc: str,
        progress: Callable[[int], None] | None,
        unread: list[str] | None = None,
    ) -> Iterator[tuple[int, str]]:
        """(its bucket's handle, key) of every entry name in a chip folder, a bucket at a time.

        Only one bucket's names are held at once, a 256th of the entries (4,000
        names at a million), never the whole list.  A bucket that is there but
        cannot be read (another member's, not open to the group) is skipped with
        a warning, and added to ``unread``: its entries are not in the walk.
        """
        chip_fd = self._open_chip_if_there(soc)
        if chip_fd is None:
            return
        any_key = is_cann_chip(soc)  # (a CANN kernel's name, not a key)
        try:
            buckets = sorted(
                n
                for n in os.listdir(chip_fd)
                if _BUCKET.fullmatch(n) or (any_key and len(n) == 2 and not n.startswith("."))
            )
            for done, bucket in enumerate(buckets, 1):
                try:
                    bucket_fd = self._open_dir(bucket, chip_fd, self.chip_dir(soc), create=False)
                except trust.UntrustedFolder as e:
                    log.warning("skipping %s", e)
                    continue
                except OSError as e:
                    if e.errno not in fsutil.GONE:  # (else removed meanwhile)
                        self._unread(soc, bucket, e, unread)
                    continue
                try:
                    names = os.listdir(bucket_fd)
                except OSError as e:
                    self._unread(soc, bucket, e, unread)
                    names = []
                try:
                    for name in names:
                        if (any_key or is_key(name)) and name.startswith(bucket):
                            yield bucket_fd, name
                finally:
                    os.close(bucket_fd)
                if progress:
                    progress(done * 100 // len(buckets))
        finally:
            os.close(chip_fd)

    # -- writing -------------------------------------------------------------

    @contextlib.contextmanager
    def _new_workdir(self, key: str) -> Iterator[Workdir]:
        """A fresh private folder on the cache's filesystem for building an entry,
        removed on leaving (a failure to remove is only logged: cleaning takes it).

        It stays locked while open, so that cleaning knows its writer is alive
        however long the compile takes.
        """
        tmp_fd = self.open_folder("tmp")
        workdir = new_build_folder(self.tmp_dir, key, self.modes.dir_bits, tmp_fd)
        try:
            fsutil.fix_new_folder(workdir.fd, self.modes)
            yield workdir
        finally:
            try:
                workdir.close()
            except OSError as e:
                log.debug("cannot remove %s: %s", workdir.path, e)

    def put(
        self, soc: str, key: str, manifest: bytes, files: dict[str, bytes], *, now: float
    ) -> int | None:
        """Store the entry of ``key``: its ``manifest`` (``entry.make_manifest``) and ``files``.

        The entry is built aside and appears whole.  Returns the bytes stored,
        or None when another writer stored the key first (its entry stands;
        ours is dropped).  ``now`` is the entry's first access stamp.  Raises
        OSError when the cache cannot be written, UntrustedFolder when the chip
        folder fails the trust rule, ValueError for a key that cannot name an
        entry or an artifact name that is not a plain file name (or is the manifest's).
        """
        _check_names(files, key)
        with self._new_workdir(key) as workdir:
            size = self._write_entry(workdir.fd, manifest, files, now)
            with self._counting(soc):
                return self._publish_counted(soc, key, workdir, size)

    def put_many(
        self, soc: str, entries: list[tuple[str, bytes, dict[str, bytes]]], *, now: float
    ) -> list[int | None]:
        """``put`` of several entries (key, manifest, files): the bytes each stored, or
        None where another writer's entry stands.

        For a batch of remote hits: the entries are built in one folder, counted
        a chunk at a time, and renamed into place (one lock, one handle on the
        chip folder).  Raises as ``put`` does; a failure stores none of those
        not yet in place.
        """
        for key, _, files in entries:
            _check_names(files, key)
        with self._new_workdir("batch") as workdir:
            sizes = []
            for key, manifest, files in entries:
                entry_fd = fsutil.make_folder(key, self.modes.dir_bits, workdir.fd, warn=False)
                if entry_fd is None:  # (a member's folder put in its place: it is left)
                    raise trust.UntrustedFolder(f"{workdir.path}/{key} {_NOT_MADE}")
                try:
                    fsutil.fix_new_folder(entry_fd, self.modes)
                    sizes.append(self._write_entry(entry_fd, manifest, files, now))
                finally:
                    os.close(entry_fd)
            with self._counting(soc):
                return self._publish_batch(soc, [key for key, _, _ in entries], workdir, sizes)

    def _write_entry(
        self, dir_fd: int, manifest: bytes, files: dict[str, bytes], now: float
    ) -> int:
        """Write an entry's files into the new folder open as ``dir_fd``; its bytes."""
        file_mode = self.modes.file_bits
        # Exact in a group-shared cache, whatever the umask; a private one's are
        # the umask's, as the open made them (a system call a file, a sixth of a
        # remote hit's copy).
        exact = self.modes.group is not None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for name, data in (*files.items(), (MANIFEST, manifest)):
            fd = os.open(name, flags, file_mode, dir_fd=dir_fd)
            try:
                if exact:
                    os.fchmod(fd, file_mode)
                fsutil.write_all(fd, data)  # (not a file object: its fstat, ioctl and lseek)
            finally:
                os.close(fd)
        os.utime(MANIFEST, (now, now), dir_fd=dir_fd, follow_symlinks=False)
        return len(manifest) + sum(map(len, files.values()))

    def _publish_batch(
        self, soc: str, keys: list[str], workdir: Workdir, sizes: list[int]
    ) -> list[int | None]:
        """``_publish_counted`` for the entries ``keys`` built in ``workdir``: when
        force or clear deletes the chip folder under it, the entries not yet
        renamed start over in a new one (nothing is written again)."""
        stored: dict[str, int | None] = {}
        for _attempt in range(_PUBLISH_ATTEMPTS):
            rest = [(key, size) for key, size in zip(keys, sizes, strict=True) if key not in stored]
            try:
                self._publish_chunks(soc, rest, workdir, stored)
            except OSError as e:
                if e.errno not in fsutil.GONE:
                    raise
                continue  # the chip folder was deleted under us: a new one then
            return [stored[key] for key in keys]
        raise OSError(errno.ENOENT, "the chip folder keeps disappearing", str(self.chip_dir(soc)))

    def _publish_chunks(
        self,
        soc: str,
        entries: list[tuple[str, int]],
        workdir: Workdir,
        stored: dict[str, int | None],
    ) -> None:
        """Rename ``entries`` into place, each chunk counted before its renames (as
        ``_publish_in_chip`` does, for the same reason) and its misses counted
        out after: a process killed half way leaves at most a chunk over-counted,
        not the batch.  ``stored`` gets each key's bytes, None if another's stands.
        """
        chip_fd = self._open_chip(soc, create=True)
        buckets: dict[str, int] = {}
        try:
            for start in range(0, len(entries), _COUNT_EVERY):
                chunk = entries[start : start + _COUNT_EVERY]
                self._count(
                    chip_fd, soc, {"entries": len(chunk), "bytes": sum(s for _, s in chunk)}
                )
                try:
                    for key, size in chunk:
                        bucket_fd = buckets.get(key[:2])
                        if bucket_fd is None:
                            bucket_fd = self._open_dir(
                                key[:2], chip_fd, self.chip_dir(soc), create=True
                            )
                            buckets[key[:2]] = bucket_fd
                        try:
                            os.rename(key, key, src_dir_fd=workdir.fd, dst_dir_fd=bucket_fd)
                        except OSError as e:
                            if not _taken(e, key, bucket_fd):
                                raise
                            stored[key] = None
                            continue
                        stored[key] = size
                finally:
                    missed = [size for key, size in chunk if stored.get(key) is None]
                    if missed:
                        self._uncount_many(chip_fd, soc, len(missed), sum(missed))
        finally:
            for fd in buckets.values():
                os.close(fd)
            os.close(chip_fd)

    def _publish_counted(self, soc: str, key: str, workdir: Workdir, size: int) -> int | None:
        for _attempt in range(_PUBLISH_ATTEMPTS):
            try:
                return size if self._publish_in_chip(soc, key, workdir, size) else None
            except OSError as e:
                if e.errno not in fsutil.GONE:
                    raise
                # The chip folder was deleted under us: a new one then.
        raise OSError(errno.ENOENT, "the chip folder keeps disappearing", str(self.chip_dir(soc)))

    def _publish_in_chip(self, soc: str, key: str, workdir: Workdir, size: int) -> bool:
        """Count the entry, then rename it into place; False if another writer's stands.

        In that order (both under the counting lock, shared): an entry anyone
        can see, and so remove and count out, is always counted.  Counting after
        the rename left an entry uncounted for good when that count failed (a
        full disk), and the counters too low until a verify.  A rename that
        fails takes its count back; if even that fails, a warning says so.
        """
        # The entry and its counters go through one handle on the chip folder:
        # if force or clear renames that folder away meanwhile, both go with it.
        chip_fd = self._open_chip(soc, create=True)
        try:
            bucket_fd = self._open_dir(key[:2], chip_fd, self.chip_dir(soc), create=True)
            try:
                self._count(chip_fd, soc, {"entries": 1, "bytes": size})
                try:
                    os.rename(
                        workdir.path.name, key, src_dir_fd=workdir.parent_fd, dst_dir_fd=bucket_fd
                    )
                except OSError as e:
                    self._uncount(chip_fd, soc, size)
                    if _taken(e, key, bucket_fd):
                        return False
                    raise
            finally:
                os.close(bucket_fd)
        finally:
            os.close(chip_fd)
        return True

    def _uncount(self, chip_fd: int, soc: str, size: int) -> None:
        self._uncount_many(chip_fd, soc, 1, size)

    def _uncount_many(self, chip_fd: int, soc: str, entries: int, size: int) -> None:
        try:
            self._count(chip_fd, soc, {"entries": -entries, "bytes": -size})
        except OSError as e:
            log.warning(
                "the counters of %s count an entry that was not stored (%s): "
                "`opcache verify` sets them right",
                soc,
                e,
            )

    def discard(self, soc: str, key: str) -> int | None:
        """Remove one entry; returns its bytes, or None if it was already gone."""
        with self.discarding(soc) as remove:
            return remove(key)

    @contextlib.contextmanager
    def discarding(self, soc: str, *, later: bool = False) -> Iterator[Callable[[str], int | None]]:
        """A remover of a chip's entries (bytes, or None if gone), for many at once.

        One lock, one handle per folder, and one counter update at the end:
        trimming 100,000 entries should cost their deletion, not 100,000 of
        everything else.  With ``later``, an entry is only renamed into a
        trash folder, deleted by a detached process (``trash.py``) once the
        batch is done or the folder full: the caller pays a rename per entry,
        not a deletion.
        """
        root_fd = self._open_root(deleting=True)
        try:
            trash_fd = self._open_below(root_fd, ("trash",), create=True)
        except BaseException:
            os.close(root_fd)
            raise
        try:
            folders = _TrashFolders(trash_fd, f"{soc}.{_HOST}", self.modes)
            try:
                with self._counting(soc):
                    chip_fd = self._open_chip_if_there(soc, root_fd)
                    if chip_fd is None:
                        yield lambda key: None
                        return
                    with self._remover(soc, chip_fd, folders, later) as remove:
                        yield remove
            finally:
                folders.close()
        finally:
            os.close(trash_fd)
            os.close(root_fd)

    @contextlib.contextmanager
    def _remover(
        self,
        soc: str,
        chip_fd: int,
        folders: _TrashFolders,
        later: bool,
    ) -> Iterator[Callable[[str], int | None]]:
        buckets: dict[str, int | None] = {}
        removed = {"entries": 0, "bytes": 0}
        counting = [True]  # (False once a count now and then failed: left for the end)

        def remove(key: str) -> int | None:
            bucket = key[:2]
            if bucket not in buckets:
                try:
                    buckets[bucket] = self._open_dir(
                        bucket, chip_fd, f"{self.root}/{soc}", create=False
                    )
                except OSError as e:
                    if e.errno not in fsutil.GONE:
                        raise
                    buckets[bucket] = None
            bucket_fd = buckets[bucket]
            if bucket_fd is None:
                return None
            size = _into_trash(key, bucket_fd, folders.fd, folders.next(), later=later)
            if size is None:
                return None
            removed["entries"] -= 1
            removed["bytes"] -= size
            if removed["entries"] <= -_COUNT_EVERY and counting[0]:
                # Now and then, so that a killed trimmer leaves little uncounted.  The
                # entry is in the trash whatever the count does: a count that fails
                # (a counter lock another holds) must not make it look kept, or a
                # trim goes on past what it had to free.
                try:
                    self._count(chip_fd, soc, removed)
                except OSError as e:
                    log.debug("counting the removals of %s later: %s", soc, e)
                    counting[0] = False
                else:
                    removed.update(entries=0, bytes=0)
            return size

        try:
            yield remove
        finally:
            for fd in buckets.values():
                if fd is not None:
                    os.close(fd)
            try:
                self._count(chip_fd, soc, removed)
            except OSError as e:  # (the removals are done: only their count is not)
                if removed["entries"]:
                    log.warning(
                        "the counters of %s still count %d entries removed (%s): "
                        "`opcache verify` sets them right",
                        soc, -removed["entries"], e,
                    )  # fmt: skip
            finally:
                os.close(chip_fd)

    def _open_chip_if_there(self, soc: str, root_fd: int | None = None) -> int | None:
        """The chip folder's handle, or None when there is no such folder (yet, or any more)."""
        try:
            if root_fd is not None:
                return self._open_dir(soc, root_fd, self.root, create=False)
            return self._open_chip(soc, create=False)
        except OSError as e:
            if e.errno in fsutil.GONE:
                return None
            raise

    def check_root(self) -> None:
        """UntrustedFolder when the root may not be used (``_check_root``): for a command
        that would otherwise find nothing there and say so."""
        self._check_root()

    def _check_root(self) -> None:
        """UntrustedFolder when the root itself may not be used: another user's link on
        its way (found when it was resolved, ``_root_refused``: no system call), or
        ``trust.root_problem``'s rule of a group-shared root anyone could have made
        or written in.  That rule is judged until it passes once: a root that passes
        is only ever replaced by whoever may write where it is, which that rule has
        already judged."""
        if self._root_refused is not None:
            raise trust.UntrustedFolder(self._root_refused)
        if not self._root_trusted:
            if self.modes.group is not None:
                resolved = trust.check_root(self.root, self.modes)
                if resolved != str(self.root):  # (a link put in its place since)
                    raise trust.UntrustedFolder(f"{self.root} now leads to {resolved}")
            self._root_trusted = self.modes.group is None or os.path.isdir(self.root)

    def _open_root(self, trusted: bool = True, *, deleting: bool = False) -> int:
        """A handle on the root, judged by ``_check_root`` first if ``trusted``.

        The root was resolved: it is opened without following a link at its last
        step (one put there since is followed only as ``trust.open_root`` follows
        it).  With ``deleting``, it is reached one folder at a time from ``/``,
        no link followed on the way but this user's and root's
        (``trust.open_root``): what is deleted in is then the folder that walk
        judged, whatever is swapped above it meanwhile.  That costs an open per
        folder on the way, so only where deleting: a hit opens it as named.
        """
        if self._root_refused is not None:
            raise trust.UntrustedFolder(self._root_refused)
        if trusted:
            self._check_root()
        if not deleting:
            try:
                return os.open(self.root, fsutil.DIR_FLAGS)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
        return trust.open_root(self.root, self.modes if trusted else None)[0]

    def _open_chip(self, soc: str, *, create: bool, trusted: bool = True) -> int:
        # Every hit comes here: one open in the common case.  The root is a
        # resolved path (each link on its way judged; nothing below it may be
        # a link), and O_NOFOLLOW guards the chip folder itself.
        if self._root_refused is not None:
            raise trust.UntrustedFolder(self._root_refused)
        if trusted:
            self._check_root()
        try:
            fd = os.open(f"{self.root}/{soc}", fsutil.DIR_FLAGS)
        except OSError:
            pass  # missing, a link, a file...: the careful way below makes or names it
        else:
            return self._trusted(fd, self.root, soc) if trusted else fd
        root_fd = self._open_root(trusted)
        try:
            return self._open_dir(soc, root_fd, self.root, create=create, trusted=trusted)
        finally:
            os.close(root_fd)

    def _trusted(self, fd: int, parent: Path | str, name: str) -> int:
        """``fd`` if the folder it holds passes the trust rule; else closed, UntrustedFolder."""
        try:
            trust.check(os.fstat(fd), self.modes, f"{parent}/{name}")
        except trust.UntrustedFolder:
            os.close(fd)
            raise
        return fd

    def _open_dir(
        self, name: str, parent_fd: int, parent: Path | str, *, create: bool, trusted: bool = True
    ) -> int:
        """A folder under ``parent_fd``, never through a link, trusted unless ``trusted``
        is False; made if asked."""
        try:
            fd = os.open(name, fsutil.DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                raise
            fd = None  # made below: an open is cheaper than a failing mkdir
        except OSError as e:
            if e.errno in (errno.ENOTDIR, errno.ELOOP) and fsutil.lexists(name, parent_fd):
                raise trust.UntrustedFolder(f"{parent}/{name} is a link or a file") from None
            raise
        if fd is None:
            try:
                fd = fsutil.make_folder(name, self.modes.dir_bits, parent_fd, warn=False)
            except FileExistsError:  # (made by another meanwhile)
                return self._open_dir(name, parent_fd, parent, create=False, trusted=trusted)
            if fd is None:
                # Another folder was put in place of the one made, between the mkdir and
                # the open (by a member who may write in the folder above): neither
                # changed nor used.
                raise trust.UntrustedFolder(f"{parent}/{name} {_NOT_MADE}")
            fsutil.fix_new_folder(fd, self.modes)
        return self._trusted(fd, parent, name) if trusted else fd

    def _count(
        self, chip_fd: int, soc: str, deltas: dict[str, float], *, reset: bool = False
    ) -> None:
        """Move (or, with ``reset``, set) the size counters of the chip folder open
        as ``chip_fd`` by ``deltas``.

        A chip folder that force or clear deleted meanwhile took the entry with
        it: there is nothing left to count then, and no error.
        """
        try:
            counters = self.sizes(soc, chip_fd)
            if reset:
                counters.reset(deltas)
            else:
                counters.add(deltas)
        except OSError as e:
            if e.errno not in fsutil.GONE:
                raise
            log.debug("the chip folder %s was deleted meanwhile; not counted", soc)

    def clear_chip(self, soc: str, *, only_in_a_cache: bool = False) -> bool:
        """Remove a whole chip folder at once; True if there was one.

        The folder is renamed into the trash: processes using it see misses,
        never half-deleted entries, and its deletion runs in the background.
        ``only_in_a_cache`` (maintenance: ``opcache clear``, ``remote clear``):
        only where the root holds ``.opcache``, which every cache opcache has
        stored in holds, trusted (FileNotFoundError, UntrustedFolder), and only
        what opcache made in the chip folder (``_clear_own_parts``): a chip
        folder is any folder named as a chip may be (``src``, ``docs``), and
        one store into a root named by mistake (a home, a share's top) makes
        ``.opcache`` there.  (A compile's ``force`` clears the whole folder
        before its first store, as CANN's does.)
        """
        from .. import trash  # (not on a hit's start-up)

        # The root reached without following another user's link, and the chip
        # folder renamed from that handle: only ever a folder of the root judged.
        try:
            root_fd = self._open_root(deleting=True)
        except FileNotFoundError:
            return False  # nothing to clear: create nothing either
        try:
            if not fsutil.lexists(soc, root_fd):
                return False
            own_parts = only_in_a_cache and not is_cann_chip(soc)
            if only_in_a_cache:
                self._check_bookkeeping(root_fd)
            trash_fd = self._open_below(root_fd, ("trash",), create=True)
            try:
                folder = trash.new_folder(trash_fd, f"{soc}.{_HOST}", self.modes)
                try:
                    if own_parts:
                        return self._clear_own_parts(soc, root_fd, trash_fd, folder)
                    return _into_trash(soc, root_fd, trash_fd, folder, later=True) is not None
                finally:
                    if folder is not None:
                        trash.delete_later(trash_fd, *folder)
            finally:
                os.close(trash_fd)
        finally:
            os.close(root_fd)

    def _clear_own_parts(
        self, soc: str, root_fd: int, trash_fd: int, folder: tuple[str, int] | None
    ) -> bool:
        """Move what opcache made in the chip folder ``soc`` into the trash ``folder``:
        its buckets and size counters, each told by its name and by the names in it
        (``_own_part``).  Anything else stays (CANN's kernels beside opcache's entries,
        or a folder of yours in a root named by mistake: ``~/db/schema.sql``), and so
        does the chip folder then.  True if anything was moved."""
        where = f"{self.root}/{soc}"
        # Stores held off meanwhile: the buckets and their counters go together, as
        # when the whole folder went in one rename.
        with self.counting_paused(soc):
            chip_fd = self._open_dir(soc, root_fd, self.root, create=False)
            try:
                names = _names(chip_fd)
                own = [name for name in names if _own_part(name, chip_fd)]
                for name in own:
                    if folder is None:  # (no trash folder of ours: each part deleted now)
                        _into_trash(name, chip_fd, trash_fd, None, later=False)
                    else:
                        _rename_if_there(name, chip_fd, name, folder[1])
            finally:
                os.close(chip_fd)
        left = [name for name in names if name not in own]
        if not left:
            with contextlib.suppress(OSError):  # (a store may have begun since)
                os.rmdir(soc, dir_fd=root_fd)
            return bool(own)
        what = "a file or folder" if len(left) == 1 else f"{len(left)} files and folders"
        log.warning("%s: left %s opcache did not make there", where, what)
        if any(_BUCKET.fullmatch(name) for name in left):
            # A bucket kept for a file of someone else's keeps its entries, which the
            # counters gone with the rest no longer count.
            self.recount(soc)
        return bool(own)

    def _check_bookkeeping(self, root_fd: int) -> None:
        """FileNotFoundError unless the root open as ``root_fd`` holds ``.opcache``;
        UntrustedFolder unless it is a folder that passes the trust rule."""
        try:
            os.close(self._open_dir(BOOKKEEPING, root_fd, self.root, create=False))
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT,
                f"no cache in {self.root}: it holds no {BOOKKEEPING} folder, as every "
                "cache opcache has stored in does, so nothing in it is cleared",
            ) from None

    def _unread(self, soc: str, bucket: str, error: OSError, unread: list[str] | None) -> None:
        path = self.chip_dir(soc) / bucket
        log.warning("skipping %s, which cannot be read: %s", path, error.strerror or error)
        if unread is not None:
            unread.append(str(path))

    def recount(self, soc: str, progress: Callable[[int], None] | None = None) -> tuple[int, int]:
        """Walk a chip folder and set its counters to what is there (left as they
        were when a bucket cannot be read: the walk did not see all of it)."""
        with self.counting_paused(soc):
            entries = total = 0
            unread: list[str] = []
            for bucket_fd, key in self._entry_names(soc, progress, unread):
                entries += 1
                total += _entry_facts(bucket_fd, key, True)[1]
            if not unread:
                self.set_used(soc, entries, total)
        return entries, total

    @contextlib.contextmanager
    def counting_paused(self, soc: str) -> Iterator[None]:
        """Hold off every store and removal of a chip (in any process) meanwhile.

        For a walk that resets the counters: a store counted between the walk
        and the reset would be lost.  This thread's own removals go on.
        """
        with self._count_lock(soc, shared=False):
            _WALKERS[(self.root, soc)] = _thread.get_ident()
            try:
                yield
            finally:
                del _WALKERS[(self.root, soc)]

    @contextlib.contextmanager
    def _counting(self, soc: str) -> Iterator[None]:
        """Shared with other stores and removals; waits while a recount walks."""
        if _WALKERS.get((self.root, soc)) == _thread.get_ident():
            yield  # this thread is the walker: it holds the lock already
            return
        with self._count_lock(soc, shared=True):
            yield

    @contextlib.contextmanager
    def locked(
        self, name: str, *, shared: bool = False, timeout: float | None = None
    ) -> Iterator[None]:
        """Hold the lock file ``.opcache/locks/<name>`` (``locks.flocked``).

        Through a handle on the locks folder opened and checked now, not a path
        checked once: in a long-lived process the folder may have been swapped
        for a link since.
        """
        with contextlib.ExitStack() as held:
            locks_fd = self.open_folder("locks")
            try:
                held.enter_context(
                    locks.flocked(name, self.modes, shared=shared, dir_fd=locks_fd, timeout=timeout)
                )
            finally:
                os.close(locks_fd)
            yield

    def _count_lock(self, soc: str, *, shared: bool) -> contextlib.AbstractContextManager[None]:
        return self.locked(f"{soc}.count", shared=shared)

    def set_used(self, soc: str, entries: int, size: int) -> None:
        """Set a chip's counters to a walk's result (walk and set under ``counting_paused``)."""
        chip_fd = self._open_chip_if_there(soc)
        if chip_fd is None:
            return
        try:
            self._count(chip_fd, soc, {"entries": entries, "bytes": size}, reset=True)
        finally:
            os.close(chip_fd)

    def clean_leftovers(self, now: float | None = None) -> int:
        """Delete build folders of dead writers, trash no deleter is working on, and
        temp files of killed writers; returns how many.

        Each folder is opened without following a link, must pass the trust
        rule, and is listed and deleted in through that handle: a link in a
        bookkeeping folder's place would lead the deletion into whatever folder
        it names (root's cron ``opcache age`` would empty a folder of root's
        that a user's link names).  A folder that may not be used is skipped:
        what uses it for its own work (a store, a trim) says why, once.
        """
        from .. import trash  # (not on a hit's start-up)

        now = time.time() if now is None else now

        def clean(open_folder: Callable[[], int], action: Callable[[int], int]) -> int:
            try:
                fd = open_folder()
            except OSError as e:
                # Not there (yet, or any more), not readable, or not to be trusted.
                log.debug("not cleaning: %s", e)
                return 0
            try:
                return action(fd)
            finally:
                os.close(fd)

        # Temp files of small atomic writes (counters, op_cache.ini) of killed
        # writers: such a write takes microseconds, so a minute-old one is dead.
        stale = partial(_remove_stale_temps, now=now)

        def root_temps(root_fd: int) -> int:
            # The root's own trust is another matter (it is the user's to choose),
            # but nothing is deleted in a root that fails the rule.
            return 0 if trust.problem(os.fstat(root_fd), self.modes) else stale(root_fd)

        def each_chip_stats(stats_fd: int) -> int:
            return sum(
                clean(partial(self._open_dir, soc, stats_fd, self.stats_dir, create=False), stale)
                for soc in _names(stats_fd)
            )

        def below(*parts: str) -> int:
            return self._open_below(root_fd, parts, create=False)

        def sizes(soc: str) -> int:
            chip_fd = self._open_dir(soc, root_fd, self.root, create=False)
            try:
                return self._open_sizes(soc, chip_fd, create=False)
            finally:
                os.close(chip_fd)

        # Every folder reached from one handle on the root, reached as it is to
        # delete in (``_open_root``): never through another user's link.
        try:
            root_fd = self._open_root(deleting=True)
        except OSError as e:
            log.debug("not cleaning: %s", e)
            return 0
        try:
            removed = clean(partial(below, "trash"), trash.sweep)
            removed += clean(partial(below, "tmp"), partial(_remove_abandoned, now=now))
            removed += clean(partial(os.dup, root_fd), root_temps)
            for soc in self._chips_in(root_fd):
                removed += clean(partial(sizes, soc), stale)
            removed += clean(partial(below, "stats"), each_chip_stats)
        finally:
            os.close(root_fd)
        return removed


def _taken(error: OSError, key: str, bucket_fd: int) -> bool:
    """Whether a rename of an entry to ``key`` failed because the name is taken: by
    another writer's entry, or by a file or link planted there (ENOTDIR, not a
    chip folder gone: that one is another's to remove, or verify's)."""
    if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
        return True
    return error.errno == errno.ENOTDIR and fsutil.lexists(key, bucket_fd)


def _check_names(files: dict[str, bytes], key: str) -> None:
    # Its first two characters name its bucket: never "..", "." or a dot-folder of
    # the cache's own.  (A remote folder's keys are CANN kernels' names too.)
    if not is_plain_name(key) or len(key) < 2 or key.startswith("."):
        raise ValueError(f"{key!r} cannot name an entry")
    for name in files:
        if not is_plain_name(name) or name == MANIFEST:
            raise ValueError(f"artifact name {name!r} is not a plain file name")


class Workdir:
    """A build folder and the lock that says its writer is alive.

    ``fd`` is the folder, ``parent_fd`` the folder it was made in: what is done
    in it goes through them, not through a path a link could now lead elsewhere.
    A marked one (``new_build_folder``'s ``marked``) is the folder inside the
    locked one; ``parent_fd`` is still the folder both were made in.
    """

    def __init__(
        self, path: Path, fd: int, parent_fd: int, outer: tuple[str, int] | None = None
    ) -> None:
        self.path = path
        self.fd = fd
        self.parent_fd = parent_fd
        self._outer = outer  # (name, fd) of the locked folder holding a marked one
        self._open = True

    def close(self) -> None:
        """Unlock, then delete what is left of the folder (nothing, once published)."""
        if not self._open:
            return
        self._open = False
        try:
            # Only if the name still is our folder: whoever can write in the
            # parent (an out_dir) could have put another folder in its place.
            # Held locked until gone, so no clean-up takes it for abandoned.
            if self._outer is None:
                fsutil.remove_made(self.path.name, self.fd, self.parent_fd)
            else:
                name, outer_fd = self._outer
                fsutil.remove_made(self.path.name, self.fd, outer_fd)
                fsutil.remove_made(name, outer_fd, self.parent_fd)
        finally:
            os.close(self.fd)
            if self._outer is not None:
                os.close(self._outer[1])
            os.close(self.parent_fd)


# The folder a marked build folder holds, named by its random part: it is the
# compile's folder and the mark that opcache made the one it is in.
_WORK_LABEL = ".opcache-work"
# Times a new build folder is made again when another is put in its place at once.
_BUILD_TRIES = 8


def new_build_folder(
    parent: Path, label: str, dir_bits: int, parent_fd: int | None = None, *, marked: bool = False
) -> Workdir:
    """A fresh folder ``<label>.<host>.<pid>.<random>`` in ``parent``, locked while open.

    The lock tells ``remove_abandoned`` that its writer is alive, however long
    the compile takes.  ``parent_fd``, if given, is ``parent`` already open
    (the Workdir takes it over); else ``parent`` is opened as named.

    ``marked``, for a folder others may write in (an out_dir): the Workdir is
    the folder ``.opcache-work.<random>`` inside it, which marks it as made by
    opcache.  Anyone who may write in ``parent`` may rename a folder of yours
    there to a build folder's name (a rename within one folder needs no
    permission on the folder renamed), but cannot put that folder in it.
    """
    if parent_fd is None:
        parent_fd = os.open(parent, _ROOT_FLAGS)
    try:
        for _ in range(_BUILD_TRIES):
            name = fsutil.unique_name(f"{label}.{_HOST}")
            fd = fsutil.make_folder(name, dir_bits, parent_fd)
            if fd is not None:
                break
        else:
            raise OSError(errno.EAGAIN, "other folders keep being put in place of new ones", parent)
    except BaseException:
        os.close(parent_fd)
        raise
    try:
        # Waited for, not tried once: a clean-up looking for dead writers' folders
        # (remove_abandoned, clean_leftovers) may hold this one's lock for the
        # microseconds of its look, between our mkdir and this flock.
        locks.flock_within(fd, parent / name)
        if not marked:
            return Workdir(parent / name, fd, parent_fd)
        work = f"{_WORK_LABEL}.{name.rsplit('.', 1)[1]}"
        # (in a folder only this user may write in: nobody else can swap it)
        os.mkdir(work, dir_bits, dir_fd=fd)
        work_fd = os.open(work, fsutil.DIR_FLAGS, dir_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            fsutil.remove_made(name, fd, parent_fd)
        os.close(fd)
        os.close(parent_fd)
        raise
    return Workdir(parent / name / work, work_fd, parent_fd, (name, fd))


def remove_abandoned(folder: Path, now: float, label: str | None = None) -> int:
    """Delete the build folders in ``folder`` whose writers are gone; returns how many.

    With ``label``, only folders named as ``new_build_folder(folder, label,
    marked=True)`` names them, and marked, are considered: ``folder`` is
    someone else's (an out_dir).
    """
    try:
        fd = os.open(folder, _ROOT_FLAGS)  # (the caller's folder, as the caller named it)
    except OSError:
        return 0
    try:
        return _remove_abandoned(fd, now, label)
    finally:
        os.close(fd)


def _remove_abandoned(folder_fd: int, now: float, label: str | None = None) -> int:
    removed = 0
    foreign = label is not None
    for name in _names(folder_fd):
        if foreign and not _is_build_name(name, label):
            continue
        if name.startswith(".nfs"):
            continue  # (NFS removes its .nfs files itself when the last reader closes)
        try:
            fd = os.open(name, fsutil.DIR_FLAGS, dir_fd=folder_fd)
        except OSError as e:
            if not foreign and e.errno in (errno.ENOTDIR, errno.ELOOP):
                # Not a folder: a stray file, or a link planted here (removed itself).
                with contextlib.suppress(OSError):
                    fsutil.remove_tree(name, folder_fd)
                    removed += 1
            continue
        try:
            if _abandoned(fd, name, now, foreign):
                # Through the handle judged, its lock held: a folder put under its name
                # meanwhile is not the one judged, and is left.  One proved ours by its
                # mark is judged by what is in it only.
                with contextlib.suppress(OSError):
                    fsutil.remove_folder(fd, name, folder_fd, ours=foreign)
                    removed += 1
        finally:
            os.close(fd)
    return removed


def _is_build_name(name: str, label: str) -> bool:
    parts = name.rsplit(".", 3)
    return (
        len(parts) == 4
        and parts[0] == label
        and _is_pid(parts[2])
        and len(parts[3]) == 8
        and not parts[3].strip("0123456789abcdef")
    )


def _is_pid(text: str) -> bool:
    # ASCII only: str.isdigit() is also true of "²", which int() refuses.
    return text.isascii() and text.isdigit()


def _abandoned(fd: int, name: str, now: float, foreign: bool = False) -> bool:
    """True when nobody is building in the folder ``name``, open as ``fd``, any more;
    then ``fd`` holds its lock.

    A live writer holds a flock on its folder.  Where flock may not reach
    (another host over NFS without a lock manager), a grace period decides.
    In a ``foreign`` folder (an out_dir others may write in), only a folder
    as we make build folders there counts: ours, 0700, and holding the
    ``.opcache-work`` folder named by its name's random part.  Anyone who can
    write in the out_dir can rename any folder of ours there, files and all,
    to a build folder's name (a rename within one folder needs no permission
    on the folder renamed), but nobody else can put that folder in it.
    """
    st = os.fstat(fd)
    changed = st.st_mtime
    if foreign:
        work = _mark(fd, name)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700 or work is None:
            log.debug("%s is named as a build folder but is not one of ours: left", name)
            return False
        # (the compiler writes in the mark's folder: its time moves, the outer one's not)
        changed = max(changed, work.st_mtime)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its writer holds it
    age = now - changed
    parts = name.rsplit(".", 3)
    if len(parts) == 4 and parts[1] == _HOST and _is_pid(parts[2]):
        # This host: the lock is reliable; a minute covers mkdir-to-flock.
        return not locks.pid_alive(int(parts[2])) or age > STALE_LOCAL_SECONDS
    return age > TMP_GRACE_SECONDS


def _mark(fd: int, name: str) -> os.stat_result | None:
    """The folder of this user's that ``new_build_folder(marked=True)`` makes in the one
    it names ``name`` (open as ``fd``), or None when it holds none."""
    try:
        work = os.stat(f"{_WORK_LABEL}.{name.rsplit('.', 1)[1]}", dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    return work if stat.S_ISDIR(work.st_mode) and work.st_uid == os.geteuid() else None


def _remove_stale_temps(folder_fd: int, now: float) -> int:
    removed = 0
    for name in _names(folder_fd):
        if not fsutil.is_temp_name(name):
            continue
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
            if now - st.st_mtime > STALE_LOCAL_SECONDS:
                os.unlink(name, dir_fd=folder_fd)
                removed += 1
    return removed


def _names(folder_fd: int) -> list[str]:
    """What is in the folder open as ``folder_fd`` (nothing, if it cannot be listed)."""
    try:
        return os.listdir(folder_fd)
    except OSError:
        return []


def _own_part(name: str, chip_fd: int) -> bool:
    """Whether ``name`` in a chip folder is opcache's: a bucket (two hex digits)
    holding only entries (32 hex digits) and temp files, or the size counters
    (``_size``) holding only their shards (``NN.count``, ``NN.lock``, an older
    ``NN.json``, the quick hits' ``appended``) and temp files; a folder, never
    through a link."""
    if name == SIZE_FOLDER:
        inside = _SHARD
    elif _BUCKET.fullmatch(name):
        inside = _KEY
    else:
        return False
    try:
        fd = os.open(name, fsutil.DIR_FLAGS, dir_fd=chip_fd)
    except OSError:
        return False
    try:
        names = os.listdir(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    return all(inside.fullmatch(n) or fsutil.is_temp_name(n) for n in names)


_SHARD = re.compile(r"[0-9]{2}\.(?:count|lock|json)|" + re.escape(QUICK_COUNTS))


def _is_real_dir(name: str, folder_fd: int) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _entry_facts(bucket_fd: int, name: str, sizes: bool) -> tuple[float, int]:
    """(stamp, bytes) of an entry; (0.0, 0) for a link or file in its place, aged first."""
    try:
        entry_fd = os.open(name, fsutil.DIR_FLAGS, dir_fd=bucket_fd)
    except OSError:
        return 0.0, 0
    try:
        try:
            stamp = os.stat(MANIFEST, dir_fd=entry_fd, follow_symlinks=False).st_mtime
        except OSError:
            stamp = 0.0
        return stamp, _files_bytes(entry_fd) if sizes else 0
    finally:
        os.close(entry_fd)


def _files_bytes(folder_fd: int) -> int:
    """Bytes of the regular files directly in a folder (an entry has no subfolders)."""
    with os.scandir(folder_fd) as files:
        return sum(
            f.stat(follow_symlinks=False).st_size for f in files if f.is_file(follow_symlinks=False)
        )


def _folder_bytes(name: str, parent_fd: int) -> int | None:
    """The bytes of the files in folder ``name``; None when it cannot be opened."""
    try:
        fd = os.open(name, fsutil.DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return None
    try:
        return _files_bytes(fd)
    finally:
        os.close(fd)


class _TrashFolders:
    """The locked trash folders a batch of removals goes into: a fresh one every
    ``TRASH_FOLDER_ENTRIES`` entries, the full one handed to its deleter then.

    A deleter lists its whole folder at once (a few hundred bytes a name): with
    folders of bounded size its memory is flat however many entries a trim
    removes, and the deleting starts before the trim ends.
    """

    def __init__(self, trash_fd: int, label: str, modes: fsutil.Modes) -> None:
        from .. import trash  # (not on a hit's start-up)

        self._trash = trash
        self.fd, self._label, self._modes = trash_fd, label, modes
        # Locked, so that no sweep deletes under us (None: folders cannot be locked here).
        self.folder = trash.new_folder(trash_fd, label, modes)
        self._filled = 0

    def next(self) -> tuple[str, int] | None:
        """The folder the next entry goes into."""
        if self.folder is not None and self._filled >= TRASH_FOLDER_ENTRIES:
            full, self.folder = self.folder, None
            self._trash.delete_later(self.fd, *full)
            self.folder = self._trash.new_folder(self.fd, self._label, self._modes)
            self._filled = 0
        self._filled += 1
        return self.folder

    def close(self) -> None:
        if self.folder is not None:
            self._trash.delete_later(self.fd, *self.folder)  # (at once if it is empty)


def _into_trash(
    src: str,
    src_dir_fd: int | None,
    trash_fd: int,
    folder: tuple[str, int] | None,
    *,
    later: bool,
) -> int | None:
    """Move ``src`` into the locked trash ``folder``: its bytes, or None if it was gone.

    With ``later`` it stays there for ``folder``'s deleter; otherwise it is
    deleted now.  Without a folder (none can be locked here), it is renamed
    into the trash (open as ``trash_fd``) alone and deleted now.
    """
    name = os.path.basename(src)
    if folder is None:
        aside = fsutil.unique_name(f"{name}.{_HOST}")
        if not _rename_if_there(src, src_dir_fd, aside, trash_fd):
            return None
        return fsutil.remove_tree(aside, trash_fd)
    if not _rename_if_there(src, src_dir_fd, name, folder[1]):
        return None
    return (_folder_bytes(name, folder[1]) or 0) if later else fsutil.remove_tree(name, folder[1])


def _rename_if_there(src: str, src_dir_fd: int | None, dst: str, dst_dir_fd: int) -> bool:
    """Rename, never through a link; False if ``src`` was gone already."""
    try:
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    except OSError as e:
        if e.errno in fsutil.GONE:
            return False
        raise
    return True


def _still_linked(path: Path, entry_fd: int) -> bool:
    """True if ``path``, from the cache root, still names the folder open as ``entry_fd``."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    was = os.fstat(entry_fd)
    return (now.st_ino, now.st_dev) == (was.st_ino, was.st_dev)
