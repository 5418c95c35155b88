"""``opcache wrap -- op_compiler ...``: torchair's static-kernel builds through the cache.

A stand-in ``op_compiler`` (``fake_op_compiler.py``) logs every run, so a hit
is proven by the log not growing; the folders are laid out as torchair lays
them out (``aclnn_static_shape_kernel_outputs/ts<stamp>_pid<pid>_outputs/``
with the op-info jsons in ``<pid>_opcompile/``), and every wrap is a real
``opcache`` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_op_compiler import write_op_compiler
from fake_opc import base_env
from helpers_wrap import opcache, wrap_imports

SOC = "Ascend910B1"
MATMUL = {
    "op_type": "MatMulV2",
    "attrs": [{"dtype": "bool", "index": 0, "name": "transpose_x1", "value": False}],
    "deterministic": "false",
    "impl_mode": "",
    "inputs": [
        {
            "dtype": "float",
            "format": "ND",
            "index": 0,
            "name": "x1",
            "origin_format": "ND",
            "origin_shape": [1, 2048],
            "param_type": "required",
            "shape": [1, 2048],
            "value_depend": False,
        },
    ],
    "outputs": [{"dtype": "float", "format": "ND", "index": 0, "name": "y", "shape": [1, 16]}],
    "tune_mode": "all",
}


class Job:
    """One torchair job's folders: its op-info dir and its output root."""

    def __init__(self, build: Path, stamp: str, pid: int, ops: dict[str, dict]) -> None:
        self.root = build / "aclnn_static_shape_kernel_outputs" / f"ts{stamp}_pid{pid}_outputs"
        self.ops = self.root / f"{pid}_opcompile"
        self.ops.mkdir(parents=True)
        for name, data in ops.items():
            (self.ops / name).write_text(json.dumps(data, indent=2))

    def argv(self, *extra: str, soc: str = SOC) -> list[str]:
        return ["op_compiler", "-p", str(self.ops), "-v", soc, "-j", "2", "-o", str(self.root)]

    def runs(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.root.glob("*.run"))}


@pytest.fixture
def toolkit(tmp_path: Path) -> dict[str, str]:
    """An environment with a fake toolkit (version file, op_compiler first on PATH)."""
    home = tmp_path / "Ascend" / "latest"
    write_op_compiler(home / "bin")
    (home / "version.info").write_text("Version=8.5.0\n")
    env = base_env(tmp_path, home / "bin")
    env["ASCEND_HOME_PATH"] = str(home)
    env["FAKE_OP_COMPILER_LOG"] = str(tmp_path / "op_compiler.log")
    return env


def compiles(env: dict[str, str]) -> int:
    log = Path(env["FAKE_OP_COMPILER_LOG"])
    return len(log.read_text().splitlines()) if log.exists() else 0


def job(tmp_path: Path, n: int, ops: dict[str, dict] | None = None) -> Job:
    ops = {"MatMulV2_float_ND_1_2048_0.json": MATMUL} if ops is None else ops
    return Job(tmp_path / "build", f"2026010112000{n}000000", 4000 + n, ops)


def wrap(env: dict[str, str], argv: list[str], cwd: Path, status: int = 0):
    return opcache("wrap", "--", *argv, env=env, cwd=cwd, status=status)


def test_second_job_with_the_same_shapes_is_a_hit_that_does_not_run_op_compiler(toolkit, tmp_path):
    first, second = job(tmp_path, 1), job(tmp_path, 2)
    done = wrap(toolkit, first.argv(), tmp_path)
    assert compiles(toolkit) == 1
    built = first.runs()
    [name] = built
    assert name.startswith("static_kernel_") and name.endswith(".run")
    assert b"compiled 1 operators" in done.stdout and b"is a stand-in" in done.stderr
    assert not [p for p in first.root.iterdir() if p.name.startswith(".opcache")]

    again = wrap(toolkit, second.argv(), tmp_path)
    assert compiles(toolkit) == 1  # the hit ran nothing
    # Restored under the name it was built with (torchair finds the package's
    # uninstall script by that name), byte for byte, and runnable as torchair runs it.
    assert second.runs() == built
    assert (again.stdout, again.stderr) == (done.stdout, done.stderr)
    run = subprocess.run([str(second.root / name)], capture_output=True, text=True, check=True)
    assert run.stdout.startswith(f"installed {name[:-4]} ")
    chip = json.loads(opcache("stats", "--json", env=toolkit, cwd=tmp_path).stdout)["chips"][SOC]
    assert (chip["misses"], chip["hits"], chip["entries"]) == (1, 1, 1)


