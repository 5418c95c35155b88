"""What a compile is asked for, what it returns, and what a compiler must provide."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from .settings import check_soc_version

Status = Literal["hit", "miss", "bypass", "disabled"]


@runtime_checkable
class Compiler(Protocol):
    """An operator compiler the cache can drive.

    ``fingerprint()`` names the toolchain (version, binary digest, tuning
    knowledge-base digests...): it is part of every key, so an upgrade never
    serves a stale kernel.  ``compile`` writes its artifacts, any number of
    plain files, into ``workdir`` and raises ``opcache.CompileError`` on failure.
    Artifact names must derive from the request's key inputs, never from
    ``op_name``, so that a hit returns the same files whatever the node is called.
    """

    name: str

    def fingerprint(self) -> str: ...

    def compile(self, request: OpRequest, workdir: Path) -> None: ...


def is_plain_name(name: str) -> bool:
    """True for a bare file name: no folder part, not '.' or '..', no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


@dataclass(frozen=True)
class OpRequest:
    """One operator to compile.

    ``sources`` maps a file name to its contents, given as bytes or as a path
    whose contents are read (once, when first needed).  ``op_name`` is the node's
    name: it decides ``op_debug_list`` bypasses but is not part of the key.
    """

    op_type: str
    soc_version: str
    op_name: str = ""
    inputs: Sequence[Mapping[str, Any]] = ()
    outputs: Sequence[Mapping[str, Any]] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, bytes | str | os.PathLike[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.op_type, str) or not self.op_type:
            raise ValueError(f"OpRequest.op_type must be a non-empty string, not {self.op_type!r}")
        check_soc_version(self.soc_version)
        for name in self.sources:
            if not is_plain_name(name):
                raise ValueError(f"OpRequest.sources: {name!r} is not a plain file name")

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


@dataclass(frozen=True)
class CompileResult:
    """What ``OpCache.compile`` did.

    ``status`` is "hit", "miss", "bypass" or "disabled"; ``key`` is the entry's
    content address (empty when the cache was not consulted); ``files`` maps each
    artifact name to its path inside ``out_dir``; ``seconds`` is the time this
    call took; ``saved_seconds`` the compile time a hit saved; ``reason`` says
    why a compile bypassed the cache or could not be stored.
    """

    status: Status
    key: str
    files: dict[str, Path]
    seconds: float
    reason: str | None = None
    saved_seconds: float = 0.0
