"""``opcache wrap -- opc|asc_opc``: a hit only while everything the compile read is unchanged.

An operator ``.py`` finds the kernel source through ``BUILD_KERNEL_SRC`` or
beside itself, the kernel includes headers of its project, the ``.py`` imports
project helper modules and reads files under ``ASCEND_CUSTOM_OPP_PATH``: none
of these is on opc's command line.  Each is changed alone, and the output
must then be what the tool itself writes (a miss), never the old kernel.
With strace the read set is traced; without it (``OPCACHE_TRACE=off``) opc
is cached only with the inputs the user lists.  The stand-in opc runs the
operator ``.py``, as CANN's opc does, and writes what it returns to ``k.o``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from fake_opc import SOC, base_env, write_tool
from helpers_wrap import GCC, opcache, opcache_script, stats, wrap, wrap_imports

from opcache.keyed_env import OPC_KEY_ENVIRONMENT

needs_strace = pytest.mark.skipif(
    shutil.which("strace") is None, reason="strace is needed to trace opc (CI installs it)"
)

# opc as CANN's: import the operator .py (its folder first on sys.path), call --main_func.
STAND_IN = r"""
import importlib.util, os, sys, time
time.sleep(float(os.environ.get("STAND_IN_SLEEP", "0")))
args = sys.argv[1:]
source = [a for a in args if not a.startswith("--")][0]
flags = dict(a[2:].partition("=")[::2] for a in args if a.startswith("--"))
with open(os.environ["FAKE_OPC_LOG"], "a") as f:
    f.write("run\n")
sys.path.insert(0, os.path.dirname(os.path.abspath(source)))
spec = importlib.util.spec_from_file_location("op", source)
op = importlib.util.module_from_spec(spec)
rewritten = os.environ.get("STAND_IN_REWRITE")
if rewritten:  # (truncated while it runs, read empty, then the same bytes again)
    with open(rewritten, "rb") as f:
        saved = f.read()
    open(rewritten, "wb").close()
spec.loader.exec_module(op)
data = getattr(op, flags["main_func"])()
if rewritten:
    with open(rewritten, "wb") as f:
        f.write(saved)
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(data)
"""

# The generated operator .py: the kernel by BUILD_KERNEL_SRC or beside itself,
# the header beside the kernel, a tiling file under ASCEND_CUSTOM_OPP_PATH, a helper.
OP_PY = """\
import os
import helper

HERE = os.path.dirname(os.path.realpath(__file__))


def add_custom():
    src = os.environ.get("BUILD_KERNEL_SRC") or os.path.join(HERE, "kernel", "k.cpp")
    with open(src, "rb") as f:
        data = f.read()
    with open(os.path.join(os.path.dirname(src), "common.h"), "rb") as f:
        data += f.read()
    tiling = os.path.join(os.environ.get("ASCEND_CUSTOM_OPP_PATH", HERE), "tiling.txt")
    if os.path.exists(tiling):
        with open(tiling, "rb") as f:
            data += f.read()
    data += helper.VALUE.encode() + os.environ.get("TILINGKEY_PAR_COMPILE", "").encode()
    return data
"""

# The issue's reproduction: a shell opc that cats the kernel and its header.
SHELL_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
echo run >> "$FAKE_OPC_LOG"
mkdir -p "$out"
cat "$BUILD_KERNEL_SRC" "$(dirname "$BUILD_KERNEL_SRC")/common.h" > "$out/k.o"
"""

ARGS = [
    "op/add_custom.py",
    "--main_func=add_custom",
    f"--soc_version={SOC}",
    "--impl_mode=high_performance,optional",
    "--op_mode=dynamic",
]
ASC_ARGS = [
    *ARGS,
    "--simplified_key_mode=0",
    '--tiling_key="1,2"',
    "--kernel-template-input=op/templates.json",
]


def project(tmp_path: Path, tool: str = "opc") -> tuple[dict[str, str], Path]:
    """(environment, project folder): the stand-in on PATH, op/, kernel/, custom opp."""
    root = tmp_path / "proj"
    (root / "op").mkdir(parents=True)
    (root / "op" / "add_custom.py").write_text(OP_PY)
    (root / "op" / "helper.py").write_text('VALUE = "helper-1\\n"\n')
    (root / "op" / "templates.json").write_text("{}\n")
    for kernel in (root / "kernel", root / "op" / "kernel"):
        kernel.mkdir()
        (kernel / "k.cpp").write_text(f"// kernel in {kernel.parent.name}\nint k = 1;\n")
        (kernel / "common.h").write_text("#define TILE 8\n")
    (root / "opp").mkdir()
    (root / "opp" / "tiling.txt").write_text("tiling 1\n")
    write_tool(tmp_path / "bin", tool, STAND_IN)
    env = base_env(tmp_path, tmp_path / "bin")
    env["BUILD_KERNEL_SRC"] = str(root / "kernel" / "k.cpp")
    env["ASCEND_CUSTOM_OPP_PATH"] = str(root / "opp")
    return env, root


def runs(env: dict[str, str]) -> int:
    log = Path(env["FAKE_OPC_LOG"])
    return len(log.read_text().splitlines()) if log.exists() else 0


def fresh(env: dict[str, str], root: Path, tool: str, args: list[str]) -> bytes:
    """What the tool itself writes now, without the cache."""
    out = root.parent / "fresh"
    shutil.rmtree(out, ignore_errors=True)
    quiet = {**env, "FAKE_OPC_LOG": os.devnull}
    command = [tool, *args, f"--output={out}"]
    subprocess.run(command, env=quiet, cwd=root, check=True, timeout=60)
    return (out / "k.o").read_bytes()


def compile_into(env: dict[str, str], root: Path, out: str, tool: str = "opc", args=ARGS) -> bytes:
    wrap(tool, *args, f"--output={out}", env=env, cwd=root)
    return (root / out / "k.o").read_bytes()


def edit(root: Path, env: dict[str, str], case: str) -> None:
    """Change one input of the compile, alone."""
    if case == "kernel":
        (root / "kernel" / "k.cpp").write_text("// edited\nint k = 2;\n")
    elif case == "header":
        (root / "kernel" / "common.h").write_text("#define TILE 16\n")
    elif case == "beside_the_py":
        del env["BUILD_KERNEL_SRC"]  # (both compiles: the kernel found beside the .py)
    elif case == "custom_opp":
        (root / "opp" / "tiling.txt").write_text("tiling 2\n")
    elif case == "helper":
        (root / "op" / "helper.py").write_text('VALUE = "helper-2\\n"\n')
    elif case == "helper_earlier_on_the_path":
        # A module made where the import looks first: the folder's listing changed.
        (root / "op" / "helper.py").rename(root / "helper_dir.py")  # (keep its text)
        (root / "op" / "helper.py").write_text('VALUE = "helper-3\\n"\n')
    else:
        raise AssertionError(case)


FILE_CASES = ["kernel", "header", "beside_the_py", "custom_opp", "helper"]


@needs_strace
def test_the_issues_shell_opc_edit_of_the_kernel_is_a_miss(tmp_path):
    """The reproduction of the issue: a hit with the old kernel before."""
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "opc", "")
    (tmp_path / "bin" / "opc").write_text(SHELL_OPC)
    first = compile_into(env, root, "out1")
    assert first == fresh(env, root, "opc", ARGS)
    (root / "kernel" / "k.cpp").write_text("// edited\nint k = 2;\n")
    second = compile_into(env, root, "out2")
    assert second == fresh(env, root, "opc", ARGS) != first
    assert runs(env) == 2
    (root / "kernel" / "common.h").write_text("#define TILE 16\n")
    assert compile_into(env, root, "out3") == fresh(env, root, "opc", ARGS)
    assert runs(env) == 3
    assert compile_into(env, root, "out4") == fresh(env, root, "opc", ARGS)
    assert runs(env) == 3  # nothing changed: a hit


@needs_strace
@pytest.mark.parametrize("case", FILE_CASES)
def test_each_file_opc_reads_changed_alone_is_a_miss(tmp_path, case):
    env, root = project(tmp_path)
    if case == "beside_the_py":
        edit(root, env, case)
        (root / "op" / "kernel" / "k.cpp").write_text("// beside, first\n")
    compile_into(env, root, "out1")
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS)
    assert runs(env) == 1  # unchanged: a hit
    if case == "beside_the_py":
        (root / "op" / "kernel" / "k.cpp").write_text("// beside, edited\n")
    else:
        edit(root, env, case)
    assert compile_into(env, root, "out3") == fresh(env, root, "opc", ARGS)
    assert runs(env) == 2  # the tool ran: a miss
    chip = stats(env, SOC)
    assert (chip["hits"], chip["misses"]) == (1, 2)


@needs_strace
def test_a_helper_module_created_earlier_on_the_import_path_is_a_miss(tmp_path):
    env, root = project(tmp_path)
    (root / "op" / "helper.py").unlink()
    (root / "lib").mkdir()
    (root / "lib" / "helper.py").write_text('VALUE = "from lib\\n"\n')
    env["PYTHONPATH"] = str(root / "lib")
    compile_into(env, root, "out1")
    # Created beside the .py, which is first on sys.path: it wins from now on.
    (root / "op" / "helper.py").write_text('VALUE = "beside\\n"\n')
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS)
    assert b"beside" in (root / "out2" / "k.o").read_bytes()
    assert runs(env) == 2


