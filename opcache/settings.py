"""Every configuration rule of opcache, decided in one place.

``resolve_settings`` turns the options a compile tool was given and the
environment into a ``Settings``: the cache mode, where the cache lives, the
size limit for aging and the debug options that bypass the cache, each with
the place its value came from.  It reads files (op_cache.ini, the debug .cfg)
but writes none.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from . import debug, ini
from ._log import get_logger
from ._record import Record
from .errors import ConfigError
from .errors import shown as _shown
from .request import check_soc_version

log = get_logger(__name__)

MODES = ("enable", "force", "disable")
DEFAULT_MODE = "disable"  # ATC's default
# The compiling commands exist to cache: their mode defaults to enable.
COMPILING_DEFAULT_MODE = "enable"
# The ATC spellings of the cache options every command takes: flag -> (metavar, help).
CACHE_FLAGS = {
    "--op_compiler_cache_mode": ("MODE", "enable, force or disable"),
    "--op_compiler_cache_dir": ("DIR", "cache folder"),
    "--op_debug_level": ("N", "0..4; not 0 bypasses the cache"),
    "--op_debug_config": ("CFG", "debug .cfg file"),
    "--soc_version": ("SOC", "one chip, e.g. Ascend910B1"),
}
MB = 1024 * 1024
AGE_SECONDS = 1800  # CANN ages only entries not used for half an hour

KERNEL_CACHE = "kernel_cache"
INI_NAME = "op_cache.ini"
ENV_CACHE_PATH = "ASCEND_CACHE_PATH"
ENV_MAX_SIZE = "ASCEND_MAX_OP_CACHE_SIZE"
ENV_RATIO = "ASCEND_REMAIN_CACHE_SIZE_RATIO"
ENV_COLLECT_PATH = "NPU_COLLECT_PATH"
ENV_SHARED_GROUP = "OPCACHE_SHARED_GROUP"
ENV_SESSION = "OPCACHE_SESSION"
ENV_REMOTE = "OPCACHE_REMOTE"
# The remote's options: name -> (variable, default).
REMOTE_OPTIONS = {
    "password": ("OPCACHE_REMOTE_PASSWORD", None),
    "read_only": ("OPCACHE_REMOTE_READ_ONLY", False),
    "prefix": ("OPCACHE_REMOTE_PREFIX", "opcache:1:"),
    "ttl": ("OPCACHE_REMOTE_TTL", None),
    "max_entry_mb": ("OPCACHE_REMOTE_MAX_ENTRY_MB", 64),
    "timeout": ("OPCACHE_REMOTE_TIMEOUT", 2.0),
}
# A remote's URL scheme -> the module of opcache.storage that opens it.
REMOTE_KINDS = {
    "redis": "redis",
    "rediss": "redis",
    "unix": "redis",
    "redis+cluster": "redis_cluster",
    "rediss+cluster": "redis_cluster",
    "file": "folder",
    "http": "http",
    "https": "http",
}
# The query option any remote's URL may hold: this tier alone is read-only.
TIER_READ_ONLY = "read_only"
_TRUE = ("1", "true", "yes", "on")
# For a build system that passes opcache no flags (the masquerade, `opcache wrap`):
ENV_DIR = "OPCACHE_DIR"  # as op_compiler_cache_dir
ENV_MODE = "OPCACHE_MODE"  # as op_compiler_cache_mode
ENV_DISABLE = "OPCACHE_DISABLE"  # true-ish: no cache at all, whatever the mode
ENV_BASE_DIR = "OPCACHE_BASE_DIR"  # paths under it are keyed relative to the working folder
ENV_VERBOSE = "OPCACHE_VERBOSE"  # true-ish: `opcache wrap -v`
# torch_npu's variables (LazyInitAclops.cpp, MakeCompileCacheDirAndSetOption):
# it hands them to ACL as the options op_compiler_cache_dir and _mode.
ENV_ACL_DIR = "ACL_OP_COMPILER_CACHE_DIR"
ENV_ACL_MODE = "ACL_OP_COMPILER_CACHE_MODE"
_FALSE = ("", "0", "false", "no", "off")

# CANN accepts letters, digits, '_', '-', '.' (and '/' between them) and CJK ideographs.
# Checked without a regex: compiling the CJK class took 2 ms of every start-up.
_DIR_ASCII = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-/")
_CJK = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2FA1F))
_VALID_DIR_TEXT = "ASCII letters, digits, '_', '-', '.', '/' and CJK ideographs"
_GID_END = 2**32 - 1  # gid_t's range; (gid_t)-1 means "no change" to chown
_WHOLE_MAX = 2**31 - 1  # the largest TTL or size cap a remote option takes
_HOST_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class Settings(Record):
    """The resolved configuration of the cache; build it with ``resolve_settings``.

    ``sources`` maps each setting's name to where its value came from:
    ``"argument"``, ``"op_cache.ini"``, ``"env:NAME"`` or ``"default"``.
    """

    __slots__ = _fields = (
        "mode",
        "root",
        "ini_path",
        "max_op_cache_size_mb",
        "remain_cache_size_ratio",
        "debug_level",
        "debug_config_path",
        "debug_config",
        "collect_path",
        "sources",
        "debug_dir",
        "shared_group",
        "session",
        "remote",
        "base_dir",
        "remote_error",
        "toolkit_env",
    )
    _compared = tuple(f for f in _fields if f != "sources")
    mode: str
    root: Path
    ini_path: Path
    max_op_cache_size_mb: int
    remain_cache_size_ratio: int
    debug_level: int
    debug_config_path: Path | None
    debug_config: debug.DebugConfig | None
    collect_path: str | None
    sources: dict[str, str]
    debug_dir: Path | None
    shared_group: int | None  # gid of a group-shared cache
    session: str | None  # the compile session a force clears each chip once for
    remote: RemoteSettings | None  # the remote tier behind the cache folder
    base_dir: Path | None  # wrapped C compiles key paths under it relative to their folder
    remote_error: str | None  # why the remote the environment names is not used
    # The toolkit's variables (ini.TOOLKIT_VARIABLES) the environment sets: op_cache.ini
    # is written with that toolkit's versions, not with those of this process's own.
    toolkit_env: tuple[tuple[str, str], ...]

    def __init__(
        self,
        *,
        mode: str,
        root: Path,
        ini_path: Path,
        max_op_cache_size_mb: int,
        remain_cache_size_ratio: int,
        debug_level: int,
        debug_config_path: Path | None,
        debug_config: debug.DebugConfig | None,
        collect_path: str | None,
        sources: dict[str, str],
        debug_dir: Path | None = None,
        shared_group: int | None = None,
        session: str | None = None,
        remote: RemoteSettings | None = None,
        base_dir: Path | None = None,
        remote_error: str | None = None,
        toolkit_env: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._init(locals())

    @property
    def debug_options(self) -> list[str]:
        """The options of the op_debug_config file (empty without one)."""
        return list(self.debug_config.options) if self.debug_config else []

    @property
    def debug_list(self) -> list[str] | None:
        """The op_debug_list entries, or None when the file has no such line."""
        if self.debug_config is None or self.debug_config.op_list is None:
            return None
        return list(self.debug_config.op_list)

    @property
    def aging_enabled(self) -> bool:
        """False when ``max_op_cache_size_mb`` is -1: no aging, no access stamps."""
        return self.max_op_cache_size_mb != -1

    @property
    def max_bytes(self) -> int | None:
        """The per-chip size limit in bytes, or None when aging is off."""
        return self.max_op_cache_size_mb * MB if self.aging_enabled else None

    def chip_dir(self, soc_version: str) -> Path:
        """The folder of one chip's entries: ``root / soc_version``."""
        return self.root / check_soc_version(soc_version)

    def bypass_reason(self, op_name: str, op_type: str) -> str | None:
        """None when the cache may be used for this operator, else why not."""
        return debug.bypass_reason(
            op_name,
            op_type,
            level=self.debug_level,
            config=self.debug_config,
            collect_path=self.collect_path,
        )

    def as_dict(self) -> dict[str, object]:
        """Every setting as plain JSON-ready values."""
        return {
            "mode": self.mode,
            "root": str(self.root),
            "ini_path": str(self.ini_path),
            "max_op_cache_size_mb": self.max_op_cache_size_mb,
            "remain_cache_size_ratio": self.remain_cache_size_ratio,
            "aging_enabled": self.aging_enabled,
            "debug_level": self.debug_level,
            "debug_config": None if self.debug_config_path is None else str(self.debug_config_path),
            "debug_options": list(self.debug_options),
            "debug_list": None if self.debug_list is None else list(self.debug_list),
            "npu_collect_path": self.collect_path,
            "debug_dir": None if self.debug_dir is None else str(self.debug_dir),
            "shared_group": self.shared_group,
            "session": self.session,
            "remote": None if self.remote is None else self.remote.as_dict(),
            "remote_error": self.remote_error,
            "base_dir": None if self.base_dir is None else str(self.base_dir),
            "sources": dict(self.sources),
        }


