"""Read-only records, written out rather than made with dataclasses.

``opcache wrap`` starts a Python for every compile command, and importing
dataclasses (with inspect, ast and dis) and building a dozen classes cost it
about 25 ms: more than the whole cache hit.  A record here names its fields
once (in ``__slots__`` or ``_fields``); its ``__init__``, whose parameters
are the fields, stores them with ``self._init(locals())``.
"""

from __future__ import annotations


class Record:
    """Fields set once, compared and shown by value; ``_compared`` may leave some out."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()
    _compared: tuple[str, ...] | None = None

    def _init(self, values: dict[str, object]) -> None:
        """Store the fields from ``values``: an ``__init__`` passes its ``locals()``."""
        for name in self._fields:
            object.__setattr__(self, name, values[name])

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def _values(self) -> tuple[object, ...]:
        compared = self._fields if self._compared is None else self._compared
        return tuple(getattr(self, name) for name in compared)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __reduce__(self) -> tuple[object, ...]:
        # Pickle (multiprocessing, copy) by fields: the default sets attributes.
        return _restore, (type(self), {name: getattr(self, name) for name in self._fields})

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__name__}({shown})"


def _restore(cls: type[Record], fields: dict[str, object]) -> Record:
    record = cls.__new__(cls)
    record._init(fields)
    return record
