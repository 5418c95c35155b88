"""CANN's aging lock in a group's kernel_cache: another member's CANN made it, 0640.

The members share ``kernel_cache`` (2770, their group); the first member's CANN
created ``op_cache_file_del.lock`` and chmodded it 0640: the others may read it,
not write it.  A pull or import by them still goes in, under a read lock that
keeps CANN's aging out; their ``cann age``, which needs CANN's write lock, says
why it cannot and exits 1.  Each member is a real child process (root only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import helpers_faults
import pytest
from helpers_cann import (
    SOC,
    held_by_other_process,
    kernel_name,
    set_access,
    store_entry,
    write_ini,
)
from helpers_faults import MEMBER_A, MEMBER_B, TEAM_GID, open_folder, requires_root, run_as

import opcache
from opcache import cann_transfer

# As a member of the team: ``opcache cann ...`` for each argv, (status, stdout, stderr).
MEMBER_CODE = """
import contextlib, io, json
from opcache.cli import main
said = []
for argv in {argvs!r}:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    said.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(said))
"""


def _team_chip(base: Path, max_mb: int) -> Path:
    """``base/atc/kernel_cache/<soc>`` as member A's CANN left it: 2770 folders of the
    team's group, old entries of A's (1.2 MB), and A's aging lock, 0640."""
    root = base / "atc" / "kernel_cache"
    chip = root / SOC
    write_ini(root, max_mb=max_mb, ratio=50)
    for i in range(4):
        set_access(store_entry(chip, kernel_name("Add", f"old{i}"), os.urandom(300_000)), 0)
    (chip / "op_cache_file_del.lock").touch()
    for path in (base / "atc", root, chip, *root.iterdir(), *chip.iterdir()):
        os.lchown(path, MEMBER_A, TEAM_GID)
        path.chmod(0o2770 if path.is_dir() else 0o640)
    return chip


@pytest.fixture(autouse=True)
def _archives_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    # (What the child imports once it is another user, who may not read Python's own
    # folder: tarfile and what it needs, for import.)
    modules = ("tarfile", "concurrent.futures.thread", "gzip", "bz2", "lzma", "shutil", "copy")
    monkeypatch.setattr(helpers_faults, "PRELOAD", (*helpers_faults.PRELOAD, *modules))


def _as_member_b(base: Path, *argvs: list[str]) -> list[list]:
    env = {
        "OPCACHE_SHARED_GROUP": str(TEAM_GID),
        "ASCEND_DRIVER_PATH": str(base / "driver"),
        "HOME": str(base),
    }
    code = "import os\nos.environ.update(" + repr(env) + ")\n" + MEMBER_CODE.format(argvs=argvs)
    return run_as(MEMBER_B, MEMBER_B, code, groups=(TEAM_GID,))


def _archive(base: Path) -> Path:
    """An archive of two entries, any member may read."""
    (base / "driver").mkdir()
    (base / "driver" / "version.info").write_text("Version=24.1.rc2\n")
    source = base / "source"
    write_ini(source / "kernel_cache")
    for i in range(2):
        store_entry(source / "kernel_cache" / SOC, kernel_name("Mul", f"new{i}"), b"x" * 1000)
    path = base / "cache.tar"
    env = {"ASCEND_DRIVER_PATH": str(base / "driver"), "HOME": str(base)}
    settings = opcache.resolve_settings(op_compiler_cache_dir=str(source))
    cann_transfer.export_archive(path, SOC, settings=settings, environ=env)
    path.chmod(0o644)
    return path


@requires_root
def test_another_member_imports_under_a_read_lock_of_cann_s_aging_lock() -> None:
    with open_folder() as base:
        chip = _team_chip(base, max_mb=100)
        lock = chip / "op_cache_file_del.lock"
        path = _archive(base)
        argv = ["cann", "import", str(path), "--op_compiler_cache_dir", str(base / "atc")]
        argv += ["--json"]
        # While A's CANN ages (its write lock), B's read lock fails: nothing goes in.
        with held_by_other_process(lock):
            ((status, out, err),) = _as_member_b(base, argv)
        assert status == 0, err
        chip_report = json.loads(out)["chips"][SOC]
        assert chip_report["written"] == 0 and "another process holds" in chip_report["busy"]
        ((status, out, err),) = _as_member_b(base, argv)
        chip_report = json.loads(out)["chips"][SOC]
        assert (status, chip_report["written"], chip_report.get("busy")) == (0, 2, None), out
        st = lock.stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (MEMBER_A, 0o640)  # A's, untouched


@requires_root
@pytest.mark.parametrize("dry_run", [False, True])
def test_another_member_s_age_says_it_cannot_take_cann_s_aging_lock(dry_run: bool) -> None:
    with open_folder() as base:
        chip = _team_chip(base, max_mb=1)  # over the limit
        before = sorted(p.name for p in chip.iterdir())
        argv = ["cann", "age", "--op_compiler_cache_dir", str(base / "atc")]
        ((status, out, err),) = _as_member_b(base, argv + (["--dry-run"] if dry_run else []))
        assert status == 1, (out, err)
        assert out.startswith(f"{SOC}: not aged: cannot take CANN's aging lock: "), out
        assert "op_cache_file_del.lock is uid 64001's, mode 0640" in out
        assert out.count("\n") == 1 and "Traceback" not in err
        assert sorted(p.name for p in chip.iterdir()) == before


# As a member of the team: hold the aging lock as a fill does, and ask from another
# process (fcntl locks are the process's) whether CANN's write lock would be granted.
FILL_CODE = """
import fcntl, json, os, struct
from opcache import cann_format
chip = {chip!r}
flock = "hhqqi4x"  # struct flock: type, whence, start, len, pid
def cann_would_lock():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        lock = os.open(os.path.join(chip, cann_format.DEL_LOCK), os.O_RDONLY)
        asked = struct.pack(flock, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        kind = struct.unpack(flock, fcntl.fcntl(lock, fcntl.F_GETLK, asked))[0]
        os.write(w, b"free" if kind == fcntl.F_UNLCK else b"held")
        os._exit(0)
    os.waitpid(pid, 0)
    return os.read(r, 4).decode()
fd = os.open(chip, os.O_RDONLY | os.O_DIRECTORY)
with cann_format.del_lock(fd, False) as busy:
    print(json.dumps([busy, cann_would_lock()]))
"""


@requires_root
def test_another_member_s_fill_keeps_cann_s_aging_out() -> None:
    with open_folder() as base:
        chip = _team_chip(base, max_mb=100)
        code = FILL_CODE.format(chip=str(chip))
        assert run_as(MEMBER_B, MEMBER_B, code, groups=(TEAM_GID,)) == [None, "held"]
