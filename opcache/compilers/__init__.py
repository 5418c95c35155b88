"""Compiler plug-ins: the ``opcache.compilers`` entry-point group.

A third party adds a compiler with a few lines in its own pyproject::

    [project.entry-points."opcache.compilers"]
    mytool = "mypackage.opcache_plugin:MyCompiler"

where ``MyCompiler(**options)`` has ``name``, ``fingerprint()`` and
``compile(request, workdir)`` (see ``opcache.Compiler``) and, optionally, a
classmethod ``usable(environ) -> (bool, str)`` for ``opcache compilers``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

from ..errors import ConfigError

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from typing import Any

    from .protocol import Compiler

GROUP = "opcache.compilers"
# Also reachable when opcache runs from a source tree without installed metadata.
_BUILTIN = {
    "cann": "opcache.compilers.cann:CannCompiler",
    "cc": "opcache.compilers.cc:CcCompiler",
    "command": "opcache.compilers.command:CommandCompiler",
}


def _registry() -> dict[str, str]:
    from importlib.metadata import entry_points  # slow to import; only when asked

    found = dict(_BUILTIN)
    for ep in entry_points(group=GROUP):
        found[ep.name] = ep.value
    return found


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def auto_choice(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(name, why) of the compiler ``auto`` stands for here.

    CANN when its environment is set and opc is found (as pypto's run_mode picks
    the NPU when CANN's environment is set), else the local C compiler.
    """
    from .cann import configured

    env = os.environ if environ is None else environ
    if configured(env):
        return "cann", "a CANN toolkit is configured and opc was found"
    return (
        "cc",
        "no CANN toolkit configured (ASCEND_HOME_PATH, ASCEND_TOOLKIT_HOME, ASCEND_OPP_PATH)",
    )


def get_compiler(name: str, **options: Any) -> Compiler:
    """The compiler plug-in ``name`` (or ``auto``), built with ``options``.

    Raises ConfigError for an unknown name or a compiler that cannot work here.
    """
    if name == "auto":
        name, _ = auto_choice(options.get("environ"))
    registry = _registry()
    if name not in registry:
        raise ConfigError(
            f"compiler {name!r} is not installed; installed: {', '.join(sorted(registry))}, auto"
        )
    try:
        factory = _load(registry[name])
        return factory(**options)
    except TypeError as e:
        raise ConfigError(f"compiler {name!r}: bad options: {e}") from None


def installed(environ: Mapping[str, str] | None = None) -> dict[str, tuple[bool, str]]:
    """Every installed compiler: (usable here, a word on why or where)."""
    env = os.environ if environ is None else environ
    out = {}
    for name, target in sorted(_registry().items()):
        try:
            factory = _load(target)
        except Exception as e:  # a broken third-party plug-in must not hide the others
            out[name] = (False, f"cannot load {target}: {e}")
            continue
        usable = getattr(factory, "usable", None)
        out[name] = usable(env) if usable else (True, target)
    return out
