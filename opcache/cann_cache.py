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

from . import _json, fsutil, ini, trust
from ._log import get_logger
from ._record import Record
from .request import is_plain_name
from .settings import AGE_SECONDS, INI_NAME, KERNEL_CACHE, MB, Settings, size_limits
from .storage.local import pid_alive

log = get_logger(__name__)

DEL_LOCK = "op_cache_file_del.lock"
# A temp file untouched this long whose writer is not running here is left over
# (the writer may run on another host of a shared folder: give it a moment).
TEMP_GRACE_SECONDS = 60
# A temp file untouched this long is left over, whoever wrote it.
TEMP_MAX_AGE_SECONDS = 3600
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
    "size settings are read as opcache reads them: a value with trailing text (500MB) is "
    "ignored, where CANN's stoi takes its leading digits",
)

_LOCK_MODE = 0o640  # CANN chmods its lock files to this
_MAX_JSON_BYTES = 16 << 20
_HASH_CHUNK = 1 << 20
_TEMP = re.compile(r"(?P<dst>.+)_(?P<pid>[0-9]+)_(?P<usec>[0-9]+)_(?P<rand>[0-9]+)\.temp")
_MIX_SUFFIXES = ("_mix_aic.json", "_mix_aiv.json")
_PRE_SUFFIX = "_pre.json"
_KERNEL_FILE_SUFFIXES = (".o", ".so", ".h")
_NOATIME = getattr(os, "O_NOATIME", 0)


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

    CANN applies the ini's size keys only when the file also names the toolkit
    versions (it writes them itself); otherwise it ignores the file whole.
    An ini the trust rule refuses (``shared_group``: the group of a
    group-shared folder), or that is not a regular file, is ignored with a warning.
    """
    path = root / INI_NAME
    applies = ini.cann_applies_sizes(path, shared_group)
    sources: dict[str, str] = {}
    env = os.environ if environ is None else environ
    _, max_mb, ratio = size_limits([path] if applies else [], env, sources, shared_group)
    ignored = None
    if not applies and ini.read_size_limits(path, shared_group) is not None:
        ignored = f"{path} is ignored, as CANN ignores it: no adk_version and ops_version in it"
    return Limits(max_mb, ratio, path, ignored, sources)


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
            "entry_bytes": _bytes(files, {f for e in view.entries for f in e.aged}),
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
                if entry.data is None:
                    continue  # CANN never ages a json it cannot parse
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
        for entry in view.entries:
            problem = entry.problem
            if problem is None:
                checked += 1
                problem = _hash_problem(fd, entry)
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


def _scan(fd: int, scan: _Scan | None = None) -> _Scan:
    """The folder's regular files by name; below it (``scan`` given) only counted."""
    top = scan is None
    scan = _Scan() if scan is None else scan
    with os.scandir(fd) as it:
        for entry in it:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and top:
                scan.files[entry.name] = st
            elif stat.S_ISREG(st.st_mode):
                scan.sub_files += 1
                scan.sub_bytes += st.st_size
            elif stat.S_ISDIR(st.st_mode):
                # CANN never makes subfolders but counts (and ages) any it finds;
                # opcache counts them and leaves them alone.
                try:
                    sub = os.open(entry.name, fsutil.DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                try:
                    _scan(sub, scan)
                finally:
                    os.close(sub)
            else:
                scan.links += 1
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
    """One ``<kernel>.json`` and the files it names.

    ``aged``: the existing files CANN's aging deletes with it (the json, its
    binary; for a ``jsonList`` entry the sub-jsons and their binaries).
    ``owned``: those plus its header and a ``jsonList`` entry's own binary.
    ``problem``: why CANN cannot reuse it (without hashing), or None.
    """

    def __init__(self, fd: int, name: str, files: Mapping[str, os.stat_result]) -> None:
        self.json = name
        self.kernel = name[: -len(".json")]
        self.aged = [name]
        self.owned = {name}
        self.bins: list[tuple[str, object, bool]] = []  # (binary, its json's sha256, required)
        self.problem: str | None = None
        self.data = _read_json(fd, name)
        if not isinstance(self.data, dict):
            self.data = None
            self.problem = f"{name} does not parse"
            # What its writer would have named it, so a fix removes it too.
            guesses = (self.kernel + suffix for suffix in _KERNEL_FILE_SUFFIXES)
            self.owned |= {name for name in guesses if name in files}
            return
        if "jsonList" in self.data:
            self._add_sub_jsons(fd, files)
            main_bin, _ = _bin_name(self.data)
            if main_bin is not None and main_bin in files:
                self.owned.add(main_bin)
                self.bins.append((main_bin, self.data.get("sha256"), True))
        else:
            self._add_binary(files)
        stem = self.data.get("binFileName")
        if isinstance(stem, str):
            suffix = self.data.get("headerFileSuffix")
            for header in {stem + suffix if isinstance(suffix, str) else "", stem + ".h"}:
                if header in files and is_plain_name(header):
                    self.owned.add(header)

    def _add_binary(self, files: Mapping[str, os.stat_result]) -> None:
        assert self.data is not None
        binary, why = _bin_name(self.data)
        if binary is None:
            self._fail(why)
            return
        if binary not in files:
            self._fail(f"its binary {binary} is missing")
            return
        self.aged.append(binary)
        self.owned.add(binary)
        self.bins.append((binary, self.data.get("sha256"), True))
        suffix = self.data["binFileSuffix"]
        if suffix not in (".o", ".so"):
            self._fail(f"binFileSuffix {suffix!r}: CANN reuses only .o and .so")
        elif suffix == ".o" and not self.data.get("kernelName"):
            self._fail("no kernelName")
        elif suffix == ".o" and files[binary].st_size == 0:
            self._fail(f"{binary} is empty")

    def _add_sub_jsons(self, fd: int, files: Mapping[str, os.stat_result]) -> None:
        assert self.data is not None
        subs = self.data["jsonList"]
        for item in subs if isinstance(subs, list) else []:
            sub = item.get("jsonFileName") if isinstance(item, dict) else None
            if not isinstance(sub, str) or not is_plain_name(sub):
                self._fail(f"jsonList names {sub!r}, not a file of this folder")
                continue
            if sub not in files:
                self._fail(f"its sub-json {sub} is missing")
                continue
            self.aged.append(sub)
            self.owned.add(sub)
            data = _read_json(fd, sub)
            if not isinstance(data, dict):
                self._fail(f"its sub-json {sub} does not parse")
                continue
            binary, why = _bin_name(data)
            if binary is None:
                self._fail(f"{sub}: {why}")
            elif binary not in files:
                self._fail(f"{sub}: its binary {binary} is missing")
            else:
                self.aged.append(binary)
                self.owned.add(binary)
                self.bins.append((binary, data.get("sha256"), False))

    def _fail(self, why: str | None) -> None:
        if self.problem is None:
            self.problem = why

    def files_to_remove(self) -> list[str]:
        """Every file of the entry, its json first: without it the entry is gone at once."""
        return [self.json, *sorted(self.owned - {self.json})]


def _bin_name(data: Mapping[str, object]) -> tuple[str | None, str | None]:
    """(binary's file name, None) or (None, why there is none)."""
    name, suffix = data.get("binFileName"), data.get("binFileSuffix")
    if not isinstance(name, str) or not isinstance(suffix, str):
        return None, "no binFileName and binFileSuffix"
    if not is_plain_name(name + suffix):
        return None, f"binFileName {name + suffix!r} is not a file of this folder"
    return name + suffix, None


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
    """The parsed json, or None when it cannot be read or parsed."""
    try:
        file_fd = _open_quietly(fd, name)
    except OSError:
        return None
    with os.fdopen(file_fd, "rb") as f:
        raw = f.read(_MAX_JSON_BYTES + 1)
    if len(raw) > _MAX_JSON_BYTES:
        return None
    try:
        return _json.loads(raw)
    except ValueError:  # too deep too: a corrupt json, as one too big (age leaves it alone)
        return None


def _hash_problem(fd: int, entry: _Entry) -> str | None:
    for binary, want, required in entry.bins:
        if binary.endswith(".so"):
            continue  # CANN hashes the kernel inside the library, not the file
        if not isinstance(want, str) or not want:
            if required:
                return f"{entry.json} has no sha256"
            continue
        try:
            got = _sha256(fd, binary)
        except OSError as e:
            return f"cannot read {binary}: {e.strerror or e}"
        if got != want.lower():
            return f"sha256 of {binary} is {got[:16]}..., its json says {want[:16]}..."
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
    if match and idle >= TEMP_GRACE_SECONDS and not pid_alive(int(match["pid"])):
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