def resolve_settings(
    *,
    op_compiler_cache_mode: str | None = None,
    op_compiler_cache_dir: str | os.PathLike[str] | None = None,
    op_debug_level: int | str | None = None,
    op_debug_config: str | os.PathLike[str] | None = None,
    debug_dir: str | os.PathLike[str] | None = None,
    shared_group: str | int | None = None,
    session: str | None = None,
    remote: str | Mapping[str, object] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    hostname: str | None = None,
    default_mode: str = DEFAULT_MODE,
) -> Settings:
    """Resolve the cache settings from options, environment and op_cache.ini.

    Options left as None or "" are unset, as in CANN's tools.  ``environ``
    defaults to ``os.environ``; ``hostname`` (for the per-host folder under
    ``ASCEND_CACHE_PATH``) defaults to this machine's name; ``default_mode`` is
    the mode when none is given (ATC's ``disable`` unless a tool says otherwise).
    ``debug_dir`` (where debug builds put their files) is recorded, never keyed.
    ``shared_group`` (else ``OPCACHE_SHARED_GROUP``), a group name or gid, makes
    the cache group-shared: folders 2770, files 0660, the group's folders trusted.
    ``session`` (else ``OPCACHE_SESSION``) names the compile session that
    ``force`` clears each chip once for, across OpCaches and processes (see
    ``OpCache``).
    ``remote`` (else ``OPCACHE_REMOTE``) is the URL of a remote tier behind the
    cache folder (``redis://[user:password@]host:port/db``, ``rediss://`` for
    TLS, ``unix:///path?db=N``), or a mapping with ``url`` and the options of
    ``RemoteSettings``; each option unset there comes from its
    ``OPCACHE_REMOTE_*`` variable, then its default.
    ``base_dir`` (else ``OPCACHE_BASE_DIR``), an absolute folder: ``opcache wrap``
    keys the paths of a C compile under it relative to the compile's folder, so
    checkouts in different folders share entries (ccache's ``base_dir``).

    The environment may also set the mode (``OPCACHE_MODE``, below an argument,
    then torch_npu's ``ACL_OP_COMPILER_CACHE_MODE``; ``OPCACHE_DISABLE``
    true-ish wins over everything) and the cache folder (``OPCACHE_DIR``, as
    ``op_compiler_cache_dir``, then ``ACL_OP_COMPILER_CACHE_DIR``, both above
    ``ASCEND_CACHE_PATH``).

    Raises ConfigError for an invalid option or environment variable (its
    ``variable`` then names the variable).  A bad op_cache.ini or size
    variable only logs a warning and falls back; a bad ``OPCACHE_REMOTE*``
    variable logs a warning and leaves the remote out (``remote_error`` says
    why), the cache folder still in use.
    """
    env = os.environ if environ is None else environ
    _check_environ(env)
    sources: dict[str, str] = {}
    if default_mode not in MODES:
        raise ValueError(f"default_mode={default_mode!r} is not one of {', '.join(MODES)}")

    mode, sources["mode"] = _resolve_mode(op_compiler_cache_mode, default_mode, env)

    cache_dir = None
    if _is_set(op_compiler_cache_dir):
        cache_dir = _absolute_dir("op_compiler_cache_dir", op_compiler_cache_dir, env)
        root, sources["root"] = cache_dir / KERNEL_CACHE, "argument"
    elif env.get(ENV_DIR):
        cache_dir = _absolute_dir(ENV_DIR, env[ENV_DIR], env, variable=ENV_DIR)
        root, sources["root"] = cache_dir / KERNEL_CACHE, f"env:{ENV_DIR}"
    elif env.get(ENV_ACL_DIR):
        # torch_npu passes it to CANN as op_compiler_cache_dir: above ASCEND_CACHE_PATH.
        cache_dir = _absolute_dir(ENV_ACL_DIR, env[ENV_ACL_DIR], env, variable=ENV_ACL_DIR)
        root, sources["root"] = cache_dir / KERNEL_CACHE, f"env:{ENV_ACL_DIR}"
    elif env.get(ENV_CACHE_PATH, "").strip():
        # Trimmed, as CANN reads it (a line of a profile with a space at its end).
        base = _absolute_dir(
            ENV_CACHE_PATH, env[ENV_CACHE_PATH].strip(), env, variable=ENV_CACHE_PATH
        )
        host = _HOST_UNSAFE.sub("_", hostname if hostname is not None else os.uname().nodename)
        root, sources["root"] = base / f"{KERNEL_CACHE}_{host}", f"env:{ENV_CACHE_PATH}"
    else:
        root, sources["root"] = _home(env) / "atc_data" / KERNEL_CACHE, "default"

    group = _resolve_group(shared_group, env, sources)  # the ini's trust rule needs it
    ini_path, max_mb, ratio = _resolve_size_limits(root, cache_dir, env, sources, group)

    level = _resolve_debug_level(op_debug_level)
    sources["debug_level"] = "argument" if _is_set(op_debug_level) else "default"
    config_path, config = None, None
    if _is_set(op_debug_config):
        config_path = _expand(str(op_debug_config), env)
        config = debug.read_debug_config(config_path)
    sources["debug_config"] = "argument" if config_path else "default"
    collect_path = env.get(ENV_COLLECT_PATH) or None
    sources["npu_collect_path"] = f"env:{ENV_COLLECT_PATH}" if collect_path else "default"
    sources["debug_dir"] = "argument" if _is_set(debug_dir) else "default"
    remote_settings, remote_error = _resolve_remote(remote, env, sources)

    return Settings(
        mode=mode,
        root=root,
        ini_path=ini_path,
        max_op_cache_size_mb=max_mb,
        remain_cache_size_ratio=ratio,
        debug_level=level,
        debug_config_path=config_path,
        debug_config=config,
        collect_path=collect_path,
        sources=sources,
        debug_dir=_expand(os.fspath(debug_dir), env) if _is_set(debug_dir) else None,
        shared_group=group,
        session=_resolve_session(session, env, sources),
        remote=remote_settings,
        base_dir=_resolve_base_dir(base_dir, env, sources),
        remote_error=remote_error,
        toolkit_env=tuple((name, env[name]) for name in ini.TOOLKIT_VARIABLES if env.get(name)),
    )


