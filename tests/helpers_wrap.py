"""What the ``opcache wrap`` tests share: running opcache as a real process, its stats, links."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
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
    prefix: Sequence[str | Path] = (),
) -> subprocess.CompletedProcess:
    """``python -m opcache ARGS``; asserts no traceback and, unless None, the exit status.

    Its output is bytes, or str with ``text``.  A run that does not end within ``timeout``
    seconds fails the test (TimeoutExpired): a hang.  ``memory`` bounds what the run may
    map (RLIMIT_AS), so a read that never ends fails fast instead of taking the machine.
    ``prefix``: a command it runs under (``bound_by_modes()``).
    """

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    done = subprocess.run(
        [*prefix, sys.executable, "-m", "opcache", *args],
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


def wrap(
    *command: str,
    env: dict[str, str],
    cwd: Path,
    status: int | None = 0,
    flags=(),
    prefix: Sequence[str | Path] = (),
):
    return opcache("wrap", *flags, "--", *command, env=env, cwd=cwd, status=status, prefix=prefix)


def bound_by_modes() -> list[str]:
    """A command prefix under which a folder's mode binds this user: for root, setpriv
    without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (root owns the test's files, so it
    still reaches what its owner may); nothing for another user.  Skips the test
    where root cannot drop them."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv(1) to run as root bound by file modes")
    prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--"]
    if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("setpriv cannot drop capabilities here")
    return prefix


REFUSING_RENAME = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static int refused(const char *to) {
    const char *name = strrchr(to, '/') ? strrchr(to, '/') + 1 : to;
    if (access(REFUSE_WHILE, F_OK) != 0 || strcmp(name, REFUSED) != 0) return 0;
    errno = EPERM; /* (as the kernel refuses one over another's file in /tmp) */
    return 1;
}
int renameat(int from_dir, const char *from, int to_dir, const char *to) {
    int (*real)(int, const char *, int, const char *) = dlsym(RTLD_NEXT, "renameat");
    return refused(to) ? -1 : real(from_dir, from, to_dir, to);
}
int rename(const char *from, const char *to) {
    int (*real)(const char *, const char *) = dlsym(RTLD_NEXT, "rename");
    return refused(to) ? -1 : real(from, to);
}
"""


def refusing_rename(folder: Path, refused: str, flag: Path) -> Path:
    """A library for LD_PRELOAD whose rename(2) and renameat(2) refuse (EPERM) a rename
    onto a file named ``refused`` while the file ``flag`` exists, and do every other one
    (a compiler, which writes its outputs in place, passes)."""
    source = folder / "refusing_rename.c"
    source.write_text(REFUSING_RENAME)
    built = folder / "refusing_rename.so"
    defines = [f'-DREFUSED="{refused}"', f'-DREFUSE_WHILE="{flag}"']
    subprocess.run(
        [GCC, "-shared", "-fPIC", *defines, "-o", built, source, "-ldl"], check=True, timeout=120
    )
    return built


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


def outputs_left(folder: Path, status: int) -> tuple:
    """``status`` and the bytes of ``folder``'s k.o and deps/k.d (None: none there)."""
    outputs = [folder / "k.o", folder / "deps" / "k.d"]
    return status, *(path.read_bytes() if path.is_file() else None for path in outputs)


def compiled_alone(folder: Path, args: Sequence[str], prefix: Sequence[str] = ()) -> tuple:
    """What real gcc alone does with ``args`` in a copy of ``folder`` (the project and
    its outputs as they are, the folders' modes kept): ``outputs_left`` of the copy."""
    copy = folder.parent / (folder.name + "-alone")
    shutil.copytree(folder, copy, symlinks=True)
    done = subprocess.run([*prefix, GCC, *args], cwd=copy, capture_output=True, timeout=120)
    return outputs_left(copy, done.returncode)


def ran_instead(done: subprocess.CompletedProcess, folder: Path, why: str) -> None:
    """``done`` said once that it could not put folder/deps/k.d in place (``why``) and ran
    the command (the full path's warning), and no error of opcache's."""
    said = done.stderr.decode(errors="replace")
    warning = f"opcache: warning: cannot put the outputs in place: {folder}/deps/k.d: {why}; "
    assert said.count(warning + "running the command\n") == 1, said
    assert "opcache: error:" not in said, said


def temporary_files(folder: Path) -> list[str]:
    """The temporary files a quick hit or opcache left under ``folder`` (none, ever)."""
    return [str(path) for path in folder.rglob(".opcache-wrap.*")]


def fill(path: Path) -> None:
    """Fill the file system of ``path`` (a new file) until it has no block left."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 512, 1):
            try:
                while True:
                    f.write(b"f" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC


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
