"""Shared fixtures for the configuration tests."""

from __future__ import annotations

import shutil
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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real redis-server for the whole run (skipped, saying how to get one, without any)."""
    from helpers_redis import HOW_TO_GET_ONE, RedisServer, find_server

    binary = find_server()
    if binary is None:
        pytest.skip(HOW_TO_GET_ONE)
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


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

    binary = find_nginx()
    if binary is None:
        pytest.skip(HOW_TO_GET_ONE)
    server = Nginx(binary, tmp_path_factory.mktemp("nginx"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nginx(nginx_server):  # type: ignore[no-untyped-def]
    """The nginx, running (started again if a test stopped it), its stored objects deleted."""
    if nginx_server.proc is None:
        nginx_server.start()
    shutil.rmtree(nginx_server.data)
    nginx_server.data.mkdir()
    return nginx_server
