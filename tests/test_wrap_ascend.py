"""``opcache wrap`` over CANN's device compilers, bisheng and ccec, with their Ascend flags.

The compilers are stand-ins built by ``helpers_ascend``: real programs that
translate the Ascend flags away and run the real clang (bisheng) or g++
(ccec), keeping the Ascend flags in the object, so a hit that should have
been a miss shows as other bytes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_ascend import make_stand_in, real_compiler
from helpers_wrap import compiled_script, opcache, opcache_script, stats, wrap

COMPILERS = ("bisheng", "ccec")
KERNEL = """\
#include "common.h"
extern "C" void add_kernel(const float *x, float *y, int n) {
    for (int i = 0; i < n && i < TILE; i++) y[i] = x[i] + OFFSET;
}
"""
COMMON_H = """\
#pragma once
#include <tiling.h>
__attribute__((used)) static const char ascend_flags[] = ASCEND_FLAGS;
"""
# A ccec line of an ascendc kernel build (CANN's _build_aicore_compile_cmd) and
# the -MD set CMake adds.
LINE = [
    "-c",
    "-O3",
    "-x",
    "cce",
    "k.cpp",
    "--cce-aicore-arch=dav-c220-vec",
    "--cce-aicore-only",
    "-o",
    "k.o",
    "-mllvm",
    "-cce-aicore-stack-size=0x8000",
    "-mllvm",
    "-cce-aicore-function-stack-size=0x8000",
    "--cce-auto-sync",
    "--npu-arch=dav-2201",
    "-std=c++17",
    "-DOFFSET=1",
    "-Iinc",
]


@pytest.fixture(scope="session")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a stand-in bisheng (over clang) and ccec (over g++)."""
    folder = tmp_path_factory.mktemp("ascend-bin")
    for name in COMPILERS:
        real = real_compiler(name)
        if real is None:
            pytest.skip(f"{name}'s stand-in needs {'clang' if name == 'bisheng' else 'g++'}")
        make_stand_in(folder, name, real)
    return folder


@pytest.fixture
def kernel(tmp_path: Path, stand_ins: Path) -> tuple[dict[str, str], Path]:
    """(environment with the stand-ins first on PATH, a folder with k.cpp and its headers)."""
    src = tmp_path / "src"
    (src / "inc").mkdir(parents=True)
    (src / "k.cpp").write_text(KERNEL)
    (src / "inc" / "common.h").write_text(COMMON_H)
    (src / "inc" / "tiling.h").write_text("#define TILE 64\n")
    return base_env(tmp_path, stand_ins), src


def plain(env: dict[str, str], src: Path, compiler: str, line: list[str]) -> bytes:
    """The object the compiler itself makes of ``line`` (its -o moved aside)."""
    line = [("plain.o" if a == "k.o" else a) for a in line]
    subprocess.run([compiler, *line], cwd=src, env=env, check=True, timeout=120)
    return (src / "plain.o").read_bytes()


def host(env: dict[str, str]) -> dict:
    return stats(env, "host")


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_device_compile_misses_then_hits_with_the_compilers_own_bytes(kernel, compiler):
    env, src = kernel
    wrap(compiler, *LINE, env=env, cwd=src)
    first = (src / "k.o").read_bytes()
    (src / "k.o").unlink()
    wrap(compiler, *LINE, env=env, cwd=src)
    chip = host(env)
    assert (chip["misses"], chip["hits"]) == (1, 1)
    assert (src / "k.o").read_bytes() == first == plain(env, src, compiler, LINE)
    assert b"--cce-aicore-arch=dav-c220-vec" in first  # (the stand-in's mark of the flags)


def _changed(line: list[str], old: str, new: str) -> list[str]:
    assert old in line
    return [new if a == old else a for a in line]


def _edit(path: Path, old: str, new: str) -> None:
    path.write_text(path.read_text().replace(old, new))


