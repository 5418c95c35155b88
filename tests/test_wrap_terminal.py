"""``opcache wrap`` as a person at a terminal meets it: Ctrl-C, signals, coloured diagnostics.

Ctrl-C is a SIGINT to the terminal's foreground process group, so the tests
send it to the group of a real ``opcache wrap`` while a stand-in compiler
runs.  Colour needs a terminal: stderr is a pseudo-terminal from ``pty``.
"""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_wrap import GCC, lines, stats, wrap, write_project

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")

STANDIN = """\
import os, signal, sys, time
from pathlib import Path

log = Path(os.environ["STANDIN_LOG"])
if "-print-prog-name=as" in sys.argv:  # opcache asks which assembler it runs
    print("/usr/bin/as")
    sys.exit(0)
if "-print-search-dirs" in sys.argv:  # and where it looks for a specs file
    sys.exit(0)
if "-M" in sys.argv:  # and for the header list
    print("k.o: " + next(a for a in sys.argv if a.endswith(".c")))
    sys.exit(0)
how = os.environ["STANDIN"]
if how == "slow":
    def interrupted(*_):
        with log.open("a") as f:
            f.write("interrupted\\n")
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as a compiler ends on Ctrl-C

    signal.signal(signal.SIGINT, interrupted)
    with log.open("a") as f:
        f.write("started\\n")
    time.sleep(600)
os.kill(os.getpid(), getattr(signal, how))
"""


@pytest.fixture
def standin(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(environment whose ``gcc`` is a stand-in that is slow or kills itself, a project)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcc = bin_dir / "gcc"
    gcc.write_text(f"#!{sys.executable}\n{STANDIN}")
    gcc.chmod(0o755)
    env = {**base_env(tmp_path, bin_dir), "STANDIN_LOG": str(tmp_path / "standin.log")}
    return env, write_project(tmp_path / "src")


COMPILE = ["gcc", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]


def test_ctrl_c_during_a_compile_ends_quietly_as_the_compiler_does(standin):
    env, src = standin
    log = Path(env["STANDIN_LOG"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "opcache", "wrap", "--", *COMPILE],
        env={**env, "STANDIN": "slow"},
        cwd=src,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group, as a terminal's foreground job
    )
    for _ in range(6000):  # until the compiler runs (at most a minute)
        if "started" in lines(log) or proc.poll() is not None:
            break
        time.sleep(0.01)
    assert lines(log) == ["started"], proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
    out, err = proc.communicate(timeout=60)
    assert (out, err) == (b"", b"")  # no traceback, nothing at all
    # Ended by SIGINT itself, as the compiler was: a shell shows 130 and stops a loop.
    assert proc.returncode == -signal.SIGINT
    assert lines(log) == ["started", "interrupted"]  # the compiler got the signal too
    assert sorted(p.name for p in src.iterdir()) == ["h.h", "k.c"]  # no object, no staging
    assert stats(env, "host").get("entries", 0) == 0


@pytest.mark.parametrize(("how", "number"), [("SIGTERM", 15), ("SIGKILL", 9), ("SIGHUP", 1)])
def test_a_compiler_killed_by_a_signal_gives_128_plus_its_number(standin, how, number):
    env, src = standin
    # Under nohup SIGHUP is ignored, and an ignored signal stays ignored through
    # exec: the stand-in could not die by it. Give the children the default.
    hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        _killed_by(env, src, how, number)
    finally:
        signal.signal(signal.SIGHUP, hup)


def _killed_by(env: dict, src: Path, how: str, number: int) -> None:
    env = {**env, "STANDIN": how}
    wrap(*COMPILE, env=env, cwd=src, status=128 + number)
    # The same for a command run as it is (not cached): gcc -E here.
    wrap("gcc", "-E", "k.c", env=env, cwd=src, status=128 + number)
    assert stats(env, "host").get("entries", 0) == 0


# -- colour -------------------------------------------------------------------------------

WARN_C = '#warning "look-here-42"\nint w(void) { return 1; }\n'
ESC = b"\x1b["


def wrap_on_a_terminal(env: dict[str, str], cwd: Path, *command: str) -> bytes:
    """Run ``opcache wrap -- command`` with stderr on a pseudo-terminal; what it showed."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "opcache", "wrap", "--", *command],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=follower,
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the terminal's other side is closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert proc.wait() == 0, shown
    return shown.replace(b"\r\n", b"\n")


def test_diagnostics_keep_their_colour_on_a_terminal_and_lose_it_elsewhere(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.c").write_text(WARN_C)
    env = {**base_env(tmp_path), "TERM": "xterm"}
    command = ["gcc", "-c", "w.c", "-o", "w.o"]
    coloured = wrap_on_a_terminal(env, src, *command)  # a miss
    assert ESC in coloured and b"look-here-42" in coloured
    piped = wrap(*command, env=env, cwd=src).stderr  # a hit, replayed into a pipe
    plain = subprocess.run([GCC, *command[1:-1], "plain.o"], cwd=src, capture_output=True)
    assert piped == plain.stderr and ESC not in piped
    assert wrap_on_a_terminal(env, src, *command) == coloured  # a hit on a terminal
    host = stats(env, "host")
    assert (host["misses"], host["hits"]) == (1, 2)  # the colour flag is not in the key
    # The user's own choice stands; TERM=dumb gets no colour either.
    assert ESC not in wrap_on_a_terminal(env, src, *command[:-2], "-fno-diagnostics-color",
                                         "-o", "w2.o")  # fmt: skip
    assert ESC not in wrap_on_a_terminal({**env, "TERM": "dumb"}, src, *command)
