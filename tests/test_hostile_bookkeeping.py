"""Bookkeeping folders and files replaced by links, FIFOs and devices (issue 16).

Whatever a folder of ``.opcache`` (or a chip's ``_size``) has been replaced by,
cleaning, aging, verifying and compiling delete nothing and write nothing
outside the cache, never wait forever, and never end in a traceback: as root
(whose cron job ages users' caches) and as a member of a group-shared cache
(where another member can plant the link).  And the counters stay right when
the disk is full, or a store races ``verify``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from helpers_cache import (
    MP,
    OTHER_SOC,
    SOC,
    ToyCompiler,
    base_spec,
    compile_child,
    entry_dirs,
    expected_files,
    make_request,
    make_settings,
    read_dir,
    read_json,
    run_script,
    tree_bytes,
    write_size_ini,
)
from helpers_faults import (
    CHILD_PROLOGUE,
    MEMBER_A,
    MEMBER_B,
    TEAM_GID,
    open_folder,
    requires_root,
    run_as,
    team_cache,
    tmpfs,
)
from helpers_wrap import opcache as run_opcache

import opcache
from opcache import fsutil, locks
from opcache.cli import main
from opcache.storage import local
from opcache.storage.local import LocalStore, new_build_folder

# Long dead, for every grace period of every cleaner.
OLD = time.time() - 2 * 86400
BAIT_KEY = "0123456789abcdef0123456789abcdef"
# Every folder opcache keeps for itself, by its place under the cache root.
BOOKKEEPING = [
    ".opcache",
    ".opcache/trash",
    ".opcache/tmp",
    ".opcache/locks",
    f".opcache/locks/{SOC}",
    ".opcache/stats",
    f".opcache/stats/{SOC}",
    f"{SOC}/_size",
]
# Where each of them could lead, inside a folder planted in its place.
BAIT_FOLDERS = ["", "trash", "tmp", "locks", f"locks/{SOC}", "stats", f"stats/{SOC}", SOC, "_size"]


def plant_bait(folder: Path) -> None:
    """In ``folder`` and its cache-like subfolders, what each of opcache's cleaners
    would delete (or its writers overwrite) were they the cache's, all old."""
    for sub in BAIT_FOLDERS:
        where = folder / sub
        where.mkdir(parents=True, exist_ok=True)
        (where / ".bait.4242.deadbeef").write_bytes(b"named as a temp file")
        (where / "precious").mkdir()
        (where / "precious" / "data.txt").write_bytes(b"a folder, as in the trash")
        build = where / f"{BAIT_KEY}.elsewhere.4242.deadbeef"
        build.mkdir()
        (build / "kernel.o").write_bytes(b"named as a build folder")
        (where / "00.json").write_bytes(b'{"entries": 5}')
        (where / "00.lock").write_bytes(b"")
        (where / BAIT_KEY).write_bytes(b"named as a key's lock file")
    for dirpath, dirs, files in os.walk(folder, topdown=False):
        for name in [*dirs, *files]:
            os.utime(os.path.join(dirpath, name), (OLD, OLD))
    os.utime(folder, (OLD, OLD))


def snapshot(folder: Path) -> dict[str, tuple]:
    """Everything below ``folder`` (itself too): kind, mode, owner, mtime, bytes."""
    found = {}
    for dirpath, dirs, files in os.walk(folder):
        for name in [".", *dirs, *files]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            data = Path(path).read_bytes() if stat.S_ISREG(st.st_mode) else None
            found[os.path.relpath(path, folder)] = (
                stat.S_IFMT(st.st_mode),
                stat.S_IMODE(st.st_mode),
                st.st_uid,
                st.st_gid,
                st.st_mtime_ns,
                data,
            )
    return found


def replace_by_link(root: Path, rel: str, target: Path, aside: Path) -> Path:
    """Put a link to ``target`` where the folder ``rel`` of the cache is (moved aside)."""
    place = root / rel
    if place.exists():
        aside.mkdir(exist_ok=True)
        shutil.move(place, aside / rel.replace("/", "_"))
    os.symlink(target, place)
    return place


def cli_env(home: Path) -> dict[str, str]:
    env = {n: v for n, v in os.environ.items() if not n.startswith(("ASCEND_", "OPCACHE_", "NPU_"))}
    env["HOME"] = str(home)
    return env


def maintain_by_cli(home: Path, *commands: str, timeout: float = 60) -> None:
    """``opcache COMMAND --op_compiler_cache_dir <home>/ops`` for each command, run from
    ``home``: bounded, never a traceback, whatever its status (helpers_wrap.opcache)."""
    env = cli_env(home)
    for command in commands:
        args = (command, "--op_compiler_cache_dir", str(home / "ops"))
        run_opcache(*args, env=env, cwd=home, status=None, timeout=timeout)


