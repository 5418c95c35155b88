"""opcache cann push / pull: CANN's own kernel_cache shared through a real Redis.

Two CANN-format folders stand for two machines (``helpers_cann`` writes them
as CANN's graph engine does); A pushes, B pulls.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from helpers_cann import (
    SOC,
    held_by_other_process,
    kernel_name,
    lock_probe,
    set_access,
    set_times,
    store_entry,
    store_mix_entry,
    store_prebuild,
    write_ini,
)

import opcache
from opcache import aging, cann_transfer
from opcache.cann_cache import CannCache, read_limits
from opcache.cli import main
from opcache.settings import resolve_settings
from opcache.storage.local import LocalStore

NOW = time.time()


class Machine:
    """One machine: its CANN cache base folder and the environment of its jobs."""

    def __init__(self, base: Path, driver: Path, redis_url: str) -> None:
        self.base = base
        self.root = base / "kernel_cache"
        self.chip = self.root / SOC
        self.env = {"ASCEND_DRIVER_PATH": str(driver), "HOME": str(base)}
        self.url = redis_url

    def settings(self):  # type: ignore[no-untyped-def]
        return resolve_settings(op_compiler_cache_dir=str(self.base), remote=self.url)

    def push(self, **kw: object) -> dict:
        report = cann_transfer.push(SOC, settings=self.settings(), environ=self.env, **kw)
        return report["chips"][SOC]

    def pull(self, **kw: object) -> dict:
        report = cann_transfer.pull(SOC, settings=self.settings(), environ=self.env, **kw)
        return report["chips"][SOC]

    def toolkit(self, adk: str = "7.0.RC1", ops: str = "7.0.RC1") -> None:
        """An installed toolkit whose version.info files say ``adk`` and ``ops``."""
        home = self.base / "toolkit"
        for folder, version in ((home / "compiler", adk), (home / "opp", ops)):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "version.info").write_text(f"Version={version}\nversion_dir=x\n")
        self.env["ASCEND_HOME_PATH"] = str(home)
        self.env["ASCEND_OPP_PATH"] = str(home / "opp")


def _driver(path: Path, version: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "version.info").write_text(f"Version={version}\n")
    return path


@pytest.fixture
def machines(tmp_path: Path, redis_url: str) -> tuple[Machine, Machine]:
    driver = _driver(tmp_path / "driver", "24.1.rc2")
    a = Machine(tmp_path / "a", driver, redis_url)
    b = Machine(tmp_path / "b", driver, redis_url)
    write_ini(a.root)
    return a, b


def _fill(a: Machine, count: int, size: int = 1000) -> list[str]:
    """``count`` plain entries in A, the first used most recently."""
    kernels = []
    for i in range(count):
        kernel = kernel_name("Add", f"k{i}")
        paths = store_entry(a.chip, kernel, os.urandom(size))
        set_access(paths, NOW - 3600 - 60 * i)
        kernels.append(kernel)
    return kernels


def _in_redis(redis_server, kernel: str):  # type: ignore[no-untyped-def]
    """A client of the test's Redis and the key that holds ``kernel``'s entry."""
    client = redis_server.client()
    (name,) = [n for n in client.keys("*") if n.decode().endswith(kernel)]
    return client, name


def _entry_files(chip: Path) -> dict[str, bytes]:
    """Every entry file of a chip folder (no locks, temps or prebuild results)."""
    return {
        p.name: p.read_bytes()
        for p in chip.iterdir()
        if not p.name.endswith((".lock", ".temp", "_pre.json"))
    }


def test_pushed_entries_are_pulled_byte_identical_whole_and_as_cann_writes(machines):
    a, b = machines
    kernels = _fill(a, 3)
    store_entry(a.chip, kernel_name("Mul", "h"), b"\x7fELF-mul", header=b"// header\n")
    store_mix_entry(a.chip, kernel_name("MatMul", "mix"), b"aic-bin", b"aiv-bin")
    store_prebuild(a.chip, kernel_name("Add", "pre"))
    pushed = a.push()
    assert (pushed["sent"], pushed["present"], pushed["skipped"]) == (5, 0, [])

    b.toolkit()  # B has no op_cache.ini yet: it is created with the toolkit's versions
    pulled = b.pull()

    assert pulled["written"] == 5 and pulled["rejected"] == pulled["corrupt"] == []
    assert pulled["ini_created"]
    assert (b.root / "op_cache.ini").read_text() == (
        "[op_compiler_cache]\nadk_version=7.0.RC1\nops_version=7.0.RC1\n"
    )
    assert _entry_files(b.chip) == _entry_files(a.chip)  # mix sub-jsons and headers too
    for path in b.chip.iterdir():
        if not path.name.endswith(".lock"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o640, path
    assert not list(b.chip.glob("*.temp"))
    assert not list(b.chip.glob("*_pre.json"))  # prebuild results are not entries
    # CANN's hit check on every pulled entry: json parses, binary there, sha256, kernelName.
    cann = CannCache(b.root, read_limits(b.root, b.env))
    report = cann.verify(SOC)["chips"][SOC]
    assert (report["entries"], report["checked"], report["faults"]) == (5, 5, [])
    # The source's access time is kept: CANN's aging order is the cluster's.
    for kernel in kernels:
        assert int((b.chip / f"{kernel}.json").stat().st_atime) == int(
            (a.chip / f"{kernel}.json").stat().st_atime
        )
    # Nothing more to do either way.
    assert a.push()["sent"] == 0
    again = b.pull()
    assert (again["written"], again["present"]) == (0, 5)


def test_a_second_push_checks_existence_in_batches_and_sends_only_what_is_new(machines):
    a, b = machines
    _fill(a, 40)
    assert a.push()["sent"] == 40
    store_entry(a.chip, kernel_name("Sub", "new"), b"new")
    second = a.push()
    assert (second["present"], second["sent"]) == (40, 1)
    b.toolkit()
    assert b.pull()["written"] == 41


def test_a_folder_remote_s_index_takes_every_push(machines, tmp_path):
    """A folder remote keeps the first value of a key: the index the first push wrote
    stood for good, and B never pulled what later pushes sent."""
    a, b = machines
    a.url = b.url = f"file://{tmp_path / 'share'}"
    (tmp_path / "share").mkdir()
    _fill(a, 2)
    assert a.push()["sent"] == 2
    store_entry(a.chip, kernel_name("Sub", "new"), b"new")
    assert a.push()["sent"] == 1
    b.toolkit()
    assert b.pull()["written"] == 3


def test_age_run_on_a_shared_folder_ages_its_cann_kernels_and_keeps_their_index(
    machines, tmp_path, monkeypatch, capsys
):
    """``opcache age`` run on a shared folder left the kernels ``cann push`` sent there
    alone: only ``remote clear`` removed them, and the share grew without end.  Now
    they age as its entries do (least recently used first, the parts of their index
    never), and a pull lists the kernels aged out as gone."""
    a, b = machines
    share = tmp_path / "share"
    a.url = b.url = f"file://{share / 'kernel_cache'}"
    (share / "kernel_cache").mkdir(parents=True)
    kernels = _fill(a, 6, size=300_000)
    assert a.push()["sent"] == 6
    store = LocalStore(share / "kernel_cache")
    (chip,) = [c for c in store.chips() if c.count(":") == 2]  # the namespace's
    index = [n.key for n in store.scan(chip) if n.key.startswith("#")]
    assert index
    for name in index:
        store.touch(chip, name, NOW - 30 * 86400)  # the least recently written of all
    for i, kernel in enumerate(kernels):  # the first used most recently
        store.touch(chip, kernel, NOW - 3600 - 60 * i)
    write_ini(share / "kernel_cache", max_mb=1, ratio=50)
    monkeypatch.setattr(aging, "NAMED_CANDIDATES", 2)  # a trim of more walks again

    assert main(["age", "--op_compiler_cache_dir", str(share)]) == 0
    assert f"{chip}: removed 5 entries" in capsys.readouterr().out

    left = {info.key for info in store.scan(chip)}
    assert left == {kernels[0], *index}
    b.toolkit()
    pulled = b.pull()
    assert (pulled["written"], sorted(pulled["gone"])) == (1, sorted(kernels[1:]))
    assert (b.chip / f"{kernels[0]}.json").exists()


def _custom_package(machine: Machine, tiling: bytes) -> None:
    """A custom operator package in the machine's own folder (ASCEND_CUSTOM_OPP_PATH)."""
    package = machine.base / "custom_opp"
    (package / "op_impl" / "ai_core" / "tbe").mkdir(parents=True, exist_ok=True)
    (package / "op_impl" / "ai_core" / "tbe" / "my_add.py").write_text("def my_add(): pass\n")
    (package / "op_impl" / "liboptiling.so").write_bytes(tiling)
    (package / "op_impl" / "current").symlink_to("ai_core")
    machine.env["ASCEND_CUSTOM_OPP_PATH"] = str(package)


@pytest.mark.parametrize("b_package", [b"same tiling", b"other tiling", None])
def test_custom_operator_packages_must_be_the_same_to_share(machines, b_package):
    """CANN names a custom operator's kernel by its description, not its implementation:
    a machine whose custom package differs (or that has none) took the other's kernels,
    built from another implementation.  Where the packages' files are the same (at
    other paths), the entries move."""
    a, b = machines
    _custom_package(a, b"same tiling")
    _fill(a, 2)
    assert a.push()["sent"] == 2
    if b_package is not None:
        _custom_package(b, b_package)
    b.toolkit()
    report = b.pull()
    if b_package == b"same tiling":
        assert report["written"] == 2
    else:
        assert "custom operator packages" in report["refused"], report
        assert not b.chip.exists()


def test_another_adk_version_in_b_pulls_nothing_and_says_why(machines):
    a, b = machines
    _fill(a, 2)
    a.push()
    (b.root).mkdir(parents=True)
    (b.root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nadk_version=8.0.RC1\nops_version=7.0.RC1\n"
    )
    report = b.pull()
    assert "8.0.RC1" in report["refused"] and "7.0.RC1" in report["refused"]
    assert not b.chip.exists()


def test_another_driver_in_b_pulls_nothing(machines, tmp_path):
    a, b = machines
    _fill(a, 2)
    a.push()
    b.env["ASCEND_DRIVER_PATH"] = str(_driver(tmp_path / "driver-b", "25.0.rc1"))
    write_ini(b.root)
    report = b.pull()
    assert "only for other versions" in report["refused"]
    assert not b.chip.exists()


def test_a_toolkit_other_than_the_ini_pulls_nothing_but_pushes_under_the_ini(machines):
    a, b = machines
    _fill(a, 1)
    a.toolkit(adk="8.0.RC1")  # upgraded since: the entries are still 7.0.RC1's
    assert a.push()["namespace"]["adk_version"] == "7.0.RC1"
    write_ini(b.root)
    b.toolkit(adk="8.0.RC1")
    assert "CANN wipes this folder" in b.pull()["refused"]
    assert not b.chip.exists()


@pytest.mark.parametrize(
    "text",
    [
        "[op_compiler_cache]\nmax_op_cache_size=100\nremain_cache_size_ratio=50\n",
        "[op_compiler_cache]\nadk_version=7.0.RC1\nops_version=\n",
        "[aaa]\nx=1\n[op_compiler_cache]\nadk_version=7.0.RC1\nops_version=7.0.RC1\n",
    ],
)
def test_an_invalid_ini_in_b_says_why_and_does_nothing(machines, text):
    a, b = machines
    _fill(a, 1)
    a.push()
    b.toolkit()
    b.root.mkdir(parents=True)
    (b.root / "op_cache.ini").write_text(text)
    report = b.pull()
    assert "op_cache.ini" in report["refused"]
    assert (b.root / "op_cache.ini").read_text() == text
    assert not b.chip.exists()


