"""CANN's kernel cache on disk: a chip folder's files, an entry, CANN's locks, its hit check.

CANN's graph engine caches operator compiles in ``<base>/kernel_cache/<soc>/``,
one flat folder per chip (hicann/ge, ``te_cache_manager.cc``,
``te_cache_space_manager.cc``, ``te_cache_utils.cc``):

- an entry is ``<kernel>.json`` and the binary its ``binFileName`` +
  ``binFileSuffix`` name (normally ``<kernel>.o``), maybe a header
  ``<kernel>.h``; a mix-core entry's json lists sub-jsons (``jsonList``), each
  with its own binary; the json's ``sha256`` is its binary's;
- ``<kernel>_pre.json`` holds prebuild results, ``<kernel>.lock`` is a
  writer's ``fcntl`` lock, ``<file>_<pid>_<usec>_<rand>.temp`` a copy in
  progress or one its writer never finished, ``op_cache_file_del.lock`` the
  lock of an aging pass.

This module reads such a folder as CANN's own code judges it, never following
a link nor moving an access time: ``scan_chip`` (its regular files),
``CannEntry`` (one entry's json and files, and CANN's hit check short of the
sha256), ``hash_problem`` (the rest of the hit check), and CANN's locks
(``kernel_lock``, ``del_lock``, ``try_lock``).  ``cann_cache.py`` keeps chip
folders healthy with it (stats, aging, verify), ``cann_transfer.py`` moves
entries between them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import pwd
import re
import stat
from collections.abc import Container, Iterator, Mapping

from . import _json, fsutil, trust
from .request import is_plain_name

DEL_LOCK = "op_cache_file_del.lock"
LOCK_MODE = 0o640  # CANN chmods its lock files to this
# CANN reads any size; real entry jsons are a few KiB.  A bigger one is left alone.
MAX_JSON_BYTES = 64 << 20
MIX_SUFFIXES = ("_mix_aic.json", "_mix_aiv.json")
PRE_SUFFIX = "_pre.json"
KERNEL_FILE_SUFFIXES = (".o", ".so", ".h")
_HASH_CHUNK = 1 << 16
_NOATIME = getattr(os, "O_NOATIME", 0)
_MAX_SUB_DEPTH = 256
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_INT_MAX = 2**31 - 1
# The files of the locks this process holds ((st_dev, st_ino), and the lock's name),
# once per hold: an fcntl lock is the process's, and closing ANY descriptor of its
# file lets it go, so while one is held its file is never opened and closed again,
# under whatever name (a hard link planted as an entry's json, binary or lock).
_held: list[tuple[int, int, str]] = []
# Descriptors found to be on a held lock's file, kept open until no lock is held.
_parked: list[int] = []


# -- a chip folder's files ------------------------------------------------------


class ChipScan:
    """The regular files of a chip folder (name -> lstat), in directory order."""

    def __init__(self) -> None:
        self.files: dict[str, os.stat_result] = {}
        self.sub_files = 0
        self.sub_bytes = 0
        self.links = 0  # and other files that are not regular: never counted

    @property
    def used(self) -> int:
        """CANN's used size: every regular file in the folder and below it."""
        return sum(st.st_size for st in self.files.values()) + self.sub_bytes


def scan_chip(fd: int) -> ChipScan:
    """The folder's regular files by name; those in folders below it only counted."""
    scan = ChipScan()
    for name, st, top in walk_chip(fd):
        if not stat.S_ISREG(st.st_mode):
            scan.links += 1
        elif top:
            scan.files[name] = st
        else:
            scan.sub_files += 1
            scan.sub_bytes += st.st_size
    return scan


def chip_used(fd: int) -> int:
    """CANN's used size of a chip folder (``ChipScan.used``), without holding a scan."""
    return sum(st.st_size for _, st, _ in walk_chip(fd) if stat.S_ISREG(st.st_mode))


