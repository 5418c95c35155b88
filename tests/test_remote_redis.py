"""The Redis remote (opcache/storage/redis.py) against a real redis-server.

Values round-trip whole and checked; bad values are RemoteCorrupt, never
served; read-only clients (by setting, or by the server's ACL) never write;
claims are exclusive, expire when their holder dies, live while it works;
a server that goes away is a RemoteError at once, and is used again when it
comes back.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from helpers_cache import (
    TESTS_DIR,
    ToyCompiler,
    compile_within,
    expected_files,
    fake_server,
    machine,
    make_request,
    read_dir,
)
from helpers_redis import run_in_child

import opcache
from opcache.storage import RemoteCorrupt, RemoteError, open_remote
from opcache.storage import redis as redis_storage
from opcache.storage.entry import make_manifest
from opcache.storage.value import pack, unpack

SOC = "Ascend910B1"
KEY = "0123456789abcdef" * 2
OTHER = "fedcba9876543210" * 2


def remote_settings(url: str, **options: object) -> opcache.Settings:
    return opcache.resolve_settings(remote={"url": url, **options}, environ={"HOME": "/nowhere"})


def remote(url: str, **options: object):  # type: ignore[no-untyped-def]
    return open_remote(remote_settings(url, **options).remote)


def entry(key: str = KEY, **files: bytes) -> tuple[bytes, dict[str, bytes]]:
    files = files or {"k.o": b"\x7fELF" + bytes(range(256)) * 8, "k.json": b'{"a": 1}'}
    return make_manifest(key, files, 1.5, {"op_type": "Add"}, 1000.0), files


def test_entries_round_trip_whole(redis_url: str) -> None:
    r = remote(redis_url)
    big = os.urandom(2 << 20)  # incompressible: sent as it is
    for files in (
        {"k.o": b"\x7fELF" * 10_000, "k.json": b"{}", "empty.h": b""},  # compressible
        {"big.o": big},
    ):
        manifest, files = entry(**files)
        sent = r.put(SOC, KEY, manifest, files)
        got, got_manifest = r.get(SOC, KEY)
        assert got.files == files and got.key == KEY and got.compile_seconds == 1.5
        assert got_manifest == manifest
        assert sent > 0
    assert sent > len(big)  # nothing gained by compressing random bytes
    assert r.get(SOC, OTHER) is None
    r.discard(SOC, KEY)
    assert r.get(SOC, KEY) is None
    r.close()


def test_a_connection_costs_no_client_setinfo(redis_url: str, redis_server) -> None:
    """A new connection sends no CLIENT SETINFO: two round trips each (a pool makes
    one per thread that asks at once), and redis-py reads its version from the
    installed package's metadata for them, half a millisecond of CPU each."""
    client = redis_server.client()
    client.config_resetstat()
    r = remote(redis_url)
    manifest, files = entry()
    r.put(SOC, KEY, manifest, files)
    assert r.get(SOC, KEY) is not None
    r.close()
    calls = client.info("commandstats")  # (Redis 7 names it cmdstat_client|setinfo)
    assert not [name for name in calls if name.startswith("cmdstat_client")], calls
    assert "cmdstat_set" in calls, calls


def test_get_many_returns_what_is_there(redis_url: str) -> None:
    r = remote(redis_url)
    keys = [f"{i:032x}" for i in range(150)]  # more than one MGET's worth
    for key in keys[::3]:
        r.put(SOC, key, *entry(key))
    found = r.get_many(SOC, keys)
    assert sorted(found) == sorted(keys[::3])
    assert all(found[k][0].key == k for k in found)


