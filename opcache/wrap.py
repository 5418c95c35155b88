"""``opcache wrap -- <compile command>``: ccache-style caching of a command line.

Three kinds of command are understood:

- CANN's ``opc <op.py> --main_func=... --input_param=<json> --soc_version=...
  --output=<dir> [...]``: the key holds the operator source, the parameter
  JSON's contents, the chip and every other flag (a flag naming a file by that
  file's contents); output locations (``--output``, ``--debug_dir``) are left
  out; ``--op_debug_level`` / ``--op_debug_config`` bypass the cache by the
  settings' rules.
- C compilers, ``cc -c src.c -o out.o`` with ``-I -D -U -O -std -f -m -W -g -x``
  flags: the key holds the source and every header the compiler lists with
  ``-M``, by content; include folders are not in it.
- CANN's ``op_compiler -p <op-info dir> -v <soc> -j <n> -o <out> [-l level]
  [--enable_super_kernel] [--super_kernel_options S] [-f true]`` (torchair's
  static kernels): the key holds every file of the ``-p`` folder (names and
  contents), the chip, the flags that change the output and the toolkit's
  identity; ``-j``, ``-o`` and ``-l`` are left out.  The output is the
  ``static_kernel_*.run`` package, restored under the name it was built with
  (torchair finds its uninstall script by that name) and executable.

The command runs with its outputs sent to a private folder; they are stored,
then moved to where the command would have written them, and the command's
stdout and stderr are replayed.  The exit status is always the command's (a
command killed by signal N gives 128+N, as a shell reports it).  Anything else
runs as it is and counts as ``uncacheable`` in stats.

The compiler run is the real one past opcache's own links and other compiler
caches (``masquerade.py``).  A cache that cannot be used never fails a compile,
nor does a bad setting from the environment: the compile runs without the
cache, and configuration warnings show at most once an hour per cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from . import _log, fsutil
from ._log import get_logger
from .cache import BUILD_GAP_SECONDS, BUILD_SESSION, OpCache
from .compilers._tool import file_identity, read_input, which
from .errors import CompileError, ConfigError
from .key import canonical_json, digest
from .masquerade import compiler_environ, compiler_kind, find_compiler, reentered
from .request import OpRequest
from .settings import Settings
from .storage.local import LocalStore

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from typing import TextIO

log = get_logger(__name__)

STDOUT = ".opcache-stdout"
STDERR = ".opcache-stderr"
HOST_CHIP = "host"  # the chip folder of C compiles and uncacheable commands
C_SOURCES = (".c", ".cc", ".cpp", ".cxx", ".C", ".s", ".S")
WARN_SECONDS = 3600  # a configuration warning shows at most once an hour per cache
# opc flags that say where outputs go: not part of the key.
_OPC_OUTPUT_FLAGS = ("output", "debug_dir")
_OPC_DEBUG_FLAGS = ("op_debug_level", "op_debug_config")


class _ToolFailed(CompileError):
    """The wrapped command exited non-zero: replay its output and status."""

    def __init__(self, returncode: int, stdout: bytes, stderr: bytes) -> None:
        super().__init__(f"exit status {returncode}")
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


class Plan:
    """How to cache one command line.

    ``command(workdir)`` is the argv with its output locations inside
    ``workdir``; ``outputs`` maps an artifact name to where the command would
    have written it, or ``output_dir`` takes every file the command wrote.
    Restored files whose names end with one of ``executables`` are made
    executable (the cache keeps contents, not modes).
    """

    def __init__(
        self,
        request: OpRequest,
        fingerprint: str,
        command: Callable[[Path], list[str]],
        outputs: dict[str, Path] | None = None,
        output_dir: Path | None = None,
        debug_level: str | None = None,
        debug_config: str | None = None,
        executables: tuple[str, ...] = (),
    ) -> None:
        self.request = request
        self.fingerprint = fingerprint
        self.command = command
        self.outputs = {} if outputs is None else outputs
        self.output_dir = output_dir
        self.debug_level = debug_level
        self.debug_config = debug_config
        self.executables = executables


class Uncacheable(Exception):
    """The command cannot be cached; the message is the reason stats count."""


class _WrappedCommand:
    """The compiler protocol over one planned command line."""

    def __init__(self, plan: Plan, kind: str, environ: Mapping[str, str]) -> None:
        self.name = f"wrap-{kind}"
        self._plan = plan
        self._environ = environ

    def fingerprint(self) -> str:
        return self._plan.fingerprint

    def compile(self, request: OpRequest, workdir: Path) -> None:
        import subprocess  # a hit runs nothing: keep it off start-up

        argv = self._plan.command(workdir)
        try:
            done = subprocess.run(argv, capture_output=True, env=dict(self._environ), check=False)
        except OSError as e:
            raise _ToolFailed(127, b"", f"opcache: cannot run {argv[0]}: {e}\n".encode()) from None
        if done.returncode != 0:
            raise _ToolFailed(exit_status(done.returncode), done.stdout, done.stderr)
        (workdir / STDOUT).write_bytes(done.stdout)
        (workdir / STDERR).write_bytes(done.stderr)


def run(
    argv: Sequence[str],
    settings_for: Callable[[str | None, str | None], Settings],
    *,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run ``argv`` through the cache; returns the command's exit status.

    ``settings_for(op_debug_level, op_debug_config)`` resolves the settings,
    given the debug options found on the command line.  With ``-v`` (the
    ``opcache`` logger at INFO) one line says what happened and the key.
    """
    env = dict(os.environ if environ is None else environ)
    kind = compiler_kind(argv[0])
    run_env = env
    if kind is not None:
        real = find_compiler(argv[0], env)
        if real is None:
            name = os.path.basename(argv[0])
            print(
                f"opcache: error: no {name} on PATH other than opcache or a compiler cache",
                file=sys.stderr,
            )
            return 127
        argv = [real, *argv[1:]]
        run_env = compiler_environ(env, real)
        if reentered(env):
            # An opcache further up caches this compile (through ccache, a script...).
            log.info("not cached: run by opcache again below itself; running %s directly", real)
            return _run_plain(argv, run_env)
    base = _settings(settings_for, None, None)  # the cache flags alone (C lines have no others)
    if base is None or base.mode == "disable":
        if base is not None:
            log.info("disabled (%s): running the command as it is", base.sources["mode"])
        return _run_plain(argv, run_env)
    try:
        if kind is None:
            raise Uncacheable(f"not a known compiler: {os.path.basename(argv[0])}")
        if kind == "opc":
            plan = _plan_opc(argv, run_env)
        elif kind == "op_compiler":
            plan = _plan_op_compiler(argv, run_env, base)
        else:
            store = LocalStore(base.root, modes=fsutil.modes_for(base.shared_group))
            plan = _plan_cc(argv, run_env, HeaderMemo(store), base.base_dir)
    except Uncacheable as e:
        return _run_uncacheable(argv, run_env, base, str(e))
    settings: Settings | None = base
    if plan.debug_level is not None or plan.debug_config is not None:
        try:
            settings = _settings(settings_for, plan.debug_level, plan.debug_config)
        except ConfigError:
            settings = None  # a bad debug flag on the line: the tool says why
        if settings is None:
            return _run_plain(argv, run_env)
    staging = _staging_path(plan)
    try:
        try:
            staging.parent.mkdir(parents=True, exist_ok=True)  # opc makes its --output folder
            staging.mkdir(mode=0o700)
        except OSError as e:
            # An output folder opcache cannot write in: the compiler says so best.
            reason = f"cannot write in the output folder: {e.strerror or e}"
            return _run_uncacheable(argv, run_env, base, reason)
        return _run_planned(plan, kind, settings, run_env, staging)
    finally:
        if os.path.lexists(staging):  # (made, even if a Ctrl-C came before mkdir returned)
            fsutil.remove_tree(staging)


