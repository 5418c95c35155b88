"""opcache cann export / import and opcache export / import: one archive file, checked on import.

For air-gapped sites and container images: an archive written on one
machine fills another's cache; a damaged or hostile archive writes nothing.
"""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from helpers_cache import ToyCompiler, make_request, make_settings
from helpers_cann import SOC, kernel_name, set_access, store_entry, store_mix_entry, write_ini

import opcache
from opcache import archive, cann_transfer
from opcache.cann_cache import CannCache, read_limits

NOW = time.time()


def _env(tmp_path: Path) -> dict[str, str]:
    driver = tmp_path / "driver"
    driver.mkdir(exist_ok=True)
    if not (driver / "version.info").exists():  # (installed once: entries written after it count)
        (driver / "version.info").write_text("Version=24.1.rc2\n")
    return {"ASCEND_DRIVER_PATH": str(driver), "HOME": str(tmp_path)}


def _cann_folder(base: Path, count: int = 3) -> list[str]:
    root = base / "kernel_cache"
    write_ini(root)
    kernels = []
    for i in range(count):
        kernel = kernel_name("Add", f"x{i}")
        set_access(store_entry(root / SOC, kernel, os.urandom(2000)), NOW - 3600 - i)
        kernels.append(kernel)
    store_mix_entry(root / SOC, kernel_name("MatMul", "mix"), b"aic", b"aiv")
    return kernels


def _settings(base: Path):  # type: ignore[no-untyped-def]
    return opcache.resolve_settings(op_compiler_cache_dir=str(base))


def _export(tmp_path: Path, name: str = "cache.tar") -> Path:
    a = tmp_path / "a"
    env = _env(tmp_path)
    _cann_folder(a)
    path = tmp_path / name
    report = cann_transfer.export_archive(path, SOC, settings=_settings(a), environ=env)
    assert report["chips"][SOC]["entries"] == 4
    return path


def _import(tmp_path: Path, path: Path) -> dict:
    b = tmp_path / "b"
    write_ini(b / "kernel_cache")
    return cann_transfer.import_archive(path, settings=_settings(b), environ=_env(tmp_path))


def _files(chip: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in chip.iterdir() if not p.name.endswith(".lock")}


@pytest.mark.parametrize("name", ["cache.tar", "cache.tar.gz"])
def test_a_cann_archive_fills_another_folder_byte_identical(tmp_path, name):
    path = _export(tmp_path, name)
    report = _import(tmp_path, path)["chips"][SOC]
    assert (report["written"], report["rejected"]) == (4, [])
    a_chip, b_chip = tmp_path / "a/kernel_cache" / SOC, tmp_path / "b/kernel_cache" / SOC
    assert _files(b_chip) == _files(a_chip)
    cann = CannCache(b_chip.parent, read_limits(b_chip.parent, {}))
    assert cann.verify(SOC)["chips"][SOC]["faults"] == []
    assert _import(tmp_path, path)["chips"][SOC]["present"] == 4  # never over an entry


def test_an_archive_of_two_chips_fills_both(tmp_path):
    """Each chip's aging lock is held while its entries go in, all at once: the second
    one let go found the first one's parked lock files gone (a TypeError traceback,
    the report lost, exit 1)."""
    a = tmp_path / "a"
    env = _env(tmp_path)
    _cann_folder(a)
    other = "Ascend310P3"
    for i in range(2):
        store_entry(a / "kernel_cache" / other, kernel_name("Mul", f"y{i}"), os.urandom(500))
    path = tmp_path / "both.tar"
    cann_transfer.export_archive(path, None, settings=_settings(a), environ=env)
    report = _import(tmp_path, path)["chips"]
    assert (report[SOC]["written"], report[other]["written"]) == (4, 2)


def test_an_archive_of_other_versions_is_refused(tmp_path):
    path = _export(tmp_path)
    b = tmp_path / "b" / "kernel_cache"
    b.mkdir(parents=True)
    (b / "op_cache.ini").write_text("[op_compiler_cache]\nadk_version=8.0\nops_version=8.0\n")
    report = cann_transfer.import_archive(
        path, settings=_settings(tmp_path / "b"), environ=_env(tmp_path)
    )
    assert "other versions" in report["chips"][SOC]["refused"]
    assert not (b / SOC).exists()


