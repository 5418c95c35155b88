"""The maintenance and batch commands: config, stats, age, clear, verify, cann,
compilers, compile and demo, parsed with argparse.

``opcache wrap`` is parsed in ``cli`` by hand: it runs once per compile command,
and argparse would cost it milliseconds it does not need.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from . import __version__, trust
from ._log import HeldWarnings
from .cache import AgingReport, OpCache, VerifyReport
from .errors import UsageError
from .request import check_soc_version
from .settings import (
    CACHE_FLAGS,
    COMPILING_DEFAULT_MODE,
    DEFAULT_MODE,
    INI_NAME,
    Settings,
    cache_settings,
    resolve_settings,
)
from .storage.cann_names import is_cann_chip
from .storage.local import BOOKKEEPING


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one ``opcache: error:`` line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _add_cache_flags(parser: argparse.ArgumentParser, flags: Sequence[str] = ()) -> None:
    """The ATC spellings of the cache options, shared by every command (``flags``: those only)."""
    group = parser.add_argument_group("cache options (as ATC spells them)")
    for flag, (metavar, text) in CACHE_FLAGS.items():
        if not flags or flag in flags:
            group.add_argument(flag, metavar=metavar, help=text)


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _settings(args: argparse.Namespace, default_mode: str = DEFAULT_MODE) -> Settings:
    return cache_settings(vars(args), default_mode)


def parse(argv: Sequence[str]) -> argparse.Namespace | None:
    """Parse one command line (not wrap): ``args.func(args)`` runs it (``cli`` runs
    it under ``run_logged``, with ``args.verbose``).  None when there is no command:
    the list of commands went to stderr.  UsageError for a mistake."""
    parser = _build_parser()
    if not argv:
        # As git does: the commands, not just "a command is required". On
        # stderr with the usage status: it is a mistake, and stdout stays clean.
        parser.print_help(sys.stderr)
        return None
    args = parser.parse_args(argv)
    if not args.soc_version:
        args.soc_version = None  # empty is unset, as for every other option
    return args


_REMOTE_COUNTERS = ("remote_hits", "remote_misses", "remote_stores", "remote_errors")


def _count(n: int, noun: str, plural: str = "") -> str:
    """``1 entry``, ``2 entries``: a number and its noun in agreement."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _cmd_config(args: argparse.Namespace) -> int:
    from .compilers import auto_choice

    settings = _settings(args)
    data = settings.as_dict()
    if args.soc_version:
        data["chip_dir"] = str(settings.chip_dir(args.soc_version))
    if settings.sources["mode"] == "default":
        data["mode_default"] = (
            f"{DEFAULT_MODE} here and in the library (ATC's default); "
            f"{COMPILING_DEFAULT_MODE} for opcache wrap, compile and demo"
        )
    name, why = auto_choice()
    data["compiler_auto"] = f"{name} ({why})"
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    sources = data.pop("sources")
    remote = data.pop("remote")
    data["remote"] = None if remote is None else remote.pop("url")
    for name, value in (remote or {}).items():
        data[f"remote_{name}"] = value
    width = max(map(len, data))
    for name, value in data.items():
        origin = sources.get(name, "")
        text = "-" if value is None else str(value)
        print(f"{name:<{width}}  {text}" + (f"  ({origin})" if origin else ""))
    return 0


def _open_cache(args: argparse.Namespace, changes: str | None = None) -> OpCache:
    """The cache the maintenance commands work on; it must exist and be readable.

    A cron job given a wrong path must not pass silently: a root that holds
    no cache is an error (exit 1) that says which root was read and why, and
    so is one this user cannot list (OSError: exit 1).  A command that
    ``changes`` the cache (what it does, for the message) needs more: the
    root's ``.opcache``, which every cache opcache has stored in holds.  A
    folder named as a chip may be (``src``) is no proof: a project, a home
    or another folder put under the root's name (by renames in a folder
    others may write in) would be written in, and ``verify`` made the
    ``.opcache`` that ``clear`` then took for a cache's.
    """
    settings = _settings(args)
    # Another user's link on the root's way is refused with one line (the store
    # refuses it again, on its own walk, wherever it would read or delete).
    walk = trust.resolve_root(settings.root)
    if walk.problem is not None:
        raise trust.UntrustedFolder(walk.problem)
    try:
        held = _holds_a_cache(Path(walk.path))
    except OSError as e:
        raise OSError(f"cannot read the cache folder {settings.root}: {e.strerror or e}") from None
    if not held:
        raise FileNotFoundError(f"no cache in {settings.root} ({_why_this_root(settings)})")
    if changes is not None and not _is_real_folder(Path(walk.path) / BOOKKEEPING, missing=False):
        raise FileNotFoundError(
            f"no cache in {settings.root}: it holds no {BOOKKEEPING} folder, as every cache "
            f"opcache has stored in does, so nothing in it is {changes}"
            + (
                " (for CANN's kernels there: opcache cann)"
                if (Path(walk.path) / INI_NAME).exists()
                else ""
            )
        )
    cache = OpCache(settings)
    if changes is not None:
        cache._store.makes_bookkeeping = False  # (checked above; one swapped in since: none)
    return cache


def _holds_a_cache(root: Path) -> bool:
    """True when ``root`` has op_cache.ini, opcache's bookkeeping or a chip folder (a
    real folder named as a chip is: ``src`` is, ``lost+found`` is not); OSError
    when it is there but cannot be listed."""
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any(
        e.name in (INI_NAME, BOOKKEEPING)
        or _is_chip_folder(e)
        or (is_cann_chip(e.name) and e.is_dir(follow_symlinks=False))  # (a shared folder's)
        for e in entries
    )