class RemoteSettings(Record):
    """The remote tier: where it is, and how the cache uses it.

    ``read_only``: fetch, never write (a developer reading what CI wrote).
    ``prefix``: every key of this cache starts with it.  ``ttl``: seconds an
    entry lives in the remote (None: until the server evicts it).
    ``max_entry_mb``: bigger entries stay local.  ``timeout``: seconds an
    operation may take (connecting: a quarter of it, at most half a second).
    """

    __slots__ = _fields = (
        "url",
        "password",
        "read_only",
        "prefix",
        "ttl",
        "max_entry_mb",
        "timeout",
    )
    url: str
    password: str | None
    read_only: bool
    prefix: str
    ttl: int | None
    max_entry_mb: int
    timeout: float

    def __init__(
        self,
        url: str,
        password: str | None,
        read_only: bool,
        prefix: str,
        ttl: int | None,
        max_entry_mb: int,
        timeout: float,
    ) -> None:
        self._init(locals())

    def __repr__(self) -> str:  # never the password, wherever a settings object is shown
        return f"RemoteSettings(url={self.shown_url!r}, read_only={self.read_only})"

    @property
    def shown_url(self) -> str:
        """The URL (each tier's, separated by spaces) with its password masked."""
        return " ".join(map(_masked_url, self.url.split(" ")))

    def tiers(self) -> list[RemoteSettings]:
        """Each tier's settings, nearest first: its URL without ``?read_only=...``,
        read-only when that says so or ``read_only`` is set.  ``password`` is the
        first tier's (the others' are in their URLs)."""
        from urllib.parse import parse_qsl, urlencode

        tiers = []
        for at, url in enumerate(self.url.split(" ")):
            base, mark, query = url.partition("?")
            pairs = parse_qsl(query, keep_blank_values=True)
            read_only = self.read_only or any(
                name == TIER_READ_ONLY and value.lower() in _TRUE for name, value in pairs
            )
            rest = urlencode([(n, v) for n, v in pairs if n != TIER_READ_ONLY])
            tiers.append(
                RemoteSettings(
                    f"{base}{mark if rest else ''}{rest}",
                    self.password if at == 0 else None,
                    read_only,
                    self.prefix,
                    self.ttl,
                    self.max_entry_mb,
                    self.timeout,
                )
            )
        return tiers

    def as_dict(self) -> dict[str, object]:
        shown = {name: getattr(self, name) for name in self._fields}
        shown["url"] = self.shown_url
        shown["password"] = None if self.password is None else "***"
        return shown


