"""The Redis remote over TLS (rediss://, rediss+cluster://) against real servers speaking it.

A redis-server built with TLS (tests/helpers_tls.py; Debian's, which .ci/run
installs) on certificates made for the run.  What a user relies on: a compile
on one machine is a remote hit on another, byte for byte, over TLS; a server
the settings do not trust (a certificate of another CA, or for another name
while the host name is checked) is never used, and costs the compile nothing
but a warning, which shows no password and no traceback; a server that wants a
client certificate takes the one ``ssl_certfile``/``ssl_keyfile`` give (a key
encrypted: opened with ``ssl_password``, which no message shows); the
command line's ``opcache remote stats`` and ``opcache compile`` do the same;
and all of it through a Redis Cluster whose nodes and bus speak TLS only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers_cache import ToyCompiler, expected_files, machine, make_request, read_dir
from helpers_cluster import Cluster, find_cli
from helpers_redis import RedisServer
from helpers_tls import (
    HOW_TO_GET_ONE,
    KEY_PASSWORD,
    PASSWORD,
    Certificates,
    TlsRedisServer,
    has_tls,
    tls_query,
)

import opcache

Start = Callable[..., TlsRedisServer]


def entry_names(server: RedisServer) -> set[bytes]:
    """The entries the server holds (claims left out: they expire by themselves)."""
    return {name for name in server.client().keys("*") if not name.endswith(b":claim")}


def compile_once(
    tmp_path: Path, name: str, url: str, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture
) -> tuple[opcache.CompileResult, dict, list[logging.LogRecord]]:
    """(result, stats, warnings) of machine ``name``'s compile of request 0 with ``url``."""
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(machine(tmp_path, name, url)) as cache,
    ):
        result = cache.compile(make_request(0), compiler, tmp_path / f"out-{name}")
        stats = cache.stats()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    return result, stats, warnings


