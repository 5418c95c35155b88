"""Hostile files where opcache expects its own: nothing hangs, nothing is written through.

Anyone who can write a folder can put a FIFO, a link, a device file or a
folder where opcache expects a file: ``op_cache.ini`` in a shared cache root,
CANN's ``<kernel>.lock`` and ``op_cache_file_del.lock``, an artifact's name in
an out_dir others write to.  A garbled force note is the same kind of input.
Each case runs opcache in a real process bounded by a timeout, so a
regression fails instead of hanging the test run.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_cache import MP, SOC, ToyCompiler, entry_dirs, expected_files, make_request, read_dir
from helpers_cann import held_by_other_process, kernel_name, set_access, store_entry
from helpers_cann import write_ini as write_cann_ini
from helpers_faults import IS_ROOT, MEMBER_A, NEEDS_ROOT, NOBODY, TEAM_GID, settings_for
from helpers_wrap import opcache as run_opcache

import opcache
from opcache import cann_format, fsutil, wrap
from opcache.cache import BUILD_SESSION
from opcache.wrap import HOST_CHIP

GCC = shutil.which("gcc")
TIMEOUT = 60  # far above any run here: only a hang reaches it
HOUR = 3600
SIZE_INI = "[op_compiler_cache]\nmax_op_cache_size=1\nremain_cache_size_ratio=10\n"


def plant(path: Path, kind: str, target: Path | None = None) -> None:
    """Put a ``kind`` where opcache expects a regular file (``target``: where a link points)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        assert target is not None
        path.symlink_to(target)
    elif kind == "device":
        if not IS_ROOT:
            pytest.skip("only root can make a device file")
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # a /dev/null of its own
    elif kind == "folder":
        path.mkdir()
    else:
        raise AssertionError(kind)


def kind_of(path: Path) -> str:
    mode = os.lstat(path).st_mode
    kinds = {stat.S_ISFIFO: "fifo", stat.S_ISLNK: "link", stat.S_ISCHR: "device"}
    kinds |= {stat.S_ISDIR: "folder", stat.S_ISREG: "file"}
    return next(name for test, name in kinds.items() if test(mode))


# -- op_cache.ini ----------------------------------------------------------------------------


def ini_env(tmp_path: Path) -> dict[str, str]:
    """A private environment whose cache is ``<tmp>/base/kernel_cache`` (and CANN's too)."""
    env = base_env(tmp_path)
    del env["ASCEND_CACHE_PATH"]
    env["OPCACHE_DIR"] = str(tmp_path / "base")
    return env


