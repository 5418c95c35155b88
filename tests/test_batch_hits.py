"""``compile_many``'s local hits: a batch opens and trusts each folder once, keys
other processes hold are watched through one listing of their lock files, and
nothing another process wrote is served without its checks.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers_cache import (
    MP,
    SOC,
    FakeClock,
    ToyCompiler,
    entry_dirs,
    expected_files,
    make_request,
    make_settings,
    read_dir,
)

import opcache
from opcache import shared_work
from opcache.key import compute_key
from opcache.locks import KeyLock


def settings_for(tmp_path: Path) -> opcache.Settings:
    return make_settings(tmp_path / "ops", tmp_path)


def _fill(tmp: str, count: int) -> None:
    """Another process stores ``count`` operators."""
    tmp_path = Path(tmp)
    requests = [make_request(i) for i in range(count)]
    with opcache.OpCache(settings_for(tmp_path), clock=FakeClock()) as cache:
        cache.compile_many(requests, ToyCompiler(tmp_path / "calls"), [tmp_path / "first"] * count)


def filled_by_another_process(tmp_path: Path, count: int) -> Path:
    """The cache root, with ``count`` operators another process stored."""
    child = MP.Process(target=_fill, args=(str(tmp_path), count))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    return settings_for(tmp_path).root


def test_a_batch_of_hits_opens_its_chip_folder_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = filled_by_another_process(tmp_path, 20)
    requests = [make_request(i) for i in range(20)]
    outs = [tmp_path / "out" / r.op_name for r in requests]
    chip = f"{root}/{SOC}"
    with opcache.OpCache(settings_for(tmp_path), clock=FakeClock()) as cache:
        compiler = ToyCompiler(tmp_path / "calls")
        cache.compile(make_request(99), compiler, tmp_path / "warm")  # the chip's first touch
        opened: Counter[str] = Counter()
        real_open = os.open

        def counting_open(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            opened[os.fspath(path)] += 1
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", counting_open)
        results = cache.compile_many(requests, compiler, outs)
        monkeypatch.undo()
    assert [r.status for r in results] == ["hit"] * 20
    for request, out in zip(requests, outs, strict=True):
        assert read_dir(out) == expected_files(request)
    # One open of the chip folder for the batch, not one per hit.
    assert opened[chip] == 1


def test_a_corrupt_entry_another_process_wrote_is_refused_in_a_batch(tmp_path: Path) -> None:
    root = filled_by_another_process(tmp_path, 6)
    requests = [make_request(i) for i in range(6)]
    bad = compute_key(requests[2], "toycc", "toycc 1.0")[0]
    artifact = next(p for p in entry_dirs(root)[bad].iterdir() if p.suffix == ".o")
    data = artifact.read_bytes()
    artifact.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, other bytes
    outs = [tmp_path / "out" / r.op_name for r in requests]
    compiler = ToyCompiler(tmp_path / "calls")
    before = compiler.calls()
    with opcache.OpCache(settings_for(tmp_path), clock=FakeClock()) as cache:
        results = cache.compile_many(requests, compiler, outs)
        stats = cache.stats(SOC)["chips"][SOC]
    assert [r.status for r in results] == ["hit", "hit", "miss", "hit", "hit", "hit"]
    assert compiler.calls() == before + 1
    for request, out in zip(requests, outs, strict=True):
        assert read_dir(out) == expected_files(request)
    assert stats["corrupt"] == 1


def test_a_bucket_swapped_for_a_link_is_not_followed_in_a_batch(tmp_path: Path) -> None:
    root = filled_by_another_process(tmp_path, 6)
    requests = [make_request(i) for i in range(6)]
    key = compute_key(requests[4], "toycc", "toycc 1.0")[0]
    bucket = root / SOC / key[:2]
    elsewhere = tmp_path / "elsewhere"
    bucket.rename(elsewhere)
    bucket.symlink_to(elsewhere)
    outs = [tmp_path / "out" / r.op_name for r in requests]
    with opcache.OpCache(settings_for(tmp_path), clock=FakeClock()) as cache:
        results = cache.compile_many(requests, ToyCompiler(tmp_path / "calls"), outs)
    # Its keys are compiled (the cache's error reported), never read through the link.
    in_bucket = [compute_key(r, "toycc", "toycc 1.0")[0][:2] == key[:2] for r in requests]
    for result, linked in zip(results, in_bucket, strict=True):
        assert result.status == ("miss" if linked else "hit")
    for request, out in zip(requests, outs, strict=True):
        assert read_dir(out) == expected_files(request)
    assert bucket.is_symlink()


def test_keys_another_process_holds_are_watched_without_a_look_at_each_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_work, "_TRY_EVERY", 600.0)  # no real try while they wait
    settings = settings_for(tmp_path)
    requests = [make_request(i) for i in range(10)]
    compiler = ToyCompiler(tmp_path / "calls")
    outs = [tmp_path / "out" / r.op_name for r in requests]
    keys = {compute_key(r, "toycc", "toycc 1.0")[0] for r in requests}
    with opcache.OpCache(settings, clock=FakeClock()) as cache:
        cache.compile(make_request(99), compiler, tmp_path / "warm")  # the chip's first touch
        # Held here on other handles, as another process of this machine would hold them.
        held = [KeyLock(cache._store.lock_path(SOC, key)) for key in keys]
        for lock in held:
            assert lock.try_acquire()
        looked: Counter[str] = Counter()
        real_stat, real_lexists = os.stat, os.path.lexists

        def counting_stat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            looked[os.path.basename(os.fspath(path))] += 1
            return real_stat(path, *args, **kwargs)

        def counting_lexists(path):  # type: ignore[no-untyped-def]
            looked[os.path.basename(os.fspath(path))] += 1
            return real_lexists(path)

        monkeypatch.setattr(os, "stat", counting_stat)
        monkeypatch.setattr(os.path, "lexists", counting_lexists)
        results: list[opcache.CompileResult] = []
        batch = threading.Thread(
            target=lambda: results.extend(cache.compile_many(requests, compiler, outs, jobs=2))
        )
        batch.start()
        time.sleep(0.6)  # the batch waits for the held keys meanwhile
        for lock in held:
            lock.release()
        batch.join(60)
        monkeypatch.undo()
    assert not batch.is_alive()
    assert [r.status for r in results] == ["miss"] * 10
    for request, out in zip(requests, outs, strict=True):
        assert read_dir(out) == expected_files(request)
    # Each key's lock file is looked at by its tries only (two a try), not at each check.
    assert max(looked[key] for key in keys) <= 4


class _GatedCompiler(ToyCompiler):
    """A ToyCompiler whose compiles wait (at most 30 s) until ``gate`` is set."""

    def __init__(self, calls_file: Path, *, gate: threading.Event) -> None:
        super().__init__(calls_file)
        self.gate = gate

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        self.gate.wait(30)
        super().compile(request, workdir)


def test_keys_another_process_compiles_come_as_hits_without_a_lock_file_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_work, "_TRY_EVERY", 600.0)  # no real try while they wait
    settings = settings_for(tmp_path)
    requests = [make_request(i) for i in range(10)]
    keys = {compute_key(r, "toycc", "toycc 1.0")[0] for r in requests}
    locks_dir = settings.root / ".opcache" / "locks" / SOC
    holder_cache = opcache.OpCache(settings, clock=FakeClock())
    # The holder's compiles end only once the batch has set every key aside as
    # held: with a fixed sleep, a loaded machine's batch could reach a claim
    # after a compile had ended and taken its lock file away (then a lock file
    # is rightly opened, and the test failed).
    all_set_aside = threading.Event()
    holder_compiler = _GatedCompiler(tmp_path / "calls", gate=all_set_aside)
    set_aside: set[str] = set()
    real_later = shared_work._Schedule.later

    def later(schedule: shared_work._Schedule, job: shared_work._Job) -> None:
        set_aside.add(job.key)
        if set_aside >= keys:
            all_set_aside.set()
        real_later(schedule, job)

    monkeypatch.setattr(shared_work._Schedule, "later", later)
    # Another OpCache holds every key's lock while it compiles them (as another
    # process of this machine would); the batch starts once all are held.
    holder = threading.Thread(
        target=holder_cache.compile_many,
        args=(requests, holder_compiler, [tmp_path / "holder"] * 10),
        kwargs={"jobs": 10},
    )
    holder.start()
    deadline = time.monotonic() + 30
    while not (locks_dir.is_dir() and keys <= set(os.listdir(locks_dir))):
        assert time.monotonic() < deadline, "the holder never took its locks"
        time.sleep(0.01)
    opened: Counter[str] = Counter()
    real_open = os.open

    def counting_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & os.O_CREAT:  # (a lock file, not the entry folder of the same name)
            opened[os.path.basename(os.fspath(path))] += 1
        return real_open(path, flags, *args, **kwargs)

    outs = [tmp_path / "out" / r.op_name for r in requests]
    with opcache.OpCache(settings, clock=FakeClock()) as cache:
        monkeypatch.setattr(os, "open", counting_open)
        results = cache.compile_many(requests, ToyCompiler(tmp_path / "calls"), outs, jobs=2)
        monkeypatch.undo()
    all_set_aside.set()  # (if the assertion below is to fail, not the join to wait)
    holder.join(60)
    holder_cache.close()
    assert [r.status for r in results] == ["hit"] * 10
    for request, out in zip(requests, outs, strict=True):
        assert read_dir(out) == expected_files(request)
    assert holder_compiler.calls() == 10  # each compiled once, by the holder
    assert not any(opened[key] for key in keys)  # no lock file made, tried or deleted


def test_a_hit_reads_each_file_of_its_entry_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = filled_by_another_process(tmp_path, 1)
    files = len(list(next(iter(entry_dirs(root).values())).iterdir()))  # MANIFEST too
    reads = 0
    real_read = os.read

    def counting_read(fd: int, size: int) -> bytes:
        nonlocal reads
        reads += 1
        return real_read(fd, size)

    with opcache.OpCache(settings_for(tmp_path), clock=FakeClock()) as cache:
        compiler = ToyCompiler(tmp_path / "calls")
        cache.compile(make_request(99), compiler, tmp_path / "warm")  # the chip's first touch
        monkeypatch.setattr(os, "read", counting_read)
        result = cache.compile(make_request(0), compiler, tmp_path / "out")
        monkeypatch.undo()
    assert result.status == "hit"
    assert read_dir(tmp_path / "out") == expected_files(make_request(0))
    assert reads == files  # one read each, none more to find its end


def test_an_artifact_longer_than_its_manifest_says_is_refused(tmp_path: Path) -> None:
    root = filled_by_another_process(tmp_path, 1)
    artifact = next(p for p in next(iter(entry_dirs(root).values())).iterdir() if p.suffix == ".o")
    with open(artifact, "ab") as f:
        f.write(b"more")
    with opcache.OpCache(settings_for(tmp_path), clock=FakeClock()) as cache:
        result = cache.compile(make_request(0), ToyCompiler(tmp_path / "calls"), tmp_path / "out")
        stats = cache.stats(SOC)["chips"][SOC]
    assert result.status == "miss"
    assert read_dir(tmp_path / "out") == expected_files(make_request(0))
    assert stats["corrupt"] == 1