def stored_cache(tmp_path: Path) -> tuple[opcache.Settings, ToyCompiler]:
    """A cache with two entries, their counters, stats and lock folders."""
    settings = make_settings(tmp_path / "ops", tmp_path)
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(settings) as cache:
        for i in (0, 1):
            assert cache.compile(make_request(i), compiler, tmp_path / "first" / str(i)).key
    return settings, compiler


# ------------------------------------------------------------------ links, as root


@pytest.mark.parametrize("rel", BOOKKEEPING)
def test_a_linked_bookkeeping_folder_is_never_followed(tmp_path: Path, rel: str) -> None:
    settings, compiler = stored_cache(tmp_path)
    root = settings.root
    victim = tmp_path / "victim"  # say, a folder of root's that a user's link names
    plant_bait(victim)
    replace_by_link(root, rel, victim, tmp_path / "aside")
    before = snapshot(victim)

    LocalStore(root).clean_leftovers(time.time() + 86400)
    maintain_by_cli(tmp_path, "age", "verify", "stats")
    with opcache.OpCache(settings) as cache:
        for i in (0, 2):  # stored before, and new
            out = tmp_path / "again" / str(i)
            cache.compile(make_request(i), compiler, out)
            assert read_dir(out) == expected_files(make_request(i))
        for action in (cache.age, cache.verify):
            try:
                action()
            except OSError as e:  # refusing, and saying which link, is fine
                assert rel.split("/")[0] in str(e)

    assert snapshot(victim) == before


@requires_root
@pytest.mark.parametrize("rel", BOOKKEEPING)
def test_roots_cron_on_a_users_cache_never_follows_the_users_links(
    tmp_path: Path, rel: str
) -> None:
    settings, _compiler = stored_cache(tmp_path)
    root = settings.root
    victim = tmp_path / "root-only"
    plant_bait(victim)
    os.chmod(victim, 0o700)
    replace_by_link(root, rel, victim, tmp_path / "aside")
    for dirpath, dirs, files in os.walk(tmp_path / "ops"):  # the user's cache, links too
        for name in [".", *dirs, *files]:
            os.lchown(os.path.join(dirpath, name), MEMBER_A, MEMBER_A)
    before = snapshot(victim)
    maintain_by_cli(tmp_path, "age", "verify", "stats")
    assert snapshot(victim) == before


# --------------------------------------------------- links, as a member of the group


MEMBER_CODE = """
from opcache.fsutil import group_shared
from opcache.storage.local import LocalStore

settings = h.make_settings({ops!r}, {base!r}, shared_group={gid})
comp = h.ToyCompiler({calls!r})
report = {{"good": [], "errors": []}}
LocalStore(settings.root, modes=group_shared({gid})).clean_leftovers(time.time() + 86400)
with opcache.OpCache(settings) as cache:
    for i in {requests!r}:
        out = Path({out!r}) / str(i)
        cache.compile(h.make_request(i), comp, out)
        report["good"].append(h.read_dir(out) == h.expected_files(h.make_request(i)))
    for action in {actions!r}:
        try:
            getattr(cache, action)()
        except OSError as e:
            report["errors"].append(str(e))
print(json.dumps(report))
"""


@requires_root
@pytest.mark.parametrize("rel", BOOKKEEPING)
def test_a_member_of_the_group_cannot_make_another_delete_or_write_outside(rel: str) -> None:
    with open_folder() as base:
        ops, calls = team_cache(base)

        def member(uid: int, out: str, requests: list[int], actions: list[str]) -> dict:
            code = MEMBER_CODE.format(
                ops=str(ops),
                base=str(base),
                gid=TEAM_GID,
                calls=str(calls),
                out=str(base / out),
                requests=requests,
                actions=actions,
            )
            return run_as(uid, uid, CHILD_PROLOGUE + code, groups=(TEAM_GID,), timeout=120)

        assert member(MEMBER_A, "a", [0, 1], ["age"])["good"] == [True, True]
        # Member B's private folder, which member A cannot enter, let alone write.
        victim = base / "private-of-b"
        plant_bait(victim)
        for dirpath, dirs, files in os.walk(victim):
            for name in [".", *dirs, *files]:
                os.lchown(os.path.join(dirpath, name), MEMBER_B, MEMBER_B)
        os.chmod(victim, 0o700)
        link = replace_by_link(ops / "kernel_cache", rel, victim, base / "aside")
        os.lchown(link, MEMBER_A, TEAM_GID)  # what member A planted
        before = snapshot(victim)

        report = member(MEMBER_B, "b", [0, 2], ["age", "verify", "stats"])

        assert report["good"] == [True, True]  # the compiles go on, whatever the cache does
        assert snapshot(victim) == before


# ------------------------------------------------------- a folder swapped mid-walk