def _cut(path: Path, keep: int) -> Path:
    data = path.read_bytes()
    out = path.with_name("cut-" + path.name)
    out.write_bytes(data[:keep])
    return out


@pytest.mark.parametrize("name", ["cache.tar", "cache.tar.gz"])
@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9])
def test_a_truncated_archive_is_refused_and_nothing_written(tmp_path, name, fraction):
    path = _export(tmp_path, name)
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    # Cut into the members' bytes: a tar's zero padding after them is no loss.
    end = path.stat().st_size if name.endswith(".gz") else last.offset_data + last.size
    cut = _cut(path, int(end * fraction))
    with pytest.raises(archive.BadArchive, match=r"truncated|not a whole"):
        _import(tmp_path, cut)
    assert not (tmp_path / "b/kernel_cache" / SOC).exists()


def test_an_archive_cut_at_a_member_boundary_is_refused(tmp_path):
    """A tar cut right after a whole member reads as a shorter tar: the trailer tells."""
    path = _export(tmp_path)
    with tarfile.open(path) as tar:
        first = tar.getmembers()[1]
    cut = _cut(path, first.offset_data + ((first.size + 511) // 512) * 512)
    with pytest.raises(archive.BadArchive, match="truncated"):
        _import(tmp_path, cut)


def _hostile(tmp_path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    """A good archive with ``member`` added before its trailer."""
    good = _export(tmp_path)
    out = tmp_path / "hostile.tar"
    with tarfile.open(good) as src, tarfile.open(out, "w") as dst:
        for info in src.getmembers():
            if info.name == archive.TRAILER:
                dst.addfile(member, io.BytesIO(data))
            dst.addfile(info, src.extractfile(info))
    return out


@pytest.mark.parametrize(
    "name", ["cann/../../evil", f"cann/{SOC}/../x", "/etc/passwd", f"cann/{SOC}/sub/x", "x"]
)
def test_an_archive_with_a_bad_name_is_refused(tmp_path, name):
    info = tarfile.TarInfo(name)
    info.size = 3
    path = _hostile(tmp_path, info, b"abc")
    with pytest.raises(archive.BadArchive, match="refusing"):
        _import(tmp_path, path)
    assert not (tmp_path / "b/kernel_cache" / SOC).exists()
    assert not (tmp_path / "evil").exists()


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE])
def test_an_archive_with_a_link_or_folder_is_refused(tmp_path, kind):
    info = tarfile.TarInfo(f"cann/{SOC}/te_add_link")
    info.type = kind
    info.linkname = "/etc/passwd"
    path = _hostile(tmp_path, info)
    with pytest.raises(archive.BadArchive, match=r"link|regular"):
        _import(tmp_path, path)
    assert not (tmp_path / "b/kernel_cache" / SOC).exists()


def test_a_damaged_entry_in_an_archive_is_refused(tmp_path):
    path = _export(tmp_path)
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as tar:
        member = tar.getmembers()[0]
    data[member.offset_data + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(archive.BadArchive, match=r"damaged|checksum"):
        _import(tmp_path, path)
    assert not (tmp_path / "b/kernel_cache" / SOC).exists()


def test_a_fifo_in_place_of_the_archive_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "cache.tar"
    os.mkfifo(fifo)
    with pytest.raises(archive.BadArchive, match="not a regular file"):
        _import(tmp_path, fifo)


def test_opcache_own_cache_exports_and_imports(tmp_path):
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(i) for i in range(3)]
    with opcache.OpCache(make_settings(tmp_path / "one", tmp_path)) as cache:
        for request in requests:
            cache.compile(request, compiler, tmp_path / "out")
    path = tmp_path / "seed.tar.gz"
    report = archive.export_cache(make_settings(tmp_path / "one", tmp_path), path)
    assert (report["entries"], report["skipped"]) == (3, [])

    other = make_settings(tmp_path / "two", tmp_path)
    imported = archive.import_cache(other, path)
    assert (imported["imported"], imported["errors"]) == (3, [])
    with opcache.OpCache(other) as cache:
        for request in requests:
            assert cache.compile(request, compiler, tmp_path / "out2").status == "hit"
    assert compiler.calls() == 3  # the second cache compiled nothing
    assert archive.import_cache(other, path)["present"] == 3


@pytest.mark.parametrize("name", ["..x", "....", "_size", "ZZ", "0" * 31 + "g"])
def test_an_opcache_archive_entry_not_named_by_a_key_is_refused(tmp_path, name):
    """A member named ``..x`` packed as a real value of key ``..x`` (its manifest
    says so) would be stored in the bucket ``..``, the cache's root: refused."""
    from opcache.storage.entry import make_manifest
    from opcache.storage.value import pack

    files = {"k.o": b"kernel"}
    value = pack(name, make_manifest(name, files, 1.0, {}, 0.0), files)
    path = tmp_path / "evil.tar"
    with tarfile.open(path, "w") as tar:
        for member, data in (
            (f"opcache/{SOC}/{name}", value),
            (archive.TRAILER, json.dumps({"format": 1, "kind": "opcache", "entries": 1}).encode()),
        ):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    settings = make_settings(tmp_path / "ops", tmp_path)
    with pytest.raises(archive.BadArchive, match="by its key"):
        archive.import_cache(settings, path)
    assert not settings.root.exists() or not any(settings.root.rglob("k.o"))


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME])
def test_an_extended_tar_header_declaring_megabytes_is_refused_on_its_size(tmp_path, kind):
    """tarfile reads a PAX or GNU long-name header whole before any member is seen: one
    declaring 64 MB (gigabytes in a few MB of gzip) is refused on its size, not read."""
    import gzip
    import tracemalloc

    info = tarfile.TarInfo("././@LongLink" if kind == tarfile.GNUTYPE_LONGNAME else "pax")
    info.type, info.size = kind, 64 << 20
    path = tmp_path / "bomb.tar.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(info.tobuf(tarfile.USTAR_FORMAT))
        for _ in range(64):
            f.write(bytes(1 << 20))
    for kind_of in (archive.OPCACHE, archive.CANN):
        tracemalloc.start()
        try:
            with pytest.raises(archive.BadArchive, match="extended tar header"):
                archive.ArchiveReader(path, kind_of).check()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20