def plant_ini(path: Path, kind: str, outside: Path) -> None:
    """A hostile ``kind`` of op_cache.ini at ``path``; valid size keys wherever it leads."""
    outside.mkdir()
    target = outside / "op_cache.ini"
    target.write_text(SIZE_INI)
    if kind == "another user's":
        if not IS_ROOT:
            pytest.skip(NEEDS_ROOT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(SIZE_INI)
        os.chown(path, NOBODY, NOBODY)
    elif kind == "writable by others":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(SIZE_INI)
        os.chmod(path, 0o666)
    else:
        plant(path, kind, target)


INI_KINDS = ["fifo", "link", "device", "folder", "another user's", "writable by others"]
INI_PLACES = {"root": "base/kernel_cache/op_cache.ini", "cache dir": "base/op_cache.ini"}


@pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
@pytest.mark.parametrize("place", list(INI_PLACES))
@pytest.mark.parametrize("kind", INI_KINDS)
def test_a_hostile_op_cache_ini_is_one_warning_and_every_command_goes_on(
    tmp_path: Path, kind: str, place: str
) -> None:
    ini = tmp_path / INI_PLACES[place]
    plant_ini(ini, kind, tmp_path / "outside")
    before = (kind_of(ini), os.lstat(ini).st_mode)
    env = ini_env(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "k.c").write_text("int k(int x) { return x * 3; }\n")

    argv = ["wrap", "--", "gcc", "-c", "k.c", "-o", "k.o"]
    done = run_opcache(*argv, env=env, cwd=project, text=True, timeout=TIMEOUT)
    assert (project / "k.o").stat().st_size > 0
    warned = [line for line in done.stderr.splitlines() if str(ini) in line]
    assert len(warned) == 1, done.stderr
    assert "ignoring" in warned[0]

    config = run_opcache("config", "--json", env=env, cwd=tmp_path, text=True, timeout=TIMEOUT)
    assert '"max_op_cache_size_mb": 500' in config.stdout  # the planted limit of 1 MB is not read
    for command in (["stats"], ["age"], ["verify"], ["cann", "stats"], ["cann", "age"]):
        run_opcache(*command, env=env, cwd=tmp_path, status=None, timeout=TIMEOUT)

    # Nothing written through it, nothing put in its place.
    assert (kind_of(ini), os.lstat(ini).st_mode) == before
    assert (tmp_path / "outside" / "op_cache.ini").read_text() == SIZE_INI


def test_making_op_cache_ini_never_changes_a_file_a_link_swapped_in_leads_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("secret")
    os.chmod(victim, 0o600)
    ini = tmp_path / "root" / "op_cache.ini"
    real_fdopen = os.fdopen

    def swapped(fd: int, *args: object, **kwargs: object):
        # Someone who can write the root swaps the temp file for a link as it is written.
        (temp,) = [p for p in ini.parent.iterdir() if p.name.startswith(".op_cache.ini.")]
        temp.unlink()
        temp.symlink_to(victim)
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", swapped)
    opcache.ensure_ini_file(ini, fsutil.group_shared(os.getgid()))
    monkeypatch.undo()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600 and victim.read_text() == "secret"


@pytest.mark.skipif(not IS_ROOT, reason=NEEDS_ROOT)
def test_a_group_shared_cache_reads_the_op_cache_ini_another_member_wrote(tmp_path: Path) -> None:
    root = tmp_path / "ops" / "kernel_cache"
    root.mkdir(parents=True)
    ini = root / "op_cache.ini"
    ini.write_text(SIZE_INI)
    os.chown(ini, MEMBER_A, TEAM_GID)
    os.chmod(ini, 0o660)
    assert settings_for(tmp_path, shared_group=TEAM_GID).max_op_cache_size_mb == 1
    # The same file, but the group is not the cache's: another user's file, ignored.
    assert settings_for(tmp_path).max_op_cache_size_mb == 500


# -- CANN's lock files -----------------------------------------------------------------------


def cann_folder(base: Path) -> tuple[Path, list[str]]:
    """A CANN chip folder over its 1 MB limit: three entries, all idle for hours."""
    root = base / "kernel_cache"
    chip = root / SOC
    kernels = []
    for label in ("a", "b", "c"):
        kernel = kernel_name("Add", label)
        set_access(store_entry(chip, kernel, os.urandom(500 * 1024))[:2], time.time() - 5 * HOUR)
        kernels.append(kernel)
    write_cann_ini(root, max_mb=1, ratio=10)
    return chip, kernels


def cann_run(base: Path, *args: str) -> tuple[int, dict]:
    env = {**base_env(base.parent), "HOME": str(base.parent)}
    del env["ASCEND_CACHE_PATH"]
    argv = ("cann", *args, "--op_compiler_cache_dir", str(base), "--json")
    done = run_opcache(*argv, env=env, cwd=base.parent, status=None, timeout=TIMEOUT)
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_a_kernel_lock_that_is_not_a_file_keeps_its_entry_and_never_hangs_age(
    tmp_path: Path, kind: str
) -> None:
    base = tmp_path / "atc"
    chip, (first, *others) = cann_folder(base)
    lock = chip / f"{first}.lock"
    lock.unlink()
    plant(lock, kind)
    status, report = cann_run(base, "age")
    assert status == 0
    chip_report = report["chips"][SOC]
    assert chip_report["kept_locked"] == [first]
    assert sorted(chip_report["removed"]) == sorted(others)
    assert (chip / f"{first}.json").exists() and kind_of(lock) == kind
    # CANN's aging lock was let go: another process takes it at once.
    with held_by_other_process(chip / cann_format.DEL_LOCK):
        pass
    status, report = cann_run(base, "verify", "--fix")
    assert status in (0, 1)


@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "link"])
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry run", "age"])
def test_an_aging_lock_that_is_not_a_file_skips_aging_and_is_left_as_it_is(
    tmp_path: Path, kind: str, dry_run: bool
) -> None:
    base = tmp_path / "atc"
    chip, kernels = cann_folder(base)
    victim = tmp_path / "victim"
    victim.write_bytes(b"")
    os.chmod(victim, 0o600)
    lock = chip / cann_format.DEL_LOCK
    plant(lock, kind, victim)
    before = os.lstat(lock)
    status, report = cann_run(base, "age", *(["--dry-run"] if dry_run else []))
    assert status == 0
    chip_report = report["chips"][SOC]
    assert cann_format.DEL_LOCK in chip_report["skipped"]
    assert chip_report["removed"] == []
    assert all((chip / f"{kernel}.json").exists() for kernel in kernels)
    after = os.lstat(lock)
    assert (after.st_mode, after.st_size) == (before.st_mode, before.st_size)  # no chmod, no write
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600 and victim.read_bytes() == b""


