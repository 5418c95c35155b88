"""The command line given hostile input: one clear line, the right status, never a traceback
or a hang.

Spec files and sources of ``opcache compile`` that are no files (a FIFO, a
device), JSON nested past any reason, ``CC`` values that are no command line;
maintenance commands on a cache this user cannot read; the smaller mistakes
of ``masquerade`` and ``cann``.  Every opcache run is a real process, bounded
in time (helpers_wrap.opcache) and, where a read could go on without end, in
memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from fake_opc import SOC, base_env
from helpers_wrap import GCC, opcache

from opcache import quickhit, quickmemo
from opcache.cli import main
from opcache.counters import QUICK_COUNTS

needs_gcc = pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")

DENIED = "Permission denied"
MEMORY = 2 << 30  # what an opcache run may map: /dev/zero read whole fails fast, not the machine


# -- opcache compile -------------------------------------------------------------------


@pytest.fixture
def specs(tmp_path: Path) -> Path:
    """A folder with k.c, FIFOs named fifo.c and pipe.json, and spec files naming each
    kind of source."""
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "k.c").write_text("int k(int x) { return x + 1; }\n")
    os.mkfifo(folder / "fifo.c")
    os.mkfifo(folder / "pipe.json")
    for name, source in (("ok", "k.c"), ("fifo", "fifo.c"), ("zero", "/dev/zero")):
        spec = {"op_type": "K", "soc_version": SOC, "op_name": name, "sources": {"k.c": source}}
        (folder / f"{name}.json").write_text(json.dumps(spec))
    (folder / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    return folder


@needs_gcc
@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("deep.json", "deep.json: nested too deeply to be an operator spec"),
        ("pipe.json", "pipe.json: cannot read it: not a regular file"),
        ("/dev/zero", "/dev/zero: cannot read it: not a regular file"),
        ("zero.json", "zero.json: field 'sources.k.c': cannot read /dev/zero: not a regular file"),
        ("fifo.json", "fifo.json: field 'sources.k.c': cannot read fifo.c: not a regular file"),
    ],
)
def test_a_spec_or_source_that_is_no_file_is_that_spec_s_error(specs, tmp_path, spec, said):
    """Reported like any bad spec (its line, exit 1); the good spec beside it compiles."""
    env = base_env(tmp_path)
    args = ["compile", "--op", spec, "ok.json", "--output", "build", "--compiler", "cc"]
    done = opcache(*args, env=env, cwd=specs, status=None, text=True, memory=MEMORY)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert f"error    {said}" in lines, lines
    assert any(line.startswith("miss") and line.endswith(" ok") for line in lines), lines
    assert done.stderr == ""


@needs_gcc
@pytest.mark.parametrize("cc", ['"', " ", "gcc '-O2"])
def test_a_cc_that_is_no_command_line_is_one_error_line(specs, tmp_path, cc):
    env = {**base_env(tmp_path), "CC": cc}
    args = ["compile", "--op", "ok.json", "--output", "build", "--compiler", "cc"]
    done = opcache(*args, env=env, cwd=specs, status=2)
    (line,) = done.stderr.decode().splitlines()
    assert line.startswith(f"opcache: error: CC={cc!r} ")
    assert not (specs / "build").exists()  # nothing compiled
    # `opcache compilers` lists cc as not usable, with the same reason, and goes on.
    listed = opcache("compilers", env=env, cwd=specs).stdout.decode()
    assert f"not usable  CC={cc!r} " in listed


# -- maintenance on a cache this user cannot read ---------------------------------------------

UNREADABLE_CODE = """
import contextlib, io
from opcache.cli import main

ops = Path({ops!r})
settings = opcache.resolve_settings(
    op_compiler_cache_mode="enable", op_compiler_cache_dir=str(ops), environ={{}}
)
compiler = h.ToyCompiler(ops / "calls")
with opcache.OpCache(settings) as cache:  # two chips of one entry each
    for soc in (h.SOC, "Ascend310P3"):
        cache.compile(h.make_request(0, soc_version=soc), compiler, ops / "out" / soc)