def test_remove_tree_never_follows_a_folder_swapped_for_a_link_mid_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a.o").write_bytes(b"x" * 10)
    victim = tmp_path / "victim"
    plant_bait(victim)
    before = snapshot(victim)
    real_scandir = os.scandir
    swapped = []

    def scandir(path=".", /):
        # Just as the walk lists "sub", someone swaps it for a link to the victim.
        where = os.readlink(f"/proc/self/fd/{path}") if isinstance(path, int) else str(path)
        if not swapped and os.path.basename(where) == "sub":
            os.rename(tree / "sub", tmp_path / "sub-moved")
            os.symlink(victim, tree / "sub")
            swapped.append(where)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    fsutil.remove_tree(tree)
    monkeypatch.undo()
    assert swapped
    assert snapshot(victim) == before


def test_a_lock_folder_swapped_for_a_link_while_held_is_not_followed_at_release(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "locks" / SOC
    folder.mkdir(parents=True)
    victim = tmp_path / "victim"
    plant_bait(victim)
    before = snapshot(victim)
    lock = locks.KeyLock(folder / BAIT_KEY)
    assert lock.acquire(5)
    os.rename(folder, tmp_path / "moved")
    os.symlink(victim, folder)
    lock.release()
    assert snapshot(victim) == before
    assert os.listdir(tmp_path / "moved") == []  # its own lock file went


def test_a_lock_file_made_anew_under_its_holder_is_left_to_its_new_holder(
    tmp_path: Path,
) -> None:
    """Removed under its holder (a clean-up), the lock file was made anew by a waiter,
    who holds it; the first holder's release deleted the waiter's file, and a third
    process compiled the key too."""
    folder = tmp_path / "locks" / SOC
    folder.mkdir(parents=True)
    first, second = locks.KeyLock(folder / "k"), locks.KeyLock(folder / "k")
    assert first.acquire(5)
    (folder / "k").unlink()
    assert second.acquire(5)
    first.release()
    third = locks.KeyLock(folder / "k")
    assert (folder / "k").exists() and not third.acquire(0.2)
    second.release()
    assert not (folder / "k").exists()


# ---------------------------------------------------- FIFOs and devices: no hang


def _plant_special(path: Path, kind: str) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path, 0o600)
        return
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # what /dev/zero is
    except PermissionError:
        pytest.skip("cannot make a device file here (needs CAP_MKNOD)")


SPECIAL_PLACES = {
    "size shards": lambda root: [root / SOC / "_size" / f"{i:02d}.count" for i in range(16)],
    "stats shards": lambda root: [
        root / ".opcache" / "stats" / SOC / f"{i:02d}.count" for i in range(16)
    ],
    "size locks": lambda root: [root / SOC / "_size" / f"{i:02d}.lock" for i in range(16)],
    "stats locks": lambda root: [
        root / ".opcache" / "stats" / SOC / f"{i:02d}.lock" for i in range(16)
    ],
    "count lock": lambda root: [root / ".opcache" / "locks" / f"{SOC}.count"],
}

COMPILE_CODE = """
import json
from pathlib import Path
import helpers_cache as h, opcache
settings = h.make_settings({ops!r}, {home!r})
comp = h.ToyCompiler({calls!r})
good = []
with opcache.OpCache(settings) as cache:
    for i in (0, 5):
        out = Path({out!r}) / str(i)
        cache.compile(h.make_request(i), comp, out)
        good.append(h.read_dir(out) == h.expected_files(h.make_request(i)))
    cache.stats()
print(json.dumps(good))
"""


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("place", sorted(SPECIAL_PLACES))
def test_a_fifo_or_device_in_place_of_a_counter_or_lock_file_never_hangs(
    tmp_path: Path, place: str, kind: str
) -> None:
    settings, _compiler = stored_cache(tmp_path)
    for path in SPECIAL_PLACES[place](settings.root):
        _plant_special(path, kind)
    maintain_by_cli(tmp_path, "stats", "age", "verify", timeout=30)
    cache_dir = str(tmp_path / "ops")
    code = COMPILE_CODE.format(
        ops=cache_dir, home=str(tmp_path), calls=str(tmp_path / "calls"), out=str(tmp_path / "o")
    )
    done = run_script(code)  # (bounded: 60 s)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, True]


# ------------------------------------------------------- counters stay right


PAGE = os.sysconf("SC_PAGE_SIZE")
SMALL = f"size={128 * PAGE}"  # 512 KiB with 4 KiB pages


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def counted_and_walked(root: Path) -> tuple[tuple[int, int], tuple[int, int]]:
    walked = entry_dirs(root)
    actual = (len(walked), sum(tree_bytes(p) for p in walked.values()))
    return LocalStore(root).used(SOC), actual


def test_a_full_disk_never_leaves_an_entry_uncounted(tmp_path: Path) -> None:
    # The disk fills up at every step of a store in turn (one more page of room
    # each round): the counters match what is there after each, with no verify.
    size = 3 * PAGE
    compiler = ToyCompiler(tmp_path / "calls", size=size)
    with tmpfs(tmp_path / "small", SMALL):
        settings = make_settings(tmp_path / "small" / "ops", tmp_path)
        with opcache.OpCache(settings) as cache:  # folders, and this process's shards
            cache.compile(make_request(100), compiler, tmp_path / "warm")
        filler = tmp_path / "small" / "filler"
        for headroom in range(4, 10):
            filler.write_bytes(b"\0" * (free_bytes(filler.parent) - headroom * PAGE))
            request = make_request(headroom)
            with opcache.OpCache(settings) as cache:
                result = cache.compile(request, compiler, tmp_path / f"out{headroom}")
            filler.unlink()
            assert result.status == "miss"
            assert read_dir(tmp_path / f"out{headroom}") == expected_files(request, size)
            counted, actual = counted_and_walked(settings.root)
            assert counted == actual, headroom