# Query options whose values are shown: none holds a secret (a file's path is
# not its content).  ssl_password is a key's passphrase; anything unknown may
# be a secret too.
_SHOWN_OPTIONS = (
    "db",
    TIER_READ_ONLY,
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
    "ssl_ciphers",
)


def _masked_url(url: str) -> str:
    """The URL with its password and every query value but ``_SHOWN_OPTIONS``' masked."""
    from urllib.parse import unquote

    scheme, sep, rest = url.partition("://")
    if _at_past_the_host(scheme, rest):
        return f"{scheme}{sep}***"  # (where the password ends is not known: none of it)
    url, mark, query = url.partition("?")
    authority, slash, path = rest.partition("?")[0].partition("/")
    credentials, at, host = authority.rpartition("@")  # (an @ in the path is a name)
    if at:
        user, colon, _ = credentials.partition(":")
        url = f"{scheme}{sep}{user}{':***' if colon else ''}@{host}{slash}{path}"
    options = []
    for option in query.split("&") if query else ():
        name, equals, _ = option.partition("=")
        if equals and unquote(name) in _SHOWN_OPTIONS:
            options.append(option)
        else:
            options.append(f"{name if equals else ''}=***")
    return url + mark + "&".join(options)


def _resolve_remote(
    value: str | Mapping[str, object] | None, env: Mapping[str, str], sources: dict
) -> tuple[RemoteSettings | None, str | None]:
    """(the remote, None), or (None, why not) for a bad remote setting in the environment.

    A bad remote variable costs only the remote: a warning, and the cache
    folder goes on alone.  A bad argument is the caller's error (ConfigError).
    """
    try:
        return _remote_settings(value, env, sources), None
    except ConfigError as e:
        if e.variable is None:
            raise
        log.warning("%s; not using the remote (the local cache still works)", e)
        return None, str(e)


def _remote_settings(
    value: str | Mapping[str, object] | None, env: Mapping[str, str], sources: dict
) -> RemoteSettings | None:
    given = dict(value) if isinstance(value, Mapping) else {"url": value}
    variable = None
    if _is_set(given.get("url")):
        sources["remote"] = "argument"
        url = str(given["url"])
    elif env.get(ENV_REMOTE):
        sources["remote"] = f"env:{ENV_REMOTE}"
        url, variable = env[ENV_REMOTE], ENV_REMOTE
    else:
        sources["remote"] = "default"
        return None
    # Tiers, nearest first, separated by spaces (or tabs, new lines).
    tiers = url.split()
    for tier in tiers or [url]:
        problem = _url_problem(tier)
        if problem:
            shown = _masked_url(tier)
            if "?" in shown:  # a query may hold secrets (?password=...): never shown
                shown = shown.partition("?")[0] + "?..."
            raise ConfigError(
                f"{variable or 'remote'}={_shown(shown)} is not valid: {problem}",
                variable=variable,
            )
    url = " ".join(tiers)
    options: dict[str, object] = {}
    for name, (option_variable, default) in REMOTE_OPTIONS.items():
        if _is_set(given.get(name)):
            options[name] = _remote_option(name, given[name], f"remote {name}", None)
            sources[f"remote_{name}"] = "argument"
        elif env.get(option_variable):
            text = env[option_variable]
            options[name] = _remote_option(name, text, option_variable, option_variable)
            sources[f"remote_{name}"] = f"env:{option_variable}"
        else:
            options[name] = default
            sources[f"remote_{name}"] = "default"
    return RemoteSettings(url=url, **options)  # type: ignore[arg-type]


