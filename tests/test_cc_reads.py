"""The cc back-end stores an object only when the key holds everything its compile read.

Real gcc and clang, real files: each case changes something the compile read
beside the request's sources (a header through a flag or a variable, the
assembler on PATH, a program gcc runs, a specs file) and shows that the next
compile is a fresh object, never the old one served as a hit.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from opcache import OpCache, OpRequest, resolve_settings
from opcache.compilers.cc import CcCompiler

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

FACTOR_C = b'#include "k.h"\nint factor(void) { return FACTOR; }\n'
BARE_C = b"int factor(void) { return FACTOR; }\n"
STDINT_C = b"#include <stdint.h>\nint64_t twice(int64_t x) { return 2 * x; }\n"
INT_C = b"int add(int a, int b) { return a + b; }\n"


def request(source: bytes, flags: list[str] | None = None, **sources: bytes) -> OpRequest:
    tensor = {"shape": [4], "dtype": "float32", "format": "ND"}
    return OpRequest(
        op_type="Factor",
        soc_version="Ascend910B1",
        op_name="factor_0",
        inputs=[tensor],
        outputs=[tensor],
        options={"flags": flags} if flags else {},
        sources={"k.c": source, **sources},
    )


def cache_at(tmp_path: Path, mode: str = "enable") -> OpCache:
    settings = resolve_settings(
        op_compiler_cache_mode=mode,
        op_compiler_cache_dir=str(tmp_path / "cache"),
        environ={"HOME": str(tmp_path)},
    )
    return OpCache(settings)


def obj(result) -> bytes:
    return next(path for name, path in result.files.items() if name.endswith(".o")).read_bytes()


def fresh(tmp_path: Path, req: OpRequest, compiler: CcCompiler) -> bytes:
    """The object a compile without the cache makes."""
    out = Path(tempfile.mkdtemp(dir=tmp_path))
    with cache_at(tmp_path, "disable") as cache:
        return obj(cache.compile(req, compiler, out))


def cc(name: str = "gcc", **env: str) -> CcCompiler:
    return CcCompiler(environ={"CC": name, "PATH": "/usr/bin:/bin", **env})


def header(folder: Path, factor: int) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "k.h").write_text(f"#define FACTOR {factor}\n")
    return folder / "k.h"


@pytest.mark.parametrize(
    ("source", "flags"),
    [
        (FACTOR_C, lambda inc: ["-I", str(inc)]),
        (BARE_C, lambda inc: ["-include", str(inc / "k.h")]),
        (BARE_C, lambda inc: ["-imacros", str(inc / "k.h")]),
        (FACTOR_C, lambda inc: [f"-iquote{inc}"]),
    ],
    ids=["-I", "-include", "-imacros", "-iquote"],
)
def test_a_header_a_flag_makes_it_read_is_never_served_stale(tmp_path, source, flags):
    inc = tmp_path / "inc"
    header(inc, 1)
    compiler = cc()
    req = request(source, flags(inc))
    with cache_at(tmp_path) as cache:
        first = cache.compile(req, compiler, tmp_path / "a")
        header(inc, 12345)
        second = cache.compile(req, compiler, tmp_path / "b")
        stats = cache.stats()
    assert first.status == second.status == "miss"
    said = f"it read {inc / 'k.h'}, no source of the request nor a system header (not keyed)"
    assert first.reason == f"not stored: cc: {said}"
    assert obj(second) == fresh(tmp_path, req, compiler) != obj(first)
    assert stats["stores"] == 0, stats


def test_a_header_of_CPATH_is_never_served_stale(tmp_path):
    inc = tmp_path / "inc"
    header(inc, 1)
    env = {"CPATH": str(inc)}
    req = request(FACTOR_C)
    with cache_at(tmp_path) as cache:
        first = cache.compile(req, cc(**env), tmp_path / "a")
        header(inc, 2)
        second = cache.compile(req, cc(**env), tmp_path / "b")
    assert first.status == second.status == "miss"
    assert obj(second) == fresh(tmp_path, req, cc(**env)) != obj(first)


def test_a_relative_include_reaches_nothing_of_tmpdir_and_is_not_stored(tmp_path, monkeypatch):
    """The sources lie one level down in a private folder: `../k.h` is opcache's
    own folder (nothing there), and `../../k.h`, $TMPDIR's, is read but not stored."""
    tmpdir = tmp_path / "tmp"
    header(tmpdir, 1)
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    compiler = cc()
    with cache_at(tmp_path) as cache:
        with pytest.raises(Exception, match=r"k\.h: No such file"):
            cache.compile(request(b'#include "../k.h"\n' + BARE_C), compiler, tmp_path / "a")
        req = request(b'#include "../../k.h"\n' + BARE_C)
        first = cache.compile(req, compiler, tmp_path / "b")
        header(tmpdir, 777)
        second = cache.compile(req, compiler, tmp_path / "c")
        stats = cache.stats()
    assert first.status == second.status == "miss"
    assert str(tmpdir / "k.h") in first.reason
    assert obj(second) != obj(first)
    assert stats["stores"] == 0, stats


