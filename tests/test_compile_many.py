"""``OpCache.compile_many``: processes that need the same operators share the work.

Real processes (fork) run compile_many over one list of operators with a
compiler that sleeps; the toy compiler logs every call with its pid, so the
tests count compiles per process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers_cache import (
    MP,
    ToyCompiler,
    entry_dirs,
    expected_files,
    make_request,
    make_settings,
    read_dir,
    read_json,
    wait_for,
    write_json,
)

import opcache
from opcache.key import canonical_json, compute_key
from opcache.storage.entry import MANIFEST


def settings_for(tmp_path: Path, mode: str = "enable", **options: object) -> opcache.Settings:
    return make_settings(tmp_path / "ops", tmp_path, mode, **options)


def compiles_by_pid(calls_file: Path) -> Counter:
    if not calls_file.exists():
        return Counter()
    return Counter(line.split()[0] for line in calls_file.read_text().splitlines())


class HangOn(ToyCompiler):
    """The toy compiler, except that it hangs on one operator (marking when it got there)."""

    def __init__(self, calls_file: Path, hang_on: str, marker: Path, **kw: object) -> None:
        super().__init__(calls_file, **kw)
        self.hang_on = hang_on
        self.marker = marker

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        if request.op_name == self.hang_on:
            self.marker.touch()
            time.sleep(3600)
        super().compile(request, workdir)


class FailOn(ToyCompiler):
    """The toy compiler, except that one operator fails to compile."""

    def __init__(self, calls_file: Path, fail_on: str, **kw: object) -> None:
        super().__init__(calls_file, **kw)
        self.fail_on = fail_on

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        if request.op_name == self.fail_on:
            raise opcache.CompileError(f"cannot compile {request.op_name}")
        super().compile(request, workdir)


def _rank(spec: dict) -> None:
    """One rank: compile_many over every operator, then report what it got."""
    report: dict = {"pid": os.getpid(), "error": None}
    try:
        wait_for(spec["go"])
        tmp = Path(spec["tmp"])
        compiler = ToyCompiler(tmp / "calls", sleep=spec["sleep"])
        requests = [make_request(i) for i in range(spec["ops"])]
        outs = [tmp / "out" / f"{os.getpid()}" / r.op_name for r in requests]
        with opcache.OpCache(settings_for(tmp)) as cache:
            results = cache.compile_many(requests, compiler, outs, jobs=spec["jobs"])
        report["statuses"] = [r.status for r in results]
        report["ok"] = [
            read_dir(out) == expected_files(request)
            for request, out in zip(requests, outs, strict=True)
        ]
    except BaseException as e:
        report["error"] = repr(e)
    write_json(spec["result"], report)


def test_ranks_share_the_work_and_each_gets_everything(tmp_path: Path) -> None:
    ranks, ops = 4, 24
    go = tmp_path / "go"
    specs = [
        {
            "tmp": str(tmp_path),
            "go": str(go),
            "ops": ops,
            "sleep": 0.2,
            "jobs": 2,
            "result": str(tmp_path / f"rank{n}.json"),
        }
        for n in range(ranks)
    ]
    procs = [MP.Process(target=_rank, args=(spec,)) for spec in specs]
    for proc in procs:
        proc.start()
    time.sleep(0.2)
    go.touch()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    reports = [read_json(spec["result"]) for spec in specs]
    for report in reports:
        assert report["error"] is None, report["error"]
        assert all(report["ok"]), report
        assert set(report["statuses"]) <= {"hit", "miss"}
    by_pid = compiles_by_pid(tmp_path / "calls")
    # Every operator compiled exactly once, in the whole group of ranks.
    assert sum(by_pid.values()) == ops
    assert len(entry_dirs(settings_for(tmp_path).root)) == ops
    # And the work was shared: every rank compiled some, none more than half.
    assert set(by_pid) == {str(r["pid"]) for r in reports}
    assert max(by_pid.values()) <= ops // 2
    assert [r["statuses"].count("miss") for r in reports] == [
        by_pid[str(r["pid"])] for r in reports
    ]


def _hang_child(tmp: str, marker: str) -> None:
    tmp_path = Path(tmp)
    compiler = HangOn(tmp_path / "calls", "add_3", Path(marker))
    requests = [make_request(i) for i in range(6)]
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile_many(requests, compiler, [tmp_path / "dead" / r.op_name for r in requests])


def test_a_holder_killed_mid_compile_loses_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "hanging"
    holder = MP.Process(target=_hang_child, args=(str(tmp_path), str(marker)))
    holder.start()
    wait_for(marker)
    requests = [make_request(i) for i in range(6)]
    compiler = ToyCompiler(tmp_path / "calls")
    outs = [tmp_path / "alive" / r.op_name for r in requests]
    killer = threading.Timer(0.5, os.kill, (holder.pid, signal.SIGKILL))
    killer.start()
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        results = cache.compile_many(requests, compiler, outs, jobs=2)
    killer.join()
    holder.join()
    assert holder.exitcode == -signal.SIGKILL
    for request, out, result in zip(requests, outs, results, strict=True):
        assert result.status in ("hit", "miss")
        assert read_dir(out) == expected_files(request)
    # The killed holder's key was compiled here, after it died.
    assert results[3].status == "miss"
    assert len(entry_dirs(settings_for(tmp_path).root)) == 6


def test_a_holder_that_hangs_is_waited_for_lock_timeout_then_compiled_here(
    tmp_path: Path,
) -> None:
    """Each retry of a held key (every second, from the watch) was taken as a fresh
    look, which set the wait's start anew: with a lock_timeout over a second (the
    default is 600 s) a rank waited for a hung holder forever."""
    marker = tmp_path / "hanging"
    holder = MP.Process(target=_hang_child, args=(str(tmp_path), str(marker)))
    holder.start()
    try:
        wait_for(marker)
        requests = [make_request(i) for i in range(6)]
        outs = [tmp_path / "alive" / r.op_name for r in requests]
        done: list = []

        def batch() -> None:
            with opcache.OpCache(settings_for(tmp_path), lock_timeout=2) as cache:
                done.append(cache.compile_many(requests, ToyCompiler(tmp_path / "c"), outs))

        waiter = threading.Thread(target=batch, daemon=True)
        waiter.start()
        waiter.join(120)
        assert done, "the batch still waits for the hung holder"
        assert done[0][3].status == "miss"  # (the hung key, compiled here after 2 s)
        for request, out, result in zip(requests, outs, done[0], strict=True):
            assert result.status in ("hit", "miss")
            assert read_dir(out) == expected_files(request)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()


def test_a_failing_operator_is_reported_alone(tmp_path: Path) -> None:
    requests = [make_request(i) for i in range(5)]
    compiler = FailOn(tmp_path / "calls", "add_2")
    outs = [tmp_path / "out" / r.op_name for r in requests]
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        results = cache.compile_many(requests, compiler, outs, jobs=2)
        stats = cache.stats()
    assert [r.status for r in results] == ["miss", "miss", "error", "miss", "miss"]
    assert isinstance(results[2].error, opcache.CompileError)
    assert "cannot compile add_2" in str(results[2].error)
    assert all(r.error is None for i, r in enumerate(results) if i != 2)
    for i in (0, 1, 3, 4):
        assert read_dir(outs[i]) == expected_files(requests[i])
    assert len(entry_dirs(settings_for(tmp_path).root)) == 4
    assert stats["stores"] == 4 and stats["misses"] == 4


def test_results_keep_the_order_of_requests_and_shared_keys_compile_once(
    tmp_path: Path,
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(1), compiler, tmp_path / "warm")
        # add_0 twice under two node names: one kernel, one compile.
        requests = [
            make_request(0),
            make_request(1),
            make_request(2),
            make_request(0, op_name="add_0_again"),
        ]
        results = cache.compile_many(requests, compiler, lambda r: tmp_path / "o" / r.op_name)
    assert [r.status for r in results] == ["miss", "hit", "miss", "hit"]
    assert results[0].key == results[3].key
    assert compiler.calls() == 3  # add_1 before, then add_0 and add_2 once each
    for request in requests:
        assert read_dir(tmp_path / "o" / request.op_name) == expected_files(request)


def test_the_entries_it_stores_hold_their_keys_inputs(tmp_path: Path) -> None:
    # (A batch keeps no key inputs from its first look: they are made again to
    # store a key it compiles.)
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(i) for i in range(3)]
    settings = settings_for(tmp_path)
    with opcache.OpCache(settings) as cache:
        results = cache.compile_many(requests, compiler, lambda r: tmp_path / "o" / r.op_name)
    entries = entry_dirs(settings.root)
    for request, result in zip(requests, results, strict=True):
        assert result.status == "miss"
        body = (entries[result.key] / MANIFEST).read_bytes().partition(b"\n")[2]
        parts = opcache.explain_key(request, compiler)["parts"]
        assert json.loads(body)["inputs"] == json.loads(canonical_json(parts))


def test_modes_and_bypasses_hold_per_operator(tmp_path: Path) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    cfg = tmp_path / "debug.cfg"
    cfg.write_text("op_debug_config = ccec_g\nop_debug_list = add_1\n")
    requests = [make_request(i) for i in range(3)]
    outs = [tmp_path / "o" / r.op_name for r in requests]
    with opcache.OpCache(settings_for(tmp_path, "disable")) as cache:
        assert [r.status for r in cache.compile_many(requests, compiler, outs)] == ["disabled"] * 3
    assert not (tmp_path / "ops").exists()
    with opcache.OpCache(settings_for(tmp_path, op_debug_config=str(cfg))) as cache:
        results = cache.compile_many(requests, compiler, outs)
        again = cache.compile_many(requests, compiler, outs)
        stats = cache.stats()
    assert [r.status for r in results] == ["miss", "bypass", "miss"]
    assert results[1].reason == "op_debug_list names the operator"
    assert [r.status for r in again] == ["hit", "bypass", "hit"]
    assert stats["bypasses"] == 2 and stats["hits"] == 2
    for request, out in zip(requests, outs, strict=True):
        assert read_dir(out) == expected_files(request)


def test_an_unusable_cache_never_fails_the_compiles(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "kernel_cache").write_text("a file where the cache root should be")
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(i) for i in range(4)]
    outs = [tmp_path / "o" / r.op_name for r in requests]
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(settings_for(tmp_path)) as cache,
    ):
        results = cache.compile_many(requests, compiler, outs, jobs=2)
    assert [r.status for r in results] == ["miss"] * 4
    for request, out in zip(requests, outs, strict=True):
        assert read_dir(out) == expected_files(request)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [w.getMessage() for w in warnings]


def test_threads_of_one_opcache_share_it(tmp_path: Path) -> None:
    compiler = ToyCompiler(tmp_path / "calls", sleep=0.05)
    requests = [make_request(i) for i in range(12)]
    results: dict[int, list[opcache.CompileResult]] = {}
    with opcache.OpCache(settings_for(tmp_path)) as cache:

        def run(n: int) -> None:
            outs = [tmp_path / f"t{n}" / r.op_name for r in requests]
            if n == 3:  # one thread compiles one at a time, as before
                pairs = zip(requests, outs, strict=True)
                results[n] = [cache.compile(r, compiler, o) for r, o in pairs]
            else:
                results[n] = cache.compile_many(requests, compiler, outs, jobs=2)

        threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert compiler.calls() == 12
    for n in range(4):
        assert {r.status for r in results[n]} <= {"hit", "miss"}
        for request in requests:
            assert read_dir(tmp_path / f"t{n}" / request.op_name) == expected_files(request)


def test_bad_arguments(tmp_path: Path) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        with pytest.raises(ValueError, match="jobs=0"):
            cache.compile_many([make_request(0)], compiler, [tmp_path], jobs=0)
        with pytest.raises(ValueError, match="1 requests but 2 output folders"):
            cache.compile_many([make_request(0)], compiler, [tmp_path, tmp_path])
        assert cache.compile_many([], compiler, []) == []
        bad = make_request(0, attrs={1: "not a string key"})
        results = cache.compile_many([bad, make_request(1)], compiler, lambda r: tmp_path / "o")
    assert results[0].status == "error" and isinstance(results[0].error, TypeError)
    assert results[1].status == "miss"


class InterruptedInMain(ToyCompiler):
    """The toy compiler; a compile in the main thread is interrupted (as by Ctrl-C)."""

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        super().compile(request, workdir)


def test_a_ctrl_c_stops_every_worker_and_reaches_the_caller(tmp_path: Path) -> None:
    compiler = InterruptedInMain(tmp_path / "calls", sleep=0.1)
    requests = [make_request(i) for i in range(12)]
    before = set(threading.enumerate())
    with opcache.OpCache(settings_for(tmp_path)) as cache, pytest.raises(KeyboardInterrupt):
        cache.compile_many(requests, compiler, lambda r: tmp_path / r.op_name, jobs=3)
    assert set(threading.enumerate()) <= before  # no worker left behind
    assert compiler.calls() < 12  # the rest were not started
    # Nothing half-done stays locked: the same operators compile at once afterwards.
    with opcache.OpCache(settings_for(tmp_path), lock_timeout=5) as cache:
        results = cache.compile_many(requests, ToyCompiler(tmp_path / "calls"), [tmp_path] * 12)
    assert {r.status for r in results} <= {"hit", "miss"}


class InterruptedTwice(ToyCompiler):
    """The toy compiler, interrupted twice: once a key is parked, the compile in the
    main thread is interrupted (a first Ctrl-C); the one in the worker sends SIGINT
    (a second) once compile_many joins its worker, then ends."""

    def __init__(
        self, calls_file: Path, parked: threading.Event, joining: threading.Event, second: bool
    ):
        super().__init__(calls_file)
        self.parked, self.joining, self.second = parked, joining, second

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        if threading.current_thread() is threading.main_thread():
            self.parked.wait(30)
            raise KeyboardInterrupt
        self.joining.wait(30)
        if self.second:
            os.kill(os.getpid(), signal.SIGINT)
        super().compile(request, workdir)


def _interrupted_twice(spec: dict) -> None:
    """A process that goes on after compile_many raised (a notebook): what it holds then."""
    from types import SimpleNamespace

    from opcache import shared_work
    from opcache.locks import KeyLock

    report: dict = {"error": None}
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        parked, joining = threading.Event(), threading.Event()
        real_park, real_join = shared_work._Batch._park, threading.Thread.join

        def park(batch: shared_work._Batch, job: shared_work._Job) -> str:
            state = real_park(batch, job)
            parked.set()
            return state

        def join(thread: threading.Thread, timeout: float | None = None) -> None:
            if thread.name.startswith("opcache-compile"):
                joining.set()
            real_join(thread, timeout)

        real_end = shared_work._Batch.end
        ends: list[int] = []

        def end(batch: shared_work._Batch) -> None:
            ends.append(1)
            if spec["where"] == "end" and len(ends) == 1:
                raise KeyboardInterrupt  # (Python's, for a SIGINT a worker took, lands here)
            real_end(batch)

        # (In this child alone.)  The requests in their order: the key parked comes first.
        shared_work._Batch._park = park  # type: ignore[method-assign]
        shared_work._Batch.end = end  # type: ignore[method-assign]
        threading.Thread.join = join  # type: ignore[method-assign]
        shared_work.random = SimpleNamespace(  # type: ignore[attr-defined]
            Random=lambda: SimpleNamespace(shuffle=lambda jobs: None)
        )
        tmp = Path(spec["tmp"])
        settings = make_settings(tmp / "cache", tmp, remote={"url": spec["url"]})
        requests = [make_request(i) for i in range(3)]
        results: list[int] = []
        cache = opcache.OpCache(settings)
        try:
            cache.compile_many(
                requests,
                InterruptedTwice(tmp / "calls", parked, joining, spec["where"] == "join"),
                [tmp / "out" / r.op_name for r in requests],
                jobs=2,
                on_result=lambda index, result: results.append(index),
            )
        except KeyboardInterrupt:
            report["raised"] = "KeyboardInterrupt"
        given = len(results)
        report["second SIGINT sent"] = joining.is_set()
        left = [t for t in threading.enumerate() if t.name.startswith("opcache-compile")]
        report["threads left"] = [t.name for t in left]
        for thread in left:
            real_join(thread, 30)
        report["results after it raised"] = len(results) - given
        lock = KeyLock(settings.root / ".opcache" / "locks" / requests[0].soc_version / spec["key"])
        report["parked key's lock free"] = lock.try_acquire()
        cache.close()
    except BaseException:
        import traceback

        report["error"] = traceback.format_exc()
    write_json(spec["result"], report)


@pytest.mark.parametrize("where", ["join", "end"])
def test_a_second_ctrl_c_while_compile_many_joins_leaves_no_lock_held(
    tmp_path: Path, redis_server, redis_url: str, where: str
) -> None:
    """A Ctrl-C stops the batch; a second, while compile_many waits for its workers'
    current compiles or lets go of what the batch holds, must not skip letting go
    of the local locks of the keys parked for another machine: the process goes
    on, and this machine's other processes wait on those locks.  (They stayed
    held.)"""
    request = make_request(0)
    compiler = ToyCompiler(tmp_path / "calls")
    key = compute_key(request, compiler.name, compiler.fingerprint())[0]
    client = redis_server.client()  # another machine compiles the first key, for a minute
    client.set(f"opcache:1:{request.soc_version}:{key}:claim", "another-machine", px=60_000)
    spec = {"tmp": str(tmp_path), "url": redis_url, "key": key, "result": str(tmp_path / "r")}
    spec["where"] = where
    child = MP.Process(target=_interrupted_twice, args=(spec,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("compile_many hung")
    report = read_json(tmp_path / "r")
    assert report["error"] is None, report["error"]
    assert report["raised"] == "KeyboardInterrupt"
    assert report["second SIGINT sent"]  # (the race's window was opened)
    assert report["threads left"] == []
    assert report["parked key's lock free"]
    assert report["results after it raised"] == 0


class WaitsFor(ToyCompiler):
    """The toy compiler; a compile first waits (30 s at most) for ``event``, and
    notes whether it came."""

    def __init__(self, calls_file: Path, event: threading.Event) -> None:
        super().__init__(calls_file)
        self.event = event
        self.started = threading.Event()
        self.came: bool | None = None

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        self.started.set()
        self.came = self.event.wait(30)
        super().compile(request, workdir)


def test_a_key_parked_for_another_machine_is_taken_while_every_thread_compiles(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Machine b parks a key machine a compiles, and its one thread compiles
    another: once a stores the key, b takes it (and lets go of its local lock,
    which b's other processes wait on) while that compile still runs.  (It
    waited for the compile: nobody looked at the remote meanwhile.)"""
    from types import SimpleNamespace

    from opcache import shared_work
    from opcache.locks import KeyLock

    parked, delivered = threading.Event(), threading.Event()
    real_park = shared_work._Batch._park

    def park(batch: shared_work._Batch, job: shared_work._Job) -> str:
        state = real_park(batch, job)
        parked.set()
        return state

    monkeypatch.setattr(shared_work._Batch, "_park", park)
    # The requests in their order: b takes the parked key first.
    keep_order = SimpleNamespace(Random=lambda: SimpleNamespace(shuffle=lambda jobs: None))
    monkeypatch.setattr(shared_work, "random", keep_order)
    requests = [make_request(0), make_request(1)]
    a_compiler = WaitsFor(tmp_path / "calls", parked)  # (stores once b parked it)
    b_compiler = WaitsFor(tmp_path / "calls", delivered)
    a_settings = make_settings(tmp_path / "a", tmp_path, remote={"url": redis_url})
    b_settings = make_settings(tmp_path / "b", tmp_path, remote={"url": redis_url})
    lock_free: list[bool] = []

    def b_result(index: int, result: opcache.CompileResult) -> None:
        if index == 0:
            path = b_settings.root / ".opcache" / "locks" / requests[0].soc_version / result.key
            lock = KeyLock(path)
            lock_free.append(lock.try_acquire())
            lock.release()
            delivered.set()

    with opcache.OpCache(a_settings) as a, opcache.OpCache(b_settings) as b:
        machine_a = threading.Thread(
            target=a.compile_many, args=(requests[:1], a_compiler, [tmp_path / "oa"])
        )
        machine_a.start()
        assert a_compiler.started.wait(30)  # a has claimed the key
        results = b.compile_many(
            requests, b_compiler, [tmp_path / "ob0", tmp_path / "ob1"], jobs=1, on_result=b_result
        )
        machine_a.join()
    assert b_compiler.came  # while b compiled the other key, not after
    assert lock_free == [True]
    assert [(r.status, r.tier) for r in results] == [("hit", "remote"), ("miss", "")]


