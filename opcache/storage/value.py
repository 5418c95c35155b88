"""An entry as one value: how a remote kind, or an archive, holds it.

A value is our own format, never pickle: ``OPCR``, a format byte and a flags
byte, then the payload (the manifest's length and bytes, then every artifact
in the manifest's order), then the XXH3-128 of everything before it.  With
the zlib flag the payload is one zlib stream, in which each part (the
manifest, each artifact) is deflated where that saves a tenth and stored as
it is (deflate's stored blocks) where not, so that a reader inflates only
what compressed and copies the rest; without the flag it is the payload as
it is, written when the stream would not save a tenth in all.  A big part is
estimated on samples before zlib sees it whole.  A value is checked whole
(checksum, the manifest's own checksum, every artifact's size and digest)
before it is returned: ``RemoteCorrupt`` otherwise.

Redis and Redis Cluster (``redis.py``, ``redis_cluster.py``), the HTTP
cache (``http.py``), ``opcache export``'s archives (``archive.py``) and
CANN's entries in a remote (``cann_transfer.py``) all hold entries so.
"""

from __future__ import annotations

import struct
import zlib

import xxhash

from .entry import CorruptEntry, Entry, check_artifact, parse_manifest
from .remote import RemoteCorrupt

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .remote import Fetched

MAGIC = b"OPCR"
FORMAT = 1
_ZLIB = 1
_HEAD = struct.Struct(">4sBB")
_LENGTH = struct.Struct(">I")
_CHECK = 16  # bytes of XXH3-128
_COMPRESS_FROM = 1024  # a smaller payload, or part of one, is kept as it is
# ... unless a value's small parts come to this much: then they are deflated too
# (forty jsons of 900 bytes kept as they are made a value 4.5x its zlib size).
_SMALL_PARTS_DEFLATED = 4096
_SAMPLE = 4096  # bytes a big part's compressibility is estimated on, twice
# The zlib stream's own framing (RFC 1950/1951): its header (deflate, 32 KB
# window, "fastest"), a stored block's header (not the last; its length and
# the length's complement), the empty last block that ends it, then the
# Adler-32 of everything inflated.
_ZLIB_HEADER = b"\x78\x01"
_STORED = struct.Struct("<BHH")
_STORED_MAX = 0xFFFF
_LAST_BLOCK = b"\x01\x00\x00\xff\xff"
_ADLER = struct.Struct(">I")


def pack(key: str, manifest: bytes, files: dict[str, bytes]) -> bytes:
    """The stored value of an entry (ValueError if ``files`` are not the manifest's)."""
    try:
        described = parse_manifest(manifest, key)["artifacts"]
    except CorruptEntry as e:
        raise ValueError(f"not the manifest of {key}: {e}") from None
    if sorted(files) != sorted(name for name, _, _ in described):
        raise ValueError("the files are not the ones the manifest names")
    parts = [_LENGTH.pack(len(manifest)) + manifest, *(files[name] for name, _, _ in described)]
    flags = 0
    packed = _compressed(parts)
    if packed is not None:
        payload, flags = packed, _ZLIB
    else:
        payload = b"".join(parts)
    value = _HEAD.pack(MAGIC, FORMAT, flags) + payload
    return value + xxhash.xxh3_128_digest(value)


def _compressed(parts: list[bytes]) -> bytes | None:
    """``parts`` joined as one zlib stream, or None when that would not save a tenth.

    Each part is deflated where that saves a tenth, else written in stored
    blocks, which inflating only copies: an artifact of random bytes beside a
    json of spaces was inflated whole, at a tenth of a remote hit.  A part under
    ``_COMPRESS_FROM`` bytes is stored too, as a payload that small is: it
    saves a few hundred bytes deflated, and inflating them costs every reader
    a block's Huffman tables and codes (a 627-byte manifest, 353 deflated: 2.6
    of a 4 KB value's 11 us of checks, a tenth of a single remote hit).  Not
    when a value's small parts come to ``_SMALL_PARTS_DEFLATED`` bytes or more
    (many small artifacts): then what deflating saves is kilobytes, on the
    wire and in the remote, and they are deflated as big parts are.  Any
    zlib reader reads the stream (the readers of every release before this one
    too).

    One deflater sees the parts in turn, each ending on a byte (a sync flush):
    a part whose blocks do not save a tenth is written stored instead, and
    its bytes are in the reader's window as in the deflater's, so what follows
    may still refer back to them.  A big part given up on samples is not seen
    by it: the next part starts a deflater of its own.
    """
    size = sum(map(len, parts))
    if size < _COMPRESS_FROM:
        return None
    small = sum(len(part) for part in parts if len(part) < _COMPRESS_FROM)
    least = _COMPRESS_FROM if small < _SMALL_PARTS_DEFLATED else 0
    tried = [len(part) >= least and _worth_trying(part) for part in parts]
    if sum(len(part) for part, t in zip(parts, tried, strict=True) if not t) * 10 > size * 9:
        return None  # (what is given up on samples alone keeps it from saving a tenth)
    pieces: list[tuple[bytes, bytes | None]] = []
    deflate = None
    for part, worth in zip(parts, tried, strict=True):
        packed = None
        if worth:
            if deflate is None:
                deflate = zlib.compressobj(1, zlib.DEFLATED, -15)  # raw: the header is ours
            packed = deflate.compress(part) + deflate.flush(zlib.Z_SYNC_FLUSH)
            if len(packed) * 10 > len(part) * 9:
                packed = None
        else:
            deflate = None
        pieces.append((part, packed))
    kept = sum(len(part if packed is None else packed) for part, packed in pieces)
    if kept * 10 > size * 9:  # (judged before a byte of the stream is put together)
        return None
    out = [_ZLIB_HEADER]
    check = 1  # (adler32's start)
    for part, packed in pieces:
        check = zlib.adler32(part, check)
        if packed is not None:
            out.append(packed)
            continue
        view = memoryview(part)  # (its blocks sliced without a copy)
        for at in range(0, len(part), _STORED_MAX):
            chunk = view[at : at + _STORED_MAX]
            out += [_STORED.pack(0, len(chunk), len(chunk) ^ 0xFFFF), chunk]
    out += [_LAST_BLOCK, _ADLER.pack(check)]
    return b"".join(out)


