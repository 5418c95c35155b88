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
import re

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
    """How deep lists and objects nest in ``value``, walked without recursion
    (past ``MAX_DEPTH``, a number past it)."""
    # A level at a time, and only its lists and objects: one isinstance per item,
    # no tuple per item (this walk was most of reading a manifest).
    depth = 0
    level = [value]
    while level:
        level = [item for item in level if isinstance(item, dict | list)]
        if not level:
            break
        depth += 1
        if depth > MAX_DEPTH:
            break
        children: list[object] = []
        for item in level:
            children.extend(item.values() if isinstance(item, dict) else item)
        level = children
    return depth


# -- CANN's reader: nlohmann::json's operator>> ------------------------------------

_BOM = b"\xef\xbb\xbf"
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LITERALS = (("true", True), ("false", False), ("null", None))
_OPEN_RUN = re.compile(r"\[[\[ \t\n\r]*")
_CLOSE_RUN = re.compile(r"\][\] \t\n\r]*")


class _Deep:
    """Stands for a list or object nested deeper than MAX_DEPTH in ``loads_nlohmann``'s result."""

    def __repr__(self) -> str:
        return "DEEP"


DEEP = _Deep()


def loads_nlohmann(raw: bytes) -> object:
    """The first JSON value of ``raw`` as CANN reads an entry's json, or ValueError.

    CANN reads with nlohmann::json's ``ifs >> json`` (hicann/ge
    ``te_file_utils.cc`` ``TeFileUtils::GetJsonValueFromJsonFile``): a UTF-8
    BOM is skipped; whatever follows the first value is never read, so
    trailing data or a second object is accepted; there is no depth limit;
    NaN, Infinity, a number that overflows a double (``1e400``), a lone
    surrogate (escaped or raw) and anything but UTF-8 (UTF-16 text) are
    errors.  Lists and objects nested deeper than ``MAX_DEPTH`` come back as
    ``DEEP``: nothing CANN reads lies there, and a Python structure that deep
    breaks every recursive walk of it.
    """
    if raw.startswith(_BOM):
        raw = raw[len(_BOM) :]
    # Bytes that are no UTF-8 become lone surrogates: an error only where the parse reaches them.
    text = raw.decode("utf-8", "surrogateescape")
    start = _WHITESPACE.match(text).end()  # type: ignore[union-attr]
    decoder = json.JSONDecoder(
        parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant
    )
    try:
        value, end = decoder.raw_decode(text, start)
    except RecursionError:
        value, end = _raw_decode_deep(text, start)
    else:
        _refuse_surrogates(value)
    if isinstance(value, (int, float)) and number_cut_short(text, start, end):
        raise ValueError("JSON number has no digits after its '.' or exponent")
    return value


def number_cut_short(text: str, start: int, end: int) -> bool:
    """Whether the number ``text[start:end]`` goes on as nlohmann reads it ("1." or "1e",
    an error there) where Python's grammar stops before the "." or "e"."""
    number, after = text[start:end].lower(), text[end : end + 1].lower()
    return (after == "." and "." not in number and "e" not in number) or (
        after == "e" and "e" not in number
    )


def _refuse_surrogates(value: object) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_string(item)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_string(key)
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)


def _check_string(text: str) -> str:
    if _SURROGATE.search(text):
        raise ValueError("JSON string holds a lone surrogate or bytes that are no UTF-8")
    return text


def _raw_decode_deep(text: str, pos: int) -> tuple[object, int]:
    """``raw_decode`` without recursion, for values nested past the interpreter's limit."""
    kept: list[list] = []  # open containers up to MAX_DEPTH: [container, pending key]
    deep = bytearray()  # open containers below them: only their kind, "[" or "{"
    while True:
        # A value starts at pos.
        pos = _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]
        char = text[pos : pos + 1]
        if char == "[" and len(kept) == MAX_DEPTH:
            # A run of "[" below the kept levels at once: "[" * 10**7 is read in seconds.
            run = _OPEN_RUN.match(text, pos)
            deep.extend(b"[" * run.group().count("["))  # type: ignore[union-attr]
            pos = run.end()  # type: ignore[union-attr]
            if text[pos : pos + 1] != "]":
                continue
            pos += 1
            value: object = _close(kept, deep)
        elif char in ("[", "{"):
            if len(kept) < MAX_DEPTH:
                kept.append([[] if char == "[" else {}, None])
            else:
                deep.append(ord(char))
            pos = _WHITESPACE.match(text, pos + 1).end()  # type: ignore[union-attr]
            if text[pos : pos + 1] != ("]" if char == "[" else "}"):
                if char == "{":
                    pos = _key(text, pos, kept, deep)
                continue
            pos += 1
            value = _close(kept, deep)
        else:
            value, pos = _scalar(text, pos)
        # A value ended at pos: put it in its container, then a ',' or the container's end.
        while True:
            if not kept:
                return value, pos
            if not deep:
                container, key = kept[-1]
                if isinstance(container, list):
                    container.append(value)
                else:
                    container[key] = value
            kind = deep[-1] if deep else ord("[" if isinstance(kept[-1][0], list) else "{")
            pos = _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]
            char = text[pos : pos + 1]
            if char == ",":
                pos += 1
                if kind == ord("{"):
                    pos = _key(text, pos, kept, deep)
                break
            if char != ("]" if kind == ord("[") else "}"):
                raise ValueError(f"JSON: unexpected {char!r} at {pos}")
            if char == "]" and deep:
                pos = _close_run(text, pos, deep)
                value = DEEP
                continue
            pos += 1
            value = _close(kept, deep)


def _close_run(text: str, pos: int, deep: bytearray) -> int:
    """Close at once the lists below the kept levels that the run of "]" at pos ends."""
    run = _CLOSE_RUN.match(text, pos).group()  # type: ignore[union-attr]
    tail = deep[-run.count("]") :]
    count = len(tail) - len(tail.rstrip(b"[")) or 1  # (1: the "]" at pos, which matches)
    del deep[-count:]
    if len(run) == run.count("]"):
        return pos + count
    end = -1
    for _ in range(count):
        end = run.index("]", end + 1)
    return pos + end + 1


def _close(kept: list[list], deep: bytearray) -> object:
    if deep:
        deep.pop()
        return DEEP
    return kept.pop()[0]


def _key(text: str, pos: int, kept: list[list], deep: bytearray) -> int:
    """Read ``"key":`` at pos into the innermost object; returns where its value starts."""
    pos = _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]
    if text[pos : pos + 1] != '"':
        raise ValueError(f"JSON: expected a key at {pos}")
    key, pos = json.decoder.scanstring(text, pos + 1, True)  # type: ignore[attr-defined]
    _check_string(key)
    pos = _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]
    if text[pos : pos + 1] != ":":
        raise ValueError(f"JSON: expected ':' at {pos}")
    if not deep:
        kept[-1][1] = key
    return pos + 1


def _scalar(text: str, pos: int) -> tuple[object, int]:
    if text[pos : pos + 1] == '"':
        value, end = json.decoder.scanstring(text, pos + 1, True)  # type: ignore[attr-defined]
        return _check_string(value), end
    for word, value in _LITERALS:
        if text.startswith(word, pos):
            return value, pos + len(word)
    match = _NUMBER.match(text, pos)
    if match is None:
        raise ValueError(f"JSON: expected a value at {pos}")
    number = match.group()
    if match.group(1) or match.group(2):
        return _finite_float(number), match.end()
    return _bounded_int(number), match.end()