def test_a_poll_asks_values_and_claims_in_one_command_a_batch(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting on keys others compile (a cold cluster polls them every few ms): each
    batch of keys' values and claims come in one MGET, not one MGET each."""
    from redis.connection import Connection

    r = remote(redis_url)
    keys = [f"{i:032x}" for i in range(100)]  # two batches
    r.put(SOC, keys[0], *entry(keys[0]))
    held = r.claim(SOC, keys[1], 5)
    claimed_and_stored = r.claim(SOC, keys[70], 5)
    r.put(SOC, keys[70], *entry(keys[70]))
    sent: list[bytes] = []
    send = Connection.send_packed_command

    def counted(self, command, *args, **kwargs):  # type: ignore[no-untyped-def]
        sent.append(b"".join(command) if isinstance(command, list) else command)
        return send(self, command, *args, **kwargs)

    monkeypatch.setattr(Connection, "send_packed_command", counted)
    found, claimed = r.watch(SOC, keys)
    monkeypatch.undo()
    assert sorted(found) == [keys[0], keys[70]]
    assert claimed == {keys[1], keys[70]}
    assert b"".join(sent).count(b"MGET") == 2  # (before: 3, the claims a command of their own)
    held.release()
    claimed_and_stored.release()
    r.close()


def test_big_entries_stay_local(redis_url: str, redis_server) -> None:
    r = remote(redis_url, max_entry_mb=1)
    assert r.put(SOC, KEY, *entry(**{"big.o": b"x" * (1 << 20)})) == 0
    assert r.get(SOC, KEY) is None
    assert r.put(SOC, OTHER, *entry(OTHER)) > 0


def test_ttl_is_set_when_asked(redis_url: str, redis_server) -> None:
    client = redis_server.client()
    remote(redis_url, ttl=100).put(SOC, KEY, *entry())
    assert 0 < client.ttl(f"opcache:1:{SOC}:{KEY}") <= 100
    remote(redis_url).put(SOC, OTHER, *entry(OTHER))
    assert client.ttl(f"opcache:1:{SOC}:{OTHER}") == -1  # no TTL: the server's eviction ages


def test_a_read_only_client_never_writes(redis_url: str, redis_server) -> None:
    writer = remote(redis_url)
    writer.put(SOC, OTHER, *entry(OTHER))
    reader = remote(redis_url, read_only=True)
    assert reader.put(SOC, KEY, *entry()) == 0
    reader.discard(SOC, OTHER)
    claim = reader.claim(SOC, KEY, 5)
    assert claim is not None and not claim.owned and not claim.failed_before  # unclaimed
    assert redis_server.client().keys("*") == [f"opcache:1:{SOC}:{OTHER}".encode()]
    assert reader.get(SOC, OTHER) is not None
    with pytest.raises(RemoteError, match="read-only"):
        reader.clear()
    # A writer's claim is one to wait for, even for a reader.
    held = writer.claim(SOC, KEY, 5)
    assert reader.claim(SOC, KEY, 5) is None
    held.release()
    claim = reader.claim(SOC, KEY, 5)  # a compile that failed is none
    assert claim is not None and not claim.owned and claim.failed_before


def test_an_acl_user_without_write_permission_is_read_only_with_one_warning(
    redis_url: str, redis_server, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis_server.client()
    admin.acl_setuser(
        "dev", enabled=True, passwords=["+devpass"], keys=["opcache:*"],
        commands=["+get", "+mget", "+exists", "+ping", "+strlen", "+scan", "+info"],
    )  # fmt: skip
    remote(redis_url).put(SOC, OTHER, *entry(OTHER))
    url = redis_url.replace("redis://", "redis://dev:devpass@")
    dev = remote(url)
    with caplog.at_level(logging.WARNING, logger="opcache"):
        assert dev.put(SOC, KEY, *entry()) == 0
        assert dev.put(SOC, KEY, *entry()) == 0
        claim = dev.claim(SOC, KEY, 5)
    assert dev.read_only and claim is not None and not claim.owned
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "refuses our writes" in warnings[0]
    assert "devpass" not in warnings[0]
    assert dev.get(SOC, OTHER) is not None
    assert admin.exists(f"opcache:1:{SOC}:{KEY}") == 0


def test_bad_values_are_corrupt_never_served(redis_url: str, redis_server) -> None:
    client = redis_server.client()
    r = remote(redis_url)
    manifest, files = entry()
    good = pack(KEY, manifest, files)
    name = f"opcache:1:{SOC}:{KEY}"
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    other = pack(OTHER, *entry(OTHER))
    for bad in (bytes(flipped), good[:-5], good[: len(good) // 2], other, b"garbage", b""):
        client.set(name, bad)
        with pytest.raises(RemoteCorrupt):
            r.get(SOC, KEY)
        assert isinstance(r.get_many(SOC, [KEY])[KEY], RemoteCorrupt)
    # A value whose checksum was made to match, with an artifact changed: the manifest catches it.
    small = pack(KEY, *entry(**{"k.json": b"{}", "k.o": b"xyz"}))  # too small to compress
    body = bytearray(small[:-16])
    assert body.endswith(b"xyz")  # the last artifact in the manifest's order
    body[-1] ^= 0x01
    client.set(name, bytes(body) + xxhash.xxh3_128_digest(bytes(body)))
    with pytest.raises(RemoteCorrupt, match="digest"):
        r.get(SOC, KEY)


def test_a_value_that_inflates_past_the_entry_cap_is_corrupt(redis_url: str, redis_server) -> None:
    """A few KB of zlib under the size cap may inflate to gigabytes: the client stops
    inflating at its own cap (OPCACHE_REMOTE_MAX_ENTRY_MB) and serves nothing."""
    import zlib

    payload = zlib.compress(b"\0" * (8 << 20), 9)  # 8 MB of zeros in ~8 KB
    body = b"OPCR" + bytes([1, 1]) + payload  # magic, format 1, zlib
    redis_server.client().set(f"opcache:1:{SOC}:{KEY}", body + xxhash.xxh3_128_digest(body))
    r = remote(redis_url, max_entry_mb=1)
    with pytest.raises(RemoteCorrupt, match="inflates past"):
        r.get(SOC, KEY)
    assert "inflates past" in str(r.get_many(SOC, [KEY])[KEY])


def _unpacked_value(key: str, files: dict[str, bytes]) -> bytes:
    """A value of ``files`` as pack writes one it does not compress, built here: pack
    refuses the names these tests need."""
    manifest = make_manifest(key, files, 1.0, {}, 1000.0)
    body = b"OPCR\x01\x00" + len(manifest).to_bytes(4, "big") + manifest
    body += b"".join(data for _, data in sorted(files.items()))
    return body + xxhash.xxh3_128_digest(body)


def test_an_artifact_name_no_file_can_have_is_corrupt_never_a_failed_compile(
    tmp_path: Path, redis_url: str, redis_server
) -> None:
    """A value whose names passed every check but were too long for a file (or held a lone
    surrogate) failed the compile writing them out (ENAMETOOLONG from the delivery)."""
    assert unpack(KEY, _unpacked_value(KEY, {"x" * 255: b"ok"}), 1 << 20)[0].files
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(machine(tmp_path, "probe", redis_url, read_only=True)) as probe:
        key = probe.compile(make_request(0), compiler, tmp_path / "o").key
    for i, name in enumerate(("x" * 256, "\u00e9" * 128, "a\ud800.o")):
        value = _unpacked_value(key, {name: b"evil"})
        with pytest.raises(RemoteCorrupt, match="bad artifact"):
            unpack(key, value, 1 << 20)
        redis_server.client().set(f"opcache:1:{SOC}:{key}", value)
        with opcache.OpCache(machine(tmp_path, f"m{i}", redis_url, read_only=True)) as cache:
            result = cache.compile(make_request(0), compiler, tmp_path / f"out{i}")
            assert result.status == "miss" and cache.stats()["remote_corrupt"] == 1
        assert read_dir(tmp_path / f"out{i}") == expected_files(make_request(0))


def test_a_value_stored_as_it_is_past_the_entry_cap_is_corrupt() -> None:
    """Only a zlib payload was held to the cap: one stored as it is was served whole."""
    value = _unpacked_value(KEY, {"k.o": os.urandom(1 << 20)})  # (random: kept as it is)
    assert unpack(KEY, value, 2 << 20)[0].files
    with pytest.raises(RemoteCorrupt, match="past"):
        unpack(KEY, value, 1 << 20)


def test_pack_refuses_files_that_are_not_the_manifests() -> None:
    manifest, files = entry()
    with pytest.raises(ValueError):
        pack(KEY, manifest, {**files, "extra.o": b"x"})
    with pytest.raises(ValueError):
        pack(OTHER, manifest, files)
    got, _ = unpack(KEY, pack(KEY, manifest, files), 1 << 20)
    assert got.files == files


def test_claims_are_exclusive_and_released(redis_url: str) -> None:
    a, b = remote(redis_url), remote(redis_url)
    first = a.claim(SOC, KEY, 5)
    assert first is not None and first.owned
    assert b.claim(SOC, KEY, 5) is None
    assert b.claimed(SOC, KEY)
    first.release()
    first.release()  # twice is harmless
    assert not b.claimed(SOC, KEY)
    second = b.claim(SOC, KEY, 5)  # its compile failed: compiled here too, at once
    assert second is not None and not second.owned
    held = b.claim(SOC, OTHER, 5)
    b.close()  # a compile left running: deleted, for one client to take over
    third = a.claim(SOC, OTHER, 5)
    assert held.owned and third is not None and third.owned
    a.close()


def test_a_compile_that_failed_leaves_a_mark_its_waiters_compile_past(
    redis_url: str, redis_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim let go unstored is overwritten with ``failed`` for a few seconds: a
    client that looks at it (watch, peek_claims) finds it held by no one, and then
    compiles the key unclaimed at once; after the mark a claim is owned again.
    An older opcache takes any value of a claim's key for a claim held: it waits
    the mark out, and never takes it for an entry."""
    monkeypatch.setattr(redis_storage, "_FAILED_SECONDS", 0.5)
    client = redis_server.client()
    name = f"opcache:1:{SOC}:{KEY}:claim"
    a, b, c = remote(redis_url), remote(redis_url), remote(redis_url)
    a.claim(SOC, KEY, 5).release()
    assert client.get(name) == b"failed" and 0 < client.pttl(name) <= 500
    assert client.exists(f"opcache:1:{SOC}:{KEY}") == 0
    assert b.claim(SOC, KEY, 5) is None  # refused, not yet looked at
    assert b.watch(SOC, [KEY]) == ({}, set())
    unclaimed = b.claim(SOC, KEY, 5)
    assert unclaimed is not None and not unclaimed.owned and unclaimed.failed_before
    assert c.peek_claims(SOC, [KEY, OTHER]) == set()
    assert c.claim(SOC, KEY, 5).failed_before
    time.sleep(0.7)  # past the mark
    again = c.claim(SOC, KEY, 5)
    assert again is not None and again.owned and not again.failed_before
    again.release()
    for r in (a, b, c):
        r.close()


def test_a_failed_compile_marks_only_its_own_claim(redis_url: str, redis_server) -> None:
    """A holder whose claim expired and was taken over leaves the new holder's claim
    as it is: that compile may yet store the entry."""
    client = redis_server.client()
    name = f"opcache:1:{SOC}:{KEY}:claim"
    a = remote(redis_url)
    held = a.claim(SOC, KEY, 5)
    client.set(name, "another-machine", px=5000)
    held.release()
    assert client.get(name) == b"another-machine"
    a.close()


def test_a_claim_lives_while_its_holder_works(redis_url: str) -> None:
    a, b = remote(redis_url), remote(redis_url)
    held = a.claim(SOC, KEY, 0.6)
    time.sleep(1.5)  # more than twice the claim's own life: renewed meanwhile
    assert b.claim(SOC, KEY, 0.6) is None
    held.release()
    assert not b.claimed(SOC, KEY)


def test_a_forked_child_renews_its_claims_and_leaves_its_parents_alone(redis_url: str) -> None:
    """The child's claims were never renewed (its renewer was the parent's thread, absent
    in the child): they expired under its compiles.  And its close released the parent's."""
    a, b = remote(redis_url), remote(redis_url)
    parents = a.claim(SOC, KEY, 0.6)  # the parent's renewer runs

    def child() -> bool:
        held = a.claim(SOC, OTHER, 0.6)
        time.sleep(1.5)  # more than twice the claim's own life: renewed meanwhile
        alive = remote(redis_url).claim(SOC, OTHER, 0.6) is None
        a.close()
        return held is not None and alive

    assert run_in_child(child)
    assert not b.claimed(SOC, OTHER)  # released at the child's close
    assert b.claimed(SOC, KEY)  # the parent's, still held
    parents.release()
    assert not b.claimed(SOC, KEY)


CLAIM_AND_HANG = """
import sys, time, opcache
from opcache.storage import open_remote
settings = opcache.resolve_settings(remote=sys.argv[1], environ={"HOME": "/nowhere"})
claim = open_remote(settings.remote).claim("Ascend910B1", sys.argv[2], 1.0)
print("claimed" if claim else "not", flush=True)
time.sleep(3600)
"""


def test_a_claim_whose_holder_died_expires(redis_url: str) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", CLAIM_AND_HANG, redis_url, KEY],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR.parent)},
    )
    assert holder.stdout.readline().strip() == "claimed"
    b = remote(redis_url)
    assert b.claim(SOC, KEY, 1.0) is None  # alive: renewed
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    deadline = time.monotonic() + 10
    while (claim := b.claim(SOC, KEY, 1.0)) is None:
        assert time.monotonic() < deadline, "the dead holder's claim never expired"
        time.sleep(0.1)
    assert claim.owned


def test_a_server_that_goes_away_is_a_remote_error_then_used_again(
    redis_url: str, redis_server
) -> None:
    r = remote(redis_url, timeout=1)
    r.put(SOC, KEY, *entry())
    redis_server.kill()
    for call in (
        lambda: r.get(SOC, KEY),
        lambda: r.get_many(SOC, [KEY]),
        lambda: r.put(SOC, OTHER, *entry(OTHER)),
        lambda: r.claim(SOC, KEY, 5),
        lambda: r.usage(),
    ):
        with pytest.raises(RemoteError) as raised:
            call()
        assert str(redis_server.port) in str(raised.value)
    redis_server.start()
    assert r.get(SOC, KEY) is None  # a fresh server: empty, and answering again
    assert r.put(SOC, KEY, *entry()) > 0


def test_usage_and_clear_touch_only_this_caches_keys(redis_url: str, redis_server) -> None:
    client = redis_server.client()
    client.set("someone:else", b"keep me")
    client.set("opcache:2:Ascend910B1:" + KEY, b"another version's")
    r = remote(redis_url)
    r.put(SOC, KEY, *entry())
    r.put(SOC, OTHER, *entry(OTHER))
    r.put("Ascend310P3", KEY, *entry())
    claim = r.claim(SOC, KEY, 5)
    usage = r.usage()
    assert usage["chips"][SOC]["entries"] == 2
    assert usage["chips"]["Ascend310P3"]["entries"] == 1
    assert usage["maxmemory_policy"]
    assert r.clear("Ascend310P3") == 1
    assert r.get("Ascend310P3", KEY) is None and r.get(SOC, KEY) is not None
    claim.release()
    assert r.clear() == 2
    assert sorted(client.keys("*")) == [b"opcache:2:Ascend910B1:" + KEY.encode(), b"someone:else"]


def test_clear_leaves_a_cache_whose_prefix_begins_with_this_ones(
    redis_url: str, redis_server
) -> None:
    """``opcache:1:teamB:``'s names are under ``opcache:1:`` too: clear deleted them."""
    ours, theirs = remote(redis_url), remote(redis_url, prefix="opcache:1:teamB:")
    for r in (ours, theirs):
        r.put(SOC, KEY, *entry())
        r.put("cann:" + SOC, "#index", *entry("#index"))  # (cann_transfer.py's names)
        r.put(f"cann:{SOC}:0123456789abcdef", "te_add_1", *entry("te_add_1"))
    held = [ours.claim(SOC, OTHER, 60), theirs.claim(SOC, OTHER, 60)]
    theirs_before = sorted(redis_server.client().keys("opcache:1:teamB:*"))
    assert len(theirs_before) == 4
    assert sum(row["entries"] for row in ours.usage()["chips"].values()) == 3
    assert ours.clear() == 3
    assert sorted(redis_server.client().keys("*")) == theirs_before
    for claim in held:
        claim.release()


def test_a_blank_prefix_is_refused_not_taken_for_none() -> None:
    """``OPCACHE_REMOTE_PREFIX=" "`` was stripped to no prefix at all: every name of the
    database was under it (an empty one is unset: the default).  Refused as any bad
    remote option is: the compile goes on without the remote, `opcache remote` says
    why in one line."""
    env = {"HOME": "/nowhere", "OPCACHE_REMOTE": "redis://h", "OPCACHE_REMOTE_PREFIX": " "}
    assert opcache.resolve_settings(environ=env).remote is None
    done = subprocess.run(
        [sys.executable, "-m", "opcache", "remote", "clear"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert done.stderr.startswith("opcache: error: OPCACHE_REMOTE_PREFIX=' ' is not valid")


@pytest.mark.parametrize("prefix", ["myapp:", "team:"])
def test_clear_under_a_prefix_another_program_shares_takes_only_opcache_s_names(
    redis_url: str, redis_server, prefix: str
) -> None:
    """A database another program uses too, under a prefix it uses: its
    ``<prefix>session:abc123``, ``<prefix>user:42`` were taken for chips and keys,
    counted by ``remote stats`` and deleted by ``remote clear``."""
    client = redis_server.client()
    others = {f"{prefix}session:abc123", f"{prefix}user:42", f"{prefix}cfg:main:x", "myapp:cfg"}
    for name in others:
        client.set(name, b"not opcache's")
    r = remote(redis_url, prefix=prefix)
    r.put(SOC, KEY, *entry())
    claim = r.claim(SOC, OTHER, 60)
    assert list(r.usage()["chips"]) == [SOC]
    claim.release()
    assert r.clear() == 1
    assert sorted(client.keys("*")) == sorted(name.encode() for name in others)


def test_a_prefix_with_glob_characters_matches_only_itself(redis_url: str, redis_server) -> None:
    client = redis_server.client()
    odd = remote(redis_url, prefix="team[a]*:")
    odd.put(SOC, KEY, *entry())
    client.set(f"teama-x:{SOC}:{KEY}", b"not ours")
    size = client.strlen(f"team[a]*:{SOC}:{KEY}")
    assert odd.usage()["chips"] == {SOC: {"entries": 1, "bytes": size}}
    assert odd.clear() == 1
    assert client.keys("*") == [f"teama-x:{SOC}:{KEY}".encode()]


def test_nothing_listens_there(tmp_path: Path) -> None:
    r = remote(f"redis://127.0.0.1:{_closed_port()}/0", timeout=1)
    with pytest.raises(RemoteError):
        r.get(SOC, KEY)


def _closed_port() -> int:
    from helpers_redis import free_port

    return free_port()


def test_a_host_name_the_client_library_chokes_on_is_a_remote_error() -> None:
    """redis-py raises UnicodeError (the idna codec) for a host label over 63
    characters, not one of its own errors."""
    from opcache.settings import RemoteSettings

    url = f"redis://{'a' * 64}.example:6379/0"  # (settings refuse it; a remote must cope anyway)
    r = open_remote(RemoteSettings(url, None, False, "opcache:1:", None, 64, 1.0))
    for call in (lambda: r.get(SOC, KEY), lambda: r.get_many(SOC, [KEY, OTHER])):
        with pytest.raises(RemoteError, match="example"):
            call()
    with pytest.raises(RemoteError):
        r.claim(SOC, KEY, 5)
    r.close()


@pytest.fixture
def locked_server(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A redis-server of its own that wants the password ``sesame``."""
    from helpers_redis import RedisServer, find_server

    server = RedisServer(find_server(), tmp_path / "locked")
    server.start()
    server.client().config_set("requirepass", "sesame")
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("password", "says"),
    [(None, "wants a password"), ("wrong", "refused"), ("sesame", None)],
    ids=["none", "wrong", "right"],
)
def test_a_server_that_wants_a_password_says_which_setting_gives_it(
    locked_server, password: str | None, says: str | None
) -> None:
    env = {"HOME": "/nowhere"} | ({} if password is None else {"OPCACHE_REMOTE_PASSWORD": password})
    settings = opcache.resolve_settings(remote={"url": locked_server.url}, environ=env)
    r = open_remote(settings.remote)
    if says is None:
        r.put(SOC, KEY, *entry())
        assert r.get(SOC, KEY) is not None
        return
    for call in (lambda: r.get(SOC, KEY), lambda: r.put(SOC, KEY, *entry())):
        with pytest.raises(RemoteError) as raised:
            call()
        message = str(raised.value)
        assert says in message and "OPCACHE_REMOTE_PASSWORD" in message, message
        assert "HELLO" not in message and "sesame" not in message
    r.close()


@pytest.fixture
def dripping() -> Iterator[str]:
    """The host:port of a server speaking enough of Redis's protocol (and of a cluster's)
    to be connected to, that
    answers a GET or MGET with a value of 100,000 bytes sent a byte every 0.1 s, until the
    client hangs up or the test ends."""

    def answer(conn: socket.socket, ended: threading.Event) -> None:
        commands = conn.makefile("rb")
        while not ended.is_set() and (line := commands.readline()):
            words = [commands.read(int(commands.readline()[1:]) + 2)[:-2]
                     for _ in range(int(line[1:]))]  # fmt: skip
            name = words[0].upper()
            if name == b"HELLO":
                conn.sendall(b"%1\r\n+proto\r\n:3\r\n")
            elif name == b"CLUSTER":  # (SLOTS: every slot is this server's)
                here = b"$9\r\n127.0.0.1\r\n:%d\r\n" % port
                conn.sendall(b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n" + here)
            elif name == b"COMMAND":  # (the cluster client's table of commands: none)
                conn.sendall(b"*0\r\n")
            elif name in (b"GET", b"MGET"):
                conn.sendall((b"*1\r\n" if name == b"MGET" else b"") + b"$100000\r\n")
                while not ended.wait(0.1):
                    conn.sendall(b"x")
            else:
                conn.sendall(b"+PONG\r\n" if name == b"PING" else b"+OK\r\n")

    with fake_server(answer) as port:
        yield f"127.0.0.1:{port}"


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_a_server_that_drips_its_answer_costs_a_miss_within_the_deadline(
    tmp_path: Path, dripping: str, scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The timeout bounds a whole answer, not each read: each read got the whole timeout
    anew, so the compile waited for every byte of the value (10,000 s of them)."""
    with caplog.at_level(logging.WARNING, logger="opcache"):
        result, stats = compile_within(tmp_path, f"{scheme}://{dripping}", timeout=0.5)
    assert result.status == "miss" and stats["remote_errors"] == 1
    assert read_dir(tmp_path / "o") == expected_files(make_request(0))
    assert "not used for" in caplog.text


def test_usage_names_chips_under_a_prefix_that_is_not_ascii(redis_url: str) -> None:
    """The prefix's length in characters was cut off the names' bytes: ``é`` is two
    bytes, so each chip was named with the prefix's last byte before it."""
    r = remote(redis_url, prefix="opcaché:")
    r.put(SOC, KEY, *entry())
    assert list(r.usage()["chips"]) == [SOC]
    assert r.clear() == 1
    r.close()
