"""``settings_from_options``: ATC flags, NPURunConfig options, a TF session's parameter_map.

Every cache option of each surface, their defaults (ATC: disable; NPURunConfig
and the session config: enable), unrelated options ignored, bad values refused
with ConfigError as ``resolve_settings`` refuses them.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import opcache
from opcache import ConfigError, resolve_settings, settings_from_options

FRAMEWORK_DEFAULTS = {"atc": "disable", "npu_run_config": "enable", "tf_session": "enable"}


class AttrValue:
    """Like TensorFlow's AttrValue protobuf: every field readable, at most one set.

    ``custom_op.parameter_map["op_debug_level"].i = 1`` leaves ``.s`` as b""
    (and ``.s = ...`` leaves ``.i`` as 0); ``WhichOneof("value")`` names the
    field that was set.
    """

    def __init__(self, **field: object) -> None:
        assert len(field) <= 1
        self.s, self.i, self.f, self.b = b"", 0, 0.0, False
        self._set = None
        for name, value in field.items():
            setattr(self, name, value)
            self._set = name

    def WhichOneof(self, group: str) -> str | None:
        assert group == "value"
        return self._set


def as_bytes(text: str) -> bytes:
    """What ``tf.compat.as_bytes`` makes of a string."""
    return text.encode("utf-8")


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.chdir(tmp_path)
    return {"HOME": str(tmp_path / "home")}


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    path = tmp_path / "test0.cfg"
    path.write_text("op_debug_config = ccec_g,oom\nop_debug_list = GatherV2,OpType::ReduceSum\n")
    return path


def surface(framework: str, **options: object) -> list[str] | dict[str, object]:
    """``options`` spelled as the framework spells them."""
    if framework == "atc":
        return [f"--{name}={value}" for name, value in options.items()]
    if framework == "tf_session":
        return {
            name: AttrValue(i=value)
            if isinstance(value, int)
            else AttrValue(s=as_bytes(str(value)))
            for name, value in options.items()
        }
    return dict(options)


def test_settings_from_options_is_exported():
    assert opcache.settings_from_options is settings_from_options


@pytest.mark.parametrize("framework", FRAMEWORK_DEFAULTS)
def test_defaults_of_each_surface(framework, env, tmp_path):
    empty = [] if framework == "atc" else {}
    settings = settings_from_options(empty, framework=framework, environ=env)
    assert settings.mode == FRAMEWORK_DEFAULTS[framework]
    assert settings.sources["mode"] == "default"
    assert settings.root == tmp_path / "home" / "atc_data" / "kernel_cache"
    assert settings.debug_level == 0
    assert settings.debug_config is None and settings.debug_config_path is None
    assert settings.debug_dir is None
    assert settings.bypass_reason("any", "Add") is None


@pytest.mark.parametrize("framework", FRAMEWORK_DEFAULTS)
def test_every_option_of_each_surface(framework, env, cfg, tmp_path):
    options = {
        "op_compiler_cache_mode": "force",
        "op_compiler_cache_dir": str(tmp_path / "data"),
        "op_debug_level": 0,
        "op_debug_config": str(cfg),
        "debug_dir": "dbg",
    }
    settings = settings_from_options(
        surface(framework, **options), framework=framework, environ=env
    )
    assert settings.mode == "force" and settings.sources["mode"] == "argument"
    assert settings.root == tmp_path / "data" / "kernel_cache"
    assert settings.sources["root"] == "argument"
    assert settings.debug_level == 0
    assert settings.debug_config_path == cfg
    assert settings.debug_options == ["ccec_g", "oom"]
    assert settings.debug_list == ["GatherV2", "OpType::ReduceSum"]
    assert settings.bypass_reason("GatherV2", "GatherV2") is not None
    assert settings.bypass_reason("sum_1", "ReduceSum") is not None
    assert settings.bypass_reason("add_1", "Add") is None
    assert settings.debug_dir == tmp_path / "dbg"
    expected = resolve_settings(**{**options, "op_debug_level": "0"}, environ=env)
    assert settings == expected  # the same rules as resolve_settings


@pytest.mark.parametrize("framework", FRAMEWORK_DEFAULTS)
@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_op_debug_level_bypasses_on_every_surface(framework, level, env):
    options = surface(framework, op_compiler_cache_mode="enable", op_debug_level=level)
    settings = settings_from_options(options, framework=framework, environ=env)
    assert settings.debug_level == level
    assert settings.bypass_reason("add_1", "Add") == f"op_debug_level is {level}"


@pytest.mark.parametrize("framework", FRAMEWORK_DEFAULTS)
@pytest.mark.parametrize("mode", ["enable", "force", "disable"])
def test_each_mode_on_every_surface(framework, mode, env):
    settings = settings_from_options(
        surface(framework, op_compiler_cache_mode=mode), framework=framework, environ=env
    )
    assert settings.mode == mode


def test_atc_flags_in_both_spellings_and_unrelated_flags_ignored(env, cfg, tmp_path):
    flags = [
        "--model=resnet50.onnx",
        "--framework",
        "5",
        "--output",
        "out/resnet50",
        "--soc_version=Ascend910B1",
        "--op_compiler_cache_mode",
        "enable",
        "--op_compiler_cache_dir",
        str(tmp_path / "data"),
        "--op_debug_level",
        "3",
        "--op_debug_config",
        str(cfg),
        "--debug_dir",
        "kernel_meta",
        "--log=debug",
        "--input_shape=x:1,3,224,224",
    ]
    settings = settings_from_options(flags, framework="atc", environ=env)
    assert settings.mode == "enable"
    assert settings.root == tmp_path / "data" / "kernel_cache"
    assert settings.debug_level == 3
    assert settings.debug_config_path == cfg
    assert settings.debug_dir == tmp_path / "kernel_meta"
    # The example.
    example = [
        "--op_compiler_cache_mode=enable",
        "--op_compiler_cache_dir",
        "/data",
        "--op_debug_level=0",
    ]
    settings = settings_from_options(example, framework="atc", environ=env)
    assert (settings.mode, settings.root, settings.debug_level) == (
        "enable",
        Path("/data/kernel_cache"),
        0,
    )


def test_atc_default_follows_ascend_cache_path(env, tmp_path):
    environ = {**env, "ASCEND_CACHE_PATH": str(tmp_path / "shared")}
    settings = settings_from_options(
        ["--op_compiler_cache_mode=enable"], framework="atc", environ=environ
    )
    assert settings.root.parent == tmp_path / "shared"
    assert settings.root.name.startswith("kernel_cache_")
    given = settings_from_options(
        ["--op_compiler_cache_dir", str(tmp_path / "mine")], framework="atc", environ=environ
    )
    assert given.root == tmp_path / "mine" / "kernel_cache"  # the option wins


@pytest.mark.parametrize("framework", ["atc", "npu_run_config", "tf_session"])
def test_torch_npu_s_variables_are_torch_npu_s_alone(framework, env, tmp_path):
    """ATC and the TF adapter never read ACL_OP_COMPILER_CACHE_MODE or _DIR (torch_npu
    hands them to CANN): they turned ATC's cache on, or the session's off, and moved
    the folder away from ASCEND_CACHE_PATH's."""
    mode = "disable" if framework != "atc" else "enable"
    environ = {
        **env,
        "ACL_OP_COMPILER_CACHE_MODE": mode,
        "ACL_OP_COMPILER_CACHE_DIR": str(tmp_path / "torch"),
        "ASCEND_CACHE_PATH": str(tmp_path / "shared"),
    }
    options: list[str] | dict[str, str] = [] if framework == "atc" else {}
    settings = settings_from_options(options, framework=framework, environ=environ)
    assert settings.mode == ("disable" if framework == "atc" else "enable")
    assert settings.root.parent == tmp_path / "shared"
    torch = settings_from_options({}, framework="torch_npu", environ=environ)
    assert (torch.mode, torch.root) == (mode, tmp_path / "torch" / "kernel_cache")