def test_a_changed_or_added_op_info_file_misses(toolkit, tmp_path):
    wrap(toolkit, job(tmp_path, 1).argv(), tmp_path)
    changed = dict(MATMUL, inputs=[dict(MATMUL["inputs"][0], shape=[2, 2048])])
    wrap(toolkit, job(tmp_path, 2, {"MatMulV2_float_ND_1_2048_0.json": changed}).argv(), tmp_path)
    assert compiles(toolkit) == 2
    more = {"MatMulV2_float_ND_1_2048_0.json": MATMUL, "Add_float_ND_8_0.json": {"op_type": "Add"}}
    wrap(toolkit, job(tmp_path, 3, more).argv(), tmp_path)
    assert compiles(toolkit) == 3
    renamed = {"MatMulV2_float_ND_1_2048_1.json": MATMUL}
    wrap(toolkit, job(tmp_path, 4, renamed).argv(), tmp_path)
    assert compiles(toolkit) == 4


def test_a_changed_soc_misses(toolkit, tmp_path):
    wrap(toolkit, job(tmp_path, 1).argv(), tmp_path)
    other = job(tmp_path, 2)
    wrap(toolkit, other.argv(soc="Ascend910B2"), tmp_path)
    assert compiles(toolkit) == 2
    assert (
        b"installed"
        in subprocess.run(
            [str(next(other.root.glob("*.run")))], capture_output=True, check=True
        ).stdout
    )


def test_jobs_log_level_and_output_folder_are_not_in_the_key_but_flags_that_change_it_are(
    toolkit, tmp_path
):
    wrap(toolkit, job(tmp_path, 1).argv(), tmp_path)
    quiet = job(tmp_path, 2).argv()
    quiet[quiet.index("-j") + 1] = "16"
    wrap(toolkit, [*quiet, "-l", "error"], tmp_path)
    long = job(tmp_path, 3)
    spelled = ["op_compiler", f"--op_params_dir={long.ops}", "--soc_version", SOC,
               "--job=4", "--output", str(long.root)]  # fmt: skip
    wrap(toolkit, spelled, tmp_path)
    assert compiles(toolkit) == 1 and len(long.runs()) == 1
    for n, extra in enumerate(
        (["-f", "true"], ["--enable_super_kernel"], ["--super_kernel_options", "a=1"]), 4
    ):
        wrap(toolkit, [*job(tmp_path, n).argv(), *extra], tmp_path)
        assert compiles(toolkit) == n - 2, extra
    wrap(toolkit, [*job(tmp_path, 9).argv(), "--follow_op_params_jit=true"], tmp_path)
    assert compiles(toolkit) == 4  # -f true spelled long: the same build


