"""opcache's loggers: ``logging`` underneath, imported only when a record can be shown.

Importing logging costs ``opcache wrap`` several milliseconds per compile
command, a good share of a cache hit.  Until some code imports logging, no one
can have configured a handler or a level, so a debug or info record would be
dropped anyway: it is skipped without the import.  Warnings and errors always
go through logging (to its last-resort handler if nothing else is set up).

The loggers are logging's own ``opcache.<module>`` loggers: configure them as
usual.  The command line registers its stderr handler with ``on_first_use``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    import logging

DEBUG = 10
_hooks: list[Callable[[], None]] = []
_held: list[list[tuple[str, str]]] = []  # the innermost HeldWarnings' list last


class HeldWarnings:
    """``with HeldWarnings() as held:`` opcache's warnings go into ``held``, not to logging.

    Each as (topic, message).  For a caller that decides itself whether to
    show them (``opcache wrap`` shows each at most once an hour): it goes by
    the topic, which names the warning whatever its details (the cache folder
    that cannot be written, not the key a write failed for); it is the
    message itself unless the warning names one.
    """

    def __enter__(self) -> list[tuple[str, str]]:
        _held.append([])
        return _held[-1]

    def __exit__(self, *exc: object) -> None:
        _held.pop()


def on_first_use(hook: Callable[[], None]) -> None:
    """Run ``hook`` once, right before opcache's first record goes to logging."""
    _hooks.append(hook)


def forget(hook: Callable[[], None]) -> None:
    """Drop ``hook`` if it has not run yet."""
    if hook in _hooks:
        _hooks.remove(hook)


def _run_hooks() -> None:
    while _hooks:
        _hooks.pop(0)()


class Logger:
    """The subset of ``logging.Logger`` opcache uses; records point at the caller."""

    __slots__ = ("_logger", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._logger: logging.Logger | None = None

    def _real(self) -> logging.Logger:
        _run_hooks()  # every time: a command line may register one per run
        if self._logger is None:
            import logging

            self._logger = logging.getLogger(self.name)
        return self._logger

    def isEnabledFor(self, level: int) -> bool:
        return "logging" in sys.modules and self._real().isEnabledFor(level)

    def debug(self, msg: str, *args: object) -> None:
        if "logging" in sys.modules:
            self._real().debug(msg, *args, stacklevel=2)

    def info(self, msg: str, *args: object) -> None:
        if "logging" in sys.modules:
            self._real().info(msg, *args, stacklevel=2)

    def warning(self, msg: str, *args: object, topic: str | None = None) -> None:
        """As logging's; ``topic``: what the warning is about, for ``HeldWarnings``."""
        if _held:
            text = msg % args if args else msg
            _held[-1].append((topic or text, text))
            return
        self._real().warning(msg, *args, stacklevel=2)


def get_logger(name: str) -> Logger:
    """The logger of module ``name`` (``opcache.<module>``)."""
    return Logger(name)
