"""The Redis Cluster remote (redis+cluster://, opcache/storage/redis_cluster.py).

Against a real cluster of three primaries (tests/helpers_cluster.py): two
machines share entries, a batch spanning slots is one look-up, claims hold
across the cluster, stats and clear reach every primary, and a primary
killed mid-run costs misses, never a compile, until it is back.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from helpers_cache import SOC, ToyCompiler, expected_files, machine, make_request, read_dir
from helpers_cluster import Cluster, find_cli
from helpers_redis import HOW_TO_GET_ONE, find_server

import opcache
from opcache.storage import open_remote
from opcache.storage import remote as storage_remote
from opcache.storage.entry import make_manifest


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    binary = find_server()
    cli = binary and find_cli(binary)
    if not binary or not cli:
        pytest.skip(HOW_TO_GET_ONE + " (and its redis-cli)")
    made = Cluster(binary, cli, tmp_path_factory.mktemp("cluster"))
    made.start()
    yield made
    made.stop()


@pytest.fixture
def url(cluster: Cluster) -> str:
    """The cluster's URL, every node up and emptied."""
    cluster.ready()
    return cluster.url


def entry(key: str) -> tuple[bytes, dict[str, bytes]]:
    files = {"k.o": key.encode() * 40}
    return make_manifest(key, files, 1.0, {"op_type": "Add"}, 1000.0), files


def test_two_machines_share_a_batch_spread_over_every_primary(
    tmp_path: Path, url: str, cluster: Cluster
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(i) for i in range(24)]
    counted = [node.client() for node in cluster.nodes]
    for client in counted:  # (each connects here: its own handshake is not counted)
        client.config_resetstat()
    with opcache.OpCache(machine(tmp_path, "a", url)) as a:
        a.compile_many(requests[:16], compiler, lambda r: tmp_path / "a" / r.op_name)
    assert all(client.dbsize() > 0 for client in counted)  # over every slot range
    with opcache.OpCache(machine(tmp_path, "b", url)) as b:
        results = b.compile_many(requests, compiler, lambda r: tmp_path / "b" / r.op_name)
        single = b.compile(requests[0], compiler, tmp_path / "b-again")
    assert [r.tier for r in results] == ["remote"] * 16 + [""] * 8
    assert single.tier == "local"  # backfilled
    assert compiler.calls() == 24
    for request in requests:
        assert read_dir(tmp_path / "b" / request.op_name) == expected_files(request)
    for client in counted:  # no CLIENT SETINFO on a node's connections (test_remote_redis)
        assert not [n for n in client.info("commandstats") if n.startswith("cmdstat_client")]


def test_claims_hold_across_the_cluster(url: str) -> None:
    """Claims on every primary are exclusive, renewed together (a pipeline per
    primary, where a cluster refuses EVALSHA), and once let go unstored (their
    compiles failed) are held by no one: the keys are compiled unclaimed."""
    settings = machine(Path("/nowhere"), "x", url).remote
    one, other = open_remote(settings), open_remote(settings)
    keys = [f"{i:032x}" for i in range(12)]
    held = [one.claim(SOC, key, 1.0) for key in keys]
    assert all(claim is not None and claim.owned for claim in held)
    time.sleep(2.5)  # more than twice the claims' own life: renewed meanwhile
    assert all(other.claim(SOC, key, 5) is None for key in keys)
    found, claimed = other.watch(SOC, keys)
    assert found == {} and claimed == set(keys)
    assert other.peek_claims(SOC, keys) == set(keys)  # (the claims of every slot at once)
    for claim in held:
        claim.release()
    assert other.watch(SOC, keys)[1] == set()
    assert other.peek_claims(SOC, keys) == set()
    assert not any(other.claim(SOC, key, 5).owned for key in keys)
    one.close()
    other.close()


def test_which_keys_are_there_is_asked_across_slots(url: str) -> None:
    r = open_remote(machine(Path("/nowhere"), "x", url).remote)
    keys = [f"{i:032x}" for i in range(40)]
    for key in keys[::2]:
        r.put(SOC, key, *entry(key))
    assert r.have_many(SOC, keys) == set(keys[::2])
    r.close()


def test_stats_and_clear_reach_every_primary(url: str, cluster: Cluster) -> None:
    settings = machine(Path("/nowhere"), "x", url).remote
    r = open_remote(settings)
    keys = [f"{i:032x}" for i in range(30)]
    for key in keys:
        r.put(SOC, key, *entry(key))
    cluster.nodes[0].client().set("someone-else:key", b"x")
    usage = r.usage()
    assert usage["chips"][SOC]["entries"] == 30
    assert usage["used_memory"] > 0 and usage["maxmemory_policy"] == "noeviction"
    assert r.clear() == 30
    assert sum(node.client().dbsize() for node in cluster.nodes) == 1  # not another's key
    r.close()


def misses(cache: opcache.OpCache, compiler: ToyCompiler, folder: Path, indices: range) -> None:
    """Requests ``indices`` compiled (misses, never failures: a dead node costs only
    its keys' look-ups), each output whole in ``folder/o<i>``."""
    for i in indices:
        assert cache.compile(make_request(i), compiler, folder / f"o{i}").status == "miss"
        assert read_dir(folder / f"o{i}") == expected_files(make_request(i))


