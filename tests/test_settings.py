"""One test per configuration rule of issue 2: the value and where it came from.

Everything that touches the filesystem runs under pyfakefs (the ``fs``
fixture), and every call passes an explicit ``environ`` (and ``hostname`` where
ASCEND_CACHE_PATH is used) so the developer's own environment never leaks in.
"""

from __future__ import annotations

import configparser
import logging
import os
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyfakefs.helpers import set_uid

from opcache import ConfigError, Settings, ensure_ini_file, resolve_settings
from opcache import ini as ini_module
from opcache.ini import read_size_limits
from opcache.settings import MB

MAX_ENV = "ASCEND_MAX_OP_CACHE_SIZE"
RATIO_ENV = "ASCEND_REMAIN_CACHE_SIZE_RATIO"


def write_ini(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def size_ini(max_mb: object, ratio: object) -> str:
    return f"[op_compiler_cache]\nmax_op_cache_size={max_mb}\nremain_cache_size_ratio={ratio}\n"


def write_cfg(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def assert_size_source(settings: Settings, source: str) -> None:
    assert settings.sources["max_op_cache_size_mb"] == source
    assert settings.sources["remain_cache_size_ratio"] == source


# --------------------------------------------------------------------------- mode


def test_mode_defaults_to_disable(env):
    settings = resolve_settings(environ=env)
    assert settings.mode == "disable"
    assert settings.sources["mode"] == "default"


@pytest.mark.parametrize("unset", [None, ""])
def test_mode_none_or_empty_is_unset(env, unset):
    settings = resolve_settings(op_compiler_cache_mode=unset, environ=env)
    assert settings.mode == "disable"
    assert settings.sources["mode"] == "default"


def test_default_mode_can_be_chosen_by_the_tool(env):
    settings = resolve_settings(environ=env, default_mode="enable")
    assert settings.mode == "enable"
    assert settings.sources["mode"] == "default"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("enable", "enable"),
        ("ENABLE", "enable"),
        ("Force", "force"),
        ("fOrCe", "force"),
        ("disable", "disable"),
        ("DISABLE", "disable"),
    ],
)
def test_mode_is_case_insensitive(env, given, expected):
    settings = resolve_settings(op_compiler_cache_mode=given, environ=env)
    assert settings.mode == expected
    assert settings.sources["mode"] == "argument"


@pytest.mark.parametrize("bad", ["bogus", "enabled", " enable", "on", "1", "forced"])
def test_invalid_mode_names_option_value_and_valid_values(env, bad):
    with pytest.raises(ConfigError) as info:
        resolve_settings(op_compiler_cache_mode=bad, environ=env)
    message = str(info.value)
    assert "op_compiler_cache_mode" in message
    assert repr(bad) in message
    for valid in ("enable", "force", "disable"):
        assert valid in message
    assert "\n" not in message


# --------------------------------------------------------------------------- root


def test_root_defaults_to_home_atc_data(env, fake_home):
    settings = resolve_settings(environ=env)
    assert settings.root == fake_home / "atc_data" / "kernel_cache"
    assert settings.sources["root"] == "default"


def test_root_from_op_compiler_cache_dir(env):
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.root == Path("/data/cache/kernel_cache")
    assert settings.sources["root"] == "argument"


def test_root_accepts_a_path_object(env):
    settings = resolve_settings(op_compiler_cache_dir=Path("/data/cache"), environ=env)
    assert settings.root == Path("/data/cache/kernel_cache")
    assert settings.sources["root"] == "argument"


def test_op_compiler_cache_dir_beats_ascend_cache_path(env):
    env["ASCEND_CACHE_PATH"] = "/shared/cache"
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env, hostname="node1")
    assert settings.root == Path("/data/cache/kernel_cache")
    assert settings.sources["root"] == "argument"


def test_root_from_ascend_cache_path_is_per_host(env):
    env["ASCEND_CACHE_PATH"] = "/shared/cache"
    settings = resolve_settings(environ=env, hostname="node-1.cluster")
    assert settings.root == Path("/shared/cache/kernel_cache_node-1.cluster")
    assert settings.sources["root"] == "env:ASCEND_CACHE_PATH"


@pytest.mark.parametrize(
    ("hostname", "host_id"),
    [
        ("my host", "my_host"),
        ("a/b\\c:d", "a_b_c_d"),
        ("h\u00f6st", "h_st"),
        ("node*1?", "node_1_"),
        ("Node_7-x.y", "Node_7-x.y"),
    ],
)
def test_host_id_replaces_unsafe_characters(env, hostname, host_id):
    env["ASCEND_CACHE_PATH"] = "/shared/cache"
    settings = resolve_settings(environ=env, hostname=hostname)
    assert settings.root == Path(f"/shared/cache/kernel_cache_{host_id}")
    assert settings.sources["root"] == "env:ASCEND_CACHE_PATH"


@pytest.mark.parametrize("value", ["", "  ", "\t"])
def test_empty_ascend_cache_path_is_unset(env, fake_home, value):
    env["ASCEND_CACHE_PATH"] = value
    settings = resolve_settings(environ=env, hostname="node1")
    assert settings.root == fake_home / "atc_data" / "kernel_cache"
    assert settings.sources["root"] == "default"


def test_ascend_cache_path_is_trimmed_as_cann_trims_it(env):
    """CANN trims the variable; a trailing space (a profile's line) was refused, exit 2."""
    env["ASCEND_CACHE_PATH"] = " /shared/cache \t"
    settings = resolve_settings(environ=env, hostname="node1")
    assert settings.root == Path("/shared/cache/kernel_cache_node1")


def test_tilde_in_op_compiler_cache_dir_uses_the_given_home(env, fake_home):
    settings = resolve_settings(op_compiler_cache_dir="~/my_cache", environ=env)
    assert settings.root == fake_home / "my_cache" / "kernel_cache"
    assert settings.sources["root"] == "argument"


def test_tilde_alone_is_home(env, fake_home):
    settings = resolve_settings(op_compiler_cache_dir="~", environ=env)
    assert settings.root == fake_home / "kernel_cache"


