"""Trimmed and cleared entries leave the cache at once and are deleted off the caller's path.

A trim renames its entries into one trash folder and a detached process
deletes it, holding the folder's lock; a sweep deletes only trash nobody holds.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_cache import (
    SOC,
    T0,
    FakeClock,
    ToyCompiler,
    entry_dirs,
    make_request,
    make_settings,
    trash_emptied,
    tree_bytes,
)
from helpers_faults import MEMBER_A, MEMBER_B, TEAM_GID, requires_root

import opcache
from opcache import fsutil, trash
from opcache.storage.local import LocalStore


@pytest.fixture
def trimmed(tmp_path: Path) -> tuple[opcache.Settings, list[str]]:
    """A 1 MB chip folder holding six old 200 kB entries: a trim takes four."""
    root = tmp_path / "ops" / "kernel_cache"
    root.mkdir(parents=True)
    (root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=1\nremain_cache_size_ratio=50\n"
    )
    settings = make_settings(tmp_path / "ops", tmp_path)
    clock = FakeClock()
    compiler = ToyCompiler(tmp_path / "calls", size=200_000)
    with opcache.OpCache(settings, clock=clock) as cache:
        keys = []
        for i in range(6):
            keys.append(cache.compile(make_request(i), compiler, tmp_path / "o").key)
            clock.advance(10)
    return settings, keys


def _age(settings: opcache.Settings) -> opcache.AgingReport:
    with opcache.OpCache(settings, clock=FakeClock(T0 + 7200)) as cache:
        return cache.age()


def test_a_trim_takes_entries_out_at_once_and_deletes_them_in_another_process(
    trimmed, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, keys = trimmed
    deleted_here = []
    real_remove_tree = fsutil.remove_tree

    def remove_tree(path):
        deleted_here.append(str(path))
        return real_remove_tree(path)

    monkeypatch.setattr(fsutil, "remove_tree", remove_tree)
    report = _age(settings)
    assert report.removed_entries == 4
    assert set(entry_dirs(settings.root)) == set(keys[4:])
    with opcache.OpCache(settings) as cache:
        stats = cache.stats()
    left = sum(tree_bytes(p) for p in entry_dirs(settings.root).values())
    assert (stats["entries"], stats["bytes"]) == (2, left)  # counted when taken out
    assert trash_emptied(settings.root) == []
    trash_dir = str(settings.root / ".opcache" / "trash")
    assert not [p for p in deleted_here if p.startswith(trash_dir)]  # not deleted here


def test_without_a_python_to_start_the_trim_deletes_in_place(
    trimmed, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, keys = trimmed
    monkeypatch.setattr(sys, "executable", "")  # an embedding program's interpreter
    assert _age(settings).removed_entries == 4
    assert os.listdir(settings.root / ".opcache" / "trash") == []  # no waiting
    assert set(entry_dirs(settings.root)) == set(keys[4:])


def test_clear_takes_the_chip_folder_out_at_once(trimmed) -> None:
    settings, _ = trimmed
    with opcache.OpCache(settings) as cache:
        assert cache.clear(SOC) == [SOC]
        assert entry_dirs(settings.root) == {}
        assert cache.stats()["entries"] == 0
    assert trash_emptied(settings.root) == []


def test_a_sweep_leaves_trash_a_deleter_holds_and_deletes_trash_nobody_holds(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "cache")
    trash_fd = store.open_folder("trash")
    try:
        held_name, held = trash.new_folder(trash_fd, "busy", store.modes)
        orphan_name, orphan = trash.new_folder(trash_fd, "orphan", store.modes)
    finally:
        os.close(trash_fd)
    (store.trash_dir / held_name / "entry").mkdir()
    (store.trash_dir / held_name / "entry" / "MANIFEST").write_bytes(b"x")
    (store.trash_dir / orphan_name / "entry").mkdir()
    os.close(orphan)  # its deleter died
    try:
        assert store.clean_leftovers() == 1
        assert os.listdir(store.trash_dir) == [held_name]
    finally:
        os.close(held)
    assert store.clean_leftovers() == 1
    assert os.listdir(store.trash_dir) == []


def test_where_folders_cannot_be_locked_trims_and_clears_delete_in_place(
    trimmed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS turns flock into byte-range locks, which a folder cannot take."""
    settings, keys = trimmed
    real_flock = trash.fcntl.flock

    def flock(fd: int, operation: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        real_flock(fd, operation)

    monkeypatch.setattr(trash.fcntl, "flock", flock)
    assert _age(settings).removed_entries == 4
    assert set(entry_dirs(settings.root)) == set(keys[4:])
    trash_dir = settings.root / ".opcache" / "trash"
    assert os.listdir(trash_dir) == []
    (trash_dir / "left-by-a-killed-trim").mkdir()
    with opcache.OpCache(settings) as cache:
        assert cache.clear(SOC) == [SOC]
        assert cache.age().leftovers_removed == 1  # nobody could hold it
        assert cache.stats()["entries"] == 0
    assert os.listdir(trash_dir) == []


def test_a_trash_folder_swept_before_its_lock_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep may take a new trash folder between its mkdir and its lock."""
    store = LocalStore(tmp_path / "cache")
    trash_dir = store.folder("trash")
    trash_fd = store.open_folder("trash")
    real_flock = trash.fcntl.flock
    swept: list[int] = []
    sweeping: list[bool] = []

    def flock(fd: int, operation: int) -> None:
        if not swept and not sweeping:  # new_folder's, not the sweep's
            sweeping.append(True)
            swept.append(trash.sweep(trash_fd))
        real_flock(fd, operation)

    monkeypatch.setattr(trash.fcntl, "flock", flock)
    try:
        made = trash.new_folder(trash_fd, "batch", store.modes)
    finally:
        os.close(trash_fd)
    assert made is not None
    name, fd = made
    try:
        assert swept == [1]  # the first folder went
        assert (trash_dir / name).is_dir() and os.listdir(trash_dir) == [name]
    finally:
        os.close(fd)


def test_a_trash_folder_another_locks_before_we_do_is_left_to_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a group-shared cache another member may open and lock a new trash folder
    between its mkdir and our lock, and hold it: clear, trims and upkeep must not
    wait for them."""
    store = LocalStore(tmp_path / "cache")
    trash_dir = store.folder("trash")
    trash_fd = store.open_folder("trash")
    ready = tmp_path / "ready"
    real_fix = trash.fsutil.fix_new_folder
    holders: list[subprocess.Popen[bytes]] = []
    first: list[str] = []

    def fix_new_folder(fd: int, modes: fsutil.Modes) -> None:
        real_fix(fd, modes)
        if holders:
            return
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        first.append(name)
        holders.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import fcntl, os, sys, time\n"
                    "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
                    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                    "open(sys.argv[2], 'w').close()\n"
                    "time.sleep(15)\n",
                    str(trash_dir / name),
                    str(ready),
                ]
            )
        )
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline, "the holder never took its lock"
            time.sleep(0.01)

    monkeypatch.setattr(trash.fsutil, "fix_new_folder", fix_new_folder)
    try:
        started = time.monotonic()
        made = trash.new_folder(trash_fd, "batch", store.modes)
        took = time.monotonic() - started
    finally:
        os.close(trash_fd)
        for holder in holders:
            holder.kill()
            holder.wait()
    assert made is not None
    name, fd = made
    try:
        assert took < 10, f"new_folder waited {took:.1f}s for another's lock"
        assert name != first[0]
        assert sorted(os.listdir(trash_dir)) == sorted([first[0], name])
    finally:
        os.close(fd)
    trash_fd = os.open(trash_dir, fsutil.DIR_FLAGS)
    try:
        assert trash.sweep(trash_fd) == 2  # nobody holds either now
    finally:
        os.close(trash_fd)


