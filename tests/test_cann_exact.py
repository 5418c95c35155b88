"""``opcache cann`` reads op_cache.ini and entry jsons exactly as CANN's own code does (issue 18).

Each test builds a CANN-format kernel_cache (``helpers_cann``) and asserts what
CANN's public source does with it: hicann/ge, ``compiler/opcompiler/
op_compile_adapter/source/``: ``cache/te_cache_space_manager.cc`` (the ini and
aging), ``cache/te_cache_manager.cc`` and ``common/compile_result_utils.cc``
(the hit check), ``common/te_file_utils.cc`` (the json reader: nlohmann's
``ifs >> json``).  Where opcache deliberately differs, the test says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from helpers_cann import (
    SOC,
    base,
    cann,
    cann_json,
    kernel_json,
    kernel_name,
    set_access,
    store_entry,
    store_mix_entry,
    write_ini,
)

__all__ = ["base"]  # the fixture, from helpers_cann

KIB = 1024
ENTRY = 1100 * KIB  # one entry is over the 1 MiB limit of age_all
HOUR = 3600
VERSIONS = "[op_compiler_cache]\nadk_version=7.0.RC1\nops_version=7.0.RC1\n"


class Cache:
    """A CANN kernel_cache whose entries were last used hours ago."""

    def __init__(self, base: Path) -> None:
        self.root = base / "kernel_cache"
        self.chip = self.root / SOC
        self.now = time.time()

    def entry(self, label: str, body: bytes | None = None, **fields: object) -> list[Path]:
        """A stored entry, 5 hours idle; ``body`` replaces its json's bytes."""
        kernel = kernel_name("Add", label)
        paths = store_entry(self.chip, kernel, os.urandom(ENTRY), **fields)  # type: ignore[arg-type]
        if body is not None:
            paths[0].write_bytes(body)
        set_access(paths, self.now - 5 * HOUR)
        return paths

    def fields(self, label: str) -> dict:
        return json.loads(self.chip.joinpath(f"{kernel_name('Add', label)}.json").read_bytes())

    def age_all(self) -> None:
        """A limit every old entry is over: CANN deletes all it can."""
        write_ini(self.root, max_mb=1, ratio=1)


def names(paths: list[Path]) -> set[str]:
    return {p.name for p in paths}


def present(chip: Path) -> set[str]:
    return {p.name for p in chip.iterdir()}


def faults(capsys, base: Path, *flags: str) -> dict[str, str]:
    """kernel label -> why, for the corrupt entries verify reports."""
    report = cann_json(capsys, base, "verify", *flags)[1]["chips"][SOC]
    return {f["name"]: f["why"] for f in report["faults"] if f["kind"] == "corrupt"}


def limits(capsys, base: Path) -> tuple[int, int, str]:
    """(max MB, ratio %) CANN's aging of ``base`` uses, and stderr (opcache's own
    cache shares the ini and may warn about it)."""
    _, out, err = cann(capsys, base, "stats", "--json")
    found = json.loads(out)["limits"]
    return found["max_op_cache_size_mb"], found["remain_cache_size_ratio"], err


# -- op_cache.ini: CANN's line parser ------------------------------------------------------

SIZES = "max_op_cache_size=7\nremain_cache_size_ratio=20\n"
INI_CASES = {
    # CANN ignores the sizes:
    "BOM before the section": ("\xef\xbb\xbf" + VERSIONS + SIZES, None),
    "colon lines": (VERSIONS + "max_op_cache_size: 7\nremain_cache_size_ratio: 20\n", None),
    "a section sorting before": ("[aa]\nx=1\n" + VERSIONS + SIZES, None),
    "no versions": ("[op_compiler_cache]\n" + SIZES, None),
    # ("[" only in column 0 opens a section: an indented one is a line without "=")
    "an indented section line": ("  " + VERSIONS + SIZES, None),
    # CANN applies them:
    "keys above the section": (SIZES + VERSIONS, (7, 20)),
    "a section sorting after": (VERSIONS + SIZES + "[zz]\nx=1\n", (7, 20)),
    "a line without =": (VERSIONS + "this line has no equals sign\n" + SIZES, (7, 20)),
    "indented keys": (VERSIONS + "  max_op_cache_size=7\n\tremain_cache_size_ratio=20\n", (7, 20)),
    "spaces in the section name": (
        "[ op_compiler_cache ]\nadk_version=1\nops_version=1\n" + SIZES,
        (7, 20),
    ),
    "a Latin-1 byte in a comment": ("# caf\xe9\n" + VERSIONS + SIZES, (7, 20)),
    "CRLF lines": ((VERSIONS + SIZES).replace("\n", "\r\n"), (7, 20)),
    "two sections: the first wins": (
        VERSIONS + SIZES + "[op_compiler_cache]\nmax_op_cache_size=-1\nremain_cache_size_ratio=5\n",
        (7, 20),
    ),
    "2147483647": (
        VERSIONS + "max_op_cache_size=2147483647\nremain_cache_size_ratio=20\n",
        (2147483647, 20),
    ),
    "stoi's leading digits": (
        VERSIONS + "max_op_cache_size=7MB\nremain_cache_size_ratio=20%\n",
        (7, 20),
    ),
    "a repeated key: the last wins": (VERSIONS + "max_op_cache_size=3\n" + SIZES, (7, 20)),
    "2147483648 is out of int": (
        VERSIONS + "max_op_cache_size=2147483648\nremain_cache_size_ratio=20\n",
        None,
    ),
}


