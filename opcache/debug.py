"""Debug options that turn the cache off, for every operator or for some.

CANN's rules: ``op_debug_level`` other than 0 bypasses the cache for every
operator; an ``op_debug_config`` file without an ``op_debug_list`` line, or with
an empty one, bypasses it for every operator; with ``op_debug_list`` only the
listed operators (by operator name, or by type as ``OpType::Name``: any item
with ``::``) are bypassed; and
``NPU_COLLECT_PATH`` forces debug options on, so it bypasses every operator.
"""

from __future__ import annotations

from pathlib import Path

from . import fsutil
from ._record import Record
from .errors import ConfigError

OPTIONS_KEY = "op_debug_config"
LIST_KEY = "op_debug_list"
# A .cfg is a few lines; a larger file is a wrong path, not a config.
_MAX_FILE_BYTES = 1 << 20


class DebugConfig(Record):
    """What an op_debug_config .cfg file says."""

    __slots__ = _fields = ("options", "op_list")
    options: tuple[str, ...]
    op_list: tuple[str, ...] | None  # None: the file has no op_debug_list line

    def __init__(self, options: tuple[str, ...], op_list: tuple[str, ...] | None) -> None:
        self._init(locals())


def _split_list(value: str) -> tuple[str, ...]:
    return tuple(item for item in "".join(value.split()).split(",") if item)


def read_debug_config(path: Path) -> DebugConfig:
    """Parse an op_debug_config file as CANN's parser does; ConfigError if it cannot
    be read.

    Lines are trimmed; blank ones and those starting with ``#`` are skipped; a
    line holding ``op_debug_config`` gives the options, else one holding
    ``op_debug_list`` the list, each the text after its first ``=``, split on
    commas; other lines are ignored (a ``[debug]`` header too).
    """

    def bad(why: str) -> ConfigError:
        return ConfigError(
            f"op_debug_config={str(path)!r}: {why}; expected a .cfg file with lines "
            f"'{OPTIONS_KEY} = opt1,opt2' and optionally '{LIST_KEY} = Name,OpType::Type'"
        )

    try:
        raw = fsutil.read_input(path, _MAX_FILE_BYTES)  # (a FIFO: refused, not waited on)
    except FileNotFoundError:
        raise bad("the file does not exist") from None
    except IsADirectoryError:
        raise bad("it is a folder") from None
    except OSError as e:
        raise bad(f"cannot read it ({e.strerror or e})") from None
    if len(raw) > _MAX_FILE_BYTES:
        raise bad(f"larger than {_MAX_FILE_BYTES} bytes")
    # CANN's parser reads bytes and looks for its ASCII keys: a comment or a name in
    # another encoding (GBK) is read, kept byte for byte as os.fsdecode keeps them.
    text = raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8", "surrogateescape")
    options: tuple[str, ...] = ()
    op_list: tuple[str, ...] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        value = line.partition("=")[2]
        if OPTIONS_KEY in line:  # (first, as CANN's parser asks: a line naming both is this)
            options = _split_list(value)
        elif LIST_KEY in line:
            op_list = _split_list(value)
    return DebugConfig(options, op_list)


def bypass_reason(
    op_name: str,
    op_type: str,
    *,
    level: int,
    config: DebugConfig | None,
    collect_path: str | None,
) -> str | None:
    """Why the cache must not be used for this operator, or None if it may be.

    The reasons are few and fixed (no operator names in them) so that stats can
    count bypasses by reason.
    """
    if level != 0:
        return f"op_debug_level is {level}"
    if collect_path:
        return "NPU_COLLECT_PATH is set"
    if config is None:
        return None
    if config.op_list is None:
        return "op_debug_config is set without op_debug_list"
    if not config.op_list:  # (CANN gives every operator the debug options then)
        return "op_debug_list is empty"
    for entry in config.op_list:
        _, sep, name = entry.partition("::")
        if sep:  # (any prefix: OpType::ReduceSum, optype::, Type::)
            if name == op_type:
                return "op_debug_list names the operator type"
        elif entry == op_name:
            return "op_debug_list names the operator"
    return None
