"""torch_npu's cache settings: ``ACL_OP_COMPILER_CACHE_MODE`` / ``ACL_OP_COMPILER_CACHE_DIR``.

torch_npu (``LazyInitAclops.cpp``, ``MakeCompileCacheDirAndSetOption``) reads
the two variables and hands them to CANN as the options ``op_compiler_cache_mode``
and ``op_compiler_cache_dir``, unless ``torch.npu.set_option`` set them first;
its mode defaults to ``enable`` and takes any value but the three modes as
``enable``.  CANN puts an option's folder above ``ASCEND_CACHE_PATH``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers_cann import SOC, kernel_name, store_entry

from opcache import ConfigError, resolve_settings, settings_from_options
from opcache.cli import main


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.chdir(tmp_path)
    return {"HOME": str(tmp_path / "home")}


def test_the_acl_folder_alone_is_the_cache_folder(env, tmp_path):
    env["ACL_OP_COMPILER_CACHE_DIR"] = str(tmp_path / "acl")
    settings = resolve_settings(environ=env)
    assert settings.root == tmp_path / "acl" / "kernel_cache"
    assert settings.sources["root"] == "env:ACL_OP_COMPILER_CACHE_DIR"


def test_the_acl_folder_ranks_as_torch_npu_and_cann_rank_it(env, tmp_path):
    env["ACL_OP_COMPILER_CACHE_DIR"] = str(tmp_path / "acl")
    env["ASCEND_CACHE_PATH"] = str(tmp_path / "ascend")
    # An option of CANN's beats ASCEND_CACHE_PATH: no per-host folder under it.
    assert resolve_settings(environ=env).root == tmp_path / "acl" / "kernel_cache"
    argument = resolve_settings(op_compiler_cache_dir=str(tmp_path / "arg"), environ=env)
    assert argument.root == tmp_path / "arg" / "kernel_cache"
    own = resolve_settings(environ={**env, "OPCACHE_DIR": str(tmp_path / "own")})
    assert own.root == tmp_path / "own" / "kernel_cache"
    empty = resolve_settings(environ={**env, "ACL_OP_COMPILER_CACHE_DIR": ""}, hostname="h")
    assert empty.root == tmp_path / "ascend" / "kernel_cache_h"


def test_a_bad_acl_folder_is_a_config_error_naming_the_variable(env):
    env["ACL_OP_COMPILER_CACHE_DIR"] = "/data/my cache"
    with pytest.raises(ConfigError, match="ACL_OP_COMPILER_CACHE_DIR") as caught:
        resolve_settings(environ=env)
    assert caught.value.variable == "ACL_OP_COMPILER_CACHE_DIR"


@pytest.mark.parametrize("mode", ["enable", "force", "disable"])
def test_the_acl_mode_sets_the_mode(env, mode):
    settings = resolve_settings(environ={**env, "ACL_OP_COMPILER_CACHE_MODE": mode})
    assert settings.mode == mode
    assert settings.sources["mode"] == "env:ACL_OP_COMPILER_CACHE_MODE"


def test_the_acl_mode_ranks_below_an_argument_and_opcache_mode(env):
    env["ACL_OP_COMPILER_CACHE_MODE"] = "disable"
    assert resolve_settings(op_compiler_cache_mode="force", environ=env).mode == "force"
    assert resolve_settings(environ={**env, "OPCACHE_MODE": "enable"}).mode == "enable"
    assert resolve_settings(environ={**env, "OPCACHE_DISABLE": "1"}).mode == "disable"
    unset = resolve_settings(environ={**env, "ACL_OP_COMPILER_CACHE_MODE": ""})
    assert unset.mode == "disable" and unset.sources["mode"] == "default"


@pytest.mark.parametrize("value", ["ENABLE", "off", "Disable"])
def test_another_acl_mode_is_enable_as_torch_npu_takes_it(env, value, caplog):
    with caplog.at_level(logging.WARNING, logger="opcache"):
        settings = resolve_settings(environ={**env, "ACL_OP_COMPILER_CACHE_MODE": value})
    assert settings.mode == "enable"
    assert "taken as enable" in caplog.text and "ACL_OP_COMPILER_CACHE_MODE" in caplog.text


def test_the_set_option_dict_defaults_to_enable(env, tmp_path):
    settings = settings_from_options({}, framework="torch_npu", environ=env)
    assert settings.mode == "enable" and settings.sources["mode"] == "default"
    assert settings.root == tmp_path / "home" / "atc_data" / "kernel_cache"


def test_the_set_option_dict_beats_the_variables(env, tmp_path):
    env["ACL_OP_COMPILER_CACHE_MODE"] = "disable"
    env["ACL_OP_COMPILER_CACHE_DIR"] = str(tmp_path / "from-env")
    options = {
        "ACL_OP_COMPILER_CACHE_MODE": "force",
        "ACL_OP_COMPILER_CACHE_DIR": str(tmp_path / "from-dict"),
        "ACL_OP_DEBUG_LEVEL": "0",
        "ACL_DEBUG_DIR": "dbg",
        "ACL_PRECISION_MODE": "must_keep_origin_dtype",  # (not a cache option: ignored)
    }
    settings = settings_from_options(options, framework="torch_npu", environ=env)
    assert settings.mode == "force" and settings.sources["mode"] == "argument"
    assert settings.root == tmp_path / "from-dict" / "kernel_cache"
    assert settings.debug_dir == tmp_path / "dbg"


def test_what_the_dict_leaves_unset_comes_from_the_variables(env, tmp_path):
    env["ACL_OP_COMPILER_CACHE_MODE"] = "disable"
    env["ACL_OP_COMPILER_CACHE_DIR"] = str(tmp_path / "from-env")
    env["ASCEND_CACHE_PATH"] = str(tmp_path / "ascend")
    # torch_npu takes an empty option as unset, as it takes a missing one.
    for options in ({}, {"ACL_OP_COMPILER_CACHE_MODE": "", "ACL_OP_COMPILER_CACHE_DIR": ""}):
        settings = settings_from_options(options, framework="torch_npu", environ=env)
        assert settings.mode == "disable"
        assert settings.root == tmp_path / "from-env" / "kernel_cache"


@pytest.mark.parametrize("value", ["sometimes", "Force", "ENABLE"])
def test_a_bad_mode_in_the_dict_is_a_config_error(env, value):
    # (set_option hands it to aclSetCompileopt as it is, and CANN takes the three modes
    # as spelled: "Force" was taken as force, where CANN refuses it)
    with pytest.raises(ConfigError, match="ACL_OP_COMPILER_CACHE_MODE"):
        settings_from_options(
            {"ACL_OP_COMPILER_CACHE_MODE": value}, framework="torch_npu", environ=env
        )
    with pytest.raises(ConfigError, match="set_option"):
        settings_from_options(["--x"], framework="torch_npu", environ=env)


def test_cann_stats_reads_the_acl_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ASCEND_CACHE_PATH", raising=False)
    monkeypatch.delenv("OPCACHE_DIR", raising=False)
    chip = tmp_path / "acl" / "kernel_cache" / SOC
    store_entry(chip, kernel_name("Add", "a"), b"\x7fELF" + b"x" * 100)
    home = tmp_path / "home" / "atc_data" / "kernel_cache" / SOC  # (where it looked before)
    store_entry(home, kernel_name("Mul", "m"), b"\x7fELF" + b"y" * 100)
    monkeypatch.setenv("ACL_OP_COMPILER_CACHE_DIR", str(tmp_path / "acl"))
    status = main(["cann", "stats", "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    report = json.loads(out)
    assert report["root"] == str(tmp_path / "acl" / "kernel_cache")
    assert report["total"]["entries"] == 1


def test_cann_help_lists_only_the_options_it_uses(capsys):
    with pytest.raises(SystemExit):
        main(["cann", "--help"])
    out = capsys.readouterr().out
    assert "--op_compiler_cache_dir" in out and "--soc_version" in out
    for flag in ("--op_compiler_cache_mode", "--op_debug_level", "--op_debug_config"):
        assert flag not in out
    assert main(["cann", "stats", "--op_debug_level", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "opcache: error: unrecognized arguments: --op_debug_level 1\n"
