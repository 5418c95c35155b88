"""What a remote hit costs beside its own work, and the checks it keeps.

A remote hit is served at once; its copy into the cache folder is made by one
copier thread for the OpCache's life (a thread started per hit cost a single
hit more than its own work), which ``close`` and the interpreter's exit wait
for.  The value is still checked as untrusted input: a manifest is read with
plain ``json.loads`` and an exact check of the fields a hit uses.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest
import xxhash
from helpers_cache import SOC, ToyCompiler, entry_dirs, expected_files, make_request, read_dir
from helpers_cache import machine as file_machine

import opcache
from opcache import _json, flow
from opcache.key import digest
from opcache.storage import RemoteCorrupt
from opcache.storage.entry import CorruptEntry, Entry, make_manifest, parse_manifest
from opcache.storage.local import LocalStore
from opcache.storage.value import pack, unpack

KEY = "0123456789abcdef0123456789abcdef"


def _shared(tmp_path: Path, count: int) -> tuple[str, list[opcache.OpRequest]]:
    """A file remote holding ``count`` entries, stored by machine a."""
    (tmp_path / "share").mkdir()
    url = f"file://{tmp_path}/share"
    requests = [make_request(i) for i in range(count)]
    with opcache.OpCache(file_machine(tmp_path, "a", url)) as a:
        for request in requests:
            a.compile(request, ToyCompiler(tmp_path / "calls_a"), tmp_path / "outa")
    return url, requests


def _copied(cache: opcache.OpCache, key: str, timeout: float = 20.0) -> None:
    """Wait until the cache folder holds ``key`` (the copier made its copy)."""
    deadline = time.monotonic() + timeout
    while cache._flow._store.stamp(SOC, key) is None:
        assert time.monotonic() < deadline, "the remote hit was never copied"
        time.sleep(0.005)


def test_single_remote_hits_share_one_copier_thread(tmp_path: Path, monkeypatch) -> None:
    url, requests = _shared(tmp_path, 4)
    started: list[str] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    cache = opcache.OpCache(file_machine(tmp_path, "b", url))
    try:
        for i, request in enumerate(requests):
            out = tmp_path / f"out{i}"
            result = cache.compile(request, ToyCompiler(tmp_path / "calls_b"), out)
            assert result.tier == "remote"
            assert read_dir(out) == expected_files(request)
            _copied(cache, result.key)  # each hit's copy made before the next hit
    finally:
        cache.close()
    assert started.count("opcache-backfill") == 1
    assert len(entry_dirs(tmp_path / "b" / "kernel_cache")) == 4
    assert not (tmp_path / "calls_b").exists()  # nothing compiled


def test_a_batch_of_remote_hits_is_delivered_before_its_copies_are_made(
    tmp_path: Path, monkeypatch
) -> None:
    """compile_many wakes the copier once its remote hits are delivered: started
    beside them (1 ms after they were fetched), it shared the interpreter with
    their deliveries (a third of scenario 16's batch).  wait_for_copies wakes
    it too (once: the copier makes the batch's copies in one pass)."""
    url, requests = _shared(tmp_path, 6)
    delivered: list[str] = []
    copied_after: list[int] = []
    real_deliver = flow.deliver

    def deliver(out: Path, files: dict[str, bytes], modes: dict[str, int]) -> dict[str, Path]:
        time.sleep(0.02)  # (a slow disk: the copier, woken early, would copy meanwhile)
        delivered.append(out.name)
        return real_deliver(out, files, modes)

    monkeypatch.setattr(flow, "deliver", deliver)
    cache = opcache.OpCache(file_machine(tmp_path, "b", url))
    tier = cache._flow.remote
    assert tier is not None
    real_keep = tier._keep

    def keep(soc: str, entries: list) -> None:  # type: ignore[type-arg]
        copied_after.append(len(delivered))
        real_keep(soc, entries)

    tier._keep = keep
    try:
        outs = [tmp_path / "out" / r.op_name for r in requests]
        results = cache.compile_many(requests, ToyCompiler(tmp_path / "calls_b"), outs)
        assert [r.tier for r in results] == ["remote"] * 6
        tier.wait_for_copies()
        assert copied_after == [6]
    finally:
        cache.close()
    assert copied_after == [6]
    assert len(entry_dirs(tmp_path / "b" / "kernel_cache")) == 6
    assert not (tmp_path / "calls_b").exists()  # nothing compiled


def test_a_child_forked_after_a_remote_hit_makes_its_own_copies(tmp_path: Path) -> None:
    url, requests = _shared(tmp_path, 2)
    cache = opcache.OpCache(file_machine(tmp_path, "b", url))
    try:
        first = cache.compile(requests[0], ToyCompiler(tmp_path / "calls_b"), tmp_path / "o0")
        assert first.tier == "remote"  # its copier runs in this process, maybe copying now
        pid = os.fork()
        if pid == 0:  # the child has no copier: its hit starts one, its close waits for it
            code = 1
            try:
                child = cache.compile(
                    requests[1], ToyCompiler(tmp_path / "calls_b"), tmp_path / "o1"
                )
                cache.close()
                code = 0 if child.tier == "remote" else 1
            finally:
                os._exit(code)
        deadline = time.monotonic() + 120
        done, status = os.waitpid(pid, os.WNOHANG)
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
            done, status = os.waitpid(pid, os.WNOHANG)
        if not done:  # (a hung child fails the test, never hangs it)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done and os.waitstatus_to_exitcode(status) == 0
        assert len(entry_dirs(tmp_path / "b" / "kernel_cache")) == 2  # the child's copy too
    finally:
        cache.close()
    assert len(entry_dirs(tmp_path / "b" / "kernel_cache")) == 2


def _hits_never_closed(tmp_path: Path, url: str, count: int) -> None:
    """A multiprocessing child's remote hits, its OpCache never closed, the copy late."""
    real_put_many = LocalStore.put_many

    def put_many(self, *args, **kw):  # type: ignore[no-untyped-def]
        time.sleep(0.5)  # the child's run is over by then
        return real_put_many(self, *args, **kw)

    LocalStore.put_many = put_many  # type: ignore[method-assign]
    cache = opcache.OpCache(file_machine(tmp_path, "b", url))
    results = cache.compile_many(
        [make_request(i) for i in range(count)],
        ToyCompiler(tmp_path / "calls_b"),
        lambda r: tmp_path / "outb" / r.op_name,
    )
    assert {r.tier for r in results} == {"remote"}


def test_a_multiprocessing_child_never_closing_its_cache_still_makes_its_copies(
    tmp_path: Path,
) -> None:
    """Such a child leaves through os._exit, past atexit: its copies are made before."""
    url, requests = _shared(tmp_path, 6)
    child = multiprocessing.get_context("fork").Process(
        target=_hits_never_closed, args=(tmp_path, url, len(requests))
    )
    child.start()
    try:
        child.join(120)
        assert child.exitcode == 0
    finally:
        child.kill()
        child.join()
    root = tmp_path / "b" / "kernel_cache"
    assert len(entry_dirs(root)) == 6
    assert list(LocalStore(root).tmp_dir.iterdir()) == []


# -- the value's checks ----------------------------------------------------------------


def _manifest(change) -> bytes:  # type: ignore[no-untyped-def]
    """A manifest of KEY for one artifact, its JSON changed by ``change``, re-checksummed."""
    raw = make_manifest(KEY, {"a.o": b"x" * 10}, 1.5, {"op_type": "Add"}, 1000.0)
    data = json.loads(raw.partition(b"\n")[2])
    change(data)
    body = json.dumps(data).encode()
    return digest(body).encode() + b"\n" + body


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["artifacts"][0].update(extra=1),  # not the three fields make_manifest writes
        lambda d: d["artifacts"][0].update(size=True),  # a bool is no size
        lambda d: d["artifacts"][0].update(size=-1),
        lambda d: d["artifacts"][0].update(name="../a.o"),
        lambda d: d["artifacts"][0].update(name="MANIFEST"),
        lambda d: d["artifacts"][0].update(xxh3=[1]),
        lambda d: d.update(artifacts=[[["a.o"]] * 3]),
        lambda d: d.update(artifacts=[{"name": [[[]]], "size": 1, "xxh3": "x"}]),
        lambda d: d.update(compile_seconds=True),
        lambda d: d.update(compile_seconds=10**400),  # overflows a float
        lambda d: d.update(compile_seconds=float("inf")),  # json.dumps writes Infinity
        lambda d: d.update(artifacts={"a.o": 10}),
    ],
)
def test_a_manifest_of_any_other_shape_is_corrupt(change) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CorruptEntry):
        parse_manifest(_manifest(change), KEY)


