"""What an ``opcache wrap`` hit does: the hit, and none of the chip folder's upkeep."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_wrap import GCC, stats, wrap, write_project

pytestmark = pytest.mark.skipif(GCC is None, reason="needs gcc")


def test_a_wrap_hit_leaves_the_upkeep_to_the_next_miss(tmp_path: Path) -> None:
    """Dead writers' leftovers and aging are a miss's business: a hit adds nothing
    to clean or to age, and a build of hits should not pay for them."""
    env, src = base_env(tmp_path), write_project(tmp_path / "src")
    cmd = ["gcc", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, "-DOFFSET=1", env=env, cwd=src)
    (root,) = (tmp_path / "cache").glob("kernel_cache*")  # (named after the machine)
    # A temp file of a writer killed an hour ago, as the upkeep finds and removes.
    leftover = root / ".op_cache.ini.12345.0123abcd"
    leftover.write_bytes(b"")
    hour_ago = time.time() - 3600
    os.utime(leftover, (hour_ago, hour_ago))

    wrap(*cmd, "-DOFFSET=1", env=env, cwd=src)
    assert stats(env, "host")["hits"] == 1
    assert leftover.exists()

    wrap(*cmd, "-DOFFSET=2", env=env, cwd=src)  # a miss
    assert stats(env, "host")["misses"] == 2
    assert not leftover.exists()


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_a_wrap_hit_lists_no_folder_and_reads_no_size_counter(tmp_path: Path) -> None:
    """A hit's own work: no listing of the cache's folders (trash, tmp, stats,
    size counters) nor of its staging folder, and none of the 16 size shards read."""
    env, src = base_env(tmp_path), write_project(tmp_path / "src")
    cmd = ["gcc", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, env=env, cwd=src)
    log = tmp_path / "strace.log"
    trace = [shutil.which("strace"), "-f", "-y", "-e", "trace=getdents64,openat", "-o", str(log)]
    done = subprocess.run(
        [*trace, sys.executable, "-m", "opcache", "wrap", "--", *cmd],
        env=env,
        cwd=src,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert stats(env, "host")["hits"] == 1
    calls = log.read_text().splitlines()
    cache = str(tmp_path / "cache")
    listed = [c for c in calls if "getdents64(" in c and (cache in c or ".opcache-wrap" in c)]
    assert listed == []
    assert not [c for c in calls if "openat(" in c and "/_size>" in c]