def test_a_cann_archive_is_not_an_opcache_archive(tmp_path):
    path = _export(tmp_path)
    with pytest.raises(archive.BadArchive, match="is not opcache/"):
        archive.import_cache(make_settings(tmp_path / "two", tmp_path), path)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "opcache", *args]
    return subprocess.run(
        argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_the_command_line_exports_imports_and_refuses_a_bad_archive(tmp_path):
    env = _env(tmp_path)
    _cann_folder(tmp_path / "a")
    path = tmp_path / "out.tar"
    a, b = (
        ["--op_compiler_cache_dir", str(tmp_path / "a")],
        ["--op_compiler_cache_dir", str(tmp_path / "b")],
    )
    done = _cli("cann", "export", str(path), *a, "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["chips"][SOC]["entries"] == 4
    write_ini(tmp_path / "b" / "kernel_cache")
    done = _cli("cann", "import", str(path), *b, env=env)
    assert done.returncode == 0, done.stderr
    assert "4 entries written" in done.stdout
    cut = _cut(path, path.stat().st_size // 2)
    done = _cli("cann", "import", str(cut), *b, env=env)
    assert done.returncode == 3
    assert done.stderr.startswith("opcache: error:") and done.stderr.count("\n") == 1
    done = _cli("cann", "import", *b, env=env)
    assert done.returncode == 2 and "FILE is missing" in done.stderr


def test_the_command_line_exports_and_imports_opcache_own_cache(tmp_path):
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(make_settings(tmp_path / "one", tmp_path)) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "out")
    path = tmp_path / "seed.tar"
    env = {"HOME": str(tmp_path)}
    done = _cli("export", str(path), "--op_compiler_cache_dir", str(tmp_path / "one"), env=env)
    assert done.returncode == 0, done.stderr
    two = ["--op_compiler_cache_dir", str(tmp_path / "two")]
    done = _cli("import", str(path), "--dry-run", "--json", *two, env=env)
    assert (done.returncode, json.loads(done.stdout)["would_import"]) == (0, 1), done.stderr
    done = _cli("import", str(path), "--json", *two, env=env)
    assert (done.returncode, json.loads(done.stdout)["imported"]) == (0, 1), done.stderr
    done = _cli("import", str(tmp_path / "missing.tar"), *two, env=env)
    assert done.returncode == 4 and done.stderr.startswith("opcache: error:")


def test_an_archive_named_through_a_link_is_read(tmp_path):
    path = _export(tmp_path)
    link = tmp_path / "link.tar"
    link.symlink_to(path)
    assert _import(tmp_path, link)["chips"][SOC]["written"] == 4


def test_an_imported_archive_serves_as_a_read_only_seed_tier(tmp_path):
    """ccache #1755's read-only fallback cache: an archive imported into a folder (an
    image's layer), named as a read-only file:// tier, fills a fresh cache on hits."""
    compiler = ToyCompiler(tmp_path / "calls")
    requests = [make_request(i) for i in range(2)]
    with opcache.OpCache(make_settings(tmp_path / "ci", tmp_path)) as cache:
        for request in requests:
            cache.compile(request, compiler, tmp_path / "out")
    archive.export_cache(make_settings(tmp_path / "ci", tmp_path), tmp_path / "seed.tar")
    archive.import_cache(make_settings(tmp_path / "seed", tmp_path), tmp_path / "seed.tar")
    seed = f"file://{tmp_path / 'seed' / 'kernel_cache'}?read_only=true"
    job = make_settings(tmp_path / "job", tmp_path, remote=seed)
    with opcache.OpCache(job) as cache:
        results = [cache.compile(r, compiler, tmp_path / "out-job") for r in requests]
    assert [(r.status, r.tier) for r in results] == [("hit", "remote")] * 2
    assert compiler.calls() == 2  # only the first cache compiled


# -- review 2: the archive read once, members capped, reserved names, recorded times --------


def _other_versions_export(tmp_path: Path, path: Path) -> str:
    """An export of a folder of adk/ops 8.0.0 (one entry) at ``path``; its kernel."""
    c = tmp_path / "c"
    root = c / "kernel_cache"
    root.mkdir(parents=True)
    (root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nadk_version=8.0.0\nops_version=8.0.0\n"
    )
    kernel = kernel_name("Add", "other toolkit")
    store_entry(root / SOC, kernel, os.urandom(500))
    cann_transfer.export_archive(path, SOC, settings=_settings(c), environ=_env(tmp_path))
    return kernel


def _rename_over_on_call(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, other: Path, path: Path
) -> None:
    """The first call of ``owner.name`` (the import calls it between its check and its
    writes) first renames ``other`` over ``path``, as another process might."""
    real = getattr(owner, name)

    def swapping(*args, **kw):  # type: ignore[no-untyped-def]
        if other.exists():
            os.replace(other, path)
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, swapping)


def test_an_archive_renamed_over_after_its_check_is_imported_as_checked(tmp_path, monkeypatch):
    """Another process renames a new export (of another toolkit) over the file while the
    import runs: only the file that was checked is written, never the other's entries."""
    path = _export(tmp_path)
    other = tmp_path / "other.tar"
    foreign = _other_versions_export(tmp_path, other)
    _rename_over_on_call(monkeypatch, cann_transfer, "local_namespace", other, path)
    report = _import(tmp_path, path)["chips"][SOC]
    assert not other.exists()  # the swap happened
    b_chip = tmp_path / "b/kernel_cache" / SOC
    assert f"{foreign}.json" not in os.listdir(b_chip)
    assert (report["written"], report["rejected"]) == (4, [])
    assert _files(b_chip) == _files(tmp_path / "a/kernel_cache" / SOC)


@pytest.mark.parametrize("change", ["rewritten", "cut"])
def test_an_archive_changed_in_place_after_its_check_writes_nothing(tmp_path, monkeypatch, change):
    """The same file rewritten (a shared or NFS path) or cut short after the check: the
    import refuses it before writing a single entry."""
    path = _export(tmp_path)
    other = tmp_path / "other.tar"
    _other_versions_export(tmp_path, other)
    new = other.read_bytes() if change == "rewritten" else path.read_bytes()[: -(10 << 10)]
    real = cann_transfer.local_namespace

    def changing(*args, **kw):  # type: ignore[no-untyped-def]
        with open(path, "r+b") as f:
            f.write(new)
            f.truncate()
        return real(*args, **kw)

    monkeypatch.setattr(cann_transfer, "local_namespace", changing)
    with pytest.raises(archive.BadArchive, match="changed"):
        _import(tmp_path, path)
    chip = tmp_path / "b/kernel_cache" / SOC
    assert not chip.exists() or not [n for n in os.listdir(chip) if n.endswith(".json")]


def test_opcache_import_of_an_archive_renamed_over_stores_what_was_checked(tmp_path, monkeypatch):
    compiler = ToyCompiler(tmp_path / "calls")
    with opcache.OpCache(make_settings(tmp_path / "one", tmp_path)) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "out")
    with opcache.OpCache(make_settings(tmp_path / "three", tmp_path)) as cache:
        cache.compile(make_request(1), compiler, tmp_path / "out")
    path, other = tmp_path / "seed.tar", tmp_path / "other.tar"
    archive.export_cache(make_settings(tmp_path / "one", tmp_path), path)
    archive.export_cache(make_settings(tmp_path / "three", tmp_path), other)
    from opcache.storage import local

    _rename_over_on_call(monkeypatch, local, "LocalStore", other, path)
    two = make_settings(tmp_path / "two", tmp_path)
    assert archive.import_cache(two, path)["imported"] == 1
    monkeypatch.undo()
    with opcache.OpCache(two) as cache:
        assert cache.compile(make_request(0), compiler, tmp_path / "o2").status == "hit"
        assert cache.compile(make_request(1), compiler, tmp_path / "o2").status == "miss"