@pytest.mark.parametrize(("text", "applied"), list(INI_CASES.values()), ids=list(INI_CASES))
def test_op_cache_ini_is_read_by_cann_s_line_parser(base, capsys, text, applied):
    """te_cache_space_manager.cc: ``LoadIniFile`` (getline; "#" only in column 0; "[" in
    column 0 opens a section named up to its last "]", trimmed of spaces and tabs; a
    line without "=" skipped; keys and values trimmed; keys above the first section
    join it; ``std::map::emplace`` keeps the first section of a name), then
    ``GetCacheInitFileCfg`` (sections in name order, another one first makes the
    file invalid; adk_version and ops_version required) and ``UpdateOpCacheSizeCfg``
    (``std::stoi``; max -1 or 1..INT_MAX, ratio 1..100).  The bytes are C++ bytes:
    a BOM is text, a Latin-1 byte is a byte."""
    cache = Cache(base)
    cache.entry("one")
    cache.root.joinpath("op_cache.ini").write_bytes(text.encode("latin-1"))
    assert limits(capsys, base)[:2] == (applied or (500, 50))


def test_a_second_section_s_minus_one_does_not_turn_aging_off(base, capsys):
    """``LoadIniFile``'s ``emplace`` keeps the first ``[op_compiler_cache]``: CANN ages."""
    cache = Cache(base)
    old = cache.entry("old")
    cache.root.joinpath("op_cache.ini").write_text(
        VERSIONS + "max_op_cache_size=1\nremain_cache_size_ratio=1\n"
        "[op_compiler_cache]\nmax_op_cache_size=-1\nremain_cache_size_ratio=50\n"
    )
    cache.entry("old2")
    assert cann_json(capsys, base, "age")[1]["chips"][SOC]["removed"]
    assert not any(p.exists() for p in old[:2])


def test_an_env_ratio_that_atoi_would_wrap_is_invalid_here(base, capsys, monkeypatch):
    """Deliberate difference: ``GetCacheRemainSizeRadio`` reads the variable with
    ``atoi``, which wraps 4294967306 to 10 (undefined behaviour); opcache calls it
    invalid and keeps 50 %, with a warning."""
    Cache(base).entry("one")
    monkeypatch.setenv("ASCEND_REMAIN_CACHE_SIZE_RATIO", "4294967306")
    max_mb, ratio, err = limits(capsys, base)
    assert (max_mb, ratio) == (500, 50) and "ASCEND_REMAIN_CACHE_SIZE_RATIO" in err


# -- entry jsons: what nlohmann's operator>> accepts ---------------------------------------


def test_trailing_data_and_a_second_object_are_read_as_cann_reads_them(base, capsys):
    """te_file_utils.cc ``GetJsonValueFromJsonFile``: ``ifs >> json`` parses the first
    value and never reads past it (nlohmann's parse with strict=false): CANN ages the
    entry and its hit check reuses it."""
    cache = Cache(base)
    trailing = cache.entry("trailing")
    trailing[0].write_bytes(trailing[0].read_bytes() + b"\n garbage \xff")
    twice = cache.entry("twice")
    twice[0].write_bytes(twice[0].read_bytes() * 2)
    set_access(trailing + twice, cache.now - 5 * HOUR)  # (reading them moved it)
    assert faults(capsys, base) == {}
    cache.age_all()
    cann(capsys, base, "age")
    assert not any(p.exists() for p in trailing + twice)


