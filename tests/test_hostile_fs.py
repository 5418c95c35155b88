"""A hostile machine: every file and folder opcache touches, replaced (issue 16).

In a group-shared cache any member can put a link, a FIFO, a device or a
folder where opcache expects one of its own files or folders (and so can the
owner of a folder opcache is pointed at).  For each such place and each kind of
plant, every maintenance command and compiles (a miss, a hit, a force) run
against the cache, as the cache's owner, as another member of its group and as
root (a cron job), each runner in a process of its own.  Asserted:

- nothing outside the cache changed: every link points into the runner's own
  private folder, stocked with files and folders named as opcache's temp
  files, locks, counters, notes and build folders, and old enough that any
  clean-up would take them; it is the same afterwards, byte for byte, mode and
  owner;
- nothing hung: every command ends within its bound (an alarm in the runner);
- no traceback, and every compile produced its object (a plant in the output
  folder aside, where the compiler itself may refuse).

The same for CANN's own kernel_cache and ``opcache cann``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_cann import SOC as CANN_SOC
from helpers_cann import kernel_name, set_access, store_entry
from helpers_faults import IS_ROOT, MEMBER_A, MEMBER_B, TEAM_GID, open_folder, run_as
from helpers_wrap import opcache as run_opcache

pytestmark = pytest.mark.skipif(
    not IS_ROOT or shutil.which("gcc") is None,
    reason="needs root (plants owned by other users, device files) and gcc",
)

# The member who plants: trusted by the group rule, like any member.
PLANTER = 64003
RUNNERS = {"owner": (MEMBER_A, TEAM_GID), "member": (MEMBER_B, TEAM_GID), "root": (0, 0)}
KINDS = ("link", "fifo", "device", "swapped")
CHIP = "host"
DAY = 86400
# Names a clean-up would take: temp files, build and trash folders, locks,
# counters, notes.  They all sit in the victim folder that links point at.
VICTIM_NAMES = (
    ".op_cache.ini.1.deadbeef",
    ".00.json.1.deadbeef",
    "host.host.1.deadbeef",
    "0123456789abcdef0123456789abcdef.host.1.deadbeef",
    "00.json",
    "00.lock",
    "op_cache.ini",
    "MANIFEST",
    "object",
)

SOURCE = "#ifndef V\n#define V 0\n#endif\nint scale(int x) { return x * 3 + V; }\n"


# ------------------------------------------------------------------ plants


def _snapshot(folder: Path) -> dict[str, tuple]:
    """Everything below ``folder``: kind, bytes, mode, owner and mtime of each."""
    seen: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            path = Path(dirpath) / name
            st = path.lstat()
            data = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
            seen[str(path.relative_to(folder))] = (
                stat.S_IFMT(st.st_mode),
                data,
                stat.S_IMODE(st.st_mode),
                st.st_uid,
                st.st_gid,
                st.st_mtime_ns,
            )
    return seen


def _make_victim(folder: Path, names: list[str], uid: int) -> None:
    """The runner's private folder, full of things a clean-up would delete."""
    folder.mkdir(mode=0o700)
    old = time.time() - 2 * DAY
    for name in {*VICTIM_NAMES, *names}:
        path = folder / name
        if ".host." in name:
            path.mkdir()
            (path / "keep").write_bytes(b"not the cache's")
            os.utime(path / "keep", (old, old))
        else:
            path.write_bytes(f"the runner's own {name}\n".encode())
        os.utime(path, (old, old))
    for dirpath, dirs, files in os.walk(folder):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in [*dirs, *files])]:
            os.lchown(name, uid, -1)
    os.utime(folder, (old, old))