def test_a_toolkit_upgrade_misses(toolkit, tmp_path):
    wrap(toolkit, job(tmp_path, 1).argv(), tmp_path)
    (Path(toolkit["ASCEND_HOME_PATH"]) / "version.info").write_text("Version=9.0.0\n")
    wrap(toolkit, job(tmp_path, 2).argv(), tmp_path)
    assert compiles(toolkit) == 2
    tool = Path(toolkit["ASCEND_HOME_PATH"]) / "bin" / "op_compiler"
    tool.write_text(tool.read_text() + "# a patched op_compiler\n")
    wrap(toolkit, job(tmp_path, 3).argv(), tmp_path)
    assert compiles(toolkit) == 3


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["-k", "te_matmul_1"], "op_compiler: unknown flag or argument -k"),
        (["--count"], "op_compiler: unknown flag or argument --count"),
        (["extra.json"], "op_compiler: unknown flag or argument extra.json"),
        (["-v", "Ascend310P3"], "op_compiler: -v is given twice"),
    ],
)
def test_a_line_it_does_not_understand_runs_uncached_with_its_reason(
    toolkit, tmp_path, extra, reason
):
    done = wrap(toolkit, [*job(tmp_path, 1).argv(), *extra], tmp_path, status=2)
    assert b"op_compiler: error:" in done.stderr  # the stand-in ran and said why
    assert compiles(toolkit) == 1
    report = json.loads(opcache("stats", "--json", env=toolkit, cwd=tmp_path).stdout)
    assert report["uncacheable_reasons"] == {reason: 1}


def test_a_failed_build_keeps_its_status_and_output_and_is_not_cached(toolkit, tmp_path):
    failing = {**toolkit, "FAKE_OP_COMPILER_FAIL": "MatMulV2: tiling failed"}
    first = job(tmp_path, 1)
    done = wrap(failing, first.argv(), tmp_path, status=2)
    assert b"MatMulV2: tiling failed" in done.stderr
    # What it wrote before failing stays where it writes it (it was deleted with the
    # build folder): its error log tells why.
    assert (first.root / "op_compiler_error.log").read_text() == "MatMulV2: tiling failed\n"
    assert not list(first.root.glob(".opcache*"))
    wrap(toolkit, job(tmp_path, 2).argv(), tmp_path)
    assert compiles(toolkit) == 2


def test_a_failed_build_leaves_the_bits_of_its_folder_and_of_a_linked_file_alone(toolkit, tmp_path):
    """What a failed run wrote is left where it writes it as the compiler leaves it: a
    team's output folder (2775) keeps its bits, and a file of 0600 that
    the error log's name links to stays 0600 (the log is written through the link,
    as the compiler writes it)."""
    failing = {**toolkit, "FAKE_OP_COMPILER_FAIL": "MatMulV2: tiling failed"}
    first = job(tmp_path, 1)
    first.root.chmod(0o2775)
    secret = tmp_path / "secret"
    secret.write_text("token\n")
    secret.chmod(0o600)
    (first.root / "op_compiler_error.log").symlink_to(secret)
    wrap(failing, first.argv(), tmp_path, status=2)
    assert oct(first.root.stat().st_mode & 0o7777) == oct(0o2775)
    assert oct(secret.stat().st_mode & 0o7777) == oct(0o600)
    assert secret.read_text() == "MatMulV2: tiling failed\n"


def test_a_static_kernel_hit_imports_nothing_it_does_not_need(toolkit, tmp_path):
    wrap(toolkit, job(tmp_path, 1).argv(), tmp_path)
    argv = job(tmp_path, 2).argv()
    status, modules, stderr = wrap_imports(argv, toolkit, tmp_path)
    assert status == "0" and compiles(toolkit) == 1, stderr
    heavy = {
        "argparse", "configparser", "dataclasses", "filelock", "inspect", "logging",
        "multiprocessing", "shutil", "subprocess", "tempfile", "typing",
    }  # fmt: skip
    assert heavy.isdisjoint(modules), heavy.intersection(modules)


def test_masquerade_through_a_link_named_op_compiler(toolkit, tmp_path):
    script = Path(sys.executable).parent / "opcache"
    if not script.exists():
        pytest.skip("the opcache console script is not installed next to python")
    links = tmp_path / "links"
    links.mkdir()
    (links / "op_compiler").symlink_to(script)
    env = {**toolkit, "PATH": f"{links}{os.pathsep}{toolkit['PATH']}"}
    for n in (1, 2):
        done = subprocess.run(job(tmp_path, n).argv(), env=env, capture_output=True)
        assert done.returncode == 0, done.stderr.decode()
    assert compiles(toolkit) == 1


