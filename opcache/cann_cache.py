"""CANN's own kernel cache, kept healthy from outside: stats, aging and checks.

CANN's graph engine caches operator compiles in ``<base>/kernel_cache/<soc>/``
(``<base>``: ``op_compiler_cache_dir``, else ``ASCEND_CACHE_PATH``, else
``$HOME/atc_data``), one flat folder per chip; what its files are, CANN's hit
check and its locks are ``cann_format.py``'s.  CANN ages a chip folder only
when a compile session starts: when the folder (every regular file in it)
reaches ``max``, it deletes entries oldest access first until ``used - max *
ratio / 100`` bytes are gone, stopping at the first one accessed in the last
30 minutes, under ``op_cache_file_del.lock``.

``CannCache`` reads such a folder by those rules: ``stats`` (what is there,
counted as CANN counts), ``age`` (CANN's aging pass and lock, so it can run
while CANN compiles) and ``verify`` (the faults CANN never repairs: corrupt
entries, orphan binaries that block every later store of their kernel, temp
files of dead writers, old prebuild results).  Where CANN is weak it does
better, and every report says so (``NOTES``).
"""

from __future__ import annotations

import contextlib
import heapq
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from . import fsutil, ini, locks, trust
from ._log import get_logger
from ._record import Record
from .cann_format import (
    KERNEL_FILE_SUFFIXES,
    MAX_JSON_BYTES,
    MIX_SUFFIXES,
    PRE_SUFFIX,
    AgingLockDenied,
    CannEntry,
    PresentFiles,
    access_time,
    chip_used,
    del_lock,
    is_entry_json,
    kernel_lock,
    open_chip_folder,
    sha256_problem,
    walk_chip,
)
from .request import is_plain_name, is_soc_version
from .settings import AGE_SECONDS, INI_NAME, KERNEL_CACHE, MB, Settings, size_limits

log = get_logger(__name__)

# The oldest entry jsons an aging pass holds at once (access time and kernel name
# in the heap's tuples); a pass that ages more walks the chip folder again for
# the next oldest.  Ageing half of a million entries, its peak was 81 MB with
# 50,000 and 101 MB with 100,000, for 9 % less CPU; holding every file's stat
# result and sorting every json peaked at 1.6 GB.
CANDIDATES = 50_000
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
    "a binFileName or jsonFileName that leads out of the chip folder (a folder part, .., \\) "
    "or through a link names nothing opcache deletes, and verify does not follow it (CANN "
    "deletes or reads it wherever it leads)",
    "an entry CANN's aging code throws on (a binFileName or binFileSuffix that is no "
    "string, a jsonList item without a jsonFileName string) is left alone and the others "
    "are aged; CANN's pass ends at it, deleting nothing at all",
    "a .so's sha256 is checked for its form only: CANN compares it with the kernel the "
    "library returns once loaded, and opcache never loads a library from a cache folder",
    f"a json over {MAX_JSON_BYTES >> 20} MiB is neither aged nor checked (CANN reads any size)",
    "ASCEND_MAX_OP_CACHE_SIZE and ASCEND_REMAIN_CACHE_SIZE_RATIO are read as opcache's own "
    "cache reads them: a value CANN half-reads (500MB as 500, a ratio of text as 0, "
    "4294967306 wrapped to 10 by atoi) is ignored with a warning",
    "entries accessed in the same second are aged in name order (CANN: directory order), "
    f"the {CANDIDATES:,} oldest at a time, the folder walked again for the next ones",
)

