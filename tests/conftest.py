"""Shared fixtures for the configuration tests."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

FAKE_HOME = "/home/tester"


@pytest.fixture
def fake_home(fs) -> Path:
    """A home folder on the fake filesystem (pyfakefs)."""
    fs.create_dir(FAKE_HOME)
    return Path(FAKE_HOME)  # made while pyfakefs is active, so it compares with fake paths


@pytest.fixture
def env(fake_home: Path) -> dict[str, str]:
    """An environment holding only HOME, so the developer's own variables never leak in."""
    return {"HOME": str(fake_home)}


def _serve(binary: str | None, how_to_get_one: str, kind: Callable, folder: Path) -> Iterator:
    """A server of ``kind`` for a session fixture, stopped at its end; the test skipped,
    saying how to get one, without its ``binary``."""
    if binary is None:
        pytest.skip(how_to_get_one)
    server = kind(binary, folder)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real redis-server for the whole run (skipped, saying how to get one, without any)."""
    from helpers_redis import HOW_TO_GET_ONE, RedisServer, find_server

    yield from _serve(find_server(), HOW_TO_GET_ONE, RedisServer, tmp_path_factory.mktemp("redis"))


@pytest.fixture
def redis_url(redis_server) -> str:
    """The server's URL, emptied for this test (started again if a test stopped it)."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    client = redis_server.client()
    client.flushall()
    for user in client.acl_users():
        if user != b"default" and user != "default":
            client.acl_deluser(user)
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def nginx_server(tmp_path_factory: pytest.TempPathFactory):
    """A real nginx with WebDAV for the whole run (skipped, saying how to get one, without)."""
    from helpers_nginx import HOW_TO_GET_ONE, Nginx, find_nginx

    yield from _serve(find_nginx(), HOW_TO_GET_ONE, Nginx, tmp_path_factory.mktemp("nginx"))


@pytest.fixture
def nginx(nginx_server):  # type: ignore[no-untyped-def]
    """The nginx, running (started again if a test stopped it), its stored objects deleted."""
    if nginx_server.proc is None:
        nginx_server.start()
    shutil.rmtree(nginx_server.data)
    nginx_server.data.mkdir()
    return nginx_server


@pytest.fixture(scope="session")
def tls_certificates(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A CA and the certificates it signed (helpers_tls; skipped without openssl)."""
    from helpers_tls import HOW_TO_GET_OPENSSL, Certificates

    if shutil.which("openssl") is None:
        pytest.skip(HOW_TO_GET_OPENSSL)
    return Certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def tls_redis_server(tmp_path_factory: pytest.TempPathFactory, tls_certificates):  # type: ignore[no-untyped-def]
    """A real redis-server speaking TLS only, wanting helpers_tls.PASSWORD, for the whole
    run (skipped, saying how to get one, without a redis-server built with TLS)."""
    from helpers_tls import HOW_TO_GET_ONE, PASSWORD, TlsRedisServer, find_tls_server

    def kind(binary: str, folder: Path) -> TlsRedisServer:
        return TlsRedisServer(binary, folder, tls_certificates, password=PASSWORD)

    yield from _serve(find_tls_server(), HOW_TO_GET_ONE, kind, tmp_path_factory.mktemp("redis-tls"))


@pytest.fixture
def tls_redis(tls_redis_server):  # type: ignore[no-untyped-def]
    """The TLS server, running (started again if a test stopped it), emptied."""
    if tls_redis_server.proc is None or tls_redis_server.proc.poll() is not None:
        tls_redis_server.start()
    client = tls_redis_server.client()
    client.flushall()
    client.close()
    return tls_redis_server


@pytest.fixture
def start_tls_redis(tmp_path: Path, tls_certificates):  # type: ignore[no-untyped-def]
    """Start another TLS server for this test: ``start(**options)`` (TlsRedisServer's
    options: ``presents``, ``clients_need_certs``, ``password``); all stopped at its end."""
    from helpers_tls import HOW_TO_GET_ONE, TlsRedisServer, find_tls_server

    binary = find_tls_server()
    if binary is None:
        pytest.skip(HOW_TO_GET_ONE)
    started: list[TlsRedisServer] = []

    def start(**options: object) -> TlsRedisServer:
        folder = tmp_path / f"redis-tls-{len(started)}"
        server = TlsRedisServer(binary, folder, tls_certificates, **options)  # type: ignore[arg-type]
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()
