"""Settings from the environment, for a build system that passes opcache no flags.

The masquerade (a ``gcc`` link to opcache) and ``opcache wrap`` read
OPCACHE_DISABLE, OPCACHE_DIR, OPCACHE_MODE and OPCACHE_VERBOSE; a bad setting
from the environment never fails a compile (a warning, then no cache), and a
configuration warning shows at most once an hour per cache, not on every compile.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_faults import read_only
from helpers_wrap import (
    GCC,
    link_compilers,
    opcache,
    opcache_script,
    plain_gcc,
    stats,
    wrap,
    write_project,
)

from opcache import ConfigError, resolve_settings

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
COMPILE = ["gcc", "-O2", "-DOFFSET=2", "-c", "k.c", "-o", "k.o"]


@pytest.fixture
def build(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(environment with opcache's gcc link first on PATH, a project folder)."""
    links = link_compilers(tmp_path / "links", opcache_script(), "gcc")
    env = base_env(tmp_path, links)
    return env, write_project(tmp_path / "src")


def masquerade(env: dict[str, str], src: Path) -> subprocess.CompletedProcess[bytes]:
    """One ``gcc -c`` as a build system runs it: through the link, no flags for opcache."""
    (src / "k.o").unlink(missing_ok=True)
    done = subprocess.run(COMPILE, env=env, cwd=src, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert b"Traceback" not in done.stderr
    plain_gcc(src, *COMPILE[1:-1], "plain.o")
    assert (src / "k.o").read_bytes() == (src / "plain.o").read_bytes()
    return done


def warnings(*runs: subprocess.CompletedProcess[bytes]) -> list[str]:
    return [
        line
        for done in runs
        for line in done.stderr.decode().splitlines()
        if line.startswith("opcache: warning:")
    ]


def no_cache_at(env: dict[str, str]) -> bool:
    done = opcache("stats", env=env, cwd=Path(env["HOME"]), status=None)
    return done.returncode == 1 and done.stderr.startswith(b"opcache: error: no cache in ")


# -- the settings themselves ---------------------------------------------------------


def test_environment_settings_and_their_sources(tmp_path):
    env = {"HOME": str(tmp_path), "ASCEND_CACHE_PATH": "/ascend"}
    s = resolve_settings(environ={**env, "OPCACHE_DIR": "/ops", "OPCACHE_MODE": "Enable"})
    assert (s.mode, s.sources["mode"]) == ("enable", "env:OPCACHE_MODE")
    # OPCACHE_DIR is op_compiler_cache_dir (its op_cache.ini too), above ASCEND_CACHE_PATH.
    assert (s.root, s.sources["root"]) == (Path("/ops/kernel_cache"), "env:OPCACHE_DIR")
    s = resolve_settings(
        op_compiler_cache_mode="force",
        op_compiler_cache_dir="/arg",
        environ={**env, "OPCACHE_DIR": "/ops", "OPCACHE_MODE": "disable"},
    )
    assert (s.mode, s.root) == ("force", Path("/arg/kernel_cache"))  # arguments win
    for on in ("1", "yes", "TRUE", "anything"):
        s = resolve_settings(
            op_compiler_cache_mode="enable", environ={**env, "OPCACHE_DISABLE": on}
        )
        assert (s.mode, s.sources["mode"]) == ("disable", "env:OPCACHE_DISABLE")
    for off in ("", "0", "false", "No", "off"):
        s = resolve_settings(
            op_compiler_cache_mode="enable", environ={**env, "OPCACHE_DISABLE": off}
        )
        assert s.mode == "enable"
    s = resolve_settings(environ={**env, "OPCACHE_BASE_DIR": "~/work"})
    assert (s.base_dir, s.sources["base_dir"]) == (tmp_path / "work", "env:OPCACHE_BASE_DIR")
    assert resolve_settings(base_dir="/w", environ=env).base_dir == Path("/w")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OPCACHE_MODE", "sometimes"),
        ("OPCACHE_DIR", "/with space"),
        ("ASCEND_CACHE_PATH", "/with space"),
        ("OPCACHE_BASE_DIR", "relative/dir"),
        ("OPCACHE_SHARED_GROUP", "no-such-group-xyz"),
    ],
)
def test_a_bad_environment_variable_is_named_by_the_error(tmp_path, variable, value):
    with pytest.raises(ConfigError) as caught:
        resolve_settings(environ={"HOME": str(tmp_path), variable: value})
    assert caught.value.variable == variable and variable in str(caught.value)