CHANGES = {
    "define": lambda src, line: _changed(line, "-DOFFSET=1", "-DOFFSET=2"),
    "npu arch": lambda src, line: _changed(line, "--npu-arch=dav-2201", "--npu-arch=dav-3510"),
    "aicore arch": lambda src, line: _changed(
        line, "--cce-aicore-arch=dav-c220-vec", "--cce-aicore-arch=dav-c220-cube"
    ),
    "mllvm value": lambda src, line: _changed(
        line, "-cce-aicore-stack-size=0x8000", "-cce-aicore-stack-size=0x4000"
    ),
    "auto sync": lambda src, line: _changed(line, "--cce-auto-sync", "--cce-auto-sync=off"),
    "source": lambda src, line: _edit(src / "k.cpp", "+ OFFSET", "- OFFSET") or line,
    "header": lambda src, line: _edit(src / "inc" / "tiling.h", "64", "32") or line,
}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("compiler", COMPILERS)
def test_every_change_that_matters_is_a_miss_with_the_new_bytes(kernel, compiler, change):
    env, src = kernel
    wrap(compiler, *LINE, env=env, cwd=src)
    old = (src / "k.o").read_bytes()
    line = CHANGES[change](src, list(LINE))
    wrap(compiler, *line, env=env, cwd=src)
    assert host(env)["misses"] == 2, change
    new = (src / "k.o").read_bytes()
    assert new != old
    assert new == plain(env, src, compiler, line)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_header_created_earlier_on_the_include_path_is_a_miss(kernel, compiler):
    env, src = kernel
    line = [*LINE, "-Iover"]
    line.insert(line.index("-Iinc"), "-Iearly")  # searched before inc/
    wrap(compiler, *line, env=env, cwd=src)
    (src / "early").mkdir()
    (src / "early" / "tiling.h").write_text("#define TILE 16\n")
    wrap(compiler, *line, env=env, cwd=src)
    assert host(env)["misses"] == 2
    assert (src / "k.o").read_bytes() == plain(env, src, compiler, line)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_dependency_file_is_restored_on_a_hit(kernel, compiler):
    env, src = kernel
    line = [*LINE, "-MD", "-MT", "obj/k.o", "-MF", "k.o.d"]
    wrap(compiler, *line, env=env, cwd=src)
    deps = (src / "k.o.d").read_text()
    assert "inc/tiling.h" in deps and deps.startswith("obj/k.o:")
    (src / "k.o.d").unlink()
    (src / "k.o").unlink()
    wrap(compiler, *line, env=env, cwd=src)
    assert host(env)["hits"] == 1
    assert (src / "k.o.d").read_text() == deps


def test_an_asc_source_with_the_asc_language_flag_is_cached(kernel):
    """CMake's ASC rule (asc-devkit): -std, flags, --npu-arch, -o, -c --asc-aicore-lang <src>."""
    env, src = kernel
    (src / "k.asc").write_text(KERNEL)
    line = ["-Iinc", "-std=c++17", "-DOFFSET=3", "--enable-simt", "--npu-arch=dav-3510"]
    line += ["-o", "k.o", "-c", "--asc-aicore-lang", "k.asc"]
    for _ in range(2):
        wrap("bisheng", *line, env=env, cwd=src)
    assert (host(env)["misses"], host(env)["hits"]) == (1, 1)
    assert (src / "k.o").read_bytes() == plain(env, src, "bisheng", line)


@pytest.mark.parametrize("flag", ["-xasc", "-xcce"])
def test_the_glued_language_flags_are_cached(kernel, flag):
    env, src = kernel
    line = [flag, *LINE[4:], "-c"]  # (without -x cce)
    for _ in range(2):
        wrap("bisheng", *line, env=env, cwd=src)
    assert (host(env)["misses"], host(env)["hits"]) == (1, 1)


def test_a_dump_flag_runs_uncached_with_its_reason(kernel):
    env, src = kernel
    line = [*LINE, "--cce-dump-ir=ir.txt"]
    done = opcache("wrap", "-v", "--", "bisheng", *line, env=env, cwd=src, text=True)
    assert "--cce-dump-ir=ir.txt" in done.stderr
    report = stats(env)
    assert json.dumps(report["uncacheable_reasons"]).count("--cce-dump-ir") == 1


@pytest.mark.parametrize("compiler", COMPILERS)
def test_masquerade_links_the_device_compilers(kernel, compiler, tmp_path):
    env, src = kernel
    links = tmp_path / "links"
    done = opcache("masquerade", str(links), env=env, cwd=tmp_path, text=True)
    made = [line.split()[0] for line in done.stdout.splitlines() if "made, wraps" in line]
    assert compiler in made, done.stdout
    env = {**env, "PATH": f"{links}:{env['PATH']}"}
    for _ in range(2):
        subprocess.run([compiler, *LINE], cwd=src, env=env, check=True, timeout=120)
    assert (host(env)["misses"], host(env)["hits"]) == (1, 1)


def test_ccaches_spelling_opcache_then_the_compiler(kernel):
    """``opcache bisheng ...`` as ``ccache bisheng ...``: what a launcher or
    gen_bisheng's ccache program runs."""
    env, src = kernel
    for _ in range(2):
        opcache("bisheng", *LINE, env=env, cwd=src)
    assert (host(env)["misses"], host(env)["hits"]) == (1, 1)
    done = opcache("bishop", "-c", "k.cpp", env=env, cwd=src, status=2, text=True)
    assert "invalid choice: 'bishop'" in done.stderr


