"""No op_cache.ini and no entry json makes any ``opcache cann`` command raise (issue 18).

Hypothesis writes CANN-format kernel_cache folders whose op_cache.ini and entry
jsons hold anything: garbage bytes, ini-like lines, JSON of every type and
depth, entries whose fields have the wrong types, NaN, huge numbers, lone
surrogates.  ``stats``, ``verify``, ``age --dry-run``, ``age`` and
``verify --fix`` each exit 0 or 1 with a JSON report, never a traceback.  The
reader that stands in for nlohmann's (``_json.loads_nlohmann``) is also checked
against Python's own parser where both apply.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from helpers_cann import SOC, kernel_json, set_access
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from opcache import _json
from opcache.cli import main

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
odd_values = json_values | st.sampled_from(["NaN", "1e400", "\ud800", "sub/x", "../x", ""])
# An entry's fields, each of the right type or of any other.
entry_fields = st.fixed_dictionaries(
    {},
    optional={
        key: odd_values
        for key in ("binFileName", "binFileSuffix", "kernelName", "sha256", "headerFileSuffix")
    }
    | {"jsonList": json_values | st.lists(st.dictionaries(st.just("jsonFileName"), odd_values))},
)
json_bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    entry_fields.map(lambda v: json.dumps(v).encode()),
    st.tuples(st.sampled_from([b"[", b'{"a":']), st.integers(1, 5000), st.booleans()).map(
        lambda t: t[0] * t[1] + (b"1" + (b"]" if t[0] == b"[" else b"}") * t[1] if t[2] else b"")
    ),
    st.sampled_from([b"NaN", b'{"a": Infinity}', b"1e400", b'"\\ud800"', b"\xef\xbb\xbf{}"]),
)
ini_lines = st.lists(
    st.one_of(
        st.sampled_from(
            ["[op_compiler_cache]", "[ op_compiler_cache ]", "[zz]", "[aa]", "[", "# c", "\ufeff["]
        ),
        st.tuples(
            st.sampled_from(
                ["max_op_cache_size", "remain_cache_size_ratio", "adk_version", "ops_version"]
            ),
            st.sampled_from(["=", " = ", ":", "=\t"]),
            st.one_of(st.integers(-(2**40), 2**40).map(str), st.text(max_size=12)),
        ).map("".join),
        st.text(max_size=30),
    ),
    max_size=10,
).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass"))
inis = st.binary(max_size=200) | ini_lines


def _folder(ini: bytes, bodies: list[bytes]) -> Path:
    base = Path(tempfile.mkdtemp(prefix="opcache-cann-fuzz-"))
    root = base / "kernel_cache"
    chip = root / SOC
    chip.mkdir(parents=True)
    (root / "op_cache.ini").write_bytes(ini)
    old = time.time() - 5 * 3600
    for index, body in enumerate(bodies):
        kernel = f"te_add_{index}"
        (chip / f"{kernel}.o").write_bytes(b"kernel")
        (chip / f"{kernel}.json").write_bytes(body)
        set_access([chip / f"{kernel}.o", chip / f"{kernel}.json"], old)
    with open(chip / "pad.bin", "wb") as pad:  # (sparse) over any limit of up to 2 MB
        pad.truncate(3 << 20)
    return base


@FUZZ
@given(inis, st.lists(json_bodies, min_size=1, max_size=3))
@example(
    b"[op_compiler_cache]\nadk_version=1\nops_version=1\nmax_op_cache_size=1\n"
    b"remain_cache_size_ratio=1\n",
    [json.dumps(kernel_json("te_add_0", b"kernel")).encode(), b"[" * 100_000],
)
def test_no_ini_or_json_makes_a_cann_command_raise(
    capsys: pytest.CaptureFixture[str], ini: bytes, bodies: list[bytes]
) -> None:
    base = _folder(ini, bodies)
    try:
        for argv in (["stats"], ["verify"], ["age", "--dry-run"], ["age"], ["verify", "--fix"]):
            status = main(["cann", *argv, "--op_compiler_cache_dir", str(base), "--json"])
            out = capsys.readouterr().out
            assert status in (0, 1), argv
            assert SOC in json.loads(out)["chips"]
    finally:
        shutil.rmtree(base)


# -- the stand-in for nlohmann's reader against Python's parser --------------------------


def _python(text: str) -> object:
    """Python's raw_decode of the first value with nlohmann's rules, or ValueError."""
    decoder = json.JSONDecoder(
        parse_int=_json._bounded_int,
        parse_float=_json._finite_float,
        parse_constant=_json._no_constant,
    )
    start = len(text) - len(text.lstrip(" \t\n\r"))
    try:
        value, end = decoder.raw_decode(text, start)
        _json._refuse_surrogates(value)
    except ValueError:
        return ValueError
    if isinstance(value, (int, float)) and _json.number_cut_short(text, start, end):
        return ValueError
    return value


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(0, 40), st.text(alphabet=' []{},:"0123456789.eE-tnl\\', max_size=6))
def test_the_deep_reader_agrees_with_python_s_where_both_apply(value, cut, noise):
    """On JSON, cut short or with noise added: the iterative reader used past the
    recursion limit accepts and rejects what Python's parser (with nlohmann's rules)
    does, with the same value."""
    text = json.dumps(value)
    text = text[: len(text) - cut] + noise if cut else text + noise
    start = len(text) - len(text.lstrip(" \t\n\r"))
    try:
        got: object = _json._raw_decode_deep(text, start)[0]
    except ValueError:
        got = ValueError
    if got is not ValueError and isinstance(got, (int, float)):
        end = _json._raw_decode_deep(text, start)[1]
        if _json.number_cut_short(text, start, end):
            got = ValueError
    assert got == _python(text)


def test_the_reader_bounds_hostile_sizes_quickly():
    """Ten million open brackets, or a million nested objects, parse in seconds with no
    RecursionError, and what lies below MAX_DEPTH comes back as DEEP."""
    assert _json.loads_nlohmann(b"[" * 10_000_000 + b"]" * 10_000_000) is not None
    value = _json.loads_nlohmann(b'{"a":' * 1_000_000 + b"1" + b"}" * 1_000_000)
    for _ in range(_json.MAX_DEPTH - 1):
        value = value["a"]  # type: ignore[index]
    assert value == {"a": _json.DEEP}
    with pytest.raises(ValueError):
        _json.loads_nlohmann(b"[" * 10_000_000)


@pytest.mark.parametrize("cut", [0, 1])
def test_a_deep_reader_error_is_a_value_error(cut):
    """Unclosed or broken nesting below the recursion limit is a ValueError, like any
    other json CANN cannot parse."""
    body = b"[" * 5000 + b"1," + b"]" * (5000 - cut)
    with pytest.raises(ValueError):
        _json.loads_nlohmann(body)


@pytest.mark.parametrize(
    ("body", "value"),
    [(b"1.", None), (b"1e", None), (b"1.5E", None), (b"1e5.", 1e5), (b"1.5.", 1.5),
     (b"0.1.2", 0.1), (b" 12x", 12), (b"012", 0), (b"-", None)],
)  # fmt: skip
def test_a_top_level_number_ends_where_nlohmann_s_lexer_ends_it(body, value):
    """nlohmann's ``lexer::scan_number``: after the integer part a "." or an "e" must be
    followed by digits, else the number is an error; after a fraction an "e" must be;
    after the exponent the number ends and the rest is never read."""
    if value is None:
        with pytest.raises(ValueError):
            _json.loads_nlohmann(body)
    else:
        assert _json.loads_nlohmann(body) == value