def test_a_bad_argument_is_not_blamed_on_the_environment(tmp_path):
    with pytest.raises(ConfigError) as caught:
        resolve_settings(op_compiler_cache_mode="sometimes", environ={"HOME": str(tmp_path)})
    assert caught.value.variable is None


def test_config_shows_where_the_environment_put_the_cache(tmp_path):
    env = {**base_env(tmp_path), "OPCACHE_DIR": str(tmp_path / "ops"), "OPCACHE_MODE": "force"}
    data = json.loads(opcache("config", "--json", env=env, cwd=tmp_path).stdout)
    assert data["root"] == str(tmp_path / "ops" / "kernel_cache")
    assert data["sources"]["root"] == "env:OPCACHE_DIR"
    assert (data["mode"], data["sources"]["mode"]) == ("force", "env:OPCACHE_MODE")


# -- the masquerade, driven by the environment -----------------------------------------


def test_opcache_disable_runs_the_compiler_plainly(build):
    env, src = build
    for value in ("1", "yes"):
        masquerade({**env, "OPCACHE_DISABLE": value}, src)
    wrap(*COMPILE, env={**env, "OPCACHE_DISABLE": "1"}, cwd=src,
         flags=["--op_compiler_cache_mode=enable"])  # fmt: skip
    assert no_cache_at(env)  # nothing made, nothing counted
    masquerade({**env, "OPCACHE_DISABLE": "0"}, src)
    assert stats(env, "host")["misses"] == 1


def test_opcache_dir_and_mode_steer_the_masquerade(build, tmp_path):
    env, src = build
    own = {**env, "OPCACHE_DIR": str(tmp_path / "ops")}
    for _ in range(2):
        masquerade(own, src)
    assert no_cache_at(env)  # not in the ASCEND_CACHE_PATH cache
    assert stats(own, "host")["hits"] == 1
    masquerade({**own, "OPCACHE_MODE": "disable"}, src)
    assert stats(own, "host")["hits"] == 1  # not even looked up


def test_opcache_verbose_and_wrap_v_say_hit_or_miss_and_the_key(build):
    env, src = build
    loud = {**env, "OPCACHE_VERBOSE": "1"}
    said = [masquerade(loud, src).stderr.decode() for _ in range(2)]
    results = [re.findall(r"^opcache: info: (\w+), key ([0-9a-f]{32})$", s, re.M) for s in said]
    assert [r[0][0] for r in results] == ["miss", "hit"]
    assert results[0][0][1] == results[1][0][1]
    quiet = masquerade(env, src)
    assert quiet.stderr == b""
    done = wrap(*COMPILE, env=env, cwd=src, flags=["-v"])
    assert re.search(rb"^opcache: info: hit, key [0-9a-f]{32}$", done.stderr, re.M)
    done = wrap("gcc", "-E", "k.c", env=env, cwd=src, flags=["-v"])
    assert b"opcache: info: uncacheable (cc: preprocess only (-E))" in done.stderr


# -- a bad setting never fails a compile ------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ASCEND_CACHE_PATH", "/path with a space"),
        ("OPCACHE_DIR", "/path with a space"),
        ("OPCACHE_MODE", "sometimes"),
        ("OPCACHE_SHARED_GROUP", "no-such-group-xyz"),
    ],
)
def test_a_bad_environment_warns_once_and_compiles_without_the_cache(build, variable, value):
    env, src = build
    env = {**env, variable: value}
    runs = [masquerade(env, src) for _ in range(3)]
    runs.append(wrap(*COMPILE, env=env, cwd=src))
    (line,) = warnings(*runs)
    assert variable in line and "compiling without the cache" in line
    assert not Path(env["HOME"], "cache").exists()  # no cache was made anywhere


