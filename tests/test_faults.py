"""Fault injection: full disks, read-only and forbidden caches, kills, NFS races (issue 5).

The promise under test: whatever the cache folder does, a compile returns the
right artifacts in ``out_dir``; the user hears about a broken cache once; and
the cache is consistent afterwards (``verify`` finds nothing corrupt, no
leftovers stay, the counters agree with a recount).

Corruption of stored entries is covered by test_store_integrity.py, SIGKILL of
a lone writer and ``force`` among busy processes by test_concurrency.py; the
kills here add a concurrent reader, a kill between publish and counting, and
the cleanup lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers_cache import (
    MP,
    SOC,
    FakeClock,
    ToyCompiler,
    base_spec,
    compile_child,
    entry_dirs,
    expected_files,
    make_request,
    make_settings,
    read_dir,
    read_json,
    run_script,
    store_forever_child,
    toolkit_env,
    trash_emptied,
    tree_bytes,
    wait_for,
)
from helpers_faults import (
    CHILD_PROLOGUE,
    NOBODY,
    count_then_hang_child,
    listing,
    open_folder,
    publish_then_hang_child,
    read_only,
    reader_child,
    requires_root,
    run_as,
    settings_for,
    tmpfs,
    warnings_of,
)

import opcache
from opcache import fsutil
from opcache.storage.local import LocalStore

PAGE = os.sysconf("SC_PAGE_SIZE")  # tmpfs gives out space in pages
SMALL = f"size={128 * PAGE}"  # 512 KiB with 4 KiB pages


def consistent(settings: opcache.Settings, **clock) -> dict:
    """verify() the cache; assert nothing corrupt, no leftovers, counters = a walk."""
    root = settings.root
    with opcache.OpCache(settings, **clock) as cache:
        report = cache.verify().as_dict()
        stats = cache.stats()
    assert report["corrupt"] == 0
    tmp = root / ".opcache" / "tmp"
    assert not tmp.exists() or os.listdir(tmp) == []
    assert trash_emptied(root) == []  # (its deleters run in the background)
    walked = entry_dirs(root)
    assert (stats["entries"], stats["bytes"]) == (
        len(walked),
        sum(tree_bytes(p) for p in walked.values()),
    )
    store = LocalStore(root)
    for key in walked:
        assert store.get(SOC, key) is not None
    return report


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# ------------------------------------------------------------------ disk full


def test_disk_full_artifacts_larger_than_the_space(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    compiler = ToyCompiler(tmp_path / "calls", size=256 * PAGE)  # twice the filesystem
    with tmpfs(tmp_path / "small", SMALL):
        settings = make_small_settings(tmp_path)
        caplog.set_level(logging.WARNING)
        with opcache.OpCache(settings) as cache:
            results = [cache.compile(make_request(i), compiler, tmp_path / f"o{i}") for i in (0, 1)]
            stats = cache.stats()
        assert [r.status for r in results] == ["miss", "miss"]
        for i in (0, 1):
            assert read_dir(tmp_path / f"o{i}") == expected_files(make_request(i), compiler.size)
        assert len(warnings_of(caplog)) == 1, warnings_of(caplog)
        assert stats["errors"] == 2
        consistent(settings)


def make_small_settings(tmp_path: Path) -> opcache.Settings:
    """A cache on the small filesystem mounted at tmp_path/small; out_dir stays outside."""
    return make_settings(tmp_path / "small" / "ops", tmp_path)


def test_disk_full_while_storing_never_fails_the_compile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The artifacts fit; the disk fills up at some later step of the store (the
    # manifest, the counters, the stats...), one more page of room each round.
    size = 3 * PAGE
    compiler = ToyCompiler(tmp_path / "calls", size=size)
    artifact_pages = 4  # the 3-page kernel and its small JSON file
    outcomes = []
    with tmpfs(tmp_path / "small", SMALL):
        settings = make_small_settings(tmp_path)
        with opcache.OpCache(settings) as cache:  # folders, counters and stats exist
            cache.compile(make_request(100), compiler, tmp_path / "warm")
        for headroom in range(artifact_pages, artifact_pages + 5):
            filler = tmp_path / "small" / "filler"
            filler.write_bytes(b"\0" * (free_bytes(filler.parent) - headroom * PAGE))
            request = make_request(headroom)
            out = tmp_path / f"out{headroom}"
            caplog.clear()
            caplog.set_level(logging.WARNING)
            with opcache.OpCache(settings) as cache:
                before = cache.stats()["errors"]
                result = cache.compile(request, compiler, out)
                filler.unlink()  # room again: the counts kept in memory can be written
                errors = cache.stats()["errors"] - before
            warnings = warnings_of(caplog)
            assert result.status == "miss"
            assert read_dir(out) == expected_files(request, size)
            assert len(warnings) <= 1, warnings
            assert errors == len(warnings), (headroom, warnings)
            if warnings:
                assert "No space left on device" in warnings[0]
            outcomes.append(bool(warnings))
            consistent(settings)
        # Some rounds met the full disk, the last ones had room enough to store.
        assert outcomes[0] and not outcomes[-1], outcomes


RLIMIT_SCRIPT = """
import json, logging, os, resource, signal
from pathlib import Path
import helpers_cache as h, opcache