@pytest.mark.parametrize("written", [False, True], ids=["nothing-yet", "its-binary-written"])
def test_an_entry_a_cann_writer_is_storing_is_skipped_and_left_alone(machines, written):
    """CANN's writer holds <kernel>.lock from before its first file to after its json
    (te_cache_manager.cc ``CopyCompileRetIntoCacheDir``)."""
    a, b = machines
    kernels = _fill(a, 3)
    a.push()
    write_ini(b.root)
    b.chip.mkdir(parents=True)
    busy = kernels[1]
    with held_by_other_process(b.chip / f"{busy}.lock"):
        if written:  # the writer's binary is in place, its json not yet
            (b.chip / f"{busy}.o").write_bytes(b"the writer's own kernel")
        report = b.pull()
        assert report["locked"] == ([] if written else [busy])
        assert report["present"] == (1 if written else 0)
        expected = {f"{busy}.lock", f"{busy}.o"} if written else {f"{busy}.lock"}
        assert {p.name for p in b.chip.glob(f"{busy}*")} == expected
    # The writer then stores its own entry, as CANN does: nothing of ours is in the way.
    mine = store_entry(b.chip, busy, b"the writer's own kernel")
    assert mine[1].read_bytes() == b"the writer's own kernel"
    assert report["written"] == 2


def test_a_corrupt_value_in_redis_is_never_written(machines, redis_server):
    a, b = machines
    kernels = _fill(a, 3)
    a.push()
    client, name = _in_redis(redis_server, kernels[0])
    value = client.get(name)
    client.set(name, value[:-20] + bytes(20))
    write_ini(b.root)
    report = b.pull()
    assert [c["entry"] for c in report["corrupt"]] == [kernels[0]]
    assert report["written"] == 2
    assert not list(b.chip.glob(f"{kernels[0]}*.[jo]*"))


def test_an_entry_failing_cann_checks_is_never_written(machines):
    """A well-formed remote value whose json's sha256 is not its binary's (a bad pusher)."""
    a, b = machines
    _fill(a, 1)
    a.push()
    bad = kernel_name("Bad", "sha")
    files = {
        f"{bad}.o": b"real bytes",
        f"{bad}.json": json.dumps(
            {"binFileName": bad, "binFileSuffix": ".o", "kernelName": "k", "sha256": "00" * 32}
        ).encode(),
    }
    _pushed_by_hand(a, [cann_transfer.Bundle(bad, int(NOW), files)])
    write_ini(b.root)
    report = b.pull()
    assert [r["entry"] for r in report["rejected"]] == [bad]
    assert "sha256" in report["rejected"][0]["why"]
    assert report["written"] == 1
    assert sorted(p.name for p in b.chip.glob(f"{bad}*")) == []  # (nor the lock file it made)


def _driver_digest(machine: Machine) -> str:
    from opcache.compilers.cann import driver_version

    return driver_version(machine.env) or "none"


def test_b_ends_under_its_limit_with_the_most_recently_used_entries(machines):
    a, b = machines
    kernels = _fill(a, 20, size=100_000)  # 2 MB; the first used most recently
    a.push()
    write_ini(b.root, max_mb=1, ratio=50)
    report = b.pull()
    assert report["stopped_at_limit"]
    used = sum(p.stat().st_size for p in b.chip.iterdir())
    assert used < 1024 * 1024
    pulled = {p.name[: -len(".json")] for p in b.chip.glob("*.json")}
    assert pulled == set(kernels[: len(pulled)]) and len(pulled) >= 9


def test_a_pull_window_holds_at_most_window_rows_however_many_share_a_second(machines, monkeypatch):
    """Windows of 7 rows, 5 bins of last access: 40 kernels last used in the same second
    (a bulk copy), and bins widened over the others' times, made windows of 40 rows and
    more.  Each read of the index now gives at most 7, still most recently used first
    (by last access, then name), and the pull stops exactly at the limit."""
    a, b = machines
    rnd = random.Random(7)
    kernels = {}
    for i in range(120):
        kernel = kernel_name("Add", f"w{i}")
        paths = store_entry(a.chip, kernel, os.urandom(20_000))
        if i % 3 == 0:
            t = int(NOW) - 5000  # (40 of them)
        elif i % 3 == 1:
            t = int(NOW) - rnd.randrange(0, 4000)  # (40 newer)
        else:
            t = int(NOW) - rnd.randrange(6000, 10**7)  # (40 older)
        set_access(paths, t)
        kernels[kernel] = t
    present = sorted(kernels)[::10]  # (some there already)
    for kernel in present:
        set_access(store_entry(b.chip, kernel, b"\x7fELF there"), NOW - 10**8)
    a.push()
    monkeypatch.setattr(cann_transfer, "WINDOW", 7)
    monkeypatch.setattr(cann_transfer, "_BINS", 5)
    read: list[int] = []  # rows given after each read of the index
    rows, batches = cann_transfer._Plan._rows, cann_transfer._Plan.batches

    def counted_rows(self):  # type: ignore[no-untyped-def]
        read.append(0)
        yield from rows(self)

    def counted_batches(self):  # type: ignore[no-untyped-def]
        for batch in batches(self):
            read[-1] += len(batch)
            yield batch

    monkeypatch.setattr(cann_transfer._Plan, "_rows", counted_rows)
    monkeypatch.setattr(cann_transfer._Plan, "batches", counted_batches)
    write_ini(b.root, max_mb=1, ratio=50)
    report = b.pull()
    assert report["stopped_at_limit"] and report["present"] == len(present)
    assert max(read) <= 7 and len(read) > 5, read
    pulled = {p.name[: -len(".json")] for p in b.chip.glob("*.json")} - set(present)
    order = sorted(set(kernels) - set(present), key=lambda k: (-kernels[k], k))
    assert 40 < len(pulled) < 80  # (the limit falls among the 40 of one second)
    assert pulled == set(order[: len(pulled)])
    used = sum(p.stat().st_size for p in b.chip.iterdir())
    assert (1 << 20) - 3 * 20_000 < used < 1 << 20


def test_a_chip_folder_that_is_a_link_is_refused_and_its_target_untouched(machines, tmp_path):
    a, b = machines
    _fill(a, 2)
    a.push()
    write_ini(b.root)
    victim = tmp_path / "victim"
    victim.mkdir()
    b.chip.symlink_to(victim)
    assert "link" in b.pull()["refused"]
    assert list(victim.iterdir()) == []


def test_dry_runs_change_nothing(machines):
    a, b = machines
    _fill(a, 2)
    assert a.push(dry_run=True)["would_send"] == 2
    assert a.push()["sent"] == 2
    b.toolkit()
    assert b.pull(dry_run=True)["would_pull"] == 2
    assert not b.root.exists()


def _cli(machine: Machine, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **machine.env, "OPCACHE_REMOTE": machine.url}
    argv = [sys.executable, "-m", "opcache", "cann", *args]
    argv += ["--op_compiler_cache_dir", str(machine.base), "--soc_version", SOC]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_the_command_line_pushes_pulls_and_refuses_in_one_line(machines):
    a, b = machines
    _fill(a, 2)
    pushed = _cli(a, "push", "--json")
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["chips"][SOC]["sent"] == 2
    write_ini(b.root)
    pulled = _cli(b, "pull")
    assert pulled.returncode == 0, pulled.stderr
    assert "2 entries written" in pulled.stdout
    (b.root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nadk_version=9.9\nops_version=7.0.RC1\n"
    )
    refused = _cli(b, "pull")
    assert refused.returncode == 3
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("opcache: error:")
    assert "Traceback" not in refused.stderr