def _run_uncacheable(
    argv: Sequence[str], env: Mapping[str, str], settings: Settings, reason: str
) -> int:
    """Run a command the cache cannot take as it is, counted with its reason in stats."""
    with _cache_warnings(settings), OpCache(settings, stats_seconds=None) as cache:
        cache.record_uncacheable(HOST_CHIP, reason)
    log.info("uncacheable (%s): running the command as it is", reason)
    return _run_plain(argv, env)


def _run_planned(
    plan: Plan, kind: str, settings: Settings, env: Mapping[str, str], staging: Path
) -> int:
    compiler = _WrappedCommand(plan, kind, env)
    # One wrap per compile command: force clears once per build, not per command.
    session = settings.session or BUILD_SESSION
    failed = None
    with _cache_warnings(settings), OpCache(settings, stats_seconds=None, session=session) as cache:
        try:
            result = cache.compile(plan.request, compiler, staging)
        except _ToolFailed as e:
            failed = e
    if failed is not None:
        log.info("miss, not stored: the command failed (exit status %d)", failed.returncode)
        _replay(failed.stdout, sys.stdout)
        _replay(failed.stderr, sys.stderr)
        return failed.returncode
    said = f" ({result.reason})" if result.reason else ""
    log.info("%s%s, key %s", result.status, said, result.key or "-")
    _restore(plan, result.files)
    return 0


