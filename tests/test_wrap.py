"""``opcache wrap -- <command>``: opc lines (stand-in opc), C compiler lines (real gcc), masquerade.

Every flow runs ``opcache`` as a real subprocess with an explicit environment
(HOME and ASCEND_CACHE_PATH under the test's folder).  Hits are proven by the
stand-in opc's invocation log and by ``opcache stats --json``; restored bytes
are compared with the bytes of a fresh compile without the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from fake_opc import SOC, base_env, invocations, write_opc, write_operator
from helpers_faults import IS_ROOT, NEEDS_ROOT, NOBODY, read_only
from helpers_wrap import (
    GCC,
    opcache,
    opcache_script,
    plain_gcc,
    stats,
    wrap,
    wrap_imports,
    write_project,
)

from opcache import OpCache, resolve_settings
from opcache.cli import main

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")

OPC_ARGS = [
    "add.py",
    "--main_func=add",
    "--input_param=p.json",
    f"--soc_version={SOC}",
    "--output=out",
]


def not_a_cache(env: dict[str, str]) -> bool:
    """True when ``opcache stats`` finds no cache where the environment points."""
    done = opcache("stats", env=env, cwd=Path(env["HOME"]), status=1)
    return done.stderr.startswith(b"opcache: error: no cache in ")


def read_dir(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# -- opc ----------------------------------------------------------------------------


@pytest.fixture
def opc(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(environment with the stand-in opc first on PATH, the operator's folder)."""
    write_opc(tmp_path / "bin")
    op_dir = tmp_path / "op"
    write_operator(op_dir)
    return base_env(tmp_path, tmp_path / "bin"), op_dir


def opc_runs(env: dict[str, str]) -> int:
    return len(invocations(Path(env["FAKE_OPC_LOG"])))


def fresh_opc(env: dict[str, str], op_dir: Path, *args: str) -> dict[str, bytes]:
    """What opc itself writes for ``args`` (no cache), into a scratch folder."""
    out = op_dir.parent / "fresh"
    shutil.rmtree(out, ignore_errors=True)
    quiet = {k: v for k, v in env.items() if k != "FAKE_OPC_LOG"}
    args = [a for a in args if not a.startswith("--output")]
    subprocess.run(["opc", *args, f"--output={out}"], env=quiet, cwd=op_dir, check=True)
    return read_dir(out)


