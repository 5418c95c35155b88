"""``opcache wrap -- <compile command>``: ccache-style caching of a command line.

Three kinds of command are understood:

- CANN's ``opc <op.py> --main_func=... --input_param=<json> --soc_version=...
  --output=<dir> [...]``: the key holds the operator source, the parameter
  JSON's contents, the chip and every other flag (a flag naming a file by that
  file's contents), the variables the operator scripts read
  (``OPC_KEY_ENVIRONMENT``) and what the compile read, traced with strace
  (``readset.py``; without strace, only the inputs ``OPCACHE_EXTRA_FILES``
  lists, else uncached); output locations (``--output``, ``--debug_dir``) are
  left out; ``--op_debug_level`` / ``--op_debug_config`` bypass the cache by
  the settings' rules.  ``asc_opc`` is the same tool under its current name.
- C compilers, ``cc -c src.c -o out.o`` with ``-I -D -U -O -std -f -m -W -g -x``
  flags: the key holds the source and every header the compiler lists with
  ``-M``, by content, the environment that changes the output and the clock
  where ``__DATE__``/``__TIME__``/``__TIMESTAMP__`` are used; a hit also needs
  every place the include search looked in and found empty still empty.
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

import _signal  # built in, loaded at start-up (opcache/__init__ uses it too)
import contextlib
import errno
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from . import _json, _log, fsutil, quickhit, quickmemo
from ._log import get_logger
from .cache import BUILD_GAP_SECONDS, BUILD_SESSION, OpCache
from .compilers import cc_driver
from .compilers.toolchain import file_identity, is_script, which
from .errors import CompileError, ConfigError, sentence
from .key import canonical_json, compute_key, digest
from .keyed_env import (
    ASCEND_CC_KEY_ENVIRONMENT,
    CC_ARGUMENT_ENVIRONMENT,
    CC_KEY_ENVIRONMENT,
    CC_PROGRAM_ENVIRONMENT,
    CC_SIDE_OUTPUT_ENVIRONMENT,
    ENV_EXTRA_FILES,
    ENV_KEY_ENV,
    OPC_READS_ENVIRONMENT,
    OPC_SIDE_OUTPUT_ENVIRONMENT,
)
from .masquerade import (
    ASCEND_CC_NAMES,
    compiler_environ,
    compiler_kind,
    exit_status,
    find_compiler,
    reentered,
    run_plain,
)
from .request import CompileResult, OpRequest
from .settings import Settings
from .storage.local import LocalStore

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from typing import TextIO

    from .readset import ReadSet

    # A compile's files left in its folder: name -> (bytes, permission bits).
    _Outputs = dict[str, tuple[bytes, int]]

log = get_logger(__name__)

STDOUT = ".opcache-stdout"
STDERR = ".opcache-stderr"
HOST_CHIP = "host"  # the chip folder of C compiles and uncacheable commands
C_SOURCES = (".c", ".cc", ".cpp", ".cxx", ".C", ".s", ".S")
WARN_SECONDS = 3600  # a configuration warning shows at most once an hour per cache
# opc flags that say where outputs go: not part of the key.
_OPC_OUTPUT_FLAGS = ("output", "debug_dir")
_OPC_DEBUG_FLAGS = ("op_debug_level", "op_debug_config")
_OPC_NAMED_FLAGS = (*_OPC_OUTPUT_FLAGS, *_OPC_DEBUG_FLAGS, "soc_version")


class _ToolFailed(CompileError):
    """The wrapped command exited non-zero: replay its output and status."""

    def __init__(self, returncode: int, stdout: bytes, stderr: bytes) -> None:
        super().__init__(f"exit status {returncode}")
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


class _AsIs(Exception):
    """The command ran, but made what a hit could not give back: it runs as it is."""


class Plan:
    """How to cache one command line.

    ``command(workdir)`` is the argv with its output locations inside
    ``workdir``; ``outputs`` maps an artifact name to where the command would
    have written it, or ``output_dir`` takes every file the command wrote.
    Restored files whose names end with one of ``executables`` are made
    executable (the cache keeps contents, not modes).  ``settled()``, run after
    the command, gives a reason not to store what it made (an input changed
    while it ran), or None.  ``explain_names``: what the key holds by contents
    only, by name, for ``opcache explain`` (``explain.NAMES``).
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
        trace: _OpcTrace | None = None,
        settled: Callable[[], str | None] | None = None,
        explain_names: dict[str, list[str]] | None = None,
        flat_outputs: bool = False,
    ) -> None:
        self.request = request
        self.fingerprint = fingerprint
        self.command = command
        self.outputs = {} if outputs is None else outputs
        self.output_dir = output_dir
        self.debug_level = debug_level
        self.debug_config = debug_config
        self.executables = executables
        self.trace = trace  # how the command is traced, its read set joining the key
        self.settled = settled
        self.explain_names = explain_names
        self.flat_outputs = flat_outputs  # (a folder in output_dir: the command runs as it is)


class Uncacheable(Exception):
    """The command cannot be cached; the message is the reason stats count."""


class NotServed(BaseException):
    """In an ``opcache server`` worker (``serve_hits_only``): this call is more than a hit.

    Raised before anything is done that the client's own ``opcache``, which then
    runs the call, would do again (run a program, count, note a warning as shown).
    Not an Exception: no handler on the way may take it for a failure and go on.
    """


_hits_only = False


def serve_hits_only() -> None:
    """From now on this process serves hits only (an ``opcache server`` worker)."""
    global _hits_only
    _hits_only = True


def _more_than_a_hit(what: str) -> None:
    if _hits_only:
        raise NotServed(what)


class _WrappedCommand:
    """The compiler protocol over one planned command line."""

    def __init__(self, plan: Plan, kind: str, environ: Mapping[str, str]) -> None:
        self.name = f"wrap-{kind}"
        self._plan = plan
        self._environ = environ
        self.explain_names = plan.explain_names  # (noted beside the key on a miss)

    def fingerprint(self) -> str:
        return self._plan.fingerprint

    def compile(
        self,
        request: OpRequest,
        workdir: Path,
        trace: tuple[str, str] | None = None,
    ) -> None:
        """Run the command; with ``trace`` (strace, its trace folder), under strace."""
        import subprocess  # a hit runs nothing: keep it off start-up

        argv = self._plan.command(workdir)
        outlived = None
        try:
            if trace is None:
                # No stdin: what a compile read there would be in no key (a stand-in's
                # "cat > k.o" under "wrap < data.txt" gave a hit of old data).
                done = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    env=dict(self._environ),
                    check=False,
                )
                status, stdout, stderr = done.returncode, done.stdout, done.stderr
            else:
                from . import readset  # (a traced miss only)

                strace, trace_dir = trace
                traced = readset.traced_command(strace, trace_dir, argv)
                status, stdout, stderr, outlived = readset.run_traced(
                    traced, trace_dir, dict(self._environ)
                )
        except OSError as e:
            raise _ToolFailed(127, b"", f"opcache: cannot run {argv[0]}: {e}\n".encode()) from None
        if status != 0:
            if self._plan.flat_outputs and self._plan.output_dir is not None:
                _leave_as_made(workdir, self._plan.output_dir)
            raise _ToolFailed(exit_status(status), stdout, stderr)
        if self._plan.flat_outputs:
            for entry in os.scandir(workdir):
                if not entry.is_file(follow_symlinks=False):
                    raise _AsIs(f"it made {entry.name}, not a file, in its output folder")
        (workdir / STDOUT).write_bytes(stdout)
        (workdir / STDERR).write_bytes(stderr)
        unsettled = self._plan.settled() if self._plan.settled is not None else None
        if unsettled is None and outlived:
            unsettled = f"{outlived} (what it reads after is not known)"
        if unsettled is not None:
            raise _Unproven(unsettled, _read_outputs(workdir))


def _leave_as_made(workdir: Path, output_dir: Path) -> None:
    """What a failed run wrote (its error log, a half package), where it writes it, as
    it would have written it there: it tells the user why.  Best effort: the failure
    is the news.

    As the compiler writes: a folder or file missing is made with the bits it made
    it with (narrowed by the umask), a file there is written over, and nothing
    that was there gets other permission bits or times (``shutil.copytree`` gave
    the output folder the private work folder's 0700, and a file reached through
    a link there the work file's bits)."""
    for top, folders, files in os.walk(workdir):
        here = output_dir / os.path.relpath(top, workdir)
        for name in [*folders, *files]:
            made, there = os.path.join(top, name), here / name
            try:
                st = os.lstat(made)
                if stat.S_ISLNK(st.st_mode):
                    if not os.path.lexists(there):
                        os.symlink(os.readlink(made), there)
                    if name in folders:
                        folders.remove(name)  # (its files are where the link leads)
                elif stat.S_ISDIR(st.st_mode):
                    if not os.path.isdir(there):
                        os.mkdir(there, stat.S_IMODE(st.st_mode))
                elif stat.S_ISREG(st.st_mode):
                    with open(made, "rb") as source:
                        data = source.read()
                    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                    fd = os.open(there, flags, stat.S_IMODE(st.st_mode))
                    with open(fd, "wb") as target:
                        target.write(data)
            except OSError as e:
                log.debug("cannot leave %s of the failed run in %s: %s", name, here, e)


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
            return run_plain(argv, run_env)
    base = _settings(settings_for, None, None)  # the cache flags alone (C lines have no others)
    if base is None or base.mode == "disable":
        if base is not None:
            log.info("disabled (%s): running the command as it is", base.sources["mode"])
        return run_plain(argv, run_env)
    try:
        if kind is None:
            raise Uncacheable(f"not a known compiler: {os.path.basename(argv[0])}")
        if kind == "opc":
            plan = _plan_opc(argv, run_env, base)
        elif kind == "op_compiler":
            plan = _plan_op_compiler(argv, run_env, base)
        else:
            store = LocalStore(base.root, modes=fsutil.modes_for(base.shared_group))
            plan = _plan_cc(argv, run_env, HeaderMemo(store), base.base_dir)
    except Uncacheable as e:
        return _run_uncacheable(argv, run_env, base, str(e))
    except OSError as e:
        # A file the key needs that this user may not read (an execute-only compiler,
        # another's file in the tuning bank): the command runs as it is, never fails.
        reason = f"cannot read what the key needs: {sentence(e)}"
        log.warning("%s: running the command uncached", reason)
        return _run_uncacheable(argv, run_env, base, reason)
    for target in plan.outputs.values() if os.geteuid() else ():  # (root renames anything)
        with contextlib.suppress(OSError):
            if quickhit.unreplaceable(target, os.lstat(target)):
                # A hit could not rename over it; the command writes into it.
                reason = "an output is another user's file in a sticky folder"
                return _run_uncacheable(argv, run_env, base, reason)
    settings: Settings | None = base
    if plan.debug_level is not None or plan.debug_config is not None:
        try:
            settings = _settings(settings_for, plan.debug_level, plan.debug_config)
        except ConfigError:
            settings = None  # a bad debug flag on the line: the tool says why
        if settings is None:
            return run_plain(argv, run_env)
    staging = _staging_path(plan)
    made: list[int] = []
    try:
        try:
            staging.parent.mkdir(parents=True, exist_ok=True)  # opc makes its --output folder
            _make_staging(staging, made)
        except OSError as e:
            # An output folder opcache cannot write in: the compiler says so best.
            reason = f"cannot write in the output folder: {e.strerror or e}"
            return _run_uncacheable(argv, run_env, base, reason)
        return _run_planned(argv, plan, kind, settings, run_env, staging, made[0])
    finally:
        _remove_staging(staging, made)


def _make_staging(staging: Path, made: list[int]) -> None:
    """Make the staging folder and put the handle on it in ``made`` (OSError if it
    cannot be made, or another folder was put in its place at once).

    Held as a handle from its mkdir on: whoever may write in the output folder
    may rename it away and put another folder (one of yours from beside it)
    under its name at any moment, and that one must not be emptied.  A Ctrl-C
    is held off meanwhile, so that a folder made is never left unknown.
    """
    held = _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})
    try:
        fd = fsutil.make_folder(staging, 0o700 | fsutil.MARK)  # (known without a listing)
        if fd is None:
            raise OSError(f"another folder was put in place of {staging}")
        made.append(fd)
    finally:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, held)


