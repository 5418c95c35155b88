"""What the ``opcache wrap`` tests share: running opcache as a real process, its stats, links."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GCC = shutil.which("gcc")

K_C = """\
#include "h.h"
int scale(int x) { return x * FACTOR + OFFSET; }
"""


def opcache(
    *args: str,
    env: dict[str, str],
    cwd: Path,
    status: int | None = 0,
    text: bool = False,
    timeout: float = 120,
    memory: int | None = None,
) -> subprocess.CompletedProcess:
    """``python -m opcache ARGS``; asserts no traceback and, unless None, the exit status.

    Its output is bytes, or str with ``text``.  A run that does not end within ``timeout``
    seconds fails the test (TimeoutExpired): a hang.  ``memory`` bounds what the run may
    map (RLIMIT_AS), so a read that never ends fails fast instead of taking the machine.
    """

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    done = subprocess.run(
        [sys.executable, "-m", "opcache", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=text,
        timeout=timeout,
        preexec_fn=None if memory is None else limit_memory,
    )
    stderr = done.stderr if text else done.stderr.decode(errors="replace")
    assert "Traceback" not in stderr, stderr
    if status is not None:
        assert done.returncode == status, stderr
    return done


def wrap(*command: str, env: dict[str, str], cwd: Path, status: int | None = 0, flags=()):
    return opcache("wrap", *flags, "--", *command, env=env, cwd=cwd, status=status)


def wrap_imports(command: list[str], env: dict[str, str], cwd: Path) -> tuple[str, set[str], str]:
    """``opcache wrap -- command`` in a Python of its own: its exit status and the modules
    it loaded by its end (stdout's last line, after whatever a hit replays), its stderr."""
    code = (
        "import sys\nfrom opcache.cli import main\n"
        f"status = main(['wrap', '--', *{command!r}])\n"
        "print(status, *sorted(sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )
    last = done.stdout.splitlines()[-1:] or [""]
    status, *modules = last[0].split() or [""]
    return status, set(modules), done.stderr


def stats(env: dict[str, str], soc: str | None = None, *flags: str) -> dict:
    """``opcache stats --json``: the whole report, or one chip's (empty if it has none)."""
    done = opcache("stats", "--json", *flags, env=env, cwd=Path(env["HOME"]))
    report = json.loads(done.stdout)
    return report["chips"].get(soc, {}) if soc else report


def plain_gcc(cwd: Path, *args: str) -> None:
    subprocess.run([GCC, *args], cwd=cwd, check=True)


def write_project(folder: Path) -> Path:
    """``folder`` with k.c including h.h (FACTOR 3; OFFSET comes from a -D)."""
    folder.mkdir(parents=True)
    (folder / "k.c").write_text(K_C)
    (folder / "h.h").write_text("#define FACTOR 3\n")
    return folder


def opcache_script() -> str:
    """The ``opcache`` console script installed beside this Python."""
    found = shutil.which("opcache", path=os.path.dirname(sys.executable))
    if found is None:
        pytest.skip("the opcache console script is not installed next to python")
    return found


def counted_opcache(folder: Path, log: Path) -> Path:
    """An ``opcache`` program in ``folder`` that notes each start in ``log``, then runs opcache.

    Named ``opcache`` like the real one, so links to it are links to opcache.
    """
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "opcache"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(sys.argv[0] + '\\n')\n"
        "from opcache.cli import main\n"
        "sys.exit(main())\n"
    )
    script.chmod(0o755)
    return script


def link_compilers(folder: Path, target: Path | str, *names: str) -> Path:
    """``folder`` with a link named after each compiler, pointing at ``target``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).symlink_to(target)
    return folder


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