def test_a_link_named_ccache_is_opcache_in_ccaches_place(kernel, tmp_path):
    """The ascendc kernel build runs ``$ASCENDC_CCACHE_EXECUTABLE <bisheng> -c ...`` when
    that variable's value ends in ``ccache`` (CANN's op compile Python): a link named
    ``ccache`` to opcache takes that place."""
    env, src = kernel
    (tmp_path / "cachebin").mkdir()
    link = tmp_path / "cachebin" / "ccache"
    link.symlink_to(opcache_script())
    bisheng = str(Path(env["PATH"].split(":")[0]) / "bisheng")
    for _ in range(2):
        subprocess.run([str(link), bisheng, *LINE], cwd=src, env=env, check=True, timeout=120)
    assert (host(env)["misses"], host(env)["hits"]) == (1, 1)


@pytest.mark.parametrize(
    "variable", ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "BISHENG_REAL_PATH"]
)
def test_another_toolkit_root_is_a_miss(kernel, variable):
    """The toolkit root variables join a device compile's key (and its header memo);
    so does BISHENG_REAL_PATH, the compiler a bisheng wrapper script may run."""
    env, src = kernel
    for _ in range(2):
        wrap("bisheng", *LINE, env={**env, variable: "/toolkit/a"}, cwd=src)
    wrap("bisheng", *LINE, env={**env, variable: "/toolkit/b"}, cwd=src)
    assert (host(env)["misses"], host(env)["hits"]) == (2, 1)


def test_headers_the_driver_finds_through_the_toolkit_root_are_keyed(kernel, tmp_path):
    # The stand-in searches $ASCEND_HOME_PATH/include, as a driver that found
    # the toolkit's headers itself would: after a switch of toolkit, and after
    # an edit of the new toolkit's header, the object is the compiler's own.
    env, src = kernel
    (src / "inc" / "tiling.h").unlink()  # (found in the toolkit only)
    for name, tile in (("a", 8), ("b", 16), ("b", 4)):
        header = tmp_path / name / "include" / "tiling.h"
        header.parent.mkdir(parents=True, exist_ok=True)
        header.write_text(f"#define TILE {tile}\n")
        toolkit = {**env, "ASCEND_HOME_PATH": str(tmp_path / name)}
        wrap("bisheng", *LINE, env=toolkit, cwd=src)
        assert (src / "k.o").read_bytes() == plain(toolkit, src, "bisheng", LINE), (name, tile)


def test_a_sync_log_flag_runs_uncached_with_its_reason(kernel):
    # --cce-auto-sync-log=FILE writes where bisheng inserted syncs beside the object.
    env, src = kernel
    line = [*LINE, "--cce-auto-sync-log=sync.txt"]
    wrap("bisheng", *line, env=env, cwd=src)
    assert stats(env)["uncacheable_reasons"] == {
        "cc: --cce-auto-sync-log=sync.txt writes a side file a hit could not give back": 1
    }


# -- review of the Ascend paths, 2026-11-28 --------------------------------------------------


@pytest.mark.parametrize(
    "words",
    [
        ["-mllvm", "-cce-aicore-record-overflow", "-mllvm", "list.txt"],  # (LLVM: the next word)
        ["-mllvm", "-cce-aicore-record-overflow=list.txt"],
        ["-mllvm", "-stats", "-mllvm", "-info-output-file=stats.txt"],
        ["-mllvm", "-info-output-file", "-mllvm", "stats.txt"],
        ["-mllvm", "-cce-aicore-dump-ir"],
    ],
)
def test_an_mllvm_option_naming_or_writing_a_file_runs_uncached(kernel, words):
    # The file it reads is in no key; the file it writes a hit could not give back.
    env, src = kernel
    (src / "list.txt").write_text("fun:add_kernel\n")
    wrap("bisheng", *LINE, *words, env=env, cwd=src)
    reasons = host(env)["uncacheable_reasons"]
    assert len(reasons) == 1 and "-mllvm" in next(iter(reasons)), reasons


def test_a_compile_for_a_host_and_its_device_runs_uncached_with_its_reason(tmp_path):
    # A mixed line (clang's offloading, bisheng without --cce-aicore-only) preprocesses
    # once per target: cc -M gives a rule and a search list each.  Before: "cannot read
    # k.o:", the second rule's target taken for a header.
    clang = real_compiler("bisheng")
    if clang is None:
        pytest.skip("needs clang")
    (tmp_path / "bin").mkdir()
    compiled_script(
        tmp_path / "bin" / "bisheng",
        f'case " $* " in *" -M "*) {clang} "$@" || exit; esac\nexec {clang} "$@"\n',
    )
    (tmp_path / "k.c").write_text("int k(void) { return 1; }\n")
    env = base_env(tmp_path, tmp_path / "bin")
    wrap("bisheng", "-c", "k.c", "-o", "k.o", env=env, cwd=tmp_path)
    assert (tmp_path / "k.o").exists()
    reasons = host(env)["uncacheable_reasons"]
    assert list(reasons) == ["cc: a compile for more than one target (a rule each in cc -M)"]
