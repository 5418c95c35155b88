"""Why a call missed: the parts of its key against the nearest stored entry.

Each compile the cache stores leaves a note of its key's parts (what
``key.explain_key`` computes) beside the cache's bookkeeping, one note per
operator and chip::

    .opcache/explain/<soc>/<id[:2]>/<id>    the explanations of up to KEEP keys

An operator is its ``op_type`` and the names of its sources (for a wrapped C
compile, the source as the command line names it); ``op_name`` is left out,
as it is left out of the key: one kernel under two node names is one entry.
``explain`` compares a request's parts with each stored key of the same
operator and chip whose entry is still there, and reports the nearest: the
one with the fewest differing parts, the newest among equals.

The notes stay bounded: a note keeps the last KEEP keys of its operator, and
drops those whose entries are gone each time it is written; an aging pass
that removed entries prunes the chip's notes, and clearing a chip (``clear``,
``force``) removes them.  A note is a diagnosis, never a reason to serve or
refuse an entry: a note that cannot be read or written only costs the
explanation (a debug record says why).

What a compile read (an opc line's read set, ``readset.py``) joins its key as
a digest, so a changed file shows as that part changed; the caller that knows
which files changed (``wrap.plan_command``) passes them as ``reads_changed``,
and each is one more line of ``changes``.  A compiler whose key holds files by
contents only (a wrapped C compile's headers) names them in ``explain_names``
(``NAMES``), which its note keeps: a changed header is then named by its path,
and a place its include search found empty that now exists is named too.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from . import _json, fsutil
from ._log import get_logger
from ._record import Record
from .key import canonical_json, digest, explain_key
from .storage.local import _names

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

    from .compilers.protocol import Compiler
    from .request import OpRequest
    from .storage.local import LocalStore

log = get_logger(__name__)

FOLDER = "explain"
KEEP = 8  # keys explained per operator and chip, newest kept
_SHORT = 100  # characters of a value shown in a difference
_HEX = frozenset("0123456789abcdef")
# What a note keeps by name beside the key's parts: the headers a C compile read,
# in the order of ``attrs.headers``, and the places its include search found empty.
NAMES = ("headers", "absent")
_LONGEST = 1 << 16  # characters of a keyed text opened up for comparing (notes may be planted)


class Explanation(Record):
    """What ``OpCache.explain`` found for one request.

    ``key`` and ``parts`` (with ``part_digests``, a digest per part) are what
    the key is made of, as ``explain_key`` gives them; ``operator`` names the
    operator and its chip.  ``stored`` says the key has an entry (the call
    would hit).  ``seen`` says another key of the operator is stored;
    ``nearest`` is that entry's key (None when not ``seen``) and ``changes``
    one line per part that differs from it, such as
    ``attrs.args: ['-O2'] -> ['-O3']`` or ``sources.k.c: digest changed``.
    """

    __slots__ = _fields = (
        "key",
        "operator",
        "parts",
        "part_digests",
        "stored",
        "seen",
        "nearest",
        "changes",
    )
    key: str
    operator: dict[str, Any]
    parts: dict[str, Any]
    part_digests: dict[str, str]
    stored: bool
    seen: bool
    nearest: str | None
    changes: list[str]

    def __init__(
        self,
        key: str,
        operator: dict[str, Any],
        parts: dict[str, Any],
        part_digests: dict[str, str],
        stored: bool,
        seen: bool,
        nearest: str | None,
        changes: list[str],
    ) -> None:
        self._init(locals())

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def text(self) -> str:
        """The explanation as ``opcache explain`` prints it."""
        op = self.operator
        lines = [f"key: {self.key}", f"operator: {_operator_name(op)} on chip {op['soc']}"]
        lines.append("parts (digest, value):")
        for name, value in self.parts.items():
            lines.append(f"  {name}: {self.part_digests[name][:12]}  {_short(value)}")
        if self.stored:
            lines.append("stored: an entry has this key (a hit)")
        elif not self.seen:
            lines.append("never seen: no stored entry of this operator on this chip (a miss)")
            lines += [f"  {change}" for change in self.changes]
        else:
            lines.append(f"a new key for an operator seen before; nearest entry: {self.nearest}")
            lines.append("differs in:" if self.changes else "differs in no part it records")
            lines += [f"  {change}" for change in self.changes]
        return "\n".join(lines)


def operator_of(request: OpRequest) -> dict[str, Any]:
    """The operator a request compiles, and its chip: what ``nearest`` searches by."""
    source = request.attrs.get("source")
    names = [source] if isinstance(source, str) else sorted(request.sources)
    return {"soc": request.soc_version, "op_type": request.op_type, "sources": names}


def _operator_name(op: Mapping[str, Any]) -> str:
    return " ".join([op["op_type"], *op["sources"]])


def _note_name(operator: Mapping[str, Any]) -> tuple[str, str, str, str]:
    """The note's parts under ``.opcache``."""
    name = digest(canonical_json(dict(operator)))
    return FOLDER, operator["soc"], name[:2], name


