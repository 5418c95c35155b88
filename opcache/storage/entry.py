"""An entry, wherever it is stored: its manifest, and how it is checked.

An entry is a set of artifacts (plain file names to bytes) and a manifest:
a checksum line, then canonical JSON naming the key, the format, the compile
time, the inputs of the key and every artifact with its size and XXH3
digest.  Every read, from the local folder or a remote, checks the
manifest's checksum and every artifact against it before anything is used.

An artifact the compiler made with other permission bits than a new file gets
(an executable, a key readable by its owner alone, CANN's 0640) has its bits
in the manifest's "modes", and a hit gives them back.  An opcache older than
this reads such a manifest whole and passes over "modes" (its files then get a
new file's bits, as they always did there): never a corrupt entry to it.

A compile that read files its key does not hold (the system headers a ``cc``
compile included, what a traced ``opc`` or ``command`` tool read) has them in the manifest's
"reads" (``readset.ReadSet``'s items), and a hit is served only while every
one is as recorded (``flow``, ``remote_tier``).  Such entries are only made
under keys an opcache older than this never computes (their compilers'
fingerprints say so), so none serves one without the check.
"""

from __future__ import annotations

import json
import math
import os

from .._record import Record
from ..key import canonical_json, digest
from ..request import is_plain_name

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from typing import Any

FORMAT = 1
# In the fingerprint of a compiler whose entries have "reads": its keys are then
# none an opcache that does not check them computes (it would serve them unchecked).
READS_CHECKED = "entry-reads-checked/1"
MANIFEST = "MANIFEST"
MAX_MANIFEST = 16 << 20
NAME_MAX = 255  # bytes of a file name, on Linux's file systems


class CorruptEntry(Exception):
    """An entry exists but cannot be trusted; the message says why.

    ``maybe_sound``: it may be sound to another opcache, one of another format
    or with a bigger size cap sharing a remote: not this one's to delete."""

    def __init__(self, message: str, *, maybe_sound: bool = False) -> None:
        super().__init__(message)
        self.maybe_sound = maybe_sound


NO_MODES: dict[str, int] = {}  # (shared by every entry without modes: never changed)


