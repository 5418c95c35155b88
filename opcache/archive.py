"""One archive file of cache entries: ``opcache export`` / ``import``, and the
container ``opcache cann export`` / ``import`` use.

An archive is a tar (gzip-compressed when its name ends in ``.gz`` or
``.tgz``) of regular files only, in this order:

- ``<kind>/<soc>/<key>``: one entry each, packed as the remote tier stores
  it (``storage/value.py``'s ``pack``: the manifest and every artifact, an
  XXH3-128 of the whole and each artifact's digest in the manifest), most
  recently used first;
- ``opcache-archive.json`` last: the kind (``opcache`` or ``cann``), the
  format and how many entries came before it.  An archive without it, or
  whose count differs, was cut short.

Reading checks the whole archive before anything is written
(``ArchiveReader.check``): a member that is not a regular file (a link, a
folder, a device), a name that is not ``<kind>/<soc>/<plain name>`` (``..``,
an absolute path, more parts), a member over ``MAX_MEMBER_BYTES`` (refused
on its header, before it is read) or not starting as a value does, a value
that does not unpack, a truncated file: the archive is refused, with the
reason.  The entries are then read again from the same open file, each one
required to be the member checked (``ArchiveReader.entries``).  Writing goes
to a temp file beside ``FILE``, renamed over it when complete (never over a
link, a device or a folder: refused); an entry over ``MAX_MEMBER_BYTES`` is
left out, and reported.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import xxhash

from . import fsutil
from ._log import get_logger
from .request import is_plain_name
from .settings import MB, REMOTE_OPTIONS, Settings, check_soc_version
from .storage import RemoteCorrupt
from .storage.entry import CorruptEntry, Entry
from .storage.local import is_key
from .storage.value import MAGIC, pack, unpack

log = get_logger(__name__)

FORMAT = 1
TRAILER = "opcache-archive.json"
OPCACHE = "opcache"
CANN = "cann"
# The largest member an archive holds, each held whole in memory while it is checked:
# the remote's default cap on an entry (OPCACHE_REMOTE_MAX_ENTRY_MB) and room for the
# value's header and manifest.  CANN's kernels are KBs to a few MB each (its default
# folder limit is 500 MB for a whole chip); an entry over it stays out of archives.
MAX_MEMBER_BYTES = REMOTE_OPTIONS["max_entry_mb"][1] * MB + MB
_MAX_TRAILER_BYTES = 1 << 16
TOO_BIG = f"it is over {MAX_MEMBER_BYTES} bytes, the most an archive holds"


class BadArchive(Exception):
    """The file is not a whole, valid archive of the kind asked; nothing was written."""


def _compressed(path: Path) -> bool:
    return path.name.endswith((".gz", ".tgz"))


class ArchiveWriter:
    """Writes an archive of ``kind`` to ``path``: ``add`` each entry, then ``close``.

    Used as a context manager, an exception leaves no file behind (and no
    half-written one at ``path``).
    """

    def __init__(self, path: Path, kind: str) -> None:
        self.path = path
        self.kind = kind
        self.count = 0
        self.bytes = 0
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(path).st_mode):
                # (renamed over, a device node or a link would be gone, nothing written)
                raise OSError(f"{path} is not a regular file: name a file for the archive")
        self._tmp = path.parent / fsutil.unique_name(f".{path.name}")
        try:
            fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            # (the temp file's name is ours: the user knows the archive's)
            raise OSError(e.errno, e.strerror, str(path)) from None
        self._file = os.fdopen(fd, "wb")
        self._tar = tarfile.open(  # noqa: SIM115  (closed by close or abort)
            fileobj=self._file,
            mode="w|gz" if _compressed(path) else "w|",
            format=tarfile.PAX_FORMAT,
        )

    def add(
        self, soc: str, key: str, manifest: bytes, files: dict[str, bytes], when: float
    ) -> bool:
        """One entry, packed (``pack``), under ``<kind>/<soc>/<key>``; False, and nothing
        added, when it or its value is over ``MAX_MEMBER_BYTES`` (an import refuses it)."""
        if len(manifest) + sum(map(len, files.values())) > MAX_MEMBER_BYTES:
            return False
        value = pack(key, manifest, files)
        if len(value) > MAX_MEMBER_BYTES:
            return False
        self._member(f"{self.kind}/{soc}/{key}", value, when)
        self.count += 1
        self.bytes += len(value)
        return True

    def _member(self, name: str, data: bytes, when: float) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mtime = int(when)
        info.mode = 0o640
        self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        """Write the trailer and put the archive at its name (or leave no file)."""
        trailer = {"format": FORMAT, "kind": self.kind, "entries": self.count}
        try:
            self._member(TRAILER, json.dumps(trailer, sort_keys=True).encode(), time.time())
            self._tar.close()
            self._file.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._tar.close()
        self._file.close()
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


class ArchiveReader:
    """An archive file opened once, read twice from that one descriptor.

    ``check`` reads it whole: every member, each value unpacked, the trailer.
    ``entries`` reads it again and gives each entry only if it is the member
    ``check`` saw at that place (name, size, XXH3-128 of its bytes), so an
    importer writes only what was checked, with the trailer checked first:
    a file renamed over the name in between is not this descriptor's, and
    one changed in place is refused before the first entry (its size or
    modification time differ) or at the first member that differs.
    """

    def __init__(self, path: Path, kind: str) -> None:
        self.path = path
        self.kind = kind
        # The file the user named, a link to it too; never waiting on a FIFO.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise BadArchive(f"{path} is not a regular file")
        self._file = os.fdopen(fd, "rb")
        self._seen: list[tuple[str, str, int, bytes]] | None = None
        self._stat = self._identity()

    def check(
        self, summary: Callable[[bytes], bytes] = lambda manifest: b""
    ) -> dict[str, list[tuple[str, int, bytes]]]:
        """Read the whole archive: {soc: [(key, packed size, summary of its manifest)]}
        in its order.

        BadArchive for any member that is not what an archive of its kind holds,
        a value that does not unpack (damaged, or another key's), a missing or
        wrong trailer: nothing of such a file is used.  Only ``summary``'s bytes
        of each manifest are kept (keep them small): a few KB of gzip can hold
        thousands of members of a 60 MB manifest each.
        """
        found: dict[str, list[tuple[str, int, bytes]]] = {}
        seen = []
        for soc, key, value in self._members():
            _, manifest = unpacked(soc, key, value)
            found.setdefault(soc, []).append((key, len(value), summary(manifest)))
            seen.append((soc, key, len(value), xxhash.xxh3_128_digest(value)))
        self._seen = seen
        self._stat = self._identity()
        return found

    def entries(self) -> Iterator[tuple[str, str, Entry, bytes]]:
        """(soc, key, entry, manifest) of each member ``check`` passed, read again.

        BadArchive when the file changed since: before the first entry when its
        size or time did, else at the first member that is not the one checked.
        """
        if self._seen is None:
            raise RuntimeError("entries() before check()")
        if self._identity() != self._stat:
            raise BadArchive(f"{self.path} changed since it was checked: nothing imported")
        for at, (soc, key, value) in enumerate(self._members()):
            got = (soc, key, len(value), xxhash.xxh3_128_digest(value))
            if at >= len(self._seen) or self._seen[at] != got:
                raise BadArchive(f"{self.path} changed while it was imported: {soc}/{key} differs")
            yield (soc, key, *unpacked(soc, key, value))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _identity(self) -> tuple[int, int, int, int]:
        st = os.fstat(self._file.fileno())
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def _members(self) -> Iterator[tuple[str, str, bytes]]:
        """(soc, key, packed value) of each entry, from the file's start.

        Raises BadArchive at the first member that is not what an archive of
        the kind holds, and at the end when the trailer is missing or its count
        differs.  The values are not unpacked here.
        """
        count = 0
        trailer = None
        self._file.seek(0)
        try:
            with tarfile.open(fileobj=self._file, mode="r|*", tarinfo=_BoundedTarInfo) as tar:
                for info in tar:
                    if trailer is not None:
                        raise BadArchive(f"{info.name!r} comes after {TRAILER}")
                    if not info.isreg():
                        what = "a link" if info.issym() or info.islnk() else "not a regular file"
                        raise BadArchive(f"{info.name!r} is {what}: an archive holds files only")
                    if info.name == TRAILER:
                        trailer = _read_member(tar, info, _MAX_TRAILER_BYTES, b"")
                        continue
                    soc, key = _entry_name(info.name, self.kind)
                    count += 1
                    yield soc, key, _read_member(tar, info, MAX_MEMBER_BYTES, MAGIC)
        except _HeaderTooBig as e:
            raise BadArchive(f"{self.path}: {e}: refusing the archive") from None
        except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
            # (gzip's BadGzipFile is an OSError: a damaged file reads as one too)
            why = e or "unexpected end"
            raise BadArchive(f"{self.path}: not a whole tar file ({why})") from None
        _check_trailer(self.path, trailer, self.kind, count)


class _HeaderTooBig(tarfile.TarError):
    pass


class _BoundedTarInfo(tarfile.TarInfo):
    """A member whose extended header (a PAX record, a GNU long name) is refused on
    its declared size: tarfile reads such a header whole before any member is
    seen, and a few MB of gzip declaring gigabytes took them in memory."""

    def _proc_member(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        if self.type in _EXTENDED_HEADERS and self.size > _MAX_TRAILER_BYTES:
            raise _HeaderTooBig(f"an extended tar header of {self.size} bytes")
        return super()._proc_member(tarfile)  # type: ignore[misc]


_EXTENDED_HEADERS = (
    tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)  # fmt: skip


def _read_member(tar: tarfile.TarFile, info: tarfile.TarInfo, limit: int, magic: bytes) -> bytes:
    """The member's bytes, refused on its declared size before any is read, and on its
    first bytes (not ``magic``) before the rest is."""
    if info.size > limit:
        raise BadArchive(
            f"{info.name!r} is {info.size} bytes: too big for an entry (at most {limit})"
        )
    reader = tar.extractfile(info)
    if reader is None:
        raise BadArchive(f"{info.name!r} cannot be read")
    head = reader.read(len(magic))
    if head != magic and len(head) == len(magic):
        raise BadArchive(f"{info.name!r} is not an opcache value: refusing the archive")
    data = head + reader.read()
    if len(data) != info.size:
        raise BadArchive(f"{info.name!r} is cut short: the archive is truncated")
    return data


def _entry_name(name: str, kind: str) -> tuple[str, str]:
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != kind or not is_plain_name(parts[2]):
        raise BadArchive(f"{name!r} is not {kind}/<soc>/<entry>: refusing the archive")
    if kind == OPCACHE and not is_key(parts[2]):
        # (its first two characters name the bucket: "..x" would be the cache's root)
        raise BadArchive(f"{name!r} does not name an entry by its key: refusing the archive")
    try:
        check_soc_version(parts[1])
    except ValueError:
        raise BadArchive(f"{name!r} does not name a chip: refusing the archive") from None
    return parts[1], parts[2]


def _check_trailer(path: Path, raw: bytes | None, kind: str, count: int) -> None:
    if raw is None:
        raise BadArchive(f"{path} has no {TRAILER}: the archive is truncated")
    try:
        trailer = json.loads(raw)
    except ValueError:
        trailer = None
    if not isinstance(trailer, dict) or trailer.get("format") != FORMAT:
        raise BadArchive(f"{path}: {TRAILER} is not of an archive this opcache writes")
    if trailer.get("kind") != kind:
        raise BadArchive(f"{path} is an archive of {trailer.get('kind')!r} entries, not {kind!r}")
    if trailer.get("entries") != count:
        raise BadArchive(
            f"{path} holds {count} entries, its {TRAILER} says {trailer.get('entries')}: truncated"
        )


def unpacked(soc: str, key: str, value: bytes) -> tuple[Entry, bytes]:
    """``unpack``'s (entry, manifest), or BadArchive naming the member."""
    try:
        return unpack(key, value, MAX_MEMBER_BYTES)
    except RemoteCorrupt as e:
        raise BadArchive(f"{soc}/{key}: {e}: refusing the archive") from None


# -- opcache's own cache ------------------------------------------------------------------


def export_cache(
    settings: Settings,
    path: Path,
    soc: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, object]:
    """Every sound entry of opcache's cache (of one chip) into an archive at ``path``.

    An entry that fails its checks is left out and reported.  Returns
    {"file", "entries", "bytes", "skipped": [{"entry", "why"}]}.
    """
    from .storage.local import LocalStore

    store = LocalStore(settings.root, modes=fsutil.modes_for(settings.shared_group))
    store.check_root()  # (a root reached through another user's link: refused, not empty)
    # An entry over what an archive holds is left out by its manifest, before it is
    # read whole (a member's sparse file of 64 GiB, which its manifest says).
    store.max_entry_bytes = MAX_MEMBER_BYTES
    chips = [soc] if soc is not None else store.chips()
    skipped: list[dict[str, str]] = []
    with ArchiveWriter(path, OPCACHE) as out:
        for done, chip in enumerate(chips, 1):
            infos = sorted(store.scan(chip), key=lambda i: -i.stamp)
            for info in infos:
                try:
                    got = store.get_with_manifest(chip, info.key)
                except (OSError, CorruptEntry) as e:
                    # (maybe sound: over max_entry_bytes by its manifest, never read)
                    why = TOO_BIG if getattr(e, "maybe_sound", False) else str(e)
                    skipped.append({"entry": f"{chip}/{info.key}", "why": why})
                    continue
                if got is not None:
                    entry, manifest = got
                    if not out.add(chip, info.key, manifest, entry.files, info.stamp):
                        skipped.append({"entry": f"{chip}/{info.key}", "why": TOO_BIG})
            if progress is not None:
                progress(done * 100 // len(chips))
    return {"file": str(path), "entries": out.count, "bytes": out.bytes, "skipped": skipped}


def import_cache(
    settings: Settings,
    path: Path,
    soc: str | None = None,
    *,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
) -> dict[str, object]:
    """The entries of an archive ``export_cache`` wrote, stored in opcache's cache.

    The archive is checked whole first (BadArchive: nothing stored).  An entry
    the cache holds already is kept as it is.  Returns {"file", "imported",
    "bytes", "present", "errors"}.
    """
    from .storage.local import LocalStore

    with ArchiveReader(path, OPCACHE) as reader:
        found = reader.check()
        total = sum(len(v) for s, v in found.items() if soc is None or s == soc)
        report: dict[str, object] = {"file": str(path), "imported": 0, "bytes": 0, "present": 0}
        errors: list[str] = []
        report["errors"] = errors
        if dry_run:
            report["would_import"] = total
            return report
        store = LocalStore(settings.root, modes=fsutil.modes_for(settings.shared_group))
        store.check_root()  # (refused once, not an error per entry)
        done = 0
        for chip, key, entry, manifest in reader.entries():
            if soc is not None and chip != soc:
                continue
            try:
                stored = store.put(chip, key, manifest, entry.files, now=time.time())
            except (OSError, ValueError) as e:
                errors.append(f"{chip}/{key}: {e}")
            else:
                if stored is None:
                    report["present"] += 1  # type: ignore[operator]
                else:
                    report["imported"] += 1  # type: ignore[operator]
                    report["bytes"] += stored  # type: ignore[operator]
            done += 1
            if progress is not None:
                progress(done * 100 // max(total, 1))
    return report