def assert_failed_closed(
    tmp_path: Path,
    name: str,
    result: opcache.CompileResult,
    stats: dict,
    warnings: list[logging.LogRecord],
    why: str,
) -> None:
    """The compile went on without the remote: compiled here, correct, one warning
    saying ``why`` (a pattern) without the password or a traceback, one remote error,
    no hit."""
    assert (result.status, result.tier) == ("miss", "")
    assert read_dir(tmp_path / f"out-{name}") == expected_files(make_request(0))
    assert (stats["remote_hits"], stats["remote_errors"]) == (0, 1)
    assert len(warnings) == 1, [w.getMessage() for w in warnings]
    said = warnings[0].getMessage()
    assert "not used for" in said and re.search(why, said), said
    assert PASSWORD not in said and "Traceback" not in said
    assert warnings[0].exc_info is None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_compile_is_a_remote_hit_on_another_machine_over_tls(
    tmp_path: Path, tls_redis: TlsRedisServer, host: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = tls_redis.tls_url(host=host)  # the server's CA, its password, the name checked
    compiler = ToyCompiler(tmp_path / "calls")
    first, stats, warnings = compile_once(tmp_path, "a", url, compiler, caplog)
    assert (first.status, stats["remote_stores"], warnings) == ("miss", 1, [])
    assert len(entry_names(tls_redis)) == 1  # stored on the TLS server
    second, stats, warnings = compile_once(tmp_path, "b", url, compiler, caplog)
    assert (second.status, second.tier, stats["remote_hits"], warnings) == ("hit", "remote", 1, [])
    assert compiler.calls() == 1
    assert read_dir(tmp_path / "out-b") == read_dir(tmp_path / "out-a")
    assert read_dir(tmp_path / "out-b") == expected_files(make_request(0))


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("another CA", "CERTIFICATE_VERIFY_FAILED"),
        ("another name, checked", "CERTIFICATE_VERIFY_FAILED"),
        ("another name, checked by default", "CERTIFICATE_VERIFY_FAILED"),
        ("a wrong password", "refused the user name or password"),
    ],
)
def test_a_server_not_to_be_trusted_is_never_used_and_costs_a_warning(
    tmp_path: Path,
    tls_redis: TlsRedisServer,
    start_tls_redis: Start,
    tls_certificates: Certificates,
    case: str,
    why: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The entry is there, stored by a machine that trusts the server; the machine
    that may not (or whose password is wrong) compiles it itself, stores nothing,
    and says why once, its password masked."""
    if case.startswith("another name"):
        server = start_tls_redis(presents=tls_certificates.other_name, password=PASSWORD)
        # Trusted with the name unchecked: ssl_check_hostname=false is false, not "false".
        trusted = server.tls_url(ssl_check_hostname="false")
        checked = {"ssl_check_hostname": "true"} if case.endswith("checked") else {}
        untrusted = server.tls_url(**checked)
    else:
        server = tls_redis
        trusted = server.tls_url()
        if case == "another CA":
            untrusted = server.tls_url(ssl_ca_certs=tls_certificates.other_ca.cert)
        else:
            untrusted = server.tls_url(password="not-" + PASSWORD)
    compiler = ToyCompiler(tmp_path / "calls")
    stored, stats, _ = compile_once(tmp_path, "a", trusted, compiler, caplog)
    assert (stored.status, stats["remote_stores"]) == ("miss", 1)
    before = entry_names(server)
    assert len(before) == 1
    result, stats, warnings = compile_once(tmp_path, "b", untrusted, compiler, caplog)
    assert_failed_closed(tmp_path, "b", result, stats, warnings, why)
    if case == "a wrong password":
        assert "not-" + PASSWORD not in warnings[0].getMessage()
    assert compiler.calls() == 2  # compiled again: no hit from that server
    assert entry_names(server) == before  # and nothing sent to it


def a_stores_and_b_hits(
    tmp_path: Path, url: str, compiler: ToyCompiler, caplog: pytest.LogCaptureFixture
) -> None:
    """Cache a compiles request 0 and stores it through ``url``; cache b gets it as a
    remote hit; neither warns."""
    first, stats, warnings = compile_once(tmp_path, "a", url, compiler, caplog)
    assert (first.status, stats["remote_stores"], warnings) == ("miss", 1, [])
    second, stats, warnings = compile_once(tmp_path, "b", url, compiler, caplog)
    assert (second.tier, stats["remote_hits"], warnings) == ("remote", 1, [])


def test_a_server_that_wants_a_client_certificate_takes_the_urls(
    tmp_path: Path,
    start_tls_redis: Start,
    tls_certificates: Certificates,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = start_tls_redis(clients_need_certs=True)
    compiler = ToyCompiler(tmp_path / "calls")
    result, stats, warnings = compile_once(tmp_path, "none", server.tls_url(), compiler, caplog)
    refused = "certificate required|handshake failure|EOF occurred|reset by peer"
    assert_failed_closed(tmp_path, "none", result, stats, warnings, refused)
    assert entry_names(server) == set()
    client = tls_certificates.client
    url = server.tls_url(ssl_certfile=client.cert, ssl_keyfile=client.key)
    a_stores_and_b_hits(tmp_path, url, compiler, caplog)
    assert compiler.calls() == 2  # the one without the certificate's, and a's
    assert read_dir(tmp_path / "out-b") == read_dir(tmp_path / "out-a")


def test_an_encrypted_client_key_is_opened_with_ssl_password_never_shown(
    tmp_path: Path,
    start_tls_redis: Start,
    tls_certificates: Certificates,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = start_tls_redis(clients_need_certs=True)
    compiler = ToyCompiler(tmp_path / "calls")
    cert, key = tls_certificates.client.cert, tls_certificates.client_key_encrypted
    wrong = server.tls_url(ssl_certfile=cert, ssl_keyfile=key, ssl_password="not-the-passphrase")
    result, stats, warnings = compile_once(tmp_path, "wrong", wrong, compiler, caplog)
    assert_failed_closed(tmp_path, "wrong", result, stats, warnings, r"ssl_password=\*\*\*")
    assert "not-the-passphrase" not in warnings[0].getMessage()
    url = server.tls_url(ssl_certfile=cert, ssl_keyfile=key, ssl_password=KEY_PASSWORD)
    a_stores_and_b_hits(tmp_path, url, compiler, caplog)
    assert read_dir(tmp_path / "out-b") == read_dir(tmp_path / "out-a")


# -- the command line ------------------------------------------------------------------


def run_opcache(*args: str, env: dict[str, str], cwd: Path, status: int = 0):  # type: ignore[no-untyped-def]
    done = subprocess.run(
        [sys.executable, "-m", "opcache", *args], env=env, cwd=cwd, capture_output=True, text=True
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == status, done.stdout + done.stderr
    return done


def cli_env(tmp_path: Path, cache: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "OPCACHE_DIR": str(tmp_path / cache)}


def write_spec(tmp_path: Path) -> Path:
    (tmp_path / "add.c").write_text("int add(int a, int b) { return a + b; }\n")
    tensor = {"shape": [4, 64], "dtype": "float32", "format": "ND"}
    spec = {
        "op_type": "Add",
        "op_name": "add_small",
        "soc_version": "Ascend910B1",
        "inputs": [tensor, tensor],
        "outputs": [tensor],
        "sources": {"add.c": "add.c"},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    return tmp_path / "spec.json"


def test_opcache_compile_shares_over_tls_and_warns_once_on_an_untrusted_server(
    tmp_path: Path, tls_redis: TlsRedisServer, tls_certificates: Certificates
) -> None:
    spec = write_spec(tmp_path)
    template = "cp {source} {workdir}/{kernel_name}.txt"
    argv = ["compile", "--op", str(spec), "--compiler", "command", "--template", template]
    argv += ["--json"]
    untrusted = tls_redis.tls_url(ssl_ca_certs=tls_certificates.other_ca.cert)
    env = {**cli_env(tmp_path, "c0"), "OPCACHE_REMOTE": untrusted}
    done = run_opcache(*argv, "--output", "b0", env=env, cwd=tmp_path)
    assert json.loads(done.stdout)["summary"]["misses"] == 1
    assert done.stderr.count("opcache: warning:") == 1 and "not used for" in done.stderr
    assert "CERTIFICATE_VERIFY_FAILED" in done.stderr and PASSWORD not in done.stderr
    assert entry_names(tls_redis) == set()
    for cache, summary in (("c1", "misses"), ("c2", "hits")):
        env = {**cli_env(tmp_path, cache), "OPCACHE_REMOTE": tls_redis.tls_url()}
        done = run_opcache(*argv, "--output", cache, env=env, cwd=tmp_path)
        assert json.loads(done.stdout)["summary"][summary] == 1, done.stdout
        assert done.stderr == ""
    assert read_dir(tmp_path / "c2" / "add_small") == read_dir(tmp_path / "b0" / "add_small")
    assert len(entry_names(tls_redis)) == 1


def test_opcache_remote_stats_over_tls(
    tmp_path: Path, tls_redis: TlsRedisServer, tls_certificates: Certificates
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(machine(tmp_path, "a", tls_redis.tls_url())) as a:
        requests = [make_request(i) for i in range(3)]
        a.compile_many(requests, compiler, lambda r: tmp_path / "o" / r.op_name)
    env = cli_env(tmp_path, "cache")
    text = run_opcache("remote", "stats", "--remote", tls_redis.tls_url(), env=env, cwd=tmp_path)
    assert "total                   3" in text.stdout, text.stdout
    data = json.loads(
        run_opcache(
            "remote", "stats", "--json", "--remote", tls_redis.tls_url(), env=env, cwd=tmp_path
        ).stdout
    )
    assert data["chips"]["Ascend910B1"]["entries"] == 3
    untrusted = tls_redis.tls_url(ssl_ca_certs=tls_certificates.other_ca.cert)
    said = run_opcache("remote", "stats", "--remote", untrusted, env=env, cwd=tmp_path, status=1)
    assert said.stderr.startswith("opcache: error: rediss://:***@127.0.0.1:"), said.stderr
    assert said.stderr.count("\n") == 1 and "CERTIFICATE_VERIFY_FAILED" in said.stderr
    assert PASSWORD not in said.stderr and said.stdout == ""


# -- a Redis Cluster over TLS ----------------------------------------------------------


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory, tls_certificates: Certificates):  # type: ignore[no-untyped-def]
    """Three primaries speaking TLS only (their cluster bus too), wanting a client
    certificate of the CA (helpers_cluster's ``tls``)."""
    from helpers_tls import find_tls_server

    binary = find_tls_server()
    cli = binary and find_cli(binary)
    if not binary or not cli or not has_tls(cli):
        pytest.skip(HOW_TO_GET_ONE + " (and its redis-cli)")
    made = Cluster(binary, cli, tmp_path_factory.mktemp("tls-cluster"), tls=tls_certificates)
    made.start()
    yield made
    made.stop()


@pytest.fixture
def cluster(tls_cluster: Cluster) -> Cluster:
    """The TLS cluster, every node up and emptied."""
    tls_cluster.ready()
    return tls_cluster


def test_a_batch_over_every_primary_is_remote_hits_on_another_machine_over_tls(
    tmp_path: Path, cluster: Cluster
) -> None:
    """Every primary's connections are TLS with the URL's CA and client certificate
    (the nodes refuse a client without one): a batch spread over all their slots is
    stored by one machine and fetched whole by another."""
    assert cluster.url.startswith("rediss+cluster://")
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(i) for i in range(16)]
    with opcache.OpCache(machine(tmp_path, "a", cluster.url)) as a:
        a.compile_many(requests, compiler, lambda r: tmp_path / "a" / r.op_name)
        assert a.stats()["remote_stores"] == 16
    assert all(node.client().dbsize() > 0 for node in cluster.nodes)  # over every primary
    with opcache.OpCache(machine(tmp_path, "b", cluster.url)) as b:
        results = b.compile_many(requests, compiler, lambda r: tmp_path / "b" / r.op_name)
        stats = b.stats()
    assert [r.tier for r in results] == ["remote"] * 16
    assert (stats["remote_hits"], stats["remote_errors"]) == (16, 0)
    assert compiler.calls() == 16
    for request in requests:
        got = read_dir(tmp_path / "b" / request.op_name)
        assert got == read_dir(tmp_path / "a" / request.op_name) == expected_files(request)


def test_opcache_remote_stats_counts_every_tls_primary(tmp_path: Path, cluster: Cluster) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(i) for i in range(12)]
    with opcache.OpCache(machine(tmp_path, "a", cluster.url)) as a:
        a.compile_many(requests, compiler, lambda r: tmp_path / "o" / r.op_name)
    env = cli_env(tmp_path, "cache")
    said = run_opcache("remote", "stats", "--json", "--remote", cluster.url, env=env, cwd=tmp_path)
    assert json.loads(said.stdout)["chips"]["Ascend910B1"]["entries"] == 12


