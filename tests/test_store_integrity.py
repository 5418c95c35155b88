"""What a hit may return: verified entries only, never through a link (issue 3, "Store").

Each damage is done to a real entry on disk; the next compile must notice it,
never serve it, count it as ``corrupt``, compile again and store a good entry.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_cache import (
    SOC,
    ToyCompiler,
    entry_dirs,
    expected_files,
    make_request,
    make_settings,
    read_dir,
    run_script,
    toolkit_env,
    tree_bytes,
)

import opcache
from opcache.key import canonical_json, digest
from opcache.storage.entry import MANIFEST, CorruptEntry, make_manifest, parse_manifest
from opcache.storage.local import LocalStore


@pytest.fixture
def compiler(tmp_path: Path) -> ToyCompiler:
    return ToyCompiler(tmp_path / "calls", size=4096)


def settings_for(tmp_path: Path, mode: str = "enable") -> opcache.Settings:
    return make_settings(tmp_path / "ops", tmp_path, mode)


def store_one(tmp_path: Path, compiler: ToyCompiler) -> tuple[str, Path]:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        result = cache.compile(make_request(), compiler, tmp_path / "first")
    assert result.status == "miss"
    return result.key, entry_dirs(settings_for(tmp_path).root)[result.key]


def binary_name() -> str:
    return next(n for n in expected_files(make_request()) if n.endswith(".o"))


def json_name() -> str:
    return next(n for n in expected_files(make_request()) if n.endswith(".json"))


def rewrite_manifest(entry: Path, change) -> None:
    """Edit the manifest's JSON and write it back with a valid checksum line."""
    _check, _nl, body = (entry / MANIFEST).read_bytes().partition(b"\n")
    data = json.loads(body)
    change(data)
    body = canonical_json(data)
    (entry / MANIFEST).write_bytes(digest(body).encode() + b"\n" + body)


