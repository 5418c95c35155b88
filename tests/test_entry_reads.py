"""Entries that keep what their compile read beyond the key (the manifest's "reads"):
a read set that is no read set is a corrupt entry, never an error of the compile;
another machine's entry, of the same files, is kept here with this machine's
times, so its hits need no digest.  (The back-ends that make them: test_cc_reads,
test_compilers.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers_cache import SOC, make_request, make_settings

import opcache
from opcache import readset
from opcache.key import compute_key
from opcache.storage.entry import make_manifest
from opcache.storage.local import LocalStore


class ReadingCompiler:
    """A compiler whose kernel holds the file ``options["config"]`` names: it says
    so with the read set of that file."""

    name = "reading"

    def fingerprint(self) -> str:
        return "reading 1"

    def compile(self, request: opcache.OpRequest, workdir: Path) -> readset.ReadSet:
        started = time.time_ns()
        config = request.options["config"]
        (workdir / "k.o").write_bytes(b"K\0" + Path(config).read_bytes())
        return readset.of_files([config], started)


def request_of(config: Path) -> opcache.OpRequest:
    return make_request(options={"config": str(config)})


def key_of(request: opcache.OpRequest) -> str:
    compiler = ReadingCompiler()
    return compute_key(request, compiler.name, compiler.fingerprint())[0]


def plant(root: Path, request: opcache.OpRequest, reads: list) -> None:
    """An entry of ``request`` with ``reads``, as another process of the folder could write."""
    key, files = key_of(request), {"k.o": b"K\0planted"}
    LocalStore(root).put(
        SOC, key, make_manifest(key, files, 1.0, {}, 1.0, reads=reads), files, now=1.0
    )


NOT_A_PATH = [["/tmp/\ud800", "file", 0o644, 1, 1, 1, "0" * 32]]  # (a lone surrogate)


@pytest.mark.parametrize("reads", [NOT_A_PATH, [["/x\0y", "missing", 0, 0, 0, 0, ""]], [[1]]])
def test_a_read_set_that_is_no_read_set_is_a_corrupt_entry_not_an_error(tmp_path, reads):
    config = tmp_path / "config"
    config.write_text("one\n")
    settings = make_settings(tmp_path / "cache", tmp_path)
    plant(settings.root, request_of(config), reads)
    time.sleep(0.02)
    with opcache.OpCache(settings) as cache:
        result = cache.compile(request_of(config), ReadingCompiler(), tmp_path / "a")
        [batch] = cache.compile_many([request_of(config)], ReadingCompiler(), [tmp_path / "b"])
        report = cache.stats()
    assert (result.status, batch.status) == ("miss", "hit")
    assert result.files["k.o"].read_bytes() == b"K\0one\n"
    assert report["corrupt"] == 1


def test_a_remote_read_set_that_is_no_read_set_is_a_corrupt_value_not_an_error(tmp_path):
    config = tmp_path / "config"
    config.write_text("one\n")
    remote = tmp_path / "remote"
    plant(remote, request_of(config), NOT_A_PATH)  # (a file:// remote is a cache folder)
    time.sleep(0.02)
    settings = make_settings(tmp_path / "cache", tmp_path, remote=remote.as_uri())
    with opcache.OpCache(settings) as cache:
        [result] = cache.compile_many([request_of(config)], ReadingCompiler(), [tmp_path / "a"])
        report = cache.stats()
    assert result.status == "miss"
    assert result.files["k.o"].read_bytes() == b"K\0one\n"
    assert report["remote_corrupt"] == 1


def machines_sharing_a_folder(tmp_path: Path):  # type: ignore[no-untyped-def]
    """(the file the compiles read, holding "one", the remote folder, a cache of a
    machine by name) for machines sharing one remote folder."""
    config = tmp_path / "config"
    config.write_text("one\n")
    remote = tmp_path / "remote"
    remote.mkdir()
    time.sleep(0.02)  # (a file a compile reads, written as it starts, leaves it unstored)

    def machine(name: str) -> opcache.OpCache:
        return opcache.OpCache(make_settings(tmp_path / name, tmp_path, remote=remote.as_uri()))

    return config, remote, machine


def test_another_machines_entry_of_the_same_files_is_kept_with_this_machines_times(tmp_path):
    """The same bytes at the same path, with other times (another machine, or a file
    written again): served, and the local copy records this machine's times, so a
    hit of it hashes nothing."""
    config, remote, machine = machines_sharing_a_folder(tmp_path)
    with machine("m1") as one:
        first = one.compile(request_of(config), ReadingCompiler(), tmp_path / "a")
    config.write_text("one\n")  # (the same bytes: new times)
    time.sleep(0.02)
    with machine("m2") as two:
        second = two.compile(request_of(config), ReadingCompiler(), tmp_path / "b")
    assert (first.status, second.status, second.tier) == ("miss", "hit", "remote")
    kept = LocalStore(make_settings(tmp_path / "m2", tmp_path).root).get(SOC, second.key)
    assert kept is not None
    assert readset.reads_now(kept.reads) == readset.SAME
    remote_copy = LocalStore(remote).get(SOC, second.key)
    assert readset.reads_now(remote_copy.reads) == readset.MOVED  # (the first machine's)


def test_a_stale_remote_entry_is_counted_once_and_replaced_in_a_batch(tmp_path):
    """compile_many of an operator whose remote entry read a file that differs here:
    compiled here (not served), counted stale once though the batch looks at the
    remote again before and after its claim, and stored over the remote's."""
    config, _, machine = machines_sharing_a_folder(tmp_path)
    with machine("m1") as one:
        one.compile(request_of(config), ReadingCompiler(), tmp_path / "a")
    config.write_text("two\n")
    time.sleep(0.02)
    with machine("m2") as two:
        [result] = two.compile_many([request_of(config)], ReadingCompiler(), [tmp_path / "b"])
        report = two.stats()
    with machine("m3") as three:
        [third] = three.compile_many([request_of(config)], ReadingCompiler(), [tmp_path / "c"])
    assert (result.status, third.status, third.tier) == ("miss", "hit", "remote")
    assert third.files["k.o"].read_bytes() == b"K\0two\n"
    assert report["stale"] == 1
