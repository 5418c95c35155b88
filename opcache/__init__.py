"""opcache: a content-addressed disk cache for operator (kernel) compiles.

It behaves as CANN's operator compile cache is documented to behave
(``enable`` / ``force`` / ``disable``, op_cache.ini, aging of entries unused for
30 minutes, debug options that bypass the cache) and does better where CANN is
weak.  See README.md for the whole picture.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Name -> module.  Loaded on first use, so that `opcache wrap`, which runs once
# per compile command, imports only what it needs.
_EXPORTS = {
    "AgingReport": "cache",
    "OpCache": "cache",
    "VerifyReport": "cache",
    "get_compiler": "compilers",
    "CompileError": "errors",
    "ConfigError": "errors",
    "settings_from_options": "frontends",
    "ensure_ini_file": "ini",
    "explain_key": "key",
    "Compiler": "compilers.protocol",
    "CompileResult": "request",
    "OpRequest": "request",
    "Settings": "settings",
    "resolve_settings": "settings",
}

__all__ = [
    "AgingReport",
    "CompileError",
    "CompileResult",
    "Compiler",
    "ConfigError",
    "OpCache",
    "OpRequest",
    "Settings",
    "VerifyReport",
    "__version__",
    "ensure_ini_file",
    "explain_key",
    "get_compiler",
    "resolve_settings",
    "settings_from_options",
]

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from typing import Any

    from .cache import AgingReport, OpCache, VerifyReport
    from .compilers import get_compiler
    from .compilers.protocol import Compiler
    from .errors import CompileError, ConfigError
    from .frontends import settings_from_options
    from .ini import ensure_ini_file
    from .key import explain_key
    from .request import CompileResult, OpRequest
    from .settings import Settings, resolve_settings


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