def walk_chip(fd: int) -> Iterator[tuple[str, os.stat_result, bool]]:
    """(name, lstat, in the folder itself) of every file that is no folder, the
    folder's own and those below it, one at a time.

    Walked without recursion, one open folder per level: folders nested more
    than ``_MAX_SUB_DEPTH`` deep are not counted (CANN's own count, by path,
    stops near PATH_MAX, about 2,000 levels).
    """
    # CANN never makes subfolders but counts (and ages) any it finds;
    # opcache counts them and leaves them alone.
    walks = [os.scandir(fd)]
    opened: list[int] = []
    try:
        while walks:
            entry = next(walks[-1], None)
            if entry is None:
                walks.pop().close()
                if opened:
                    os.close(opened.pop())
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:  # gone, or in a folder another user keeps closed: not counted
                continue
            if not stat.S_ISDIR(st.st_mode):
                yield entry.name, st, len(walks) == 1
            elif len(walks) <= _MAX_SUB_DEPTH:
                try:
                    sub = os.open(entry.name, fsutil.DIR_FLAGS, dir_fd=opened[-1] if opened else fd)
                except OSError:
                    continue
                try:
                    walk = os.scandir(sub)
                except OSError:
                    os.close(sub)
                    continue
                opened.append(sub)
                walks.append(walk)
    finally:
        for walk in walks:
            walk.close()
        for opened_fd in opened:
            os.close(opened_fd)