def test_stats_counted_while_the_disk_is_full_are_kept(tmp_path: Path) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    with tmpfs(tmp_path / "small", SMALL):
        settings = make_settings(tmp_path / "small" / "ops", tmp_path)
        with opcache.OpCache(settings) as cache:  # this process's stats shard exists
            cache.compile(make_request(0), compiler, tmp_path / "warm")
        filler = tmp_path / "small" / "filler"
        with opcache.OpCache(settings, stats_seconds=None) as cache:
            for i in (0, 0, 1):  # two hits, a miss (stored)
                cache.compile(make_request(i), compiler, tmp_path / "out" / str(i))
            filler.write_bytes(b"\0" * free_bytes(filler.parent))
            assert free_bytes(filler.parent) == 0
        # (closed, its counts written, on the full disk)
        filler.unlink()
        with opcache.OpCache(settings) as cache:
            stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["stores"]) == (2, 2, 2)


def test_a_full_disk_never_writes_through_a_counter_hard_linked_to_a_file_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk a shard is rewritten in place; a member of a shared cache may
    have made it a hard link to a file outside the cache, which must stay as it is."""
    settings = make_settings(tmp_path / "ops", tmp_path)
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(settings) as cache:  # this process's shards exist
        cache.compile(make_request(0), compiler, tmp_path / "warm")
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's private data\n" * 40)
    victim.chmod(0o600)
    before = victim.read_bytes()
    shard = f"{os.getpid() % 16:02d}.count"
    linked = [
        settings.root / SOC / "_size" / shard,
        settings.root / ".opcache" / "stats" / SOC / shard,
    ]
    for path in linked:
        assert path.is_file()
        path.unlink()
        os.link(victim, path)
    real_write_atomic = fsutil.write_atomic

    def full_disk(name, data, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.path.basename(os.fspath(name)) == shard:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_atomic(name, data, *args, **kwargs)

    monkeypatch.setattr(fsutil, "write_atomic", full_disk)
    with opcache.OpCache(settings) as cache:
        result = cache.compile(make_request(1), compiler, tmp_path / "o")
        cache.verify()
        cache.stats()
    assert result.status == "miss"
    assert read_dir(tmp_path / "o") == expected_files(make_request(1))
    assert victim.read_bytes() == before


def test_a_store_just_before_verify_takes_its_lock_is_not_reported_as_a_wrong_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, _compiler = stored_cache(tmp_path)
    real_pause = LocalStore.counting_paused
    raced = []

    def store_then_pause(self, soc):
        if not raced:  # another process stores one entry, start to end, right now
            spec = base_spec(tmp_path)
            spec.update(requests=[7], result=str(tmp_path / "racer.json"))
            racer = MP.Process(target=compile_child, args=(spec,))
            racer.start()
            racer.join(60)
            raced.append(racer.exitcode)
        return real_pause(self, soc)

    monkeypatch.setattr(LocalStore, "counting_paused", store_then_pause)
    with opcache.OpCache(settings) as cache:
        chip = cache.verify().as_dict()["chips"][SOC]
    monkeypatch.undo()
    assert raced == [0]
    assert read_json(tmp_path / "racer.json")["results"][0]["status"] == "miss"
    assert (chip["counted_entries"], chip["counted_bytes"]) == (chip["entries"], chip["bytes"])
    assert chip["entries"] == 3


# ------------------------------------------- the trim's lock file: never followed


class _FileLockBefore3201:
    """filelock < 3.20.1's lock (CVE-2025-68146): opened through a link with
    O_TRUNC, then fchmod'ed, whatever the path named."""

    def __init__(self, path: os.PathLike[str] | str, timeout: float = -1, mode: int = 0o644):
        self._path, self._mode, self._fd = path, mode, -1

    def acquire(self) -> None:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, self._mode)
        os.fchmod(self._fd, self._mode)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def release(self) -> None:
        os.close(self._fd)