def _plant(path: Path, kind: str, victim: Path, was_dir: bool) -> None:
    """Replace ``path`` (which may be missing) by a plant of ``kind``, owned by PLANTER."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "link":
        path.symlink_to(victim if was_dir else victim / path.name)
    elif kind == "fifo":
        os.mkfifo(path, 0o660)
    elif kind == "device":
        # /dev/zero's numbers: a read that does not check for a regular file never ends.
        os.mknod(path, stat.S_IFCHR | 0o660, os.makedev(1, 5))
    elif was_dir:
        path.write_bytes(b"a file where a folder was\n")
        os.chmod(path, 0o660)
    else:
        path.mkdir()
        (path / "inside").write_bytes(b"a folder where a file was\n")
        os.chmod(path, 0o2770)
        os.lchown(path / "inside", PLANTER, TEAM_GID)
    os.lchown(path, PLANTER, TEAM_GID)


def _give_to_team(folder: Path, uid: int) -> None:
    """A group-shared cache ``uid`` made: its folders 2770, its files 0660, group TEAM_GID."""
    for dirpath, dirs, files in os.walk(folder):
        os.chown(dirpath, uid, TEAM_GID)
        os.chmod(dirpath, 0o2770)
        for name in files:
            path = os.path.join(dirpath, name)
            os.lchown(path, uid, TEAM_GID)
            if not os.path.islink(path):
                os.chmod(path, 0o660)
        del dirs  # (walked by os.walk)


# ------------------------------------------------------------- the runner

# Runs as the runner: every command of ``plan`` in this process, stderr (fd 2)
# captured per command, an alarm as the bound on each; one JSON line out.
RUNNER = r"""
import contextlib, json, os, signal, stat, subprocess, sys, tempfile, traceback
from pathlib import Path

class Hung(BaseException):
    pass

def on_alarm(signum, frame):
    raise Hung()

signal.signal(signal.SIGALRM, on_alarm)
from opcache.cli import main

plan = json.loads(PLAN)
null = os.open(os.devnull, os.O_WRONLY)
report = []
for case in plan:
    os.chdir(case["cwd"])
    results = []
    for name, argv, extra in case["commands"]:
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(case["env"], **extra)
        err = tempfile.TemporaryFile()
        keep, keep_out = os.dup(2), os.dup(1)
        os.dup2(err.fileno(), 2)
        os.dup2(null, 1)
        rc, exc, hung = None, None, False
        signal.setitimer(signal.ITIMER_REAL, case["bound"])
        try:
            if argv[0] == "!plain":  # the compiler alone, as a reference
                rc = subprocess.run(argv[1:], timeout=case["bound"], check=False).returncode
            else:
                rc = main(argv)
        except (Hung, subprocess.TimeoutExpired):
            hung = True
            # The compiler's own children (gcc's cc1, blocked on a FIFO) outlive the
            # driver the alarm killed: ended here, not left on the machine.
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        words = f.read().split(b"\0")
                except OSError:
                    continue
                outs = {os.path.dirname(o).encode() + b"/" for o in case["objects"]}
                if int(pid) != os.getpid() and words[0].endswith(b"cc1") and any(
                    out in w for w in words for out in outs
                ):
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
        except BaseException:
            exc = traceback.format_exc()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stderr.flush()
            sys.stdout.flush()
            os.dup2(keep, 2)
            os.dup2(keep_out, 1)
            os.close(keep)
            os.close(keep_out)
            os.environ.clear()
            os.environ.update(saved)
        err.seek(0)
        text = err.read().decode(errors="replace")[-3000:]
        results.append({"name": name, "rc": rc, "exc": exc, "hung": hung, "err": text})
    objects = {}
    for name in case["objects"]:
        # An object is a regular file of the compiler's (a plant left there is none).
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            objects[name] = False
            continue
        try:
            objects[name] = stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 4) == b"\x7fELF"
        finally:
            os.close(fd)
    report.append({"kind": case["kind"], "results": results, "objects": objects})
