"""The cache key: what makes two compiles the same compile.

The key is XXH3-128 over a canonical JSON of the request's key inputs (op_type,
soc_version, inputs, outputs, attrs, options, the digest of every source) and
the compiler's name and fingerprint.  ``op_name`` is left out on purpose: the
same kernel under two node names is one entry.
"""

from __future__ import annotations

import json
from json.encoder import c_make_encoder, encode_basestring

import xxhash

from ._log import DEBUG, get_logger

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .compilers.protocol import Compiler
    from .request import OpRequest


log = get_logger(__name__)

# Bump when the meaning of a key changes: old entries then simply stop matching.
SCHEMA = 1


# XXH3-128 of bytes as 32 hex digits: the one hash opcache uses.  xxhash's own
# function, not a wrapper around it: a remote hit computes four or more (its key,
# its manifest's checksum, each artifact's digest), and a wrapper's call cost
# half as much again as hashing a KB.
digest: Callable[[bytes], str] = xxhash.xxh3_128_hexdigest


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: equal values give equal bytes.

    Mapping keys must be strings: JSON would turn ``{1: x}`` into ``{"1": x}``
    and two different requests would share a key.
    """
    _check_keys(value)
    try:
        # A word that is not UTF-8 (a byte 0xff in a -D value or a folder's name reaches
        # Python as "\udcff") is written as JSON's escape of it, "\\udcff": still
        # JSON (a manifest holds it) and no other word's bytes.
        return "".join(_encode(value, 0)).encode("utf-8", "backslashreplace")
    except (TypeError, ValueError) as e:
        raise TypeError(f"an OpRequest field is not JSON data: {e}") from None
    except RecursionError:  # (no circular check: a container holding itself ends so)
        raise TypeError(
            "an OpRequest field is not JSON data: it holds itself or nests too deep"
        ) from None


# One encoder, made once: JSONEncoder.encode makes one per call, and its circular
# check keeps a dict of the containers on the way (together a quarter of a
# canonical_json).  Without the check, a container that holds itself recurses
# until RecursionError, refused as any other value that is not JSON.
_ENCODER = json.JSONEncoder(
    sort_keys=True,
    separators=(",", ":"),
    ensure_ascii=False,
    allow_nan=True,
    check_circular=False,
)
if c_make_encoder is None:  # (a Python without json's C part)
    _encode = _ENCODER.iterencode
else:  # (markers, default, encoder, indent, separators, sort_keys, skipkeys, allow_nan)
    _encode = c_make_encoder(
        None, _ENCODER.default, encode_basestring, None, ":", ",", True, False, True
    )

# JSON's leaves, passed over at the cost of a set lookup (half of the walk was
# isinstance tests of leaves).
_LEAVES = frozenset({str, int, float, bool, type(None)})
_SEQUENCES = (list, tuple)  # (a tuple: isinstance of a union was slower, 3.11)


def _check_keys(value: Any) -> None:
    # A loop, not recursion: a call per leaf was a tenth of a library hit.  Only
    # what is not a leaf is pushed (and popped): the leaves of a mapping or list
    # are passed over where they are met.
    pending = [value]
    seen: set[int] = set()  # a container holding itself is json's error to report
    while pending:
        item = pending.pop()
        ident = id(item)
        if ident in seen:
            continue
        seen.add(ident)
        if isinstance(item, dict):
            for name, inner in item.items():
                if not isinstance(name, str):
                    raise TypeError(f"an OpRequest field has a non-string mapping key: {name!r}")
                if type(inner) not in _LEAVES:
                    pending.append(inner)
        elif isinstance(item, _SEQUENCES):
            for inner in item:
                if type(inner) not in _LEAVES:
                    pending.append(inner)


def request_parts(request: OpRequest) -> dict[str, Any]:
    """The request's share of the key (everything but the schema and the compiler)."""
    return {
        "op_type": request.op_type,
        "soc_version": request.soc_version,
        "inputs": request.inputs,
        "outputs": request.outputs,
        "attrs": request.attrs,
        "options": request.options,
        "sources": {name: digest(data) for name, data in request.source_bytes.items()},
    }


def key_inputs(request: OpRequest, compiler_name: str, fingerprint: str) -> dict[str, Any]:
    """Every part that goes into the key, as plain JSON data."""
    return {
        "schema": SCHEMA,
        **request_parts(request),
        "compiler": {"name": compiler_name, "fingerprint": fingerprint},
    }


def compute_key(
    request: OpRequest, compiler_name: str, fingerprint: str
) -> tuple[str, dict[str, Any]]:
    """(key, the inputs it was computed from)."""
    inputs = key_inputs(request, compiler_name, fingerprint)
    blob = canonical_json(inputs)
    key = digest(blob)
    if log.isEnabledFor(DEBUG):
        log.debug("key %s for %s/%s: %s", key, request.soc_version, request.op_type, blob.decode())
    return key, inputs


def explain_key(request: OpRequest, compiler: Compiler) -> dict[str, Any]:
    """What went into a request's key: each part, its own digest, and the key.

    Compare two explanations to see which part made a miss.
    """
    parts = key_inputs(request, compiler.name, compiler.fingerprint())
    return {
        "key": digest(canonical_json(parts)),
        "parts": parts,
        "part_digests": {name: digest(canonical_json(value)) for name, value in parts.items()},
    }