_TEMP = re.compile(r"(?P<dst>.+)_(?P<pid>[0-9]+)_(?P<usec>[0-9]+)_(?P<rand>[0-9]+)\.temp")


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

    def stats(self, soc: str | None = None, *, check: bool = False) -> dict[str, object]:
        """What each chip folder holds, bytes counted as CANN counts them.

        Its files are told by name and ``lstat`` alone (``_chip_counts``); with
        ``check``, each entry's json is read as CANN reads it (``_chip_stats``):
        the files it names otherwise than by its kernel, and whether CANN would
        reuse it (``broken_entries``, None without ``check``).
        """
        report = self._each_chip(soc, self._chip_stats if check else self._chip_counts)
        report["checked"] = check
        report["total"] = _total(report["chips"])
        return report

    def age(
        self, soc: str | None = None, *, dry_run: bool = False, names: bool = True
    ) -> dict[str, object]:
        """One CANN aging pass over each chip folder (``dry_run``: report only).

        Each chip's report counts the entries removed and kept
        (``removed_count``, ``kept_locked_count``, ``kept_accessed_count``) and,
        with ``names``, lists them (``removed``, ``kept_locked``,
        ``kept_accessed``; empty without): about 80 bytes an entry, 40 MB for
        half a million removed.
        """
        return self._each_chip(
            soc, lambda fd: self._age_chip(fd, dry_run, names), deletes=None if dry_run else "aged"
        )

    def verify(self, soc: str | None = None, *, fix: bool = False) -> dict[str, object]:
        """Find corrupt entries, orphans, stale temps, old prebuild results (``fix``: remove)."""
        deletes = "fixed" if fix else None
        return self._each_chip(soc, lambda fd: self._verify_chip(fd, fix), deletes=deletes)

    # -- folders ---------------------------------------------------------------

    def _each_chip(
        self, soc: str | None, work: Callable[[int], dict], *, deletes: str | None = None
    ) -> dict[str, object]:
        """``work`` on each chip folder (or ``soc``'s) of the root, after the root is
        proved CANN's for work that ``deletes`` (what it does, for the message)."""
        root_fd = self._open_root()
        try:
            if deletes is not None:
                self._check_cann_root(root_fd, deletes)
            chips = {}
            for name in self._chips(root_fd, soc):
                try:
                    fd = open_chip_folder(root_fd, name, self._modes, f"{self.root}/{name}")
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
        # The configured root may be reached through links, as opcache's own cache is,
        # but only this user's or root's: it is opened one folder at a time, each link
        # judged as it is met (trust.open_root).  Another user's link would lead stats,
        # age and verify --fix into whatever folder of this user's it names.
        try:
            fd = trust.open_root(self.root, self._modes)[0]
        except (FileNotFoundError, NotADirectoryError):
            raise NoCannCache(f"no CANN kernel cache at {self.root}: no such folder") from None
        try:
            trust.check(os.fstat(fd), self._modes, self.root)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_cann_root(self, root_fd: int, deletes: str) -> None:
        """NoCannCache unless the root holds op_cache.ini (a file, or a link: an admin's
        shared one, which CANN reads through realpath).  CANN writes it at its first
        compile there, and wipes a chip folder it finds without one.  A chip folder
        is any folder named as a chip may be (``src``): a folder of yours put under
        the root's name (by renames in a team folder) must not lose its ``util.h``
        and ``main.o`` as orphans."""
        try:
            st = os.stat(INI_NAME, dir_fd=root_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is None or not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise NoCannCache(
                f"no CANN kernel cache at {self.root}: it holds no {INI_NAME}, which CANN "
                f"writes at its first compile there, so nothing in it is {deletes}"
            )

    def _chips(self, root_fd: int, soc: str | None) -> list[str]:
        names = []
        with os.scandir(root_fd) as it:
            for entry in it:
                if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                    if is_soc_version(entry.name):
                        names.append(entry.name)
                    else:  # (lost+found, notes: no chip of CANN's, nothing in it removed)
                        log.debug("%s/%s is named as no chip: left alone", self.root, entry.name)
        if soc is not None:
            if soc not in names:
                raise NoCannCache(f"no CANN kernel cache for {soc} in {self.root}")
            return [soc]
        if not names:
            raise NoCannCache(f"no CANN kernel cache at {self.root}: it holds no chip folder")
        return sorted(names)

    # -- stats ---------------------------------------------------------------

    def _chip_counts(self, fd: int) -> dict[str, object]:
        # One walk, no file opened: an entry is a <kernel>.json, and owns the files
        # of its kernel's name (<kernel>.o, .so, .h, and a mix entry's
        # <kernel>_mix_aic.json / _mix_aiv.json with their binaries), as CANN
        # names them.  Per file one lstat, and one more for a binary's entry json.
        entries = _Entries(int(self._clock()))
        counts = dict.fromkeys(_COUNTED, 0)
        present = PresentFiles(fd)
        for name, st, top in walk_chip(fd):
            if not _count_file(counts, st, top):
                continue
            if is_entry_json(name):
                entries.count(access_time(st))
                counts["entry_bytes"] += st.st_size
                continue
            kind = _loose_kind(name)
            if kind == "orphans" and _entry_of_name(name) in present:
                if name.endswith(".h"):
                    counts["headers"] += 1
                    counts["header_bytes"] += st.st_size
                else:
                    counts["entry_bytes"] += st.st_size
                continue
            _count_loose(counts, kind, st)
        return self._chip_report(counts, entries, None)

    def _chip_stats(self, fd: int) -> dict[str, object]:
        # Two passes, holding counters and the few files whose owner is not the
        # entry of their name: the entries, then every file (see _Owners).
        owners = _Owners(fd, int(self._clock()))
        counts = dict.fromkeys(_COUNTED, 0)
        for name, st, top in walk_chip(fd):
            if not _count_file(counts, st, top):
                continue
            owned, aged = owners.of(name)
            if aged:
                counts["entry_bytes"] += st.st_size
            if owned and name.endswith(".h"):
                counts["headers"] += 1
                counts["header_bytes"] += st.st_size
            if not owned:
                _count_loose(counts, _loose_kind(name), st)
        return self._chip_report(counts, owners, owners.broken)

    def _chip_report(
        self, counts: dict[str, int], entries: _Entries, broken: int | None
    ) -> dict[str, object]:
        max_bytes = self.limits.max_bytes
        return {
            "used_bytes": counts["used_bytes"],
            "files": counts["files"],
            "limit_bytes": max_bytes,
            "over_limit": max_bytes is not None and counts["used_bytes"] >= max_bytes,
            "entries": entries.entries,
            "entry_bytes": counts["entry_bytes"],
            "broken_entries": broken,
            "idle_entries": entries.idle,
            "oldest_access": entries.oldest,
            "newest_access": entries.newest,
            **{k: counts[k] for k in _COUNTED if k not in ("used_bytes", "files", "entry_bytes")},
        }

    # -- aging -----------------------------------------------------------------

    def _age_chip(self, fd: int, dry_run: bool, names: bool) -> dict[str, object]:
        used = chip_used(fd)
        max_bytes = self.limits.max_bytes
        ratio = self.limits.remain_cache_size_ratio
        report: dict[str, object] = {
            "dry_run": dry_run,
            "used_bytes": used,
            "limit_bytes": max_bytes,
            "to_free": 0,
            "names_listed": names,
            "removed": [],
            "removed_count": 0,
            "removed_bytes": 0,
            "kept_locked": [],
            "kept_locked_count": 0,
            "kept_accessed": [],
            "kept_accessed_count": 0,
            "stopped_at_recent": False,
            "used_after": used,
            "skipped": None,
            "errors": [],
        }
        if max_bytes is None:
            report["skipped"] = "aging is off (max_op_cache_size -1)"
            return report
        if used < max_bytes:
            return report
        try:
            with del_lock(fd, dry_run, aging=True) as held_by:
                if held_by is not None:
                    report["skipped"] = held_by
                    return report
                to_free = used - max_bytes * ratio // 100
                report["to_free"] = to_free
                self._delete_oldest(fd, to_free, dry_run, report)
        except AgingLockDenied as e:
            return {"error": str(e)}  # (not a pass skipped now and then: never, as this user)
        report["used_after"] = used - report["removed_bytes"]
        return report

    def _delete_oldest(self, fd: int, to_free: int, dry_run: bool, report: dict) -> None:
        """CANN's ``AgingCacheFileByAccessTime``, step for step (see the module's docstring),
        but for the order of entries accessed in the same second (``_oldest_first``)."""
        present = PresentFiles(fd)
        counted = 0
        for atime, kernel in _oldest_first(fd):
            if int(self._clock()) - atime < AGE_SECONDS:
                report["stopped_at_recent"] = True
                break
            name = kernel + ".json"
            try:
                now_st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                now_st = None
            if now_st is not None and access_time(now_st) == atime:
                entry = CannEntry(fd, name, present)
                if entry.lock_file:  # planted: said (CANN never ages it either: no json)
                    report["errors"].append(f"{kernel}: not aged: {entry.unchecked}")
                if entry.aged is None:
                    continue  # CANN never ages a json it cannot parse (see CannEntry)
                with kernel_lock(fd, kernel) as free:
                    if not free:
                        _tell(report, "kept_locked", kernel)
                    else:
                        size = _bytes(fd, entry.aged)
                        counted += size
                        _tell(report, "removed", kernel)
                        if dry_run:
                            report["removed_bytes"] += size
                        else:
                            report["removed_bytes"] += _remove(fd, entry.aged, report["errors"])
            elif now_st is not None:
                _tell(report, "kept_accessed", kernel)
            if counted >= to_free:
                break

    # -- verify ----------------------------------------------------------------

    def _verify_chip(self, fd: int, fix: bool) -> dict[str, object]:
        # Two passes, as stats: the entries (each checked as it is read), then the
        # files no entry owns; only the faults and their files' lstat are held.
        now = self._clock()
        faults: dict[str, list[dict[str, object]]] = {
            kind: [] for kind in ("corrupt", "orphan", "stale temp", "old prebuild")
        }
        seen: dict[str, os.stat_result] = {}  # a fault's files as they were checked

        def fault(kind: str, name: str, why: str, remove: list[str], locks: list[str]) -> None:
            found = {"kind": kind, "name": name, "why": why, "files": remove, "locks": locks}
            faults[kind].append(found)

        checked = 0
        unchecked = []

        def check(entry: CannEntry, json_st: os.stat_result) -> None:
            nonlocal checked
            problem = entry.problem
            if problem is None and entry.unchecked is not None:
                unchecked.append({"name": entry.kernel, "why": entry.unchecked})
                return
            if problem is None:
                checked += 1
                problem = sha256_problem(fd, entry)
            if problem is not None:
                remove = entry.files_to_remove()
                # Its json as walked (a writer replaces it last); the rest as now.
                seen[entry.json] = json_st
                for name in remove[1:]:
                    with contextlib.suppress(FileNotFoundError):
                        seen[name] = os.stat(name, dir_fd=fd, follow_symlinks=False)
                fault("corrupt", entry.kernel, problem, remove, [entry.kernel])

        owners = _Owners(fd, int(now), check)
        present = PresentFiles(fd)
        for name, st, top in walk_chip(fd):
            if not top or not stat.S_ISREG(st.st_mode) or owners.of(name)[0]:
                continue
            kind = _loose_kind(name)
            if kind == "orphans" and now - st.st_mtime >= TEMP_GRACE_SECONDS:
                seen[name] = st
                fault("orphan", name, "no entry names it", [name], _orphan_locks(name))
            elif kind == "temps" and (why := _stale_temp(name, st, now)) is not None:
                seen[name] = st
                fault("stale temp", name, why, [name], [])
            elif kind == "prebuild":
                idle = now - max(st.st_atime, st.st_mtime)
                entry_json = name[: -len(PRE_SUFFIX)] + ".json"
                if entry_json not in present and idle >= AGE_SECONDS:
                    why = f"no {entry_json}, unused for {int(idle // 60)} minutes"
                    seen[name] = st
                    fault("old prebuild", name, why, [name], [name[: -len(".json")]])
        found_all = [found for of_kind in faults.values() for found in of_kind]
        errors: list[str] = []
        if fix:
            for found in found_all:
                found["removed"] = self._remove_fault(fd, found, seen, errors)
        return {
            "entries": owners.entries,
            "checked": checked,
            "unchecked": unchecked,
            "faults": found_all,
            "removed": sum(1 for f in found_all if f.get("removed")),
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


def _tell(report: dict, what: str, kernel: str) -> None:
    """Count an entry aging removed or kept, and name it where the report lists names.

    The report lists the batch's own strings: a copy of each would be new memory
    among the batch's, which its end could not free.
    """
    report[what + "_count"] += 1
    if report["names_listed"]:
        report[what].append(kernel)


def _why_kept(
    fd: int, found: dict, files: dict[str, os.stat_result], held: contextlib.ExitStack
) -> str | None:
    """Why a fault must stay (taking its writer's locks into ``held`` meanwhile), or None."""
    for kernel in found["locks"]:
        if not held.enter_context(kernel_lock(fd, kernel)):
            return f"{kernel}.lock is held by a writer"
    for name in found["files"]:
        if name in files and not _unchanged(fd, name, files[name]):
            return f"{name} changed since it was checked"
    if found["kind"] == "orphan":
        try:
            os.stat(_kernel_of(found["name"]) + ".json", dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return "its entry appeared since it was checked"
    return None


def _count_file(counts: dict[str, int], st: os.stat_result, top: bool) -> bool:
    """Count a walked file as CANN counts its size; whether it is a regular file of the
    chip folder itself, which stats then sorts by kind."""
    if not stat.S_ISREG(st.st_mode):
        counts["links"] += 1
        return False
    counts["files"] += 1
    counts["used_bytes"] += st.st_size
    if not top:
        counts["subfolder_files"] += 1
        counts["subfolder_bytes"] += st.st_size
    return top


def _count_loose(counts: dict[str, int], kind: str, st: os.stat_result) -> None:
    """Count a file no entry owns, of ``_loose_kind`` ``kind``."""
    counts[kind] += 1
    if kind in _KIND_BYTES:  # (a lock's bytes are not reported)
        counts[_KIND_BYTES[kind]] += st.st_size


def _loose_kind(name: str) -> str:
    """What a file no entry owns is (a verify list, a stats figure)."""
    if name.endswith(".lock"):
        return "locks"
    if name.endswith(".temp"):
        return "temps"
    if name.endswith(PRE_SUFFIX):
        return "prebuild"
    if name.endswith((*KERNEL_FILE_SUFFIXES, *MIX_SUFFIXES)):
        return "orphans"
    return "other"


_KIND_BYTES = {
    "temps": "temp_bytes",
    "prebuild": "prebuild_bytes",
    "orphans": "orphan_bytes",
    "other": "other_bytes",
}
_COUNTED = (
    "used_bytes", "files", "entry_bytes", "headers", "header_bytes", "prebuild",
    "prebuild_bytes", "locks", "temps", "temp_bytes", "orphans", "orphan_bytes", "other",
    "other_bytes", "subfolder_files", "subfolder_bytes", "links",
)  # fmt: skip
# The files named after an entry's kernel that it owns unless its json says
# otherwise, and whether CANN's aging deletes them with it.
_OWN_SUFFIXES = {".o": True, ".so": True, ".h": False}


class _Entries:
    """Entries counted by their json's access time (whole seconds), as ``now`` sees them."""

    def __init__(self, now: int) -> None:
        self._now = now
        self.entries = self.idle = 0
        self.oldest: int | None = None
        self.newest: int | None = None

    def count(self, atime: int) -> None:
        self.entries += 1
        self.idle += self._now - atime >= AGE_SECONDS
        self.oldest = atime if self.oldest is None else min(self.oldest, atime)
        self.newest = atime if self.newest is None else max(self.newest, atime)


class _Owners(_Entries):
    """Which entry owns each file of a chip folder, from one pass over its entries,
    holding only the exceptions: an entry ``k.json`` owns ``k.o``, ``k.so`` and
    ``k.h`` where they exist, CANN's aging deleting the first two with it.  Files
    an entry owns under other names (sub-jsons, a binary named otherwise) and the
    files of its name it does not own are kept by name; the entries themselves
    are dropped once counted."""

    def __init__(
        self,
        fd: int,
        now: int,
        each: Callable[[CannEntry, os.stat_result], None] | None = None,
    ) -> None:
        super().__init__(now)
        self._fd = fd
        self.broken = 0
        self._owned: set[str] = set()  # owned by an entry not of their name
        self._aged: set[str] = set()
        self._not_owned: set[str] = set()  # of an entry's name, not its
        self._aged_flipped: set[str] = set()  # of an entry's name, aged otherwise than said
        present = PresentFiles(fd)
        for name, st in _entry_json_stats(fd):
            entry = CannEntry(fd, name, present)
            self.count(access_time(st))
            self._own(entry, present)
            if each is not None:
                each(entry, st)

    def _own(self, entry: CannEntry, present: PresentFiles) -> None:
        self.broken += entry.problem is not None
        aged = set(entry.aged or [entry.json])
        own = {entry.json, *(entry.kernel + suffix for suffix in _OWN_SUFFIXES)}
        self._owned |= entry.owned - own
        self._aged |= aged - own
        for suffix, ages in _OWN_SUFFIXES.items():
            name = entry.kernel + suffix
            if name not in entry.owned:
                if name in present:
                    self._not_owned.add(name)
            elif (name in aged) != ages:
                self._aged_flipped.add(name)

    def of(self, name: str) -> tuple[bool, bool]:
        """(whether an entry owns file ``name``, whether CANN's aging deletes it with one)."""
        if is_entry_json(name):
            return True, True
        by_name = self._by_name(name)
        owned = name in self._owned or by_name is not None
        return owned, name in self._aged or bool(by_name)

    def _by_name(self, name: str) -> bool | None:
        """Whether the entry of this file's name ages it; None where it has none."""
        suffix = next((s for s in _OWN_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            return None
        kernel_json = name[: -len(suffix)] + ".json"
        if name in self._not_owned or not is_entry_json(kernel_json):
            return None
        if kernel_json not in PresentFiles(self._fd):
            return None
        return _OWN_SUFFIXES[suffix] != (name in self._aged_flipped)


def _kernel_of(name: str) -> str:
    """The kernel an orphan file was written for (a mix sub-file's main kernel)."""
    stem = name[: -len(".json")] if name.endswith(".json") else os.path.splitext(name)[0]
    for suffix in MIX_SUFFIXES:
        mix = suffix[: -len(".json")]
        if stem.endswith(mix):
            return stem[: -len(mix)]
    return stem


def _entry_of_name(name: str) -> str:
    """The entry json a binary, header or sub-json belongs to by its name, or ""."""
    owner = _kernel_of(name) + ".json"
    return owner if is_entry_json(owner) else ""


def _orphan_locks(name: str) -> list[str]:
    stem = name[: -len(".json")] if name.endswith(".json") else os.path.splitext(name)[0]
    return list(dict.fromkeys([stem, _kernel_of(name)]))


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


def _oldest_first(fd: int) -> Iterator[tuple[int, str]]:
    """(access time, kernel) of each entry json of a chip folder, oldest first (ties
    by kernel name), CANDIDATES at a time: a walk for each, so a million entries
    are never held at once."""
    after: tuple[int, str] | None = None
    while True:
        batch = heapq.nsmallest(CANDIDATES, _entry_jsons(fd, after))
        yield from batch
        if len(batch) < CANDIDATES:
            return
        after = batch[-1]


def _entry_jsons(fd: int, after: tuple[int, str] | None) -> Iterator[tuple[int, str]]:
    """(access time, kernel) of each entry json (a regular file) past ``after``."""
    for name, st in _entry_json_stats(fd):
        found = (access_time(st), name[: -len(".json")])
        if after is None or found > after:
            yield found


def _entry_json_stats(fd: int) -> Iterator[tuple[str, os.stat_result]]:
    """The name and ``lstat`` of each entry json of the chip folder that is a regular file."""
    with os.scandir(fd) as it:
        for item in it:
            if not is_entry_json(item.name):
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield item.name, st


def _bytes(fd: int, names: Iterable[str]) -> int:
    """The bytes of the regular files ``names`` of the chip folder, as they are now."""
    total = 0
    for name in names:
        if not is_plain_name(name):
            continue
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


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


_SUMMED = (
    "used_bytes", "files", "entries", "entry_bytes", "idle_entries", "headers", "header_bytes",
    "prebuild", "prebuild_bytes", "locks", "temps", "temp_bytes", "orphans",
    "orphan_bytes", "other", "other_bytes", "subfolder_files", "subfolder_bytes", "links",
)  # fmt: skip


def _total(chips: Mapping[str, Mapping[str, object]]) -> dict[str, object]:
    read = [c for c in chips.values() if "error" not in c]
    total: dict[str, object] = {k: sum(c[k] for c in read) for k in _SUMMED}  # type: ignore[misc]
    broken = [c["broken_entries"] for c in read]
    total["broken_entries"] = None if None in broken else sum(broken)  # type: ignore[arg-type]
    oldest = [c["oldest_access"] for c in read if c["oldest_access"] is not None]
    newest = [c["newest_access"] for c in read if c["newest_access"] is not None]
    total["oldest_access"] = min(oldest, default=None)  # type: ignore[type-var]
    total["newest_access"] = max(newest, default=None)  # type: ignore[type-var]
    return total