def test_a_primary_killed_mid_run_costs_misses_then_recovers(
    tmp_path: Path,
    url: str,
    cluster: Cluster,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(storage_remote, "FIRST_PAUSE", 0.0)  # asked again at each compile
    compiler = ToyCompiler(tmp_path / "calls")
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(machine(tmp_path, "a", url, timeout=1)) as a,
    ):
        misses(a, compiler, tmp_path, range(1))
        cluster.kill(1)
        misses(a, compiler, tmp_path, range(1, 9))  # keys on every node: the dead one's fail
        down = a.stats()
        cluster.restart(1)
        misses(a, compiler, tmp_path, range(9, 12))
        up = a.stats()
    assert down["remote_errors"] >= 1
    assert up["remote_stores"] == down["remote_stores"] + 3  # used again, every slot
    assert up["remote_errors"] == down["remote_errors"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not used for" in warnings[0]
    with opcache.OpCache(machine(tmp_path, "b", url)) as b:
        assert b.compile(make_request(10), compiler, tmp_path / "b").tier == "remote"


def test_a_failover_to_a_replica_costs_misses_then_the_new_primary_is_used(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    cluster: Cluster,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(storage_remote, "FIRST_PAUSE", 0.0)  # asked again at each compile
    binary = cluster.nodes[0].binary
    replicated = Cluster(binary, cluster.cli, tmp_path_factory.mktemp("replicated"), replicas=True)
    replicated.start()
    try:
        url = replicated.url
        compiler = ToyCompiler(tmp_path / "calls")
        with (
            caplog.at_level(logging.WARNING, logger="opcache"),
            opcache.OpCache(machine(tmp_path, "a", url, timeout=1)) as a,
        ):
            misses(a, compiler, tmp_path, range(1))
            replicated.kill(0)
            misses(a, compiler, tmp_path, range(1, 7))
            replicated.wait_failed_over(0)
            before = a.stats()["remote_stores"]
            # The first may still ask the dead primary: then found.
            misses(a, compiler, tmp_path, range(7, 10))
            after = a.stats()["remote_stores"]
        assert after >= before + 2
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "not used for" in warnings[0]
        with opcache.OpCache(machine(tmp_path, "b", url)) as b:
            assert b.compile(make_request(9), compiler, tmp_path / "b").tier == "remote"
    finally:
        replicated.stop()


def test_the_url_is_checked_and_its_password_masked(tmp_path: Path) -> None:
    for bad, problem in (
        ("redis+cluster://h1:7000,h2:99999", "port"),
        ("redis+cluster://h1:7000/1", "one database"),
        ("redis+cluster://h1:7000,", "name the server's host"),
        ("redis+cluster://h1:7000?db=2", "query may hold"),
        # redis-py refused these only when connecting, or read "off" as true.
        ("rediss+cluster://h1:7000?ssl_cert_reqs=never", "ssl_cert_reqs='never'"),
        ("rediss+cluster://h1:7000?ssl_check_hostname=off", "ssl_check_hostname='off'"),
        ("rediss://h1:7000/0?ssl_check_hostname=maybe", "is not true or false"),
    ):
        with pytest.raises(opcache.ConfigError, match=problem):
            machine(tmp_path, "a", bad)
    good = machine(tmp_path, "a", "rediss+cluster://u:pw@h1:7000,[::1]:7001?ssl_cert_reqs=none")
    assert good.remote.shown_url == "rediss+cluster://u:***@h1:7000,[::1]:7001?ssl_cert_reqs=none"


def test_tls_options_are_read_as_rediss_reads_them() -> None:
    """They were passed on as strings: ssl_check_hostname=false, the string "false", was
    true (the host name checked), ssl_min_version a string TLS could not use."""
    from opcache.storage.redis_cluster import query_options

    got = query_options("ssl_check_hostname=false&ssl_cert_reqs=none&ssl_min_version=3")
    assert got == {"ssl_check_hostname": False, "ssl_cert_reqs": "none", "ssl_min_version": 3}
    with pytest.raises(ValueError, match="ssl_min_version"):
        query_options("ssl_min_version=tls1.3")


def test_the_password_variable_is_sent_as_written(
    tmp_path: Path, url: str, cluster: Cluster
) -> None:
    """OPCACHE_REMOTE_PASSWORD is not percent-decoded (as for Redis and HTTP): ``s3cr%41t``
    logs in as itself, not as ``s3crAt``; only a password inside the URL is decoded."""
    password = "s3cr%41t"
    for node in cluster.nodes:
        node.client().config_set("requirepass", password)
    try:
        remote = open_remote(machine(tmp_path, "a", url, password=password).remote)
        remote.put(SOC, "k" * 32, *entry("k" * 32))
        assert remote.have_many(SOC, ["k" * 32]) == {"k" * 32}
        remote.close()
        in_url = url.replace("://", "://:s3cr%2541t@", 1)  # %25 is '%': the URL's s3cr%41t
        remote = open_remote(machine(tmp_path, "b", in_url).remote)
        assert remote.have_many(SOC, ["k" * 32]) == {"k" * 32}
        remote.close()
    finally:
        for node in cluster.nodes:
            node.client(password=password).config_set("requirepass", "")
