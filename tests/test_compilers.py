"""The compiler plug-ins: registry, cc (real compiles), cann (stand-in opc), command, auto."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from fake_opc import OP_SOURCE, SOC, base_env, invocations, make_toolkit, write_opc, write_tool
from helpers_marks import needs_strace

import opcache
from opcache import CompileError, ConfigError, OpCache, OpRequest, resolve_settings
from opcache.compilers import auto_choice, get_compiler, installed
from opcache.compilers.cann import CannCompiler
from opcache.compilers.cc import CcCompiler
from opcache.compilers.command import CommandCompiler

KERNEL_C = b"""\
#include <stddef.h>
#ifndef IN0_SIZE
#error IN0_SIZE must reach the source
#endif
#ifndef ATTR_ALPHA
#error ATTR_ALPHA must reach the source
#endif
static const size_t shape[IN0_NDIM] = IN0_SHAPE;
float scale(void) { return (float)ATTR_ALPHA * (float)shape[0]; }
void kernel(const float *a, const float *b, float *o) {
    for (size_t i = 0; i < IN0_SIZE; i++) o[i] = a[i] * ATTR_ALPHA + b[i];
}
"""


def cc_request(**overrides) -> OpRequest:
    tensor = {"shape": [4, 64], "dtype": "float32", "format": "ND"}
    fields = {
        "op_type": "AddScaled",
        "soc_version": SOC,
        "op_name": "add_scaled_0",
        "inputs": [tensor, tensor],
        "outputs": [tensor],
        "attrs": {"alpha": 2},
        "sources": {"add.c": KERNEL_C},
    }
    fields.update(overrides)
    return OpRequest(**fields)


def cann_request(**overrides) -> OpRequest:
    tensor = {"shape": [16, 1024], "dtype": "float16", "format": "ND"}
    fields = {
        "op_type": "Add",
        "soc_version": SOC,
        "op_name": "add_0",
        "inputs": [tensor, tensor],
        "outputs": [tensor],
        "attrs": {"alpha": 1.0},
        "options": {"impl_mode": "high_performance"},
        "sources": {"add.py": OP_SOURCE.encode()},
    }
    fields.update(overrides)
    return OpRequest(**fields)


def cache_at(tmp_path: Path, **env) -> OpCache:
    settings = resolve_settings(
        op_compiler_cache_mode="enable",
        op_compiler_cache_dir=str(tmp_path / "cache"),
        environ={"HOME": str(tmp_path), **env},
    )
    return OpCache(settings)


def read_dir(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def no_cann(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """The process environment without any CANN variable and without opc on PATH."""
    for name in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH", "TUNE_BANK_PATH"):
        monkeypatch.delenv(name, raising=False)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    path = [p for p in path if not os.access(os.path.join(p, "opc"), os.X_OK)]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    monkeypatch.setenv("HOME", str(tmp_path))
    return dict(os.environ)


@pytest.fixture
def toolkit(tmp_path: Path, no_cann: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A fake CANN toolkit and an environment that points at it through ASCEND_HOME_PATH."""
    root = make_toolkit(tmp_path / "Ascend" / "latest")
    env = {**no_cann, "ASCEND_HOME_PATH": str(root), "FAKE_OPC_LOG": str(tmp_path / "opc.log")}
    return root, env


# -- registry -------------------------------------------------------------------


def test_builtin_compilers_are_registered_as_entry_points():
    found = {ep.name: ep for ep in entry_points(group="opcache.compilers")}
    assert {"cc", "cann", "command"} <= set(found)
    for name in ("cc", "cann", "command"):
        assert found[name].load().name == name


def test_get_compiler_is_exported_and_builds_cc():
    compiler = opcache.get_compiler("cc")
    assert compiler.name == "cc"
    assert isinstance(compiler, opcache.Compiler)


def test_unknown_compiler_is_a_config_error_listing_the_installed_ones():
    with pytest.raises(ConfigError, match=r"'nosuch'.*installed: .*cann.*cc.*command"):
        get_compiler("nosuch")


def test_bad_option_is_a_config_error():
    with pytest.raises(ConfigError, match="cc"):
        get_compiler("cc", no_such_option=1)


def test_a_third_party_plugin_is_found_through_its_entry_point(tmp_path, monkeypatch):
    site = tmp_path / "site"
    dist = site / "opcache_toy-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: opcache-toy\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[opcache.compilers]\ntoy = opcache_toy:Toy\nbroken = opcache_toy_missing:Nope\n"
    )
    (site / "opcache_toy.py").write_text(
        textwrap.dedent(
            """\
            class Toy:
                name = "toy"
                def __init__(self, level=1, environ=None):
                    self.level = level
                def fingerprint(self):
                    return f"toy {self.level}"
                def compile(self, request, workdir):
                    (workdir / "toy.bin").write_bytes(request.op_type.encode())
            """
        )
    )
    monkeypatch.syspath_prepend(str(site))
    toy = get_compiler("toy", level=3)
    assert toy.fingerprint() == "toy 3"
    listed = installed()
    assert listed["toy"][0] is True
    assert listed["broken"][0] is False and "cannot load" in listed["broken"][1]
    assert listed["cc"][0] is True  # a broken plug-in does not hide the others
    with cache_at(tmp_path) as cache:
        result = cache.compile(cc_request(), toy, tmp_path / "out")
    assert result.status == "miss"
    assert (tmp_path / "out" / "toy.bin").read_bytes() == b"AddScaled"


