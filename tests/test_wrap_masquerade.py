"""The masquerade beside other compiler wrappers: never a loop, one entry per compile.

opcache's links, Debian's ccache links (``/usr/lib/ccache``) and a script that
re-runs the next ``gcc`` on PATH (as ccache, distcc and many build farms do),
in every order on PATH.  Each opcache start is counted by a logging
``opcache`` program, so a loop shows as a count past the bound and is stopped
there; the object must be the one a plain gcc makes.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_wrap import (
    GCC,
    counted_opcache,
    lines,
    link_compilers,
    opcache,
    opcache_script,
    plain_gcc,
    stats,
    wrap,
    write_project,
)

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")

CCACHE_LINKS = Path("/usr/lib/ccache")
needs_ccache = pytest.mark.skipif(
    not (CCACHE_LINKS / "gcc").exists(),
    reason="ccache's links are not installed (apt-get install ccache); the script wrapper "
    "tests reproduce the same loop without it",
)
COMPILE = ["gcc", "-O2", "-DOFFSET=4", "-c", "k.c", "-o", "k.o"]
BOUND = 12  # opcache starts allowed for one compile; a loop passes it at once


def script_wrapper(folder: Path, log: Path) -> Path:
    """A ``gcc`` that notes its start and runs the first other ``gcc`` on PATH (as ccache)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "gcc"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$0" >> {log}\n'
        'me=$(readlink -f "$0")\n'
        "IFS=:\n"
        "for d in $PATH; do\n"
        '  if [ -x "$d/gcc" ] && [ "$(readlink -f "$d/gcc")" != "$me" ]; then\n'
        '    exec "$d/gcc" "$@"\n'
        "  fi\n"
        "done\n"
        "exit 127\n"
    )
    script.chmod(0o755)
    return folder


def run_bounded(argv: list[str], env: dict[str, str], cwd: Path, starts: Path) -> int:
    """Run ``argv``; stop it (and fail) as soon as opcache has started more than BOUND times."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True)
    while True:
        try:
            status = proc.wait(timeout=0.05)
            break
        except subprocess.TimeoutExpired:
            pass
        if len(lines(starts)) > BOUND:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"a process loop: opcache started {len(lines(starts))} times and counting")
    assert len(lines(starts)) <= BOUND
    return status


@pytest.fixture
def project(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """(environment, the project folder, the log of opcache starts) with opcache's gcc link."""
    starts = tmp_path / "opcache-starts.log"
    counted = counted_opcache(tmp_path / "opcache-bin", starts)
    link_compilers(tmp_path / "links", counted, "gcc")
    env = base_env(tmp_path)
    env["CCACHE_DIR"] = str(tmp_path / "ccache")
    return env, write_project(tmp_path / "src"), starts


def with_path(env: dict[str, str], *folders: Path) -> dict[str, str]:
    return {**env, "PATH": os.pathsep.join([*map(str, folders), env["PATH"]])}


def plain_object(src: Path) -> bytes:
    plain_gcc(src, *COMPILE[1:-1], "plain.o")
    return (src / "plain.o").read_bytes()


def check_build_twice(
    env: dict[str, str], src: Path, starts: Path, most: int, opcache_hits: int = 1, entries: int = 1
) -> None:
    """Two builds, each with at most ``most`` opcache starts, each object plain gcc's."""
    for _ in range(2):
        (src / "k.o").unlink(missing_ok=True)
        before = len(lines(starts))
        assert run_bounded(COMPILE, env, src, starts) == 0
        assert len(lines(starts)) - before <= most
        assert (src / "k.o").read_bytes() == plain_object(src)
    host = stats(env, "host")
    assert (host["entries"], host["hits"]) == (entries, opcache_hits), host


@needs_ccache
def test_opcache_before_ccache_runs_the_real_compiler_once(project, tmp_path):
    env, src, starts = project
    env = with_path(env, tmp_path / "links", CCACHE_LINKS)
    # opcache passes ccache's links over: one opcache start per compile, no ccache.
    check_build_twice(env, src, starts, most=1)


@needs_ccache
def test_ccache_before_opcache_is_bounded(project, tmp_path):
    env, src, starts = project
    env = with_path(env, CCACHE_LINKS, tmp_path / "links")
    # ccache runs its gcc (opcache) for the preprocessor and the compile: a few starts;
    # the second build is a ccache hit, which runs no compiler at all.
    check_build_twice(env, src, starts, most=3, opcache_hits=0)


def test_a_wrapper_script_after_opcache_runs_the_compiler_directly(project, tmp_path):
    """opcache -> script -> opcache again: the first runs the script uncached (what a
    script runs is not keyed), the second runs gcc itself, uncached."""
    env, src, starts = project
    wrapper_log = tmp_path / "wrapper.log"
    wrapper = script_wrapper(tmp_path / "wrapper", wrapper_log)
    env = with_path(env, tmp_path / "links", wrapper)
    check_build_twice(env, src, starts, most=2, opcache_hits=0, entries=0)
    assert len(lines(wrapper_log)) == 2
    reason = f"cc: {wrapper / 'gcc'} is a script: the compiler it runs is not keyed"
    assert stats(env)["uncacheable_reasons"] == {reason: 2}


