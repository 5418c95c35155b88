"""What the ``opcache wrap`` tests share: running opcache as a real process, its stats, links."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
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


_LAUNCHER_C = r"""
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char self[PATH_MAX], script[PATH_MAX + 4];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n < 0) return 127;
    self[n] = 0;
    snprintf(script, sizeof script, "%s.sh", self);
    char **args = calloc(argc + 2, sizeof *args);
    args[0] = "/bin/sh";
    args[1] = script;
    for (int i = 1; i < argc; i++) args[i + 1] = argv[i];
    execv("/bin/sh", args);
    return 127;
}
"""
_launcher: list[bytes] = []


def compiled_script(path: Path, script: str, version: str = "") -> Path:
    """A compiler at ``path`` that is no script (opcache runs a script compiler
    uncached: what it runs is not keyed): a small program that runs ``script``,
    kept as ``path``.sh, with its arguments.  Another ``version`` is another
    binary (another identity), the same behaviour."""
    if not _launcher:
        with tempfile.TemporaryDirectory() as build:
            source = Path(build) / "launcher.c"
            source.write_text(_LAUNCHER_C)
            subprocess.run([GCC, "-O", "-o", f"{build}/launcher", source], check=True)
            _launcher.append(Path(f"{build}/launcher").read_bytes())
    path.with_name(path.name + ".sh").write_text(script)
    path.unlink(missing_ok=True)
    path.write_bytes(_launcher[0] + version.encode())
    path.chmod(0o755)
    return path


def tailing_assembler(folder: Path, real_as: str) -> Path:
    """``folder`` holding an ``as`` that runs ``real_as``, then appends ``tail`` to its object."""
    folder.mkdir(parents=True)
    script = folder / "as"
    script.write_text(
        "#!/bin/sh\n"
        'for a; do case "$prev" in -o) out=$a;; esac; prev=$a; done\n'
        f'{real_as} "$@" && printf tail >> "$out"\n'
    )
    script.chmod(0o755)
    return folder


def relocated_gcc(prefix: Path) -> Path:
    """This gcc's driver copied into ``prefix/bin``, its own folders (``lib/gcc/...``,
    ``libexec/gcc/...``) linked under ``prefix`` as under its own: a gcc installed
    in a prefix of its own, which looks for its programs there first.  Skips the
    test where gcc names an assembler of its own (it looks for none then)."""
    named = subprocess.run([GCC, "-print-prog-name=as"], capture_output=True, text=True)
    if "/" in named.stdout:
        pytest.skip("this gcc has an assembler of its own")
    real = Path(os.path.realpath(GCC))
    (prefix / "bin").mkdir(parents=True)
    shutil.copy(real, prefix / "bin" / "gcc")
    for flag in ("-print-libgcc-file-name", "-print-prog-name=cc1"):
        said = subprocess.run([GCC, flag], capture_output=True, text=True, check=True)
        own = Path(os.path.realpath(said.stdout.strip())).parent
        mirror = prefix / own.relative_to(real.parent.parent)
        mirror.mkdir(parents=True, exist_ok=True)
        for entry in own.iterdir():
            if not (mirror / entry.name).exists():
                (mirror / entry.name).symlink_to(entry)
    return prefix / "bin" / "gcc"


def assembler_in_its_prefix(gcc: Path) -> Path:
    """binutils installed into the prefix of ``relocated_gcc``'s ``gcc``: a
    ``tailing_assembler`` in ``<prefix>/<machine>/bin``, one of gcc's program
    folders, which gcc now runs before PATH's ``as``.  Its folder."""
    real_as = shutil.which("as")
    assert real_as is not None
    machine = subprocess.run([gcc, "-dumpmachine"], capture_output=True, text=True, check=True)
    tools = tailing_assembler(gcc.parent.parent / machine.stdout.strip() / "bin", real_as)
    said = subprocess.run([gcc, "-print-prog-name=as"], capture_output=True, text=True)
    assert os.path.samefile(said.stdout.strip(), tools / "as")  # (gcc runs it now)
    return tools
