"""Races of the remote tier: machines that park keys for each other, a worker
thread that dies, remotes that fail in ways redis-py does not name, claims
of many compiles far from the remote, a compile that fails while others wait.

Every wait here is bounded: a machine runs in a forked process joined with a
timeout (killed, and the test failed, when it hangs), never a timed assertion.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import pytest
from helpers_cache import (
    MP,
    ToyCompiler,
    expected_files,
    make_request,
    make_settings,
    read_dir,
    read_json,
    wait_for,
    write_json,
)
from helpers_redis import DelayingProxy

import opcache
from opcache import remote_tier, shared_work

# A machine that hangs is killed after this long: far more than a round needs.
_HUNG = 60.0


def _machine_settings(tmp: Path, name: str, url: str, **remote: object) -> opcache.Settings:
    return make_settings(tmp / name, tmp, remote={"url": url, **remote})


def _slow_polls(seconds: float) -> None:
    """Widen the race window: every look at the parked keys takes ``seconds`` more."""
    real = remote_tier.RemoteTier.poll

    def poll(self, soc, keys):  # type: ignore[no-untyped-def]
        time.sleep(seconds)
        return real(self, soc, keys)

    remote_tier.RemoteTier.poll = poll  # (in a forked child: the test's process is untouched)


def _rounds(spec: dict) -> None:
    """One machine: ``rounds`` compile_many batches, each in step with the other machine."""
    report: dict = {"error": None, "bad": []}
    try:
        _slow_polls(spec["poll_sleep"])
        tmp = Path(spec["tmp"])
        compiler = ToyCompiler(tmp / "calls", sleep=spec["sleep"])
        requests = [make_request(i) for i in range(spec["ops"])]
        for n in range(spec["rounds"]):
            (tmp / f"{spec['name']}-ready-{n}").touch()
            for other in spec["others"]:
                wait_for(tmp / f"{other}-ready-{n}")
            prefix = f"opcache:round{n}:"  # each round a cold remote
            settings = _machine_settings(tmp, f"{spec['name']}-{n}", spec["url"], prefix=prefix)
            outs = [tmp / "out" / spec["name"] / str(n) / r.op_name for r in requests]
            with opcache.OpCache(settings) as cache:
                results = cache.compile_many(requests, compiler, outs, jobs=spec["jobs"])
            for request, result, out in zip(requests, results, outs, strict=True):
                if result.error is not None or read_dir(out) != expected_files(request):
                    report["bad"].append(f"round {n} {request.op_name}: {result.error!r}")
    except BaseException:
        report["error"] = traceback.format_exc()
    write_json(spec["result"], report)


def test_machines_parking_keys_for_each_other_never_hang(tmp_path: Path, redis_url: str) -> None:
    """Two machines x jobs=4 on one list of keys, many rounds: each parks the keys
    the other compiles, and one thread looks at them while others park more.
    (Two threads polling at once once made the batch wait forever.)"""
    names = ["a", "b"]
    specs = [
        {
            "tmp": str(tmp_path),
            "name": name,
            "others": [n for n in names if n != name],
            "url": redis_url,
            "rounds": 10,
            "ops": 40,
            "jobs": 4,
            "sleep": 0.02,
            "poll_sleep": 0.05,
            "result": str(tmp_path / f"{name}.json"),
        }
        for name in names
    ]
    procs = [MP.Process(target=_rounds, args=(spec,)) for spec in specs]
    for proc in procs:
        proc.start()
    for report in _joined(procs, specs):
        assert report["bad"] == []


def _poll_dies(spec: dict) -> None:
    """A machine whose look at the parked keys raises; then the same keys again."""
    import redis

    report: dict = {"error": None}
    try:

        def broken(self, schedule):  # type: ignore[no-untyped-def]
            raise RuntimeError("injected failure of a poll")

        real, shared_work._Batch._poll = shared_work._Batch._poll, broken
        tmp = Path(spec["tmp"])
        compiler = ToyCompiler(tmp / "calls")
        requests = [make_request(i) for i in range(spec["ops"])]
        settings = _machine_settings(tmp, "a", spec["url"])
        with opcache.OpCache(settings, lock_timeout=3600) as cache:
            results = cache.compile_many(requests, compiler, [tmp / "o1"] * len(requests), jobs=4)
            report["first"] = [[r.status, str(r.error)] for r in results]
            shared_work._Batch._poll = real
            redis.Redis.from_url(spec["url"]).delete(*spec["claims"])
            # Nothing stays locked: with the claims gone, every key compiles (a lock
            # left held would make this wait lock_timeout, an hour).
            again = cache.compile_many(requests, compiler, [tmp / "o2"] * len(requests), jobs=4)
            report["again"] = [r.status for r in again]
    except BaseException:
        report["error"] = traceback.format_exc()
    write_json(spec["result"], report)


def test_a_worker_that_dies_ends_the_batch_with_errors(
    tmp_path: Path, redis_url: str, redis_server
) -> None:
    """An exception outside a job's own handling (here: in the poll of the keys
    another machine compiles) ends the batch: those keys fail with it, the
    others are done, no lock is left held.  (It once left the batch waiting
    forever for a count of jobs in hand that never came back to zero.)"""
    ops, claimed = 8, 4
    with opcache.OpCache(make_settings(tmp_path / "keys", tmp_path)) as local:
        compiler = ToyCompiler(tmp_path / "key-calls")
        keys = [local.compile(make_request(i), compiler, tmp_path / "k").key for i in range(ops)]
    soc = make_request(0).soc_version
    claims = [f"opcache:1:{soc}:{key}:claim" for key in keys[:claimed]]
    client = redis_server.client()
    for name in claims:  # another machine compiles these, for a minute
        client.set(name, "another-machine", px=60_000)
    spec = {
        "tmp": str(tmp_path),
        "url": redis_url,
        "ops": ops,
        "claims": claims,
        "result": str(tmp_path / "result.json"),
    }
    proc = MP.Process(target=_poll_dies, args=(spec,))
    proc.start()
    proc.join(_HUNG)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"compile_many still running after {_HUNG:.0f} s: hung")
    report = read_json(spec["result"])
    assert report["error"] is None, report["error"]
    first = report["first"]
    # The keys parked for the other machine fail with the error; the others were
    # compiled, or failed the same way if the poll came before them.
    assert [status for status, _ in first[:claimed]] == ["error"] * claimed
    for status, error in first:
        assert status == "miss" or "injected failure of a poll" in error
    assert report["again"][:claimed] == ["miss"] * claimed
    assert set(report["again"]) <= {"hit", "miss"}


def _joined(procs: list, specs: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    """The reports of the machines ``procs`` ran ``specs`` in, once all are done (one
    still running after ``_HUNG`` seconds fails the test)."""
    hung = []
    for proc, spec in zip(procs, specs, strict=True):
        proc.join(_HUNG)
        if proc.is_alive():
            hung.append(spec["name"])
            proc.kill()
            proc.join()
    assert not hung, f"machine(s) {hung} still running after {_HUNG:.0f} s: hung"
    reports = [read_json(spec["result"]) for spec in specs]
    for report in reports:
        assert report["error"] is None, report["error"]
    return reports


def _busy_machine(spec: dict) -> None:
    """A machine compiling ``ops`` keys at once, each for ``sleep`` s (its compiles
    noted in ``<name>-calls``)."""
    report: dict = {"error": None}
    try:
        remote_tier.CLAIM_SECONDS = spec["claim_seconds"]  # (in a forked child)
        tmp = Path(spec["tmp"])
        compiler = ToyCompiler(tmp / f"{spec['name']}-calls", sleep=spec["sleep"])
        requests = [make_request(i) for i in range(spec["ops"])]
        outs = [tmp / "out" / spec["name"] / r.op_name for r in requests]
        with opcache.OpCache(_machine_settings(tmp, spec["name"], spec["url"])) as cache:
            results = cache.compile_many(requests, compiler, outs, jobs=spec["ops"])
        report["results"] = [[r.status, r.tier] for r in results]
    except BaseException:
        report["error"] = traceback.format_exc()
    write_json(spec["result"], report)


def test_the_claims_of_many_compiles_far_from_the_remote_live_while_they_run(
    tmp_path: Path, redis_url: str, redis_server
) -> None:
    """A machine 0.1 s (a round trip) from the remote compiles 32 keys at once; a
    second machine asks for them once their claims would have expired unrenewed:
    it waits for the first's entries and compiles none.  (Renewed one round trip
    each, a pass over 32 claims took 3.2 s, twice their life here: most expired
    under their live compiles, and the second machine compiled those again.)"""
    ops, life = 32, 1.5

    def spec(name: str, url: str, sleep: float) -> dict:
        return {
            "tmp": str(tmp_path),
            "name": name,
            "url": url,
            "ops": ops,
            "sleep": sleep,
            "claim_seconds": life,
            "result": str(tmp_path / f"{name}.json"),
        }

    proxy = DelayingProxy(redis_server.port, 0.05)
    try:
        far_spec = spec("far", proxy.url, 6.0)
        far = MP.Process(target=_busy_machine, args=(far_spec,))
        far.start()
        calls = ToyCompiler(tmp_path / "far-calls")
        deadline = time.monotonic() + _HUNG
        while calls.calls() < ops and far.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls.calls() == ops, "the far machine never compiled all its keys at once"
        time.sleep(life + 1)  # past the life of a claim no one renewed
        near_spec = spec("near", redis_url, 0.0)
        near = MP.Process(target=_busy_machine, args=(near_spec,))
        near.start()
        far_report, near_report = _joined([far, near], [far_spec, near_spec])
    finally:
        proxy.stop()
    assert ToyCompiler(tmp_path / "near-calls").calls() == 0
    assert near_report["results"] == [["hit", "remote"]] * ops
    assert far_report["results"] == [["miss", ""]] * ops
    assert calls.calls() == ops


class _SlowFailing(ToyCompiler):
    """Fails each compile after ``sleep`` seconds; notes when each began and ended."""

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        with open(self.calls_file, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} start {time.time()}\n")
        time.sleep(self.sleep)
        with open(self.calls_file, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} end {time.time()}\n")
        raise opcache.CompileError("this operator does not compile")


def _failing_machine(spec: dict) -> None:
    """A machine compiling one key that fails, through ``compile`` or ``compile_many``."""
    report: dict = {"error": None}
    try:
        tmp = Path(spec["tmp"])
        compiler = _SlowFailing(tmp / "calls", sleep=spec["sleep"])
        out = tmp / "out" / spec["name"]
        wait_for(tmp / "go")
        with opcache.OpCache(_machine_settings(tmp, spec["name"], spec["url"])) as cache:
            if spec["api"] == "compile":
                try:
                    cache.compile(make_request(0), compiler, out)
                    report["status"] = "compiled"
                except opcache.CompileError:
                    report["status"] = "error"
            else:
                report["status"] = cache.compile_many([make_request(0)], compiler, [out])[0].status
    except BaseException:
        report["error"] = traceback.format_exc()
    write_json(spec["result"], report)


@pytest.mark.parametrize("api", ["compile", "compile_many"])
@pytest.mark.parametrize("machines", [("a", "b", "c"), ("a", "a", "b", "b")])
def test_the_machines_waiting_for_a_compile_that_fails_compile_it_side_by_side(
    tmp_path: Path, redis_url: str, api: str, machines: tuple[str, ...]
) -> None:
    """Ranks of several machines want a key whose compile fails: one compiles it
    while the others wait, then all of those compile it at once, side by side,
    as the ranks waiting on a local lock do.  (The claim deleted at the failure,
    the next machine claimed the key and the last waited for that one's failure
    too: one after another.  And a rank that waited for the remote kept its
    machine's lock through its own compile: the machine's other ranks after it.)"""
    specs = [
        {
            "tmp": str(tmp_path),
            "name": name,
            "url": redis_url,
            "api": api,
            "sleep": 1.5,
            "result": str(tmp_path / f"{n}.json"),
        }
        for n, name in enumerate(machines)
    ]
    procs = [MP.Process(target=_failing_machine, args=(spec,)) for spec in specs]
    for proc in procs:
        proc.start()
    (tmp_path / "go").touch()
    reports = _joined(procs, specs)
    assert [report["status"] for report in reports] == ["error"] * len(specs)
    spans: dict[str, list[float]] = {}
    for line in (tmp_path / "calls").read_text(encoding="utf-8").splitlines():
        pid, _, when = line.split()
        spans.setdefault(pid, []).append(float(when))
    assert len(spans) == len(specs) and all(len(span) == 2 for span in spans.values()), spans
    first, *others = sorted(spans.values())
    assert all(start >= first[1] for start, _ in others), spans  # they waited for it
    assert all(start < end for start, _ in others for _, end in others), spans  # side by side


class _FingerprintFailsLater(ToyCompiler):
    """A tool that can be read for the batch's first look, not for its compile."""

    checks_its_tools = True

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.asked = 0

    def fingerprint(self) -> str:
        self.asked += 1
        if self.asked > 1:
            raise PermissionError(13, "Permission denied", "/opt/tool")
        return super().fingerprint()


def test_a_fingerprint_that_fails_after_the_claim_lets_the_claim_go(
    tmp_path: Path, redis_url: str, redis_server
) -> None:
    """compile_many claimed the key in the cluster, then the compiler's fingerprint
    failed (its tool unreadable now): the error was the request's, but the claim was
    renewed for the rest of the process's life, every other machine waiting on it."""
    settings = _machine_settings(tmp_path, "a", redis_url)
    with opcache.OpCache(settings) as cache:
        (result,) = cache.compile_many(
            [make_request(0)], _FingerprintFailsLater(tmp_path / "calls"), [tmp_path / "o"]
        )
        assert result.status == "error" and "Permission denied" in str(result.error)
        claims = [n for n in redis_server.client().keys("*") if n.endswith(b":claim")]
        held = [n for n in claims if redis_server.client().get(n) not in (None, b"failed")]
        assert held == []
