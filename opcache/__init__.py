"""opcache: a content-addressed disk cache for operator (kernel) compiles.

It behaves as CANN's operator compile cache is documented to behave
(``enable`` / ``force`` / ``disable``, op_cache.ini, aging of entries unused for
30 minutes, debug options that bypass the cache) and does better where CANN is
weak.  See README.md for the whole picture.
"""

# The command line's SIGINT handler is set before anything else runs: a Ctrl-C
# lands at any moment of a build, the start of this module included.  (So no
# ``from __future__ import annotations``: that is an import before the handler.)
import _signal  # built in and loaded at start-up: importing it runs nothing
import sys


def _end_by_sigint(signum: int, frame: object) -> None:
    """SIGINT while the command line starts or leaves: end by it, silently, as gcc does.

    Between these moments there is nothing to clean up, and a traceback of an
    import half done is noise in a build's output.  ``cli._leave`` lets
    KeyboardInterrupt through while a command runs, so that it cleans up.
    """
    import os

    _signal.signal(signum, _signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # (not reached: the signal ends the process)


def _the_program_starts() -> bool:
    """True when this import starts opcache's command line (the console script, a link
    named like a compiler to it, ``python -m opcache``), not a program that uses the library."""
    argv = getattr(sys, "argv", None) or [""]
    if argv[0] == "-m":  # python -m <module>: its package is being imported now
        words = getattr(sys, "orig_argv", [])
        module = words[-len(argv)] if len(words) >= len(argv) else ""
        module = module.partition("m")[2] if module.startswith("-") else module  # -mopcache
        return module.split(".")[0] == "opcache"
    import os

    real = os.path.realpath(argv[0]) if argv[0] else ""
    return os.path.basename(real) == "opcache" and os.path.isfile(real)


def _sigint_raises(raises: bool) -> None:
    """Let a Ctrl-C raise KeyboardInterrupt (True), or end the program silently (False).

    Changes only what opcache set or Python's default: a SIGINT the program was
    started with ignored (``nohup``, a background job) stays ignored.
    """
    now = _signal.getsignal(_signal.SIGINT)
    if now is _end_by_sigint or now is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler if raises else _end_by_sigint)


if _the_program_starts():
    _sigint_raises(False)

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
    "settings_from_options": "framework_options",
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
    from .framework_options import settings_from_options
    from .ini import ensure_ini_file
    from .key import explain_key
    from .request import CompileResult, OpRequest
    from .settings import Settings, resolve_settings


def __getattr__(name: str) -> "Any":
    import importlib

    if name not in _EXPORTS:
        raise AttributeError(f"module 'opcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