def test_a_remote_value_is_checked_without_walking_what_a_hit_does_not_use(monkeypatch) -> None:
    """The manifest's inputs are never read by a hit: parsing is all they cost (the
    generic reader's depth walk and number hooks were most of a hit's check)."""

    def refused(raw: object) -> object:
        raise AssertionError("the generic JSON reader walked a manifest")

    monkeypatch.setattr(_json, "loads", refused)
    files = {"a.o": b"\x7fELF" + bytes(range(256)) * 8, "a.json": b"{}"}
    manifest = make_manifest(KEY, files, 2.0, {"attrs": {"axes": [[[[1]]]]}}, 1000.0)
    entry, got = unpack(KEY, pack(KEY, manifest, files), 1 << 20)
    assert (entry.files, entry.compile_seconds, got) == (files, 2.0, manifest)


def test_a_remote_value_nested_past_python_s_recursion_is_corrupt_not_a_crash() -> None:
    body = b'{"format":1,"key":"%s","inputs":%s,"artifacts":[],"compile_seconds":1}' % (
        KEY.encode(),
        b"[" * 100_000 + b"]" * 100_000,
    )
    manifest = digest(body).encode() + b"\n" + body
    # A value (format 1, zlib) holding it, checksummed as a writer would.
    forged = b"OPCR\x01\x01" + zlib.compress(struct.pack(">I", len(manifest)) + manifest, 1)
    forged += xxhash.xxh3_128_digest(forged)
    with pytest.raises(RemoteCorrupt):
        unpack(KEY, forged, 1 << 30)