def _settings(
    settings_for: Callable[[str | None, str | None], Settings],
    level: str | None,
    config: str | None,
) -> Settings | None:
    """The settings, their warnings shown at most once an hour; None: compile without a cache.

    A bad flag on opcache's own command line is the user's mistake (the
    ConfigError goes up: exit 2).  A bad environment variable must not fail
    every compile of a build: it is a warning, and the compile runs uncached.
    """
    off = None
    with _log.HeldWarnings() as held:
        try:
            settings: Settings | None = settings_for(level, config)
        except ConfigError as e:
            if e.variable is None:
                raise
            settings = None
            off = f"{e}; compiling without the cache"
    if held:
        _warn_rarely(held, settings)
    if off is not None:
        _warn_rarely([(off, off)], None, cache_off=True)
    return settings


@contextlib.contextmanager
def _cache_warnings(settings: Settings) -> Iterator[None]:
    """The cache's warnings during the block (a read-only cache...), shown by ``_warn_rarely``."""
    with _log.HeldWarnings() as held:
        yield
    if held:
        _warn_rarely(held, settings)


def _warn_rarely(
    held: list[tuple[str, str]], settings: Settings | None, *, cache_off: bool = False
) -> None:
    """Log each warning (topic, message) unless it was shown in the last hour for this cache.

    A build runs opcache once per compile: the same warning on each of a
    thousand compiles buries everything else.  A setting that turns the cache
    off (``cache_off``) must not leave the next builds uncached in silence
    either: it shows again at the first compile of each build, a build being a
    run of compiles with no pause longer than BUILD_GAP_SECONDS (as for
    ``force``).  When each was shown, and last met, is noted in the cache's
    bookkeeping, and where that cannot be written (a read-only cache) or no
    cache is in use (disable mode, a bad environment), in the user's state
    folder.
    """
    import time

    import platformdirs

    places = [LocalStore(platformdirs.user_state_path("opcache"))]
    if settings is not None and settings.mode != "disable":
        places.insert(0, LocalStore(settings.root, modes=fsutil.modes_for(settings.shared_group)))
    now = time.time()
    for topic, message in held:
        name = digest(topic.encode())
        shown, met = _last_shown(places, name)
        new_build = cache_off and not 0 <= now - met <= BUILD_GAP_SECONDS
        if 0 <= now - shown < WARN_SECONDS and not new_build:  # (false for nan: never)
            log.debug("%s (shown less than an hour ago)", message)
        else:
            log.warning("%s", message)
            shown = now
        if cache_off:
            _note_shown(places, name, f"{shown!r} {now!r}".encode())
        elif shown == now:
            _note_shown(places, name, repr(now).encode())


def _last_shown(places: list[LocalStore], name: str) -> tuple[float, float]:
    """(when a warning was last shown, when last met) by its notes, nan if never."""
    shown, met = [], []
    for notes in places:
        try:
            when = [float(word) for word in (notes.read_note("warned", name) or b"").split()]
        except ValueError:
            continue  # (a damaged note: as if never shown)
        if when:  # (a note of one time: shown then)
            shown.append(when[0])
            met.append(when[-1])
    return max(shown, default=float("nan")), max(met, default=float("nan"))


def _note_shown(places: list[LocalStore], name: str, note: bytes) -> None:
    for notes in places:
        try:
            notes.write_note(note, "warned", name)
            return
        except OSError as e:
            log.debug("cannot note the warning in %s: %s", notes.root, e)


def _staging_path(plan: Plan) -> Path:
    """Where a private folder beside the outputs goes, so moving them there is a rename."""
    parent = plan.output_dir or next(iter(plan.outputs.values())).parent
    return parent / fsutil.unique_name(".opcache-wrap")


def _restore(plan: Plan, files: dict[str, Path]) -> None:
    stdout = files.pop(STDOUT, None)
    stderr = files.pop(STDERR, None)
    for name, path in files.items():
        target = plan.outputs.get(name)
        if target is None and plan.output_dir is not None:
            target = plan.output_dir / name
        if target is not None:
            # Made executable in staging, where nobody else can swap a link in.
            if name.endswith(plan.executables):
                mode = os.stat(path).st_mode
                os.chmod(path, mode | (mode & 0o444) >> 2)  # x wherever r, as chmod +x
            os.replace(path, target)
    for saved, stream in ((stdout, sys.stdout), (stderr, sys.stderr)):
        if saved is not None:
            _replay(saved.read_bytes(), stream)


def _replay(data: bytes, stream: TextIO) -> None:
    """Write a command's saved output; diagnostics in colour only where colour shows."""
    if not data:
        return
    if stream is sys.stderr and b"\x1b[" in data and not _colour_terminal(os.environ):
        data = re.sub(rb"\x1b\[[0-9;]*[mK]", b"", data)
    stream.flush()
    stream.buffer.write(data)
    stream.buffer.flush()