def damage(kind: str, entry: Path, outside: Path) -> None:
    binary = entry / binary_name()
    good = binary.read_bytes()
    if kind == "truncate":
        binary.write_bytes(good[: len(good) // 2])
    elif kind == "truncate_to_zero":
        binary.write_bytes(b"")
    elif kind == "append":
        binary.write_bytes(good + b"\0")
    elif kind == "flip_byte":
        data = bytearray(good)
        data[len(data) // 2] ^= 0x01
        binary.write_bytes(bytes(data))
    elif kind == "delete_artifact":
        (entry / json_name()).unlink()
    elif kind == "delete_manifest":
        (entry / MANIFEST).unlink()
    elif kind == "garble_manifest":
        raw = bytearray((entry / MANIFEST).read_bytes())
        raw[len(raw) // 2] ^= 0x20
        (entry / MANIFEST).write_bytes(bytes(raw))
    elif kind == "empty_manifest":
        (entry / MANIFEST).write_bytes(b"")
    elif kind == "manifest_without_checksum":
        _check, _nl, body = (entry / MANIFEST).read_bytes().partition(b"\n")
        (entry / MANIFEST).write_bytes(body)
    elif kind == "manifest_of_other_format":
        rewrite_manifest(entry, lambda d: d.update(format=99))
    elif kind == "manifest_of_other_key":
        rewrite_manifest(entry, lambda d: d.update(key="0" * 32))
    elif kind == "artifact_is_a_folder":
        binary.unlink()
        binary.mkdir()
        (binary / "inside").write_bytes(good)
    elif kind == "artifact_is_a_symlink":
        # The link points at a file with the right bytes: only not following links catches it.
        outside.write_bytes(good)
        binary.unlink()
        os.symlink(outside, binary)
    elif kind == "manifest_is_a_symlink":
        outside.write_bytes((entry / MANIFEST).read_bytes())
        (entry / MANIFEST).unlink()
        os.symlink(outside, entry / MANIFEST)
    elif kind == "artifact_is_a_fifo":
        binary.unlink()
        os.mkfifo(binary)
    else:
        raise AssertionError(kind)


DAMAGES = [
    "truncate",
    "truncate_to_zero",
    "append",
    "flip_byte",
    "delete_artifact",
    "delete_manifest",
    "garble_manifest",
    "empty_manifest",
    "manifest_without_checksum",
    "manifest_of_other_format",
    "manifest_of_other_key",
    "artifact_is_a_folder",
    "artifact_is_a_symlink",
    "manifest_is_a_symlink",
    "artifact_is_a_fifo",
]


@pytest.mark.parametrize("kind", DAMAGES)
def test_damaged_entry_is_detected_and_replaced(
    tmp_path: Path, compiler: ToyCompiler, kind: str
) -> None:
    key, entry = store_one(tmp_path, compiler)
    outside = tmp_path / "outside.bin"
    damage(kind, entry, outside)
    outside_before = outside.read_bytes() if outside.exists() else None
    request = make_request()
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        result = cache.compile(request, compiler, tmp_path / "out")
        stats = cache.stats()
        again = cache.compile(request, compiler, tmp_path / "out2")
    assert result.status == "miss"
    assert result.key == key
    assert compiler.calls() == 2  # never served: compiled again
    assert read_dir(tmp_path / "out") == expected_files(request, compiler.size)
    assert stats["corrupt"] == 1
    assert stats["chips"][SOC]["corrupt"] == 1
    # Replaced by a good entry, which the next compile hits.
    assert again.status == "hit"
    assert read_dir(tmp_path / "out2") == expected_files(request, compiler.size)
    assert compiler.calls() == 2
    fresh = LocalStore(settings_for(tmp_path).root).get(SOC, key)
    assert fresh is not None
    assert fresh.files == expected_files(request, compiler.size)
    # Nothing outside the cache was followed into or removed.
    if outside_before is not None:
        assert outside.read_bytes() == outside_before
    # One entry, as before.  The byte counter cannot know how the damage changed
    # the files' sizes behind opcache's back; verify() recounts it.
    assert stats["entries"] == 1
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        assert cache.verify().corrupt == 0
        assert cache.stats()["bytes"] == tree_bytes(entry)


def test_entry_folder_replaced_by_a_symlink_is_not_followed(
    tmp_path: Path, compiler: ToyCompiler
) -> None:
    _key, entry = store_one(tmp_path, compiler)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(entry, elsewhere)  # a complete, valid copy: only the link is wrong
    shutil.rmtree(entry)
    os.symlink(elsewhere, entry)
    copy_before = read_dir(elsewhere)
    request = make_request()
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        result = cache.compile(request, compiler, tmp_path / "out")
        again = cache.compile(request, compiler, tmp_path / "out2")
        stats = cache.stats()
    assert result.status == "miss"
    assert compiler.calls() == 2
    assert read_dir(tmp_path / "out") == expected_files(request, compiler.size)
    assert stats["corrupt"] == 1
    assert again.status == "hit"
    assert not entry.is_symlink()
    assert entry.is_dir()
    # What the link pointed at is left alone.
    assert read_dir(elsewhere) == copy_before


def test_verify_does_not_follow_a_symlinked_entry(tmp_path: Path, compiler: ToyCompiler) -> None:
    _key, entry = store_one(tmp_path, compiler)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(entry, elsewhere)
    shutil.rmtree(entry)
    os.symlink(elsewhere, entry)
    copy_before = read_dir(elsewhere)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        report = cache.verify()
    assert report.corrupt == 1
    assert report.chips[SOC].entries == 0
    assert not os.path.lexists(entry)
    assert read_dir(elsewhere) == copy_before


@pytest.mark.parametrize("bad_name", ["../escape.o", "sub/kernel.o", "..", ".", "", "/abs.o"])
def test_manifest_naming_a_path_is_refused(
    tmp_path: Path, compiler: ToyCompiler, bad_name: str
) -> None:
    key, entry = store_one(tmp_path, compiler)
    target = tmp_path / "ops" / "kernel_cache" / SOC / "escape.o"

    def point_outside(data: dict) -> None:
        data["artifacts"][0]["name"] = bad_name

    rewrite_manifest(entry, point_outside)
    with pytest.raises(CorruptEntry, match="bad artifact"):
        LocalStore(settings_for(tmp_path).root).get(SOC, key)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        result = cache.compile(make_request(), compiler, tmp_path / "out")
        stats = cache.stats()
    assert result.status == "miss"
    assert stats["corrupt"] == 1
    assert sorted(os.listdir(tmp_path / "out")) == sorted(expected_files(make_request()))
    assert not target.exists()


def test_parse_manifest_round_trip_and_refusals() -> None:
    files = {"k.o": b"\x7fELF", "k.json": b"{}"}
    raw = make_manifest("a" * 32, files, 1.5, {"op_type": "Add"}, 123.0)
    parsed = parse_manifest(raw, "a" * 32)
    assert parsed["compile_seconds"] == 1.5
    assert sorted(name for name, _size, _d in parsed["artifacts"]) == ["k.json", "k.o"]
    assert {name: size for name, size, _d in parsed["artifacts"]} == {"k.o": 4, "k.json": 2}
    with pytest.raises(CorruptEntry):
        parse_manifest(raw, "b" * 32)
    with pytest.raises(CorruptEntry):
        parse_manifest(raw[:-1], "a" * 32)
    for bad in ("../x", "a/b", MANIFEST):
        body = json.loads(raw.partition(b"\n")[2])
        body["artifacts"][0]["name"] = bad
        blob = canonical_json(body)
        with pytest.raises(CorruptEntry, match="bad artifact"):
            parse_manifest(digest(blob).encode() + b"\n" + blob, "a" * 32)


def test_a_manifest_keeps_the_bits_of_an_artifact_a_new_file_would_not_have() -> None:
    """In "modes", last, where an older opcache passes over it: the format, the artifacts
    and their fields are the ones it checks (it read "format":2 as corrupt and removed
    the entry).  Each mode is checked as the rest, on the quick path and the whole one."""
    files = {"k.o": b"\x7fELF", "run.sh": b"#!/bin/sh\n"}
    plain = make_manifest("a" * 32, files, 1.5, {}, 3.0)
    raw = make_manifest("a" * 32, files, 1.5, {"op": "Add"}, 3.0, {"run.sh": 0o755})
    assert parse_manifest(plain, "a" * 32)["modes"] == {}
    assert b'"modes"' not in plain
    body = json.loads(raw.partition(b"\n")[2])
    assert body["format"] == 1 and list(body)[-1] == "modes"
    assert all(sorted(item) == ["name", "size", "xxh3"] for item in body["artifacts"])
    parsed = parse_manifest(raw, "a" * 32)
    assert parsed["modes"] == {"run.sh": 0o755}
    assert [name for name, _, _ in parsed["artifacts"]] == ["k.o", "run.sh"]
    spaced = json.dumps(body).encode()  # (laid out otherwise: parsed whole)
    assert parse_manifest(_signed(spaced), "a" * 32)["modes"] == {"run.sh": 0o755}
    canonical = raw.partition(b"\n")[2]
    for bad in (
        canonical.replace(b'"run.sh":493', b'"run.sh":4096'),
        canonical.replace(b'"run.sh":493', b'"run.sh":-1'),
        canonical.replace(b'"run.sh":493', b'"run.sh":"755"'),
        canonical.replace(b'"run.sh":493', b'"run.sh":true'),
        canonical.replace(b'"run.sh":493', b'"other":493'),
        canonical.replace(b'{"run.sh":493}', b"{}"),
        canonical.replace(b'{"run.sh":493}', b"[493]"),
    ):
        with pytest.raises(CorruptEntry, match="permission bits"):
            parse_manifest(_signed(bad), "a" * 32)


@pytest.mark.parametrize("bad_name", ["../escape.o", "sub/x.o", "..", MANIFEST])
def test_store_refuses_artifact_names_that_are_not_plain(tmp_path: Path, bad_name: str) -> None:
    store = LocalStore(tmp_path / "root")
    key = "ab" * 16
    files = {"good.o": b"x", bad_name: b"y"}
    with pytest.raises(ValueError, match="artifact"):
        store.put(SOC, key, make_manifest(key, files, 0.1, {}, 1.0), files, now=1.0)
    assert store.get(SOC, key) is None
    assert not (tmp_path / "root" / ".opcache" / "escape.o").exists()


def test_verify_removes_corrupt_entries_and_recounts(tmp_path: Path, compiler: ToyCompiler) -> None:
    settings = settings_for(tmp_path)
    with opcache.OpCache(settings) as cache:
        keys = [cache.compile(make_request(i), compiler, tmp_path / "o").key for i in range(5)]
    entries = entry_dirs(settings.root)
    binary = next(p for p in entries[keys[1]].iterdir() if p.suffix == ".o")
    binary.write_bytes(binary.read_bytes()[:10])
    (entries[keys[3]] / MANIFEST).unlink()
    store = LocalStore(settings.root)
    # Counters knocked off by hand: verify must recount them from the disk.
    store.sizes(SOC).reset({"entries": 42, "bytes": 7})
    good_bytes = sum(tree_bytes(entries[k]) for k in (keys[0], keys[2], keys[4]))
    with opcache.OpCache(settings) as cache:
        report = cache.verify()
        stats = cache.stats()
    chip = report.chips[SOC]
    assert report.corrupt == 2
    assert (chip.checked, chip.corrupt, chip.entries) == (5, 2, 3)
    assert chip.bytes == good_bytes
    assert (chip.counted_entries, chip.counted_bytes) == (42, 7)
    assert set(entry_dirs(settings.root)) == {keys[0], keys[2], keys[4]}
    assert (stats["entries"], stats["bytes"], stats["corrupt"]) == (3, good_bytes, 2)
    assert report.as_dict()["corrupt"] == 2
    # A second pass finds nothing.
    with opcache.OpCache(settings) as cache:
        assert cache.verify().corrupt == 0


def test_a_huge_sparse_artifact_costs_verify_and_export_no_memory(
    tmp_path: Path, compiler: ToyCompiler
) -> None:
    """A member of a shared cache plants an artifact of 2 GiB (a sparse file, a few KB
    on disk) whose manifest says so: verify reads it a chunk at a time (found corrupt
    and removed), export leaves it out by its manifest, each within 1 GiB of memory."""
    key, entry = store_one(tmp_path, compiler)
    big = 2 << 30
    with open(entry / binary_name(), "r+b") as f:
        f.truncate(big)

    def grow(data: dict) -> None:
        for artifact in data["artifacts"]:
            if artifact["name"] == binary_name():
                artifact["size"] = big

    rewrite_manifest(entry, grow)
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from opcache.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    flags = ["--op_compiler_cache_dir", str(tmp_path / "ops")]
    env = {**os.environ, "HOME": str(tmp_path)}
    exported = subprocess.run(
        [sys.executable, "-c", script, "export", str(tmp_path / "seed.tar"), "--json", *flags],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert exported.returncode == 0 and "Traceback" not in exported.stderr, exported.stderr
    assert json.loads(exported.stdout)["skipped"][0]["entry"] == f"{SOC}/{key}"
    verified = subprocess.run(
        [sys.executable, "-c", script, "verify", "--json", *flags],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert verified.returncode == 0 and "Traceback" not in verified.stderr, verified.stderr
    assert json.loads(verified.stdout)["corrupt"] == 1
    assert entry_dirs(settings_for(tmp_path).root) == {}


def test_verify_and_age_remove_leftovers_of_dead_writers(
    tmp_path: Path, compiler: ToyCompiler
) -> None:
    from opcache.storage import local as store_module

    settings = settings_for(tmp_path)
    with opcache.OpCache(settings) as cache:
        cache.compile(make_request(), compiler, tmp_path / "o")
    dead = subprocess.Popen(["true"])
    dead.wait()
    tmp_dir = settings.root / ".opcache" / "tmp"
    host = store_module._HOST
    leftover = tmp_dir / f"{'c' * 32}.{host}.{dead.pid}.0123abcd"
    leftover.mkdir()
    (leftover / "half.o").write_bytes(b"half")
    alive = tmp_dir / f"{'d' * 32}.{host}.{os.getpid()}.0123abcd"
    alive.mkdir()
    trash = settings.root / ".opcache" / "trash" / "something"
    trash.mkdir(parents=True)
    with opcache.OpCache(settings) as cache:
        dry = cache.age(dry_run=True)
        assert dry.leftovers_removed == 0
        assert leftover.exists()
        report = cache.verify()
    assert report.leftovers_removed == 2
    assert not leftover.exists()
    assert not trash.exists()
    assert alive.exists()  # our own build folder is not a leftover
    shutil.rmtree(alive)


def _modes_script(tmp_path: Path, umask: int) -> dict:
    toolkit = toolkit_env(tmp_path)  # (so that op_cache.ini is made)
    code = f"""
import json, os, stat, helpers_cache as h, opcache
root = h.make_settings({str(tmp_path / "ops")!r}, {str(tmp_path)!r}).root
comp = h.ToyCompiler({str(tmp_path / "calls")!r})
settings = h.make_settings({str(tmp_path / "ops")!r}, {str(tmp_path)!r}, env={toolkit!r})
with opcache.OpCache(settings) as c:
    for i in (0, 1, 0):
        c.compile(h.make_request(i), comp, {str(tmp_path / "out")!r})
    c.compile(h.make_request(0, soc_version="Ascend310P3"), comp, {str(tmp_path / "out")!r})
    c.verify()
    c.clear("Ascend310P3")
modes = {{}}
for dirpath, dirs, files in os.walk(root):
    for name in [*dirs, *files]:
        p = os.path.join(dirpath, name)
        st = os.lstat(p)
        modes[os.path.relpath(p, root)] = [stat.S_IMODE(st.st_mode), stat.S_ISDIR(st.st_mode)]
st = os.lstat(root)
modes["."] = [stat.S_IMODE(st.st_mode), True]
print(json.dumps(modes))
"""
    done = run_script(code, umask=umask)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    ("umask", "file_mode", "dir_mode"), [(0o022, 0o640, 0o750), (0o077, 0o600, 0o700)]
)
def test_file_and_folder_modes(tmp_path: Path, umask: int, file_mode: int, dir_mode: int) -> None:
    # Folders and files as the child saw them: the trash it walked may be gone by now.
    modes = _modes_script(tmp_path, umask)
    # The walk saw entries, counters, stats and the ini file.
    assert any(rel.endswith(MANIFEST) for rel in modes)
    assert any(rel.startswith(".opcache/stats/") for rel in modes)
    assert any("/_size/" in rel for rel in modes)
    wrong = {
        rel: oct(mode)
        for rel, (mode, is_dir) in modes.items()
        if mode != (dir_mode if is_dir else file_mode)
    }
    assert wrong == {}


def test_op_cache_ini_respects_a_strict_umask(tmp_path: Path) -> None:
    modes = _modes_script(tmp_path, 0o077)
    assert modes["op_cache.ini"] == [0o600, False]


def _signed(body: bytes) -> bytes:
    return digest(body).encode() + b"\n" + body


def test_a_manifest_is_checked_without_parsing_the_inputs_of_its_key(monkeypatch) -> None:
    # A hit uses the artifacts and the compile time, not the key's inputs: most of
    # a manifest's text, and of its parse.  (Each field used is still parsed whole.)
    from opcache.storage import entry

    inputs = {"attrs": {f"a{i}": [i, {"x": "y" * 20}] for i in range(500)}}
    raw = make_manifest("a" * 32, {"k.o": b"\x7fELF"}, 2.5, inputs, 9.0)

    class WholeParse(json.JSONDecoder):
        def decode(self, s, *args):  # type: ignore[override]
            raise AssertionError("the whole manifest was parsed")

    monkeypatch.setattr(entry, "_DECODER", WholeParse(parse_constant=entry._no_constant))
    parsed = parse_manifest(raw, "a" * 32)
    assert parsed["compile_seconds"] == 2.5
    assert parsed["artifacts"] == [("k.o", 4, digest(b"\x7fELF"))]


def test_a_manifest_laid_out_otherwise_is_parsed_whole_and_checked_the_same() -> None:
    raw = make_manifest("a" * 32, {"k.o": b"x"}, 1.5, {"op_type": "Add"}, 3.0)
    fields = json.loads(raw.partition(b"\n")[2])
    spaced = json.dumps(fields).encode()  # ", " and ": ": not make_manifest's text
    last_first = json.dumps(dict(reversed(fields.items())), separators=(",", ":")).encode()
    for body in (spaced, last_first):
        parsed = parse_manifest(_signed(body), "a" * 32)
        assert parsed["compile_seconds"] == 1.5
        assert parsed["artifacts"] == [("k.o", 1, digest(b"x"))]
        with pytest.raises(CorruptEntry):
            parse_manifest(_signed(body), "b" * 32)
    canonical = raw.partition(b"\n")[2]
    for bad, why in [
        (canonical.replace(b'"compile_seconds":1.5', b'"compile_seconds":NaN'), "not JSON"),
        (canonical.replace(b'"compile_seconds":1.5', b'"compile_seconds":"1"'), "lacks"),
        (canonical.replace(b'"format":1', b'"format":2'), "another entry or format"),
        (canonical.replace(b'"size":1', b'"size":-1'), "bad artifact"),
        (canonical.replace(b'"artifacts":[', b'"artifacts":[[', 1), "not JSON"),
    ]:
        with pytest.raises(CorruptEntry, match=why):
            parse_manifest(_signed(bad), "a" * 32)


def test_the_span_of_a_manifest_between_its_fields_and_key_is_vouched_for_only(
    tmp_path: Path,
) -> None:
    # What parse_manifest says it does: a manifest laid out as make_manifest
    # writes it is read from its fields and its key; the key's inputs between
    # them are vouched for by the checksum, and not read (a later duplicate of
    # a field there changes nothing a hit serves: the fields before it do).
    raw = make_manifest("a" * 32, {"k.o": b"x"}, 1.5, {"op_type": "Add"}, 3.0)
    body = raw.partition(b"\n")[2]
    extra = b',"artifacts":[],"format":2'
    doubled = body.replace(b'{"op_type":"Add"}', b'{"op_type":"Add"}' + extra)
    parsed = parse_manifest(_signed(doubled), "a" * 32)
    assert parsed["artifacts"] == [("k.o", 1, digest(b"x"))]
    assert parse_manifest(_signed(body.replace(b'"Add"', b"[not json")), "a" * 32)
    with pytest.raises(CorruptEntry, match="checksum"):
        parse_manifest(digest(body).encode() + b"\n" + doubled, "a" * 32)


@pytest.mark.parametrize("cache", ["a group's", "private, its root writable by others"])
def test_a_chip_folder_others_could_plant_as_a_link_is_refused_not_looked_through(
    tmp_path: Path, cache: str
) -> None:
    # Where only the cache's owner can put a link, a miss may be told by one lstat
    # of the entry's path; where others can (a group's cache, a root others may
    # write to, a shared folder remote's), a look through a link to a mount that
    # never answers would hang every compile: there every level is opened
    # without links.
    from opcache import fsutil
    from opcache.trust import UntrustedFolder

    root = tmp_path / "cache"
    if cache == "a group's":
        store = LocalStore(root, modes=fsutil.group_shared(os.getgid()))
        root.mkdir(mode=0o2770)
    else:
        store = LocalStore(root)
        root.mkdir()
        root.chmod(0o777)
    (tmp_path / "elsewhere").mkdir()
    (root / SOC).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UntrustedFolder):
        store.get(SOC, "ab" * 16)