def _worth_trying(part: bytes) -> bool:
    """Whether ``part`` is offered to zlib: a big one only if it may save a twentieth,
    estimated on its head compressed whole and two samples of the rest (random
    bytes, compressed data: zlib took 2.6 ms per 100 KB to find they do not)."""
    size = len(part)
    if size <= 8 * _SAMPLE:
        return True
    half = _SAMPLE // 2
    middle = (size + _SAMPLE) // 2
    sample = part[middle : middle + half] + part[-half:]
    kept = len(zlib.compress(part[:_SAMPLE], 1))
    kept += (size - _SAMPLE) * len(zlib.compress(sample, 1)) / len(sample)
    return kept * 20 <= size * 19


def unpack(key: str, value: bytes, limit: int) -> tuple[Entry, bytes]:
    """(the entry, its manifest's bytes) from a stored value; RemoteCorrupt if not whole,
    or if its manifest and files are over ``limit`` bytes (checked as it inflates: a
    value under a remote's size cap may still be zlib that inflates to gigabytes)."""
    if len(value) < _HEAD.size + _CHECK or not value.startswith(MAGIC):
        raise RemoteCorrupt("not an opcache value")
    # Slices of a view copy nothing (a 100 KB value was copied three times): only
    # the manifest and the files are, once each.
    view = memoryview(value)
    if not value.endswith(xxhash.xxh3_128_digest(view[:-_CHECK])):
        raise RemoteCorrupt("the value is damaged (checksum)")
    _, version, flags = _HEAD.unpack_from(value)
    if version != FORMAT:
        raise RemoteCorrupt(f"value format {version}, not {FORMAT}", maybe_sound=True)
    payload: bytes | memoryview = view[_HEAD.size : -_CHECK]
    if flags & _ZLIB:
        payload = _inflated(payload, limit + _LENGTH.size)
    elif len(payload) > limit + _LENGTH.size:
        raise RemoteCorrupt(f"{len(payload) - _LENGTH.size} bytes, past {limit}", maybe_sound=True)
    if len(payload) < _LENGTH.size:
        raise RemoteCorrupt("no manifest")
    (length,) = _LENGTH.unpack_from(payload)
    at = _LENGTH.size + length
    manifest = bytes(payload[_LENGTH.size : at])
    try:
        described = parse_manifest(manifest, key)
        files = {}
        for name, size, want in described["artifacts"]:
            files[name] = check_artifact(name, size, want, bytes(payload[at : at + size]))
            at += size
    except CorruptEntry as e:
        raise RemoteCorrupt(str(e), maybe_sound=e.maybe_sound) from None
    if at != len(payload):
        raise RemoteCorrupt(f"{len(payload) - at} bytes past the last artifact")
    seconds, modes, reads = described["compile_seconds"], described["modes"], described["reads"]
    return Entry(key, files, seconds, 0.0, modes, reads), manifest


def _inflated(stream: memoryview, limit: int) -> bytes:
    """The bytes of a zlib stream (RemoteCorrupt past ``limit`` bytes, checked as it
    inflates: a few MB of zlib may inflate to GBs).

    Inflated as the raw deflate inside its zlib framing: its Adler-32 is not
    computed (13,000 of the 142,000 instructions of a 4 KB value's unpack),
    since the value's own checksum, the manifest's and every artifact's
    digest, all checked, cover every byte it would.  The header is checked as zlib checks
    it (deflate, a window of at most 32 KB, no preset dictionary), and the
    stream must end with the four bytes of its Adler-32.
    """
    if (
        len(stream) < 2
        or stream[0] & 0x0F != 8  # (deflate)
        or stream[0] >> 4 > 7  # (a window over 32 KB)
        or stream[1] & 0x20  # (a preset dictionary)
        or (stream[0] << 8 | stream[1]) % 31
    ):
        raise RemoteCorrupt("cannot decompress: not a zlib stream")
    inflate = zlib.decompressobj(-((stream[0] >> 4) + 8))
    try:
        inflated = inflate.decompress(stream[2:], limit)
    except zlib.error as e:
        raise RemoteCorrupt(f"cannot decompress: {e}") from None
    if inflate.unconsumed_tail:
        raise RemoteCorrupt(f"it inflates past {limit - _LENGTH.size} bytes", maybe_sound=True)
    if not inflate.eof or len(inflate.unused_data) != _ADLER.size:
        raise RemoteCorrupt("cannot decompress: the stream is cut short or runs on")
    return inflated


def checked(key: str, value: bytes, limit: int) -> Fetched | RemoteCorrupt:
    """``unpack``'s answer with the value's size on the wire, or its RemoteCorrupt (a
    server's answer that is no string too: Redis answering a GET with ``:5``)."""
    if not isinstance(value, bytes):
        return RemoteCorrupt(f"not a value: the server answered {type(value).__name__}")
    try:
        return (*unpack(key, value, limit), len(value))
    except RemoteCorrupt as e:
        e.size = len(value)
        return e