# Query options a remote URL may hold: what redis-py takes from a URL and
# opcache does not set itself (its timeouts and retries stay opcache's).
_URL_OPTIONS = ("db",)
# The values redis-py takes for two TLS options; any other fails only at connect, or
# (ssl_check_hostname) is read as true.
_CERT_REQS = ("none", "optional", "required")
_TLS_BOOLEANS = ("1", "0", "true", "false", "t", "f", "yes", "no", "y", "n")
_TLS_OPTIONS = (
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_ca_data",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_cert_reqs",
    "ssl_check_hostname",
    "ssl_ciphers",
)


# Characters no credential holds: a header or a command line would end at them.
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f]")


def _at_past_the_host(scheme: str, rest: str) -> bool:
    """Whether the URL after ``scheme://`` (``rest``) holds a password cut short by a
    ``/`` or ``?`` in it, as it is: the host part has no ``@``, and one comes in the
    first query word before any ``=`` (``redis://u:pa?ss@host``), or in the path of
    a Redis URL (a db number: ``redis://u:ab/cd@host``) or of an http one whose host
    part has a ``:`` (a password's, or a port: the two cannot be told apart).  Read as
    it is, the password's pieces would be the host, port or path, and quoted so in a
    message.  An ``@`` elsewhere
    (``?ssl_ca_certs=/home/john@corp/ca.pem``, ``https://h/opcache@team/``) is a name.
    """
    if scheme in ("file", "unix"):
        return False
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, after = rest[:end], rest[end:]
    if "@" in authority or "@" not in after:
        return False
    path, _, query = after.partition("?")
    if "@" in query.split("&", 1)[0].split("=", 1)[0] and not path:
        return True
    if "@" in path:  # (https://u:2024/pw@h/ and https://h:8443/a@b/ look alike: refused)
        return scheme not in ("http", "https") or ":" in authority
    return False


def _url_problem(url: str) -> str | None:
    """What is wrong with a remote's URL (one tier's), or None.

    Everything the client would choke on, or silently read otherwise, is
    refused here: a port that is not 1..65535, a db that is not a number (a
    client would quietly use db 0), a host name no resolver takes (a label
    over 63 characters), a query option redis-py would pass on blindly.
    """
    return _form_problem(url) or _split_problem(url)


def _form_problem(url: str) -> str | None:
    """``_url_problem``'s checks of each part, as opcache reads them."""
    scheme, sep, rest = url.partition("://")
    valid = " or ".join(s + "://..." for s in sorted(REMOTE_KINDS))
    if not sep or scheme not in REMOTE_KINDS:
        return f"use a URL {valid} (tiers separated by spaces)"
    if not all(33 <= ord(c) <= 126 for c in url):
        return "a URL holds no spaces, control or non-ASCII characters (percent-encode them)"
    if "#" in rest:
        return "a URL has no '#' (write %23 in a password)"
    if _at_past_the_host(scheme, rest):
        return (
            "an '@' after the host's end: percent-encode '/', '?' and '@' in a user name "
            "or password, and '@' in a path (%2F, %3F, %40)"
        )
    from urllib.parse import unquote

    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    credentials, _, hostport = netloc.rpartition("@")
    if _CONTROL.search(unquote(credentials)):
        return "a user name or password holds no control characters (%00-%1F, %7F)"
    if "[" in credentials or "]" in credentials:  # (urlsplit reads them as an IPv6 host's)
        return "percent-encode '[' and ']' in a user name or password (%5B, %5D)"
    if scheme == "unix":
        if hostport or not path:
            return "use unix:///path/to/redis.sock[?db=N]"
        return _query_problem(query, _URL_OPTIONS)
    if scheme == "file":
        if netloc or not path:
            return "use file:///path/to/the/shared/folder (an absolute path, no host)"
        if any(ord(c) < 32 or c == "\x7f" for c in unquote(path)):
            # (a NUL no path can hold: os calls raise ValueError on it)
            return "a folder's path holds no control characters (%00-%1F, %7F)"
        return _query_problem(query, ())
    if scheme.endswith("+cluster"):
        if slash and path:
            return f"a cluster has one database: no /{_shown(path)[1:-1]} after its nodes"
        for node in hostport.split(","):
            problem = _host_port_problem(node)
            if problem:
                return problem
        return _query_problem(query, _TLS_OPTIONS if scheme == "rediss+cluster" else ())
    problem = _host_port_problem(hostport)
    if problem:
        return problem
    if scheme in ("http", "https"):
        return _query_problem(query, ())  # the path is the server's: any
    if slash and path and _number_problem(path):
        return f"the database {path!r} is not a number (redis://host:port/0)"
    return _query_problem(query, (*_URL_OPTIONS, *(_TLS_OPTIONS if scheme == "rediss" else ())))