class _Chips:
    """The chip folders a maintenance command can work on, and those it cannot read.

    A folder this user cannot list would otherwise count as empty (``stats``
    0 entries) or be passed over, and the command would succeed: each is said
    on stderr, the others are worked on, and the command exits 1.  Without
    the bookkeeping folder, or the one chip asked for, nothing can be done
    (OSError).
    """

    def __init__(self, root: Path, soc: str | None) -> None:
        self.root = root
        self.unreadable: dict[str, str] = {}
        if soc:
            # A link or a file in its place is the cache's to refuse ("not a chip folder").
            names = [soc] if _is_real_folder(root / soc) else []
        else:
            with os.scandir(root) as listed:
                names = [e.name for e in listed if _is_chip_folder(e)]
        self.readable: list[str] = []
        for name in sorted(names):
            try:
                os.scandir(root / name).close()
            except FileNotFoundError:
                # The one asked for is not there: a chip not compiled for here yet, or a
                # name mistyped in a cron line, which would otherwise pass unseen.
                print(f"opcache: warning: no chip folder {root / name}", file=sys.stderr)
                continue
            except OSError as e:
                self.unreadable[name] = e.strerror or str(e)
            else:
                self.readable.append(name)
        try:
            os.scandir(root / BOOKKEEPING).close()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise OSError(f"cannot read {root / BOOKKEEPING}: {e.strerror or e}") from None
        if soc and self.unreadable:
            raise OSError(self._error(soc))

    def each(self, soc: str | None) -> list[str | None]:
        """The ``soc_version`` arguments to call the command with: as asked, or each
        readable chip when some cannot be read."""
        return [soc] if soc or not self.unreadable else list(self.readable)

    def report(self, undone: str) -> int:
        """Say which folders could not be read (the command's output left them ``undone``);
        the exit status."""
        for name in self.unreadable:
            print(f"opcache: error: {self._error(name)}; {undone}", file=sys.stderr)
        return 1 if self.unreadable else 0

    def _error(self, name: str) -> str:
        return f"cannot read the chip folder {self.root / name}: {self.unreadable[name]}"