def test_tilde_in_ascend_cache_path_uses_the_given_home(env, fake_home):
    env["ASCEND_CACHE_PATH"] = "~/shared"
    settings = resolve_settings(environ=env, hostname="node1")
    assert settings.root == fake_home / "shared" / "kernel_cache_node1"
    assert settings.sources["root"] == "env:ASCEND_CACHE_PATH"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("cache", "/work/proj/cache/kernel_cache"),
        ("./cache", "/work/proj/cache/kernel_cache"),
        ("../other", "/work/other/kernel_cache"),
        ("a/b/../c", "/work/proj/a/c/kernel_cache"),
    ],
)
def test_relative_op_compiler_cache_dir_is_made_absolute(fs, env, given, expected):
    fs.create_dir("/work/proj")
    os.chdir("/work/proj")
    settings = resolve_settings(op_compiler_cache_dir=given, environ=env)
    assert settings.root == Path(expected)
    assert settings.root.is_absolute()
    assert settings.sources["root"] == "argument"


def test_relative_ascend_cache_path_is_made_absolute(fs, env):
    fs.create_dir("/work/proj")
    os.chdir("/work/proj")
    env["ASCEND_CACHE_PATH"] = "shared"
    settings = resolve_settings(environ=env, hostname="node1")
    assert settings.root == Path("/work/proj/shared/kernel_cache_node1")
    assert settings.sources["root"] == "env:ASCEND_CACHE_PATH"


BAD_DIRS = [
    "/data/my cache",
    "/data/c*che",
    "/data/a;b",
    "/data/$HOME",
    "/data/tab\there",
    "/data/new\nline",
    "/data/caf\u00e9",  # a letter, but neither ASCII nor CJK
    "/data/a:b",
    "/data/(x)",
    "/data/\u00a0nbsp",
]


@pytest.mark.parametrize("bad", BAD_DIRS)
def test_invalid_op_compiler_cache_dir_raises(env, bad):
    with pytest.raises(ConfigError) as info:
        resolve_settings(op_compiler_cache_dir=bad, environ=env)
    message = str(info.value)
    assert "op_compiler_cache_dir" in message
    assert repr(bad) in message
    assert "ASCII letters" in message and "CJK" in message
    assert "\n" not in message


@pytest.mark.parametrize("bad", BAD_DIRS)
def test_invalid_ascend_cache_path_raises(env, bad):
    env["ASCEND_CACHE_PATH"] = bad
    with pytest.raises(ConfigError) as info:
        resolve_settings(environ=env, hostname="node1")
    message = str(info.value)
    assert "ASCEND_CACHE_PATH" in message
    assert repr(bad) in message
    assert "ASCII letters" in message and "CJK" in message


def test_cjk_op_compiler_cache_dir_is_accepted(env):
    settings = resolve_settings(op_compiler_cache_dir="/data/\u7f13\u5b58_cache", environ=env)
    assert settings.root == Path("/data/\u7f13\u5b58_cache/kernel_cache")
    assert settings.sources["root"] == "argument"


def test_cjk_ascend_cache_path_is_accepted(env):
    env["ASCEND_CACHE_PATH"] = "/\u5171\u4eab/cache"
    settings = resolve_settings(environ=env, hostname="node1")
    assert settings.root == Path("/\u5171\u4eab/cache/kernel_cache_node1")
    assert settings.sources["root"] == "env:ASCEND_CACHE_PATH"


def test_allowed_punctuation_in_dir_is_accepted(env):
    settings = resolve_settings(op_compiler_cache_dir="/data/a_b-c.d/e", environ=env)
    assert settings.root == Path("/data/a_b-c.d/e/kernel_cache")


# --------------------------------------------------------------------------- chip_dir


@pytest.mark.parametrize("soc", ["Ascend910B1", "Ascend310P3", "Ascend910B4-1", "Ascend910_9391"])
def test_chip_dir_is_root_slash_soc_version(env, soc):
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.chip_dir(soc) == Path("/data/cache/kernel_cache") / soc
    assert settings.chip_dir(soc).parent == settings.root


@pytest.mark.parametrize(
    "bad",
    [
        *[".", "..", ".hidden", "a/b", "../x", "/abs", "a\\b", "", "Ascend 910", "Ascend910\n"],
        *["x*", "op_cache.ini", "a..b", "_size", "-x", "A" * 65],
    ],
)
def test_invalid_soc_version_raises(env, bad):
    settings = resolve_settings(environ=env)
    with pytest.raises(ConfigError) as info:
        settings.chip_dir(bad)
    message = str(info.value)
    assert "soc_version" in message
    assert repr(bad) in message