def _split_problem(url: str) -> str | None:
    """What urlsplit, which every kind reads its URL with, refuses in ``url``: a
    backstop for what the checks before let through (its ValueError was a traceback)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        if not parts.scheme.endswith("+cluster"):  # (a cluster's nodes are no one port)
            parts.port  # noqa: B018 (it raises for a port urlsplit cannot read)
    except ValueError as e:
        return f"{e} (an IPv6 host is written [::1]:6379)"
    return None


def _host_port_problem(hostport: str) -> str | None:
    host, port = hostport, ""
    if hostport.startswith("["):  # an IPv6 address: [::1]:6379
        if "]" not in hostport:
            return f"the IPv6 host {_shown(hostport)} needs its ']' ([::1]:6379)"
        host, _, port = hostport[1:].partition("]")
        if port and not port.startswith(":"):
            return f"{hostport!r} is not host:port"
        port = port[1:]
        problem = _ip6_problem(host)
    else:
        host, _, port = hostport.partition(":")
        problem = _host_problem(host)
    if problem:
        return problem
    if port and not (port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
        return f"the port {port!r} is not a number from 1 to 65535"
    return None


def _host_problem(host: str) -> str | None:
    if not host:
        return "name the server's host (redis://host:6379/0)"
    labels = host.split(".")
    if len(host) > 253 or not all(
        0 < len(label) <= 63 and all(c.isalnum() or c in "-_" for c in label) for label in labels
    ):
        return (
            f"the host {_shown(host)} is not a host name (labels of 1 to 63 letters, "
            "digits, '-' and '_', 253 characters in all) or an IP address"
        )
    return None


def _ip6_problem(host: str) -> str | None:
    import ipaddress

    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return f"the host [{_shown(host)[1:-1]}] is not an IPv6 address"
    return None


def _number_problem(text: str) -> bool:
    number = _whole(text)
    return number is None or number > _WHOLE_MAX


def _whole(text: str) -> int | None:
    """The number ASCII digits spell, None for anything else or more than 10 digits.

    (int() takes at most 4,300 digits; a setting never needs 11.)
    """
    if text.isascii() and text.isdigit() and len(text.lstrip("0")) <= 10:
        return int(text)
    return None


def _query_problem(query: str, also: tuple[str, ...]) -> str | None:
    if not query:
        return None
    from urllib.parse import parse_qsl

    taken = (TIER_READ_ONLY, *also)
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in taken:
            return f"its query may hold {', '.join(taken)}, not {_shown(name)}"
        if name == "db" and _number_problem(value):
            return f"db={_shown(value)} is not a number"
        if name == TIER_READ_ONLY and value.lower() not in (*_TRUE, *_FALSE):
            return f"{TIER_READ_ONLY}={_shown(value)} is not true or false"
        if name == "ssl_cert_reqs" and value not in _CERT_REQS:
            return f"ssl_cert_reqs={_shown(value)} is not one of {', '.join(_CERT_REQS)}"
        # redis-py reads any word but these as true: "off" checked the host name.
        if name == "ssl_check_hostname" and value.lower() not in _TLS_BOOLEANS:
            return f"ssl_check_hostname={_shown(value)} is not true or false (1/0, yes/no, t/f)"
    return None


def _remote_option(name: str, value: object, option: str, variable: str | None) -> object:
    """A remote option's value from text (or a value of its own type); ConfigError if bad."""
    text = str(value).strip()
    if name == "read_only":
        if isinstance(value, bool) or text.lower() in _TRUE + _FALSE:
            return value if isinstance(value, bool) else text.lower() in _TRUE
        valid = "true or false (1/0, yes/no, on/off)"
    elif name in ("ttl", "max_entry_mb"):
        lowest, number = (0 if name == "ttl" else 1), _whole(text)
        if number is not None and lowest <= number <= _WHOLE_MAX:
            return number or None  # a TTL of 0: none
        what = "seconds (0: none)" if name == "ttl" else "MB"
        valid = f"a whole number of {what} from {lowest} to {_WHOLE_MAX}"
    elif name == "timeout":
        try:
            seconds = float(text)
        except ValueError:
            seconds = 0.0
        if 0 < seconds <= 600:
            return seconds
        valid = "a number of seconds, more than 0 and at most 600"
    elif name == "password" and _CONTROL.search(str(value)):
        # http.client would refuse it in a header and quote the header, secret and all.
        valid = "a password with no control characters (not even a secret file's last new line)"
    elif name == "prefix" and not text:
        # (taken as it was, spaces only: no prefix at all, every key of the database)
        valid = "a prefix that is not blank (unset: opcache:1:)"
    elif _encodable(str(value)):  # password, prefix: any text the server can be sent
        return text if name == "prefix" else str(value)
    else:
        valid = "text in UTF-8"
    shown = "***" if name == "password" else _shown(value)
    raise ConfigError(f"{option}={shown} is not valid; use {valid}", variable=variable)


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # bytes of another encoding, as os.environ holds them
        return False
    return True