class PresentFiles(Container[str]):
    """The regular files of a chip folder, looked up one name at a time: what
    ``CannEntry`` asks of a scan, without holding one."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or not is_plain_name(name):
            return False
        try:
            st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode)


def is_entry_json(name: str) -> bool:
    """An entry's main json, as CANN's aging collects them (``_pre.json`` it then drops)."""
    return (
        len(name) > len(".json")
        and name.endswith(".json")
        and not name.endswith(MIX_SUFFIXES)
        and not name.endswith(PRE_SUFFIX)
    )


def open_chip_folder(parent: int, name: str, modes: fsutil.Modes, what: str) -> int:
    """Open a chip folder: a real folder (never a link) that passes the trust rule."""
    try:
        fd = os.open(name, fsutil.DIR_FLAGS, dir_fd=parent)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise trust.UntrustedFolder(f"{what} is a link or a file, not a folder") from None
        raise
    try:
        trust.check(os.fstat(fd), modes, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- an entry, judged by CANN's own code ----------------------------------------


class CannEntry:
    """One ``<kernel>.json`` and the files it names, judged by CANN's own code.

    ``aged``: the existing files CANN's aging deletes with it
    (``GetFilesAccessTime``), or None where CANN never ages it (its json does
    not parse) or where CANN's code throws on it, which ends CANN's whole
    pass; opcache leaves just that entry alone.
    ``problem``: why CANN's hit check (``MatchCompileCache``) never reuses it,
    short of comparing the sha256, or None.
    ``unchecked``: why opcache cannot tell without following a link, leaving
    the chip folder or reading past its limit; such an entry is neither
    called corrupt nor removed.
    ``binary``: the binary the hit check reads (``binFileName`` +
    ``binFileSuffix``, maybe with folders) and ``sha256`` what its json says;
    ``owned``: its files in this folder (the aged ones, its binary, header,
    sub-jsons and their binaries).
    ``lock_file``: its json or a sub-json is the file of a lock this process
    holds (``HeldLockFile``): planted, not CANN's; unchecked, never aged.
    """

    def __init__(self, fd: int, name: str, files: Container[str]) -> None:
        self.json = name
        self.kernel = name[: -len(".json")]
        self.owned = {name}
        self.aged: list[str] | None = None
        self.problem: str | None = None
        self.unchecked: str | None = None
        self.binary: str | None = None
        self.sha256 = ""
        self.lock_file = False
        try:
            data = read_json(fd, name)
            aged, throws = _aged_files(fd, name, data, files)
        except (_Unread, ValueError) as e:
            if isinstance(e, _Unread):
                self.unchecked = f"{name}: {e}"
                self.lock_file = isinstance(e, _LockFile)
            else:
                self.problem = f"{name} does not parse as CANN reads it ({e})"
            # What its writer would have named it, so a fix removes it too.
            guesses = (self.kernel + suffix for suffix in KERNEL_FILE_SUFFIXES)
            self.owned |= {name for name in guesses if name in files}
            return
        self.aged = None if throws else aged
        self.owned.update(aged)
        self._hit_check(fd, data, files)

    def _hit_check(self, fd: int, data: object, files: Container[str]) -> None:
        """``MatchCompileCache`` through ``ParseCompileResult`` (compile_result_utils.cc)
        and ``VerifyBinFileSha256`` short of hashing; see the class docstring."""
        try:
            binary = _bin_of(data)
        except _Throws as e:
            self.problem = str(e)
            return
        if binary is None:
            mix = isinstance(data, dict) and "jsonList" in data
            self.problem = "no binFileName and binFileSuffix" + (
                " (a jsonList entry without them is never reused)" if mix else ""
            )
            return
        assert isinstance(data, dict)
        if "\0" in binary:
            # (os calls raise ValueError on it; CANN's C string ends at the NUL.)
            self.problem = f"its binary {binary!r} holds a NUL: no file has that name"
            return
        self.binary = binary
        if is_plain_name(binary) and binary in files:
            self.owned.add(binary)
            self._own_header(data, binary, files)
        try:
            with _binary_of(fd, binary) as (parent, last):
                st = os.stat(last, dir_fd=parent, follow_symlinks=False) if last else None
        except FileNotFoundError:
            self.problem = f"its binary {binary} is missing"
            return
        except _Unread as e:
            self.unchecked = f"its binary {binary} {e}"
            return
        except OSError as e:  # a folder on its way this user cannot search: CANN's user may
            self.unchecked = f"its binary {binary} cannot be reached ({e.strerror or e})"
            return
        if st is not None and stat.S_ISLNK(st.st_mode):
            self.unchecked = f"its binary {binary} is a link: not followed"
            return
        kind = ".o" if binary.endswith(".o") else ".so" if binary.endswith(".so") else None
        if kind is None:
            self.problem = f"its binary {binary} is no .o or .so: CANN has no kernel to reuse"
            return
        if st is None or not stat.S_ISREG(st.st_mode):
            self.unchecked = f"its binary {binary} is not a regular file"
            return
        self.problem = _fields_problem(data, kind, binary, st.st_size)
        sha = data.get("sha256")
        if self.problem is None and isinstance(sha, str):
            self.sha256 = sha
            if kind == ".so" and not _SHA256_HEX.fullmatch(sha):
                self.problem = f"sha256 {sha[:16]!r}... is no lower-case sha256: it never matches"

    def _own_header(self, data: Mapping[str, object], binary: str, files: Container[str]) -> None:
        stem, suffix = binary.rpartition(".")[0], data.get("headerFileSuffix")
        for header in {stem + suffix if isinstance(suffix, str) else "", stem + ".h"}:
            if header in files and is_plain_name(header):
                self.owned.add(header)

    def files_to_remove(self) -> list[str]:
        """Every file of the entry, its json first: without it the entry is gone at once."""
        return [self.json, *sorted(self.owned - {self.json})]


class _Unread(Exception):
    """opcache does not read this file: CANN might, so nothing is concluded from it."""


class _LockFile(_Unread):
    """The json is the file of a lock this process holds (``HeldLockFile``)."""


class _Throws(Exception):
    """CANN's code throws here (nlohmann's ``get<std::string>`` or ``operator[]`` on the
    wrong type): its aging pass deletes nothing at all and its hit check fails."""


def _bin_of(data: object) -> str | None:
    """``binFileName`` + ``binFileSuffix`` as CANN reads them; None when either is absent
    or the json is no object (``contains``/``find`` are false there)."""
    if not isinstance(data, dict) or "binFileName" not in data or "binFileSuffix" not in data:
        return None
    name, suffix = data["binFileName"], data["binFileSuffix"]
    if not isinstance(name, str) or not isinstance(suffix, str):
        raise _Throws("binFileName or binFileSuffix is not a string: CANN's reader throws")
    return name + suffix


def _fields_problem(data: Mapping[str, object], kind: str, binary: str, size: int) -> str | None:
    """``SetKernelBin``/``SetKernelBinBySo``, ``SetHeaderFilePath``, ``VerifyBinFileSha256``
    on the json's fields: why they fail, or None."""
    if "kernelName" not in data:
        return "no kernelName"
    for key in ("kernelName", "headerFileSuffix", "sha256"):
        if key in data and not isinstance(data[key], str):
            return f"{key} is not a string: CANN's reader throws"
    if kind == ".o" and size == 0:
        return f"{binary} is empty"
    if kind == ".o" and size > _INT_MAX:
        return f"{binary} is larger than 2 GiB"
    if not data.get("sha256"):
        return "no sha256"
    return None


def _jsonlist_items(value: object) -> list[object]:
    """What iterating a nlohmann value yields: a list's items, an object's values,
    nothing for null, the value itself for a string, number or boolean."""
    if isinstance(value, list):
        return value
    if isinstance(value, dict):
        return list(value.values())
    return [] if value is None else [value]