def test_opcache_compilers_lists_each_and_whether_usable(tmp_path):
    bin_dir = tmp_path / "bin"
    write_opc(bin_dir)
    no_opc = base_env(tmp_path)
    with_opc = base_env(tmp_path, bin_dir)
    cmd = [sys.executable, "-m", "opcache", "compilers"]

    text = subprocess.run(cmd, env=no_opc, capture_output=True, text=True, check=True).stdout
    lines = {line.split()[0]: line for line in text.splitlines()}
    assert "usable" in lines["cc"] and "not usable" not in lines["cc"]
    assert "not usable" in lines["cann"]
    assert "-> cc" in lines["auto"]

    text = subprocess.run(
        [*cmd, "--json"], env=with_opc, capture_output=True, text=True, check=True
    ).stdout
    data = json.loads(text)
    assert text.startswith('{\n  "auto": {\n    "choice": ')  # indented, as every --json
    assert {"cc", "cann", "command", "auto"} <= set(data)
    assert data["cann"]["usable"] is True and str(bin_dir / "opc") in data["cann"]["note"]
    assert data["cc"]["usable"] is True
    # opc on PATH alone is not a configured toolkit: auto stays with cc, and says why.
    assert data["auto"]["choice"] == "cc" and data["auto"]["usable"] is True
    assert "ASCEND_HOME_PATH" in data["auto"]["reason"]


# -- cc ---------------------------------------------------------------------------


def test_cc_writes_kernel_object_and_description_with_its_sha256(tmp_path):
    compiler = CcCompiler()
    work = tmp_path / "work"
    work.mkdir()
    request = cc_request()
    compiler.compile(request, work)
    files = read_dir(work)
    assert len(files) == 2
    obj_name = next(n for n in files if n.endswith(".o"))
    kernel = obj_name[: -len(".o")]
    assert kernel.startswith("AddScaled_")
    assert "add_scaled_0" not in kernel
    description = json.loads(files[f"{kernel}.json"])
    assert description["sha256"] == hashlib.sha256(files[obj_name]).hexdigest()
    assert description["kernelName"] == kernel
    assert files[obj_name][:4] == b"\x7fELF"


def test_cc_kernel_name_ignores_op_name_and_a_hit_returns_the_same_files(tmp_path):
    compiler = CcCompiler()
    with cache_at(tmp_path) as cache:
        first = cache.compile(cc_request(op_name="node_a"), compiler, tmp_path / "a")
        second = cache.compile(cc_request(op_name="node_b"), compiler, tmp_path / "b")
    assert (first.status, second.status) == ("miss", "hit")
    assert sorted(first.files) == sorted(second.files)
    assert read_dir(tmp_path / "a") == read_dir(tmp_path / "b")


def test_cc_hit_is_byte_identical_to_a_fresh_compile(tmp_path):
    compiler = CcCompiler()
    with cache_at(tmp_path) as cache:
        assert cache.compile(cc_request(), compiler, tmp_path / "miss").status == "miss"
        assert cache.compile(cc_request(), compiler, tmp_path / "hit").status == "hit"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    CcCompiler().compile(cc_request(), fresh)
    assert read_dir(tmp_path / "hit") == read_dir(fresh) == read_dir(tmp_path / "miss")


def test_cc_shapes_and_attrs_reach_the_source_as_defines(tmp_path):
    compiler = CcCompiler()
    objects = {}
    for label, request in {
        "alpha2": cc_request(),
        "alpha3": cc_request(attrs={"alpha": 3}),
        "bigger": cc_request(inputs=[{"shape": [8, 64], "dtype": "float32"}] * 2),
    }.items():
        work = tmp_path / label
        work.mkdir()
        compiler.compile(request, work)
        (obj,) = [p for p in work.iterdir() if p.suffix == ".o"]
        objects[label] = obj.read_bytes()
    assert len(set(objects.values())) == 3


def test_cc_source_without_the_defines_fails(tmp_path):
    """The #error guards in KERNEL_C are real: without attrs the compile fails."""
    with pytest.raises(CompileError, match="ATTR_ALPHA must reach the source"):
        CcCompiler().compile(cc_request(attrs={}), tmp_path)


def test_cc_options_become_flags_and_defines(tmp_path):
    source = b"#if OPT_UNROLL != 4\n#error no OPT_UNROLL\n#endif\nint f(int x) { return x * 3; }\n"
    compiler = CcCompiler()
    outs = {}
    for label, options in {
        "default": {"unroll": 4},
        "o0": {"unroll": 4, "flags": ["-O0"]},
        "o2": {"unroll": 4, "flags": ["-O2"]},
    }.items():
        work = tmp_path / label
        work.mkdir()
        compiler.compile(cc_request(sources={"f.c": source}, options=options), work)
        (obj,) = [p for p in work.iterdir() if p.suffix == ".o"]
        outs[label] = obj.read_bytes()
    assert outs["default"] == outs["o2"]  # -O2 when no flag sets the level
    assert outs["o0"] != outs["o2"]