def test_non_string_soc_version_raises(env):
    settings = resolve_settings(environ=env)
    with pytest.raises(ConfigError, match="soc_version"):
        settings.chip_dir(None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- size limits


def test_size_defaults_are_500_mb_and_50_percent(env, caplog):
    settings = resolve_settings(environ=env)
    assert settings.max_op_cache_size_mb == 500
    assert settings.remain_cache_size_ratio == 50
    assert settings.aging_enabled is True
    assert settings.max_bytes == 500 * 1_048_576
    assert_size_source(settings, "default")
    assert warnings_of(caplog) == []


def test_mb_is_1048576_bytes(env):
    env[MAX_ENV] = "3"
    settings = resolve_settings(environ=env)
    assert MB == 1_048_576
    assert settings.max_bytes == 3 * 1_048_576


def test_env_size_variables_are_used(env, caplog):
    env[MAX_ENV] = "1024"
    env[RATIO_ENV] = "80"
    settings = resolve_settings(environ=env)
    assert settings.max_op_cache_size_mb == 1024
    assert settings.remain_cache_size_ratio == 80
    assert settings.sources["max_op_cache_size_mb"] == f"env:{MAX_ENV}"
    assert settings.sources["remain_cache_size_ratio"] == f"env:{RATIO_ENV}"
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("value", ["-1", "1", "2", "500", "2147483646"])
def test_env_max_size_valid_range(env, caplog, value):
    env[MAX_ENV] = value
    settings = resolve_settings(environ=env)
    assert settings.max_op_cache_size_mb == int(value)
    assert settings.sources["max_op_cache_size_mb"] == f"env:{MAX_ENV}"
    assert settings.remain_cache_size_ratio == 50
    assert settings.sources["remain_cache_size_ratio"] == "default"
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("value", ["1", "50", "99", "100"])
def test_env_ratio_valid_range(env, caplog, value):
    env[RATIO_ENV] = value
    settings = resolve_settings(environ=env)
    assert settings.remain_cache_size_ratio == int(value)
    assert settings.sources["remain_cache_size_ratio"] == f"env:{RATIO_ENV}"
    assert settings.max_op_cache_size_mb == 500
    assert settings.sources["max_op_cache_size_mb"] == "default"
    assert warnings_of(caplog) == []


BAD_MAX = ["0", "-2", "-100", "2147483647", "99999999999", "abc", "1.5", "100MB", "1e3", "0x10"]
BAD_RATIO = ["0", "-1", "101", "1000", "half", "50%", "5.0"]


@pytest.mark.parametrize(
    ("name", "value", "default"),
    [(MAX_ENV, v, 500) for v in BAD_MAX] + [(RATIO_ENV, v, 50) for v in BAD_RATIO],
)
def test_invalid_env_size_warns_once_and_uses_default(env, caplog, name, value, default):
    env[name] = value
    with caplog.at_level(logging.WARNING, logger="opcache"):
        settings = resolve_settings(environ=env)
    attr = "max_op_cache_size_mb" if name == MAX_ENV else "remain_cache_size_ratio"
    assert getattr(settings, attr) == default
    assert settings.sources[attr] == "default"
    records = warnings_of(caplog)
    assert len(records) == 1
    message = records[0].getMessage()
    assert name in message
    assert value in message


def test_env_with_thousands_of_digits_warns_instead_of_raising(env, caplog):
    value = "1" * 5000  # beyond Python's int-from-str digit limit
    env[MAX_ENV] = value
    env[RATIO_ENV] = value
    settings = resolve_settings(environ=env)
    assert settings.max_op_cache_size_mb == 500
    assert settings.remain_cache_size_ratio == 50
    assert_size_source(settings, "default")
    assert len(warnings_of(caplog)) == 2


def test_invalid_max_env_does_not_affect_valid_ratio_env(env, caplog):
    env[MAX_ENV] = "0"
    env[RATIO_ENV] = "30"
    settings = resolve_settings(environ=env)
    assert settings.max_op_cache_size_mb == 500
    assert settings.sources["max_op_cache_size_mb"] == "default"
    assert settings.remain_cache_size_ratio == 30
    assert settings.sources["remain_cache_size_ratio"] == f"env:{RATIO_ENV}"
    assert len(warnings_of(caplog)) == 1


def test_empty_env_size_variables_are_unset(env, caplog):
    env[MAX_ENV] = ""
    env[RATIO_ENV] = ""
    settings = resolve_settings(environ=env)
    assert settings.max_op_cache_size_mb == 500
    assert settings.remain_cache_size_ratio == 50
    assert_size_source(settings, "default")
    assert warnings_of(caplog) == []


def test_env_minus_one_turns_aging_off(env):
    env[MAX_ENV] = "-1"
    settings = resolve_settings(environ=env)
    assert settings.max_op_cache_size_mb == -1
    assert settings.aging_enabled is False
    assert settings.max_bytes is None
    assert settings.sources["max_op_cache_size_mb"] == f"env:{MAX_ENV}"


# --------------------------------------------------------------------------- op_cache.ini


def test_ini_at_root_supplies_both_keys_over_env(env, fake_home, caplog):
    root = fake_home / "atc_data" / "kernel_cache"
    write_ini(root / "op_cache.ini", size_ini(2048, 70))
    env[MAX_ENV] = "1024"
    env[RATIO_ENV] = "80"
    settings = resolve_settings(environ=env)
    assert settings.max_op_cache_size_mb == 2048
    assert settings.remain_cache_size_ratio == 70
    assert settings.ini_path == root / "op_cache.ini"
    assert_size_source(settings, "op_cache.ini")
    assert warnings_of(caplog) == []


def test_ini_in_op_compiler_cache_dir_supplies_both_keys(env, caplog):
    write_ini(Path("/data/cache/op_cache.ini"), size_ini(300, 20))
    env[MAX_ENV] = "1024"
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 300
    assert settings.remain_cache_size_ratio == 20
    assert settings.ini_path == Path("/data/cache/op_cache.ini")
    assert_size_source(settings, "op_cache.ini")
    assert warnings_of(caplog) == []


def test_ini_at_root_is_read_before_the_one_in_op_compiler_cache_dir(env):
    write_ini(Path("/data/cache/kernel_cache/op_cache.ini"), size_ini(111, 11))
    write_ini(Path("/data/cache/op_cache.ini"), size_ini(222, 22))
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 111
    assert settings.remain_cache_size_ratio == 11
    assert settings.ini_path == Path("/data/cache/kernel_cache/op_cache.ini")
    assert_size_source(settings, "op_cache.ini")


def test_generated_ini_at_root_never_hides_a_persons_ini(env, caplog):
    assert ensure_ini_file(Path("/data/cache/kernel_cache/op_cache.ini")) is True
    write_ini(Path("/data/cache/op_cache.ini"), size_ini(222, 22))
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 222
    assert settings.remain_cache_size_ratio == 22
    assert settings.ini_path == Path("/data/cache/op_cache.ini")
    assert_size_source(settings, "op_cache.ini")
    assert warnings_of(caplog) == []


def test_cann_generated_ini_with_version_keys_never_hides_a_persons_ini(env, caplog):
    write_ini(
        Path("/data/cache/kernel_cache/op_cache.ini"),
        "[op_compiler_cache]\nadk_version=7.0.0\nops_version=7.0.0\n",
    )
    write_ini(Path("/data/cache/op_cache.ini"), size_ini(-1, 60))
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == -1
    assert settings.aging_enabled is False
    assert settings.remain_cache_size_ratio == 60
    assert settings.ini_path == Path("/data/cache/op_cache.ini")
    assert_size_source(settings, "op_cache.ini")
    assert warnings_of(caplog) == []


def test_invalid_ini_at_root_falls_through_to_the_second_ini(env, caplog):
    first = write_ini(Path("/data/cache/kernel_cache/op_cache.ini"), size_ini(0, 22))
    write_ini(Path("/data/cache/op_cache.ini"), size_ini(222, 22))
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 222
    assert settings.ini_path == Path("/data/cache/op_cache.ini")
    assert_size_source(settings, "op_cache.ini")
    records = warnings_of(caplog)
    assert len(records) == 1
    assert str(first) in records[0].getMessage()


def test_ini_path_names_root_ini_when_no_file_supplies_the_keys(env):
    ensure_ini_file(Path("/data/cache/op_cache.ini"))
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.ini_path == Path("/data/cache/kernel_cache/op_cache.ini")
    assert_size_source(settings, "default")


def test_ini_path_defaults_to_root_ini(env, fake_home):
    settings = resolve_settings(environ=env)
    assert settings.ini_path == fake_home / "atc_data" / "kernel_cache" / "op_cache.ini"


def test_ini_in_home_is_not_read_without_op_compiler_cache_dir(env, fake_home):
    # The second place is <op_compiler_cache_dir>/op_cache.ini only.
    write_ini(fake_home / "atc_data" / "op_cache.ini", size_ini(222, 22))
    settings = resolve_settings(environ=env)
    assert settings.max_op_cache_size_mb == 500
    assert_size_source(settings, "default")


def test_ini_under_ascend_cache_path_root(env):
    root = Path("/shared/cache/kernel_cache_node1")
    write_ini(root / "op_cache.ini", size_ini(900, 90))
    env["ASCEND_CACHE_PATH"] = "/shared/cache"
    settings = resolve_settings(environ=env, hostname="node1")
    assert settings.max_op_cache_size_mb == 900
    assert settings.remain_cache_size_ratio == 90
    assert settings.ini_path == root / "op_cache.ini"
    assert_size_source(settings, "op_cache.ini")


def test_ini_minus_one_turns_aging_off(env):
    write_ini(Path("/data/cache/op_cache.ini"), size_ini(-1, 50))
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == -1
    assert settings.aging_enabled is False
    assert settings.max_bytes is None
    assert_size_source(settings, "op_cache.ini")


@pytest.mark.parametrize(
    ("max_mb", "ratio"), [(1, 1), (2147483646, 100), (-1, 1), (500, 50), ("+7", "007")]
)
def test_ini_valid_range_boundaries(env, caplog, max_mb, ratio):
    write_ini(Path("/data/cache/op_cache.ini"), size_ini(max_mb, ratio))
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == int(max_mb)
    assert settings.remain_cache_size_ratio == int(ratio)
    assert_size_source(settings, "op_cache.ini")
    assert warnings_of(caplog) == []


def test_ini_tolerates_comments_spaces_and_other_keys(env, caplog):
    text = (
        "# written by hand\n"
        "[op_compiler_cache]\n"
        "adk_version = 7.0.0\n"
        "; another comment\n"
        "max_op_cache_size = 4096 \n"
        "\n"
        "remain_cache_size_ratio =  25\n"
    )
    write_ini(Path("/data/cache/op_cache.ini"), "\ufeff" + text)  # and a BOM
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 4096
    assert settings.remain_cache_size_ratio == 25
    assert_size_source(settings, "op_cache.ini")
    assert warnings_of(caplog) == []


INVALID_INIS = {
    "other section only": (
        "[cache]\nmax_op_cache_size=100\nremain_cache_size_ratio=30\n",
        "op_compiler_cache",
    ),
    "binary garbage": (
        b"\x00\xff\xfe\x80garbage=\x80\n[op_compiler_cache]\nmax_op_cache_size=\xff\n"
        b"remain_cache_size_ratio=1",
        "max_op_cache_size",
    ),
    "max not a number": (size_ini("abc", 30), "abc"),
    "ratio not a number": (size_ini(100, "half"), "half"),
    "max empty": (size_ini("", 30), "max_op_cache_size"),
    "max zero": (size_ini(0, 30), "0"),
    "max below -1": (size_ini(-2, 30), "-2"),
    "max too large": (size_ini(2147483648, 30), "2147483648"),
    "max thousands of digits": (size_ini("9" * 5000, 30), "max_op_cache_size"),
    "ratio zero": (size_ini(100, 0), "0"),
    "ratio too large": (size_ini(100, 101), "101"),
    "ratio negative": (size_ini(100, -5), "-5"),
    "only max": ("[op_compiler_cache]\nmax_op_cache_size=100\n", "remain_cache_size_ratio"),
    "only ratio": ("[op_compiler_cache]\nremain_cache_size_ratio=30\n", "max_op_cache_size"),
}


@pytest.mark.parametrize(("text", "mentioned"), list(INVALID_INIS.values()), ids=list(INVALID_INIS))
def test_invalid_ini_warns_once_naming_the_file_and_falls_back_to_env(env, caplog, text, mentioned):
    path = write_ini(Path("/data/cache/op_cache.ini"), text)
    env[MAX_ENV] = "700"
    env[RATIO_ENV] = "40"
    with caplog.at_level(logging.WARNING, logger="opcache"):
        settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 700
    assert settings.remain_cache_size_ratio == 40
    assert settings.sources["max_op_cache_size_mb"] == f"env:{MAX_ENV}"
    assert settings.sources["remain_cache_size_ratio"] == f"env:{RATIO_ENV}"
    assert settings.ini_path == Path("/data/cache/kernel_cache/op_cache.ini")
    records = warnings_of(caplog)
    assert len(records) == 1
    message = records[0].getMessage()
    assert str(path) in message
    if mentioned is not None:
        assert mentioned in message


@pytest.mark.parametrize(
    "text",
    [
        size_ini(0, 30),
        "[op_compiler_cache]\nmax_op_cache_size=100\n",
        "[a]\nk=v\n" + size_ini(1, 1),  # another section first
    ],
)
def test_invalid_ini_falls_back_to_defaults_without_env(env, caplog, text):
    write_ini(Path("/data/cache/op_cache.ini"), text)
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 500
    assert settings.remain_cache_size_ratio == 50
    assert_size_source(settings, "default")
    assert len(warnings_of(caplog)) == 1


# Read line by line as CANN reads it (issue 18): what CANN applies, opcache's own cache applies.
CANN_READ_INIS = {
    "keys above the section": (
        "max_op_cache_size=100\nremain_cache_size_ratio=30\n[op_compiler_cache]\n",
        (100, 30),
    ),
    "a line without =": (size_ini(100, 30) + "this line is garbage\n", (100, 30)),
    "stoi's leading digits": (size_ini("100MB", "30%"), (100, 30)),
    "a float": (size_ini("1.5", 30), (1, 30)),
    "INT_MAX": (size_ini(2147483647, 30), (2147483647, 30)),
    "indented keys": (
        "[op_compiler_cache]\n  max_op_cache_size=100\n\tremain_cache_size_ratio=30\n",
        (100, 30),
    ),
    "no section at all": ("max_op_cache_size=100\nremain_cache_size_ratio=30\n", None),
    "colon lines": (
        "[op_compiler_cache]\nmax_op_cache_size: 100\nremain_cache_size_ratio: 30\n",
        None,
    ),
}


@pytest.mark.parametrize(("text", "read"), list(CANN_READ_INIS.values()), ids=list(CANN_READ_INIS))
def test_own_ini_is_read_as_cann_reads_it_without_its_versions(env, caplog, text, read):
    """te_cache_space_manager.cc LoadIniFile / UpdateOpCacheSizeCfg; a file CANN finds no
    size keys in is silent, as one with neither key is."""
    write_ini(Path("/data/cache/op_cache.ini"), text)
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    limits = (settings.max_op_cache_size_mb, settings.remain_cache_size_ratio)
    assert limits == (read or (500, 50))
    assert warnings_of(caplog) == []


def test_only_one_ini_key_does_not_mix_with_env(env):
    # The single valid key is ignored too: the two keys work only together.
    write_ini(Path("/data/cache/op_cache.ini"), "[op_compiler_cache]\nmax_op_cache_size=100\n")
    env[RATIO_ENV] = "40"
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 500
    assert settings.sources["max_op_cache_size_mb"] == "default"
    assert settings.remain_cache_size_ratio == 40
    assert settings.sources["remain_cache_size_ratio"] == f"env:{RATIO_ENV}"


def test_ini_that_is_a_folder_warns_once_and_falls_back(fs, env, caplog):
    fs.create_dir("/data/cache/op_cache.ini")
    env[MAX_ENV] = "700"
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 700
    assert settings.sources["max_op_cache_size_mb"] == f"env:{MAX_ENV}"
    records = warnings_of(caplog)
    assert len(records) == 1
    assert "/data/cache/op_cache.ini" in records[0].getMessage()


def test_unreadable_ini_warns_once_and_falls_back(fs, env, caplog):
    path = write_ini(Path("/data/cache/op_cache.ini"), size_ini(100, 30))
    os.chmod(path, 0o000)
    set_uid(1000)  # pyfakefs ignores permissions for root; reset when the fixture ends
    env[MAX_ENV] = "700"
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 700
    assert settings.remain_cache_size_ratio == 50
    assert settings.sources["max_op_cache_size_mb"] == f"env:{MAX_ENV}"
    assert settings.sources["remain_cache_size_ratio"] == "default"
    records = warnings_of(caplog)
    assert len(records) == 1
    assert str(path) in records[0].getMessage()


NEITHER_KEY_INIS = {
    "empty": "",
    "comments only": "# nothing here\n; nor here\n\n",
    "section only": "[op_compiler_cache]\n",
    "cann versions": "[op_compiler_cache]\nadk_version=7.0.0\nops_version=7.0.0\n",
    "commented keys": "[op_compiler_cache]\n#max_op_cache_size=100\n#remain_cache_size_ratio=30\n",
    "opcache template": ini_module._TEMPLATE,
}


@pytest.mark.parametrize("text", list(NEITHER_KEY_INIS.values()), ids=list(NEITHER_KEY_INIS))
def test_ini_with_neither_size_key_warns_nothing(env, caplog, text):
    write_ini(Path("/data/cache/kernel_cache/op_cache.ini"), text)
    write_ini(Path("/data/cache/op_cache.ini"), text)
    env[MAX_ENV] = "700"
    with caplog.at_level(logging.DEBUG, logger="opcache"):
        settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 700
    assert settings.sources["max_op_cache_size_mb"] == f"env:{MAX_ENV}"
    assert settings.remain_cache_size_ratio == 50
    assert settings.sources["remain_cache_size_ratio"] == "default"
    assert warnings_of(caplog) == []


def test_invalid_ini_and_invalid_env_warn_once_each(env, caplog):
    path = write_ini(Path("/data/cache/op_cache.ini"), size_ini(0, 30))
    env[MAX_ENV] = "zero"
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 500
    assert_size_source(settings, "default")
    messages = [r.getMessage() for r in warnings_of(caplog)]
    assert len(messages) == 2
    assert str(path) in messages[0]
    assert MAX_ENV in messages[1] and "zero" in messages[1]


@given(st.binary(max_size=512))
def test_read_size_limits_never_raises_on_arbitrary_bytes(raw):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "op_cache.ini"
        path.write_bytes(raw)
        limits = read_size_limits(path)
    if limits is not None:
        assert limits.max_op_cache_size_mb == -1 or 1 <= limits.max_op_cache_size_mb <= 2**31 - 1
        assert 1 <= limits.remain_cache_size_ratio <= 100


@given(
    st.text(
        alphabet=st.sampled_from("[]=:#;\n \t+-0123456789abcx_\u00e9\u7f13"),
        max_size=200,
    ).map(lambda body: "[op_compiler_cache]\n" + body)
)
def test_read_size_limits_never_raises_on_ini_like_text(text):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "op_cache.ini"
        path.write_text(text, encoding="utf-8")
        read_size_limits(path)


@given(
    st.one_of(st.just(-1), st.integers(1, 2147483646)),
    st.integers(1, 100),
)
def test_read_size_limits_round_trips_every_valid_pair(max_mb, ratio):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "op_cache.ini"
        path.write_text(size_ini(max_mb, ratio), encoding="utf-8")
        limits = read_size_limits(path)
    assert limits is not None
    assert (limits.max_op_cache_size_mb, limits.remain_cache_size_ratio) == (max_mb, ratio)


@given(st.text(max_size=40))
def test_size_parsers_never_raise_and_stay_in_range(text):
    max_mb = ini_module.parse_max_size(text)
    ratio = ini_module.parse_ratio(text)
    assert max_mb is None or max_mb == -1 or 1 <= max_mb <= 2147483646
    assert ratio is None or 1 <= ratio <= 100


# --------------------------------------------------------------------------- ensure_ini_file


def test_ensure_ini_file_creates_the_template(fs):
    path = Path("/data/cache/kernel_cache/op_cache.ini")
    assert ensure_ini_file(path) is True
    text = path.read_text(encoding="utf-8")
    assert "[op_compiler_cache]" in text
    assert "#max_op_cache_size=500" in text
    assert "#remain_cache_size_ratio=50" in text
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(text)
    assert parser.sections() == ["op_compiler_cache"]
    assert "max_op_cache_size" not in parser["op_compiler_cache"]
    assert "remain_cache_size_ratio" not in parser["op_compiler_cache"]
    # Written aside and linked into place: no temporary file is left behind.
    assert os.listdir(path.parent) == ["op_cache.ini"]


def test_ensure_ini_file_keeps_env_values_in_force(env, caplog):
    assert ensure_ini_file(Path("/data/cache/kernel_cache/op_cache.ini")) is True
    assert ensure_ini_file(Path("/data/cache/op_cache.ini")) is True
    env[MAX_ENV] = "64"
    env[RATIO_ENV] = "10"
    settings = resolve_settings(op_compiler_cache_dir="/data/cache", environ=env)
    assert settings.max_op_cache_size_mb == 64
    assert settings.remain_cache_size_ratio == 10
    assert settings.sources["max_op_cache_size_mb"] == f"env:{MAX_ENV}"
    assert settings.sources["remain_cache_size_ratio"] == f"env:{RATIO_ENV}"
    assert settings.ini_path == Path("/data/cache/kernel_cache/op_cache.ini")
    assert warnings_of(caplog) == []


def test_ensure_ini_file_never_overwrites_a_persons_file(fs):
    path = write_ini(Path("/data/cache/op_cache.ini"), size_ini(123, 45))
    assert ensure_ini_file(path) is False
    assert path.read_text(encoding="utf-8") == size_ini(123, 45)
    assert os.listdir(path.parent) == ["op_cache.ini"]


def test_ensure_ini_file_never_overwrites_even_an_empty_file(fs):
    path = write_ini(Path("/data/cache/op_cache.ini"), "")
    assert ensure_ini_file(path) is False
    assert path.read_text(encoding="utf-8") == ""


def test_ensure_ini_file_second_call_returns_false(fs):
    path = Path("/data/cache/op_cache.ini")
    assert ensure_ini_file(path) is True
    first = path.read_text(encoding="utf-8")
    assert ensure_ini_file(path) is False
    assert path.read_text(encoding="utf-8") == first


def test_ensure_ini_file_without_hard_links_still_creates_it(fs, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = Path("/data/cache/op_cache.ini")
    assert ensure_ini_file(path) is True
    assert "#max_op_cache_size=500" in path.read_text(encoding="utf-8")
    assert os.listdir(path.parent) == ["op_cache.ini"]
    assert ensure_ini_file(path) is False


# --------------------------------------------------------------------------- debug level


def test_debug_level_defaults_to_zero(env):
    settings = resolve_settings(environ=env)
    assert settings.debug_level == 0
    assert settings.sources["debug_level"] == "default"
    assert settings.bypass_reason("conv1", "Conv2D") is None


@pytest.mark.parametrize(
    ("given", "expected"),
    [(0, 0), (1, 1), (4, 4), ("0", 0), ("2", 2), ("4", 4), (" 3 ", 3)],
)
def test_debug_level_accepts_int_or_digit_string(env, given, expected):
    settings = resolve_settings(op_debug_level=given, environ=env)
    assert settings.debug_level == expected
    assert settings.sources["debug_level"] == "argument"


@pytest.mark.parametrize(
    "bad", [5, -1, 100, "5", "-1", "+1", "abc", "1.0", 1.0, "\u0663", True, False, [1]]
)
def test_invalid_debug_level_raises(env, bad):
    with pytest.raises(ConfigError) as info:
        resolve_settings(op_debug_level=bad, environ=env)
    message = str(info.value)
    assert "op_debug_level" in message
    assert repr(bad) in message
    assert "0 to 4" in message


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_debug_level_not_zero_bypasses_every_operator(env, level):
    settings = resolve_settings(op_debug_level=level, environ=env)
    for name, op_type in [("conv1", "Conv2D"), ("gather", "GatherV2"), ("x", "Add")]:
        reason = settings.bypass_reason(name, op_type)
        assert isinstance(reason, str) and "op_debug_level" in reason


def test_debug_level_zero_uses_the_cache(env):
    settings = resolve_settings(op_debug_level="0", environ=env)
    assert settings.bypass_reason("conv1", "Conv2D") is None


# --------------------------------------------------------------------------- debug config


def test_debug_config_missing_file_raises(env):
    with pytest.raises(ConfigError) as info:
        resolve_settings(op_debug_config="/nowhere/debug.cfg", environ=env)
    message = str(info.value)
    assert "op_debug_config" in message
    assert "/nowhere/debug.cfg" in message
    assert "does not exist" in message
    assert "op_debug_list" in message  # says what a valid file looks like


def test_debug_config_that_is_a_folder_raises(fs, env):
    fs.create_dir("/cfg/debug.cfg")
    with pytest.raises(ConfigError, match="op_debug_config"):
        resolve_settings(op_debug_config="/cfg/debug.cfg", environ=env)


@pytest.mark.parametrize(
    ("text", "options", "op_list"),
    [
        ("[debug]\nop_debug_config = ccec_g\nno equals sign here\n", ["ccec_g"], None),
        ("garbage\n", [], None),
        ("op_debug_config ccec_O0,oom\n", [], None),  # (the value is after an '=')
        ("op_debug_config = oom\nop_debug_list =\n", ["oom"], []),
        ("# op_debug_list = X\n  op_debug_list=Type::Add\n", [], ["Type::Add"]),
        # A line naming both is the options line, as CANN asks for that one first.
        ("op_debug_config=ccec_g,oom   # add op_debug_list to narrow it\n", None, None),
    ],
)
def test_a_debug_config_file_is_read_as_cann_reads_it(env, text, options, op_list):
    """CANN's parser takes the line holding op_debug_list or op_debug_config and skips
    every other line: a '[debug]' header, or any line without '=', was a ConfigError
    (exit 2 on the command line, and wrap ran every compile uncached)."""
    path = write_cfg(Path("/cfg/debug.cfg"), text)
    settings = resolve_settings(op_debug_config=str(path), environ=env)
    if options is not None:
        assert (settings.debug_options, settings.debug_list) == (options, op_list)
    else:
        assert settings.debug_list is None
    assert settings.bypass_reason("any_name", "Add") is not None  # (each bypasses Add)


def test_an_empty_debug_list_bypasses_every_operator(env):
    """CANN gives every operator the debug options when the list is empty; it was read
    as a list naming none, and every operator was cached with debug options on."""
    path = write_cfg(Path("/cfg/debug.cfg"), "op_debug_config = oom\nop_debug_list =\n")
    settings = resolve_settings(op_debug_config=str(path), environ=env)
    assert settings.bypass_reason("GatherV2_1", "GatherV2") == "op_debug_list is empty"


def test_a_debug_config_not_in_utf8_is_read_as_cann_reads_its_bytes(fs, env):
    """CANN's parser reads bytes and finds its ASCII keys: a comment saved in GBK was
    refused (exit 2 on the command line), where CANN bypasses the cache for GatherV2."""
    fs.create_file(
        "/cfg/debug.cfg",
        contents="# 调试配置\nop_debug_config = ccec_g,oom\nop_debug_list = GatherV2\n".encode(
            "gbk"
        ),
    )
    settings = resolve_settings(op_debug_config="/cfg/debug.cfg", environ=env)
    assert (settings.debug_options, settings.debug_list) == (["ccec_g", "oom"], ["GatherV2"])
    assert settings.bypass_reason("GatherV2", "GatherV2") is not None
    assert settings.bypass_reason("Add_1", "Add") is None


def test_a_debug_config_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    env = {"HOME": str(tmp_path)}  # (a real FIFO: no fake filesystem)
    fifo = tmp_path / "debug.cfg"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def resolve() -> None:
        try:
            resolve_settings(op_debug_config=str(fifo), environ=env)
        except BaseException as e:  # (handed to the test's thread)
            outcome.append(e)

    reader = threading.Thread(target=resolve, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "resolve_settings waits for a writer of the FIFO"
    assert isinstance(outcome[0], ConfigError)
    assert "not a regular file" in str(outcome[0])


def test_debug_config_without_list_bypasses_every_operator(env):
    path = write_cfg(
        Path("/cfg/debug.cfg"),
        "# debug build\n\nop_debug_config = ccec_O0, ccec_g ,oom\n",
    )
    settings = resolve_settings(op_debug_config=str(path), environ=env)
    assert settings.debug_options == ["ccec_O0", "ccec_g", "oom"]
    assert settings.debug_list is None
    assert settings.debug_config_path == path
    assert settings.sources["debug_config"] == "argument"
    for name, op_type in [("conv1", "Conv2D"), ("gather", "GatherV2")]:
        reason = settings.bypass_reason(name, op_type)
        assert isinstance(reason, str) and reason


def test_debug_config_unset_has_no_options(env):
    settings = resolve_settings(op_debug_config="", environ=env)
    assert settings.debug_options == []
    assert settings.debug_list is None
    assert settings.debug_config_path is None
    assert settings.sources["debug_config"] == "default"


def test_debug_config_path_expands_tilde(env, fake_home):
    write_cfg(fake_home / "debug.cfg", "op_debug_config = oom\n")
    settings = resolve_settings(op_debug_config="~/debug.cfg", environ=env)
    assert settings.debug_config_path == fake_home / "debug.cfg"
    assert settings.debug_options == ["oom"]


@pytest.fixture
def listed(env) -> Settings:
    path = write_cfg(
        Path("/cfg/debug.cfg"),
        "op_debug_config = ccec_g\n"
        "op_debug_list =  GatherV2 ,\tOpType::ReduceSum,opType::MatMul, OPTYPE :: Add ,,\n",
    )
    return resolve_settings(op_debug_config=str(path), environ=env)


def test_debug_list_is_parsed_with_spaces_ignored(listed):
    assert listed.debug_list == ["GatherV2", "OpType::ReduceSum", "opType::MatMul", "OPTYPE::Add"]
    assert listed.debug_options == ["ccec_g"]


@pytest.mark.parametrize(
    ("name", "op_type"),
    [
        ("GatherV2", "Gather"),  # by exact operator name
        ("sum_1", "ReduceSum"),  # OpType::
        ("mm", "MatMul"),  # opType::
        ("add_3", "Add"),  # OPTYPE:: with spaces
    ],
)
def test_debug_list_bypasses_listed_operators(listed, name, op_type):
    reason = listed.bypass_reason(name, op_type)
    assert isinstance(reason, str) and "op_debug_list" in reason


@pytest.mark.parametrize(
    ("name", "op_type"),
    [
        ("conv1", "Conv2D"),  # not listed at all
        ("gatherv2", "Gather"),  # names match exactly, case included
        ("GatherV2_1", "Gather"),  # no prefix matching
        ("ReduceSum", "Other"),  # a type entry does not match an operator name
        ("x", "GatherV2"),  # a name entry does not match an operator type
        ("y", "reducesum"),  # types match exactly, case included
        ("OpType::ReduceSum", "Other"),
    ],
)
def test_debug_list_leaves_other_operators_to_the_cache(listed, name, op_type):
    assert listed.bypass_reason(name, op_type) is None


def test_npu_collect_path_bypasses_every_operator(env):
    env["NPU_COLLECT_PATH"] = "/tmp/collect"
    settings = resolve_settings(environ=env)
    assert settings.collect_path == "/tmp/collect"
    for name, op_type in [("conv1", "Conv2D"), ("gather", "GatherV2")]:
        reason = settings.bypass_reason(name, op_type)
        assert isinstance(reason, str) and "NPU_COLLECT_PATH" in reason


def test_npu_collect_path_bypasses_even_operators_not_in_the_list(listed, env):
    env["NPU_COLLECT_PATH"] = "/tmp/collect"
    settings = resolve_settings(op_debug_config="/cfg/debug.cfg", environ=env)
    assert settings.bypass_reason("conv1", "Conv2D") is not None


def test_empty_npu_collect_path_is_unset(env):
    env["NPU_COLLECT_PATH"] = ""
    settings = resolve_settings(environ=env)
    assert settings.collect_path is None
    assert settings.bypass_reason("conv1", "Conv2D") is None


def test_no_debug_option_uses_the_cache_for_every_operator(env):
    settings = resolve_settings(op_compiler_cache_mode="enable", environ=env)
    assert settings.bypass_reason("conv1", "Conv2D") is None
    assert settings.bypass_reason("GatherV2", "GatherV2") is None


# --------------------------------------------------------------------------- as_dict


def test_as_dict_carries_every_setting_and_its_source(env):
    env[MAX_ENV] = "64"
    settings = resolve_settings(
        op_compiler_cache_mode="Enable", op_compiler_cache_dir="/data/cache", environ=env
    )
    data = settings.as_dict()
    assert data["mode"] == "enable"
    assert data["root"] == "/data/cache/kernel_cache"
    assert data["ini_path"] == "/data/cache/kernel_cache/op_cache.ini"
    assert data["max_op_cache_size_mb"] == 64
    assert data["remain_cache_size_ratio"] == 50
    assert data["aging_enabled"] is True
    assert data["sources"] == {
        "mode": "argument",
        "root": "argument",
        "max_op_cache_size_mb": f"env:{MAX_ENV}",
        "remain_cache_size_ratio": "default",
        "debug_level": "default",
        "debug_config": "default",
        "shared_group": "default",
        "ini_path": "default",
        "npu_collect_path": "default",
        "debug_dir": "default",
        "session": "default",
        "remote": "default",
        "base_dir": "default",
    }


def test_ini_default_section_is_not_inherited(fs, env, caplog):
    """A [DEFAULT] header is an ordinary section: its keys never reach [op_compiler_cache]."""
    root = Path("/data/ops/kernel_cache")
    fs.create_file(
        root / "op_cache.ini",
        contents="[DEFAULT]\nmax_op_cache_size=5\nremain_cache_size_ratio=5\n[op_compiler_cache]\n",
    )
    s = resolve_settings(op_compiler_cache_dir="/data/ops", environ=env)
    assert (s.max_op_cache_size_mb, s.remain_cache_size_ratio) == (500, 50)
    assert s.sources["max_op_cache_size_mb"] == "default"


def test_default_mode_must_be_a_mode(env):
    with pytest.raises(ValueError, match="default_mode"):
        resolve_settings(default_mode="bogus", environ=env)


# --------------------------------------------------------------------------- shared group


def test_shared_group_from_argument_env_or_default(env):
    import grp
    import os

    gid = os.getegid()
    name = grp.getgrgid(gid).gr_name
    assert resolve_settings(environ=env).shared_group is None
    s = resolve_settings(shared_group=name, environ=env)
    assert (s.shared_group, s.sources["shared_group"]) == (gid, "argument")
    s = resolve_settings(environ={**env, "OPCACHE_SHARED_GROUP": str(gid)})
    assert (s.shared_group, s.sources["shared_group"]) == (gid, "env:OPCACHE_SHARED_GROUP")


def test_shared_group_that_does_not_exist_is_a_config_error(env):
    with pytest.raises(ConfigError, match="OPCACHE_SHARED_GROUP='no-such-group-xyz'"):
        resolve_settings(environ={**env, "OPCACHE_SHARED_GROUP": "no-such-group-xyz"})
    with pytest.raises(ConfigError, match="shared_group="):
        resolve_settings(shared_group="no-such-group-xyz", environ=env)


def test_empty_values_count_as_unset(env):
    """As in CANN's tools, "" is the same as not giving the option."""
    s = resolve_settings(
        op_compiler_cache_mode="",
        op_compiler_cache_dir="",
        op_debug_level="",
        op_debug_config="",
        environ=env,
    )
    assert (s.mode, s.sources["mode"]) == ("disable", "default")
    assert (s.root, s.sources["root"]) == (Path(env["HOME"]) / "atc_data/kernel_cache", "default")
    assert (s.debug_level, s.sources["debug_level"]) == (0, "default")
    assert (s.debug_config_path, s.sources["debug_config"]) == (None, "default")


def test_ini_keys_are_case_sensitive_as_cann_reads_them(fs, env, caplog):
    root = Path("/data/ops/kernel_cache")
    fs.create_file(
        root / "op_cache.ini",
        contents="[op_compiler_cache]\nMAX_OP_CACHE_SIZE=7\nRemain_Cache_Size_Ratio=9\n",
    )
    s = resolve_settings(op_compiler_cache_dir="/data/ops", environ=env)
    assert (s.max_op_cache_size_mb, s.sources["max_op_cache_size_mb"]) == (500, "default")


def test_sources_name_the_origin_of_ini_path_collect_path_and_debug_dir(fs, env):
    root = Path("/data/ops/kernel_cache")
    fs.create_file(
        root / "op_cache.ini",
        contents="[op_compiler_cache]\nmax_op_cache_size=7\nremain_cache_size_ratio=9\n",
    )
    s = resolve_settings(
        op_compiler_cache_dir="/data/ops",
        debug_dir="/dbg",
        environ={**env, "NPU_COLLECT_PATH": "/collect"},
    )
    assert s.sources["ini_path"] == "op_cache.ini"
    assert s.sources["npu_collect_path"] == "env:NPU_COLLECT_PATH"
    assert (s.debug_dir, s.sources["debug_dir"]) == (Path("/dbg"), "argument")


def test_home_missing_from_environ_is_the_accounts_home_not_os_environ(monkeypatch):
    import pwd

    monkeypatch.setenv("HOME", "/somewhere/else")
    s = resolve_settings(environ={})
    assert s.root == Path(pwd.getpwuid(os.getuid()).pw_dir) / "atc_data" / "kernel_cache"


def test_settings_are_read_only_picklable_and_equal_whatever_the_sources(tmp_path) -> None:
    import pickle

    a = resolve_settings(op_compiler_cache_dir=str(tmp_path), op_debug_level=0, environ={})
    b = resolve_settings(op_compiler_cache_dir=str(tmp_path), environ={})
    assert a.sources != b.sources and a == b and hash(a) == hash(b)
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a.mode = "force"  # type: ignore[misc]


def test_a_relative_or_home_folder_is_checked_as_given(tmp_path, monkeypatch):
    """CANN checks the text given: 'cache' run from a folder with a space in its path
    was refused (the absolute path was checked), and '~/cache' under such a HOME."""
    spaced = tmp_path / "dir with space"
    spaced.mkdir()
    monkeypatch.chdir(spaced)
    env = {"HOME": str(spaced)}
    settings = resolve_settings(op_compiler_cache_dir="cache", environ=env)
    assert settings.root == spaced / "cache" / "kernel_cache"
    settings = resolve_settings(op_compiler_cache_dir="~/cache", environ=env)
    assert settings.root == spaced / "cache" / "kernel_cache"
    for bad in ("my cache", "~ x/cache", "~x;y/c"):  # (~name is checked too)
        with pytest.raises(ConfigError, match="may contain only"):
            resolve_settings(op_compiler_cache_dir=bad, environ=env)
