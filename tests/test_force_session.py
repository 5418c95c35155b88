"""``force`` clears a chip once per compile session, then behaves as ``enable``.

A session is one OpCache unless one is named (``OPCACHE_SESSION``, or
``OpCache(session=...)``); ``opcache wrap`` names a build: a run of force
compiles with no pause longer than ten minutes.  So a build of many short
compile commands (make, ninja, a script, in parallel or not) clears once, at
its first command, and keeps every entry it stores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_cache import (
    MP,
    ToyCompiler,
    entry_dirs,
    expected_files,
    make_request,
    make_settings,
    read_dir,
)

import opcache
from opcache.cache import BUILD_GAP_SECONDS

GCC = shutil.which("gcc")


def settings_for(tmp_path: Path, mode: str = "force", **env: str) -> opcache.Settings:
    return make_settings(tmp_path / "ops", tmp_path, mode, env=env)


def test_opcaches_of_one_session_clear_once(tmp_path: Path) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    root = settings_for(tmp_path).root
    with opcache.OpCache(settings_for(tmp_path, "enable")) as cache:
        old = cache.compile(make_request(0), compiler, tmp_path / "o").key
    with opcache.OpCache(settings_for(tmp_path), session="build-1") as first:
        assert first.compile(make_request(1), compiler, tmp_path / "o").status == "miss"
    assert old not in entry_dirs(root)  # the session's first touch cleared the chip
    with opcache.OpCache(settings_for(tmp_path), session="build-1") as second:
        assert second.compile(make_request(1), compiler, tmp_path / "o").status == "hit"
        assert second.compile(make_request(2), compiler, tmp_path / "o").status == "miss"
    assert len(entry_dirs(root)) == 2
    # Another session clears again.
    with opcache.OpCache(settings_for(tmp_path), session="build-2") as third:
        assert third.compile(make_request(1), compiler, tmp_path / "o").status == "miss"
    assert len(entry_dirs(root)) == 1


def test_the_session_comes_from_opcache_session(tmp_path: Path) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    settings = settings_for(tmp_path, OPCACHE_SESSION="ci-1234")
    assert settings.session == "ci-1234"
    assert settings.sources["session"] == "env:OPCACHE_SESSION"
    assert settings_for(tmp_path).session is None
    for expected in ("miss", "hit"):
        with opcache.OpCache(settings) as cache:
            assert cache.compile(make_request(0), compiler, tmp_path / "o").status == expected
    # An explicit session wins over the environment's.
    with opcache.OpCache(settings, session="other") as cache:
        assert cache.compile(make_request(0), compiler, tmp_path / "o").status == "miss"


def _force_child(tmp_path: str, indices: list[int], result: str) -> None:
    settings = settings_for(Path(tmp_path), OPCACHE_SESSION="ranks")
    compiler = ToyCompiler(Path(tmp_path) / "calls", sleep=0.05)
    statuses = []
    with opcache.OpCache(settings) as cache:
        for index in indices:
            out = Path(tmp_path) / "out" / f"{os.getpid()}-{index}"
            statuses.append(cache.compile(make_request(index), compiler, out).status)
            assert read_dir(out) == expected_files(make_request(index))
    Path(result).write_text(json.dumps(statuses))


def test_processes_of_one_session_keep_each_others_entries(tmp_path: Path) -> None:
    """Four ranks in force mode start together: one clear, and every entry they store stays."""
    compiler = ToyCompiler(tmp_path / "calls")
    root = settings_for(tmp_path).root
    with opcache.OpCache(settings_for(tmp_path, "enable")) as cache:
        old = cache.compile(make_request(99), compiler, tmp_path / "o").key
    procs = [
        MP.Process(
            target=_force_child,
            args=(str(tmp_path), list(range(rank * 4, rank * 4 + 4)), str(tmp_path / f"r{rank}")),
        )
        for rank in range(4)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    entries = entry_dirs(root)
    assert old not in entries
    assert len(entries) == 16
    assert all(json.loads((tmp_path / f"r{r}").read_text()) == ["miss"] * 4 for r in range(4))


# -------------------------------------------------------------------- opcache wrap


WRAP = f"{sys.executable} -m opcache wrap --op_compiler_cache_mode force -- gcc"


def _build(project: Path, env: dict[str, str], how: str) -> None:
    """One build of a.c .. d.c, each file compiled by its own ``opcache wrap``."""
    if how == "ninja":
        (project / "build.ninja").write_text(
            f"rule cc\n  command = {WRAP} -c $in -o $out\n"
            + "".join(f"build {f}.o: cc {f}.c\n" for f in "abcd")
        )
        argv = ["ninja", "-j", "4"]
    else:
        each = f"{WRAP} -c $f.c -o $f.o" + (" &" if how == "parallel" else ";")
        argv = ["sh", "-c", f"rm -f *.o; for f in a b c d; do {each} done; wait"]
    if how == "ninja":
        for obj in project.glob("*.o"):
            obj.unlink()
    done = subprocess.run(argv, cwd=project, env=env, capture_output=True, start_new_session=True)
    assert done.returncode == 0, done.stderr.decode() + done.stdout.decode()
    assert b"Traceback" not in done.stderr


def _project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """Four C sources to build, and an environment with a cache of its own."""
    project = tmp_path / "project"
    project.mkdir()
    for name in "abcd":
        (project / f"{name}.c").write_text(f"int {name}(int x) {{ return x * {ord(name)}; }}\n")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "ASCEND_CACHE_PATH": str(tmp_path / "cache"),
    }
    return project, env


def _stats(env: dict[str, str], cwd: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "opcache", "stats", "--json"], env=env, cwd=cwd, capture_output=True
    )
    return json.loads(done.stdout)["chips"]["host"]


@pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
@pytest.mark.parametrize("how", ["serial", "parallel", "ninja"])
def test_a_force_build_through_wrap_keeps_every_entry(tmp_path: Path, how: str) -> None:
    if how == "ninja" and shutil.which("ninja") is None:
        pytest.skip("ninja is not installed (apt-get install ninja-build)")
    project, env = _project(tmp_path)
    _build(project, env, how)
    first = _stats(env, tmp_path)
    assert first["entries"] == 4 and first["misses"] == 4
    # The same build again, soon after: still one session, nothing cleared.
    _build(project, env, how)
    second = _stats(env, tmp_path)
    assert second["entries"] == 4 and second["hits"] == 4
    # After a pause longer than a build's gap, the next force build clears again.
    note = next((tmp_path / "cache").glob("kernel_cache_*/.opcache/force/host"))
    session, _, when = note.read_bytes().partition(b"\n")
    note.write_bytes(session + b"\n" + str(float(when) - BUILD_GAP_SECONDS - 1).encode())
    _build(project, env, how)
    third = _stats(env, tmp_path)
    assert third["entries"] == 4 and third["misses"] == 8 and third["hits"] == 4


@pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
def test_a_named_session_decides_for_wrap_too(tmp_path: Path) -> None:
    project, env = _project(tmp_path)
    for session, misses in (("ci-1", 4), ("ci-1", 4), ("ci-2", 8)):
        _build(project, {**env, "OPCACHE_SESSION": session}, "parallel")
        stats = _stats(env, tmp_path)
        assert stats["entries"] == 4 and stats["misses"] == misses
