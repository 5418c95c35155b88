"""The HTTP remote (http://, opcache/storage/http.py) against a real nginx with WebDAV.

Two machines share entries; damaged and truncated objects are never served
and are replaced; basic auth and a bearer token work and are never shown; a
401, a server that refuses writes and a dead server never fail a compile.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_cache import (
    SOC,
    ToyCompiler,
    compile_within,
    expected_files,
    fake_server,
    machine,
    make_request,
    read_dir,
)
from helpers_nginx import BASIC, TOKEN, Nginx
from helpers_redis import run_in_child

import opcache
from opcache.settings import RemoteSettings
from opcache.storage import RemoteCorrupt, RemoteError
from opcache.storage.entry import make_manifest
from opcache.storage.http import HttpRemote, connect
from opcache.storage.value import pack

KEY = "0123456789abcdef" * 2
OTHER = "fedcba9876543210" * 2


def settings(url: str, **options: object) -> RemoteSettings:
    given = {"password": None, "read_only": False, "prefix": "opcache:1:", "ttl": None}
    given |= {"max_entry_mb": 64, "timeout": 2.0, **options}
    return RemoteSettings(url=url, **given)  # type: ignore[arg-type]


def entry(key: str = KEY, **files: bytes) -> tuple[bytes, dict[str, bytes]]:
    files = files or {"k.o": b"\x7fELF" + bytes(range(256)) * 8, "k.json": b'{"a": 1}'}
    return make_manifest(key, files, 1.5, {"op_type": "Add"}, 1000.0), files


def test_entries_round_trip_as_one_object_each(nginx: Nginx) -> None:
    writer, reader = connect(settings(nginx.url())), connect(settings(nginx.url()))
    manifest, files = entry()
    sent = writer.put(SOC, KEY, manifest, files)
    assert sent == nginx.object_path(KEY).stat().st_size  # bazel-remote's ac/ layout
    got, got_manifest = reader.get(SOC, KEY)
    assert got.files == files and got_manifest == manifest
    assert reader.get(SOC, OTHER) is None
    assert writer.put(SOC, KEY, manifest, files) == 0  # HEAD: there already
    writer.discard(SOC, KEY)
    assert reader.get(SOC, KEY) is None
    writer.close()
    reader.close()


def test_a_batch_is_fetched_on_a_bounded_number_of_kept_connections(nginx: Nginx) -> None:
    r = connect(settings(nginx.url()))
    keys = [f"{i:032x}" for i in range(60)]
    for key in keys[::2]:
        r.put(SOC, key, *entry(key))
    for _ in range(3):
        found = r.get_many(SOC, keys)
        assert sorted(found) == sorted(keys[::2])
        assert all(found[k][0].key == k for k in found)
    assert 1 < len(r._open) <= 8 + 1  # the pool's threads' and this thread's, kept
    assert r.have_many(SOC, keys) == set(keys[::2])  # HEADs: no value sent
    r.close()
    assert not r._open


def test_a_forked_child_uses_connections_and_threads_of_its_own(nginx: Nginx) -> None:
    """The child's batch ran on the parent's pool, whose threads it has not got (it waited
    forever), and its requests on the parent's kept socket (each read the other's answers)."""
    r = connect(settings(nginx.url()))
    keys = [f"{i:032x}" for i in range(64)]
    for key in keys[::2]:
        r.put(SOC, key, *entry(key))
    assert sorted(r.get_many(SOC, keys)) == sorted(keys[::2])  # every pool thread idle now
    parents = r._local.conn.sock.getsockname()

    def child() -> bool:
        found = r.get_many(SOC, keys)
        one = r.get(SOC, keys[0])
        ours = r._local.conn.sock.getsockname()
        r.close()
        return sorted(found) == sorted(keys[::2]) and one is not None and ours != parents

    assert run_in_child(child)
    assert sorted(r.get_many(SOC, keys)) == sorted(keys[::2])  # the parent's go on
    assert r._local.conn.sock.getsockname() == parents
    r.close()


def test_a_value_over_the_server_s_body_limit_stays_local_said_once(
    nginx: Nginx, caplog: pytest.LogCaptureFixture
) -> None:
    """An nginx left at its default body limit (1 MB) answers a big PUT 413: that was a
    RemoteError, which paused the remote's reads too; now the value is not sent."""
    r = connect(settings(nginx.url("small")))
    big = entry(**{"k.o": os.urandom(4096)})
    with caplog.at_level(logging.WARNING, logger="opcache"):
        assert r.put(SOC, KEY, *big) == 0
        assert r.put(SOC, OTHER, *entry(OTHER, **{"k.o": os.urandom(4096)})) == 0
    assert caplog.text.count("HTTP 413") == 1, caplog.text
    small = "00" * 16
    assert r.put(SOC, small, *entry(small)) > 0 and r.get(SOC, small) is not None
    assert r.get_many(SOC, [KEY, OTHER]) == {}
    r.close()