def _is_real_folder(path: Path, missing: bool = True) -> bool:
    """Whether ``path`` is a folder, not a link; ``missing`` when it cannot be told (not
    there, not readable: where asked for a chip, the listing below says which)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return missing


def _is_chip_folder(entry: os.DirEntry[str]) -> bool:
    # (a folder named as no chip is (``odd name``, lost+found) is none: not a chip
    # argument the whole command would refuse)
    if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
        return False
    try:
        check_soc_version(entry.name)
    except ValueError:
        return False
    return True


def _root_setting(settings: Settings) -> str:
    """The setting the cache root came from, as a user sets it."""
    source = settings.sources.get("root", "default")
    if source == "argument":
        return "--op_compiler_cache_dir"
    return source.removeprefix("env:") if source.startswith("env:") else "the default"


def _why_this_root(settings: Settings) -> str:
    """Where the cache root came from, and the folder the other setting would name.

    ``--op_compiler_cache_dir X`` reads ``X/kernel_cache`` and
    ``ASCEND_CACHE_PATH=X`` reads ``X/kernel_cache_<host>``: a common mix-up.
    """
    setting = _root_setting(settings)
    base = str(settings.root.parent)
    if setting == "--op_compiler_cache_dir":
        other = resolve_settings(environ={"ASCEND_CACHE_PATH": base}).root
        said = f"from --op_compiler_cache_dir {base}, which names <dir>/kernel_cache"
        hint = f"ASCEND_CACHE_PATH={base} would name {other}"
    elif setting == "ASCEND_CACHE_PATH":
        other = resolve_settings(op_compiler_cache_dir=base, environ={}).root
        said = f"from ASCEND_CACHE_PATH={base}, which names <path>/kernel_cache_<host>"
        hint = f"--op_compiler_cache_dir {base} would name {other}"
    else:
        return (
            "the default, $HOME/atc_data/kernel_cache: neither --op_compiler_cache_dir "
            "nor ASCEND_CACHE_PATH is set"
        )
    with contextlib.suppress(OSError):
        if _holds_a_cache(other):
            hint += ", which holds a cache"
    return f"{said}; {hint}"


def _progress(label: str) -> Callable[[int], None] | None:
    """A percentage on stderr when it is a terminal; nothing in cron or pipes."""
    if not sys.stderr.isatty():
        return None

    def show(percent: int) -> None:
        end = "\n" if percent >= 100 else ""
        print(f"\r{label} {percent:3d}%", end=end, file=sys.stderr, flush=True)

    return show


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _cmd_stats(args: argparse.Namespace) -> int:
    with _open_cache(args, "zeroed" if args.zero else None) as cache:
        if args.zero:
            cache.zero_stats(args.soc_version)
            print(json.dumps({"zeroed": True}) if args.json else "statistics zeroed")
            return 0
        chips = _Chips(cache.settings.root, args.soc_version)
        report = cache.stats(args.soc_version)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return chips.report("its entries and size are not counted")
    print(f"cache folder: {cache.settings.root} (from {_root_setting(cache.settings)})")
    rows = [("total", report), *sorted(report["chips"].items())]
    print(
        f"{'chip':<16} {'entries':>8} {'size':>10} {'hits':>8} {'misses':>8} {'hit rate':>8} "
        f"{'stores':>7} {'bypass':>7} {'corrupt':>7} {'evicted':>7} {'errors':>6} {'saved':>9}"
    )
    for name, row in rows:
        asked = row["hits"] + row["misses"]
        rate = f"{100 * row['hits'] / asked:.1f}%" if asked else "-"
        print(
            f"{name:<16} {row['entries']:>8} {_size(row['bytes']):>10} {row['hits']:>8} "
            f"{row['misses']:>8} {rate:>8} {row['stores']:>7} {row['bypasses']:>7} "
            f"{row['corrupt']:>7} {row['evicted_entries']:>7} {row['errors']:>6} "
            f"{row['time_saved_seconds']:>8.1f}s"
        )
    if report["misses_new_key"] or report["misses_never_seen"]:
        print(
            f"misses: {_count(report['misses_new_key'], 'new key')} of operators seen before, "
            f"{report['misses_never_seen']} never seen (opcache explain says why)"
        )
    if report["stale"]:
        print(
            f"{_count(report['stale'], 'entry', 'entries')} not served: a file read by "
            "the compile that made it changed since (compiled again)"
        )
    if cache.settings.remote is not None or any(report[n] for n in _REMOTE_COUNTERS):
        where = cache.settings.remote.shown_url if cache.settings.remote else "(none set now)"
        errors, by_url = _count(report["remote_errors"], "error"), report["remote_errors_by_url"]
        if set(by_url) - {where}:  # errors of another remote: say whose
            errors += f" ({', '.join(f'{n} at {url}' for url, n in by_url.items())})"
        print(
            f"remote {where}: {_count(report['remote_hits'], 'hit')}, "
            f"{_count(report['remote_misses'], 'miss', 'misses')}, "
            f"{_count(report['remote_stores'], 'store')}, "
            f"{errors}, {report['remote_corrupt']} corrupt; "
            f"{_size(report['remote_bytes_down'])} down, {_size(report['remote_bytes_up'])} up"
        )
    _print_reasons("bypassed the cache for a debug option", report["bypass_reasons"])
    _print_reasons("not cached: compiles opcache cannot key", report["uncacheable_reasons"])
    return chips.report("its entries and size are not counted")


_TOP_REASONS = 10


def _print_reasons(title: str, reasons: dict[str, int]) -> None:
    """Why calls were not cached, most frequent first; past the top ten, a sum."""
    if not reasons:
        return
    ranked = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
    print(f"{title} ({_count(sum(reasons.values()), 'call')}), most frequent first:")
    for reason, count in ranked[:_TOP_REASONS]:
        print(f"{count:>10}  {reason}")
    rest = ranked[_TOP_REASONS:]
    if rest:
        others = _count(len(rest), "other reason")
        print(f"{sum(c for _, c in rest):>10}  {others} (opcache stats --json lists every one)")


def _cmd_age(args: argparse.Namespace) -> int:
    report = AgingReport()
    with _open_cache(args, None if args.dry_run else "aged") as cache:
        chips = _Chips(cache.settings.root, args.soc_version)
        for soc in chips.each(args.soc_version):
            _merge(report, cache.age(soc, dry_run=args.dry_run, progress=_progress("aging")))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2, sort_keys=True))
        return max(chips.report("not aged"), 1 if report.errors else 0)
    verb = "would remove" if args.dry_run else "removed"
    for soc, chip in report.chips.items():
        if chip.removed_entries or chip.errors or args.verbose:
            print(
                f"{soc}: {verb} {_count(chip.removed_entries, 'entry', 'entries')}, "
                f"{_size(chip.freed_bytes)} "
                f"({_size(chip.bytes_before)} -> {_size(chip.bytes_before - chip.freed_bytes)})"
                + (f"; skipped: {chip.skipped}" if chip.skipped else "")
                + (f"; {chip.errors} could not be removed" if chip.errors else "")
            )
    if report.leftovers_removed or (args.verbose and not args.dry_run):
        print(f"removed {_count(report.leftovers_removed, 'leftover')} of interrupted writers")
    if args.dry_run or args.verbose:
        # Asked to report: say so even when nothing is (or would be) removed.
        print(
            f"in all: {verb} {_count(report.removed_entries, 'entry', 'entries')}, "
            f"{_size(report.freed_bytes)}, of {_count(len(report.chips), 'chip folder')}"
            + (" (dry run: nothing was removed)" if args.dry_run else "")
        )
    return max(chips.report("not aged"), 1 if report.errors else 0)


_Report = TypeVar("_Report", AgingReport, VerifyReport)


def _merge(report: _Report, part: _Report) -> None:
    """Add the report of one call (a call per readable chip) to the whole."""
    report.chips.update(part.chips)
    report.leftovers_removed += part.leftovers_removed


def _cmd_clear(args: argparse.Namespace) -> int:
    with _open_cache(args, "cleared") as cache:
        chips = _Chips(cache.settings.root, args.soc_version)
        cleared = [name for soc in chips.each(args.soc_version) for name in cache.clear(soc)]
    print(f"cleared {', '.join(cleared)}" if cleared else "nothing to clear")
    return chips.report("not cleared")


def _cmd_verify(args: argparse.Namespace) -> int:
    report = VerifyReport()
    with _open_cache(args, "verified") as cache:
        chips = _Chips(cache.settings.root, args.soc_version)
        for soc in chips.each(args.soc_version):
            _merge(report, cache.verify(soc, progress=_progress("verifying")))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2, sort_keys=True))
        return max(chips.report("not verified"), 1 if report.errors else 0)
    for soc, chip in report.chips.items():
        drift = ""
        # The corrupt entries verify removed were in the counters, with the size
        # they had when stored (damage may have changed it): that is no drift.
        if chip.unread or chip.unsized:
            drift = "; the counters were left as they were (not all of it could be read)"
        elif chip.unwritten:
            drift = f"; the counters were left as they were ({chip.unwritten})"
        elif chip.counted_entries - chip.corrupt != chip.entries or (
            not chip.corrupt and chip.counted_bytes != chip.bytes
        ):
            drift = (
                "; the counters were wrong (they said "
                f"{_count(chip.counted_entries, 'entry', 'entries')}, "
                f"{_size(chip.counted_bytes)}) and now match"
            )
        print(
            f"{soc}: {_count(chip.checked, 'entry', 'entries')} checked, "
            f"{chip.corrupt} corrupt removed, {_count(chip.entries, 'entry', 'entries')} kept, "
            f"{_size(chip.bytes)}{drift}"
            + (f"; {chip.errors} could not be checked or removed" if chip.errors else "")
            + (f"; {_count(chip.unread, 'folder')} could not be read" if chip.unread else "")
        )
    print(f"removed {_count(report.leftovers_removed, 'leftover')} of interrupted writers")
    return max(chips.report("not verified"), 1 if report.errors else 0)


def _cmd_compilers(args: argparse.Namespace) -> int:
    from .compilers import auto_choice, installed

    found = installed()
    name, why = auto_choice()
    if args.json:
        data: dict[str, dict[str, object]] = {
            n: {"usable": ok, "note": note} for n, (ok, note) in found.items()
        }
        data["auto"] = {"choice": name, "reason": why, "usable": found.get(name, (False,))[0]}
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    for each, (ok, note) in found.items():
        print(f"{each:<10} {'usable' if ok else 'not usable':<11} {note}")
    print(f"{'auto':<10} {'-> ' + name:<11} {why}")
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    import threading

    from .specs import Outcome, compile_specs

    if args.compiler == "command" and not args.template:
        raise UsageError(
            "compile: --compiler command needs --template, e.g. "
            "--template 'mycc -c {source} -o {workdir}/{kernel_name}.o'"
        )
    if args.template and args.compiler != "command":
        raise UsageError("compile: --template is for --compiler command only")
    settings = _settings(args, COMPILING_DEFAULT_MODE)
    options = {"template": args.template} if args.template else {}
    totals = {"hit": 0, "miss": 0, "bypass": 0, "disabled": 0, "error": 0}
    printing = threading.Lock()

    def show(outcome: Outcome) -> None:
        """One line per operator as it finishes; a compiler's stderr tail follows, indented."""
        if outcome.error:
            detail = outcome.error.replace("\n", "\n    ")
            line = f"error    {outcome.spec}: {detail}"
        else:
            line = f"{outcome.status:<8} {outcome.seconds:8.3f}s  {outcome.op}"
        with printing:
            print(line, flush=True)

    outcomes = compile_specs(
        args.op, settings, args.output, compiler=args.compiler,
        compiler_options=options, jobs=args.jobs, on_outcome=None if args.json else show,
    )  # fmt: skip
    for outcome in outcomes:
        totals[outcome.status] += 1
    saved = sum(outcome.saved_seconds for outcome in outcomes)
    summary = {
        "operators": len(outcomes),
        "hits": totals["hit"],
        "misses": totals["miss"],
        "bypasses": totals["bypass"],
        "disabled": totals["disabled"],
        "errors": totals["error"],
        "time_saved_seconds": round(saved, 3),
    }
    if args.json:
        print(json.dumps({"summary": summary, "operators": [o.as_dict() for o in outcomes]}))
    else:
        print(
            f"{_count(summary['operators'], 'operator')}: {_count(summary['hits'], 'hit')}, "
            f"{_count(summary['misses'], 'miss', 'misses')}, "
            f"{_count(summary['bypasses'], 'bypass', 'bypasses')}, "
            f"{_count(summary['errors'], 'error')}; "
            f"time saved {saved:.2f}s"
        )
    return 1 if totals["error"] else 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run

    if args.soc_version is not None:
        check_soc_version(args.soc_version)
    options = {
        "op_compiler_cache_mode": args.op_compiler_cache_mode,
        "op_compiler_cache_dir": args.op_compiler_cache_dir,
        "op_debug_level": args.op_debug_level,
        "op_debug_config": args.op_debug_config,
    }
    return run(keep=args.keep, cache_options=options)


