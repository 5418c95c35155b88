"""The torture harness, short: many processes on one cache, every result checked (issue 5).

``tools/torture.py`` runs workers (enable and now and then force, the real
``cc`` back-end and a fast test compiler, clocks far ahead), a cron process
(age, verify, clear, flipped bytes) and a tiny size limit for 20 seconds, then
checks every artifact against a fresh compile and the counters against a
recount.  The long run is for people; this one is part of the suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from opcache.compilers.cc import find_cc

REPO = Path(__file__).resolve().parent.parent
TORTURE = REPO / "tools" / "torture.py"
SUMMARY = re.compile(
    r"^torture: (\d+) compiles, (\d+) hits, (\d+) wrong, (\d+) errors, (\d+) lost$", re.M
)


@pytest.mark.skipif(
    find_cc(os.environ) is None, reason="no C compiler (CC, cc, gcc, clang): the harness uses one"
)
def test_a_short_torture_run_finds_nothing_wrong() -> None:
    done = subprocess.run(
        [sys.executable, str(TORTURE), "--seconds", "20", "--procs", "4", "--ops", "24"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, output
    found = SUMMARY.search(done.stdout)
    assert found, output
    compiles, hits, wrong, errors, lost = map(int, found.groups())
    assert compiles > 0, output
    assert hits > 0, output
    assert (wrong, errors, lost) == (0, 0, 0), output
