"""The remote tier on the command line: config, stats, remote stats/clear, and wrap.

Every command runs as a real ``opcache`` process against a real redis-server.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GCC = shutil.which("gcc")


def opcache(*args: str, env: dict[str, str], cwd: Path, status: int = 0):
    done = subprocess.run(
        [sys.executable, "-m", "opcache", *args], env=env, cwd=cwd, capture_output=True, text=True
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == status, done.stdout + done.stderr
    return done


@pytest.fixture
def env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    import os

    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "OPCACHE_DIR": str(tmp_path / "cache"),
        "OPCACHE_REMOTE": redis_url,
    }


def test_config_shows_the_remote_with_its_origin_and_no_password(
    tmp_path: Path, env: dict[str, str]
) -> None:
    secret = {**env, "OPCACHE_REMOTE": "redis://ci:s3cret@cache.example:6380/2"}
    text = opcache("config", env={**secret, "OPCACHE_REMOTE_TTL": "86400"}, cwd=tmp_path).stdout
    assert "redis://ci:***@cache.example:6380/2  (env:OPCACHE_REMOTE)" in text
    assert "remote_ttl" in text and "86400  (env:OPCACHE_REMOTE_TTL)" in text
    data = json.loads(opcache("config", "--json", env=secret, cwd=tmp_path).stdout)
    assert data["remote"]["url"] == "redis://ci:***@cache.example:6380/2"
    assert "s3cret" not in text and "s3cret" not in json.dumps(data)
    bad = opcache("config", env={**env, "OPCACHE_REMOTE_TTL": "soon"}, cwd=tmp_path)
    assert bad.stderr.startswith("opcache: warning: OPCACHE_REMOTE_TTL='soon' is not valid")


@pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
def test_wrap_shares_objects_between_machines_and_stats_show_the_remote(
    tmp_path: Path, env: dict[str, str]
) -> None:
    (tmp_path / "k.c").write_text("int k(int x) { return 3 * x; }\n")
    wrap = ["wrap", "--", "gcc", "-c", "k.c", "-o", "k.o"]
    opcache(*wrap, env=env, cwd=tmp_path)
    first = (tmp_path / "k.o").read_bytes()
    other = {**env, "OPCACHE_DIR": str(tmp_path / "other-machine")}
    (tmp_path / "k.o").unlink()
    hit = opcache("wrap", "-v", *wrap[1:], env=other, cwd=tmp_path)
    assert (tmp_path / "k.o").read_bytes() == first
    assert "hit" in hit.stderr
    report = json.loads(opcache("stats", "--json", env=other, cwd=tmp_path).stdout)
    assert report["remote_hits"] == 1 and report["misses"] == 0
    text = opcache("stats", env=other, cwd=tmp_path).stdout
    assert "remote redis://127.0.0.1" in text and "1 hit, 0 misses" in text


@pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
def test_a_bad_or_dead_remote_never_fails_a_wrapped_compile(
    tmp_path: Path, env: dict[str, str]
) -> None:
    (tmp_path / "k.c").write_text("int k(void) { return 1; }\n")
    wrap = ["wrap", "--", "gcc", "-c", "k.c", "-o", "k.o"]
    bad = opcache(*wrap, env={**env, "OPCACHE_REMOTE": "ftp://nope"}, cwd=tmp_path)
    assert "OPCACHE_REMOTE" in bad.stderr and (tmp_path / "k.o").exists()
    from helpers_redis import free_port

    dead = {**env, "OPCACHE_REMOTE": f"redis://127.0.0.1:{free_port()}/0"}
    (tmp_path / "k.o").unlink()
    gone = opcache(*wrap, env={**dead, "OPCACHE_DIR": str(tmp_path / "c2")}, cwd=tmp_path)
    assert (tmp_path / "k.o").exists()
    assert gone.stderr.count("opcache: warning:") == 1 and "not used for" in gone.stderr
    # A maintenance command given the same bad setting works on the cache folder, and says so.
    said = opcache("stats", env={**env, "OPCACHE_REMOTE": "ftp://nope"}, cwd=tmp_path).stderr
    assert said.startswith("opcache: warning: OPCACHE_REMOTE='ftp://nope' is not valid")


def test_remote_stats_and_clear_act_on_this_caches_keys(
    tmp_path: Path, env: dict[str, str], redis_server
) -> None:
    import opcache as lib
    from opcache.storage import open_remote
    from opcache.storage.entry import make_manifest

    settings = lib.resolve_settings(remote=env["OPCACHE_REMOTE"], environ={"HOME": "/x"})
    remote = open_remote(settings.remote)
    for soc, key in (
        ("Ascend910B1", "a" * 32),
        ("Ascend910B1", "b" * 32),
        ("Ascend310P3", "c" * 32),
    ):
        files = {"k.o": b"x" * 1000}
        remote.put(soc, key, make_manifest(key, files, 1.0, {}, 1.0), files)
    redis_server.client().set("not-ours", b"keep")
    text = opcache("remote", "stats", env=env, cwd=tmp_path).stdout
    assert "total                   3" in text and "Ascend310P3" in text
    data = json.loads(opcache("remote", "stats", "--json", env=env, cwd=tmp_path).stdout)
    assert data["chips"]["Ascend910B1"]["entries"] == 2
    cleared = opcache("remote", "clear", "--soc_version", "Ascend310P3", env=env, cwd=tmp_path)
    assert "removed 1 entry" in cleared.stdout
    opcache("remote", "clear", env=env, cwd=tmp_path)
    assert redis_server.client().keys("*") == [b"not-ours"]
    none = {k: v for k, v in env.items() if k != "OPCACHE_REMOTE"}
    said = opcache("remote", "stats", env=none, cwd=tmp_path, status=2).stderr
    assert said.startswith("opcache: error: remote: no remote is set")
    # A bad one: the error alone (it came after the other commands' warning of it).
    bad = {**env, "OPCACHE_REMOTE": "ftp://nope"}
    said = opcache("remote", "stats", env=bad, cwd=tmp_path, status=2).stderr
    assert said.startswith("opcache: error: OPCACHE_REMOTE='ftp://nope' is not valid")
    assert said.count("\n") == 1, said
    redis_server.kill()
    down = opcache("remote", "stats", env=env, cwd=tmp_path, status=1).stderr
    assert down.startswith("opcache: error: redis://127.0.0.1:") and down.count("\n") == 1
