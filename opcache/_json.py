"""JSON from files other users or processes can write: parse it, or raise ValueError.

``json.loads`` fails on hostile text in more ways than ValueError: ``'[' *
200000`` raises RecursionError, and a value nested just below the interpreter's
limit parses but makes the next ``repr`` or recursive walk of it raise one.  A
4000-digit integer parses, then ``math.isfinite`` or ``float`` on it raises
OverflowError; ``NaN`` and ``Infinity`` are no JSON at all.  Every reader of a
planted file treats ValueError as "damaged, ignore it", so this one function
turns all of these into ValueError.

Numbers are kept to what a C++ parser (CANN's nlohmann::json) reads: finite
doubles; it rejects an integer too large for a double too.  No file opcache
reads nests anywhere near ``MAX_DEPTH``.
"""

from __future__ import annotations

import json
import math

MAX_DEPTH = 64


def loads(raw: bytes | str) -> object:
    """The parsed value, or ValueError for text that is no JSON, too deep or out of range."""
    try:
        value = json.loads(
            raw,
            parse_int=_bounded_int,
            parse_float=_finite_float,
            parse_constant=_no_constant,
        )
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if _depth(value) > MAX_DEPTH:
        raise ValueError("JSON nested too deeply")
    return value


def _bounded_int(text: str) -> int:
    value = int(text)  # ValueError past Python's digit limit
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"JSON integer out of range: {text[:20]}...") from None
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"JSON number out of range: {text[:20]}")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not JSON")


def _depth(value: object) -> int:
    """How deep lists and objects nest in ``value``, walked without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                break
            stack.extend((child, depth + 1) for child in item)
    return deepest