# -- out_dir artifacts -----------------------------------------------------------------------


def _hit_child(tmp: str, shared: str, how: str) -> None:
    """The hit (or compile_many's copy of one key) into ``shared``, in a child: if it
    hangs on what is in out_dir, the test fails rather than hangs."""
    tmp_path = Path(tmp)
    compiler = ToyCompiler(tmp_path / "calls")
    request = make_request(0)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        if how == "compile":
            statuses = [cache.compile(request, compiler, tmp_path / "first").status]
            statuses.append(cache.compile(request, compiler, shared).status)
        else:  # one key twice: the second request's copy is delivered as a hit
            twin = make_request(0, op_name="add_twin")
            results = cache.compile_many([request, twin], compiler, [tmp_path / "first", shared])
            statuses = [r.status for r in results]
    (tmp_path / "statuses").write_text(json.dumps(statuses))


OUT_KINDS = ["symlink", "hard link", "fifo", "device", "another user's file"]


@pytest.mark.parametrize("how", ["compile", "compile_many"])
@pytest.mark.parametrize("kind", OUT_KINDS)
def test_a_hit_replaces_what_someone_put_in_an_artifact_s_place_and_writes_nothing_through(
    tmp_path: Path, kind: str, how: str
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    shared = tmp_path / "shared"  # an out_dir others can write to, as /tmp
    shared.mkdir()
    os.chmod(shared, 0o1777)
    files = expected_files(make_request(0))
    for name in files:
        path = shared / name
        if kind == "symlink":
            plant(path, "link", victim)
        elif kind == "hard link":
            os.link(victim, path)
        elif kind == "another user's file":
            if not IS_ROOT:
                pytest.skip(NEEDS_ROOT)
            path.write_bytes(b"theirs")
            os.chmod(path, 0o666)  # they can change what we write there, whenever they like
            os.chown(path, NOBODY, NOBODY)
        else:
            plant(path, kind)
    child = MP.Process(target=_hit_child, args=(str(tmp_path), str(shared), how))
    child.start()
    child.join(TIMEOUT)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"a hit into an out_dir holding a {kind} hangs")
    assert child.exitcode == 0
    assert json.loads((tmp_path / "statuses").read_text()) == ["miss", "hit"]
    assert victim.read_bytes() == b"someone else's file"
    for name, data in files.items():
        path = shared / name
        assert kind_of(path) == "file" and path.read_bytes() == data
        assert path.stat().st_uid == os.geteuid() and path.stat().st_nlink == 1
    assert sorted(os.listdir(shared)) == sorted(files)  # no build folder left


def test_a_hit_rewrites_its_own_files_in_place(tmp_path: Path) -> None:
    """The usual case, a file of ours from an earlier build: written in place, as always."""
    compiler = ToyCompiler(tmp_path / "calls")
    out = tmp_path / "out"
    files = expected_files(make_request(0))
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "first")
        out.mkdir()
        for name in files:
            (out / name).write_bytes(b"an older build's bytes, longer than the new ones" * 100)
            os.chmod(out / name, 0o600)
        inodes = {name: (out / name).stat().st_ino for name in files}
        assert cache.compile(make_request(0), compiler, out).status == "hit"
    assert read_dir(out) == files
    assert {name: (out / name).stat().st_ino for name in files} == inodes
    assert all(stat.S_IMODE((out / name).stat().st_mode) == 0o600 for name in files)


