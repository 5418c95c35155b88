"""The cache key: what makes two compiles the same compile (issue 3, "Key")."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest
from helpers_cache import SOC, ToyCompiler, make_request, make_settings

import opcache
from opcache.key import SCHEMA, canonical_json, compute_key


@pytest.fixture
def compiler(tmp_path: Path) -> ToyCompiler:
    return ToyCompiler(tmp_path / "calls")


def key_of(request: opcache.OpRequest, compiler: ToyCompiler) -> str:
    return opcache.explain_key(request, compiler)["key"]


def test_key_is_128_bit_hex_and_stable(compiler: ToyCompiler) -> None:
    first = key_of(make_request(), compiler)
    assert re.fullmatch(r"[0-9a-f]{32}", first)
    assert key_of(make_request(), compiler) == first
    assert compute_key(make_request(), compiler.name, compiler.fingerprint())[0] == first


def test_dict_order_does_not_change_the_key(compiler: ToyCompiler) -> None:
    a = opcache.OpRequest(
        op_type="Conv2D",
        soc_version=SOC,
        op_name="conv",
        inputs=[{"shape": [1, 3, 8, 8], "dtype": "float16", "format": "NCHW"}],
        outputs=[{"shape": [1, 4, 8, 8], "dtype": "float16", "format": "NCHW"}],
        attrs={"strides": [1, 1], "pads": {"top": 0, "left": 1}, "groups": 1},
        options={"impl_mode": "high_precision", "precision_mode": "force_fp16"},
        sources={"conv.py": b"x", "helper.py": b"y"},
    )
    b = opcache.OpRequest(
        op_type="Conv2D",
        soc_version=SOC,
        op_name="conv",
        inputs=[{"format": "NCHW", "dtype": "float16", "shape": [1, 3, 8, 8]}],
        outputs=[{"format": "NCHW", "shape": [1, 4, 8, 8], "dtype": "float16"}],
        attrs={"groups": 1, "pads": {"left": 1, "top": 0}, "strides": [1, 1]},
        options={"precision_mode": "force_fp16", "impl_mode": "high_precision"},
        sources={"helper.py": b"y", "conv.py": b"x"},
    )
    assert key_of(a, compiler) == key_of(b, compiler)


def _changed(field: str) -> opcache.OpRequest:
    base = make_request()
    first_input = dict(base.inputs[0])
    if field == "op_type":
        return make_request(op_type="Sub")
    if field == "soc_version":
        return make_request(soc_version="Ascend310P3")
    if field in ("shape", "dtype", "format"):
        first_input[field] = {"shape": [16, 1025], "dtype": "float32", "format": "NZ"}[field]
        return make_request(inputs=[first_input, base.inputs[1]])
    if field == "input_count":
        return make_request(inputs=[first_input])
    if field == "outputs":
        return make_request(outputs=[{**base.outputs[0], "dtype": "float32"}])
    if field == "attrs":
        return make_request(attrs={"alpha": 2.0})
    if field == "attr_int_vs_float":
        return make_request(attrs={"alpha": 1})
    if field == "options":
        return make_request(options={"impl_mode": "high_precision"})
    if field == "source_bytes":
        return make_request(sources={"add.py": b"def add(x, y):\n    return y + x\n"})
    if field == "source_name":
        return make_request(sources={"add2.py": base.sources["add.py"]})
    if field == "extra_source":
        return make_request(sources={**base.sources, "util.py": b""})
    raise AssertionError(field)


@pytest.mark.parametrize(
    "field",
    [
        "op_type",
        "soc_version",
        "shape",
        "dtype",
        "format",
        "input_count",
        "outputs",
        "attrs",
        "attr_int_vs_float",
        "options",
        "source_bytes",
        "source_name",
        "extra_source",
    ],
)
def test_any_changed_part_changes_the_key(field: str, compiler: ToyCompiler) -> None:
    assert key_of(_changed(field), compiler) != key_of(make_request(), compiler)


def test_input_order_is_part_of_the_key(compiler: ToyCompiler) -> None:
    first = dict(make_request().inputs[0])
    other = {**first, "dtype": "float32"}
    one = make_request(inputs=[other, first])
    two = make_request(inputs=[first, other])
    assert key_of(one, compiler) != key_of(two, compiler)


def test_compiler_name_and_fingerprint_are_part_of_the_key(tmp_path: Path) -> None:
    request = make_request()
    base = key_of(request, ToyCompiler(tmp_path / "c"))
    assert key_of(request, ToyCompiler(tmp_path / "c", name="othercc")) != base
    assert key_of(request, ToyCompiler(tmp_path / "c", version="1.1")) != base
    # Behaviour knobs that are not the toolchain's identity leave the key alone.
    assert key_of(request, ToyCompiler(tmp_path / "c", sleep=1.0, size=9)) == base


def test_op_name_is_not_part_of_the_key(compiler: ToyCompiler) -> None:
    assert key_of(make_request(op_name="node_a"), compiler) == key_of(
        make_request(op_name="node_b"), compiler
    )


def test_source_given_as_path_is_read(tmp_path: Path, compiler: ToyCompiler) -> None:
    code = make_request().sources["add.py"]
    source = tmp_path / "add.py"
    source.write_bytes(code)
    by_path = make_request(sources={"add.py": source})
    by_str = make_request(sources={"add.py": str(source)})
    assert key_of(by_path, compiler) == key_of(make_request(), compiler)
    assert key_of(by_str, compiler) == key_of(make_request(), compiler)
    source.write_bytes(code + b"# changed\n")
    assert key_of(make_request(sources={"add.py": source}), compiler) != key_of(
        make_request(), compiler
    )


def test_explain_key_shows_every_part(compiler: ToyCompiler) -> None:
    request = make_request()
    explained = opcache.explain_key(request, compiler)
    parts = explained["parts"]
    assert set(parts) == {
        "schema",
        "op_type",
        "soc_version",
        "inputs",
        "outputs",
        "attrs",
        "options",
        "sources",
        "compiler",
    }
    assert parts["schema"] == SCHEMA
    assert parts["op_type"] == "Add"
    assert parts["soc_version"] == SOC
    assert parts["compiler"] == {"name": "toycc", "fingerprint": "toycc 1.0"}
    assert set(parts["sources"]) == {"add.py"}
    assert re.fullmatch(r"[0-9a-f]{32}", parts["sources"]["add.py"])
    assert "op_name" not in parts
    assert set(explained["part_digests"]) == set(parts)

    # Comparing two explanations names the part that made the miss.
    other = opcache.explain_key(make_request(options={"impl_mode": "x"}), compiler)
    differing = {
        name
        for name, value in explained["part_digests"].items()
        if other["part_digests"][name] != value
    }
    assert differing == {"options"}


def test_explain_key_matches_the_key_the_cache_uses(tmp_path: Path, compiler: ToyCompiler) -> None:
    settings = make_settings(tmp_path / "ops", tmp_path)
    request = make_request()
    with opcache.OpCache(settings) as cache:
        result = cache.compile(request, compiler, tmp_path / "out")
    assert result.key == opcache.explain_key(request, compiler)["key"]
    assert (settings.chip_dir(SOC) / result.key[:2] / result.key).is_dir()


def test_key_is_logged_at_debug(caplog: pytest.LogCaptureFixture, compiler: ToyCompiler) -> None:
    caplog.set_level(logging.DEBUG, logger="opcache")
    request = make_request()
    key, inputs = compute_key(request, compiler.name, compiler.fingerprint())
    blob = canonical_json(inputs)
    messages = [r.getMessage() for r in caplog.records if r.name == "opcache.key"]
    assert len(messages) == 1
    assert key in messages[0]
    assert blob.decode() in messages[0]
    assert '"fingerprint":"toycc 1.0"' in messages[0]


def test_a_new_fingerprint_misses_instead_of_serving_a_stale_kernel(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "ops", tmp_path)
    old = ToyCompiler(tmp_path / "calls", version="8.0")
    new = ToyCompiler(tmp_path / "calls", version="8.1")
    with opcache.OpCache(settings) as cache:
        assert cache.compile(make_request(), old, tmp_path / "a").status == "miss"
        assert cache.compile(make_request(), new, tmp_path / "b").status == "miss"
        assert cache.compile(make_request(), old, tmp_path / "c").status == "hit"
    assert old.calls() == 2


def test_requests_are_read_only_compare_by_value_and_survive_pickling() -> None:
    import pickle

    from opcache import OpRequest

    request = OpRequest("Add", SOC, op_name="add_1", attrs={"alpha": 1})
    assert OpRequest("Add", SOC).attrs == {} and OpRequest("Add", SOC).sources == {}
    assert pickle.loads(pickle.dumps(request)) == request
    assert request != OpRequest("Add", SOC, op_name="add_2", attrs={"alpha": 1})
    with pytest.raises(AttributeError):
        request.op_type = "Mul"  # type: ignore[misc]


def test_a_request_that_contains_itself_is_refused_not_hung() -> None:
    attrs: dict = {"alpha": 1}
    attrs["self"] = attrs
    with pytest.raises(TypeError, match="not JSON data"):
        canonical_json({"attrs": attrs})


def test_a_request_nested_too_deep_is_refused_as_not_json() -> None:
    attrs: list = []
    inner = attrs
    for _ in range(sys.getrecursionlimit() + 10):
        inner.append([])
        inner = inner[0]
    with pytest.raises(TypeError, match="not JSON data"):
        canonical_json({"attrs": attrs})


class _Attrs(dict):
    pass


class _Name(str):
    pass


@pytest.mark.parametrize(
    "value",
    [
        {"attrs": {"pads": [{"top": 0}, ({1: 0},)]}},  # deep in a tuple in a list
        {"attrs": _Attrs({2.5: "x"})},  # a mapping of another class
        {"attrs": [[{"a": {None: 1}}]] * 2},  # the same list twice, then deeper
        {1: "top"},
    ],
)
def test_a_mapping_key_that_is_not_text_is_refused_wherever_it_is(value: dict) -> None:
    # JSON would write 1 as "1": two different requests would share a key.
    with pytest.raises(TypeError, match="non-string mapping key"):
        canonical_json(value)


def test_text_keys_of_a_str_class_and_shared_parts_are_json_as_usual() -> None:
    shared = {"dtype": "float16"}
    value = {"inputs": [shared, shared], "attrs": _Attrs({_Name("k"): (1, 2.5, None, True)})}
    assert canonical_json(value) == (
        b'{"attrs":{"k":[1,2.5,null,true]},"inputs":[{"dtype":"float16"},{"dtype":"float16"}]}'
    )
