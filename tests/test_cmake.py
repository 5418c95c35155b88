"""A real CMake + Ninja kernel project built through opcache, three ways.

The project (``helpers_ascend.write_project``): 20 bisheng kernels (C++ with
the Ascend flags), four ASC-language kernels, two C host files, shared
headers; bisheng is the stand-in over clang.  Each way builds it, wipes the
build folder and builds it again (every compile a hit, the same bytes), then
edits one header: ninja rebuilds exactly the files that include it, which it
knows from the dependency files opcache gave back on the hits.

- ``CMAKE_<LANG>_COMPILER_LAUNCHER``, spelled ``opcache;wrap;--`` (C, ASC) or
  plain ``opcache``, as ccache is (CXX);
- the masquerade: ``opcache masquerade`` links first on PATH;
- a wrapper script in the style of ops-nn's ``gen_bisheng``: a ``bisheng``
  first on PATH that runs ``opcache $BISHENG_REAL_PATH "$@"``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_ascend import cmake_available, make_stand_in, real_compiler, write_project
from helpers_wrap import opcache, opcache_script, stats

pytestmark = pytest.mark.skipif(cmake_available() is not None, reason=str(cmake_available()))

OBJECTS = 26  # 20 C++ kernels, 4 ASC kernels, 2 C files


def counts(env: dict[str, str]) -> tuple[int, int]:
    """(misses, hits) of the C-family compiles so far (none before the cache exists)."""
    if not any(Path(env["HOME"], "cache").glob("kernel_cache*/host")):
        return 0, 0
    chip = stats(env, "host")
    return chip.get("misses", 0), chip.get("hits", 0)


class Build:
    """One way of building the project: configure + ninja, and what each build did."""

    def __init__(self, root: Path, env: dict[str, str], cmake_args: list[str]) -> None:
        self.root, self.env, self.cmake_args = root, env, cmake_args
        self.build = root / "build"

    def configure(self) -> None:
        shutil.rmtree(self.build, ignore_errors=True)
        subprocess.run(
            ["cmake", "-G", "Ninja", "-S", str(self.root), "-B", str(self.build), *self.cmake_args],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=300,
        )

    def ninja(self) -> tuple[set[str], tuple[int, int]]:
        """(the objects ninja built, (misses, hits) of these compiles)."""
        before = counts(self.env)
        done = subprocess.run(
            ["ninja", "-v"], cwd=self.build, env=self.env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        built = set(re.findall(r" -o (CMakeFiles/\S+\.o) ", done.stdout))
        after = counts(self.env)
        return built, (after[0] - before[0], after[1] - before[1])

    def objects(self) -> dict[str, bytes]:
        return {
            str(p.relative_to(self.build)): p.read_bytes()
            for p in self.build.glob("CMakeFiles/*.dir/src/*.o")
        }


def build_twice_then_edit_a_header(build: Build, includers: dict[str, list[str]]) -> None:
    build.configure()
    built, (misses, hits) = build.ninja()
    assert len(built) == OBJECTS and (misses, hits) == (OBJECTS, 0)
    first = build.objects()
    assert len(first) == OBJECTS
    build.configure()  # a fresh build folder: everything compiles again
    built, (misses, hits) = build.ninja()
    assert len(built) == OBJECTS and (misses, hits) == (0, OBJECTS)
    assert build.objects() == first
    header = build.root / "include" / "vector.h"
    header.write_text(header.read_text().replace("2.0f", "3.0f"))
    built, (misses, hits) = build.ninja()
    assert built == set(includers["vector.h"])  # from the .d files the hits restored
    assert (misses, hits) == (len(built), 0)
    changed = {name for name, data in build.objects().items() if first[name] != data}
    assert changed == set(includers["vector.h"])
    built, _ = build.ninja()
    assert built == set()  # nothing left to do


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, dict[str, list[str]], Path]:
    """(the project's folder, its headers' includers, a folder with the stand-in bisheng)."""
    real = real_compiler("bisheng")
    assert real is not None
    stand_in = make_stand_in(tmp_path / "cann" / "bin", "bisheng", real)
    root = tmp_path / "project"
    return root, write_project(root), stand_in.parent


def test_compiler_launchers_for_c_cxx_and_asc(project, tmp_path):
    root, includers, cann = project
    env = base_env(tmp_path, cann)
    launcher = f"{opcache_script()};wrap;--"
    args = [f"-DCMAKE_{lang}_COMPILER_LAUNCHER={launcher}" for lang in ("C", "ASC")]
    args.append(f"-DCMAKE_CXX_COMPILER_LAUNCHER={opcache_script()}")  # (ccache's spelling)
    args += [f"-DCMAKE_CXX_COMPILER={cann / 'bisheng'}", "-DCMAKE_C_COMPILER=gcc"]
    build_twice_then_edit_a_header(Build(root, env, args), includers)


def test_the_masquerade(project, tmp_path):
    root, includers, cann = project
    env = base_env(tmp_path, cann)
    links = tmp_path / "links"
    opcache("masquerade", str(links), env=env, cwd=tmp_path)
    assert (links / "bisheng").is_symlink() and (links / "gcc").is_symlink()
    env["PATH"] = f"{links}:{env['PATH']}"
    args = ["-DCMAKE_CXX_COMPILER=bisheng", "-DCMAKE_C_COMPILER=gcc"]
    build_twice_then_edit_a_header(Build(root, env, args), includers)


def test_a_gen_bisheng_style_wrapper(project, tmp_path):
    """ops-nn's build.sh writes build/gen_bisheng_dir/bisheng running
    ``<ccache program> "$BISHENG_REAL_PATH" "$@"`` and puts it first on PATH:
    opcache as that program."""
    root, includers, cann = project
    env = base_env(tmp_path, cann)
    wrapper_dir = tmp_path / "gen_bisheng_dir"
    wrapper_dir.mkdir()
    wrapper = wrapper_dir / "bisheng"
    wrapper.write_text(
        "#!/bin/bash\n"
        f'export BISHENG_REAL_PATH="{cann / "bisheng"}"\n'
        f'exec "{opcache_script()}" "${{BISHENG_REAL_PATH}}" "$@"\n'
    )
    wrapper.chmod(0o755)
    env["PATH"] = f"{wrapper_dir}:{env['PATH']}"
    args = ["-DCMAKE_CXX_COMPILER=bisheng", "-DCMAKE_C_COMPILER_LAUNCHER=" + opcache_script()]
    args[-1] += ";wrap;--"
    build_twice_then_edit_a_header(Build(root, env, args), includers)
