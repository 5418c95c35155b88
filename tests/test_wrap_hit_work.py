"""What an ``opcache wrap`` hit does: the hit, and none of the chip folder's upkeep."""

from __future__ import annotations

import os
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
    assert (root / "op_cache.ini").is_file()
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