@needs_strace
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("BUILD_KERNEL_SRC", "op/kernel/k.cpp"),
        ("ASCEND_CUSTOM_OPP_PATH", "other_opp"),
        ("TILINGKEY_PAR_COMPILE", "1"),
        ("ASCEND_OPP_PATH", "some/opp"),
    ],
)
def test_each_environment_variable_opc_reads_changed_alone_is_a_miss(tmp_path, variable, value):
    env, root = project(tmp_path)
    (root / "other_opp").mkdir()
    (root / "other_opp" / "tiling.txt").write_text("tiling of another opp\n")
    compile_into(env, root, "out1")
    env[variable] = str(root / value) if "/" in value or "opp" in value else value
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS)
    assert runs(env) == 2


# (Set to a folder that is not there: these would make the compile fail; the
# kernel source's variable is changed to another file above.)
UNSETTABLE = ("LD_PRELOAD", "PYTHONHOME", "BUILD_KERNEL_SRC")


@needs_strace
@pytest.mark.parametrize("variable", [v for v in OPC_KEY_ENVIRONMENT if v not in UNSETTABLE])
def test_every_keyed_variable_set_alone_is_a_miss(tmp_path, variable):
    env, root = project(tmp_path)
    compile_into(env, root, "out1")
    value = str(tmp_path / "elsewhere")
    env[variable] = value if variable != "PATH" else f"{value}{os.pathsep}{env['PATH']}"
    compile_into(env, root, "out2")
    assert runs(env) == 2


@pytest.mark.parametrize("case", FILE_CASES)
def test_without_strace_opc_is_never_stale(tmp_path, case):
    """No tracing and no list of inputs: opc runs every time, and stats say why."""
    env, root = project(tmp_path)
    env["OPCACHE_TRACE"] = "off"
    first = wrap("opc", *ARGS, "--output=out1", env=env, cwd=root)
    assert b"warning: opc: cannot see which files opc reads" in first.stderr
    edit(root, env, case)
    second = wrap("opc", *ARGS, "--output=out2", env=env, cwd=root)
    assert b"cannot see which files" not in second.stderr  # said once (an hour)
    assert (root / "out2" / "k.o").read_bytes() == fresh(env, root, "opc", ARGS)
    assert runs(env) == 2
    reasons = stats(env, "host")["uncacheable_reasons"]
    assert any("not traced" in reason for reason in reasons), reasons


@pytest.mark.parametrize("case", [c for c in FILE_CASES if c != "beside_the_py"])
def test_without_strace_the_listed_extra_inputs_join_the_key(tmp_path, case):
    env, root = project(tmp_path)
    env["OPCACHE_TRACE"] = "off"
    listed = [root / "kernel", root / "opp" / "*.txt", root / "op" / "*.py"]
    env["OPCACHE_EXTRA_FILES"] = os.pathsep.join(str(p) for p in listed)
    env["OPCACHE_KEY_ENV"] = "SOME_SETTING"
    compile_into(env, root, "out1")
    compile_into(env, root, "out2")
    assert runs(env) == 1  # listed and unchanged: a hit
    edit(root, env, case)
    assert compile_into(env, root, "out3") == fresh(env, root, "opc", ARGS)
    assert runs(env) == 2
    env["SOME_SETTING"] = "x"
    compile_into(env, root, "out4")
    assert runs(env) == 3


@pytest.mark.parametrize("traced", [True, False])
def test_a_file_rewritten_with_the_same_bytes_while_opc_runs_is_not_stored(tmp_path, traced):
    """A generator truncating the kernel and writing the same bytes again while opc
    runs: opc read it empty, and that object is not kept under the key of the
    kernel's bytes, traced or listed in OPCACHE_EXTRA_FILES."""
    if traced and shutil.which("strace") is None:
        pytest.skip("strace is needed to trace opc (CI installs it)")
    env, root = project(tmp_path)
    if not traced:
        env["OPCACHE_TRACE"] = "off"
        env["OPCACHE_EXTRA_FILES"] = os.pathsep.join(
            str(p) for p in (root / "kernel", root / "opp" / "*.txt", root / "op" / "*.py")
        )
    rewriting = {**env, "STAND_IN_REWRITE": str(root / "kernel" / "k.cpp")}
    compile_into(rewriting, root, "out1")
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS)
    assert runs(env) == 2


@needs_strace
def test_asc_opc_is_cached_as_opc_with_its_flags(tmp_path):
    env, root = project(tmp_path, "asc_opc")
    compile_into(env, root, "out1", "asc_opc", ASC_ARGS)
    assert compile_into(env, root, "out2", "asc_opc", ASC_ARGS) == fresh(
        env, root, "asc_opc", ASC_ARGS
    )
    assert runs(env) == 1
    (root / "op" / "templates.json").write_text('{"t": 1}\n')  # a file a flag names
    compile_into(env, root, "out3", "asc_opc", ASC_ARGS)
    assert runs(env) == 2
    edit(root, env, "header")
    assert compile_into(env, root, "out4", "asc_opc", ASC_ARGS) == fresh(
        env, root, "asc_opc", ASC_ARGS
    )
    assert runs(env) == 3
    assert stats(env, SOC)["hits"] == 1


@needs_strace
def test_asc_opc_masquerade(tmp_path):
    """`opcache masquerade` links asc_opc (a Python script, as CANN's is) and caches it."""
    env, root = project(tmp_path, "asc_opc")
    links = tmp_path / "links"
    done = opcache("masquerade", str(links), env=env, cwd=tmp_path)
    assert b"asc_opc" in done.stdout and (links / "asc_opc").is_symlink(), done.stdout
    assert os.path.realpath(links / "asc_opc") == os.path.realpath(opcache_script())
    env["PATH"] = f"{links}{os.pathsep}{env['PATH']}"
    for out in ("out1", "out2"):
        command = ["asc_opc", *ASC_ARGS, f"--output={out}"]
        done = subprocess.run(command, env=env, cwd=root, capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()
    assert runs(env) == 1
    assert stats(env, SOC)["hits"] == 1


@needs_strace
def test_a_new_driver_version_is_a_miss(tmp_path):
    env, root = project(tmp_path)
    driver = tmp_path / "Ascend" / "driver"  # (not a folder of the toolkit's: not its version)
    driver.mkdir(parents=True)
    (driver / "version.info").write_text("Version=24.1.rc1\n")
    env["ASCEND_DRIVER_PATH"] = str(driver)
    compile_into(env, root, "out1")
    compile_into(env, root, "out2")
    assert runs(env) == 1
    (driver / "version.info").write_text("Version=24.1.rc2\n")
    compile_into(env, root, "out3")
    assert runs(env) == 2


def test_a_strace_that_cannot_trace_never_fails_the_compile(tmp_path):
    """strace refused (ptrace off in a container): opc runs as it is, uncached, said once."""
    env, root = project(tmp_path)
    write_tool(
        tmp_path / "fake-strace",
        "strace",
        "import sys\n"
        "sys.stderr.write('strace: ptrace(PTRACE_TRACEME, ...): Operation not permitted\\n')\n"
        "sys.exit(1)\n",
    )
    env["PATH"] = f"{tmp_path / 'fake-strace'}{os.pathsep}{env['PATH']}"
    for out, edited in (("out1", False), ("out2", True)):
        if edited:
            edit(root, env, "kernel")
        done = wrap("opc", *ARGS, f"--output={out}", env=env, cwd=root)
        assert (root / out / "k.o").read_bytes() == fresh(env, root, "opc", ARGS)
        said = b"strace cannot trace here" in done.stderr
        assert said == (not edited)  # a warning, once (an hour), not at every compile
    assert runs(env) == 2
    reasons = stats(env, SOC)["uncacheable_reasons"]
    assert any("strace cannot trace here" in reason for reason in reasons), reasons


@needs_strace
def test_time_saved_is_the_traced_compiles(tmp_path):
    """The entry of a traced miss (stored once its read set is known) keeps its compile time."""
    env, root = project(tmp_path)
    env["STAND_IN_SLEEP"] = "0.5"
    compile_into(env, root, "out1")
    compile_into(env, root, "out2")
    assert runs(env) == 1
    assert stats(env, SOC)["time_saved_seconds"] >= 0.5  # (at least the sleep: no upper bound)


# opc as a Python script that imports a module installed with `pip install --user`.
USER_SITE_OPC = r"""
import os, sys, opextra
with open(os.environ["FAKE_OPC_LOG"], "a") as f:
    f.write("run\n")
out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--output=")][0]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "k.o"), "w") as f:
    f.write(opextra.VALUE)
"""


@needs_strace
@pytest.mark.parametrize("variable", ["HOME", "PYTHONUSERBASE"])
def test_another_python_user_site_is_a_miss(tmp_path, variable):
    """HOME (or PYTHONUSERBASE) picks the user site-packages: each its own module."""
    python = getattr(sys, "_base_executable", sys.executable)  # (a venv's has no user site)
    probe = "import site; print(site.ENABLE_USER_SITE, site.getusersitepackages())"
    env, root = project(tmp_path)
    sites = {}
    for name in ("u1", "u2"):
        base = tmp_path / name / ".local"
        where = {**env, "PYTHONUSERBASE": str(base)}
        enabled, site = subprocess.run(
            [python, "-c", probe], env=where, capture_output=True, text=True, check=True
        ).stdout.split()
        if enabled != "True":
            pytest.skip(f"{python} has no user site-packages")
        Path(site).mkdir(parents=True)
        (Path(site) / "opextra.py").write_text(f"VALUE = 'from {name}'\n")
        sites[name] = str(tmp_path / name) if variable == "HOME" else str(base)
    (tmp_path / "bin" / "opc").write_text(f"#!{python}\n{USER_SITE_OPC}")
    env[variable] = sites["u1"]
    assert compile_into(env, root, "out1") == b"from u1"
    env[variable] = sites["u2"]
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS) == b"from u2"
    assert runs(env) == 2


