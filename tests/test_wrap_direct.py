"""Direct mode of `opcache wrap` for C compiles: a hit runs no preprocessor.

The header list of a source is remembered with each header's digest; it is used
while every header still has those contents, and refreshed by `cc -M` otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_wrap import compiled_script

GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(GCC is None, reason="needs gcc")


@pytest.fixture
def logged_gcc(tmp_path: Path) -> tuple[Path, Path]:
    """A `gcc` first on PATH that logs every call, then runs the real one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "gcc.log"
    compiled_script(bin_dir / "gcc", f'echo "$*" >> {log}\nexec {GCC} "$@"\n')
    return bin_dir, log


def wrap(tmp_path: Path, bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "HOME": str(tmp_path),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    return subprocess.run(
        [sys.executable, "-m", "opcache", "wrap", "--op_compiler_cache_dir", str(tmp_path / "c"),
         "--", "gcc", "-O2", *args],
        cwd=tmp_path / "src", env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def plain(tmp_path: Path) -> bytes:
    subprocess.run(
        [GCC, "-O2", "-c", "k.c", "-o", str(tmp_path / "ref.o")], cwd=tmp_path / "src", check=True
    )
    return (tmp_path / "ref.o").read_bytes()


def test_a_hit_runs_neither_the_preprocessor_nor_the_compiler(tmp_path, logged_gcc) -> None:
    bin_dir, log = logged_gcc
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text('#include "a.h"\nint f(void) { return A; }\n')
    (src / "a.h").write_text("#define A 1\n")
    assert wrap(tmp_path, bin_dir, "-c", "k.c", "-o", "k.o").returncode == 0
    first = calls(log)
    assert any(" -M " in f" {c} " for c in first)  # the header list was learnt once
    assert (src / "k.o").read_bytes() == plain(tmp_path)
    (src / "k.o").unlink()
    assert wrap(tmp_path, bin_dir, "-c", "k.c", "-o", "k.o").returncode == 0
    assert calls(log) == first  # nothing ran: the remembered headers still match
    assert (src / "k.o").read_bytes() == plain(tmp_path)


def test_a_header_that_starts_including_another_is_followed(tmp_path, logged_gcc) -> None:
    bin_dir, log = logged_gcc
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text('#include "a.h"\nint f(void) { return A + B; }\n')
    (src / "a.h").write_text("#define A 1\n#define B 2\n")
    assert wrap(tmp_path, bin_dir, "-c", "k.c", "-o", "k.o").returncode == 0
    # a.h now takes B from a new header: the old header list is stale.
    (src / "a.h").write_text('#define A 1\n#include "b.h"\n')
    (src / "b.h").write_text("#define B 3\n")
    assert wrap(tmp_path, bin_dir, "-c", "k.c", "-o", "k.o").returncode == 0
    assert (src / "k.o").read_bytes() == plain(tmp_path)
    # Only b.h changes now: the refreshed list holds it, so this is a miss too.
    (src / "b.h").write_text("#define B 4\n")
    before = len(calls(log))
    assert wrap(tmp_path, bin_dir, "-c", "k.c", "-o", "k.o").returncode == 0
    assert (src / "k.o").read_bytes() == plain(tmp_path)
    assert len(calls(log)) > before  # it compiled again
    # And back to the first contents: the first header list is still
    # remembered, so this is a hit on the entry stored then, with no -M run.
    (src / "a.h").write_text("#define A 1\n#define B 2\n")
    expected = plain(tmp_path)
    before = len(calls(log))
    assert wrap(tmp_path, bin_dir, "-c", "k.c", "-o", "k.o").returncode == 0
    assert (src / "k.o").read_bytes() == expected
    assert len(calls(log)) == before


def test_a_remembered_header_list_with_a_nul_in_a_path_is_passed_over(tmp_path, logged_gcc):
    """A damaged note (a path holding a NUL, which no system call takes) failed the
    compile with 'embedded null byte': the cache never fails a compile."""
    import json

    bin_dir, _ = logged_gcc
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text('#include "a.h"\nint f(void) { return A; }\n')
    (src / "a.h").write_text("#define A 1\n")
    assert wrap(tmp_path, bin_dir, "-c", "k.c", "-o", "k.o").returncode == 0
    (note,) = [p for p in (tmp_path / "c").rglob("*") if p.is_file() and "direct" in p.parts]
    variants = json.loads(note.read_text())
    variants[0]["absent"].append("a\0b")
    note.write_text(json.dumps(variants))
    (src / "k.o").unlink()
    done = wrap(tmp_path, bin_dir, "-c", "k.c", "-o", "k.o")
    assert (done.returncode, done.stderr) == (0, "")
    assert (src / "k.o").read_bytes() == plain(tmp_path)


@pytest.mark.parametrize("size", ["its own", "a.h's"])
def test_once_only_headers_and_an_include_not_taken_keep_direct_mode(tmp_path, logged_gcc, size):
    """A header named by an #include in a branch not taken is there and not read; with
    #pragma once headers read, only one that could be their twin (their contents)
    makes each compile ask cc -M: this one does not, even of the same size as one
    (a size alone turned direct mode off, as for libstdc++'s math.h, which <cmath>
    passes over, beside a header of its 4,573 bytes)."""
    bin_dir, log = logged_gcc
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text(
        '#include "a.h"\n#ifdef _WIN32\n#include "win.h"\n#endif\nint f(void) { return A; }\n'
    )
    (src / "a.h").write_text("#pragma once\n#define A 1\n")
    win = "#pragma once\n#include <windows.h>\n"
    if size == "a.h's":
        win = "#pragma once\n#define B 2\n"
        assert len(win) == len((src / "a.h").read_text())
    (src / "win.h").write_text(win)
    assert wrap(tmp_path, bin_dir, "-c", "k.c", "-o", "k.o").returncode == 0
    first = calls(log)
    (src / "k.o").unlink()
    assert wrap(tmp_path, bin_dir, "-c", "k.c", "-o", "k.o").returncode == 0
    assert calls(log) == first
    assert (src / "k.o").read_bytes() == plain(tmp_path)