@pytest.mark.parametrize("body", [b"null", b"[1, 2]", b'"text"', b"42", b"true", b"{}"])
def test_a_json_of_any_top_level_type_is_aged_alone_and_never_reused(base, capsys, body):
    """te_cache_space_manager.cc ``GetFilesAccessTime``: ``find("jsonList")`` on a value
    that is no object finds nothing, ``AddBinFileInfoFromJson`` finds no binFileName,
    so the entry is the json alone, aged by its access time.  compile_result_utils.cc
    ``SetBinFilePath``: ``contains("binFileName")`` is false, so no hit."""
    cache = Cache(base)
    paths = cache.entry("odd", body)
    assert set(faults(capsys, base)) == {kernel_name("Add", "odd")}
    cache.age_all()
    cann(capsys, base, "age")
    assert not paths[0].exists() and paths[1].exists()  # its binary is not named: it stays


def test_a_json_over_16_mib_is_aged_and_reused(base, capsys):
    """nlohmann reads any size: CANN ages and reuses a 17 MiB json."""
    cache = Cache(base)
    paths = cache.entry("big")
    data = cache.fields("big") | {"pad": "x" * (17 << 20)}
    paths[0].write_text(json.dumps(data))
    set_access(paths, cache.now - 5 * HOUR)
    assert faults(capsys, base) == {}
    cache.age_all()
    cann(capsys, base, "age")
    assert not any(p.exists() for p in paths)


UNPARSABLE = {
    "NaN": b'{"blockDim": NaN}',
    "Infinity": b'{"blockDim": -Infinity}',
    "1e400": b'{"blockDim": 1e400}',
    "lone surrogate": b'{"kernelName": "\\ud800"}',
    "raw surrogate": b'{"kernelName": "\xed\xa0\x80"}',
    "UTF-16": '{"blockDim": 1}'.encode("utf-16"),
}


@pytest.mark.parametrize("body", list(UNPARSABLE.values()), ids=list(UNPARSABLE))
def test_what_nlohmann_cannot_parse_is_never_aged_and_never_reused(base, capsys, body):
    """nlohmann rejects NaN and Infinity (no such JSON), a number that overflows a
    double (parser: "number overflow"), a lone surrogate, escaped or as bytes, and text
    that is no UTF-8: ``GetJsonValueFromJsonFile`` fails, so ``GetFilesAccessTime``
    skips the entry (never aged) and ``ParseCompileResult`` fails (JSON_INVALID)."""
    cache = Cache(base)
    data = cache.entry("bad")
    fields = json.dumps(cache.fields("bad"))[1:-1].encode()
    at = body.index(b"{") + 1 if not body.startswith(b"\xff") else None
    data[0].write_bytes(body[:at] + fields + b", " + body[at:] if at else body)
    set_access(data, cache.now - 5 * HOUR)
    assert set(faults(capsys, base)) == {kernel_name("Add", "bad")}
    cache.age_all()
    cann(capsys, base, "age")
    assert all(p.exists() for p in data)


def test_a_json_nested_100000_deep_crashes_nothing_and_is_aged(base, capsys):
    """nlohmann's parser keeps its own stack: any depth parses.  CANN ages such an
    entry (the json alone: it names no binary)."""
    cache = Cache(base)
    deep = cache.entry("deep", b"[" * 100_000 + b"]" * 100_000)
    nested = cache.entry("nested")
    data = json.dumps(cache.fields("nested") | {"x": "HOLE"}).encode()
    nested[0].write_bytes(data.replace(b'"HOLE"', b'{"a":' * 100_000 + b"1" + b"}" * 100_000))
    set_access(nested, cache.now - 5 * HOUR)
    for action in ("stats", "verify"):
        assert cann(capsys, base, action)[0] in (0, 1)
    assert set(faults(capsys, base)) == {kernel_name("Add", "deep")}  # nested is reusable
    cache.age_all()
    status, _, err = cann(capsys, base, "age")
    assert (status, err) == (0, "")
    assert not deep[0].exists() and not any(p.exists() for p in nested)