def state_notes(env: dict[str, str]) -> list[Path]:
    """The notes of warnings shown, kept in the user's state folder."""
    folder = Path(env["HOME"], ".local", "state", "opcache", ".opcache", "warned")
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_a_bad_setting_that_turns_the_cache_off_is_said_again_at_each_build(build):
    """Once per build (no pause over ten minutes between compiles), and once an hour
    within one: the next builds must not run uncached in silence."""
    env, src = build
    env = {**env, "OPCACHE_MODE": "sometimes"}
    assert len(warnings(*[masquerade(env, src) for _ in range(3)])) == 1
    (note,) = state_notes(env)
    note.write_text(repr(time.time() - 601))  # last met ten minutes ago, as older opcaches note
    assert len(warnings(*[masquerade(env, src) for _ in range(3)])) == 1  # a new build
    note.write_text(f"{time.time() - 3000!r} {time.time() - 5!r}")
    assert warnings(masquerade(env, src)) == []  # a build going on, told 50 minutes ago
    note.write_text(f"{time.time() - 3601!r} {time.time() - 5!r}")
    (line,) = warnings(masquerade(env, src))  # an hour later
    assert "OPCACHE_MODE" in line and "compiling without the cache" in line


def test_a_read_only_cache_warns_once_an_hour_and_compiles(build):
    env, src = build
    masquerade(env, src)  # the cache is made, with an entry

    def miss(offset: int) -> subprocess.CompletedProcess[bytes]:
        """A compile of a new key: it locks and stores, which a read-only cache refuses."""
        cmd = [*COMPILE[:2], f"-DOFFSET={offset}", *COMPILE[3:]]
        done = subprocess.run(cmd, env=env, cwd=src, capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done

    with read_only(Path(env["ASCEND_CACHE_PATH"])):
        (line,) = warnings(*[miss(offset) for offset in (10, 11, 12)])
        assert "Read-only file system" in line and "goes on without the cache" in line
        # Noted in the user's state folder, the cache being read-only; an hour later, again.
        (note,) = state_notes(env)
        note.write_text(repr(time.time() - 3601))
        assert len(warnings(miss(13), miss(14))) == 1


def test_a_bad_cache_flag_of_opcache_itself_is_still_an_error(build):
    env, src = build
    done = wrap(*COMPILE, env=env, cwd=src, status=2,
                flags=["--op_compiler_cache_dir", "/path with a space"])  # fmt: skip
    assert done.stderr.startswith(b"opcache: error: op_compiler_cache_dir=")
    assert not (src / "k.o").exists()


@pytest.mark.parametrize("bad", ["size variable", "op_cache.ini"])
def test_a_size_warning_shows_once_an_hour_per_cache(build, bad):
    env, src = build
    root = Path(env["ASCEND_CACHE_PATH"]) / f"kernel_cache_{host_id()}"
    if bad == "size variable":
        env = {**env, "ASCEND_MAX_OP_CACHE_SIZE": "lots"}
        named = "ASCEND_MAX_OP_CACHE_SIZE"
    else:
        root.mkdir(parents=True)
        (root / "op_cache.ini").write_text(
            "[op_compiler_cache]\nmax_op_cache_size=lots\nremain_cache_size_ratio=50\n"
        )
        named = "op_cache.ini"
    runs = [masquerade(env, src) for _ in range(3)]
    (line,) = warnings(*runs)
    assert named in line
    assert stats(env, "host")["hits"] == 2  # the cache works meanwhile
    # The note of when it was shown lives in the cache's bookkeeping; an hour later, again.
    (note,) = (root / ".opcache" / "warned").iterdir()
    note.write_text(repr(float(note.read_text()) - 3601))
    assert len(warnings(masquerade(env, src))) == 1
    assert warnings(masquerade(env, src)) == []


def host_id() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", os.uname().nodename)