messages = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            messages.append(record.getMessage())
logging.getLogger().addHandler(Keep())

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
settings = h.make_settings({ops!r}, {home!r})
comp = h.ToyCompiler({calls!r})
with opcache.OpCache(settings) as cache:
    cache.compile(h.make_request(0), comp, Path({out!r}) / "warm")  # folders, counters, stats
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    # Small artifacts (the user's out_dir gets them whole); a huge attribute
    # makes the manifest, which records the key's inputs, larger than the limit.
    big = h.make_request(1, attrs={{"table": "x" * {big}}})
    result = cache.compile(big, comp, Path({out!r}) / "big")
    small = cache.compile(h.make_request(2), comp, Path({out!r}) / "small")
    again = cache.compile(big, comp, Path({out!r}) / "again")
    stats = cache.stats()
print(json.dumps({{
    "statuses": [result.status, small.status, again.status],
    "good": [
        h.read_dir(Path({out!r}) / "big") == h.expected_files(big),
        h.read_dir(Path({out!r}) / "small") == h.expected_files(h.make_request(2)),
        h.read_dir(Path({out!r}) / "again") == h.expected_files(big),
    ],
    "warnings": messages,
    "errors": stats["errors"],
    "stores": stats["stores"],
}}))
"""


def test_file_size_limit_while_storing_never_fails_the_compile(tmp_path: Path) -> None:
    limit = 64 * 1024
    code = RLIMIT_SCRIPT.format(
        ops=str(tmp_path / "ops"),
        home=str(tmp_path),
        calls=str(tmp_path / "calls"),
        out=str(tmp_path / "out"),
        limit=limit,
        big=4 * limit,
    )
    done = run_script(code)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["statuses"] == ["miss", "miss", "miss"]
    assert report["good"] == [True, True, True]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "File too large" in report["warnings"][0]
    assert report["errors"] == 2  # both compiles of the big request
    assert report["stores"] == 2  # the warm-up and the small request
    consistent(settings_for(tmp_path))
    assert len(entry_dirs(settings_for(tmp_path).root)) == 2


# ---------------------------------------------------------- read-only cache


def test_read_only_cache_hits_and_compiles_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    settings = settings_for(tmp_path)
    clock = FakeClock(time.time())
    with opcache.OpCache(settings, clock=clock) as cache:
        stored = cache.compile(make_request(0), compiler, tmp_path / "a")
    before = listing(tmp_path / "ops")
    with read_only(tmp_path / "ops"):
        caplog.set_level(logging.WARNING)
        clock.advance(3600)  # the hit wants to record its access: it cannot
        with opcache.OpCache(settings, clock=clock) as cache:
            hit = cache.compile(make_request(0), compiler, tmp_path / "b")
            misses = [cache.compile(make_request(i), compiler, tmp_path / f"m{i}") for i in (1, 2)]
            cache.stats()  # cannot write the counts: no error either
        assert hit.status == "hit"
        assert hit.key == stored.key
        assert read_dir(tmp_path / "b") == expected_files(make_request(0))
        assert [m.status for m in misses] == ["miss", "miss"]
        for i in (1, 2):
            assert read_dir(tmp_path / f"m{i}") == expected_files(make_request(i))
        assert compiler.calls() == 3
        warnings = warnings_of(caplog)
        assert len(warnings) == 1, warnings
        assert "Read-only file system" in warnings[0]
    assert listing(tmp_path / "ops") == before
    consistent(settings)


PERMISSION_CODE = """
settings = h.make_settings({ops!r}, {home!r})
before = len(keep.messages)  # what resolving the settings said
comp = h.ToyCompiler({calls!r})
with opcache.OpCache(settings) as cache:
    results = [cache.compile(h.make_request(i), comp, Path({out!r}) / str(i)) for i in (0, 1, 0)]