def _colour_terminal(env: Mapping[str, str]) -> bool:
    """Whether the compiler would colour its diagnostics here (gcc's and clang's ``auto``)."""
    return os.isatty(2) and env.get("TERM", "dumb") != "dumb"


def exit_status(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128+N when killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _run_plain(argv: Sequence[str], env: Mapping[str, str]) -> int:
    import subprocess

    try:
        return exit_status(subprocess.run(list(argv), env=dict(env), check=False).returncode)
    except OSError as e:
        print(f"opcache: error: cannot run {argv[0]}: {e.strerror or e}", file=sys.stderr)
        return 127


def _read(path: str) -> bytes:
    try:
        return read_input(path)
    except OSError as e:
        raise Uncacheable(f"cannot read {path}: {e.strerror or e}") from None


# -- opc --------------------------------------------------------------------------


def _opc_flags(args: Sequence[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """(positional arguments, [(flag, value)]) of an opc command line."""
    positional: list[str] = []
    flags: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 < len(args) and not args[i + 1].startswith("-"):
                    value = args[i + 1]
                    i += 1
                else:
                    value = None  # a switch
            flags.append((name, value))
        elif arg.startswith("-"):
            raise Uncacheable(f"opc: unknown flag {arg}")
        else:
            positional.append(arg)
        i += 1
    return positional, flags


def _plan_opc(argv: Sequence[str], env: Mapping[str, str]) -> Plan:
    from .compilers.cann import CannCompiler

    positional, flags = _opc_flags(argv[1:])
    if len(positional) != 1:
        raise Uncacheable("opc: expected exactly one operator source")
    values = dict(flags)
    if len(values) != len(flags):
        raise Uncacheable("opc: a flag is given twice")
    soc = values.get("soc_version")
    if not soc:
        raise Uncacheable("opc: no --soc_version")
    source = positional[0]
    sources = {os.path.basename(source): _read(source)}
    op_type, op_name = "opc", ""
    key_flags = []
    for name, value in flags:
        if name in _OPC_OUTPUT_FLAGS or name in _OPC_DEBUG_FLAGS or name == "soc_version":
            continue
        if value is not None and os.path.isfile(value):
            data = _read(value)
            key_flags.append([name, "file", json.dumps(len(data)), digest(data)])
            if name == "input_param":
                op_type, op_name = _opc_names(data, values.get("main_func"))
        else:
            key_flags.append([name, "value", value])
    output_dir = Path(os.path.abspath(values.get("output") or "."))
    try:
        request = OpRequest(
            op_type=op_type,
            soc_version=soc,
            op_name=op_name,
            attrs={"flags": key_flags},
            sources=sources,
        )
    except ValueError as e:
        raise Uncacheable(f"opc: {e}") from None
    opc = CannCompiler(opc=_which(argv[0], env), environ=env)

    def command(workdir: Path) -> list[str]:
        out = [argv[0], source]
        for name, value in flags:
            if name == "output":
                continue
            out.append(f"--{name}" if value is None else f"--{name}={value}")
        return [*out, f"--output={workdir}"]

    return Plan(
        request=request,
        fingerprint=opc.fingerprint(),
        command=command,
        output_dir=output_dir,
        debug_level=values.get("op_debug_level"),
        debug_config=values.get("op_debug_config"),
    )


def _opc_names(param: bytes, main_func: str | None) -> tuple[str, str]:
    """(op_type, op_name) for op_debug_list, from the parameter JSON where it says."""
    try:
        data = json.loads(param)
    except ValueError:
        data = None
    data = data if isinstance(data, dict) else {}
    op_type = data.get("op_type") or main_func or "opc"
    op_name = data.get("op_name") or data.get("kernel_name") or ""
    return str(op_type), str(op_name)


# -- op_compiler (static kernels) ------------------------------------------------

# op_compiler's flags that take a value, in both spellings -> the long name.
_OP_COMPILER_VALUES = {"-p": "op_params_dir", "-v": "soc_version", "-j": "job", "-o": "output"}
_OP_COMPILER_VALUES |= {"-l": "log", "-f": "follow_op_params_jit"}
_OP_COMPILER_VALUES |= {f"--{name}": name for name in list(_OP_COMPILER_VALUES.values())}
_OP_COMPILER_VALUES["--super_kernel_options"] = "super_kernel_options"
_OP_COMPILER_SWITCHES = {"--enable_super_kernel": "enable_super_kernel"}
# Parallelism, where the package goes and how much is logged: not the package;
# the op-info folder is keyed by its files, not by where it is.
_OP_COMPILER_UNKEYED = ("job", "output", "log", "op_params_dir")


def _op_compiler_flags(args: Sequence[str]) -> dict[str, tuple[str | None, list[str]]]:
    """An op_compiler line's flags: long name -> (value or None for a switch, words as given)."""
    flags: dict[str, tuple[str | None, list[str]]] = {}
    args = list(args)
    i = 0
    while i < len(args):
        start = i
        arg, i = args[i], i + 1
        flag, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if flag in _OP_COMPILER_SWITCHES and not eq:
            name, value = _OP_COMPILER_SWITCHES[flag], None
        elif flag in _OP_COMPILER_VALUES:
            name = _OP_COMPILER_VALUES[flag]
            if not eq:
                if i >= len(args):
                    raise Uncacheable(f"op_compiler: {flag} needs a value")
                value, i = args[i], i + 1
        else:
            raise Uncacheable(f"op_compiler: unknown flag or argument {arg}")
        if name in flags:
            raise Uncacheable(f"op_compiler: {flag} is given twice")
        flags[name] = (value, args[start:i])
    return flags


def _plan_op_compiler(argv: Sequence[str], env: Mapping[str, str], base: Settings) -> Plan:
    from .compilers.cann import find_toolkit, toolkit_fingerprint

    given = _op_compiler_flags(argv[1:])
    flags = {name: value for name, (value, _) in given.items()}
    for needed in ("op_params_dir", "soc_version", "output"):
        if not flags.get(needed):
            raise Uncacheable(f"op_compiler: no --{needed}")
    params = Path(flags["op_params_dir"] or "")
    if not params.is_dir():
        raise Uncacheable(f"op_compiler: {params} is not a folder")
    # Every op-info file, by name and contents: the names are the op list's order.
    op_info = []
    for path in sorted(params.rglob("*")):
        if path.is_file():
            data = _read(str(path))
            op_info.append([path.relative_to(params).as_posix(), len(data), digest(data)])
    keyed = {n: v for n, v in flags.items() if n not in _OP_COMPILER_UNKEYED}
    try:
        request = OpRequest(
            op_type="static_kernel",
            soc_version=flags["soc_version"] or "",
            attrs={"flags": sorted(keyed.items()), "op_info": op_info},
        )
    except ValueError as e:
        raise Uncacheable(f"op_compiler: {e}") from None
    tool = _which(argv[0], env)
    home, found, _ = find_toolkit(env, "op_compiler")
    if found is None or os.path.realpath(found) != os.path.realpath(tool):
        home = Path(os.path.realpath(tool)).parent.parent  # <toolkit>/bin/op_compiler
    notes = None
    if base.mode != "disable":
        notes = LocalStore(base.root, modes=fsutil.modes_for(base.shared_group))
    fingerprint = toolkit_fingerprint("op_compiler", tool, home, env, notes)

    def command(workdir: Path) -> list[str]:
        words = [w for name, (_, spelled) in given.items() if name != "output" for w in spelled]
        return [argv[0], *words, "-o", str(workdir)]

    return Plan(
        request=request,
        fingerprint=fingerprint,
        command=command,
        output_dir=Path(os.path.abspath(flags["output"] or ".")),
        executables=(".run",),
    )


# -- C compilers ------------------------------------------------------------------

# Flags that take their value as the next argument when not glued to it.
_CC_VALUE_FLAGS = {"-o", "-I", "-D", "-U", "-x", "-isystem", "-iquote", "-idirafter", "-MF"}
_CC_VALUE_FLAGS |= {"-MT", "-MQ", "-include"}
_CC_INCLUDE_DIRS = ("-I", "-isystem", "-iquote", "-idirafter")
_CC_KEY_PREFIXES = ("-D", "-U", "-O", "-std=", "-f", "-m", "-W", "-g", "-x", "-pedantic")
_CC_KEY_EXACT = {"-w", "-pipe", "-ansi", "-pthread"}
_CC_UNPREDICTABLE = ("-fprofile-", "-fauto-profile", "-save-temps", "-Wp,", "-Wa,", "-Wl,")
_CC_NOT_A_COMPILE = {"-E": "preprocess only", "-S": "assembly output", "-M": "dependencies only"}
_CC_NOT_A_COMPILE |= {"-MM": "dependencies only", "-fsyntax-only": "no output"}


def _plan_cc(
    argv: Sequence[str], env: Mapping[str, str], memo: HeaderMemo, base_dir: Path | None = None
) -> Plan:
    args = list(argv[1:])
    cwd = os.getcwd()
    # The folder as the compiler names it in debug info, when it lies under base_dir.
    relative_to = _under_base_dir(base_dir, env, cwd) if base_dir is not None else None
    if relative_to is not None:
        args = _relative_args(args, base_dir, cwd)  # type: ignore[arg-type]
    compile_only = False
    output: str | None = None
    sources: list[str] = []
    key_args: list[str] = []
    pass_args: list[str] = []  # what the -M run and the real compile both need
    dep_file: str | None = None
    want_deps = debug = False
    has_target = False
    i = 0
    while i < len(args):
        arg = args[i]
        value = None
        if arg in _CC_VALUE_FLAGS:
            if i + 1 >= len(args):
                raise Uncacheable(f"cc: {arg} without a value")
            value = args[i + 1]
            i += 1
        i += 1
        if arg.startswith("@"):
            raise Uncacheable("cc: response files are not supported")
        if arg in _CC_NOT_A_COMPILE:
            raise Uncacheable(f"cc: {_CC_NOT_A_COMPILE[arg]} ({arg})")
        if arg.startswith(_CC_UNPREDICTABLE):
            raise Uncacheable(f"cc: {arg} makes the output unpredictable")
        if arg == "-c":
            compile_only = True
        elif arg == "-o" or (arg.startswith("-o") and len(arg) > 2):
            output = value if arg == "-o" else arg[2:]
        elif arg in ("-MD", "-MMD"):
            want_deps = True
            key_args.append(arg)
        elif arg == "-MF" or (arg.startswith("-MF") and len(arg) > 3):
            dep_file = value if arg == "-MF" else arg[3:]
        elif arg in ("-MT", "-MQ"):
            has_target = True
            key_args += [arg, value or ""]
        elif arg == "-MP":
            key_args.append(arg)
        elif arg.startswith(_CC_INCLUDE_DIRS):
            pass_args += [arg, value] if value is not None else [arg]
        elif arg == "-include":
            pass_args += [arg, value or ""]
        elif not arg.startswith("-"):
            if not arg.endswith(C_SOURCES):
                raise Uncacheable(f"cc: {arg} is not a C source")
            sources.append(arg)
        elif arg in _CC_KEY_EXACT or arg.startswith(_CC_KEY_PREFIXES):
            debug = debug or (arg.startswith("-g") and arg != "-g0")
            words = [arg, value] if value is not None else [arg]
            key_args += words
            pass_args += words
        else:
            raise Uncacheable(f"cc: unsupported flag {arg}")
    if not compile_only:
        raise Uncacheable("cc: not a compile to an object (-c missing)")
    if len(sources) != 1:
        raise Uncacheable("cc: expected exactly one source")
    source = sources[0]
    if output is None:
        output = os.path.splitext(os.path.basename(source))[0] + ".o"
    out_path = Path(os.path.abspath(output))
    if not out_path.parent.is_dir():
        raise Uncacheable("cc: the output folder does not exist")
    source_data = _read(source)
    compiler_identity = file_identity(_which(argv[0], env), memo.store)
    deps_in_key = memo.header_digests(
        argv[0], compiler_identity, pass_args, source, source_data, env
    )
    key_sources = {os.path.basename(source): source_data}
    attrs: dict[str, object] = {"args": key_args, "source": source, "headers": deps_in_key}
    extra = []  # flags the key decides without holding them
    if debug or want_deps:
        # Debug info and dependency files name folders: the key must too.  Under
        # base_dir the paths are relative, and debug info names the folder ".".
        attrs["cwd"] = cwd if relative_to is None else "."
        attrs["include_args"] = pass_args
        if debug and relative_to is not None:
            extra.append(f"-fdebug-prefix-map={relative_to}=.")  # first: the user's maps win
    if _colour_wanted(argv[0], args, env):
        extra.append("-fdiagnostics-color")  # replayed without colour where it cannot show
    outputs = {"object": out_path}
    if want_deps:
        dep_path = dep_file or os.path.splitext(output)[0] + ".d"
        outputs["deps"] = Path(os.path.abspath(dep_path))
    for path in outputs.values():
        # -o /dev/null (configure scripts) or a link: restoring would replace it.
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
            raise Uncacheable("cc: an output is not a regular file")
    request = OpRequest(op_type="cc", soc_version=HOST_CHIP, attrs=attrs, sources=key_sources)

    def command(workdir: Path) -> list[str]:
        out = [argv[0], *extra, *pass_args, "-c", source, "-o", str(workdir / "object")]
        if want_deps:
            out += [a for a in key_args if a in ("-MD", "-MMD")]
            out += ["-MF", str(workdir / "deps")]
            if not has_target:
                out += ["-MT", output]
            out += _target_args(key_args)
        return out

    return Plan(request=request, fingerprint=compiler_identity, command=command, outputs=outputs)


# Flags whose value is a path, glued to it ("" for a path on its own).
_PATH_PREFIXES = ("-I", "-isystem", "-iquote", "-idirafter", "-include", "-MF", "-MT", "-MQ", "-o")
_PATH_PREFIXES += ("",)
_COLOUR_FLAGS = ("-fdiagnostics-color", "-fno-diagnostics-color", "-fcolor-diagnostics")
_COLOUR_FLAGS += ("-fno-color-diagnostics",)


def _under_base_dir(base_dir: Path, env: Mapping[str, str], cwd: str) -> str | None:
    """The working folder as the compiler names it ($PWD, as gcc's getpwd) if under base_dir."""
    apparent = cwd
    pwd = env.get("PWD", "")
    try:
        if pwd.startswith("/") and os.path.samestat(os.stat(pwd), os.stat(cwd)):
            apparent = pwd
    except OSError:
        pass
    if _is_under(cwd, os.path.realpath(base_dir)) or _is_under(apparent, str(base_dir)):
        return apparent
    return None


def _is_under(path: str, folder: str) -> bool:
    folder = folder.rstrip("/")
    return path == folder or path.startswith(folder + "/")


def _relative_args(args: list[str], base_dir: Path, cwd: str) -> list[str]:
    """Absolute paths under ``base_dir`` rewritten relative to ``cwd`` (ccache's base_dir)."""
    bases = (str(base_dir), os.path.realpath(base_dir))
    out = []
    for arg in args:
        for prefix in _PATH_PREFIXES:
            path = arg[len(prefix) :]
            if arg.startswith(prefix) and path.startswith("/"):
                if any(_is_under(path, base) for base in bases):
                    arg = prefix + _relative(path, cwd)
                break
        out.append(arg)
    return out


def _relative(path: str, cwd: str) -> str:
    """``path`` from ``cwd`` (a real path), naming the same file.

    Its folder is resolved first, so ``..`` steps are right whatever links the
    path went through; its last part stays: a source linked from elsewhere
    still finds its ``#include "..."`` files beside the link.
    """
    head, tail = os.path.split(path.rstrip("/") or "/")
    if tail in ("", ".", ".."):
        return os.path.relpath(os.path.realpath(path), cwd)
    folder = os.path.relpath(os.path.realpath(head), cwd)
    return tail if folder == "." else os.path.join(folder, tail)


def _colour_wanted(cc: str, args: list[str], env: Mapping[str, str]) -> bool:
    """Whether to ask gcc or clang for colour: on a terminal, when the user said nothing.

    The compiler's output is captured, so its own ``auto`` would see a pipe.
    As ccache does; the flag is not in the key, and colour codes are dropped
    when the output is replayed where colour cannot show.
    """
    if not _colour_terminal(env) or any(a.startswith(_COLOUR_FLAGS) for a in args):
        return False
    return re.search(r"gcc|g\+\+|clang", os.path.basename(os.path.realpath(cc))) is not None


def _target_args(key_args: list[str]) -> list[str]:
    out = []
    for i, arg in enumerate(key_args):
        if arg in ("-MT", "-MQ"):
            out += [arg, key_args[i + 1]]
        elif arg == "-MP":
            out.append(arg)
    return out


def _which(executable: str, env: Mapping[str, str]) -> str:
    found = which(executable, env)
    if found is None:
        raise Uncacheable(f"cannot find {executable}")
    return found


class HeaderMemo:
    """Direct mode: the headers a source read last time, so a hit runs no preprocessor.

    Keyed by everything that decides which headers the preprocessor opens (the
    compiler, the flags and include folders, the source's path and contents,
    the working folder, the include variables).  A remembered header list is
    used only while every header still has the contents it had then: same
    contents, same ``#include``s, same list.  Otherwise ``cc -M`` runs again.
    """

    _VARIANTS = 4  # header sets remembered per source (e.g. a header edited back and forth)

    def __init__(self, store: LocalStore | None) -> None:
        self.store = store  # None: nothing is remembered

    def header_digests(
        self,
        cc: str,
        identity: str,
        pass_args: list[str],
        source: str,
        source_data: bytes,
        env: Mapping[str, str],
    ) -> list[str]:
        """The digests of the headers ``source`` includes, in the order first read."""
        memo_key = digest(
            canonical_json(
                {
                    "compiler": identity,
                    "args": pass_args,
                    "source": [source, digest(source_data)],
                    "cwd": os.getcwd(),
                    # repr: text even for bytes of no encoding (os.environ's surrogates)
                    "env": repr([env.get(name) for name in _INCLUDE_VARIABLES]),
                }
            )
        )
        variants = self._recall(memo_key)
        for variant in variants:
            digests = _current_digests(variant)
            if digests is not None:
                return digests
        headers = [h for h in _cc_headers(cc, pass_args, source, env) if h != source]
        variant = [[h, digest(_read(h))] for h in headers]
        self._remember(memo_key, [variant, *variants][: self._VARIANTS])
        return [d for _, d in variant]

    def _recall(self, memo_key: str) -> list[list[list[str]]]:
        raw = self.store.read_note("direct", memo_key[:2], memo_key) if self.store else None
        try:
            variants = json.loads(raw) if raw else []
        except ValueError:
            return []
        ok = isinstance(variants, list) and all(
            isinstance(v, list)
            and all(
                isinstance(h, list) and len(h) == 2 and all(isinstance(x, str) for x in h)
                for h in v
            )
            for v in variants
        )
        return variants if ok else []

    def _remember(self, memo_key: str, variants: list[list[list[str]]]) -> None:
        if self.store is None:
            return
        try:
            data = json.dumps(variants).encode()
            self.store.write_note(data, "direct", memo_key[:2], memo_key)
        except OSError as e:
            log.debug("cannot remember the headers of %s: %s", memo_key, e)


_INCLUDE_VARIABLES = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "OBJC_INCLUDE_PATH")


def _current_digests(variant: list[list[str]]) -> list[str] | None:
    """The headers' digests if every one still has the recorded contents, else None."""
    digests = []
    for path, want in variant:
        try:
            now = digest(read_input(path))
        except OSError:
            return None
        if now != want:
            return None
        digests.append(now)
    return digests


def _cc_headers(cc: str, pass_args: list[str], source: str, env: Mapping[str, str]) -> list[str]:
    """Every file the preprocessor reads for ``source``, in the order ``cc -M`` lists them."""
    import subprocess

    done = subprocess.run(
        [cc, *pass_args, "-M", source], capture_output=True, env=dict(env), check=False
    )
    if done.returncode != 0:
        raise Uncacheable("cc: the preprocessor failed (the compile will report why)")
    return list(dict.fromkeys(_make_prerequisites(done.stdout.decode(errors="surrogateescape"))))


# gcc's make quoting (libcpp/mkdeps.cc): a space or tab of a name follows a
# backslash, and the backslashes right before it are doubled (2N+1 then a
# space: N of the name and the space; 2N: N that end the name); $ is $$, # is
# \#; other backslashes are as they are; a backslash-newline continues a line.
_MAKE_QUOTING = re.compile(r"(?P<run>\\+)(?P<space>[ \t])|\\(?P<hash>#)|\$(?P<dollar>\$)|\\\n|\s")


def _make_prerequisites(rule: str) -> list[str]:
    """The file names after the target of a make rule as ``cc -M`` writes it."""
    target_end = re.search(r":(\s|$)", rule)
    prerequisites = rule[target_end.end() :] if target_end else ""

    def unquote(match: re.Match[str]) -> str:
        if match["run"] is not None:
            run = len(match["run"])
            return "\\" * (run // 2) + (match["space"] if run % 2 else "\0")
        return match["hash"] or match["dollar"] or "\0"  # "\0": between two names

    return [name for name in _MAKE_QUOTING.sub(unquote, prerequisites).split("\0") if name]


# -- planning without running (opcache explain) ------------------------------------


def plan_command(
    argv: Sequence[str], settings: Settings, environ: Mapping[str, str] | None = None
) -> tuple[OpRequest, _WrappedCommand]:
    """How ``opcache wrap`` would key ``argv``, without running it: (the request,
    the compiler whose name and fingerprint join the key).

    Planned as ``run`` plans it, past opcache's own links; Uncacheable, with
    the reason wrap would count, for a command it would not cache.  A C line's
    headers are listed by ``cc -M`` afresh: nothing is noted in the cache.
    """
    env = dict(os.environ if environ is None else environ)
    kind = compiler_kind(argv[0])
    if kind is None:
        raise Uncacheable(f"not a known compiler: {os.path.basename(argv[0])}")
    real = find_compiler(argv[0], env)
    if real is None:
        name = os.path.basename(argv[0])
        raise Uncacheable(f"no {name} on PATH other than opcache or a compiler cache")
    argv = [real, *argv[1:]]
    env = compiler_environ(env, real)
    if kind == "opc":
        plan = _plan_opc(argv, env)
    elif kind == "op_compiler":
        plan = _plan_op_compiler(argv, env, settings)
    else:
        plan = _plan_cc(argv, env, HeaderMemo(None), settings.base_dir)
    return plan.request, _WrappedCommand(plan, kind, env)