def test_opc_miss_runs_opc_once_then_hit_restores_identical_bytes(opc):
    env, op_dir = opc
    first = wrap("opc", *OPC_ARGS, env=env, cwd=op_dir)
    assert opc_runs(env) == 1
    out = op_dir / "out"
    files = read_dir(out)
    assert sorted(files) == ["add_kernel.json", "add_kernel.o"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging left
    assert b"opc: compiled add_kernel" in first.stdout
    assert b"is a stand-in" in first.stderr

    shutil.rmtree(out)
    second = wrap("opc", *OPC_ARGS, env=env, cwd=op_dir)
    assert opc_runs(env) == 1  # the hit did not run opc
    assert read_dir(out) == files == fresh_opc(env, op_dir, *OPC_ARGS)
    assert second.stdout == first.stdout  # the tool's output is replayed
    assert second.stderr == first.stderr
    chip = stats(env, SOC)
    assert (chip["hits"], chip["misses"], chip["entries"]) == (1, 1, 1)


def test_opc_by_absolute_path_and_space_separated_flags(opc, tmp_path):
    env, op_dir = opc
    path = str(tmp_path / "bin" / "opc")
    args = ["add.py", "--main_func", "add", "--input_param", "p.json", "--soc_version", SOC]
    wrap(path, *args, "--output", "out", env=env, cwd=op_dir)
    wrap(path, *OPC_ARGS, env=env, cwd=op_dir)  # the same compile, spelled with '='
    assert opc_runs(env) == 1
    assert sorted(read_dir(op_dir / "out")) == ["add_kernel.json", "add_kernel.o"]


def test_opc_failure_propagates_its_status_and_output_and_caches_nothing(opc):
    env, op_dir = opc
    failing = {**env, "FAKE_OPC_FAIL": "tiling does not fit in UB", "FAKE_OPC_STATUS": "7"}
    for runs in (1, 2):
        done = wrap("opc", *OPC_ARGS, env=failing, cwd=op_dir, status=7)
        assert b"tiling does not fit in UB" in done.stderr
        assert opc_runs(env) == runs  # a failure is never served from the cache
        assert list((op_dir / "out").iterdir()) == []  # no outputs, no staging folder
    wrap("opc", *OPC_ARGS, env=env, cwd=op_dir)
    assert opc_runs(env) == 3
    assert stats(env, SOC)["entries"] == 1


def test_output_and_debug_dir_are_not_in_the_key(opc):
    env, op_dir = opc
    wrap("opc", *OPC_ARGS, env=env, cwd=op_dir)
    args = [a for a in OPC_ARGS if not a.startswith("--output")]
    wrap("opc", *args, "--output=elsewhere/deeper", "--debug_dir=dbg", env=env, cwd=op_dir)
    assert opc_runs(env) == 1
    assert read_dir(op_dir / "elsewhere" / "deeper") == read_dir(op_dir / "out")


def test_param_json_is_keyed_by_its_contents(opc):
    env, op_dir = opc
    wrap("opc", *OPC_ARGS, env=env, cwd=op_dir)
    # Same contents under another name, in another folder: a hit.
    (op_dir / "params").mkdir()
    shutil.copy(op_dir / "p.json", op_dir / "params" / "renamed.json")
    args = [a.replace("p.json", "params/renamed.json") for a in OPC_ARGS]
    wrap("opc", *args, env=env, cwd=op_dir)
    assert opc_runs(env) == 1
    # Other contents (a new shape), same kernel name: a miss with the new bytes.
    before = read_dir(op_dir / "out")
    param = json.loads((op_dir / "p.json").read_text())
    param["inputs"][0]["shape"] = [32, 1024]
    (op_dir / "p.json").write_text(json.dumps(param))
    wrap("opc", *OPC_ARGS, env=env, cwd=op_dir)
    assert opc_runs(env) == 2
    after = read_dir(op_dir / "out")
    assert after != before
    assert after == fresh_opc(env, op_dir, *OPC_ARGS)


def test_operator_source_is_keyed_by_its_contents(opc):
    env, op_dir = opc
    wrap("opc", *OPC_ARGS, env=env, cwd=op_dir)
    os.utime(op_dir / "add.py", (1, 1))  # mtime alone changes nothing
    wrap("opc", *OPC_ARGS, env=env, cwd=op_dir)
    assert opc_runs(env) == 1
    (op_dir / "add.py").write_text((op_dir / "add.py").read_text() + "# tuned\n")
    wrap("opc", *OPC_ARGS, env=env, cwd=op_dir)
    assert opc_runs(env) == 2


def test_other_flags_are_in_the_key_and_a_file_flag_by_its_contents(opc):
    env, op_dir = opc
    (op_dir / "precision.ini").write_text("Add=high_precision\n")
    with_file = [*OPC_ARGS, "--op_precision_mode=precision.ini"]
    wrap("opc", *with_file, env=env, cwd=op_dir)
    wrap("opc", *OPC_ARGS, "--impl_mode=high_performance", env=env, cwd=op_dir)
    wrap("opc", *OPC_ARGS, "--impl_mode=high_precision", env=env, cwd=op_dir)
    assert opc_runs(env) == 3
    # The same contents under another name: a hit with the bytes opc would write.
    shutil.copy(op_dir / "precision.ini", op_dir / "copy.ini")
    shutil.rmtree(op_dir / "out")
    wrap("opc", *OPC_ARGS, "--op_precision_mode=copy.ini", env=env, cwd=op_dir)
    assert opc_runs(env) == 3
    assert read_dir(op_dir / "out") == fresh_opc(env, op_dir, *with_file)
    # New contents in the same file: a miss.
    (op_dir / "precision.ini").write_text("Add=high_performance\n")
    wrap("opc", *with_file, env=env, cwd=op_dir)
    assert opc_runs(env) == 4


@pytest.mark.parametrize("level", ["1", "2", "4"])
def test_op_debug_level_on_the_opc_line_bypasses_the_cache(opc, level):
    env, op_dir = opc
    for runs in (1, 2):
        wrap("opc", *OPC_ARGS, f"--op_debug_level={level}", env=env, cwd=op_dir)
        assert opc_runs(env) == runs
        assert sorted(read_dir(op_dir / "out")) == ["add_kernel.json", "add_kernel.o"]
    chip = stats(env, SOC)
    assert (chip["bypasses"], chip["hits"], chip["misses"], chip["entries"]) == (2, 0, 0, 0)
    assert chip["bypass_reasons"] == {f"op_debug_level is {level}": 2}


def test_op_debug_level_zero_is_cached(opc):
    env, op_dir = opc
    wrap("opc", *OPC_ARGS, "--op_debug_level=0", env=env, cwd=op_dir)
    wrap("opc", *OPC_ARGS, "--op_debug_level=0", env=env, cwd=op_dir)
    assert opc_runs(env) == 1


@pytest.mark.parametrize(
    ("op_list", "bypassed"),
    [
        (None, True),
        ("add_kernel", True),
        ("OpType::Add", True),
        ("some_other_node,OpType::Mul", False),
    ],
)
def test_op_debug_config_on_the_opc_line(opc, op_list, bypassed):
    env, op_dir = opc
    cfg = op_dir / "debug.cfg"
    cfg.write_text("op_debug_config = oom\n" + (f"op_debug_list = {op_list}\n" if op_list else ""))
    for _ in range(2):
        wrap("opc", *OPC_ARGS, f"--op_debug_config={cfg}", env=env, cwd=op_dir)
    assert opc_runs(env) == (2 if bypassed else 1)
    chip = stats(env, SOC)
    assert chip["bypasses"] == (2 if bypassed else 0)
    assert chip["hits"] == (0 if bypassed else 1)


def test_wrap_cache_flags_disable_and_cache_dir(opc, tmp_path):
    env, op_dir = opc
    for _ in range(2):
        wrap("opc", *OPC_ARGS, env=env, cwd=op_dir, flags=["--op_compiler_cache_mode=disable"])
    assert opc_runs(env) == 2
    assert not_a_cache(env)  # disable never makes one
    own = tmp_path / "own_cache"
    for _ in range(2):
        wrap("opc", *OPC_ARGS, env=env, cwd=op_dir, flags=[f"--op_compiler_cache_dir={own}"])
    assert opc_runs(env) == 3
    assert not_a_cache(env)  # not in the ASCEND_CACHE_PATH cache
    chip = stats(env, SOC, f"--op_compiler_cache_dir={own}")
    assert (chip["entries"], chip["misses"], chip["hits"]) == (1, 1, 1)


def test_opc_line_it_does_not_understand_runs_uncached_with_its_status(opc):
    env, op_dir = opc
    # Two operator sources: not a command opcache can key; opc itself rejects it.
    done = wrap("opc", *OPC_ARGS, "extra.py", env=env, cwd=op_dir, status=1)
    assert b"expected one operator source" in done.stderr
    assert opc_runs(env) == 1
    report = stats(env)
    assert report["uncacheable"] == 1
    assert report["uncacheable_reasons"] == {"opc: expected exactly one operator source": 1}


def test_two_builds_of_one_operator_at_once_run_opc_once(opc):
    """Single flight across processes: the second waits for the first and hits."""
    env, op_dir = opc
    slow = {**env, "FAKE_OPC_SLEEP": "1"}
    args = [a for a in OPC_ARGS if not a.startswith("--output")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "opcache", "wrap", "--", "opc", *args, f"--output=out{i}"],
            env=slow,
            cwd=op_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
    assert opc_runs(env) == 1
    assert read_dir(op_dir / "out0") == read_dir(op_dir / "out1")
    chip = stats(env, SOC)
    assert (chip["misses"], chip["hits"]) == (1, 1)


def test_opc_masquerade(opc, tmp_path):
    """A link named ``opc`` to opcache, first on PATH, caches the real opc found later."""
    env, op_dir = opc
    links = tmp_path / "links"
    links.mkdir()
    (links / "opc").symlink_to(opcache_script())
    env = {**env, "PATH": f"{links}{os.pathsep}{env['PATH']}"}
    for _ in range(2):
        done = subprocess.run(["opc", *OPC_ARGS], env=env, cwd=op_dir, capture_output=True)
        assert done.returncode == 0, done.stderr.decode()
    assert opc_runs(env) == 1
    assert sorted(read_dir(op_dir / "out")) == ["add_kernel.json", "add_kernel.o"]
    assert stats(env, SOC)["hits"] == 1


# -- C compilers ----------------------------------------------------------------------


@pytest.fixture
def csrc(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(environment, a folder with k.c including h.h)."""
    return base_env(tmp_path), write_project(tmp_path / "src")


def host(env: dict[str, str]) -> dict:
    return stats(env, "host")


def test_cc_miss_then_hit_with_the_bytes_of_a_plain_compile(csrc, tmp_path):
    env, src = csrc
    cmd = ["gcc", "-O2", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, env=env, cwd=src)
    first = (src / "k.o").read_bytes()
    (src / "k.o").unlink()
    wrap(*cmd, env=env, cwd=src)
    chip = host(env)
    assert (chip["misses"], chip["hits"]) == (1, 1)
    plain = tmp_path / "plain"
    shutil.copytree(src, plain)
    (plain / "k.o").unlink()
    plain_gcc(plain, "-O2", "-DOFFSET=1", "-c", "k.c", "-o", "k.o")
    assert (src / "k.o").read_bytes() == first == (plain / "k.o").read_bytes()
    assert [p.name for p in src.iterdir() if p.name.startswith(".")] == []


def test_cc_header_change_is_a_miss_with_the_new_bytes(csrc, tmp_path):
    env, src = csrc
    cmd = ["gcc", "-O2", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, env=env, cwd=src)
    old = (src / "k.o").read_bytes()
    (src / "h.h").write_text("#define FACTOR 5\n")
    wrap(*cmd, env=env, cwd=src)
    assert host(env)["misses"] == 2
    new = (src / "k.o").read_bytes()
    plain_gcc(src, "-O2", "-DOFFSET=1", "-c", "k.c", "-o", "plain.o")
    assert new != old
    assert new == (src / "plain.o").read_bytes()


def test_cc_headers_swapping_contents_is_a_miss(csrc):
    """Which header holds which contents matters, not only the set of contents."""
    env, src = csrc
    first = "#ifndef X\n#define X 1\n#endif\n"
    second = "#ifndef X\n#define X 2\n#endif\n"
    (src / "s.c").write_text('#include "a.h"\n#include "b.h"\nint f(void) { return X; }\n')
    (src / "a.h").write_text(first)
    (src / "b.h").write_text(second)
    wrap("gcc", "-c", "s.c", "-o", "s.o", env=env, cwd=src)
    (src / "a.h").write_text(second)
    (src / "b.h").write_text(first)
    wrap("gcc", "-c", "s.c", "-o", "s.o", env=env, cwd=src)
    plain_gcc(src, "-c", "s.c", "-o", "plain.o")
    assert (src / "s.o").read_bytes() == (src / "plain.o").read_bytes()
    assert host(env)["misses"] == 2


def test_cc_header_in_an_include_folder(csrc):
    env, src = csrc
    (src / "inc").mkdir()
    (src / "h.h").rename(src / "inc" / "h.h")
    cmd = ["gcc", "-Iinc", "-DOFFSET=2", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, env=env, cwd=src)
    (src / "inc" / "h.h").write_text("#define FACTOR 7\n")
    wrap(*cmd, env=env, cwd=src)
    plain_gcc(src, "-Iinc", "-DOFFSET=2", "-c", "k.c", "-o", "plain.o")
    assert host(env)["misses"] == 2
    assert (src / "k.o").read_bytes() == (src / "plain.o").read_bytes()


def test_cc_same_sources_in_another_folder_hit(csrc, tmp_path):
    env, src = csrc
    cmd = ["gcc", "-O2", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, env=env, cwd=src)
    other = tmp_path / "elsewhere" / "checkout"
    shutil.copytree(src, other)
    (other / "k.o").unlink()
    wrap(*cmd, env=env, cwd=other)
    assert host(env)["hits"] == 1
    assert (other / "k.o").read_bytes() == (src / "k.o").read_bytes()


def test_cc_debug_info_keys_the_folder(csrc, tmp_path):
    """-g records the compile folder in the object: another folder must not hit."""
    env, src = csrc
    cmd = ["gcc", "-g", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, env=env, cwd=src)
    other = tmp_path / "other"
    shutil.copytree(src, other)
    (other / "k.o").unlink()
    wrap(*cmd, env=env, cwd=other)
    assert host(env)["misses"] == 2
    plain_gcc(other, "-g", "-DOFFSET=1", "-c", "k.c", "-o", "plain.o")
    assert (other / "k.o").read_bytes() == (other / "plain.o").read_bytes()
    assert (other / "k.o").read_bytes() != (src / "k.o").read_bytes()


def test_cc_define_change_is_a_miss(csrc):
    env, src = csrc
    wrap("gcc", "-DOFFSET=1", "-c", "k.c", "-o", "k.o", env=env, cwd=src)
    one = (src / "k.o").read_bytes()
    wrap("gcc", "-DOFFSET=2", "-c", "k.c", "-o", "k.o", env=env, cwd=src)
    wrap("gcc", "-D", "OFFSET=2", "-c", "k.c", "-o", "k2.o", env=env, cwd=src)
    chip = host(env)
    assert chip["misses"] >= 2
    assert (src / "k.o").read_bytes() != one
    plain_gcc(src, "-DOFFSET=2", "-c", "k.c", "-o", "plain.o")
    assert (src / "k.o").read_bytes() == (src / "plain.o").read_bytes()
    assert (src / "k2.o").read_bytes() == (src / "plain.o").read_bytes()


def test_cc_optimisation_level_is_in_the_key(csrc):
    env, src = csrc
    wrap("gcc", "-O0", "-DOFFSET=1", "-c", "k.c", "-o", "k.o", env=env, cwd=src)
    wrap("gcc", "-O2", "-DOFFSET=1", "-c", "k.c", "-o", "k.o", env=env, cwd=src)
    assert host(env)["misses"] == 2


def test_cc_mtime_alone_is_not_a_miss(csrc):
    env, src = csrc
    cmd = ["gcc", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, env=env, cwd=src)
    os.utime(src / "k.c", (1, 1))
    os.utime(src / "h.h", (1, 1))
    wrap(*cmd, env=env, cwd=src)
    assert host(env)["hits"] == 1


def test_cc_dependency_file_is_restored(csrc, tmp_path):
    env, src = csrc
    cmd = ["gcc", "-MD", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, env=env, cwd=src)
    deps = (src / "k.d").read_text()
    assert deps.startswith("k.o:") and "h.h" in deps
    (src / "k.d").unlink()
    (src / "k.o").unlink()
    wrap(*cmd, env=env, cwd=src)
    assert host(env)["hits"] == 1
    plain = tmp_path / "plain"
    shutil.copytree(src, plain)
    for name in ("k.o", "k.d"):
        (plain / name).unlink()
    plain_gcc(plain, "-MD", "-DOFFSET=1", "-c", "k.c", "-o", "k.o")
    assert (src / "k.d").read_text() == (plain / "k.d").read_text()
    assert (src / "k.o").read_bytes() == (plain / "k.o").read_bytes()


def test_cc_dependency_file_names_this_compiles_object(csrc):
    """Two -o of one compile: each dependency file names its own object (make reads it)."""
    env, src = csrc
    for folder in ("a", "b"):
        (src / folder).mkdir()
        wrap("gcc", "-MD", "-DOFFSET=1", "-c", "k.c", "-o", f"{folder}/k.o", env=env, cwd=src)
        assert (src / folder / "k.d").read_text().startswith(f"{folder}/k.o:")
    (src / "b" / "k.d").unlink()
    wrap("gcc", "-MD", "-DOFFSET=1", "-c", "k.c", "-o", "b/k.o", env=env, cwd=src)
    assert (src / "b" / "k.d").read_text().startswith("b/k.o:")
    assert host(env)["hits"] == 1


@pytest.mark.parametrize("output", ["o$x.o", "a b.o", ".o", "noext", "a.b.o"])
def test_cc_md_writes_the_dependency_file_gcc_writes(csrc, output):
    """-MD without -MF or -MT: the file gcc names (its last suffix made .d, ".o" gives
    ".d"), its target quoted for make as gcc quotes it (o$$x.o, a\\ b.o)."""
    env, src = csrc
    plain = subprocess.run(
        ["gcc", "-MD", "-DOFFSET=1", "-c", "k.c", "-o", output], cwd=src, capture_output=True
    )
    assert plain.returncode == 0
    made = sorted(p.name for p in src.iterdir() if p.name.endswith(".d"))
    expected = {name: (src / name).read_bytes() for name in made}
    for name in made:
        (src / name).unlink()
    for _ in range(2):
        wrap("gcc", "-MD", "-DOFFSET=1", "-c", "k.c", "-o", output, env=env, cwd=src)
        assert {n: (src / n).read_bytes() for n in made} == expected
        assert sorted(p.name for p in src.iterdir() if p.name.endswith(".d")) == made
    assert host(env)["hits"] == 1


def test_cc_mmd_with_mf_and_mt(csrc):
    env, src = csrc
    cmd = ["gcc", "-MMD", "-MF", "deps/k.dep", "-MT", "obj/k.o", "-DOFFSET=1"]
    (src / "deps").mkdir()
    (src / "obj").mkdir()
    wrap(*cmd, "-c", "k.c", "-o", "obj/k.o", env=env, cwd=src)
    text = (src / "deps" / "k.dep").read_text()
    (src / "deps" / "k.dep").unlink()
    wrap(*cmd, "-c", "k.c", "-o", "obj/k.o", env=env, cwd=src)
    assert host(env)["hits"] == 1
    assert (src / "deps" / "k.dep").read_text() == text
    assert text.startswith("obj/k.o:") and "h.h" in text and "stdio" not in text


@pytest.fixture
def other_fs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A folder on another file system than tmp_path (tmpfs's /dev/shm)."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's folder")
    folder = Path(tempfile.mkdtemp(prefix="opcache-test-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_cc_a_dependency_file_on_another_file_system_is_put_in_place(csrc, other_fs):
    """-MF on another file system than -o (where the staging folder is): the miss and
    the hit put it in place, with no warning and no second run of the compiler."""
    env, src = csrc
    deps = other_fs / "k.d"
    cmd = ["gcc", "-MD", "-MF", str(deps), "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    for _ in range(2):
        deps.write_text("an older one\n")
        done = wrap(*cmd, env=env, cwd=src)
        assert b"cannot put the outputs in place" not in done.stderr, done.stderr
        assert deps.read_text().startswith("k.o: k.c")
        assert stat.S_IMODE(deps.stat().st_mode) == 0o666 & ~_umask()
        assert [p.name for p in other_fs.iterdir()] == ["k.d"]  # (no temp file left)
    assert (host(env)["hits"], host(env)["misses"], host(env).get("errors", 0)) == (1, 1, 0)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_cc_warnings_are_replayed_on_a_hit(csrc):
    env, src = csrc
    (src / "w.c").write_text('#warning "kernel-warning-42"\nint w(void) { return 1; }\n')
    first = wrap("gcc", "-c", "w.c", "-o", "w.o", env=env, cwd=src)
    second = wrap("gcc", "-c", "w.c", "-o", "w.o", env=env, cwd=src)
    assert host(env)["hits"] == 1
    assert b"kernel-warning-42" in first.stderr
    assert second.stderr == first.stderr


def test_cc_bypassed_by_a_debug_flag_says_so_plainly(csrc):
    env, src = csrc
    flags = ["-v", "--op_debug_level=1"]
    done = wrap("gcc", "-DOFFSET=1", "-c", "k.c", "-o", "k.o", env=env, cwd=src, flags=flags)
    said = done.stderr.decode().splitlines()
    assert "opcache: debug: bypassing the cache for cc: op_debug_level is 1" in said, said
    assert host(env)["bypasses"] == 1


def test_cc_compile_error_propagates_and_is_not_cached(csrc):
    env, src = csrc
    (src / "bad.c").write_text("int bad(void) { return undeclared_thing_42; }\n")
    for _ in range(2):
        done = wrap("gcc", "-c", "bad.c", "-o", "bad.o", env=env, cwd=src, status=None)
        assert done.returncode == 1
        assert b"undeclared_thing_42" in done.stderr
        assert not (src / "bad.o").exists()
    assert host(env).get("entries", 0) == 0
    assert host(env).get("hits", 0) == 0


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        (["gcc", "-E", "-DOFFSET=9", "k.c"], "cc: preprocess only (-E)"),
        (["gcc", "-DOFFSET=1", "k.c", "main.c", "-o", "prog"], "cc: not a compile to an object"),
        (["echo", "hi"], "not a known compiler: echo"),
    ],
)
def test_commands_it_does_not_understand_run_uncached(csrc, command, reason):
    env, src = csrc
    (src / "main.c").write_text(
        "int scale(int);\nint main(void) { return scale(2) == 7 ? 0 : 1; }\n"
    )
    done = wrap(*command, env=env, cwd=src)
    if command[0] == "echo":
        assert done.stdout == b"hi\n"
    elif "-E" in command:
        assert b"return x * 3 + 9;" in done.stdout
    else:
        assert subprocess.run([str(src / "prog")]).returncode == 0
    report = stats(env)
    assert report["uncacheable"] == 1
    (recorded,) = report["uncacheable_reasons"]
    assert recorded.startswith(reason)
    assert report["hits"] == report["misses"] == 0
    text = opcache("stats", env=env, cwd=src).stdout.decode()
    assert "not cached: compiles opcache cannot key (1 call)" in text
    assert f"         1  {recorded}\n" in text


def test_stats_says_why_calls_were_not_cached_most_frequent_first(tmp_path):
    env = base_env(tmp_path)
    settings = resolve_settings(environ=env, op_compiler_cache_mode="enable")
    with OpCache(settings) as cache:
        for n in range(12):  # reason n counted n + 1 times
            for _ in range(n + 1):
                cache.record_uncacheable("host", f"cc: unsupported flag -fthing{n:02}")
        cache.record_uncacheable("host", "cc: not a compile to an object (-c missing)")
    text = opcache("stats", env=env, cwd=tmp_path).stdout.decode().splitlines()
    start = text.index("not cached: compiles opcache cannot key (79 calls), most frequent first:")
    shown = text[start + 1 :]
    assert shown[0] == "        12  cc: unsupported flag -fthing11"
    assert shown[9] == "         3  cc: unsupported flag -fthing02"
    assert shown[10] == "         4  3 other reasons (opcache stats --json lists every one)"
    assert len(shown) == 11


def test_cc_output_that_is_not_a_regular_file_is_left_alone(csrc):
    """``-o`` naming a link (here to /dev/null) runs uncached and keeps the link."""
    env, src = csrc
    (src / "null").symlink_to(os.devnull)
    wrap("gcc", "-DOFFSET=1", "-c", "k.c", "-o", "null", env=env, cwd=src)
    assert (src / "null").is_symlink() and os.readlink(src / "null") == os.devnull
    assert stats(env)["uncacheable_reasons"] == {"cc: an output is not a regular file": 1}


def test_cc_output_folder_missing_lets_the_compiler_say_why(csrc):
    env, src = csrc
    done = wrap("gcc", "-DOFFSET=1", "-c", "k.c", "-o", "nowhere/k.o", env=env, cwd=src, status=1)
    assert b"nowhere/k.o" in done.stderr
    assert stats(env)["uncacheable"] == 1


def test_cc_output_folder_opcache_cannot_write_in_lets_the_compiler_say_why(csrc, tmp_path):
    env, src = csrc
    out = tmp_path / "read-only"
    out.mkdir()
    cmd = ["gcc", "-DOFFSET=1", "-c", "k.c", "-o", str(out / "k.o")]
    with read_only(out):
        plain = subprocess.run([GCC, *cmd[1:]], cwd=src, capture_output=True)
        assert plain.returncode != 0 and b"Read-only file system" in plain.stderr
        done = wrap(*cmd, env=env, cwd=src, status=plain.returncode)
    assert done.stderr == plain.stderr  # the compiler's own words, nothing of opcache's
    reasons = stats(env)["uncacheable_reasons"]
    assert reasons == {"cannot write in the output folder: Read-only file system": 1}


def test_cc_paths_with_spaces_dollars_and_hashes_are_cached(csrc, tmp_path):
    """``cc -M`` quotes such names for make; opcache reads them back as gcc wrote them."""
    env, _ = csrc
    src = tmp_path / "dir with space $HOME #1"
    headers = src / "sub dir #2"
    headers.mkdir(parents=True)
    (headers / "h $x #y.h").write_text("#define FACTOR 3\n")
    (headers / "back\\ slash\tand tab.h").write_text("#define OFFSET 4\n")
    (src / "my file.c").write_text(
        '#include "h $x #y.h"\n#include "back\\ slash\tand tab.h"\n'
        "int scale(int x) { return x * FACTOR + OFFSET; }\n"
    )
    cmd = ["gcc", f"-I{headers.name}", "-c", "my file.c", "-o", "my $file #1.o"]
    for _ in range(2):
        (src / "my $file #1.o").unlink(missing_ok=True)
        wrap(*cmd, env=env, cwd=src)
    assert (host(env)["misses"], host(env)["hits"]) == (1, 1)
    plain_gcc(src, *cmd[1:-1], "plain.o")
    assert (src / "my $file #1.o").read_bytes() == (src / "plain.o").read_bytes()
    # The headers are in the key: a change to either is a miss.
    for header, text in (("h $x #y.h", "#define FACTOR 5\n"),
                         ("back\\ slash\tand tab.h", "#define OFFSET 6\n")):  # fmt: skip
        (headers / header).write_text(text)
        wrap(*cmd, env=env, cwd=src)
    assert (host(env)["misses"], host(env)["hits"]) == (3, 1)
    assert stats(env)["uncacheable"] == 0


def test_cc_words_and_folders_that_are_not_utf8_are_cached(csrc, tmp_path):
    """A byte that is no UTF-8 in a -D value or the folder's name: the compile is gcc's,
    and another such byte is another key."""
    env, _ = csrc
    src = Path(os.fsdecode(bytes(tmp_path) + b"/dir\xff"))
    shutil.copytree(csrc[1], src)
    for value in (b"\xff", b"\xfe", b"\xff"):
        define = os.fsdecode(b'-DNAME="' + value + b'"')
        wrap("gcc", "-g", define, "-DOFFSET=1", "-c", "k.c", "-o", "k.o", env=env, cwd=src)
        plain_gcc(src, "-g", define, "-DOFFSET=1", "-c", "k.c", "-o", "plain.o")
        assert (src / "k.o").read_bytes() == (src / "plain.o").read_bytes()
    assert (host(env)["misses"], host(env)["hits"]) == (2, 1)


def test_uncacheable_command_keeps_its_exit_status(csrc):
    env, src = csrc
    done = wrap("sh", "-c", "echo out; echo err >&2; exit 5", env=env, cwd=src, status=5)
    assert (done.stdout, done.stderr) == (b"out\n", b"err\n")


def test_missing_command_is_reported(csrc):
    env, src = csrc
    done = wrap("no-such-compiler-xyz", "-c", "k.c", env=env, cwd=src, status=127)
    assert b"no-such-compiler-xyz" in done.stderr


def test_cc_masquerade_through_a_link_named_gcc(csrc, tmp_path):
    env, src = csrc
    links = tmp_path / "links"
    links.mkdir()
    (links / "gcc").symlink_to(opcache_script())
    env = {**env, "PATH": f"{links}{os.pathsep}{env['PATH']}"}
    assert shutil.which("gcc", path=env["PATH"]) == str(links / "gcc")
    for _ in range(2):
        done = subprocess.run(
            ["gcc", "-DOFFSET=4", "-c", "k.c", "-o", "k.o"], env=env, cwd=src, capture_output=True
        )
        assert done.returncode == 0, done.stderr.decode()
    chip = host(env)
    assert (chip["misses"], chip["hits"]) == (1, 1)
    plain_gcc(src, "-DOFFSET=4", "-c", "k.c", "-o", "plain.o")
    assert (src / "k.o").read_bytes() == (src / "plain.o").read_bytes()


def test_a_link_called_by_its_path_finds_the_compiler_before_its_folder_on_path(csrc, tmp_path):
    """CC=~/opcache-bin/gcc with that folder at PATH's end: only the folders after it
    were searched, and the compile failed with 127."""
    env, src = csrc
    links = tmp_path / "links"
    links.mkdir()
    (links / "gcc").symlink_to(opcache_script())
    env = {**env, "PATH": f"{env['PATH']}{os.pathsep}{links}"}
    done = subprocess.run(
        [str(links / "gcc"), "-DOFFSET=4", "-c", "k.c", "-o", "k.o"],
        env=env,
        cwd=src,
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr.decode()
    plain_gcc(src, "-DOFFSET=4", "-c", "k.c", "-o", "plain.o")
    assert (src / "k.o").read_bytes() == (src / "plain.o").read_bytes()


@pytest.mark.parametrize("client", [False, True], ids=["links", "--client"])
@pytest.mark.parametrize(
    "kind",
    [
        "others may write it",
        "a link",
        "another user's",
        "in a folder others may write",
        "in another user's folder",
        "through another user's link",
    ],
)
def test_masquerade_refuses_a_folder_others_may_change(tmp_path, kind, client):
    """The folder goes first on PATH: one anyone may write (mkdir -m 777), a link
    someone may point elsewhere, or another user's folder, was taken, and its links
    recommended.  With --client, opcache's client was built into it (through the
    link) before the folder was refused: nothing may be written into a refused one.
    So was one in a folder someone else may rename it in (it is theirs, or others
    may write it and it is not sticky), or one named through another user's link:
    they could put a folder of theirs in its place later."""
    folder = tmp_path / "bin"
    if kind.startswith(("in ", "through ")):
        if kind != "in a folder others may write" and not IS_ROOT:
            pytest.skip(NEEDS_ROOT)
        parent = tmp_path / "shared"
        parent.mkdir()
        folder = parent / "bin"
        if kind == "in a folder others may write":
            parent.chmod(0o777)
        elif kind == "in another user's folder":
            os.chown(parent, NOBODY, NOBODY)
        else:
            (tmp_path / "theirs").symlink_to(parent)
            os.lchown(tmp_path / "theirs", NOBODY, NOBODY)
            folder = tmp_path / "theirs" / "bin"
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
        line = ["masquerade", *(["--client"] if client else []), str(folder)]
        done = opcache(*line, env=env, cwd=tmp_path, status=None, timeout=240)
        assert done.returncode == 1 and b"yours alone" in done.stderr, done.stderr
        assert not (parent / "bin").exists()  # (nothing made there)
        return
    if kind == "a link":
        (tmp_path / "real").mkdir()
        folder.symlink_to(tmp_path / "real")
    elif kind == "another user's":
        if not IS_ROOT:
            pytest.skip(NEEDS_ROOT)
        folder.mkdir()
        os.chown(folder, NOBODY, NOBODY)  # (0755: root may write in it, and must not)
    else:
        folder.mkdir()
        folder.chmod(0o777)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    line = ["masquerade", *(["--client"] if client else []), str(folder)]
    done = opcache(*line, env=env, cwd=tmp_path, status=None, timeout=240)
    assert done.returncode == 1 and b"yours alone" in done.stderr, done.stderr
    assert done.stderr.count(b"\n") == 1, done.stderr  # (the refusal alone: no warning)
    assert list((tmp_path / "real" if kind == "a link" else folder).iterdir()) == []


def test_masquerade_takes_a_folder_in_a_sticky_one_others_may_write(tmp_path):
    """In /tmp (1777) only the folder's owner may rename it: it stays the user's."""
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    opcache("masquerade", str(sticky / "bin"), env=env, cwd=tmp_path)
    assert (sticky / "bin" / "gcc").is_symlink()


# -- the command line itself -------------------------------------------------------------


def test_wrap_needs_a_command_after_double_dash(capsys):
    assert main(["wrap", "gcc", "-c", "k.c"]) == 2
    assert main(["wrap", "--"]) == 2
    err = capsys.readouterr().err
    assert err.count("opcache: error:") == 2 and "Traceback" not in err


def test_a_bad_cache_flag_stops_before_the_command_runs(opc):
    env, op_dir = opc
    done = wrap(
        "opc", *OPC_ARGS, env=env, cwd=op_dir, status=2, flags=["--op_compiler_cache_mode=bogus"]
    )
    assert b"op_compiler_cache_mode" in done.stderr
    assert opc_runs(env) == 0


def test_wrap_flags_take_either_spelling_and_a_mistake_is_one_line(csrc, tmp_path):
    env, src = csrc
    cmd = ["gcc", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    for flags in (["--op_compiler_cache_dir", str(tmp_path / "c")],
                  [f"--op_compiler_cache_dir={tmp_path / 'c'}", "-v"]):  # fmt: skip
        wrap(*cmd, env=env, cwd=src, flags=flags)
    assert stats(env, "host", f"--op_compiler_cache_dir={tmp_path / 'c'}")["hits"] == 1
    (src / "k.o").unlink()
    for flags in (["--op_compiler_cache_dri=x"], ["--op_compiler_cache_dir"], ["-x"]):
        done = wrap(*cmd, env=env, cwd=src, flags=flags, status=2)
        assert done.stderr.decode().count("\n") == 1, done.stderr
        assert done.stderr.startswith(b"opcache: error: wrap: ")
    assert not (src / "k.o").exists()  # the command did not run
    usage = opcache("wrap", "-v", "--help", env=env, cwd=src).stdout.decode()
    assert "--op_compiler_cache_mode" in usage and "-- COMMAND" in usage


def test_a_warning_shows_without_verbose_and_the_compile_succeeds(csrc, tmp_path):
    env, src = csrc
    (tmp_path / "a-file").write_text("not a folder")
    flags = ["--op_compiler_cache_dir", str(tmp_path / "a-file" / "cache")]
    done = wrap("gcc", "-DOFFSET=1", "-c", "k.c", "-o", "k.o", env=env, cwd=src, flags=flags)
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opcache: warning: "), lines
    assert (src / "k.o").exists()


def test_a_wrap_hit_imports_nothing_it_does_not_need(csrc):
    """`opcache wrap` starts a Python per compile command: its imports are its cost."""
    env, src = csrc
    cmd = ["gcc", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, env=env, cwd=src)
    status, modules, stderr = wrap_imports(cmd, env, src)
    assert status == "0" and host(env)["hits"] == 1, stderr
    heavy = {
        "argparse", "configparser", "dataclasses", "filelock", "inspect", "logging",
        "multiprocessing", "shutil", "subprocess", "tempfile", "typing",
        "opcache.trash",  # (deleting is a miss's or a trim's work)
        "opcache.explain", "opcache.shared_work",  # (a miss's note; compile_many)
    }  # fmt: skip
    assert heavy.isdisjoint(modules), heavy.intersection(modules)
