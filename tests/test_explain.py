"""``opcache explain``: why a call missed (issue 17).

Real gcc (and the stand-in opc) through ``opcache wrap`` as real processes;
then ``opcache explain -- <the same command>`` with one thing changed must
name that part, and only it.  The library call and the stats counters that
tell a new key of a known operator from an operator never seen, too.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from fake_opc import SOC, base_env, write_opc, write_operator, write_tool
from helpers_cache import (
    FakeClock,
    ToyCompiler,
    entry_dirs,
    make_request,
    make_settings,
    write_size_ini,
)
from helpers_wrap import GCC, compiled_script, opcache, stats, wrap, write_project
from test_wrap_opc_reads import ARGS as OPC_ARGS
from test_wrap_opc_reads import edit
from test_wrap_opc_reads import project as opc_project

from opcache import OpCache
from opcache.cli import main
from opcache.keyed_env import (
    CC_ARGUMENT_ENVIRONMENT,
    CC_KEY_ENVIRONMENT,
    CC_PROGRAM_ENVIRONMENT,
    OPC_KEY_ENVIRONMENT,
)

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")

CC = ["gcc", "-O2", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]


@pytest.fixture
def csrc(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(environment, a folder with k.c including h.h), compiled once through the cache."""
    env, src = base_env(tmp_path), write_project(tmp_path / "src")
    wrap(*CC, env=env, cwd=src)
    return env, src


def explain(*command: str, env: dict[str, str], cwd: Path) -> dict:
    done = opcache("explain", "--json", "--", *command, env=env, cwd=cwd)
    return json.loads(done.stdout)


def explain_text(*command: str, env: dict[str, str], cwd: Path) -> str:
    return opcache("explain", "--", *command, env=env, cwd=cwd).stdout.decode()


def test_the_command_wrap_stored_is_explained_as_stored(csrc):
    env, src = csrc
    found = explain(*CC, env=env, cwd=src)
    assert found["stored"] is True
    assert found["changes"] == []
    assert found["operator"] == {"soc": "host", "op_type": "cc", "sources": ["k.c"]}
    assert found["parts"]["attrs"]["args"] == ["-O2", "-DOFFSET=1"]
    assert set(found["part_digests"]) == set(found["parts"])
    assert "stored: an entry has this key" in explain_text(*CC, env=env, cwd=src)


def test_a_changed_define_is_named(csrc):
    env, src = csrc
    changed = [a.replace("OFFSET=1", "OFFSET=2") for a in CC]
    found = explain(*changed, env=env, cwd=src)
    assert (found["stored"], found["seen"]) == (False, True)
    assert found["changes"] == ["attrs.args: ['-O2', '-DOFFSET=1'] -> ['-O2', '-DOFFSET=2']"]
    stored = explain(*CC, env=env, cwd=src)
    assert found["nearest"] == stored["key"] != found["key"]
    text = explain_text(*changed, env=env, cwd=src)
    assert "a new key for an operator seen before" in text
    assert "attrs.args: ['-O2', '-DOFFSET=1'] -> ['-O2', '-DOFFSET=2']" in text


def test_a_changed_source_is_named(csrc):
    env, src = csrc
    (src / "k.c").write_text((src / "k.c").read_text() + "int unused;\n")
    found = explain(*CC, env=env, cwd=src)
    assert found["seen"] and not found["stored"]
    assert found["changes"] == ["sources.k.c: digest changed"]


def test_a_changed_header_is_named(csrc):
    env, src = csrc
    (src / "h.h").write_text("#define FACTOR 5\n")
    found = explain(*CC, env=env, cwd=src)
    assert found["seen"] and not found["stored"]
    assert found["changes"] == [f"attrs.headers: {src / 'h.h'} changed"]


def test_a_changed_compiler_is_named(tmp_path):
    """The compiler's identity (a gcc on PATH before the system's) is part of the key."""
    env, src = base_env(tmp_path), write_project(tmp_path / "src")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcc = compiled_script(bin_dir / "gcc", f'exec {GCC} "$@"\n')
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    wrap(*CC, env=env, cwd=src)
    compiled_script(gcc, f'exec {GCC} "$@"\n', version="another version")
    found = explain(*CC, env=env, cwd=src)
    assert found["seen"] and not found["stored"]
    assert len(found["changes"]) == 1
    assert found["changes"][0].startswith("compiler.fingerprint: ")


