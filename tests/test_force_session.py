"""``force`` clears a chip once per compile session, then behaves as ``enable``.

A session is one OpCache unless one is named (``OPCACHE_SESSION``, or
``OpCache(session=...)``); ``opcache wrap`` names its build's process group,
so a build of many short compile commands clears once, at its first command,
and keeps every entry it stores.
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
from opcache.cache import process_group_session

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


def test_process_group_session_names_the_group_and_its_leader() -> None:
    here = process_group_session()
    assert here == process_group_session()
    assert f":{os.getpgrp()}:" in here
    code = "from opcache.cache import process_group_session as s; print(s())"
    apart = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, start_new_session=True
    )
    assert apart.stdout.strip() not in ("", here)


# -------------------------------------------------------------------- opcache wrap


def _build(project: Path, env: dict[str, str], *, parallel: bool) -> None:
    """One build: a shell compiling every source with its own ``opcache wrap``, in a new group."""
    wrap = f"{sys.executable} -m opcache wrap --op_compiler_cache_mode force -- gcc -c"
    each = f"{wrap} $f.c -o $f.o" + (" &" if parallel else ";")
    script = f"for f in a b c d; do {each} done; wait"
    done = subprocess.run(
        ["sh", "-c", script], cwd=project, env=env, capture_output=True, start_new_session=True
    )
    assert done.returncode == 0, done.stderr.decode()
    assert b"Traceback" not in done.stderr


def _stats(env: dict[str, str], cwd: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "opcache", "stats", "--json"], env=env, cwd=cwd, capture_output=True
    )
    return json.loads(done.stdout)["chips"]["host"]


@pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_a_force_build_through_wrap_keeps_every_entry(tmp_path: Path, parallel: bool) -> None:
    project = tmp_path / "project"
    project.mkdir()
    for name in "abcd":
        (project / f"{name}.c").write_text(f"int {name}(int x) {{ return x * {ord(name)}; }}\n")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "ASCEND_CACHE_PATH": str(tmp_path / "cache"),
    }
    _build(project, env, parallel=parallel)
    first = _stats(env, tmp_path)
    assert first["entries"] == 4 and first["misses"] == 4
    # Every command of the build after the first used the cache as enable does.
    _build(project, {**env, "OPCACHE_SESSION": "kept"}, parallel=parallel)
    second = _stats(env, tmp_path)
    assert second["entries"] == 4 and second["misses"] == 8  # a new session: cleared once
    _build(project, {**env, "OPCACHE_SESSION": "kept"}, parallel=parallel)
    third = _stats(env, tmp_path)
    assert third["entries"] == 4 and third["hits"] == 4  # the same session: nothing cleared