def _remove_staging(staging: Path, made: list[int]) -> None:
    """Delete the staging folder, if it was made (``made``: its handle) and its name
    still holds it; a folder put in its place is left as it is (a warning says so).

    A Ctrl-C is held off meanwhile: raised half way, it would leave the folder
    behind in the user's output folder.  It is raised once the folder is gone.
    """
    if not made:
        return
    held = _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})
    try:
        fsutil.remove_made(staging, made[0])  # (a hit's restore left it empty: one rmdir)
    finally:
        os.close(made[0])
        _signal.pthread_sigmask(_signal.SIG_SETMASK, held)


def _run_uncacheable(
    argv: Sequence[str], env: Mapping[str, str], settings: Settings, reason: str
) -> int:
    """Run a command the cache cannot take as it is, counted with its reason in stats."""
    _more_than_a_hit(reason)
    # (only counted: the remote is neither loaded nor connected)
    with _cache_warnings(settings), OpCache(settings, stats_seconds=None, eager=False) as c:
        c.record_uncacheable(HOST_CHIP, reason)
    log.info("uncacheable (%s): running the command as it is", reason)
    return run_plain(argv, env)


def _run_planned(
    argv: Sequence[str],
    plan: Plan,
    kind: str,
    settings: Settings,
    env: Mapping[str, str],
    staging: Path,
    staging_fd: int,
) -> int:
    compiler = _WrappedCommand(plan, kind, env)
    # One wrap per compile command: force clears once per build, not per command.
    session = settings.session or BUILD_SESSION
    failed = as_is = None
    rerun = False  # the command runs after all: what the cache gave cannot be used
    # The remote is opened, and the chip folder's upkeep done, at the first local
    # miss: a hit must not import the remote's client nor read the size counters.
    with (
        _cache_warnings(settings),
        OpCache(
            settings, stats_seconds=None, session=session, eager=False, upkeep_at_miss=True
        ) as cache,
    ):
        try:
            if plan.trace is not None:
                result = plan.trace.compile(cache, compiler, staging, staging_fd)
            else:
                result = cache.compile(plan.request, compiler, staging)
        except _ToolFailed as e:
            failed = e
        except _Unproven as e:
            result = _unstored(
                cache, plan.request.soc_version, str(e), e, (staging, staging_fd), 0.0
            )
        except _AsIs as e:
            cache.record_uncacheable(plan.request.soc_version, f"{kind}: {e}")
            as_is = e
        except OSError as e:
            # A hit that cannot be written into the staging folder (a file size limit,
            # a full disk): the command meets that itself, as it would alone.
            log.warning("cannot put the outputs in place: %s; running the command", sentence(e))
            rerun = True
        if as_is is None and not rerun:
            rerun = _put_in_place(plan, staging, staging_fd, None if failed else result)
            if rerun and failed is None and result.status == "hit":
                cache._unserved(result, plan.request.soc_version)  # (the command compiles)
    if as_is is not None:
        log.info("not stored (%s): running the command as it is", as_is)
        return run_plain(argv, env)
    if rerun:
        return run_plain(argv, env)
    if failed is not None:
        log.info("miss, not stored: the command failed (exit status %d)", failed.returncode)
        _replay(failed.stdout, sys.stdout)
        _replay(failed.stderr, sys.stderr)
        return failed.returncode
    if kind == "cc" and result.status == "hit" and result.tier == "local":
        _note_hit(plan, settings, result)
    _replay_streams(result.files)
    return 0


def _put_in_place(plan: Plan, staging: Path, staging_fd: int, result: CompileResult | None) -> bool:
    """Move ``result``'s outputs (None: a failed command's, none) from the staging folder
    to where the command writes them; True if the command must run instead."""
    if not fsutil.holds(staging, staging_fd):
        # Another folder was put under its name (one of yours from beside it): nothing
        # is taken from it (its removal, left, says so), and the command, which wrote
        # into it by its name, may have failed for that.
        log.info("the staging folder %s was moved: running the command", staging)
        return True
    if result is None:
        return False
    said = f" ({result.reason})" if result.reason else ""
    log.info("%s%s, key %s", result.status, said, result.key or "-")
    try:
        _restore(plan, result.files)
    except OSError as e:
        # An output opcache may not replace where the command may write it (another
        # user's file, writable, in a sticky folder): the command says what it makes.
        log.warning("cannot put the outputs in place: %s; running the command", sentence(e))
        return True
    return False


last_hit: list[quickmemo.Hit] = []  # a full hit that may leave a memo (cli writes it)


def _note_hit(plan: Plan, settings: Settings, result: CompileResult) -> None:
    """Note a local hit of a C compile for its memo (``quickmemo``), unless the memo could
    not stand in for it: force mode (a build clears first), the clock in the key."""
    from .aging import STAMP_GRANULARITY

    if settings.mode != "enable" or {"date", "mtimes"} & plan.request.attrs.keys():
        return
    last_hit[:] = [
        quickmemo.Hit(
            root=os.path.abspath(settings.root),
            soc=plan.request.soc_version,
            key=result.key,
            outputs={name: str(path) for name, path in plan.outputs.items()},
            stamp_every=STAMP_GRANULARITY if settings.aging_enabled else -1.0,
            saved=result.saved_seconds,
            file_mode=fsutil.modes_for(settings.shared_group).file,
            streams=(STDOUT, STDERR),
        )
    ]


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
    if held or off is not None:
        _more_than_a_hit("a configuration warning")  # (noted as shown once shown)
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
    """Move the outputs in ``files`` to where the command writes them (OSError if one
    cannot be); the saved streams (``STDOUT``, ``STDERR``) stay in ``files``."""
    for name, path in files.items():
        if name in (STDOUT, STDERR):
            continue
        target = plan.outputs.get(name)
        if target is None and plan.output_dir is not None:
            target = plan.output_dir / name
        if target is not None:
            # Made executable in staging, where nobody else can swap a link in.
            if name.endswith(plan.executables):
                mode = os.stat(path).st_mode
                os.chmod(path, mode | (mode & 0o444) >> 2)  # x wherever r, as chmod +x
            try:
                os.replace(path, target)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                _copy_over(path, target)


def _copy_over(path: Path, target: Path) -> None:
    """Put the staged file ``path`` at ``target``, on another file system than the
    staging folder (``-MF /tmp/x.d`` beside ``-o build/x.o``): a new file in the
    target's folder, with the staged one's permission bits, renamed over it, as a
    move within one file system would be (the file at ``target`` is never written
    into, a link there is replaced, not followed)."""
    data = path.read_bytes()  # (the private staging folder's: nobody swapped it)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    temp = target.parent / fsutil.unique_name(".opcache-wrap")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o600)
    try:
        try:
            fsutil.write_all(fd, data)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    path.unlink()  # (the staging folder, emptied, then goes with one rmdir)


def _replay_streams(files: dict[str, Path]) -> None:
    """Write the command's saved output where it wrote it."""
    for saved, stream in ((files.get(STDOUT), sys.stdout), (files.get(STDERR), sys.stderr)):
        if saved is not None:
            data = saved.read_bytes()
            saved.unlink()  # (the staging folder, emptied, then goes with one rmdir)
            _replay(data, stream)


def _replay(data: bytes, stream: TextIO) -> None:
    """Write a command's saved output; diagnostics in colour only where colour shows."""
    if not data or stream is None:  # (None: opcache started with that descriptor closed)
        return
    if stream is sys.stderr and b"\x1b[" in data and not _colour_terminal(os.environ):
        data = re.sub(rb"\x1b\[[0-9;]*[mK]", b"", data)
    stream.flush()
    stream.buffer.write(data)
    stream.buffer.flush()


def _colour_terminal(env: Mapping[str, str]) -> bool:
    """Whether the compiler would colour its diagnostics here (gcc's and clang's ``auto``)."""
    return os.isatty(2) and env.get("TERM", "dumb") != "dumb"


def _read(path: str) -> bytes:
    return _read_seen(path)[0]


def _read_seen(path: str) -> tuple[bytes, tuple[int, ...]]:
    """A file's bytes and its ``_identity`` as they were read."""
    try:
        data, st = fsutil.read_input_stat(path)
    except OSError as e:
        raise Uncacheable(f"cannot read {path}: {e.strerror or e}") from None
    if (st.st_dev, st.st_ino) in _standard_streams():
        # (a header that is a link to /dev/stdin: the compile of a miss gets no stdin)
        raise Uncacheable(f"cc: {path} is opcache's stdin, stdout or stderr, not a source file")
    return data, _identity(st)


