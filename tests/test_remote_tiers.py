"""Remotes in tiers (OPCACHE_REMOTE="<nearest> <farther> ...", opcache/storage/tiers.py).

With a real Redis, a real nginx and a shared folder: looked up in order, a
hit backfilled into the nearer tiers, stores to every writable tier, each
tier read-only on its own, a dead tier costs only itself.
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
from pathlib import Path

import pytest
from helpers_cache import (
    SOC,
    ToyCompiler,
    expected_files,
    fake_server,
    machine,
    make_request,
    read_dir,
)
from helpers_nginx import Nginx

import opcache


@pytest.fixture
def share(tmp_path: Path) -> Path:
    folder = tmp_path / "share"
    folder.mkdir()
    return folder


def in_folder(share: Path, key: str) -> Path:
    return share / SOC / key[:2] / key


def stored_by_a(tmp_path: Path, url: str, compiler: ToyCompiler) -> str:
    """Machine a compiles request 0 (a miss, stored in the writable tiers): its key."""
    with opcache.OpCache(machine(tmp_path, "a", url)) as a:
        return a.compile(make_request(0), compiler, tmp_path / "out-a").key


def a_remote_hit_on_b(tmp_path: Path, url: str, compiler: ToyCompiler) -> None:
    """Machine b gets request 0 whole from a remote tier: nothing compiled but a's."""
    with opcache.OpCache(machine(tmp_path, "b", url)) as b:
        result = b.compile(make_request(0), compiler, tmp_path / "out-b")
    assert (result.status, result.tier) == ("hit", "remote")
    assert read_dir(tmp_path / "out-b") == expected_files(make_request(0))
    assert compiler.calls() == 1


def test_stores_go_to_every_tier_and_a_far_hit_is_backfilled_near(
    tmp_path: Path, nginx: Nginx, share: Path
) -> None:
    url = f"file://{share} {nginx.url()}"
    compiler = ToyCompiler(tmp_path / "calls")
    key = stored_by_a(tmp_path, url, compiler)
    assert in_folder(share, key).is_dir() and nginx.object_path(key).is_file()
    shutil.rmtree(share / SOC)  # the near tier lost it (aged, another site's folder)
    a_remote_hit_on_b(tmp_path, url, compiler)
    assert in_folder(share, key).is_dir()  # backfilled


def test_each_tier_is_read_only_on_its_own(tmp_path: Path, nginx: Nginx, share: Path) -> None:
    url = f"file://{share} {nginx.url()}?read_only=true"
    compiler = ToyCompiler(tmp_path / "calls")
    key = stored_by_a(tmp_path, url, compiler)
    assert in_folder(share, key).is_dir() and not nginx.object_path(key).exists()
    # The far tier, read-only, is still read; nothing is backfilled into it.
    with opcache.OpCache(machine(tmp_path, "w", nginx.url())) as w:
        key1 = w.compile(make_request(1), compiler, tmp_path / "o1").key
    with opcache.OpCache(machine(tmp_path, "b", url)) as b:
        assert b.compile(make_request(1), compiler, tmp_path / "o1b").tier == "remote"
    assert in_folder(share, key1).is_dir()
    # Read-only for all: nothing written anywhere.
    with opcache.OpCache(machine(tmp_path, "c", url, read_only=True)) as c:
        key2 = c.compile(make_request(2), compiler, tmp_path / "o2").key
    assert not in_folder(share, key2).exists() and not nginx.object_path(key2).exists()


def test_a_bad_value_in_one_tier_is_taken_sound_from_the_next(
    tmp_path: Path, nginx: Nginx, share: Path
) -> None:
    url = f"file://{share} {nginx.url()}"
    compiler = ToyCompiler(tmp_path / "calls")
    key = stored_by_a(tmp_path, url, compiler)
    for artifact in in_folder(share, key).iterdir():
        if artifact.name != "MANIFEST":
            artifact.write_bytes(b"planted")
    a_remote_hit_on_b(tmp_path, url, compiler)


