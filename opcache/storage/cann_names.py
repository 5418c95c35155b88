"""CANN's kernels in a store: the chips and names ``opcache cann push`` gives them.

A remote (or a shared folder, a cache root like any other) holds them beside
opcache's own entries; ``clear``, ``usage``, the maintenance commands and aging
tell them apart by these names alone.
"""

from __future__ import annotations

from ..request import is_soc_version

# CANN's kernels in a remote (``opcache cann push``, ``cann_transfer.py``): the chip
# ``cann:<soc>`` holds the head of the index of a chip's namespaces,
# ``cann:<soc>:<namespace id>`` the kernels of one namespace, each an entry named by
# its kernel, and the parts of its index (``#index-00`` to ``#index-ff``).
_NAMESPACE_DIGITS = frozenset("0123456789abcdef")
_NAMESPACE_LENGTH = 16


def cann_chip(soc: str, namespace: str | None = None) -> str:
    """The chip of CANN's index of ``soc``, or of the kernels of one of its namespaces."""
    return f"cann:{soc}" if namespace is None else f"cann:{soc}:{namespace}"


def is_cann_chip(chip: str) -> bool:
    """Whether ``chip`` is one ``cann_chip`` names: ``clear`` and ``usage`` count such
    chips as this cache's, and no other name that begins the same."""
    kind, _, rest = chip.partition(":")
    soc, has_namespace, namespace = rest.partition(":")
    if kind != "cann":
        return False
    if has_namespace and not (
        len(namespace) == _NAMESPACE_LENGTH and set(namespace) <= _NAMESPACE_DIGITS
    ):
        return False
    return is_soc_version(soc)


def is_cann_index(name: str) -> bool:
    """Whether an entry of a CANN chip is a part of its index (``#index2``, ``#index-xx``),
    not a kernel: no kernel given or taken is named with a ``#`` first."""
    return name.startswith("#")
