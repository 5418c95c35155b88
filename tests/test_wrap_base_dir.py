"""OPCACHE_BASE_DIR (ccache's base_dir): checkouts in different folders share entries.

Two copies of one project, built as CMake builds them (absolute paths, from a
build folder) with ``-g`` and ``-MD``, through ``opcache wrap``: the second
build hits, and what it gets names neither the first checkout nor its own
absolute folder (debug info names the build folder ``.``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_wrap import GCC, K_C, stats, wrap

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")


def checkout(folder: Path) -> Path:
    (folder / "include").mkdir(parents=True)
    (folder / "src").mkdir()
    (folder / "build").mkdir()
    (folder / "include" / "h.h").write_text("#define FACTOR 3\n")
    (folder / "src" / "k.c").write_text(K_C)
    return folder


def command(proj: Path, *extra: str) -> list[str]:
    """The compile line a CMake build writes: every path absolute."""
    return [
        "gcc", "-g", "-O2", *extra, f"-I{proj}/include", "-DOFFSET=1",
        "-c", f"{proj}/src/k.c", "-o", f"{proj}/build/k.o",
    ]  # fmt: skip


@pytest.fixture
def two_checkouts(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    work = tmp_path / "work"
    first, second = checkout(work / "alice" / "proj"), checkout(work / "bob" / "proj")
    env = {**base_env(tmp_path), "OPCACHE_BASE_DIR": str(work)}
    return env, first, second


def build(env: dict[str, str], proj: Path, *extra: str) -> None:
    cwd = proj / "build"
    wrap(*command(proj, *extra), env={**env, "PWD": str(cwd)}, cwd=cwd)


def test_a_second_checkout_hits_with_debug_info_of_its_own(two_checkouts):
    env, first, second = two_checkouts
    build(env, first)
    build(env, second)
    host = stats(env, "host")
    assert (host["misses"], host["hits"]) == (1, 1)
    obj = (second / "build" / "k.o").read_bytes()
    assert obj == (first / "build" / "k.o").read_bytes()
    assert str(first).encode() not in obj and str(second).encode() not in obj
    # Byte for byte what gcc makes in the second checkout with relative paths and
    # the build folder mapped to "." (as ccache's manual tells its users to do).
    cwd = second / "build"
    subprocess.run(
        [GCC, f"-fdebug-prefix-map={cwd}=.", "-g", "-O2", "-I../include", "-DOFFSET=1",
         "-c", "../src/k.c", "-o", "plain.o"],
        cwd=cwd, check=True,
    )  # fmt: skip
    assert obj == (cwd / "plain.o").read_bytes()


def test_dependency_files_name_relative_paths(two_checkouts):
    env, first, second = two_checkouts
    build(env, first, "-MD")
    build(env, second, "-MD")
    assert stats(env, "host")["hits"] == 1
    deps = (second / "build" / "k.d").read_text()
    target, _, inputs = deps.partition(":")
    assert target == "k.o" and {"../src/k.c", "../include/h.h"} <= set(inputs.split()), deps
    assert str(first) not in deps and str(second) not in deps


def test_without_base_dir_the_folder_is_in_the_key(two_checkouts):
    env, first, second = two_checkouts
    del env["OPCACHE_BASE_DIR"]
    build(env, first)
    build(env, second)
    assert stats(env, "host")["misses"] == 2
    assert str(second).encode() in (second / "build" / "k.o").read_bytes()


def test_a_build_outside_base_dir_is_keyed_by_its_folder(two_checkouts, tmp_path):
    env, first, _ = two_checkouts
    elsewhere = tmp_path / "elsewhere" / "proj"
    shutil.copytree(first, elsewhere)
    build(env, first)
    build(env, elsewhere)
    assert stats(env, "host")["misses"] == 2
    assert str(elsewhere).encode() in (elsewhere / "build" / "k.o").read_bytes()