class Entry(Record):
    """A verified entry: its artifacts' bytes and what the manifest recorded."""

    __slots__ = _fields = ("key", "files", "compile_seconds", "stamp", "modes", "reads")
    key: str
    files: dict[str, bytes]
    compile_seconds: float
    stamp: float  # last recorded access, seconds since the epoch
    modes: dict[str, int]  # the permission bits of the artifacts a new file would not have
    reads: list | None  # what the compile read beyond its key (ReadSet items), to check

    def __init__(
        self,
        key: str,
        files: dict[str, bytes],
        compile_seconds: float,
        stamp: float,
        modes: dict[str, int] = NO_MODES,
        reads: list | None = None,
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
    modes: dict[str, int] = NO_MODES,
    reads: list | None = None,
) -> bytes:
    """The manifest of an entry: a checksum line, then canonical JSON.  ``modes``:
    the permission bits of the artifacts that a new file would not have; ``reads``:
    what the compile read beyond its key (``ReadSet.to_json``)."""
    fields = {
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
    if modes:  # (sorted last: the fields before it are where older versions find them)
        fields["modes"] = modes
    if reads is not None:  # (sorted after "modes")
        fields["reads"] = reads
    body = canonical_json(fields)
    return digest(body).encode() + b"\n" + body


def with_reads(manifest: bytes, reads: list) -> bytes:
    """A checked manifest (``parse_manifest``) with its "reads" replaced: the same
    files, with the times they have on this machine."""
    fields = _DECODER.decode(manifest.partition(b"\n")[2].decode())
    fields["reads"] = reads
    body = canonical_json(fields)
    return digest(body).encode() + b"\n" + body


def parse_manifest(raw: bytes, key: str) -> dict[str, Any]:
    """Check a manifest and return {'artifacts': [(name, size, digest)], 'compile_seconds',
    'modes': {name: permission bits} of the artifacts that have them, 'reads': what
    the compile read beyond its key (a list of ReadSet items) or None}.

    Raises CorruptEntry where the checksum fails, or where a field a hit uses
    (the format, the key, the compile time, each artifact's name, size and
    digest) is missing or not of its exact type, or where an artifact's name is
    not one a file can have here (a folder part, over 255 bytes, a lone
    surrogate).  A manifest laid out as make_manifest writes it is read
    without parsing the key's inputs between those fields and its key
    (``_before_inputs``): whatever that span holds, the checksum vouches for
    every byte, and a hit uses none of it.
    """
    check, newline, body = raw.partition(b"\n")
    if not newline or check.decode("ascii", "replace") != digest(body):
        raise CorruptEntry("the manifest is damaged (checksum)")
    # Plain json, not _json.loads, whose depth walk and number hooks over the whole
    # value were most of a hit's check: only the fields below are used, each of
    # its exact type, and nothing walks the rest.  RecursionError is what text
    # nested too deeply raises.
    try:
        text = body.decode()
        data = _before_inputs(text, key)
        if data is None:
            data = _DECODER.decode(text)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        raise CorruptEntry("the manifest is not JSON") from None
    if type(data) is not dict or data.get("format") != FORMAT or data.get("key") != key:
        other_format = type(data) is dict and data.get("format") != FORMAT
        raise CorruptEntry("the manifest is of another entry or format", maybe_sound=other_format)
    artifacts = data.get("artifacts")
    seconds = data.get("compile_seconds")
    try:  # (a 400-digit integer overflows a float)
        seconds = float(seconds) if type(seconds) in (int, float) else math.nan
    except OverflowError:
        seconds = math.nan
    if type(artifacts) is not list or not math.isfinite(seconds):
        raise CorruptEntry("the manifest lacks its artifacts")
    out = []
    for item in artifacts:
        # Exactly what make_manifest writes: {"name", "size", "xxh3"}.
        if type(item) is not dict or len(item) != 3:
            raise CorruptEntry("the manifest names a bad artifact")
        name, size, want = item.get("name"), item.get("size"), item.get("xxh3")
        if (
            not is_plain_name(name)
            or name == MANIFEST
            or not _fits_a_folder(name)
            or type(size) is not int
            or size < 0
            or type(want) is not str
        ):
            shown = repr(name)[:80] if type(name) is str else "one without a name"
            raise CorruptEntry(f"the manifest names a bad artifact: {shown}")
        out.append((name, size, want))
    modes = data.get("modes", NO_MODES)
    if modes is not NO_MODES and not _are_modes(modes, {name for name, _, _ in out}):
        raise CorruptEntry("the manifest gives bad permission bits")
    reads = data.get("reads")
    if reads is not None and type(reads) is not list:
        raise CorruptEntry("the manifest gives a bad read set")
    return {"artifacts": out, "compile_seconds": seconds, "modes": modes, "reads": reads}


def _are_modes(modes: object, names: set[str]) -> bool:
    """Whether ``modes`` is what make_manifest writes: bits (no set-user-ID and the like:
    no hit makes a file that runs as another) of some of the artifacts ``names``."""
    return (
        type(modes) is dict
        and bool(modes)
        and all(
            name in names and type(mode) is int and 0 <= mode <= 0o777
            for name, mode in modes.items()
        )
    )


def _fits_a_folder(name: str) -> bool:
    """Whether ``name`` can be a file's: a remote's manifest naming one too long, or with a
    lone surrogate, passed every check and then failed the compile writing it out."""
    try:
        return len(os.fsencode(name)) <= NAME_MAX
    except UnicodeError:
        return False


# make_manifest's canonical JSON: its fields in this order, "inputs" then "key" last.
_LAID_OUT = (
    ("artifacts", ',"compile_seconds":'),
    ("compile_seconds", ',"created":'),
    ("created", ',"format":'),
    ("format", ',"inputs":'),
)


def _before_inputs(text: str, key: str) -> dict[str, Any] | None:
    """The fields of a manifest of ``key`` laid out as make_manifest writes it, each
    parsed but "inputs", which is passed over: a hit does not use it, and it was
    most of a manifest's text and of its parse.  None when ``text`` is laid out
    otherwise (then it is parsed whole); ValueError where the whole parse fails too.
    """
    if not text.startswith('{"artifacts":'):
        return None
    data: dict[str, Any] = {"key": key}
    tail = f',"key":"{key}"'
    if text.endswith(tail + "}"):
        end = len(text) - len(tail) - 1
    else:  # ("modes", then "reads", sorted after the key, when there are any)
        end = text.rfind(tail + ',"modes":')
        if end < 0:
            end = text.rfind(tail + ',"reads":')
        if end < 0:
            return None
        stop = end + len(tail)
        for name in ("modes", "reads"):
            follows = f',"{name}":'
            if not text.startswith(follows, stop):
                continue
            try:
                data[name], stop = _DECODER.scan_once(text, stop + len(follows))
            except StopIteration:
                raise ValueError("not JSON") from None
        if stop != len(text) - 1 or text[stop] != "}":
            return None
    at = len('{"artifacts":')
    for name, follows in _LAID_OUT:
        try:  # (the decoder's own scanner: raw_decode around it was half the time)
            data[name], at = _DECODER.scan_once(text, at)
        except StopIteration:
            raise ValueError("not JSON") from None
        if not text.startswith(follows, at):
            return None
        at += len(follows)
    return data if at < end else None


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not JSON")


# One decoder (json.loads with an argument builds one per call, a third of its time).
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