def test_a_wrapper_script_before_opcache(project, tmp_path):
    env, src, starts = project
    wrapper_log = tmp_path / "wrapper.log"
    env = with_path(env, script_wrapper(tmp_path / "wrapper", wrapper_log), tmp_path / "links")
    check_build_twice(env, src, starts, most=1)
    assert len(lines(wrapper_log)) == 2


def test_a_link_that_leads_only_to_opcache_is_one_line_and_127(project, tmp_path):
    env, src, starts = project
    env = {**env, "PATH": str(tmp_path / "links")}  # no real gcc anywhere
    assert run_bounded(COMPILE, env, src, starts) == 127
    assert len(lines(starts)) == 1


def test_wrap_of_a_name_that_is_an_opcache_link_stores_one_entry(tmp_path):
    """``opcache wrap -- gcc`` with opcache's gcc link first on PATH: one cache, one entry."""
    src = write_project(tmp_path / "src")
    env = with_path(base_env(tmp_path), link_compilers(tmp_path / "links", opcache_script(), "gcc"))
    for _ in range(2):
        wrap(*COMPILE, env=env, cwd=src)
    host = stats(env, "host")
    assert (host["entries"], host["misses"], host["hits"]) == (1, 1, 1), host
    assert (src / "k.o").read_bytes() == plain_object(src)


# -- opcache masquerade DIR ------------------------------------------------------------


@pytest.fixture
def compilers(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH holds stand-in compilers by name, and gcc itself."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("cc", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-gcc-12", "clang++", "c99-gcc"):
        (tools / name).symlink_to(GCC)
    (tools / "c89-gcc").write_text('#!/bin/sh\nexec gcc -std=c89 "$@"\n')
    (tools / "c89-gcc").chmod(0o755)
    (tools / "gcc-ar").symlink_to(GCC)  # not a compiler name
    (tools / "notes.txt").write_text("not a program")
    return {**base_env(tmp_path), "PATH": f"{tools}{os.pathsep}{os.path.dirname(GCC)}"}


def masquerade(folder: Path, env: dict[str, str], status: int = 0) -> list[str]:
    done = opcache("masquerade", str(folder), env=env, cwd=Path(env["HOME"]), status=status)
    return done.stdout.decode().splitlines()


def test_masquerade_links_every_compiler_name_on_path(compilers, tmp_path):
    links = tmp_path / "links"
    out = masquerade(links, compilers)
    made = {p.name for p in links.iterdir()}
    assert {"cc", "gcc", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-gcc-12", "clang++"} <= made
    assert "gcc-ar" not in made and "notes.txt" not in made
    assert "c89-gcc" not in made  # a script: a cache would key the script, not its compiler
    assert any(line.startswith("c89-gcc") and "script" in line for line in out)
    target = os.path.realpath(opcache_script())
    assert all(os.path.realpath(p) == target for p in links.iterdir())
    assert out[-1].endswith(f"PATH={links}:$PATH")
    # The links work: make's default `cc` is cached.
    src = write_project(tmp_path / "src")
    env = with_path(compilers, links)
    for _ in range(2):
        subprocess.run(["cc", *COMPILE[1:]], env=env, cwd=src, check=True)
    assert stats(env, "host")["hits"] == 1


def test_masquerade_is_idempotent_and_never_replaces_a_file(compilers, tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    (links / "cc").write_text("#!/bin/sh\necho mine\n")
    first = masquerade(links, compilers)
    assert (links / "cc").read_text() == "#!/bin/sh\necho mine\n"
    assert any(line.startswith("cc ") and "left alone" in line for line in first)
    made = sorted(p.name for p in links.iterdir())
    second = masquerade(links, compilers)
    assert sorted(p.name for p in links.iterdir()) == made
    assert all("made" not in line for line in second)
    assert any(line.startswith("gcc ") and "kept" in line for line in second)


def test_masquerade_with_no_compiler_on_path_says_so(tmp_path):
    env = {**base_env(tmp_path), "PATH": str(tmp_path / "empty")}
    done = opcache("masquerade", str(tmp_path / "links"), env=env, cwd=tmp_path, status=1)
    assert b"no compiler" in done.stderr


def test_masquerade_mistakes_are_one_sentence(compilers, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    done = opcache("masquerade", "", env=compilers, cwd=work, status=2)
    said = b"opcache: error: masquerade: DIR is empty; name the folder for the links\n"
    assert done.stderr == said
    assert list(work.iterdir()) == []  # not a link made in the current folder
    (work / "a-file").write_text("")
    for folder, said in (
        ("a-file", f"{work / 'a-file'} is there and is not a folder"),
        ("a-file/links", f"cannot make the folder {work / 'a-file/links'}: Not a directory"),
    ):
        done = opcache("masquerade", folder, env=compilers, cwd=work, status=1)
        assert done.stderr.decode() == f"opcache: error: {said}\n"


def test_masquerade_s_path_hint_is_quoted_for_the_shell(compilers, tmp_path):
    links = tmp_path / "my links $HOME"
    out = masquerade(links, compilers)
    assert out[-1].endswith(f"PATH='{links}':$PATH")
    shown = subprocess.run(
        ["sh", "-c", out[-1].split("use them with: ")[1] + '; echo "$PATH"'],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout == f"{links}:/usr/bin:/bin\n"