def _zeros_member_archive(path: Path, size: int) -> None:
    """A .tar.gz of one member of ``size`` zero bytes (a few hundred KiB on disk)."""

    class Zeros(io.RawIOBase):
        def __init__(self, n: int) -> None:
            self.n = n

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
            k = min(len(b), self.n)
            b[:k] = bytes(k)
            self.n -= k
            return k

    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo(f"cann/{SOC}/" + kernel_name("Add", "bomb"))
        info.size = size
        tar.addfile(info, io.BufferedReader(Zeros(size)))


def test_a_member_bigger_than_any_entry_is_refused_from_its_header(tmp_path):
    """A small .tar.gz whose member inflates past the largest entry an archive carries is
    refused on its declared size, before any of it is read into memory."""
    path = tmp_path / "bomb.tar.gz"
    _zeros_member_archive(path, 100 << 20)  # (the review's bomb: 300 MiB cost 633 MiB)
    assert path.stat().st_size < 1 << 20
    with pytest.raises(archive.BadArchive, match="too big"):
        _import(tmp_path, path)


def test_a_member_that_is_not_an_entry_is_refused_from_its_first_bytes(tmp_path):
    path = tmp_path / "zeros.tar.gz"
    _zeros_member_archive(path, 10 << 20)
    with pytest.raises(archive.BadArchive, match="not an opcache value"):
        _import(tmp_path, path)