@pytest.mark.parametrize("filelock_version", ["installed", "before 3.20.1"])
def test_a_link_at_the_trim_lock_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, filelock_version: str
) -> None:
    if filelock_version != "installed":  # the trim must not depend on filelock's open
        old = types.ModuleType("filelock")
        old.FileLock = _FileLockBefore3201
        old.Timeout = TimeoutError
        monkeypatch.setitem(sys.modules, "filelock", old)
    settings, _compiler = stored_cache(tmp_path)
    root = settings.root
    victim = tmp_path / "secret"
    victim.write_bytes(b"the victim's private data")
    victim.chmod(0o600)
    # Over its limit: the next age trims, taking the chip's cleanup lock.
    write_size_ini(root, 1, 50)
    (root / SOC / "_size" / "07.count").write_text('{"bytes": 5000000000}')
    os.symlink(victim, root / ".opcache" / "locks" / f"{SOC}.cleanup")

    settings = make_settings(tmp_path / "ops", tmp_path)  # (reads the new limit)
    with opcache.OpCache(settings) as cache, contextlib.suppress(OSError):  # (a refusal is fine)
        cache.age()

    assert victim.read_bytes() == b"the victim's private data"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600


# ---------------------------------------- a lock held forever: the miss still ends


HOLD_CODE = """
import fcntl, os, sys, time
fd = os.open({lock!r}, os.O_RDONLY)  # flock needs no more than reading
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
time.sleep(600)
"""


def test_a_counting_lock_held_forever_by_another_process_does_not_hang_a_miss(
    tmp_path: Path,
) -> None:
    settings, _compiler = stored_cache(tmp_path)
    lock = settings.root / ".opcache" / "locks" / f"{SOC}.count"
    assert lock.is_file()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_CODE.format(lock=str(lock))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        code = COMPILE_CODE.format(
            ops=str(tmp_path / "ops"),
            home=str(tmp_path),
            calls=str(tmp_path / "calls"),
            out=str(tmp_path / "o"),
        )
        # Two compiles, one a miss that waits locks.LOCK_WAIT_SECONDS for the
        # counting lock and is then not stored: well within run_script's 60 s.
        done = run_script(code)
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, True]


# ------------------------------------------- out_dir: only our own build folders go


def test_a_folder_renamed_to_a_build_folders_name_in_out_dir_is_not_deleted(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)  # a team's out folder, without the sticky bit
    mine = out / "include"
    mine.mkdir(mode=0o755)
    (mine / "victim.h").write_bytes(b"precious")
    os.utime(mine, (OLD, OLD))
    # What anyone who may write in out can do: rename it, files and all.
    renamed = out / ".opcache-build.elsewhere.1.deadbeef"
    os.rename(mine, renamed)
    settings = make_settings(tmp_path / "ops", tmp_path)
    with opcache.OpCache(settings) as cache:
        cache.compile(make_request(0), ToyCompiler(tmp_path / "calls"), out)
    assert (renamed / "victim.h").read_bytes() == b"precious"