def record(
    store: LocalStore,
    request: OpRequest,
    key: str,
    parts: dict[str, Any],
    *,
    now: float | None = None,
    names: Mapping[str, Sequence[str]] | None = None,
) -> bool | None:
    """Keep the explanation of a key just compiled for storing.

    Returns whether another key of its operator is stored (a new key for an
    operator seen before), or None when the notes cannot be read.  Kept are
    this key and the last KEEP - 1 others whose entries are still there.
    ``names``: what the key holds by contents only, by name (``NAMES``).
    """
    operator = operator_of(request)
    soc = operator["soc"]
    where = _note_name(operator)
    note = {"key": key, "created": time.time() if now is None else now, "parts": parts}
    if names:
        note["names"] = {name: list(names[name]) for name in NAMES if name in names}
    seen = False

    def updated(raw: bytes | None) -> bytes:
        nonlocal seen
        kept = [n for n in _parsed(raw) if n["key"] != key]
        kept = [n for n in kept if store.stamp(soc, n["key"]) is not None]
        seen = bool(kept)
        return json.dumps([*kept[-(KEEP - 1) :], note]).encode()

    try:
        # Locked: two keys of one operator stored at once must both be kept.
        with store.locked(f"{soc}.explain"):
            store.update_note(updated, *where)
    except OSError as e:
        log.debug("cannot note the explanation of %s/%s: %s", soc, key, e)
        return None
    return seen


def explain(
    store: LocalStore,
    request: OpRequest,
    compiler: Compiler,
    *,
    reads_changed: Sequence[str] = (),
) -> Explanation:
    """The key of ``request`` and how it differs from the nearest stored entry;
    ``reads_changed``: files the compile read last time that are not as they were."""
    explained = explain_key(request, compiler)
    names = getattr(compiler, "explain_names", None)
    key = explained["key"]
    parts = json.loads(canonical_json(explained["parts"]))  # as a note holds them: no tuples
    operator = operator_of(request)
    soc = operator["soc"]
    stored = store.stamp(soc, key) is not None
    best: tuple[int, float] | None = None
    nearest, changes, was = None, [], {"names": {}}
    for note in _read(store, _note_name(operator)):
        if note["key"] == key or store.stamp(soc, note["key"]) is None:
            continue
        found = differences(_readable(note["parts"]), _readable(parts))
        rank = (len(found), -note["created"])
        if best is None or rank < best:
            best, nearest, changes, was = rank, note["key"], found, note
    if nearest is not None and names:
        changes = _by_name(changes, was, names, parts)
    if not stored:
        changes = [*changes, *(f"read set: {path} changed" for path in reads_changed)]
        absent = was["names"].get("absent", ())
        changes += [f"lookup: {path} now exists" for path in absent if _exists(path)]
    return Explanation(
        key,
        operator,
        parts,
        explained["part_digests"],
        stored,
        nearest is not None,
        nearest,
        changes,
    )


