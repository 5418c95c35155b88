"""Remote URLs and servers that try opcache's promises: a URL urlsplit refuses is a
setting's error, never a traceback; a server without HELLO is used, and never
shown the password it quotes back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers_cache import SOC, compile_within
from helpers_cluster import _CLUSTER_ARGS, _cluster_port
from helpers_redis import RedisServer, find_server

from opcache import ConfigError, resolve_settings
from opcache.cli import main
from opcache.storage import RemoteError, open_remote
from opcache.storage.entry import make_manifest

KEY = "0123456789abcdef" * 2

# Each an unbalanced bracket, which urlsplit reads as an IPv6 host's half.
BRACKETED = [
    ("http://u:pa[ss@h/x", "percent-encode '[' and ']'"),
    ("redis+cluster://u:pa]ss@127.0.0.1:9", "percent-encode '[' and ']'"),
    ("redis://u:p[w@h:1/0", "percent-encode '[' and ']'"),
    ("http://[::1/x", "needs its ']'"),
    ("redis+cluster://[::1", "needs its ']'"),
    ("redis+cluster://h:7000,[::1:7001", "needs its ']'"),
]


@pytest.mark.parametrize(("url", "why"), BRACKETED)
def test_a_url_with_an_unbalanced_bracket_is_refused_when_read(
    tmp_path, url: str, why: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        resolve_settings(remote=url, environ={"HOME": str(tmp_path)})
    assert why in str(raised.value)
    settings = resolve_settings(environ={"HOME": str(tmp_path), "OPCACHE_REMOTE": url})
    assert settings.remote is None and why in settings.remote_error


@pytest.mark.parametrize("command", [["remote", "stats"], ["cann", "push"], ["cann", "pull"]])
def test_a_url_with_an_unbalanced_bracket_is_one_error_line(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, command
) -> None:
    """These ended in urlsplit's ``ValueError: Invalid IPv6 URL``, a traceback."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OPCACHE_REMOTE", raising=False)
    for url, why in BRACKETED:
        argv = [*command, "--remote", url, "--op_compiler_cache_dir", str(tmp_path / "ops")]
        if command[0] == "cann":
            argv += ["--soc_version", "Ascend910B1"]
        status = main(argv)
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err, err
        assert err.startswith("opcache: error: remote=") and why in err, err
        assert err.count("\n") == 1 and "pa[ss" not in err and "pa]ss" not in err


def test_what_urlsplit_refuses_is_a_problem_even_past_the_other_checks(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last check is urlsplit's own (and its port's): whatever the checks before
    miss is refused as they refuse, not a ValueError where the URL is used."""
    from opcache import settings

    monkeypatch.setattr(settings, "_form_problem", lambda url: None)
    for url in ("http://[::1/x", "redis://h:99999/0"):
        with pytest.raises(ConfigError, match="is not valid: "):
            resolve_settings(remote=url, environ={"HOME": str(tmp_path)})
    assert resolve_settings(remote="redis+cluster://h:1,h:2", environ={"HOME": str(tmp_path)})


# -- a server without HELLO (Redis 5, or one that renamed it away) --------------------------


class _Resp2Server(RedisServer):
    """A redis-server the helpers' client (RESP3 with redis-py 8) cannot talk to without
    HELLO: theirs told to speak RESP2."""

    def client(self, **options: object):  # type: ignore[no-untyped-def]
        return super().client(protocol=2, **options)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """``started(*options)``: a redis-server of this test's own, with ``options``."""
    binary = find_server()
    if binary is None:
        pytest.skip("no redis-server")
    servers: list[RedisServer] = []

    def start(*options: str) -> RedisServer:
        server = _Resp2Server(binary, tmp_path / f"redis{len(servers)}")
        if "--cluster-enabled" in options:
            server.port = _cluster_port()  # (its bus port, 10000 above, free too)
        servers.append(server)
        server.start(*options)
        return server

    yield start
    for server in servers:
        server.stop()


