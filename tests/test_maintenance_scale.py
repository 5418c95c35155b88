"""Maintenance at scale (issue 22, item 4): memory flat in the entry count, one pass.

The memory of a maintenance command is measured structurally, with tracemalloc
at N and at 4N entries in tmp_path: what grows with the entries is a bug, what
a million entries would cost follows from it.  The passes are counted as the
calls that open or stat a file, per entry.  No timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers_cache import SOC, T0, FakeClock, make_settings, trash_emptied, write_size_ini
from helpers_cann import SOC as CANN_SOC
from helpers_cann import kernel_json, set_access, write_ini

import opcache
from opcache import aging, cann_cache, cann_transfer, commands, trash
from opcache.settings import AGE_SECONDS, MB, resolve_settings
from opcache.storage import local
from opcache.storage.entry import make_manifest
from opcache.storage.local import LocalStore

KERNEL = 4096  # bytes of each entry's .o
NOW = T0 + 7200  # every stamp below is older than the 30 minutes aging spares
# Memory a walk may grow by from N to 4N entries: a few names per bucket.  A
# walk that held every entry grew by about 175 bytes for each of the 3N more.
FLAT_BYTES = 32 * 1024
# The peak at 4N: an entry, a bucket's names, the candidates.  Reads that asked
# for their limit (16 MB a manifest, 1 MB a counter shard) peaked at 1 to 4 MB.
PEAK_BYTES = 512 * 1024


def fill(root: Path, count: int, *, stamp: Callable[[int], float]) -> list[str]:
    """``count`` entries of a .o and a .json, the ``i``-th last used at ``stamp(i)``;
    their keys, in the order made."""
    store = LocalStore(root)
    keys = []
    for i in range(count):
        key = f"{i:032x}"[::-1]  # spread over the 256 buckets
        files = {"k.o": i.to_bytes(4, "big") * (KERNEL // 4), "k.json": b'{"kernel": "k"}'}
        store.put(SOC, key, make_manifest(key, files, 0.5, {}, stamp(i)), files, now=stamp(i))
        keys.append(key)
    return keys


def open_cache(tmp_path: Path, name: str) -> opcache.OpCache:
    # A 1 MB limit kept at 50 %: a trim frees all but 512 KB.
    write_size_ini(tmp_path / name / "kernel_cache", 1, 50)
    settings = make_settings(tmp_path / name, tmp_path)
    return opcache.OpCache(settings, clock=FakeClock(NOW))


@contextlib.contextmanager
def peak_growth() -> Iterator[list[int]]:
    """The peak bytes allocated inside the block, above what was allocated before it."""
    found: list[int] = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        yield found
        found.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()


def measure(tmp_path: Path, count: int, command: Callable[[opcache.OpCache], object]) -> int:
    # What the command imports and starts once (its deleter) is not the walk's:
    # a small cache first, over its limit too.
    with open_cache(tmp_path, f"warm-{count}") as warm:
        fill(warm.settings.root, 220, stamp=lambda i: T0 - 10_000 + i)
        command(warm)
    cache = open_cache(tmp_path, f"cache-{count}")
    fill(cache.settings.root, count, stamp=lambda i: T0 - 10_000 + i)
    with cache, peak_growth() as peak:
        command(cache)
    trash_emptied(warm.settings.root)
    trash_emptied(cache.settings.root)
    return peak[0]


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(lambda cache: cache.age(), id="trim"),
        pytest.param(lambda cache: cache.age(dry_run=True), id="trim --dry-run"),
        pytest.param(lambda cache: cache.verify(), id="verify"),
    ],
)
def test_maintenance_memory_is_flat_in_the_entry_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: Callable[[opcache.OpCache], object]
) -> None:
    # A trim holds this many candidates at most: fewer than either cache has.
    monkeypatch.setattr(aging, "CANDIDATES", 40, raising=False)
    small = measure(tmp_path, 300, command)
    large = measure(tmp_path, 1200, command)
    assert large - small < FLAT_BYTES, (small, large)
    assert large < PEAK_BYTES, large


def fill_cann(base: Path, count: int) -> Path:
    """A CANN chip folder of ``count`` entries (json, .o, every other one a header,
    every fourth an orphan .o), last used at T0 + i; its kernel_cache folder."""
    chip = base / "kernel_cache" / CANN_SOC
    chip.mkdir(parents=True)
    for i in range(count):
        kernel = f"te_add_{i:08d}"
        binary = i.to_bytes(4, "big") * 16
        (chip / f"{kernel}.o").write_bytes(binary)
        body = json.dumps(kernel_json(kernel, binary, header=i % 2 == 0)).encode()
        (chip / f"{kernel}.json").write_bytes(body)
        if i % 2 == 0:
            (chip / f"{kernel}.h").write_bytes(b"// header\n")
        if i % 4 == 0:
            (chip / f"te_gone_{i:08d}.o").write_bytes(b"orphan")
        set_access([chip / f"{kernel}.json"], T0 + i)
    return chip.parent


def cann_stats_peak(base: Path, count: int, check: bool) -> int:
    root = fill_cann(base, count)
    cache = cann_cache.CannCache(root, cann_cache.read_limits(root), clock=FakeClock(NOW))
    with peak_growth() as peak:
        chip = cache.stats(check=check)["chips"][CANN_SOC]
    assert chip["entries"] == count
    assert chip["broken_entries"] == (0 if check else None)
    assert chip["headers"] == count // 2
    assert chip["orphans"] == count // 4
    assert chip["oldest_access"] == T0
    assert chip["newest_access"] == T0 + count - 1
    aged = [p for p in (root / CANN_SOC).glob("te_add_*") if p.suffix in (".json", ".o")]
    assert chip["entry_bytes"] == sum(p.stat().st_size for p in aged)
    return peak[0]


@pytest.mark.parametrize("check", [False, True], ids=["by name", "check"])
def test_cann_stats_memory_is_flat_in_the_entry_count(tmp_path: Path, check: bool) -> None:
    # Counting by name holds nothing per entry; a check parses each json, and holds
    # none: an entry's json, CannEntry and lstat results once held about 2.7 KB each.
    cann_stats_peak(tmp_path / "warm", 40, check)
    small = cann_stats_peak(tmp_path / "small", 1000, check)
    large = cann_stats_peak(tmp_path / "large", 4000, check)
    assert large - small < FLAT_BYTES, (small, large)
    assert large < PEAK_BYTES, large


def cann_verify_peak(base: Path, count: int) -> int:
    root = fill_cann(base, count)
    cache = cann_cache.CannCache(root, cann_cache.read_limits(root), clock=FakeClock(NOW))
    with peak_growth() as peak:
        chip = cache.verify()["chips"][CANN_SOC]
    assert (chip["entries"], chip["checked"], chip["unchecked"]) == (count, count, [])
    # The orphans, written just now, are younger than the grace a writer gets.
    assert chip["faults"] == []
    return peak[0]


def cann_age_peak(base: Path, count: int) -> int:
    root = fill_cann(base, count)
    # Over its limit whatever the count; only the 251 oldest entries (last used
    # at T0 + i) are idle for 30 minutes, so as many go from every folder.
    (root / CANN_SOC / "other.bin").write_bytes(b"\0" * 2 * MB)
    write_ini(root, 1, 50)
    now = T0 + AGE_SECONDS + 250
    cache = cann_cache.CannCache(root, cann_cache.read_limits(root), clock=FakeClock(now))
    with peak_growth() as peak:
        chip = cache.age(dry_run=True)["chips"][CANN_SOC]
    assert chip["removed"] == [f"te_add_{i:08d}" for i in range(min(count, 251))]
    assert chip["stopped_at_recent"] == (count > 251)
    assert chip["to_free"] > chip["removed_bytes"] > 0
    return peak[0]


@pytest.mark.parametrize("peak_of", [cann_verify_peak, cann_age_peak], ids=["verify", "age"])
def test_cann_verify_and_age_memory_is_flat_in_the_entry_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peak_of: Callable[[Path, int], int]
) -> None:
    # Each held a stat result for every file of the folder; verify held every
    # entry's CannEntry too, a sort held every json's access time and name.
    monkeypatch.setattr(cann_cache, "CANDIDATES", 100, raising=False)
    peak_of(tmp_path / "warm", 40)
    small = peak_of(tmp_path / "small", 1000)
    large = peak_of(tmp_path / "large", 4000)
    assert large - small < FLAT_BYTES, (small, large)
    assert large < PEAK_BYTES, large


def cann_age_all_peak(base: Path, count: int, dry_run: bool) -> int:
    root = fill_cann(base, count)
    # Every entry idle and the limit far below what they hold: all of them go.
    (root / CANN_SOC / "other.bin").write_bytes(b"\0" * 2 * MB)
    write_ini(root, 1, 1)
    now = T0 + AGE_SECONDS + count
    cache = cann_cache.CannCache(root, cann_cache.read_limits(root), clock=FakeClock(now))
    with peak_growth() as peak:
        chip = cache.age(dry_run=dry_run, names=False)["chips"][CANN_SOC]
    assert (chip["removed_count"], chip["removed"], chip["names_listed"]) == (count, [], False)
    assert chip["removed_bytes"] > 0 and chip["errors"] == []
    return peak[0]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry run", "age"])
def test_cann_age_memory_is_flat_in_the_entries_it_removes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dry_run: bool
) -> None:
    # Its report counts them: naming each held about 80 bytes an entry (54-87 MB
    # for a third to a half of a million), which only --json and -v list.
    monkeypatch.setattr(cann_cache, "CANDIDATES", 100, raising=False)
    cann_age_all_peak(tmp_path / "warm", 40, dry_run)
    small = cann_age_all_peak(tmp_path / "small", 1000, dry_run)
    large = cann_age_all_peak(tmp_path / "large", 4000, dry_run)
    assert large - small < FLAT_BYTES, (small, large)
    assert large < PEAK_BYTES, large


def cann_push_peak(base: Path, count: int, driver: Path) -> int:
    write_ini(base / "kernel_cache")  # (the versions, before the entries: none predates it)
    root = fill_cann(base, count)
    (base / "remote").mkdir()
    settings = resolve_settings(op_compiler_cache_dir=str(base), remote=f"file://{base}/remote")
    env = {"HOME": str(base), "ASCEND_DRIVER_PATH": str(driver)}
    with peak_growth() as peak:
        report = cann_transfer.push(CANN_SOC, settings=settings, environ=env, dry_run=True)
    chip = report["chips"][CANN_SOC]  # type: ignore[index]
    assert (chip["would_send"], chip["entries"], chip["skipped"]) == (count, count, [])
    assert root.is_dir()
    return peak[0]


def test_cann_push_memory_is_flat_in_the_entry_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dry run reads and checks every entry the remote lacks, as a push does before
    # sending it: each file's lstat and each entry's CannEntry were held, about
    # 3.8 KB an entry (385 MB at 100,000).  Listed 100 at a time, in parts of 32.
    monkeypatch.setattr(cann_transfer, "CANDIDATES", 100, raising=False)
    monkeypatch.setattr(cann_transfer, "_LISTED", 32, raising=False)
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "version.info").write_text("Version=24.1.rc2\n")
    cann_push_peak(tmp_path / "warm", 40, driver)
    small = cann_push_peak(tmp_path / "small", 1000, driver)
    large = cann_push_peak(tmp_path / "large", 4000, driver)
    assert large - small < FLAT_BYTES, (small, large)
    # (and op_cache.ini, read at once: up to 1 MiB asked for)
    assert large < PEAK_BYTES + MB, large


def cann_transfer_peak(base: Path, count: int, driver: Path, what: str) -> int:
    """The peak of a push that finds every entry on the remote already (``push``), or
    of a pull of them all into an empty chip folder (``pull``)."""
    write_ini(base / "kernel_cache")
    root = fill_cann(base, count)
    (base / "remote").mkdir()
    remote = f"file://{base}/remote"
    settings = resolve_settings(op_compiler_cache_dir=str(base), remote=remote)
    env = {"HOME": str(base), "ASCEND_DRIVER_PATH": str(driver)}
    assert (
        cann_transfer.push(CANN_SOC, settings=settings, environ=env)["chips"][CANN_SOC]["sent"]
        == count
    )  # type: ignore[index]
    if what == "push":
        with peak_growth() as peak:
            report = cann_transfer.push(CANN_SOC, settings=settings, environ=env)
        chip = report["chips"][CANN_SOC]  # type: ignore[index]
        assert (chip["present"], chip["sent"], chip.get("errors")) == (count, 0, None)
    else:
        taker = base / "taker"
        write_ini(taker / "kernel_cache")
        settings = resolve_settings(op_compiler_cache_dir=str(taker), remote=remote)
        with peak_growth() as peak:
            report = cann_transfer.pull(CANN_SOC, settings=settings, environ=env)
        chip = report["chips"][CANN_SOC]  # type: ignore[index]
        assert (chip["written"], chip["present"], chip["rejected"]) == (count, 0, [])
        newest = max((taker / "kernel_cache" / CANN_SOC).glob("*.json"), key=os.path.getatime)
        assert newest.name == f"te_add_{count - 1:08d}.json"
    assert root.is_dir()
    return peak[0]


@pytest.mark.parametrize("what", ["push", "pull"])
def test_cann_push_with_nothing_to_send_and_pull_are_flat_in_the_entry_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    # The remote's index was one value, read, merged and written whole: a push held
    # every kernel's row (read and listed), a pull every row and the sorted list of
    # what it lacked, about 900 bytes a kernel.  Rows now go by parts of the index
    # (a push keeps its own on disk), and a pull holds one window of them.
    monkeypatch.setattr(cann_transfer, "CANDIDATES", 100, raising=False)
    monkeypatch.setattr(cann_transfer, "_LISTED", 32, raising=False)
    monkeypatch.setattr(cann_transfer, "WINDOW", 100, raising=False)
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "version.info").write_text("Version=24.1.rc2\n")
    cann_transfer_peak(tmp_path / "warm", 40, driver, what)
    small = cann_transfer_peak(tmp_path / "small", 1000, driver, what)
    large = cann_transfer_peak(tmp_path / "large", 4000, driver, what)
    assert large - small < FLAT_BYTES, (small, large)
    assert large < PEAK_BYTES + MB, large


def test_a_json_report_is_written_as_it_is_encoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cann age --json names every entry it removes; its encoded chunks, joined
    # into one string before printing, took about 160 bytes a name more.
    names = [f"te_add_{i:08d}" for i in range(20_000)]
    report = {"chips": {CANN_SOC: {"removed": names, "removed_count": len(names)}}}
    with (tmp_path / "report.json").open("w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        with peak_growth() as peak:
            commands._print_json(report)
    monkeypatch.undo()
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert peak[0] < PEAK_BYTES, peak[0]


def test_a_trim_in_several_walks_removes_the_oldest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stamps shared by three entries each, and batches of 40: a batch ends inside
    # a group of equal stamps, and the next walk must start right after it.
    monkeypatch.setattr(aging, "CANDIDATES", 40, raising=False)
    cache = open_cache(tmp_path, "ops")
    keys = fill(cache.settings.root, 400, stamp=lambda i: T0 - 10_000 + i // 3)
    with cache:
        entries, used = cache._store.used(SOC)
        assert used >= MB
        report = cache.age().chips[SOC]
    size = used // entries
    to_free = used - MB * 50 // 100
    removed = -(-to_free // size)
    oldest_first = sorted(keys, key=lambda k: (keys.index(k) // 3, k))
    assert report.removed_entries == removed > 3 * 40  # several walks
    assert report.freed_bytes == removed * size
    kept = {info.key for info in LocalStore(cache.settings.root).scan(SOC)}
    assert kept == set(oldest_first[removed:])
    trash_emptied(cache.settings.root)


def test_a_trim_stops_at_entries_too_young_whatever_the_walks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aging, "CANDIDATES", 40, raising=False)
    cache = open_cache(tmp_path, "ops")
    # 100 old entries, then 300 used a minute ago: only the old can go.
    young = NOW - 60
    fill(cache.settings.root, 400, stamp=lambda i: T0 - 10_000 + i if i < 100 else young)
    with cache:
        report = cache.age().chips[SOC]
    assert report.removed_entries == 100
    assert report.oldest_kept == young
    trash_emptied(cache.settings.root)


def test_a_large_trim_hands_its_trash_to_several_deleters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A deleter lists its whole trash folder at once: a trim fills a folder per
    # 30 entries here, each handed to a deleter when full, not one for them all.
    monkeypatch.setattr(local, "TRASH_FOLDER_ENTRIES", 30, raising=False)
    handed: list[int] = []
    real = trash.delete_later

    def delete_later(trash_fd: int, name: str, fd: int) -> None:
        handed.append(len(os.listdir(fd)))
        real(trash_fd, name, fd)

    monkeypatch.setattr(trash, "delete_later", delete_later)
    cache = open_cache(tmp_path, "ops")
    fill(cache.settings.root, 400, stamp=lambda i: T0 - 10_000 + i)
    with cache:
        report = cache.age().chips[SOC]
        assert report.removed_entries > 3 * 30
        assert sum(handed) == report.removed_entries
        assert max(handed) <= 30
        kept = sum(1 for _ in LocalStore(cache.settings.root).scan(SOC))
        assert cache._store.used(SOC)[0] == kept == 400 - report.removed_entries
    assert trash_emptied(cache.settings.root) == []


class Calls:
    """Counts the calls made to some ``os`` functions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> None:
        self.counts = dict.fromkeys(names, 0)
        for name in names:
            monkeypatch.setattr(os, name, self._counting(name, getattr(os, name)))

    def _counting(self, name: str, real: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            self.counts[name] += 1
            return real(*args, **kwargs)

        return call


def test_verify_opens_each_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    count = 200
    cache = open_cache(tmp_path, "ops")
    fill(cache.settings.root, count, stamp=lambda i: NOW)
    with cache:
        cache.verify()  # lock files and folders made, modules imported
        calls = Calls(monkeypatch, ("open", "stat", "lstat", "scandir"))
        report = cache.verify().chips[SOC]
        monkeypatch.undo()
    assert (report.checked, report.entries, report.corrupt) == (count, count, 0)
    assert (report.counted_entries, report.counted_bytes) == (report.entries, report.bytes)
    # Per entry: its folder, its manifest and its two artifacts, nothing twice;
    # a few more per bucket and per chip.
    per_entry = 1 + 1 + 2
    assert calls.counts["open"] <= per_entry * count + 3 * 256, calls.counts
    # None per entry: the chip folders, the counter shards (16), the quick hits'
    # counts file.
    looks = calls.counts["stat"] + calls.counts["lstat"] + calls.counts["scandir"]
    assert looks < 32, calls.counts