def differences(old: Any, new: Any, path: str = "") -> list[str]:
    """One line per part of ``new`` that is not as in ``old``, named by its path."""
    if old == new:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for name in sorted(set(old) | set(new), key=str):
            at = f"{path}.{name}" if path else str(name)
            if name not in old:
                out.append(f"{at}: added, {_short(new[name])}")
            elif name not in new:
                out.append(f"{at}: removed, was {_short(old[name])}")
            else:
                out += differences(old[name], new[name], at)
        return out
    if _is_digest(old) and _is_digest(new):
        return [f"{path}: digest changed"]
    if (
        isinstance(old, list)
        and isinstance(new, list)
        and len(old) == len(new)
        and (
            len(_short(old)) >= _SHORT
            or any(isinstance(v, list | dict) or _is_digest(v) for v in old)
        )
    ):
        out = []
        for index, (was, now) in enumerate(zip(old, new, strict=True)):
            out += differences(was, now, f"{path}[{index}]")
        return out
    return [f"{path}: {_short(old)} -> {_short(new)}"]


def _by_name(
    changes: list[str],
    note: Mapping[str, Any],
    names: Mapping[str, Sequence[str]],
    parts: Mapping[str, Any],
) -> list[str]:
    """``changes`` with the headers' lines by file: the key holds the headers'
    contents in order (``attrs.headers``), the notes their names."""
    old_names, new_names = note["names"].get("headers"), names.get("headers")
    if old_names is None or new_names is None:
        return changes
    old_attrs, new_attrs = note["parts"].get("attrs"), parts.get("attrs")
    if not isinstance(old_attrs, dict) or not isinstance(new_attrs, dict):
        return changes
    old_digests, new_digests = old_attrs.get("headers"), new_attrs.get("headers")
    if not isinstance(old_digests, list) or not isinstance(new_digests, list):
        return changes
    if len(old_names) != len(old_digests) or len(new_names) != len(new_digests):
        return changes
    old = dict(zip(old_names, old_digests, strict=True))
    new = dict(zip(new_names, new_digests, strict=True))
    named = [f"attrs.headers: {path} removed" for path in old if path not in new]
    for path, value in new.items():
        if path not in old:
            named.append(f"attrs.headers: {path} added")
        elif old[path] != value:
            named.append(f"attrs.headers: {path} changed")
    if not named:
        return changes  # (the same headers, in another order)
    return [c for c in changes if not c.startswith("attrs.headers")] + named


def _readable(parts: dict[str, Any]) -> dict[str, Any]:
    """``parts`` with the values the key holds as text opened up for comparing:
    the environment (a repr of [name, value] pairs) as a mapping, a fingerprint
    that is a JSON object as that object, the listed extra files by path; each
    then differs by name."""
    out = dict(parts)
    attrs = out.get("attrs")
    if isinstance(attrs, dict) and isinstance(attrs.get("env"), str):
        out["attrs"] = attrs = {**attrs, "env": _pairs(attrs["env"])}
    if isinstance(attrs, dict) and isinstance(attrs.get("extra_files"), list):
        out["attrs"] = {**attrs, "extra_files": _by_path(attrs["extra_files"])}
    compiler = out.get("compiler")
    if isinstance(compiler, dict) and isinstance(compiler.get("fingerprint"), str):
        out["compiler"] = {**compiler, "fingerprint": _json_object(compiler["fingerprint"])}
    return out


def _pairs(text: str) -> Any:
    """The mapping a repr of [name, value] pairs stands for, else ``text`` as it is."""
    import ast

    if len(text) > _LONGEST:
        return text
    try:
        pairs = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    if not isinstance(pairs, list | tuple) or not all(
        isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs
    ):
        return text
    return {name: value for name, value in pairs}


def _by_path(files: list[Any]) -> Any:
    """``OPCACHE_EXTRA_FILES``' [path, size, digest] (or [pattern, "no match"]) as
    path: digest, else ``files`` as they are."""
    if not all(isinstance(f, list) and f and isinstance(f[0], str) for f in files):
        return files
    return {f[0]: f[-1] for f in files}


