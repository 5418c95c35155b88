"""CANN's own kernel cache, kept healthy from outside: stats, aging and checks.

CANN's graph engine caches operator compiles in ``<base>/kernel_cache/<soc>/``
(``<base>``: ``op_compiler_cache_dir``, else ``ASCEND_CACHE_PATH``, else
``$HOME/atc_data``), one flat folder per chip (hicann/ge,
``te_cache_manager.cc``, ``te_cache_space_manager.cc``, ``te_cache_utils.cc``):

- an entry is ``<kernel>.json`` and the binary its ``binFileName`` +
  ``binFileSuffix`` name (normally ``<kernel>.o``), maybe a header
  ``<kernel>.h``; a mix-core entry's json lists sub-jsons (``jsonList``), each
  with its own binary; the json's ``sha256`` is its binary's;
- ``<kernel>_pre.json`` holds prebuild results, ``<kernel>.lock`` is a
  writer's ``fcntl`` lock, ``<file>_<pid>_<usec>_<rand>.temp`` a copy in
  progress or one its writer never finished;
- CANN ages a chip folder only when a compile session starts: when the folder
  (every regular file in it) reaches ``max``, it deletes entries oldest access
  first until ``used - max * ratio / 100`` bytes are gone, stopping at the
  first one accessed in the last 30 minutes, under ``op_cache_file_del.lock``.

``CannCache`` reads such a folder by those rules: ``stats`` (what is there,
counted as CANN counts), ``age`` (CANN's aging pass and lock, so it can run
while CANN compiles) and ``verify`` (the faults CANN never repairs: corrupt
entries, orphan binaries that block every later store of their kernel, temp
files of dead writers, old prebuild results).  Where CANN is weak it does
better, and every report says so (``NOTES``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from . import _json, fsutil, ini, locks, trust
from ._log import get_logger
from ._record import Record
from .request import is_plain_name
from .settings import AGE_SECONDS, INI_NAME, KERNEL_CACHE, MB, Settings, size_limits

log = get_logger(__name__)

DEL_LOCK = "op_cache_file_del.lock"
# A temp file untouched this long whose writer is not running here is left over
# (the writer may run on another host of a shared folder: give it a moment).
TEMP_GRACE_SECONDS = 60
# A temp file untouched this long is left over, whoever wrote it.
TEMP_MAX_AGE_SECONDS = 3600
# CANN reads any size; real entry jsons are a few KiB.  A bigger one is left alone.
_MAX_JSON_BYTES = 64 << 20
NOTES = (
    "access times are read with stat only, and jsons opened with O_NOATIME where permitted: "
    "looking never makes an entry look used (CANN's aging reads each json after taking its "
    "access time, so on relatime mounts it skips entries it has just read)",
    "links are never followed, counted or deleted",
    "an entry whose <kernel>.lock a CANN writer holds is never deleted (CANN's aging does not "
    "check)",
    "folders others can write are refused (the trust rule of opcache's own cache)",
    "files in subfolders of a chip folder count toward its size, as CANN counts them, but "
    "are never deleted (CANN would age jsons found there)",
    "a binFileName or jsonFileName that leads out of the chip folder (a folder part, .., \\) "
    "or through a link names nothing opcache deletes, and verify does not follow it (CANN "
    "deletes or reads it wherever it leads)",
    "an entry CANN's aging code throws on (a binFileName or binFileSuffix that is no "
    "string, a jsonList item without a jsonFileName string) is left alone and the others "
    "are aged; CANN's pass ends at it, deleting nothing at all",
    "a .so's sha256 is checked for its form only: CANN compares it with the kernel the "
    "library returns once loaded, and opcache never loads a library from a cache folder",
    f"a json over {_MAX_JSON_BYTES >> 20} MiB is neither aged nor checked (CANN reads any size)",
    "ASCEND_MAX_OP_CACHE_SIZE and ASCEND_REMAIN_CACHE_SIZE_RATIO are read as opcache's own "
    "cache reads them: a value CANN half-reads (500MB as 500, a ratio of text as 0, "
    "4294967306 wrapped to 10 by atoi) is ignored with a warning",
)

_LOCK_MODE = 0o640  # CANN chmods its lock files to this
_HASH_CHUNK = 1 << 20
_TEMP = re.compile(r"(?P<dst>.+)_(?P<pid>[0-9]+)_(?P<usec>[0-9]+)_(?P<rand>[0-9]+)\.temp")
_MIX_SUFFIXES = ("_mix_aic.json", "_mix_aiv.json")
_PRE_SUFFIX = "_pre.json"
_KERNEL_FILE_SUFFIXES = (".o", ".so", ".h")
_NOATIME = getattr(os, "O_NOATIME", 0)
_MAX_SUB_DEPTH = 256


class NoCannCache(Exception):
    """The folder holds no CANN kernel cache; the message says where and why."""


def cann_root(settings: Settings) -> Path:
    """The folder of CANN's chip folders, found as CANN finds it.

    ``<base>/kernel_cache`` for the base ``settings`` came from
    (``op_compiler_cache_dir`` > ``ASCEND_CACHE_PATH`` > ``$HOME/atc_data``).
    CANN appends plain ``kernel_cache`` to whichever base won, where opcache's
    own cache under ``ASCEND_CACHE_PATH`` is ``kernel_cache_<host>``.
    """
    return settings.root.parent / KERNEL_CACHE


class Limits(Record):
    """The size limit and share kept that CANN's aging of a root applies; see ``read_limits``."""

    __slots__ = _fields = (
        "max_op_cache_size_mb",
        "remain_cache_size_ratio",
        "ini_path",
        "ini_ignored",
        "sources",
    )
    max_op_cache_size_mb: int
    remain_cache_size_ratio: int
    ini_path: Path
    ini_ignored: str | None  # why the ini's size keys do not apply, when it has them
    sources: dict[str, str]

    def __init__(
        self,
        max_op_cache_size_mb: int,
        remain_cache_size_ratio: int,
        ini_path: Path,
        ini_ignored: str | None,
        sources: dict[str, str],
    ) -> None:
        self._init(locals())

    @property
    def max_bytes(self) -> int | None:
        """The per-chip limit in bytes; None when aging is off (-1)."""
        return None if self.max_op_cache_size_mb == -1 else self.max_op_cache_size_mb * MB

    def as_dict(self) -> dict[str, object]:
        return {
            "max_op_cache_size_mb": self.max_op_cache_size_mb,
            "max_bytes": self.max_bytes,
            "remain_cache_size_ratio": self.remain_cache_size_ratio,
            "ini_path": str(self.ini_path),
            "ini_ignored": self.ini_ignored,
            "sources": dict(self.sources),
        }


