"""opcache: a content-addressed disk cache for operator (kernel) compiles.

It behaves as CANN's operator compile cache is documented to behave
(``enable`` / ``force`` / ``disable``, op_cache.ini, aging of entries unused for
30 minutes, debug options that bypass the cache) and does better where CANN is
weak.  See README.md for the whole picture.
"""

from __future__ import annotations

from .cache import AgingReport, OpCache, VerifyReport
from .compilers import get_compiler
from .errors import CompileError, ConfigError
from .frontends import settings_from_options
from .ini import ensure_ini_file
from .key import explain_key
from .request import Compiler, CompileResult, OpRequest
from .settings import Settings, resolve_settings

__version__ = "0.1.0"

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