def _archive_of(tmp_path: Path, bundles: list[cann_transfer.Bundle]) -> Path:
    """An archive of ``bundles`` as ``export_archive`` writes them (in this order)."""
    a = tmp_path / "a" / "kernel_cache"
    write_ini(a)
    ns, _ = cann_transfer.local_namespace(a, SOC, _env(tmp_path), None, taking=False)
    path = tmp_path / "made.tar"
    with archive.ArchiveWriter(path, archive.CANN) as out:
        for b in bundles:
            out.add(SOC, b.kernel, cann_transfer._manifest(ns, b), b.files, NOW)
    return path


def _bundle(tmp_path: Path, kernel: str, atime: int) -> cann_transfer.Bundle:
    chip = tmp_path / "src" / SOC
    paths = store_entry(chip, kernel, os.urandom(300))
    return cann_transfer.Bundle(kernel, atime, {p.name: p.read_bytes() for p in paths})


@pytest.mark.parametrize("atime", [10**19, 10**13, -5])
def test_an_entry_recorded_as_used_in_the_future_is_written_as_used_now(tmp_path, atime):
    """A bad recorded access time neither aborts the import (10**19 overflowed utime)
    nor pins the entry against CANN's aging (10**13: the year 2446)."""
    kernels = [kernel_name("Add", f"t{i}") for i in range(3)]
    bundles = [_bundle(tmp_path, k, int(NOW) - 60) for k in kernels]
    bundles[1] = cann_transfer.Bundle(kernels[1], atime, bundles[1].files)
    path = _archive_of(tmp_path, bundles)
    before = time.time()
    report = _import(tmp_path, path)["chips"][SOC]
    assert (report["written"], report["rejected"]) == (3, [])
    chip = tmp_path / "b/kernel_cache" / SOC
    assert all(os.stat(chip / f"{k}.json").st_atime <= time.time() + 1 for k in kernels)
    if atime > 0:
        assert os.stat(chip / f"{kernels[1]}.o").st_atime >= before - 1