def test_a_request_whose_folder_fails_does_not_fail_the_others_of_its_key(
    tmp_path: Path,
) -> None:
    (tmp_path / "a-file").write_text("")
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(0), make_request(0, op_name="again")]
    outs = [tmp_path / "good", tmp_path / "a-file" / "sub"]
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        results = cache.compile_many(requests, compiler, outs)
        # The same when the key is a hit: each request is delivered on its own.
        hits = cache.compile_many(requests, compiler, [tmp_path / "good2", outs[1]])
    assert [r.status for r in results] == ["miss", "error"]
    assert [r.status for r in hits] == ["hit", "error"]
    assert isinstance(results[1].error, OSError)
    assert read_dir(tmp_path / "good") == expected_files(requests[0])
    assert read_dir(tmp_path / "good2") == expected_files(requests[0])


def test_a_key_whose_first_requests_folders_fail_is_compiled_for_the_next(
    tmp_path: Path,
) -> None:
    """A key's compile goes into the out_dir of its first request: where that one
    cannot be made, it goes into the next's.  (It failed every request of the
    key with the first one's error, and compiled none.)"""
    (tmp_path / "a-file").write_text("")
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(0, op_name=f"name_{n}") for n in range(4)]
    bad = [tmp_path / "a-file" / "sub", tmp_path / "a-file" / "sub2"]
    outs = [*bad, tmp_path / "good", tmp_path / "good2"]
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        results = cache.compile_many(requests, compiler, outs)
        others = [make_request(1, op_name=f"name_{n}") for n in range(2)]
        none = cache.compile_many(others, compiler, bad)
        stored = cache.compile(requests[2], compiler, tmp_path / "later")
    assert [r.status for r in results] == ["error", "error", "miss", "hit"]
    # Each failed request has its own folder's error.
    for result, out in zip(results[:2], bad, strict=True):
        assert isinstance(result.error, NotADirectoryError) and result.error.filename == str(out)
    assert compiler.calls() == 1
    assert read_dir(outs[2]) == read_dir(outs[3]) == expected_files(requests[2])
    assert stored.status == "hit"
    # All of the key's folders failing: each request its own error, and no compile.
    assert [(r.status, r.error.filename) for r in none] == [("error", str(out)) for out in bad]
    assert compiler.calls() == 1


