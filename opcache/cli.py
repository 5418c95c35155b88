"""The ``opcache`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from .errors import ConfigError
from .settings import Settings, check_soc_version, resolve_settings

EXIT_USAGE = 2


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one ``opcache: error:`` line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The ATC spellings of the cache options, shared by every command."""
    group = parser.add_argument_group("cache options (as ATC spells them)")
    group.add_argument("--op_compiler_cache_mode", metavar="MODE", help="enable, force or disable")
    group.add_argument("--op_compiler_cache_dir", metavar="DIR", help="cache folder")
    group.add_argument("--op_debug_level", metavar="N", help="0..4; not 0 bypasses the cache")
    group.add_argument("--op_debug_config", metavar="CFG", help="debug .cfg file")
    group.add_argument("--soc_version", metavar="SOC", help="one chip, e.g. Ascend910B1")


def _settings(args: argparse.Namespace) -> Settings:
    if args.soc_version is not None:
        check_soc_version(args.soc_version)
    return resolve_settings(
        op_compiler_cache_mode=args.op_compiler_cache_mode,
        op_compiler_cache_dir=args.op_compiler_cache_dir,
        op_debug_level=args.op_debug_level,
        op_debug_config=args.op_debug_config,
    )


def _cmd_config(args: argparse.Namespace) -> int:
    settings = _settings(args)
    data = settings.as_dict()
    if args.soc_version is not None:
        data["chip_dir"] = str(settings.chip_dir(args.soc_version))
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    sources = data.pop("sources")
    width = max(map(len, data))
    for name, value in data.items():
        origin = sources.get(name, "")
        text = "-" if value is None else str(value)
        print(f"{name:<{width}}  {text}" + (f"  ({origin})" if origin else ""))
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="opcache", description="An operator compile cache.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what opcache does")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    config = commands.add_parser("config", help="print every resolved setting and its source")
    _add_cache_flags(config)
    config.add_argument("--json", action="store_true", help="one JSON object")
    config.set_defaults(func=_cmd_config)
    return parser


def _setup_logging(verbose: bool) -> tuple[logging.Handler, int]:
    """Install the stderr handler; returns it and the level to restore after the run."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    logger = logging.getLogger("opcache")
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING)
    return handler, previous_level


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"opcache: {record.levelname.lower()}: {record.getMessage()}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    installed = None
    try:
        args = _build_parser().parse_args(argv)
        installed = _setup_logging(args.verbose)
        return args.func(args)
    except (_UsageError, ConfigError) as e:
        print(f"opcache: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        # A second main() in the same process must not print every warning twice.
        if installed is not None:
            logger = logging.getLogger("opcache")
            logger.removeHandler(installed[0])
            logger.setLevel(installed[1])


if __name__ == "__main__":
    sys.exit(main())
