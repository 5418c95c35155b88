"""Read-only records, written out rather than made with dataclasses.

``opcache wrap`` starts a Python for every compile command, and importing
dataclasses (with inspect, ast and dis) and building a dozen classes cost it
about 25 ms: more than the whole cache hit.  A record here names its fields
once (in ``__slots__`` or ``_fields``); its ``__init__``, whose parameters
are the fields, stores them with ``self._init(locals())``.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from collections.abc import Callable


class Record:
    """Fields set once, compared and shown by value; ``_compared`` may leave some out."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()
    _compared: tuple[str, ...] | None = None
    # (field, what stores it): a slot's own setter where the field is a slot, which
    # skips the lookup object.__setattr__ makes per field (a remote hit makes three
    # records: a CompileResult 1.6-1.8 -> 1.1-1.2 us, an Entry 0.8 -> 0.6 us).
    _setters: tuple[tuple[str, Callable[[object, object], None]], ...] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls._setters = tuple((name, _setter(cls, name)) for name in cls._fields)

    def _init(self, values: dict[str, object]) -> None:
        """Store the fields from ``values``: an ``__init__`` passes its ``locals()``."""
        for name, store in self._setters:
            store(self, values[name])

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


def _setter(cls: type, name: str) -> Callable[[object, object], None]:
    slot = getattr(cls, name, None)
    if type(slot) is _SLOT:
        return slot.__set__
    return lambda record, value: object.__setattr__(record, name, value)


class _HasSlot:
    __slots__ = ("slot",)


_SLOT = type(_HasSlot.slot)  # (types.MemberDescriptorType, without importing types)


def _restore(cls: type[Record], fields: dict[str, object]) -> Record:
    record = cls.__new__(cls)
    record._init(fields)
    return record