def test_an_operator_never_seen_says_so(csrc):
    env, src = csrc
    (src / "j.c").write_text("int j(void) { return 1; }\n")
    found = explain("gcc", "-c", "j.c", "-o", "j.o", env=env, cwd=src)
    assert (found["stored"], found["seen"], found["nearest"], found["changes"]) == (
        False,
        False,
        None,
        [],
    )
    text = explain_text("gcc", "-c", "j.c", "-o", "j.o", env=env, cwd=src)
    assert "never seen" in text


def test_explain_runs_nothing_and_an_empty_cache_has_seen_nothing(tmp_path):
    env, src = base_env(tmp_path), write_project(tmp_path / "src")
    found = explain(*CC, env=env, cwd=src)
    assert (found["stored"], found["seen"]) == (False, False)
    assert not (src / "k.o").exists()
    assert not (tmp_path / "cache").exists()  # nothing made in the cache either


needs_strace = pytest.mark.skipif(
    shutil.which("strace") is None, reason="strace is needed to trace opc (CI installs it)"
)

# The opc: it reads a kernel and its header that its command line does not name.
SHELL_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
cat "$BUILD_KERNEL_SRC" "$(dirname "$BUILD_KERNEL_SRC")/common.h" > "$out/k.o"
"""


@needs_strace
@pytest.mark.parametrize("edited", ["k.cpp", "common.h"])
def test_a_file_opc_read_off_its_command_line_is_named(tmp_path, edited):
    write_tool(tmp_path / "bin", "opc", "").write_text(SHELL_OPC)  # (a shell script)
    root = tmp_path / "proj"
    (root / "kernel").mkdir(parents=True)
    (root / "add.py").write_text("def add():\n    pass\n")
    (root / "kernel" / "k.cpp").write_text("int k = 1;\n")
    (root / "kernel" / "common.h").write_text("#define TILE 8\n")
    env = base_env(tmp_path, tmp_path / "bin")
    env["BUILD_KERNEL_SRC"] = str(root / "kernel" / "k.cpp")
    args = ["add.py", "--main_func=add", f"--soc_version={SOC}"]
    wrap("opc", *args, "--output=out", env=env, cwd=root)
    assert explain("opc", *args, "--output=out2", env=env, cwd=root)["stored"]
    (root / "kernel" / edited).write_text("// edited\n")
    found = explain("opc", *args, "--output=out2", env=env, cwd=root)
    assert found["seen"] and not found["stored"]
    assert found["changes"][-1] == f"read set: {root / 'kernel' / edited} changed"
    assert found["changes"][0].startswith("attrs.reads: ")
    assert found["changes"][0].endswith(" -> 'unknown'")
    assert f"read set: {root / 'kernel' / edited} changed" in explain_text(
        "opc", *args, "--output=out2", env=env, cwd=root
    )
    wrap("opc", *args, "--output=out2", env=env, cwd=root)
    chip = stats(env, SOC)
    assert (chip["misses"], chip["misses_never_seen"], chip["misses_new_key"]) == (2, 1, 1)
    assert explain("opc", *args, "--output=out3", env=env, cwd=root)["stored"]


@needs_strace
def test_an_opc_flag_change_is_named(tmp_path):
    write_opc(tmp_path / "bin")
    op_dir = tmp_path / "op"
    write_operator(op_dir)
    env = base_env(tmp_path, tmp_path / "bin")
    args = ["add.py", "--main_func=add", "--input_param=p.json", f"--soc_version={SOC}"]
    wrap("opc", *args, "--output=out", "--impl_mode=high_performance", env=env, cwd=op_dir)
    found = explain(
        "opc", *args, "--output=out2", "--impl_mode=high_precision", env=env, cwd=op_dir
    )
    assert found["operator"]["soc"] == SOC
    assert found["seen"] and not found["stored"]
    # (what a compile of the new line would read is not known before it runs)
    assert found["changes"][0] == (
        "attrs.flags[2]: ['impl_mode', 'value', 'high_performance'] "
        "-> ['impl_mode', 'value', 'high_precision']"
    )
    assert found["changes"][1:] == [f"attrs.reads: {found['changes'][1].split()[1]} -> 'unknown'"]
    assert not (op_dir / "out2").exists()


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ([], "explain needs the command after '--'"),
        (["ls", "-l"], "not a known compiler: ls"),
        (["gcc", "-c", "missing.c", "-o", "m.o"], "cannot read missing.c"),
    ],
)
def test_user_errors_are_one_line_with_status_2(csrc, command, says):
    env, src = csrc
    done = opcache("explain", "--", *command, env=env, cwd=src, status=2)
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opcache: error: ")
    assert says in lines[0]
    assert done.stdout == b""


def test_stats_count_new_keys_of_known_operators_apart_from_never_seen(csrc):
    env, src = csrc
    wrap(*[a.replace("OFFSET=1", "OFFSET=2") for a in CC], env=env, cwd=src)  # new key
    wrap(*[a.replace("-O2", "-O1") for a in CC], env=env, cwd=src)  # new key
    (src / "j.c").write_text("int j(void) { return 1; }\n")
    wrap("gcc", "-c", "j.c", "-o", "j.o", env=env, cwd=src)  # never seen
    wrap(*CC, env=env, cwd=src)  # a hit
    chip = stats(env, "host")
    assert (chip["misses"], chip["hits"]) == (4, 1)
    assert (chip["misses_never_seen"], chip["misses_new_key"]) == (2, 2)
    assert stats(env)["misses_new_key"] == 2
    text = opcache("stats", env=env, cwd=src).stdout.decode()
    assert "misses: 2 new keys of operators seen before, 2 never seen" in text


def test_the_library_call(tmp_path):
    compiler = ToyCompiler(tmp_path / "calls")
    with OpCache(make_settings(tmp_path / "cache", tmp_path)) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "out0")
        never = cache.explain(make_request(0, op_type="Mul"), compiler)
        assert (never.seen, never.stored, never.nearest, never.changes) == (False, False, None, [])
        stored = cache.explain(make_request(0), compiler)
        assert stored.stored and stored.changes == []
        other = cache.explain(make_request(1, op_name="another_node"), compiler)
        assert (other.seen, other.stored, other.nearest) == (True, False, stored.key)
        assert other.changes == [
            "inputs[0].shape: [16, 1024] -> [16, 1025]",
            "inputs[1].shape: [16, 1024] -> [16, 1025]",
            "outputs[0].shape: [16, 1024] -> [16, 1025]",
        ]
        newer = ToyCompiler(tmp_path / "calls", version="2.0")
        assert cache.explain(make_request(0), newer).changes == [
            "compiler.fingerprint: 'toycc 1.0' -> 'toycc 2.0'"
        ]
        assert other.as_dict()["changes"] == other.changes
        assert "inputs[0].shape" in other.text()


def test_the_nearest_entry_is_the_one_with_fewest_differences(tmp_path):
    compiler = ToyCompiler(tmp_path / "calls")
    with OpCache(make_settings(tmp_path / "cache", tmp_path)) as cache:
        cache.compile(make_request(0, attrs={"alpha": 2.0}), compiler, tmp_path / "a")
        near = cache.compile(make_request(1), compiler, tmp_path / "b")
        cache.compile(make_request(0, attrs={"alpha": 3.0}), compiler, tmp_path / "c")
        found = cache.explain(make_request(1, attrs={"alpha": 4.0}), compiler)
        assert found.nearest == near.key
        assert found.changes == ["attrs.alpha: 1.0 -> 4.0"]


def explanation_notes(root: Path) -> list[Path]:
    return [p for p in (root / ".opcache" / "explain").rglob("*") if p.is_file()]


def test_clear_removes_the_explanations_and_notes_stay_bounded(tmp_path):
    compiler = ToyCompiler(tmp_path / "calls")
    settings = make_settings(tmp_path / "cache", tmp_path)
    with OpCache(settings) as cache:
        for index in range(12):
            cache.compile(make_request(index), compiler, tmp_path / f"out{index}")
        notes = explanation_notes(settings.root)
        assert len(notes) == 1  # one operator
        kept = json.loads(notes[0].read_bytes())
        assert len(kept) == 8  # the last eight keys of it
        assert cache.explain(make_request(11), compiler).stored
        assert cache.clear() == [make_request().soc_version]
        assert explanation_notes(settings.root) == []
        again = cache.explain(make_request(12), compiler)
        assert (again.seen, again.stored) == (False, False)


def test_explanations_of_aged_entries_go(tmp_path):
    compiler = ToyCompiler(tmp_path / "calls", size=400_000)
    clock = FakeClock()
    write_size_ini(tmp_path / "cache" / "kernel_cache", 1, 50)
    settings = make_settings(tmp_path / "cache", tmp_path)
    with OpCache(settings, clock=clock) as cache:
        for index in range(3):
            cache.compile(make_request(index), compiler, tmp_path / f"out{index}")
            clock.advance(7200)
        cache.age()
        kept = entry_dirs(settings.root)
        assert 0 < len(kept) < 3  # aging removed some
        noted = {
            n["key"] for f in explanation_notes(settings.root) for n in json.loads(f.read_text())
        }
        assert noted == set(kept)


def _plant_odd_keys(root: Path) -> None:
    """Before each note's explanations, ones whose keys no digest makes: a NUL
    (which os calls refuse with ValueError), a path, upper case."""
    odd = ["ab\u0000c", "../../../../etc/passwd", "0123456789ABCDEF0123456789ABCDEF"]
    for note in explanation_notes(root):
        kept = json.loads(note.read_text())
        planted = [{"key": key, "created": 1.0, "parts": {}} for key in odd]
        note.write_text(json.dumps([*planted, *kept]))


def test_explanations_with_keys_no_digest_makes_are_dropped(tmp_path, capsys):
    """Notes are files others may write: a key not of key.digest's shape is left
    out, and ``opcache age``, a compile and ``explain`` go on as without it."""
    compiler = ToyCompiler(tmp_path / "calls", size=400_000)
    clock = FakeClock()
    write_size_ini(tmp_path / "cache" / "kernel_cache", 1, 50)
    settings = make_settings(tmp_path / "cache", tmp_path)
    with OpCache(settings, clock=clock) as cache:
        for index in range(3):
            cache.compile(make_request(index), compiler, tmp_path / f"out{index}")
    _plant_odd_keys(settings.root)
    assert main(["age", "--op_compiler_cache_dir", str(tmp_path / "cache")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert 0 < len(entry_dirs(settings.root)) < 3  # (it aged, so it pruned the notes)
    noted = {n["key"] for f in explanation_notes(settings.root) for n in json.loads(f.read_text())}
    assert noted == set(entry_dirs(settings.root))

    _plant_odd_keys(settings.root)
    with OpCache(settings, clock=clock) as cache:
        result = cache.compile(make_request(5), compiler, tmp_path / "out5")
        found = cache.explain(make_request(6), compiler)
    assert result.status == "miss"
    assert found.seen and found.nearest in entry_dirs(settings.root)


def test_planted_links_and_fifos_in_the_explanations_are_left_alone(csrc, tmp_path):
    """A link in place of a chip's notes leads nowhere outside the cache; a FIFO in
    place of a note neither hangs a compile or ``explain`` nor is written through."""
    env, src = csrc
    notes = Path(env["ASCEND_CACHE_PATH"]).glob("kernel_cache*/.opcache/explain/host")
    (chip_notes,) = list(notes)
    (note,) = [p for p in chip_notes.rglob("*") if p.is_file()]
    note.unlink()
    os.mkfifo(note)
    found = explain(*[a.replace("OFFSET=1", "OFFSET=3") for a in CC], env=env, cwd=src)
    assert (found["stored"], found["seen"]) == (False, False)
    wrap(*[a.replace("OFFSET=1", "OFFSET=3") for a in CC], env=env, cwd=src)
    assert note.is_file() and not note.is_symlink()  # replaced, not written through

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine\n")
    before = sorted(p.name for p in victim.rglob("*"))
    shutil.rmtree(chip_notes)
    chip_notes.symlink_to(victim, target_is_directory=True)
    wrap(*[a.replace("OFFSET=1", "OFFSET=4") for a in CC], env=env, cwd=src)
    explain(*CC, env=env, cwd=src)
    opcache("clear", env=env, cwd=src)
    assert sorted(p.name for p in victim.rglob("*")) == before
    assert (victim / "keep").read_text() == "mine\n"
    assert stats(env, "host")["misses"] == 3


# -- each stale case of issue 17 (tests/test_wrap_stale.py, test_wrap_opc_reads.py) ----
# The compile, one thing changed, and explain names that thing.


def changes_after(src: Path, env: dict[str, str], args: list[str], then: dict[str, str]) -> list:
    """Compile ``gcc ARGS -c k.c -o k.o`` under ``env``; explain it under ``then``."""
    command = ["gcc", *args, "-c", "k.c", "-o", "k.o"]
    wrap(*command, env=env, cwd=src)
    found = explain(*command, env=then, cwd=src)
    assert found["seen"] and not found["stored"]
    return found["changes"]


@pytest.mark.parametrize("macro", ["__DATE__", "__TIME__"])
def test_a_changed_source_date_epoch_is_named(tmp_path, macro):
    env, src = base_env(tmp_path), tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text(f"const char *d(void) {{ return {macro}; }}\n")
    changes = changes_after(
        src, {**env, "SOURCE_DATE_EPOCH": "0"}, ["-O2"], {**env, "SOURCE_DATE_EPOCH": "100000000"}
    )
    assert changes == ["attrs.date: ['0', None, None] -> ['100000000', None, None]"]


def test_time_without_an_epoch_is_explained_as_uncacheable(tmp_path):
    env, src = base_env(tmp_path), tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text("const char *t(void) { return __TIME__; }\n")
    command = ["gcc", "-O2", "-c", "k.c", "-o", "k.o"]
    wrap(*command, env=env, cwd=src)
    done = opcache("explain", "--", *command, env=env, cwd=src, status=2)
    assert done.stderr.decode() == (
        "opcache: error: explain: opcache wrap would not cache this command: "
        "cc: __TIME__ without SOURCE_DATE_EPOCH\n"
    )
    assert done.stdout == b""  # no key pretended


@pytest.mark.parametrize("a_exists", [True, False])
def test_a_header_created_earlier_on_the_include_path_is_named(tmp_path, a_exists):
    env, src = base_env(tmp_path), tmp_path / "src"
    (src / "B").mkdir(parents=True)
    (src / "k.c").write_text('#include "q.h"\nint f(void) { return Q; }\n')
    (src / "B" / "q.h").write_text("#define Q 2\n")
    if a_exists:
        (src / "A").mkdir()
    command = ["gcc", "-IA", "-IB", "-O2", "-c", "k.c", "-o", "k.o"]
    wrap(*command, env=env, cwd=src)
    (src / "A").mkdir(exist_ok=True)
    (src / "A" / "q.h").write_text("#define Q 1\n")
    found = explain(*command, env=env, cwd=src)
    assert found["changes"] == [
        f"attrs.headers: {src / 'B' / 'q.h'} removed",
        f"attrs.headers: {src / 'A' / 'q.h'} added",
        f"lookup: {src / 'A' / 'q.h' if a_exists else src / 'A'} now exists",
    ]
    text = explain_text(*command, env=env, cwd=src)
    assert f"lookup: {src / 'A' / 'q.h' if a_exists else src / 'A'} now exists" in text


def test_a_changed_timestamp_is_named_with_its_file(tmp_path):
    env, src = {**base_env(tmp_path), "TZ": "UTC"}, tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text("const char *s(void) { return __TIMESTAMP__; }\n")
    os.utime(src / "k.c", (0, 0))
    command = ["gcc", "-O2", "-c", "k.c", "-o", "k.o"]
    wrap(*command, env=env, cwd=src)
    os.utime(src / "k.c", (100000000, 100000000))
    found = explain(*command, env=env, cwd=src)
    assert found["changes"] == ["attrs.mtimes[0]: ['k.c', 0] -> ['k.c', 100000000]"]


# Values that keep gcc working: a folder that is not there, a locale it knows (not
# one Python coerces to C.UTF-8 by setting LC_CTYPE).  Left out: those that break it.
CC_VARIABLES = {name: None for name in CC_KEY_ENVIRONMENT} | {
    "LANG": "C.utf8",
    "LC_CTYPE": "C.utf8",
    "LC_ALL": "C",
}
UNSETTABLE_CC = ("GCC_COMPARE_DEBUG", "GCC_EXEC_PREFIX")


@pytest.mark.parametrize(
    "variable",
    [
        v
        for v in CC_VARIABLES
        if v not in (*UNSETTABLE_CC, *CC_PROGRAM_ENVIRONMENT, *CC_ARGUMENT_ENVIRONMENT)
    ],
)
def test_each_keyed_variable_of_a_c_compile_is_named(tmp_path, variable):
    env, src = base_env(tmp_path), write_project(tmp_path / "src")
    value = CC_VARIABLES[variable] or str(tmp_path / "elsewhere")
    changes = changes_after(src, env, ["-O2", "-DOFFSET=1"], {**env, variable: value})
    was = repr(env[variable]) if variable in env else None
    if was is None:
        assert changes == [f"attrs.env.{variable}: added, {value!r}"]
    else:
        assert changes == [f"attrs.env.{variable}: {was} -> {value!r}"]


@pytest.mark.parametrize(
    "variable", ["DEPENDENCIES_OUTPUT", *CC_PROGRAM_ENVIRONMENT, *CC_ARGUMENT_ENVIRONMENT]
)
def test_a_variable_that_makes_a_c_compile_uncacheable_says_so(csrc, variable):
    env, src = csrc
    env = {**env, variable: "deps.d" if variable == "DEPENDENCIES_OUTPUT" else str(src / "no")}
    done = opcache("explain", "--", *CC, env=env, cwd=src, status=2)
    assert f"would not cache this command: cc: {variable} is set" in done.stderr.decode()


@needs_strace
@pytest.mark.parametrize(
    ("case", "read"),
    [
        ("kernel", "kernel/k.cpp"),
        ("header", "kernel/common.h"),
        ("beside_the_py", "op/kernel/k.cpp"),
        ("custom_opp", "opp/tiling.txt"),
        ("helper", "op/helper.py"),
    ],
)
def test_each_file_opc_reads_is_named(tmp_path, case, read):
    env, root = opc_project(tmp_path)
    if case == "beside_the_py":
        edit(root, env, case)  # (both compiles: the kernel found beside the .py)
    command = ["opc", *OPC_ARGS, "--output=out1"]
    wrap(*command, env=env, cwd=root)
    if case == "beside_the_py":
        (root / "op" / "kernel" / "k.cpp").write_text("// beside, edited\n")
    else:
        edit(root, env, case)
    found = explain(*command, env=env, cwd=root)
    assert found["seen"] and not found["stored"]
    assert found["changes"][0].startswith("attrs.reads: ")
    assert f"read set: {root / read} changed" in found["changes"][1:]


@needs_strace
@pytest.mark.parametrize(
    "variable", [v for v in OPC_KEY_ENVIRONMENT if v not in ("LD_PRELOAD", "PYTHONHOME")]
)
def test_each_keyed_variable_of_an_opc_compile_is_named(tmp_path, variable):
    env, root = opc_project(tmp_path)
    command = ["opc", *OPC_ARGS, "--output=out1"]
    wrap(*command, env=env, cwd=root)
    was = env.get(variable)
    value = str(tmp_path / "elsewhere")
    env[variable] = value if variable != "PATH" else f"{value}{os.pathsep}{env['PATH']}"
    found = explain(*command, env=env, cwd=root)
    assert found["seen"] and not found["stored"]
    shown = [repr(v) if len(repr(v)) <= 100 else repr(v)[:97] + "..." for v in (was, value)]
    shown[1] = shown[1] if variable != "PATH" else repr(env[variable])[:97] + "..."
    assert f"attrs.env.{variable}: {shown[0]} -> {shown[1]}" in found["changes"]


@needs_strace
def test_a_new_driver_is_named(tmp_path):
    env, root = opc_project(tmp_path)
    driver = tmp_path / "Ascend" / "driver"
    driver.mkdir(parents=True)
    (driver / "version.info").write_text("Version=24.1.rc1\n")
    env["ASCEND_DRIVER_PATH"] = str(driver)
    command = ["opc", *OPC_ARGS, "--output=out1"]
    wrap(*command, env=env, cwd=root)
    (driver / "version.info").write_text("Version=24.1.rc2\n")
    found = explain(*command, env=env, cwd=root)
    reads, driver = found["changes"]  # (the read set is remembered by toolkit: unknown)
    assert reads.startswith("attrs.reads: ") and reads.endswith(" -> 'unknown'")
    assert driver == "compiler.fingerprint.driver: digest changed"


def test_names_in_a_note_that_are_not_lists_of_paths_are_left_out(csrc):
    """A note's names are a diagnosis only: garbage in them costs the names, not explain."""
    env, src = csrc
    (note,) = Path(env["ASCEND_CACHE_PATH"]).glob("kernel_cache*/.opcache/explain/host/*/*")
    kept = json.loads(note.read_bytes())
    *_, last = kept[0]["names"]["headers"]  # (gcc's stdc-predef.h may come first)
    assert last == str(src / "h.h")
    place = len(kept[0]["names"]["headers"]) - 1
    kept[0]["names"] = {"headers": 5, "absent": [1, None]}
    note.write_text(json.dumps(kept))
    (src / "h.h").write_text("#define FACTOR 5\n")
    found = explain(*CC, env=env, cwd=src)
    assert found["changes"] == [f"attrs.headers[{place}]: digest changed"]  # (by its place)