def test_a_jsonlist_object_has_its_sub_jsons_and_binaries_aged(base, capsys):
    """``GetFilesAccessTime`` iterates ``jsonList`` with nlohmann's iterator, which walks
    an object's values as it walks a list: CANN deletes the sub-jsons and their binaries."""
    cache = Cache(base)
    kernel = kernel_name("MatMul", "mix")
    paths = store_mix_entry(cache.chip, kernel, os.urandom(ENTRY), os.urandom(ENTRY))
    main = json.loads(paths[0].read_bytes())
    main["jsonList"] = {str(i): item for i, item in enumerate(main["jsonList"])}
    paths[0].write_text(json.dumps(main))
    set_access(paths, cache.now - 5 * HOUR)
    cache.age_all()
    cann(capsys, base, "age")
    assert not any(p.exists() for p in paths)
    assert (cache.chip / f"{kernel}.o").exists()  # its own binary: CANN never ages it


# -- verify: CANN's hit check, exactly ---------------------------------------------------------


def test_verify_passes_what_cann_s_hit_check_reuses(base, capsys):
    """compile_result_utils.cc ``SetKernelBin`` needs ``contains("kernelName")``, not a
    non-empty one; ``SetBinFilePath`` takes ``realpath(<dir>/<binFileName><suffix>)``,
    so a binary in a subfolder is found; te_cache_manager.cc ``VerifyBinFileSha256``
    compares its sha256.  None of these is a fault, and ``--fix`` removes nothing."""
    cache = Cache(base)
    empty_name = cache.entry("empty", kernelName="")
    kernel = kernel_name("Add", "sub")
    binary = os.urandom(ENTRY)
    (cache.chip / "sub").mkdir(parents=True)
    (cache.chip / "sub" / f"{kernel}.o").write_bytes(binary)
    data = kernel_json(kernel, binary, binFileName=f"sub/{kernel}")
    (cache.chip / f"{kernel}.json").write_text(json.dumps(data))
    before = present(cache.chip)
    assert cann_json(capsys, base, "verify", "--fix")[1]["chips"][SOC]["faults"] == []
    assert present(cache.chip) == before and all(p.exists() for p in empty_name)
    (cache.chip / "sub" / f"{kernel}.o").write_bytes(b"other")  # the sha256 is checked there
    assert set(faults(capsys, base)) == {kernel}


def test_verify_reports_what_cann_s_hit_check_never_reuses(base, capsys):
    """``ParseCompileResult`` fails on a main json without ``binFileName`` (a ``jsonList``
    entry included); ``VerifyBinFileSha256`` compares the sha256 string exactly with the
    lower-case hex digest, so an upper-case one never matches."""
    cache = Cache(base)
    upper = cache.entry("upper")
    data = cache.fields("upper")
    data["sha256"] = data["sha256"].upper()
    upper[0].write_text(json.dumps(data))
    mix = kernel_name("MatMul", "mix")
    store_mix_entry(cache.chip, mix, os.urandom(KIB), os.urandom(KIB), main=None)
    found = faults(capsys, base)
    assert set(found) == {kernel_name("Add", "upper"), mix}
    assert "jsonList" in found[mix]
    cann(capsys, base, "verify", "--fix")
    assert not upper[0].exists() and not (cache.chip / f"{mix}.json").exists()


def test_verify_checks_so_entries_as_far_as_cann_s_check_goes_without_running_them(base, capsys):
    """``SetKernelBinBySo`` needs ``kernelName``; the sha256 CANN compares is that of the
    kernel the library's ``GetKernelBin()`` returns (after ``dlopen``), in lower-case hex:
    one that is no lower-case sha256 never matches.  opcache never loads a library
    from a cache folder, so a well-formed one is left unverified (deliberately)."""
    cache = Cache(base)
    sha = hashlib.sha256(b"kernel").hexdigest()
    cases = {
        "good": {"sha256": sha},
        "upper": {"sha256": sha.upper()},
        "short": {"sha256": "abc"},
        "nokernel": {"sha256": sha, "kernelName": None},
    }
    for label, fields in cases.items():
        kernel = kernel_name("Add", label)
        cache.chip.mkdir(parents=True, exist_ok=True)
        (cache.chip / f"{kernel}.so").write_bytes(b"\x7fELF library")
        data = kernel_json(kernel, b"", binFileSuffix=".so", **fields)
        data = {k: v for k, v in data.items() if v is not None}
        (cache.chip / f"{kernel}.json").write_text(json.dumps(data))
    assert set(faults(capsys, base)) == {
        kernel_name("Add", x) for x in ("upper", "short", "nokernel")
    }
    report = cann_json(capsys, base, "verify")[1]["chips"][SOC]
    assert report["checked"] == 1  # "good": every check but the kernel's own sha256


