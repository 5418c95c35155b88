"""``opcache demo`` and the defaults of the compiling commands (``opcache config``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from fake_opc import base_env, make_toolkit

from opcache import demo
from opcache.cli import main

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="a C compiler is needed"
)
ROW = re.compile(r"^(\w+_\d+x\d+)\s+(\w+)\s+([\d.]+) ms\s+(\w+)\s+([\d.]+) ms$")


def demo_env(tmp_path: Path) -> dict[str, str]:
    env = base_env(tmp_path)
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")
    return env


def run_demo(tmp_path: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "opcache", "demo", *args],
        env=demo_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


def rows(text: str) -> list[tuple[str, str, float, str, float]]:
    found = []
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            name, a, ta, b, tb = match.groups()
            found.append((name, a, float(ta), b, float(tb)))
    return found


def test_demo_compiles_a_dozen_kernels_misses_then_hits_and_cleans_up(tmp_path):
    out = run_demo(tmp_path)
    table = rows(out)
    assert len(table) == 12
    assert len({name for name, *_ in table}) == 12
    assert {(a, b) for _, a, _, b, _ in table} == {("miss", "hit")}
    speedup = re.search(r"speed-up of the second run: (\d+)x", out)
    assert speedup and int(speedup.group(1)) >= 2
    # The cache went with the demo's folder: nothing points at it as if it stayed.
    assert "opcache stats" not in out
    (last,) = [line for line in out.splitlines() if "--keep" in line]
    assert "(removed with " in last
    assert list((tmp_path / "tmp").iterdir()) == []  # its folder is gone
    assert not (tmp_path / "cache").exists()  # ASCEND_CACHE_PATH was not touched


def test_demo_keep_leaves_a_cache_that_opcache_stats_reads(tmp_path):
    out = run_demo(tmp_path, "--keep")
    (folder,) = (tmp_path / "tmp").iterdir()
    assert folder.name.startswith("opcache-demo-")
    command = re.search(r"look at it:\s+(opcache stats .*)$", out, re.M).group(1).split()
    done = subprocess.run(
        [sys.executable, "-m", "opcache", *command[1:], "--json"],
        env=base_env(tmp_path),
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(done.stdout)
    assert (report["entries"], report["misses"], report["hits"]) == (12, 12, 12)
    assert report["time_saved_seconds"] > 0


def test_demo_follows_the_cache_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--op_compiler_cache_mode=disable"]) == 0
    text = capsys.readouterr().out
    table = rows(text)
    assert {(a, b) for _, a, _, b, _ in table} == {("disabled", "disabled")}
    assert text.endswith("\nthe cache was disabled: nothing was stored\n")
    assert "cache folder" not in text and "opcache stats" not in text
    assert list(tmp_path.iterdir()) == []
    own = tmp_path / "own"
    assert main(["demo", f"--op_compiler_cache_dir={own}"]) == 0
    assert main(["demo", f"--op_compiler_cache_dir={own}"]) == 0
    text = capsys.readouterr().out
    table = rows(text)
    assert [(a, b) for _, a, _, b, _ in table] == [("miss", "hit")] * 12 + [("hit", "hit")] * 12
    assert (own / "kernel_cache").is_dir()  # a cache the user named stays, and is shown
    assert text.endswith(f"look at it:   opcache stats --op_compiler_cache_dir {own}\n")
    assert main(["stats", f"--op_compiler_cache_dir={own}"]) == 0
    assert main(["demo", "--op_debug_level=1"]) == 0
    table = rows(capsys.readouterr().out)
    assert {(a, b) for _, a, _, b, _ in table} == {("bypass", "bypass")}
    assert main(["demo", "--op_compiler_cache_mode=sometimes"]) == 2
    assert "op_compiler_cache_mode" in capsys.readouterr().err


def test_demo_requests_are_distinct_kernels():
    requests = demo.requests()
    assert len(requests) == 12
    assert len({r.op_type for r in requests}) >= 3
    assert len({r.op_name for r in requests}) == 12
    from opcache.compilers.toolchain import kernel_name

    assert len({kernel_name(r) for r in requests}) == 12


# -- defaults of the compiling commands, as opcache config shows them --------------


def config(env: dict[str, str], *args: str, as_json: bool = True):
    done = subprocess.run(
        [sys.executable, "-m", "opcache", "config", *args, *(["--json"] if as_json else [])],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout) if as_json else done.stdout


def test_config_shows_which_default_applied_and_the_auto_compiler(tmp_path):
    env = base_env(tmp_path)
    data = config(env)
    assert data["mode"] == "disable"
    assert data["sources"]["mode"] == "default"
    assert "disable" in data["mode_default"]
    assert "enable for opcache wrap, compile and demo" in data["mode_default"]
    assert data["compiler_auto"].startswith("cc")
    text = config(env, as_json=False)
    assert re.search(r"^mode_default\s+disable", text, re.M)
    assert re.search(r"^compiler_auto\s+cc", text, re.M)
    # A mode given as a flag: no default applied.
    assert "mode_default" not in config(env, "--op_compiler_cache_mode=enable")
    env["ASCEND_HOME_PATH"] = str(make_toolkit(tmp_path / "toolkit"))
    assert re.search(r"^compiler_auto\s+cann", config(env, as_json=False), re.M)


def test_wrap_and_compile_default_to_enable(tmp_path):
    """Without any flag, wrap and compile cache (the library keeps ATC's disable)."""
    env = base_env(tmp_path)
    (tmp_path / "k.c").write_text("int k(void) { return 42; }\n")
    for _ in range(2):
        subprocess.run(
            [sys.executable, "-m", "opcache", "wrap", "--", "gcc", "-c", "k.c", "-o", "k.o"],
            env=env,
            cwd=tmp_path,
            check=True,
        )
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps({"op_type": "K", "soc_version": "Ascend910B1", "sources": {"k.c": "k.c"}})
    )
    outs = [
        subprocess.run(
            [
                sys.executable,
                "-m",
                "opcache",
                "compile",
                "--op",
                str(spec),
                "--output",
                "b",
                "--compiler",
                "cc",
                "--json",
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for _ in range(2)
    ]
    assert [json.loads(o)["operators"][0]["status"] for o in outs] == ["miss", "hit"]
    report = json.loads(
        subprocess.run(
            [sys.executable, "-m", "opcache", "stats", "--json"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert report["chips"]["host"]["hits"] == 1
    assert report["chips"]["Ascend910B1"]["hits"] == 1