def _aged_files(fd: int, name: str, data: object, files: Container[str]) -> tuple[list[str], bool]:
    """(files CANN's aging deletes with json ``name`` that opcache deletes too, whether
    CANN's ``GetFilesAccessTime`` throws on it).

    A plain entry: its binary.  A ``jsonList`` entry (a list, or an object's
    values): each sub-json and each sub-json's binary, not its own binary.
    Only regular files of this folder are listed: a name with a folder part,
    ``..`` or ``\\`` CANN deletes wherever it leads; opcache does not.  _LockFile
    when a sub-json is the file of a lock this process holds.
    """
    found = [name]

    def add(file: str | None) -> None:
        if file is not None and is_plain_name(file) and file in files and file not in found:
            found.append(file)

    try:
        if not isinstance(data, dict) or "jsonList" not in data:
            add(_bin_of(data))
            return found, False
        for item in _jsonlist_items(data["jsonList"]):
            sub = item.get("jsonFileName") if isinstance(item, dict) else None
            if not isinstance(sub, str):
                raise _Throws("a jsonList item has no jsonFileName string")
            if not (is_plain_name(sub) and sub in files):
                continue
            add(sub)
            try:
                add(_bin_of(read_json(fd, sub)))
            except _LockFile as e:
                raise _LockFile(f"its sub-json {sub}: {e}") from None
            except (_Unread, ValueError):
                continue  # CANN skips a sub-json it cannot parse
    except _Throws:
        return found, True
    return found, False


@contextlib.contextmanager
def _binary_of(fd: int, name: str) -> Iterator[tuple[int, str]]:
    """(folder fd, last part) of ``name`` under the chip folder ``fd``, walked without
    following links: FileNotFoundError where CANN's realpath fails, _Unread where it
    leads through a link or out of the folder.  An empty last part is the folder."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _Unread("leads out of its folder: not followed")
    opened: list[int] = []
    parent = fd
    try:
        for part in parts[:-1]:
            try:
                parent = os.open(part, fsutil.DIR_FLAGS, dir_fd=parent)
            except NotADirectoryError:
                raise FileNotFoundError(name) from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise _Unread("leads through a link: not followed") from None
                raise
            opened.append(parent)
        last = parts[-1] if parts else ""
        if last and name.endswith(("/", "/.")):  # "x.o/": realpath fails unless x.o is a folder
            mode = os.stat(last, dir_fd=parent, follow_symlinks=False).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                raise FileNotFoundError(name)
        yield parent, last
    finally:
        for opened_fd in opened:
            os.close(opened_fd)


# -- reading without disturbing ---------------------------------------------------


def access_time(st: os.stat_result) -> int:
    """Access time in whole seconds, as CANN reads ``st_atime``."""
    return st.st_atime_ns // 1_000_000_000


def open_quietly(fd: int, name: str) -> int:
    """Open a regular file for reading without moving the access time where the kernel
    allows it (never through a link, never waiting on a FIFO swapped in since the scan).

    O_NOATIME needs the file's owner (or CAP_FOWNER); for others' files a
    plain read may move it, as any reader's would.  HeldLockFile when it is
    the file of a lock this process holds (``held_lock``): kept open, not read.
    """
    file_fd = -1
    if _NOATIME:
        with contextlib.suppress(PermissionError):
            file_fd, st = fsutil.open_regular(name, os.O_RDONLY | _NOATIME, dir_fd=fd)
    if file_fd < 0:
        file_fd, st = fsutil.open_regular(name, dir_fd=fd)
    lock = held_lock(st)
    if lock is not None:
        _park_or_close(file_fd, st)  # (closing it would let go of that lock)
        raise HeldLockFile(name, lock)
    return file_fd


class HeldLockFile(OSError):
    """The file is that of a lock this process holds: another name of it (a hard link,
    which CANN never makes), never CANN's entry, never read."""

    def __init__(self, name: str, lock: str) -> None:
        super().__init__(errno.EBUSY, f"it is the file of {lock}, which opcache holds locked", name)


def read_json(fd: int, name: str) -> object:
    """The json as CANN's reader parses it (``_json.loads_nlohmann``); ValueError when
    CANN cannot parse it, _Unread when opcache cannot read it (or will not: too big)."""
    try:
        file_fd = open_quietly(fd, name)
    except HeldLockFile as e:
        raise _LockFile(f"not read: {e.strerror} (a hard link: not CANN's entry)") from None
    except OSError as e:
        raise _Unread(f"cannot read it ({e.strerror or e})") from None
    with os.fdopen(file_fd, "rb") as f:
        # Asked for its size and a byte, not for the limit: a read allocates all
        # it asks for, 64 MiB a json.
        size = os.fstat(file_fd).st_size
        raw = f.read(min(size, MAX_JSON_BYTES) + 1)
        if size < len(raw) <= MAX_JSON_BYTES:  # it grew since: read on to the limit
            raw += f.read(MAX_JSON_BYTES + 1 - len(raw))
    if len(raw) > MAX_JSON_BYTES:
        raise _Unread(f"larger than {MAX_JSON_BYTES >> 20} MiB: not read")
    return _json.loads_nlohmann(raw)


