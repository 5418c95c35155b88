"""The remote tier behind the local cache, with a real redis-server.

Each "machine" is a cache folder of its own; they share one Redis.  A local
miss asks the remote, a remote hit is checked and stored locally, a miss
everywhere compiles once in the whole cluster and is stored in both tiers.
A remote that fails never fails a compile.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest
from helpers_cache import (
    MP,
    SOC,
    ToyCompiler,
    entry_dirs,
    expected_files,
    machine,
    make_request,
    read_dir,
    read_json,
    wait_for,
    write_json,
)

import opcache
from opcache.storage import remote as storage_remote


def entry_names(redis_server) -> list[bytes]:
    """The entries in Redis (a claim marked stored outlives its compile for a while)."""
    return [name for name in redis_server.client().keys("*") if not name.endswith(b":claim")]


def remote_stats(cache: opcache.OpCache) -> dict[str, int]:
    report = cache.stats()
    return {k: v for k, v in report.items() if k.startswith("remote_")}


def store_then_damage(
    tmp_path: Path, redis_url: str, redis_server, compiler: ToyCompiler, request: opcache.OpRequest
) -> tuple[str, bytes]:
    """Store ``request`` on machine a, then flip a byte in the middle of its remote value.

    Returns the value's name in Redis and the damaged value.
    """
    with opcache.OpCache(machine(tmp_path, "a", redis_url)) as a:
        key = a.compile(request, compiler, tmp_path / "o").key
    client = redis_server.client()
    name = f"opcache:1:{SOC}:{key}"
    value = bytearray(client.get(name))
    value[len(value) // 2] ^= 0xFF
    client.set(name, bytes(value))
    return name, bytes(value)


def test_two_machines_share_entries_through_the_remote(tmp_path: Path, redis_url: str) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    request = make_request(0)
    with opcache.OpCache(machine(tmp_path, "a", redis_url)) as a:
        first = a.compile(request, compiler, tmp_path / "out-a")
        assert first.status == "miss" and first.tier == ""
        assert remote_stats(a)["remote_stores"] == 1
    with opcache.OpCache(machine(tmp_path, "b", redis_url)) as b:
        second = b.compile(request, compiler, tmp_path / "out-b")
        third = b.compile(request, compiler, tmp_path / "out-b2")
        stats = remote_stats(b)
    assert (second.status, second.tier) == ("hit", "remote")
    assert (third.status, third.tier) == ("hit", "local")  # backfilled on the way
    assert compiler.calls() == 1
    assert read_dir(tmp_path / "out-b") == expected_files(request)
    assert set(entry_dirs(tmp_path / "b" / "kernel_cache")) == {first.key}
    assert stats["remote_hits"] == 1 and stats["remote_misses"] == 0
    assert stats["remote_bytes_down"] > sum(map(len, expected_files(request).values()))


def test_compile_many_fetches_hits_in_one_batch_and_backfills(
    tmp_path: Path, redis_url: str, redis_server
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(i) for i in range(10)]
    with opcache.OpCache(machine(tmp_path, "a", redis_url)) as a:
        a.compile_many(requests[:6], compiler, lambda r: tmp_path / "a-out" / r.op_name)
    client = redis_server.client()
    client.config_resetstat()
    with opcache.OpCache(machine(tmp_path, "b", redis_url)) as b:
        results = b.compile_many(requests, compiler, lambda r: tmp_path / "b-out" / r.op_name)
    assert [r.tier for r in results] == ["remote"] * 6 + [""] * 4
    assert [r.status for r in results] == ["hit"] * 6 + ["miss"] * 4
    assert compiler.calls() == 10
    for request in requests:
        assert read_dir(tmp_path / "b-out" / request.op_name) == expected_files(request)
    commands = client.info("commandstats")
    # One batch; then per miss its claim, its entry and the claim marked stored, no
    # claim deleted.  (GET and EVALSHA are not counted here: another test's process
    # may still renew its claims on this shared server.)
    assert commands["cmdstat_mget"]["calls"] == 1
    assert commands["cmdstat_set"]["calls"] == 4 * 3
    assert "cmdstat_del" not in commands


def test_a_read_only_client_reads_and_never_writes(
    tmp_path: Path, redis_url: str, redis_server
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(machine(tmp_path, "ci", redis_url)) as ci:
        ci.compile(make_request(0), compiler, tmp_path / "o")
    keys_before = sorted(redis_server.client().keys("*"))
    with opcache.OpCache(machine(tmp_path, "dev", redis_url, read_only=True)) as dev:
        assert dev.compile(make_request(0), compiler, tmp_path / "o").tier == "remote"
        assert dev.compile(make_request(1), compiler, tmp_path / "o").status == "miss"
        assert remote_stats(dev)["remote_stores"] == 0
    assert sorted(redis_server.client().keys("*")) == keys_before


def test_an_acl_user_without_write_permission_warns_once_and_compiles(
    tmp_path: Path, redis_url: str, redis_server, caplog: pytest.LogCaptureFixture
) -> None:
    redis_server.client().acl_setuser(
        "dev", enabled=True, passwords=["+pw"], keys=["opcache:*"],
        commands=["+get", "+mget", "+exists", "+ping"],
    )  # fmt: skip
    url = redis_url.replace("redis://", "redis://dev:pw@")
    compiler = ToyCompiler(tmp_path / "calls")
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(machine(tmp_path, "dev", url)) as dev,
    ):
        results = [dev.compile(make_request(i), compiler, tmp_path / f"o{i}") for i in range(3)]
    assert [r.status for r in results] == ["miss"] * 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "refuses our writes" in warnings[0]
    assert redis_server.client().keys("*") == []


def test_a_corrupted_remote_value_is_never_served_and_is_replaced(
    tmp_path: Path, redis_url: str, redis_server
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    request = make_request(0)
    name, damaged = store_then_damage(tmp_path, redis_url, redis_server, compiler, request)
    client = redis_server.client()
    with opcache.OpCache(machine(tmp_path, "b", redis_url)) as b:
        result = b.compile(request, compiler, tmp_path / "b")
        stats = remote_stats(b)
    assert result.status == "miss"  # compiled again, not served
    assert read_dir(tmp_path / "b") == expected_files(request)
    assert stats["remote_corrupt"] >= 1
    assert client.get(name) != damaged  # the good compile took its place
    with opcache.OpCache(machine(tmp_path, "c", redis_url)) as c:
        assert c.compile(request, compiler, tmp_path / "c").tier == "remote"


def test_a_server_killed_mid_run_never_fails_a_compile_and_is_used_again(
    tmp_path: Path,
    redis_url: str,
    redis_server,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(storage_remote, "FIRST_PAUSE", 0.3)
    compiler = ToyCompiler(tmp_path / "calls")
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(machine(tmp_path, "a", redis_url, timeout=1)) as a,
    ):
        assert a.compile(make_request(0), compiler, tmp_path / "o0").status == "miss"
        redis_server.kill()
        for i in range(1, 4):
            result = a.compile(make_request(i), compiler, tmp_path / f"o{i}")
            assert result.status == "miss"
            assert read_dir(tmp_path / f"o{i}") == expected_files(make_request(i))
        down = remote_stats(a)
        redis_server.start()  # empty, on the same port
        time.sleep(0.4)  # the pause is over
        assert a.compile(make_request(4), compiler, tmp_path / "o4").status == "miss"
        up = remote_stats(a)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not used for" in warnings[0]
    assert down["remote_errors"] == 1  # then paused: not asked again meanwhile
    assert up["remote_stores"] == down["remote_stores"] + 1  # used again
    assert len(entry_names(redis_server)) == 1


def _paused_by_a_failure(tmp_path: Path, redis_server, redis_url: str):  # type: ignore[no-untyped-def]
    """(a compiler, the settings of machine a) once a compile found the server down:
    the remote paused, the pause noted in a's cache folder."""
    redis_server.kill()
    compiler = ToyCompiler(tmp_path / "calls")
    settings = machine(tmp_path, "a", redis_url, timeout=1)
    with opcache.OpCache(settings) as first:
        first.compile(make_request(0), compiler, tmp_path / "o")
        assert remote_stats(first)["remote_errors"] == 1
    return compiler, settings