def _cmd_remote(args: argparse.Namespace) -> int:
    """``opcache remote stats|clear``: the remote tier, this cache's keys only."""
    from .storage import RemoteError, open_remote

    # A bad remote setting is this command's error alone, not also the warning that
    # the other commands give before they go on with the cache folder.
    with HeldWarnings():
        settings = _settings(args)
    if settings.remote is None:
        raise UsageError(
            settings.remote_error
            or "remote: no remote is set: OPCACHE_REMOTE=redis://host:6379/0, or --remote URL"
        )
    try:
        remote = open_remote(settings.remote)
        try:
            if args.action == "clear":
                removed = remote.clear(args.soc_version)
                print(f"removed {_count(removed, 'entry', 'entries')} from {remote.where}")
                return 0
            usage = remote.usage(args.soc_version)
        finally:
            remote.close()
    except RemoteError as e:
        print(f"opcache: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"remote": settings.remote.shown_url, **usage}, indent=2, sort_keys=True))
        return 0
    print(f"remote: {settings.remote.shown_url}, keys under {settings.remote.prefix!r}")
    chips = usage["chips"]
    total = {"entries": sum(c["entries"] for c in chips.values())}
    total["bytes"] = sum(c["bytes"] for c in chips.values())
    print(f"{'chip':<16} {'entries':>8} {'size':>10}")
    for name, row in [("total", total), *chips.items()]:
        print(f"{name:<16} {row['entries']:>8} {_size(row['bytes']):>10}")
    used, limit, policy = usage["used_memory"], usage["maxmemory"], usage["maxmemory_policy"]
    if policy is None:  # not a Redis: a folder or an HTTP server, aged on its own
        return 0
    limit_text = _size(limit) if limit else "no limit"
    print(f"server memory: {_size(used or 0)} used of {limit_text}, eviction {policy}")
    if policy == "noeviction" or not limit:
        print(
            "opcache: warning: the server never evicts: once its memory is full, stores fail; "
            "set maxmemory and maxmemory-policy allkeys-lru (see docs/remote.md)",
            file=sys.stderr,
        )
    return 0


def _cmd_cann(args: argparse.Namespace) -> int:
    """``opcache cann stats|age|verify``: CANN's own kernel_cache (``cann_cache.py``)."""
    from . import cann_cache

    if args.fix and args.action != "verify":
        raise UsageError("--fix goes with 'opcache cann verify'")
    if args.check and args.action != "stats":
        raise UsageError("--check goes with 'opcache cann stats'")
    if args.dry_run and args.action in ("stats", "verify", "export"):
        raise UsageError(f"--dry-run does not go with 'opcache cann {args.action}'")
    if (args.file is None) != (args.action not in ("export", "import")):
        raise UsageError(
            f"cann {args.action}: "
            + ("FILE is missing" if args.file is None else f"no FILE here ({args.file!r})")
        )
    if args.remote is not None and args.action not in ("push", "pull"):
        raise UsageError("--remote goes with 'opcache cann push' and 'pull'")
    if args.action in ("push", "pull", "export", "import"):
        return _cmd_transfer(args)
    cache = cann_cache.open_cann_cache(_settings(args))
    try:
        if args.action == "stats":
            report = cache.stats(args.soc_version, check=args.check)
        elif args.action == "age":
            # Every entry named only where asked: 40 MB for half a million.
            names = args.json or args.verbose
            report = cache.age(args.soc_version, dry_run=args.dry_run, names=names)
        else:
            report = cache.verify(args.soc_version, fix=args.fix)
    except cann_cache.NoCannCache as e:
        print(f"opcache: error: {e}", file=sys.stderr)  # a cron job with a wrong path must notice
        return 1
    chips = report["chips"]
    failed = any("error" in c or c.get("errors") for c in chips.values())
    if args.action == "verify":
        failed = failed or any(not f.get("removed") for c in chips.values() for f in c["faults"])
    if args.json:
        _print_json(report)
    else:
        lines = {"stats": _cann_stats_lines, "age": _cann_age_lines, "verify": _cann_verify_lines}
        for line in lines[args.action](report, args):
            print(line)
    return 1 if failed else 0


def _print_json(report: dict) -> None:
    """Print ``report`` as one JSON object, written as it is encoded: the chunks of a
    report naming half a million entries, joined into one string first, took 100 MB."""
    if sys.stdout is None:  # (started with stdout closed: nothing to print to)
        return
    json.dump(report, sys.stdout, indent=2, sort_keys=True)
    print()


# Exit statuses of push, pull, export and import, for the scripts that run them.
EXIT_PARTIAL = 1  # done, but some entries were not moved (damaged, refused by a check)
EXIT_REFUSED = 3  # nothing moved: versions differ, op_cache.ini invalid, archive bad
EXIT_UNAVAILABLE = 4  # the remote cannot be reached or the file read


def _cmd_transfer(args: argparse.Namespace) -> int:
    """``opcache cann push|pull|export|import`` and ``opcache export|import``."""
    from . import archive, cann_transfer
    from .storage import RemoteError

    settings = _settings(args)
    progress = _progress(f"{args.action}ing")
    soc = args.soc_version
    try:
        if args.command == "cann" and args.action in ("push", "pull"):
            move = cann_transfer.push if args.action == "push" else cann_transfer.pull
            report = move(soc, settings=settings, dry_run=args.dry_run, progress=progress)
        elif args.command == "cann" and args.action == "export":
            report = cann_transfer.export_archive(
                Path(args.file), soc, settings=settings, progress=progress
            )
        elif args.command == "cann":
            report = cann_transfer.import_archive(
                Path(args.file), soc, settings=settings, dry_run=args.dry_run, progress=progress
            )
        elif args.action == "export":
            report = archive.export_cache(settings, Path(args.file), soc, progress)
        else:
            report = archive.import_cache(
                settings, Path(args.file), soc, dry_run=args.dry_run, progress=progress
            )
    except (archive.BadArchive, trust.UntrustedFolder) as e:  # (a root that may not be used)
        print(f"opcache: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (RemoteError, OSError) as e:
        print(f"opcache: error: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.json:
        _print_json(report)
    chips = report.get("chips", {"": report})
    for soc_name, chip in chips.items():
        if "refused" in chip:
            print(f"opcache: error: {soc_name}: {chip['refused']}", file=sys.stderr)
        elif not args.json:
            print(_transfer_line(soc_name, chip))
    if any("refused" in c for c in chips.values()):
        return EXIT_REFUSED
    bad = ("corrupt", "rejected", "not_sent", "errors")
    return EXIT_PARTIAL if any(c.get(k) for c in chips.values() for k in bad) else 0


def _transfer_line(soc: str, chip: dict) -> str:
    """One line per chip: what moved, and what did not."""
    head = f"{soc}: " if soc else ""
    if "would_send" in chip or "would_pull" in chip or "would_import" in chip:
        n = chip.get("would_send", chip.get("would_pull", chip.get("would_import")))
        return f"{head}dry run: {_count(n, 'entry', 'entries')} to move"
    if "sent" in chip:
        parts = [
            f"{_count(chip['sent'], 'entry', 'entries')} sent ({_size(chip['bytes'])})",
            f"{chip['present']} already there",
        ]
    elif "written" in chip:
        parts = [
            f"{_count(chip['written'], 'entry', 'entries')} written ({_size(chip['bytes'])})",
            f"{chip['present']} already there",
        ]
        if chip["locked"]:
            parts.append(f"{len(chip['locked'])} skipped (a CANN writer holds its lock)")
        if chip["stopped_at_limit"]:
            parts.append("stopped before the size limit")
        if chip.get("busy"):
            parts.append(f"nothing written: {chip['busy']}")
    elif "imported" in chip:
        parts = [
            f"{_count(chip['imported'], 'entry', 'entries')} stored ({_size(chip['bytes'])})",
            f"{chip['present']} already there",
        ]
    else:
        parts = [f"{_count(chip['entries'], 'entry', 'entries')} exported ({_size(chip['bytes'])})"]
    for key in ("corrupt", "discarded", "rejected", "not_sent", "skipped", "errors"):
        for item in chip.get(key) or []:
            what = item if isinstance(item, str) else f"{item['entry']} ({item['why']})"
            parts.append(f"{key.replace('_', ' ')}: {what}")
    return head + "; ".join(parts)


def _cann_limit_line(report: dict) -> str:
    limits = report["limits"]
    source = limits["sources"]["max_op_cache_size_mb"]
    if limits["max_bytes"] is None:
        text = f"aging off (max_op_cache_size -1, from {source})"
    else:
        text = (
            f"limit {_size(limits['max_bytes'])} per chip, {limits['remain_cache_size_ratio']}% "
            f"kept when aging (from {source})"
        )
    return text + (f"; {limits['ini_ignored']}" if limits["ini_ignored"] else "")


def _ago(when: int | None) -> str:
    if when is None:
        return "-"
    minutes = max(0, int(time.time() - when)) // 60
    if minutes == 0:
        return "under a minute ago"
    if minutes < 120:
        return f"{minutes} min ago"
    return f"{minutes // 60} h ago" if minutes < 48 * 60 else f"{minutes // 1440} days ago"


def _cann_stats_lines(report: dict, args: argparse.Namespace) -> list[str]:
    lines = [f"CANN kernel cache: {report['root']}", _cann_limit_line(report)]
    for soc, c in report["chips"].items():
        if "error" in c:
            lines.append(f"{soc}: not read: {c['error']}")
            continue
        limit = c["limit_bytes"]
        share = f" ({100 * c['used_bytes'] / limit:.0f}% of the limit)" if limit else ""
        broken = c["broken_entries"]
        lines += [
            f"{soc}: {_count(c['entries'], 'entry', 'entries')} ({_size(c['entry_bytes'])}"
            + (f", {broken} unusable" if broken is not None else "")
            + f"), {_size(c['used_bytes'])} used{share}",
            f"  last access: oldest {_ago(c['oldest_access'])}, newest "
            f"{_ago(c['newest_access'])}; idle 30 min or more: {c['idle_entries']}",
            f"  headers: {c['headers']} ({_size(c['header_bytes'])}), prebuild results: "
            f"{c['prebuild']} ({_size(c['prebuild_bytes'])}), lock files: {c['locks']}, temp "
            f"leftovers: {c['temps']} ({_size(c['temp_bytes'])}), orphans: {c['orphans']} "
            f"({_size(c['orphan_bytes'])}), other files: {c['other']} "
            f"({_size(c['other_bytes'])})"
            + (
                f", in subfolders: {c['subfolder_files']} ({_size(c['subfolder_bytes'])})"
                if c["subfolder_files"]
                else ""
            ),
        ]
    if not report["checked"]:
        lines.append(
            "note: files told by their names, no json read (--check reads them: which "
            "entries CANN would never reuse, files an entry names otherwise)"
        )
    lines += [f"note: {note}" for note in report["notes"]]
    return lines


def _cann_age_lines(report: dict, args: argparse.Namespace) -> list[str]:
    lines = []
    verb = "would remove" if args.dry_run else "removed"
    for soc, c in report["chips"].items():
        if "error" in c:
            lines.append(f"{soc}: not aged: {c['error']}")
            continue
        removed, kept = c["removed_count"], c["kept_locked_count"]
        if removed or kept or c["errors"] or args.verbose or args.dry_run:
            line = (
                f"{soc}: {verb} {_count(removed, 'entry', 'entries')}, "
                f"{_size(c['removed_bytes'])} "
                f"({_size(c['used_bytes'])} -> {_size(c['used_after'])})"
            )
            if c["skipped"]:
                line += f"; skipped: {c['skipped']}"
            if kept:
                line += f"; kept {_count(kept, 'entry', 'entries')} a writer holds"
            lines.append(line)
        lines += [f"  {verb}: {name}" for name in c["removed"]]
        lines += [f"  kept, a writer holds it: {name}" for name in c["kept_locked"]]
        lines += [f"{soc}: {error}" for error in c["errors"]]
    if args.verbose:
        lines = [_cann_limit_line(report), *lines] + [f"note: {n}" for n in report["notes"]]
    return lines


def _cann_verify_lines(report: dict, args: argparse.Namespace) -> list[str]:
    lines = []
    for soc, c in report["chips"].items():
        if "error" in c:
            lines.append(f"{soc}: not verified: {c['error']}")
            continue
        lines.append(
            f"{soc}: {_count(c['entries'], 'entry', 'entries')}, {c['checked']} checked by "
            f"sha256, {_count(len(c['faults']), 'fault')}"
            + (f", {c['removed']} removed" if args.fix else "")
            + (f", {len(c['unchecked'])} not checked (kept)" if c["unchecked"] else "")
        )
        # Entries opcache cannot judge without following a link: named, never removed.
        lines += [f"  not checked: {u['name']}: {u['why']}" for u in c["unchecked"]]
        for fault in c["faults"]:
            state = ""
            if args.fix:
                state = " (removed)" if fault.get("removed") else f" (kept: {fault.get('kept')})"
            lines.append(f"  {fault['kind']}: {fault['name']}: {fault['why']}{state}")
        lines += [f"  {error}" for error in c["errors"]]
    if args.verbose:
        lines += [f"note: {note}" for note in report["notes"]]
    return lines


def _cmd_masquerade(args: argparse.Namespace) -> int:
    import shlex

    from .masquerade import make_links, opcache_executable, open_links_folder

    if not args.folder:  # os.path.abspath("") is the current folder
        raise UsageError("masquerade: DIR is empty; name the folder for the links")
    target = opcache_executable()
    if target is None:
        raise FileNotFoundError("no opcache program to link to beside this Python or on PATH")
    folder = Path(os.path.abspath(args.folder))
    # Judged before anything is written there (the client too), and written through
    # the folder opened then: a refused folder gets nothing.
    dir_fd = open_links_folder(folder)
    try:
        if args.client:
            target = _client_for(folder, dir_fd, target)
        done = make_links(folder, os.environ, target, dir_fd)
    finally:
        os.close(dir_fd)
    for name, what in done:
        print(f"{name:<28} {what}")
    if not done:
        print("no compiler (cc, gcc, clang, g++, ..., bisheng, opc) found on PATH", file=sys.stderr)
        return 1
    print(f"links point at {target}; use them with: PATH={shlex.quote(str(folder))}:$PATH")
    return 0


def _client_for(folder: Path, dir_fd: int, program: str) -> str:
    """opcache's client built in ``folder`` (open as ``dir_fd``, judged: what the links
    then run), else ``program``."""
    from .server import build_client

    try:
        return build_client(folder, program, os.environ, dir_fd)
    except OSError as e:
        print(f"opcache: warning: {e}; the links run opcache itself", file=sys.stderr)
        return program


def _cmd_server(args: argparse.Namespace) -> int:
    from .masquerade import opcache_executable
    from .quickhit import runtime_folder
    from .server import idle_seconds, serve, socket_name

    path = args.socket
    if path is None:
        program = opcache_executable()
        if program is None:
            raise FileNotFoundError("no opcache program beside this Python or on PATH")
        path = os.path.join(runtime_folder(os.environ), socket_name(program, os.environb))
    return serve(path, idle_seconds(os.environ), args.program)


def _cmd_explain(args: argparse.Namespace) -> int:
    from .wrap import Uncacheable, plan_command

    if not args.argv:
        raise UsageError("explain needs the command after '--': opcache explain -- gcc -c k.c")
    settings = _settings(args, COMPILING_DEFAULT_MODE)
    try:
        request, compiler, reads_changed = plan_command(args.argv, settings)
    except Uncacheable as e:
        raise UsageError(f"explain: opcache wrap would not cache this command: {e}") from None
    with OpCache(settings, stats_seconds=None) as cache:
        explained = cache.explain(request, compiler, reads_changed=reads_changed)
    if args.json:
        print(json.dumps(explained.as_dict(), indent=2, sort_keys=True))
    else:
        print(explained.text())
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="opcache", description="An operator compile cache.")
    python = sys.version.split()[0]
    version = f"opcache {__version__} (Python {python}, {os.path.dirname(__file__)})"
    parser.add_argument("--version", action="version", version=version, help="print it and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    def command(
        name: str, func: Callable[[argparse.Namespace], int], help: str, flags: Sequence[str] = ()
    ) -> _Parser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument("-v", "--verbose", action="store_true", help="say more")
        _add_cache_flags(sub, flags)
        sub.set_defaults(func=func)
        return sub

    config = command("config", _cmd_config, "print every resolved setting and its source")
    config.add_argument("--json", action="store_true", help="one JSON object")
    stats = command("stats", _cmd_stats, "show hits, misses and sizes per chip")
    stats.add_argument("--json", action="store_true", help="one JSON object")
    stats.add_argument("--zero", action="store_true", help="set the counters to zero")
    age = command("age", _cmd_age, "one aging pass per chip folder (for cron)")
    age.add_argument("--dry-run", action="store_true", help="report, remove nothing")
    age.add_argument("--json", action="store_true", help="one JSON object")
    command("clear", _cmd_clear, "delete every entry (of one chip with --soc_version)")
    verify = command("verify", _cmd_verify, "check every entry, remove corrupt ones, recount")
    verify.add_argument("--json", action="store_true", help="one JSON object")
    compilers = command("compilers", _cmd_compilers, "list the compiler plug-ins installed")
    compilers.add_argument("--json", action="store_true", help="one JSON object")
    comp = command("compile", _cmd_compile, "compile operators described in JSON spec files")
    comp.add_argument(
        "--op",
        action="extend",
        nargs="+",
        required=True,
        metavar="SPEC.json",
        help="spec files: each one operator object or a list of them (repeatable)",
    )
    comp.add_argument("--output", required=True, metavar="DIR", help="results go to DIR/<op>/")
    comp.add_argument("--compiler", default="auto", help="cc, cann, command or auto (default)")
    comp.add_argument("--template", help="the command template of --compiler command")
    comp.add_argument(
        "--jobs",
        type=_positive,
        metavar="N",
        help="compiles at a time (default: the cores this process may use)",
    )
    comp.add_argument("--json", action="store_true", help="one JSON object")
    demo = command("demo", _cmd_demo, "compile a dozen C kernels through the cache, twice")
    demo.add_argument("--keep", action="store_true", help="keep the demo's folder")
    # (CANN's cache is found by its folder alone: no mode or debug option changes it)
    cann = command(
        "cann",
        _cmd_cann,
        "CANN's own kernel_cache: stats, age, verify (cron); push, pull, export, import it",
        ("--op_compiler_cache_dir", "--soc_version"),
    )
    cann.add_argument(
        "action",
        choices=("stats", "age", "verify", "push", "pull", "export", "import"),
        help="stats: what is there; age: CANN's aging pass; verify: find (--fix: remove) faults; "
        "push/pull: to/from the remote; export/import: to/from one archive FILE",
    )
    cann.add_argument("file", nargs="?", metavar="FILE", help="export, import: the archive")
    cann.add_argument(
        "--remote", metavar="URL", help="push, pull: the remote (else OPCACHE_REMOTE)"
    )
    cann.add_argument("--json", action="store_true", help="one JSON object")
    cann.add_argument(
        "--dry-run", action="store_true", help="age, push, pull, import: report, change nothing"
    )
    cann.add_argument("--fix", action="store_true", help="verify: remove what it finds")
    cann.add_argument(
        "--check",
        action="store_true",
        help="stats: read every entry's json (which CANN would reuse, files named otherwise)",
    )
    for name, text in (
        ("export", "write opcache's cache (or one chip's) into one archive FILE"),
        ("import", "store the entries of an archive FILE in opcache's cache"),
    ):
        sub = command(name, _cmd_transfer, text, ("--op_compiler_cache_dir", "--soc_version"))
        sub.add_argument("file", metavar="FILE", help="the archive (.tar, or .tar.gz: compressed)")
        sub.add_argument("--json", action="store_true", help="one JSON object")
        sub.set_defaults(action=name, dry_run=False)
        if name == "import":
            sub.add_argument("--dry-run", action="store_true", help="check FILE, store nothing")
    remote = command("remote", _cmd_remote, "the remote tier: stats, or clear this cache's keys")
    remote.add_argument(
        "action",
        choices=("stats", "clear"),
        help="stats: entries and bytes per chip, the server's memory; clear: delete them",
    )
    remote.add_argument("--remote", metavar="URL", help="the remote (else OPCACHE_REMOTE)")
    remote.add_argument("--json", action="store_true", help="one JSON object")
    masq = commands.add_parser(
        "masquerade",
        help="link the compilers found on PATH to opcache in DIR",
        description="Make a link in DIR, named like each compiler found on PATH (cc, gcc, "
        "x86_64-linux-gnu-gcc-12, g++, clang, bisheng, ccec, opc...), that runs it through "
        "the cache. "
        "Existing files are never replaced; running it again adds what is new.",
    )
    masq.add_argument("folder", metavar="DIR", help="the folder to put first on PATH")
    masq.add_argument(
        "--client",
        action="store_true",
        help="build opcache's C client in DIR with this machine's C compiler and link to it: "
        "hits served by a warm opcache server (docs/wrap.md)",
    )
    masq.add_argument("-v", "--verbose", action="store_true", help="say more")
    masq.set_defaults(func=_cmd_masquerade, soc_version=None)  # (main reads it)
    server = command(
        "server",
        _cmd_server,
        "serve wrap hits to opcache's client until idle (the client starts it)",
    )
    server.add_argument(
        "--socket", metavar="PATH", help="where to listen (default: this install's client's)"
    )
    explain = command(
        "explain",
        _cmd_explain,
        "why a command would miss: its key's parts against the nearest stored entry",
    )
    explain.add_argument("--json", action="store_true", help="one JSON object")
    explain.add_argument(
        "argv", nargs="*", metavar="-- COMMAND", help="a command line as opcache wrap takes it"
    )
    # Listed for --help only: `opcache wrap` is parsed in cli, by hand (everything
    # after -- is the command), and never reaches this parser.
    wrap_help = "run a compile command through the cache: wrap -- cc ..."
    commands.add_parser("wrap", help=wrap_help, description=wrap_help)
    return parser