# opc reads its tiling config and writes it back (normalised in place).
REWRITING_OPC = r"""
import json, os, sys
with open(os.environ["FAKE_OPC_LOG"], "a") as f:
    f.write("run\n")
out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--output=")][0]
with open("op/tiling.json") as f:
    cfg = json.load(f)
with open("op/tiling.json", "w") as f:
    json.dump(cfg, f)
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "k.o"), "w") as f:
    f.write(str(cfg["tile"]))
"""


@needs_strace
def test_an_input_opc_reads_and_writes_back_is_never_stale(tmp_path):
    """Read, then rewritten by the compile: what it read is unknown, the compile unstored."""
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "opc", REWRITING_OPC)
    (root / "op" / "tiling.json").write_text('{"tile": 8}\n')
    assert compile_into(env, root, "out1") == b"8"
    (root / "op" / "tiling.json").write_text('{"tile": 16}\n')
    assert compile_into(env, root, "out2") == b"16" == fresh(env, root, "opc", ARGS)
    assert runs(env) == 2
    reasons = stats(env, SOC)["uncacheable_reasons"]
    assert any("tiling.json changed while the compile ran" in r for r in reasons), reasons


# A shell opc that cd's into its tools folder and runs a program there by a relative path.
CD_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
echo run >> "$FAKE_OPC_LOG"
mkdir -p "$out"
cd tools && ./gen > "$out/k.o"
"""


@needs_strace
@pytest.mark.skipif(GCC is None, reason="gcc builds the program opc runs")
def test_a_program_run_by_a_relative_path_after_a_cd_is_in_the_read_set(tmp_path):
    """A child's calls before its first note of its folder are placed in the folder it had."""
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "opc", "")
    (tmp_path / "bin" / "opc").write_text(CD_OPC)
    (root / "tools").mkdir()

    def build(text: str) -> None:
        c = tmp_path / "gen.c"
        c.write_text(f'#include <stdio.h>\nint main(void) {{ puts("{text}"); return 0; }}\n')
        subprocess.run([GCC, str(c), "-o", str(root / "tools" / "gen")], check=True, timeout=60)

    build("v1")
    assert compile_into(env, root, "out1") == b"v1\n"
    assert compile_into(env, root, "out2") == b"v1\n"
    assert runs(env) == 1  # placed: cached
    build("v2")
    assert compile_into(env, root, "out3") == fresh(env, root, "opc", ARGS) == b"v2\n"
    assert runs(env) == 2


def test_a_relative_path_the_trace_cannot_place_is_unprovable(tmp_path):
    """A process that moves before any note of its folder: its relative paths are not guessed."""
    from opcache import readset

    def hexed(text: str) -> str:
        return "".join(f"\\x{b:02x}" for b in text.encode())

    traces = tmp_path / "trace"
    traces.mkdir()
    (traces / f"{readset.TRACE_PREFIX}.7").write_text(
        f'1700000000.000001 chdir("{hexed("tools")}") = 0\n'
        f'1700000000.000002 execve("{hexed("./gen")}", ["{hexed("./gen")}"], 0x1) = 0\n'
    )
    with pytest.raises(readset.Unprovable, match="a relative path the trace cannot place"):
        readset.record(str(traces), 0, [])


# -- what a hit costs: the stats of its read set, nothing more ------------------------


@needs_strace
def test_hits_into_one_output_folder_leave_the_remembered_read_set_alone(tmp_path):
    """The shell opc's mkdir -p looks up the output folder, whose times move with each
    hit's own staging in it: a folder the compile did not list is checked for being one,
    and the note is not written again at every hit."""
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "opc", "")
    (tmp_path / "bin" / "opc").write_text(SHELL_OPC)
    first = compile_into(env, root, "out")
    (note,) = (tmp_path / "cache").rglob(".opcache/reads/*/*")
    before = note.stat()
    for _ in range(2):
        assert compile_into(env, root, "out") == first
    assert runs(env) == 1  # hits
    after = note.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    (root / "out").chmod(0o700)  # (its mode is still checked: the output is made afresh)
    assert compile_into(env, root, "out") == fresh(env, root, "opc", ARGS)
    assert runs(env) == 2


@needs_strace
def test_an_opc_hit_imports_nothing_it_does_not_need(tmp_path):
    """`opcache wrap` starts a Python per opc command: a hit does not load what only
    tracing a miss needs (the toolkit's and Python's folders are globbed on a miss)."""
    env, root = project(tmp_path)
    compile_into(env, root, "out1")
    command = ["opc", *ARGS, "--output=out2"]
    status, modules, stderr = wrap_imports(command, env, root)
    assert status == "0" and runs(env) == 1, stderr
    heavy = {
        "argparse", "configparser", "dataclasses", "filelock", "glob", "inspect", "logging",
        "multiprocessing", "shutil", "subprocess", "tempfile", "typing", "opcache.explain",
        "opcache._links",
    }  # fmt: skip
    assert heavy.isdisjoint(modules), heavy.intersection(modules)


def test_a_read_sets_digest_is_the_canonical_json_of_its_paths_and_contents(tmp_path):
    """Keys made before stay the same: the digest is canonical_json's, times left out."""
    from opcache import readset
    from opcache.key import canonical_json, digest

    (tmp_path / "f").write_text("é\n")
    (tmp_path / "link").symlink_to("f")
    paths = ["f", "link", "missing"]
    items = [i for p in paths for i in readset._facts_with_link(str(tmp_path / p), listed=False)]
    items.append(readset._facts(str(tmp_path), False, listed=True, cheap=False))
    reads = readset.ReadSet(items)
    rows = [[i[0], i[1], i[2], i[3] if i[1] == "file" else 0, i[6]] for i in items]
    assert reads.digest == digest(canonical_json(rows))


# -- adversarial review, 2026-11-28: reads a trace showed, but the read set missed ----------

FWALK_OPC = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
data = b""
for folder, _, files, fd in os.fwalk("kernel"):  # (opens folders without O_DIRECTORY)
    for name in sorted(files):
        with open(os.path.join(folder, name), "rb") as f:
            data += f.read()
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(data)
"""

RDWR_OPC = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
with open("op/tuning.db", "r+b") as f:  # (as sqlite opens its database: read-write)
    data = f.read()
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(data)
"""

PROC_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
cat /proc/self/cwd/kernel/k.cpp > "$out/k.o"
"""

SHM_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
cat "$SHM_KERNEL" > "$out/k.o"
"""


@needs_strace
@pytest.mark.parametrize("case", ["fwalk", "rdwr", "proc", "shm"])
def test_an_input_read_in_a_way_of_its_own_changed_is_never_stale(tmp_path, case):
    env, root = project(tmp_path)
    shm = None
    if case in ("fwalk", "rdwr"):
        write_tool(tmp_path / "bin", "opc", FWALK_OPC if case == "fwalk" else RDWR_OPC)
        (root / "op" / "tuning.db").write_bytes(b"tile=8\n")
    else:
        write_tool(tmp_path / "bin", "opc", "")
        (tmp_path / "bin" / "opc").write_text(PROC_OPC if case == "proc" else SHM_OPC)
    if case == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm here")
        shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
        env["SHM_KERNEL"] = str(shm / "k.cpp")
        (shm / "k.cpp").write_text("int k = 1;\n")
    try:
        for n in (1, 2):  # (the second: a hit, when the compile could be cached)
            assert compile_into(env, root, f"out{n}") == fresh(env, root, "opc", ARGS)
        time.sleep(0.02)  # (a change a clock tick after the compiles)
        if case == "fwalk":
            (root / "kernel" / "b.cpp").write_text("int b = 2;\n")  # a new file listed
        elif case == "rdwr":
            (root / "op" / "tuning.db").write_bytes(b"tile=16\n")
        elif case == "proc":
            (root / "kernel" / "k.cpp").write_text("int k = 2;\n")
        else:
            (shm / "k.cpp").write_text("int k = 2;\n")
        assert compile_into(env, root, "out3") == fresh(env, root, "opc", ARGS)
    finally:
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)


@needs_strace
def test_what_the_caller_pipes_in_is_no_input_of_a_cached_compile(tmp_path):
    # A cached compile gets no stdin: what it read there would be in no key.
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "opc", "")
    (tmp_path / "bin" / "opc").write_text(
        '#!/bin/sh\nfor a; do case "$a" in --output=*) out="${a#--output=}";; esac; done\n'
        'mkdir -p "$out"\ncat > "$out/k.o"\n'
    )
    data = tmp_path / "data.txt"
    for n, text in enumerate(("one\n", "two\n")):
        data.write_text(text)
        with open(data, "rb") as stdin:
            subprocess.run(
                [sys.executable, "-m", "opcache", "wrap", "--", "opc", *ARGS, f"--output=o{n}"],
                env=env, cwd=root, stdin=stdin, check=True, timeout=120,
            )  # fmt: skip
        assert (root / f"o{n}" / "k.o").read_bytes() == b""