print(json.dumps(report))
"""

BOUND = 10.0  # seconds a command may take before it counts as hung


def _run(uid: int, gid: int, plan: list[dict]) -> list[dict]:
    code = f"PLAN = {json.dumps(json.dumps(plan))}\n" + RUNNER
    groups = (TEAM_GID,) if uid else ()
    # Bounded per command: on a build that hangs everywhere, the child takes long.
    return run_as(uid, gid, code, groups=groups, timeout=1200)


def _check(report: list[dict], victims: dict[str, tuple[Path, dict]]) -> None:
    """No hang, no traceback, every compile done, every victim untouched."""
    problems = []
    for case in report:
        kind = case["kind"]
        for result in case["results"]:
            what = f"{kind}: {result['name']}"
            if result["hung"]:
                problems.append(f"{what} hung")
            if result["exc"]:
                problems.append(f"{what} raised:\n{result['exc']}")
            if "Traceback" in result["err"]:
                problems.append(f"{what} printed a traceback:\n{result['err']}")
            allowed = (0,) if result["name"].startswith("compile") else (0, 1)
            if result["rc"] not in allowed:
                problems.append(f"{what} exited {result['rc']}:\n{result['err']}")
        for name, good in case["objects"].items():
            if not good:
                problems.append(f"{kind}: no object {name}")
        folder, before = victims[kind]
        after = _snapshot(folder)
        if after != before:
            changed = sorted(k for k in {*before, *after} if before.get(k) != after.get(k))
            problems.append(f"{kind}: outside the cache, changed: {changed}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------- opcache's own cache

# Each place opcache reads, writes, lists or deletes in, as globs below the
# cache root of a cache that has seen misses, hits, a force, age and verify.
FOLDERS = {
    "bookkeeping": [".opcache"],
    "trash": [".opcache/trash"],
    "tmp": [".opcache/tmp"],
    "locks": [".opcache/locks"],
    "key-locks": [".opcache/locks/host"],
    "stats": [".opcache/stats"],
    "chip-stats": [".opcache/stats/host"],
    "force": [".opcache/force"],
    "direct": [".opcache/direct"],
    "direct-bucket": [".opcache/direct/??"],
    "tools": [".opcache/tools"],
    "explain": [".opcache/explain"],
    "explain-chip": [".opcache/explain/host"],
    "chip": ["host"],
    "size": ["host/_size"],
    "bucket": ["host/??"],
    "entry": ["host/??/*"],
}
SHARDS = [f"{i:02d}" for i in range(16)]
FILES = {
    "ini": ["op_cache.ini"],
    "force-note": [".opcache/force/host"],
    "count-lock": [".opcache/locks/host.count"],
    "force-lock": [".opcache/locks/host.force"],
    "key-lock": [".opcache/locks/host/KEY"],
    "size-shards": [f"host/_size/{i}.{kind}" for i in SHARDS for kind in ("count", "json")],
    "size-locks": [f"host/_size/{i}.lock" for i in SHARDS],
    "stats-shards": [
        f".opcache/stats/host/{i}.{kind}" for i in SHARDS for kind in ("count", "json")
    ],
    "stats-locks": [f".opcache/stats/host/{i}.lock" for i in SHARDS],
    "direct-note": [".opcache/direct/??/*"],
    "tool-note": [".opcache/tools/*"],
    "explain-note": [".opcache/explain/host/??/*"],
    "manifest": ["host/??/*/MANIFEST"],
    "artifact": ["host/??/*/object"],
}


def _compile(out: str, *flags: str) -> list[str]:
    return ["wrap", "--", "gcc", "-c", "k.c", "-o", out, "-MD", *flags]


def _commands(out: Path) -> list:
    return [
        ["compile-miss", _compile(str(out / "a.o"), "-DV=1"), {}],
        ["compile-hit", _compile(str(out / "b.o")), {}],
        ["stats", ["stats"], {}],
        ["stats-json", ["stats", "--json"], {}],
        ["config", ["config"], {}],
        ["age", ["age"], {}],
        ["age-dry", ["age", "--dry-run"], {}],
        ["verify", ["verify"], {}],
        ["compile-force", _compile(str(out / "c.o"), "-DV=2"), {"OPCACHE_MODE": "force"}],
        ["clear-chip", ["clear", "--soc_version", CHIP], {}],
        ["clear", ["clear"], {}],
    ]


@pytest.fixture(scope="module")
def template() -> Iterator[tuple[Path, Path, str]]:
    """A cache that has seen it all; (open folder, its kernel_cache, the hit's key)."""
    with open_folder() as top:
        src = top / "src"
        src.mkdir()
        (src / "k.c").write_text(SOURCE)
        os.chmod(src / "k.c", 0o644)
        cache = top / "template"
        env = _team_env(top, cache)

        def opcache(*argv: str, **extra: str) -> None:
            run_opcache(*argv, env={**env, **extra}, cwd=src)

        out = top / "tout"
        out.mkdir()
        opcache(*_compile(str(out / "t.o")))
        opcache(*_compile(str(out / "t.o")))  # a hit: hit counters
        opcache(*_compile(str(out / "f.o"), "-DV=3"), OPCACHE_MODE="force")
        opcache("age")
        opcache("verify")
        opcache("stats")
        root = cache / "kernel_cache"
        key = next((root / CHIP).glob("??/*")).name
        yield top, root, key


def _team_env(home: Path, cache: Path) -> dict[str, str]:
    """The whole environment of a team member's opcache: ``cache`` shared with TEAM_GID."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "OPCACHE_DIR": str(cache),
        "OPCACHE_SHARED_GROUP": str(TEAM_GID),
    }


def _case_folder(base: Path, uid: int, template_root: Path | None) -> Path:
    """``base``, open to all, holding a copy of the template's cache given to the team
    (none if ``template_root`` is None) and ``out``, which ``uid`` and the team may write.
    Returns ``out``."""
    base.mkdir()
    os.chmod(base, 0o755)
    if template_root is not None:
        shutil.copytree(template_root, base / "cache" / "kernel_cache", symlinks=True)
        _give_to_team(base / "cache", MEMBER_A)
    out = base / "out"
    out.mkdir()
    os.chown(out, uid, TEAM_GID)
    os.chmod(out, 0o2770)  # a folder the team may write: so may the planter
    return out


def _case(kind: str, src_top: Path, base: Path, home: Path, commands: list, objects: list) -> dict:
    """One case of the runner's plan: ``commands`` run in the sources with ``base``'s
    cache, and the ``objects`` they make."""
    return {
        "kind": kind,
        "cwd": str(src_top / "src"),
        "bound": BOUND,
        "env": _team_env(home, base / "cache"),
        "commands": commands,
        "objects": objects,
    }


def _expand(root: Path, patterns: list[str], key: str) -> list[tuple[Path, bool]]:
    """Each place a pattern names (made up when nothing matches), and whether it is a folder."""
    places = []
    for pattern in patterns:
        pattern = pattern.replace("KEY", key)
        found = sorted(root.glob(pattern)) if any(c in pattern for c in "*?") else []
        for path in found or [root / pattern]:
            is_dir = path.is_dir() and not path.is_symlink()
            places.append((path.relative_to(root), is_dir))
    assert places, patterns
    return places


def _opcache_cases(template, target: str, runner: str, top: Path) -> tuple[list, dict]:
    src_top, template_root, key = template
    uid, _gid = RUNNERS[runner]
    patterns = {**FOLDERS, **FILES}[target]
    plan, victims = [], {}
    for kind in KINDS:
        base = top / kind
        out = _case_folder(base, uid, template_root)
        root = base / "cache" / "kernel_cache"
        places = _expand(root, patterns, key)
        victim = base / "victim"
        _make_victim(victim, [p.name for p, _ in places], uid)
        for place, was_dir in places:
            _plant(root / place, kind, victim, was_dir)
        victims[kind] = (victim, _snapshot(victim))
        home = base / "home"
        home.mkdir()
        os.chown(home, uid, -1)
        objects = [str(out / n) for n in ("a.o", "b.o", "c.o")]
        plan.append(_case(kind, src_top, base, home, _commands(out), objects))
    return plan, victims


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("target", [*FOLDERS, *FILES])
def test_a_planted_thing_in_opcache_s_cache(template, target: str, runner: str) -> None:
    with open_folder() as top:
        plan, victims = _opcache_cases(template, target, runner, top)
        _check(_run(*RUNNERS[runner], plan), victims)


# A plant where the compiler writes: opcache passes a command whose outputs are
# not regular files to the compiler as it is (``-o /dev/null`` must stay
# /dev/null), so what happens is what the compiler alone makes happen.
OUTPUTS = ("b.o", "b.d")


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_a_planted_output_fares_as_with_the_compiler_alone(template, runner: str) -> None:
    src_top, template_root, _key = template
    uid, _gid = RUNNERS[runner]
    with open_folder() as top:
        plan, victims = [], {}
        for kind in KINDS:
            for who in ("opcache", "gcc"):
                base = top / f"{kind}-{who}"
                out = _case_folder(base, uid, template_root if who == "opcache" else None)
                victim = base / "victim"
                _make_victim(victim, list(OUTPUTS), uid)
                for name in OUTPUTS:
                    _plant(out / name, kind, victim, False)
                victims[f"{kind}-{who}"] = (victim, _snapshot(victim))
                compile_ = _compile(str(out / "b.o"))
                argv = compile_ if who == "opcache" else ["!plain", *compile_[2:]]
                commands = [["compile", argv, {}]]
                objects = [str(out / "b.o")]
                plan.append(_case(f"{kind}-{who}", src_top, base, base, commands, objects))
        report = {case["kind"]: case for case in _run(uid, _gid, plan)}
        for kind in KINDS:
            ours, alone = report[f"{kind}-opcache"], report[f"{kind}-gcc"]
            assert not ours["results"][0]["exc"], ours["results"][0]["exc"]
            assert "Traceback" not in ours["results"][0]["err"], ours["results"][0]["err"]
            for field in ("rc", "hung"):
                assert ours["results"][0][field] == alone["results"][0][field], (kind, field)
            assert list(ours["objects"].values()) == list(alone["objects"].values()), kind
            changes = []
            for who in ("opcache", "gcc"):
                folder, before = victims[f"{kind}-{who}"]
                after = _snapshot(folder)
                # What was written there, the folder's own name aside.
                base = str(folder.parent).encode()
                changes.append(
                    {
                        k: (after[k][0], (after[k][1] or b"").replace(base, b"BASE"))
                        if k in after
                        else None
                        for k in {*before, *after}
                        if before.get(k) != after.get(k)
                    }
                )
            assert changes[0] == changes[1], kind


# -------------------------------------------------------- CANN's kernel_cache

CANN_TARGETS = {
    "cann-ini": (["op_cache.ini"], False),
    "cann-chip": ([CANN_SOC], True),
    "cann-del-lock": ([f"{CANN_SOC}/op_cache_file_del.lock"], False),
    "cann-kernel-locks": ([f"{CANN_SOC}/*.lock"], False),
    "cann-jsons": ([f"{CANN_SOC}/*.json"], False),
    "cann-binaries": ([f"{CANN_SOC}/*.o"], False),
}


def _cann_cache(root: Path) -> None:
    """Eight old entries of 300 KiB over a 1 MB limit: age has work to do."""
    chip = root / CANN_SOC
    for i in range(8):
        paths = store_entry(chip, kernel_name("add", str(i)), os.urandom(300 * 1024))
        set_access(paths, time.time() - 2 * 3600)
    (chip / "op_cache_file_del.lock").write_bytes(b"")
    (root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=1\nremain_cache_size_ratio=50\n"
    )


def _cann_commands(base: Path) -> list:
    flags = ["--op_compiler_cache_dir", str(base)]
    return [
        ["cann-stats", ["cann", "stats", *flags], {}],
        ["cann-stats-json", ["cann", "stats", "--json", *flags], {}],
        ["cann-verify", ["cann", "verify", *flags], {}],
        ["cann-age-dry", ["cann", "age", "--dry-run", *flags], {}],
        ["cann-age", ["cann", "age", *flags], {}],
        ["cann-verify-fix", ["cann", "verify", "--fix", *flags], {}],
    ]


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("target", list(CANN_TARGETS))
def test_a_planted_thing_in_cann_s_kernel_cache(target: str, runner: str) -> None:
    uid, gid = RUNNERS[runner]
    patterns, _ = CANN_TARGETS[target]
    with open_folder() as top:
        plan, victims = [], {}
        for kind in KINDS:
            base = top / kind / "atc"
            root = base / "kernel_cache"
            _cann_cache(root)
            _give_to_team(top / kind, MEMBER_A)
            places = _expand(root, patterns, "")
            victim = top / kind / "victim"
            _make_victim(victim, [p.name for p, _ in places], uid)
            for place, was_dir in places:
                _plant(root / place, kind, victim, was_dir)
            victims[kind] = (victim, _snapshot(victim))
            plan.append(
                {
                    "kind": kind,
                    "cwd": "/",
                    "bound": BOUND,
                    "env": {
                        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                        "HOME": str(top / kind),
                        "OPCACHE_SHARED_GROUP": str(TEAM_GID),
                    },
                    "commands": _cann_commands(base),
                    "objects": [],
                }
            )
        _check(_run(uid, gid, plan), victims)