def test_a_folder_swapped_in_for_a_build_folder_is_not_deleted_at_close(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    plant_bait(victim)
    before = snapshot(victim)
    build = new_build_folder(out, ".opcache-build", 0o700)
    os.rename(build.path, tmp_path / "moved")
    os.rename(victim, build.path)
    build.close()
    os.rename(build.path, victim)
    assert snapshot(victim) == before


# ------------------------------------------ planted deep folders, odd build names


DEPTH = 2000


def plant_deep(folder: Path, name: str) -> Path:
    """``folder/name/d/d/...``, DEPTH levels, made through handles (the path is
    longer than PATH_MAX), all old."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    os.mkdir(name, 0o700, dir_fd=fd)
    cur = os.open(name, os.O_RDONLY, dir_fd=fd)
    for _ in range(DEPTH):
        os.mkdir("d", dir_fd=cur)
        below = os.open("d", os.O_RDONLY, dir_fd=cur)
        os.close(cur)
        cur = below
    os.close(cur)
    os.utime(name, (OLD, OLD), dir_fd=fd)
    os.close(fd)
    return folder / name


def build_name(label: str, pid: str) -> str:
    return f"{label}.{local._HOST}.{pid}.deadbeef"


# (where, relative to the cache root or, for "out", to the compile's out_dir; name)
PLANTED = {
    "deep in trash": (".opcache/trash", "x.elsewhere.1.deadbeef"),
    "deep in tmp": (".opcache/tmp", f"{BAIT_KEY}.elsewhere.1.deadbeef"),
    "deep in out": ("out", ".opcache-build.elsewhere.1.deadbeef"),
    "unicode pid in tmp": (".opcache/tmp", build_name(BAIT_KEY, "\u00b2")),
    "unicode pid in out": ("out", build_name(".opcache-build", "\u00b2")),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_deep_or_oddly_named_folder_is_cleaned_without_a_traceback(
    tmp_path: Path, case: str
) -> None:
    settings, compiler = stored_cache(tmp_path)
    where, name = PLANTED[case]
    folder = tmp_path / "o" if where == "out" else settings.root / where
    if case.startswith("deep"):
        planted = plant_deep(folder, name)
    else:
        planted = folder / name
        planted.mkdir(mode=0o700, parents=True)
    if where == "out":  # as opcache marks its build folders there (else never its own)
        mark = planted / f".opcache-work.{name.rsplit('.', 1)[1]}"
        mark.mkdir(mode=0o700)
        os.utime(mark, (OLD, OLD))  # (written in last long ago too: a dead writer's)
    os.utime(planted, (OLD, OLD))
    try:
        with opcache.OpCache(settings) as cache:  # a first compile cleans leftovers
            for i in (0, 2):
                cache.compile(make_request(i), compiler, tmp_path / "o")
            cache.age()
            cache.verify()
        maintain_by_cli(tmp_path, "age", "verify")  # (no traceback, or it fails)
        assert read_dir(tmp_path / "o") == {
            **expected_files(make_request(0)),
            **expected_files(make_request(2)),
        }
        # Dead writers' and old: deleted; but not in out_dir a name no build folder has.
        assert planted.exists() == (case == "unicode pid in out")
    finally:  # (pytest's own clean-up of old tmp_paths recurses)
        subprocess.run(["rm", "-rf", str(planted)], check=False, timeout=60)


# -------------------- the locks folder swapped for a link after its first check


def test_a_locks_folder_swapped_after_a_long_lived_process_checked_it_is_not_followed(
    tmp_path: Path,
) -> None:
    settings = make_settings(tmp_path / "ops", tmp_path, "force")
    compiler = ToyCompiler(tmp_path / "calls")
    victim = tmp_path / "victim"
    plant_bait(victim)
    before = snapshot(victim)
    with opcache.OpCache(settings, session="build-1") as cache:
        # The first chip's force clear and miss check the locks folder once...
        cache.compile(make_request(0), compiler, tmp_path / "o" / "0")
        replace_by_link(settings.root, ".opcache/locks", victim, tmp_path / "aside")
        # ...then another chip's force lock and the keys' single-flight locks are
        # taken (by compiles that fail: what a miss notes for opcache explain is
        # explain.py's own business).
        failing = ToyCompiler(tmp_path / "calls", fail=True)
        for i, soc in ((1, OTHER_SOC), (2, SOC)):
            with pytest.raises(opcache.CompileError):
                cache.compile(make_request(i, soc_version=soc), failing, tmp_path / "o" / str(i))
    assert snapshot(victim) == before


HOLD_THEN_SWAP_CODE = """
import fcntl, os, sys, time
locks, outside, lock = sys.argv[1:]
fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
time.sleep(1.0)  # the waiter is waiting by now
os.rename(locks, locks + "-moved")
os.symlink(outside, locks)
time.sleep(1.0)
os.close(fd)
"""


def test_a_locks_folder_swapped_for_a_link_while_a_waiter_waits_is_not_followed(
    tmp_path: Path,
) -> None:
    """A member renames ``.opcache/locks`` and puts a link to another folder in its
    place while a compile waits for a key another process compiles: nothing is made
    in that folder, and the compile still ends with the right files."""
    settings = make_settings(tmp_path / "ops", tmp_path)
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(make_settings(tmp_path / "scratch", tmp_path)) as scratch:
        key = scratch.compile(make_request(0), compiler, tmp_path / "scratch-out").key
    store = LocalStore(settings.root)
    os.close(store.open_folder("locks", SOC))
    outside = tmp_path / "outside"
    outside.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLD_THEN_SWAP_CODE,
            str(store.locks_dir),
            str(outside),
            str(store.locks_dir / SOC / key),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        started = time.monotonic()
        with opcache.OpCache(settings, lock_timeout=30) as cache:
            cache.compile(make_request(0), compiler, tmp_path / "o")
        waited = time.monotonic() - started
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()
        holder.wait()
    assert waited >= 0.9  # (it was waiting when the folder was swapped)
    assert read_dir(tmp_path / "o") == expected_files(make_request(0))
    assert os.listdir(outside) == []


def test_stats_never_shows_the_names_a_link_in_place_of_the_stats_folder_leads_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings, _compiler = stored_cache(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "private-project-name").write_text("mine\n")
    replace_by_link(settings.root, ".opcache/stats", outside, tmp_path / "aside")
    for flags in ((), ("--json",)):
        status = main(["stats", *flags, "--op_compiler_cache_dir", str(tmp_path / "ops")])
        out, err = capsys.readouterr()
        assert status == 0
        assert "private-project-name" not in out + err
        assert SOC in out
    assert os.listdir(outside) == ["private-project-name"]


def test_a_file_linked_in_as_a_lock_file_keeps_its_mode(tmp_path: Path) -> None:
    """In a group-shared cache a member may hard-link a file of another member's
    from elsewhere in as a lock file: taking the lock does not chmod that file."""
    notes = tmp_path / "notes.txt"
    notes.write_text("ours\n")
    notes.chmod(0o666)
    locks_dir = tmp_path / "locks"
    locks_dir.mkdir()
    os.link(notes, locks_dir / "host.count")
    lock = locks.KeyLock(locks_dir / "host.count", fsutil.group_shared(os.getgid()))
    assert lock.try_acquire()
    lock.release()
    assert notes.stat().st_mode & 0o7777 == 0o666


def test_a_file_of_ours_moved_in_as_a_lock_file_keeps_its_mode(tmp_path: Path) -> None:
    """A member who may rename in a shared folder moves a secret of ours (0600, one
    name) in as a lock file, and back once our chmod opened it to the group: only
    a lock file made by the call itself is chmodded."""
    locks_dir = tmp_path / "locks"
    locks_dir.mkdir()
    secret = locks_dir / "host.count"
    secret.write_text("a private key\n")
    secret.chmod(0o600)
    modes = fsutil.group_shared(os.getgid())
    lock = locks.KeyLock(secret, modes)
    assert lock.try_acquire()
    assert secret.stat().st_mode & 0o7777 == 0o600  # (moved back out while it is held)
    lock.release()
    made = locks.KeyLock(locks_dir / "new.count", modes)  # (one it makes: the group's mode)
    assert made.try_acquire()
    assert (locks_dir / "new.count").stat().st_mode & 0o7777 == modes.file_bits
    made.release()


# ------------------------------------ what another user keeps closed, or names oddly


CANN_AS_MEMBER = """
import contextlib, io
from opcache.cli import main
report = {{}}
for action in ("age", "stats"):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = main(["cann", action, "--json", "--op_compiler_cache_dir", {atc!r}])
    report[action] = [status, json.loads(out.getvalue() or "null")]
print(json.dumps(report))
"""


@requires_root
def test_a_folder_another_member_keeps_closed_does_not_stop_cann_aging() -> None:
    """A member's subfolder (0740) in a shared CANN chip folder, whose files the others
    cannot stat: their aging and stats count around it, not give up on the chip."""
    from helpers_cann import kernel_name, set_access, store_entry, write_ini

    with open_folder() as base:
        atc = base / "atc"
        chip = atc / "kernel_cache" / SOC
        chip.mkdir(parents=True)
        for n in range(4):
            paths = store_entry(chip, kernel_name("Add", str(n)), os.urandom(400 << 10))
            set_access(paths, time.time() - 7200)
        write_ini(atc / "kernel_cache", max_mb=1, ratio=50)
        for dirpath, dirs, files in os.walk(base):
            for name in [".", *dirs, *files]:
                os.lchown(os.path.join(dirpath, name), MEMBER_A, TEAM_GID)
        closed = chip / "m"
        closed.mkdir()
        (closed / "x").write_text("x")
        for path in (closed, closed / "x"):
            os.lchown(path, MEMBER_B, TEAM_GID)
        closed.chmod(0o740)  # (the team may list it, not look at what is in it)
        code = CHILD_PROLOGUE + CANN_AS_MEMBER.format(atc=str(atc))
        report = run_as(MEMBER_A, TEAM_GID, code, groups=(TEAM_GID,))
        status, aged = report["age"]
        assert status == 0 and aged["chips"][SOC]["removed"], aged
        assert report["stats"][0] == 0
        assert (closed / "x").exists()


@pytest.mark.parametrize("where", ["stats", "size"])
def test_a_folder_in_place_of_the_appended_counts_ends_no_command(
    tmp_path: Path, where: str
) -> None:
    """A folder named ``appended`` in a counter folder (a member's, or a planted one) is
    set aside, not read or deleted: verify and stats go on, the counters right."""
    settings = make_settings(tmp_path / "ops", tmp_path)
    with opcache.OpCache(settings) as cache:
        cache.compile(make_request(0), ToyCompiler(tmp_path / "calls"), tmp_path / "out")
    counters = (
        settings.root / ".opcache" / "stats" / SOC
        if where == "stats"
        else settings.root / SOC / "_size"
    )
    (counters / "appended").mkdir(parents=True)
    for argv in (["verify"], ["stats", "--zero"], ["stats", "--json"]):
        args = (*argv, "--op_compiler_cache_dir", str(tmp_path / "ops"))
        run_opcache(*args, env=cli_env(tmp_path), cwd=tmp_path, text=True)


MAINTAIN_AS_MEMBER = """
import contextlib, io
from opcache.cli import main
statuses = []
for command in ("age", "verify", "stats"):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        statuses.append(main([command, "--op_compiler_cache_dir", {ops!r}]))
print(json.dumps(statuses))
"""  # (each command's status: 1 says the unreadable chip was left, 2 would be a usage error)


@requires_root
def test_a_folder_named_as_no_chip_is_not_taken_for_one() -> None:
    """Beside a chip folder the user cannot read (0700, root's), a folder that
    names no chip (``odd name``) is not taken for one: the commands work on the
    readable chips (exit 1 for the unreadable one) rather than refuse them all."""
    with open_folder() as base:
        settings = make_settings(base / "ops", base)
        with opcache.OpCache(settings) as cache:
            cache.compile(make_request(0), ToyCompiler(base / "calls"), base / "out")
        for dirpath, dirs, files in os.walk(base):
            for name in [".", *dirs, *files]:
                os.lchown(os.path.join(dirpath, name), MEMBER_A, MEMBER_A)
        (settings.root / "odd name").mkdir()
        os.lchown(settings.root / "odd name", MEMBER_A, MEMBER_A)
        (settings.root / "Ascend310P3").mkdir(mode=0o700)  # (root's)
        code = CHILD_PROLOGUE + MAINTAIN_AS_MEMBER.format(ops=str(base / "ops"))
        assert run_as(MEMBER_A, MEMBER_A, code) == [1, 1, 1]  # (not 2: a usage error)


def test_counts_that_cannot_be_written_say_so(tmp_path, caplog):
    # A file in place of the stats folder: the compile is served, and a warning says
    # why opcache stats will not show it (before: a debug line only).
    settings = make_settings(tmp_path / "ops", tmp_path)
    with opcache.OpCache(settings) as cache:
        cache.compile(make_request(0), ToyCompiler(tmp_path / "calls"), tmp_path / "out0")
    folder = settings.root / ".opcache" / "stats"
    shutil.rmtree(folder)
    folder.write_text("not a folder")
    with opcache.OpCache(settings) as cache:
        result = cache.compile(make_request(1), ToyCompiler(tmp_path / "calls"), tmp_path / "out1")
    assert result.status == "miss"
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("cannot write the counts" in m and str(folder) in m for m in said), said


UNREAD_BUCKET_CODE = """
settings = h.make_settings({ops!r}, {base!r}, shared_group={gid})
comp = h.ToyCompiler({calls!r})
with opcache.OpCache(settings) as cache:
    if {store}:
        for i in (0, 1):
            cache.compile(h.make_request(i), comp, Path({base!r}) / "b" / str(i))
        key = cache.compile(h.make_request(0), comp, Path({base!r}) / "b" / "again").key
        closed = settings.root / h.SOC / key[:2]
        if {closed!r}:  # (member B's)
            os.chmod(closed / key if {closed!r} == "entry" else closed, 0o2700)
        print(json.dumps(cache.stats()["chips"][h.SOC]["bytes"]))
    else:
        chip = cache.verify().as_dict()["chips"][h.SOC]
        now = cache.stats()["chips"][h.SOC]
        print(json.dumps([chip, now["entries"], now["bytes"], keep.messages]))
"""


@requires_root
@pytest.mark.parametrize("closed", ["bucket", "entry"])
def test_verify_leaves_the_counters_alone_when_a_folder_cannot_be_read(closed: str) -> None:
    # Member B's bucket (or entry), not open to the group: member A's verify does not
    # see (or size) its entries, which are there; it says so, and does not count them away.
    with open_folder() as base:
        ops, calls = team_cache(base)
        said = {}
        for uid, store in ((MEMBER_B, True), (MEMBER_A, False)):
            code = UNREAD_BUCKET_CODE.format(
                ops=str(ops),
                base=str(base),
                gid=TEAM_GID,
                calls=str(calls),
                store=store,
                closed=closed,
            )
            said[uid] = run_as(uid, uid, CHILD_PROLOGUE + code, groups=(TEAM_GID,))
        chip, entries, size, warnings = said[MEMBER_A]
        assert (entries, size) == (2, said[MEMBER_B]), chip
        assert chip["unread" if closed == "bucket" else "errors"] == 1, chip
        assert any("left as they were" in w for w in warnings), warnings


@requires_root
def test_verify_sets_every_counter_or_none() -> None:
    # The size counters are split in shards, each with its lock file.  One lock file
    # member A cannot open (member B's, made without the group's bits): verify leaves
    # every shard as it was and names the file whole, where it used to zero the shards
    # before it (the counters then said 1 entry of 2) and say "15.lock: Permission denied".
    with open_folder() as base:
        ops, calls = team_cache(base)
        fmt = {"ops": str(ops), "base": str(base), "gid": TEAM_GID, "calls": str(calls)}
        code, fmt["closed"] = CHILD_PROLOGUE + UNREAD_BUCKET_CODE, ""  # (nothing closed)
        size = run_as(MEMBER_B, MEMBER_B, code.format(store=True, **fmt), groups=(TEAM_GID,))
        sizes = ops / "kernel_cache" / SOC / local.SIZE_FOLDER
        (shard,) = sizes.glob("*.count")
        last = "14" if shard.name == "15.count" else "15"
        split = {"entries": 1, "bytes": 1}
        shard.write_text(json.dumps({"entries": 1, "bytes": size - 1}))
        (sizes / f"{last}.count").write_text(json.dumps(split))
        (sizes / f"{last}.lock").touch(mode=0o600)
        for made in (f"{last}.count", f"{last}.lock"):
            os.chown(sizes / made, MEMBER_B, TEAM_GID)
        os.chmod(sizes / f"{last}.count", 0o660)
        chip, entries, now, warnings = run_as(
            MEMBER_A, MEMBER_A, code.format(store=False, **fmt), groups=(TEAM_GID,)
        )
        assert (entries, now) == (2, size), chip
        assert chip["unwritten"] == f"{sizes / last}.lock: Permission denied", chip
        assert any(f"{sizes / last}.lock" in w for w in warnings), warnings