@needs_strace
def test_an_opc_in_the_project_s_own_bin_leaves_the_project_in_the_read_set(tmp_path):
    # opc found on PATH in the project's bin/: its "home" is the project, which holds a
    # version.info of the operator package's (ASCEND_OPP_PATH): not left out as a toolkit.
    env, root = project(tmp_path)
    write_tool(root / "bin", "opc", "")
    (root / "bin" / "opc").write_text(SHELL_OPC)
    (root / "opp" / "version.info").write_text("Version=7.0\n")
    env["PATH"] = f"{root / 'bin'}:{env['PATH']}"
    env["ASCEND_OPP_PATH"] = str(root / "opp")
    for n in (1, 2):
        assert compile_into(env, root, f"out{n}") == fresh(env, root, "opc", ARGS)
    (root / "kernel" / "k.cpp").write_text("// edited\nint k = 2;\n")
    assert compile_into(env, root, "out3") == fresh(env, root, "opc", ARGS)


WAITING_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
cat "$BUILD_KERNEL_SRC" > "$out/k.o"
touch "$READY"
while [ ! -e "$GO" ]; do sleep 0.02; done
"""


@needs_strace
def test_a_file_read_then_deleted_by_another_process_leaves_the_compile_unstored(tmp_path):
    # Recorded as missing, the next run (the file still gone) would hit on what it held.
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "opc", "")
    (tmp_path / "bin" / "opc").write_text(WAITING_OPC)
    # (named to come after the kernel: the first path found unsound is the one said)
    env["READY"], env["GO"] = str(tmp_path / "zz-ready"), str(tmp_path / "zz-go")
    command = [sys.executable, "-m", "opcache", "wrap", "--", "opc", *ARGS, "--output=out1"]
    running = subprocess.Popen(command, env=env, cwd=root)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "zz-ready").exists():
            assert time.monotonic() < deadline and running.poll() is None
            time.sleep(0.02)
        (root / "kernel" / "k.cpp").unlink()  # (another process: the build's clean step)
        (tmp_path / "zz-go").touch()
        assert running.wait(60) == 0
    finally:
        running.kill()
    reasons = stats(env, SOC)["uncacheable_reasons"]
    assert any("k.cpp was read and is gone" in r for r in reasons), reasons


@needs_strace
def test_a_process_opc_leaves_running_does_not_keep_the_compile_waiting(tmp_path):
    # strace -f waits for every process the command started: a server left running
    # kept the build waiting as long as it ran.  Now it is let go, the compile unstored.
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "opc", "")
    (tmp_path / "bin" / "opc").write_text(SHELL_OPC + "( sleep 30 </dev/null >/dev/null 2>&1 & )\n")
    started = time.monotonic()
    assert compile_into(env, root, "out1") == fresh(env, root, "opc", ARGS)
    assert time.monotonic() - started < 20
    reasons = stats(env, SOC)["uncacheable_reasons"]
    assert any("a process it started outlived it" in r for r in reasons), reasons
    subprocess.run(["pkill", "-f", "sleep 30"], check=False)


def test_the_command_s_end_is_read_from_its_trace_as_subprocess_gives_it(tmp_path):
    from opcache import readset

    ends = ((1, "+++ exited with 3 +++", 3), (2, "+++ killed by SIGTERM +++", -15), (3, "", None))
    for pid, line, status in ends:
        (tmp_path / f"trace.{pid}").write_text(f"1.000001 openat(...) = 3\n1.000002 {line}\n")
        assert readset._exit_status(str(tmp_path), pid) == status


# -- what the compile looked at before changing it, and listings that moved on ---------------

TILING_CACHE_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
if [ -e "$TILING_CACHE" ]; then cat "$TILING_CACHE" > "$out/k.o"
else echo computed > "$out/k.o"; echo cached > "$TILING_CACHE"; fi
"""

MARKER_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
if [ -e "$MARKER" ]; then rm "$MARKER"; echo first > "$out/k.o"
else cat "$BUILD_KERNEL_SRC" > "$out/k.o"; fi
"""


def shell_tool(tmp_path: Path, script: str) -> None:
    write_tool(tmp_path / "bin", "opc", "")
    (tmp_path / "bin" / "opc").write_text(script)


@needs_strace
def test_a_file_the_compile_makes_when_it_finds_none_is_looked_for_on_each_hit(tmp_path):
    # A tiling cache in HOME, made by the first compile: the next compile reads it and
    # writes what it holds.  A hit on the first compile's output would be stale.
    env, root = project(tmp_path)
    shell_tool(tmp_path, TILING_CACHE_OPC)
    env["TILING_CACHE"] = str(tmp_path / "tiling.cache")
    assert compile_into(env, root, "out1") == b"computed\n"
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS) == b"cached\n"
    assert compile_into(env, root, "out3") == b"cached\n"
    assert stats(env, SOC)["hits"] == 1
    (tmp_path / "tiling.cache").unlink()
    assert compile_into(env, root, "out4") == b"computed\n"  # (the first compile's entry)
    assert stats(env, SOC)["hits"] == 2


@needs_strace
def test_a_file_the_compile_finds_and_deletes_is_looked_for_on_each_hit(tmp_path):
    # A marker the compile checks and removes: what it made depends on the marker, which
    # the next run no longer finds.  Recorded as there, as the compile found it.
    env, root = project(tmp_path)
    shell_tool(tmp_path, MARKER_OPC)
    env["MARKER"] = str(tmp_path / "first-run")
    (tmp_path / "first-run").touch()
    time.sleep(0.02)  # (made a clock tick before the compile)
    assert compile_into(env, root, "out1") == b"first\n"
    kernel = fresh(env, root, "opc", ARGS)
    assert compile_into(env, root, "out2") == kernel
    assert compile_into(env, root, "out3") == kernel
    assert stats(env, SOC)["hits"] == 1
    (tmp_path / "first-run").touch()
    assert compile_into(env, root, "out4") == b"first\n"  # (the first compile's entry)
    assert stats(env, SOC)["hits"] == 2


LISTING_OPC = r"""
import os, sys, time
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
data = b""
for name in sorted(os.listdir("kernel")):
    if name.endswith(".cpp"):
        with open(os.path.join("kernel", name), "rb") as f:
            data += f.read()
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(data)
if os.environ.get("READY"):  # (its pid said, then a signal waited for: no path looked at)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    with open(os.environ["READY"], "w") as f:
        f.write(str(os.getpid()))
    signal.sigwait([signal.SIGUSR1])
"""


@needs_strace
@pytest.mark.parametrize("through_a_link", [False, True])
def test_a_folder_that_gains_a_file_after_the_compile_listed_it_leaves_it_unstored(
    tmp_path, through_a_link
):
    # Recorded with the new name, the next run (the file still there) would hit on an
    # output made without it.  (strace names a listing's folder by its real path; the
    # compile may name it by a link.)
    env, root = project(tmp_path)
    folder = root / "kernel"
    if through_a_link:
        folder = root / "real_kernel"
        (root / "kernel").rename(folder)
        (root / "kernel").symlink_to("real_kernel")
    write_tool(tmp_path / "bin", "opc", LISTING_OPC)
    ready = tmp_path / "ready"
    env["READY"] = str(ready)
    command = [sys.executable, "-m", "opcache", "wrap", "--", "opc", *ARGS, "--output=out1"]
    running = subprocess.Popen(command, env=env, cwd=root)
    try:
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text()):
            assert time.monotonic() < deadline and running.poll() is None
            time.sleep(0.02)
        (folder / "b.cpp").write_text("int b = 2;\n")  # (another process)
        os.kill(int(ready.read_text()), signal.SIGUSR1)
        assert running.wait(60) == 0
    finally:
        running.kill()
    reasons = stats(env, SOC)["uncacheable_reasons"]
    assert any("kernel" in r and "listed" in r for r in reasons), reasons
    del env["READY"]
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS)
    assert b"int b = 2" in (root / "out2" / "k.o").read_bytes()


@needs_strace
def test_a_python_opc_writing_bytecode_hits_from_its_second_run(tmp_path):
    # Python checks a .pyc against its source (in the read set): the .pyc files and
    # __pycache__ folders it makes, reads and replaces are no inputs, so the second run
    # hits and an edited helper is stored at once.
    env, root = project(tmp_path)
    del env["PYTHONDONTWRITEBYTECODE"]
    assert compile_into(env, root, "out1") == fresh(env, root, "opc", ARGS)
    assert (root / "op" / "__pycache__").is_dir()
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS)
    assert runs(env) == 1
    edit(root, env, "helper")
    assert compile_into(env, root, "out3") == fresh(env, root, "opc", ARGS)
    assert compile_into(env, root, "out4") == fresh(env, root, "opc", ARGS)
    assert runs(env) == 2


# -- review of the above, 2026-11-28 -------------------------------------------------------

NESTED_CACHE_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
if [ -e "$CACHE_DIR/t.bin" ]; then cat "$CACHE_DIR/t.bin" > "$out/k.o"
else echo computed > "$out/k.o"; mkdir "$CACHE_DIR"; echo cached > "$CACHE_DIR/t.bin"; fi
"""

NESTED_CACHE_PY = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
d = os.environ["CACHE_DIR"]; t = os.path.join(d, "t.bin")
if os.path.exists(t):
    data = open(t, "rb").read()
else:
    data = b"computed\n"
    os.makedirs(d, exist_ok=True)
    open(t, "wb").write(b"cached\n")