def test_cc_compile_error_carries_the_command_line_and_stderr_tail(tmp_path):
    bad = b"int broken(void) { return undeclared_thing_42; }\n"
    with pytest.raises(CompileError) as caught:
        CcCompiler().compile(cc_request(sources={"bad.c": bad}), tmp_path)
    message = str(caught.value)
    assert "-c bad.c" in message and "-o " in message
    assert "undeclared_thing_42" in message  # from the compiler's stderr
    assert list(tmp_path.iterdir()) == []


def test_cc_needs_exactly_one_c_source(tmp_path):
    with pytest.raises(CompileError, match="exactly one C source"):
        CcCompiler().compile(cc_request(sources={"a.py": b"x"}), tmp_path)


def test_cc_failure_through_the_cache_stores_nothing(tmp_path):
    bad = cc_request(sources={"bad.c": b"this is not C\n"})
    with cache_at(tmp_path) as cache:
        with pytest.raises(CompileError):
            cache.compile(bad, CcCompiler(), tmp_path / "out")
        with pytest.raises(CompileError):
            cache.compile(bad, CcCompiler(), tmp_path / "out")
        report = cache.stats()
    assert report["entries"] == 0 and report["hits"] == 0


def test_cc_follows_the_CC_variable_and_fails_clearly_without_a_compiler(tmp_path):
    compiler = CcCompiler(environ={"CC": "gcc -std=c11", "PATH": os.environ["PATH"]})
    assert os.path.basename(compiler.argv[0]) == "gcc" and compiler.argv[1:] == ["-std=c11"]
    assert "-std=c11" in compiler.fingerprint()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no C compiler"):
        CcCompiler(environ={"PATH": str(empty)})
    ok, note = CcCompiler.usable({"PATH": str(empty)})
    assert not ok and "CC" in note


# -- cann ---------------------------------------------------------------------------


