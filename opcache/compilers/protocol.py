"""The compiler protocol: what the cache needs of a compiler plug-in.

Its own module because ``typing.Protocol`` costs ``opcache wrap``'s start-up
an import of typing, and nothing there needs the protocol at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    from ..request import OpRequest


@runtime_checkable
class Compiler(Protocol):
    """An operator compiler the cache can drive.

    ``fingerprint()`` names the toolchain (version, binary digest, tuning
    knowledge-base digests...): it is part of every key, so an upgrade never
    serves a stale kernel.  It is asked once per compiler object in an OpCache
    (opcache's own back-ends, which re-check their tools with a stat each, at
    every compile).  ``compile`` writes its artifacts, any number of
    plain files, into ``workdir`` and raises ``opcache.CompileError`` on failure.
    It returns None, or a reason its artifacts must not be stored: the compile
    read something the key does not hold (a header found outside the request's
    sources, a tool that changed meanwhile).  They are then delivered as a miss
    and counted as uncacheable with that reason, never served as a hit.
    (opcache's own ``cc`` and ``cann`` may return a ``readset.ReadSet`` instead:
    what the compile read beyond the key, which every hit of the entry checks.)
    Artifact names must derive from the request's key inputs, never from
    ``op_name``, so that a hit returns the same files whatever the node is called.
    """

    name: str

    def fingerprint(self) -> str: ...

    def compile(self, request: OpRequest, workdir: Path) -> str | None: ...