# -- deliberate differences ------------------------------------------------------------------


def test_a_bin_name_leading_elsewhere_is_never_deleted(base, capsys):
    """``AddBinFileInfoFromJson`` deletes ``<dir>/<binFileName><suffix>`` wherever it
    leads, even in another chip folder; opcache deletes only files of the entry's own
    folder (deliberate), and verify neither checks nor removes what it cannot reach."""
    cache = Cache(base)
    other = cache.root / "Ascend310P3"
    other.mkdir(parents=True)
    victim = other / "te_victim.o"
    victim.write_bytes(b"another chip's kernel")
    stray = cache.entry("stray", binFileName="../Ascend310P3/te_victim", binFileSuffix="")
    stray[0].write_text(
        json.dumps(cache.fields("stray") | {"binFileName": "../Ascend310P3/te_victim.o"})
    )
    backslash = cache.entry("backslash")
    (cache.chip / "a\\b.o").write_bytes(b"a file named with a backslash")
    backslash[0].write_text(json.dumps(cache.fields("backslash") | {"binFileName": "a\\b"}))
    set_access(stray + backslash, cache.now - 5 * HOUR)
    report = cann_json(capsys, base, "verify", "--fix")[1]["chips"][SOC]
    assert [u["name"] for u in report["unchecked"]] == [kernel_name("Add", "stray")]
    text = cann(capsys, base, "verify")[1]  # and a reader of the text is told, too
    assert "1 not checked (kept)" in text
    assert f"not checked: {kernel_name('Add', 'stray')}: " in text
    cache.age_all()
    cann(capsys, base, "age")
    assert victim.exists() and (cache.chip / "a\\b.o").exists()
    assert not stray[0].exists() and not backslash[0].exists()  # the jsons are aged


@pytest.mark.parametrize(
    "fields",
    [{"binFileName": 7}, {"jsonList": [{"name": "x"}]}, {"jsonList": "text"}],
    ids=["non-string binFileName", "jsonList item without jsonFileName", "jsonList a string"],
)
def test_an_entry_cann_s_code_throws_on_is_left_but_the_others_are_aged(base, capsys, fields):
    """Where nlohmann's ``get<std::string>`` or ``operator[]`` throws in
    ``GetFilesAccessTime``, CANN's whole aging pass ends and deletes nothing at all;
    opcache (deliberately) leaves just that entry and ages the others."""
    cache = Cache(base)
    odd = cache.entry("odd")
    odd[0].write_text(json.dumps(cache.fields("odd") | fields))
    set_access(odd, cache.now - 6 * HOUR)  # the oldest: CANN would stop at it
    plain = cache.entry("plain")
    cache.age_all()
    report = cann_json(capsys, base, "age")[1]["chips"][SOC]
    assert report["removed"] == [kernel_name("Add", "plain")]
    assert all(p.exists() for p in odd) and not any(p.exists() for p in plain)
    assert names(odd) <= present(cache.chip)


def test_subfolders_nested_deeper_than_python_s_recursion_crash_nothing(base, capsys):
    """te_file_utils.cc ``GetDirectorySize`` and ``CollectCacheJsonFileAccessTime`` recurse
    into any subfolder; opcache walks them with a stack of its own, so 1,500 levels
    (past Python's recursion limit) are read, not a RecursionError."""
    cache = Cache(base)
    cache.entry("one")
    depth = 1500
    made = 0
    fd = os.open(cache.chip, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while made < depth:
            os.mkdir("d", dir_fd=fd)
            made += 1
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.close(fd)
        fd = -1
        for action in ("stats", "verify", "age"):
            status, _, err = cann(capsys, base, action)
            assert status == 0 and "Traceback" not in err
        report = cann_json(capsys, base, "stats")[1]["chips"][SOC]
        assert report["files"] > 1  # deeper than the walk goes: not counted
    finally:
        # Removed here: pytest's recursive clean-up of old temp folders would fail on it.
        if fd >= 0:
            os.close(fd)
        for level in range(made, 0, -1):
            os.rmdir(cache.chip.joinpath(*["d"] * level))
