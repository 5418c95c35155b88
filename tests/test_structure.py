"""The package's shape: no import circle, and records whose field lists agree.

An import circle (a imports b, b imports a, directly or around a loop) makes a
module's names depend on which of them is imported first, and a layer that
cannot be read, tested or replaced alone.  Every import counts: at module
level, inside a function (deferred, for start-up time) and under
``TYPE_CHECKING`` (a loop a type checker follows is a loop a reader follows).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
from helpers_cache import TESTS_DIR

import opcache
from opcache._record import Record

PACKAGE = TESTS_DIR.parent / "opcache"


def module_files() -> dict[str, Path]:
    """Module name (relative to opcache, '' for the package) -> its source file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The opcache modules that module ``name`` imports anywhere in its text."""
    here = name.split(".") if name else []
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [
                alias.name.removeprefix("opcache").lstrip(".")
                for alias in node.names
                if alias.name == "opcache" or alias.name.startswith("opcache.")
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "opcache" or node.module.startswith("opcache.")):
                stem = node.module.removeprefix("opcache").lstrip(".")
            else:
                continue
            # `from pkg import name`: the submodule pkg.name when there is one.
            targets = [
                f"{stem}.{alias.name}".lstrip(".")
                if f"{stem}.{alias.name}".lstrip(".") in modules
                else stem
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One loop of imports in ``graph``, as the modules it goes through, or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start)):
            return circle
    return None


def show(circle: list[str] | tuple[str, ...]) -> str:
    return " -> ".join(f"opcache.{m}".rstrip(".") for m in [*circle, circle[0]])


GRAPH = import_graph()


def test_the_graph_sees_every_kind_of_import():
    assert "storage.remote" in GRAPH["storage"]  # from .remote import ... in a package
    assert "compilers.protocol" in GRAPH["key"]  # under TYPE_CHECKING
    assert "counters" in GRAPH["stats"]  # module level
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c"]


def test_no_import_circle():
    circle = find_circle(GRAPH)
    assert circle is None, f"import circle: {show(circle)}"


def records() -> list[type[Record]]:
    for info in pkgutil.walk_packages(opcache.__path__, "opcache."):
        if info.name == "opcache.__main__":  # importing it runs the command line
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:  # an optional client library (a remote kind's)
            if (e.name or "opcache").split(".")[0] == "opcache":
                raise
    found, todo = [], list(Record.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


RECORDS = records()


def test_records_are_found():
    names = {cls.__name__ for cls in RECORDS}
    assert {"Settings", "OpRequest", "CompileResult", "Entry", "Modes"} <= names


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_a_records_field_lists_agree(cls):
    """_fields, __slots__, the annotations and __init__'s parameters name the same fields."""
    fields = list(cls._fields)
    assert fields and len(set(fields)) == len(fields), f"_fields: {fields}"
    if "__slots__" in vars(cls):
        assert list(vars(cls)["__slots__"]) == fields, "__slots__ is not _fields"
    annotated = [
        n for n in inspect.get_annotations(cls) if n not in ("_fields", "_compared", "__slots__")
    ]
    assert annotated == fields, "the class's annotations are not _fields, in order"
    parameters = list(inspect.signature(cls.__init__).parameters)[1:]
    assert parameters == fields, "__init__'s parameters are not _fields, in order"
    assert set(cls._compared or ()) <= set(fields), "_compared names a field _fields has not"