def run(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([*args, "--op_compiler_cache_dir", str(ops)])
    return [status, out.getvalue(), err.getvalue()]


said = {{}}
for folder in ("root", "chip"):
    path = settings.root if folder == "root" else settings.root / h.SOC
    os.chmod(path, 0)
    commands = ("stats", "stats --json", "age --json", "verify", "verify --json")
    said[folder] = {{c: run(*c.split()) for c in commands}}
    said[folder]["clear"] = run("clear")  # last: the other chip goes
    os.chmod(path, 0o750)
print(json.dumps(said))
"""


def test_maintenance_on_a_cache_it_cannot_read_says_so_and_fails(tmp_path):
    """As a user without root's DAC override: a root or a chip folder of mode 000."""
    from helpers_faults import CHILD_PROLOGUE, NOBODY, open_folder, run_as

    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another user")
    with open_folder() as base:
        os.chown(base, NOBODY, NOBODY)
        said = run_as(NOBODY, NOBODY, CHILD_PROLOGUE + UNREADABLE_CODE.format(ops=str(base)))
        root = base / "kernel_cache"
        for command, (status, out, err) in said["root"].items():
            assert (status, out) == (1, ""), (command, out, err)
            assert "Traceback" not in err, err
            # (After a warning that op_cache.ini cannot be read.)
            assert err.endswith(f"opcache: error: cannot read the cache folder {root}: {DENIED}\n")
        chip = root / SOC
        for command, (status, out, err) in said["chip"].items():
            assert status == 1, (command, out, err)
            assert "Traceback" not in err and "[Errno" not in err, err
            assert err.startswith(f"opcache: error: cannot read the chip folder {chip}: {DENIED};")
            # The other chip is worked on all the same.
            assert "Ascend310P3" in out, (command, out)
        assert said["chip"]["clear"][1] == "cleared Ascend310P3\n"


def test_maintenance_on_a_cache_path_too_long_to_use_fails(tmp_path, capsys):
    for command in ("stats", "age", "verify", "clear"):
        status = main([command, "--op_compiler_cache_dir", str(tmp_path / ("x" * 5000))])
        last = capsys.readouterr().err.splitlines()[-1]  # (after warnings about op_cache.ini)
        assert status == 1
        assert last.startswith("opcache: error: cannot read the cache folder ")
        assert last.endswith(": File name too long")


# -- smaller things the command line says ------------------------------------------------------


def test_cann_on_a_folder_without_its_cache_is_an_error_line(tmp_path, capsys):
    status = main(["cann", "stats", "--op_compiler_cache_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 1
    where = tmp_path / "kernel_cache"
    assert err == f"opcache: error: no CANN kernel cache at {where}: no such folder\n"


@needs_gcc
def test_compile_v_shows_the_compiler_s_warnings(specs, tmp_path):
    (specs / "k.c").write_text('#warning "look-here-42"\nint k(int x) { return x + 1; }\n')
    env = base_env(tmp_path)
    args = ["compile", "--op", "ok.json", "--output", "build", "--compiler", "cc"]
    quiet = opcache(*args, env=env, cwd=specs).stderr.decode()
    assert quiet == ""  # a batch of a thousand operators: not a warning each
    (specs / "k.c").write_text('#warning "look-here-43"\nint k(int x) { return x + 2; }\n')
    said = opcache(*args, "-v", env=env, cwd=specs).stderr.decode()
    assert "opcache: info: cc K said:\nk.c:1:2: warning: #warning " in said
    assert "look-here-43" in said


EXECUTE_ONLY_CODE = """
import contextlib, io, json, os
from opcache.cli import main
base = {base!r}
os.chdir(base)
os.environ.update(HOME=base, ASCEND_CACHE_PATH=os.path.join(base, "cache"))
err = io.StringIO()
with contextlib.redirect_stderr(err):
    status = main(["wrap", "--", os.path.join(base, "bin", "gcc"), "-c", "b.c", "-o", "b.o"])
print(json.dumps([status, os.path.exists("b.o"), err.getvalue()]))
"""


@pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
def test_a_compiler_this_user_may_run_but_not_read_compiles_uncached(tmp_path):
    # Mode 0711: the key cannot hold its digest; the compile runs as it is.
    from helpers_faults import NOBODY, open_folder, run_as

    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another user")
    with open_folder() as base:
        (base / "bin").mkdir()
        gcc = base / "bin" / "gcc"
        gcc.write_bytes(Path(os.path.realpath(GCC)).read_bytes())
        gcc.chmod(0o711)
        for folder in ("lib", "libexec"):  # (where it finds its cc1, as from /usr/bin)
            (base / folder).symlink_to(f"/usr/{folder}")
        (base / "b.c").write_text("int b(void) { return 2; }\n")
        os.chown(base, NOBODY, NOBODY)
        code = EXECUTE_ONLY_CODE.format(base=str(base))
        status, made, err = run_as(NOBODY, NOBODY, code)
        assert (status, made) == (0, True), err
        assert "Traceback" not in err and "cannot read what the key needs" in err, err
        said = json.loads(opcache("stats", "--json", env=base_env(base), cwd=base).stdout)
        reasons = said["chips"]["host"]["uncacheable_reasons"]
        assert any("cannot read what the key needs" in r and "gcc" in r for r in reasons), reasons


STICKY_CODE = """
import json, os, sys
base = {base!r}
os.chdir(base)
os.environ.update(HOME=base, XDG_RUNTIME_DIR=os.path.join(base, "run"))
os.environ["ASCEND_CACHE_PATH"] = os.path.join(base, "cache")
pid = os.fork()
if pid == 0:  # (the program leaves at once when done: a child of its own)
    os.dup2(os.open("err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
    sys.argv = ["opcache", "wrap", "--", {gcc!r}, "-c", "b.c", "-o", {target!r}]
    from opcache.cli import main
    main()
    os._exit(99)
status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
with open("err") as err:
    print(json.dumps([status, err.read()]))
"""


@pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
@pytest.mark.parametrize("sticky", [True, False])
def test_an_output_another_user_owns_is_written_as_the_compiler_writes_it(tmp_path, sticky):
    # In a sticky folder (as /tmp), another user's b.o, writable by all: gcc writes into
    # it, but no one else may rename over it.  A miss, a hit and a quick hit (from the
    # memo a hit leaves) each ended in 'opcache: error: ... -> out/b.o: Operation not
    # permitted', exit 1, where gcc alone succeeds: the command runs, uncached.  In a
    # folder that is not sticky a rename over it is allowed: the quick hit serves it.
    from helpers_faults import MEMBER_B, NOBODY, open_folder, run_as

    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another user")
    with open_folder() as base:
        (base / "b.c").write_text("int b(void) { return 2; }\n")
        (base / "run").mkdir(mode=0o700)
        os.chown(base / "run", NOBODY, NOBODY)
        (base / "out").mkdir()
        os.chmod(base / "out", 0o1777 if sticky else 0o777)
        os.chown(base, NOBODY, NOBODY)
        subprocess.run([GCC, "-c", "b.c", "-o", "made.o"], cwd=base, check=True)
        made = (base / "made.o").read_bytes()
        target = base / "out" / "b.o"
        code = STICKY_CODE.format(base=str(base), gcc=GCC, target=str(target))

        def planted() -> None:
            target.unlink(missing_ok=True)
            target.write_bytes(b"another user's object")
            os.chown(target, MEMBER_B, MEMBER_B)
            target.chmod(0o666)

        def run() -> None:
            status, err = run_as(NOBODY, NOBODY, code)
            assert (status, target.read_bytes()) == (0, made), err
            assert "opcache: error" not in err, err

        if sticky:
            planted()
            run()  # (nothing stored: the command ran as it is)
        target.unlink(missing_ok=True)
        run()  # a miss
        time.sleep(quickmemo.RACY_SECONDS + 0.3)  # (a memo only of files older than this)
        target.unlink()
        run()  # a hit that leaves a memo
        assert list((base / "run").glob(f"opcache-{NOBODY}/{quickhit.FOLDER}/*")), "no memo"
        planted()
        run()  # the memo's quick hit, or (sticky) the command itself
        (root,) = (base / "cache").glob("kernel_cache*")
        quick = root / ".opcache" / "stats" / "host" / QUICK_COUNTS
        quick_hits = len(quick.read_bytes().splitlines()) if quick.exists() else 0
        assert quick_hits == (0 if sticky else 1)
        said = json.loads(opcache("stats", "--json", env=base_env(base), cwd=base).stdout)
        host = said["chips"]["host"]
        assert (host["hits"], host["misses"]) == (1 if sticky else 2, 1), host
        reasons = host.get("uncacheable_reasons", {})
        assert sum(reasons.values()) == (2 if sticky else 0), reasons