os.makedirs(flags["output"], exist_ok=True)
open(os.path.join(flags["output"], "k.o"), "wb").write(data)
"""


@needs_strace
@pytest.mark.parametrize("language", ["shell", "python"])
def test_a_file_made_in_a_folder_the_compile_makes_when_missing_is_looked_for(tmp_path, language):
    # Everything under a folder the compile made is its own; the folder itself is
    # recorded as missing, as it found it.
    env, root = project(tmp_path)
    if language == "shell":
        shell_tool(tmp_path, NESTED_CACHE_OPC)
    else:
        write_tool(tmp_path / "bin", "opc", NESTED_CACHE_PY)
    env["CACHE_DIR"] = str(tmp_path / "home-cache")
    assert compile_into(env, root, "out1") == b"computed\n"
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS) == b"cached\n"


@needs_strace
def test_a_pyc_python_used_though_stale_is_in_the_read_set(tmp_path):
    # Python checks a .pyc by its source's size and mtime in whole seconds: an edit that
    # keeps both (cp -p, tar, an edit within the second) runs the old bytecode, as the
    # tool itself does; once the .pyc is gone the tool gives the new source's output.
    env, root = project(tmp_path)
    del env["PYTHONDONTWRITEBYTECODE"]
    helper = root / "op" / "helper.py"
    compile_into(env, root, "out1")
    st = helper.stat()
    helper.write_text('VALUE = "helper-2\\n"\n')  # (the same size)
    os.utime(helper, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS)
    shutil.rmtree(root / "op" / "__pycache__")
    assert b"helper-2" in fresh(env, root, "opc", ARGS)
    shutil.rmtree(root / "op" / "__pycache__")
    assert compile_into(env, root, "out3") == fresh(env, root, "opc", ARGS)


REMOVE_THEN_WRITE_PY = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
os.makedirs("kernel_meta", exist_ok=True)
data = open(os.environ["BUILD_KERNEL_SRC"], "rb").read()
j = os.path.join("kernel_meta", "k.json")
if os.path.exists(j):
    os.remove(j)
with open(j, "w") as f:
    f.write("{}")
os.makedirs(flags["output"], exist_ok=True)
open(os.path.join(flags["output"], "k.o"), "wb").write(data)
"""

LOCK_PY = r"""
import fcntl, os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
lock = os.path.join(os.environ["HOME"], "opc.lock")
fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
data = open(os.environ["BUILD_KERNEL_SRC"], "rb").read()
os.makedirs(flags["output"], exist_ok=True)
open(os.path.join(flags["output"], "k.o"), "wb").write(data)
os.unlink(lock)
os.close(fd)
"""

CANN_LOCK_PY = r"""
import fcntl, os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
# CANN's LockAndOpenCacheFile: fopen a+, chmod 0640, then the lock.
lock = open(os.path.join(os.environ["HOME"], "k.lock"), "a+")
os.chmod(lock.name, 0o640)
fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
data = open(os.environ["BUILD_KERNEL_SRC"], "rb").read()
os.makedirs(flags["output"], exist_ok=True)
open(os.path.join(flags["output"], "k.o"), "wb").write(data)
"""

LINKED_TEMP_PY = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
tmp = os.path.join(os.environ["LINKED"], "kernel", "k.tmp")  # (through a link)
open(tmp, "w").close()
data = b"".join(open(os.path.join("kernel", n), "rb").read()
                for n in sorted(os.listdir("kernel")) if n.endswith(".cpp"))
os.unlink(tmp)
os.makedirs(flags["output"], exist_ok=True)
open(os.path.join(flags["output"], "k.o"), "wb").write(data)
"""


@needs_strace
@pytest.mark.parametrize(
    "case", ["remove_then_write", "lock_file", "cann_lock_file", "temp_through_a_link"]
)
def test_files_a_compile_makes_and_removes_of_its_own_leave_it_cached(tmp_path, case):
    # Its old output replaced, a lock file made and removed, a temporary file made
    # through a link in a folder it lists: stored, and hits from then on.
    env, root = project(tmp_path)
    script = {
        "remove_then_write": REMOVE_THEN_WRITE_PY,
        "lock_file": LOCK_PY,
        "cann_lock_file": CANN_LOCK_PY,
    }
    write_tool(tmp_path / "bin", "opc", script.get(case, LINKED_TEMP_PY))
    (root / "kernel_meta").mkdir()  # (there already: another operator's compile made it)
    (tmp_path / "link").symlink_to(root)
    env["LINKED"] = str(tmp_path / "link")
    for n in range(1, 5):
        assert compile_into(env, root, f"out{n}") == fresh(env, root, "opc", ARGS)
    chip = stats(env, SOC)
    assert chip["hits"] >= 2, chip["uncacheable_reasons"]


MARKER_BY_REMOVE_PY = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
try:
    os.remove(os.environ["MARKER"])
    data = b"first\n"
except FileNotFoundError:
    data = open(os.environ["BUILD_KERNEL_SRC"], "rb").read()
os.makedirs(flags["output"], exist_ok=True)
open(os.path.join(flags["output"], "k.o"), "wb").write(data)
"""

CLAIM_BY_RENAME_SH = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
if mv "$HOME/pending.cfg" "$HOME/used.cfg" 2>/dev/null; then cat "$HOME/used.cfg" > "$out/k.o"
else cat "$BUILD_KERNEL_SRC" > "$out/k.o"; fi
"""


@needs_strace
@pytest.mark.parametrize("case", ["removed", "renamed"])
def test_a_file_the_compile_removes_or_renames_without_looking_first_is_no_output(tmp_path, case):
    # A remove or a rename that works says the file was there.
    env, root = project(tmp_path)
    if case == "removed":
        write_tool(tmp_path / "bin", "opc", MARKER_BY_REMOVE_PY)
        env["MARKER"] = str(tmp_path / "first-run")
        (tmp_path / "first-run").touch()
    else:
        shell_tool(tmp_path, CLAIM_BY_RENAME_SH)
        (tmp_path / "pending.cfg").write_text("pending config\n")
    time.sleep(0.02)
    first = compile_into(env, root, "out1")
    assert first == (b"first\n" if case == "removed" else b"pending config\n")
    if case == "renamed":
        (tmp_path / "used.cfg").unlink()
        (tmp_path / "pending.cfg").write_text("another config\n")  # (what it read: gone)
        assert compile_into(env, root, "out2") == b"another config\n"
        (tmp_path / "used.cfg").unlink()
    assert compile_into(env, root, "out3") == fresh(env, root, "opc", ARGS)


# -- review of the Ascend paths, 2026-11-28: what CANN's own compile Python reads ----------

ASC_ENV_OPC = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
opts = ["kernel"]
if os.environ.get("ASCENDC_COV") == "1":  # (asc_op_compile_base: -g for coverage)
    opts.append("-g")
if os.environ.get("SKT_ENABLE") == "1":  # (-mllvm -cce-aicore-sk-transform)
    opts.append("sk-transform")
log = os.environ.get("ASCENDC_BUILD_LOG_DIR")
if log:
    os.makedirs(log, exist_ok=True)
    open(os.path.join(log, "k_build.log"), "w").write("bisheng ...\n")
os.makedirs(flags["output"], exist_ok=True)
open(os.path.join(flags["output"], "k.o"), "w").write(" ".join(opts))
"""


@needs_strace
@pytest.mark.parametrize("variable", ["ASCENDC_COV", "SKT_ENABLE"])
def test_a_variable_cann_s_compile_python_reads_is_in_the_key(tmp_path, variable):
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "asc_opc", ASC_ENV_OPC)
    assert compile_into(env, root, "out1", tool="asc_opc") == b"kernel"
    env[variable] = "1"
    assert compile_into(env, root, "out2", tool="asc_opc") == fresh(env, root, "asc_opc", ARGS)


@needs_strace
def test_a_build_log_folder_runs_asc_opc_uncached(tmp_path):
    # Each kernel's build log goes to ASCENDC_BUILD_LOG_DIR: a hit would write none.
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "asc_opc", ASC_ENV_OPC)
    env["ASCENDC_BUILD_LOG_DIR"] = str(tmp_path / "logs")
    for out in ("out1", "out2"):
        shutil.rmtree(tmp_path / "logs", ignore_errors=True)
        compile_into(env, root, out, tool="asc_opc")
        assert (tmp_path / "logs" / "k_build.log").exists()
    reasons = stats(env)["uncacheable_reasons"]
    assert any("ASCENDC_BUILD_LOG_DIR" in r for r in reasons), reasons


@needs_strace
@pytest.mark.parametrize("flag", ["--out=out2", "--op_debug_l=3"])
def test_a_flag_that_may_stand_for_an_output_or_debug_flag_runs_uncached(tmp_path, flag):
    # asc_opc parses its line with getopt, which takes a unique prefix for the flag.
    env, root = project(tmp_path)
    shell_tool(tmp_path, "#!/bin/sh\nmkdir -p o && echo k > o/k.o\n")
    wrap("opc", *ARGS, flag, env=env, cwd=root)
    reasons = stats(env)["uncacheable_reasons"]
    assert any("may stand for" in r for r in reasons), reasons


# -- review as a user who is not root, 2026-11-28 --------------------------------------------

ACCESS_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
{ cat "$BUILD_KERNEL_SRC"; cat opt.txt 2>/dev/null || echo "no opt"; } > "$out/k.o"
"""

ACCESS_CODE = """
import contextlib, io, json, os
from opcache.cli import main
os.chdir({root!r})
os.environ.update({env!r})
err = io.StringIO()
with contextlib.redirect_stderr(err):
    status = main(["wrap", "--", "opc", *{args!r}, "--output={out}"])
with open(os.path.join({root!r}, "{out}", "k.o")) as f:
    print(json.dumps([status, f.read(), err.getvalue()]))