@pytest.mark.parametrize("name", ["gcc", "clang"])
def test_a_kernel_of_system_headers_hits_with_the_object_a_compile_makes(tmp_path, name):
    if shutil.which(name) is None:
        pytest.skip(f"needs {name}")
    compiler = cc(name)
    req = request(STDINT_C)
    with cache_at(tmp_path) as cache:
        first = cache.compile(req, compiler, tmp_path / "a")
        second = cache.compile(req, cc(name), tmp_path / "b")
    assert (first.status, first.reason, second.status) == ("miss", None, "hit")
    assert sorted(second.files) == sorted(first.files)  # the object and its json: no list
    assert len(second.files) == 2
    # The dependency list the compile writes changes nothing in the object.
    flags = compiler._flags(req)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "k.c").write_bytes(STDINT_C)
    subprocess.run([name, *flags, "-c", "k.c", "-o", "k.o"], cwd=tmp_path / "plain", check=True)
    assert (tmp_path / "plain" / "k.o").read_bytes() == obj(first) == obj(second)


def assembler(folder: Path, mark: int) -> None:
    folder.mkdir(exist_ok=True)
    real = shutil.which("as")
    script = folder / "as"
    script.write_text(f'#!/bin/sh\nexec {real} --defsym MARK={mark} "$@"\n')
    script.chmod(0o755)


def test_another_assembler_on_PATH_is_another_key(tmp_path):
    """gcc runs the `as` PATH finds (`gcc -print-prog-name=as` says a bare `as`)."""
    said = subprocess.run(["gcc", "-print-prog-name=as"], capture_output=True, text=True)
    if said.stdout.strip() != "as":
        pytest.skip("this gcc has an assembler of its own")
    bin_ = tmp_path / "bin"
    assembler(bin_, 1)
    other = f"{bin_}:/usr/bin:/bin"
    req = request(INT_C)
    with cache_at(tmp_path) as cache:
        first = cache.compile(req, cc(), tmp_path / "a")
        second = cache.compile(req, cc(PATH=other), tmp_path / "b")
    assert (first.status, second.status) == ("miss", "miss")
    assert obj(second) == fresh(tmp_path, req, cc(PATH=other)) != obj(first)


def test_an_assembler_put_on_PATH_under_a_live_compiler_is_not_stored(tmp_path):
    said = subprocess.run(["gcc", "-print-prog-name=as"], capture_output=True, text=True)
    if said.stdout.strip() != "as":
        pytest.skip("this gcc has an assembler of its own")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    compiler = cc(PATH=f"{bin_}:/usr/bin:/bin")
    with cache_at(tmp_path) as cache:
        assert cache.compile(request(INT_C), compiler, tmp_path / "a").status == "miss"
        assembler(bin_, 1)  # after the fingerprint was taken
        late = cache.compile(request(STDINT_C), compiler, tmp_path / "b")
        stats = cache.stats()
    assert late.status == "miss"
    assert (
        late.reason
        == "not stored: cc: the as the compiler runs changed since its fingerprint was taken"
    )
    assert stats["stores"] == 1, stats


def test_programs_of_COMPILER_PATH_are_not_keyed_and_not_stored(tmp_path):
    cc1 = subprocess.run(["gcc", "-print-prog-name=cc1"], capture_output=True, text=True)
    cc1 = cc1.stdout.strip()
    folder = tmp_path / "programs"
    folder.mkdir()

    def wrapper(n: int) -> None:
        (folder / "cc1").write_text(f'#!/bin/sh\nexec {cc1} -DFACTOR={n} "$@"\n')
        (folder / "cc1").chmod(0o755)

    env = {"COMPILER_PATH": str(folder)}
    req = request(BARE_C)
    wrapper(1)
    with cache_at(tmp_path) as cache:
        first = cache.compile(req, cc(**env), tmp_path / "a")
        wrapper(2)
        second = cache.compile(req, cc(**env), tmp_path / "b")
    assert (first.status, second.status) == ("miss", "miss")
    assert "COMPILER_PATH is set" in first.reason
    assert obj(second) == fresh(tmp_path, req, cc(**env)) != obj(first)


