"""Access stamps and aging, with an injected clock (issue 3, "Access times and aging").

The chip folder's limit is 1 MB (op_cache.ini) and each entry holds a 200,000
byte kernel, so five entries fit and six are over the limit; with a ratio of
50 % a pass trims the folder to at most 524,288 bytes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers_cache import (
    OTHER_SOC,
    SOC,
    T0,
    FakeClock,
    ToyCompiler,
    entry_dirs,
    make_request,
    make_settings,
    run_script,
    tree_bytes,
    wait_for,
)

import opcache
from opcache.settings import AGE_SECONDS, MB

KERNEL = 200_000
LIMIT = 1 * MB
KEEP = LIMIT * 50 // 100


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ops" / "kernel_cache"


@pytest.fixture
def compiler(tmp_path: Path) -> ToyCompiler:
    return ToyCompiler(tmp_path / "calls", size=KERNEL)


def limited(tmp_path: Path, max_mb: int = 1, ratio: int = 50) -> opcache.Settings:
    root = tmp_path / "ops" / "kernel_cache"
    root.mkdir(parents=True, exist_ok=True)
    (root / "op_cache.ini").write_text(
        f"[op_compiler_cache]\nmax_op_cache_size={max_mb}\nremain_cache_size_ratio={ratio}\n",
        encoding="utf-8",
    )
    settings = make_settings(tmp_path / "ops", tmp_path)
    assert settings.max_bytes == max_mb * MB
    return settings


def fill(
    cache: opcache.OpCache, compiler: ToyCompiler, clock: FakeClock, out: Path, count: int = 6
) -> list[str]:
    """Store ``count`` entries ten seconds apart; returns their keys, oldest first."""
    keys = []
    for i in range(count):
        result = cache.compile(make_request(i), compiler, out / str(i))
        assert result.status == "miss"
        keys.append(result.key)
        clock.advance(10)
    return keys


def used(root: Path, soc: str = SOC) -> int:
    return sum(tree_bytes(p) for p in entry_dirs(root, soc).values())


def stamp(root: Path, key: str) -> float:
    return (entry_dirs(root)[key] / "MANIFEST").stat().st_mtime


def test_entries_are_small_enough_for_the_scenario(tmp_path: Path, compiler: ToyCompiler) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        fill(cache, compiler, clock, tmp_path / "o", count=5)
    size = used(settings.root)
    assert 5 * KERNEL < size < LIMIT  # five fit
    assert size / 5 * 6 >= LIMIT  # a sixth goes over


def test_oldest_entries_go_first_until_under_max_times_ratio(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o")
        # Over the limit, but everything is young: nothing went.
        assert set(entry_dirs(root)) == set(keys)
        before = used(root)
        assert before >= LIMIT
        sizes = {k: tree_bytes(p) for k, p in entry_dirs(root).items()}
        clock.now = T0 + 7200
        report = cache.age()
        stats = cache.stats()
    chip = report.chips[SOC]
    # 6 entries of ~201 kB: removing 3 leaves ~603 kB > 512 KiB, removing 4 is enough.
    assert set(entry_dirs(root)) == set(keys[4:])
    assert report.removed_entries == chip.removed_entries == 4
    assert report.freed_bytes == sum(sizes[k] for k in keys[:4])
    assert chip.bytes_before == before
    assert chip.bytes_after == used(root) == before - report.freed_bytes
    assert chip.bytes_after <= KEEP
    assert chip.entries_before == 6
    assert chip.skipped is None
    assert (stats["evicted_entries"], stats["evicted_bytes"]) == (4, report.freed_bytes)
    assert (stats["entries"], stats["bytes"]) == (2, used(root))
    assert report.as_dict()["chips"][SOC]["removed_entries"] == 4


def test_a_higher_ratio_keeps_more(tmp_path: Path, root: Path, compiler: ToyCompiler) -> None:
    clock = FakeClock()
    settings = limited(tmp_path, ratio=80)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o")
        clock.now = T0 + 7200
        report = cache.age()
    # Keep <= 838,860 bytes: removing 2 of 6 leaves ~804 kB.
    assert report.removed_entries == 2
    assert set(entry_dirs(root)) == set(keys[2:])
    assert used(root) <= LIMIT * 80 // 100


def test_entries_used_within_half_an_hour_are_never_deleted(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o")
        # Everything stored at most 1799 s ago by the clock: a pass removes nothing.
        clock.now = T0 + AGE_SECONDS - 1
        report = cache.age()
        assert report.removed_entries == 0
        assert set(entry_dirs(root)) == set(keys)
        assert report.chips[SOC].bytes_after == report.chips[SOC].bytes_before >= LIMIT

        # Later the last three are used again; the first three stay idle.
        clock.now = T0 + 5000
        for i in (3, 4, 5):
            assert cache.compile(make_request(i), compiler, tmp_path / "h").status == "hit"
        clock.now = T0 + 5000 + AGE_SECONDS - 1
        report = cache.age()
    # Four would be needed to get under 512 KiB, but only the three idle ones may go:
    # the folder stays above its limit rather than losing a young entry.
    assert report.removed_entries == 3
    assert set(entry_dirs(root)) == set(keys[3:])
    assert used(root) > KEEP


def test_a_hit_refreshes_the_access_stamp_so_the_entry_survives(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o")
        assert stamp(root, keys[0]) == T0
        clock.now = T0 + 7000
        assert cache.compile(make_request(0), compiler, tmp_path / "h").status == "hit"
        assert stamp(root, keys[0]) == T0 + 7000
        clock.now = T0 + 7200
        report = cache.age()
    # The oldest by creation was used 200 s ago: the next four oldest go instead.
    assert report.removed_entries == 4
    assert set(entry_dirs(root)) == {keys[0], keys[5]}


def test_aging_runs_after_a_store_that_crosses_the_limit(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o", count=5)
        assert set(entry_dirs(root)) == set(keys)
        clock.now = T0 + 7200
        newest = cache.compile(make_request(9), compiler, tmp_path / "n").key
        stats = cache.stats()
    # No age() call: the store itself triggered the pass; the new entry is young.
    assert set(entry_dirs(root)) == {keys[4], newest}
    assert stats["evicted_entries"] == 4
    assert stats["bytes"] == used(root) <= KEEP


def test_aging_runs_when_an_opcache_first_touches_a_chip(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o")
    assert len(entry_dirs(root)) == 6
    clock.now = T0 + 7200
    with opcache.OpCache(settings, clock=clock) as cache:
        assert cache.compile(make_request(5), compiler, tmp_path / "h").status == "hit"
        stats = cache.stats()
    assert set(entry_dirs(root)) == set(keys[4:])
    assert stats["evicted_entries"] == 4


def test_dry_run_reports_without_removing(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o")
        before = {k: tree_bytes(p) for k, p in entry_dirs(root).items()}
        clock.now = T0 + 7200
        dry = cache.age(dry_run=True)
        assert set(entry_dirs(root)) == set(keys)
        assert {k: tree_bytes(p) for k, p in entry_dirs(root).items()} == before
        mid = cache.stats()
        real = cache.age()
    assert dry.removed_entries == real.removed_entries == 4
    assert dry.freed_bytes == real.freed_bytes == sum(before[k] for k in keys[:4])
    assert dry.chips[SOC].bytes_after == real.chips[SOC].bytes_after
    assert mid["evicted_entries"] == 0
    assert mid["entries"] == 6
    assert set(entry_dirs(root)) == set(keys[4:])


def test_age_under_the_limit_does_nothing(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o", count=4)
        clock.now = T0 + 10 * 86400
        report = cache.age()
    chip = report.chips[SOC]
    assert report.removed_entries == 0
    assert chip.bytes_before == chip.bytes_after == used(root) < LIMIT
    assert chip.skipped is None
    assert set(entry_dirs(root)) == set(keys)


def test_aging_is_per_chip(tmp_path: Path, root: Path, compiler: ToyCompiler) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o", count=4)
        other = [
            cache.compile(make_request(i, soc_version=OTHER_SOC), compiler, tmp_path / "p").key
            for i in range(4)
        ]
        # 8 entries in all, 4 per chip: each chip folder is under its own limit.
        clock.now = T0 + 7200
        report = cache.age()
    assert report.removed_entries == 0
    assert set(report.chips) == {SOC, OTHER_SOC}
    assert set(entry_dirs(root)) == set(keys)
    assert set(entry_dirs(root, OTHER_SOC)) == set(other)


def test_nothing_is_deleted_or_stamped_when_aging_is_off(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    clock = FakeClock()
    settings = make_settings(tmp_path / "ops", tmp_path, env={"ASCEND_MAX_OP_CACHE_SIZE": "-1"})
    assert settings.max_bytes is None
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o", count=8)
        assert stamp(root, keys[0]) == T0
        clock.now = T0 + 30 * 86400
        mtime_ns = (entry_dirs(root)[keys[0]] / "MANIFEST").stat().st_mtime_ns
        assert cache.compile(make_request(0), compiler, tmp_path / "h").status == "hit"
        assert (entry_dirs(root)[keys[0]] / "MANIFEST").stat().st_mtime_ns == mtime_ns
        report = cache.age()
        stats = cache.stats()
    assert report.removed_entries == 0
    assert set(entry_dirs(root)) == set(keys)
    assert stats["evicted_entries"] == 0
    assert used(root) > LIMIT
    # A new OpCache (aging at first touch) removes nothing either.
    with opcache.OpCache(settings, clock=clock) as cache:
        cache.compile(make_request(1), compiler, tmp_path / "h2")
    assert set(entry_dirs(root)) == set(keys)


def test_a_hit_writes_a_stamp_when_aging_is_on(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    # The counterpart of the test above: same steps, default limit (500 MB).
    clock = FakeClock()
    settings = make_settings(tmp_path / "ops", tmp_path)
    assert settings.max_bytes == 500 * MB
    with opcache.OpCache(settings, clock=clock) as cache:
        key = cache.compile(make_request(0), compiler, tmp_path / "o").key
        assert stamp(root, key) == T0
        clock.now = T0 + 30 * 86400
        assert cache.compile(make_request(0), compiler, tmp_path / "h").status == "hit"
    assert stamp(root, key) == T0 + 30 * 86400


def _holding(locks: list[Path], tmp_path: Path):  # type: ignore[no-untyped-def]
    """Another process holding ``locks`` (flock, made if missing) until killed."""
    ready = tmp_path / "holding"
    holder = run_script(
        f"""