# -- CANN's hit check: the binary's sha256 ---------------------------------------


def hash_problem(fd: int, entry: CannEntry) -> str | None:
    """Why CANN would not reuse ``entry`` or opcache cannot move it as a whole: what
    ``sha256_problem`` finds, ``entry.unchecked``, a binary outside the folder."""
    if entry.unchecked is not None:
        return entry.unchecked
    if entry.binary is not None and not is_plain_name(entry.binary):
        return f"its binary {entry.binary} is not a file of this folder"
    return sha256_problem(fd, entry)


def sha256_problem(fd: int, entry: CannEntry) -> str | None:
    """The last step of CANN's hit check for a ``.o``: its json's sha256 is exactly the
    lower-case hex digest of its bytes.  A ``.so``'s sha256 is that of the kernel its
    ``GetKernelBin()`` returns once loaded: opcache never runs a library to find it."""
    binary = entry.binary
    if binary is None or not binary.endswith(".o"):
        return None
    try:
        with _binary_of(fd, binary) as (parent, last):
            got = _sha256(parent, last)
    except (OSError, _Unread) as e:
        return f"cannot read {binary}: {getattr(e, 'strerror', None) or e}"
    if got != entry.sha256:
        return f"sha256 of {binary} is {got[:16]}..., its json says {entry.sha256[:16]}..."
    return None


def _sha256(fd: int, name: str) -> str:
    h = hashlib.sha256()
    # Unbuffered: each read allocates its chunk (then trims it to what was read),
    # so the chunk stays small (1 MiB was mapped and unmapped for each 4 KB binary).
    with os.fdopen(open_quietly(fd, name), "rb", buffering=0) as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# -- CANN's locks: whole-file fcntl (F_SETLK) write locks ---------------------------


@contextlib.contextmanager
def kernel_lock(fd: int, kernel: str) -> Iterator[bool]:
    """True while no CANN writer holds ``<kernel>.lock``; holds it against them meanwhile.

    A shared (read) fcntl lock: it fails while a writer holds its write lock,
    and makes a writer that comes while we delete skip its store, as CANN's
    writers do when the lock is taken.  A missing lock file is no writer; a
    link, FIFO, device or folder in its place is no lock either, and keeps
    the entry, as a held one does; so do the aging lock's own name
    (``op_cache_file_del``), a lock file of more than one name and the file
    of a lock this process holds (``held_lock``).
    """
    if f"{kernel}.lock" == DEL_LOCK:
        yield False  # the aging lock, which this process may hold: closing it releases it
        return
    try:
        lock_fd, st = fsutil.open_regular(f"{kernel}.lock", dir_fd=fd)
    except FileNotFoundError:
        yield True
        return
    except OSError:
        yield False  # not a lock file we can open, but it is named as one
        return
    if st.st_nlink != 1 or held_lock(st) is not None:
        # Maybe another name of the aging lock this process holds (locking it again
        # would turn our write lock into a read lock, closing it would let it go).
        _park_or_close(lock_fd, st)
        yield False
        return
    with holding(lock_fd, st, f"{kernel}.lock"):
        yield try_lock(lock_fd, fcntl.LOCK_SH)


# What ``del_lock`` yields when the lock is only busy: any other reason is lasting.
AGING_NOW = f"another process holds {DEL_LOCK}: it is aging this folder"


