"""``opcache config``: every resolved setting with its source, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import opcache
from opcache.cli import main

JSON_KEYS = {
    "mode",
    "root",
    "ini_path",
    "max_op_cache_size_mb",
    "remain_cache_size_ratio",
    "aging_enabled",
    "sources",
}
CACHE_VARIABLES = (
    "ASCEND_CACHE_PATH",
    "ASCEND_MAX_OP_CACHE_SIZE",
    "ASCEND_REMAIN_CACHE_SIZE_RATIO",
    "NPU_COLLECT_PATH",
    "OPCACHE_SHARED_GROUP",
    # The compiler `auto` picks (shown by `opcache config`) depends on these.
    "ASCEND_HOME_PATH",
    "ASCEND_TOOLKIT_HOME",
    "ASCEND_OPP_PATH",
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME is a fresh folder and no cache variable of the developer is set."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return home


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["config", *argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)


def assert_one_error_line(capsys: pytest.CaptureFixture[str], status: int) -> str:
    assert status == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("opcache: error: ")
    assert "Traceback" not in err
    return lines[0]


def test_config_prints_every_setting_with_its_source(home, capsys):
    assert main(["config"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert rows["mode"] == ["disable", "(default)"]
    assert rows["root"] == [str(home / "atc_data" / "kernel_cache"), "(default)"]
    assert rows["ini_path"] == [
        str(home / "atc_data" / "kernel_cache" / "op_cache.ini"),
        "(default)",
    ]
    assert rows["max_op_cache_size_mb"] == ["500", "(default)"]
    assert rows["remain_cache_size_ratio"] == ["50", "(default)"]
    assert rows["aging_enabled"] == ["True"]
    assert rows["debug_level"] == ["0", "(default)"]


def test_config_shows_environment_sources(home, capsys, monkeypatch):
    monkeypatch.setenv("ASCEND_MAX_OP_CACHE_SIZE", "-1")
    monkeypatch.setenv("ASCEND_REMAIN_CACHE_SIZE_RATIO", "30")
    assert main(["config"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["max_op_cache_size_mb"] == ["-1", "(env:ASCEND_MAX_OP_CACHE_SIZE)"]
    assert rows["remain_cache_size_ratio"] == ["30", "(env:ASCEND_REMAIN_CACHE_SIZE_RATIO)"]
    assert rows["aging_enabled"] == ["False"]


def test_config_json_has_the_documented_keys(home, capsys):
    data = run_json(capsys)
    assert data.keys() >= JSON_KEYS
    assert data["mode"] == "disable"
    assert data["root"] == str(home / "atc_data" / "kernel_cache")
    assert data["ini_path"] == str(home / "atc_data" / "kernel_cache" / "op_cache.ini")
    assert data["max_op_cache_size_mb"] == 500
    assert data["remain_cache_size_ratio"] == 50
    assert data["aging_enabled"] is True
    assert data["sources"]["mode"] == "default"
    assert data["sources"]["root"] == "default"
    assert data["sources"]["max_op_cache_size_mb"] == "default"


def test_config_json_reports_the_ini_in_force(home, tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=2048\nremain_cache_size_ratio=70\n"
    )
    data = run_json(capsys, f"--op_compiler_cache_dir={cache_dir}")
    assert data["ini_path"] == str(cache_dir / "op_cache.ini")
    assert data["max_op_cache_size_mb"] == 2048
    assert data["remain_cache_size_ratio"] == 70
    assert data["sources"]["max_op_cache_size_mb"] == "op_cache.ini"
    assert data["sources"]["remain_cache_size_ratio"] == "op_cache.ini"


def _flags(cache_dir: Path, cfg: Path, equals: bool) -> list[str]:
    pairs = [
        ("--op_compiler_cache_mode", "Enable"),
        ("--op_compiler_cache_dir", str(cache_dir)),
        ("--op_debug_level", "0"),
        ("--op_debug_config", str(cfg)),
        ("--soc_version", "Ascend910B1"),
    ]
    if equals:
        return [f"{flag}={value}" for flag, value in pairs]
    return [part for pair in pairs for part in pair]


@pytest.mark.parametrize("equals", [True, False], ids=["flag=value", "flag value"])
def test_config_accepts_both_flag_spellings(home, tmp_path, capsys, equals):
    cache_dir = tmp_path / "cache"
    cfg = tmp_path / "debug.cfg"
    cfg.write_text("op_debug_config = ccec_g\nop_debug_list = GatherV2, OpType::ReduceSum\n")
    data = run_json(capsys, *_flags(cache_dir, cfg, equals))
    assert data["mode"] == "enable"
    assert data["root"] == str(cache_dir / "kernel_cache")
    assert data["chip_dir"] == str(cache_dir / "kernel_cache" / "Ascend910B1")
    assert data["debug_level"] == 0
    assert data["debug_config"] == str(cfg)
    assert data["debug_options"] == ["ccec_g"]
    assert data["debug_list"] == ["GatherV2", "OpType::ReduceSum"]
    assert data["sources"]["mode"] == "argument"
    assert data["sources"]["root"] == "argument"
    assert data["sources"]["debug_level"] == "argument"
    assert data["sources"]["debug_config"] == "argument"


def test_config_bad_env_size_warns_once_per_run(home, capsys, monkeypatch):
    monkeypatch.setenv("ASCEND_MAX_OP_CACHE_SIZE", "lots")
    for _ in range(2):
        assert main(["config", "--json"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["max_op_cache_size_mb"] == 500
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("opcache: warning: ")
        assert "ASCEND_MAX_OP_CACHE_SIZE" in lines[0] and "lots" in lines[0]


@pytest.mark.parametrize(
    ("argv", "mentioned"),
    [
        (["config", "--op_compiler_cache_mode=bogus"], "op_compiler_cache_mode"),
        (["config", "--op_compiler_cache_mode", "bogus"], "op_compiler_cache_mode"),
        (["config", "--op_compiler_cache_dir=/tmp/my cache"], "op_compiler_cache_dir"),
        (["config", "--op_debug_level=9"], "op_debug_level"),
        (["config", "--op_debug_level", "x"], "op_debug_level"),
        (["config", "--op_debug_config=/nowhere/debug.cfg"], "op_debug_config"),
        (["config", "--soc_version=../etc"], "soc_version"),
        (["config", "--soc_version", "."], "soc_version"),
    ],
)
def test_config_error_is_one_line_and_exit_2(home, capsys, argv, mentioned):
    line = assert_one_error_line(capsys, main(argv))
    assert mentioned in line


def test_invalid_ascend_cache_path_is_one_error_line(home, capsys, monkeypatch):
    monkeypatch.setenv("ASCEND_CACHE_PATH", "/tmp/bad*path")
    line = assert_one_error_line(capsys, main(["config"]))
    assert "ASCEND_CACHE_PATH" in line


@pytest.mark.parametrize(
    ("argv", "mentioned"),
    [
        (["config", "--bogus"], "--bogus"),
        (["config", "--op_compiler_cache_mode"], "--op_compiler_cache_mode"),
        (["nosuchcommand"], "nosuchcommand"),
    ],
)
def test_usage_error_is_one_line_and_exit_2(home, capsys, argv, mentioned):
    line = assert_one_error_line(capsys, main(argv))
    assert mentioned in line


def test_bare_opcache_prints_the_commands_on_stderr_exit_2(home, capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: opcache ")
    for command in ("config", "stats", "age", "clear", "verify", "compile", "demo", "wrap"):
        assert f"\n    {command} " in err, command


def test_version_prints_the_version_and_exits_0(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "opcache", "--version"],
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith(f"opcache {opcache.__version__} (Python ")


@pytest.mark.parametrize("command", ["config", "stats", "wrap"])
def test_an_empty_soc_version_is_unset_as_every_empty_value(home, capsys, command):
    if command == "wrap":
        assert main(["wrap", "--soc_version", "", "--", "true"]) == 0
    else:
        (home / "kernel_cache").mkdir()
        (home / "kernel_cache" / "op_cache.ini").touch()
        assert main([command, "--soc_version=", "--op_compiler_cache_dir", str(home)]) == 0
    assert "error" not in capsys.readouterr().err


def _clean_env(home: Path) -> dict[str, str]:
    return {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def test_python_m_opcache_config_json(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "opcache", "config", "--json"],
        env=_clean_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    data = json.loads(result.stdout)
    assert data.keys() >= JSON_KEYS
    assert data["mode"] == "disable"
    assert data["root"] == str(tmp_path / "atc_data" / "kernel_cache")
    assert data["ini_path"] == str(tmp_path / "atc_data" / "kernel_cache" / "op_cache.ini")
    assert data["max_op_cache_size_mb"] == 500
    assert data["remain_cache_size_ratio"] == 50
    assert data["aging_enabled"] is True
    assert data["sources"]["root"] == "default"
    assert data["sources"]["max_op_cache_size_mb"] == "default"


def test_python_m_opcache_error_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "opcache", "config", "--op_compiler_cache_mode", "bogus"],
        env=_clean_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("opcache: error: op_compiler_cache_mode='bogus'")