import fcntl, os, pathlib, time
for path in {[str(lock) for lock in locks]!r}:
    fcntl.flock(os.open(path, os.O_RDWR | os.O_CREAT, 0o640), fcntl.LOCK_EX)
pathlib.Path({str(ready)!r}).touch()
time.sleep(60)
""",
        wait=False,
    )
    wait_for(ready)
    return holder


def test_cleanup_lock_held_by_another_process_skips_the_pass(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o")
    holder = _holding([root / ".opcache" / "locks" / f"{SOC}.cleanup"], tmp_path)
    try:
        clock.now = T0 + 7200
        with opcache.OpCache(settings, clock=clock) as cache:
            # The compile is not blocked by the held lock either.
            assert cache.compile(make_request(0), compiler, tmp_path / "h").status == "hit"
            report = cache.age()
        assert report.removed_entries == 0
        assert report.chips[SOC].skipped is not None
        assert set(entry_dirs(root)) == set(keys)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with opcache.OpCache(settings, clock=clock) as cache:
        report = cache.age()
    assert report.chips[SOC].skipped is None
    assert report.removed_entries == 4
    assert keys[0] in entry_dirs(root)  # its hit above made it young


def test_a_member_holding_the_size_counters_neither_stalls_nor_overtrims_aging(
    tmp_path: Path, root: Path, compiler: ToyCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process (a member of a shared cache) holds every size-counter shard:
    a trim still removes just what it must (a count that fails does not make an
    entry in the trash look kept), and waits for those locks once, not per removal."""
    from opcache import locks
    from opcache.storage import local

    monkeypatch.setattr(local, "_COUNT_EVERY", 1)  # (a count after every removal)
    monkeypatch.setattr(locks, "LOCK_WAIT_SECONDS", 0.2)
    given_up: list[float] = []  # the waits for a lock that ended without it
    poll = locks._poll

    def watched(attempt, wait):  # type: ignore[no-untyped-def]
        took = poll(attempt, wait)
        if not took:
            given_up.append(wait)
        return took

    monkeypatch.setattr(locks, "_poll", watched)
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o")
    shards = sorted((root / SOC / "_size").glob("*.lock"))
    assert shards
    holder = _holding(shards, tmp_path)
    try:
        clock.now = T0 + 7200
        with opcache.OpCache(settings, clock=clock) as cache:
            report = cache.age()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert set(entry_dirs(root)) == set(keys[4:])  # (as test_oldest_entries_go_first...)
    assert report.removed_entries == 4
    assert given_up == [0.2] + [0.0] * (len(given_up) - 1)  # (one wait, then one try each)