def _waiting_rank(tmp: str, result: str) -> None:
    tmp_path = Path(tmp)
    requests = [make_request(i) for i in range(6)]
    outs = [tmp_path / "ranks" / f"{os.getpid()}" / r.op_name for r in requests]
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        compiler = ToyCompiler(tmp_path / "calls", sleep=0.5)  # time for the others to come
        results = cache.compile_many(requests, compiler, outs, jobs=2)
    ok = all(read_dir(o) == expected_files(r) for r, o in zip(requests, outs, strict=True))
    write_json(result, {"ok": ok, "statuses": [r.status for r in results]})


def test_a_dead_holders_key_is_compiled_once_by_the_ranks_waiting_for_it(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "hanging"
    holder = MP.Process(target=_hang_child, args=(str(tmp_path), str(marker)))
    holder.start()
    wait_for(marker)
    ranks = [
        MP.Process(target=_waiting_rank, args=(str(tmp_path), str(tmp_path / f"r{n}.json")))
        for n in range(3)
    ]
    for rank in ranks:
        rank.start()
    time.sleep(0.5)  # every rank is waiting for add_3 by now
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    for rank in ranks:
        rank.join(60)
        assert rank.exitcode == 0
    for n in range(3):
        assert read_json(tmp_path / f"r{n}.json")["ok"]
    calls = (tmp_path / "calls").read_text().split("\n")
    assert sum(line.endswith(" add_3") for line in calls) == 1  # once, not once per rank