@pytest.mark.parametrize("case", ["another CA", "no client certificate"])
def test_a_cluster_not_to_be_trusted_is_never_used_and_costs_a_warning(
    tmp_path: Path,
    cluster: Cluster,
    tls_certificates: Certificates,
    case: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The cluster's client connects as it is made: refused there, the compile goes
    on, says why once (the URL's password masked), and counts it, as for one server."""
    compiler = ToyCompiler(tmp_path / "calls")
    stored, stats, _ = compile_once(tmp_path, "a", cluster.url, compiler, caplog)
    assert (stored.status, stats["remote_stores"]) == ("miss", 1)
    client = tls_certificates.client
    if case == "another CA":
        ca, why = tls_certificates.other_ca.cert, "CERTIFICATE_VERIFY_FAILED"
        query = tls_query(tls_certificates, ssl_ca_certs=ca, ssl_certfile=client.cert,
                          ssl_keyfile=client.key)  # fmt: skip
    else:
        why = "certificate required|handshake failure|EOF occurred|reset by peer"
        query = tls_query(tls_certificates)
    untrusted = f"rediss+cluster://:{PASSWORD}@{cluster.hosts}{query}"
    result, stats, warnings = compile_once(tmp_path, "b", untrusted, compiler, caplog)
    assert_failed_closed(tmp_path, "b", result, stats, warnings, why)
    ((shown, count),) = stats["remote_errors_by_url"].items()
    assert shown.startswith("rediss+cluster://:***@127.0.0.1:") and count == 1
    assert compiler.calls() == 2  # compiled again: no hit from that cluster
    assert sum(len(entry_names(node)) for node in cluster.nodes) == 1  # nor a store