def test_a_hit_makes_a_missing_out_dir(tmp_path: Path) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    out = tmp_path / "new" / "deeper"
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "first")
        assert cache.compile(make_request(0), compiler, out).status == "hit"
    assert read_dir(out) == expected_files(make_request(0))
    assert sorted(os.listdir(out)) == sorted(expected_files(make_request(0)))


def test_wrap_makes_a_restored_package_executable_before_it_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    os.chmod(victim, 0o644)
    out = tmp_path / "out"  # op_compiler's -o, a folder others can write to
    out.mkdir(mode=0o777)
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "k.run").write_bytes(b"#!/bin/sh\n")
    os.chmod(staging / "k.run", 0o644)
    plan = wrap.Plan(make_request(0), "", lambda workdir: [], output_dir=out, executables=(".run",))
    real_replace = os.replace

    def replace_then_swap(src: str, dst: str) -> None:
        real_replace(src, dst)
        os.unlink(dst)  # someone swaps a link in as soon as the package is there
        os.symlink(victim, dst)

    monkeypatch.setattr(os, "replace", replace_then_swap)
    wrap._restore(plan, {"k.run": staging / "k.run"})
    monkeypatch.undo()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644


# -- force notes -----------------------------------------------------------------------------


def force_note(tmp_path: Path, soc: str = SOC) -> Path:
    return settings_for(tmp_path).root / ".opcache" / "force" / soc


GARBLED = {
    "garbage time": b"opcache:build\ngarbage",
    "no time": b"opcache:build",
    "endless time": b"opcache:build\ninf",
    "far future": b"opcache:build\n1e300",
    "not text": b"\xff\xfe\n\x00",
    "empty": b"",
}


@pytest.mark.parametrize("note", list(GARBLED.values()), ids=list(GARBLED))
def test_a_garbled_force_note_is_another_session_cleared_once(tmp_path: Path, note: bytes) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    root = settings_for(tmp_path).root
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        old = cache.compile(make_request(9), compiler, tmp_path / "o").key
    path = force_note(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(note)
    for status in ("miss", "hit"):  # one clear, then the build's own note
        with opcache.OpCache(settings_for(tmp_path, "force"), session=BUILD_SESSION) as cache:
            assert cache.compile(make_request(1), compiler, tmp_path / "o").status == status
    assert old not in entry_dirs(root)
    assert len(entry_dirs(root)) == 1


@pytest.mark.parametrize("session", ["ci\n1", "ci\\n1", "\udcff", "a\x00b", "é 缓存"])
def test_any_session_string_clears_its_chip_once(tmp_path: Path, session: str) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    root = settings_for(tmp_path).root
    for index, status in ((1, "miss"), (1, "hit"), (2, "miss")):
        with opcache.OpCache(settings_for(tmp_path, "force"), session=session) as cache:
            assert cache.compile(make_request(index), compiler, tmp_path / "o").status == status
    assert len(entry_dirs(root)) == 2
    # A session named as this one is spelled in the note is still another session.
    other = ascii(session)
    with opcache.OpCache(settings_for(tmp_path, "force"), session=other) as cache:
        assert cache.compile(make_request(1), compiler, tmp_path / "o").status == "miss"


@pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
def test_a_force_build_through_wrap_survives_a_garbled_note(tmp_path: Path) -> None:
    env = ini_env(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "k.c").write_text("int k(int x) { return x * 3; }\n")
    note = tmp_path / "base" / "kernel_cache" / ".opcache" / "force" / HOST_CHIP
    note.parent.mkdir(parents=True)
    note.write_bytes(b"opcache:build\ngarbage")
    argv = ["wrap", "--op_compiler_cache_mode", "force", "--", "gcc", "-c", "k.c", "-o", "k.o"]
    for _ in range(2):
        run_opcache(*argv, env=env, cwd=project, timeout=TIMEOUT)
        assert (project / "k.o").stat().st_size > 0
    stats = run_opcache("stats", "--json", env=env, cwd=tmp_path, status=None, timeout=TIMEOUT)
    chip = json.loads(stats.stdout)["chips"]
    assert (chip[HOST_CHIP]["misses"], chip[HOST_CHIP]["hits"]) == (1, 1)
