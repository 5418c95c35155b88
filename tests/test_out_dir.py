"""What a compile leaves in its out_dir besides the artifacts: nothing.

The compiler runs in a build folder inside out_dir, locked while it runs; a
compile killed there leaves the folder, and a later compile into that out_dir
removes it (only once its writer is dead, and nothing else; a process looks
through an out_dir at most once a minute).  A failed compile
leaves no out_dir it made.
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
from pathlib import Path

import pytest
from helpers_cache import ToyCompiler, compiling_half_way, expected_files, make_request, read_dir
from helpers_faults import open_folder, settings_for

import opcache
from opcache import flow
from opcache.storage.local import TMP_GRACE_SECONDS


def build_folders(out: Path) -> list[Path]:
    return sorted(out.glob(".opcache-build.*"))


def a_minute_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Move this process's clock for looking through out_dirs on by a minute: one
    looked through a moment ago is looked through again at the next compile."""
    now = flow._sweep_clock()
    monkeypatch.setattr(flow, "_sweep_clock", lambda: now + flow._SWEEP_EVERY)


def test_a_killed_compiles_build_folder_goes_with_a_compile_into_its_out_dir_a_minute_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process looks through an out_dir at its first compile into it, then once a
    minute at most: a listing per compile made a miss into a folder of N files O(N)."""
    with compiling_half_way(tmp_path) as child:
        out = tmp_path / "out" / f"{child.pid}-0"
        (live,) = build_folders(out)
        # Not ours to judge: wrap's staging, a user's folders and files, and a
        # young build folder of another host sharing out_dir over NFS.
        others = [
            out / ".opcache-wrap.123.deadbeef",
            out / ".opcache-k2j3h4x9",
            out / ".opcache-build.elsewhere.1.deadbeef",
            out / ".opcache-build.notes",
        ]
        for folder in others:
            folder.mkdir()
        (out / "user.o").write_bytes(b"mine")
        compiler = ToyCompiler(tmp_path / "calls")
        with opcache.OpCache(settings_for(tmp_path)) as cache:
            assert cache.compile(make_request(1), compiler, out).status == "miss"
            assert live.is_dir()  # its compile is still running
            child.kill()
            child.join(10)
            assert child.exitcode == -signal.SIGKILL
            assert build_folders(out) == sorted([live, *others[2:]])
            assert cache.compile(make_request(2), compiler, out).status == "miss"
            assert live.is_dir()  # (looked through a moment ago)
            a_minute_later(monkeypatch)
            assert cache.compile(make_request(3), compiler, out).status == "miss"
        assert not live.exists()
        assert all(folder.is_dir() for folder in others)
        assert (out / "user.o").read_bytes() == b"mine"
        for index in (1, 2, 3):
            for name, data in expected_files(make_request(index)).items():
                assert (out / name).read_bytes() == data


def test_another_hosts_build_folder_still_written_in_is_not_taken_for_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over NFS without locks, another host's build folder is judged by its age.  Its
    compiler writes in the inner marked folder, whose time moves; the outer folder's
    does not: a compile running past the grace period was taken for dead and its
    folder deleted under it."""
    out = tmp_path / "out"
    live = out / ".opcache-build.elsewhere.1.0badf00d"
    work = live / ".opcache-work.0badf00d"
    work.mkdir(parents=True)
    (work / "half.o").write_bytes(b"half")
    live.chmod(0o700)
    old = os.stat(live).st_mtime - 2 * TMP_GRACE_SECONDS
    os.utime(live, (old, old))  # (the outer folder: untouched since it was made)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(0), ToyCompiler(tmp_path / "calls"), out)
    assert (work / "half.o").read_bytes() == b"half"
    os.utime(work, (old, old))  # (and no longer written in either: dead)
    a_minute_later(monkeypatch)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(1), ToyCompiler(tmp_path / "calls"), out)
    assert not live.exists()


@pytest.mark.parametrize("mode", ["enable", "disable"])
def test_a_failed_compile_leaves_no_out_dir_it_made(tmp_path: Path, mode: str) -> None:
    failing = ToyCompiler(tmp_path / "calls", fail=True)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "user.o").write_bytes(b"mine")
    with opcache.OpCache(settings_for(tmp_path, mode)) as cache:
        for out in (tmp_path / "new" / "op", existing):
            with pytest.raises(opcache.CompileError):
                cache.compile(make_request(0), failing, out)
        assert not (tmp_path / "new" / "op").exists()
        assert os.listdir(existing) == ["user.o"]
        good = ToyCompiler(tmp_path / "calls")
        cache.compile(make_request(0), good, tmp_path / "new" / "op")
    assert read_dir(tmp_path / "new" / "op") == expected_files(make_request(0))


