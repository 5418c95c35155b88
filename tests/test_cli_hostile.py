"""The command line given hostile input: one clear line, the right status, never a traceback
or a hang.

Spec files and sources of ``opcache compile`` that are no files (a FIFO, a
device), JSON nested past any reason, ``CC`` values that are no command line;
maintenance commands on a cache this user cannot read; the smaller mistakes
of ``masquerade`` and ``cann``.  Every opcache run is a real process, bounded
in time (helpers_wrap.opcache) and, where a read could go on without end, in
memory.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from fake_opc import SOC, base_env
from helpers_wrap import GCC, opcache

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")

MEMORY = 2 << 30  # what an opcache run may map: /dev/zero read whole fails fast, not the machine


def bounded_opcache(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m opcache ARGS`` with its memory and time bounded."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))

    done = subprocess.run(
        [sys.executable, "-m", "opcache", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


# -- opcache compile -------------------------------------------------------------------


@pytest.fixture
def specs(tmp_path: Path) -> Path:
    """A folder with k.c, FIFOs named fifo.c and pipe.json, and spec files naming each
    kind of source."""
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "k.c").write_text("int k(int x) { return x + 1; }\n")
    os.mkfifo(folder / "fifo.c")
    os.mkfifo(folder / "pipe.json")
    for name, source in (("ok", "k.c"), ("fifo", "fifo.c"), ("zero", "/dev/zero")):
        spec = {"op_type": "K", "soc_version": SOC, "op_name": name, "sources": {"k.c": source}}
        (folder / f"{name}.json").write_text(json.dumps(spec))
    (folder / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    return folder


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("deep.json", "deep.json: nested too deeply to be an operator spec"),
        ("pipe.json", "pipe.json: cannot read it: not a regular file"),
        ("/dev/zero", "/dev/zero: cannot read it: not a regular file"),
        ("zero.json", "zero.json: field 'sources.k.c': cannot read /dev/zero: not a regular file"),
        ("fifo.json", "fifo.json: field 'sources.k.c': cannot read fifo.c: not a regular file"),
    ],
)
def test_a_spec_or_source_that_is_no_file_is_that_spec_s_error(specs, tmp_path, spec, said):
    """Reported like any bad spec (its line, exit 1); the good spec beside it compiles."""
    env = base_env(tmp_path)
    args = ["compile", "--op", spec, "ok.json", "--output", "build", "--compiler", "cc"]
    done = bounded_opcache(*args, env=env, cwd=specs)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert f"error    {said}" in lines, lines
    assert any(line.startswith("miss") and line.endswith(" ok") for line in lines), lines
    assert done.stderr == ""


@pytest.mark.parametrize("cc", ['"', " ", "gcc '-O2"])
def test_a_cc_that_is_no_command_line_is_one_error_line(specs, tmp_path, cc):
    env = {**base_env(tmp_path), "CC": cc}
    args = ["compile", "--op", "ok.json", "--output", "build", "--compiler", "cc"]
    done = opcache(*args, env=env, cwd=specs, status=2)
    (line,) = done.stderr.decode().splitlines()
    assert line.startswith(f"opcache: error: CC={cc!r} ")
    assert not (specs / "build").exists()  # nothing compiled
    # `opcache compilers` lists cc as not usable, with the same reason, and goes on.
    listed = opcache("compilers", env=env, cwd=specs).stdout.decode()
    assert f"not usable  CC={cc!r} " in listed