@pytest.mark.parametrize("variable", ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH"])
def test_cann_finds_the_toolkit_through_each_variable(tmp_path, no_cann, variable):
    root = make_toolkit(tmp_path / "toolkit")
    value = root / "opp" if variable == "ASCEND_OPP_PATH" else root
    env = {**no_cann, variable: str(value)}
    compiler = get_compiler("cann", environ=env)
    assert compiler.opc == str(root / "bin" / "opc")
    assert auto_choice(env)[0] == "cann"


def test_cann_finds_opc_under_compiler_bin(tmp_path, no_cann):
    root = tmp_path / "toolkit"
    write_opc(root / "compiler" / "bin")
    env = {**no_cann, "ASCEND_TOOLKIT_HOME": str(root)}
    assert CannCompiler(environ=env).opc == str(root / "compiler" / "bin" / "opc")


def test_cann_finds_opc_on_path(tmp_path, no_cann):
    bin_dir = tmp_path / "bin"
    write_opc(bin_dir)
    env = {**no_cann, "PATH": f"{bin_dir}{os.pathsep}{no_cann['PATH']}"}
    assert CannCompiler(environ=env).opc == str(bin_dir / "opc")
    # opc on PATH alone is not a configured CANN environment: auto stays with cc.
    assert auto_choice(env)[0] == "cc"


def test_cann_opc_given_by_name_is_looked_up_on_path(tmp_path, no_cann):
    bin_dir = tmp_path / "bin"
    write_opc(bin_dir)
    env = {**no_cann, "PATH": f"{bin_dir}{os.pathsep}{no_cann['PATH']}"}
    compiler = CannCompiler(opc="opc", environ=env)
    assert compiler.opc == str(bin_dir / "opc")
    assert str(bin_dir / "opc") in compiler.fingerprint()
    with pytest.raises(ConfigError, match="no-such-opc"):
        CannCompiler(opc="no-such-opc", environ=env)


def test_missing_toolkit_is_one_clear_error_naming_the_variables(no_cann, tmp_path):
    env = {**no_cann, "ASCEND_HOME_PATH": str(tmp_path / "nothing-here")}
    with pytest.raises(ConfigError) as caught:
        get_compiler("cann", environ=env)
    message = str(caught.value)
    assert "\n" not in message
    for name in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH", "PATH"):
        assert name in message
    assert str(tmp_path / "nothing-here") in message
    ok, note = CannCompiler.usable(env)
    assert not ok and "ASCEND_HOME_PATH" in note


def test_auto_picks_cann_with_a_toolkit_and_cc_without(toolkit, no_cann):
    _, env = toolkit
    assert auto_choice(env)[0] == "cann"
    assert get_compiler("auto", environ=env).name == "cann"
    assert auto_choice(no_cann)[0] == "cc"
    assert get_compiler("auto", environ=no_cann).name == "cc"
    # A variable set to a folder without opc is not a toolkit.
    assert auto_choice({**no_cann, "ASCEND_HOME_PATH": "/nonexistent"})[0] == "cc"


def test_opcache_config_shows_the_auto_choice(tmp_path):
    root = make_toolkit(tmp_path / "toolkit")
    env = base_env(tmp_path)
    cmd = [sys.executable, "-m", "opcache", "config", "--json"]
    plain = json.loads(subprocess.run(cmd, env=env, capture_output=True, check=True).stdout)
    assert plain["compiler_auto"].startswith("cc")
    env["ASCEND_HOME_PATH"] = str(root)
    cann = json.loads(subprocess.run(cmd, env=env, capture_output=True, check=True).stdout)
    assert cann["compiler_auto"].startswith("cann")


def test_cann_compile_runs_opc_with_its_arguments(toolkit, tmp_path):
    _, env = toolkit
    work = tmp_path / "work"
    work.mkdir()
    request = cann_request(options={"impl_mode": "high_performance", "op_mode": "static"})
    CannCompiler(environ=env).compile(request, work)
    (run,) = invocations(tmp_path / "opc.log")
    args = run["args"]
    assert args[0].endswith("add.py")
    assert "--main_func=add" in args
    assert f"--soc_version={SOC}" in args
    assert f"--output={work}" in args
    assert "--impl_mode=high_performance" in args and "--op_mode=static" in args
    param_arg = next(a for a in args if a.startswith("--input_param="))
    assert param_arg.endswith(".json")
    files = read_dir(work)
    (obj,) = [n for n in files if n.endswith(".o")]
    kernel = obj[:-2]
    assert kernel.startswith("Add_") and f"{kernel}.json" in files
    assert json.loads(files[f"{kernel}.json"])["sha256"] == hashlib.sha256(files[obj]).hexdigest()


def test_cann_main_func_option_and_default(toolkit, tmp_path):
    _, env = toolkit
    source = OP_SOURCE.replace("def add(", "def add_custom(").encode()
    request = cann_request(sources={"op.py": source}, options={"main_func": "add_custom"})
    CannCompiler(environ=env).compile(request, tmp_path)
    (run,) = invocations(tmp_path / "opc.log")
    assert "--main_func=add_custom" in run["args"]
    assert not any(a.startswith("--main_func=add_custom=") for a in run["args"])
    assert sum(a.startswith("--main_func") for a in run["args"]) == 1


def test_cann_failure_is_a_compile_error_with_the_command_and_stderr(toolkit, tmp_path):
    _, env = toolkit
    env = {**env, "FAKE_OPC_FAIL": "vector core overflow in add", "FAKE_OPC_STATUS": "3"}
    with pytest.raises(CompileError) as caught:
        CannCompiler(environ=env).compile(cann_request(), tmp_path)
    message = str(caught.value)
    assert "exit status 3" in message
    assert "--main_func=add" in message and "--soc_version=Ascend910B1" in message
    assert "vector core overflow in add" in message


@needs_strace
def test_cann_hit_does_not_run_opc(toolkit, tmp_path):
    _, env = toolkit
    compiler = CannCompiler(environ=env)
    with cache_at(tmp_path) as cache:
        first = cache.compile(cann_request(op_name="n1"), compiler, tmp_path / "a")
        second = cache.compile(
            cann_request(op_name="n2"), CannCompiler(environ=env), tmp_path / "b"
        )
    assert (first.status, second.status) == ("miss", "hit")
    assert len(invocations(tmp_path / "opc.log")) == 1
    assert read_dir(tmp_path / "a") == read_dir(tmp_path / "b")


def _status_after(tmp_path: Path, env: dict[str, str], out: str) -> str:
    time.sleep(0.02)  # (a file opc reads, written as it starts, leaves its compile unstored)
    with cache_at(tmp_path) as cache:
        return cache.compile(cann_request(), CannCompiler(environ=env), tmp_path / out).status


@needs_strace
def test_cann_fingerprint_follows_version_info(toolkit, tmp_path):
    root, env = toolkit
    before = CannCompiler(environ=env).fingerprint()
    assert _status_after(tmp_path, env, "a") == "miss"
    assert _status_after(tmp_path, env, "b") == "hit"
    (root / "version.info").write_text("Version=8.0.RC2\n")
    assert CannCompiler(environ=env).fingerprint() != before
    assert _status_after(tmp_path, env, "c") == "miss"
    assert len(invocations(tmp_path / "opc.log")) == 2


def test_cann_fingerprint_follows_the_opp_version(toolkit):
    root, env = toolkit
    before = CannCompiler(environ=env).fingerprint()
    (root / "opp" / "version.info").write_text("Version=8.0.RC2\n")
    assert CannCompiler(environ=env).fingerprint() != before


@needs_strace
def test_cann_fingerprint_follows_the_tuning_bank(toolkit, tmp_path):
    _, env = toolkit
    bank = tmp_path / "bank"
    (bank / "Ascend910B1").mkdir(parents=True)
    tuned = bank / "Ascend910B1" / "add.bank"
    tuned.write_text("tiling=16\n")
    env = {**env, "TUNE_BANK_PATH": str(bank)}
    before = CannCompiler(environ=env).fingerprint()
    assert CannCompiler(environ=env).fingerprint() == before  # stable
    assert _status_after(tmp_path, env, "a") == "miss"
    tuned.write_text("tiling=32\n")  # same size, new contents
    st = tuned.stat()
    os.utime(tuned, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert CannCompiler(environ=env).fingerprint() != before
    assert _status_after(tmp_path, env, "b") == "miss"
    (bank / "Ascend910B1" / "mul.bank").write_text("tiling=8\n")  # a new file
    assert _status_after(tmp_path, env, "c") == "miss"
    assert _status_after(tmp_path, env, "d") == "hit"


@pytest.mark.parametrize("spaces", ["", " "], ids=["plain", "with_a_space_after"])
def test_cann_tuning_bank_defaults_to_aoe_data_under_ascend_cache_path(toolkit, tmp_path, spaces):
    """A space after the variable (which CANN trims, as opcache does for the cache) left
    the bank under the trimmed path out of the key: a tuning change still hit."""
    _, env = toolkit
    env = {**env, "ASCEND_CACHE_PATH": str(tmp_path / "ascend_cache") + spaces}
    before = CannCompiler(environ=env).fingerprint()
    bank = tmp_path / "ascend_cache" / "aoe_data"
    bank.mkdir(parents=True)
    (bank / "knowledge.json").write_text("{}")
    assert CannCompiler(environ=env).fingerprint() != before


def test_cann_fingerprint_follows_the_opc_executable(toolkit):
    root, env = toolkit
    before = CannCompiler(environ=env).fingerprint()
    opc = root / "bin" / "opc"
    opc.write_text(opc.read_text() + "\n# patched\n")
    assert CannCompiler(environ=env).fingerprint() != before


def _replace(path: Path, text: str, *, same_times_as: Path | None = None) -> None:
    """Install ``text`` at ``path`` as a package manager does: a new file renamed over
    it (a new inode), with the old one's times when ``same_times_as`` says (tar, rsync -t)."""
    new = path.with_name(path.name + ".new")
    new.write_text(text)
    new.chmod(0o755)
    if same_times_as is not None:
        st = same_times_as.stat()
        os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, path)


def test_a_tool_replaced_with_the_same_size_and_mtime_is_hashed_again(tmp_path):
    """The digest memo held size and mtime only: a tool replaced by one of the same
    size and mtime kept the old digest in the process, even for a new compiler."""
    from opcache.compilers import toolchain

    tool = tmp_path / "mycc"
    tool.write_text("#!/bin/sh\necho 1\n")
    first = toolchain.file_identity(tool)
    _replace(tool, "#!/bin/sh\necho 2\n", same_times_as=tool)
    assert toolchain.file_identity(tool) != first


def test_a_fifo_in_a_keyed_tool_s_place_is_refused_not_waited_on(tmp_path):
    """A tool or a tuning bank file is looked at, then read for its digest: a FIFO put
    in its place meanwhile (a folder others may write) hung the compile for good."""
    from opcache.compilers import toolchain

    os.mkfifo(tmp_path / "mycc")
    with pytest.raises(OSError, match="not a regular file"):
        toolchain.file_identity(tmp_path / "mycc")


@needs_strace
def test_cann_opc_upgraded_in_place_under_a_long_lived_compiler_gets_new_keys(toolkit, tmp_path):
    """The fingerprint was taken once per compiler object: after an upgrade in place, one
    OpCache and compiler kept serving the old opc's kernels, and stored the new opc's
    kernels under the old opc's keys."""
    root, env = toolkit
    opc = root / "bin" / "opc"
    compiler = CannCompiler(environ=env)
    with cache_at(tmp_path) as cache:
        assert cache.compile(cann_request(), compiler, tmp_path / "a").status == "miss"
        _replace(opc, opc.read_text() + "\n# 8.0\n")
        assert cache.compile(cann_request(), compiler, tmp_path / "b").status == "miss"
        assert cache.compile(cann_request(), compiler, tmp_path / "c").status == "hit"


@needs_strace
def test_a_tool_changed_while_it_compiles_is_not_stored(tmp_path):
    """A miss compiled by a tool upgraded meanwhile was stored under the old tool's key,
    where another process still running the old tool found it."""
    tool = tmp_path / "mycc"
    upgrade = f"#!/bin/sh\ncp {tool}.v2 {tool}.new && mv {tool}.new {tool}\n"
    tool.write_text(upgrade + 'echo v1 > "$1"\n')
    tool.chmod(0o755)
    Path(f"{tool}.v2").write_text('#!/bin/sh\necho v2 > "$1"\n')
    Path(f"{tool}.v2").chmod(0o755)
    compiler = CommandCompiler(f"{tool} {{workdir}}/{{kernel_name}}.o")
    with cache_at(tmp_path) as cache:
        result = cache.compile(cc_request(), compiler, tmp_path / "a")
        # (its trace sees the tool rewritten, or the fingerprint does, after)
        assert result.status == "miss"
        assert result.reason in (
            "not stored: the compiler changed while it compiled",
            f"not stored: {tool}: {tool} changed while the compile ran (it wrote what it had read)",
        )
        assert cache.compile(cc_request(), compiler, tmp_path / "b").status == "miss"
        assert cache.compile(cc_request(), compiler, tmp_path / "c").status == "hit"


@needs_strace
def test_cann_key_holds_the_environment_and_custom_packages_opc_keys_in_wrap(toolkit, tmp_path):
    """The cann back-end keyed neither PYTHONPATH (where an operator's imports are
    found) nor the custom operator packages: a package edited gave a stale hit."""
    _, env = toolkit
    package = tmp_path / "custom" / "vendors" / "me" / "impl.txt"
    package.parent.mkdir(parents=True)
    package.write_text("impl 1\n")
    env = {**env, "ASCEND_CUSTOM_OPP_PATH": str(tmp_path / "custom"), "PYTHONPATH": "/a"}
    key = opcache.explain_key(cann_request(), CannCompiler(environ=env))["key"]
    for other in ({"PYTHONPATH": "/b"}, {"ASCEND_CUSTOM_OPP_PATH": str(tmp_path)}):
        assert (
            opcache.explain_key(cann_request(), CannCompiler(environ={**env, **other}))["key"]
            != key
        )
    assert _status_after(tmp_path, env, "a") == "miss"
    package.write_text("impl 2\n")
    assert _status_after(tmp_path, env, "b") == "miss"
    assert _status_after(tmp_path, env, "c") == "hit"


def write_interpreter(folder: Path, note: str) -> Path:
    """A tiny interpreter of our own: a shell script that runs this Python."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fakepy"
    path.write_text(f'#!/bin/sh\n# interpreter {note}\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return path


@needs_strace
def test_cann_fingerprint_follows_the_python_that_opc_runs_with(toolkit, tmp_path, monkeypatch):
    root, env = toolkit
    opc = root / "bin" / "opc"
    script = opc.read_text().split("\n", 1)[1]
    opc.write_text("#!/usr/bin/env fakepy\n" + script)  # found on the environment's PATH
    one = write_interpreter(tmp_path / "py1", "one")
    two = write_interpreter(tmp_path / "py2", "two")
    env_one = {**env, "PATH": f"{one.parent}{os.pathsep}{env['PATH']}"}
    env_two = {**env, "PATH": f"{two.parent}{os.pathsep}{env['PATH']}"}
    first = CannCompiler(environ=env_one).fingerprint()
    assert str(one) in first
    monkeypatch.setattr(sys, "version", "9.9.9 (opcache's own Python, not opc's)")
    assert CannCompiler(environ=env_one).fingerprint() == first
    assert CannCompiler(environ=env_two).fingerprint() != first
    assert _status_after(tmp_path, env_one, "a") == "miss"  # opc really runs through it
    assert _status_after(tmp_path, env_one, "b") == "hit"
    assert _status_after(tmp_path, env_two, "c") == "miss"
    one.write_text(one.read_text() + "# upgraded\n")
    assert CannCompiler(environ=env_one).fingerprint() != first
    # An interpreter named by its path (with a flag), whatever PATH says.
    opc.write_text(f"#!{two} -u\n" + script)
    assert str(two) in CannCompiler(environ=env_one).fingerprint()


# -- command ---------------------------------------------------------------------------


@needs_strace
def test_command_template_compiles_through_the_cache(tmp_path):
    template = "cp {source} {workdir}/{kernel_name}.bin"
    compiler = get_compiler("command", template=template, fingerprint="cp 1")
    assert compiler.name == "command"
    request = cc_request(sources={"k.c": b"int x;\n"})
    with cache_at(tmp_path) as cache:
        first = cache.compile(request, compiler, tmp_path / "a")
        second = cache.compile(request, compiler, tmp_path / "b")
    assert (first.status, second.status) == ("miss", "hit")
    (name,) = first.files
    assert name.startswith("AddScaled_") and name.endswith(".bin")
    assert (tmp_path / "b" / name).read_bytes() == b"int x;\n"


@needs_strace
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_command_a_header_the_template_includes_is_never_served_stale(tmp_path):
    """A template that compiles with its own -I folder: a header there edited in place,
    or a header added earlier on the search path, gives the object a compile makes
    now, never the old one (its key names neither)."""
    first_inc, second_inc = tmp_path / "inc1", tmp_path / "inc2"
    first_inc.mkdir()
    second_inc.mkdir()
    (second_inc / "k.h").write_text("#define FACTOR 1\n")
    template = f"gcc -I{first_inc} -I{second_inc} -c {{source}} -o {{workdir}}/{{kernel_name}}.o"
    compiler = CommandCompiler(template, environ={"PATH": "/usr/bin:/bin"})
    request = cc_request(sources={"k.c": b'#include "k.h"\nint factor(void) { return FACTOR; }\n'})
    time.sleep(0.02)  # (a file the compile reads, written as it starts, leaves it unstored)
    outputs = []
    with cache_at(tmp_path) as cache:
        for change in (
            None,
            lambda: (second_inc / "k.h").write_text("#define FACTOR 2\n"),  # (in place)
            lambda: (first_inc / "k.h").write_text("#define FACTOR 3\n"),  # (earlier on -I)
            None,
        ):
            if change is not None:
                change()
                time.sleep(0.02)
            result = cache.compile(request, compiler, tmp_path / f"o{len(outputs)}")
            outputs.append((result.status, next(iter(result.files.values())).read_bytes()))
    assert [status for status, _ in outputs] == ["miss", "miss", "miss", "hit"]
    assert len({data for _, data in outputs[:3]}) == 3  # (three different objects)
    assert outputs[3][1] == outputs[2][1]


def test_command_without_strace_compiles_and_stores_nothing(tmp_path):
    template = "cp {source} {workdir}/{kernel_name}.bin"
    compiler = CommandCompiler(template, environ={"PATH": "/usr/bin:/bin", "OPCACHE_TRACE": "off"})
    request = cc_request(sources={"k.c": b"int x;\n"})
    with cache_at(tmp_path) as cache:
        results = [cache.compile(request, compiler, tmp_path / o) for o in "ab"]
        report = cache.stats()
    assert [r.status for r in results] == ["miss", "miss"]
    assert report["stores"] == 0
    assert list(report["uncacheable_reasons"]) == [
        "cp: not traced (no strace on PATH or OPCACHE_TRACE=off)"
    ]


def test_command_template_fields(tmp_path):
    script = tmp_path / "tool.py"
    script.write_text(
        textwrap.dedent(
            """\
            import json, sys
            out, soc, kernel, op_type, param, *sources = sys.argv[1:]
            data = {"soc": soc, "kernel": kernel, "op_type": op_type,
                    "param": json.load(open(param)),
                    "sources": [open(s).read() for s in sources]}
            open(f"{out}/{kernel}.json", "w").write(json.dumps(data))
            """
        )
    )
    template = (
        f"{sys.executable} {script} {{workdir}} {{soc_version}} {{kernel_name}} {{op_type}} "
        "{param} {sources}"
    )
    compiler = CommandCompiler(template)
    request = cc_request(sources={"a.c": b"A", "b.c": b"B"}, options={"mode": "fast"})
    compiler.compile(request, tmp_path)
    (described,) = tmp_path.glob("AddScaled_*.json")
    data = json.loads(described.read_text())
    assert data["soc"] == SOC and data["op_type"] == "AddScaled"
    assert described.name == f"{data['kernel']}.json"
    assert data["param"]["attrs"] == {"alpha": 2}
    assert data["param"]["options"] == {"mode": "fast"}
    assert sorted(data["sources"]) == ["A", "B"]


def test_command_fingerprint_has_the_user_part_and_the_template():
    a = CommandCompiler("cp {source} {workdir}", fingerprint="v1").fingerprint()
    b = CommandCompiler("cp {source} {workdir}", fingerprint="v2").fingerprint()
    c = CommandCompiler("cp -p {source} {workdir}", fingerprint="v1").fingerprint()
    assert len({a, b, c}) == 3


def test_command_bad_templates_are_config_errors():
    with pytest.raises(ConfigError, match="nosuch"):
        get_compiler("command", template="cp {nosuch} {workdir}")
    with pytest.raises(ConfigError, match="not an executable"):
        get_compiler("command", template="no-such-tool-xyz {source}")
    with pytest.raises(ConfigError, match="empty"):
        get_compiler("command", template="  ")
    with pytest.raises(ConfigError):
        get_compiler("command")  # no template


def test_command_failure_is_a_compile_error(tmp_path):
    compiler = CommandCompiler("false {source}")
    with pytest.raises(CompileError, match="false"):
        compiler.compile(cc_request(sources={"k.c": b""}), tmp_path)


def test_a_remembered_compiler_digest_never_outlives_a_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest is kept in the cache by ctime among others: a same-size rewrite
    with its mtime put back still changes the identity, so no stale kernel."""
    from opcache.compilers import toolchain
    from opcache.storage.local import LocalStore

    monkeypatch.setattr(toolchain, "_TOO_NEW_SECONDS", -1e9)  # remember even a new file
    monkeypatch.setattr(toolchain, "_identities", {})
    store = LocalStore(tmp_path / "cache")
    tool = tmp_path / "mycc"
    tool.write_bytes(b"version 1")
    first = toolchain.file_identity(tool, store)
    assert len(os.listdir(tmp_path / "cache" / ".opcache" / "tools")) == 1
    toolchain._identities.clear()  # a new process
    assert toolchain.file_identity(tool, store) == first  # from the note
    before = tool.stat()
    tool.write_bytes(b"version 2")
    os.utime(tool, ns=(before.st_atime_ns, before.st_mtime_ns))
    toolchain._identities.clear()
    assert toolchain.file_identity(tool, store) != first


# -- cann: what opc read beyond the key --------------------------------------------

# A stand-in opc whose kernel holds what the operator's source tree holds: the
# kernel source it finds through BUILD_KERNEL_SRC, as Ascend C operators do.
_SOURCE_TREE_OPC = r"""
import os, sys
flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
with open(os.path.join(os.environ["BUILD_KERNEL_SRC"], "k.cpp"), "rb") as f:
    kernel = f.read()
with open(os.path.join(flags["output"], "k.o"), "wb") as f:
    f.write(b"KERNEL\0" + kernel)
"""


def _kernel_of(result) -> bytes:
    return result.files["k.o"].read_bytes()


@needs_strace
def test_cann_a_kernel_source_found_through_a_variable_is_never_served_stale(toolkit, tmp_path):
    """The operator's kernel source, read through BUILD_KERNEL_SRC (no request field
    names it), edited in place: a long-lived compiler object and a new one in a new
    cache both get the kernel a compile makes now, never the old one."""
    root, env = toolkit
    write_tool(root / "bin", "opc", _SOURCE_TREE_OPC)
    kernels = tmp_path / "op_kernel"
    kernels.mkdir()
    (kernels / "k.cpp").write_text("version 1\n")
    env = {**env, "BUILD_KERNEL_SRC": str(kernels)}
    time.sleep(0.02)  # (a file opc reads, written as it starts, leaves its compile unstored)
    compiler = CannCompiler(environ=env)
    with cache_at(tmp_path) as cache:
        first = cache.compile(cann_request(), compiler, tmp_path / "a")
        assert cache.compile(cann_request(), compiler, tmp_path / "b").status == "hit"
        with open(kernels / "k.cpp", "r+") as f:  # (the same size, in place)
            f.write("version 2\n")
        time.sleep(0.02)
        later = cache.compile(cann_request(), compiler, tmp_path / "c")
        again = cache.compile(cann_request(), compiler, tmp_path / "d")
    with cache_at(tmp_path) as other:
        third = other.compile(cann_request(), CannCompiler(environ=env), tmp_path / "e")
        report = other.stats()
    assert [r.status for r in (first, later, again, third)] == ["miss", "miss", "hit", "hit"]
    assert _kernel_of(first) == b"KERNEL\0version 1\n"
    assert _kernel_of(later) == _kernel_of(third) == b"KERNEL\0version 2\n"
    assert report["stale"] == 1


@needs_strace
def test_cann_a_file_an_option_names_is_never_served_stale(toolkit, tmp_path):
    """A configuration file named by an option (its path in the key, not its
    contents), edited: the next compile is a miss with the kernel of the new file."""
    _, env = toolkit
    config = tmp_path / "core.ini"
    config.write_text("cores=1\n")
    request = cann_request(options={"core_type": str(config)})
    time.sleep(0.02)
    with cache_at(tmp_path) as cache:
        first = cache.compile(request, CannCompiler(environ=env), tmp_path / "a")
        config.write_text("cores=2\n")
        time.sleep(0.02)
        later = cache.compile(request, CannCompiler(environ=env), tmp_path / "b")
    assert (first.status, later.status) == ("miss", "miss")
    assert read_dir(tmp_path / "a") != read_dir(tmp_path / "b")


@needs_strace
def test_cann_a_custom_package_file_edited_in_place_is_never_served_stale(toolkit, tmp_path):
    """A file of a custom operator package (ASCEND_CUSTOM_OPP_PATH) that opc reads,
    edited in place under a long-lived compiler object: a miss, the new kernel."""
    root, env = toolkit
    package = tmp_path / "custom"
    package.mkdir()
    (package / "k.cpp").write_text("tiling 1\n")
    write_tool(root / "bin", "opc", _SOURCE_TREE_OPC)
    env = {**env, "ASCEND_CUSTOM_OPP_PATH": str(package), "BUILD_KERNEL_SRC": str(package)}
    time.sleep(0.02)
    compiler = CannCompiler(environ=env)
    with cache_at(tmp_path) as cache:
        first = cache.compile(cann_request(), compiler, tmp_path / "a")
        with open(package / "k.cpp", "r+") as f:
            f.write("tiling 2\n")
        time.sleep(0.02)
        later = cache.compile(cann_request(), compiler, tmp_path / "b")
    assert (first.status, later.status) == ("miss", "miss")
    assert _kernel_of(later) == b"KERNEL\0tiling 2\n"


def test_cann_without_strace_compiles_and_stores_nothing(toolkit, tmp_path):
    """OPCACHE_TRACE=off (as where strace is missing): what opc reads is not known, so
    its kernel is delivered and never stored, counted uncacheable with the reason."""
    _, env = toolkit
    env = {**env, "OPCACHE_TRACE": "off"}
    with cache_at(tmp_path) as cache:
        results = [
            cache.compile(cann_request(), CannCompiler(environ=env), tmp_path / o) for o in "ab"
        ]
        report = cache.stats()
    assert [r.status for r in results] == ["miss", "miss"]
    assert read_dir(tmp_path / "a") == read_dir(tmp_path / "b") != {}
    assert len(invocations(tmp_path / "opc.log")) == 2
    assert report["stores"] == 0
    assert any("not traced" in reason for reason in report["uncacheable_reasons"])


@needs_strace
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_command_hits_into_output_folders_made_anew_and_through_links(tmp_path, monkeypatch):
    """gcc resolves the links on its source's and output's paths, and looks at every
    folder above its output: with the temporary folder and the output folder reached
    through links, and each output folder deleted after its compile, the second
    compile still hits (never unstored, never stale at every look)."""
    (tmp_path / "realtmp").mkdir()
    (tmp_path / "tmp").symlink_to(tmp_path / "realtmp")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "realout").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "realout")
    template = "gcc -c {source} -o {workdir}/{kernel_name}.o"
    compiler = CommandCompiler(template, environ={"PATH": "/usr/bin:/bin"})
    request = cc_request(sources={"k.c": b"int twice(int x) { return 2 * x; }\n"})
    statuses = []
    with cache_at(tmp_path) as cache:
        for n in range(3):
            out = tmp_path / "out" / f"build{n}"
            statuses.append(cache.compile(request, compiler, out).status)
            shutil.rmtree(out)
        report = cache.stats()
    assert statuses == ["miss", "hit", "hit"]
    assert report["stale"] == 0


def test_command_key_holds_the_linker_and_user_site_variables_not_the_messages():
    def fingerprint(**env: str) -> str:
        return CommandCompiler(
            "cp {source} {workdir}", environ={"PATH": "/usr/bin:/bin", **env}
        ).fingerprint()

    plain = fingerprint()
    for name in ("LIBRARY_PATH", "LD_RUN_PATH", "PYTHONUSERBASE", "CPATH", "LD_LIBRARY_PATH"):
        assert fingerprint(**{name: "/opt/x"}) != plain, name
    for name in ("COLUMNS", "GCC_COLORS", "LC_MESSAGES"):
        assert fingerprint(**{name: "120"}) == plain, name
