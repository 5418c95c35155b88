"""The ``opcache`` command line.

``opcache wrap`` runs once per compile command, so its path imports as little
as it can: its flags are parsed here by hand, and argparse, logging and the
other commands (``commands.py``) load only when something needs them.
"""

from __future__ import annotations

import os
import sys
import time

from . import _sigint_raises

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    import logging
    from collections.abc import Callable, Mapping, MutableMapping, Sequence
    from typing import NoReturn

    from .settings import Settings

EXIT_USAGE = 2
WRAP_USAGE = "wrap needs the command after '--': opcache wrap -- gcc -c k.c -o k.o"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Run as the program (``argv`` None), a command does not return: it leaves
    at once when done, and quietly on a Ctrl-C (see ``_leave``).
    """
    if argv is None:
        _environ_as_started(os.environ)
        # The quick hit first, before the imports of the full path (quickhit.py).
        _started.append(time.time())
        from . import quickhit

        status = quickhit.serve(sys.argv)
        if status is not None:
            _leave(lambda: status)
        from . import masquerade

        if masquerade.compiler_kind(sys.argv[0]):
            _leave(lambda: _masquerade(sys.argv))
        args = sys.argv[1:]
        _leave(lambda: _run(args))
    return _run(argv)


# What CPython sets LC_CTYPE to as it starts in a C or POSIX locale (PEP 538).
_COERCED = frozenset({"C.UTF-8", "C.utf8", "UTF-8"})


def _environ_as_started(environ: MutableMapping[str, str]) -> None:
    """Give LC_CTYPE back the value the program was started with (none, or its own).

    CPython in a C or POSIX locale (a container, a CI job, ``env -i``) sets
    LC_CTYPE to a UTF-8 locale in its own environment as it starts: every
    compiler opcache ran inherited it, and gcc wrote its messages with UTF-8
    quotes where the same command alone writes ASCII ones (and the key held a
    locale the caller never had).  The environment a process started with is
    ``/proc/self/environ``; it is read only when LC_CTYPE holds such a locale.
    """
    now = environ.get("LC_CTYPE")
    if now not in _COERCED:
        return
    try:
        with open("/proc/self/environ", "rb") as f:
            started = f.read()
    except OSError:
        return
    for item in started.split(b"\0"):
        if item.startswith(b"LC_CTYPE="):
            environ["LC_CTYPE"] = os.fsdecode(item[len(b"LC_CTYPE=") :])
            return
    del environ["LC_CTYPE"]


# When the program started (a memo's racy rule): a full wrap hit may leave a memo
# (the program's, not the library's: quickmemo.serving for a server's call).
_started: list[float] = []


def _leave(command: Callable[[], int]) -> NoReturn:
    """Run a command and exit without the interpreter's teardown.

    That teardown is about 6 ms of every ``opcache wrap``.  Exit handlers run
    and the standard streams are flushed first, as at any exit; only the
    freeing of modules and objects is skipped.  A Ctrl-C (SIGINT, which the
    compiler gets too) ends opcache the way it ends the compiler: quietly, by
    SIGINT once cleaned up, so the shell sees 130 and a shell loop stops.
    Before and after the command (imports, exit) it ends opcache at once,
    silently: the handler ``opcache/__init__.py`` sets first thing.
    """
    import atexit
    import contextlib

    interrupted = False
    try:
        try:
            _sigint_raises(True)  # the command cleans up on KeyboardInterrupt
            status = command()
        finally:
            _sigint_raises(False)
    except KeyboardInterrupt:
        interrupted, status = True, 130  # (the status should SIGINT not end us)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # (None: the descriptor was closed when Python started, `>&-`)
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            if stream is not None:
                stream.flush()
    if interrupted:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _run(argv: Sequence[str]) -> int:
    from . import masquerade
    from .errors import ConfigError, UsageError

    try:
        if argv[:1] == ["wrap"]:
            return _wrap_main(argv[1:])
        if argv and masquerade.compiler_kind(argv[0]):
            # ccache's spelling, `opcache gcc -c k.c`: a build's launcher or
            # ccache program (CMake's, ops-nn's gen_bisheng) takes opcache as it is.
            return _wrap_main(["--", *argv])
        from . import commands

        args = commands.parse(argv)
        if args is None:
            return EXIT_USAGE
        args.program = main  # (opcache server's workers run command lines as this does)
        return run_logged(args.verbose, lambda: args.func(args))
    except (UsageError, ConfigError) as e:
        print(f"opcache: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _wrap_main(argv: Sequence[str]) -> int:
    """``opcache wrap [-v] [cache flags] -- command...``"""
    from .errors import UsageError
    from .settings import ENV_VERBOSE, env_true

    argv = list(argv)
    own = argv[: argv.index("--")] if "--" in argv else argv
    if "-h" in own or "--help" in own:
        print(_wrap_help())
        return 0
    if "--" not in argv:
        raise UsageError(WRAP_USAGE)
    split = argv.index("--")
    command = argv[split + 1 :]
    if not command:
        raise UsageError("wrap: no command after '--'")
    verbose, flags = _parse_wrap_flags(argv[:split])
    verbose = verbose or env_true(os.environ, ENV_VERBOSE)
    return run_logged(verbose, lambda: _wrap_command(flags, command, verbose))


def _parse_wrap_flags(argv: list[str]) -> tuple[bool, dict[str, str]]:
    """(verbose, cache flags by name): ``--flag value`` or ``--flag=value``."""
    from .errors import UsageError
    from .settings import CACHE_FLAGS

    verbose, flags = False, {}
    args = iter(argv)
    for arg in args:
        if arg in ("-v", "--verbose"):
            verbose = True
            continue
        flag, eq, value = arg.partition("=")
        if flag not in CACHE_FLAGS:
            raise UsageError(
                f"wrap: unknown option {arg!r} (options: -v, {', '.join(CACHE_FLAGS)})"
            )
        if not eq:
            value = next(args, None)  # type: ignore[assignment]
            if value is None:
                raise UsageError(f"wrap: {flag} needs a value")
        flags[flag[2:]] = value
    return verbose, flags


def _wrap_help() -> str:
    from .settings import CACHE_FLAGS

    lines = [
        "usage: opcache wrap [-v] [cache options] -- COMMAND...",
        "",
        "Run a compile command (opc, or a C compiler) through the cache.",
        "",
        "  -v, --verbose         say what happened (hit, miss...), with the key and its parts",
    ]
    for flag, (metavar, text) in CACHE_FLAGS.items():
        lines.append(f"  {flag} {metavar}".ljust(40) + text)
    lines += [
        "",
        "Environment (for links named like a compiler, which take no flags): OPCACHE_DISABLE,",
        "OPCACHE_DIR, OPCACHE_MODE, OPCACHE_BASE_DIR, OPCACHE_VERBOSE; see docs/wrap.md.",
    ]
    return "\n".join(lines)


def _wrap_command(flags: Mapping[str, str | None], command: Sequence[str], verbose: bool) -> int:
    from . import masquerade, quickmemo, wrap
    from .settings import COMPILING_DEFAULT_MODE, cache_settings

    def settings_for(level: str | None, config: str | None) -> Settings:
        return cache_settings(flags, COMPILING_DEFAULT_MODE, level, config)

    # wrap.run resolves the cache flags alone first: a bad one is opcache's
    # error (ConfigError, exit 2) before anything runs.
    # -v says more than a quick hit would; Python 3.10's pathlib calls os.stat past
    # the Recorder (bound at its import), so a memo could miss what it read.
    started = quickmemo.serving or _started  # (a server started as the program too)
    wrap.last_hit.clear()  # (a server's worker serves one call after another)
    # Only a C compile's hit leaves a memo: opc's traced misses and checks stat
    # thousands of paths, which recording would only slow down.
    cc = masquerade.compiler_kind(command[0]) == "cc"
    if not started or not cc or verbose or sys.version_info < (3, 11):
        return wrap.run(command, settings_for)
    with quickmemo.Recorder() as recorder:
        status = wrap.run(command, settings_for)
    if status == 0 and wrap.last_hit and not recorder.warned:
        quickmemo.write_memo(sys.argv, recorder, wrap.last_hit.pop(), started[0])
    return status


def _masquerade(argv: Sequence[str]) -> int:
    """Started as a link named like a compiler: wrap the real one, later on PATH."""
    from .settings import ENV_VERBOSE, env_true

    verbose = env_true(os.environ, ENV_VERBOSE)
    return run_logged(verbose, lambda: _wrap_command({}, argv, verbose))


def run_logged(verbose: bool, func: Callable[[], int]) -> int:
    """Run a command with opcache's records on stderr; errors of the cache folder exit 1."""
    from . import _log
    from .errors import ConfigError, sentence

    stderr = _StderrLog(verbose)
    if verbose:
        stderr.install()
    else:
        # Without -v only warnings show: logging need not load unless one comes.
        _log.on_first_use(stderr.install)
    try:
        return func()
    except ConfigError as e:
        print(f"opcache: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `opcache stats --json | head`: the reader left; say nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        # The cache folder itself is unusable (not a folder, no permission...):
        # a maintenance command cannot work around that.
        print(f"opcache: error: {sentence(e)}", file=sys.stderr)
        return 1
    finally:
        _log.forget(stderr.install)
        stderr.remove()


class _StderrLog:
    """opcache's records on stderr as ``opcache: <level>: <message>``, for one command."""

    def __init__(self, verbose: bool) -> None:
        self._verbose = verbose
        self._installed: tuple[logging.Handler, int] | None = None

    def install(self) -> None:
        import logging

        class Formatter(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                return f"opcache: {record.levelname.lower()}: {record.getMessage()}"

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(Formatter())
        logger = logging.getLogger("opcache")
        self._installed = (handler, logger.level)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if self._verbose else logging.WARNING)

    def remove(self) -> None:
        """Undo ``install``: a second main() in one process must not print everything twice."""
        if self._installed is None:
            return
        import logging

        handler, level = self._installed
        logger = logging.getLogger("opcache")
        logger.removeHandler(handler)
        logger.setLevel(level)
        self._installed = None


if __name__ == "__main__":
    sys.exit(main())