def test_without_a_remote_the_command_line_says_so(machines):
    a, _ = machines
    env = {k: v for k, v in os.environ.items() if k != "OPCACHE_REMOTE"}
    argv = [sys.executable, "-m", "opcache", "cann", "push", "--soc_version", SOC]
    argv += ["--op_compiler_cache_dir", str(a.base)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("opcache: error:") and "OPCACHE_REMOTE" in done.stderr


def test_push_asks_which_entries_the_remote_has_without_fetching_them(machines, redis_server):
    a, _ = machines
    _fill(a, 40, size=10_000)
    a.push()
    client = redis_server.client()
    client.config_resetstat()
    again = a.push()
    assert (again["present"], again["sent"]) == (40, 0)
    calls = {k: v["calls"] for k, v in client.info("commandstats").items()}
    assert calls.get("cmdstat_exists", 0) == 40  # a batched EXISTS per entry, no value
    # No entry fetched: the index's head (read before and after its parts are merged)
    # and its parts, a few at a time.
    parts = cann_transfer.SHARDS // cann_transfer._SHARDS_AT_ONCE
    assert calls.get("cmdstat_mget", 0) == parts
    assert calls.get("cmdstat_get", 0) <= 2
    assert "cmdstat_set" not in calls  # nothing new: not even the index is written again


def test_a_small_disk_stops_the_pull_at_its_reserve_leaving_no_part_of_an_entry(machines):
    """A pull never takes a disk past its reserve (a tenth of a small one): the jobs that
    follow it keep room; nothing half written, no lock file of an entry not written."""
    from helpers_faults import tmpfs

    a, b = machines
    kernels = _fill(a, 8, size=100_000)
    a.push()
    with tmpfs(b.base, f"size={96 * os.sysconf('SC_PAGE_SIZE')}"):  # 384 KiB with 4 KiB pages
        write_ini(b.root, max_mb=-1, ratio=50)  # no size limit: the disk is the limit
        report = b.pull()
        st = os.statvfs(b.chip)
        names = {p.name for p in b.chip.iterdir()}
    total = st.f_blocks * st.f_frsize
    assert report["written"] >= 1 and report["rejected"] == []
    assert report["errors"] == [
        cann_transfer.DISK_RESERVE.format(cann_transfer._human(total // 10))
    ]
    assert st.f_bavail * st.f_frsize >= total // 10
    assert not [n for n in names if n.endswith(".temp")]
    written = kernels[: report["written"]]
    assert {n for n in names if n.endswith(".json")} == {f"{k}.json" for k in written}
    assert {n for n in names if n.endswith(".o")} == {f"{k}.o" for k in written}
    assert {n for n in names if n.endswith(".lock")} == {f"{k}.lock" for k in written} | {
        "op_cache_file_del.lock"
    }


@pytest.mark.parametrize("count", [60, 3000])
def test_a_tmpdir_filled_during_a_push_leaves_the_index_unwritten_exit_1(machines, tmp_path, count):
    """TMPDIR fills after the push started: the rows it spools are refused, at a write
    (3000 kernels) or only when the buffered files are written out (60): the entries are
    sent, the index is not written, and push says why (``errors``, exit 1, its --json
    report), leaving nothing of its own in TMPDIR."""
    from helpers_faults import tmpfs

    a, _ = machines
    _fill(a, count, size=16)
    with tmpfs(tmp_path / "smalltmp", "size=4k") as small:
        a.env = {**a.env, "TMPDIR": str(small)}
        fill = (
            "import tempfile\ntempfile.gettempdir()\n"  # (opcache started with room)
            f"fd = os.open({str(small / 'filler')!r}, os.O_WRONLY | os.O_CREAT)\n"
            "try:\n    os.write(fd, b'x' * 8192)\nexcept OSError:\n    pass\nos.close(fd)\n"
        )
        done = _cli_patched(a, fill, "push", "--json")
        left = sorted(os.listdir(small))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    report = json.loads(done.stdout)["chips"][SOC]
    assert report["sent"] == count
    assert len(report["errors"]) == 1 and "cannot keep its rows in" in report["errors"][0]
    assert "No space left on device" in report["errors"][0]
    assert left == ["filler"]
    assert _index_of(a) == {}  # (not written: no pull sees half of it)


def test_a_big_disk_keeps_a_reserve_of_10_gib_at_most(machines, monkeypatch):
    """A 16 TiB shared file system with 600 GiB free has room: 5 % of it (819 GiB) as the
    reserve stopped every pull there before its first entry."""
    a, b = machines
    _fill(a, 5, size=1000)
    a.push()
    write_ini(b.root, max_mb=-1, ratio=50)
    real, block = os.fstatvfs, 4096

    def big(fd: int) -> os.statvfs_result:
        st = real(fd)
        free = (600 << 30) // block
        return os.statvfs_result((block, block, (16 << 40) // block, free, free, *tuple(st)[5:]))

    monkeypatch.setattr(cann_transfer.os, "fstatvfs", big)
    report = b.pull()
    assert (report["written"], report.get("errors", [])) == (5, [])


def test_a_disk_filled_meanwhile_stops_the_pull_at_the_first_enospc(machines, monkeypatch):
    """Another writer fills the disk during a pull: every entry after failed as well, each
    fetched, tried, warned of and leaving its lock file behind."""
    from helpers_faults import tmpfs

    a, b = machines
    kernels = _fill(a, 100, size=500)  # four batches
    a.push()
    fetches = []
    real_open = cann_transfer.open_remote

    def counting(*args, **kw):  # type: ignore[no-untyped-def]
        remote = real_open(*args, **kw)
        get_many = remote.get_many

        def fetch(chip, keys):  # type: ignore[no-untyped-def]
            if not keys[0].startswith("#"):  # (not the index)
                fetches.append(len(keys))
            return get_many(chip, keys)

        remote.get_many = fetch
        return remote

    stores = []
    real_store = cann_transfer._Writer._store

    def store(self, bundle, main):  # type: ignore[no-untyped-def]
        stores.append(bundle.kernel)
        if len(stores) == 10:  # another process fills what is left of the disk
            with open(b.base / "filler", "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        return real_store(self, bundle, main)

    monkeypatch.setattr(cann_transfer, "open_remote", counting)
    monkeypatch.setattr(cann_transfer._Writer, "_store", store)
    with tmpfs(b.base, "size=4m"):
        write_ini(b.root, max_mb=-1, ratio=50)
        monkeypatch.setattr(cann_transfer, "disk_reserve", lambda total: 0, raising=False)
        report = b.pull()
        names = {p.name for p in b.chip.iterdir()}
    assert report["errors"] == [cann_transfer.DISK_FULL.format("No space left on device")]
    assert (report["written"], report["rejected"], len(stores)) == (9, [], 10)
    # The batch written, and the next one, fetched ahead meanwhile, at most.
    assert len(fetches) <= 2, fetches
    assert {n for n in names if n.endswith(".json")} == {f"{k}.json" for k in kernels[:9]}
    assert {n for n in names if n.endswith(".lock")} == {f"{k}.lock" for k in kernels[:9]} | {
        "op_cache_file_del.lock"
    }
    assert not [n for n in names if n.endswith((".temp", ".o")) and n[:-2] not in kernels[:9]]


def test_the_command_line_stops_a_pull_on_a_full_disk_in_one_line(machines):
    """The reviewer's run: aging off, a 4 MiB disk; the pull filled it to 100 %, then
    fetched and tried every other entry, one warning each, exit status 1 on a full disk
    (and `|| true; python train.py` started the job on it)."""
    from helpers_faults import tmpfs

    a, b = machines
    _fill(a, 800, size=200)
    a.push()
    with tmpfs(b.base, "size=4m"):
        write_ini(b.root, max_mb=-1, ratio=50)
        done = _cli(b, "pull", "--json")
        st = os.statvfs(b.chip)
        locks = [p.name for p in b.chip.iterdir() if p.name.endswith(".lock")]
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)["chips"][SOC]
    assert len(report["errors"]) == 1 and report["errors"][0].startswith("stopped: the disk")
    assert 100 < report["written"] < 800 and report["rejected"] == []
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert len(locks) == report["written"] + 1  # (and the aging lock)
    assert st.f_bavail * st.f_frsize >= (st.f_blocks * st.f_frsize) // 10


def test_a_pull_while_another_fills_or_ages_the_folder_writes_nothing(machines):
    """op_cache_file_del.lock (CANN's aging lock) is held by every pull: two pulls never
    count the size limit each for themselves."""
    a, b = machines
    _fill(a, 2)
    a.push()
    write_ini(b.root)
    b.chip.mkdir(parents=True)
    with held_by_other_process(b.chip / "op_cache_file_del.lock"):
        report = b.pull()
    assert "op_cache_file_del.lock" in report["busy"] and report["written"] == 0
    assert sorted(p.name for p in b.chip.iterdir()) == ["op_cache_file_del.lock"]
    assert b.pull()["written"] == 2


def test_a_pull_that_can_never_take_the_aging_lock_says_so_in_its_exit_status(machines, tmp_path):
    """A link planted in place of op_cache_file_del.lock was reported as a busy lock,
    exit 0, on every run: a cron job never learnt that nothing was ever written."""
    a, b = machines
    _fill(a, 2)
    a.push()
    write_ini(b.root)
    b.chip.mkdir(parents=True)
    (tmp_path / "elsewhere").touch()
    (b.chip / "op_cache_file_del.lock").symlink_to(tmp_path / "elsewhere")
    env = {**os.environ, **b.env, "OPCACHE_REMOTE": b.url}
    argv = [sys.executable, "-m", "opcache", "cann", "pull", "--soc_version", SOC]
    done = subprocess.run(
        [*argv, "--op_compiler_cache_dir", str(b.base)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 1, done
    assert "op_cache_file_del.lock: it is a link" in done.stdout
    assert sorted(p.name for p in b.chip.iterdir()) == ["op_cache_file_del.lock"]


def test_two_pulls_at_once_stay_under_the_limit(machines):
    a, b = machines
    _fill(a, 20, size=100_000)
    a.push()
    write_ini(b.root, max_mb=1, ratio=50)
    env = {**os.environ, **b.env, "OPCACHE_REMOTE": b.url}
    argv = [sys.executable, "-m", "opcache", "cann", "pull", "--soc_version", SOC]
    argv += ["--op_compiler_cache_dir", str(b.base), "--json"]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    reports = [json.loads(p.communicate(timeout=120)[0])["chips"][SOC] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(r["written"] for r in reports) >= 9
    assert sum(p.stat().st_size for p in b.chip.iterdir()) < 1024 * 1024


def test_an_entry_over_the_remote_size_cap_is_not_sent_and_the_others_are(machines, monkeypatch):
    a, b = machines
    kernels = _fill(a, 5, size=1000)
    big = kernel_name("Big", "x")
    store_entry(a.chip, big, os.urandom(1_100_000))
    set_access([a.chip / f"{big}.json"], NOW - 3600 - 150)  # in the middle of one batch
    monkeypatch.setenv("OPCACHE_REMOTE_MAX_ENTRY_MB", "1")
    report = a.push()
    assert [n["entry"] for n in report["not_sent"]] == [big]
    assert "size cap" in report["not_sent"][0]["why"]
    assert report["sent"] == 5
    write_ini(b.root)
    pulled = b.pull()
    assert pulled["written"] == 5
    assert {p.name[: -len(".json")] for p in b.chip.glob("*.json")} == set(kernels)


@pytest.mark.parametrize("suffix", [".json", ".o", ".lock", "op_cache_file_del.lock", "ini"])
@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_planted_link_or_fifo_in_b_is_never_written_through_nor_waited_on(
    machines, tmp_path, suffix, kind
):
    a, b = machines
    (kernel,) = _fill(a, 1)
    a.push()
    write_ini(b.root)
    b.chip.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    if suffix == "ini":
        (b.root / "op_cache.ini").unlink()
        place = b.root / "op_cache.ini"
    elif suffix.startswith("op_cache"):
        place = b.chip / suffix
    else:
        place = b.chip / f"{kernel}{suffix}"
    if kind == "link":
        place.symlink_to(victim)
    else:
        os.mkfifo(place)
    report = b.pull()  # a FIFO opened for reading would hang here
    assert victim.read_bytes() == b"precious"
    assert place.is_symlink() if kind == "link" else stat.S_ISFIFO(place.lstat().st_mode)
    if suffix == "ini":
        assert "op_cache.ini" in report["refused"]
    elif suffix.startswith("op_cache"):
        (error,) = report["errors"]  # (never taken: not a lock another holds for a while)
        assert "op_cache_file_del.lock" in error and report["written"] == 0
    elif suffix == ".lock":
        assert report["locked"] == [kernel]
    else:
        assert (report["present"], report["written"]) == (1, 0)


def test_a_remote_entry_bringing_another_kernels_json_writes_nothing(machines):
    """A bad pusher's entry te_x carrying te_x2.json: that json would be another entry,
    shown before te_x's own checks; nothing of it is written."""
    a, b = machines
    _fill(a, 1)
    a.push()
    bad = kernel_name("Bad", "names")
    binary = b"kernel bytes"
    other = json.dumps({"binFileName": f"{bad}2", "binFileSuffix": ".o", "kernelName": "k"})
    files = {
        f"{bad}.o": binary,
        f"{bad}.json": json.dumps(
            {"binFileName": bad, "binFileSuffix": ".o", "kernelName": "k",
             "sha256": hashlib.sha256(binary).hexdigest()}
        ).encode(),
        f"{bad}2.json": other.encode(),
    }  # fmt: skip
    _pushed_by_hand(a, [cann_transfer.Bundle(bad, int(NOW), files)])
    write_ini(b.root)
    report = b.pull()
    assert [r["entry"] for r in report["rejected"]] == [bad]
    assert not list(b.chip.glob(f"{bad}*"))


@pytest.mark.parametrize(
    "text",
    [
        "adk_version=7.0.RC1\n[op_compiler_cache]\nops_version=7.0.RC1\n",  # keys above join it
        "[ op_compiler_cache ]\n  adk_version = 7.0.RC1\nops_version=7.0.RC1\n[zz]\na=b\n",
        "[op_compiler_cache]\nadk_version=7.0.RC1\nops_version=7.0.RC1\n[op_compiler_cache]\n"
        "adk_version=9.9\n",  # the first of two sections
    ],
)
def test_b_versions_are_read_as_cann_reads_the_ini(machines, text):
    """te_cache_space_manager.cc ``LoadIniFile`` / ``GetCacheInitFileCfg`` (ini.py)."""
    a, b = machines
    _fill(a, 1)
    a.push()
    b.root.mkdir(parents=True)
    (b.root / "op_cache.ini").write_text(text)
    report = b.pull()
    assert (report["written"], report["namespace"]["adk_version"]) == (1, "7.0.RC1")


def test_an_entry_the_remote_evicted_is_dropped_from_its_index(machines, redis_server):
    a, b = machines
    kernels = _fill(a, 3)
    a.push()
    client, name = _in_redis(redis_server, kernels[2])
    client.delete(name)  # as maxmemory-policy allkeys-lru would
    write_ini(b.root)
    assert b.pull()["gone"] == [kernels[2]]
    shutil.rmtree(b.chip)
    again = b.pull()
    assert (again["written"], again["gone"]) == (2, [])


def test_a_terminal_shows_the_progress_and_a_pipe_does_not(machines):
    import pty

    a, b = machines
    _fill(a, 40, size=1000)
    a.push()
    write_ini(b.root)
    main, side = pty.openpty()
    env = {**os.environ, **b.env, "OPCACHE_REMOTE": b.url}
    argv = [sys.executable, "-m", "opcache", "cann", "pull", "--soc_version", SOC]
    argv += ["--op_compiler_cache_dir", str(b.base)]
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=side, timeout=120)
    os.close(side)
    shown = b""
    with contextlib.suppress(OSError):  # EIO once the terminal's other side is closed
        while chunk := os.read(main, 4096):
            shown += chunk
    os.close(main)
    assert done.returncode == 0
    assert b"pulling 100%" in shown
    assert b"%" not in done.stdout  # the report line, no progress


def test_exit_status_partial_and_unreachable(machines, redis_server):
    a, b = machines
    kernels = _fill(a, 2)
    a.push()
    client, name = _in_redis(redis_server, kernels[0])
    client.set(name, b"not a value")
    write_ini(b.root)
    partial = _cli(b, "pull")
    assert partial.returncode == 1, partial.stderr
    assert "1 entry written" in partial.stdout and "corrupt: " + kernels[0] in partial.stdout
    dead = _cli(b, "pull", "--remote", "redis://127.0.0.1:1/0")
    assert dead.returncode == 4
    assert dead.stderr.startswith("opcache: error:") and dead.stderr.count("\n") == 1


def _pushed_by_hand(a: Machine, bundles: list[cann_transfer.Bundle]) -> None:
    """Entries put in the remote (and its index) as a pusher of other code might."""
    from opcache.storage import open_remote

    ns = cann_transfer.Namespace(SOC, "7.0.RC1", "7.0.RC1", _driver_digest(a))
    remote = open_remote(a.settings().remote)
    try:
        for bundle in bundles:
            manifest = cann_transfer._manifest(ns, bundle)
            remote.put(ns.remote_chip, bundle.kernel, manifest, bundle.files)
        rows = {b.kernel: (int(NOW) - i, b.size) for i, b in enumerate(bundles)}
        cann_transfer._write_index(remote, ns, rows)
    finally:
        remote.close()


def _bundle_of(chip: Path, kernel: str, atime: int) -> cann_transfer.Bundle:
    paths = store_entry(chip, kernel, os.urandom(200))
    return cann_transfer.Bundle(kernel, atime, {p.name: p.read_bytes() for p in paths})


def test_a_pulled_entry_recorded_as_used_in_the_future_neither_aborts_nor_pins(machines, tmp_path):
    a, b = machines
    kernels = [kernel_name("Add", f"f{i}") for i in range(3)]
    atimes = [int(NOW) - 60, 10**19, 10**13]
    _pushed_by_hand(
        a, [_bundle_of(tmp_path / "src", k, t) for k, t in zip(kernels, atimes, strict=True)]
    )
    write_ini(b.root)
    report = b.pull()
    assert (report["written"], report["rejected"]) == (3, [])
    assert max(os.stat(b.chip / f"{k}.o").st_atime for k in kernels) <= time.time() + 1


def test_a_pulled_entry_named_as_cann_aging_lock_is_refused(machines, tmp_path):
    a, b = machines
    kernels = ["op_cache_file_del", kernel_name("Add", "after it")]
    _pushed_by_hand(a, [_bundle_of(tmp_path / "src", k, int(NOW)) for k in kernels])
    write_ini(b.root)
    report = b.pull()
    assert report["written"] == 1
    assert [r["entry"] for r in report["rejected"]] == ["op_cache_file_del"]
    assert not (b.chip / "op_cache_file_del.json").exists()


def test_an_entry_named_as_cann_aging_lock_is_not_pushed(machines):
    a, _ = machines
    _fill(a, 1)
    store_entry(a.chip, "op_cache_file_del", os.urandom(100))
    report = a.push()
    assert report["sent"] == 1
    assert [s["entry"] for s in report["skipped"]] == ["op_cache_file_del"]


def _toolkit_change(root: Path, adk: str = "8.0.RC1") -> None:
    """What CANN's first compile under another toolkit does to the shared ini: its
    versions rewritten in place (its own chip folder wiped, the others kept)."""
    ini = root / "op_cache.ini"
    ini.write_text(ini.read_text().replace("7.0.RC1", adk))


def test_entries_older_than_the_last_toolkit_change_are_not_given(machines, tmp_path):
    a, b = machines
    old = kernel_name("Add", "310p under 7.0")
    set_times(store_entry(a.root / "Ascend310P3", old, b"\x7fELF by 7.0"), NOW - 60)
    _toolkit_change(a.root)  # an 8.0 compile on the 910B1 wiped only its own folder
    new = kernel_name("Add", "910b under 8.0")
    store_entry(a.chip, new, b"\x7fELF by 8.0")

    pushed = cann_transfer.push(settings=a.settings(), environ=a.env)["chips"]
    assert pushed["Ascend310P3"]["sent"] == 0
    assert [s["entry"] for s in pushed["Ascend310P3"]["skipped"]] == [old]
    assert "predate the last toolkit change" in pushed["Ascend310P3"]["skipped"][0]["why"]
    assert (pushed[SOC]["sent"], pushed[SOC]["namespace"]["adk_version"]) == (1, "8.0.RC1")
    exported = cann_transfer.export_archive(
        tmp_path / "a.tar", settings=a.settings(), environ=a.env
    )["chips"]
    assert exported["Ascend310P3"]["entries"] == 0 and exported[SOC]["entries"] == 1

    b.toolkit(adk="8.0.RC1", ops="8.0.RC1")
    pulled = cann_transfer.pull("Ascend310P3", settings=b.settings(), environ=b.env)
    assert pulled["chips"]["Ascend310P3"].get("written", 0) == 0
    assert not (b.root / "Ascend310P3" / f"{old}.json").exists()


def test_an_ini_changed_during_a_push_stops_what_is_read_after(machines):
    a, _ = machines
    kernels = _fill(a, 3)

    def progress(percent: int) -> None:
        if percent < 50:  # after the first entry read
            _toolkit_change(a.root)

    report = a.push(progress=progress)
    assert report["sent"] == 1
    assert [s["entry"] for s in report["skipped"]] == kernels[1:]
    assert {s["why"] for s in report["skipped"]} == {cann_transfer.INI_CHANGED}


@pytest.mark.parametrize("chip", [SOC, "Ascend310P3"])
def test_no_ini_is_made_over_entries_of_unknown_versions(machines, tmp_path, chip):
    a, b = machines
    _fill(a, 1)
    a.push()
    exported = cann_transfer.export_archive(
        tmp_path / "a.tar", SOC, settings=a.settings(), environ=a.env
    )
    assert exported["chips"][SOC]["entries"] == 1
    # B's folder is left from another toolkit, its ini gone: CANN's first compile
    # there wipes the chip folder; an ini made now would keep these under 7.0.RC1.
    old = kernel_name("Mul", "old toolkit")
    store_entry(b.root / chip, old, b"\x7fELF by 6.0")
    (b.root / "op_cache.ini").unlink()
    b.toolkit()
    for report in (
        b.pull(),
        cann_transfer.import_archive(tmp_path / "a.tar", settings=b.settings(), environ=b.env)[
            "chips"
        ][SOC],
    ):
        assert "run one compile first" in report["refused"]
        assert chip in report["refused"]
    assert not (b.root / "op_cache.ini").exists()


def test_an_ini_is_made_beside_opcache_s_own_entries(machines, tmp_path):
    """opcache's entries, in its buckets of the chip folder, are keyed by their toolkit
    and never read by CANN: a pull made no ini over them, and was refused."""
    from helpers_cache import ToyCompiler, make_request, make_settings

    a, b = machines
    _fill(a, 1)
    a.push()
    with opcache.OpCache(make_settings(b.base, tmp_path)) as cache:
        request = make_request(soc_version=SOC)
        assert cache.compile(request, ToyCompiler(tmp_path / "t"), tmp_path / "o").status == "miss"
    assert not (b.root / "op_cache.ini").exists()  # (no toolkit: none made)
    b.toolkit()
    report = b.pull()
    assert report["ini_created"] and report["written"] == 1


def test_no_ini_is_made_over_a_chip_folder_that_is_a_link(machines):
    """CANN follows the link, and would take the files behind it for the installed
    toolkit's."""
    a, b = machines
    _fill(a, 1)
    a.push()
    elsewhere = b.base / "elsewhere"
    store_entry(elsewhere, kernel_name("Mul", "old toolkit"), b"\x7fELF by 6.0")
    b.root.mkdir(parents=True)
    (b.root / "Ascend310P3").symlink_to(elsewhere)
    b.toolkit()
    assert "run one compile first" in b.pull()["refused"]
    assert not (b.root / "op_cache.ini").exists()


def test_an_ini_is_made_beside_locks_alone(machines):
    a, b = machines
    _fill(a, 1)
    a.push()
    b.chip.mkdir(parents=True)
    (b.chip / "op_cache_file_del.lock").touch()
    b.toolkit()
    report = b.pull()
    assert report["ini_created"] and report["written"] == 1


def _put_value(a: Machine, chip: str, key: str, value: object) -> None:
    """A value of the remote's index put by hand (``json.dumps``'d unless bytes)."""
    from opcache.storage.entry import make_manifest

    data = value if isinstance(value, bytes) else json.dumps(value, separators=(",", ":")).encode()
    files = {cann_transfer.INDEX_FILE: data}
    manifest = make_manifest(key, files, 0.0, {"soc": SOC}, time.time())
    client = cann_transfer._connect(a.settings())
    try:
        client.discard(chip, key)  # (a folder remote keeps the first value of a key)
        client.put(chip, key, manifest, files)
    finally:
        client.close()


def _put_index(a: Machine, index: object) -> None:
    _put_value(a, f"cann:{SOC}", cann_transfer.INDEX, index)


def _put_shard(a: Machine, ident: str, shard: int, rows: object, fmt: int = 2) -> None:
    key = cann_transfer._shard_key(shard)
    _put_value(a, f"cann:{SOC}:{ident}", key, {"format": fmt, "rows": rows})


_SPACE = {"adk_version": "7", "ops_version": "7", "driver": "d", "shards": 256}


@pytest.mark.parametrize(
    "head, part",
    [
        (["oops"], None),
        ({"x": "oops"}, None),
        ({"x": {**_SPACE, "adk_version": 7}}, None),
        ({"x": {**_SPACE, "shards": "many"}}, None),
        (None, ["oops"]),
        (None, {"k": [1]}),
        (None, b"not json"),
    ],
)
def test_a_damaged_remote_index_is_read_as_empty_and_mended_by_a_push(machines, head, part):
    a, b = machines
    kernels = _fill(a, 2)
    write_ini(b.root)
    if head is not None:
        _put_index(a, {"format": 2, "soc": SOC, "namespaces": head})
        assert b.pull().get("written", 0) == 0  # nothing of its namespace, no traceback
    ident = a.push()["namespace"]["id"]
    if part is not None:  # the part of the index naming the first kernel damaged
        shard = cann_transfer._shard_of(kernels[0])
        if isinstance(part, bytes):
            _put_value(a, f"cann:{SOC}:{ident}", cann_transfer._shard_key(shard), part)
        else:
            _put_shard(a, ident, shard, part)
        assert b.pull()["written"] == sum(cann_transfer._shard_of(k) != shard for k in kernels)
    pushed = a.push()  # (nothing to send: the damaged part is written again all the same)
    assert (pushed["sent"], pushed.get("errors")) == (0, None)
    b.pull()
    assert {p.name[: -len(".json")] for p in b.chip.glob("*.json")} == set(kernels)
    read, damaged = _index_of(a, with_damage=True)
    assert not damaged and len(read[ident]["entries"]) == len(kernels)


@pytest.mark.parametrize("bad", ["te_bad_\ud800", "#index-20"])
def test_a_row_no_pull_can_fetch_is_left_out_as_damaged_and_mended_by_a_push(machines, bad):
    """A row named with a lone surrogate (JSON carries one: every pull ended in a
    traceback) or as a part of the index (fetched as a kernel, rejected: exit 1 at every
    pull) is a damaged row: left out with a warning, dropped by the next push."""
    a, b = machines
    kernels = _fill(a, 3, size=16)
    ident = a.push()["namespace"]["id"]
    shard = cann_transfer._shard_of(kernels[0])
    rows = {
        k: list(row)
        for k, row in _index_of(a)[ident]["entries"].items()
        if cann_transfer._shard_of(k) == shard
    }
    _put_shard(a, ident, shard, {**rows, bad: [int(NOW) + 10, 16]})  # (the newest row)
    write_ini(b.root)
    done = _cli(b, "pull", "--json")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert f"part {shard:02x} of the remote's index is damaged" in done.stderr
    report = json.loads(done.stdout)["chips"][SOC]
    assert (report["written"], report["rejected"]) == (3, [])
    assert a.push().get("errors") is None
    read, damaged = _index_of(a, with_damage=True)
    assert not damaged and sorted(read[ident]["entries"]) == sorted(kernels)


@pytest.mark.parametrize("how", ["push", "export"])
def test_an_entry_over_the_cap_is_left_out_without_being_read(machines, tmp_path, how):
    a, _ = machines
    _fill(a, 1)
    big = kernel_name("Big", "header")
    store_entry(a.chip, big, b"\x7fELF small", header=b"// h\n")
    os.truncate(a.chip / f"{big}.h", 256 << 20)  # sparse: a quarter GiB on no disk
    tracemalloc.start()
    try:
        if how == "push":
            report = a.push()
            left_out = report["not_sent"]
        else:
            report = cann_transfer.export_archive(
                tmp_path / "a.tar", SOC, settings=a.settings(), environ=a.env
            )["chips"][SOC]
            left_out = report["skipped"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [s["entry"] for s in left_out] == [big]
    assert report.get("sent", report.get("entries")) == 1
    assert peak < 128 << 20  # (a json is read into a buffer of 64 MiB, untouched)


RESERVED = ["te_add_abc_pre", "te_mm_abc_mix_aic", "te_mm_abc_mix_aiv", "te_x.json"]


def test_pulled_or_imported_entries_named_as_cann_other_files_are_refused(machines, tmp_path):
    a, b = machines
    bundles = [_bundle_of(tmp_path / "src", k, int(NOW)) for k in [*RESERVED, "te_add_ok"]]
    _pushed_by_hand(a, bundles)
    write_ini(b.root)
    report = b.pull()
    assert report["written"] == 1
    assert sorted(r["entry"] for r in report["rejected"]) == sorted(RESERVED)
    assert sorted(p.name for p in b.chip.glob("*.json")) == ["te_add_ok.json"]

    from opcache.archive import CANN, ArchiveWriter

    ns = cann_transfer.Namespace(SOC, "7.0.RC1", "7.0.RC1", _driver_digest(a))
    with ArchiveWriter(tmp_path / "e.tar", CANN) as out:
        for bundle in bundles:
            out.add(SOC, bundle.kernel, cann_transfer._manifest(ns, bundle), bundle.files, NOW)
    shutil.rmtree(b.chip)
    imported = cann_transfer.import_archive(
        tmp_path / "e.tar", settings=b.settings(), environ=b.env
    )
    assert sorted(r["entry"] for r in imported["chips"][SOC]["rejected"]) == sorted(RESERVED)
    assert sorted(p.name for p in b.chip.glob("*.json")) == ["te_add_ok.json"]


def test_an_entry_with_a_dot_in_its_kernel_name_is_not_pushed(machines):
    a, _ = machines
    _fill(a, 1)
    store_entry(a.chip, "te_x.y", os.urandom(100))
    report = a.push()
    assert report["sent"] == 1
    assert [s["entry"] for s in report["skipped"]] == ["te_x.y"]


def test_custom_packages_compare_by_their_files_not_bytecode_nor_link_text(machines, tmp_path):
    """Python writes __pycache__ beside an implementation CANN imports: A's namespace
    changed after its first compile, and no machine shared with another.  A link in a
    package was taken by its target's path: two machines whose links lead to other
    implementations shared entries."""
    a, b = machines
    _custom_package(a, b"same tiling")
    _custom_package(b, b"same tiling")
    cache = a.base / "custom_opp" / "op_impl" / "ai_core" / "tbe" / "__pycache__"
    cache.mkdir()
    (cache / "my_add.cpython-311.pyc").write_bytes(os.urandom(64))
    _fill(a, 2)
    assert a.push()["sent"] == 2
    b.toolkit()
    assert b.pull()["written"] == 2
    for machine, code in ((a, "def my_add(): return 1\n"), (b, "def my_add(): return 2\n")):
        impl = machine.base / "impl"
        impl.mkdir()
        (impl / "my_add.py").write_text(code)
        (machine.base / "custom_opp" / "op_impl" / "linked").symlink_to(impl)
    c_entry = kernel_name("Mul", "after")
    store_entry(a.chip, c_entry, b"x")
    a.push()
    assert "custom operator packages" in b.pull()["refused"]


def _after(path: Path) -> None:
    """Wait until a file written now gets a later time than ``path``'s (file times tick
    with the kernel's clock, coarser than ``time.time``)."""
    probe = path.parent / ".tick"
    while True:
        probe.write_bytes(b"")
        if probe.stat().st_mtime_ns > path.stat().st_mtime_ns:
            probe.unlink()
            return
        time.sleep(0.001)


@pytest.mark.parametrize("change", ["custom package", "package restored by tar", "driver"])
def test_entries_compiled_before_a_driver_or_package_change_are_not_given(
    machines, tmp_path, change
):
    """CANN keeps its folder when a driver or custom operator package changes: the old
    kernels went to the remote filed under the new one's namespace, and a machine with
    the new package pulled them.  A tar or rpm install restores old modification
    times: the change time tells."""
    a, b = machines
    _custom_package(a, b"tiling v1")
    old = _fill(a, 2)
    assert a.push()["sent"] == 2
    _after(a.chip / f"{old[0]}.json")
    impl = a.base / "custom_opp" / "op_impl" / "ai_core" / "tbe" / "my_add.py"
    changed = impl if change != "driver" else tmp_path / "driver" / "version.info"
    before = changed.stat().st_mtime
    changed.write_text("def my_add(): return 2\n" if change != "driver" else "Version=25.0\n")
    if change != "custom package":
        os.utime(changed, (before, before))  # as tar and rpm set it back
    new = kernel_name("Mul", "after the change")
    store_entry(a.chip, new, b"\x7fELF by v2")

    report = a.push()
    assert report["sent"] == 1
    assert [s["entry"] for s in report["skipped"]] == old
    assert "predate the last driver or custom operator package" in report["skipped"][0]["why"]
    exported = cann_transfer.export_archive(
        tmp_path / "a.tar", SOC, settings=a.settings(), environ=a.env
    )["chips"][SOC]
    assert exported["entries"] == 1 and len(exported["skipped"]) == 2

    _custom_package(b, b"tiling v1")
    (b.base / "custom_opp" / "op_impl" / "ai_core" / "tbe" / "my_add.py").write_text(
        impl.read_text()
    )
    b.toolkit()
    assert b.pull()["written"] == 1
    assert sorted(p.stem for p in b.chip.glob("*.json")) == [new]


@pytest.mark.parametrize("step", ["first import", "clean"])
def test_bytecode_python_writes_or_a_clean_step_deletes_holds_back_no_entry(machines, step):
    """A package folder's own times were stamped: the __pycache__ Python makes at its
    first import, or a clean step's deleting it, kept every entry before from being
    given for good, though the namespace's files were unchanged."""
    a, _ = machines
    _custom_package(a, b"tiling v1")
    tbe = a.base / "custom_opp" / "op_impl" / "ai_core" / "tbe"
    if step == "clean":
        (tbe / "__pycache__").mkdir()
    old = _fill(a, 2)
    _after(a.chip / f"{old[0]}.json")
    if step == "clean":
        (tbe / "__pycache__").rmdir()
    else:
        (tbe / "__pycache__").mkdir()
        (tbe / "__pycache__" / "my_add.cpython-311.pyc").write_bytes(os.urandom(64))
    report = a.push()
    assert (report["sent"], report["skipped"]) == (2, [])


def test_entries_compiled_with_a_package_since_removed_are_not_given(machines):
    a, _ = machines
    _custom_package(a, b"tiling v1")
    old = _fill(a, 2)
    _after(a.chip / f"{old[0]}.json")
    shutil.rmtree(a.base / "custom_opp")  # its ASCEND_CUSTOM_OPP_PATH left set
    report = a.push()
    assert (report["sent"], len(report["skipped"])) == (0, 2)
    assert report["namespace"].get("custom") is None


def test_a_package_changed_while_a_push_lists_the_folder_refuses_it(machines, monkeypatch):
    """An entry compiled with the new package before the folder is listed, the namespace
    digested from the old one: it went to the old one's namespace."""
    a, _ = machines
    _custom_package(a, b"tiling v1")
    _fill(a, 1)
    real = cann_transfer.entry_json_stats

    def package_changes_then_scan(fd: int):  # type: ignore[no-untyped-def]
        impl = a.base / "custom_opp" / "op_impl" / "ai_core" / "tbe" / "my_add.py"
        _after(impl)
        impl.write_text("def my_add(): return 2\n")
        store_entry(a.chip, kernel_name("Mul", "v2"), b"\x7fELF by v2")
        return real(fd)

    monkeypatch.setattr(cann_transfer, "entry_json_stats", package_changes_then_scan)
    report = a.push()
    assert "custom operator package changed" in report["refused"]


def test_a_refused_export_leaves_an_existing_file_as_it_was(machines, tmp_path, capsys):
    from opcache.cli import main

    a, _ = machines
    _fill(a, 1)
    mine = tmp_path / "notes.tar"
    mine.write_bytes(b"the user's own file")
    argv = ["cann", "export", str(mine), "--op_compiler_cache_dir", str(a.base)]
    status = main([*argv, "--soc_version", "Ascend310P3"])  # no such chip folder here
    err = capsys.readouterr().err
    assert status == 3 and err.startswith("opcache: error: ") and err.count("\n") == 1
    assert mine.read_bytes() == b"the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir() if "notes" in p.name) == ["notes.tar"]


def test_folders_named_as_no_chip_is_are_neither_pushed_nor_exported(machines, tmp_path):
    """lost+found, a copy kept by hand, notes: each was taken for a chip, exported (and the
    archive then refused whole by import) or pushed as ``cann:notes by alice``."""
    a, b = machines
    kernels = _fill(a, 2)
    (a.root / "lost+found").mkdir()
    shutil.copytree(a.chip, a.root / f"{SOC}.bak")
    store_entry(a.root / "notes by alice", kernel_name("Add", "notes"), b"\x7fELF")
    others = sorted(["lost+found", f"{SOC}.bak", "notes by alice"])

    pushed = cann_transfer.push(settings=a.settings(), environ=a.env)
    assert list(pushed["chips"]) == [SOC] and pushed["not_chip_folders"] == others
    assert pushed["chips"][SOC]["sent"] == 2
    exported = cann_transfer.export_archive(
        tmp_path / "a.tar", settings=a.settings(), environ=a.env
    )
    assert list(exported["chips"]) == [SOC] and exported["not_chip_folders"] == others

    b.toolkit()
    imported = cann_transfer.import_archive(
        tmp_path / "a.tar", settings=b.settings(), environ=b.env
    )
    assert imported["chips"][SOC]["written"] == 2
    assert sorted(p.stem for p in b.chip.glob("*.json")) == sorted(kernels)
    with pytest.raises(opcache.ConfigError):
        cann_transfer.pull("../elsewhere", settings=b.settings(), environ=b.env)
    assert not (b.base / "elsewhere").exists()


def _damage_folder_value(share: Path, kernel: str) -> None:
    (binary,) = [p for p in share.rglob(f"{kernel}.o")]
    data = bytearray(binary.read_bytes())
    data[0] ^= 0xFF
    binary.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["redis", "folder"])
def test_a_damaged_remote_entry_is_discarded_by_a_pull_and_sent_again_by_a_push(
    machines, redis_server, tmp_path, kind
):
    """Push asks only whether a key is there: a damaged value stood for good, every pull
    reporting it corrupt (exit 1) and every push saying it was already there."""
    a, b = machines
    if kind == "folder":
        a.url = b.url = f"file://{tmp_path / 'share'}"
        (tmp_path / "share").mkdir()
    kernels = _fill(a, 3)
    a.push()
    if kind == "redis":
        client, name = _in_redis(redis_server, kernels[0])
        client.set(name, client.get(name)[:-20] + bytes(20))
    else:
        _damage_folder_value(tmp_path / "share", kernels[0])
    write_ini(b.root)
    first = b.pull()
    assert [c["entry"] for c in first["corrupt"]] == [kernels[0]]
    assert first["discarded"] == [kernels[0]]
    assert (a.push()["sent"], b.pull()["written"]) == (1, 1)
    assert sorted(p.stem for p in b.chip.glob("*.json")) == sorted(kernels)


def test_a_pull_says_what_it_discarded_without_json(machines, redis_server, monkeypatch, capsys):
    """Only --json listed the damaged entries a pull removed from the remote."""
    from opcache.cli import main

    a, b = machines
    kernels = _fill(a, 2)
    a.push()
    client, name = _in_redis(redis_server, kernels[0])
    client.set(name, client.get(name)[:-20] + bytes(20))
    write_ini(b.root)
    for variable, value in {**b.env, "OPCACHE_REMOTE": b.url}.items():
        monkeypatch.setenv(variable, value)
    argv = ["cann", "pull", "--soc_version", SOC, "--op_compiler_cache_dir", str(b.base)]
    assert main(argv) == 1  # (a damaged entry: some not moved)
    assert f"discarded: {kernels[0]}" in capsys.readouterr().out


def test_a_read_only_pull_discards_nothing(machines, redis_server, monkeypatch):
    a, b = machines
    kernels = _fill(a, 2)
    a.push()
    client, name = _in_redis(redis_server, kernels[0])
    damaged = client.get(name)[:-20] + bytes(20)
    client.set(name, damaged)
    write_ini(b.root)
    monkeypatch.setenv("OPCACHE_REMOTE_READ_ONLY", "1")
    report = b.pull()
    assert (report["corrupt"][0]["entry"], report["discarded"]) == (kernels[0], [])
    assert client.get(name) == damaged


def test_a_value_of_another_format_is_left_on_the_remote(machines, redis_server):
    """Another opcache's value, sound to it: a pull that cannot read it leaves it."""
    import xxhash

    a, b = machines
    kernels = _fill(a, 2)
    a.push()
    client, name = _in_redis(redis_server, kernels[0])
    value = bytearray(client.get(name)[:-16])
    value[4] = 2  # (the format, after the magic)
    newer = bytes(value) + xxhash.xxh3_128_digest(bytes(value))
    client.set(name, newer)
    write_ini(b.root)
    report = b.pull()
    assert "format" in report["corrupt"][0]["why"] and report["discarded"] == []
    assert client.get(name) == newer


def test_an_entry_over_a_pulling_machine_s_cap_is_left_on_an_http_remote(
    machines, nginx, monkeypatch
):
    """The HTTP cache words an object over the cap without a number after "over": a
    pull with a smaller cap than the pusher's took it for damage and deleted it, for
    every machine."""
    a, b = machines
    a.url = b.url = nginx.url()
    kernels = _fill(a, 2, size=1_500_000)
    assert a.push()["sent"] == 2
    write_ini(b.root)
    monkeypatch.setenv("OPCACHE_REMOTE_MAX_ENTRY_MB", "1")
    report = b.pull()
    assert sorted(c["entry"] for c in report["corrupt"]) == sorted(kernels)
    assert all(c["maybe_sound"] for c in report["corrupt"]) and report["discarded"] == []
    monkeypatch.delenv("OPCACHE_REMOTE_MAX_ENTRY_MB")
    assert b.pull()["written"] == 2


def test_an_export_into_a_missing_folder_names_the_file_asked_for(machines, tmp_path, capsys):
    from opcache.cli import main

    a, _ = machines
    _fill(a, 1)
    wanted = tmp_path / "missing" / "a.tar"
    status = main(["cann", "export", str(wanted), "--op_compiler_cache_dir", str(a.base)])
    err = capsys.readouterr().err
    assert status == 4 and err.startswith("opcache: error: ") and err.count("\n") == 1
    assert f"'{wanted}'" in err and ".a.tar." not in err


def test_an_empty_soc_version_names_every_chip_in_the_library_too(machines, tmp_path):
    """As on the command line (``--soc_version ''`` names no chip): an empty chip name is
    unset, not a chip folder named ''."""
    a, b = machines
    _fill(a, 2)
    pushed = cann_transfer.push("", settings=a.settings(), environ=a.env)["chips"]
    assert list(pushed) == [SOC] and pushed[SOC]["sent"] == 2
    exported = cann_transfer.export_archive(
        tmp_path / "a.tar", "", settings=a.settings(), environ=a.env
    )
    assert list(exported["chips"]) == [SOC]
    write_ini(b.root)
    b.chip.mkdir(parents=True)
    assert (
        cann_transfer.pull("", settings=b.settings(), environ=b.env)["chips"][SOC]["written"] == 2
    )
    shutil.rmtree(b.chip)
    imported = cann_transfer.import_archive(
        tmp_path / "a.tar", "", settings=b.settings(), environ=b.env
    )
    assert imported["chips"][SOC]["written"] == 2


def test_pull_keeps_the_aging_lock_when_op_cache_ini_is_another_name_of_it(machines, monkeypatch):
    """The ini was read after the aging lock was taken: one that is a hard link to the
    lock's file (a member of a group cache can make it) let go of the lock when closed,
    and CANN's aging could run while the entries went in."""
    a, b = machines
    _fill(a, 2)
    a.push()
    b.toolkit()
    b.chip.mkdir(parents=True)
    aging_lock = b.chip / "op_cache_file_del.lock"
    aging_lock.write_text("[op_compiler_cache]\nadk_version=7.0.RC1\nops_version=7.0.RC1\n")
    os.link(aging_lock, b.root / "op_cache.ini")
    seen = []
    store = cann_transfer._Writer._store

    def probing(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(lock_probe(aging_lock))
        return store(self, *args, **kwargs)

    monkeypatch.setattr(cann_transfer._Writer, "_store", probing)
    report = b.pull()
    assert report["written"] == 2
    assert seen == ["held", "held"]


def _cann_of_a_new_toolkit_starts(root: Path, soc: str = SOC) -> None:
    """CANN's DelCachedFiles under another toolkit: the shared ini's versions rewritten
    (UpdateOpCacheIniFile), then the chip folder emptied, locks and temps too."""
    _toolkit_change(root)
    for path in (root / soc).iterdir():
        path.unlink()


def _old_kernels_in(chip: Path, kernels: list[str]) -> list[str]:
    return sorted(k for k in kernels if (chip / f"{k}.json").exists() or (chip / f"{k}.o").exists())


@pytest.mark.parametrize("when", ["before an entry", "after an entry is shown"])
def test_a_toolkit_change_during_a_pull_leaves_no_old_kernel_under_the_new_ini(
    machines, monkeypatch, when
):
    """A CANN of a new toolkit starts compiling while a pull runs: the pull went on
    writing the old toolkit's kernels, which the new CANN reuses (its kernel names
    carry no toolkit version) and B's next push published under the new namespace."""
    a, b = machines
    kernels = _fill(a, 100, size=500)
    assert a.push()["sent"] == 100
    write_ini(b.root)
    b.chip.mkdir()
    calls = [0]
    if when == "before an entry":
        real = cann_transfer._Writer.write

        def write(self, bundle):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] == 50:
                _cann_of_a_new_toolkit_starts(b.root)
            return real(self, bundle)

        monkeypatch.setattr(cann_transfer._Writer, "write", write)
    else:  # the ini rewritten right after the 50th json is renamed, the wipe after the check
        changed = cann_transfer.IniMark.changed

        def probing(self):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] == 50:
                _toolkit_change(b.root)
                seen = changed(self)
                for path in b.chip.iterdir():
                    path.unlink()
                return seen
            return changed(self)

        monkeypatch.setattr(cann_transfer.IniMark, "changed", probing)
    report = b.pull()
    monkeypatch.undo()
    assert report["errors"] == [cann_transfer.TOOLKIT_CHANGED]
    assert report["written"] == 49  # (wiped by the new CANN)
    assert _old_kernels_in(b.chip, kernels) == []
    assert [p.name for p in b.chip.iterdir()] in ([], [f"{kernels[49]}.lock"])
    assert "adk_version=8.0.RC1" in (b.root / "op_cache.ini").read_text()
    # Nothing of 7.0.RC1 goes out as 8.0.RC1's.
    pushed = b.push()
    assert (pushed["namespace"]["adk_version"], pushed["entries"], pushed["sent"]) == (
        "8.0.RC1",
        0,
        0,
    )


def _cli_patched(machine: Machine, patch: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``opcache cann ARGS`` in a process of its own, ``patch`` (Python, with
    ``cann_transfer`` and ``Path`` at hand) run first: what another process does
    meanwhile, at a set point."""
    env = {**os.environ, **machine.env, "OPCACHE_REMOTE": machine.url}
    code = (
        "import os, sys, runpy\nfrom pathlib import Path\nfrom opcache import cann_transfer\n"
        f"{patch}\nsys.argv = ['opcache', *sys.argv[1:]]\n"
        "runpy.run_module('opcache', run_name='__main__')\n"
    )
    argv = [sys.executable, "-c", code, "cann", *args]
    argv += ["--op_compiler_cache_dir", str(machine.base), "--soc_version", SOC]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_the_command_line_says_a_toolkit_change_stopped_the_pull_in_one_line(machines):
    a, b = machines
    kernels = _fill(a, 40, size=500)
    a.push()
    write_ini(b.root)
    b.chip.mkdir()
    patch = f"""
real, calls = cann_transfer._Writer.write, [0]
def write(self, bundle):
    calls[0] += 1
    if calls[0] == 20:  # CANN of 8.0.RC1: the ini rewritten, then the folder wiped
        ini = Path({str(b.root / "op_cache.ini")!r})
        ini.write_text(ini.read_text().replace("7.0.RC1", "8.0.RC1"))
        for name in os.listdir({str(b.chip)!r}):
            os.unlink(os.path.join({str(b.chip)!r}, name))
    return real(self, bundle)
cann_transfer._Writer.write = write
"""
    done = _cli_patched(b, patch, "pull")
    assert done.returncode == 1, done
    assert "op_cache.ini changed while entries went in" in done.stdout
    assert done.stderr.count("op_cache.ini changed") == 1, done.stderr  # one warning
    assert _old_kernels_in(b.chip, kernels) == []


def test_a_toolkit_change_during_an_import_leaves_no_old_kernel_under_the_new_ini(
    machines, monkeypatch, tmp_path
):
    a, b = machines
    kernels = _fill(a, 20, size=500)
    path = tmp_path / "a.tar"
    exported = cann_transfer.export_archive(path, SOC, settings=a.settings(), environ=a.env)
    assert exported["chips"][SOC]["entries"] == 20
    write_ini(b.root)
    b.chip.mkdir()
    real = cann_transfer._Writer.write
    calls = [0]

    def write(self, bundle):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 10:
            _cann_of_a_new_toolkit_starts(b.root)
        return real(self, bundle)

    monkeypatch.setattr(cann_transfer._Writer, "write", write)
    report = cann_transfer.import_archive(path, SOC, settings=b.settings(), environ=b.env)
    chip = report["chips"][SOC]
    assert chip["errors"] == [cann_transfer.TOOLKIT_CHANGED]
    assert calls[0] == 10  # nothing tried after
    assert _old_kernels_in(b.chip, kernels) == []


@pytest.mark.parametrize("versions", ["8.0.0", "7.0.RC1"])
def test_an_ini_another_process_makes_before_the_pull_does_must_name_its_toolkit(
    machines, monkeypatch, versions
):
    """No ini when the pull read it; a CANN of another toolkit made one (and wiped)
    before the pull's own: the pull reported ini_created and wrote its toolkit's
    kernels under the other's ini."""
    a, b = machines
    _fill(a, 5)
    assert a.push()["sent"] == 5
    b.toolkit()  # 7.0.RC1, as A's ini
    real = cann_transfer.create_ini

    def create_ini(path, *rest):  # type: ignore[no-untyped-def]
        path.write_text(f"[op_compiler_cache]\nadk_version={versions}\nops_version={versions}\n")
        return real(path, *rest)

    monkeypatch.setattr(cann_transfer, "create_ini", create_ini)
    report = b.pull()
    if versions == "7.0.RC1":  # (another pull of the same toolkit, say)
        assert (report["written"], report["ini_created"]) == (5, False)
        return
    assert "says adk_version 8.0.0, ops_version 8.0.0" in report["refused"]
    assert not [p for p in b.chip.iterdir() if p.name.endswith((".json", ".o"))]
    (b.root / "op_cache.ini").unlink()
    patch = """
real = cann_transfer.create_ini
def create_ini(path, *rest):
    path.write_text('[op_compiler_cache]\\nadk_version=8.0.0\\nops_version=8.0.0\\n')
    return real(path, *rest)
cann_transfer.create_ini = create_ini
"""
    done = _cli_patched(b, patch, "pull")
    assert done.returncode == 3, done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("opcache: error: "), done


def _rows(count: int, atime: int) -> dict[str, list[int]]:
    """``count`` index rows, as other machines' pushes leave them."""
    return {kernel_name("Old", str(i)): [atime, 4096] for i in range(count)}


def _index_of(machine: Machine, *, with_damage: bool = False):  # type: ignore[no-untyped-def]
    """The remote's index whole: {namespace: {versions, pushed, entries: {kernel: row}}}."""
    client = cann_transfer._connect(machine.settings())
    try:
        spaces, damaged = cann_transfer._read_head(client, SOC)
        for ident, space in spaces.items():
            space["entries"] = {}
            for _, rows, state in cann_transfer._shards(client, _Named(ident)):
                space["entries"].update(rows)
                damaged |= state != cann_transfer.SOUND
    finally:
        client.close()
    return (spaces, damaged) if with_damage else spaces


class _Named:
    """A namespace known by its id alone, as the index's parts are read."""

    def __init__(self, ident: str) -> None:
        self.remote_chip = f"cann:{SOC}:{ident}"


def test_namespaces_not_pushed_for_30_days_leave_the_index(machines):
    """The head keeps every namespace ever pushed, each one's parts beside its entries:
    one no push wrote or confirmed for 30 days leaves it, and its parts go."""
    a, b = machines
    kernels = _fill(a, 300, size=16)
    now = int(time.time())
    day = 86400
    _put_index(
        a,
        {
            "format": 2,
            "soc": SOC,
            "namespaces": {
                "stale": {**_SPACE, "pushed": now - 31 * day},
                "recent": {**_SPACE, "pushed": now - 2 * day},
                "unstamped": _SPACE,
            },
        },
    )
    _put_shard(a, "stale", 7, _rows(10, now))
    pushed = a.push()
    assert (pushed["sent"], pushed.get("errors")) == (300, None)
    index = _index_of(a)
    assert sorted(index) == sorted(["recent", "unstamped", pushed["namespace"]["id"]])
    assert index["recent"]["pushed"] == now - 2 * day
    assert 0 <= index["unstamped"]["pushed"] - now < 60  # (its 30 days start now)
    assert 0 <= index[pushed["namespace"]["id"]]["pushed"] - now < 60
    client = cann_transfer._connect(a.settings())
    try:
        assert not client.have_many(f"cann:{SOC}:stale", [cann_transfer._shard_key(7)])
    finally:
        client.close()
    write_ini(b.root)
    assert b.pull()["written"] == 300
    assert {p.name[: -len(".json")] for p in b.chip.glob("*.json")} == set(kernels)


def test_a_part_of_the_index_the_remote_refuses_is_a_warning_and_exit_status_1(machines):
    """A part past the cap (1 MiB here: 11,000 rows; about 180 million kernels at the
    default 64 MiB): push must say the index was not written, and exit 1."""
    a, b = machines
    kernels = _fill(a, 2)
    ident = a.push()["namespace"]["id"]
    shard = cann_transfer._shard_of(kernel_name("New", "0"))
    news = [kernel_name("New", str(i)) for i in range(40_000)]
    news = [k for k in news if cann_transfer._shard_of(k) == shard][:40]
    now = int(time.time())
    row = len(json.dumps(_rows(2, now), separators=(",", ":"))) // 2  # (bytes a row)
    _put_shard(a, ident, shard, _rows((1 << 20) // row - 40, now))  # (1 MiB less 3 KB)
    for kernel in news:  # (each in that part: 3 KB more)
        store_entry(a.chip, kernel, b"\x7fELF new")
    env = {**os.environ, **a.env, "OPCACHE_REMOTE": a.url, "OPCACHE_REMOTE_MAX_ENTRY_MB": "1"}
    argv = [sys.executable, "-m", "opcache", "cann", "push", "--soc_version", SOC]
    done = subprocess.run(
        [*argv, "--op_compiler_cache_dir", str(a.base)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 1, done
    assert "40 entries sent" in done.stdout
    assert "index of Ascend910B1 was not written in part" in done.stdout
    assert "over the entry cap (1048576 bytes)" in done.stdout
    assert len(done.stderr.splitlines()) == 1 and "OPCACHE_REMOTE_MAX_ENTRY_MB" in done.stderr
    # The part as it was, the others written: pulls get what they name.
    write_ini(b.root)
    assert b.pull()["written"] == sum(cann_transfer._shard_of(k) != shard for k in kernels)


def test_a_part_an_http_server_refuses_as_too_big_stays_as_it_was(machines, nginx):
    """An HTTP server answering 413 to a part (its body limit outgrown): the part was
    deleted, then refused again, its rows gone from every pull.  It stays as it was:
    a warning, exit status 1."""
    a, b = machines
    a.url = nginx.url("cache")
    kernels = _fill(a, 3000, size=16)
    ident = a.push()["namespace"]["id"]
    # The same objects behind /small/ (a 1 KiB body limit: the parts outgrew it).
    shutil.copytree(nginx.data, nginx.folder / "data" / "small")
    a.url = b.url = nginx.url("small")
    big = max(range(256), key=lambda s: sum(cann_transfer._shard_of(k) == s for k in kernels))
    in_big = [k for k in kernels if cann_transfer._shard_of(k) == big]
    before = _index_of(a)[ident]["entries"]
    set_access([a.chip / f"{in_big[0]}.json", a.chip / f"{in_big[0]}.o"], NOW - 60)
    report = a.push()  # (that row changed: the part is written, and refused)
    assert report["errors"] == [
        f"the remote did not take the index of {SOC}: pulls get nothing new"
    ]
    assert _index_of(a)[ident]["entries"] == before  # (the part as it was)
    write_ini(b.root, max_mb=-1)
    assert b.pull()["written"] == len(kernels)


@pytest.mark.parametrize("how", ["over the cap", "another format", "split otherwise"])
def test_an_index_this_machine_cannot_read_is_never_replaced_by_a_new_one(
    machines, monkeypatch, how
):
    """A machine with a smaller entry cap read the cluster's index as damaged and wrote a
    new one, holding its own namespace alone: every other namespace's rows were gone.
    So with a newer opcache's head."""
    a, b = machines
    _fill(a, 2)
    ident = a.push()["namespace"]["id"]
    head = {"format": 2, "soc": SOC, "namespaces": {k: dict(v) for k, v in _index_of(a).items()}}
    for space in head["namespaces"].values():
        del space["entries"]
    head["namespaces"]["other"] = {**_SPACE, "pushed": int(time.time())}
    if how == "over the cap":
        head["namespaces"]["other"]["custom"] = "c" * (1 << 20)
        said = "cannot be read here"
    elif how == "another format":
        head["format"] = 3
        said = "of another format (3)"
    else:
        head["namespaces"]["other"]["shards"] = 512
        said = "splits namespace other otherwise (512 parts)"
    _put_index(a, head)
    if how == "over the cap":
        monkeypatch.setenv("OPCACHE_REMOTE_MAX_ENTRY_MB", "1")
    store_entry(a.chip, kernel_name("New", "one"), b"\x7fELF new")
    pushed = a.push()
    assert pushed["sent"] == 1 and said in pushed["errors"][0], pushed
    write_ini(b.root)
    assert said in b.pull()["refused"]
    monkeypatch.delenv("OPCACHE_REMOTE_MAX_ENTRY_MB", raising=False)
    client = cann_transfer._connect(a.settings())
    try:
        got = client.get_many(f"cann:{SOC}", [cann_transfer.INDEX])[cann_transfer.INDEX]
    finally:
        client.close()
    assert json.loads(got[0].files[cann_transfer.INDEX_FILE]) == head  # (as it was)
    assert ident in head["namespaces"]


def test_an_older_opcache_s_index_is_neither_read_nor_replaced(machines):
    """The index of an older opcache (one value, ``#index``, format 1) stays as it was
    for the older machines of a cluster being upgraded: this one keeps its own."""
    a, b = machines
    kernels = _fill(a, 3)
    old = {"format": 1, "soc": SOC, "namespaces": {"x": {**_SPACE, "entries": {}}}}
    _put_value(a, f"cann:{SOC}", "#index", old)
    pushed = a.push()
    assert (pushed["sent"], pushed.get("errors")) == (3, None)
    write_ini(b.root)
    assert b.pull()["written"] == len(kernels)
    client = cann_transfer._connect(a.settings())
    try:
        got = client.get_many(f"cann:{SOC}", ["#index"])["#index"]
    finally:
        client.close()
    assert json.loads(got[0].files[cann_transfer.INDEX_FILE]) == old


def _counting_json_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the jsons read and parsed as CANN parses them, from now on."""
    from opcache import cann_format

    read: list[str] = []
    real = cann_format.read_json

    def counted(fd: int, name: str) -> object:
        read.append(name)
        return real(fd, name)

    monkeypatch.setattr(cann_format, "read_json", counted)
    return read


def test_a_push_reads_only_the_jsons_of_entries_the_remote_lacks(machines, monkeypatch):
    """Every json was read and parsed, and every entry held, before the remote was asked:
    a push with nothing to send took 12 s and 468 MB at 100,000 entries."""
    a, _ = machines
    _fill(a, 40)
    assert a.push()["sent"] == 40
    read = _counting_json_reads(monkeypatch)
    again = a.push()
    assert (again["entries"], again["present"], again["sent"], again["skipped"]) == (40, 40, 0, [])
    assert read == []
    new = kernel_name("Sub", "new")
    store_entry(a.chip, new, b"new")
    assert a.push(dry_run=True)["would_send"] == 1
    assert a.push()["sent"] == 1
    assert read == [f"{new}.json", f"{new}.json"]


def test_entries_listed_after_the_driver_changed_mid_push_are_not_given(machines, monkeypatch):
    """The folder is listed a part at a time, the inputs checked again after each: an
    entry compiled after a driver change made while a push runs (listed in a later
    part) went to the old driver's namespace."""
    monkeypatch.setattr(cann_transfer, "CANDIDATES", 2, raising=False)
    monkeypatch.setattr(cann_transfer, "_LISTED", 1, raising=False)
    a, _ = machines
    kernels = _fill(a, 4)
    late = kernel_name("Mul", "by the new driver")

    def progress(percent: int) -> None:
        if percent == 25:  # the first entry sent
            driver = Path(a.env["ASCEND_DRIVER_PATH"]) / "version.info"
            _after(driver)
            driver.write_text("Version=25.0.rc1\n")
            set_access(store_entry(a.chip, late, b"\x7fELF by 25.0"), NOW - 7200)  # the oldest

    report = a.push(progress=progress)
    assert report["sent"] == 1
    assert "driver or a custom operator package changed" in report["errors"][0]
    client = cann_transfer._connect(a.settings())
    try:
        ns = cann_transfer.Namespace(SOC, "7.0.RC1", "7.0.RC1", report["namespace"]["driver"])
        assert client.have_many(ns.remote_chip, [*kernels, late]) == {kernels[0]}
    finally:
        client.close()
    assert _cli(a, "push").returncode == 0  # the next run: the new driver's namespace


def _changing_at(monkeypatch, entry: int, change) -> None:  # type: ignore[no-untyped-def]
    """``change()`` run as the writer of a pull or an import comes to its ``entry``-th
    entry: an administrator installing a driver or a package meanwhile."""
    write = cann_transfer._Writer.write
    seen = [0]

    def writing(self, bundle):  # type: ignore[no-untyped-def]
        seen[0] += 1
        if seen[0] == entry:
            change()
        return write(self, bundle)

    monkeypatch.setattr(cann_transfer._Writer, "write", writing)


@pytest.mark.parametrize("how", ["pull", "import"])
@pytest.mark.parametrize("what", ["driver", "custom package"])
@pytest.mark.parametrize("every", ["default", "each entry"])
def test_a_driver_or_package_changed_while_entries_go_in_leaves_none_to_push_as_the_new(
    machines, tmp_path, monkeypatch, how, what, every
):
    """Entries written after the change are the old driver's or package's, dated after
    the new one: a push filed them under the new namespace, and every machine with the
    new one pulled kernels of the old.  Now the writer stops, and those written since
    it last saw the inputs unchanged are taken out; the ones it saw confirmed (written
    before the change) stay, and no push gives them (older than the change)."""
    a, b = machines
    _custom_package(a, b"tiling v1")
    _custom_package(b, b"tiling v1")
    write_ini(b.root)
    kernels = _fill(a, 12)
    if every == "each entry":
        monkeypatch.setattr(cann_transfer, "_INPUTS_EVERY", 0.0)
        monkeypatch.setattr(cann_transfer, "_INPUTS_SPACING", 0)
    if what == "driver":
        driver = Path(b.env["ASCEND_DRIVER_PATH"])
        b.env["ASCEND_DRIVER_PATH"] = str(shutil.copytree(driver, tmp_path / "driver-b"))
        changed = tmp_path / "driver-b" / "version.info"
        new = b"Version=25.0.rc1\n"
    else:
        changed = b.base / "custom_opp" / "op_impl" / "liboptiling.so"
        new = b"tiling v2"
    _changing_at(monkeypatch, 5, lambda: changed.write_bytes(new))
    if how == "pull":
        assert a.push()["sent"] == 12
        report = b.pull()
    else:
        cann_transfer.export_archive(tmp_path / "a.tar", settings=a.settings(), environ=a.env)
        archive = tmp_path / "a.tar"
        report = cann_transfer.import_archive(archive, settings=b.settings(), environ=b.env)
        report = report["chips"][SOC]
    assert any("changed while entries went in" in e for e in report["errors"]), report
    kept = 4 if every == "each entry" else 0
    assert report["written"] == kept
    assert sorted(p.name for p in b.chip.glob("*.json")) == sorted(
        f"{k}.json" for k in kernels[:kept]
    )
    assert len(list(b.chip.glob("*.o"))) == kept
    time.sleep(0.02)
    c = Machine(tmp_path / "c", Path(b.env["ASCEND_DRIVER_PATH"]), f"file://{tmp_path}/r2")
    (tmp_path / "r2").mkdir()
    b.url = c.url
    assert b.push()["sent"] == 0


def test_a_pulled_value_whose_manifest_names_another_namespace_is_refused(machines, tmp_path):
    """A remote that files one namespace's value under another's key (a mirror out of
    step, a copy by hand): the manifest says which it is, and a pull reads it, as an
    import did."""
    a, b = machines
    (kernel,) = _fill(a, 1)
    a.push()
    other = cann_transfer.Namespace(SOC, "7.0.RC1", "7.0.RC1", _driver_digest(a))
    b.env["ASCEND_DRIVER_PATH"] = str(_driver(tmp_path / "driver-b", "25.0.rc1"))
    write_ini(b.root)
    mine, _ = cann_transfer.local_namespace(b.root, SOC, b.env, None, taking=True)
    from opcache.storage import open_remote

    remote = open_remote(a.settings().remote)
    try:
        got = remote.get_many(other.remote_chip, [kernel])[kernel]
        remote.put(mine.remote_chip, kernel, got[1], got[0].files)
        rows = {kernel: (int(NOW), sum(map(len, got[0].files.values())))}
        cann_transfer._write_index(remote, mine, rows)
    finally:
        remote.close()
    report = b.pull()
    assert report["written"] == 0
    assert report["rejected"] == [{"entry": kernel, "why": "its versions are not this folder's"}]
    assert not list(b.chip.glob("*.json"))


@pytest.mark.parametrize("how", ["push", "pull"])
def test_a_driver_version_that_cannot_be_read_is_refused_not_taken_for_none(
    machines, tmp_path, how
):
    """Two machines whose drivers' version.info this user cannot read (a driver folder
    of another group: here a FIFO, which no read waits on) both counted as driver
    ``none``, and shared kernels across drivers.  A missing one is still ``none``."""
    a, b = machines
    _fill(a, 1)
    unreadable = tmp_path / "driver-x"
    unreadable.mkdir()
    os.mkfifo(unreadable / "version.info")
    if how == "push":
        a.env["ASCEND_DRIVER_PATH"] = str(unreadable)
        report = a.push()
    else:
        assert a.push()["sent"] == 1
        b.env["ASCEND_DRIVER_PATH"] = str(unreadable)
        write_ini(b.root)
        report = b.pull()
    assert "the driver's version.info cannot be read" in report["refused"], report
    assert not b.chip.exists()
    (unreadable / "version.info").unlink()
    a.env["ASCEND_DRIVER_PATH"] = b.env["ASCEND_DRIVER_PATH"] = str(unreadable)
    assert a.push()["namespace"]["driver"] == "none"


def test_the_ini_a_pull_makes_goes_into_the_root_it_opened_not_through_a_link_swapped_above(
    machines, tmp_path, monkeypatch
):
    """The root's folders are reached one at a time, each link judged; the ini was then
    made by its path, through whatever another user swapped in above the root
    meanwhile (a folder of others may write), into another of this user's CANN bases
    (whose entries of unknown versions CANN would then take as the toolkit's)."""
    a, b = machines
    _fill(a, 1)
    assert a.push()["sent"] == 1
    b.toolkit()
    b.base.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "kernel_cache").mkdir(parents=True)
    real = cann_transfer.create_ini

    def swapped_above(path, *rest):  # type: ignore[no-untyped-def]
        b.base.rename(tmp_path / "b-moved")
        b.base.symlink_to(elsewhere)
        return real(path, *rest)

    monkeypatch.setattr(cann_transfer, "create_ini", swapped_above)
    b.pull()
    assert not (elsewhere / "kernel_cache" / "op_cache.ini").exists()
    assert (tmp_path / "b-moved" / "kernel_cache" / "op_cache.ini").is_file()


def test_packages_that_can_no_longer_be_told_take_out_what_went_in_since_last_seen(
    machines, monkeypatch
):
    """A custom package grown past what is read (Refused) while a pull wrote: taken
    for a change, not for the inputs as they were (the entries were kept)."""
    a, b = machines
    write_ini(b.root)
    _fill(a, 6)
    assert a.push()["sent"] == 6

    def grown(self):  # type: ignore[no-untyped-def]
        raise cann_transfer.Refused("the custom operator packages hold over 100000 files")

    mark = cann_transfer.InputsMark
    _changing_at(monkeypatch, 3, lambda: monkeypatch.setattr(mark, "changed", grown))
    report = b.pull()
    assert any("changed while entries went in" in e for e in report["errors"]), report
    assert report["written"] == 0
    assert not list(b.chip.glob("*.json"))


def test_an_ini_made_meanwhile_is_read_in_the_root_opened_not_through_a_link_swapped_above(
    machines, tmp_path, monkeypatch
):
    """No ini when the pull read it; a CANN of another toolkit made one as the pull went
    to make its own, and a link swapped in above the root meanwhile led the pull's read
    of it to another base's ini naming this toolkit: the pull took that one and wrote
    its kernels into a folder CANN takes for the other toolkit's."""
    a, b = machines
    _fill(a, 2)
    assert a.push()["sent"] == 2
    b.toolkit()  # 7.0.RC1, as A's ini
    b.base.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    write_ini(elsewhere / "kernel_cache")  # (7.0.RC1: this toolkit's)
    real = cann_transfer.create_ini

    def made_meanwhile(path, *rest):  # type: ignore[no-untyped-def]
        path.write_text("[op_compiler_cache]\nadk_version=8.0.0\nops_version=8.0.0\n")
        b.base.rename(tmp_path / "b-moved")
        b.base.symlink_to(elsewhere)
        return real(path, *rest)

    monkeypatch.setattr(cann_transfer, "create_ini", made_meanwhile)
    report = b.pull()
    assert "says adk_version 8.0.0, ops_version 8.0.0" in report["refused"], report
    moved = tmp_path / "b-moved" / "kernel_cache" / SOC
    assert not [p for p in moved.iterdir() if p.name.endswith((".json", ".o"))]
