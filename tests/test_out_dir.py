"""What a compile leaves in its out_dir besides the artifacts: nothing.

The compiler runs in a build folder inside out_dir, locked while it runs; a
compile killed there leaves the folder, and the next compile into that out_dir
removes it (only once its writer is dead, and nothing else).  A failed compile
leaves no out_dir it made.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers_cache import ToyCompiler, compiling_half_way, expected_files, make_request, read_dir
from helpers_faults import settings_for

import opcache


def build_folders(out: Path) -> list[Path]:
    return sorted(out.glob(".opcache-build.*"))


def test_a_killed_compiles_build_folder_goes_with_the_next_compile_into_its_out_dir(
    tmp_path: Path,
) -> None:
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
        assert not live.exists()
        assert all(folder.is_dir() for folder in others)
        assert (out / "user.o").read_bytes() == b"mine"
        for index in (1, 2):
            for name, data in expected_files(make_request(index)).items():
                assert (out / name).read_bytes() == data


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
