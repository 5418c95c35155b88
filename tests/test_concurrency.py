"""Many processes on one cache folder: single flight, SIGKILL, force (issue 3, "Store").

Every test here uses real processes (multiprocessing with fork, or a Python
subprocess) and real files; the toy compiler counts its calls in a file that
all processes append to.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers_cache import (
    MP,
    SOC,
    ToyCompiler,
    base_spec,
    busy_child,
    compile_child,
    compiling_half_way,
    entry_dirs,
    expected_files,
    make_request,
    make_settings,
    read_dir,
    read_json,
    store_forever_child,
    trash_emptied,
    tree_bytes,
    wait_for,
)

import opcache
from opcache.storage.local import LocalStore


def run_children(target, specs: list[dict], go: Path | None = None, timeout: float = 60) -> list:
    procs = [MP.Process(target=target, args=(spec,)) for spec in specs]
    for proc in procs:
        proc.start()
    if go is not None:
        time.sleep(0.05)
        go.touch()
    for proc in procs:
        proc.join(timeout)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
            pytest.fail("a child process did not finish")
    reports = [read_json(spec["result"]) for spec in specs]
    for report in reports:
        assert report["error"] is None, report["error"]
    return reports


def settings_for(tmp_path: Path, mode: str = "enable") -> opcache.Settings:
    return make_settings(tmp_path / "ops", tmp_path, mode)


def tmp_leftovers(tmp_path: Path) -> list[str]:
    folder = settings_for(tmp_path).root / ".opcache" / "tmp"
    return os.listdir(folder) if folder.exists() else []


# ---------------------------------------------------------------- single flight


def test_n_processes_asking_for_one_key_compile_it_once(tmp_path: Path) -> None:
    go = tmp_path / "go"
    specs = []
    for n in range(6):
        spec = base_spec(tmp_path, sleep=1.0)
        spec.update(requests=[0], go=str(go), result=str(tmp_path / f"r{n}.json"))
        specs.append(spec)
    started = time.monotonic()
    reports = run_children(compile_child, specs, go)
    elapsed = time.monotonic() - started
    results = [report["results"][0] for report in reports]
    assert ToyCompiler(tmp_path / "calls").calls() == 1
    assert sorted(r["status"] for r in results) == ["hit"] * 5 + ["miss"]
    assert all(r["ok"] for r in results)
    assert len({r["key"] for r in results}) == 1
    assert elapsed < 5.0  # one compile of 1 s, not six in a row
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        stats = cache.stats()
    assert (stats["misses"], stats["hits"], stats["stores"], stats["entries"]) == (1, 5, 1, 1)
    assert len(entry_dirs(settings_for(tmp_path).root)) == 1


def test_threads_asking_for_one_key_compile_it_once(tmp_path: Path) -> None:
    compiler = ToyCompiler(tmp_path / "calls", sleep=0.5)
    results: list[opcache.CompileResult] = []
    barrier = threading.Barrier(4)
    with opcache.OpCache(settings_for(tmp_path)) as cache:

        def work(n: int) -> None:
            barrier.wait()
            results.append(cache.compile(make_request(0), compiler, tmp_path / f"t{n}"))

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert compiler.calls() == 1
    assert sorted(r.status for r in results) == ["hit", "hit", "hit", "miss"]
    for n in range(4):
        assert read_dir(tmp_path / f"t{n}") == expected_files(make_request(0))


def test_different_keys_compile_in_parallel(tmp_path: Path) -> None:
    # No lock on the whole cache while compiling: four 1 s compiles overlap.
    go = tmp_path / "go"
    specs = []
    for n in range(4):
        spec = base_spec(tmp_path, sleep=1.0)
        spec.update(requests=[n], go=str(go), result=str(tmp_path / f"r{n}.json"))
        specs.append(spec)
    reports = run_children(compile_child, specs, go)
    seconds = [report["results"][0]["seconds"] for report in reports]
    assert [report["results"][0]["status"] for report in reports] == ["miss"] * 4
    assert max(seconds) < 2.5, seconds
    assert ToyCompiler(tmp_path / "calls").calls() == 4


def test_a_short_lock_timeout_makes_the_waiter_compile_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = base_spec(tmp_path, sleep=3.0)
    spec.update(requests=[0], result=str(tmp_path / "holder.json"))
    holder = MP.Process(target=compile_child, args=(spec,))
    holder.start()
    calls = tmp_path / "calls"
    deadline = time.monotonic() + 20
    while not (calls.exists() and calls.read_text()):
        assert time.monotonic() < deadline, "the holder never started compiling"
        time.sleep(0.01)
    caplog.set_level(logging.WARNING)
    compiler = ToyCompiler(calls)
    started = time.monotonic()
    with opcache.OpCache(settings_for(tmp_path), lock_timeout=0.3) as cache:
        result = cache.compile(make_request(0), compiler, tmp_path / "mine")
    elapsed = time.monotonic() - started
    assert result.status == "miss"
    assert 0.3 <= elapsed < 2.5
    assert read_dir(tmp_path / "mine") == expected_files(make_request(0))
    assert compiler.calls() == 2
    assert any("waited" in r.getMessage() for r in caplog.records)
    holder.join(30)
    report = read_json(spec["result"])
    assert report["error"] is None, report["error"]
    assert report["results"][0]["status"] == "miss"
    assert report["results"][0]["ok"]
    # One good entry, whoever published first.
    store = LocalStore(settings_for(tmp_path).root)
    entry = store.get(SOC, result.key)
    assert entry is not None
    assert entry.files == expected_files(make_request(0))


# ------------------------------------------------------------------ SIGKILL


def test_killed_lock_holder_does_not_block_the_waiters(tmp_path: Path) -> None:
    with compiling_half_way(tmp_path) as holder:
        root = settings_for(tmp_path).root
        # Mid-compile: half the artifacts are written, nothing is visible, and
        # the compiler works in its out_dir, not in the cache.
        assert entry_dirs(root) == {}
        assert tmp_leftovers(tmp_path) == []
        key = opcache.explain_key(make_request(0), ToyCompiler(tmp_path / "calls"))["key"]
        assert LocalStore(root).get(SOC, key) is None
        killer = threading.Timer(0.5, holder.kill)
        killer.start()
        compiler = ToyCompiler(tmp_path / "calls")
        started = time.monotonic()
        with opcache.OpCache(settings_for(tmp_path)) as cache:  # lock_timeout: 10 minutes
            result = cache.compile(make_request(0), compiler, tmp_path / "waiter")
            waited = time.monotonic() - started
            killer.join()
            holder.join(10)
            assert holder.exitcode == -signal.SIGKILL
            assert result.status == "miss"
            assert 0.4 < waited < 10
            assert read_dir(tmp_path / "waiter") == expected_files(make_request(0))
            assert compiler.calls() == 2
            assert tmp_leftovers(tmp_path) == []
            assert cache.compile(make_request(0), compiler, tmp_path / "w2").status == "hit"


def test_sigkill_at_random_instants_never_leaves_a_partial_entry(tmp_path: Path) -> None:
    rng = random.Random(1234)
    size = 256 * 1024
    log = tmp_path / "attempted"
    root = settings_for(tmp_path).root
    store = LocalStore(root)
    compiler = ToyCompiler(tmp_path / "calls", size=size)
    key_to_index: dict[str, int] = {}
    leftovers_seen = 0
    for iteration in range(20):
        started = tmp_path / f"started{iteration}"
        spec = base_spec(tmp_path, size=size)
        spec.update(first=iteration * 1000, log=str(log), started=str(started))
        child = MP.Process(target=store_forever_child, args=(spec,))
        child.start()
        wait_for(started)
        time.sleep(rng.uniform(0.0, 0.12))
        child.kill()
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        # A kill mid-compile leaves the build folder beside out_dir; one mid-store,
        # a folder in the cache's tmp (the next writer's first touch cleans it).
        leftovers_seen += len(tmp_leftovers(tmp_path))
        leftovers_seen += len(list(Path(spec["out"]).glob("*/.opcache-*")))
        for index in map(int, log.read_text().split()):
            key_to_index.setdefault(
                opcache.explain_key(make_request(index), compiler)["key"], index
            )
        # Whatever is visible is complete and right.
        for key in entry_dirs(root):
            entry = store.get(SOC, key)  # raises CorruptEntry on a partial entry
            assert entry is not None
            assert entry.files == expected_files(make_request(key_to_index[key]), size)
    assert len(key_to_index) > 20
    # Some kills landed while an entry was being built: their folders were left over.
    assert leftovers_seen >= 3
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        # Readers get a hit with the right bytes, or a miss.
        for key, index in sorted(key_to_index.items(), key=lambda item: item[1])[:30]:
            out = tmp_path / "check" / str(index)
            result = cache.compile(make_request(index), compiler, out)
            assert result.status in ("hit", "miss")
            assert result.key == key
            assert read_dir(out) == expected_files(make_request(index), size)
        report = cache.verify()
        stats = cache.stats()
    assert report.corrupt == 0
    assert stats["corrupt"] == 0
    assert tmp_leftovers(tmp_path) == []
    assert (stats["entries"], stats["bytes"]) == (
        len(entry_dirs(root)),
        sum(tree_bytes(p) for p in entry_dirs(root).values()),
    )


# -------------------------------------------------------------------- force


def test_force_while_others_hit_and_store(tmp_path: Path) -> None:
    go = tmp_path / "go"
    specs = []
    for n, mode in enumerate(["enable", "enable", "force"]):
        spec = base_spec(tmp_path, size=8192)
        spec.update(
            mode=mode,
            requests=list(range(6)) if mode == "enable" else [0, 6],
            seconds=2.0,
            go=str(go),
            result=str(tmp_path / f"r{n}.json"),
        )
        specs.append(spec)
    reports = run_children(busy_child, specs, go)
    for report in reports:
        assert report["warnings"] == []
        assert report["bad"] == 0
        assert report["rounds"] > 1
    forced = reports[2]
    assert forced["statuses"].get("miss", 0) >= forced["rounds"]  # each round cleared
    assert sum(r["statuses"].get("hit", 0) for r in reports[:2]) > 0
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        stats = cache.stats()
        report = cache.verify()
    assert stats["errors"] == 0
    assert stats["corrupt"] == 0
    assert report.corrupt == 0
    assert trash_emptied(settings_for(tmp_path).root) == []


def test_an_entry_cleared_while_it_is_read_is_a_miss_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Another process's force/clear renames the chip folder aside and deletes it
    # file by file; a reader caught half-way must see a miss, not a corrupt entry.
    from opcache.storage import local as store_module

    compiler = ToyCompiler(tmp_path / "calls")
    settings = settings_for(tmp_path)
    with opcache.OpCache(settings) as cache:
        key = cache.compile(make_request(0), compiler, tmp_path / "a").key
    real_read_file = store_module.LocalStore._read_file
    done = []

    def read_then_clear(self, dir_fd: int, name: str, limit: int):
        data = real_read_file(self, dir_fd, name, limit)
        if name == store_module.MANIFEST and not done:
            done.append(name)
            aside = tmp_path / "aside"
            os.rename(settings.chip_dir(SOC), aside)  # what clear_chip does first
            for path in (aside / key[:2] / key).iterdir():
                if path.name != store_module.MANIFEST:
                    path.unlink()  # remove_tree half-way through the entry
        return data

    monkeypatch.setattr(store_module.LocalStore, "_read_file", read_then_clear)
    caplog.set_level(logging.WARNING)
    with opcache.OpCache(settings) as cache:
        result = cache.compile(make_request(0), compiler, tmp_path / "b")
        stats = cache.stats()
    assert done
    assert result.status == "miss"
    assert read_dir(tmp_path / "b") == expected_files(make_request(0))
    assert stats["corrupt"] == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