def test_a_failed_compile_leaves_none_of_the_folders_it_made(tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper" / "op"
    for mode in ("enable", "disable"):
        settings = settings_for(tmp_path, mode)
        with opcache.OpCache(settings) as cache, pytest.raises(opcache.CompileError):
            cache.compile(make_request(0), ToyCompiler(tmp_path / "calls", fail=True), out)
        assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    with opcache.OpCache(settings) as cache, pytest.raises(opcache.CompileError):
        cache.compile(
            make_request(0), ToyCompiler(tmp_path / "calls", fail=True), tmp_path / "kept" / "op"
        )
    assert (tmp_path / "kept").is_dir()  # it was there before


def probed_as_its_writer_locks_it(monkeypatch: pytest.MonkeyPatch, folder: Path) -> list[Path]:
    """Each new folder made in ``folder`` is probed by a clean-up looking for dead
    writers (``_abandoned``: an open and a flock of its own, held for its look)
    just as its writer first tries to lock it, between the writer's mkdir and its
    lock; the probe lets go after that try.  Returns the folders probed."""
    real = fcntl.flock
    probed: list[Path] = []

    def flock(fd: int, operation: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.parent != folder or path in probed or not path.is_dir():
            return real(fd, operation)
        probed.append(path)
        probe = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            real(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return real(fd, operation)
        finally:
            os.close(probe)

    monkeypatch.setattr(fcntl, "flock", flock)
    return probed


@pytest.mark.parametrize("where", ["out_dir", "cache tmp"])
def test_a_clean_up_probing_a_new_build_folder_does_not_fail_its_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """Another compile into the same out_dir looks for dead writers' build folders
    there (``clean_leftovers`` does the same in the cache's tmp): its probe may
    hold a new folder's lock at the moment the folder's writer first tries it.
    (That try failed the compile, or its store, with BlockingIOError.)"""
    out = tmp_path / "out"
    out.mkdir()
    settings = settings_for(tmp_path)
    folder = out if where == "out_dir" else settings.root / ".opcache" / "tmp"
    folder.mkdir(parents=True, exist_ok=True)
    probed = probed_as_its_writer_locks_it(monkeypatch, folder)
    with opcache.OpCache(settings) as cache:
        result = cache.compile(make_request(0), ToyCompiler(tmp_path / "calls"), out)
        again = cache.compile(make_request(0), ToyCompiler(tmp_path / "calls"), tmp_path / "o2")
    assert len(probed) == 1  # the race's window was opened
    assert (result.status, result.reason) == ("miss", None)
    assert again.status == "hit"  # stored
    assert read_dir(out) == expected_files(make_request(0))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


class FailsFirstOnceTheOtherComes(ToyCompiler):
    """The toy compiler; its first compile fails, once ``other_comes`` is set."""

    def __init__(self, calls_file: Path, other_comes: threading.Event) -> None:
        super().__init__(calls_file)
        self.compiling = threading.Event()
        self.other_comes = other_comes

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        if not self.compiling.is_set():
            self.compiling.set()
            self.other_comes.wait(30)
            raise opcache.CompileError("the first compile fails")
        super().compile(request, workdir)


def test_a_failed_compile_removing_the_out_dir_it_made_does_not_fail_another_into_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two compiles into one new out_dir: the first makes it, the second finds it
    there; the first fails and removes it just as the second makes its build
    folder there.  (The second failed with FileNotFoundError.)"""
    out = tmp_path / "new" / "out"
    at_build, removed = threading.Event(), threading.Event()
    compiler = FailsFirstOnceTheOtherComes(tmp_path / "calls", at_build)
    real_missing, real_build, real_rmdir = (
        flow._missing_folders, flow.new_build_folder, Path.rmdir
    )  # fmt: skip
    looked: list[int] = []  # the threads that looked for the out folder, in turn
    mutex = threading.Lock()

    def missing_folders(folder: Path) -> list[Path]:
        me = threading.get_ident()
        with mutex:
            second = me not in looked and len(looked) == 1
            if me not in looked:
                looked.append(me)
        if second:
            compiler.compiling.wait(30)  # (looks once the first compiles there)
        return real_missing(folder)

    def new_build_folder(parent: Path, *args: object, **kwargs: object) -> object:
        if looked[1:] == [threading.get_ident()] and not at_build.is_set():
            at_build.set()
            removed.wait(30)
        return real_build(parent, *args, **kwargs)

    def rmdir(folder: Path) -> None:
        real_rmdir(folder)
        if folder == out:
            removed.set()

    monkeypatch.setattr(flow, "_missing_folders", missing_folders)
    monkeypatch.setattr(flow, "new_build_folder", new_build_folder)
    monkeypatch.setattr(Path, "rmdir", rmdir)
    requests = [make_request(0), make_request(1)]
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        results = cache.compile_many(requests, compiler, [out, out], jobs=2)
    assert removed.is_set()  # the race's window was opened
    failed, done = sorted(results, key=lambda r: r.status)
    assert failed.status == "error" and isinstance(failed.error, opcache.CompileError)
    assert done.status == "miss", done.error
    (request,) = [r for r, result in zip(requests, results, strict=True) if result is done]
    assert read_dir(out) == expected_files(request)


def test_a_failed_compile_removing_the_out_dir_it_made_does_not_fail_a_hit_into_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing compile finds a new out_dir missing; a hit into it finds it missing
    too and makes it; the failure removes it (it made it too, as far as it knows)
    before the hit opens its files there.  (The hit failed with FileNotFoundError.)"""
    out = tmp_path / "new" / "out"
    hit, failing = make_request(0), make_request(1)
    looked, made, removed = threading.Event(), threading.Event(), threading.Event()
    real_missing, real_mkdir, real_rmdir = flow._missing_folders, Path.mkdir, Path.rmdir
    hitting = threading.get_ident()

    def missing_folders(folder: Path) -> list[Path]:
        found = real_missing(folder)
        if threading.get_ident() != hitting and not looked.is_set():
            looked.set()
            made.wait(30)  # (then it makes the folder too, finding it there)
        return found

    def mkdir(folder: Path, *args: object, **kwargs: object) -> None:
        real_mkdir(folder, *args, **kwargs)
        if folder == out and threading.get_ident() == hitting and not made.is_set():
            made.set()
            removed.wait(30)

    def rmdir(folder: Path) -> None:
        real_rmdir(folder)
        if folder == out:
            removed.set()

    errors: list[BaseException] = []

    def fail(cache: opcache.OpCache) -> None:
        try:
            cache.compile(failing, ToyCompiler(tmp_path / "calls", fail=True), out)
        except BaseException as e:  # (the thread's, for the test to see)
            errors.append(e)

    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        assert cache.compile(hit, compiler, tmp_path / "first").status == "miss"
        monkeypatch.setattr(flow, "_missing_folders", missing_folders)
        monkeypatch.setattr(Path, "mkdir", mkdir)
        monkeypatch.setattr(Path, "rmdir", rmdir)
        neighbour = threading.Thread(target=fail, args=(cache,))
        neighbour.start()
        try:
            assert looked.wait(30)
            result = cache.compile(hit, compiler, out)
        finally:
            made.set()  # (a neighbour still waiting goes on)
            neighbour.join(30)
    assert removed.is_set()  # the race's window was opened
    assert [type(e) for e in errors] == [opcache.CompileError]
    assert result.status == "hit"
    assert read_dir(out) == expected_files(hit)


def test_a_hit_replacing_a_link_in_an_out_dir_that_vanishes_makes_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit's file whose name holds a link is written in a build folder of its own
    and moved in; the link's owner removes it and a failing compile into the
    out_dir the folder it made, just before that build folder is made there.
    (The hit failed with FileNotFoundError.)"""
    out = tmp_path / "out"
    out.mkdir()
    (out / "kernel.o").symlink_to(tmp_path / "elsewhere")
    real_build = flow.new_build_folder
    vanished: list[Path] = []

    def new_build_folder(parent: Path, *args: object, **kwargs: object) -> object:
        if parent == out and not vanished:
            (out / "kernel.o").unlink()
            out.rmdir()
            vanished.append(out)
        return real_build(parent, *args, **kwargs)

    monkeypatch.setattr(flow, "new_build_folder", new_build_folder)
    assert flow.deliver(out, {"kernel.o": b"new"}) == {"kernel.o": out / "kernel.o"}
    assert vanished  # the race's window was opened
    assert read_dir(out) == {"kernel.o": b"new"}
    assert not build_folders(out)


_HALF_WRITTEN = r"""
import os, resource, signal, sys
from pathlib import Path
from opcache.flow import deliver
out = Path(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (EFBIG part-way, as a full disk gives)
resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))
try:
    deliver(out, {"kernel.o": b"new!" * 2000})
except OSError as e:
    print("failed:", e.strerror)
"""


def test_a_hit_that_fails_part_way_leaves_no_output_at_all(tmp_path: Path) -> None:
    # Not the new bytes over the last build's tail at its size and a new mtime,
    # which make would take for up to date: no file, as gcc leaves none.
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    (out / "kernel.o").write_bytes(b"OLD-" * 2500)  # the last build's, longer
    done = subprocess.run(
        [sys.executable, "-c", _HALF_WRITTEN, str(out)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "failed: File too large" in done.stdout
    assert not (out / "kernel.o").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hold another user's lease")
def test_a_file_another_user_holds_a_lease_on_is_replaced_as_a_miss_replaces_it() -> None:
    import fcntl

    from opcache.flow import deliver

    with open_folder() as shared:
        out = shared / "out"
        out.mkdir()
        out.chmod(0o777)  # a team's out folder
        _deliver_over_a_lease(out, fcntl, deliver)


def _deliver_over_a_lease(out: Path, fcntl, deliver) -> None:  # type: ignore[no-untyped-def]
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # another user: a file of theirs at the artifact's name, leased
        try:
            signal.signal(signal.SIGIO, signal.SIG_IGN)  # (told of the lease's break)
            os.setgid(64_002)
            os.setuid(64_002)
            fd = os.open(out / "kernel.o", os.O_RDONLY | os.O_CREAT, 0o666)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            os.write(ready_w, b"x")
            signal.pause()
        finally:
            os._exit(0)
    os.close(ready_w)  # (a child that failed closes the pipe: no wait for ever)
    try:
        assert os.read(ready_r, 1) == b"x"
        assert deliver(out, {"kernel.o": b"new"}) == {"kernel.o": out / "kernel.o"}
        assert (out / "kernel.o").read_bytes() == b"new"
    finally:
        os.close(ready_r)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