def test_a_specs_file_in_LIBRARY_PATH_is_never_served_stale(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    env = {"LIBRARY_PATH": str(lib)}
    source = b"int v(void) {\n#ifdef FROM_SPECS\nreturn FROM_SPECS;\n#endif\nreturn 0;\n}\n"
    req = request(source)
    with cache_at(tmp_path) as cache:
        first = cache.compile(req, cc(**env), tmp_path / "a")
        (lib / "specs").write_text("*cpp:\n+ -DFROM_SPECS=42\n\n")
        second = cache.compile(req, cc(**env), tmp_path / "b")
    assert (first.status, first.reason, second.status) == ("miss", None, "miss")
    assert (
        second.reason == f"not stored: cc: gcc may read the specs file {lib / 'specs'} (not keyed)"
    )
    assert obj(second) == fresh(tmp_path, req, cc(**env)) != obj(first)


@pytest.mark.parametrize(
    "flags",
    [
        lambda d: [f"-B{d}"],
        lambda d: [f"-specs={d / 'empty.specs'}"],
        lambda d: ["--sysroot=/"],
        lambda d: [f"@{d / 'rsp'}"],
        lambda d: [f"-fprofile-use={d / 'p.gcda'}"],
        lambda d: ["-wrapper", "/usr/bin/env"],
        lambda d: ["-MD"],
    ],
    ids=["-B", "-specs", "--sysroot", "@file", "-fprofile-use", "-wrapper", "-MD"],
)
def test_flags_that_read_what_no_key_holds_are_not_stored(tmp_path, flags):
    (tmp_path / "empty.specs").write_text("")
    (tmp_path / "rsp").write_text("-O1\n")
    with cache_at(tmp_path) as cache:
        result = cache.compile(request(INT_C, flags(tmp_path)), cc(), tmp_path / "a")
        stats = cache.stats()
    assert result.status == "miss" and result.reason.startswith("not stored: cc: "), result
    assert stats["stores"] == 0, stats


def test_an_incbin_directive_is_not_stored(tmp_path):
    data = tmp_path / "blob.bin"
    data.write_bytes(b"one")
    source = f'__asm__(".section .rodata\\n.incbin \\"{data}\\"\\n.text");\n'.encode() + INT_C
    with cache_at(tmp_path) as cache:
        result = cache.compile(request(source), cc(), tmp_path / "a")
    assert (
        result.reason
        == "not stored: cc: a .incbin directive in k.c reads a file the key does not hold"
    )


def test_a_system_header_renamed_in_under_a_live_compiler_gives_a_new_key(tmp_path):
    """A header of the compiler's own include folders replaced as a package upgrade
    replaces it (a new file renamed over it): the same compiler object, long-lived,
    gives a new key and the object a compile makes now (it hit the old one)."""
    system = tmp_path / "system"
    system.mkdir()
    wrapper = tmp_path / "mycc"
    wrapper.write_text(f'#!/bin/sh\nexec gcc -isystem {system} "$@"\n')
    wrapper.chmod(0o755)

    def upgrade(factor: int) -> None:
        (system / "ver.h.new").write_text(f"#define FACTOR {factor}\n")
        (system / "ver.h.new").rename(system / "ver.h")

    upgrade(1)
    req = request(b"#include <ver.h>\nint factor(void) { return FACTOR; }\n")
    compiler = cc(str(wrapper))
    with cache_at(tmp_path) as cache:
        first = cache.compile(req, compiler, tmp_path / "a")
        assert cache.compile(req, compiler, tmp_path / "b").status == "hit"
        upgrade(2)
        later = cache.compile(req, compiler, tmp_path / "c")
    assert (first.status, later.status) == ("miss", "miss")
    assert obj(later) == fresh(tmp_path, req, cc(str(wrapper))) != obj(first)


def test_a_system_header_edited_in_place_in_a_subfolder_is_never_served_stale(tmp_path):
    """A header one folder below the compiler's include folders (as bits/ is), rewritten
    in place (no rename: no folder's times move): the same long-lived compiler object,
    and a new cache in another process's place, both get the object a compile makes
    now, never the old one; the entry is counted stale once and replaced."""
    system = tmp_path / "system"
    (system / "bits").mkdir(parents=True)
    (system / "ver.h").write_text("#include <bits/factor.h>\n")
    factor = system / "bits" / "factor.h"
    factor.write_text("#define FACTOR 1\n")
    wrapper = tmp_path / "mycc"
    wrapper.write_text(f'#!/bin/sh\nexec gcc -isystem {system} "$@"\n')
    wrapper.chmod(0o755)
    req = request(b"#include <ver.h>\nint factor(void) { return FACTOR; }\n")
    compiler = cc(str(wrapper))
    with cache_at(tmp_path) as cache:
        first = cache.compile(req, compiler, tmp_path / "a")
        assert cache.compile(req, compiler, tmp_path / "b").status == "hit"
        with open(factor, "r+") as f:  # (the same size: only the contents and times move)
            f.write("#define FACTOR 2\n")
        time.sleep(0.05)  # (a header written as a compile starts leaves it unstored)
        later = cache.compile(req, compiler, tmp_path / "c")
        again = cache.compile(req, compiler, tmp_path / "d")
    with cache_at(tmp_path) as other:  # (a new compiler object: another process's)
        third = other.compile(req, cc(str(wrapper)), tmp_path / "e")
        report = other.stats()
    assert [r.status for r in (first, later, again, third)] == ["miss", "miss", "hit", "hit"]
    assert obj(later) == obj(third) == fresh(tmp_path, req, cc(str(wrapper))) != obj(first)
    assert report["stale"] == 1


def test_an_entry_whose_headers_differ_on_this_machine_is_not_served_from_the_remote(tmp_path):
    """Machines share a remote (a folder); the second's system header (at the same
    path) differs: the first's entry is not served there (counted stale), and the
    second's own compile is stored over it, which a third machine like it hits."""
    system = tmp_path / "system"
    system.mkdir()
    (system / "ver.h").write_text("#define FACTOR 1\n")
    wrapper = tmp_path / "mycc"
    wrapper.write_text(f'#!/bin/sh\nexec gcc -isystem {system} "$@"\n')
    wrapper.chmod(0o755)
    req = request(b"#include <ver.h>\nint factor(void) { return FACTOR; }\n")
    (tmp_path / "remote").mkdir()

    def machine(name: str) -> OpCache:
        settings = resolve_settings(
            op_compiler_cache_mode="enable",
            op_compiler_cache_dir=str(tmp_path / name / "cache"),
            remote=(tmp_path / "remote").as_uri(),
            environ={"HOME": str(tmp_path / name)},
        )
        return OpCache(settings)

    with machine("m1") as one:
        first = one.compile(req, cc(str(wrapper)), tmp_path / "a")
    with open(system / "ver.h", "r+") as f:  # (machine m2's header: the same path, other bytes)
        f.write("#define FACTOR 2\n")
    time.sleep(0.05)  # (a header written as a compile starts leaves it unstored)
    with machine("m2") as two:
        second = two.compile(req, cc(str(wrapper)), tmp_path / "b")
        report = two.stats()
    with machine("m3") as three:  # (a third machine, with m2's header: m2's entry)
        third = three.compile(req, cc(str(wrapper)), tmp_path / "c")
    assert [r.status for r in (first, second, third)] == ["miss", "miss", "hit"]
    assert third.tier == "remote"
    assert obj(second) == obj(third) == fresh(tmp_path, req, cc(str(wrapper))) != obj(first)
    assert report["stale"] == 1


def test_a_system_header_reached_through_the_private_folder_hits(tmp_path, monkeypatch):
    """`#include "../../<...>/usr/include/limits.h"`: a system header named through the
    private folder the compile ran in (gone after it) is kept by its real folder,
    so the entry hits, never found stale at every look."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t"))
    (tmp_path / "t").mkdir()
    ups = len((tmp_path / "t").parts) + 1  # (<tempdir>/opcache-cc-*/src, up to /)
    source = f'#include "{"../" * ups}usr/include/limits.h"\nint most(void) {{ return INT_MAX; }}\n'
    req = request(source.encode())
    compiler = cc()
    with cache_at(tmp_path) as cache:
        results = [cache.compile(req, compiler, tmp_path / o) for o in "abc"]
        report = cache.stats()
    assert [r.status for r in results] == ["miss", "hit", "hit"]
    assert report["stale"] == 0
