"""What a compile is asked for, what it returns, and what a compiler must provide."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path

from ._record import Record
from .errors import ConfigError, shown

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from typing import Any, Literal

    Status = Literal["hit", "miss", "bypass", "disabled", "error"]

# A chip's folder name.  CANN's chips are named like Ascend910B1, Ascend310P3,
# Ascend910B4-1, Ascend910_9391, Ascend950PR_9599: letters, digits, '_', '-'.
# No dot and no leading '_' or '-': the root also holds op_cache.ini and
# .opcache, which `opcache clear --soc_version` must never be able to name.
_SOC = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def check_soc_version(soc_version: str) -> str:
    """Return ``soc_version`` if it is a safe folder name, else raise ConfigError."""
    if not isinstance(soc_version, str) or not _SOC.fullmatch(soc_version):
        raise ConfigError(
            f"soc_version={shown(soc_version)} is not valid; use up to 64 letters, digits, "
            "'_' and '-', starting with a letter or digit, e.g. 'Ascend910B1'"
        )
    return soc_version


def is_soc_version(name: str) -> bool:
    """Whether ``name`` is one a soc_version may have (``check_soc_version``): a chip
    folder's name, as opcache's and CANN's are."""
    return isinstance(name, str) and bool(_SOC.fullmatch(name))


def is_plain_name(name: str) -> bool:
    """True for a bare file name: no folder part, not '.' or '..', no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


class OpRequest(Record):
    """One operator to compile.

    ``sources`` maps a file name to its contents, given as bytes or as a path
    whose contents are read (once, when first needed).  ``op_name`` is the node's
    name: it decides ``op_debug_list`` bypasses but is not part of the key.
    """

    # No __slots__: source_bytes is cached in the instance's __dict__.
    _fields = (
        "op_type",
        "soc_version",
        "op_name",
        "inputs",
        "outputs",
        "attrs",
        "options",
        "sources",
    )
    op_type: str
    soc_version: str
    op_name: str
    inputs: Sequence[Mapping[str, Any]]
    outputs: Sequence[Mapping[str, Any]]
    attrs: Mapping[str, Any]
    options: Mapping[str, Any]
    sources: Mapping[str, bytes | str | os.PathLike[str]]

    def __init__(
        self,
        op_type: str,
        soc_version: str,
        op_name: str = "",
        inputs: Sequence[Mapping[str, Any]] = (),
        outputs: Sequence[Mapping[str, Any]] = (),
        attrs: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        sources: Mapping[str, bytes | str | os.PathLike[str]] | None = None,
    ) -> None:
        if not isinstance(op_type, str) or not op_type:
            raise ValueError(f"OpRequest.op_type must be a non-empty string, not {op_type!r}")
        check_soc_version(soc_version)
        attrs = {} if attrs is None else attrs
        options = {} if options is None else options
        sources = {} if sources is None else sources
        for name in sources:
            if not is_plain_name(name):
                raise ValueError(f"OpRequest.sources: {name!r} is not a plain file name")
        self._init(locals())

    @cached_property
    def source_bytes(self) -> dict[str, bytes]:
        """The contents of every source, read from disk where a path was given."""
        out = {}
        for name, value in self.sources.items():
            if isinstance(value, bytes | bytearray | memoryview):
                out[name] = bytes(value)
            else:
                out[name] = Path(value).read_bytes()
        return out


class CompileResult(Record):
    """What ``OpCache.compile`` (or ``compile_many``, for one operator) did.

    ``status`` is "hit", "miss", "bypass", "disabled", or "error" (only from
    ``compile_many``: the compile failed and ``error`` holds the exception,
    usually a ``CompileError``); ``key`` is the entry's content address (empty
    when the cache was not consulted); ``files`` maps each artifact name to its
    path inside ``out_dir``; ``seconds`` is the time this operator took;
    ``saved_seconds`` the compile time a hit saved; ``reason`` says why a
    compile bypassed the cache or could not be stored; ``tier`` is where a
    hit came from: "local" (the cache folder) or "remote" (then stored in the
    cache folder too), and "" for anything but a hit.
    """

    __slots__ = _fields = (
        "status",
        "key",
        "files",
        "seconds",
        "reason",
        "saved_seconds",
        "error",
        "tier",
    )
    status: Status
    key: str
    files: dict[str, Path]
    seconds: float
    reason: str | None
    saved_seconds: float
    error: BaseException | None
    tier: str

    def __init__(
        self,
        status: Status,
        key: str,
        files: dict[str, Path],
        seconds: float,
        reason: str | None = None,
        saved_seconds: float = 0.0,
        error: BaseException | None = None,
        tier: str = "",
    ) -> None:
        self._init(locals())