@contextlib.contextmanager
def del_lock(fd: int, dry_run: bool, *, aging: bool = False) -> Iterator[str | None]:
    """Hold ``op_cache_file_del.lock`` as CANN takes it; yields None, or why not.

    CANN opens it with ``fopen("a+")``, chmods it 0640 and takes a
    non-blocking whole-file write lock; a process that cannot skips its pass.
    A dry run only tests it, creating nothing.  Anything but a regular file
    in its place (a link, FIFO, device, folder) skips the pass, untouched.

    In a group's cache the file is often another member's, 0640: this user
    may only read it.  Filling the folder (pull, import) then takes a read
    lock on it, which keeps CANN's aging out as well (its write lock fails,
    and it skips its pass); ``aging`` (deleting entries) needs the write lock
    and raises AgingLockDenied instead.
    """
    how = fcntl.LOCK_SH if dry_run else fcntl.LOCK_EX
    made = False
    try:
        if dry_run:
            lock_fd, st = fsutil.open_regular(DEL_LOCK, os.O_RDWR, dir_fd=fd)
        else:
            flags = os.O_RDWR | os.O_APPEND
            lock_fd, st, made = fsutil.made_or_opened(DEL_LOCK, flags, LOCK_MODE, dir_fd=fd)
    except FileNotFoundError:
        yield None  # (dry run) no lock file: no one holds it
        return
    except PermissionError as e:
        if aging:
            raise AgingLockDenied(_denied(fd, e)) from None
        try:  # (nothing created: the file is there, or the folder refused it as well)
            lock_fd, st = fsutil.open_regular(DEL_LOCK, dir_fd=fd)
        except OSError:
            yield f"cannot open {DEL_LOCK}: {e.strerror or e}"
            return
        how = fcntl.LOCK_SH
    except OSError as e:
        try:
            if not (dry_run and e.errno == errno.EROFS):
                raise
            # A dry run over a read-only mount (a backup, a snapshot) still says what a
            # pass would remove: the lock tested as the read lock it can take.
            lock_fd, st = fsutil.open_regular(DEL_LOCK, dir_fd=fd)
        except OSError as e:
            why = "it is a link" if e.errno == errno.ELOOP else e.strerror or e
            yield f"cannot open {DEL_LOCK}: {why}"
            return
    # (Another chip's aging lock, hard-linked here, may be one this process holds already:
    # locking it again could only turn our write lock into a read lock.)
    again = held_lock(st) is not None
    with holding(lock_fd, st, DEL_LOCK):
        # Only a file made here (CANN chmods any it opens, but one already there may
        # be a file of ours a member of a shared cache moved in or linked from
        # elsewhere, a secret its chmod would open to the group).
        if made:
            with contextlib.suppress(OSError):
                os.fchmod(lock_fd, LOCK_MODE)
        free = again or try_lock(lock_fd, how)
        yield None if free else AGING_NOW


class AgingLockDenied(Exception):
    """This user may not open ``op_cache_file_del.lock`` for writing, which CANN's write
    lock, the one an aging pass takes, needs."""


def _denied(fd: int, e: OSError) -> str:
    """Why an aging pass cannot take CANN's aging lock (``e``: opening it to write)."""
    try:
        st = os.stat(DEL_LOCK, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return f"cannot take CANN's aging lock: cannot create {DEL_LOCK} ({e.strerror or e})"
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = f"uid {st.st_uid}"
    return (
        f"cannot take CANN's aging lock: {DEL_LOCK} is {owner}'s, mode "
        f"{stat.S_IMODE(st.st_mode):04o} (CANN's chmod), and this user may not open it "
        f"to write, as CANN's write lock needs: run the aging as {owner}"
    )


def held_lock(st: os.stat_result) -> str | None:
    """The name of a lock this process holds whose file is the one ``st`` describes, or
    None: a descriptor of that file must not be closed while the lock is held."""
    for dev, ino, name in _held:
        if (dev, ino) == (st.st_dev, st.st_ino):
            return name
    return None


@contextlib.contextmanager
def holding(lock_fd: int, st: os.stat_result, name: str) -> Iterator[None]:
    """Count ``lock_fd``'s file among the held locks' (``held_lock``) while the block runs,
    then close it, which lets go of any lock taken on it in the block.

    A lock taken on a file of a chip folder goes through it (``kernel_lock``,
    ``del_lock``, and whoever else locks one), so that no file read meanwhile
    under another name (``open_quietly``) closes a held lock's file.
    """
    _held.append((st.st_dev, st.st_ino, name))
    try:
        yield
    finally:
        _held.remove((st.st_dev, st.st_ino, name))
        _park_or_close(lock_fd, st)
        if not _held:
            while _parked:
                os.close(_parked.pop())


def _park_or_close(file_fd: int, st: os.stat_result) -> None:
    """Close a descriptor now, or, when its file is that of a lock this process still
    holds, once no lock is held."""
    if held_lock(st) is not None:
        _parked.append(file_fd)
    else:
        os.close(file_fd)


def try_lock(lock_fd: int, how: int) -> bool:
    """CANN's non-blocking whole-file fcntl lock (F_SETLK); False while another process holds one.

    ``fcntl.lockf`` is ``fcntl(F_SETLK)``, the same lock CANN takes, not ``flock``.
    """
    try:
        fcntl.lockf(lock_fd, how | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return False
    return True
