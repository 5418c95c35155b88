"""op_cache.ini: CANN's size-limit file, read and created the way CANN does.

The file has a section ``[op_compiler_cache]`` with ``max_op_cache_size`` (MB,
-1 turns aging off) and ``remain_cache_size_ratio`` (percent), read line by
line as CANN's graph engine reads it.  The two keys take effect only
together: a file that lacks either, or holds a bad value, is ignored as a
whole.  A file opcache creates carries the keys commented out, so
the environment variables keep their effect until a person sets them here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Mapping
from pathlib import Path

from . import fsutil, trust
from ._log import get_logger
from ._record import Record

log = get_logger(__name__)

SECTION = "op_compiler_cache"
MAX_KEY = "max_op_cache_size"
RATIO_KEY = "remain_cache_size_ratio"

MAX_SIZE_LIMIT = 2147483646
DEFAULT_MAX_SIZE_MB = 500
DEFAULT_RATIO = 50

_INTEGER = re.compile(r"[+-]?[0-9]+")
# Far larger than any real op_cache.ini; a bigger file is a mistake, not a config.
_MAX_FILE_BYTES = 1 << 20

_TEMPLATE = f"""\
# Operator compile cache settings (CANN's op_cache.ini format), created by opcache.
[{SECTION}]
VERSIONS# Size limit of each chip folder in MB (1 MB = 1048576 bytes): -1 turns aging
# off, otherwise 1..2147483647.  The two keys below take effect only when
# both are set and valid; until then ASCEND_MAX_OP_CACHE_SIZE and
# ASCEND_REMAIN_CACHE_SIZE_RATIO apply, then the defaults shown.
#{MAX_KEY}={DEFAULT_MAX_SIZE_MB}
# Percent of the limit kept when the folder is trimmed, 1..100.
#{RATIO_KEY}={DEFAULT_RATIO}
"""


def parse_max_size(text: str) -> int | None:
    """``max_op_cache_size`` / ``ASCEND_MAX_OP_CACHE_SIZE``: -1 or 1..2147483646."""
    value = _parse_int(text)
    if value is None or not (value == -1 or 1 <= value <= MAX_SIZE_LIMIT):
        return None
    return value


def parse_ratio(text: str) -> int | None:
    """``remain_cache_size_ratio`` / ``ASCEND_REMAIN_CACHE_SIZE_RATIO``: 1..100."""
    value = _parse_int(text)
    if value is None or not 1 <= value <= 100:
        return None
    return value


def _parse_int(text: str) -> int | None:
    text = text.strip()
    if not _INTEGER.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
        return None


class SizeLimits(Record):
    """The two size keys of an op_cache.ini that supplies both."""

    __slots__ = _fields = ("max_op_cache_size_mb", "remain_cache_size_ratio")
    max_op_cache_size_mb: int
    remain_cache_size_ratio: int

    def __init__(self, max_op_cache_size_mb: int, remain_cache_size_ratio: int) -> None:
        self._init(locals())


def read_size_limits(path: Path, shared_group: int | None = None) -> SizeLimits | None:
    """Return the size limits ``path`` supplies, or None.

    A missing file, or one with neither size key, is silent.  Anything else that
    keeps the file from supplying both keys logs one warning naming the file and
    what is wrong with it.  That includes a link, FIFO, device or folder in its
    place, and a file with size keys that the cache's trust rule refuses
    (``shared_group``: the group of a group-shared cache): the root is not
    trust-checked, so anyone who can write there could otherwise set every
    user's limits, or hang every compile with a FIFO.
    """
    try:
        raw, untrusted = _read(path, shared_group)
    except (FileNotFoundError, NotADirectoryError):
        return None  # a file in the path: the cache says so when it tries to use the folder
    except OSError as e:
        why = "it is a link" if e.errno == errno.ELOOP else e.strerror or e
        log.warning("ignoring %s: cannot read it (%s)", path, why)
        return None
    problem, limits = _parse(raw)
    # Silent when it would set nothing: opcache's own file, in a group's cache
    # that this process reads as a private one, is group-writable.
    if untrusted and (problem or limits):
        log.warning("ignoring %s: it is %s", path, untrusted)
        return None
    if problem:
        log.warning("ignoring the size settings of %s: %s", path, problem)
    return limits


def _read(
    path: Path, shared_group: int | None, dir_fd: int | None = None
) -> tuple[bytes, str | None]:
    """(its bytes, one more than a config may hold; why the trust rule refuses it,
    or None); OSError unless it is a regular file.  ``dir_fd``: its folder, open
    (``path``'s name is read in it)."""
    fd, st = fsutil.open_regular(path if dir_fd is None else path.name, dir_fd=dir_fd)
    try:
        with open(fd, "rb", closefd=False) as f:
            modes = fsutil.modes_for(shared_group)
            return f.read(_MAX_FILE_BYTES + 1), trust.problem(st, modes, own_group=True)
    finally:
        os.close(fd)


def _parse(raw: bytes) -> tuple[str | None, SizeLimits | None]:
    """(what is wrong, limits): both None for a file with neither size key.

    Read as CANN reads it (``_cann_sections``, ``_cann_limits``): opcache's own
    cache and CANN share the file under ``op_compiler_cache_dir``, and a line
    means the same to both.  Without CANN's rule that the file also name
    ``adk_version`` and ``ops_version``: a file a person wrote with the size keys
    alone (as CANN's documents say to) applies, and opcache's key holds the
    toolkit's identity, whatever versions the file names.
    """
    if len(raw) > _MAX_FILE_BYTES:
        return f"larger than {_MAX_FILE_BYTES} bytes", None
    limits, problem = _cann_limits(_cann_sections(raw), versions=False)
    return problem, limits


class CannIni(Record):
    """What CANN's graph engine takes from an op_cache.ini (see ``read_cann``)."""

    __slots__ = _fields = ("limits", "ignored")
    limits: SizeLimits | None  # the size keys CANN applies, or None
    ignored: str | None  # why size keys in the file do not apply, when it has some

    def __init__(self, limits: SizeLimits | None, ignored: str | None) -> None:
        self._init(locals())


def read_cann(path: Path, shared_group: int | None = None) -> CannIni:
    """The size limits CANN itself takes from the op_cache.ini at ``path``.

    Read line by line as hicann/ge ``te_cache_space_manager.cc`` reads it
    (``LoadIniFile``, ``GetCacheInitFileCfg``, ``UpdateOpCacheSizeCfg``; see
    ``_cann_sections`` and ``_cann_limits``).  A file that is not a regular
    file, one the trust rule refuses, or one over 1 MiB is ignored here, with
    a warning (CANN follows links and reads any size).
    """
    try:
        raw, untrusted = _read(path, shared_group)
    except (FileNotFoundError, NotADirectoryError):
        return CannIni(None, None)
    except OSError as e:
        why = "it is a link" if e.errno == errno.ELOOP else e.strerror or e
        log.warning("ignoring %s: cannot read it (%s)", path, why)
        return CannIni(None, f"{path} is ignored: cannot read it ({why})")
    if untrusted:
        return CannIni(None, f"{path} is ignored: it is {untrusted}")
    if len(raw) > _MAX_FILE_BYTES:
        return CannIni(None, f"{path} is ignored: larger than {_MAX_FILE_BYTES} bytes")
    limits, why = _cann_limits(_cann_sections(raw))
    return CannIni(limits, None if why is None else f"{path} is ignored, as CANN ignores it: {why}")


def _cann_sections(raw: bytes) -> dict[bytes, list[tuple[bytes, bytes]]]:
    """The sections of an op_cache.ini as ``TeCacheSpaceManager::LoadIniFile`` reads them.

    Lines split at "\\n"; empty lines and lines starting with "#" skipped; a
    line starting with "[" ends the section before it and names the next one
    (the text up to its last "]", spaces and tabs trimmed; none: the line is
    skipped); any other line with "=" is a key and value, each trimmed, kept
    when both are non-empty; a line without "=" is skipped.  A section is kept
    only if it has a name and keys (keys above the first section join it), and
    only the first of a name (``std::map::emplace``).  Bytes, as C++ reads them:
    a BOM is text, a Latin-1 byte is a byte.
    """
    sections: dict[bytes, list[tuple[bytes, bytes]]] = {}
    pairs: list[tuple[bytes, bytes]] = []
    name = b""
    for line in raw.split(b"\n"):
        if not line or line.startswith(b"#"):
            continue
        if line.startswith(b"["):
            if name and pairs:
                sections.setdefault(name, pairs)
                pairs = []
            end = line.rfind(b"]")
            if end >= 0:
                name = line[1:end].strip(b" \t")
            continue
        key, equals, value = line.partition(b"=")
        key, value = key.strip(b" \t"), value.strip(b" \t")
        if equals and key and value:
            pairs.append((key, value))
    if name and pairs:
        sections.setdefault(name, pairs)
    return sections


def _cann_limits(
    sections: dict[bytes, list[tuple[bytes, bytes]]], versions: bool = True
) -> tuple[SizeLimits | None, str | None]:
    """(limits CANN applies, or None; why size keys present do not apply, or None).

    ``GetCacheInitFileCfg``: sections in name order; the first that is not
    ``op_compiler_cache`` makes the file invalid; within the section the last
    of a repeated key wins; the file counts only once ``adk_version`` and
    ``ops_version`` are set (``versions``: else at once).
    ``UpdateOpCacheSizeCfg``: both size keys, each read by ``std::stoi``; max
    -1 or 1..INT_MAX, ratio 1..100.
    """
    keys = (MAX_KEY.encode(), RATIO_KEY.encode())
    has_sizes = any(key in keys for pairs in sections.values() for key, _ in pairs)
    found, why = _cann_config(sections, versions)
    if found is None:
        return None, why if has_sizes else None
    max_text, ratio_text = found.get(keys[0]), found.get(keys[1])
    if max_text is None and ratio_text is None:
        return None, None
    if max_text is None or ratio_text is None:
        return None, f"{RATIO_KEY if max_text else MAX_KEY} is missing"
    max_mb, ratio = stoi(max_text), stoi(ratio_text)
    if max_mb is None or max_mb == 0 or max_mb < -1:
        return None, f"{MAX_KEY}={max_text.decode('latin-1')!r} is not -1 or 1..2147483647"
    if ratio is None or not 1 <= ratio <= 100:
        return None, f"{RATIO_KEY}={ratio_text.decode('latin-1')!r} is not 1..100"
    return SizeLimits(max_mb, ratio), None


def _cann_config(
    sections: dict[bytes, list[tuple[bytes, bytes]]], versions: bool = True
) -> tuple[dict[bytes, bytes] | None, str | None]:
    """(the keys CANN takes, or None; why none): ``GetCacheInitFileCfg``'s walk (see
    ``_cann_limits``)."""
    found: dict[bytes, bytes] = {}
    for name in sorted(sections):
        if name != SECTION.encode():
            shown = name.decode("latin-1")
            return None, f"its section [{shown}] comes before a complete [{SECTION}] in name order"
        found.update(sorted(sections[name], key=lambda pair: pair[0]))
        if not versions or (found.get(b"adk_version") and found.get(b"ops_version")):
            return found, None
    return None, f"no [{SECTION}] section with adk_version and ops_version in it"


def read_cann_versions(
    path: Path, shared_group: int | None = None, dir_fd: int | None = None
) -> tuple[str, str] | None:
    """(adk_version, ops_version) as CANN takes them from the op_cache.ini at ``path``
    (``_cann_sections``, ``_cann_config``); None when there is no file.  ``dir_fd``:
    its folder, open (read through it, not through ``path``'s folders).

    ValueError saying why when CANN would not use the file (it then neither
    checks the versions nor repairs the file), when the trust rule refuses it
    or it is over 1 MiB; OSError when it cannot be read (a link, a FIFO...).
    """
    try:
        raw, untrusted = _read(path, shared_group, dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if untrusted:
        raise ValueError(f"{path} is {untrusted}")
    if len(raw) > _MAX_FILE_BYTES:
        raise ValueError(f"{path} is larger than {_MAX_FILE_BYTES} bytes")
    found, why = _cann_config(_cann_sections(raw))
    if found is None:
        raise ValueError(f"{path} is ignored by CANN: {why}")
    return found[b"adk_version"].decode("latin-1"), found[b"ops_version"].decode("latin-1")


_STOI = re.compile(rb"[ \t\n\v\f\r]*([+-]?)0*([0-9]+)")


def stoi(text: bytes) -> int | None:
    """C++ ``std::stoi``: leading whitespace, a sign and digits, the rest ignored;
    None where it throws (no digits, or outside int)."""
    match = _STOI.match(text.split(b"\0", 1)[0])  # (strtol reads a C string)
    if match is None or len(match[2]) > 10:
        return None
    value = int(match[2]) * (-1 if match[1] == b"-" else 1)
    return value if -(2**31) <= value < 2**31 else None


def ensure_ini_file(
    path: Path,
    modes: fsutil.Modes = fsutil.PRIVATE,
    versions: tuple[str, str] | None = None,
) -> bool:
    """Create op_cache.ini at ``path`` when it is missing; True if this call made it.

    The file gets the section header, the toolkit's ``versions`` (adk, ops) as
    CANN writes them, and the size keys commented out with their defaults.
    CANN takes an ini without both versions for one it must not touch: it
    would never again wipe a chip folder when its toolkit changes.  It appears
    whole or not at all (written aside, then linked into place), and a file
    that already exists, whoever wrote it, is never replaced.
    """
    if os.path.lexists(path):  # (a link too: never written through)
        return False
    lines = f"adk_version={versions[0]}\nops_version={versions[1]}\n" if versions else ""
    text = _TEMPLATE.replace("VERSIONS", lines)
    fsutil.makedirs(path.parent, modes)
    tmp = path.parent / fsutil.unique_name(f".{path.name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            os.fchmod(f.fileno(), modes.file_bits)  # (by name, a link put there is followed)
        try:
            # link() fails if the name exists: the no-overwrite rename POSIX lacks.
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:
            # Filesystems without hard links: O_EXCL still never overwrites, at
            # the price of a short window where the file exists but is empty.
            return _create_exclusive(path, text)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _create_exclusive(path: Path, text: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return True


# Where CANN's toolkit is (its home, or the operator package's folder).
TOOLKIT_VARIABLES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


def toolkit_versions(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(adk_version, ops_version) of the installed toolkit, as CANN finds them
    (``InitAdkAndOppVersion``): the ``Version=`` line of the compiler's
    ``version.info`` and of ``$ASCEND_OPP_PATH/version.info``; None unless both
    are found."""
    homes = [Path(environ[n]) for n in TOOLKIT_VARIABLES[:2] if environ.get(n)]
    adk = next((v for h in homes for p in ("compiler", ".") if (v := _version_line(h / p))), None)
    opp = environ.get("ASCEND_OPP_PATH")
    ops = _version_line(Path(opp)) if opp else None
    return (adk, ops) if adk and ops else None


def _version_line(folder: Path) -> str | None:
    try:
        fd, _ = fsutil.open_regular(folder / "version.info")
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        text = f.read(1 << 16).decode("latin-1")
    for line in text.splitlines():
        if line.startswith("Version="):
            return line[len("Version=") :].strip() or None
    return None


def folder_with_cann_files(root: Path) -> Path | None:
    """A chip folder of ``root`` that holds a file of CANN's, or may: None when none does.

    Asked before an op_cache.ini is made where there was none: CANN's first
    compile wipes such files, and an ini naming the installed toolkit would
    tell CANN they are that toolkit's.  CANN reads its kernels from the chip
    folder itself and makes no subfolders (opcache's entries are in its
    buckets, keyed by their toolkit): anything there but a folder or a lock is
    CANN's, or may be: a link to a kernel elsewhere too, which CANN follows.  A
    chip folder that is a link (CANN follows it) or that cannot be read may
    hold some, as may a ``root`` that cannot be listed.
    """
    try:
        with os.scandir(root) as listing:
            chips = sorted((e.name, e) for e in listing if not e.name.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return root
    for _, chip in chips:
        try:
            if chip.is_symlink():
                return Path(chip.path)
            if not chip.is_dir(follow_symlinks=False):
                continue
            with os.scandir(chip.path) as listing:
                if any(
                    not e.is_dir(follow_symlinks=False) and not e.name.endswith(".lock")
                    for e in listing
                ):
                    return Path(chip.path)
        except FileNotFoundError:
            continue
        except OSError:
            return Path(chip.path)
    return None
