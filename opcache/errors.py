"""The exceptions opcache raises to its callers."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting has a value opcache cannot use.

    The message names the option, the bad value and what is valid, so the
    command line can print it as one line.  ``variable`` names the environment
    variable that held the value, None when the caller passed it: a wrapped
    compile goes on without the cache for a bad environment, never for a bad
    flag on opcache's own command line.
    """

    def __init__(self, message: str, *, variable: str | None = None) -> None:
        super().__init__(message)
        self.variable = variable


class CompileError(RuntimeError):
    """The operator compiler failed; nothing was stored in the cache."""


class UsageError(Exception):
    """A mistake on the command line: one ``opcache: error:`` line, exit 2."""


def shown(value: object) -> str:
    """``repr(value)``, cut short: a message names the value, not 5,000 digits of it."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(str(value))} characters)"


def sentence(error: OSError) -> str:
    """An OSError as a user reads it: its file names and why, without ``[Errno N]``
    and quotes.  (opcache's own OSErrors are sentences already.)"""
    if error.strerror is None:
        return str(error)
    names = [str(name) for name in (error.filename, error.filename2) if name is not None]
    return f"{' -> '.join(names)}: {error.strerror}" if names else error.strerror