def test_a_kernel_named_as_cann_aging_lock_is_refused_and_the_lock_stays_held(
    tmp_path, monkeypatch
):
    """An entry named op_cache_file_del: its lock would be CANN's aging lock the import
    holds, and closing it would free that lock for the rest of the import."""
    kernels = ["op_cache_file_del", *(kernel_name("Add", f"d{i}") for i in range(2))]
    path = _archive_of(tmp_path, [_bundle(tmp_path, k, int(NOW)) for k in kernels])
    lock = tmp_path / "b/kernel_cache" / SOC / "op_cache_file_del.lock"
    seen = _aging_lock_after_each_write(monkeypatch, lock)
    report = _import(tmp_path, path)["chips"][SOC]
    assert seen == [True] * 3
    assert report["written"] == 2
    [(rejected)] = report["rejected"]
    assert rejected["entry"] == "op_cache_file_del" and "aging lock" in rejected["why"]
    assert not (lock.parent / "op_cache_file_del.json").exists()


def test_an_entry_lock_linked_to_the_aging_lock_is_never_taken(tmp_path, monkeypatch):
    """A planted hard link <kernel>.lock -> op_cache_file_del.lock: that entry is skipped,
    and the aging lock stays held for the rest of the import."""
    kernels = [kernel_name("Add", f"h{i}") for i in range(3)]
    path = _archive_of(
        tmp_path, [_bundle(tmp_path, k, int(NOW) - i) for i, k in enumerate(kernels)]
    )
    chip = tmp_path / "b/kernel_cache" / SOC
    chip.mkdir(parents=True)
    lock = chip / "op_cache_file_del.lock"
    lock.touch()
    os.link(lock, chip / f"{kernels[0]}.lock")
    seen = _aging_lock_after_each_write(monkeypatch, lock)
    report = _import(tmp_path, path)["chips"][SOC]
    assert seen == [True] * 3
    assert report["written"] == 2
    assert not (chip / f"{kernels[0]}.json").exists()


def _aging_lock_after_each_write(monkeypatch: pytest.MonkeyPatch, lock: Path) -> list[bool]:
    """Fills, as the import writes each entry, whether another process finds ``lock`` held."""
    seen: list[bool] = []
    real = cann_transfer._Writer.write

    def write(self, bundle):  # type: ignore[no-untyped-def]
        real(self, bundle)
        seen.append(_held_by_someone(lock))

    monkeypatch.setattr(cann_transfer._Writer, "write", write)
    return seen


