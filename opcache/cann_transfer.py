"""CANN's own kernel cache across machines: push, pull, export, import.

CANN's graph engine keeps its compiles in ``<base>/kernel_cache/<soc>/``
(``cann_format.py`` says how), one folder per machine.  This module moves
those entries, whole, between such folders: through a remote tier
(``push`` / ``pull``, any ``storage.Remote``) or through one archive file
(``export_archive`` / ``import_archive``, ``archive.py``'s container).

**What may be shared.**  CANN reuses an entry only under the same chip,
toolkit and operator package (its ``op_cache.ini`` check: ``adk_version``,
``ops_version``) and driver.  Every entry is filed under a namespace of
exactly those: the chip, the two versions from the folder's
``op_cache.ini``, the digest of the driver's ``version.info``
(``compilers.cann.driver_version``; ``none`` without a driver) and, when
there are any, the digest of the custom operator packages' files
(``compilers.cann.custom_opp_digest``: CANN names a custom operator's kernel
by its description, not its implementation).  An entry
of another namespace is never written into a folder; when the remote or the
archive holds the chip only under other versions, the pull is refused
(``Refused``) and says which.

**Reading** (push, export): an entry is its json and the files it names
(binary, header, a mix-core entry's sub-jsons and their binaries), taken
only if CANN's hit check passes (``cann_format``'s: the json parses, the
binaries are there, sha256 equal, ``kernelName`` for ``.o``) and every file
is named after its kernel, and none written before ``op_cache.ini`` last
changed (``IniMark``) nor before the driver or a custom operator package last
changed (``InputsMark``).  Files are read without moving their access time.
The folder is listed by names and ``lstat`` a part at a time (``_Reader``),
never held whole; a json is read only when its entry is to be given (by push,
once the remote said it lacks it).

**Writing** (pull, import), as CANN's ``CopyFileToCacheDir`` writes:
``<kernel>.lock`` taken (``F_SETLK``, non-blocking: an entry whose lock a
CANN writer holds is skipped, and a CANN writer that comes meanwhile skips
its store, as it does for any held lock); never over an existing file of
the entry; each file into ``<name>_<pid>_<usec>_<rand>.temp`` (0640 whatever
the umask) renamed into place, binaries first and the json last; the json
is renamed only after the files on disk passed CANN's hit check, so no
unchecked entry is ever visible.  The source's access time is kept, so
CANN's aging still removes the least recently used first.  Entries go most
recently used first, and the transfer stops before the chip folder's used
size (counted as CANN counts it) would reach its limit.  A missing
``op_cache.ini`` is created as CANN creates it (the two versions, 0640):
without it CANN's first compile would wipe the folder; never while a chip
folder holds files (of unknown versions: the ini would make CANN keep them).
The ini is looked at again after each entry is shown, its lock held
(``IniMark``): a CANN of another toolkit rewrites it, then wipes the folder,
and would take an entry written after as its own; the writing stops there.
The driver and the custom packages (``InputsMark``) are looked at again every
``_INPUTS_EVERY`` seconds and at the end: once they changed, the entries
written since they were last seen unchanged are taken out, and the writing
stops.  An entry is taken only if its manifest names the folder's versions.

**The remote's keys.**  Per chip, the head of its index, ``cann:<soc>`` /
``#index2``: the namespaces pushed, and when a push last wrote or confirmed each
(one not pushed for ``INDEX_KEEP_SECONDS`` leaves it when it is next written).
Per namespace, its kernels' rows (last access, size) in ``SHARDS`` parts,
``cann:<soc>:<namespace id>`` / ``#index-00`` to ``#index-ff`` by a crc32 of the
kernel's name, each read, merged (latest access wins) and written on its own, a
few at a time and only when it changed: a push lost to a concurrent one is
mended by the next.  A push keeps the rows it lists on disk (``_Spool``), a
group of parts per file, and holds one group at a time; a pull reads the parts
once to count what it lacks by last access (``_Plan``), then again per window
of at most ``WINDOW`` rows, most recently used first.  Entries are
``cann:<soc>:<namespace id>`` / ``<kernel>``, each an opcache entry (manifest
and files, checked whole on every read).  An older opcache's index (one value,
``#index``) is neither read nor written: docs/cann.md says what a mixed cluster
sees.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import heapq
import os
import random
import re
import stat
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from . import _json, fsutil, ini, trust
from ._log import get_logger
from ._record import Record
from .archive import CANN, MAX_MEMBER_BYTES, TOO_BIG, ArchiveReader, ArchiveWriter, BadArchive
from .cann_cache import Limits, cann_root, read_limits
from .cann_cache import _entry_json_stats as entry_json_stats
from .cann_format import (
    AGING_NOW,
    DEL_LOCK,
    KERNEL_FILE_SUFFIXES,
    LOCK_MODE,
    CannEntry,
    PresentFiles,
    access_time,
    chip_used,
    del_lock,
    hash_problem,
    held_lock,
    holding,
    is_entry_json,
    open_chip_folder,
    open_quietly,
    try_lock,
)
from .compilers.cann import (
    DRIVER_VARIABLE,
    INSTALL_INFO,
    MAX_PACKAGE_FILES,
    custom_opp_digest,
    custom_opp_folders,
    driver_folder,
    driver_version,
)
from .errors import ConfigError
from .key import canonical_json, digest
from .request import check_soc_version, is_plain_name
from .settings import INI_NAME, Settings, resolve_settings
from .storage import Remote, RemoteCorrupt, RemoteError, open_remote
from .storage.cann_names import cann_chip, is_cann_index
from .storage.entry import make_manifest

log = get_logger(__name__)

FORMAT = 2
# The remote's index of a chip: its head (``cann:<soc>`` / ``#index2``: the
# namespaces) and, per namespace, ``SHARDS`` parts of its rows (``cann:<soc>:<id>`` /
# ``#index-00`` to ``#index-ff``, by a crc32 of the kernel's name).  An older
# opcache's one value (``#index``, format 1) is neither read nor written.
INDEX = "#index2"
SHARD_PREFIX = "#index-"
SHARDS = 256
INDEX_FILE = "index.json"
_SHARDS_AT_ONCE = 8  # parts of the index read (and written) per round trip
# A pull: the rows it holds at once (one window of last-access times, fetched most
# recently used first), and the bins of last-access times its first pass counts.
WINDOW = 100_000
_BINS = 16_384
_BATCH = 32  # entries per round trip: a batch of big kernels stays a bounded answer
_BATCH_BYTES = 16 << 20  # and at most this much sent at once
# A giving side's listing: entries taken per walk of the chip folder (most recently
# used first, a walk each), and per part of it, whose files are looked at before
# the inputs are checked again.  What is held per entry is its name and its files'
# lstat, for one part at a time.
CANDIDATES = 50_000
_LISTED = 4096


class Refused(Exception):
    """This folder cannot take (or give) these entries; the message says why.  Nothing
    was written."""


class Namespace(Record):
    """What makes CANN's entries interchangeable: chip, toolkit, operator package, driver,
    and the custom operator packages (``custom``: their digest, "" when there are none)."""

    __slots__ = _fields = ("soc", "adk_version", "ops_version", "driver", "custom")
    soc: str
    adk_version: str
    ops_version: str
    driver: str
    custom: str

    def __init__(
        self, soc: str, adk_version: str, ops_version: str, driver: str, custom: str = ""
    ) -> None:
        self._init(locals())

    @property
    def ident(self) -> str:
        return digest(canonical_json(self.versions()))[:16]

    @property
    def remote_chip(self) -> str:
        return cann_chip(self.soc, self.ident)

    def versions(self) -> dict[str, str]:
        # (no custom packages: the namespace of a folder is what it was before they counted)
        custom = {"custom": self.custom} if self.custom else {}
        return {"adk_version": self.adk_version, "ops_version": self.ops_version,
                "driver": self.driver, **custom}  # fmt: skip

    def describe(self) -> str:
        return _described(self.versions())


def _described(versions: dict[str, str]) -> str:
    custom = versions.get("custom")
    return (
        f"adk_version {versions['adk_version']}, ops_version {versions['ops_version']}, "
        f"driver {versions['driver'][:12]}"
        + (f", custom operator packages {custom[:12]}" if custom else "")
    )


# -- versions ---------------------------------------------------------------------------


def ini_versions(
    path: Path, shared_group: int | None = None, dir_fd: int | None = None
) -> tuple[str, str] | None:
    """(adk_version, ops_version) of ``op_cache.ini`` read as CANN reads it
    (``ini.read_cann_versions``, through ``dir_fd`` when given); None when there is
    no file.  Refused when CANN would not use it, when it is not a regular file or
    the trust rule refuses it."""
    try:
        return ini.read_cann_versions(path, shared_group, dir_fd)
    except ValueError as e:
        raise Refused(str(e)) from None
    except OSError as e:
        why = "it is a link" if e.errno == errno.ELOOP else e.strerror or e
        raise Refused(f"{path} cannot be read ({why})") from None


def local_namespace(
    root: Path, soc: str, environ: Mapping[str, str], shared_group: int | None, *, taking: bool
) -> tuple[Namespace, bool]:
    """(the namespace of ``root``'s chip folder ``soc``, whether op_cache.ini is missing).

    ``taking`` (pull, import): a missing ini is fine when the toolkit's
    versions are known (the caller creates it); one that names other versions
    than the installed toolkit is refused (CANN wipes the folder at its next
    compile).  Giving (push, export) needs the ini, and its versions are those of
    the entries written since it last changed (``IniMark``).  Refused when the
    ini is invalid.
    """
    try:
        driver = driver_version(environ, strict=True) or "none"
    except OSError as e:
        raise Refused(
            f"the driver's version.info cannot be read ({e.strerror or e}): which driver "
            "this machine has cannot be told"
        ) from None
    custom = custom_opp_digest(environ) or ""
    path = root / INI_NAME
    in_ini = ini_versions(path, shared_group)
    installed = ini.toolkit_versions(environ)
    if in_ini is None:
        if not taking:
            raise Refused(f"no {path}: CANN's next compile there wipes the folder")
        if installed is None:
            raise Refused(
                f"no {path}, and no toolkit found to tell the versions it takes (set "
                "ASCEND_HOME_PATH and ASCEND_OPP_PATH, or run one compile first)"
            )
        holding = ini.folder_with_cann_files(root)
        if holding is not None:
            # An ini made now would tell CANN they are the installed toolkit's: kept.
            raise Refused(
                f"no {path}, and {holding} holds files of unknown versions that CANN's "
                "first compile there wipes: run one compile first"
            )
        return Namespace(soc, *installed, driver, custom), True
    if taking and installed is not None and installed != in_ini:
        raise Refused(
            f"{path} says adk_version {in_ini[0]}, ops_version {in_ini[1]}, the installed toolkit "
            f"{installed[0]}, {installed[1]}: CANN wipes this folder at its next compile"
        )
    return Namespace(soc, *in_ini, driver, custom), False


class IniMark:
    """op_cache.ini as a giving side read it: which file, last changed when.

    CANN rewrites the ini, shared by every chip folder, only when it finds it
    missing or naming other versions than its own (and in ``force`` mode): it
    then wipes its own chip folder alone, so the other chip folders keep
    entries of the old toolkit under the new versions.  An entry written
    before the ini's last change may be such a one: it is never given.
    """

    def __init__(self, path: Path, stamp: tuple[int, int, int, int]) -> None:
        self.path = path
        self.stamp = stamp

    @property
    def mtime_ns(self) -> int:
        return self.stamp[2]

    def predates(self, st: os.stat_result) -> bool:
        return st.st_mtime_ns < self.mtime_ns

    def changed(self) -> bool:
        return _stamp(self.path) != self.stamp


PREDATES = "it may predate the last toolkit change: written before op_cache.ini last changed"
INI_CHANGED = "op_cache.ini changed meanwhile (a toolkit change?): run it again"
PREDATES_INPUT = (
    "it may predate the last driver or custom operator package change: written before {} "
    "last changed"
)
CHANGED = "it changed while this ran: the next run gives it"
INPUTS_CHANGED = "the driver or a custom operator package changed while it was read: run it again"
STOPPED_INPUTS = (
    "the driver or a custom operator package changed while this ran: the entries not "
    "listed before are left for the next run"
)


class InputsMark:
    """The driver and the custom operator packages as a giving side found them: each
    file the namespace is digested from, with the time it last changed.

    CANN wipes its folder only for other versions in op_cache.ini: after a new
    driver or custom operator package the entries compiled before stay, and the
    namespace, digested from what is installed now, would file them as built with
    the new one.  An entry written before the newest change is never given.  A
    file's change time counts as well as its modification time: a package
    installed by tar or rpm gets its old modification times back, never an old
    change time.
    """

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.stamps = _input_stamps(environ)
        self.newest_ns, self.newest = max(
            ((max(st[2], st[3]), path) for path, st in self.stamps.items()), default=(0, "")
        )

    def predates(self, st: os.stat_result) -> bool:
        return st.st_mtime_ns < self.newest_ns

    @property
    def why(self) -> str:
        return PREDATES_INPUT.format(self.newest)

    def changed(self) -> bool:
        return _input_stamps(self.environ) != self.stamps


def _input_stamps(environ: Mapping[str, str]) -> dict[str, tuple[int, int, int, int, int]]:
    """{path: (device, inode, mtime, ctime, size)} of what ``driver_version`` and
    ``custom_opp_digest`` read (links followed, as they read), one stat each;
    Refused past the files a digest reads."""
    stamps: dict[str, tuple[int, int, int, int, int]] = {}

    def mark(path: str) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            try:  # (a dangling link: its target, made later, is newer than it)
                st = os.lstat(path)
            except OSError:
                return False
        stamps[path] = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        return True

    def parent(path: str) -> str:
        return os.path.dirname(os.path.normpath(os.path.abspath(path)))

    # A folder that is not there may have been removed: its parent's times say when.
    driver = str(driver_folder(environ))
    if not environ.get(DRIVER_VARIABLE):
        mark(INSTALL_INFO)  # (it says where the driver is)
    if mark(driver):
        mark(os.path.join(driver, "version.info"))
    else:
        mark(parent(driver))
    seen = set()
    for folder in custom_opp_folders(environ):
        if not os.path.isdir(folder):
            mark(parent(folder))
            continue
        for top, subfolders, files in os.walk(folder, followlinks=True):
            # A package's own folders are walked, not stamped: Python's first import
            # makes a __pycache__ in one, and a clean step deletes it, which would move
            # its times and hold back every entry before for good.  (So a file only
            # deleted from a package, nothing else changed, is not seen: docs/cann.md.)
            try:
                identity = os.stat(top)[1:3]  # (inode, device)
            except OSError:
                identity = None
            if identity is None or identity in seen:
                subfolders.clear()
                continue
            seen.add(identity)
            # (Python's bytecode is no part of the digest, and is written at first imports)
            subfolders[:] = [f for f in subfolders if f != "__pycache__"]
            for name in files:
                mark(os.path.join(top, name))
            if len(stamps) > MAX_PACKAGE_FILES:
                raise Refused(f"the custom operator packages hold over {len(stamps)} files")
    return stamps


def _stamp(path: Path, dir_fd: int | None = None) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path if dir_fd is None else path.name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def giving_namespace(
    root: Path, soc: str, environ: Mapping[str, str], shared_group: int | None
) -> tuple[Namespace, IniMark, InputsMark]:
    """The namespace of a chip folder that gives entries (push, export), and the marks
    of what it comes from; Refused when the ini changed while read (its versions then
    may not be the ones of its time)."""
    path = root / INI_NAME
    before = _stamp(path)
    # (marked before the digest: a change while it reads is seen by the reader's check)
    inputs = InputsMark(environ)
    ns, _ = local_namespace(root, soc, environ, shared_group, taking=False)
    if before is None or _stamp(path) != before:
        raise Refused(f"{path} changed while it was read (a toolkit change?): run it again")
    return ns, IniMark(path, before), inputs


def taking_namespace(
    root: Path, soc: str, environ: Mapping[str, str], shared_group: int | None
) -> tuple[Namespace, IniMark | None, InputsMark]:
    """The namespace of a chip folder that takes entries (pull, import), the mark of
    the op_cache.ini it was read from (None when there is none yet: ``create_ini``
    makes it), and the mark of the driver and custom packages it was digested from
    (the writer stops when they change).  Refused when the ini changed while read."""
    path = root / INI_NAME
    before = _stamp(path)
    inputs = InputsMark(environ)  # (before the digest, as giving_namespace marks them)
    ns, missing = local_namespace(root, soc, environ, shared_group, taking=True)
    if missing:
        return ns, None, inputs
    if before is None or _stamp(path) != before:
        raise Refused(f"{path} changed while it was read (a toolkit change?): run it again")
    return ns, IniMark(path, before), inputs


def create_ini(
    path: Path, ns: Namespace, shared_group: int | None = None, dir_fd: int | None = None
) -> tuple[IniMark, bool]:
    """op_cache.ini as CANN's ``CreatOpCacheIniFile`` writes it: exactly the section and
    the two versions, mode 0640 narrowed by the umask; never over an existing file.
    ``dir_fd``: the root folder, reached under the trust rule (``_Chip``), made in
    (or, made meanwhile, read) through that handle: a link swapped above the root
    meanwhile leads nowhere.

    (its mark, whether this made it).  One another process made meanwhile is
    taken only if it names ``ns``'s versions: a CANN of another toolkit that
    made it wipes the chip folder and takes what is written after as its own.
    """
    text = f"[{ini.SECTION}]\nadk_version={ns.adk_version}\nops_version={ns.ops_version}\n"
    try:
        name = path if dir_fd is None else path.name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o640, dir_fd=dir_fd)
    except FileExistsError:
        before = _stamp(path, dir_fd)
        found = ini_versions(path, shared_group, dir_fd)
        if found != (ns.adk_version, ns.ops_version):
            said = f"adk_version {found[0]}, ops_version {found[1]}" if found else "nothing"
            raise Refused(
                f"{path} was made meanwhile, and says {said}, not this toolkit's "
                f"{ns.adk_version}, {ns.ops_version} (a CANN of another toolkit?): nothing written"
            ) from None
        if before is None or _stamp(path, dir_fd) != before:
            raise Refused(
                f"{path} changed while it was read (a toolkit change?): run it again"
            ) from None
        return IniMark(path, before), False
    with os.fdopen(fd, "w", encoding="latin-1") as f:
        f.write(text)
        f.flush()
        st = os.fstat(fd)
    return IniMark(path, (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)), True


# -- a chip folder, read --------------------------------------------------------------------


class Bundle(Record):
    """One entry whole: its kernel, last access (seconds), files by name."""

    __slots__ = _fields = ("kernel", "atime", "files")
    kernel: str
    atime: int
    files: dict[str, bytes]

    def __init__(self, kernel: str, atime: int, files: dict[str, bytes]) -> None:
        self._init(locals())

    @property
    def size(self) -> int:
        return sum(map(len, self.files.values()))


_PART = re.compile(r"(_mix_ai[cv])?(\.json|\.o|\.so|\.h)")


def _reserved(kernel: str) -> str | None:
    """Why a chip folder cannot hold an entry of this kernel name as CANN's (None if it can)."""
    if f"{kernel}.lock" == DEL_LOCK:
        # Its lock would be the aging lock a pull holds, and closing it releases that.
        return f"a name CANN reserves: its lock would be the aging lock {DEL_LOCK}"
    if not is_entry_json(f"{kernel}.json"):
        # Its json would be another entry's prebuild results or mix-core part.
        return "a name CANN gives other files (_pre, _mix_aic, _mix_aiv)"
    if "." in kernel:
        return "not a kernel name: CANN's ends at the first dot of its json's name"
    if is_cann_index(kernel):
        # Its key on the remote could be a part of the index (``SHARD_PREFIX``).
        return "a name the remote's index takes (#...)"
    return None


def _own_name(kernel: str, name: str) -> bool:
    """A file an entry may bring, as CANN names them: ``<kernel>.json``, its binary
    ``.o``/``.so``, header ``.h``, a mix-core entry's ``<kernel>_mix_aic.json`` /
    ``_mix_aiv.json`` and their binaries; never another kernel's json, shown for a
    moment before its own checks, nor a lock or temp file."""
    return name.startswith(kernel) and bool(_PART.fullmatch(name[len(kernel) :]))


class _Listed:
    """One entry as a part of the listing found it: its kernel, and the ``lstat`` of
    each regular file of its kernel's name that CANN's naming allows it
    (``_looked_at``), taken before the inputs were checked again."""

    __slots__ = ("files", "kernel")

    def __init__(self, kernel: str, files: dict[str, os.stat_result]) -> None:
        self.kernel = kernel
        self.files = files

    @property
    def json(self) -> str:
        return f"{self.kernel}.json"

    @property
    def atime(self) -> int:
        return access_time(self.files[self.json])

    def size(self, names: Iterable[str] | None = None) -> int:
        """The bytes of ``names`` (every file found, by default) as listed."""
        found = self.files if names is None else names
        return sum(self.files[name].st_size for name in found)


def _looked_at(kernel: str, files: Container[str]) -> Iterator[str]:
    """The files a listing looks for, by name: the json, binary and header of
    ``kernel``, its mix-core sub-jsons, and the binary and header of each one found
    (in ``files``, so far)."""
    for stem in (kernel, f"{kernel}_mix_aic", f"{kernel}_mix_aiv"):
        if stem == kernel or f"{stem}.json" in files:
            yield from (f"{stem}{suffix}" for suffix in (".json", *KERNEL_FILE_SUFFIXES))


class _Found(Container[str]):
    """What ``CannEntry`` asks of a listing, for one entry: the files its listing
    looked at, as found then; any other name as it is now (``PresentFiles``)."""

    def __init__(self, fd: int, listed: _Listed) -> None:
        self._listed = listed
        self._now = PresentFiles(fd)

    def __contains__(self, name: object) -> bool:
        files = self._listed.files
        if name in files:
            return True
        if name in _looked_at(self._listed.kernel, files):
            return False
        return name in self._now


class _Reader:
    """The entries of a chip folder open as ``fd``, most recently used first, listed
    a part at a time (``parts``) and each one checked (``check``) and read
    (``read``) only when asked: none written before ``ini``'s or ``inputs``' last
    change, none read whole when its files are over ``cap`` bytes (``too_big``
    says so).  Per entry, what a part holds: its name and its files' ``lstat``.

    The inputs are checked again after each part is listed: an entry listed
    after they changed may be of the new ones.  Refused when they changed before
    the first part; after a later one, ``stopped`` says so and no more is listed.
    """

    def __init__(self, fd: int, ini: IniMark, inputs: InputsMark, cap: int, too_big: str) -> None:
        self.fd = fd
        self.ini = ini
        self.inputs = inputs
        self.cap = cap
        self.too_big = too_big
        self.skipped: list[dict[str, str]] = []
        self.total = 0  # the entry jsons the first walk found (for a percentage)
        self.stopped: str | None = None

    def parts(self) -> Iterator[list[_Listed]]:
        """The entries, most recently used first (ties by name), ``_LISTED`` at a time;
        a walk of the folder for each ``CANDIDATES`` of them, so a million are never
        held at once."""
        first = True
        after: tuple[int, str] | None = None
        while True:
            batch = heapq.nsmallest(CANDIDATES, self._walk(after, count=first))
            # (the inputs checked once even when there is no entry, as for a part)
            for at in range(0, max(len(batch), first), _LISTED):
                part = [self._list(kernel) for _, kernel in batch[at : at + _LISTED]]
                # Every file of the part was listed by now: with the inputs unchanged
                # since before the namespace was digested, none is of other ones.
                if self.inputs.changed():
                    if first:
                        raise Refused(INPUTS_CHANGED)
                    self.stopped = STOPPED_INPUTS
                    return
                first = False
                yield [listed for listed in part if listed is not None]
            if len(batch) < CANDIDATES:
                return
            after = batch[-1]

    def _walk(self, after: tuple[int, str] | None, *, count: bool) -> Iterator[tuple[int, str]]:
        """(minus the access time, kernel) of each entry json past ``after``."""
        for name, st in entry_json_stats(self.fd):
            self.total += count
            found = (-access_time(st), name[: -len(".json")])
            if after is None or found > after:
                yield found

    def _list(self, kernel: str) -> _Listed | None:
        """The entry's files found by name (None once its json is gone)."""
        files: dict[str, os.stat_result] = {}
        for name in _looked_at(kernel, files):
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files[name] = st
        return _Listed(kernel, files) if f"{kernel}.json" in files else None

    def listable(self, listed: _Listed) -> bool:
        """Whether the entry may be given, as far as its name and its json's times
        tell (no json read); if not, why goes to ``skipped``."""
        kernel = listed.kernel
        problem = "not a kernel name" if not is_plain_name(kernel) else _reserved(kernel)
        json_st = listed.files[listed.json]
        if problem is None and self.ini.predates(json_st):
            problem = PREDATES
        if problem is None and self.inputs.predates(json_st):
            problem = self.inputs.why
        if problem is not None:
            self.skipped.append({"entry": kernel, "why": problem})
        return problem is None

    def check(self, listed: _Listed) -> CannEntry | None:
        """The entry, judged by CANN's code and the rules of giving (its json read and
        parsed); None, with why in ``skipped``, when it may not be given."""
        entry = CannEntry(self.fd, listed.json, _Found(self.fd, listed))
        problem = entry.problem
        if problem is None and not all(_own_name(entry.kernel, f) for f in entry.owned):
            problem = "it names files not named after its kernel as CANN names them"
        if problem is None:
            problem = self._late(listed, entry)
        if problem is None and any(self.ini.predates(listed.files[f]) for f in entry.owned):
            problem = PREDATES
        if problem is None and any(self.inputs.predates(listed.files[f]) for f in entry.owned):
            problem = self.inputs.why
        if problem is not None:
            self.skipped.append({"entry": entry.kernel, "why": problem})
            return None
        return entry

    def _late(self, listed: _Listed, entry: CannEntry) -> str | None:
        """A file the entry owns that its listing did not look for (a binary named as a
        sub-json's, no sub-json there): found now, and the inputs checked again."""
        late = [name for name in entry.owned if name not in listed.files]
        for name in late:
            try:
                listed.files[name] = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except OSError:
                return CHANGED
        return INPUTS_CHANGED if late and self.inputs.changed() else None

    def read(self, listed: _Listed, entry: CannEntry) -> Bundle | str:
        """The entry's bundle, or why it cannot be sent (CANN's hit check failed)."""
        if listed.size(entry.owned) > self.cap:
            return self.too_big
        try:
            problem = hash_problem(self.fd, entry)
            files = {}
            room = self.cap
            for name in sorted(entry.owned):
                with os.fdopen(open_quietly(self.fd, name), "rb") as f:
                    st = os.fstat(f.fileno())
                    seen = listed.files[name]
                    if (st.st_ino, st.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
                        # Replaced since it was listed: maybe compiled after the inputs changed.
                        return CHANGED
                    if st.st_size > room:  # (grown or replaced since it was listed)
                        return self.too_big
                    files[name] = f.read(st.st_size + 1)  # (one more: it grew)
                room -= len(files[name])
                if room < 0:
                    return self.too_big
        except OSError as e:
            return f"cannot read it: {e.strerror or e}"
        # Read while the ini still names the versions it is filed under.
        if self.ini.changed():
            return INI_CHANGED
        return problem or Bundle(listed.kernel, listed.atime, files)


# -- a chip folder, written --------------------------------------------------------------


class _Full(Exception):
    """The next entry would take the chip folder to its size limit."""


class _Stop(Exception):
    """Nothing more goes into this chip folder; the message says why."""


# Errors that mean the file system (or this user's quota on it) is full.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL = "stopped: the disk is full ({}): nothing more written"
DISK_RESERVE = (
    "stopped: the disk would be left with under {} free (the reserve kept for the jobs "
    "that follow): nothing more written"
)


def disk_reserve(total: int) -> int:
    """The free space a pull or an import leaves on a file system of ``total`` bytes:
    5 % of it, at least 1 GiB, at most 10 % (a small file system keeps a tenth) and
    at most 10 GiB (a 100 TB shared file system with 4 TB free has room to spare)."""
    return min(max(total // 20, 1 << 30), total // 10, 10 << 30)


TOOLKIT_CHANGED = (
    "stopped: op_cache.ini changed while entries went in (the folder's toolkit changed? "
    "CANN then wipes the folder, and would take what is written after as its own)"
)
INPUTS_CHANGED_TAKING = (
    "stopped: the driver or a custom operator package changed while entries went in: "
    "those written since it was last seen unchanged are taken out again"
)
WITHDRAWN = "the driver or a custom operator package changed while it went in"
NOT_THIS_NAMESPACE = "its versions are not this folder's"
# How often a writer looks at the driver and custom packages again (a stat of each of
# their files): the entries written in between are taken out when they changed.
_INPUTS_EVERY = 0.5
_INPUTS_SPACING = 4  # and at least this many times as long as the last look took


class _Writer:
    """Stores bundles into a chip folder open as ``fd`` as CANN stores (module docstring).

    ``ns``'s versions are the only ones it takes (``write_given``).  Its driver
    and custom packages (``inputs``, marked before ``ns`` was digested) are
    looked at again every ``_INPUTS_EVERY`` seconds and when the writing ends
    (``finish``): once they changed, the entries written since they were last
    seen unchanged are taken out and nothing more is written.  Kept, such an
    entry (of the old driver, dated after the new one) would be pushed as the
    new one's.
    """

    def __init__(
        self,
        fd: int,
        limits: Limits,
        report: dict,
        ini: IniMark,
        inputs: InputsMark,
        ns: Namespace,
    ) -> None:
        self.fd = fd
        self.used = chip_used(fd)  # (the folder's names not held: ``has`` asks it)
        self.limit = limits.max_bytes
        self.report = report
        self.ini = ini
        self.inputs = inputs
        self.versions = canonical_json(ns.versions())
        self.stopped: str | None = None  # why nothing more is written, once so
        self._parked: list[int] = []
        # The entries written since the inputs were last seen unchanged: (kernel,
        # bytes, (name, device, inode) of each file).
        self._unconfirmed: list[tuple[str, int, list[tuple[str, int, int]]]] = []
        self._confirmed_at = time.monotonic()
        self._every = _INPUTS_EVERY  # (seconds until the next look)

    def close(self) -> None:
        """Close the lock files kept open (``_locked``); call it once the writes are done."""
        for fd in self._parked:
            os.close(fd)
        self._parked.clear()

    def finish(self) -> None:
        """Once the writing is done: the entries written since the inputs were last
        seen unchanged are taken out if they changed meanwhile."""
        try:
            self._confirm()
        except _Stop as e:
            self._stop(e)

    def write_given(self, kernel: str, manifest: bytes, files: dict[str, bytes]) -> None:
        """``write`` of an entry a remote or an archive gave, with its manifest: refused
        unless the manifest names this folder's versions (a remote that files one
        namespace's value under another's, a mirror out of step, an archive's)."""
        if _versions_of(manifest) != self.versions:
            self._bad(kernel, NOT_THIS_NAMESPACE)
            return
        self.write(Bundle(kernel, _atime_of(manifest), files))

    def has(self, kernel: str) -> bool:
        return fsutil.lexists(f"{kernel}.json", self.fd)

    def fits(self, size: int) -> bool:
        return self.limit is None or self.used + size < self.limit

    def write(self, bundle: Bundle) -> None:
        """Store one bundle; the report says what became of it.  _Full when it does not
        fit; ``stopped`` says why once nothing more may be written (then in the report's
        ``errors``)."""
        if self.stopped is not None:
            return None
        try:
            return self._write(bundle)
        except _Stop as e:
            self._stop(e)
            return None

    def _write(self, bundle: Bundle) -> None:
        kernel, files = bundle.kernel, bundle.files
        main = f"{kernel}.json"
        if not is_plain_name(kernel) or main not in files:
            return self._bad(kernel, "no json named after its kernel")
        reserved = _reserved(kernel)
        if reserved is not None:
            return self._bad(kernel, reserved)
        if not all(_own_name(kernel, name) for name in files):
            return self._bad(kernel, "it brings files not named as CANN names its files")
        if any(fsutil.lexists(name, self.fd) for name in files):
            self.report["present"] += 1
            return None
        if not self.fits(bundle.size):
            raise _Full
        self._check_room([len(data) for data in files.values()])
        with self._locked(kernel) as lock:
            if not lock.free:
                self.report["locked"].append(kernel)
                return None
            if any(fsutil.lexists(name, self.fd) for name in files):  # (CANN re-checks too)
                self.report["present"] += 1
                return None
            why = self._store(bundle, main)
            lock.kept = why is None
        if why is not None:
            return self._bad(kernel, why)
        self.used += bundle.size
        self.report["written"] += 1
        self.report["bytes"] += bundle.size
        if time.monotonic() - self._confirmed_at >= self._every:
            self._confirm()
        return None

    def _confirm(self) -> None:
        """Look at the inputs again: unchanged, the entries written so far are theirs;
        changed (or no longer to be told: a package grown past what is read), those
        written since the last look are taken out (_Stop).  The next look is due in
        ``_INPUTS_EVERY`` or ``_INPUTS_SPACING`` times this one's length, whichever is
        longer: big packages on a slow file system never take most of the run."""
        started = time.monotonic()
        try:
            changed = self.inputs.changed()
        except Refused:
            changed = True
        if not changed:
            self._unconfirmed.clear()
            self._confirmed_at = time.monotonic()
            self._every = max(_INPUTS_EVERY, _INPUTS_SPACING * (self._confirmed_at - started))
            return
        for kernel, size, files in self._unconfirmed:
            self._withdraw(files)
            self.used -= size
            self.report["written"] -= 1
            self.report["bytes"] -= size
            self.report["rejected"].append({"entry": kernel, "why": WITHDRAWN})
        self._unconfirmed.clear()
        raise _Stop(INPUTS_CHANGED_TAKING)

    def _withdraw(self, files: list[tuple[str, int, int]]) -> None:
        """Remove an entry's files (its json first: no entry is seen half gone), each
        only while it is still the file written (CANN's aging may have removed it,
        and a compile made another of that name)."""
        for name, dev, ino in files:
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == (dev, ino):
                    os.unlink(name, dir_fd=self.fd)

    def has_room(self, size: int) -> bool:
        """Whether an entry of ``size`` bytes leaves the disk its reserve; when not,
        the writer stops (``stopped``, in the report's ``errors``)."""
        try:
            self._check_room([size])
        except _Stop as e:
            self._stop(e)
        return self.stopped is None

    def _check_room(self, sizes: list[int]) -> None:
        """_Stop when writing files of ``sizes`` bytes would leave the file system under
        ``disk_reserve`` (each file in whole blocks, one more for the folder)."""
        try:
            st = os.fstatvfs(self.fd)
        except OSError:
            return
        if st.f_blocks == 0:  # (a file system that tells nothing of its size)
            return
        block = st.f_frsize or st.f_bsize or 1
        need = sum(-(-size // block) * block for size in sizes) + block
        reserve = disk_reserve(st.f_blocks * block)
        if st.f_bavail * block - need < reserve:
            raise _Stop(DISK_RESERVE.format(_human(reserve)))

    def _stop(self, e: _Stop) -> None:
        self.stopped = str(e)
        self.report.setdefault("errors", []).append(self.stopped)
        log.warning("%s", self.stopped)

    def _bad(self, kernel: str, why: str) -> None:
        self.report["rejected"].append({"entry": kernel, "why": why})
        log.warning("%s not written: %s", kernel, why)

    @contextlib.contextmanager
    def _locked(self, kernel: str) -> Iterator[_EntryLock]:
        """CANN's ``LockAndOpenCacheFile``: ``<kernel>.lock`` opened a+, chmod 0640,
        a non-blocking whole-file write lock; not ``free`` when another process holds
        it (or something that is not a regular file stands there, or a file of more
        than one name: a hard link to the aging lock this process holds, which
        closing it would release).

        A lock file this made is removed, still locked, unless the caller says
        the entry was ``kept``: a pull that writes nothing leaves no lock file
        (only if it is still the file made: a regular file of the same inode).
        _Stop when the disk is full.
        """
        name = f"{kernel}.lock"
        try:
            lock_fd, st, created = fsutil.made_or_opened(
                name, os.O_RDWR | os.O_APPEND, LOCK_MODE, dir_fd=self.fd
            )
        except OSError as e:
            if e.errno in _NO_SPACE:
                raise _Stop(DISK_FULL.format(e.strerror)) from None
            yield _EntryLock(False)
            return
        if st.st_nlink != 1 or held_lock(st) is not None:
            # Any close of the aging lock's file releases it: kept open until close().
            self._parked.append(lock_fd)
            yield _EntryLock(False)
            return
        # Held as a lock of this process's: a file of the entry swapped meanwhile for
        # another name of it is refused by the checks' reads, not closed under it.
        with holding(lock_fd, st, name):
            if created:  # (one there already keeps its mode: see fsutil.made_or_opened)
                with contextlib.suppress(OSError):
                    os.fchmod(lock_fd, LOCK_MODE)
            lock = _EntryLock(try_lock(lock_fd, fcntl.LOCK_EX))
            try:
                yield lock
            finally:
                if created and lock.free and not lock.kept:
                    _remove_own(self.fd, name, st)

    def _store(self, bundle: Bundle, main: str) -> str | None:
        """Write the files (json last), check them on disk, then show the json;
        None, or why not (then nothing of it is left).  _Stop (nothing of it left)
        when op_cache.ini changed by the time the json is shown."""
        order = sorted(bundle.files, key=lambda n: (n == main, n.endswith(".json"), n))
        done: list[str] = []  # what to remove if the entry cannot be shown
        stop = None
        try:
            for name in order[:-1]:
                done.append(self._temp(name, bundle))
                os.rename(done[-1], name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                done[-1] = name
            tmp = self._temp(main, bundle)
            done.append(tmp)
            why = self._check(bundle, main, tmp)
            if why is None:
                os.rename(tmp, main, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                done[-1] = main
                # Its lock still held.  CANN of a new toolkit rewrites the ini first, then
                # wipes the folder: an entry shown before the rewrite is wiped, one shown
                # after is caught here.  (Its kernel names carry no toolkit version: it
                # would reuse an old toolkit's kernel.)
                if not self.ini.changed():
                    files = []  # (json first: taken out, the entry is gone before its files)
                    for name in reversed(done):
                        st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                        files.append((name, st.st_dev, st.st_ino))
                    self._unconfirmed.append((bundle.kernel, bundle.size, files))
                    return None
                why = stop = TOOLKIT_CHANGED
        except (OSError, OverflowError, ValueError) as e:  # one entry's bad data ends no run
            why = f"cannot write it: {getattr(e, 'strerror', None) or e}"
            if isinstance(e, OSError) and e.errno in _NO_SPACE:
                # Every entry after would fail the same way: the run ends here.
                stop = DISK_FULL.format(e.strerror)
        for name in done:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.fd)
        if stop is not None:
            raise _Stop(stop)
        return why

    def _temp(self, name: str, bundle: Bundle) -> str:
        """``name``'s bytes in CANN's ``<name>_<pid>_<usec>_<rand>.temp`` (0640 exactly),
        with the source's access time."""
        tmp = f"{name}_{os.getpid()}_{time.time_ns() // 1000}_{random.randint(0, 2**31 - 1)}.temp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, LOCK_MODE, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(bundle.files[name])
            os.fchmod(fd, LOCK_MODE)
            os.utime(fd, ns=(bundle.atime * 1_000_000_000, time.time_ns()))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise
        os.close(fd)
        return tmp

    def _check(self, bundle: Bundle, main: str, tmp: str) -> str | None:
        """CANN's hit check on the files as written, the json still under its temp name."""
        names = [n for n in bundle.files if n != main] + [tmp]
        files = {n: os.stat(n, dir_fd=self.fd, follow_symlinks=False) for n in names}
        entry = CannEntry(self.fd, tmp, files)
        why = entry.problem or hash_problem(self.fd, entry)
        if why is None and entry.owned != set(names):
            why = "its files are not the ones its json names"
        return why.replace(tmp, main) if why else None


class _EntryLock:
    """An entry's lock as ``_Writer._locked`` took it: ``free`` (taken), ``kept`` (the
    entry was written: its lock file stays, as CANN's do)."""

    __slots__ = ("free", "kept")

    def __init__(self, free: bool) -> None:
        self.free = free
        self.kept = False


def _remove_own(fd: int, name: str, made: os.stat_result) -> None:
    """Unlink ``name`` of the folder ``fd`` if it is still the regular file ``made``
    describes (never a link, nor a file put in its place meanwhile)."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (made.st_dev, made.st_ino):
            os.unlink(name, dir_fd=fd)
    except OSError as e:
        log.debug("%s left: %s", name, e)


def _human(size: int) -> str:
    """``size`` bytes for a person: KiB, MiB or GiB."""
    for shift, unit in ((30, "GiB"), (20, "MiB")):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size / 1024:.1f} KiB"


# -- the local side --------------------------------------------------------------------


class _Chip:
    """A chip folder of a CANN root, opened (and made, when taking) under the trust rule."""

    def __init__(self, root: Path, soc: str, modes: fsutil.Modes, *, create: bool) -> None:
        if create:
            # (made where the links of this user's or root's lead, never another's)
            fsutil.makedirs(Path(trust.check_root(root, modes)), modes)
        try:
            # Reached one folder at a time, each link judged as it is met; kept open
            # (``root_fd``): what is made in the root is made through it.
            self.root_fd = root_fd = trust.open_root(root, modes)[0]
        except (FileNotFoundError, NotADirectoryError):
            raise Refused(f"no CANN kernel cache at {root}: no such folder") from None
        try:
            trust.check(os.fstat(root_fd), modes, root)
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(soc, modes.dir_bits, dir_fd=root_fd)
            try:
                self.fd = open_chip_folder(root_fd, soc, modes, f"{root}/{soc}")
            except FileNotFoundError:
                raise Refused(f"no CANN kernel cache for {soc} in {root}") from None
        except BaseException:
            os.close(root_fd)
            raise

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.root_fd)


def _chips(root: Path, soc: str | None) -> tuple[list[str], list[str]]:
    """(the chip folders to move, asked or each one of ``root``; the folders of root
    left out, named as no chip is).  ConfigError for a ``soc`` no chip has."""
    if soc:  # (empty is unset, as every setting)
        return [check_soc_version(soc)], []
    try:
        # (listed through a handle reached as _Chip reaches it: another user's link on the
        # way is refused here, not read as the chips of whatever it names)
        root_fd = trust.open_root(root, None)[0]
    except trust.UntrustedFolder:
        raise
    except OSError:
        folders = []
    else:
        try:
            with os.scandir(root_fd) as listing:
                folders = sorted(
                    e.name
                    for e in listing
                    if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
                )
        except OSError:
            folders = []
        finally:
            os.close(root_fd)
    names, others = [], []
    for name in folders:
        try:
            names.append(check_soc_version(name))
        except ConfigError:
            # lost+found, a copy (Ascend910B1.bak), notes: an archive naming one is refused
            # whole, a remote would hold it as a chip.
            log.info("%s/%s left out: not a chip's name", root, name)
            others.append(name)
    if not names:
        raise ConfigError(f"no chip folder in {root}: say which chip with --soc_version")
    return names, others


def _new_report(ns: Namespace) -> dict:
    return {
        "namespace": {"soc": ns.soc, "id": ns.ident, **ns.versions()},
        "written": 0, "bytes": 0, "present": 0, "locked": [], "rejected": [], "corrupt": [],
        "gone": [], "stopped_at_limit": False, "ini_created": False,
    }  # fmt: skip


def _taking(
    root: Path, soc: str, settings: Settings, ns: Namespace, mark: IniMark | None, dry_run: bool
) -> tuple[dict, _Chip | None, IniMark | None]:
    """The report of a chip folder that takes entries, the folder opened, made if
    missing, and the mark of its op_cache.ini, created if missing (``mark`` None)
    (no folder nor mark on a dry run: nothing is made)."""
    report = _new_report(ns)
    if dry_run:
        return report, None, None
    chip = _Chip(root, soc, fsutil.modes_for(settings.shared_group), create=True)
    if mark is None:
        try:
            made = create_ini(root / INI_NAME, ns, settings.shared_group, chip.root_fd)
            mark, report["ini_created"] = made
        except BaseException:
            chip.close()
            raise
    return report, chip, mark


# -- the remote ------------------------------------------------------------------------------


def _index_chip(soc: str) -> str:
    return cann_chip(soc)


_VERSION_KEYS = ("adk_version", "ops_version", "driver")


def _shard_of(kernel: str) -> int:
    """The part of its namespace's index a kernel's row is kept in."""
    return zlib.crc32(kernel.encode("utf-8", "surrogateescape")) % SHARDS


def _shard_key(shard: int) -> str:
    # (in the namespace's chip, beside its kernels: "#" begins no kernel given or taken)
    return f"{SHARD_PREFIX}{shard:02x}"


def _read_head(remote: Remote, soc: str) -> tuple[dict[str, dict], bool]:
    """(the chip's namespaces in the remote's index head, whether any part of it was
    damaged); the parts that are not as ``_write_index`` writes them are dropped,
    so a push writes back a sound head.  Refused when it may be sound to another
    opcache (over this one's entry cap, another format, its rows split otherwise):
    never replaced by a new one."""
    got = remote.get_many(_index_chip(soc), [INDEX]).get(INDEX)
    if got is None:
        return {}, False
    if isinstance(got, RemoteCorrupt) and got.maybe_sound:
        raise Refused(
            f"the remote's index of {soc} cannot be read here ({got}): another opcache's, "
            "with a bigger OPCACHE_REMOTE_MAX_ENTRY_MB? (set the same on every machine)"
        )
    if isinstance(got, RemoteCorrupt):
        log.warning("the remote's index of %s is damaged (%s): starting a new one", soc, got)
        return {}, True
    try:
        index = _json.loads(got[0].files.get(INDEX_FILE, b""))
    except ValueError:
        index = None
    if not isinstance(index, dict):
        log.warning("the remote's index of %s is damaged: starting a new one", soc)
        return {}, True
    if index.get("format") != FORMAT:
        raise Refused(
            f"the remote's index of {soc} is of another format ({index.get('format')!r}): "
            "a newer opcache's? (not replaced)"
        )
    found = index.get("namespaces")
    spaces = {}
    damaged = not isinstance(found, dict)
    for ident, space in (found if isinstance(found, dict) else {}).items():
        if not isinstance(space, dict) or not all(
            isinstance(space.get(k), str) for k in _VERSION_KEYS
        ):
            damaged = True
            continue
        shards = space.get("shards")
        if type(shards) is not int or shards < 1:
            damaged = True
            continue
        if shards != SHARDS:
            raise Refused(
                f"the remote's index of {soc} splits namespace {ident} otherwise "
                f"({shards} parts): another opcache's? (not replaced)"
            )
        custom = space.get("custom")
        custom_part = {"custom": custom} if isinstance(custom, str) and custom else {}
        damaged |= "custom" in space and not custom_part
        pushed = space.get("pushed")
        pushed_part = {"pushed": pushed} if type(pushed) is int and pushed >= 0 else {}
        damaged |= "pushed" in space and not pushed_part
        versions = {k: space[k] for k in _VERSION_KEYS}
        spaces[ident] = {**versions, **custom_part, **pushed_part, "shards": SHARDS}
    if damaged:
        log.warning("the remote's index of %s is damaged in part: those parts dropped", soc)
    return spaces, damaged


def _sound_rows(rows: object) -> dict[str, tuple[int, int]]:
    """{kernel: (last access, size)} of an index's rows, bad rows dropped: among them
    the names no pull can fetch as a kernel (one no file name is: a lone surrogate
    JSON may carry; one a part of the index takes: ``#...``)."""
    out = {}
    for kernel, row in (rows if isinstance(rows, dict) else {}).items():
        if (
            _fetchable(kernel)
            and isinstance(row, list)
            and len(row) == 2
            and all(type(v) is int for v in row)
        ):
            out[kernel] = (row[0], row[1])
    return out


def _fetchable(kernel: str) -> bool:
    """Whether a row's name may be a kernel a pull fetches and writes."""
    if not is_plain_name(kernel) or is_cann_index(kernel):
        return False
    try:
        kernel.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


SOUND, DAMAGED, FOREIGN = "", "damaged", "foreign"


def _shard_rows(value: object) -> tuple[dict[str, tuple[int, int]], str]:
    """(the rows of a part of the index as fetched, SOUND, DAMAGED: its bad rows
    dropped, or FOREIGN: another opcache's, maybe sound, never replaced)."""
    if value is None:
        return {}, SOUND
    if isinstance(value, RemoteCorrupt):
        return {}, FOREIGN if value.maybe_sound else DAMAGED
    try:
        shard = _json.loads(value[0].files.get(INDEX_FILE, b""))  # type: ignore[index]
    except ValueError:
        shard = None
    if not isinstance(shard, dict):
        return {}, DAMAGED
    if shard.get("format") != FORMAT:
        return {}, FOREIGN
    found = shard.get("rows")
    rows = _sound_rows(found)
    return rows, SOUND if isinstance(found, dict) and len(rows) == len(found) else DAMAGED


def _shards(
    remote: Remote, ns: Namespace, first: int = 0, last: int = SHARDS
) -> Iterator[tuple[int, dict[str, tuple[int, int]], str]]:
    """(shard, its rows, how it was found: ``_shard_rows``) of the namespace's index
    parts ``first`` to ``last`` (excluded), fetched ``_SHARDS_AT_ONCE`` at a time."""
    for at in range(first, last, _SHARDS_AT_ONCE):
        keys = [_shard_key(i) for i in range(at, min(at + _SHARDS_AT_ONCE, last))]
        got = remote.get_many(ns.remote_chip, keys)
        for shard, key in enumerate(keys, at):
            yield (shard, *_shard_rows(got.pop(key, None)))


class _Rows:
    """Rows for the index, by group of ``_SHARDS_AT_ONCE`` parts: held in memory."""

    def __init__(self, rows: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.rows = rows or {}
        self.failed: str | None = None

    def group(self, at: int) -> dict[int, dict[str, tuple[int, int]]]:
        out: dict[int, dict[str, tuple[int, int]]] = {}
        for kernel, row in self.rows.items():
            shard = _shard_of(kernel)
            if at <= shard < at + _SHARDS_AT_ONCE:
                out.setdefault(shard, {})[kernel] = row
        return out


class _Spool(_Rows):
    """Rows for the index kept on disk (``TMPDIR``) as a push lists them, a file per
    group of parts, so that a push holds one group's rows at a time, not every
    kernel's.  ``failed`` says why once the disk refused them."""

    def __init__(self) -> None:
        super().__init__()
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._files: dict[int, BinaryIO] = {}

    def add(self, kernel: str, atime: int, size: int) -> None:
        if self.failed is not None:
            return
        group = _shard_of(kernel) // _SHARDS_AT_ONCE
        try:
            if self._folder is None:
                self._folder = tempfile.TemporaryDirectory(prefix="opcache-push-")
            f = self._files.get(group)
            if f is None:
                path = os.path.join(self._folder.name, str(group))
                f = self._files[group] = open(path, "wb")  # noqa: SIM115
            # (NUL-separated: no file name holds one)
            f.write(f"{kernel}\0{atime}\0{size}\0".encode("utf-8", "surrogateescape"))
        except OSError as e:
            self._failing(e)

    def _failing(self, e: OSError) -> None:
        where = self._folder.name if self._folder else tempfile.gettempdir()
        self.failed = f"cannot keep its rows in {where}: {e.strerror or e}"

    def flush(self) -> None:
        """Every file's rows written out, before the index is: a disk that filled meanwhile
        refuses the rows still buffered here (``failed``), not at a file's close."""
        for f in self._files.values():
            if self.failed is not None:
                return
            try:
                f.flush()
            except OSError as e:
                self._failing(e)

    def group(self, at: int) -> dict[int, dict[str, tuple[int, int]]]:
        out: dict[int, dict[str, tuple[int, int]]] = {}
        f = self._files.pop(at // _SHARDS_AT_ONCE, None)
        if f is None:
            return out
        f.close()
        with open(f.name, "rb") as r:
            fields = r.read().split(b"\0")
        os.unlink(f.name)
        for i in range(0, len(fields) - 2, 3):
            kernel = fields[i].decode("utf-8", "surrogateescape")
            atime, size = int(fields[i + 1]), int(fields[i + 2])
            rows = out.setdefault(_shard_of(kernel), {})
            old = rows.get(kernel)
            rows[kernel] = (max(atime, old[0]) if old else atime, size)
        return out

    def close(self) -> None:
        for f in self._files.values():
            with contextlib.suppress(OSError):  # (rows not written out: ``failed`` says so)
                f.close()
        self._files.clear()
        if self._folder is not None:
            self._folder.cleanup()


def _have(remote: Remote, chip: str, keys: list[str]) -> set[str]:
    """The keys the remote holds, asked in batches."""
    found: set[str] = set()
    for at in range(0, len(keys), _BATCH):
        found |= remote.have_many(chip, keys[at : at + _BATCH])
    return found


def _manifest(ns: Namespace, bundle: Bundle) -> bytes:
    inputs = {"cann": ns.versions(), "soc": ns.soc, "atime": bundle.atime}
    return make_manifest(bundle.kernel, bundle.files, 0.0, inputs, time.time())


def _connect(settings: Settings) -> Remote:
    if settings.remote is None:
        raise ConfigError(
            settings.remote_error
            or "no remote is set: OPCACHE_REMOTE=redis://host:6379/0, or --remote URL"
        )
    return open_remote(settings.remote)


def _settings(
    settings: Settings | None, op_compiler_cache_dir: str | None, remote: str | None
) -> Settings:
    if settings is not None:
        return settings
    return resolve_settings(op_compiler_cache_dir=op_compiler_cache_dir, remote=remote)


def _each_chip(
    transfer: Callable[..., dict],
    soc_version: str | None,
    settings: Settings,
    environ: Mapping[str, str] | None,
    dry_run: bool,
    progress: Callable[[int], None] | None,
) -> dict[str, object]:
    """``transfer`` (a push or a pull) of each chip folder through one connection; a chip
    that cannot take part is reported ``refused``, the others still go."""
    env = os.environ if environ is None else environ
    root = cann_root(settings)
    chips: dict[str, object] = {}
    socs, others = _chips(root, soc_version)
    client = _connect(settings)
    try:
        for soc in socs:
            try:
                chips[soc] = transfer(client, root, soc, settings, env, dry_run, progress)
            except (Refused, trust.UntrustedFolder) as e:
                chips[soc] = {"refused": str(e)}
    finally:
        client.close()
    return {"remote": client.where, "root": str(root), "dry_run": dry_run, "chips": chips,
            "not_chip_folders": others}  # fmt: skip


def push(
    soc_version: str | None = None,
    *,
    op_compiler_cache_dir: str | None = None,
    remote: str | None = None,
    settings: Settings | None = None,
    environ: Mapping[str, str] | None = None,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
) -> dict[str, object]:
    """Upload the entries of CANN's chip folders (or ``soc_version``'s) the remote lacks.

    The folder is found as CANN finds it (``op_compiler_cache_dir`` >
    ``ASCEND_CACHE_PATH`` > ``$HOME/atc_data``), the remote from ``remote``
    (else ``OPCACHE_REMOTE``).  Returns {"remote", "root", "chips": {soc:
    report}}; a chip that cannot give is reported with ``refused``.  Raises
    RemoteError when the remote fails, ConfigError when none is set.
    """
    return _each_chip(
        _push_chip,
        soc_version,
        _settings(settings, op_compiler_cache_dir, remote),
        environ,
        dry_run,
        progress,
    )


def _push_chip(
    client: Remote,
    root: Path,
    soc: str,
    settings: Settings,
    environ: Mapping[str, str],
    dry_run: bool,
    progress: Callable[[int], None] | None,
) -> dict:
    ns, ini_mark, inputs = giving_namespace(root, soc, environ, settings.shared_group)
    chip = _Chip(root, soc, fsutil.modes_for(settings.shared_group), create=False)
    with contextlib.ExitStack() as held:
        held.callback(chip.close)
        cap = client.max_entry_bytes
        reader = _Reader(chip.fd, ini_mark, inputs, cap, f"over its size cap ({cap} bytes)")
        report: dict = {
            "namespace": {"soc": soc, "id": ns.ident, **ns.versions()},
            "entries": 0, "present": 0, "sent": 0, "bytes": 0,
            "not_sent": [], "skipped": reader.skipped,
        }  # fmt: skip
        if dry_run:
            report["would_send"] = 0
        # (kernel, last access, size) of what the remote holds, for its index: kept on
        # disk as listed, merged into the index's parts at the end.
        stored = _Spool() if not dry_run else None
        if stored is not None:
            held.callback(stored.close)

        def settle(batch: list[tuple[str, int, int]], sending: Future[list[int]]) -> None:
            for (kernel, atime, size), sent in zip(batch, sending.result(), strict=True):
                if sent:
                    report["sent"] += 1
                    report["bytes"] += sent
                    assert stored is not None
                    stored.add(kernel, atime, size)
                else:
                    why = "the remote is read-only" if client.read_only else "over its size cap"
                    report["not_sent"].append({"entry": kernel, "why": why})

        # One thread talks to the remote (asks, sends: packing, the network) while
        # this one reads and checks the next entries; two batches in flight at
        # most, so memory stays bounded.  An entry's json is read only once the
        # remote said it lacks it.
        pending: deque[tuple[list[tuple[str, int, int]], Future[list[int]]]] = deque()
        batch: list[tuple[str, bytes, dict[str, bytes]]] = []
        rows: list[tuple[str, int, int]] = []  # (kernel, last access, size) of each
        done = 0

        def send() -> None:
            nonlocal batch, rows
            pending.append((rows, remote.submit(client.put_many, ns.remote_chip, batch)))
            batch, rows = [], []
            if len(pending) > 1:
                settle(*pending.popleft())

        def give(item: _Listed) -> None:
            entry = reader.check(item)
            if entry is None:
                return
            report["entries"] += 1
            if dry_run:
                report["would_send"] += 1
                return
            bundle = reader.read(item, entry)
            if isinstance(bundle, str):
                # (what the remote would refuse is not sent, as when it refuses)
                kind = "not_sent" if bundle == reader.too_big else "skipped"
                report[kind].append({"entry": item.kernel, "why": bundle})
                return
            batch.append((item.kernel, _manifest(ns, bundle), bundle.files))
            rows.append((item.kernel, bundle.atime, item.size(entry.owned)))
            if len(batch) == _BATCH or sum(r[2] for r in rows) >= _BATCH_BYTES:
                send()

        with ThreadPoolExecutor(1, thread_name_prefix="opcache-push") as remote:
            for part in reader.parts():
                listed = [item for item in part if reader.listable(item)]
                kernels = [item.kernel for item in listed]
                there = remote.submit(_have, client, ns.remote_chip, kernels).result()
                done += len(part) - len(listed)
                for item in listed:
                    if item.kernel in there:
                        # (its size: its files by name, the ones it owns as CANN names them)
                        report["entries"] += 1
                        report["present"] += 1
                        if stored is not None:
                            stored.add(item.kernel, item.atime, item.size())
                    else:
                        give(item)
                    done += 1
                    if progress is not None:
                        progress(min(done * 100 // max(reader.total, 1), 100))
            if batch:
                send()
            while pending:
                settle(*pending.popleft())
        if reader.stopped is not None:
            report["errors"] = [reader.stopped]
        if stored is not None:
            stored.flush()
            why = _write_index(client, ns, stored)
            if why is not None:
                log.warning("%s", why)
                report["errors"] = [*report.get("errors", []), why]
    return report


# A namespace no push wrote or confirmed for this long leaves the index when its head
# is next written (docs/cann.md): its machines are gone or run other versions.
INDEX_KEEP_SECONDS = 30 * 86400
_CONFIRM_SECONDS = 86400  # a push confirms its namespace at most once a day


def _write_index(
    client: Remote,
    ns: Namespace,
    rows: Mapping[str, tuple[int, int]] | _Rows,
    gone: Collection[str] = (),
    *,
    pushing: bool = True,
) -> str | None:
    """Merge ``rows`` into the namespace's index on the remote (latest access wins),
    and drop the entries a pull found ``gone`` (evicted), each part of it read,
    merged and written on its own (only those that changed), ``_SHARDS_AT_ONCE`` at
    a time; None, or why the remote did not take it.  A push (``pushing``) stamps
    ``ns`` as pushed now in the head; other namespaces not pushed for
    ``INDEX_KEEP_SECONDS`` are dropped as the head is written (their parts removed)."""
    if client.read_only:
        return None
    if not isinstance(rows, _Rows):
        rows = _Rows(rows)
    soc, chip, cap = ns.soc, ns.remote_chip, client.max_entry_bytes
    try:
        _read_head(client, soc)  # (one another opcache may still read: not replaced)
    except Refused as e:
        return f"{e}: not written"
    if rows.failed is not None:
        return f"the remote's index of {soc} was not written: {rows.failed}"
    gone_in: dict[int, set[str]] = {}
    for kernel in gone:
        gone_in.setdefault(_shard_of(kernel), set()).add(kernel)
    changed, foreign, refused, over = False, 0, 0, 0
    for at in range(0, SHARDS, _SHARDS_AT_ONCE):
        local = rows.group(at)
        if not pushing and not local and not any(at <= i < at + _SHARDS_AT_ONCE for i in gone_in):
            continue  # (a pull drops what it found gone: those parts alone are read)
        writes = []
        for shard, before, state in _shards(client, ns, at, at + _SHARDS_AT_ONCE):
            if state == FOREIGN:
                foreign += 1
                continue
            entries = {k: v for k, v in before.items() if k not in gone_in.get(shard, ())}
            for kernel, (atime, size) in local.get(shard, {}).items():
                old = entries.get(kernel)
                entries[kernel] = (max(atime, old[0]) if old else atime, size)
            if entries != before or state == DAMAGED:
                rows_json = {k: list(v) for k, v in entries.items()}
                data = canonical_json({"format": FORMAT, "rows": rows_json})
                writes.append((_shard_key(shard), data))
        for key, data in writes:
            took = _put_value(client, chip, key, data, soc)
            over += took is None
            refused += took is False
        changed |= bool(writes)
    why = []
    if foreign:
        why.append(
            f"the remote's index of {soc}: {foreign} of its parts cannot be read here "
            "(another opcache's, with a bigger OPCACHE_REMOTE_MAX_ENTRY_MB?): not replaced"
        )
    if over:
        why.append(
            f"the remote's index of {soc} was not written in part: {over} of its parts over "
            f"the entry cap ({cap} bytes): pulls get none of the entries sent since that "
            "they name (raise OPCACHE_REMOTE_MAX_ENTRY_MB on every machine)"
        )
    head = _write_head(client, ns, changed, pushing=pushing)
    if head is not None:
        why.append(head)
    if refused:
        why.append(f"the remote did not take the index of {soc}: pulls get nothing new")
    return "; ".join(why) or None


def _write_head(client: Remote, ns: Namespace, changed: bool, *, pushing: bool) -> str | None:
    """Write the chip's head (read again now: a push meanwhile) when ``ns`` is not in it,
    it is damaged, a push changed rows (``changed``) or confirms ``ns`` (once a day);
    then remove the parts of the namespaces it dropped.  None, or why not."""
    now = int(time.time())
    try:
        spaces, damaged = _read_head(client, ns.soc)
    except Refused as e:
        return f"{e}: not written"
    pushed = spaces.get(ns.ident, {}).get("pushed")
    confirm = pushing and (pushed is None or not 0 <= now - pushed < _CONFIRM_SECONDS)
    if ns.ident in spaces and not damaged and not confirm and not (pushing and changed):
        return None  # nothing new: a cron push of an unchanged folder writes nothing
    dropped = []
    for ident, space in list(spaces.items()):
        if ident == ns.ident:
            continue
        if "pushed" not in space:
            space["pushed"] = now  # (hand-written: counted from now)
        elif now - space["pushed"] > INDEX_KEEP_SECONDS:
            log.info(
                "%s: namespace %s not pushed for 30 days: left out of the index", ns.soc, ident
            )
            dropped.append(ident)
            del spaces[ident]
    spaces[ns.ident] = {
        **ns.versions(),
        "pushed": now if pushing or pushed is None else pushed,
        "shards": SHARDS,
    }
    data = canonical_json({"format": FORMAT, "soc": ns.soc, "namespaces": spaces})
    if not _put_value(client, _index_chip(ns.soc), INDEX, data, ns.soc):  # (a small value)
        return f"the remote did not take the index of {ns.soc}: pulls get nothing new"
    for ident in dropped:  # (their entries stay until the remote evicts them)
        chip = cann_chip(ns.soc, ident)
        try:
            for shard in range(SHARDS):
                client.discard(chip, _shard_key(shard))
        except RemoteError as e:
            log.debug("%s: the index of namespace %s left: %s", ns.soc, ident, e)
    return None


def _put_value(client: Remote, chip: str, key: str, data: bytes, soc: str) -> bool | None:
    """Store one value of the index (the head or a part); whether the remote took it
    (None: over its entry cap, not sent)."""
    manifest = make_manifest(key, {INDEX_FILE: data}, 0.0, {"soc": soc}, time.time())
    if len(manifest) + len(data) > client.max_entry_bytes:
        return None
    # (An entry's key names its contents: a remote may keep a key's first value, the
    # index is the one kind of value that changes.  One refused leaves the one there.)
    return bool(client.replace(chip, key, manifest, {INDEX_FILE: data}))


def pull(
    soc_version: str | None = None,
    *,
    op_compiler_cache_dir: str | None = None,
    remote: str | None = None,
    settings: Settings | None = None,
    environ: Mapping[str, str] | None = None,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
) -> dict[str, object]:
    """Download into CANN's chip folder (``soc_version``, else each one there) the
    entries of its namespace the remote has and it lacks, as CANN writes them.

    For a job launcher: call it before the job starts (``push`` at its end, or
    from cron).  Returns {"remote", "root", "chips": {soc: report}}; a chip
    refused (versions differ, invalid ini) has ``refused`` and nothing written.
    Raises RemoteError when the remote fails, ConfigError when none is set.
    """
    return _each_chip(
        _pull_chip,
        soc_version,
        _settings(settings, op_compiler_cache_dir, remote),
        environ,
        dry_run,
        progress,
    )


def _pull_chip(
    client: Remote,
    root: Path,
    soc: str,
    settings: Settings,
    environ: Mapping[str, str],
    dry_run: bool,
    progress: Callable[[int], None] | None,
) -> dict:
    ns, mark, inputs = taking_namespace(root, soc, environ, settings.shared_group)
    spaces, _ = _read_head(client, soc)
    if ns.ident not in spaces:
        others = [_described(s) for s in spaces.values()]
        if others:
            raise Refused(
                f"the remote holds {soc} entries only for other versions ({'; '.join(others)}), "
                f"not for this folder's {ns.describe()}: nothing pulled"
            )
    report, chip, mark = _taking(root, soc, settings, ns, mark, dry_run)
    if chip is None:
        try:
            there = _Chip(root, soc, fsutil.modes_for(settings.shared_group), create=False)
        except Refused:  # (not there yet)
            plan = _Plan(client, ns, lambda kernel: False, ns.ident in spaces)
        else:
            try:
                has = lambda kernel: fsutil.lexists(f"{kernel}.json", there.fd)  # noqa: E731
                plan = _Plan(client, ns, has, ns.ident in spaces)
            finally:
                there.close()
        report["would_pull"] = plan.wanted
        return report
    # (Read before the aging lock is taken: see import_archive.)
    limits = read_limits(root, environ, settings.shared_group)
    with contextlib.ExitStack() as held:
        held.callback(chip.close)
        if not _fill_lock(held, chip, report):
            return report
        assert mark is not None
        writer = _Writer(chip.fd, limits, report, mark, inputs, ns)
        held.callback(writer.close)
        held.callback(writer.finish)  # (first: its lock files and the folder still held)
        plan = _Plan(client, ns, writer.has, ns.ident in spaces)
        report["present"] = plan.present
        batches = plan.batches()
        batch = next(batches, None)
        if batch is not None and not writer.has_room(batch[0][1]):
            batch = None  # (a disk under its reserve already: nothing fetched)
        done = 0
        # One thread fetches the next batch while this one writes the last.
        with ThreadPoolExecutor(1, thread_name_prefix="opcache-pull") as fetcher:
            chip_name = ns.remote_chip
            if batch is not None:
                ahead = fetcher.submit(client.get_many, chip_name, [k for k, _ in batch])
            while batch is not None:
                got = ahead.result()
                after = next(batches, None)
                if after is not None:
                    ahead = fetcher.submit(client.get_many, chip_name, [k for k, _ in after])
                if not writer.fits(batch[0][1]):
                    report["stopped_at_limit"] = True
                kernels = [k for k, _ in batch]
                if report["stopped_at_limit"] or not _write_batch(writer, kernels, got, report):
                    ahead.cancel()  # (what is on its way already is not waited for)
                    break
                done += len(batch)
                if progress is not None:
                    progress(min(done * 100 // max(plan.wanted, 1), 100))
                batch = after
    report["discarded"] = _discard_damaged(client, ns, report["corrupt"])
    if report["gone"] or report["discarded"]:
        why = _write_index(client, ns, {}, [*report["gone"], *report["discarded"]], pushing=False)
        if why is not None:  # (the next push drops them again)
            log.warning("%s", why)
    return report


class _Plan:
    """What a pull fetches, most recently used first, without holding every row of
    the index: a first pass over its parts counts the rows this folder lacks
    (``wanted``) in bins of last-access time (at most ``_BINS``: a bin's span of
    seconds doubles while there are more), which cut the times into spans of at
    most ``WINDOW`` rows but for a bin of more; ``batches`` then reads the parts
    again for each window of at most ``WINDOW`` rows, newest first, and holds that
    window's rows alone, sorted."""

    def __init__(
        self, client: Remote, ns: Namespace, has: Callable[[str], bool], indexed: bool
    ) -> None:
        self.client = client
        self.ns = ns
        self.has = has
        self.wanted = self.present = 0
        self._warned: set[int] = set()
        bins: dict[int, int] = {}
        shift = 0
        for rows in self._rows() if indexed else ():
            for kernel, (atime, _) in rows.items():
                if has(kernel):
                    self.present += 1
                    continue
                self.wanted += 1
                at = atime >> shift
                bins[at] = bins.get(at, 0) + 1
                while len(bins) > _BINS:
                    shift += 1
                    wider: dict[int, int] = {}
                    for at, count in bins.items():
                        wider[at >> 1] = wider.get(at >> 1, 0) + count
                    bins = wider
        # Spans of last access (newest, oldest), newest first, touching each other, each
        # of at most WINDOW rows as counted but for a bin of more alone (``batches``
        # takes that one in windows of WINDOW rows).
        self.windows: list[tuple[int | None, int | None]] = []
        newest: int | None = None
        count = 0
        for at in sorted(bins, reverse=True):
            if count and count + bins[at] > WINDOW:
                oldest = (at + 1) << shift
                self.windows.append((newest, oldest))
                newest, count = oldest - 1, 0
            count += bins[at]
        if count:
            self.windows.append((newest, None))

    def _rows(self) -> Iterator[dict[str, tuple[int, int]]]:
        for shard, rows, state in _shards(self.client, self.ns):
            if state != SOUND and shard not in self._warned:
                self._warned.add(shard)
                log.warning(
                    "%s: part %02x of the remote's index is %s: its rows left out",
                    self.ns.soc,
                    shard,
                    "damaged" if state == DAMAGED else "not one this opcache reads",
                )
            yield rows

    def batches(self) -> Iterator[list[tuple[str, int]]]:
        """Batches of (kernel, size) to fetch, most recently used first (by last access,
        then name): per span of ``windows``, a window of its ``WINDOW`` first rows
        (a heap), then of the next ones after the last taken, until one falls short."""
        for newest, oldest in self.windows:
            after: tuple[int, str] | None = None  # (-last access, kernel) of the last taken
            while True:
                chosen = heapq.nsmallest(
                    WINDOW,
                    (
                        (-atime, kernel, size)
                        for rows in self._rows()
                        for kernel, (atime, size) in rows.items()
                        if (newest is None or atime <= newest)
                        and (oldest is None or atime >= oldest)
                        and (after is None or (-atime, kernel) > after)
                        and not self.has(kernel)
                    ),
                )
                for at in range(0, len(chosen), _BATCH):
                    yield [(kernel, size) for _, kernel, size in chosen[at : at + _BATCH]]
                if len(chosen) < WINDOW:
                    break
                after = chosen[-1][:2]
                del chosen  # (before the next window's are chosen: one window held at once)


def _discard_damaged(client: Remote, ns: Namespace, corrupt: list[dict]) -> list[str]:
    """Remove the entries of ``corrupt`` from the remote (not a read-only one): push asks
    only whether a key is there, so a damaged value would stand for good, every pull
    failing on it.  The kernels removed."""
    removed: list[str] = []
    for item in corrupt:
        if client.read_only:  # (or turned so: the server refused a write)
            break
        if item.get("maybe_sound"):  # (another opcache's, of another format or size cap)
            continue
        try:
            client.discard(ns.remote_chip, item["entry"])
        except RemoteError as e:
            log.warning("%s: damaged entries left on the remote: %s", ns.soc, e)
            break
        if not client.read_only:
            removed.append(item["entry"])
    return removed


def _fill_lock(held: contextlib.ExitStack, chip: _Chip, report: dict) -> bool:
    """Hold the chip folder's ``op_cache_file_del.lock`` in ``held`` while entries go in;
    False (and why, in the report) when another process holds it (``busy``), or it
    cannot be taken at all (a link or a folder in its place: ``errors``, which a
    cron job's exit status shows, where a busy lock is tried again next time).

    It is CANN's aging lock: with it, two pulls (or imports) never fill one folder
    at once, each counting only its own entries against the limit, and CANN's
    aging skips its pass meanwhile, as it does while another process ages.
    """
    why = held.enter_context(del_lock(chip.fd, False))
    if why == AGING_NOW:
        report["busy"] = why
    elif why is not None:
        report["errors"] = [f"nothing written: {why}"]
    return why is None


def _write_batch(writer: _Writer, batch: list[str], got: dict, report: dict) -> bool:
    """Write a fetched batch in order; False once the folder is full or the writer
    stopped (``_Writer.stopped``)."""
    for kernel in batch:
        value = got.get(kernel)
        if value is None:
            report["gone"].append(kernel)  # evicted since it was indexed
            continue
        if isinstance(value, RemoteCorrupt):
            item = {"entry": kernel, "why": str(value)}
            if value.maybe_sound:
                item["maybe_sound"] = True
            report["corrupt"].append(item)
            log.warning("%s not written: the remote's value is damaged (%s)", kernel, value)
            continue
        entry, manifest = value[0], value[1]
        try:
            writer.write_given(kernel, manifest, entry.files)
        except _Full:
            report["stopped_at_limit"] = True
            return False
        if writer.stopped:
            return False
    return True


def _atime_of(manifest: bytes) -> int:
    """The source's last access recorded in an entry's manifest, at most now (now when
    absent or not a time)."""
    try:
        inputs = _json.loads(manifest.partition(b"\n")[2]).get("inputs", {})  # type: ignore[union-attr]
        atime = inputs.get("atime")
    except (ValueError, AttributeError):
        atime = None
    now = int(time.time())
    # A time to come is no access: kept, it would pin the entry against CANN's aging
    # (or overflow utime).
    return min(atime, now) if isinstance(atime, int) and atime >= 0 else now


# -- an archive file ---------------------------------------------------------------------------


def export_archive(
    path: Path,
    soc_version: str | None = None,
    *,
    op_compiler_cache_dir: str | None = None,
    settings: Settings | None = None,
    environ: Mapping[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, object]:
    """Every sound entry of CANN's chip folders (or ``soc_version``'s) into one archive."""
    settings = _settings(settings, op_compiler_cache_dir, None)
    env = os.environ if environ is None else environ
    root = cann_root(settings)
    chips: dict[str, object] = {}
    socs, others = _chips(root, soc_version)
    out = ArchiveWriter(Path(path), CANN)
    try:
        for soc in socs:
            try:
                chips[soc] = _export_chip(out, root, soc, settings, env, progress)
            except (Refused, trust.UntrustedFolder) as e:
                chips[soc] = {"refused": str(e)}
    except BaseException:
        out.abort()
        raise
    if all("refused" in chip for chip in chips.values()):
        out.abort()  # nothing exported: an existing file of that name is left as it was
    else:
        out.close()
    return {"file": str(path), "root": str(root), "chips": chips, "not_chip_folders": others}


def _export_chip(
    out: ArchiveWriter,
    root: Path,
    soc: str,
    settings: Settings,
    environ: Mapping[str, str],
    progress: Callable[[int], None] | None,
) -> dict:
    ns, ini_mark, inputs = giving_namespace(root, soc, environ, settings.shared_group)
    chip = _Chip(root, soc, fsutil.modes_for(settings.shared_group), create=False)
    try:
        reader = _Reader(chip.fd, ini_mark, inputs, MAX_MEMBER_BYTES, TOO_BIG)
        report = {"namespace": {"soc": soc, "id": ns.ident, **ns.versions()},
                  "entries": 0, "bytes": 0, "skipped": reader.skipped}  # fmt: skip
        done = 0
        for part in reader.parts():
            for item in part:
                done += 1
                if progress is not None:
                    progress(min(done * 100 // max(reader.total, 1), 100))
                if not reader.listable(item) or (entry := reader.check(item)) is None:
                    continue
                bundle = reader.read(item, entry)
                if isinstance(bundle, str):
                    report["skipped"].append({"entry": item.kernel, "why": bundle})
                    continue
                if not out.add(soc, item.kernel, _manifest(ns, bundle), bundle.files, bundle.atime):
                    report["skipped"].append({"entry": item.kernel, "why": TOO_BIG})
                    continue
                report["entries"] += 1
                report["bytes"] += bundle.size
        if reader.stopped is not None:
            report["errors"] = [reader.stopped]
    finally:
        chip.close()
    return report


def import_archive(
    path: Path,
    soc_version: str | None = None,
    *,
    op_compiler_cache_dir: str | None = None,
    settings: Settings | None = None,
    environ: Mapping[str, str] | None = None,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
) -> dict[str, object]:
    """The entries of an archive ``export_archive`` wrote, into CANN's chip folders, as
    ``pull`` writes them.  The archive is checked whole first: BadArchive when it is
    not a whole, valid one (nothing written)."""
    settings = _settings(settings, op_compiler_cache_dir, None)
    env = os.environ if environ is None else environ
    root = cann_root(settings)
    chips: dict[str, object] = {}
    taking: dict[str, tuple[_Chip, dict, Namespace, IniMark, InputsMark]] = {}
    writers: dict[str, _Writer] = {}
    with contextlib.ExitStack() as held:
        reader = held.enter_context(ArchiveReader(Path(path), CANN))
        found = reader.check(lambda manifest: digest(_versions_of(manifest)).encode())
        for soc, rows in found.items():
            if soc_version and soc != soc_version:
                continue
            try:
                ns, mark, inputs = taking_namespace(root, soc, env, settings.shared_group)
                if {versions for _, _, versions in rows} != {
                    digest(canonical_json(ns.versions())).encode()
                }:
                    raise Refused(
                        f"the archive's {soc} entries are of other versions than this folder's "
                        f"{ns.describe()}: nothing imported"
                    )
                report, chip, mark = _taking(root, soc, settings, ns, mark, dry_run)
            except (Refused, trust.UntrustedFolder) as e:
                chips[soc] = {"refused": str(e)}
                continue
            chips[soc] = report
            if chip is None:
                report["would_import"] = len(rows)
                continue
            held.callback(chip.close)
            assert mark is not None
            taking[soc] = chip, report, ns, mark, inputs
        # Every chip's ini read (namespaces, limits) before any aging lock is taken: a
        # file opened and closed while one is held may be a hard link to it, which
        # the close would let go of.
        limits = read_limits(root, env, settings.shared_group) if taking else None
        for soc, (chip, report, ns, mark, inputs) in taking.items():
            if _fill_lock(held, chip, report):
                assert limits is not None
                writers[soc] = _Writer(chip.fd, limits, report, mark, inputs, ns)
                held.callback(writers[soc].close)
                held.callback(writers[soc].finish)
        total = sum(len(found[s]) for s in writers)
        # The same open file again, each entry the one checked above.
        for done, (soc, kernel, entry, manifest) in enumerate(reader.entries(), 1):
            writer = writers.get(soc)
            if writer is None or writer.report["stopped_at_limit"] or writer.stopped:
                continue
            try:
                writer.write_given(kernel, manifest, entry.files)
            except _Full:
                writer.report["stopped_at_limit"] = True
            if progress is not None:
                progress(min(done, total) * 100 // max(total, 1))
    return {"file": str(path), "root": str(root), "dry_run": dry_run, "chips": chips}


def _versions_of(manifest: bytes) -> bytes:
    try:
        inputs = _json.loads(manifest.partition(b"\n")[2]).get("inputs", {})  # type: ignore[union-attr]
        return canonical_json(inputs.get("cann"))
    except (ValueError, AttributeError, TypeError):
        return b""


__all__ = [
    "BadArchive",
    "Namespace",
    "Refused",
    "export_archive",
    "import_archive",
    "ini_versions",
    "pull",
    "push",
]