def _standard_streams() -> set[tuple[int, int]]:
    """The files of this process's stdin, stdout and stderr, as (device, inode): asked
    at each read (a file read, not a hit: a server's worker takes each caller's)."""
    streams = set()
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            streams.add((st.st_dev, st.st_ino))
    return streams


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells a file from itself rewritten, even with the same bytes: every write
    moves its ctime (which nothing sets back), and so does a rename onto its name.
    Not its device and inode: taken from the open file as it is read (``fstat``)
    and from its name after the compile (``stat``), they differ on overlayfs
    before Linux 4.19 (a container image's lower layer), where every compile
    would then seem to have met a file changed."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _unchanged_since(seen: Mapping[str, tuple[int, ...]], started_ns: int) -> bool:
    """Whether every file of ``seen`` (path: its ``_identity`` when it was read) is
    still that file, not written since ``started_ns``, taken before any was read:
    a write in the same clock tick as the one before keeps its identity."""
    for path, was in seen.items():
        try:
            st = os.stat(path)
        except OSError:
            return False
        if _identity(st) != was or fsutil.written_since(st, started_ns):
            return False
    return True


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


def _plan_opc(argv: Sequence[str], env: Mapping[str, str], base: Settings | None = None) -> Plan:
    """An opc (or asc_opc) line.  With ``base`` (the settings of a wrap that runs it)
    the compile is traced (``readset.py``), or without strace cached only when
    the user lists what else it reads (``OPCACHE_EXTRA_FILES``, ``OPCACHE_KEY_ENV``)."""
    from . import readset
    from .compilers.cann import CannCompiler, keyed_environment, toolkit_fingerprint, trace_folders
    from .compilers.toolchain import user_key_names

    positional, flags = _opc_flags(argv[1:])
    if len(positional) != 1:
        raise Uncacheable("opc: expected exactly one operator source")
    values = dict(flags)
    if len(values) != len(flags):
        raise Uncacheable("opc: a flag is given twice")
    for name in values:
        # asc_opc takes a flag's unique prefix for it (getopt): --out=... is --output.
        whole = [f for f in _OPC_NAMED_FLAGS if name and f.startswith(name) and f != name]
        if whole:
            raise Uncacheable(f"opc: --{name} may stand for --{whole[0]}")
    for name in OPC_SIDE_OUTPUT_ENVIRONMENT:
        if env.get(name):
            raise Uncacheable(f"opc: {name} is set (it writes files a hit could not give back)")
    soc = values.get("soc_version")
    if not soc:
        raise Uncacheable("opc: no --soc_version")
    source = positional[0]
    import time

    # Before any file of the key is read: one written since (a generator truncating
    # it and writing the same bytes) may have been read half written by opc.
    started = time.time_ns()
    seen: dict[str, tuple[int, ...]] = {}
    source_data, seen[source] = _read_seen(source)
    sources = {os.path.basename(source): source_data}
    op_type, op_name = "opc", ""
    key_flags = []
    for name, value in flags:
        if name in _OPC_NAMED_FLAGS:
            continue
        if value is not None and os.path.isfile(value):
            data, seen[value] = _read_seen(value)
            key_flags.append([name, "file", json.dumps(len(data)), digest(data)])
            if name == "input_param":
                op_type, op_name = _opc_names(data, values.get("main_func"))
        else:
            key_flags.append([name, "value", value])
    output_dir = Path(fsutil.absolute(values.get("output") or "."))
    user_env = user_key_names(env)
    extra = _extra_files(env, seen)
    attrs: dict[str, object] = {"flags": key_flags, "env": keyed_environment(env)}
    if extra is not None:
        attrs["extra_files"] = extra

    def make_request(reads: str | None) -> OpRequest:
        keyed = attrs if reads is None else {**attrs, "reads": reads}
        return OpRequest(
            op_type=op_type, soc_version=soc, op_name=op_name, attrs=keyed, sources=sources
        )

    try:
        request = make_request(None)
    except ValueError as e:
        raise Uncacheable(f"opc: {e}") from None
    notes = None
    if base is not None and base.mode != "disable":
        notes = LocalStore(base.root, modes=fsutil.modes_for(base.shared_group))
    opc = CannCompiler(opc=_which(argv[0], env), environ=env, notes=notes)
    # (not opc.fingerprint(): the read set holds the custom packages and what else it read)
    fingerprint = toolkit_fingerprint("opc", opc.opc, opc.home, env, notes)
    trace = None
    strace = readset.strace_program(env)
    if base is not None and strace is None:
        if extra is None and not user_env:
            why = f"no strace on PATH or {readset.ENV_TRACE}=off"
            message = (
                f"opc: cannot see which files opc reads ({why}): its calls are not cached; "
                f"install strace, or list what it reads in {ENV_EXTRA_FILES} / {ENV_KEY_ENV}"
            )
            _warn_rarely([("opc-untraced", message)], base)
            raise Uncacheable(f"opc: not traced ({why}) and no {ENV_EXTRA_FILES}")
    elif base is not None and strace is not None:
        memo_key = digest(
            canonical_json(
                {
                    "key": compute_key(request, "wrap-opc", fingerprint)[0],
                    "cwd": os.getcwd(),
                    "env": repr([[n, env.get(n)] for n in OPC_READS_ENVIRONMENT]),
                }
            )
        )

        def folders() -> tuple[list[str], list[str]]:
            return trace_folders(opc.opc, opc.home, env, os.getcwd())

        trace = _OpcTrace(strace, memo_key, notes, make_request, folders)

    def command(workdir: Path) -> list[str]:
        out = [argv[0], source]
        for name, value in flags:
            if name == "output":
                continue
            out.append(f"--{name}" if value is None else f"--{name}={value}")
        return [*out, f"--output={workdir}"]

    def settled() -> str | None:
        """Whether a file of the key changed while opc ran (the same bytes or others), or
        one was added where ``OPCACHE_EXTRA_FILES`` names a folder or a pattern.
        (A traced compile's other reads are the read set's to judge.)"""
        try:
            if _unchanged_since(seen, started) and _extra_files(env) == extra:
                return None
        except (Uncacheable, OSError):
            pass
        return "opc: a file it read changed while it ran"

    plan = Plan(
        request=request,
        fingerprint=fingerprint,
        command=command,
        output_dir=output_dir,
        debug_level=values.get("op_debug_level"),
        debug_config=values.get("op_debug_config"),
        trace=trace,
        settled=settled,
    )
    return plan


def _extra_files(
    env: Mapping[str, str], seen: dict[str, tuple[int, ...]] | None = None
) -> list[list[object]] | None:
    """The files ``OPCACHE_EXTRA_FILES`` names (a folder: every file in it), with their
    digests; ``seen`` takes each one's ``_identity`` as read."""
    spec = env.get(ENV_EXTRA_FILES)
    if spec is None:
        return None
    import glob

    found: list[list[object]] = []
    for pattern in (p for p in spec.split(os.pathsep) if p):
        paths = []
        for match in sorted(glob.glob(pattern, recursive=True)):
            if os.path.isdir(match):
                paths += sorted(str(p) for p in Path(match).rglob("*") if p.is_file())
            else:
                paths.append(match)
        if not paths:
            found.append([pattern, "no match"])
        for path in paths:
            data, identity = _read_seen(path)
            if seen is not None:
                seen[path] = identity
            found.append([path, len(data), digest(data)])
    return found


class _Done(Exception):
    """The compile was served under another key (its read set's): the result."""

    def __init__(self, result: CompileResult) -> None:
        super().__init__("done")
        self.result = result


class _Unproven(Exception):
    """The compile ran, but what it read cannot be known: its files, not to be stored."""

    def __init__(self, reason: str, files: _Outputs) -> None:
        super().__init__(reason)
        self.files = files


def _unstored(
    cache: OpCache,
    soc: str,
    reason: str,
    made: _Unproven,
    staging: tuple[Path, int],
    seconds: float,
) -> CompileResult:
    """What a compile made that is not to be stored, in the staging folder (its path and
    handle: written through the handle, never into a folder put under its name);
    counted as uncacheable."""
    cache.record_uncacheable(soc, reason)
    folder, fd = staging
    files = {}
    for name, (data, bits) in made.files.items():
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(os.open(name, flags, 0o666, dir_fd=fd), "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), bits)
        files[name] = folder / name
    return CompileResult("miss", "", files, seconds, str(made))


class _OpcTrace:
    """An opc line whose key holds what the compile read (``readset.py``).

    The key's ``reads`` part is the digest of the newest remembered read set
    that still holds; with none, "unknown": a key never stored, whose compile
    (one at a time, under its lock) is traced and then stored under the key
    of what it read.
    """

    def __init__(
        self,
        strace: str,
        memo_key: str,
        notes: LocalStore | None,
        make_request: Callable[[str | None], OpRequest],
        folders: Callable[[], tuple[list[str], list[str]]],
    ) -> None:
        from . import readset

        self.strace = strace
        self.memo_key = memo_key
        self._make_request = make_request
        self.memo = readset.Memo(notes)
        # (left out of a read set, kept in it): found when a miss is traced, as a hit
        # needs neither (finding them lists the toolkit's and Python's folders).
        self.folders = folders

    def request(self, reads: ReadSet | None) -> OpRequest:
        return self._make_request(reads.digest if reads is not None else "unknown")

    def compile(
        self, cache: OpCache, command: _WrappedCommand, staging: Path, staging_fd: int
    ) -> CompileResult:
        import time

        known = self.memo.matching(self.memo_key)
        traced = _TracedCommand(self, command, cache, known, staging)
        started = time.perf_counter()
        try:
            return cache.compile(self.request(known), traced, staging)
        except _Done as done:
            return done.result
        except _Unproven as e:
            seconds = time.perf_counter() - started
            soc = self.request(None).soc_version
            return _unstored(cache, soc, f"opc: {e}", e, (staging, staging_fd), seconds)


class _TracedCommand:
    """An opc compile under strace; stored under the key of what it read."""

    def __init__(
        self,
        trace: _OpcTrace,
        command: _WrappedCommand,
        cache: OpCache,
        known: ReadSet | None,
        staging: Path,
    ) -> None:
        self.name = command.name
        self._trace = trace
        self._command = command
        self._cache = cache
        self._known = known
        self._staging = staging  # (where the cache builds: its out_dir)

    def fingerprint(self) -> str:
        return self._command.fingerprint()

    def compile(self, request: OpRequest, workdir: Path) -> None:
        import tempfile
        import time

        from . import readset

        trace, out = self._trace, self._staging
        if self._known is None:
            known = trace.memo.matching(trace.memo_key)
            if known is not None:  # traced by another process while this one waited
                again = _TracedCommand(trace, self._command, self._cache, known, out)
                raise _Done(self._cache.compile(trace.request(known), again, out))
        trace_dir = tempfile.mkdtemp(prefix=".opcache-trace", dir=out)
        try:
            started = time.time_ns()
            try:
                self._command.compile(
                    request,
                    workdir,
                    trace=(trace.strace, trace_dir),
                )
            except _ToolFailed as e:
                if readset.traced(trace_dir):
                    raise  # opc's own failure
                # strace could not start it (ptrace refused in a container...): as it is.
                said = e.stderr.decode(errors="replace").strip().splitlines()
                self._command.compile(request, workdir)
                reason = f"strace cannot trace here ({said[0] if said else e})"
                log.warning("opc: %s: opc calls are not cached", reason, topic="opc-strace")
                raise _Unproven(reason, _read_outputs(workdir)) from None
            try:
                exclude, keep = trace.folders()
                # (opcache's staging, where the outputs go: no input)
                reads = readset.record(trace_dir, started, [*exclude, str(out)], keep)
            except readset.Unprovable as e:
                raise _Unproven(str(e), _read_outputs(workdir)) from None
        finally:
            fsutil.remove_tree(trace_dir, ours=True)
        trace.memo.remember(trace.memo_key, reads)
        if self._known is not None and reads.digest == self._known.digest:
            return  # stored under this key
        seconds = (time.time_ns() - started) / 1e9
        made = _Made(self.name, self.fingerprint(), _read_outputs(workdir), seconds)
        raise _Done(self._cache.compile(trace.request(reads), made, out))


class _Made:
    """A compiler whose compile is done: it hands over the files made."""

    def __init__(self, name: str, fingerprint: str, files: _Outputs, seconds: float) -> None:
        self.name = name
        self._fingerprint = fingerprint
        self._files = files
        self.compile_seconds = seconds  # the compile's, not the hand-over's (stats' time saved)

    def fingerprint(self) -> str:
        return self._fingerprint

    def compile(self, request: OpRequest, workdir: Path) -> None:
        for name, (data, bits) in self._files.items():
            (workdir / name).write_bytes(data)
            os.chmod(workdir / name, bits)  # (kept as the compile made it: an entry's mode)


def _read_outputs(workdir: Path) -> _Outputs:
    """The files a compile left in ``workdir``: their bytes and permission bits."""
    outputs = {}
    for entry in os.scandir(workdir):
        if entry.is_file(follow_symlinks=False):
            bits = entry.stat(follow_symlinks=False).st_mode & 0o777
            outputs[entry.name] = (Path(entry.path).read_bytes(), bits)
    return outputs


def _opc_names(param: bytes, main_func: str | None) -> tuple[str, str]:
    """(op_type, op_name) for op_debug_list, from the parameter JSON where it says."""
    try:
        data = _json.loads(param)
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
    import time

    from .compilers.cann import (
        custom_opp_digest,
        find_toolkit,
        keyed_environment,
        toolkit_fingerprint,
    )

    given = _op_compiler_flags(argv[1:])
    flags = {name: value for name, (value, _) in given.items()}
    for needed in ("op_params_dir", "soc_version", "output"):
        if not flags.get(needed):
            raise Uncacheable(f"op_compiler: no --{needed}")
    params = Path(flags["op_params_dir"] or "")
    if not params.is_dir():
        raise Uncacheable(f"op_compiler: {params} is not a folder")
    # Before any file of the key is read: one written since (a generator's FORCE rule
    # truncating it and writing the same bytes) may have been read empty by
    # op_compiler, though its bytes are the same again when settled() looks.
    started = time.time_ns()
    info_seen: dict[str, tuple[int, ...]] = {}
    op_info = _op_info(params, info_seen)
    tool = _which(argv[0], env)
    home, found, _ = find_toolkit(env, "op_compiler")
    if found is None or os.path.realpath(found) != os.path.realpath(tool):
        home = Path(os.path.realpath(tool)).parent.parent  # <toolkit>/bin/op_compiler
    keyed = {n: v for n, v in flags.items() if n not in _OP_COMPILER_UNKEYED}
    custom_stats: dict[str, os.stat_result] = {}
    attrs: dict[str, object] = {
        "flags": sorted(keyed.items()),
        "op_info": op_info,
        # What its operators' implementations read: the environment opc's key holds,
        # and the custom operator packages (their tiling libraries, their sources).
        "env": keyed_environment(env),
        "custom_opp": custom_opp_digest(env, home, custom_stats) or "none",
    }
    custom_seen = {path: _identity(st) for path, st in custom_stats.items()}
    extra_seen: dict[str, tuple[int, ...]] = {}
    extra = _extra_files(env, extra_seen)
    if extra is not None:
        attrs["extra_files"] = extra
    try:
        request = OpRequest(
            op_type="static_kernel", soc_version=flags["soc_version"] or "", attrs=attrs
        )
    except ValueError as e:
        raise Uncacheable(f"op_compiler: {e}") from None
    notes = None
    if base.mode != "disable":
        notes = LocalStore(base.root, modes=fsutil.modes_for(base.shared_group))
    fingerprint = toolkit_fingerprint("op_compiler", tool, home, env, notes)

    def command(workdir: Path) -> list[str]:
        words = [w for name, (_, spelled) in given.items() if name != "output" for w in spelled]
        return [argv[0], *words, "-o", str(workdir)]

    def settled() -> str | None:
        """What of the key changed while it ran: the op-info, the custom packages,
        the extra files (an install or an edit meanwhile, the same bytes or others).
        The files are walked and read again too: a file added is no file read."""
        try:
            if not _unchanged_since(info_seen, started) or _op_info(params) != op_info:
                return f"op_compiler: {params} changed while it ran"
            if (
                not _unchanged_since(custom_seen, started)
                or (custom_opp_digest(env, home) or "none") != attrs["custom_opp"]
            ):
                return "op_compiler: a custom operator package changed while it ran"
            if not _unchanged_since(extra_seen, started) or _extra_files(env) != extra:
                return f"op_compiler: a file of {ENV_EXTRA_FILES} changed while it ran"
        except (Uncacheable, OSError) as e:
            return f"op_compiler: what it read cannot be read again ({e})"
        return None

    return Plan(
        request=request,
        fingerprint=fingerprint,
        command=command,
        output_dir=Path(fsutil.absolute(flags["output"] or ".")),
        executables=(".run",),
        settled=settled,
        flat_outputs=True,
    )


def _op_info(params: Path, seen: dict[str, tuple[int, ...]] | None = None) -> list[list[object]]:
    """Every op-info file under ``params``, by name and contents (the names are the op
    list's order); ``seen`` takes each one's ``_identity`` as read.  Uncacheable for
    anything else there that op_compiler may read and the key could not hold: a link
    to a folder, a FIFO, a device, a dangling link."""
    found: list[list[object]] = []
    for top, folders, files in os.walk(params):
        folders.sort()
        for name in sorted(files + [f for f in folders if os.path.islink(f"{top}/{f}")]):
            path = os.path.join(top, name)
            if not os.path.isfile(path):  # (a link to a file is keyed by its contents)
                raise Uncacheable(f"op_compiler: {path} is not a file (a link to a folder?)")
            data, identity = _read_seen(path)
            if seen is not None:
                seen[path] = identity
            found.append([os.path.relpath(path, params), len(data), digest(data)])
    return found


# -- C compilers ------------------------------------------------------------------

# Flags that take their value as the next argument when not glued to it.
_CC_VALUE_FLAGS = {"-o", "-I", "-D", "-U", "-x", "-isystem", "-iquote", "-idirafter", "-MF"}
_CC_VALUE_FLAGS |= {"-MT", "-MQ", "-include", "-mllvm"}
_CC_INCLUDE_DIRS = ("-I", "-isystem", "-iquote", "-idirafter")
_CC_SYSTEM_DIRS = ("-isystem", "-idirafter")  # (a header found there shows no warnings)
_CC_KEY_PREFIXES = ("-D", "-U", "-O", "-std=", "-f", "-m", "-W", "-g", "-x", "-pedantic")
_CC_KEY_EXACT = {"-w", "-pipe", "-ansi", "-pthread"}
_CC_UNPREDICTABLE = ("-fprofile-", "-fauto-profile", "-save-temps", "-Wp,", "-Wa,", "-Wl,")
# (gcc reads <object>.gcda with it, named after -o: a private folder's finds none)
_CC_UNPREDICTABLE += ("-fbranch-probabilities",)
# Flags that make gcc write a file beside the object (.dwo, .su, .gcno, .ci,
# dumps, reports, SARIF/JSON diagnostics): the compile runs in a private folder
# and a hit restores the object alone, so the file would be missing.
_CC_SIDE_FILES = ("-gsplit-dwarf", "-fstack-usage", "-fdump-", "-fcallgraph-info")
_CC_SIDE_FILES += ("-ftest-coverage", "-fsave-optimization-record")
_CC_SIDE_FILES += ("-fdiagnostics-format=sarif-file", "-fdiagnostics-format=json-file")
_CC_SIDE_FILES += ("-fdiagnostics-add-output=",)
# (clang's: <object>.json, an optimization record, the driver's process stats)
_CC_SIDE_FILES += ("-ftime-trace", "-foptimization-record-file=", "-fproc-stat-report")
# Flags naming a file whose contents change the output (a plugin, clang's
# sanitizer, coverage and XRay lists, old spellings too): the file's digest
# joins the key.  clang lists some of them in its -M output, not all.  Any
# other flag keyed by its text whose value names a file is uncacheable.
_CC_FILE_FLAGS = ("-fplugin=", "-fpass-plugin=", "-fsanitize-ignorelist=", "-fsanitize-blacklist=")
_CC_FILE_FLAGS += ("-fsanitize-system-ignorelist=", "-fsanitize-coverage-allowlist=")
_CC_FILE_FLAGS += ("-fsanitize-coverage-ignorelist=", "-fsanitize-coverage-whitelist=")
_CC_FILE_FLAGS += ("-fsanitize-coverage-blacklist=", "-fxray-attr-list=")
_CC_FILE_FLAGS += ("-fxray-always-instrument=", "-fxray-never-instrument=")
# Flags making clang read files no -M listing names (modules and their maps, which
# a header made later turns on; an include search beside every including file;
# a sections list), or write its own command line (opcache's, with the build
# folder's -o) into the object.  ccache refuses modules too.
_CC_UNLISTED_READS = ("-fmodules", "-fcxx-modules", "-fmodule-file", "-fprebuilt-module-path")
_CC_UNLISTED_READS += ("-fimplicit-module-maps", "-fms-compatibility")
_CC_UNLISTED_READS += ("-fbasic-block-sections=list=",)
_CC_RECORDS_ITS_COMMAND = ("-frecord-command-line", "-grecord-command-line")
# (clang's spellings of them; gcc's own records its switches without -o: kept)
_CLANG_RECORDS_ITS_COMMAND = ("-frecord-gcc-switches", "-grecord-gcc-switches")
# clang's switches between its own assembler and an external one (the last given
# counts).  The external one is the first <triple>-as or as in its program folders,
# then on PATH, for the target its flags give: more names and places than the key
# can hold, so such a compile runs uncached.
_CLANG_INTEGRATED_AS = {
    "-fintegrated-as": True,
    "-integrated-as": True,
    "-fno-integrated-as": False,
    "-no-integrated-as": False,
}
_CC_NOT_A_COMPILE = {"-E": "preprocess only", "-S": "assembly output", "-M": "dependencies only"}
_CC_NOT_A_COMPILE |= {"-MM": "dependencies only", "-fsyntax-only": "no output"}
# The flags of CANN's device compilers (bisheng, ccec), keyed and passed as
# they are: --cce-aicore-arch=, --cce-aicore-only, --cce-auto-sync[=off], ...
# (kernel lines of CANN's ops builds), --npu-arch=, --enable-simt and
# --asc-aicore-lang (asc-devkit's cmake/asc/asc_modules/CMakeASCInformation.cmake),
# --run-mode= (its CPU debug mode).  -x cce / -x asc and -mllvm <opt> are keyed
# as every C compiler's -x and -m flags are.
_ASCEND_PREFIXES = ("--cce-", "--npu-arch=", "--run-mode=")
_ASCEND_SWITCHES = {"--enable-simt", "--asc-aicore-lang"}
_ASCEND_SOURCES = (".asc", ".cce")  # (CMake's ASC language: .asc)


def _header_kinds(headers: Sequence[str], folders: Sequence[tuple[str, str]]) -> list[str]:
    """For each header as the preprocessor named it, the flag of the include folder it
    lies in (``-I``, ``-isystem``...; the deepest folder where several hold it), or "".

    Compared as text, ``./`` and doubled slashes left out (gcc names ``-I./inc``'s
    headers ``inc/h.h``).  A folder given as a system folder and as another is a
    system folder (gcc drops the other)."""
    kind_of: dict[str, str] = {}
    for flag, place in folders:
        folder = os.path.normpath(place)
        if folder not in kind_of or flag in _CC_SYSTEM_DIRS:
            kind_of[folder] = flag
    prefixes = [(flag, "" if f == "." else f.rstrip("/") + "/") for f, flag in kind_of.items()]
    kinds = []
    for header in headers:
        name = os.path.normpath(header)
        kind, depth = "", -1
        for flag, prefix in prefixes:
            inside = name.startswith(prefix) if prefix else not name.startswith("/")
            if inside and len(prefix) > depth and prefix != "/":
                kind, depth = flag, len(prefix)
        kinds.append(kind)
    return kinds


def _plan_cc(
    argv: Sequence[str], env: Mapping[str, str], memo: HeaderMemo, base_dir: Path | None = None
) -> Plan:
    args = list(argv[1:])
    # Set, even empty: gcc reads COMPILER_PATH= as "./" and runs ./as from it.
    for name in CC_SIDE_OUTPUT_ENVIRONMENT:
        if name in env:
            raise Uncacheable(f"cc: {name} is set")
    for name in CC_PROGRAM_ENVIRONMENT:
        if name in env:
            raise Uncacheable(f"cc: {name} is set (the programs gcc runs from it are not keyed)")
    for name in CC_ARGUMENT_ENVIRONMENT:
        if name in env:
            raise Uncacheable(f"cc: {name} is set (the flags it adds are not checked)")
    cwd = os.getcwd()
    apparent = _apparent_folder(env, cwd)
    # The folder as the compiler names it in debug info, when it lies under base_dir.
    relative_to = _under_base_dir(apparent, base_dir, cwd) if base_dir is not None else None
    if relative_to is not None:
        args = _relative_args(args, base_dir, cwd)  # type: ignore[arg-type]
    compile_only = False
    output: str | None = None
    sources: list[str] = []
    key_args: list[str] = []
    pass_args: list[str] = []  # what the -M run and the real compile both need
    dep_file: str | None = None
    want_deps = debug = lto = False
    has_target = False
    mllvm_before = ""  # the last -mllvm value: the option a bare value is given to
    flag_files: list[list[str]] = []  # [flag, the digest of the file it names]
    include_folders: list[tuple[str, str]] = []  # (-I, -isystem..., the folder), in order
    after_source: list[str] = []  # -x after the source: it applies to no input
    ascend = os.path.basename(argv[0]) in ASCEND_CC_NAMES
    known_sources = C_SOURCES + _ASCEND_SOURCES if ascend else C_SOURCES
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
        if arg.startswith("@") or (value is not None and value.startswith("@")):
            # (the driver reads @file in a flag's value too: every word is expanded)
            raise Uncacheable("cc: response files are not supported")
        if arg in _CC_NOT_A_COMPILE:
            raise Uncacheable(f"cc: {_CC_NOT_A_COMPILE[arg]} ({arg})")
        if arg.startswith(_CC_UNPREDICTABLE):
            raise Uncacheable(f"cc: {arg} makes the output unpredictable")
        if arg.startswith(("-march=", "-mtune=", "-mcpu=")) and arg.endswith("=native"):
            # The same flag names another CPU on another machine sharing the cache.
            reason = "depends on this machine's CPU (uncacheable, not expanded into the key)"
            raise Uncacheable(f"cc: {arg} {reason}")
        if arg.startswith(_CC_SIDE_FILES) or (arg.startswith("-fopt-info") and "=" in arg):
            raise Uncacheable(f"cc: {arg} writes a side file a hit could not give back")
        if arg.startswith(_CC_UNLISTED_READS):
            raise Uncacheable(f"cc: {arg} reads files the preprocessor's listing does not name")
        if arg in _CC_RECORDS_ITS_COMMAND:
            raise Uncacheable(f"cc: {arg} writes the compile's own command line into the object")
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
            flag = next(f for f in _CC_INCLUDE_DIRS if arg.startswith(f))
            place = value if value is not None else arg[len(flag) :]
            _an_include_folder(flag, place)
            include_folders.append((flag, place))
            pass_args += [arg, value] if value is not None else [arg]
        elif arg == "-include":
            pass_args += [arg, value or ""]
        elif not arg.startswith("-"):
            if not arg.endswith(known_sources):
                raise Uncacheable(f"cc: {arg} is not a C source")
            sources.append(arg)
        elif ascend and (arg in _ASCEND_SWITCHES or arg.startswith(_ASCEND_PREFIXES)):
            if "dump" in arg or arg.startswith("--cce-auto-sync-log"):
                # (--cce-dump-*, and where auto-sync inserted syncs: files beside the object)
                raise Uncacheable(f"cc: {arg} writes a side file a hit could not give back")
            _names_no_file(arg)
            key_args.append(arg)
            pass_args.append(arg)
        elif arg.startswith(_CC_FILE_FLAGS):
            flag_files.append([arg, _flag_file_digest(arg)])
            key_args.append(arg)
            pass_args.append(arg)
        elif arg.startswith("-x") and sources:
            # (gcc and clang apply -x to the inputs after it: it stays there)
            after_source += [arg, value] if value is not None else [arg]
        elif arg in _CC_KEY_EXACT or arg.startswith(_CC_KEY_PREFIXES):
            if arg.startswith("-f"):
                _names_no_file(arg)
            if arg == "-mllvm":
                _mllvm_reads_no_file(value or "", mllvm_before)
                mllvm_before = value or ""
            debug = debug or (arg.startswith("-g") and arg != "-g0")
            # (gcc's LTO objects name the folder and the headers' paths as debug info
            # does; clang's bitcode does not: kept only for gcc, below)
            lto = lto or (arg.startswith("-flto") and arg != "-fno-lto")
            words = [arg, value] if value is not None else [arg]
            key_args += words
            pass_args += words
        else:
            raise Uncacheable(f"cc: unsupported flag {arg}")
    for name in _INCLUDE_VARIABLES:
        for place in env.get(name, "").split(":"):
            _an_include_folder(name, place)
    if not compile_only:
        raise Uncacheable("cc: not a compile to an object (-c missing)")
    if len(sources) != 1:
        raise Uncacheable("cc: expected exactly one source")
    source = sources[0]
    if output is None:
        output = os.path.splitext(os.path.basename(source))[0] + ".o"
    if "-" in (output, dep_file):
        raise Uncacheable("cc: an output goes to stdout (-)")
    out_path = Path(fsutil.absolute(output))
    if not out_path.parent.is_dir():
        raise Uncacheable("cc: the output folder does not exist")
    import time

    # Before anything of the key is read: a file written since may have been read
    # half written (a generator truncating and writing it again) by cc -M or the
    # compiler, though its bytes are the same when opcache reads them.
    started = time.time_ns()
    source_data, source_seen = _read_seen(source)
    # The binary, and the name it is run by: clang++ compiles a .c as C++, and a
    # cross name (aarch64-linux-gnu-clang) picks another target (ccache keys it too).
    found = _which(argv[0], env)
    if is_script(found):
        # (Debian's c99-gcc, a bisheng wrapper: the compiler it runs, found on PATH or
        # through a variable, is not the script's identity)
        raise Uncacheable(f"cc: {found} is a script: the compiler it runs is not keyed")
    compiler_identity = file_identity(found, memo.store)
    compiler_identity += "\0" + os.path.basename(argv[0])
    config_folders = _config_folders(argv[0], found)
    config_files = _config_files(config_folders)
    if config_files:
        reason = f"clang may read the configuration file {config_files[0]} (not keyed)"
        raise Uncacheable(f"cc: {reason}")
    lto = lto and not config_folders
    # (gcc takes <place>.gch, clang <place>.pch first: a clang has config folders)
    pch_suffixes = (".gch", ".pch") if config_folders else (".gch",)
    integrated_as = True
    for arg in args:
        if config_folders and arg in _CLANG_RECORDS_ITS_COMMAND:
            raise Uncacheable(f"cc: {arg} writes the compile's own command line into the object")
        integrated_as = _CLANG_INTEGRATED_AS.get(arg, integrated_as)
    if config_folders and not integrated_as:
        raise Uncacheable(
            "cc: clang runs an external assembler (-fno-integrated-as), looked for in places"
            " and by names the key does not hold"
        )
    if config_folders:
        # clang takes C++ headers and start files from the newest GCC it finds: one
        # installed beside it later is another header list (direct mode's memo is
        # keyed by the identity too) and another object.
        compiler_identity += "\0" + "\0".join(_gcc_installations(found))
    keyed_names = CC_KEY_ENVIRONMENT + ASCEND_CC_KEY_ENVIRONMENT if ascend else CC_KEY_ENVIRONMENT
    inputs = memo.header_digests(
        argv[0], compiler_identity, pass_args, source, source_data, env, keyed_names,
        source_seen, started,
    )  # fmt: skip
    for place in inputs.paths:
        if place.startswith(("/dev/", "/proc/")):
            # (#include "/dev/stdin": the caller's stdin, which the compile does not get)
            raise Uncacheable(f"cc: it reads {place}, no file of sources (stdin, a device)")
    for place in [*inputs.paths, *inputs.absent, *inputs.passed]:
        # gcc takes <place>.gch, clang <place>.pch first, where it exists, for the
        # header it looks for there; cc -M names the header alone, so the key would
        # not hold it.
        for suffix in pch_suffixes:
            if not _absent(place + suffix):
                raise Uncacheable(f"cc: a precompiled header {place}{suffix} may be used")
    key_sources = {os.path.basename(source): source_data}
    attrs: dict[str, object] = {"args": key_args, "source": source, "headers": inputs.digests}
    if include_folders:
        # -I or -isystem decides whether a header's warnings show (and fail a -Werror
        # compile): the folders' kinds, and the kind of folder each header was found
        # in, join the key; their paths do not (the same sources elsewhere still hit).
        attrs["include_kinds"] = [flag for flag, _ in include_folders]
        attrs["header_kinds"] = _header_kinds(inputs.paths, include_folders)
    if flag_files:
        attrs["flag_files"] = flag_files
    if inputs.twins:
        read_as = [digest(source_data), *inputs.digests]
        hashes = dict(zip([source, *inputs.paths], read_as, strict=True))
        attrs["twins"] = _twin_classes(inputs.twins, hashes)
    if after_source:
        attrs["after_source"] = after_source
    search_dirs = _search_dirs(argv[0], compiler_identity, env, memo.store)
    if not config_folders:  # (gcc; clang reads no specs file)
        if search_dirs is None:
            raise Uncacheable(
                f"cc: {argv[0]} -print-search-dirs failed: where it looks for specs is unknown"
            )
        for place in cc_driver.specs_places(search_dirs):
            if not _absent(place):
                raise Uncacheable(f"cc: gcc may read the specs file {place} (not keyed)")
    programs = cc_driver.search_folders(search_dirs or {}, "programs")
    assembler = _path_assembler(argv[0], compiler_identity, programs, env, memo.store)
    if assembler is not None:
        attrs["assembler"] = assembler
    keyed_env = [(name, env[name]) for name in keyed_names if name in env]
    if keyed_env:
        attrs["env"] = repr(keyed_env)  # repr: text even for bytes of no encoding
    macros = {*inputs.macros, *_macros_in(source_data), *cc_driver.directives_in(source_data)}
    joined = os.fsencode(" ".join(args))
    if b"__has_include" in joined:
        raise Uncacheable("cc: __has_include in a flag: the places it looks are not known")
    macros.update(_macros_in(joined), cc_driver.directives_in(joined))
    for directive, why in cc_driver.FILE_DIRECTIVES.items():
        if directive in macros:
            raise Uncacheable(f"cc: a {directive} directive {why}")
    attrs |= _clock_key(argv[0], macros, env, [source, *inputs.paths])
    extra = []  # flags the key decides without holding them
    sanitized = any(a.startswith("-fsanitize=") for a in key_args)
    # A line table written by hand (.file, .loc in assembly or an asm string) is
    # debug info too: the assembler names the working folder in it, -g or not.
    debug = debug or not macros.isdisjoint(cc_driver.LINE_DIRECTIVES)
    if debug or lto or want_deps or sanitized or not macros.isdisjoint(_PATH_MACROS):
        # Debug info, LTO objects, dependency files, __FILE__ and a sanitizer's source
        # locations name the headers where they were found (the same contents in
        # another folder is another object).
        attrs["header_paths"] = inputs.paths
    if want_deps and not has_target:
        # The dependency file names the object as its target (-MQ output below):
        # another -o of the same compile is another file (ccache keys it too).
        attrs["dep_target"] = output
    if debug or lto or want_deps:
        # Debug info, LTO objects and dependency files name folders: the key must
        # too, as the compiler names them.  Under base_dir the paths are relative,
        # and debug info names the folder "." (gcc's LTO objects name it whole).
        attrs["cwd"] = apparent if relative_to is None or lto else "."
        attrs["include_args"] = pass_args
        if debug and relative_to is not None:
            extra.append(f"-fdebug-prefix-map={relative_to}=.")  # first: the user's maps win
    if _colour_wanted(argv[0], args, env):
        extra.append("-fdiagnostics-color")  # replayed without colour where it cannot show
    outputs = {"object": out_path}
    if want_deps:
        dep_path = dep_file or _dep_file_of(output)
        outputs["deps"] = Path(fsutil.absolute(dep_path))
    for path in outputs.values():
        # -o /dev/null (configure scripts) or a link: restoring would replace it.
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
            raise Uncacheable("cc: an output is not a regular file")
    request = OpRequest(op_type="cc", soc_version=HOST_CHIP, attrs=attrs, sources=key_sources)

    def command(workdir: Path) -> list[str]:
        out = [argv[0], *extra, *pass_args, "-c", source, *after_source]
        out += ["-o", str(workdir / "object")]
        if want_deps:
            out += [a for a in key_args if a in ("-MD", "-MMD")]
            out += ["-MF", str(workdir / "deps")]
            if not has_target:  # (quoted for make, as the driver's own target is)
                out += ["-MQ", output]
            out += _target_args(key_args)
        return out

    read = dict(zip([source, *inputs.paths], [source_seen, *inputs.seen], strict=True))

    def settled() -> str | None:
        # A file rewritten or a header made while the compiler ran (a generator
        # still writing, the same bytes or others): the object may hold other
        # contents than the key says.
        if (
            not _unchanged_since(read, started)
            or not all(_absent(path) for path in inputs.absent)
            or not all(_no_file(path) for path in inputs.passed)
        ):
            return "cc: a file it read changed during the compile"
        return None

    return Plan(
        request=request,
        fingerprint=compiler_identity,
        command=command,
        outputs=outputs,
        settled=settled,
        explain_names={
            "headers": [os.path.abspath(path) for path in inputs.paths],
            "absent": [os.path.abspath(path) for path in inputs.absent],
        },
    )


def _config_folders(invoked: str, found: str) -> list[str]:
    """Where a clang-based driver looks for its configuration files (flags it adds to
    every compile): the folder of its real binary and of the name it is run by.
    Empty for gcc, which reads no such file."""
    real = os.path.realpath(found)
    if "clang" not in os.path.basename(real) and os.path.basename(invoked) not in ASCEND_CC_NAMES:
        return []
    return list(dict.fromkeys((os.path.dirname(real), os.path.dirname(os.path.abspath(found)))))


def _config_files(folders: list[str]) -> list[str]:
    """Every ``*.cfg`` in ``folders``: each may be one clang reads.  Which names it
    reads depends on its version, the name it is run by and the target its flags
    give (clang 14 run as ``x86_64-linux-gnu-clang-14 -m32``:
    ``i386-linux-gnu-clang.cfg``, ``i386.cfg``, ``x86_64-linux-gnu-clang.cfg``,
    ``x86_64-linux-gnu.cfg``; clang 16 ``<triple>-clang.cfg``, ``clang.cfg``,
    ``<triple>.cfg``), so any is taken as read: one listing per folder."""
    files = []
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError as e:
            raise Uncacheable(
                f"cc: cannot list {folder} for clang's configuration files ({e.strerror or e})"
            ) from None
        files += [os.path.join(folder, name) for name in sorted(names) if name.endswith(".cfg")]
    return files


def _gcc_installations(found: str) -> list[str]:
    """Every GCC installation a clang run as ``found`` may choose from: the version
    folders under ``lib*/gcc*/<triple>/`` of the prefix above the folder it is run
    from (clang's InstalledDir), of its real binary's, and of ``/usr``; and what
    Gentoo's gcc-config files, which pick one, are now."""
    prefixes = (
        os.path.dirname(os.path.dirname(os.path.abspath(found))),
        os.path.dirname(os.path.dirname(os.path.realpath(found))),
        "/usr",
    )
    found_here = []
    for prefix in dict.fromkeys(prefixes):
        for lib in ("lib", "lib64", "lib32", "libx32"):
            for kind in ("gcc", "gcc-cross"):
                folder = os.path.join(prefix, lib, kind)
                for triple in _names(folder):
                    versions = _names(os.path.join(folder, triple))
                    found_here += [os.path.join(folder, triple, v) for v in versions]
    # Gentoo's gcc-config: clang takes the installation its files name (LDPATH); each
    # file as it is now (a write moves its ctime), a dangling link (.NATIVE) as none.
    places = (os.path.join(_GENTOO_GCC_CONFIG, name) for name in _names(_GENTOO_GCC_CONFIG))
    found_here += filter(None, map(_program_held, places))
    return sorted(found_here)


_GENTOO_GCC_CONFIG = "/etc/env.d/gcc"


def _names(folder: str) -> list[str]:
    """The names in ``folder``; none when it is not there or cannot be listed."""
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _dep_file_of(output: str) -> str:
    """Where ``-MD`` without ``-MF`` writes: the output's name, its last suffix made
    ``.d`` (gcc's and clang's rule: ``-o .o`` gives ``.d``, ``-o noext`` ``noext.d``)."""
    head, tail = os.path.split(output)
    dot = tail.rfind(".")
    return os.path.join(head, (tail[:dot] if dot >= 0 else tail) + ".d")


def _search_dirs(
    cc: str, identity: str, env: Mapping[str, str], store: LocalStore | None
) -> dict[str, str] | None:
    """What ``cc -print-search-dirs`` says, by line (``install``, ``programs``,
    ``libraries``); None if it fails.  Asked once per compiler and
    ``LIBRARY_PATH`` (which the start-file folders begin with)."""
    asked = [identity, env.get("LIBRARY_PATH")]  # (None: unset; "" reads ./ as a folder)
    said = _compiler_says(cc, "-print-search-dirs", asked, env, store)
    if said is None:
        return None
    return cc_driver.search_dirs(os.fsdecode(said))


def _compiler_says(
    cc: str, flag: str, asked: list[str | None], env: Mapping[str, str], store: LocalStore | None
) -> bytes | None:
    """What ``cc flag`` prints (None if it fails), asked once per ``asked`` (the
    compiler's identity and what else moves the answer) and remembered in the
    cache's notes: a hit runs no compiler."""
    memo_key = digest(canonical_json([flag, *asked]))
    said = store.read_note("asked", memo_key[:2], memo_key) if store else None
    if said is not None:
        return said
    import subprocess  # (not on a hit: a hit's start-up is its cost)

    try:
        done = subprocess.run([cc, flag], capture_output=True, env=env, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Uncacheable(f"cc: cannot run {cc} {flag} ({e})") from None
    if done.returncode != 0:
        return None
    if store is not None:
        with contextlib.suppress(OSError):
            store.write_note(done.stdout, "asked", memo_key[:2], memo_key)
    return done.stdout


def _path_assembler(
    cc: str, identity: str, programs: list[str], env: Mapping[str, str], store: LocalStore | None
) -> str | None:
    """The identity of the assembler gcc runs: the one PATH picks, or its own.

    ``cc -print-prog-name=as`` names a bare ``as`` when the compiler has none
    of its own (a distribution's gcc): then PATH picks it, and another one
    earlier on PATH (binutils of a module or a conda environment) makes
    another object.  The compiler looks in its own ``programs`` folders
    (``-print-search-dirs``) first: what the ``<target>-as`` and ``as`` of each
    hold, one ``stat`` each, joins what the answer is remembered by with the compiler,
    so an ``as`` installed there later (binutils put in the compiler's own
    prefix) is asked about again.
    """
    # (COMPILER_PATH and GCC_EXEC_PREFIX move where gcc looks for its own)
    asked = [identity, *(env.get(n) for n in ("COMPILER_PATH", "GCC_EXEC_PREFIX"))]
    # In each folder gcc tries <its target>-as first (x86_64-linux-gnu-as), then as.
    machine = os.fsdecode(
        (_compiler_says(cc, "-dumpmachine", [identity], env, store) or b"").strip()
    )
    names = [f"{machine}-as", "as"] if machine else ["as"]
    places = (os.path.join(folder, name) for folder in programs for name in names)
    asked += filter(None, map(_program_held, places))
    name = (_compiler_says(cc, "-print-prog-name=as", asked, env, store) or b"").strip()
    if not name:
        return None
    if b"/" in name:
        # The compiler's own (a cross toolchain's): PATH does not choose it, but
        # binutils upgraded on their own make another object.
        return file_identity(os.fsdecode(name), store)
    return file_identity(_which(os.fsdecode(name), env), store)


def _program_held(place: str) -> str:
    """What a compiler looking for a program at ``place`` may find there, links followed:
    "" for nothing, else the place and what tells its file apart (any change moves
    the ctime) or the error."""
    try:
        st = os.stat(place)
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except OSError as e:
        return f"{place}: error {e.errno}"
    return f"{place}: {st.st_dev} {st.st_ino} {st.st_mode} {st.st_ctime_ns}"


def _flag_file_digest(arg: str) -> str:
    """The digest of the file a ``_CC_FILE_FLAGS`` flag names."""
    flag, path = arg.split("=", 1)
    if flag == "-fplugin" and "/" not in path:
        # gcc looks for NAME.so in its own plugin folder.
        raise Uncacheable(f"cc: {arg} names a plugin of gcc's own folder (not keyed)")
    if flag == "-fpass-plugin" and "/" not in path:
        raise Uncacheable(f"cc: {arg} names a plugin the library path finds (not keyed)")
    try:
        return digest(fsutil.read_input(path))
    except OSError as e:
        raise Uncacheable(f"cc: cannot read the file of {flag}= ({e.strerror})") from None


# LLVM options writing a file beside the object (statistics, remarks, dumps).
_MLLVM_WRITES = ("info-output-file", "pass-remarks-output", "debugify-export")
_MLLVM_WRITES += ("cfg-dot-filename-prefix", "stats-json")


def _mllvm_reads_no_file(value: str, before: str) -> None:
    """Uncacheable when an ``-mllvm`` value names a file (``-opt=FILE``, or ``FILE``
    alone after ``-mllvm -opt``: LLVM takes an option's value as the next word) or
    makes LLVM write one."""
    option = (value if value.startswith("-") else before).lstrip("-").partition("=")[0]
    if option in _MLLVM_WRITES or "dump" in option:
        raise Uncacheable(f"cc: -mllvm {value} writes a side file a hit could not give back")
    try:
        _names_no_file(value if value.startswith("-") else "=" + value)
    except Uncacheable:
        raise Uncacheable(f"cc: -mllvm {value} names a file opcache does not key") from None


def _names_no_file(arg: str) -> None:
    """Uncacheable when a flag keyed by its text names a file by its value
    (``-fNAME=FILE``, ``-fNAME=KIND=FILE``): the compiler may read it, and its
    contents are not keyed.  A folder is allowed (``-fdebug-compilation-dir=.``)."""
    _, sep, value = arg.partition("=")
    if not sep:
        return
    for part in {value, *value.split("=")}:
        try:
            if part and not stat.S_ISDIR(os.stat(part).st_mode):
                raise Uncacheable(f"cc: {arg} names a file opcache does not key")
        except (OSError, ValueError):
            pass


def _clock_key(
    cc: str, macros: set[str], env: Mapping[str, str], files: list[str]
) -> dict[str, object]:
    """What the key needs for the clock macros the compile expands (ccache's rule).

    ``__DATE__``: the date, or SOURCE_DATE_EPOCH, which gcc uses instead of the
    clock for both ``__DATE__`` and ``__TIME__``; another compiler (clang before
    16 ignores it) keys the clock too.  ``__TIME__`` with no such epoch is
    uncacheable.  ``__TIMESTAMP__``: the modification time of every file read
    (it names the time of the file it is expanded in).  TZ joins, as local time
    is what these macros show.
    """
    import time

    out: dict[str, object] = {}
    epoch = env.get("SOURCE_DATE_EPOCH") or None
    honours_epoch = re.search(r"gcc|g\+\+", os.path.basename(os.path.realpath(cc))) is not None
    if "__TIME__" in macros and not epoch:
        raise Uncacheable("cc: __TIME__ without SOURCE_DATE_EPOCH")
    if "__TIME__" in macros and not honours_epoch:
        raise Uncacheable("cc: __TIME__ and a compiler not known to use SOURCE_DATE_EPOCH")
    if "__DATE__" in macros or "__TIME__" in macros:
        clock = None if epoch and honours_epoch else time.strftime("%Y-%m-%d")
        out["date"] = [epoch, clock, env.get("TZ")]
    if "__TIMESTAMP__" in macros:
        try:
            out["mtimes"] = [[path, int(os.stat(path).st_mtime)] for path in files]
        except OSError as e:
            raise Uncacheable(f"cc: __TIMESTAMP__ and a file with no time: {e}") from None
        out["mtimes_tz"] = env.get("TZ")
    return out


# Flags whose value is a path, glued to it ("" for a path on its own).
_PATH_PREFIXES = ("-I", "-isystem", "-iquote", "-idirafter", "-include", "-MF", "-MT", "-MQ", "-o")
_PATH_PREFIXES += ("",)
_COLOUR_FLAGS = ("-fdiagnostics-color", "-fno-diagnostics-color", "-fcolor-diagnostics")
_COLOUR_FLAGS += ("-fno-color-diagnostics",)


_INCLUDE_VARIABLES = (
    "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "OBJC_INCLUDE_PATH", "OBJCPLUS_INCLUDE_PATH",
)  # fmt: skip


def _an_include_folder(flag: str, place: str) -> None:
    """Uncacheable where an include folder given by ``flag`` is there but no folder.

    gcc drops such a place from its search list without a word, where it says
    it drops a missing one (which a hit checks is still missing): a FIFO or a
    file there that later becomes a folder of headers was never seen.  (clang
    reads a file there as a header map: the headers it names are in no listing.)
    """
    if place and os.path.exists(place) and not os.path.isdir(place):
        raise Uncacheable(f"cc: {flag} {place} is there but is not a folder")


def _apparent_folder(env: Mapping[str, str], cwd: str) -> str:
    """The working folder as gcc and clang name it (in debug info, LTO objects): $PWD
    when it is this folder under another name (a link on the way), as gcc's getpwd
    and LLVM's current_path take it; else ``cwd``."""
    pwd = env.get("PWD", "")
    try:
        if pwd.startswith("/") and os.path.samestat(os.stat(pwd), os.stat(cwd)):
            return pwd
    except OSError:
        pass
    return cwd


def _under_base_dir(apparent: str, base_dir: Path, cwd: str) -> str | None:
    """The working folder as the compiler names it (``apparent``) if under base_dir."""
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
    the working folder, the environment variables that join the compile's key).
    A remembered header list is used only while every header still has the
    contents it had then (same contents, same ``#include``s, same list) and
    every place the preprocessor looked for a header before the folder where
    it found it, or for a ``__has_include`` that failed, is still empty (a
    header created earlier on the include path).  Otherwise ``cc -M`` runs again.
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
        keyed: Sequence[str],
        source_seen: tuple[int, ...],
        started: int,
    ) -> CcInputs:
        """The headers ``source`` includes (in the order first read), with their digests;
        ``keyed``: the names of the environment variables that join the key;
        ``source_seen``: the source's ``_identity`` as read, after ``started``."""
        memo_key = digest(
            canonical_json(
                {
                    # 7: variants with negative lookups, macros, directives and twins;
                    # 8: none remembered from a file written as cc -M ran; 10: line
                    # directives, file directives and includes in any form
                    "format": 10,
                    "compiler": identity,
                    "args": pass_args,
                    "source": [source, digest(source_data)],
                    "cwd": os.getcwd(),
                    # repr: text even for bytes of no encoding (os.environ's surrogates)
                    "env": repr([env.get(name) for name in keyed]),
                }
            )
        )
        variants = self._recall(memo_key)
        for variant in variants:
            current = _current_digests(variant)
            if current is not None:
                return CcInputs(
                    variant["headers"], *current, variant["macros"], variant["absent"],
                    variant["passed"], variant["twins"],
                )  # fmt: skip
        found = _cc_headers(cc, pass_args, source, env)
        headers = [h for h in found.headers if h != source]
        seen: dict[str, tuple[int, ...]] = {}
        contents: dict[str, bytes] = {}
        for header in headers:
            contents[header], seen[header] = _read_seen(header)
        forced = [pass_args[i + 1] for i, a in enumerate(pass_args[:-1]) if a == "-include"]
        reads = {source: source_data, **contents}
        absent, present, passed, twins, known = _negative_lookups(found, reads, forced)
        for path in present:
            with contextlib.suppress(OSError):  # (gone or unreadable since: as gcc then finds it)
                if path not in contents:
                    contents[path], st = fsutil.read_input_stat(path)
                    seen[path] = _identity(st)
        named = [(*_macros_in(data), *cc_driver.directives_in(data)) for data in contents.values()]
        macros = sorted({m for names in named for m in names})
        paths = list(contents)
        digests = [digest(data) for data in contents.values()]
        # Only when the search list is known and every header was placed in it
        # can a hit check that no header has been created earlier on it.  And
        # only when no file was written since before cc -M ran: a header it read
        # may since include others (ccache's "too new" files).
        if found.searched and known and _unchanged_since({source: source_seen, **seen}, started):
            variant = {
                "headers": paths,
                "digests": digests,
                "absent": absent,
                "passed": passed,
                "macros": macros,
                "twins": twins,
            }
            self._remember(memo_key, [variant, *variants][: self._VARIANTS])
        return CcInputs(paths, digests, [seen[p] for p in paths], macros, absent, passed, twins)

    def _recall(self, memo_key: str) -> list[dict[str, list[str]]]:
        raw = self.store.read_note("direct", memo_key[:2], memo_key) if self.store else None
        try:
            variants = _json.loads(raw) if raw else []
        except ValueError:
            return []
        fields = ("headers", "digests", "absent", "passed", "macros", "twins")
        # (a path holding a NUL, which no system call takes, is a damaged note's)
        ok = isinstance(variants, list) and all(
            isinstance(v, dict)
            and all(
                isinstance(v.get(f), list)
                and all(isinstance(x, str) and "\0" not in x for x in v[f])
                for f in fields
            )
            and len(v["headers"]) == len(v["digests"])
            for v in variants
        )
        return variants if ok else []

    def _remember(self, memo_key: str, variants: list[dict[str, list[str]]]) -> None:
        if self.store is None:
            return
        try:
            data = json.dumps(variants).encode()
            self.store.write_note(data, "direct", memo_key[:2], memo_key)
        except OSError as e:
            log.debug("cannot remember the headers of %s: %s", memo_key, e)


class CcInputs:
    """The headers a C compile reads, their digests and identities as read
    (``_identity``), the macros in them that make the output depend on more
    than their contents (``_KEY_MACROS``), the places the include search found
    empty (``absent``), those it passed over holding no file (``passed``), and
    the once-only files read (the source too) whose contents another of them
    has (``twins``, ``_negative_lookups``)."""

    def __init__(
        self,
        paths: list[str],
        digests: list[str],
        seen: list[tuple[int, ...]],
        macros: list[str],
        absent: list[str],
        passed: list[str],
        twins: list[str],
    ) -> None:
        self.paths = paths
        self.digests = digests
        self.seen = seen
        self.macros = macros
        self.absent = absent
        self.passed = passed
        self.twins = twins


class _Found:
    """What ``cc -M -v`` says: the headers read; the include search list, its
    ``#include "..."`` folders (``quote``) then its ``#include <...>`` ones
    (``bracket``); the folders of the list that do not exist; whether the
    compiler printed its search list at all (``searched``)."""

    def __init__(
        self,
        headers: list[str],
        quote: list[str],
        bracket: list[str],
        absent: list[str],
        searched: bool,
    ) -> None:
        self.headers = headers
        self.quote = [d.rstrip("/") or "/" for d in quote]
        self.bracket = [d.rstrip("/") or "/" for d in bracket]
        self.absent = absent
        self.searched = searched


# Macros whose expansion is not in the files' contents: the time, a file's
# time, a file's path (C++20's source_location too).  Found as text (a name
# pasted together by ## is not).
_PATH_MACROS = ("__FILE__", "__FILE_NAME__", "__builtin_FILE", "__builtin_source_location")
_KEY_MACROS = ("__DATE__", "__TIME__", "__TIMESTAMP__", *_PATH_MACROS)


def _macros_in(data: bytes) -> list[str]:
    return [m for m in _KEY_MACROS if m.encode() in data]


def _current_digests(
    variant: dict[str, list[str]],
) -> tuple[list[str], list[tuple[int, ...]]] | None:
    """The headers' digests and identities (``_identity``) if every one still has the
    recorded contents and every recorded negative lookup still finds nothing, else
    None."""
    for path in variant["absent"]:
        if not _absent(path):
            return None
    if not all(_no_file(path) for path in variant["passed"]):
        return None
    digests, seen = [], []
    for path, want in zip(variant["headers"], variant["digests"], strict=True):
        try:
            data, st = fsutil.read_input_stat(path)
        except OSError:
            return None
        now = digest(data)
        if now != want:
            return None
        digests.append(now)
        seen.append(_identity(st))
    return digests, seen


def _absent(path: str) -> bool:
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False  # (cannot tell: not a place known to be empty)
    return False


# #include "name" (and its kin) looks beside the including file first;
# __has_include asks about a header without reading it.  Patterns, compiled (re
# caches them) only on a miss: compiling them cost every hit a third of a millisecond.
_QUOTED_INCLUDE = rb'(?m)^[ \t]*#[ \t]*(?:include|include_next|import)[ \t]*"([^"\n]+)"'
_COMPUTED_INCLUDE = rb"(?m)^[ \t]*#[ \t]*(?:include|include_next|import)[ \t]+[A-Za-z_]"
_HAS_INCLUDE = rb'__has_include(_next)?\s*\(\s*(?:"([^"\n]+)"|<([^>\n]+)>)\s*\)'
_COMPUTED_HAS_INCLUDE = rb'__has_include(?:_next)?\s*\(\s*[^"<\s]'
_HAS_INCLUDE_WRAPPER = (
    rb"(?m)^[ \t]*#[ \t]*define[ \t]+(\w+)\([ \t]*(\w+)[ \t]*\)[ \t]*"
    rb"__has_include(_next)?[ \t]*\([ \t]*\2[ \t]*\)[ \t]*$"
)
# (#define HAS __has_include: its uses are looked up as a wrapper's)
_HAS_INCLUDE_ALIAS = (
    rb"(?m)^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+__has_include(_next)?[ \t]*(?://[^\n]*)?$"
)
# What may name __has_include without asking for a header: a test of whether the
# compiler has it, a definition for one that has not.
_NOT_ASKING = (
    rb"\bdefined\s*\(?\s*__has_include(?:_next)?\b"
    rb"|(?m:^[ \t]*#[ \t]*(?:ifdef|ifndef|undef|define)[ \t]+__has_include(?:_next)?\b[^\n]*$)"
)
_HAS_INCLUDE_WORD = rb"(?<![A-Za-z0-9_])__has_include(?:_next)?(?![A-Za-z0-9_])"
# A string or character literal, or a comment (one scan: "logs/*.txt" opens none).
_LITERAL_OR_COMMENT = rb'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|/\*.*?\*/|//[^\n]*'


def _include_text(data: bytes) -> bytes:
    """``data`` as the preprocessor reads its include directives: lines continued by a
    backslash joined, comments blanked (string literals kept), ``%:`` and ``??=``
    starting a line read as ``#``.  ``#include /* why */ "x.h"``, ``%:include``,
    ``#inc\\<newline>lude`` and ``"x\\<newline>.h"`` are then plain directives the
    patterns read; read as they are, x.h made beside them later hit."""
    text = data
    if b"\\\n" in text or b"\\\r\n" in text:
        text = re.sub(rb"\\\r?\n", b"", text)
    if b"/*" in text or b"//" in text:
        # (one pass, left to right: a comment ends at its first */, a literal is kept)
        text = re.sub(_LITERAL_OR_COMMENT, _blank_comment, text, flags=re.S)
    if b"%:" in text or b"??=" in text:
        text = re.sub(rb"(?m)^([ \t]*)(?:%:|\?\?=)", rb"\1#", text)
    return text


def _blank_comment(found: re.Match[bytes]) -> bytes:
    """A comment ``_LITERAL_OR_COMMENT`` found as a blank; a literal as it is."""
    return found[0] if found[0][:1] in b"\"'" else b" "


def _negative_lookups(
    found: _Found, reads: dict[str, bytes], forced: list[str]
) -> tuple[list[str], list[str], list[str], list[str], bool]:
    """(places looked up and empty, files ``__has_include`` found, places looked up
    that hold no file (``_earlier_place``), the once-only files read that have the
    same contents as another (``_once_only``), whether a hit may go by the header
    list: every header lies in a folder of the search list or beside a file read,
    and no file an ``#include`` names may have been skipped as a once-only file's
    twin (``_skipped_twin``)) for a compile.

    A header found in folder k of the search list was first looked for in
    folders 0..k-1 (all of them: a quoted include, ``#include_next`` and a
    header under two folders of the list are all covered by taking every
    earlier folder); a quoted include was looked for beside its includer.
    Each such place that does not exist is recorded, as its first missing
    folder when one is (``A/sys`` stands for every ``A/sys/*.h``).
    """
    passed: set[str] = set()
    absent = set(found.absent)
    for name in forced:  # (an -include file is looked for in the working folder first)
        _earlier_place("", name, absent, passed)
    chain = found.quote + found.bracket
    names = {os.path.basename(header) for header in found.headers}
    places = [*chain, *{os.path.dirname(path) for path in reads}]
    known = True
    once = _once_only(reads)
    twins_by_size: dict[int, set[bytes]] = {}
    for path in once:
        twins_by_size.setdefault(len(reads[path]), set()).add(reads[path])
    listed = {_tidy(path) for path in reads}
    # header -> for each folder k of the list it lies in, the files cc -M did not
    # name in the folders before k (their indexes, their places)
    ways: dict[str, list[tuple[int, list[tuple[int, str]]]]] = {}
    for header in found.headers:
        placed = False
        for k, folder in enumerate(places):
            name = _name_under(header, folder)
            if name is None:
                continue
            placed = True
            if k < len(chain):
                names.add(name)
                before = []
                for j, earlier in enumerate(chain[:k]):
                    place = os.path.join(earlier, name)
                    there = _earlier_place(earlier, name, absent, passed)
                    if there is None or _tidy(place) in listed:
                        continue
                    if _may_be_twin(place, there.st_size, twins_by_size):
                        log.debug("%s may be a once-only file's twin, skipped", place)
                        known = False  # (_skipped_twin's case: cc -M runs each time)
                    else:
                        before.append((j, place))
                ways.setdefault(header, []).append((k, before))
        if not placed:
            log.debug("%s lies in no folder searched: its earlier places are not known", header)
            known = False
    present = []
    # Wrappers (fmt's "#define FMT_HAS_INCLUDE(x) __has_include(x)"): their uses
    # with a literal name are looked up as __has_include's are.
    wrappers = {
        name: next_
        for data in reads.values()
        if b"__has_include" in data
        for name, next_ in [
            *((name, next_) for name, _, next_ in re.findall(_HAS_INCLUDE_WRAPPER, data)),
            *re.findall(_HAS_INCLUDE_ALIAS, data),
        ]
    }
    reached = {_tidy(name) for name in forced}  # (found beside a file, not on the list)
    for path, data in reads.items():
        beside = os.path.dirname(path)
        text = _include_text(data)
        quoted_names = [os.fsdecode(raw) for raw in re.findall(_QUOTED_INCLUDE, text)]
        if re.search(_COMPUTED_INCLUDE, text):
            # A name a macro gives is not in the text: every name found, beside it.
            quoted_names += names
            reached.update(
                h for h in map(_tidy, found.headers) if _name_under(h, beside) is not None
            )
        reached.update(_tidy(os.path.join(beside, name)) for name in quoted_names)
        asked = _has_include_names(data, wrappers)
        for name in quoted_names:
            _earlier_place(beside, name, absent, passed)
        for next_, quoted, angled in asked:
            name = os.fsdecode(quoted or angled)
            for folder in [beside, *chain] if quoted else found.bracket:
                if _earlier_place(folder, name, absent, passed) is not None:
                    present.append(os.path.join(folder, name))
                    # _next searches after the includer's folder, which holds
                    # its own copy: every place of the list is taken.
                    if not next_:
                        break
    _search_changed(found, reads, ways, reached)
    if once:
        twin = _skipped_twin(found, reads, forced, twins_by_size, listed)
        if twin is not None:
            log.debug("%s may be a once-only file's twin, skipped: cc -M runs each time", twin)
            known = False
    alike: dict[bytes, list[str]] = {}
    for path in once:
        alike.setdefault(reads[path], []).append(path)
    twins = [path for group in alike.values() if len(group) > 1 for path in group]
    return sorted(absent), present, sorted(passed), twins, known


def _search_changed(
    found: _Found,
    reads: dict[str, bytes],
    ways: dict[str, list[tuple[int, list[tuple[int, str]]]]],
    reached: set[str],
) -> None:
    """Uncacheable when a header cc -M found in folder k of the search list has, in a
    folder before k where the preprocessor looked for it first, a regular file cc -M
    did not name (``ways``, by ``_negative_lookups``): made after cc -M ran, it is
    what the compile reads, and its object would be kept under the other header's
    key (and served once it is gone).

    Not when the header may have been reached otherwise: beside a file read
    (``reached``), under another name in a folder with nothing before it, by an
    ``#include_next`` of a file read in a folder from that one on (libstdc++'s
    ``<cstdlib>`` passes over its own ``stdlib.h``), or by an ``#include <...>``,
    where the place is an ``-iquote`` folder.
    """
    quote = len(found.quote)
    # (the folders of the files read that hold an #include_next: it looks past them)
    next_from = {
        k for header, at in ways.items() if b"include_next" in reads.get(header, b"") for k, _ in at
    }
    for header, at in ways.items():
        if _tidy(header) in reached:
            continue
        passed_over = []
        for k, before in at:
            unexplained = [
                place
                for j, place in before
                if not j < quote <= k and not any(j <= i < k for i in next_from)
            ]
            if not unexplained:
                break
            passed_over.append(unexplained[0])
        else:
            if passed_over:
                raise Uncacheable(
                    f"cc: {passed_over[0]} is before {header} on the include path, which cc -M"
                    " named (made meanwhile?)"
                )


def _twin_classes(twins: list[str], digests: dict[str, str]) -> list[list[int]]:
    """Which of ``twins`` (once-only files read that have the same contents as another:
    ``CcInputs.twins``) the compilers take for one file, the second skipped: for each,
    the first of them with its contents and inode (clang's rule) and the first with
    its contents and mtime second (gcc's).  Their times and inodes are no key's: the
    same files in another checkout are the same compile."""
    firsts: dict[tuple[object, ...], int] = {}
    classes = []
    for i, path in enumerate(twins):
        try:
            st = os.stat(path)
        except OSError as e:
            raise Uncacheable(f"cannot read {path}: {e.strerror or e}") from None
        same_file = firsts.setdefault((digests[path], "inode", st.st_dev, st.st_ino), i)
        same_time = firsts.setdefault((digests[path], "mtime", st.st_mtime_ns // 10**9), i)
        classes.append([same_file, same_time])
    return classes


# A once-only file (#pragma once; any file, where an #import is read) is skipped
# where the preprocessor meets it again as another file: gcc takes a file of the
# same size, mtime (in seconds) and contents for the same, and cc -M does not name
# the second; clang takes a file of the same inode (a hard link) for the same, and
# names it.  Neither is in the contents the key holds.
_ONCE = rb'pragma\s+once\b|_Pragma\s*\(\s*"\s*once\b'
_IMPORT = rb"(?m)^[ \t]*#[ \t]*import\b"
_INCLUDE_NAME = rb'(?m)^[ \t]*#[ \t]*(include_next|include|import)[ \t]*(?:"([^"\n]+)"|<([^>\n]+)>)'


def _once_only(reads: dict[str, bytes]) -> list[str]:
    """The files read that may be once-only: those naming ``#pragma once``; every one,
    where an ``#import`` is read (gcc then compares a file it imports with every file
    read before)."""
    if any(b"import" in data and re.search(_IMPORT, data) for data in reads.values()):
        return list(reads)
    return [path for path, data in reads.items() if b"once" in data and re.search(_ONCE, data)]


def _skipped_twin(
    found: _Found,
    reads: dict[str, bytes],
    forced: list[str],
    twins_by_size: dict[int, set[bytes]],
    listed: set[str],
) -> str | None:
    """A file that an ``#include`` written in a file read (or an ``-include``) finds
    first where the preprocessor looks, that ``cc -M`` does not name (``listed``: the
    files read, tidied), and that has the contents of a once-only file read
    (``_may_be_twin``): gcc may have skipped it as that file's twin, and a hit would
    not see it edited (or the twin's mtime moved), which makes gcc read it.  Most
    such files are named by an ``#include`` in a branch not taken (``#ifdef _WIN32``)
    or passed over by an ``#include_next``, and have other contents: their changes
    make no other object, and their header lists are remembered as any other.
    """
    chain = found.quote + found.bracket
    wanted = [("", False, True, name) for name in forced]  # (the working folder first)
    for path, data in reads.items():
        wanted += [
            (os.path.dirname(path), directive == b"include_next", bool(quoted), name)
            for directive, quoted, angled in re.findall(_INCLUDE_NAME, data)
            for name in [os.fsdecode(quoted or angled)]
        ]
    for beside, next_, quoted, name in dict.fromkeys(wanted):
        for folder in [beside, *chain] if quoted else found.bracket:
            place = os.path.join(folder, name) if folder else name
            try:
                st = os.stat(place)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                continue
            if _tidy(place) not in listed and _may_be_twin(place, st.st_size, twins_by_size):
                return place
            if not next_:  # (_next looks on past its includer's own folder: every one)
                break
    return None


def _may_be_twin(place: str, size: int, twins_by_size: dict[int, set[bytes]]) -> bool:
    """Whether the file at ``place`` (of ``size`` bytes) may be one the compiler skipped
    as a once-only file's twin: it has the contents of one (``twins_by_size``, by
    their size: gcc compares the size first, then the bytes).  One that cannot be
    read is taken for one."""
    contents = twins_by_size.get(size)
    if contents is None:
        return False
    try:
        return fsutil.read_input(place, size) in contents
    except OSError:
        return True


def _has_include_names(
    data: bytes, wrappers: dict[bytes, bytes]
) -> list[tuple[bytes, bytes, bytes]]:
    """(``_next`` or not, a quoted name, an angled name) of each ``__has_include`` (or
    use of a wrapper of it) in ``data``; Uncacheable for one of a name a macro gives:
    where it looked is not in the text."""
    if b"__has_include" not in data and not wrappers:
        return []
    # (the wrappers' own definitions, tests of whether the compiler has it)
    text = re.sub(_HAS_INCLUDE_ALIAS, b"", re.sub(_HAS_INCLUDE_WRAPPER, b"", data))
    text = re.sub(_NOT_ASKING, b"", text)
    asked = re.findall(_HAS_INCLUDE, text)  # (in comments too: a look more, never one less)
    computed = re.search(_COMPUTED_HAS_INCLUDE, text) is not None
    if not computed and re.search(_HAS_INCLUDE_WORD, _code_only(re.sub(_HAS_INCLUDE, b"", text))):
        # Asked in a way the text does not show (through a macro, its name pasted): the
        # places it looked are not known.
        raise Uncacheable("cc: __has_include used where the header it asks for is not written")
    for name, next_ in wrappers.items():
        if name not in text:
            continue
        # (its definitions, the one for a compiler without __has_include too, are no use)
        used = re.sub(rb"(?m)^[ \t]*#[ \t]*define[ \t]+" + re.escape(name) + rb"\b.*$", b"", text)
        word = rb"\b" + re.escape(name) + rb"\s*\(\s*"
        uses = re.findall(word + rb'(?:"([^"\n]+)"|<([^>\n]+)>)\s*\)', used)
        asked += [(next_, quoted, angled) for quoted, angled in uses]
        computed = computed or re.search(word + rb'[^"<\s]', used) is not None
    if computed:
        raise Uncacheable("cc: __has_include of a name a macro gives")
    return asked


def _code_only(data: bytes) -> bytes:
    """``data`` with its comments taken out and its string and character literals
    emptied (a name there is no use of it)."""
    return re.sub(
        _LITERAL_OR_COMMENT, lambda m: b'""' if m[0][:1] in b"\"'" else b" ", data, flags=re.S
    )


def _earlier_place(
    folder: str, name: str, absent: set[str], passed: set[str]
) -> os.stat_result | None:
    """Note a place the preprocessor looked at: its ``_first_missing`` part joins
    ``absent``; a place that is there but holds no file it opens (a folder named as
    the header, a link to nothing) joins ``passed``: it may open it once that changes
    (``_no_file``).  The place's stat when it holds a regular file.

    Uncacheable when it holds another file: gcc and clang open a FIFO, a device or a
    link to /dev/null as a header (/dev/null an empty one), which opcache does not
    read (it may block) and a hit could not check.
    """
    missing = _first_missing(folder, name)
    if missing is not None:
        absent.add(missing)
        return None
    path = os.path.join(folder, name) if folder else name
    try:
        st = os.stat(path)
    except OSError:
        passed.add(path)  # (a link to nothing)
        return None
    if stat.S_ISDIR(st.st_mode):
        passed.add(path)
        return None
    if not stat.S_ISREG(st.st_mode):
        raise Uncacheable(f"cc: {path} is no regular file (the preprocessor would open it)")
    return st


def _no_file(path: str) -> bool:
    """Whether ``path`` holds no file the preprocessor would open (links followed): it
    passes over nothing and a folder, and opens anything else, /dev/null too."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return True


def _name_under(header: str, folder: str) -> str | None:
    """``header``'s name relative to ``folder`` if it lies there (None if not).

    ``cc -M`` drops a leading ``./`` and doubled slashes from a header's name
    while ``-v`` prints the folder as given (``-I./C``): both are tidied.  A
    ``..`` stays: ``<sub/../x.h>`` is looked for through ``sub`` in each
    folder, and found only where ``sub`` is there (normalised, its name was
    ``x.h``, and a folder holding ``x.h`` but no ``sub`` was taken for one it
    passed over, where making ``sub`` later gives another header).
    """
    path, place = _tidy(header), _tidy(folder)
    if place == "." and not path.startswith("/"):
        return path
    prefix = place if place.endswith("/") else place + "/"
    return path[len(prefix) :] if path.startswith(prefix) else None


def _tidy(path: str) -> str:
    """``path`` without doubled slashes, ``.`` parts or a trailing slash (``..`` kept)."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    root = "/" if path.startswith("/") else ""
    return root + "/".join(parts) or root or "."


def _first_missing(folder: str, name: str) -> str | None:
    """The first part of ``folder/name`` that does not exist (None: all of it exists)."""
    path = folder
    for part in name.split("/"):
        path = os.path.join(path, part) if path else part
        if part and _absent(path):
            return path
    return None


def _cc_headers(cc: str, pass_args: list[str], source: str, env: Mapping[str, str]) -> _Found:
    """Every file the preprocessor reads for ``source``, in the order ``cc -M`` lists
    them, and the include search list ``-v`` prints beside."""
    import subprocess

    done = subprocess.run(
        [cc, *pass_args, "-M", "-v", source],
        capture_output=True,
        env={**env, "LC_ALL": "C"},  # the search list in English, to be read
        check=False,
    )
    if done.returncode != 0:
        raise Uncacheable("cc: the preprocessor failed (the compile will report why)")
    rules = done.stdout.decode(errors="surrogateescape")
    if re.search(r"(?<!\\)\n(?=\S)", rules.strip()):
        # A compile for a host and its device (clang's offloading, a mixed bisheng
        # line): a preprocessor run, a rule and a search list each, which direct mode
        # does not read as one.
        raise Uncacheable("cc: a compile for more than one target (a rule each in cc -M)")
    headers = list(dict.fromkeys(cc_driver.make_prerequisites(rules)))
    return _Found(headers, *cc_driver.search_list(done.stderr.decode(errors="surrogateescape")))


# -- planning without running (opcache explain) ------------------------------------


def plan_command(
    argv: Sequence[str], settings: Settings, environ: Mapping[str, str] | None = None
) -> tuple[OpRequest, _WrappedCommand, list[str]]:
    """How ``opcache wrap`` would key ``argv``, without running it: (the request,
    the compiler whose name and fingerprint join the key, the files that are no
    longer as the last traced compile of this opc line read them).

    Planned as ``run`` plans it, past opcache's own links; Uncacheable, with
    the reason wrap would count, for a command it would not cache.  A C line's
    headers are listed by ``cc -M`` afresh: nothing is noted in the cache.  An
    opc line's key holds the remembered read set that still holds, as on a
    wrap; with none, the read set is unknown, and the last one's changed
    files say why.
    """
    from . import readset

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
        plan = _plan_opc(argv, env, settings)
    elif kind == "op_compiler":
        plan = _plan_op_compiler(argv, env, settings)
    else:
        plan = _plan_cc(argv, env, HeaderMemo(None), settings.base_dir)
    request, changed = plan.request, []
    if plan.trace is not None:
        trace = plan.trace
        known = trace.memo.matching(trace.memo_key)
        request = trace.request(known)
        last = trace.memo.recall(trace.memo_key)[:1] if known is None else []
        for item in last[0].items if last else []:
            path = item[0].rstrip("\0")  # (a link's target comes as path + NUL)
            if path not in changed and not readset.ReadSet([list(item)]).unchanged():
                changed.append(path)
    return request, _WrappedCommand(plan, kind, env), changed
