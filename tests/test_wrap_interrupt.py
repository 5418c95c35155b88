"""Ctrl-C at any moment of an ``opcache wrap`` or a masquerade compile: quiet, ended by SIGINT.

A parallel build interrupted by Ctrl-C catches some compiles while Python is
still importing opcache.  Whenever the SIGINT lands, opcache must say nothing
(no traceback) and end the way the compiler does, by SIGINT itself, or finish
normally if it was done.

Python's own start-up (the interpreter, ``site`` and the ``.pth`` files of the
installation, the first line of pip's console script) runs before opcache's
first instruction, and a SIGINT there gets Python's traceback whatever opcache
does.  So the clock starts at opcache's first instruction: a ``sitecustomize``
on PYTHONPATH adds an audit hook that sees the package ``opcache`` begin to
run, then at its Nth import after that either sends the SIGINT itself
(``import:N``, exact and repeatable) or tells the test, which waits a given
time and presses Ctrl-C, the SIGINT to the whole process group, the compiler
included (``sync:FD``); ``count:FD`` counts the imports of a whole run.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_wrap import GCC, link_compilers, opcache_script, write_project

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")

SITECUSTOMIZE = """\
import os, sys


def _interrupt_opcache():
    how = os.environ.pop("OPCACHE_TEST_INTERRUPT", "")  # (the compiler need not see it)
    if not how:
        return
    kind, _, value = how.partition(":")
    import _signal

    seen = {"started": False, "imports": 0}
    init = os.path.join("opcache", "__init__.py")

    def hook(event, args):
        if event == "exec" and not seen["started"]:
            seen["started"] = getattr(args[0], "co_filename", "").endswith(init)
        elif event == "import" and seen["started"]:
            seen["imports"] += 1
            if kind == "sync" and seen["imports"] == 1:
                os.write(int(value), b"!")
                os.close(int(value))
            elif kind == "import" and seen["imports"] == int(value):
                os.kill(os.getpid(), _signal.SIGINT)

    sys.addaudithook(hook)
    if kind == "count":
        import atexit

        atexit.register(lambda: os.write(int(value), str(seen["imports"]).encode()))


_interrupt_opcache()
"""
RUNS = 16  # per way of starting; the delays spread evenly over 0 to 150 ms


@pytest.fixture
def project(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(environment with the audit hook and opcache's gcc link on PATH, a project folder)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    links = link_compilers(tmp_path / "links", opcache_script(), "gcc")
    env = {**base_env(tmp_path, links), "PYTHONPATH": str(site)}
    return env, write_project(tmp_path / "src")


def starts(way: str, offset: int) -> list[str]:
    """The command line of one compile (``-DOFFSET=offset``), started the given way."""
    compile_ = ["gcc", f"-DOFFSET={offset}", "-c", "k.c", "-o", "k.o"]
    if way == "masquerade":
        return compile_  # the gcc link first on PATH
    if way == "python -m":
        return [sys.executable, "-m", "opcache", "wrap", "--", *compile_]
    return [opcache_script(), "wrap", "--", *compile_]


def run(
    env: dict[str, str], src: Path, way: str, offset: int, how: str, delay: float = 0
) -> tuple[int, bytes, bytes]:
    """One compile with ``OPCACHE_TEST_INTERRUPT`` set to ``how`` (``FD``: a pipe's end);
    after ``sync``, Ctrl-C ``delay`` s later.  (returncode, stderr, what came down the pipe)."""
    pipe_read, pipe_write = os.pipe()
    try:
        proc = subprocess.Popen(
            starts(way, offset),
            env={**env, "OPCACHE_TEST_INTERRUPT": how.replace("FD", str(pipe_write))},
            cwd=src,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(pipe_write,),
            start_new_session=True,  # its own group, as a terminal's foreground job
        )
        os.close(pipe_write)
        said = b""
        if how.startswith("sync"):
            ready, _, _ = select.select([pipe_read], [], [], 60)
            said = os.read(pipe_read, 1) if ready else b""
            assert said == b"!", proc.communicate(timeout=60)
            time.sleep(delay)
            with contextlib.suppress(ProcessLookupError):  # all gone already
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=120)
        if how.startswith("count"):
            said = os.read(pipe_read, 100)
    finally:
        os.close(pipe_read)
    return proc.returncode, err, said


def assert_quiet_and_whole(returncode: int, err: bytes, src: Path) -> None:
    assert b"Traceback" not in err, err.decode()
    assert err == b"", err.decode()  # not a word, as gcc on Ctrl-C
    assert returncode in (0, -signal.SIGINT), (returncode, err.decode())
    assert not [p.name for p in src.iterdir() if p.name.startswith(".opcache")]  # no staging
    if returncode == 0:
        assert (src / "k.o").stat().st_size > 0


@pytest.mark.parametrize("way", ["wrap", "masquerade"])
def test_ctrl_c_from_opcache_s_first_instruction_on_is_quiet(project, way):
    env, src = project
    for n in range(RUNS):
        delay = 0.150 * n / (RUNS - 1)
        # Every other run compiles (a new -D), the others hit the entry of the run before.
        returncode, err, _ = run(env, src, way, n // 2, "sync:FD", delay)
        assert_quiet_and_whole(returncode, err, src)
        (src / "k.o").unlink(missing_ok=True)


@pytest.mark.parametrize("way", ["wrap", "masquerade", "python -m"])
def test_ctrl_c_at_each_import_of_opcache_is_quiet(project, way):
    """Exact and repeatable: the SIGINT lands during the Nth module opcache imports."""
    env, src = project
    returncode, _, said = run(env, src, way, -1, "count:FD")  # a miss, as each run below
    total = int(said)
    assert returncode == 0 and total > 10  # (the count itself works)
    for n in sorted({1, 2, 3, *range(4, total + 1, max(1, total // 12)), total}):
        returncode, err, _ = run(env, src, way, n, f"import:{n}")
        assert_quiet_and_whole(returncode, err, src)
        assert returncode == -signal.SIGINT  # it landed before the end
        (src / "k.o").unlink(missing_ok=True)