def test_a_dead_tier_costs_only_itself(
    tmp_path: Path, nginx: Nginx, share: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nginx.stop()
    url = f"{nginx.url()} file://{share}"
    compiler = ToyCompiler(tmp_path / "calls")
    with caplog.at_level(logging.WARNING, logger="opcache"):
        with opcache.OpCache(machine(tmp_path, "a", url, timeout=1)) as a:
            for i in range(3):
                assert a.compile(make_request(i), compiler, tmp_path / f"o{i}").status == "miss"
            assert a.stats()["remote_stores"] == 3  # into the folder
        with opcache.OpCache(machine(tmp_path, "b", url, timeout=1)) as b:
            assert b.compile(make_request(0), compiler, tmp_path / "o-b").tier == "remote"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert all(nginx.url() in w for w in warnings) and 1 <= len(warnings) <= 2
    assert compiler.calls() == 3


def test_a_dead_tier_is_skipped_by_the_other_processes_of_the_cache_too(
    tmp_path: Path, share: Path
) -> None:
    # A far tier that takes each connection and never answers: each compile
    # command of a build (one `opcache wrap` process each) waited its timeout.
    connections = []

    def silent(conn: socket.socket, ended: threading.Event) -> None:
        connections.append(conn)
        while not ended.is_set() and conn.recv(4096):
            pass  # (until the client gives up and hangs up)

    compiler = ToyCompiler(tmp_path / "calls")
    with fake_server(silent) as port:
        url = f"file://{share} http://127.0.0.1:{port}/cache"
        with opcache.OpCache(machine(tmp_path, "a", url, timeout=1)) as first:
            assert first.compile(make_request(0), compiler, tmp_path / "o0").status == "miss"
        tried = len(connections)
        assert tried >= 1
        # Another process of the same cache folder (a new OpCache: nothing of the
        # first one's in memory) skips the dead tier; the folder still serves.
        with opcache.OpCache(machine(tmp_path, "a", url, timeout=1)) as second:
            key = second.compile(make_request(1), compiler, tmp_path / "o1").key
        assert len(connections) == tried
    assert in_folder(share, key).is_dir()


def test_redis_first_gives_claims_and_the_folder_behind_it_keeps_entries(
    tmp_path: Path, redis_url: str, share: Path
) -> None:
    url = f"{redis_url} file://{share}"
    settings = machine(tmp_path, "a", url)
    assert settings.remote.shown_url == url
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(settings) as a:
        results = a.compile_many(
            [make_request(i) for i in range(4)], compiler, lambda r: tmp_path / r.op_name
        )
    assert [r.status for r in results] == ["miss"] * 4
    assert all(in_folder(share, r.key).is_dir() for r in results)
    with opcache.OpCache(machine(tmp_path, "b", url)) as b:
        assert b.compile(make_request(3), compiler, tmp_path / "again").tier == "remote"
    assert compiler.calls() == 4
    # The claims are Redis's: a's, marked stored, are seen through the tiers.
    from opcache.storage import open_remote

    tiers = open_remote(settings.remote)
    keys = [r.key for r in results]
    assert tiers.peek_claims(SOC, [*keys, "0" * 32]) == set(keys)
    tiers.close()


def test_tier_urls_are_each_checked_and_masked(tmp_path: Path) -> None:
    with pytest.raises(opcache.ConfigError, match=r"'ftp://x'.*tiers separated by spaces"):
        machine(tmp_path, "a", "redis://h:6379/0 ftp://x")
    with pytest.raises(opcache.ConfigError, match="read_only='maybe' is not true or false"):
        machine(tmp_path, "a", "redis://h:6379/0 http://h/x?read_only=maybe")
    shown = machine(tmp_path, "a", "redis://:pw@h:6379/0  http://u:tok@h/x").remote.shown_url
    assert shown == "redis://:***@h:6379/0 http://u:***@h/x"
    tiers = machine(tmp_path, "a", "redis://h/0?read_only=1 http://h/x", password="p").remote
    first, second = tiers.tiers()
    assert (first.url, first.read_only, first.password) == ("redis://h/0", True, "p")
    assert (second.url, second.read_only, second.password) == ("http://h/x", False, None)


def test_stats_and_clear_go_to_every_tier_that_can_list(
    tmp_path: Path, redis_url: str, nginx: Nginx, share: Path
) -> None:
    from opcache.storage import RemoteError, open_remote

    url = f"{redis_url} file://{share} {nginx.url()}"
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(machine(tmp_path, "a", url)) as a:
        keys = [a.compile(make_request(i), compiler, tmp_path / f"o{i}").key for i in range(3)]
    tiers = open_remote(machine(tmp_path, "a", url).remote)
    assert tiers.have_many(SOC, [*keys, "f" * 32]) == set(keys)
    usage = tiers.usage()
    assert usage["chips"][SOC]["entries"] == 6  # three in Redis, three in the folder
    assert usage["maxmemory_policy"] is not None  # Redis's
    assert "not supported" in usage["tiers"][nginx.url()]["error"]
    with pytest.raises(RemoteError, match=r"not supported.*\(6 entries removed\)"):
        tiers.clear()
    assert tiers.usage()["chips"] == {}
    tiers.close()
