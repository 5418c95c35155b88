"""A new kind of remote is a ``Remote`` subclass with two methods, ``get_many`` and
``put``, and a ``connect(settings)``: the base class's defaults give it the rest
(``get``, no claims, ``watch``, and ``opcache remote`` saying what it cannot do).

The kind here keeps its values in a dict, in value.py's checked format, and is
plugged in as a real one is: a module under ``opcache.storage`` and its URL
scheme in ``settings.REMOTE_KINDS``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from helpers_cache import (
    SOC,
    ToyCompiler,
    entry_dirs,
    expected_files,
    make_request,
    make_settings,
    read_dir,
)

import opcache
from opcache import settings as opcache_settings
from opcache.cli import main
from opcache.storage import UNCLAIMED, Remote, RemoteCorrupt, RemoteError
from opcache.storage.value import pack, unpack

URL = "memtest://localhost:1"


VALUES: dict[tuple[str, str], bytes] = {}  # the remote's, by (chip, key)


class DictRemote(Remote):
    """The two methods a remote kind must have."""

    def get_many(self, soc: str, keys: list[str]) -> dict:
        found: dict = {}
        for key in keys:
            value = VALUES.get((soc, key))
            if value is None:
                continue
            try:
                found[key] = (*unpack(key, value, 1 << 20), len(value))
            except RemoteCorrupt as e:
                e.size = len(value)
                found[key] = e
        return found

    def put(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
        value = pack(key, manifest, files)
        VALUES[(soc, key)] = value
        return len(value)


@pytest.fixture
def dict_remote(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, str], bytes]:
    """The kind plugged in under ``memtest://``; its values, empty."""
    module = types.ModuleType("opcache.storage.memtest")
    module.connect = DictRemote  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(opcache_settings.REMOTE_KINDS, "memtest", "memtest")
    VALUES.clear()
    return VALUES


def machine(tmp_path: Path, name: str) -> opcache.Settings:
    return make_settings(tmp_path / name, tmp_path, remote={"url": URL})


def test_a_two_method_remote_shares_entries_between_machines(
    tmp_path: Path, dict_remote: dict
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    request = make_request(0)
    with opcache.OpCache(machine(tmp_path, "a")) as a:
        first = a.compile(request, compiler, tmp_path / "out-a")
    assert first.status == "miss" and list(dict_remote) == [(SOC, first.key)]
    with opcache.OpCache(machine(tmp_path, "b")) as b:
        second = b.compile(request, compiler, tmp_path / "out-b")
        third = b.compile(request, compiler, tmp_path / "out-b2")
    assert (second.status, second.tier) == ("hit", "remote")
    assert (third.status, third.tier) == ("hit", "local")  # backfilled
    assert compiler.calls() == 1
    assert read_dir(tmp_path / "out-b") == expected_files(request)
    assert set(entry_dirs(tmp_path / "b" / "kernel_cache")) == {first.key}


def test_with_no_claims_compile_many_compiles_what_no_tier_has(
    tmp_path: Path, dict_remote: dict
) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(i) for i in range(6)]
    with opcache.OpCache(machine(tmp_path, "a")) as a:
        a.compile_many(requests[:3], compiler, [tmp_path / "a" / str(i) for i in range(3)])
    with opcache.OpCache(machine(tmp_path, "b")) as b:
        results = b.compile_many(requests, compiler, [tmp_path / "b" / str(i) for i in range(6)])
    assert [(r.status, r.tier) for r in results] == [("hit", "remote")] * 3 + [("miss", "")] * 3
    assert compiler.calls() == 6
    assert len(dict_remote) == 6


def test_the_defaults_of_a_remote_kind(tmp_path: Path, dict_remote: dict) -> None:
    remote = DictRemote(machine(tmp_path, "a").remote)
    assert remote.claim(SOC, "k", 1.0) is UNCLAIMED and not UNCLAIMED.owned
    assert not remote.claimed(SOC, "k")
    assert remote.get(SOC, "k") is None
    assert remote.watch(SOC, ["k"]) == ({}, set())
    for unsupported in (remote.usage, remote.clear, lambda: remote.discard(SOC, "k")):
        with pytest.raises(RemoteError, match="not supported"):
            unsupported()
    remote.close()


def test_opcache_remote_stats_says_a_kind_without_them_cannot(
    tmp_path: Path, dict_remote: dict, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("OPCACHE_REMOTE", URL)
    status = main(["remote", "stats", "--op_compiler_cache_dir", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith("opcache: error: ") and "not supported" in err
    assert len(err.splitlines()) == 1
