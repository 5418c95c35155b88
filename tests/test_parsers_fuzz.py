"""Every parser of a file a user or another process can write: parse or fail clearly.

Property-based: arbitrary bytes and near-valid text go into op_cache.ini, the
op_debug_config .cfg, entry manifests, stats counter files, opc parameter
JSON and `opcache compile` spec files.  Each either parses or fails with its
documented error; nothing else escapes, and nothing hangs (hypothesis'
deadline).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_cann import SOC, kernel_json, kernel_name, set_access, store_entry, write_ini
from helpers_wrap import GCC, opcache, stats, wrap, write_project
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opcache import ConfigError
from opcache.cann_format import read_json as cann_read_json
from opcache.counters import CounterFiles
from opcache.debug import read_debug_config
from opcache.explain import _read as explain_notes
from opcache.ini import read_size_limits
from opcache.key import digest
from opcache.readset import Memo
from opcache.request import OpRequest
from opcache.specs import load_specs
from opcache.storage.entry import CorruptEntry, make_manifest, parse_manifest
from opcache.storage.local import LocalStore
from opcache.wrap import HeaderMemo, Plan, Uncacheable, _opc_names, _plan_opc

FUZZ = settings(
    max_examples=150,
    deadline=2000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
KEY = "0123456789abcdef0123456789abcdef"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
# Text that looks like the real files: key = value lines, sections, comments, junk.
_key = st.sampled_from(
    ["max_op_cache_size", "remain_cache_size_ratio", "op_debug_config", "op_debug_list"]
)
ini_like = st.lists(
    st.one_of(
        st.just("[op_compiler_cache]"),
        st.tuples(_key, st.sampled_from(["=", " = ", ":"]), st.text(max_size=30)).map("".join),
        st.text(max_size=40),
        st.just("# comment"),
    ),
    max_size=12,
).map("\n".join)


def _file(data: bytes) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="opcache-fuzz-"))
    path = folder / "f"
    path.write_bytes(data)
    return path


@FUZZ
@given(st.binary(max_size=400) | ini_like.map(str.encode))
def test_op_cache_ini_parses_or_is_ignored(data: bytes) -> None:
    limits = read_size_limits(_file(data))
    if limits is not None:
        assert limits.max_op_cache_size_mb == -1 or limits.max_op_cache_size_mb >= 1
        assert 1 <= limits.remain_cache_size_ratio <= 100


@FUZZ
@given(st.binary(max_size=400) | ini_like.map(str.encode))
def test_debug_config_parses_or_raises_config_error(data: bytes) -> None:
    path = _file(data)
    try:
        config = read_debug_config(path)
    except ConfigError as e:
        assert "op_debug_config" in str(e) and str(path) in str(e)
        return
    assert all(isinstance(o, str) and o and "," not in o for o in config.options)
    assert config.op_list is None or all(" " not in e for e in config.op_list)


@FUZZ
@given(st.binary(max_size=600))
def test_manifest_garbage_is_corrupt(data: bytes) -> None:
    try:
        parsed = parse_manifest(data, KEY)
    except CorruptEntry:
        return
    # Only a checksummed manifest of this key can get here.
    assert data.partition(b"\n")[0].decode() == digest(data.partition(b"\n")[2])
    assert isinstance(parsed["artifacts"], list)


@FUZZ
@given(json_values)
def test_manifest_with_a_valid_checksum_but_any_body(body: object) -> None:
    raw = json.dumps(body).encode()
    data = digest(raw).encode() + b"\n" + raw
    try:
        parsed = parse_manifest(data, KEY)
    except CorruptEntry:
        return
    for name, size, want in parsed["artifacts"]:
        assert "/" not in name and name not in (".", "..") and size >= 0 and isinstance(want, str)


@FUZZ
@given(st.dictionaries(st.sampled_from(["a.o", "a.json", "x"]), st.binary(max_size=64)))
def test_manifest_round_trip(artifacts: dict[str, bytes]) -> None:
    raw = make_manifest(KEY, artifacts, 1.5, {"op_type": "Add"}, 1000.0)
    parsed = parse_manifest(raw, KEY)
    assert [(n, s) for n, s, _ in parsed["artifacts"]] == [
        (n, len(d)) for n, d in sorted(artifacts.items())
    ]
    with pytest.raises(CorruptEntry):
        parse_manifest(raw, "f" * 32)


@FUZZ
@given(
    st.lists(
        st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()), max_size=4
    )
)
def test_stats_files_of_any_content_read_as_numbers(shards: list[bytes]) -> None:
    folder = Path(tempfile.mkdtemp(prefix="opcache-fuzz-"))
    for index, data in enumerate(shards):
        (folder / f"{index:02d}.json").write_bytes(data)
    totals = CounterFiles(folder).totals()
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in totals.values())
    CounterFiles(folder).add({"hits": 1})
    assert CounterFiles(folder).totals().get("hits", 0) >= 1


@FUZZ
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_opc_parameter_json_of_any_content(data: bytes) -> None:
    folder = Path(tempfile.mkdtemp(prefix="opcache-fuzz-"))
    (folder / "op.py").write_text("def add(): pass\n")
    (folder / "param.json").write_bytes(data)
    opc = folder / "opc"
    opc.write_text("#!/bin/sh\nexit 0\n")
    opc.chmod(0o755)
    argv = [
        str(opc),
        str(folder / "op.py"),
        "--main_func=add",
        f"--input_param={folder / 'param.json'}",
        "--soc_version=Ascend910B1",
        f"--output={folder / 'out'}",
    ]
    try:
        plan = _plan_opc(argv, {"PATH": "/usr/bin:/bin", "HOME": str(folder)})
    except Uncacheable:
        return
    assert isinstance(plan, Plan)
    assert isinstance(plan.request, OpRequest) and plan.request.soc_version == "Ascend910B1"


@FUZZ
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_spec_files_of_any_content(data: bytes) -> None:
    folder = Path(tempfile.mkdtemp(prefix="opcache-fuzz-"))
    spec = folder / "ops.json"
    spec.write_bytes(data)
    for where, request in load_specs([spec]):
        assert where.startswith(str(spec))
        assert isinstance(request, OpRequest | str)


# -- JSON that Python's parser fails on in other ways than ValueError --------------------
# Too deep for its recursion ('[' * 200000: RecursionError), deep enough that the next
# recursive walk of what it parsed fails, or numbers that overflow on float() / isfinite.
DEEP = b"[" * 200_000
NEARLY_DEEP = b"[" * 900 + b"]" * 900
DEEP_OBJECTS = b'{"a":' * 900 + b"1" + b"}" * 900
HUGE = b"9" * 4000
HOSTILE = [DEEP, NEARLY_DEEP, DEEP_OBJECTS, HUGE, b"-" + HUGE, b"1e999", b"NaN", b"-Infinity"]
hostile_json = st.tuples(
    st.sampled_from(HOSTILE),
    st.sampled_from([b"%s", b"[%s]", b'{"hits":%s}', b'{"headers":%s,"digests":[]}']),
).map(lambda parts: parts[1] % parts[0])
HOSTILE_FUZZ = settings(FUZZ, max_examples=40)


@HOSTILE_FUZZ
@given(st.lists(hostile_json, min_size=1, max_size=3), st.integers(0, 10**30))
def test_stats_files_too_deep_or_too_large_read_as_numbers(shards: list[bytes], big: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="opcache-fuzz-"))
    for index, data in enumerate(shards):
        (folder / f"{index:02d}.json").write_bytes(data)
    (folder / "15.json").write_bytes(b'{"hits":%d,"bytes":1}' % big)
    totals = CounterFiles(folder).totals()
    assert all(abs(v) < 2**63 + 1 and math.isfinite(v) for v in totals.values())
    assert totals["bytes"] == 1 and totals.get("hits", 0) == (big if big < 2**63 else 0)
    CounterFiles(folder).add({"hits": 1})
    assert CounterFiles(folder).totals()["hits"] >= 1


@HOSTILE_FUZZ
@given(hostile_json)
def test_manifest_too_deep_or_too_large_is_corrupt(inner: bytes) -> None:
    for body in (inner, make_manifest(KEY, {}, 1.0, {}, 0.0).split(b"\n", 1)[1]):
        body = body.replace(b'"compile_seconds":1.0', b'"compile_seconds":' + HUGE[:400])
        raw = digest(body).encode() + b"\n" + body
        with pytest.raises(CorruptEntry):
            parse_manifest(raw, KEY)


@HOSTILE_FUZZ
@given(hostile_json)
def test_notes_too_deep_or_too_large_are_forgotten(data: bytes) -> None:
    store = LocalStore(Path(tempfile.mkdtemp(prefix="opcache-fuzz-")))
    for where in (("reads", KEY[:2], KEY), ("direct", KEY[:2], KEY)):
        store.write_note(data, *where)
    assert Memo(store).recall(KEY) == []
    assert HeaderMemo(store)._recall(KEY) == []


def test_a_read_set_naming_a_path_with_a_nul_is_forgotten(tmp_path: Path) -> None:
    """A path holding a NUL (other than the mark of a followed link) is no path: os
    calls raise ValueError on it.  The set is not one, and the compile reads anew."""
    store = LocalStore(tmp_path / "cache")
    there = tmp_path / "there"
    there.mkdir()
    items = [[str(there / "a\0b"), "missing", 0, 0, 0, 0, ""]]
    store.write_note(json.dumps([items]).encode(), "reads", KEY[:2], KEY)
    assert Memo(store).recall(KEY) == []
    assert Memo(store).matching(KEY) is None


@HOSTILE_FUZZ
@given(hostile_json)
def test_explain_notes_too_deep_or_too_large_are_forgotten(data: bytes) -> None:
    store = LocalStore(Path(tempfile.mkdtemp(prefix="opcache-fuzz-")))
    store.write_note(data, "explain", "s", KEY)
    assert explain_notes(store, ("explain", "s", KEY)) == []


@HOSTILE_FUZZ
@given(hostile_json)
def test_cann_jsons_deep_or_huge_parse_as_cann_s_nlohmann_parses_them(data: bytes) -> None:
    """CANN's reader has no depth limit (issue 18): nesting parses, whatever its depth;
    an unclosed one, NaN, Infinity and numbers no double holds are errors."""
    folder = Path(tempfile.mkdtemp(prefix="opcache-fuzz-"))
    (folder / "k.json").write_bytes(data)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        value = cann_read_json(fd, "k.json")
    except ValueError:
        value = ValueError
    finally:
        os.close(fd)
    assert (value is not ValueError) == (NEARLY_DEEP in data or DEEP_OBJECTS in data)


@HOSTILE_FUZZ
@given(hostile_json)
def test_opc_parameter_json_too_deep_or_too_large(data: bytes) -> None:
    assert _opc_names(data, "add") == ("add", "")


@pytest.mark.skipif(GCC is None, reason="gcc is needed for real compiles")
def test_planted_counter_shards_too_deep_or_too_large_fail_no_compile(tmp_path: Path) -> None:
    env, src = base_env(tmp_path), write_project(tmp_path / "src")
    cmd = ["gcc", "-DOFFSET=1", "-c", "k.c", "-o", "k.o"]
    wrap(*cmd, env=env, cwd=src)
    (src / "k.o").unlink()
    shards = [
        *tmp_path.glob("cache/**/_size/*.count"),
        *tmp_path.glob("cache/**/.opcache/stats/host/*.count"),
    ]
    assert {p.parent.name for p in shards} == {"_size", "host"}
    for folder in {p.parent for p in shards}:
        (folder / "03.count").write_bytes(b'{"bytes":' + HUGE + b"}")
        (folder / "05.count").write_bytes(b'{"entries":' + HUGE[:400] + b"}")
        (folder / "07.json").write_bytes(DEEP)
    wrap(*cmd, env=env, cwd=src)  # a hit or a miss, but k.o made, no traceback
    assert (src / "k.o").stat().st_size > 0
    (src / "k.o").unlink()
    wrap(*cmd, "-O1", env=env, cwd=src)
    assert (src / "k.o").stat().st_size > 0
    assert stats(env, "host")
    opcache("age", env=env, cwd=tmp_path)


def test_cann_age_ages_deep_jsons_as_cann_and_keeps_those_it_cannot_parse(tmp_path: Path) -> None:
    """CANN's nlohmann reader parses any depth, so it ages (and reuses) the deep one;
    it rejects a number no double holds, so it never ages that one, and verify reports it
    (issue 18; te_file_utils.cc GetJsonValueFromJsonFile)."""
    base = tmp_path / "atc"
    root = base / "kernel_cache"
    chip = root / SOC
    kept = {}
    for label, planted in (("deep", b"[" * 100_000 + b"]" * 100_000), ("huge", HUGE), ("ok", b"1")):
        kernel = kernel_name("Add", label)
        binary = os.urandom(600 * 1024)
        paths = store_entry(chip, kernel, binary)
        body = json.dumps({**kernel_json(kernel, binary), "pad": "X"}).encode()
        paths[0].write_bytes(body.replace(b'"X"', planted))
        set_access(paths, time.time() - 5 * 3600)
        kept[label] = paths
    write_ini(root, max_mb=1, ratio=10)
    env = {"HOME": str(tmp_path), "LANG": "C.UTF-8"}
    opcache("cann", "age", "--op_compiler_cache_dir", str(base), env=env, cwd=tmp_path)
    assert all(p.exists() for p in kept["huge"])
    assert not any(p.exists() for p in kept["ok"] + kept["deep"])
    verify = ("cann", "verify", "--op_compiler_cache_dir", str(base), "--json")
    done = opcache(*verify, env=env, cwd=tmp_path, status=1, text=True)
    faults = json.loads(done.stdout)["chips"][SOC]["faults"]
    assert [f["name"] for f in faults] == [kernel_name("Add", "huge")]