# -- what a push costs ----------------------------------------------------------------


def test_a_value_that_does_not_compress_is_given_up_on_samples(monkeypatch) -> None:
    """Random bytes (beside a small json) are stored as they are, estimated on 8 KB
    rather than offered whole to zlib (2.6 ms per 100 KB); a value that
    compresses still is."""
    offered: list[int] = []
    real_compress = zlib.compress

    def compress(data: bytes, level: int = -1) -> bytes:
        offered.append(len(data))
        return real_compress(data, level)

    monkeypatch.setattr(zlib, "compress", compress)
    noise = {"a.json": b"{" + b" " * 1022 + b"}", "a.o": os.urandom(100_000)}
    value = pack(KEY, make_manifest(KEY, noise, 1.0, {}, 0.0), noise)
    assert value[5] == 0  # no zlib flag
    assert sum(offered) <= 2 * 4096
    assert unpack(KEY, value, 1 << 20)[0].files == noise
    plain = {"a.o": b"\x00" * 60_000 + os.urandom(40_000)}  # an .o's zeros, then code
    value = pack(KEY, make_manifest(KEY, plain, 1.0, {}, 0.0), plain)
    assert value[5] == 1 and len(value) < 50_000
    assert unpack(KEY, value, 1 << 20)[0].files == plain


def test_an_artifact_that_does_not_compress_is_stored_in_the_stream_as_it_is() -> None:
    """Beside a json that compresses, an artifact of random bytes goes into the zlib
    stream as stored blocks (inflating copies it) instead of being deflated with
    the rest (inflating it was a tenth of a 4 KB remote hit); any zlib reader,
    the last release's too, reads the value."""
    files = {"a.json": b"{" + b" " * 1022 + b"}", "a.o": os.urandom(3072)}
    manifest = make_manifest(KEY, files, 1.0, {}, 0.0)
    value = pack(KEY, manifest, files)
    assert value[5] == 1  # the zlib flag: the json is deflated
    assert files["a.o"] in value  # ... and the random bytes are not
    assert len(value) < 3072 + 1024 + len(manifest)
    payload = struct.pack(">I", len(manifest)) + manifest + files["a.json"] + files["a.o"]
    assert zlib.decompress(value[6:-16]) == payload  # as the last release inflates it
    entry, got = unpack(KEY, value, 1 << 20)
    assert (entry.files, got) == (files, manifest)
    # Over a stored block's 65,535 bytes: in two.
    big = {"a.json": b" " * 20_000, "a.o": os.urandom(100_000)}
    manifest = make_manifest(KEY, big, 1.0, {}, 0.0)
    value = pack(KEY, manifest, big)
    assert value[5] == 1 and big["a.o"][:65_535] in value and big["a.o"][65_535:] in value
    assert zlib.decompress(value[6:-16])[-100_000:] == big["a.o"]
    assert unpack(KEY, value, 1 << 20)[0].files == big
    # A part deflated after a stored one may refer back into it (its bytes are in
    # the reader's window too); one after a big part given up on samples may not.
    noise = os.urandom(3000)
    for twice in (
        {"a.json": b" " * 2000, "b.o": noise, "c.o": noise},
        {"a.json": b" " * 2000, "b.o": os.urandom(40_000), "c.o": b"x" * 9000 + noise[:99]},
    ):
        manifest = make_manifest(KEY, twice, 1.0, {}, 0.0)
        value = pack(KEY, manifest, twice)
        assert value[5] == 1
        assert unpack(KEY, value, 1 << 20)[0].files == twice
    assert len(pack(KEY, make_manifest(KEY, twice, 1.0, {}, 0.0), twice)) < 41_000