def _held_by_someone(lock: Path) -> bool:
    """Whether another process finds CANN's fcntl lock on ``lock`` held."""
    probe = (
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n"
        "    sys.exit(1)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(lock)], timeout=60)
    return done.returncode == 1


def test_an_entry_over_the_member_cap_is_left_out_of_the_export_and_the_rest_imports(
    tmp_path, monkeypatch
):
    # The three entries of a 2000-byte binary are over it (3031 bytes), the mix entry is not.
    monkeypatch.setattr(archive, "MAX_MEMBER_BYTES", 2900)
    a = tmp_path / "a"
    env = _env(tmp_path)
    big = _cann_folder(a)
    path = tmp_path / "cache.tar"
    report = cann_transfer.export_archive(path, SOC, settings=_settings(a), environ=env)
    chip = report["chips"][SOC]
    assert (chip["entries"], sorted(s["entry"] for s in chip["skipped"])) == (1, sorted(big))
    assert all("the most an archive holds" in s["why"] for s in chip["skipped"])
    assert _import(tmp_path, path)["chips"][SOC]["written"] == 1


def test_a_value_inflating_past_the_member_cap_is_refused(tmp_path, monkeypatch):
    """A small member whose compressed value inflates to more than an archive holds (a
    zlib bomb inside the value) is refused as it inflates, not after."""
    a = tmp_path / "a" / "kernel_cache"
    write_ini(a)
    kernel = kernel_name("Add", "inflating")
    paths = store_entry(tmp_path / "src" / SOC, kernel, bytes(4 << 20))
    bundle = cann_transfer.Bundle(kernel, int(NOW), {p.name: p.read_bytes() for p in paths})
    path = _archive_of(tmp_path, [bundle])
    assert path.stat().st_size < 1 << 20
    monkeypatch.setattr(archive, "MAX_MEMBER_BYTES", 1 << 20)
    with pytest.raises(archive.BadArchive, match="inflates past"):
        _import(tmp_path, path)
    assert not (tmp_path / "b/kernel_cache" / SOC).exists()


BOMB = """
import resource, sys
from pathlib import Path
from opcache import archive
resource.setrlimit(resource.RLIMIT_AS, (600 << 20, 600 << 20))
with archive.ArchiveReader(Path(sys.argv[1]), archive.OPCACHE) as reader:
    print(sum(len(rows) for rows in reader.check().values()))
"""


def test_an_archive_of_huge_manifests_is_checked_in_bounded_memory(tmp_path):
    """Each member's manifest of 20 MB (of one letter: 20 KB of gzip) was kept for the
    whole check: 40 of them, an archive of about 1 MB, took 800 MB before a byte was
    written (a MemoryError traceback under a limit).  Only what a caller asks is kept."""
    from opcache.storage.entry import make_manifest

    path = tmp_path / "big.tar.gz"
    with archive.ArchiveWriter(path, archive.OPCACHE) as out:
        for i in range(40):
            key = f"{i:032x}"
            files = {"k.o": b"\x7fELF"}
            manifest = make_manifest(key, files, 1.0, {"pad": "A" * (20 << 20)}, 0.0)
            assert out.add("Ascend910B1", key, manifest, files, 0.0)
    assert path.stat().st_size < 4 << 20
    done = subprocess.run(
        [sys.executable, "-c", BOMB, str(path)], capture_output=True, text=True, timeout=300
    )
    assert (done.returncode, done.stdout.strip()) == (0, "40"), done.stderr[-500:]


@pytest.mark.parametrize("kind", ["link", "device", "folder"])
def test_export_never_replaces_what_is_not_a_regular_file(tmp_path, kind):
    """Renamed over, /dev/full (as root) or a link to /dev/stdout was gone, a file in its
    place: the export is refused, and no temp file is left beside it."""
    env = _env(tmp_path)
    _cann_folder(tmp_path)
    target = tmp_path / "out" / "cache.tar"
    target.parent.mkdir()
    keep = tmp_path / "kept"
    keep.write_text("not an archive")
    if kind == "link":
        target.symlink_to(keep)
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("needs root to make a device node")
        os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(1, 7))  # (as /dev/full)
    else:
        target.mkdir()
    done = _cli("cann", "export", str(target), "--op_compiler_cache_dir", str(tmp_path), env=env)
    assert done.returncode == 4 and "not a regular file" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in target.parent.iterdir()) == ["cache.tar"]
    made = {"link": target.is_symlink(), "device": target.is_char_device()}
    assert made.get(kind, target.is_dir()) and keep.read_text() == "not an archive"


def test_an_export_that_cannot_be_put_in_place_leaves_no_temp_file(tmp_path, monkeypatch):
    def refused(*args: object) -> None:
        raise PermissionError(13, "Permission denied")

    from opcache.storage.entry import make_manifest

    key, files = "0" * 32, {"k.o": b"\x7fELF"}
    writer = archive.ArchiveWriter(tmp_path / "cache.tar", archive.OPCACHE)
    monkeypatch.setattr(archive.os, "replace", refused)
    with pytest.raises(PermissionError), writer:
        writer.add("Ascend910B1", key, make_manifest(key, files, 1.0, {}, 0.0), files, 0.0)
    assert list(tmp_path.iterdir()) == []