def _json_object(text: str) -> Any:
    """The object a JSON text holds (CANN's tool fingerprints), else ``text`` as it is."""
    try:
        found = _json.loads(text) if len(text) <= _LONGEST else None
    except ValueError:
        return text
    return found if isinstance(found, dict) else text


def _exists(path: str) -> bool:
    """Whether anything is at ``path`` (itself, not where a link leads)."""
    try:
        os.lstat(path)
    except OSError:
        return False
    return True


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 32 and set(value) <= _HEX


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= _SHORT else shown[: _SHORT - 3] + "..."


def _read(store: LocalStore, where: tuple[str, ...]) -> list[dict[str, Any]]:
    """The explanations a note holds, oldest first; what is not one is left out."""
    return _parsed(store.read_note(*where))


def _parsed(raw: bytes | None) -> list[dict[str, Any]]:
    """The explanations in a note's bytes (``_read``)."""
    try:
        notes = _json.loads(raw) if raw else []
    except ValueError:
        return []
    found = [
        n
        for n in (notes if isinstance(notes, list) else [])
        if isinstance(n, dict)
        # Notes are files others may write: a key goes into paths (an entry's
        # stamp), so only one of the shape key.digest makes is taken.
        and _is_digest(n.get("key"))
        and isinstance(n.get("parts"), dict)
        and isinstance(n.get("created"), int | float)
    ]
    for note in found:
        names = note.get("names")
        names = names if isinstance(names, dict) else {}
        note["names"] = {
            name: names[name]
            for name in NAMES
            if isinstance(names.get(name), list) and all(isinstance(p, str) for p in names[name])
        }
    return found


def prune(store: LocalStore, soc: str) -> None:
    """Drop the explanations of a chip's entries that are gone (after aging removed some)."""
    try:
        chip_fd = store.open_folder(FOLDER, soc, create=False)
    except OSError:
        return  # no notes (or none to trust): nothing to prune
    try:
        buckets = [b for b in _names(chip_fd) if len(b) == 2 and set(b) <= _HEX]
    finally:
        os.close(chip_fd)
    try:
        with store.locked(f"{soc}.explain"):
            _prune_buckets(store, soc, buckets)
    except OSError as e:
        log.debug("cannot prune the explanations of %s: %s", soc, e)


def _prune_buckets(store: LocalStore, soc: str, buckets: list[str]) -> None:
    for bucket in buckets:
        try:
            bucket_fd = store.open_folder(FOLDER, soc, bucket, create=False)
        except OSError:
            continue
        try:
            names = _names(bucket_fd)
        finally:
            os.close(bucket_fd)
        for name in names:
            if name.startswith(bucket) and len(name) == 32 and set(name) <= _HEX:
                _prune_note(store, (FOLDER, soc, bucket, name))


def _prune_note(store: LocalStore, where: tuple[str, str, str, str]) -> None:
    soc = where[1]
    notes = _read(store, where)
    kept = [n for n in notes if store.stamp(soc, n["key"]) is not None]
    if len(kept) == len(notes) and notes:
        return
    with contextlib.suppress(OSError):
        if kept:
            store.write_note(json.dumps(kept).encode(), *where)
        else:
            bucket_fd = store.open_folder(*where[:-1], create=False)
            try:
                os.unlink(where[-1], dir_fd=bucket_fd)
            finally:
                os.close(bucket_fd)


def forget(store: LocalStore, soc: str) -> None:
    """Remove every explanation of a chip (its entries were cleared)."""
    try:
        folder_fd = store.open_folder(FOLDER, create=False)
    except OSError:
        return
    try:
        fsutil.remove_tree(soc, folder_fd)
    except OSError as e:
        log.debug("cannot remove the explanations of %s: %s", soc, e)
    finally:
        os.close(folder_fd)