def test_npu_run_config_keyword_options(env, tmp_path):
    options = {
        "graph_run_mode": 1,
        "session_device_id": 0,
        "deterministic": 1,
        "precision_mode": "allow_mix_precision",
        "enable_dump": True,
        "dump_path": "/nonexistent/dump",
        "op_compiler_cache_mode": None,  # NPURunConfig's keyword defaults are None
        "op_compiler_cache_dir": tmp_path / "data",  # a Path, as Python callers write
        "op_debug_level": None,
        "debug_dir": None,
    }
    settings = settings_from_options(options, framework="npu_run_config", environ=env)
    assert settings.mode == "enable" and settings.sources["mode"] == "default"
    assert settings.root == tmp_path / "data" / "kernel_cache"
    assert settings.debug_level == 0 and settings.debug_dir is None


def test_tf_session_parameter_map_values(env, tmp_path):
    parameter_map = {
        "use_off_line": AttrValue(b=True),
        "precision_mode": AttrValue(s=as_bytes("allow_mix_precision")),
        "enable_dump_debug": AttrValue(b=True),
        "dump_debug_mode": AttrValue(s=as_bytes("all")),
        "op_compiler_cache_mode": AttrValue(s=as_bytes("force")),
        "op_compiler_cache_dir": AttrValue(s=as_bytes(str(tmp_path / "kernel_cache_dir"))),
        "op_debug_level": AttrValue(i=2),
    }
    settings = settings_from_options(parameter_map, framework="tf_session", environ=env)
    assert settings.mode == "force"
    assert settings.root == tmp_path / "kernel_cache_dir" / "kernel_cache"
    assert settings.debug_level == 2
    assert settings.bypass_reason("add", "Add") == "op_debug_level is 2"