"""


@needs_strace
@pytest.mark.parametrize("first_in_the_group", [False, True])
def test_a_file_this_user_may_read_now_and_could_not_then_is_a_miss(first_in_the_group):
    # The same stat, another answer to "may I read it": the user joined (or left) the
    # file's group.  What the compile read then is not what it would read now.
    from helpers_faults import MEMBER_A, TEAM_GID, open_folder, run_as

    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another user")
    with open_folder() as base:
        env, root = project(base)
        shell_tool(base, ACCESS_OPC)
        (root / "opt.txt").write_text("OPT ON\n")
        subprocess.run(["chown", "-R", f"{MEMBER_A}:{MEMBER_A}", str(base)], check=True)
        os.chown(root / "opt.txt", 0, TEAM_GID)
        (root / "opt.txt").chmod(0o640)
        said = []
        for n, member in enumerate((first_in_the_group, not first_in_the_group)):
            code = ACCESS_CODE.format(root=str(root), env=env, args=ARGS, out=f"out{n}")
            groups = (TEAM_GID,) if member else ()
            said.append(run_as(MEMBER_A, MEMBER_A, code, groups=groups))
        for (status, output, err), member in zip(
            said, (first_in_the_group, not first_in_the_group), strict=True
        ):
            assert status == 0, err
            assert output.endswith("OPT ON\n" if member else "no opt\n"), (member, output)


COUNTING_DB_OPC = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
fd = os.open(os.path.join(os.environ["HOME"], "tuning.db"), os.O_RDWR | os.O_CREAT, 0o644)
seen = os.read(fd, 100)  # (what it read decides the kernel)
os.lseek(fd, 0, 0)
os.write(fd, b"%d" % (int(seen or b"0") + 1))
os.makedirs(flags["output"], exist_ok=True)
open(os.path.join(flags["output"], "k.o"), "wb").write(b"tuned by " + (seen or b"nothing"))
"""


@needs_strace
def test_a_database_the_compile_reads_and_rewrites_leaves_each_compile_unstored(tmp_path):
    # What it read is gone once it wrote: no run can be stored (a hit would give the
    # kernel tuned by what the database held once).
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "opc", COUNTING_DB_OPC)
    for n, seen in enumerate((b"nothing", b"1", b"2")):
        assert compile_into(env, root, f"out{n}") == b"tuned by " + seen
    chip = stats(env, SOC)
    assert (chip.get("hits", 0), chip.get("stores", 0)) == (0, 0), chip
    assert any("opened read-write and changed" in r for r in chip["uncacheable_reasons"])


# Stand-ins reading their input in ways a review found the read set missed.
PROC_FD_OPC = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
folder = os.open("kernel", os.O_PATH | os.O_DIRECTORY)
with open(f"/proc/self/fd/{folder}/k.cpp", "rb") as f:  # (through the open folder)
    data = f.read()
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(data)
"""

PATH_OPC = r"""
import os, sys, time
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
with open(os.environ["READ_PATH"], "rb") as f:
    data = f.read()
if os.environ.get("READ_MARK"):  # (read: the test may now move things, for a while)
    open(os.environ["READ_MARK"], "w").close()
    time.sleep(1.5)
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(data)
"""

SCRIPT_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
./gen.sh > "$out/k.o"
"""


@needs_strace
@pytest.mark.parametrize("case", ["proc_fd", "run", "dotdot_after_a_link", "interpreter"])
def test_an_input_a_review_found_unseen_changed_is_never_stale(tmp_path, case):
    """Each was a hit with the old output: a file read through an open folder's
    /proc/self/fd/N, one under /run (left out with /proc, /sys, /dev), one named
    src/../x where src is a link (the name taken as text, the file read elsewhere),
    a script's #! interpreter (run by the kernel with no call of its own)."""
    env, root = project(tmp_path)
    changed: Path
    cleanup = None
    if case == "proc_fd":
        write_tool(tmp_path / "bin", "opc", PROC_FD_OPC)
        changed = root / "kernel" / "k.cpp"
    elif case == "interpreter":
        if GCC is None:
            pytest.skip("gcc is needed to build an interpreter")
        (tmp_path / "bin" / "opc").write_text(SCRIPT_OPC)
        interp = tmp_path / "interp"
        (root / "gen.sh").write_text(f"#!{interp}\n")
        (root / "gen.sh").chmod(0o755)
        changed = interp
    else:
        write_tool(tmp_path / "bin", "opc", PATH_OPC)
        if case == "run":
            if not os.access("/run/lock", os.W_OK):
                pytest.skip("no /run/lock to write here")
            changed = Path(tempfile.mkdtemp(dir="/run/lock")) / "k.cpp"
            cleanup = changed.parent
        else:
            (tmp_path / "real" / "src").mkdir(parents=True)
            (root / "src").symlink_to(tmp_path / "real" / "src")
            (root / "common.h").write_text("the name's file\n")  # (where text leads)
            changed = tmp_path / "real" / "common.h"
        env["READ_PATH"] = "src/../common.h" if case == "dotdot_after_a_link" else str(changed)

    def write(version: int) -> None:
        if case == "interpreter":
            c_file = tmp_path / "interp.c"
            c_file.write_text(f'#include <stdio.h>\nint main(void) {{ puts("v{version}"); }}\n')
            subprocess.run([GCC, str(c_file), "-o", str(changed)], check=True)
        else:
            changed.write_text(f"int k = {version};\n")

    try:
        write(1)
        for n in (1, 2):
            assert compile_into(env, root, f"out{n}") == fresh(env, root, "opc", ARGS)
        time.sleep(0.02)
        write(2)
        assert compile_into(env, root, "out3") == fresh(env, root, "opc", ARGS)
    finally:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)


@needs_strace
def test_a_link_moved_while_the_compile_ran_leaves_it_unstored(tmp_path):
    """opc read cfg -> a.txt; cfg was pointed at b.txt before it ended (both files
    older than the compile): stored, the next run was a hit with a.txt's bytes."""
    env, root = project(tmp_path)
    write_tool(tmp_path / "bin", "opc", PATH_OPC)
    for name, text in (("a.txt", "A\n"), ("b.txt", "B\n")):
        (root / name).write_text(text)
        os.utime(root / name, (1_600_000_000, 1_600_000_000))
    (root / "cfg").symlink_to("a.txt")
    mark = tmp_path / "read"
    command = [sys.executable, "-m", "opcache", "wrap", "--", "opc", *ARGS, "--output=out1"]
    env_marked = {**env, "READ_PATH": "cfg", "READ_MARK": str(mark)}
    with subprocess.Popen(command, env=env_marked, cwd=root) as running:
        deadline = time.monotonic() + 60
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        (root / "cfg.new").symlink_to("b.txt")
        (root / "cfg.new").rename(root / "cfg")
        assert running.wait(timeout=120) == 0
    env["READ_PATH"] = "cfg"
    assert compile_into(env, root, "out2") == fresh(env, root, "opc", ARGS) == b"B\n"


NOFOLLOW_OPC = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
os.close(os.open("cfg", os.O_PATH | os.O_NOFOLLOW))  # (the link itself, as lstat-like tools do)
with open(os.environ["READ_PATH"], "rb") as f:
    data = f.read()
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(data)
"""


@needs_strace
@pytest.mark.parametrize("case", ["a link opened itself", "a name not in UTF-8"])
def test_a_compile_read_in_these_ways_is_stored_and_hits(tmp_path, case):
    """A link opened with O_NOFOLLOW is the link's own descriptor (its folder's real
    path and its own name): it was taken for a link that moved, and nothing was
    stored.  A file whose name is not UTF-8 failed the compile with a traceback."""
    env, root = project(tmp_path)
    if case == "a link opened itself":
        write_tool(tmp_path / "bin", "opc", NOFOLLOW_OPC)
        (root / "a.txt").write_text("A\n")
        (root / "cfg").symlink_to("a.txt")
        env["READ_PATH"] = "a.txt"
    else:
        write_tool(tmp_path / "bin", "opc", PATH_OPC)
        name = os.fsdecode(b"k\xff.cpp")
        (root / name).write_text("int k = 1;\n")
        env["READ_PATH"] = name
    for n in (1, 2):
        assert compile_into(env, root, f"out{n}") == fresh(env, root, "opc", ARGS)
    assert (stats(env, SOC)["misses"], stats(env, SOC)["hits"]) == (1, 1)


# -- a compile that reads its kernel through a link it made itself ------------------------

# asc_opc as the review's stand-in: the kernel source staged in ./kernel_meta_<main_func>
# by a link the compile makes (STAGE), then read there.  STAGE_FOLDER: "made", the compile
# makes that folder and removes it before it ends; "existing", it is there already and
# the links are left in it; "existing, cleaned", there already and the links removed.
STAGED_OPC = r"""
import os, shutil, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
how, src = os.environ["STAGE"], os.environ["BUILD_KERNEL_SRC"]
scratch = "kernel_meta_" + flags["main_func"]
os.makedirs(scratch, exist_ok=True)
staged = os.path.join(scratch, "k.cpp")
for name in ("k.cpp", "inc", "a", "b"):
    if os.path.lexists(os.path.join(scratch, name)):
        os.remove(os.path.join(scratch, name))
if how == "symlink":
    os.symlink(src, staged)
elif how == "relative symlink":
    os.symlink(os.path.relpath(src, scratch), staged)
elif how == "hard link":
    os.link(src, staged)
elif how == "folder symlink":  # (the kernel's folder linked, the file read through it)
    os.symlink(os.path.dirname(src), os.path.join(scratch, "inc"))
    staged = os.path.join(scratch, "inc", os.path.basename(src))
elif how == "chain":  # k.cpp -> a -> b -> the source (relative, absolute, hard)
    os.link(src, os.path.join(scratch, "b"))
    os.symlink(os.path.abspath(os.path.join(scratch, "b")), os.path.join(scratch, "a"))
    os.symlink("a", staged)
