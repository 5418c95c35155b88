"""The exceptions opcache raises to its callers."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting has a value opcache cannot use.

    The message names the option, the bad value and what is valid, so the
    command line can print it as one line.
    """


class CompileError(RuntimeError):
    """The operator compiler failed; nothing was stored in the cache."""