@needs_strace
def test_a_helper_module_created_earlier_on_the_import_path_is_named(tmp_path):
    env, root = opc_project(tmp_path)
    (root / "op" / "helper.py").unlink()
    (root / "lib").mkdir()
    (root / "lib" / "helper.py").write_text('VALUE = "from lib\\n"\n')
    env["PYTHONPATH"] = str(root / "lib")
    command = ["opc", *OPC_ARGS, "--output=out1"]
    wrap(*command, env=env, cwd=root)
    (root / "op" / "helper.py").write_text('VALUE = "beside\\n"\n')  # first on sys.path
    found = explain(*command, env=env, cwd=root)
    assert found["seen"] and not found["stored"]
    assert found["changes"][0].startswith("attrs.reads: ")
    # (the import listed the .py's folder: its listing changed)
    assert f"read set: {root / 'op'} changed" in found["changes"][1:]


def test_a_locks_folder_swapped_for_a_link_later_is_not_followed(tmp_path):
    """A long-lived process notes explanations under a lock of ``.opcache/locks``:
    a link put there after its first use leads nowhere (the folder is checked at each use)."""
    compiler = ToyCompiler(tmp_path / "calls")
    settings = make_settings(tmp_path / "cache", tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine\n")
    with OpCache(settings) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "out0")
        locks = settings.root / ".opcache" / "locks"
        locks.rename(tmp_path / "aside")
        locks.symlink_to(victim, target_is_directory=True)
        cache.compile(make_request(1), compiler, tmp_path / "out1")
        cache.age()
    assert sorted(p.name for p in victim.iterdir()) == ["keep"]


def test_opc_without_tracing_is_explained_as_uncacheable_or_by_its_listed_files(tmp_path):
    env, root = opc_project(tmp_path)
    env["OPCACHE_TRACE"] = "off"
    command = ["opc", *OPC_ARGS, "--output=out1"]
    done = opcache("explain", "--", *command, env=env, cwd=root, status=2)
    assert "would not cache this command: opc: not traced" in done.stderr.decode()
    env["OPCACHE_EXTRA_FILES"] = str(root / "kernel")
    wrap(*command, env=env, cwd=root)
    edit(root, env, "header")
    found = explain(*command, env=env, cwd=root)
    assert found["changes"] == [f"attrs.extra_files.{root / 'kernel' / 'common.h'}: digest changed"]