def cache_settings(
    flags: Mapping[str, str | None],
    default_mode: str = DEFAULT_MODE,
    debug_level: str | None = None,
    debug_config: str | None = None,
) -> Settings:
    """The settings the command line's cache flags (by name without ``--``) resolve to."""
    if flags.get("soc_version"):  # empty is unset, as for every option
        check_soc_version(flags["soc_version"])  # type: ignore[arg-type]
    return resolve_settings(
        op_compiler_cache_mode=flags.get("op_compiler_cache_mode"),
        op_compiler_cache_dir=flags.get("op_compiler_cache_dir"),
        op_debug_level=debug_level if debug_level is not None else flags.get("op_debug_level"),
        op_debug_config=debug_config if debug_config is not None else flags.get("op_debug_config"),
        remote=flags.get("remote"),
        default_mode=default_mode,
    )


def env_true(environ: Mapping[str, str], name: str) -> bool:
    """Whether a switch variable is on: set to anything but empty, 0, false, no or off."""
    return environ.get(name, "").strip().lower() not in _FALSE


def _resolve_base_dir(
    value: str | os.PathLike[str] | None, env: Mapping[str, str], sources: dict
) -> Path | None:
    if _is_set(value):
        sources["base_dir"], option, variable = "argument", "base_dir", None
    elif env.get(ENV_BASE_DIR):
        value = env[ENV_BASE_DIR]
        sources["base_dir"], option, variable = f"env:{ENV_BASE_DIR}", ENV_BASE_DIR, ENV_BASE_DIR
    else:
        sources["base_dir"] = "default"
        return None
    text = os.fspath(value)  # type: ignore[arg-type]
    if not (text.startswith("/") or text.startswith("~")):
        # Relative to what? Each compile runs in its own folder.
        raise ConfigError(
            f"{option}={_shown(text)} is not valid; use an absolute path", variable=variable
        )
    return _expand(text, env)


def _resolve_session(value: str | None, env: Mapping[str, str], sources: dict) -> str | None:
    if _is_set(value):
        sources["session"] = "argument"
        return str(value)
    if env.get(ENV_SESSION):
        sources["session"] = f"env:{ENV_SESSION}"
        if not _encodable(env[ENV_SESSION]):  # it is written in a note, as UTF-8
            raise ConfigError(
                f"{ENV_SESSION}={_shown(env[ENV_SESSION])} is not valid; use text in UTF-8",
                variable=ENV_SESSION,
            )
        return env[ENV_SESSION]
    sources["session"] = "default"
    return None


def _resolve_group(value: str | int | None, env: Mapping[str, str], sources: dict) -> int | None:
    if _is_set(value):
        sources["shared_group"] = "argument"
        option = "shared_group"
    elif env.get(ENV_SHARED_GROUP):
        value = env[ENV_SHARED_GROUP]
        sources["shared_group"] = f"env:{ENV_SHARED_GROUP}"
        option = ENV_SHARED_GROUP
    else:
        sources["shared_group"] = "default"
        return None
    gid: int | None
    if isinstance(value, int) and not isinstance(value, bool):
        gid = value
    else:
        text = str(value).strip()
        gid = _whole(text) if text.isascii() and text.isdigit() else _group_id(text)
    if gid is None or not 0 <= gid < _GID_END:  # chown cannot take it: the cache could not
        raise ConfigError(
            f"{option}={_shown(value)} is not valid; use the name or number "
            f"(0 to {_GID_END - 1}) of an existing group",
            variable=None if option == "shared_group" else option,
        )
    return gid


