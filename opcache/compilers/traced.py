"""A library back-end's compile run under ``strace -f``: what it read beyond its key.

A tool run from a template or a script reads files no request field names
(headers through ``-I``, a kernel source a variable points at, helper
modules): the key cannot hold them.  Traced as ``opcache wrap -- opc`` traces
a miss (``readset.py``), its read set goes into the entry, and a hit is
served only while it is unchanged.  Without strace, what it read is not
known, and its output is not stored.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .. import readset
from .._log import get_logger
from .toolchain import check_tool, run_tool

log = get_logger(__name__)
_TOLD: set[str] = set()  # the tools whose compiles were said not to be cached


def run(
    argv: Sequence[str],
    *,
    cwd: str,
    workdir: Path,
    environ: Mapping[str, str],
    what: str,
    tool: str,
    exclude: Sequence[str] = (),
    keep: Sequence[str] = (),
) -> str | readset.ReadSet:
    """Run a compile in ``cwd`` (the request's sources) writing into ``workdir``,
    traced: its read set (the sources, the outputs and ``exclude`` left out, but
    what lies under ``keep``), or why its output must not be stored, said of
    ``tool`` (errors as ``toolchain.run_tool``'s, said of ``what``)."""
    strace = readset.strace_program(environ)
    if strace is None:
        run_tool(argv, cwd=Path(cwd), environ=environ, what=what)
        if tool not in _TOLD:  # (once a process: every compile of it is a miss)
            _TOLD.add(tool)
            log.warning(
                "%s: its compiles are not cached: without strace (not on PATH, or %s=off) "
                "what it reads is not known; install strace",
                tool,
                readset.ENV_TRACE,
            )
        return f"{tool}: not traced (no strace on PATH or {readset.ENV_TRACE}=off)"
    with tempfile.TemporaryDirectory(prefix="opcache-trace-") as trace_dir:
        started = time.time_ns()
        traced = readset.traced_command(strace, trace_dir, argv)
        status, _, stderr, outlived = readset.run_traced(traced, trace_dir, environ, cwd=cwd)
        if not readset.traced(trace_dir):  # (ptrace refused, as in some containers)
            said = stderr.decode(errors="replace").strip().splitlines()
            run_tool(argv, cwd=Path(cwd), environ=environ, what=what)
            return f"{tool}: strace cannot trace here ({said[0] if said else status})"
        check_tool(argv, status, stderr, what)
        if outlived:
            return f"{tool}: {outlived}"
        # opcache's own build folder around ``workdir`` (flow's) is gone once the
        # compile is stored: no input.  Both as named and as the tool may name them
        # (gcc resolves the links on its source's and its output's paths).
        own = workdir.parent if workdir.parent.name.startswith(readset.OWN_NAMES) else workdir
        ours = [cwd, os.fspath(own)]
        ours += [os.path.realpath(path) for path in ours]
        try:
            reads = readset.record(trace_dir, started, [*exclude, *ours], keep)
        except readset.Unprovable as e:
            return f"{tool}: {e}"
    # The folders above the outputs are where the caller has them written (a build
    # folder made anew, deleted after), not inputs where the tool only looked at
    # them.  (One it listed stays: a module found there would be found by name.)
    above = _folders_above(own)
    reads.items = [
        item
        for item in reads.items
        if item[0].rstrip("\0") not in above or (item[1] == "dir" and item[6])
    ]
    return reads


def _folders_above(path: Path) -> set[str]:
    """Every folder ``path`` lies in, as named and as its links resolve."""
    folders = set()
    for named in (os.path.abspath(path), os.path.realpath(path)):
        while True:
            parent = os.path.dirname(named)
            if parent == named:
                break
            folders.add(parent)
            named = parent
    return folders