def test_a_part_under_a_kilobyte_is_stored_in_the_stream_as_it_is() -> None:
    """A small manifest (or artifact) is not deflated even where that would save a
    tenth: inflating its few hundred bytes cost a reader more than they weigh.
    A part of a kilobyte or more still is, and any zlib reader reads the value."""
    files = {"a.json": b"{" + b" " * 1022 + b"}", "a.o": os.urandom(3072)}
    inputs = {"inputs": [{"shape": [16, 1024], "dtype": "float16", "format": "ND"}] * 3}
    manifest = make_manifest(KEY, files, 1.0, inputs, 0.0)
    assert len(manifest) < 1024 and len(zlib.compress(manifest, 1)) * 10 < len(manifest) * 9
    value = pack(KEY, manifest, files)
    assert value[5] == 1 and manifest in value and files["a.json"] not in value
    payload = struct.pack(">I", len(manifest)) + manifest + files["a.json"] + files["a.o"]
    assert zlib.decompress(value[6:-16]) == payload
    assert unpack(KEY, value, 1 << 20) == (Entry(KEY, files, 1.0, 0.0), manifest)
    small = {"a.json": b" " * 900, "a.o": os.urandom(3072)}  # nothing worth deflating
    value = pack(KEY, make_manifest(KEY, small, 1.0, inputs, 0.0), small)
    assert value[5] == 0 and small["a.json"] in value


def test_many_small_artifacts_are_deflated_together() -> None:
    """Small parts are kept as they are only while they are few: an entry of forty
    900-byte jsons is deflated (kept as they are, the value was 4.5x its zlib
    size, in the remote and on the wire), and any zlib reader reads it."""
    files = {
        f"k{n}.json": json.dumps({"op": f"Op{n}", "shape": [16, n], "pad": " " * 800}).encode()
        for n in range(40)
    }
    assert all(len(data) < 1024 for data in files.values())
    manifest = make_manifest(KEY, files, 1.0, {}, 0.0)
    value = pack(KEY, manifest, files)
    raw = sum(map(len, files.values())) + len(manifest)
    assert value[5] == 1 and len(value) * 3 < raw
    payload = struct.pack(">I", len(manifest)) + manifest
    payload += b"".join(files[name] for name in sorted(files))
    assert zlib.decompress(value[6:-16]) == payload  # as the last release inflates it
    assert unpack(KEY, value, 1 << 20) == (Entry(KEY, files, 1.0, 0.0), manifest)


def _zlib_value(manifest: bytes, files: dict[str, bytes], stream: bytes | None = None) -> bytes:
    """A value (format 1, zlib) of ``stream`` (else the payload deflated by plain zlib),
    checksummed as a writer would."""
    payload = struct.pack(">I", len(manifest)) + manifest + b"".join(files.values())
    value = b"OPCR\x01\x01" + (zlib.compress(payload) if stream is None else stream)
    return value + xxhash.xxh3_128_digest(value)


def test_a_value_is_inflated_without_its_adler32_which_its_digests_cover() -> None:
    """The zlib stream's Adler-32 is not computed (2 us of a 4 KB value's check):
    the value's checksum, the manifest's and every artifact's digest cover every
    byte it would.  A stream whose Adler-32 alone is wrong is read; a byte
    changed inside it, whatever the Adler-32 and the value's checksum say, is
    still refused."""
    files = {"a.json": b"{" + b" " * 1022 + b"}", "a.o": os.urandom(3072)}
    manifest = make_manifest(KEY, files, 1.0, {}, 0.0)
    stream = zlib.compress(struct.pack(">I", len(manifest)) + manifest + b"".join(files.values()))
    entry, _ = unpack(KEY, _zlib_value(manifest, files, stream[:-4] + b"\0\0\0\0"), 1 << 20)
    assert entry.files == files
    changed = bytearray(pack(KEY, manifest, files)[6:-16])
    changed[changed.index(files["a.o"][:64]) + 10] ^= 1  # (in its stored block)
    adler = zlib.adler32(zlib.decompressobj(-15).decompress(bytes(changed[2:])))
    changed[-4:] = struct.pack(">I", adler)
    with pytest.raises(RemoteCorrupt, match="digest"):
        unpack(KEY, _zlib_value(manifest, files, bytes(changed)), 1 << 20)