def test_an_entry_used_between_scan_and_delete_is_kept(
    tmp_path: Path, root: Path, compiler: ToyCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pass re-checks each entry's stamp just before deleting it.
    from opcache import aging

    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = fill(cache, compiler, clock, tmp_path / "o")
    real_scan = aging.LocalStore.scan
    oldest = entry_dirs(root)[keys[0]] / "MANIFEST"

    def scan_then_touch(self, soc, progress=None, **kwargs):
        infos = list(real_scan(self, soc, progress, **kwargs))
        os.utime(oldest, (T0 + 7190, T0 + 7190))  # another process's hit, after the scan
        yield from infos

    monkeypatch.setattr(aging.LocalStore, "scan", scan_then_touch)
    clock.now = T0 + 7200
    with opcache.OpCache(settings, clock=clock) as cache:
        report = cache.age()
    assert keys[0] in entry_dirs(root)
    assert report.removed_entries == 4
    assert set(entry_dirs(root)) == {keys[0], keys[5]}


def test_counters_match_a_recount_after_stores_hits_evictions_and_clears(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    clock = FakeClock()
    settings = limited(tmp_path)
    with opcache.OpCache(settings, clock=clock) as cache:
        fill(cache, compiler, clock, tmp_path / "o")
        clock.now = T0 + 7200
        for i in (5, 6, 7, 5):
            cache.compile(make_request(i), compiler, tmp_path / "m")
        clock.now = T0 + 20000
        cache.age()
        for i in range(3):
            cache.compile(make_request(i, soc_version=OTHER_SOC), compiler, tmp_path / "p")
        cache.clear(OTHER_SOC)
        cache.compile(make_request(0, soc_version=OTHER_SOC), compiler, tmp_path / "p")
        stats = cache.stats()
        report = cache.verify()
    assert stats["evicted_entries"] > 0
    for soc in (SOC, OTHER_SOC):
        on_disk = entry_dirs(root, soc)
        chip = stats["chips"][soc]
        assert (chip["entries"], chip["bytes"]) == (len(on_disk), used(root, soc)), soc
        counted = report.chips[soc]
        assert (counted.counted_entries, counted.counted_bytes) == (
            counted.entries,
            counted.bytes,
        )