def test_damaged_and_truncated_objects_are_never_served(nginx: Nginx) -> None:
    r = connect(settings(nginx.url()))
    r.put(SOC, KEY, *entry())
    r.put(SOC, OTHER, *entry(OTHER))
    damaged = nginx.object_path(KEY)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    truncated = nginx.object_path(OTHER)
    truncated.write_bytes(truncated.read_bytes()[:-7])
    found = r.get_many(SOC, [KEY, OTHER])
    assert all(isinstance(v, RemoteCorrupt) for v in found.values()) and len(found) == 2
    assert r.put(SOC, KEY, *entry()) > 0  # a bad object is stored over, not kept
    assert r.get(SOC, KEY) is not None


def test_an_object_over_the_entry_cap_is_never_read_whole(nginx: Nginx) -> None:
    r = connect(settings(nginx.url(), max_entry_mb=1))
    nginx.object_path(KEY).parent.mkdir(parents=True, exist_ok=True)
    nginx.object_path(KEY).write_bytes(b"x" * (3 << 20))
    assert isinstance(r.get_many(SOC, [KEY])[KEY], RemoteCorrupt)


def test_two_machines_share_entries_and_a_bad_object_is_replaced(
    tmp_path: Path, nginx: Nginx
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    request = make_request(0)
    with opcache.OpCache(machine(tmp_path, "a", nginx.url())) as a:
        key = a.compile(request, compiler, tmp_path / "out-a").key
    with opcache.OpCache(machine(tmp_path, "b", nginx.url())) as b:
        result = b.compile(request, compiler, tmp_path / "out-b")
        assert (result.status, result.tier) == ("hit", "remote")
    assert compiler.calls() == 1
    assert read_dir(tmp_path / "out-b") == expected_files(request)
    path = nginx.object_path(key)
    path.write_bytes(path.read_bytes()[:-1])
    with opcache.OpCache(machine(tmp_path, "c", nginx.url())) as c:
        result = c.compile(request, compiler, tmp_path / "out-c")
        assert result.status == "miss" and c.stats()["remote_corrupt"] == 1
    assert read_dir(tmp_path / "out-c") == expected_files(request)
    with opcache.OpCache(machine(tmp_path, "d", nginx.url())) as d:
        assert d.compile(request, compiler, tmp_path / "out-d").tier == "remote"


def test_basic_auth_and_a_bearer_token_work_and_are_never_shown(nginx: Nginx) -> None:
    user, password = BASIC
    basic = connect(settings(nginx.url("basic").replace("//", f"//{user}@"), password=password))
    assert basic.put(SOC, KEY, *entry()) > 0 and basic.get(SOC, KEY) is not None
    in_url = connect(settings(nginx.url("basic").replace("//", f"//{user}:{password}@")))
    assert in_url.get(SOC, KEY) is not None
    token = connect(settings(nginx.url("token"), password=TOKEN))
    assert token.put(SOC, KEY, *entry()) > 0 and token.get(SOC, KEY) is not None
    wrong = connect(settings(nginx.url("token"), password="guess"))
    with pytest.raises(RemoteError, match="refused the credentials") as refused:
        wrong.get(SOC, KEY)
    shown = f"{in_url.where} {refused.value} {token.where}"
    assert password not in shown and TOKEN not in shown and "guess" not in str(refused.value)
    anonymous = connect(settings(nginx.url("basic")))
    with pytest.raises(RemoteError, match=r"wants credentials.*OPCACHE_REMOTE_PASSWORD"):
        anonymous.get(SOC, KEY)


def test_a_401_never_fails_a_compile_and_the_password_is_never_shown(
    tmp_path: Path, nginx: Nginx, caplog: pytest.LogCaptureFixture
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    url = nginx.url("basic").replace("//", "//ci:wrong-pass@")
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(machine(tmp_path, "a", url)) as a,
    ):
        result = a.compile(make_request(0), compiler, tmp_path / "out")
        stats = a.stats()
    assert result.status == "miss" and stats["remote_errors"] == 1
    assert read_dir(tmp_path / "out") == expected_files(make_request(0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "refused the credentials" in warnings[0]
    assert "wrong-pass" not in caplog.text + json.dumps(stats, default=str)


def test_a_server_that_refuses_writes_is_read_from_with_one_warning(
    tmp_path: Path, nginx: Nginx, caplog: pytest.LogCaptureFixture
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(machine(tmp_path, "a", nginx.url())) as a:
        a.compile(make_request(0), compiler, tmp_path / "o0")
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(machine(tmp_path, "b", nginx.url("ro"))) as b,
    ):
        assert b.compile(make_request(0), compiler, tmp_path / "o1").tier == "remote"
        for i in (1, 2):
            assert b.compile(make_request(i), compiler, tmp_path / f"o{i}b").status == "miss"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "refuses our writes (HTTP 403)" in warnings[0]


def test_a_dead_server_never_fails_a_compile(
    tmp_path: Path, nginx: Nginx, caplog: pytest.LogCaptureFixture
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    nginx.stop()
    with (
        caplog.at_level(logging.WARNING, logger="opcache"),
        opcache.OpCache(machine(tmp_path, "a", nginx.url(), timeout=1)) as a,
    ):
        for i in range(3):
            result = a.compile(make_request(i), compiler, tmp_path / f"o{i}")
            assert result.status == "miss"
            assert read_dir(tmp_path / f"o{i}") == expected_files(make_request(i))
        assert a.stats()["remote_errors"] == 1  # then paused
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not used for" in warnings[0]


def test_the_url_is_checked(tmp_path: Path) -> None:
    for url, problem in (
        ("http://", "name the server's host"),
        ("https://cache:99999/x", "port"),
        ("http://cache/x?layout=flat", "query may hold"),
    ):
        with pytest.raises(opcache.ConfigError, match=problem):
            machine(tmp_path, "a", url)
    assert machine(tmp_path, "a", "https://u:pw@cache.example:8443/ops").remote.shown_url == (
        "https://u:***@cache.example:8443/ops"
    )


def test_a_percent_encoded_path_is_sent_as_written(nginx: Nginx) -> None:
    r = connect(settings(nginx.url("cache/team%2Da")))  # the server's folder team-a
    r.put(SOC, KEY, *entry())
    name = hashlib.sha256(f"opcache:1:{SOC}:{KEY}".encode()).hexdigest()
    assert (nginx.data / "team-a" / "ac" / name).is_file()
    assert r.get(SOC, KEY) is not None


def test_https_with_the_servers_ca_and_an_untrusted_server_never_fails_a_compile(
    tmp_path: Path, nginx: Nginx, monkeypatch: pytest.MonkeyPatch
) -> None:
    if nginx.tls_port is None:
        pytest.skip("no openssl to make the TLS server's certificate (apt-get install openssl)")
    untrusted = connect(settings(nginx.tls_url()))
    with pytest.raises(RemoteError, match="CERTIFICATE_VERIFY_FAILED"):
        untrusted.get(SOC, KEY)
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(machine(tmp_path, "a", nginx.tls_url())) as a:
        assert a.compile(make_request(0), compiler, tmp_path / "o").status == "miss"
        assert a.stats()["remote_errors"] == 1  # the compile went on
    monkeypatch.setenv("SSL_CERT_FILE", str(nginx.certificate))  # OpenSSL's own variable
    trusted = connect(settings(nginx.tls_url()))
    assert trusted.put(SOC, KEY, *entry()) > 0 and trusted.get(SOC, KEY) is not None
    assert nginx.object_path(KEY).is_file()


def test_a_password_from_the_environment_is_sent_as_written(nginx: Nginx) -> None:
    key = "5" * 32
    token = connect(settings(nginx.url("token"), password=TOKEN))
    token.put(SOC, key, *entry(key))
    encoded = connect(settings(nginx.url("token").replace("//", "//:%74%30ken@")))
    assert encoded.get(SOC, key) is not None  # a URL's password is percent-decoded
    literal = connect(settings(nginx.url("token"), password="%74%30ken"))
    with pytest.raises(RemoteError, match="refused the credentials"):
        literal.get(SOC, key)  # the variable's is not: it is another token


def test_an_upload_cut_off_half_way_leaves_nothing_visible(nginx: Nginx) -> None:
    r = connect(settings(nginx.url()))
    manifest, files = entry()
    value = pack(KEY, manifest, files)
    path = "/cache/ac/" + nginx.object_path(KEY).name
    with socket.create_connection(("127.0.0.1", nginx.port), timeout=10) as s:
        head = f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(value)}\r\n\r\n"
        s.sendall(head.encode() + value[: len(value) // 2])  # then the writer dies
    assert r.get(SOC, KEY) is None and not nginx.object_path(KEY).exists()
    assert r.put(SOC, KEY, manifest, files) == len(value)
    assert r.get(SOC, KEY) is not None


def test_a_token_with_a_control_character_is_never_in_an_error(nginx: Nginx) -> None:
    """Settings built by hand skip the check on reading them: http.client refuses the header
    and quotes it in its error, which must not reach the message."""
    token = connect(settings(nginx.url("token"), password=TOKEN + "-SECRET\n"))
    with pytest.raises(RemoteError, match="cannot be sent") as refused:
        token.get(SOC, KEY)
    assert "SECRET" not in str(refused.value)


@pytest.fixture
def dripping() -> Iterator[str]:
    """The URL of a server that answers a 200 of 100,000 bytes and sends them a byte every
    0.1 s, until the client hangs up or the test ends."""

    def answer(conn: socket.socket, ended: threading.Event) -> None:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not ended.wait(0.1):
            conn.sendall(b"x")

    with fake_server(answer) as port:
        yield f"http://127.0.0.1:{port}/c"


def test_a_server_that_drips_its_answer_costs_a_miss_within_the_deadline(
    tmp_path: Path, dripping: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The timeout bounds a whole request, not each read: a byte a second never holds a
    compile (each read got the whole timeout anew, so the compile waited for every byte)."""
    with caplog.at_level(logging.WARNING, logger="opcache"):
        result, stats = compile_within(tmp_path, dripping, timeout=0.5)
    assert result.status == "miss" and stats["remote_errors"] == 1
    assert read_dir(tmp_path / "o") == expected_files(make_request(0))
    assert "no whole answer within the timeout" in caplog.text


def test_a_retry_on_a_new_connection_keeps_the_request_s_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kept connection the server hangs up is tried again on a new one, within the
    first try's deadline: a server that hung up just before the timeout each time made
    one look last twice the timeout."""
    requests = []

    def answer(conn: socket.socket, ended: threading.Event) -> None:
        while conn.recv(65536):
            requests.append(1)
            if len(requests) == 2:
                return  # the kept connection hung up on the second request
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")

    deadlines = []
    exchange = HttpRemote._exchange

    def watched(self, conn, method, path, body, deadline):  # type: ignore[no-untyped-def]
        deadlines.append(deadline)
        return exchange(self, conn, method, path, body, deadline)

    monkeypatch.setattr(HttpRemote, "_exchange", watched)
    with fake_server(answer) as port:
        remote = connect(settings(f"http://127.0.0.1:{port}/c", timeout=5))
        assert remote.get(SOC, KEY) is None
        assert remote.get(SOC, KEY) is None  # tried again on a new connection
        remote.close()
    assert len(requests) == 3 and len(deadlines) == 3
    assert deadlines[2] == deadlines[1]
