"""Marks the test modules share (not for child processes, which run without pytest)."""

from __future__ import annotations

import shutil

import pytest

# The library's cann and command back-ends store a compile only once strace told
# what it read: their hits need it.
needs_strace = pytest.mark.skipif(
    shutil.which("strace") is None, reason="strace is needed to trace a compile (CI installs it)"
)