def read_limits(
    root: Path, environ: Mapping[str, str] | None = None, shared_group: int | None = None
) -> Limits:
    """CANN's size settings for ``root``: ``root/op_cache.ini`` > environment > defaults.

    The ini is read as CANN reads it (``ini.read_cann``): its size keys count
    only in a file that also names the toolkit versions, which CANN writes
    itself.  An ini the trust rule refuses (``shared_group``: the group of a
    group-shared folder), or that is not a regular file, is ignored with a warning.
    """
    path = root / INI_NAME
    read = ini.read_cann(path, shared_group)
    sources: dict[str, str] = {}
    if read.limits is not None:
        sources["max_op_cache_size_mb"] = sources["remain_cache_size_ratio"] = INI_NAME
        sources["ini_path"] = INI_NAME
        max_mb, ratio = read.limits.max_op_cache_size_mb, read.limits.remain_cache_size_ratio
    else:
        env = os.environ if environ is None else environ
        _, max_mb, ratio = size_limits([], env, sources, shared_group)
    return Limits(max_mb, ratio, path, read.ignored, sources)


def open_cann_cache(
    settings: Settings,
    environ: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.time,
) -> CannCache:
    """The CANN cache ``settings`` locate, with CANN's size settings for it."""
    root = cann_root(settings)
    limits = read_limits(root, environ, settings.shared_group)
    return CannCache(root, limits, modes=fsutil.modes_for(settings.shared_group), clock=clock)