print(json.dumps({{
    "statuses": [r.status for r in results],
    "good": [h.read_dir(Path({out!r}) / str(i)) == h.expected_files(h.make_request(i))
             for i in (0, 1)],
    "settings_warnings": keep.messages[:before],
    "warnings": keep.messages[before:],
}}))
"""


@requires_root
@pytest.mark.parametrize("private_root", [False, True], ids=["entries", "whole_cache"])
def test_permission_denied_compiles_uncached_with_one_warning(private_root: bool) -> None:
    with open_folder() as base:
        ops = base / "ops"
        settings = opcache.resolve_settings(
            op_compiler_cache_mode="enable",
            op_compiler_cache_dir=str(ops),
            environ={"HOME": str(base), **toolkit_env(base)},  # (op_cache.ini made)
        )
        with opcache.OpCache(settings) as cache:  # root's cache: folders 0750, files 0640
            cache.compile(make_request(0), ToyCompiler(base / "calls"), base / "root-out")
        os.chmod(ops, 0o755)
        if not private_root:
            # The root and its op_cache.ini readable by all; the entries are not.
            os.chmod(settings.root, 0o755)
            os.chmod(settings.root / "op_cache.ini", 0o644)
        before = listing(ops)
        (base / "calls").chmod(0o666)
        (base / "out").mkdir(mode=0o777)
        os.chmod(base / "out", 0o777)
        code = PERMISSION_CODE.format(
            ops=str(ops), home=str(base), calls=str(base / "calls"), out=str(base / "out")
        )
        report = run_as(NOBODY, NOBODY, CHILD_PROLOGUE + code)
        assert report["statuses"] == ["miss", "miss", "miss"]
        assert report["good"] == [True, True]
        assert len(report["warnings"]) == 1, report["warnings"]
        assert "Permission denied" in report["warnings"][0]
        # An unreadable op_cache.ini is said while resolving the settings, once.
        assert len(report["settings_warnings"]) == int(private_root), report
        assert listing(ops) == before


# ------------------------------------------------------------------- kills


def _fill(settings: opcache.Settings, clock: FakeClock, tmp_path: Path, count: int) -> list[str]:
    compiler = ToyCompiler(tmp_path / "calls", size=200_000)
    keys = []
    with opcache.OpCache(settings, clock=clock) as cache:
        for i in range(count):
            keys.append(cache.compile(make_request(i), compiler, tmp_path / "fill").key)
            clock.advance(60)
    return keys


def age_then_hang_child(spec: dict) -> None:
    """Age the cache and stop dead after the first entry it evicts (cleanup lock held)."""
    real_discarding = LocalStore.discarding

    @contextlib.contextmanager
    def discarding_then_hang(self, soc: str, **options):
        with real_discarding(self, soc, **options) as remove:

            def remove_then_hang(key: str):
                size = remove(key)
                Path(spec["marker"]).touch()
                time.sleep(3600)
                return size

            yield remove_then_hang

    LocalStore.discarding = discarding_then_hang
    settings = settings_for(Path(spec["tmp_path"]))
    with opcache.OpCache(settings, clock=FakeClock(spec["now"])) as cache:
        cache.age()


def test_killed_while_holding_the_cleanup_lock_others_age_afterwards(tmp_path: Path) -> None:
    root = tmp_path / "ops" / "kernel_cache"
    root.mkdir(parents=True)
    (root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=1\nremain_cache_size_ratio=50\n"
    )
    settings = settings_for(tmp_path)
    clock = FakeClock()
    keys = _fill(settings, clock, tmp_path, 7)  # 1.4 MB: over the 1 MB limit, all young
    assert len(entry_dirs(root)) == 7
    now = clock.now + 7200  # two hours later all are old
    marker = tmp_path / "evicted-one"
    spec = {"marker": str(marker), "tmp_path": str(tmp_path), "now": now}
    child = MP.Process(target=age_then_hang_child, args=(spec,))
    child.start()
    try:
        wait_for(marker)
        with opcache.OpCache(settings, clock=FakeClock(now)) as cache:
            held = cache.age().as_dict()
        assert held["chips"][SOC]["skipped"]  # the child holds the cleanup lock
        assert held["removed_entries"] == 0
        child.kill()
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        with opcache.OpCache(settings, clock=FakeClock(now)) as cache:
            # A trimmer counts its removals in batches: the one killed before its
            # first count left the counters high; verify (the cron job) recounts.
            cache.verify()
            report = cache.age().as_dict()
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert report["chips"][SOC]["skipped"] is None
    # The child took the oldest; this pass goes on down to 512 KB, oldest first.
    assert report["removed_entries"] == 4
    assert set(entry_dirs(root)) == set(keys[5:])
    consistent(settings, clock=FakeClock(now))


def test_sigkill_of_writers_with_a_reader_running(tmp_path: Path) -> None:
    size = 128 * 1024
    settings = settings_for(tmp_path)
    root = settings.root
    base = {
        "cache_dir": str(tmp_path / "ops"),
        "home": str(tmp_path),
        "out": str(tmp_path / "out"),
        "compiler": {"calls_file": str(tmp_path / "calls"), "size": size},
    }
    with opcache.OpCache(settings) as cache:  # the root exists before the reader starts
        cache.compile(make_request(99_000), ToyCompiler(tmp_path / "calls", size=size), tmp_path)
    reader_spec = {
        "root": str(root),
        "size": size,
        "ready": str(tmp_path / "reader-ready"),
        "stop": str(tmp_path / "reader-stop"),
        "result": str(tmp_path / "reader.json"),
    }
    reader = MP.Process(target=reader_child, args=(reader_spec,))
    reader.start()
    try:
        wait_for(reader_spec["ready"])
        # 1. Killed at random instants, many times.
        rng = random.Random(5)
        log = tmp_path / "attempted"
        for iteration in range(30):
            started = tmp_path / f"started{iteration}"
            spec = {**base, "first": iteration * 1000, "log": str(log), "started": str(started)}
            child = MP.Process(target=store_forever_child, args=(spec,))
            child.start()
            wait_for(started)
            time.sleep(rng.uniform(0.0, 0.1))
            child.kill()
            child.join(10)
            assert child.exitcode == -signal.SIGKILL
        # 2. Killed just after the rename into place (counted before it): visible.
        # 3. Killed just before that rename: a whole build folder left in .opcache/tmp,
        #    and counted, never published.
        for when, index in (("after", 50_000), ("before", 60_000)):
            marker = tmp_path / f"publishing-{when}"
            spec = {**base, "calls": str(tmp_path / "calls"), "size": size, "when": when}
            spec.update(index=index, marker=str(marker), out=str(tmp_path / "out" / when))
            _kill_when(MP.Process(target=publish_then_hang_child, args=(spec,)), marker)
    finally:
        Path(reader_spec["stop"]).touch()
        reader.join(30)
        if reader.is_alive():
            reader.kill()
            reader.join()
    seen = read_json(reader_spec["result"])
    assert seen["error"] is None, seen["error"]
    assert seen["bad"] == []  # never a partial or wrong entry
    assert seen["entries_read"] > 30
    walked = entry_dirs(root)
    assert len(walked) > 30
    leftovers = os.listdir(root / ".opcache" / "tmp")
    assert len(leftovers) >= 1
    counted = LocalStore(root).used(SOC)
    actual = (len(walked), sum(tree_bytes(p) for p in walked.values()))
    assert counted != actual  # at least the entry counted but never published
    report = consistent(settings)
    chip = report["chips"][SOC]
    assert (chip["counted_entries"], chip["counted_bytes"]) == counted
    assert (chip["entries"], chip["bytes"]) == actual
    assert report["leftovers_removed"] >= len(leftovers)


def test_a_counter_update_killed_half_way_leaves_nothing_behind(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    marker = tmp_path / "counting"
    spec = {
        "cache_dir": str(tmp_path / "ops"),
        "home": str(tmp_path),
        "calls": str(tmp_path / "calls"),
        "out": str(tmp_path / "out"),
        "index": 0,
        "marker": str(marker),
    }
    _kill_when(MP.Process(target=count_then_hang_child, args=(spec,)), marker)
    size_folder = settings.root / SOC / "_size"
    temp_files = [n for n in os.listdir(size_folder) if n.startswith(".")]
    assert temp_files  # what the kill left
    # Cleaning runs with a clock far ahead: any grace period for live writers is over.
    clock = FakeClock(time.time() + 24 * 3600)
    consistent(settings, clock=clock)
    with opcache.OpCache(settings, clock=clock) as cache:
        cache.age()
    assert [n for n in os.listdir(size_folder) if n.startswith(".")] == []


def test_a_store_racing_verify_is_not_lost_from_the_counters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # verify walks, then resets the counters to the walk: another process's store
    # must not be counted in between (it waits for the walk and counts after).
    settings, _keys = _stored(tmp_path, 3)
    real_walk = LocalStore.check_each
    racers = []

    def walk_then_store(self, *args, **kwargs):
        yield from real_walk(self, *args, **kwargs)
        spec = base_spec(tmp_path)
        spec.update(requests=[100], result=str(tmp_path / "racer.json"))
        racer = MP.Process(target=compile_child, args=(spec,))
        racer.start()
        racers.append(racer)
        time.sleep(0.5)  # long enough for its store to reach the counters, were it allowed

    monkeypatch.setattr(LocalStore, "check_each", walk_then_store)
    with opcache.OpCache(settings) as cache:
        cache.verify()
    monkeypatch.undo()
    for racer in racers:
        racer.join(30)
        assert racer.exitcode == 0
    assert racers
    walked = entry_dirs(settings.root)
    assert len(walked) == 3 + len(racers)
    assert LocalStore(settings.root).used(SOC) == (
        len(walked),
        sum(tree_bytes(p) for p in walked.values()),
    )


def _kill_when(child, marker: Path) -> None:
    child.start()
    try:
        wait_for(marker)
    finally:
        child.kill()
        child.join(10)
    assert child.exitcode == -signal.SIGKILL


def test_chip_folder_cleared_while_the_first_store_creates_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The race behind rare warnings of test_force_while_others_hit_and_store.
    settings = settings_for(tmp_path)
    compiler = ToyCompiler(tmp_path / "calls")
    real_mkdir = os.mkdir
    cleared = []

    def mkdir_then_clear(path, mode=0o777, *, dir_fd=None):
        real_mkdir(path, mode, dir_fd=dir_fd)
        at_root = dir_fd is not None and os.path.samestat(os.fstat(dir_fd), os.stat(settings.root))
        if os.fspath(path) == SOC and at_root and not cleared:
            # Another process's force/clear renames the new chip folder away.
            cleared.append(True)
            os.rename(settings.root / SOC, tmp_path / "cleared-chip")

    caplog.set_level(logging.WARNING)
    with opcache.OpCache(settings) as cache:
        monkeypatch.setattr(os, "mkdir", mkdir_then_clear)
        result = cache.compile(make_request(), compiler, tmp_path / "a")
        monkeypatch.undo()
        again = cache.compile(make_request(), compiler, tmp_path / "b")
        stats = cache.stats()
    assert cleared
    assert result.status == "miss"
    assert read_dir(tmp_path / "a") == expected_files(make_request())
    assert warnings_of(caplog) == []
    assert stats["errors"] == 0
    assert again.status == "hit"


# ------------------------------------------------------------ NFS-style races


def _stale_once(monkeypatch: pytest.MonkeyPatch, name: str, err: int, when) -> list[str]:
    """Make ``os.<name>`` fail once with ``err`` for the first path ``when`` accepts."""
    real = getattr(os, name)
    hit: list[str] = []

    def flaky(path, *args, **kwargs):
        full = os.fspath(path)
        if kwargs.get("dir_fd") is not None:  # (what is deleted through a folder's handle)
            full = os.path.join(os.readlink(f"/proc/self/fd/{kwargs['dir_fd']}"), full)
        if not hit and when(full):
            hit.append(full)
            raise OSError(err, os.strerror(err), full)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, flaky)
    return hit


def _tree(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    for name in ("a.o", "b.o", "sub/c.o"):
        (path / name).write_bytes(b"x" * 10)
    return path


ERRNOS = [pytest.param(errno.ESTALE, id="ESTALE"), pytest.param(errno.ENOENT, id="ENOENT")]


@pytest.mark.parametrize("name", ["unlink", "rmdir"])
@pytest.mark.parametrize("err", ERRNOS)
def test_remove_tree_tolerates_stale_handles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, err: int
) -> None:
    tree = _tree(tmp_path / "tree")
    hit = _stale_once(monkeypatch, name, err, lambda p: p.startswith(str(tree)))
    fsutil.remove_tree(tree)  # no exception
    assert hit
    monkeypatch.undo()
    fsutil.remove_tree(tree)  # a later pass finishes what was left
    assert not tree.exists()


def test_remove_tree_when_another_cleaner_got_there_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = _tree(tmp_path / "tree")
    real_unlink, real_rmdir = os.unlink, os.rmdir

    def raced(real):
        def remove(path, *args, **kwargs):
            real(path, *args, **kwargs)  # the other cleaner's removal
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(path))

        return remove

    monkeypatch.setattr(os, "unlink", raced(real_unlink))
    monkeypatch.setattr(os, "rmdir", raced(real_rmdir))
    fsutil.remove_tree(tree)
    assert not tree.exists()


def _stored(tmp_path: Path, count: int = 3) -> tuple[opcache.Settings, list[str]]:
    settings = settings_for(tmp_path)
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(settings) as cache:
        keys = [cache.compile(make_request(i), compiler, tmp_path / "o").key for i in range(count)]
    return settings, keys


@pytest.mark.parametrize("err", ERRNOS)
@pytest.mark.parametrize("name", ["unlink", "rmdir"])
def test_stale_handles_while_cleaning_the_trash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, err: int
) -> None:
    settings, keys = _stored(tmp_path)
    trash = settings.root / ".opcache" / "trash"
    _tree(trash / "old-entry")
    hit = _stale_once(monkeypatch, name, err, lambda p: p.startswith(str(trash)))
    with opcache.OpCache(settings) as cache:
        cache.age()
        cache.verify()
        hit_after = cache.compile(make_request(0), ToyCompiler(tmp_path / "calls"), tmp_path / "h")
    assert hit_after.status == "hit"
    assert hit
    monkeypatch.undo()
    consistent(settings)
    assert set(entry_dirs(settings.root)) == set(keys)


@pytest.mark.parametrize("err", ERRNOS)
def test_stale_handle_while_aging_an_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    root = tmp_path / "ops" / "kernel_cache"
    root.mkdir(parents=True)
    (root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=1\nremain_cache_size_ratio=50\n"
    )
    settings = settings_for(tmp_path)
    clock = FakeClock()
    keys = _fill(settings, clock, tmp_path, 6)
    trash = str(root / ".opcache" / "trash")
    hit = _stale_once(monkeypatch, "unlink", err, lambda p: p.startswith(trash))
    # No Python to start a deleter with: the trimmed entries are deleted here.
    monkeypatch.setattr(sys, "executable", "")
    clock.advance(7200)
    with opcache.OpCache(settings, clock=clock) as cache:
        report = cache.age().as_dict()
    assert hit
    assert report["removed_entries"] == 4
    assert set(entry_dirs(root)) == set(keys[4:])
    monkeypatch.undo()
    consistent(settings, clock=clock)


def test_stale_handle_while_reading_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings, keys = _stored(tmp_path, 1)
    entry = entry_dirs(settings.root)[keys[0]]
    real_open = os.open
    stale = []

    def open_stale(path, flags, *args, **kwargs):
        # The manifest, opened relative to its entry folder, on a handle gone stale.
        reading = not flags & os.O_CREAT  # (a store writes one through its folder too)
        if os.fspath(path) == "MANIFEST" and kwargs.get("dir_fd") is not None and reading:
            stale.append(path)
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), "MANIFEST")
        return real_open(path, flags, *args, **kwargs)

    caplog.set_level(logging.WARNING)
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(settings) as cache:
        monkeypatch.setattr(os, "open", open_stale)
        result = cache.compile(make_request(0), compiler, tmp_path / "a")
        monkeypatch.undo()
        again = cache.compile(make_request(0), compiler, tmp_path / "b")
        stats = cache.stats()
    assert stale
    assert result.status == "miss"
    assert read_dir(tmp_path / "a") == expected_files(make_request(0))
    assert warnings_of(caplog) == []
    assert (stats["corrupt"], stats["errors"]) == (0, 0)
    assert entry.is_dir()  # not removed as corrupt: the next compile hits it
    assert again.status == "hit"


def test_nfs_placeholders_are_left_alone(tmp_path: Path) -> None:
    settings, keys = _stored(tmp_path)
    book = settings.root / ".opcache"
    placeholders = [book / "trash" / ".nfs000123", book / "tmp" / ".nfs000456"]
    for path in placeholders:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"still open somewhere")
    _tree(book / "trash" / "gone-entry")
    with opcache.OpCache(settings) as cache:
        aged = cache.age().as_dict()
        verified = cache.verify().as_dict()
    assert aged["leftovers_removed"] == 1
    assert verified["leftovers_removed"] == 0
    assert verified["corrupt"] == 0
    for path in placeholders:
        assert path.read_bytes() == b"still open somewhere"
    assert sorted(os.listdir(book / "trash")) == [".nfs000123"]
    assert set(entry_dirs(settings.root)) == set(keys)


def test_a_busy_nfs_placeholder_inside_the_trash_is_retried_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file deleted while open on another client becomes .nfsXXXX and cannot be
    # removed until that client closes it (EBUSY): its folder waits for a later pass.
    settings, keys = _stored(tmp_path)
    folder = _tree(settings.root / ".opcache" / "trash" / "entry-in-use")
    (folder / ".nfs0000000000abcd00000001").write_bytes(b"open elsewhere")
    real_unlink = os.unlink

    def busy(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)).startswith(".nfs"):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), os.fspath(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", busy)
    with opcache.OpCache(settings) as cache:
        cache.age()
        cache.verify()
    assert sorted(os.listdir(folder)) == [".nfs0000000000abcd00000001"]
    monkeypatch.undo()  # the other client closed the file
    consistent(settings)
    assert set(entry_dirs(settings.root)) == set(keys)