def _uncacheable(env: dict[str, str], tmp_path: Path) -> dict[str, int]:
    chips = json.loads(opcache("stats", "--json", env=env, cwd=tmp_path).stdout)["chips"]
    return {**chips.get(SOC, {}), **chips.get("host", {})}.get("uncacheable_reasons", {})


def test_a_changed_custom_operator_package_misses(toolkit, tmp_path):
    """op_compiler builds custom operators from their packages (tiling libraries,
    implementations): a changed package, or another one named, was a hit of the old."""
    package = tmp_path / "custom" / "vendors" / "mine"
    (package / "op_impl").mkdir(parents=True)
    (package / "op_impl" / "liboptiling.so").write_bytes(b"tiling v1")
    env = {**toolkit, "ASCEND_CUSTOM_OPP_PATH": str(package)}
    wrap(env, job(tmp_path, 1).argv(), tmp_path)
    (package / "op_impl" / "liboptiling.so").write_bytes(b"tiling v2")
    second = job(tmp_path, 2)
    wrap(env, second.argv(), tmp_path)
    assert compiles(toolkit) == 2
    plain = job(tmp_path, 3)
    subprocess.run(plain.argv(), env=env, check=True, capture_output=True)
    installed = [
        subprocess.run([str(p)], capture_output=True, text=True).stdout.split()[-1]
        for p in (*second.root.glob("*.run"), *plain.root.glob("*.run"))
    ]
    assert installed[0] == installed[1]  # what op_compiler itself makes now


def test_an_op_info_file_changed_while_it_runs_is_not_stored(toolkit, tmp_path):
    first = job(tmp_path, 1)
    [info] = first.ops.iterdir()
    wrap({**toolkit, "FAKE_OP_COMPILER_EDIT": str(info)}, first.argv(), tmp_path)
    assert first.runs()  # (delivered)
    wrap(toolkit, job(tmp_path, 2).argv(), tmp_path)
    assert compiles(toolkit) == 2  # nothing was stored under the old contents' key
    assert any("changed while it ran" in r for r in _uncacheable(toolkit, tmp_path))


@pytest.mark.parametrize("which", ["op-info", "custom package", "extra file"])
def test_a_file_rewritten_with_the_same_bytes_while_it_runs_is_not_stored(toolkit, tmp_path, which):
    """A generator's FORCE rule truncates a file of the key and writes its bytes again
    while op_compiler runs: it read the file empty, and the package was stored under
    the full file's key (settled() compared the contents alone) and served."""
    package = tmp_path / "custom" / "mine"
    (package / "op_impl").mkdir(parents=True)
    (package / "op_impl" / "my_add.py").write_text("def my_add(): pass\n")
    extra = tmp_path / "tiling.cfg"
    extra.write_text("tile=8\n")
    env = {**toolkit, "ASCEND_CUSTOM_OPP_PATH": str(package), "OPCACHE_EXTRA_FILES": str(extra)}
    first = job(tmp_path, 1)
    [info] = first.ops.iterdir()
    rewritten = {"op-info": info, "custom package": package / "op_impl" / "my_add.py"}
    rewritten["extra file"] = extra
    before = rewritten[which].read_bytes()
    wrap({**env, "FAKE_OP_COMPILER_REWRITE": str(rewritten[which])}, first.argv(), tmp_path)
    assert rewritten[which].read_bytes() == before and first.runs()  # (delivered)
    wrap(env, job(tmp_path, 2).argv(), tmp_path)
    assert compiles(toolkit) == 2  # nothing was stored of the compile of the empty file
    assert any("changed while it ran" in r for r in _uncacheable(toolkit, tmp_path))


