"""An entry, wherever it is stored: its manifest, and how it is checked.

An entry is a set of artifacts (plain file names to bytes) and a manifest:
a checksum line, then canonical JSON naming the key, the format, the compile
time, the inputs of the key and every artifact with its size and XXH3
digest.  Every read, from the local folder or a remote, checks the
manifest's checksum and every artifact against it before anything is used.
"""

from __future__ import annotations

from .. import _json
from .._record import Record
from ..key import canonical_json, digest
from ..request import is_plain_name

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from typing import Any

FORMAT = 1
MANIFEST = "MANIFEST"
MAX_MANIFEST = 16 << 20


class CorruptEntry(Exception):
    """An entry exists but cannot be trusted; the message says why."""


class Entry(Record):
    """A verified entry: its artifacts' bytes and what the manifest recorded."""

    __slots__ = _fields = ("key", "files", "compile_seconds", "stamp")
    key: str
    files: dict[str, bytes]
    compile_seconds: float
    stamp: float  # last recorded access, seconds since the epoch

    def __init__(
        self, key: str, files: dict[str, bytes], compile_seconds: float, stamp: float
    ) -> None:
        self._init(locals())


def check_artifact(name: str, size: int, want: str, data: bytes) -> bytes:
    """``data`` if it is the artifact the manifest describes, else CorruptEntry."""
    if len(data) != size:
        raise CorruptEntry(f"{name}: {len(data)} bytes, the manifest says {size}")
    if digest(data) != want:
        raise CorruptEntry(f"{name}: its digest does not match the manifest")
    return data


def make_manifest(
    key: str,
    artifacts: dict[str, bytes],
    compile_seconds: float,
    inputs: dict[str, Any],
    now: float,
) -> bytes:
    """The manifest of an entry: a checksum line, then canonical JSON."""
    body = canonical_json(
        {
            "format": FORMAT,
            "key": key,
            "created": now,
            "compile_seconds": compile_seconds,
            "artifacts": [
                {"name": name, "size": len(data), "xxh3": digest(data)}
                for name, data in sorted(artifacts.items())
            ],
            "inputs": inputs,
        }
    )
    return digest(body).encode() + b"\n" + body


def parse_manifest(raw: bytes, key: str) -> dict[str, Any]:
    """Check a manifest and return {'artifacts': [(name, size, digest)], 'compile_seconds'}.

    Raises CorruptEntry for anything that is not a manifest of ``key`` that
    this version of opcache wrote.
    """
    check, newline, body = raw.partition(b"\n")
    if not newline or check.decode("ascii", "replace") != digest(body):
        raise CorruptEntry("the manifest is damaged (checksum)")
    try:
        data = _json.loads(body)
    except ValueError:
        raise CorruptEntry("the manifest is not JSON") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
        raise CorruptEntry("the manifest is of another entry or format")
    artifacts = data.get("artifacts")
    seconds = data.get("compile_seconds")
    if not isinstance(artifacts, list) or not isinstance(seconds, int | float):
        raise CorruptEntry("the manifest lacks its artifacts")
    out = []
    for item in artifacts:
        name = item.get("name") if isinstance(item, dict) else None
        size = item.get("size") if isinstance(item, dict) else None
        want = item.get("xxh3") if isinstance(item, dict) else None
        if (
            not is_plain_name(name)
            or name == MANIFEST
            or not isinstance(size, int)
            or size < 0
            or not isinstance(want, str)
        ):
            raise CorruptEntry(f"the manifest names a bad artifact: {str(item)[:80]}")
        out.append((name, size, want))
    return {"artifacts": out, "compile_seconds": float(seconds)}
