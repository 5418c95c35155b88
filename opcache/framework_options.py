"""The framework option surfaces that carry CANN's cache options.

``settings_from_options`` reads the options that concern the cache from ATC's
command-line flags, NPURunConfig's keyword options or a TensorFlow session's
``parameter_map``, ignores the rest, and applies each surface's own default
mode: ATC disables the cache unless told otherwise, NPURunConfig and the
session config enable it.  ``torch_npu`` is the dict of ``torch.npu.set_option``,
whose ``ACL_*`` names torch_npu hands to CANN as these options.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ConfigError
from .settings import ENV_ACL_DIR, ENV_ACL_MODE, MODES, Settings, resolve_settings

FRAMEWORKS = {
    "atc": "disable",
    "npu_run_config": "enable",
    "tf_session": "enable",
    "torch_npu": "enable",  # (MakeCompileCacheDirAndSetOption's default)
}
OPTIONS = (
    "op_compiler_cache_mode",
    "op_compiler_cache_dir",
    "op_debug_level",
    "op_debug_config",
    "debug_dir",
)
# torch.npu.set_option's names of them (torch_npu's EnvVariables.cpp hooks).
TORCH_NPU_OPTIONS = {
    "ACL_OP_COMPILER_CACHE_MODE": "op_compiler_cache_mode",
    "ACL_OP_COMPILER_CACHE_DIR": "op_compiler_cache_dir",
    "ACL_OP_DEBUG_LEVEL": "op_debug_level",
    "ACL_DEBUG_DIR": "debug_dir",
}
_PATH_OPTIONS = ("op_compiler_cache_dir", "op_debug_config", "debug_dir")


def settings_from_options(
    options: Sequence[str] | Mapping[str, Any],
    *,
    framework: str,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Resolve settings from one framework's option surface.

    ``framework`` is ``"atc"`` (``options``: ATC flags such as
    ``["--op_compiler_cache_mode=enable", "--op_compiler_cache_dir", "/data"]``),
    ``"npu_run_config"`` (NPURunConfig keyword options), ``"tf_session"`` (a
    ``parameter_map``-style mapping whose values may be bytes or AttrValue-like
    objects with ``.s`` / ``.i``) or ``"torch_npu"`` (the dict given to
    ``torch.npu.set_option``: ``ACL_OP_COMPILER_CACHE_MODE``, ``_DIR``,
    ``ACL_OP_DEBUG_LEVEL``, ``ACL_DEBUG_DIR``; a name left out or empty falls
    to the environment, ``ACL_OP_COMPILER_CACHE_*`` included, as torch_npu
    does).  Raises ConfigError for a bad value.
    """
    if framework not in FRAMEWORKS:
        raise ConfigError(
            f"framework={framework!r} is not valid; use one of {', '.join(FRAMEWORKS)}"
        )
    if framework == "atc":
        if isinstance(options, Mapping | str | bytes):
            raise ConfigError("framework='atc' takes a list of flags, e.g. ['--op_debug_level=0']")
        found = _atc_flags(options)
    elif framework == "torch_npu":
        if not isinstance(options, Mapping):
            raise ConfigError("framework='torch_npu' takes the dict given to torch.npu.set_option")
        found = {
            name: _plain(name, options[acl])
            for acl, name in TORCH_NPU_OPTIONS.items()
            if acl in options
        }
        mode = found.get("op_compiler_cache_mode")
        if mode and mode not in MODES:
            # set_option hands it to aclSetCompileopt as it is: CANN takes the three
            # modes as spelled ("Force" too is refused), where opcache's own take any case.
            raise ConfigError(
                f"ACL_OP_COMPILER_CACHE_MODE={mode!r} is not valid; use one of {', '.join(MODES)}"
            )
    else:
        if not isinstance(options, Mapping):
            raise ConfigError(f"framework={framework!r} takes a mapping of option names to values")
        found = {name: _plain(name, options[name]) for name in OPTIONS if name in options}
    env = os.environ if environ is None else environ
    if framework != "torch_npu":  # (its own variables: ATC and the TF adapter never read them)
        env = {k: v for k, v in env.items() if k not in (ENV_ACL_MODE, ENV_ACL_DIR)}
    return resolve_settings(
        op_compiler_cache_mode=found.get("op_compiler_cache_mode"),
        op_compiler_cache_dir=found.get("op_compiler_cache_dir"),
        op_debug_level=found.get("op_debug_level"),
        op_debug_config=found.get("op_debug_config"),
        debug_dir=found.get("debug_dir"),
        environ=env,
        default_mode=FRAMEWORKS[framework],
    )


def _atc_flags(flags: Sequence[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    args = [str(a) for a in flags]
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if name not in OPTIONS:
            continue
        if not eq:
            if i >= len(args) or args[i].startswith("--"):
                raise ConfigError(f"--{name} needs a value")
            value = args[i]
            i += 1
        found[name] = value
    return found


def _plain(name: str, value: Any) -> str | int | None:
    """A TF AttrValue, bytes, str, path or int as the plain value resolve_settings takes."""
    if value is None:
        return None
    if not isinstance(value, str | bytes | int | float | os.PathLike) and (
        hasattr(value, "s") or hasattr(value, "i")
    ):
        value = _attr_value(value)
        if value is None:
            return None
    if isinstance(value, os.PathLike) and name in _PATH_OPTIONS:
        value = os.fspath(value)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{name}={value!r} is not UTF-8 text") from None
    if isinstance(value, str):
        return value
    if name == "op_debug_level" and isinstance(value, int) and not isinstance(value, bool):
        return value
    kinds = "a string, bytes or an integer" if name == "op_debug_level" else "a string or bytes"
    raise ConfigError(f"{name}={value!r} is not valid; expected {kinds}")


def _attr_value(value: Any) -> Any:
    """The field that is set in an AttrValue (protobuf: every field reads, one is set)."""
    which = getattr(value, "WhichOneof", None)
    if callable(which):
        field = which("value")
        return None if field is None else getattr(value, field)
    s = getattr(value, "s", None)
    if s or not hasattr(value, "i"):
        return s
    return value.i