def test_tf_session_plain_bytes_strings_and_simple_objects(env, tmp_path):
    as_plain_bytes = {
        "op_compiler_cache_mode": as_bytes("disable"),
        "op_compiler_cache_dir": as_bytes(str(tmp_path / "d")),
        "op_debug_level": as_bytes("1"),
        "debug_dir": as_bytes("dbg"),
    }
    settings = settings_from_options(as_plain_bytes, framework="tf_session", environ=env)
    assert (settings.mode, settings.debug_level) == ("disable", 1)
    assert settings.root == tmp_path / "d" / "kernel_cache"
    assert settings.debug_dir == tmp_path / "dbg"
    simple = {
        "op_compiler_cache_mode": SimpleNamespace(s=b"enable"),
        "op_debug_level": SimpleNamespace(i=3),
    }
    settings = settings_from_options(simple, framework="tf_session", environ=env)
    assert (settings.mode, settings.debug_level) == ("enable", 3)


def test_an_unset_attr_value_is_unset(env):
    settings = settings_from_options(
        {"op_compiler_cache_mode": AttrValue(), "op_debug_level": AttrValue()},
        framework="tf_session",
        environ=env,
    )
    assert settings.mode == "enable" and settings.sources["mode"] == "default"
    assert settings.debug_level == 0


@pytest.mark.parametrize("framework", FRAMEWORK_DEFAULTS)
@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("op_compiler_cache_mode", "sometimes", "op_compiler_cache_mode"),
        ("op_compiler_cache_dir", "/data/my cache", "op_compiler_cache_dir"),
        ("op_debug_level", 9, "op_debug_level"),
        ("op_debug_level", "high", "op_debug_level"),
        ("op_debug_config", "/nonexistent/debug.cfg", "op_debug_config"),
    ],
)
def test_bad_values_are_config_errors(framework, option, value, match, env):
    with pytest.raises(ConfigError, match=match):
        settings_from_options(
            surface(framework, **{option: value}), framework=framework, environ=env
        )
    # ... as resolve_settings refuses them.
    with pytest.raises(ConfigError, match=match):
        resolve_settings(**{option: value}, environ=env)


@pytest.mark.parametrize(
    ("options", "framework"),
    [
        ({"op_debug_level": True}, "npu_run_config"),
        ({"op_debug_level": 1.5}, "npu_run_config"),
        ({"op_compiler_cache_dir": 123}, "npu_run_config"),
        ({"debug_dir": 7}, "npu_run_config"),
        ({"op_compiler_cache_mode": ["enable"]}, "npu_run_config"),
        ({"op_compiler_cache_dir": b"\xff\xfe"}, "tf_session"),
        ({"op_compiler_cache_dir": AttrValue(i=5)}, "tf_session"),
        ({"op_debug_level": AttrValue(b=True)}, "tf_session"),
        ({"op_compiler_cache_mode": AttrValue(f=1.0)}, "tf_session"),
        (["--op_debug_level"], "atc"),
        (["--op_compiler_cache_dir", "--op_debug_level=0"], "atc"),
        ({"op_debug_level": "0"}, "atc"),
        ("--op_debug_level=0", "atc"),
        (["--op_debug_level=0"], "npu_run_config"),
        ({}, "pytorch"),
    ],
)
def test_bad_shapes_and_types_are_config_errors(options, framework, env):
    with pytest.raises(ConfigError):
        settings_from_options(options, framework=framework, environ=env)


def test_environ_defaults_to_the_process_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ASCEND_CACHE_PATH", str(tmp_path / "from_env"))
    settings = settings_from_options({}, framework="npu_run_config")
    assert settings.root.parent == tmp_path / "from_env"
    assert os.fspath(settings.root).startswith(str(tmp_path))
