"""``opcache compile --op SPEC.json ... --output DIR``: JSON specs compiled with real back-ends."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_opc import OP_SOURCE, SOC, base_env, invocations, make_toolkit
from helpers_marks import needs_strace

from opcache.cli import main

KERNEL_C = """\
#include <stddef.h>
void kernel(const float *a, const float *b, float *o) {
    for (size_t i = 0; i < IN0_SIZE; i++) o[i] = a[i] * ATTR_ALPHA + b[i];
}
"""


def spec(op_type: str, shape: list[int], op_name: str | None = None, **extra) -> dict:
    tensor = {"shape": shape, "dtype": "float32", "format": "ND"}
    data = {
        "op_type": op_type,
        "soc_version": SOC,
        "inputs": [tensor, tensor],
        "outputs": [tensor],
        "attrs": {"alpha": 2},
        "sources": {"add.c": "kernels/add.c"},
        **extra,
    }
    if op_name:
        data["op_name"] = op_name
    return data


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """specs/one.json (one object) and specs/many.json (a list of two), sources in specs/kernels."""
    specs = tmp_path / "specs"
    (specs / "kernels").mkdir(parents=True)
    (specs / "kernels" / "add.c").write_text(KERNEL_C)
    (specs / "one.json").write_text(json.dumps(spec("AddScaled", [4, 64], "add_small")))
    many = [spec("AddScaled", [8, 64], "add_big"), spec("AddScaled", [2, 32])]
    (specs / "many.json").write_text(json.dumps(many))
    return specs


def run(*args: str, env: dict[str, str], cwd: Path, status: int = 0) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "opcache", *args], env=env, cwd=cwd, capture_output=True, text=True
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == status, done.stdout + done.stderr
    return done.stdout


def compile_cmd(project: Path, *extra: str) -> list[str]:
    # Spec paths given from another folder: sources resolve against each spec's folder.
    return [
        "compile",
        "--op",
        str(project / "one.json"),
        str(project / "many.json"),
        "--output",
        "build",
        *extra,
    ]


def tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_compile_specs_then_all_hits(project, tmp_path):
    env = base_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    first = run(*compile_cmd(project, "--compiler", "cc"), env=env, cwd=work)
    lines = first.splitlines()
    assert len(lines) == 4
    # One line per operator as it finishes (in any order), then the summary.
    assert [line.split()[0] for line in lines[:3]] == ["miss", "miss", "miss"]
    named = sorted(line.split()[-1] for line in lines[:3])
    assert named == ["AddScaled", "add_big", "add_small"]  # no op_name: the op_type names it
    assert lines[3].startswith("3 operators: 0 hits, 3 misses, 0 bypasses, 0 errors")

    build = work / "build"
    folders = sorted(p.name for p in build.iterdir())
    assert "add_small" in folders and "add_big" in folders
    (unnamed,) = [f for f in folders if f.startswith("AddScaled_")]  # the kernel's name
    for folder in folders:
        files = {p.name: p.read_bytes() for p in (build / folder).iterdir()}
        (obj,) = [n for n in files if n.endswith(".o")]
        described = json.loads(files[obj[:-2] + ".json"])
        assert described["sha256"] == hashlib.sha256(files[obj]).hexdigest()
    assert unnamed == next(iter((build / unnamed).glob("*.o"))).stem
    before = tree(build)

    import shutil

    shutil.rmtree(build)
    second = run(*compile_cmd(project, "--compiler", "cc"), env=env, cwd=work)
    assert [line.split()[0] for line in second.splitlines()[:3]] == ["hit", "hit", "hit"]
    assert "3 operators: 3 hits, 0 misses" in second
    assert tree(build) == before


def test_compile_json_output(project, tmp_path):
    env = base_env(tmp_path)
    out = run(*compile_cmd(project, "--compiler", "cc", "--json"), env=env, cwd=tmp_path)
    data = json.loads(out)
    assert data["summary"]["operators"] == 3 and data["summary"]["misses"] == 3
    assert data["summary"]["errors"] == 0
    ops = data["operators"]
    assert [o["op"] for o in ops] == ["add_small", "add_big", "AddScaled"]
    assert ops[0]["spec"] == str(project / "one.json")
    assert ops[1]["spec"] == f"{project / 'many.json'}[0]"
    assert all(o["status"] == "miss" and o["error"] is None for o in ops)
    assert tmp_path / ops[0]["output"] == tmp_path / "build" / "add_small"
    again = json.loads(
        run(*compile_cmd(project, "--compiler", "cc", "--json"), env=env, cwd=tmp_path)
    )
    assert again["summary"]["hits"] == 3
    assert all(o["saved_seconds"] > 0 for o in again["operators"])


@needs_strace
def test_compile_with_jobs_runs_that_many_compiles_at_once(tmp_path):
    """--jobs 2 with the cann back-end (auto, a toolkit set): two opc runs at a time."""
    root = make_toolkit(tmp_path / "toolkit")
    env = {**base_env(tmp_path), "ASCEND_HOME_PATH": str(root), "FAKE_OPC_SLEEP": "0.3"}
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "add.py").write_text(OP_SOURCE)
    ops = []
    for i in range(4):
        tensor = {"shape": [16, 64 * (i + 1)], "dtype": "float16"}
        ops.append(
            {
                "op_type": "Add",
                "soc_version": SOC,
                "op_name": f"add_{i}",
                "inputs": [tensor, tensor],
                "outputs": [tensor],
                "sources": {"add.py": "add.py"},
            }
        )
    (specs / "ops.json").write_text(json.dumps(ops))
    cmd = ["compile", "--op", "specs/ops.json", "--output", "build", "--jobs", "2", "--json"]
    data = json.loads(run(*cmd, env=env, cwd=tmp_path))
    assert [o["status"] for o in data["operators"]] == ["miss"] * 4
    assert [o["op"] for o in data["operators"]] == [f"add_{i}" for i in range(4)]
    runs = invocations(tmp_path / "opc.log")
    assert len(runs) == 4
    slept = [line.split() for line in (tmp_path / "opc.log.concurrent").read_text().splitlines()]
    assert most_at_once([(float(a), float(b)) for a, b in slept]) == 2  # never more
    for i in range(4):
        assert len(list((tmp_path / "build" / f"add_{i}").glob("Add_*.o"))) == 1
    # The workers' stats reached the disk.
    report = json.loads(run("stats", "--json", env=env, cwd=tmp_path))
    assert report["chips"][SOC]["misses"] == 4
    again = json.loads(run(*cmd, env={**env, "FAKE_OPC_SLEEP": ""}, cwd=tmp_path))
    assert again["summary"]["hits"] == 4
    assert len(invocations(tmp_path / "opc.log")) == 4


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most of the (start, end) spans that overlap at one moment."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


@needs_strace
def test_compile_processes_on_one_spec_list_share_the_work(tmp_path):
    """Three `opcache compile` processes (ranks) on one list: each operator compiled once."""
    root = make_toolkit(tmp_path / "toolkit")
    env = {**base_env(tmp_path), "ASCEND_HOME_PATH": str(root), "FAKE_OPC_SLEEP": "0.2"}
    (tmp_path / "add.py").write_text(OP_SOURCE)
    tensor = {"dtype": "float16"}
    ops = [
        {
            "op_type": "Add",
            "soc_version": SOC,
            "op_name": f"add_{i}",
            "inputs": [{**tensor, "shape": [16, 64 * (i + 1)]}] * 2,
            "outputs": [{**tensor, "shape": [16, 64 * (i + 1)]}],
            "sources": {"add.py": "add.py"},
        }
        for i in range(16)
    ]
    (tmp_path / "ops.json").write_text(json.dumps(ops))

    def rank_flags(n: int) -> list[str]:
        return ["--jobs", "1", "--output", f"rank{n}", "--json"]

    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "opcache", "compile", "--op", "ops.json", *rank_flags(n)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(3)
    ]
    reports = [json.loads(rank.communicate(timeout=120)[0]) for rank in ranks]
    runs = invocations(tmp_path / "opc.log")
    assert len(runs) == 16  # once each, among the three
    # (whose compile a run was: its --output is in the rank's out_dir, as opc may
    # run under strace, its parent)
    outputs = [next(a for a in r["args"] if a.startswith("--output=")) for r in runs]
    by_rank = {n: sum(f"/rank{n}/" in out for out in outputs) for n in range(3)}
    assert all(by_rank.values()), by_rank  # every rank compiled some
    for n, report in enumerate(reports):
        assert report["summary"]["errors"] == 0
        assert report["summary"]["hits"] + report["summary"]["misses"] == 16
        for i in range(16):
            assert len(list((tmp_path / f"rank{n}" / f"add_{i}").glob("Add_*.o"))) == 1


def test_bad_specs_are_reported_with_file_and_field_and_the_rest_compiles(project, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "kernels").symlink_to(project / "kernels")
    no_soc = spec("AddScaled", [4, 64], "no_soc")
    del no_soc["soc_version"]
    (bad / "mixed.json").write_text(
        json.dumps(
            [
                no_soc,
                spec("AddScaled", [4, 64], "bad_attrs", attrs=[1, 2]),
                {**spec("AddScaled", [4, 64], "bad_type"), "op_type": 7},
                spec("AddScaled", [4, 64], "no_source", sources={"add.c": "missing.c"}),
                {**spec("AddScaled", [4, 64], "bad_chip"), "soc_version": "../etc"},
                spec("AddScaled", [4, 64], "bad_field", colour="blue"),
                spec(
                    "AddScaled", [16, 64], "good", sources={"add.c": str(project / "kernels/add.c")}
                ),
            ]
        )
    )
    (bad / "broken.json").write_text("{not json")
    env = base_env(tmp_path)
    cmd = ["compile", "--op", "bad/mixed.json", "bad/broken.json", "missing.json"]
    out = run(
        *cmd,
        str(project / "one.json"),
        "--output",
        "build",
        "--compiler",
        "cc",
        env=env,
        cwd=tmp_path,
        status=1,
    )
    errors = [line for line in out.splitlines() if line.startswith("error")]
    expected = [
        ("bad/mixed.json[0]", "field 'soc_version': missing"),
        ("bad/mixed.json[1]", "field 'attrs': expected dict, got list"),
        ("bad/mixed.json[2]", "field 'op_type': expected str, got int"),
        ("bad/mixed.json[3]", "field 'sources.add.c': cannot read"),
        ("bad/mixed.json[4]", "soc_version"),
        ("bad/mixed.json[5]", "field 'colour'"),
        ("bad/broken.json", "not JSON"),
        ("missing.json", "cannot read"),
    ]
    assert len(errors) == len(expected), out
    for (where, what), line in zip(expected, errors, strict=True):
        assert where in line and what in line, line
    assert "missing.c" in errors[3]
    oks = [line for line in out.splitlines() if line.startswith("miss")]
    assert sorted(line.split()[-1] for line in oks) == ["add_small", "good"]  # as they finish
    assert "8 errors" in out.splitlines()[-1]
    assert (tmp_path / "build" / "good").is_dir() and (tmp_path / "build" / "add_small").is_dir()


def test_json_lists_the_operators_in_the_specs_order_bad_ones_included(project, tmp_path):
    # The bad spec is reported first as it is known first; --json still lists
    # each operator where its spec stands (a script pairs them up by position).
    ops = [
        spec("AddScaled", [4, 64], "first", sources={"add.c": str(project / "kernels/add.c")}),
        spec("AddScaled", [4, 64], "no_source", sources={"add.c": "missing.c"}),
        spec("AddScaled", [8, 64], "last", sources={"add.c": str(project / "kernels/add.c")}),
    ]
    (tmp_path / "ops.json").write_text(json.dumps(ops))
    cmd = ["compile", "--op", "ops.json", "--output", "build", "--compiler", "cc", "--json"]
    data = json.loads(run(*cmd, env=base_env(tmp_path), cwd=tmp_path, status=1))
    listed = [(op["spec"], op["status"]) for op in data["operators"]]
    assert listed == [("ops.json[0]", "miss"), ("ops.json[1]", "error"), ("ops.json[2]", "miss")]


def test_a_failing_compile_is_an_error_and_is_not_cached(project, tmp_path):
    (project / "kernels" / "broken.c").write_text("void kernel(void) { undeclared_thing_42; }\n")
    (project / "broken.json").write_text(
        json.dumps(spec("Broken", [4], "broken", sources={"k.c": "kernels/broken.c"}))
    )
    env = base_env(tmp_path)
    cmd = [
        "compile",
        "--op",
        str(project / "broken.json"),
        str(project / "one.json"),
        "--output",
        "build",
        "--compiler",
        "cc",
    ]
    for status_of_good in ("miss", "hit"):
        out = run(*cmd, env=env, cwd=tmp_path, status=1)
        lines = [line for line in out.splitlines() if not line.startswith(" ")]
        assert len(lines) == 3  # one per operator and the summary; details indented
        (error,) = [line for line in lines[:2] if line.startswith("error")]
        assert "broken.json" in error
        assert "-c k.c" in error  # the command line
        assert "undeclared_thing_42" in out  # the compiler's stderr
        (good,) = [line for line in lines[:2] if not line.startswith("error")]
        assert good.split()[0] == status_of_good
        assert "1 error;" in lines[2]
        # The failed operator's folder was made by this compile: it is gone again.
        assert sorted(os.listdir(tmp_path / "build")) == ["add_small"]
    report = json.loads(run("stats", "--json", env=env, cwd=tmp_path))
    assert report["entries"] == 1


def test_compile_defaults_to_enable_and_follows_the_cache_flags(project, tmp_path):
    env = base_env(tmp_path)
    flags = ["--compiler", "cc", "--json"]
    disabled = [*flags, "--op_compiler_cache_mode=disable"]
    for _ in range(2):
        data = json.loads(run(*compile_cmd(project, *disabled), env=env, cwd=tmp_path))
        assert {o["status"] for o in data["operators"]} == {"disabled"}
    bypass = [*flags, "--op_debug_level=2"]
    data = json.loads(run(*compile_cmd(project, *bypass), env=env, cwd=tmp_path))
    assert {o["status"] for o in data["operators"]} == {"bypass"}
    assert data["summary"]["bypasses"] == 3
    own = tmp_path / "own"
    for expected in ("miss", "hit"):
        data = json.loads(
            run(
                *compile_cmd(project, *flags, f"--op_compiler_cache_dir={own}"),
                env=env,
                cwd=tmp_path,
            )
        )
        assert {o["status"] for o in data["operators"]} == {expected}
    assert (own / "kernel_cache" / SOC).is_dir()


@needs_strace
def test_compile_with_a_command_template(project, tmp_path):
    env = base_env(tmp_path)
    template = "cp {source} {workdir}/{kernel_name}.txt"
    cmd = compile_cmd(project, "--compiler", "command", "--template", template, "--json")
    first = json.loads(run(*cmd, env=env, cwd=tmp_path))
    second = json.loads(run(*cmd, env=env, cwd=tmp_path))
    assert first["summary"]["misses"] == 3 and second["summary"]["hits"] == 3
    (copied,) = (tmp_path / "build" / "add_small").glob("AddScaled_*.txt")
    assert copied.read_text() == KERNEL_C


def test_unknown_compiler_is_one_error_line(project, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ASCEND_CACHE_PATH", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(compile_cmd(project, "--compiler", "nosuch")) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("opcache: error: ") and "nosuch" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "build").exists()


def test_compile_in_process_with_auto_and_no_toolkit(project, tmp_path, monkeypatch, capsys):
    for name in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ASCEND_CACHE_PATH", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(compile_cmd(project)) == 0  # auto: cc here
    assert main(compile_cmd(project)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3].startswith("3 operators: 0 hits, 3 misses")
    assert out[7].startswith("3 operators: 3 hits, 0 misses")
    assert "time saved" in out[7]
    assert os.listdir(tmp_path / "build" / "add_small")


def test_cann_without_a_toolkit_names_the_variables(project, tmp_path, monkeypatch, capsys):
    for name in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(compile_cmd(project, "--compiler", "cann")) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "ASCEND_HOME_PATH" in err and "ASCEND_OPP_PATH" in err and "PATH" in err


def test_an_op_name_never_leaves_the_output_folder(project, tmp_path):
    names = [
        "model/layer_1/MatMul",  # a TensorFlow node name: flattened
        "../../escape",
        str(tmp_path / "absolute"),
        "..",
        ".",
        "model/./x",
        "model/../../up",
    ]
    sources = {"add.c": str(project / "kernels/add.c")}
    specs = [spec("AddScaled", [4, 64 + i], name, sources=sources) for i, name in enumerate(names)]
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "names.json").write_text(json.dumps(specs))
    before = sorted(p for p in tmp_path.rglob("*") if "build" not in p.parts)
    env = base_env(tmp_path)
    cmd = ["compile", "--op", "names.json", "--output", "build", "--compiler", "cc"]
    out = run(*cmd, env=env, cwd=tmp_path / "work", status=1)
    lines = out.splitlines()  # bad specs are reported before anything compiles
    for index, line in enumerate(lines[:6], start=1):
        assert line.startswith(f"error    names.json[{index}]: field 'op_name': "), line
        assert repr(names[index]) in line
    assert lines[6].split()[0] == "miss" and lines[6].split()[-1] == "model/layer_1/MatMul"
    assert lines[-1].startswith("7 operators: 0 hits, 1 miss, 0 bypasses, 6 errors")
    assert os.listdir(tmp_path / "work" / "build") == ["model_layer_1_MatMul"]
    assert os.listdir(tmp_path / "work" / "build" / "model_layer_1_MatMul")
    after = sorted(p for p in tmp_path.rglob("*") if "build" not in p.parts)
    assert [p for p in after if p not in before and not str(p).startswith(env["HOME"] + "/")] == []
    assert not (tmp_path / "absolute").exists()


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--jobs", "0"], "--jobs: '0' is not a whole number of at least 1"),
        (["--jobs", "-2"], "--jobs: '-2' is not a whole number of at least 1"),
        (["--compiler", "command"], "--compiler command needs --template"),
        (["--compiler", "cc", "--template", "x {source}"], "--template is for --compiler command"),
    ],
)
def test_compile_flag_mistakes_are_one_line(project, tmp_path, monkeypatch, capsys, extra, said):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(compile_cmd(project, *extra)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("opcache: error: ") and said in err and len(err.splitlines()) == 1
    assert not (tmp_path / "build").exists()


def test_every_compile_flag_has_help(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    text = capsys.readouterr().out
    assert "--op SPEC.json [SPEC.json ...]\n" in text
    listed = text[text.index("--op SPEC.json") :].split("\n")[1]
    assert "spec file" in listed


FLAGS = ["--output", "out", "--jobs", "3"]


def test_ctrl_c_stops_compile_quietly(tmp_path):
    """Ctrl-C (SIGINT to the process group) ends `opcache compile --jobs 3` at once, quietly."""
    import signal
    import time

    root = make_toolkit(tmp_path / "toolkit")
    env = {**base_env(tmp_path), "ASCEND_HOME_PATH": str(root), "FAKE_OPC_SLEEP": "3"}
    (tmp_path / "add.py").write_text(OP_SOURCE)
    ops = [
        {
            "op_type": "Add",
            "soc_version": SOC,
            "op_name": f"add_{i}",
            "inputs": [{"shape": [16, 64 * (i + 1)], "dtype": "float16"}] * 2,
            "outputs": [{"shape": [16, 64 * (i + 1)], "dtype": "float16"}],
            "sources": {"add.py": "add.py"},
        }
        for i in range(9)
    ]
    (tmp_path / "ops.json").write_text(json.dumps(ops))
    proc = subprocess.Popen(
        [sys.executable, "-m", "opcache", "compile", "--op", "ops.json", *FLAGS],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    log = tmp_path / "opc.log"
    deadline = time.monotonic() + 30
    while not (log.exists() and len(invocations(log)) >= 3):
        assert time.monotonic() < deadline, "opc never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=30)[1]  # no thread left waiting forever
    assert proc.returncode == -signal.SIGINT
    assert "Traceback" not in err and err == ""
    assert len(invocations(log)) == 3  # nothing more was started
