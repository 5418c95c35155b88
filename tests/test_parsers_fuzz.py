"""Every parser of a file a user or another process can write: parse or fail clearly.

Property-based: arbitrary bytes and near-valid text go into op_cache.ini, the
op_debug_config .cfg, entry manifests, stats counter files, opc parameter
JSON and `opcache compile` spec files.  Each either parses or fails with its
documented error; nothing else escapes, and nothing hangs (hypothesis'
deadline).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opcache import ConfigError
from opcache.batch import load_specs
from opcache.counters import CounterFiles
from opcache.debug import read_debug_config
from opcache.ini import read_size_limits
from opcache.key import digest
from opcache.request import OpRequest
from opcache.storage.entry import CorruptEntry, make_manifest, parse_manifest
from opcache.wrap import Plan, Uncacheable, _plan_opc

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