def test_a_zlib_stream_of_any_level_and_window_is_read_and_a_bad_one_refused() -> None:
    """The last releases' values (zlib's levels, a smaller window) are read; a
    stream that is not zlib's deflate, wants a preset dictionary, or is cut short
    of its Adler-32 is refused as zlib refuses it."""
    files = {"a.json": b"[" + b"1," * 2000 + b"1]", "a.o": b"\x7fELF" + bytes(range(256)) * 4}
    manifest = make_manifest(KEY, files, 1.0, {}, 0.0)
    payload = struct.pack(">I", len(manifest)) + manifest + b"".join(files.values())
    for level, window in ((1, 15), (6, 15), (9, 15), (9, 9), (0, 12)):
        deflate = zlib.compressobj(level, zlib.DEFLATED, window)
        stream = deflate.compress(payload) + deflate.flush()
        entry, got = unpack(KEY, _zlib_value(manifest, files, stream), 1 << 20)
        assert (entry.files, got) == (files, manifest)
    stream = zlib.compress(payload)

    def header(method: int, flags: int) -> bytes:  # (its check bits set as zlib's are)
        return bytes([method, flags | (31 - (method << 8 | flags) % 31) % 31])

    bad = {
        "not deflate": header(0x77, 0x80) + stream[2:],
        "a window over 32 KB": header(0x88, 0x80) + stream[2:],
        "a preset dictionary": header(0x78, 0xA0) + stream[2:],
        "a header that fails its check": b"\x78\x02" + stream[2:],
        "cut short of its Adler-32": stream[:-1],
        "running on past its Adler-32": stream + b"\0",
        "cut short": stream[: len(stream) // 2],
        "no stream": b"",
    }
    for why, stream in bad.items():
        with pytest.raises(RemoteCorrupt, match="decompress"):
            unpack(KEY, _zlib_value(manifest, files, stream), 1 << 20)
            pytest.fail(why)


def test_a_hit_after_one_into_a_new_folder_makes_its_folder_before_opening(
    tmp_path: Path, monkeypatch
) -> None:
    """A batch delivering into new out folders makes each first, rather than after
    an open that fails for want of it (a system call per hit); a folder there
    already, or one whose parents are missing, is delivered into as before."""
    failed: list[str] = []
    real_open = os.open

    def opened(path, flags, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        try:
            return real_open(path, flags, mode, dir_fd=dir_fd)
        except FileNotFoundError:
            failed.append(str(path))
            raise

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(flow, "_make_out_first", False)  # (as after a hit into a folder there)
    monkeypatch.setattr(flow, "_files_there", False, raising=False)
    files = {"a.json": b"{}", "a.o": b"\x7fELF"}
    for i in range(3):
        assert flow.deliver(tmp_path / f"op{i}", files) == {
            name: tmp_path / f"op{i}" / name for name in files
        }
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "a.o").write_bytes(b"old")
    flow.deliver(tmp_path / "there", files)
    flow.deliver(tmp_path / "deep" / "er", files)
    for folder in ("op0", "op1", "op2", "there", "deep/er"):
        assert {name: (tmp_path / folder / name).read_bytes() for name in files} == files
    # Only the first new folder, and the one whose parent was missing, cost a failed open.
    assert failed == [f"{tmp_path}/op0/a.json", f"{tmp_path}/deep/er/a.json"]


def test_a_private_cache_copies_remote_hits_without_setting_modes_again(
    tmp_path: Path, monkeypatch
) -> None:
    """A private cache's files have the bits the open gave them (the umask's): no
    fchmod per file of every copy; a group-shared cache still sets its bits
    exactly, whatever the umask."""
    from opcache import fsutil

    fixed: list[int] = []  # the modes set on an entry's files
    writing = [False]
    real_fchmod, real_write_entry = os.fchmod, LocalStore._write_entry

    def fchmod(fd: int, mode: int) -> None:
        if writing[0]:
            fixed.append(mode)
        real_fchmod(fd, mode)

    def write_entry(*args, **kwargs):  # type: ignore[no-untyped-def]
        writing[0] = True
        try:
            return real_write_entry(*args, **kwargs)
        finally:
            writing[0] = False

    monkeypatch.setattr(os, "fchmod", fchmod)
    monkeypatch.setattr(LocalStore, "_write_entry", write_entry)
    files = {"a.json": b"{}", "a.o": b"\x7fELF"}
    entries = [
        (f"{i:032x}", make_manifest(f"{i:032x}", files, 1.0, {}, 0.0), files) for i in (1, 2)
    ]
    private = LocalStore(tmp_path / "private")
    assert private.put_many(SOC, entries, now=1000.0) == [len(m) + 6 for _, m, _ in entries]
    assert fixed == []
    for key, _, _ in entries:
        for name in ("a.json", "a.o", "MANIFEST"):
            mode = (private.entry_dir(SOC, key) / name).stat().st_mode & 0o777
            assert mode == fsutil.PRIVATE.file_bits
    shared = LocalStore(tmp_path / "shared", modes=fsutil.group_shared(os.getgid()))
    shared.put_many(SOC, entries, now=1000.0)
    assert fixed == [0o660] * 6


def test_hits_into_an_out_folder_holding_their_files_write_over_them_checked(
    tmp_path: Path, monkeypatch
) -> None:
    """After a hit whose files were there, the next opens its files as ones that are
    there (no open that fails to make them first) and truncates only what is
    left past the new bytes; a link or a file with another name put there
    meanwhile is still replaced, never written through."""
    calls: list[str] = []
    real_open, real_ftruncate = os.open, os.ftruncate

    def opened(path, flags, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        try:
            return real_open(path, flags, mode, dir_fd=dir_fd)
        except FileExistsError:
            calls.append("open failed")
            raise

    def ftruncate(fd: int, length: int) -> None:
        calls.append(f"ftruncate {length}")
        real_ftruncate(fd, length)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "ftruncate", ftruncate)
    monkeypatch.setattr(flow, "_files_there", False, raising=False)
    out = tmp_path / "out"
    files = {"a.json": b"{}" * 10, "a.o": b"\x7fELF" * 10}
    flow.deliver(out, files)
    flow.deliver(out, files)  # the files made by the first: the first file tried as new
    assert calls == ["open failed"]
    calls.clear()
    flow.deliver(out, files)  # now opened as there at once; the same sizes: nothing truncated
    shorter = {"a.json": b"{}", "a.o": b"\x7fELF" * 20}
    flow.deliver(out, shorter)
    assert calls == ["ftruncate 2"]
    assert {name: (out / name).read_bytes() for name in files} == shorter
    outside = tmp_path / "outside"
    outside.write_bytes(b"not yours")
    (out / "a.o").unlink()
    (out / "a.o").symlink_to(outside)
    os.link(outside, tmp_path / "linked")
    (out / "a.json").unlink()
    os.link(tmp_path / "linked", out / "a.json")  # a file with other names
    flow.deliver(out, files)
    assert outside.read_bytes() == b"not yours"
    assert not (out / "a.o").is_symlink() and (out / "a.json").stat().st_nlink == 1
    assert {name: (out / name).read_bytes() for name in files} == files
    new = tmp_path / "new" / "deeper"  # then a folder not there, nor its parent
    assert flow.deliver(new, files) == {name: new / name for name in files}
    assert {name: (new / name).read_bytes() for name in files} == files


def test_a_local_miss_before_the_remote_opens_no_folder(tmp_path: Path, monkeypatch) -> None:
    """A key with nothing at its entry's path is a miss told by one lstat: the chip
    and bucket folders are opened one by one without links only when something
    is there, which is then read (or refused) the careful way."""
    store = LocalStore(tmp_path / "cache")
    files = {"a.json": b"{}", "a.o": b"\x7fELF"}
    there = "ab" + "0" * 30
    store.put(SOC, there, make_manifest(there, files, 1.0, {}, 0.0), files, now=1000.0)
    opened: list[str] = []
    real_open = os.open

    def counted(path, flags, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        opened.append(str(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", counted)
    for missing in ("ab" + "1" * 30, "cd" + "0" * 30):  # its bucket there, and not
        assert store.get(SOC, missing) is None
    assert opened == []
    got = store.get(SOC, there)
    assert got is not None and got.files == files
    assert opened  # read the careful way