class CannCache:
    """One CANN ``kernel_cache`` folder; each operation works chip folder by chip folder.

    Every operation returns a JSON-ready dict: ``root``, ``limits``, ``notes``
    and ``chips`` (soc -> that chip's report; a chip that could not be read has
    ``error``).  They raise NoCannCache when the folder holds no CANN cache (or
    not the chip asked for) and trust.UntrustedFolder for an untrusted root.
    """

    def __init__(
        self,
        root: Path,
        limits: Limits,
        *,
        modes: fsutil.Modes = fsutil.PRIVATE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.limits = limits
        self._modes = modes
        self._clock = clock

    def stats(self, soc: str | None = None) -> dict[str, object]:
        """What each chip folder holds, bytes counted as CANN counts them."""
        report = self._each_chip(soc, self._chip_stats)
        report["total"] = _total(report["chips"])
        return report

    def age(self, soc: str | None = None, *, dry_run: bool = False) -> dict[str, object]:
        """One CANN aging pass over each chip folder (``dry_run``: report only)."""
        return self._each_chip(soc, lambda fd: self._age_chip(fd, dry_run))

    def verify(self, soc: str | None = None, *, fix: bool = False) -> dict[str, object]:
        """Find corrupt entries, orphans, stale temps, old prebuild results (``fix``: remove)."""
        return self._each_chip(soc, lambda fd: self._verify_chip(fd, fix))

    # -- folders ---------------------------------------------------------------

    def _each_chip(self, soc: str | None, work: Callable[[int], dict]) -> dict[str, object]:
        root_fd = self._open_root()
        try:
            chips = {}
            for name in self._chips(root_fd, soc):
                try:
                    fd = _open_dir(root_fd, name, self._modes, f"{self.root}/{name}")
                except OSError as e:
                    chips[name] = {"error": str(e)}
                    continue
                try:
                    chips[name] = work(fd)
                except OSError as e:
                    chips[name] = {"error": f"{self.root}/{name}: {e}"}
                finally:
                    os.close(fd)
        finally:
            os.close(root_fd)
        return {
            "root": str(self.root),
            "limits": self.limits.as_dict(),
            "notes": list(NOTES),
            "chips": chips,
        }

    def _open_root(self) -> int:
        # The configured root may itself be a link, as for opcache's own cache.
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise NoCannCache(f"no CANN kernel cache at {self.root}: no such folder") from None
        try:
            trust.check(os.fstat(fd), self._modes, self.root)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _chips(self, root_fd: int, soc: str | None) -> list[str]:
        names = []
        with os.scandir(root_fd) as it:
            for entry in it:
                if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                    names.append(entry.name)
        if soc is not None:
            if soc not in names:
                raise NoCannCache(f"no CANN kernel cache for {soc} in {self.root}")
            return [soc]
        if not names:
            raise NoCannCache(f"no CANN kernel cache at {self.root}: it holds no chip folder")
        return sorted(names)

    # -- stats ---------------------------------------------------------------

    def _chip_stats(self, fd: int) -> dict[str, object]:
        scan = _scan(fd)
        view = _View(fd, scan)
        now = int(self._clock())
        files = scan.files
        atimes = [_atime(files[e.json]) for e in view.entries]
        max_bytes = self.limits.max_bytes
        return {
            "used_bytes": scan.used,
            "files": len(files) + scan.sub_files,
            "limit_bytes": max_bytes,
            "over_limit": max_bytes is not None and scan.used >= max_bytes,
            "entries": len(view.entries),
            "entry_bytes": _bytes(files, {f for e in view.entries for f in e.aged or [e.json]}),
            "broken_entries": sum(1 for e in view.entries if e.problem),
            "idle_entries": sum(1 for a in atimes if now - a >= AGE_SECONDS),
            "oldest_access": min(atimes, default=None),
            "newest_access": max(atimes, default=None),
            "headers": len(view.headers),
            "header_bytes": _bytes(files, view.headers),
            "prebuild": len(view.prebuild),
            "prebuild_bytes": _bytes(files, view.prebuild),
            "locks": len(view.locks),
            "temps": len(view.temps),
            "temp_bytes": _bytes(files, view.temps),
            "orphans": len(view.orphans),
            "orphan_bytes": _bytes(files, view.orphans),
            "other": len(view.other),
            "other_bytes": _bytes(files, view.other),
            "subfolder_files": scan.sub_files,
            "subfolder_bytes": scan.sub_bytes,
            "links": scan.links,
        }

    # -- aging -----------------------------------------------------------------

    def _age_chip(self, fd: int, dry_run: bool) -> dict[str, object]:
        scan = _scan(fd)
        max_bytes = self.limits.max_bytes
        ratio = self.limits.remain_cache_size_ratio
        report: dict[str, object] = {
            "dry_run": dry_run,
            "used_bytes": scan.used,
            "limit_bytes": max_bytes,
            "to_free": 0,
            "removed": [],
            "removed_bytes": 0,
            "kept_locked": [],
            "kept_accessed": [],
            "stopped_at_recent": False,
            "used_after": scan.used,
            "skipped": None,
            "errors": [],
        }
        if max_bytes is None:
            report["skipped"] = "aging is off (max_op_cache_size -1)"
            return report
        if scan.used < max_bytes:
            return report
        with _del_lock(fd, dry_run) as held_by:
            if held_by is not None:
                report["skipped"] = held_by
                return report
            to_free = scan.used - max_bytes * ratio // 100
            report["to_free"] = to_free
            self._delete_oldest(fd, scan, to_free, dry_run, report)
        return report

    def _delete_oldest(
        self, fd: int, scan: _Scan, to_free: int, dry_run: bool, report: dict
    ) -> None:
        """CANN's ``AgingCacheFileByAccessTime``, step for step (see the module's docstring)."""
        files = scan.files
        # Oldest access first; ties in directory order, as CANN's multimap keeps them.
        candidates = sorted(
            ((_atime(st), name) for name, st in files.items() if _is_entry_json(name)),
            key=lambda c: c[0],
        )
        counted = 0
        for atime, name in candidates:
            if int(self._clock()) - atime < AGE_SECONDS:
                report["stopped_at_recent"] = True
                break
            try:
                now_st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                now_st = None
            if now_st is not None and _atime(now_st) == atime:
                entry = _Entry(fd, name, files)
                if entry.aged is None:
                    continue  # CANN never ages a json it cannot parse (see _Entry)
                with _kernel_lock(fd, entry.kernel) as free:
                    if not free:
                        report["kept_locked"].append(entry.kernel)
                    else:
                        counted += _bytes(files, entry.aged)
                        report["removed"].append(entry.kernel)
                        if dry_run:
                            report["removed_bytes"] += _bytes(files, entry.aged)
                        else:
                            report["removed_bytes"] += _remove(fd, entry.aged, report["errors"])
            elif now_st is not None:
                report["kept_accessed"].append(name[: -len(".json")])
            if counted >= to_free:
                break
        report["used_after"] = scan.used - report["removed_bytes"]

    # -- verify ----------------------------------------------------------------

    def _verify_chip(self, fd: int, fix: bool) -> dict[str, object]:
        scan = _scan(fd)
        view = _View(fd, scan)
        files = scan.files
        now = self._clock()
        faults: list[dict[str, object]] = []

        def fault(kind: str, name: str, why: str, remove: list[str], locks: list[str]) -> None:
            faults.append({"kind": kind, "name": name, "why": why, "files": remove, "locks": locks})

        checked = 0
        unchecked = []
        for entry in view.entries:
            problem = entry.problem
            if problem is None and entry.unchecked is not None:
                unchecked.append({"name": entry.kernel, "why": entry.unchecked})
                continue
            if problem is None:
                checked += 1
                problem = _sha256_problem(fd, entry)
            if problem is not None:
                fault("corrupt", entry.kernel, problem, entry.files_to_remove(), [entry.kernel])
        for name in view.orphans:
            if now - files[name].st_mtime >= TEMP_GRACE_SECONDS:
                fault("orphan", name, "no entry names it", [name], _orphan_locks(name))
        for name in view.temps:
            why = _stale_temp(name, files[name], now)
            if why is not None:
                fault("stale temp", name, why, [name], [])
        for name in view.prebuild:
            st = files[name]
            idle = now - max(st.st_atime, st.st_mtime)
            entry_json = name[: -len(_PRE_SUFFIX)] + ".json"
            if entry_json not in files and idle >= AGE_SECONDS:
                why = f"no {entry_json}, unused for {int(idle // 60)} minutes"
                fault("old prebuild", name, why, [name], [name[: -len(".json")]])
        errors: list[str] = []
        if fix:
            for found in faults:
                found["removed"] = self._remove_fault(fd, found, files, errors)
        return {
            "entries": len(view.entries),
            "checked": checked,
            "unchecked": unchecked,
            "faults": faults,
            "removed": sum(1 for f in faults if f.get("removed")),
            "errors": errors,
        }

    def _remove_fault(
        self, fd: int, found: dict, files: dict[str, os.stat_result], errors: list[str]
    ) -> bool:
        """Remove one fault's files unless a writer holds its lock or it changed since the scan."""
        with contextlib.ExitStack() as held:
            why = _why_kept(fd, found, files, held)
            if why is not None:
                found["kept"] = why
                return False
            before = len(errors)
            _remove(fd, found["files"], errors)
        return len(errors) == before


def _why_kept(
    fd: int, found: dict, files: dict[str, os.stat_result], held: contextlib.ExitStack
) -> str | None:
    """Why a fault must stay (taking its writer's locks into ``held`` meanwhile), or None."""
    for kernel in found["locks"]:
        if not held.enter_context(_kernel_lock(fd, kernel)):
            return f"{kernel}.lock is held by a writer"
    for name in found["files"]:
        if not _unchanged(fd, name, files[name]):
            return f"{name} changed since it was checked"
    if found["kind"] == "orphan":
        try:
            os.stat(_kernel_of(found["name"]) + ".json", dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return "its entry appeared since it was checked"
    return None


# -- a chip folder's files ------------------------------------------------------


class _Scan:
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


def _scan(fd: int) -> _Scan:
    """The folder's regular files by name; those in folders below it only counted.

    Walked without recursion, one open folder per level: folders nested more
    than ``_MAX_SUB_DEPTH`` deep are not counted (CANN's own count, by path,
    stops near PATH_MAX, about 2,000 levels).
    """
    scan = _Scan()
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
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and len(walks) == 1:
                scan.files[entry.name] = st
            elif stat.S_ISREG(st.st_mode):
                scan.sub_files += 1
                scan.sub_bytes += st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                scan.links += 1
            elif len(walks) <= _MAX_SUB_DEPTH:
                try:
                    sub = os.open(entry.name, fsutil.DIR_FLAGS, dir_fd=opened[-1] if opened else fd)
                except OSError:
                    continue
                opened.append(sub)
                walks.append(os.scandir(sub))
    finally:
        for walk in walks:
            walk.close()
        for opened_fd in opened:
            os.close(opened_fd)
    return scan


def _is_entry_json(name: str) -> bool:
    """An entry's main json, as CANN's aging collects them (``_pre.json`` it then drops)."""
    return (
        len(name) > len(".json")
        and name.endswith(".json")
        and not name.endswith(_MIX_SUFFIXES)
        and not name.endswith(_PRE_SUFFIX)
    )


class _Entry:
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
    """

    def __init__(self, fd: int, name: str, files: Mapping[str, os.stat_result]) -> None:
        self.json = name
        self.kernel = name[: -len(".json")]
        self.owned = {name}
        self.aged: list[str] | None = None
        self.problem: str | None = None
        self.unchecked: str | None = None
        self.binary: str | None = None
        self.sha256 = ""
        try:
            data = _read_json(fd, name)
        except (_Unread, ValueError) as e:
            if isinstance(e, _Unread):
                self.unchecked = f"{name}: {e}"
            else:
                self.problem = f"{name} does not parse as CANN reads it ({e})"
            # What its writer would have named it, so a fix removes it too.
            guesses = (self.kernel + suffix for suffix in _KERNEL_FILE_SUFFIXES)
            self.owned |= {name for name in guesses if name in files}
            return
        aged, throws = _aged_files(fd, name, data, files)
        self.aged = None if throws else aged
        self.owned.update(aged)
        self._hit_check(fd, data, files)

    def _hit_check(self, fd: int, data: object, files: Mapping[str, os.stat_result]) -> None:
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

    def _own_header(self, data: Mapping[str, object], binary: str, files: Mapping) -> None:
        stem, suffix = binary.rpartition(".")[0], data.get("headerFileSuffix")
        for header in {stem + suffix if isinstance(suffix, str) else "", stem + ".h"}:
            if header in files and is_plain_name(header):
                self.owned.add(header)

    def files_to_remove(self) -> list[str]:
        """Every file of the entry, its json first: without it the entry is gone at once."""
        return [self.json, *sorted(self.owned - {self.json})]


class _Unread(Exception):
    """opcache does not read this file: CANN might, so nothing is concluded from it."""


class _Throws(Exception):
    """CANN's code throws here (nlohmann's ``get<std::string>`` or ``operator[]`` on the
    wrong type): its aging pass deletes nothing at all and its hit check fails."""


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_INT_MAX = 2**31 - 1


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


def _aged_files(
    fd: int, name: str, data: object, files: Mapping[str, os.stat_result]
) -> tuple[list[str], bool]:
    """(files CANN's aging deletes with json ``name`` that opcache deletes too, whether
    CANN's ``GetFilesAccessTime`` throws on it).

    A plain entry: its binary.  A ``jsonList`` entry (a list, or an object's
    values): each sub-json and each sub-json's binary, not its own binary.
    Only regular files of this folder are listed: a name with a folder part,
    ``..`` or ``\\`` CANN deletes wherever it leads; opcache does not.
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
                add(_bin_of(_read_json(fd, sub)))
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


class _View:
    """A chip folder's files sorted into what they are."""

    def __init__(self, fd: int, scan: _Scan) -> None:
        files = scan.files
        self.entries = [_Entry(fd, name, files) for name in files if _is_entry_json(name)]
        owned = {f for e in self.entries for f in e.owned}
        self.headers = {f for e in self.entries for f in e.owned if f.endswith(".h")}
        self.prebuild: list[str] = []
        self.locks: list[str] = []
        self.temps: list[str] = []
        self.orphans: list[str] = []
        self.other: list[str] = []
        for name in files:
            if name in owned:
                continue
            if name.endswith(".lock"):
                self.locks.append(name)
            elif name.endswith(".temp"):
                self.temps.append(name)
            elif name.endswith(_PRE_SUFFIX):
                self.prebuild.append(name)
            elif name.endswith((*_KERNEL_FILE_SUFFIXES, *_MIX_SUFFIXES)):
                self.orphans.append(name)
            else:
                self.other.append(name)


def _kernel_of(name: str) -> str:
    """The kernel an orphan file was written for (a mix sub-file's main kernel)."""
    stem = name[: -len(".json")] if name.endswith(".json") else os.path.splitext(name)[0]
    for suffix in _MIX_SUFFIXES:
        mix = suffix[: -len(".json")]
        if stem.endswith(mix):
            return stem[: -len(mix)]
    return stem


def _orphan_locks(name: str) -> list[str]:
    stem = name[: -len(".json")] if name.endswith(".json") else os.path.splitext(name)[0]
    return list(dict.fromkeys([stem, _kernel_of(name)]))


# -- reading without disturbing ---------------------------------------------------


def _atime(st: os.stat_result) -> int:
    """Access time in whole seconds, as CANN reads ``st_atime``."""
    return st.st_atime_ns // 1_000_000_000


def _open_quietly(fd: int, name: str) -> int:
    """Open a regular file for reading without moving the access time where the kernel
    allows it (never through a link, never waiting on a FIFO swapped in since the scan).

    O_NOATIME needs the file's owner (or CAP_FOWNER); for others' files a
    plain read may move it, as any reader's would.
    """
    if _NOATIME:
        try:
            return fsutil.open_regular(name, os.O_RDONLY | _NOATIME, dir_fd=fd)[0]
        except PermissionError:
            pass
    return fsutil.open_regular(name, dir_fd=fd)[0]


def _read_json(fd: int, name: str) -> object:
    """The json as CANN's reader parses it (``_json.loads_nlohmann``); ValueError when
    CANN cannot parse it, _Unread when opcache cannot read it (or will not: too big)."""
    try:
        file_fd = _open_quietly(fd, name)
    except OSError as e:
        raise _Unread(f"cannot read it ({e.strerror or e})") from None
    with os.fdopen(file_fd, "rb") as f:
        raw = f.read(_MAX_JSON_BYTES + 1)
    if len(raw) > _MAX_JSON_BYTES:
        raise _Unread(f"larger than {_MAX_JSON_BYTES >> 20} MiB: not read")
    return _json.loads_nlohmann(raw)


def _hash_problem(fd: int, entry: _Entry) -> str | None:
    """Why CANN would not reuse ``entry`` or opcache cannot move it as a whole: what
    ``_sha256_problem`` finds, ``entry.unchecked``, a binary outside the folder."""
    if entry.unchecked is not None:
        return entry.unchecked
    if entry.binary is not None and not is_plain_name(entry.binary):
        return f"its binary {entry.binary} is not a file of this folder"
    return _sha256_problem(fd, entry)


def _sha256_problem(fd: int, entry: _Entry) -> str | None:
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
    with os.fdopen(_open_quietly(fd, name), "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stale_temp(name: str, st: os.stat_result, now: float) -> str | None:
    """Why a ``.temp`` file is left over, or None while its writer may still finish it."""
    idle = now - st.st_mtime
    match = _TEMP.fullmatch(name)
    if match and idle >= TEMP_GRACE_SECONDS and not locks.pid_alive(int(match["pid"])):
        return f"its writer (pid {match['pid']}) is not running"
    if idle >= TEMP_MAX_AGE_SECONDS:
        return f"untouched for {int(idle // 60)} minutes"
    return None


def _unchanged(fd: int, name: str, seen: os.stat_result) -> bool:
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return True  # gone already: nothing to remove
    return (st.st_ino, st.st_size, st.st_mtime_ns) == (seen.st_ino, seen.st_size, seen.st_mtime_ns)


def _bytes(files: Mapping[str, os.stat_result], names: Iterable[str]) -> int:
    return sum(files[n].st_size for n in names if n in files)


def _remove(fd: int, names: list[str], errors: list[str]) -> int:
    """Unlink the regular files ``names``; returns the bytes removed."""
    freed = 0
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue  # as CANN's DeleteFile: regular files only, never a link
            os.unlink(name, dir_fd=fd)
            freed += st.st_size
        except FileNotFoundError:
            continue
        except OSError as e:
            errors.append(f"cannot remove {name}: {e.strerror or e}")
            log.warning("cannot remove %s: %s", name, e)
    return freed


# -- CANN's locks: whole-file fcntl (F_SETLK) write locks ---------------------------


@contextlib.contextmanager
def _kernel_lock(fd: int, kernel: str) -> Iterator[bool]:
    """True while no CANN writer holds ``<kernel>.lock``; holds it against them meanwhile.

    A shared (read) fcntl lock: it fails while a writer holds its write lock,
    and makes a writer that comes while we delete skip its store, as CANN's
    writers do when the lock is taken.  A missing lock file is no writer; a
    link, FIFO, device or folder in its place is no lock either, and keeps
    the entry, as a held one does.
    """
    try:
        lock_fd, _ = fsutil.open_regular(f"{kernel}.lock", dir_fd=fd)
    except FileNotFoundError:
        yield True
        return
    except OSError:
        yield False  # not a lock file we can open, but it is named as one
        return
    try:
        yield _try_lock(lock_fd, fcntl.LOCK_SH)
    finally:
        os.close(lock_fd)  # releases the lock


@contextlib.contextmanager
def _del_lock(fd: int, dry_run: bool) -> Iterator[str | None]:
    """Hold ``op_cache_file_del.lock`` as CANN takes it; yields None, or why not.

    CANN opens it with ``fopen("a+")``, chmods it 0640 and takes a
    non-blocking whole-file write lock; a process that cannot skips its pass.
    A dry run only tests it, creating nothing.  Anything but a regular file
    in its place (a link, FIFO, device, folder) skips the pass, untouched.
    """
    flags = os.O_RDONLY if dry_run else os.O_RDWR | os.O_CREAT | os.O_APPEND
    try:
        lock_fd, _ = fsutil.open_regular(DEL_LOCK, flags, dir_fd=fd)
    except FileNotFoundError:
        yield None  # (dry run) no lock file: no one holds it
        return
    except OSError as e:
        why = "it is a link" if e.errno == errno.ELOOP else e.strerror or e
        yield f"cannot open {DEL_LOCK}: {why}"
        return
    try:
        if not dry_run:
            with contextlib.suppress(OSError):  # someone else's file: CANN goes on too
                os.fchmod(lock_fd, _LOCK_MODE)
        free = _try_lock(lock_fd, fcntl.LOCK_SH if dry_run else fcntl.LOCK_EX)
        yield None if free else f"another process holds {DEL_LOCK}: it is aging this folder"
    finally:
        os.close(lock_fd)


def _try_lock(lock_fd: int, how: int) -> bool:
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


def _open_dir(parent: int, name: str, modes: fsutil.Modes, what: str) -> int:
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


_SUMMED = (
    "used_bytes", "files", "entries", "entry_bytes", "broken_entries", "idle_entries",
    "headers", "header_bytes", "prebuild", "prebuild_bytes", "locks", "temps", "temp_bytes",
    "orphans", "orphan_bytes", "other", "other_bytes", "subfolder_files", "subfolder_bytes",
    "links",
)  # fmt: skip


def _total(chips: Mapping[str, Mapping[str, object]]) -> dict[str, object]:
    read = [c for c in chips.values() if "error" not in c]
    total: dict[str, object] = {k: sum(c[k] for c in read) for k in _SUMMED}  # type: ignore[misc]
    oldest = [c["oldest_access"] for c in read if c["oldest_access"] is not None]
    newest = [c["newest_access"] for c in read if c["newest_access"] is not None]
    total["oldest_access"] = min(oldest, default=None)  # type: ignore[type-var]
    total["newest_access"] = max(newest, default=None)  # type: ignore[type-var]
    return total