def _open(url: str, password: str | None = None):  # type: ignore[no-untyped-def]
    env = {"HOME": "/nowhere"} | ({} if password is None else {"OPCACHE_REMOTE_PASSWORD": password})
    return open_remote(resolve_settings(remote={"url": url}, environ=env).remote)


def _entry() -> tuple[bytes, dict[str, bytes]]:
    files = {"k.o": b"\x7fELF" * 100}
    return make_manifest(KEY, files, 1.0, {"op_type": "Add"}, 1000.0), files


def _one_node_clusters(nodes: list[RedisServer]) -> list[str]:
    """The URLs of ``nodes``, started cluster nodes, each made a cluster of its own
    (together: each waits a while after its start before it says it is whole)."""
    for node in nodes:
        node.client().execute_command("CLUSTER ADDSLOTS", *range(16384))
    deadline = time.monotonic() + 10
    for node in nodes:
        while node.client().execute_command("CLUSTER INFO")["cluster_state"] != "ok":
            assert time.monotonic() < deadline, "a one node cluster is not whole"
            time.sleep(0.02)
    return [f"redis+cluster://127.0.0.1:{node.port}" for node in nodes]


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_a_server_without_hello_is_used_with_or_without_a_password(started, scheme) -> None:
    """redis-py 8 opens with ``HELLO 3``: such a server refused every connection."""
    options = ("--rename-command", "HELLO", "", *(_CLUSTER_ARGS if "cluster" in scheme else ()))
    plain, locked = started(*options), started(*options)
    urls = [node.url for node in (plain, locked)]
    if "cluster" in scheme:
        urls = _one_node_clusters([plain, locked])
    locked.client().config_set("requirepass", "sesame")
    for r in (_open(urls[0]), _open(urls[1], "sesame")):
        assert r.put(SOC, KEY, *_entry()) > 0
        assert r.get(SOC, KEY) is not None
        claim = r.claim(SOC, "f" * 32, 5)  # (the claims' scripts, answered in RESP2)
        assert claim is not None and claim.owned
        claim.release()
        assert r.usage()["chips"][SOC]["entries"] == 1
        r.close()
    with pytest.raises(RemoteError, match=r"wants a password|cannot use"):
        _open(urls[1]).get(SOC, KEY)


LONG = "L0ng-" + "x" * 200  # past the 128 characters Redis quotes of a refused command


@pytest.mark.parametrize(
    ("written", "password", "sent"),
    [
        ("", "sesame", "sesame"),
        ("", LONG, LONG),
        ("u:se%5Bsa%40me@", None, "se[sa@me"),  # percent-decoded from the URL, then sent
    ],
    ids=["env", "long", "url"],
)
def test_a_password_the_server_quotes_back_is_never_shown(
    started, tmp_path: Path, monkeypatch, capsys, caplog, written, password, sent
) -> None:
    """A server without the command that carries the password (HELLO, AUTH) refuses it
    quoting its arguments: "unknown command `HELLO`, with args beginning with: `3`,
    `AUTH`, `default`, `sesame`", which went into the warning and the error line."""
    server = started("--rename-command", "HELLO", "", "--rename-command", "AUTH", "")
    url = f"redis://{written}127.0.0.1:{server.port}"
    with pytest.raises(RemoteError) as raised:
        _open(url, password).get(SOC, KEY)
    message = str(raised.value)
    assert "unknown command" in message, message
    shown = [message]
    with caplog.at_level(logging.WARNING, logger="opcache"):
        result, _ = compile_within(tmp_path, url, password=password)
    assert result.status == "miss" and "not used for" in caplog.text
    shown.append(caplog.text)
    monkeypatch.setenv("HOME", str(tmp_path))
    if password is not None:
        monkeypatch.setenv("OPCACHE_REMOTE_PASSWORD", password)
    argv = ["remote", "stats", "--remote", url, "--op_compiler_cache_dir", str(tmp_path / "o2")]
    assert main(argv) == 1
    shown.append(capsys.readouterr().err)
    assert shown[-1].startswith("opcache: error: ")
    for text in shown:
        assert sent[:8] not in text and "se%5Bsa" not in text, text