def _group_id(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except (KeyError, ValueError):  # ValueError: a NUL, or text no file name can hold
        return None


# Variables whose text resolve_settings passes on, as paths or names: a NUL
# (possible only through ``environ=``) would fail a system call far from here.
_TEXT_VARIABLES = (
    "HOME",
    ENV_CACHE_PATH,
    ENV_COLLECT_PATH,
    ENV_SHARED_GROUP,
    ENV_SESSION,
    ENV_DIR,
    ENV_MODE,
    ENV_DISABLE,
    ENV_BASE_DIR,
    ENV_ACL_DIR,
    ENV_ACL_MODE,
)


def _check_environ(env: Mapping[str, str]) -> None:
    for name in _TEXT_VARIABLES:
        value = env.get(name)
        if isinstance(value, str) and "\0" in value:
            raise ConfigError(
                f"{name}={_shown(value)} is not valid: it holds a NUL character", variable=name
            )


def _is_set(value: object) -> bool:
    return value is not None and value != ""


def _resolve_mode(value: str | None, default: str, env: Mapping[str, str]) -> tuple[str, str]:
    if env_true(env, ENV_DISABLE):
        return "disable", f"env:{ENV_DISABLE}"  # the switch that turns every opcache off
    option, variable, source = "op_compiler_cache_mode", None, "argument"
    if not _is_set(value):
        value = env.get(ENV_MODE)
        if not value:
            return _acl_mode(default, env)
        option = variable = ENV_MODE
        source = f"env:{ENV_MODE}"
    mode = value.lower() if isinstance(value, str) else value
    if mode not in MODES:
        raise ConfigError(
            f"{option}={_shown(value)} is not valid; use one of {', '.join(MODES)}",
            variable=variable,
        )
    return mode, source


def _acl_mode(default: str, env: Mapping[str, str]) -> tuple[str, str]:
    """The mode torch_npu gives CANN from ``ACL_OP_COMPILER_CACHE_MODE``, when it is set.

    torch_npu takes the three modes as spelled, and any other value as
    ``enable`` (its MakeCompileCacheDirAndSetOption): so does opcache, with a warning.
    """
    value = env.get(ENV_ACL_MODE)
    if not value:  # (empty is unset, as for every variable of opcache's)
        return default, "default"
    if value not in MODES:
        log.warning(
            "%s=%s is not one of %s: taken as enable, as torch_npu takes it",
            ENV_ACL_MODE,
            _shown(value),
            ", ".join(MODES),
        )
        return "enable", f"env:{ENV_ACL_MODE}"
    return value, f"env:{ENV_ACL_MODE}"


def _resolve_debug_level(value: int | str | None) -> int:
    if not _is_set(value):
        return 0
    if isinstance(value, bool):
        level = None
    elif isinstance(value, int):
        level = value
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        level = int(value.strip())
    else:
        level = None
    if level is None or not 0 <= level <= 4:
        raise ConfigError(f"op_debug_level={value!r} is not valid; use an integer from 0 to 4")
    return level


def _home(env: Mapping[str, str]) -> Path:
    # Without HOME in the given environment: the account's home from the user
    # database, not os.environ (the environment given is the only one read).
    home = env.get("HOME")
    if not home:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    if not home.startswith("/"):  # a cache in whichever folder each compile runs in
        raise ConfigError(
            f"HOME={_shown(home)} is not valid for the cache folder; use an absolute path "
            f"(or set {ENV_DIR})",
            variable="HOME",
        )
    return Path(home)


def _expand(text: str, env: Mapping[str, str]) -> Path:
    """``~`` from the given environment's HOME; relative paths against the cwd."""
    if text == "~" or text.startswith("~/"):
        text = str(_home(env)) + text[1:]
    elif text.startswith("~"):
        text = os.path.expanduser(text)
    return Path(os.path.abspath(text))


def _valid_dir(text: str) -> bool:
    return bool(text) and all(
        c in _DIR_ASCII or any(low <= ord(c) <= high for low, high in _CJK) for c in text
    )


def _absolute_dir(
    option: str,
    value: str | os.PathLike[str],
    env: Mapping[str, str],
    variable: str | None = None,
) -> Path:
    text = os.fspath(value)
    # The text given is checked, as CANN checks it: not the folder a relative one is
    # in, nor the home a leading ~ stands for (CANN takes $HOME as it is too).
    given = text[2:] if text.startswith("~/") else "" if text == "~" else text
    if not text or (given and not _valid_dir(given)):
        raise ConfigError(
            f"{option}={_shown(text)} is not valid: a path may contain only {_VALID_DIR_TEXT}",
            variable=variable,
        )
    return _expand(text, env)


def _resolve_size_limits(
    root: Path,
    cache_dir: Path | None,
    env: Mapping[str, str],
    sources: dict[str, str],
    shared_group: int | None,
) -> tuple[Path, int, int]:
    """(ini_path, max MB, ratio): op_cache.ini if it supplies both, else env, else defaults."""
    candidates = [root / INI_NAME]
    if cache_dir is not None:
        candidates.append(cache_dir / INI_NAME)
    ini_path, max_mb, ratio = size_limits(candidates, env, sources, shared_group)
    return ini_path or candidates[0], max_mb, ratio


def size_limits(
    ini_paths: Sequence[Path],
    environ: Mapping[str, str],
    sources: dict[str, str],
    shared_group: int | None = None,
) -> tuple[Path | None, int, int]:
    """(ini in force, size limit in MB, share kept in %) by CANN's priority.

    The first op_cache.ini of ``ini_paths`` that supplies both size keys, else
    ``ASCEND_MAX_OP_CACHE_SIZE`` and ``ASCEND_REMAIN_CACHE_SIZE_RATIO`` each on
    its own, else 500 MB and 50 %.  The ini is None when none supplied them;
    ``sources`` gets where each value came from; ``shared_group`` is the
    cache's group, for the trust rule an ini must pass.
    """
    for path in ini_paths:
        limits = ini.read_size_limits(path, shared_group)
        if limits is not None:
            sources["max_op_cache_size_mb"] = sources["remain_cache_size_ratio"] = INI_NAME
            sources["ini_path"] = INI_NAME  # the file in force supplied the size keys
            return path, limits.max_op_cache_size_mb, limits.remain_cache_size_ratio
    max_mb, sources["max_op_cache_size_mb"] = _env_limit(
        environ, ENV_MAX_SIZE, ini.parse_max_size, ini.DEFAULT_MAX_SIZE_MB, "-1 or 1..2147483646"
    )
    ratio, sources["remain_cache_size_ratio"] = _env_limit(
        environ, ENV_RATIO, ini.parse_ratio, ini.DEFAULT_RATIO, "1..100"
    )
    sources["ini_path"] = "default"  # none supplies both keys: where CANN keeps it
    return None, max_mb, ratio


def _env_limit(
    env: Mapping[str, str],
    name: str,
    parse: Callable[[str], int | None],
    default: int,
    valid: str,
) -> tuple[int, str]:
    text = env.get(name)
    if text is None or text == "":
        return default, "default"
    value = parse(text)
    if value is None:
        log.warning("ignoring %s=%s: not %s; using %s", name, _shown(text), valid, default)
        return default, "default"
    return value, f"env:{name}"