def _planted(folder: Path, owner: int, group: int) -> None:
    """A team folder (2770) holding a file any member may delete, and a member's
    private folder (0750) holding a file only that member may."""
    (folder / "private").mkdir(parents=True)
    (folder / "notes").write_text("any member may delete this\n")
    (folder / "private" / "secret").write_text("only its owner may delete this\n")
    for path, mode in ((folder, 0o2770), (folder / "private", 0o750)):
        os.chown(path, owner, group)
        path.chmod(mode)
    for path in (folder / "notes", folder / "private" / "secret"):
        os.chown(path, owner, group)


@requires_root
def test_a_sweep_never_empties_a_folder_a_member_moved_in_that_it_could_not_empty(tmp_path):
    """In a group-shared cache a member can move any folder of a team folder into the
    trash, another member's private one too: a sweep (by whoever, root's cron too)
    deletes only what the one who moved it could have deleted."""
    trash_dir = tmp_path / "trash"
    trash_dir.mkdir()
    os.chown(trash_dir, MEMBER_A, TEAM_GID)
    trash_dir.chmod(0o2770)
    _planted(trash_dir / "project", MEMBER_B, TEAM_GID)
    _planted(trash_dir / "other", MEMBER_B, TEAM_GID)
    (trash_dir / "other").chmod(0o750)  # moved in whole: not even its files
    fd = os.open(trash_dir, fsutil.DIR_FLAGS)
    try:
        trash.sweep(fd)
    finally:
        os.close(fd)
    assert (trash_dir / "project" / "private" / "secret").exists()
    assert not (trash_dir / "project" / "notes").exists()  # (its mover could delete it)
    assert (trash_dir / "other" / "notes").exists()
    assert (trash_dir / "other" / "private" / "secret").exists()


@requires_root
def test_a_private_folder_goes_whole_from_a_shared_folder_only_if_it_is_ones_own(tmp_path):
    """A folder (0700) found in a world-writable folder goes whole if it is one's own: no
    one but its owner could have moved it into that folder (a rename into another folder
    writes its ``..``), though anyone there could have given it its name (a build folder
    in an out_dir is known by its mark: ``local._abandoned``).  Another user's is left,
    unless the caller says it made it."""
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    for owner, ours, goes in ((0, False, True), (MEMBER_B, False, False), (MEMBER_B, True, True)):
        (out / "build" / "sub").mkdir(parents=True, exist_ok=True)
        (out / "build" / "sub" / "x.o").write_bytes(b"x")
        for path in (out / "build", out / "build" / "sub", out / "build" / "sub" / "x.o"):
            os.chown(path, owner, owner)
        (out / "build").chmod(0o700)
        fsutil.remove_tree(out / "build", ours=ours)
        assert (out / "build").exists() is not goes, (owner, ours)


def test_an_entry_is_kept_under_any_name_that_names_a_bucket_but_no_dot_folder(tmp_path):
    """A folder remote keeps CANN's kernels by their names (``te_add_<sha256>``) and
    its index as ``#index``; a name whose bucket would be ``..``, ``.`` or a dot
    folder of the cache's own is refused before anything is written."""
    from opcache.storage.entry import make_manifest

    store = LocalStore(tmp_path / "store")
    files = {"k.o": b"kernel"}
    for key in ("te_add_" + "0" * 64, "#index"):
        assert store.put(SOC, key, make_manifest(key, files, 1.0, {}, 0.0), files, now=T0)
    for key in ("..x", ".opcache", "x", "a/b"):
        with pytest.raises(ValueError, match="cannot name an entry"):
            store.put(SOC, key, make_manifest(key, files, 1.0, {}, 0.0), files, now=T0)
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [".opcache", SOC]