def test_the_pause_is_shared_with_other_processes_of_the_cache(
    tmp_path: Path, redis_server, redis_url: str
) -> None:
    _paused_by_a_failure(tmp_path, redis_server, redis_url)
    # Another process of the same cache folder: it skips the remote while paused.
    code = (
        "import json, sys, opcache\n"
        "from helpers_cache import ToyCompiler, make_request, make_settings\n"
        "s = make_settings(sys.argv[1], sys.argv[2], remote={'url': sys.argv[3], 'timeout': 1})\n"
        "with opcache.OpCache(s) as c:\n"
        "    c.compile(make_request(1), ToyCompiler(sys.argv[4]), sys.argv[5])\n"
        "    print(json.dumps(c.stats()))\n"
    )
    import subprocess

    from helpers_cache import TESTS_DIR

    args = [str(tmp_path / "a"), str(tmp_path), redis_url, str(tmp_path / "calls")]
    done = subprocess.run(
        [sys.executable, "-c", code, *args, str(tmp_path / "o1")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{TESTS_DIR}{os.pathsep}{TESTS_DIR.parent}"},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["remote_errors"] == 1  # only the first process's
    assert "not used for" not in done.stderr


def test_a_pause_further_ahead_than_the_longest_is_no_pause(
    tmp_path: Path, redis_server, redis_url: str
) -> None:
    """A cache folder shared between hosts: one whose clock runs two hours ahead noted
    a pause until its now + 10 s, and every other host left the remote unused for two
    hours (so did one host whose clock stepped back)."""
    compiler, settings = _paused_by_a_failure(tmp_path, redis_server, redis_url)
    (note,) = (tmp_path / "a").rglob("remote-pause-*")
    note.write_text(f"{time.time() + 7200 + storage_remote.FIRST_PAUSE:.3f}")
    redis_server.start()
    with opcache.OpCache(settings) as second:
        second.compile(make_request(1), compiler, tmp_path / "o1")
        assert remote_stats(second)["remote_stores"] == 1


def test_big_entries_stay_local(tmp_path: Path, redis_url: str, redis_server) -> None:
    compiler = ToyCompiler(tmp_path / "calls", size=2 << 20)
    with opcache.OpCache(machine(tmp_path, "a", redis_url, max_entry_mb=1)) as a:
        result = a.compile(make_request(0), compiler, tmp_path / "o")
        assert result.status == "miss"
        assert remote_stats(a)["remote_stores"] == 0
    # No entry: its claim is marked failed, and machines waiting for it compile it at once.
    assert redis_server.client().keys("*") == [f"opcache:1:{SOC}:{result.key}:claim".encode()]
    assert len(entry_dirs(tmp_path / "a" / "kernel_cache")) == 1


def _cold_machine(spec: dict) -> None:
    report: dict = {"error": None}
    try:
        wait_for(spec["go"])
        tmp = Path(spec["tmp"])
        compiler = ToyCompiler(tmp / "calls", sleep=0.2)
        requests = [make_request(i) for i in range(spec["ops"])]
        settings = machine(tmp, spec["name"], spec["url"])
        with opcache.OpCache(settings) as cache:
            if spec["many"]:
                outs = [tmp / spec["name"] / "out" / r.op_name for r in requests]
                results = cache.compile_many(requests, compiler, outs, jobs=2)
            else:
                outs = [tmp / spec["name"] / "out" / r.op_name for r in requests]
                results = [
                    cache.compile(r, compiler, o) for r, o in zip(requests, outs, strict=True)
                ]
        report["ok"] = all(
            read_dir(o) == expected_files(r) for r, o in zip(requests, outs, strict=True)
        )
        report["statuses"] = [r.status for r in results]
    except BaseException as e:
        report["error"] = repr(e)
    write_json(spec["result"], report)


@pytest.mark.parametrize("many", [True, False], ids=["compile_many", "compile"])
def test_machines_on_separate_folders_compile_each_operator_once(
    tmp_path: Path, redis_url: str, many: bool
) -> None:
    ops = 3 if not many else 12
    go = tmp_path / "go"
    specs = [
        {
            "tmp": str(tmp_path),
            "name": f"m{n}",
            "url": redis_url,
            "go": str(go),
            "ops": ops,
            "many": many,
            "result": str(tmp_path / f"m{n}.json"),
        }
        for n in range(3)
    ]
    procs = [MP.Process(target=_cold_machine, args=(spec,)) for spec in specs]
    for proc in procs:
        proc.start()
    time.sleep(0.2)
    go.touch()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    for spec in specs:
        report = read_json(spec["result"])
        assert report["error"] is None, report["error"]
        assert report["ok"]
    compiler = ToyCompiler(tmp_path / "calls")
    assert compiler.calls() == ops  # once each in the whole cluster
    for spec in specs:  # and every machine has every entry in its own folder
        assert len(entry_dirs(tmp_path / spec["name"] / "kernel_cache")) == ops


def test_no_remote_no_remote_code(tmp_path: Path) -> None:
    code = (
        "import sys, opcache\n"
        "from helpers_cache import ToyCompiler, make_request, make_settings\n"
        "s = make_settings(sys.argv[1], sys.argv[1])\n"
        "with opcache.OpCache(s) as c:\n"
        "    c.compile(make_request(0), ToyCompiler(sys.argv[1] + '/calls'), sys.argv[1] + '/o')\n"
        "remote = ('opcache.remote', 'opcache.storage.redis', 'redis')\n"
        "print(sorted(m for m in sys.modules if m.startswith(remote)))\n"
    )
    import subprocess

    from helpers_cache import TESTS_DIR

    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{TESTS_DIR}{os.pathsep}{TESTS_DIR.parent}"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("many", [False, True], ids=["compile", "compile_many"])
def test_a_damaged_value_is_warned_about_and_counted_once(
    tmp_path: Path, redis_url: str, redis_server, caplog: pytest.LogCaptureFixture, many: bool
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    request = make_request(0)
    store_then_damage(tmp_path, redis_url, redis_server, compiler, request)
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(machine(tmp_path, "b", redis_url)) as b,
    ):
        if many:
            (result,) = b.compile_many([request], compiler, [tmp_path / "b"])
        else:
            result = b.compile(request, compiler, tmp_path / "b")
        stats = remote_stats(b)
    assert result.status == "miss"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "corrupt remote entry" in warnings[0], warnings
    assert stats["remote_corrupt"] == 1


def test_bytes_down_and_up_are_both_the_bytes_on_the_wire(
    tmp_path: Path, redis_url: str, redis_server
) -> None:
    compiler = ToyCompiler(tmp_path / "calls", size=64 << 10)  # compressible: zlib'd on the wire
    requests = [make_request(i) for i in range(3)]
    with opcache.OpCache(machine(tmp_path, "a", redis_url)) as a:
        a.compile_many(requests, compiler, lambda r: tmp_path / "a" / r.op_name)
        up = remote_stats(a)["remote_bytes_up"]
    client = redis_server.client()
    stored = sum(client.strlen(name) for name in entry_names(redis_server))
    assert up == stored
    with opcache.OpCache(machine(tmp_path, "b", redis_url)) as b:
        b.compile_many(requests[:2], compiler, lambda r: tmp_path / "b" / r.op_name)
        b.compile(requests[2], compiler, tmp_path / "b" / "2")
        down = remote_stats(b)["remote_bytes_down"]
    assert down == stored  # not the (bigger) artifacts once uncompressed
    assert down < 3 * sum(map(len, expected_files(requests[0], 64 << 10).values()))


@pytest.mark.parametrize("error", [UnicodeError, ValueError, OverflowError])
def test_any_error_of_the_client_library_is_a_remote_unavailable(
    tmp_path: Path,
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    error: type[Exception],
) -> None:
    """redis-py lets some errors through as they are: a host label over 63
    characters is a UnicodeError from the idna codec, at connect time."""
    import socket

    def refuse(*args: object, **kwargs: object) -> None:
        raise error("label empty or too long")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(i) for i in range(3)]
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(machine(tmp_path, "a", redis_url)) as a,
    ):
        first = a.compile(requests[0], compiler, tmp_path / "o0")
        rest = a.compile_many(requests[1:], compiler, [tmp_path / "o1", tmp_path / "o2"])
        stats = remote_stats(a)
    assert [r.status for r in (first, *rest)] == ["miss"] * 3
    for i, request in enumerate(requests):
        assert read_dir(tmp_path / f"o{i}") == expected_files(request)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not used for" in warnings[0], warnings
    assert "label empty or too long" in warnings[0]
    assert stats["remote_errors"] == 1  # then paused


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_a_remote_that_fails_as_the_cache_opens_is_counted(
    tmp_path: Path, scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A cluster's client connects as it is made, in ``open``: its failure there (no
    node answering, an untrusted certificate) paused the remote, warned, and was never
    counted, where a single server's, failing at the PING after, was."""
    from helpers_redis import free_port

    url = f"{scheme}://127.0.0.1:{free_port()}"  # nothing listens there
    compiler = ToyCompiler(tmp_path / "calls")
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(machine(tmp_path, "a", url, timeout=1)) as a,
    ):
        assert a.compile(make_request(0), compiler, tmp_path / "o0").status == "miss"
        assert a.compile(make_request(1), compiler, tmp_path / "o1").status == "miss"
        stats = a.stats()
    assert read_dir(tmp_path / "o1") == expected_files(make_request(1))
    assert stats["remote_errors"] == 1  # then paused: not asked again meanwhile
    assert stats["remote_errors_by_url"] == {url: 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not used for" in warnings[0]


def test_a_corrected_url_is_tried_at_once_and_stats_blame_the_one_that_failed(
    tmp_path: Path, redis_server, redis_url: str
) -> None:
    from helpers_redis import free_port

    bad = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(machine(tmp_path, "a", bad, timeout=1)) as first:
        assert first.compile(make_request(0), compiler, tmp_path / "o0").status == "miss"
        assert remote_stats(first)["remote_errors"] == 1  # the bad URL is paused
    # The user fixes the URL: the next process of the folder uses it at once.
    with opcache.OpCache(machine(tmp_path, "a", redis_url, timeout=1)) as fixed:
        assert fixed.compile(make_request(1), compiler, tmp_path / "o1").status == "miss"
        stats = fixed.stats()
    assert stats["remote_stores"] == 1 and stats["remote_errors"] == 1
    assert stats["remote_errors_by_url"] == {bad: 1}
    assert len(entry_names(redis_server)) == 1
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "OPCACHE_DIR": str(tmp_path / "a"),
        "OPCACHE_REMOTE": redis_url,
    }
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "opcache", "stats"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("remote ")]
    assert f"1 error (1 at {bad})" in line, line
