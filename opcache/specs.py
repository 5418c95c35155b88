"""``opcache compile``: operators described in JSON files, compiled with ``compile_many``.

A spec file holds one object or a list of objects with the ``OpRequest``
fields.  ``sources`` maps a file name to a path, relative to the spec file's
folder when not absolute.  Each operator's artifacts go to
``<output>/<op_name or kernel name>/``, where a ``/`` in op_name becomes ``_``
(TensorFlow node names such as ``model/layer_1/MatMul`` are normal); a name
that would still leave ``<output>`` (absolute, a ``.`` or ``..`` part) is a bad
spec.  One bad spec is reported with its file and field and does not stop the
others.  Several ``opcache compile`` processes started on one spec list (the
ranks of a job) share the work: each operator is compiled once among them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import fsutil
from .cache import OpCache
from .compilers import get_compiler
from .compilers.toolchain import kernel_name
from .errors import ConfigError
from .request import CompileResult, OpRequest
from .settings import Settings

_FIELDS: dict[str, tuple[type, ...]] = {
    "op_type": (str,),
    "soc_version": (str,),
    "op_name": (str,),
    "inputs": (list,),
    "outputs": (list,),
    "attrs": (dict,),
    "options": (dict,),
    "sources": (dict,),
}
_REQUIRED = ("op_type", "soc_version")


@dataclass
class Outcome:
    """What happened to one operator of a spec file."""

    spec: str  # "<file>[<index>]"
    op: str  # op_name, or the op_type when the spec has no name
    status: str  # hit, miss, bypass, disabled, or error
    seconds: float = 0.0
    saved_seconds: float = 0.0
    output: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_specs(paths: Sequence[str | os.PathLike[str]]) -> Iterator[tuple[str, OpRequest | str]]:
    """(where, request or what is wrong) for every operator in the spec files."""
    for path in paths:
        path = Path(path)
        try:
            data = json.loads(fsutil.read_input(path))
        except OSError as e:
            yield str(path), f"cannot read it: {e.strerror or e}"
            continue
        except ValueError as e:
            yield str(path), f"not JSON: {e}"
            continue
        except RecursionError:
            yield str(path), "nested too deeply to be an operator spec"
            continue
        items = data if isinstance(data, list) else [data]
        for index, item in enumerate(items):
            where = f"{path}[{index}]" if isinstance(data, list) else str(path)
            yield where, _request(item, path.parent)


def _request(item: Any, base: Path) -> OpRequest | str:
    if not isinstance(item, dict):
        return "an operator must be a JSON object"
    for name in _REQUIRED:
        if name not in item:
            return f"field {name!r}: missing"
    for name, value in item.items():
        if name not in _FIELDS:
            return f"field {name!r}: unknown (fields: {', '.join(_FIELDS)})"
        if not isinstance(value, _FIELDS[name]):
            kinds = " or ".join(t.__name__ for t in _FIELDS[name])
            return f"field {name!r}: expected {kinds}, got {type(value).__name__}"
    sources = {}
    for name, value in item.get("sources", {}).items():
        if not isinstance(value, str):
            return f"field 'sources.{name}': expected a path string"
        path = base / value
        try:
            sources[name] = fsutil.read_input(path)
        except OSError as e:
            return f"field 'sources.{name}': cannot read {path}: {e.strerror or e}"
    for tensor_field in ("inputs", "outputs"):
        for i, tensor in enumerate(item.get(tensor_field, [])):
            if not isinstance(tensor, dict):
                return f"field '{tensor_field}[{i}]': expected an object"
    if item.get("op_name"):
        try:
            _folder_name(item["op_name"])
        except ValueError as e:
            return f"field 'op_name': {e}"
    try:
        return OpRequest(**{**item, "sources": sources})
    except (ValueError, ConfigError) as e:
        return str(e)


def _folder_name(op_name: str) -> str:
    """The operator's folder under the output: ``op_name`` with each ``/`` made ``_``.

    Raises ValueError for a name that would leave the output folder all the same.
    """
    if op_name.startswith("/"):
        raise ValueError(f"{op_name!r} is an absolute path; an operator's name must not be one")
    parts = op_name.split("/")
    if "." in parts or ".." in parts:
        raise ValueError(f"{op_name!r} has a '.' or '..' part, which would leave --output")
    if "\0" in op_name:
        raise ValueError(f"{op_name!r} holds a NUL character")
    return "_".join(parts)


def _target(output: Path, request: OpRequest) -> Path:
    return output / (_folder_name(request.op_name) if request.op_name else kernel_name(request))


def compile_specs(
    specs: Sequence[str | os.PathLike[str]],
    settings: Settings,
    output: str | os.PathLike[str],
    *,
    compiler: str = "auto",
    compiler_options: dict[str, Any] | None = None,
    jobs: int | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Compile every operator of ``specs``, ``jobs`` at a time (default: the cores
    this process may use); returns an outcome per operator, in order.

    ``on_outcome`` is called with each as soon as it is known (bad specs first,
    then the operators as they finish, from the thread that did each).
    Raises ConfigError (before compiling anything) for a bad compiler name or option.
    """
    built = get_compiler(compiler, **(compiler_options or {}))  # a bad one fails here, once
    report = on_outcome or (lambda outcome: None)
    outcomes: list[Outcome | None] = []  # in the specs' order, each filled when known
    good: list[tuple[str, OpRequest]] = []
    at: list[int] = []  # each good request's place in ``outcomes``
    for where, request in load_specs(specs):  # bad specs first: known before any compile
        if isinstance(request, str):
            bad = Outcome(where, "?", "error", error=request)
            outcomes.append(bad)
            report(bad)
        else:
            at.append(len(outcomes))
            outcomes.append(None)
            good.append((where, request))
    outs = [_target(Path(output), request) for _, request in good]

    def outcome(index: int, result: CompileResult) -> Outcome:
        where, request = good[index]
        label = request.op_name or request.op_type
        if result.error is not None:
            return Outcome(where, label, "error", result.seconds, error=str(result.error))
        return Outcome(
            where, label, result.status, result.seconds, result.saved_seconds, str(outs[index])
        )

    with OpCache(settings) as cache:
        results = cache.compile_many(
            [request for _, request in good],
            built,
            outs,
            jobs=jobs,
            on_result=lambda index, result: report(outcome(index, result)),
        )
    for index, result in enumerate(results):
        outcomes[at[index]] = outcome(index, result)
    return [done for done in outcomes if done is not None]