def test_a_link_to_a_folder_among_the_op_info_runs_uncached(toolkit, tmp_path):
    """A folder op_compiler may read through a link was left out of the key."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "Add_float_ND_8_0.json").write_text(json.dumps({"op_type": "Add"}))
    for n in (1, 2):
        one = job(tmp_path, n)
        (one.ops / "gathered").symlink_to(shared)
        wrap(toolkit, one.argv(), tmp_path)
        (shared / "Add_float_ND_8_0.json").write_text(json.dumps({"op_type": "Add", "n": n}))
    assert compiles(toolkit) == 2
    assert any("not a file" in r for r in _uncacheable(toolkit, tmp_path))


def test_a_folder_it_writes_into_the_output_is_delivered_as_op_compiler_writes_it(
    toolkit, tmp_path
):
    """A folder the tool made in -o was dropped (a hit or a miss gave the package
    alone), and the package stored as if whole."""
    env = {**toolkit, "FAKE_OP_COMPILER_SUBDIR": "1"}
    for n in (1, 2):
        one = job(tmp_path, n)
        wrap(env, one.argv(), tmp_path)
        assert (one.root / "kernel_meta" / "k.o").read_text() == "kernel\n"
        assert len(one.runs()) == 1 and not list(one.root.glob(".opcache*"))
    assert any("not a file" in r for r in _uncacheable(toolkit, tmp_path))


def test_a_custom_package_changed_while_it_runs_is_not_stored(toolkit, tmp_path):
    """An install into the package while op_compiler ran: the package it built was
    stored under the key of the files before (the key's part not checked again)."""
    package = tmp_path / "custom" / "mine"
    (package / "op_impl").mkdir(parents=True)
    (package / "op_impl" / "my_add.pyc").write_bytes(b"impl v1")  # (shipped without source)
    env = {**toolkit, "ASCEND_CUSTOM_OPP_PATH": str(package)}
    edit = {**env, "FAKE_OP_COMPILER_EDIT": str(package / "op_impl" / "my_add.pyc")}
    wrap(edit, job(tmp_path, 1).argv(), tmp_path)
    assert any("custom operator package changed" in r for r in _uncacheable(env, tmp_path))
    wrap(env, job(tmp_path, 2).argv(), tmp_path)
    (package / "op_impl" / "my_add.pyc").write_bytes(b"impl v2")  # (a .pyc is a module too)
    wrap(env, job(tmp_path, 3).argv(), tmp_path)
    assert compiles(toolkit) == 3


def test_a_custom_package_digest_reads_no_endless_file_and_has_bounds(tmp_path, monkeypatch):
    from opcache.compilers import cann

    package = tmp_path / "mine"
    package.mkdir()
    (package / "pagemap").symlink_to("/proc/self/pagemap")  # (regular, and never ends)
    (package / "kernel.py").write_text("def k(): pass\n")
    env = {"ASCEND_CUSTOM_OPP_PATH": str(package)}
    assert cann.custom_opp_digest(env) is not None  # (returned: the file was not read through)
    monkeypatch.setattr(cann, "MAX_PACKAGE_FILES", 1)
    with pytest.raises(OSError, match="over 1 files"):
        cann.custom_opp_digest(env)


def test_the_vendors_folder_is_named_as_given_and_read_once(tmp_path):
    """Named twice (the toolkit's home and ASCEND_OPP_PATH, through a 'latest' link),
    the folder is read once for a digest, but each name is kept: opc's traced reads
    are matched by their path."""
    from opcache.compilers import cann

    (tmp_path / "8.0" / "opp" / "vendors" / "mine").mkdir(parents=True)
    (tmp_path / "8.0" / "opp" / "vendors" / "mine" / "add.py").write_text("x = 1\n")
    (tmp_path / "latest").symlink_to(tmp_path / "8.0")
    env = {"ASCEND_OPP_PATH": str(tmp_path / "latest" / "opp")}
    named = cann.custom_opp_folders(env, tmp_path / "8.0")
    assert named == [str(tmp_path / "8.0" / "opp" / "vendors"), f"{tmp_path}/latest/opp/vendors"]
    once = cann.custom_opp_digest({"ASCEND_OPP_PATH": str(tmp_path / "8.0" / "opp")})
    assert cann.custom_opp_digest(env, tmp_path / "8.0") == once