with open(staged) as f:
    data = f.read()
if os.environ["STAGE_FOLDER"] == "made":
    shutil.rmtree(scratch)
elif os.environ["STAGE_FOLDER"] == "existing, cleaned":
    for name in os.listdir(scratch):
        os.remove(os.path.join(scratch, name))
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "w") as f:
    f.write("OBJ:" + data)
"""

STAGES = ["symlink", "relative symlink", "hard link", "folder symlink", "chain"]


@needs_strace
@pytest.mark.parametrize("folder", ["made", "existing", "existing, cleaned"])
@pytest.mark.parametrize("how", STAGES)
def test_a_kernel_read_through_a_link_the_compile_made_edited_is_a_miss(tmp_path, how, folder):
    """The review's reproduction: the staged kernel's source was in no read set (the
    link's source taken for a file the compile changed, its target never looked up,
    the staged name dropped as the compile's own): a hit with the old object.  Each
    compile is stored and hits until the edit (links left in a folder that was there:
    the first compile found no link there, the second finds one, so it misses once);
    but one that read the kernel through a hard link it removed is not stored (what
    the link held cannot be checked: the kernel's ctime is the link's)."""
    env, root = project(tmp_path, "asc_opc")
    write_tool(tmp_path / "bin", "asc_opc", STAGED_OPC)
    env.update(STAGE=how, STAGE_FOLDER=folder)
    if folder != "made":
        (root / "kernel_meta_add_custom").mkdir()  # (another compile's, kept)
    kernel = root / "kernel" / "k.cpp"
    kernel.write_text("int k = 1;\n")
    first = compile_into(env, root, "out1", "asc_opc", ASC_ARGS)
    assert first == b"OBJ:int k = 1;\n"
    assert compile_into(env, root, "out2", "asc_opc", ASC_ARGS) == first
    left = 1 if folder == "existing" else 0  # (the one more miss)
    stored = left or how not in ("hard link", "chain")
    if left:
        assert compile_into(env, root, "out2b", "asc_opc", ASC_ARGS) == first
    chip = stats(env, SOC)
    assert (chip["misses"], chip["hits"]) == ((1 + left, 1) if stored else (0, 0)), chip
    time.sleep(0.02)
    kernel.write_text("int k = 2;\n")  # (in place: a hard link left staged holds it too)
    assert compile_into(env, root, "out3", "asc_opc", ASC_ARGS) == b"OBJ:int k = 2;\n"
    assert fresh(env, root, "asc_opc", ASC_ARGS) == b"OBJ:int k = 2;\n"
    assert compile_into(env, root, "out4", "asc_opc", ASC_ARGS) == b"OBJ:int k = 2;\n"
    chip = stats(env, SOC)  # (each edit a miss, stored, and a hit after it)
    assert (chip["misses"], chip["hits"]) == ((2 + left, 2) if stored else (0, 0)), chip
    if not stored:
        reasons = chip["uncacheable_reasons"]
        assert any("through a hard link it removed" in r for r in reasons), reasons


# Other ways a compile reads through links it made (LINK_CASE), in ./kernel_meta, there
# already; each link removed before it ends.
LINK_CASES_OPC = r"""
import os, shutil, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
case, src = os.environ["LINK_CASE"], os.environ["BUILD_KERNEL_SRC"]
kernel = os.path.dirname(src)
scratch = os.path.abspath("kernel_meta")
staged = os.path.join(scratch, "k.cpp")
data = b""
if case == "re-pointed":  # one name, two links in turn
    for target in (src, os.path.join(kernel, "common.h")):
        os.symlink(target, staged)
        data += open(staged, "rb").read()
        os.remove(staged)
elif case == "dotdot":  # the kernel's folder linked, then .. from it: its parent
    os.symlink(kernel, os.path.join(scratch, "inc"))
    data = open(os.path.join(scratch, "inc", "..", "opp", "tiling.txt"), "rb").read()
elif case == "optional header":  # looked for through the link, not there
    os.symlink(kernel, os.path.join(scratch, "inc"))
    extra = os.path.join(scratch, "inc", "extra.h")
    data = open(extra, "rb").read() if os.path.exists(extra) else b"no extra"
elif case == "written then linked":  # a hard link to a file the compile wrote
    gen = os.path.join(scratch, "gen.cpp")
    with open(gen, "wb") as f:
        f.write(open(src, "rb").read())
    os.link(gen, staged)
    data = open(staged, "rb").read()
    os.remove(gen)
elif case == "renamed into place":  # (as ln -sf: a temporary name, then a rename)
    os.symlink(src, staged + ".tmp")
    os.rename(staged + ".tmp", staged)
    data = open(staged, "rb").read()
elif case == "folder renamed":  # a folder holding the link, renamed
    tmp = os.path.join(scratch, "tmp")
    os.mkdir(tmp)
    os.symlink(os.path.relpath(src, tmp), os.path.join(tmp, "k.cpp"))  # (relative)
    os.rename(os.path.join(scratch, "tmp"), os.path.join(scratch, "final"))
    data = open(os.path.join(scratch, "final", "k.cpp"), "rb").read()
elif case == "source renamed":  # the linked file moved away and back
    os.symlink(src, staged)
    data = open(staged, "rb").read()
    os.rename(src, src + ".away")
    os.rename(src + ".away", src)
elif case == "through proc":
    os.symlink("/proc/self/cwd/kernel/k.cpp", staged)
    data = open(staged, "rb").read()
elif case == "tmpfile":  # O_TMPFILE given a name by linkat, as atomic writers do
    fd = os.open(scratch, os.O_TMPFILE | os.O_WRONLY, 0o644)
    os.write(fd, open(src, "rb").read())
    anywhere = os.open("/", os.O_RDONLY)  # (a dir fd: linkat, AT_SYMLINK_FOLLOW)
    os.link(f"/proc/self/fd/{fd}", staged, src_dir_fd=anywhere, follow_symlinks=True)
    os.close(fd)
    data = open(staged, "rb").read()
for name in os.listdir(scratch):
    path = os.path.join(scratch, name)
    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(b"OBJ:" + data)
"""

# The same staging by a shell: ln, then cat, each a process of its own.  The link is
# left; the next run's `ln -f` makes another under a temporary name and renames it
# over the first (coreutils 9).
SHELL_LINK_OPC = """#!/bin/sh
for a; do case "$a" in --output=*) out="${a#--output=}";; esac; done
mkdir -p "$out"
ln -f $LN_FLAGS "$BUILD_KERNEL_SRC" kernel_meta/k.cpp
{ printf OBJ:; cat kernel_meta/k.cpp; } > "$out/k.o"
"""


@needs_strace
@pytest.mark.parametrize(
    "case, changed",
    [
        ("re-pointed", "kernel/k.cpp"),
        ("re-pointed", "kernel/common.h"),
        ("dotdot", "opp/tiling.txt"),
        ("optional header", "kernel/extra.h"),
        ("renamed into place", "kernel/k.cpp"),
        ("folder renamed", "kernel/k.cpp"),
        ("ln -s", "kernel/k.cpp"),
        ("ln", "kernel/k.cpp"),
    ],
)
def test_a_file_reached_through_links_the_compile_made_changed_is_a_miss(tmp_path, case, changed):
    """Each file the compile reached through a link it made is in the read set: both
    targets of a name linked twice, a file reached by .. past a linked folder (its
    parent, not the link's), a header looked for there and missing (then made), a
    link renamed into place or in a folder renamed, links made by one process and
    read by another (`ln -f` renaming its new link over the last run's)."""
    env, root = project(tmp_path, "asc_opc")
    if case.startswith("ln"):
        write_tool(tmp_path / "bin", "asc_opc", "")
        (tmp_path / "bin" / "asc_opc").write_text(SHELL_LINK_OPC)
        env["LN_FLAGS"] = "-s" if case == "ln -s" else ""
    else:
        write_tool(tmp_path / "bin", "asc_opc", LINK_CASES_OPC)
        env["LINK_CASE"] = case
    (root / "kernel_meta").mkdir()
    for n in (1, 2):
        assert compile_into(env, root, f"out{n}", "asc_opc", ASC_ARGS) == fresh(
            env, root, "asc_opc", ASC_ARGS
        )
    time.sleep(0.02)
    (root / changed).write_text("// changed\n")
    third = compile_into(env, root, "out3", "asc_opc", ASC_ARGS)
    assert b"// changed" in third
    assert third == fresh(env, root, "asc_opc", ASC_ARGS)
    chip = stats(env, SOC)
    assert (chip["misses"], chip["hits"]) == (2, 1), chip["uncacheable_reasons"]


@needs_strace
@pytest.mark.parametrize(
    "case, why",
    [
        ("written then linked", "linked a file it had changed"),
        ("source renamed", "changed while the compile ran"),
        ("through proc", "reached through /proc"),
        ("tmpfile", "a hard link to a file with no name"),
    ],
)
def test_a_link_whose_file_cannot_be_known_leaves_the_compile_unstored(tmp_path, case, why):
    """A hard link to a file the compile wrote, a linked file renamed away and back, a
    link into /proc, an O_TMPFILE linked by /proc/self/fd/N: what the link led to is
    not known for sure, so the compile runs uncached (its output the tool's own)."""
    env, root = project(tmp_path, "asc_opc")
    write_tool(tmp_path / "bin", "asc_opc", LINK_CASES_OPC)
    env["LINK_CASE"] = case
    (root / "kernel_meta").mkdir()
    kernel = root / "kernel" / "k.cpp"
    for n, text in enumerate(("int k = 1;\n", "int k = 2;\n")):
        kernel.write_text(text)
        assert compile_into(env, root, f"out{n}", "asc_opc", ASC_ARGS) == b"OBJ:" + text.encode()
    chip = stats(env, SOC)
    assert chip["hits"] == 0
    assert any(why in reason for reason in chip["uncacheable_reasons"]), chip


@needs_strace
def test_dotdot_past_a_made_link_through_a_users_link_runs_uncached(tmp_path):
    """The compile links kernel_meta/inc to the kernel's folder, named through a link
    of the user's (cur -> v1), and reads inc/../opp/tiling.txt: v1's.  Re-pointed to
    v2, the same read is v2's file, which a read set of v1's path never looks at: a
    hit served v1's tiling.  Where .. past a link it made meets a link of the user's,
    the compile runs uncached."""
    env, root = project(tmp_path, "asc_opc")
    write_tool(tmp_path / "bin", "asc_opc", LINK_CASES_OPC)
    env["LINK_CASE"] = "dotdot"
    (root / "kernel_meta").mkdir()
    for version in ("v1", "v2"):
        shutil.copytree(root / "kernel", root / version / "kernel")
        (root / version / "opp").mkdir()
        (root / version / "opp" / "tiling.txt").write_text(f"tiling {version}\n")
    (root / "cur").symlink_to("v1")
    env["BUILD_KERNEL_SRC"] = str(root / "cur" / "kernel" / "k.cpp")
    for n in (1, 2):
        assert compile_into(env, root, f"out{n}", "asc_opc", ASC_ARGS) == b"OBJ:tiling v1\n"
    (root / "cur").unlink()
    (root / "cur").symlink_to("v2")
    assert compile_into(env, root, "out3", "asc_opc", ASC_ARGS) == b"OBJ:tiling v2\n"
    chip = stats(env, SOC)
    assert chip["hits"] == 0
    assert any(".. past a link the compile made" in r for r in chip["uncacheable_reasons"])


# A hard link to the kernel, read; then, while the test replaces the kernel, a pause.
HARD_LINK_MARKED_OPC = r"""
import os, sys, time
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
staged = os.path.join("kernel_meta", "k.cpp")
if os.path.lexists(staged):
    os.remove(staged)
os.link(os.environ["BUILD_KERNEL_SRC"], staged)
data = open(staged, "rb").read()
if os.environ.get("READ_MARK"):
    time.sleep(0.05)  # (a change after the mark: later than the link by more than a tick)
    open(os.environ["READ_MARK"], "w").close()
    time.sleep(1.5)
if os.environ["STAGED"] == "removed":
    os.remove(staged)
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(b"OBJ:" + data)
"""


@needs_strace
@pytest.mark.parametrize("staged", ["removed", "left"])
@pytest.mark.parametrize(
    "change", ["renamed over it", "a link on its way re-pointed", "rewritten, its mtime kept"]
)
def test_a_linked_source_changed_while_the_compile_ran_leaves_it_unstored(tmp_path, change, staged):
    """The compile hard-linked the kernel and read the link; meanwhile another kernel,
    as old by its mtime, was renamed over it, or the folder link on the kernel's path
    was pointed at a folder holding another, or the kernel was rewritten in place and
    its mtime set back (cp -p).  The linked file's ctime is the compile's own (link,
    unlink): only that its link is still there and the same file, and that its ctime
    is no later than the compile's link, tell it is the file the compile read."""
    env, root = project(tmp_path, "asc_opc")
    write_tool(tmp_path / "bin", "asc_opc", HARD_LINK_MARKED_OPC)
    (root / "kernel_meta").mkdir()
    old = (1_600_000_000, 1_600_000_000)
    for n in (1, 2):
        (root / f"real{n}").mkdir()
        (root / f"real{n}" / "k.cpp").write_text(f"int k = {n};\n")  # (the same size)
        os.utime(root / f"real{n}" / "k.cpp", old)
    (root / "src").symlink_to("real1")
    env["BUILD_KERNEL_SRC"] = str(root / "src" / "k.cpp")
    mark = tmp_path / "read"
    command = [sys.executable, "-m", "opcache", "wrap", "--", "asc_opc", *ASC_ARGS, "--output=o1"]
    marked = {**env, "STAGED": staged, "READ_MARK": str(mark)}
    with subprocess.Popen(command, env=marked, cwd=root) as running:
        deadline = time.monotonic() + 60
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if change == "renamed over it":
            (root / "real2" / "k.cpp").rename(root / "real1" / "k.cpp")
        elif change == "rewritten, its mtime kept":
            (root / "real1" / "k.cpp").write_text("int k = 2;\n")
            os.utime(root / "real1" / "k.cpp", old)
        else:
            (root / "src.new").symlink_to("real2")
            (root / "src.new").rename(root / "src")
        assert running.wait(timeout=120) == 0
    assert (root / "o1" / "k.o").read_bytes() == b"OBJ:int k = 1;\n"
    env["STAGED"] = staged
    assert compile_into(env, root, "o2", "asc_opc", ASC_ARGS) == b"OBJ:int k = 2;\n"
    reasons = stats(env, SOC)["uncacheable_reasons"]
    why = ("changed while the compile ran", "is another file now")
    if staged == "removed":
        why = ("through a hard link it removed",)
    assert any(w in r for r in reasons for w in why), reasons


# The compile makes a folder, waits (the test puts a link there), then reads the link.
PLANTED_OPC = r"""
import os, shutil, sys, time
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
os.mkdir("kernel_meta")
open(os.environ["READ_MARK"], "w").close()
deadline = time.monotonic() + 30
while not os.path.lexists("kernel_meta/k.cpp") and time.monotonic() < deadline:
    time.sleep(0.02)
data = open("kernel_meta/k.cpp", "rb").read()
if os.environ["FOLDER"] == "removed":
    shutil.rmtree("kernel_meta")
os.makedirs(flags["output"], exist_ok=True)
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(b"OBJ:" + data)
"""


@needs_strace
@pytest.mark.parametrize("folder", ["removed", "kept"])
def test_a_link_another_process_put_in_the_compile_s_folder_leaves_it_unstored(tmp_path, folder):
    """A path in a folder the compile made is its own; but one that a link made by a
    process strace does not see led out of it, as `strace -y` names the file opened,
    was read unrecorded (a hit with the old kernel).  Whether the link is still
    there at the end or gone with the folder, the compile is not stored."""
    env, root = project(tmp_path, "asc_opc")
    write_tool(tmp_path / "bin", "asc_opc", PLANTED_OPC)
    kernel = root / "kernel" / "k.cpp"
    for n, text in enumerate(("int k = 1;\n", "int k = 2;\n")):
        kernel.write_text(text)
        mark = tmp_path / f"made{n}"
        marked = {**env, "FOLDER": folder, "READ_MARK": str(mark)}
        out = f"o{n}"
        command = [sys.executable, "-m", "opcache", "wrap", "--", "asc_opc", *ASC_ARGS]
        with subprocess.Popen([*command, f"--output={out}"], env=marked, cwd=root) as running:
            deadline = time.monotonic() + 60
            while not mark.exists() and running.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if mark.exists():  # (else a hit: the tool did not run)
                (root / "kernel_meta" / "k.cpp").symlink_to(kernel)
            assert running.wait(timeout=120) == 0
        assert (root / out / "k.o").read_bytes() == b"OBJ:" + text.encode()
        shutil.rmtree(root / "kernel_meta", ignore_errors=True)
    chip = stats(env, SOC)
    assert chip["hits"] == 0
    assert any("did not make" in r for r in chip["uncacheable_reasons"]), chip


@needs_strace
def test_a_traced_opc_s_outputs_keep_their_permission_bits(tmp_path):
    """An opc that makes its object 0640 (as CANN's tools make theirs) gives 0640 through
    the cache too, from the traced miss and from the hit (the traced path handed over
    bytes only, and both gave 0644)."""
    env, root = project(tmp_path)
    stand_in = tmp_path / "bin" / "opc"
    stand_in.write_text(
        stand_in.read_text() + "os.chmod(os.path.join(flags['output'], 'k.o'), 0o640)\n"
    )
    for out in ("o1", "o2"):
        wrap("opc", *ARGS, f"--output={out}", env=env, cwd=root)
        assert (root / out / "k.o").stat().st_mode & 0o777 == 0o640, out
    assert runs(env) == 1
    assert stats(env, SOC)["hits"] == 1


@needs_strace
def test_a_driver_version_that_cannot_be_read_is_no_driver_in_the_key(tmp_path):
    """A driver's version.info this user cannot read (a driver folder of another group:
    here a FIFO, which no read waits on) counted as no driver: two machines with
    different drivers, each unreadable, shared kernels.  Now it is keyed by where it
    is on this host: another is a miss, the same a hit.  (The driver folders sit in
    the stand-in toolkit's folder, where version files are read too: a FIFO there
    hung every compile.)"""
    env, root = project(tmp_path)
    for name in ("driver-a", "driver-b"):
        (tmp_path / name).mkdir()
        os.mkfifo(tmp_path / name / "version.info")
    env["ASCEND_DRIVER_PATH"] = str(tmp_path / "driver-a")
    compile_into(env, root, "out1")
    compile_into(env, root, "out2")
    assert runs(env) == 1
    env["ASCEND_DRIVER_PATH"] = str(tmp_path / "driver-b")
    compile_into(env, root, "out3")
    assert runs(env) == 2
