"""OpCache: modes, bypasses, failed compiles, an unwritable cache, stats, clear.

Every test uses real files under tmp_path, a toy compiler that counts its calls
in a file, and settings resolved from explicit options and an environment that
holds only HOME.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
from helpers_cache import (
    OTHER_SOC,
    SOC,
    FakeClock,
    ToyCompiler,
    entry_dirs,
    expected_files,
    make_request,
    make_settings,
    read_dir,
    run_script,
    toolkit_env,
    trash_emptied,
    tree_bytes,
    wait_for,
)

import opcache
from opcache import ini
from opcache.storage.local import LocalStore

BYPASS_LEVEL = "op_debug_level is 1"
BYPASS_COLLECT = "NPU_COLLECT_PATH is set"
BYPASS_CONFIG = "op_debug_config is set without op_debug_list"
BYPASS_LISTED = "op_debug_list names the operator"
BYPASS_LISTED_TYPE = "op_debug_list names the operator type"


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "ops"


@pytest.fixture
def root(cache_dir: Path) -> Path:
    return cache_dir / "kernel_cache"


@pytest.fixture
def compiler(tmp_path: Path) -> ToyCompiler:
    return ToyCompiler(tmp_path / "calls")


def settings_for(tmp_path: Path, mode: str = "enable", **kw: object) -> opcache.Settings:
    return make_settings(tmp_path / "ops", tmp_path, mode, **kw)


def all_paths(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


# ------------------------------------------------------------------------- enable


def test_enable_miss_then_hit_delivers_identical_files(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    request = make_request()
    want = expected_files(request)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        first = cache.compile(request, compiler, tmp_path / "out1")
        second = cache.compile(request, compiler, tmp_path / "out2")
    assert (first.status, second.status) == ("miss", "hit")
    assert compiler.calls() == 1
    assert first.key == second.key
    assert read_dir(tmp_path / "out1") == want
    assert read_dir(tmp_path / "out2") == want
    assert second.files == {name: tmp_path / "out2" / name for name in want}
    assert first.files == {name: tmp_path / "out1" / name for name in want}
    # The entry holds the artifacts and a manifest, nothing else.
    entries = entry_dirs(root)
    assert list(entries) == [first.key]
    assert sorted(p.name for p in entries[first.key].iterdir()) == sorted([*want, "MANIFEST"])


def test_hit_from_a_new_opcache_and_a_new_process_state(
    tmp_path: Path, compiler: ToyCompiler
) -> None:
    request = make_request()
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        assert cache.compile(request, compiler, tmp_path / "a").status == "miss"
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        result = cache.compile(request, compiler, tmp_path / "b")
    assert result.status == "hit"
    assert read_dir(tmp_path / "b") == expected_files(request)
    assert compiler.calls() == 1


def test_other_op_name_is_a_hit_with_the_same_files(tmp_path: Path, compiler: ToyCompiler) -> None:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        first = cache.compile(make_request(op_name="layer1/add"), compiler, tmp_path / "a")
        second = cache.compile(make_request(op_name="layer7/add"), compiler, tmp_path / "b")
    assert (first.status, second.status) == ("miss", "hit")
    assert first.key == second.key
    assert sorted(first.files) == sorted(second.files)
    assert read_dir(tmp_path / "a") == read_dir(tmp_path / "b")
    assert compiler.calls() == 1


def test_different_requests_are_different_entries(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        keys = {cache.compile(make_request(i), compiler, tmp_path / f"o{i}").key for i in range(3)}
        statuses = [
            cache.compile(make_request(i), compiler, tmp_path / "x").status for i in range(3)
        ]
    assert len(keys) == 3
    assert set(entry_dirs(root)) == keys
    assert statuses == ["hit"] * 3
    assert compiler.calls() == 3


def test_op_cache_ini_is_created_on_first_use(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    cache = opcache.OpCache(settings_for(tmp_path, env=toolkit_env(tmp_path)))
    assert not (root / "op_cache.ini").exists()
    cache.compile(make_request(), compiler, tmp_path / "out")
    cache.close()
    text = (root / "op_cache.ini").read_text(encoding="utf-8")
    assert "[op_compiler_cache]" in text


def test_no_op_cache_ini_is_made_without_a_toolkit(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    """One without versions, in CANN's own folder (the default root), was a file CANN
    neither checks nor repairs: a toolkit installed later never wiped the chip folders
    when it changed, and ignored the size keys a person added to it."""
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        assert cache.compile(make_request(), compiler, tmp_path / "out").status == "miss"
        assert cache.compile(make_request(), compiler, tmp_path / "again").status == "hit"
    assert not os.path.lexists(root / "op_cache.ini")


def test_op_cache_ini_is_created_in_force_mode(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    with opcache.OpCache(settings_for(tmp_path, "force", env=toolkit_env(tmp_path))) as cache:
        cache.compile(make_request(), compiler, tmp_path / "out")
    assert (root / "op_cache.ini").is_file()


def test_op_cache_ini_holds_the_toolkit_s_versions_as_cann_writes_them(
    tmp_path: Path, root: Path, compiler: ToyCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without both versions CANN takes the file for one it must neither check nor
    repair: once opcache had made it, CANN never wiped a chip folder again when its
    toolkit changed, and served the old toolkit's kernels.  The toolkit is the one the
    environment given to resolve_settings names, not this process's own."""
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "this-process-s-toolkit"))
    with opcache.OpCache(settings_for(tmp_path, env=toolkit_env(tmp_path))) as cache:
        cache.compile(make_request(), compiler, tmp_path / "out")
    assert ini.read_cann_versions(root / "op_cache.ini") == ("8.0.RC1", "8.0.RC1")
    assert settings_for(tmp_path).sources["max_op_cache_size_mb"] == "default"


@pytest.mark.parametrize("planted", ["file", "link"])
def test_no_op_cache_ini_is_made_over_cann_s_kernels_of_unknown_versions(
    tmp_path: Path, root: Path, compiler: ToyCompiler, planted: str
) -> None:
    """A kernel an older toolkit left, and no ini: CANN's first compile would wipe it;
    an ini naming the installed versions told CANN to keep it.  CANN reads kernels
    through links in a chip folder too (realpath): one linked there was not seen."""
    (root / "Ascend310P3").mkdir(parents=True)
    kernel = root / "Ascend310P3" / "te_add_1.json"
    if planted == "file":
        kernel.write_text("{}")
    else:
        (tmp_path / "old").mkdir()
        (tmp_path / "old" / "te_add_1.json").write_text("{}")
        kernel.symlink_to(tmp_path / "old" / "te_add_1.json")
    with opcache.OpCache(settings_for(tmp_path, env=toolkit_env(tmp_path))) as cache:
        assert cache.compile(make_request(), compiler, tmp_path / "out").status == "miss"
    assert not (root / "op_cache.ini").exists()


def test_no_op_cache_ini_is_made_over_a_chip_folder_that_is_a_link(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    """CANN follows the link to the files behind it; an ini would vouch for them."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "te_add_1.json").write_text("{}")
    root.mkdir(parents=True)
    (root / "Ascend310P3").symlink_to(elsewhere)
    with opcache.OpCache(settings_for(tmp_path, env=toolkit_env(tmp_path))) as cache:
        assert cache.compile(make_request(), compiler, tmp_path / "out").status == "miss"
    assert not (root / "op_cache.ini").exists()


def test_no_op_cache_ini_is_made_where_the_toolkit_s_versions_are_not_known(
    tmp_path: Path, root: Path, compiler: ToyCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read from the environment given, where this process's own names a toolkit whose
    versions are known."""
    for name, value in toolkit_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    env = {"ASCEND_HOME_PATH": str(tmp_path / "no-version-info-here")}
    with opcache.OpCache(settings_for(tmp_path, env=env)) as cache:
        assert cache.compile(make_request(), compiler, tmp_path / "out").status == "miss"
    assert not (root / "op_cache.ini").exists()  # (CANN makes its own, with them)


def test_existing_op_cache_ini_is_kept(tmp_path: Path, root: Path, compiler: ToyCompiler) -> None:
    root.mkdir(parents=True)
    mine = "[op_compiler_cache]\nmax_op_cache_size=7\nremain_cache_size_ratio=30\n"
    (root / "op_cache.ini").write_text(mine, encoding="utf-8")
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(), compiler, tmp_path / "out")
    assert (root / "op_cache.ini").read_text(encoding="utf-8") == mine


# -------------------------------------------------------------------------- force


def test_force_clears_each_chip_once_per_opcache(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        old_a = cache.compile(make_request(0), compiler, tmp_path / "o").key
        old_b = cache.compile(make_request(1), compiler, tmp_path / "o").key
        other = cache.compile(make_request(0, soc_version=OTHER_SOC), compiler, tmp_path / "o").key
    assert set(entry_dirs(root)) == {old_a, old_b}
    assert compiler.calls() == 3

    forced = opcache.OpCache(settings_for(tmp_path, "force"))
    # First touch of the chip: its entries go, then it behaves as enable.
    first = forced.compile(make_request(0), compiler, tmp_path / "f1")
    assert first.status == "miss"
    assert read_dir(tmp_path / "f1") == expected_files(make_request(0))
    assert set(entry_dirs(root)) == {old_a}
    assert old_b not in entry_dirs(root)
    # The other chip is untouched until this OpCache uses it.
    assert set(entry_dirs(root, OTHER_SOC)) == {other}
    # The same OpCache does not clear again.
    assert forced.compile(make_request(0), compiler, tmp_path / "f2").status == "hit"
    assert forced.compile(make_request(1), compiler, tmp_path / "f3").status == "miss"
    assert forced.compile(make_request(1), compiler, tmp_path / "f4").status == "hit"
    assert set(entry_dirs(root)) == {old_a, old_b}
    assert compiler.calls() == 5
    # Its first touch of the other chip clears that one.
    assert (
        forced.compile(make_request(5, soc_version=OTHER_SOC), compiler, tmp_path / "f5").status
        == "miss"
    )
    assert other not in entry_dirs(root, OTHER_SOC)
    forced.close()

    # A second OpCache in force mode clears again.
    with opcache.OpCache(settings_for(tmp_path, "force")) as again:
        assert again.compile(make_request(0), compiler, tmp_path / "g").status == "miss"
    assert set(entry_dirs(root)) == {old_a}
    assert compiler.calls() == 7


def test_force_counters_restart_from_the_cleared_folder(
    tmp_path: Path, compiler: ToyCompiler
) -> None:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        for i in range(3):
            cache.compile(make_request(i), compiler, tmp_path / "o")
        assert cache.stats()["entries"] == 3
    with opcache.OpCache(settings_for(tmp_path, "force")) as forced:
        forced.compile(make_request(9), compiler, tmp_path / "o")
        stats = forced.stats()
    assert stats["entries"] == 1
    assert stats["bytes"] == sum(
        tree_bytes(p) for p in entry_dirs(settings_for(tmp_path).root).values()
    )


# ------------------------------------------------------------------------ disable


def test_disable_compiles_into_out_dir_and_touches_no_cache_file(
    tmp_path: Path, root: Path, cache_dir: Path, compiler: ToyCompiler
) -> None:
    request = make_request()
    cache = opcache.OpCache(settings_for(tmp_path, "disable"))
    first = cache.compile(request, compiler, tmp_path / "out")
    second = cache.compile(request, compiler, tmp_path / "out2")
    assert (first.status, second.status) == ("disabled", "disabled")
    assert first.key == ""
    assert compiler.calls() == 2
    assert read_dir(tmp_path / "out") == expected_files(request)
    assert first.files == {n: tmp_path / "out" / n for n in expected_files(request)}
    # No temp folder left in out_dir either.
    assert sorted(os.listdir(tmp_path / "out")) == sorted(expected_files(request))
    # Maintenance on a cache that does not exist creates nothing.
    assert cache.stats()["entries"] == 0
    assert cache.age().removed_entries == 0
    assert cache.verify().corrupt == 0
    cache.close()
    assert not cache_dir.exists()
    assert not root.exists()


def test_disable_leaves_an_existing_cache_untouched(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(), compiler, tmp_path / "o")
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}
    with opcache.OpCache(settings_for(tmp_path, "disable")) as cache:
        result = cache.compile(make_request(), compiler, tmp_path / "d")
    assert result.status == "disabled"
    assert compiler.calls() == 2
    after = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}
    assert after == before


def test_disable_wins_over_bypass(tmp_path: Path, cache_dir: Path, compiler: ToyCompiler) -> None:
    settings = settings_for(tmp_path, "disable", op_debug_level=1, env={"NPU_COLLECT_PATH": "/x"})
    with opcache.OpCache(settings) as cache:
        result = cache.compile(make_request(), compiler, tmp_path / "out")
    assert result.status == "disabled"
    assert read_dir(tmp_path / "out") == expected_files(make_request())
    assert not cache_dir.exists()


# ------------------------------------------------------------------------- bypass


def _cfg(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "debug.cfg"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("level", BYPASS_LEVEL),
        ("collect", BYPASS_COLLECT),
        ("config", BYPASS_CONFIG),
        ("list_name", BYPASS_LISTED),
        ("list_type", BYPASS_LISTED_TYPE),
    ],
)
def test_bypass_neither_reads_nor_writes_entries(
    tmp_path: Path, root: Path, compiler: ToyCompiler, how: str, reason: str
) -> None:
    stored, fresh = make_request(0), make_request(1)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        key = cache.compile(stored, compiler, tmp_path / "warm").key
    entry = entry_dirs(root)[key]
    stamp = (entry / "MANIFEST").stat().st_mtime_ns
    options: dict[str, object] = {}
    env: dict[str, str] = {}
    if how == "level":
        options["op_debug_level"] = 1
    elif how == "collect":
        env["NPU_COLLECT_PATH"] = str(tmp_path / "collect")
    elif how == "config":
        options["op_debug_config"] = _cfg(tmp_path, "op_debug_config = ccec_O0\n")
    elif how == "list_name":
        text = "op_debug_config = ccec_g\nop_debug_list = add_0,add_1\n"
        options["op_debug_config"] = _cfg(tmp_path, text)
    else:
        text = "op_debug_config = ccec_g\nop_debug_list = OpType::Add\n"
        options["op_debug_config"] = _cfg(tmp_path, text)
    settings = settings_for(tmp_path, env=env, **options)
    with opcache.OpCache(settings) as cache:
        hit_would_be = cache.compile(stored, compiler, tmp_path / "b1")
        miss_would_be = cache.compile(fresh, compiler, tmp_path / "b2")
        stats = cache.stats()
    assert (hit_would_be.status, miss_would_be.status) == ("bypass", "bypass")
    assert hit_would_be.reason == reason
    assert hit_would_be.key == ""
    # The stored entry was not served (the compiler ran) and not stamped ...
    assert compiler.calls() == 3
    assert (entry / "MANIFEST").stat().st_mtime_ns == stamp
    # ... and the new one was not stored.
    assert set(entry_dirs(root)) == {key}
    assert read_dir(tmp_path / "b1") == expected_files(stored)
    assert read_dir(tmp_path / "b2") == expected_files(fresh)
    assert hit_would_be.files == {n: tmp_path / "b1" / n for n in expected_files(stored)}
    assert stats["bypasses"] == 2
    assert stats["bypass_reasons"] == {reason: 2}
    assert stats["chips"][SOC]["bypass_reasons"] == {reason: 2}
    assert (stats["hits"], stats["misses"], stats["stores"]) == (0, 1, 1)


def test_op_debug_list_bypasses_only_the_listed_operators(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    cfg = _cfg(tmp_path, "op_debug_config = ccec_g\nop_debug_list = add_1\n")
    with opcache.OpCache(settings_for(tmp_path, op_debug_config=cfg)) as cache:
        listed = cache.compile(make_request(1), compiler, tmp_path / "a")
        other = cache.compile(make_request(2), compiler, tmp_path / "b")
        again = cache.compile(make_request(2, op_name="add_9"), compiler, tmp_path / "c")
        stats = cache.stats()
    assert (listed.status, other.status, again.status) == ("bypass", "miss", "hit")
    assert list(entry_dirs(root)) == [other.key]
    assert stats["bypass_reasons"] == {BYPASS_LISTED: 1}


def test_bypasses_are_counted_by_reason(tmp_path: Path, compiler: ToyCompiler) -> None:
    with opcache.OpCache(settings_for(tmp_path, op_debug_level=2)) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "a")
    with opcache.OpCache(settings_for(tmp_path, env={"NPU_COLLECT_PATH": "/c"})) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "b")
        cache.compile(make_request(1), compiler, tmp_path / "c")
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        stats = cache.stats()
    assert stats["bypasses"] == 3
    assert stats["bypass_reasons"] == {"op_debug_level is 2": 1, BYPASS_COLLECT: 2}


# -------------------------------------------------------------- failed compiles


def test_compile_error_raises_and_stores_nothing(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    failing = ToyCompiler(tmp_path / "calls", fail=True)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        with pytest.raises(opcache.CompileError, match="toy compiler failed"):
            cache.compile(make_request(), failing, tmp_path / "out")
        stats = cache.stats()
        assert entry_dirs(root) == {}
        tmp = root / ".opcache" / "tmp"
        assert not tmp.exists() or os.listdir(tmp) == []
        assert not (tmp_path / "out").exists()  # no build folder, no out_dir it made
        # The key is not poisoned: the next compile runs and stores.
        result = cache.compile(make_request(), compiler, tmp_path / "out2")
    assert result.status == "miss"
    assert stats["stores"] == 0
    assert stats["entries"] == 0
    assert failing.calls() == 2  # same calls file: the failure and the success
    assert list(entry_dirs(root)) == [result.key]


@pytest.mark.parametrize("mode", ["disable", "bypass"])
def test_compile_error_without_the_cache(tmp_path: Path, mode: str) -> None:
    failing = ToyCompiler(tmp_path / "calls", fail=True)
    if mode == "disable":
        settings = settings_for(tmp_path, "disable")
    else:
        settings = settings_for(tmp_path, op_debug_level=1)
    with opcache.OpCache(settings) as cache, pytest.raises(opcache.CompileError):
        cache.compile(make_request(), failing, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------ what gets stored


def test_only_plain_files_are_stored(tmp_path: Path, root: Path) -> None:
    class Messy(ToyCompiler):
        def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
            super().compile(request, workdir)
            (workdir / "sub").mkdir()
            (workdir / "sub" / "x.o").write_bytes(b"nested")
            os.symlink("/etc/hostname", workdir / "link.o")

    messy = Messy(tmp_path / "calls")
    request = make_request()
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        first = cache.compile(request, messy, tmp_path / "a")
        second = cache.compile(request, messy, tmp_path / "b")
    assert (first.status, second.status) == ("miss", "hit")
    assert sorted(second.files) == sorted(expected_files(request))
    entry = entry_dirs(root)[first.key]
    assert sorted(p.name for p in entry.iterdir()) == sorted([*expected_files(request), "MANIFEST"])


def test_a_compiler_may_compile_its_parts_through_the_same_cache(
    tmp_path: Path, root: Path
) -> None:
    """A fused operator's compiler that asks the cache for a part of it first."""

    class Fusing(ToyCompiler):
        def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
            part = cache.compile(make_request(7), ToyCompiler(tmp_path / "calls"), workdir / "p")
            assert part.status in ("miss", "hit")
            super().compile(request, workdir)

    with opcache.OpCache(settings_for(tmp_path)) as cache:
        fused = Fusing(tmp_path / "calls", name="fusing")
        assert cache.compile(make_request(), fused, tmp_path / "a").status == "miss"
        assert cache.compile(make_request(), fused, tmp_path / "b").status == "hit"
        stats = cache.stats()
    assert (stats["misses"], stats["hits"], stats["errors"]) == (2, 1, 0)


def test_an_artifact_named_manifest_is_delivered_but_not_stored(tmp_path: Path, root: Path) -> None:
    odd = ToyCompiler(tmp_path / "calls", extra={"MANIFEST": b"mine"})
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        first = cache.compile(make_request(), odd, tmp_path / "a")
        second = cache.compile(make_request(), odd, tmp_path / "b")
    assert (first.status, second.status) == ("miss", "miss")
    assert (tmp_path / "b" / "MANIFEST").read_bytes() == b"mine"
    assert entry_dirs(root) == {}


class _Moded(ToyCompiler):
    """Also makes ``helper``, an executable, and ``secret.key``, its owner's alone."""

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        super().compile(request, workdir)
        (workdir / "helper").write_bytes(b"#!/bin/sh\n")
        (workdir / "helper").chmod(0o755)
        (workdir / "secret.key").write_bytes(b"k")
        (workdir / "secret.key").chmod(0o600)


def _modes(folder: Path) -> tuple[int, int, set[int]]:
    """The bits of helper, of secret.key, and of the kernel's files."""
    bits = {path.name: path.stat().st_mode & 0o7777 for path in folder.iterdir()}
    return bits.pop("helper"), bits.pop("secret.key"), set(bits.values())


def test_a_hit_gives_each_artifact_the_permission_bits_its_compile_gave(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executable stays one and a key its owner's alone, from the cache folder, a
    batch's copy of a compile and a shared folder's remote hit (before: every hit's
    file had the bits of a new one, 0644: a program that no longer ran and a secret
    any user could read).  An entry of plain files keeps the format older versions read."""
    monkeypatch.setattr(opcache.fsutil, "UMASK", 0o022)
    os.umask(0o022)
    moded = _Moded(tmp_path / "calls")
    plain = make_request(1)
    (tmp_path / "share").mkdir()
    remote = {"remote": f"file://{tmp_path / 'share'}"}
    with opcache.OpCache(settings_for(tmp_path, **remote)) as cache:
        miss = cache.compile(make_request(), moded, tmp_path / "miss")
        hit = cache.compile(make_request(), moded, tmp_path / "hit")
        batch = cache.compile_many([make_request(2)] * 2, moded, [tmp_path / "b1", tmp_path / "b2"])
        plain_key = cache.compile(plain, ToyCompiler(tmp_path / "calls"), tmp_path / "p").key
    other = make_settings(tmp_path / "other", tmp_path, **remote)
    with opcache.OpCache(other) as cache:
        from_remote = cache.compile(make_request(), moded, tmp_path / "remote")
    with opcache.OpCache(other) as cache:
        copied = cache.compile(make_request(), moded, tmp_path / "copied")
    assert [miss.status, hit.status, from_remote.status, copied.status] == ["miss"] + ["hit"] * 3
    assert [r.status for r in batch] == ["miss", "hit"]
    assert (from_remote.tier, copied.tier) == ("remote", "local")
    want = _modes(tmp_path / "miss")
    assert want == (0o755, 0o600, {0o644})
    for name in ("hit", "b1", "b2", "remote", "copied"):
        assert _modes(tmp_path / name) == want, name
    plain_manifest = (entry_dirs(root)[plain_key] / "MANIFEST").read_bytes()
    assert b'"format":1,' in plain_manifest and b'"mode"' not in plain_manifest

    monkeypatch.setattr(opcache.fsutil, "UMASK", 0o077)  # (a stricter user: its bits narrowed)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        narrowed = cache.compile(make_request(), moded, tmp_path / "narrowed")
    assert narrowed.status == "hit"
    assert _modes(tmp_path / "narrowed")[:2] == (0o700, 0o600)


def test_a_umask_set_after_opcache_was_imported_is_the_one_a_compile_has(
    tmp_path: Path, root: Path
) -> None:
    """A program that sets its umask once it has imported opcache (a daemon's 0o002): the
    miss's files have a new file's bits under it, which are no bits to keep, and the
    hit gives the same (the umask read at import took them for bits of their own)."""
    request = make_request()
    compiler = ToyCompiler(tmp_path / "calls")
    before = os.umask(0o002)
    try:
        with opcache.OpCache(settings_for(tmp_path)) as cache:
            missed = cache.compile(request, compiler, tmp_path / "a")
            hit = cache.compile(request, compiler, tmp_path / "b")
    finally:
        os.umask(before)
        opcache.fsutil.UMASK = opcache.fsutil.umask_now()
    assert (missed.status, hit.status) == ("miss", "hit")
    for result in (missed, hit):
        assert {path.stat().st_mode & 0o777 for path in result.files.values()} == {0o664}
    assert b'"modes"' not in (entry_dirs(root)[missed.key] / "MANIFEST").read_bytes()


def test_a_plug_ins_fingerprint_is_asked_once_per_compiler_object(tmp_path: Path) -> None:
    """A third party's fingerprint may run its tool, or hold a time: asked once per
    compiler object, as before opcache's own back-ends came to re-check theirs at
    every compile, it costs a hit nothing and its compiles are stored."""

    class Stamped(ToyCompiler):
        asked = 0

        def fingerprint(self) -> str:
            Stamped.asked += 1
            return f"stamped {time.time_ns()}"

    stamped = Stamped(tmp_path / "calls")
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        statuses = [cache.compile(make_request(), stamped, tmp_path / "a").status for _ in "abc"]
    assert statuses == ["miss", "hit", "hit"]
    assert Stamped.asked == 1


def test_a_compile_that_read_what_the_key_does_not_hold_is_served_never_stored(
    tmp_path: Path, root: Path
) -> None:
    """A compiler's compile returns why its output must not be stored (it read a file
    outside the request's sources): each compile runs and delivers, nothing is kept
    locally, and stats count it as uncacheable with that reason, in a batch too."""

    class Reading(ToyCompiler):
        def compile(self, request: opcache.OpRequest, workdir: Path) -> str | None:
            super().compile(request, workdir)
            return "it read /tmp/k.h, outside its sources"

    reading = Reading(tmp_path / "calls")
    requests = [make_request(), make_request()]
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        first = cache.compile(requests[0], reading, tmp_path / "a")
        second = cache.compile(requests[0], reading, tmp_path / "b")
        batch = cache.compile_many(requests, reading, [tmp_path / "c", tmp_path / "d"])
        stats = cache.stats()
    results = [first, second, *batch]
    assert [r.status for r in results] == ["miss", "miss", "miss", "hit"]  # (one key: one compile)
    assert first.reason == "not stored: it read /tmp/k.h, outside its sources"
    for name in ("a", "b", "c", "d"):
        assert read_dir(tmp_path / name) == expected_files(make_request())
    assert entry_dirs(root) == {}
    assert reading.calls() == 3
    reasons = stats["uncacheable_reasons"]
    assert reasons == {"it read /tmp/k.h, outside its sources": 3}, stats
    assert (stats["stores"], stats["hits"]) == (0, 1)


# ---------------------------------------------------------- an unwritable cache


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_cache_root_that_cannot_be_created_never_fails_a_compile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, compiler: ToyCompiler
) -> None:
    # A regular file where a folder should be: mkdir fails (ENOTDIR) even for root.
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    settings = make_settings(blocker / "ops", tmp_path)
    caplog.clear()
    caplog.set_level(logging.WARNING)
    with opcache.OpCache(settings) as cache:
        results = [cache.compile(make_request(i), compiler, tmp_path / f"o{i}") for i in range(3)]
        again = cache.compile(make_request(0), compiler, tmp_path / "again")
        stats = cache.stats()
    assert [r.status for r in results] == ["miss"] * 3
    assert again.status == "miss"
    assert compiler.calls() == 4
    for i, result in enumerate(results):
        assert read_dir(tmp_path / f"o{i}") == expected_files(make_request(i))
        assert result.files == {n: tmp_path / f"o{i}" / n for n in expected_files(make_request(i))}
    cache_warnings = [w for w in _warnings(caplog) if "cache" in w]
    assert len(cache_warnings) == 1, _warnings(caplog)
    assert len(_warnings(caplog)) == 1, _warnings(caplog)
    assert stats["entries"] == 0
    assert blocker.read_text() == "not a folder"


def test_chip_folder_that_cannot_be_written_counts_errors(
    tmp_path: Path, root: Path, caplog: pytest.LogCaptureFixture, compiler: ToyCompiler
) -> None:
    root.mkdir(parents=True)
    (root / SOC).write_text("a file where the chip folder should be")
    caplog.set_level(logging.WARNING)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        first = cache.compile(make_request(0), compiler, tmp_path / "a")
        second = cache.compile(make_request(1), compiler, tmp_path / "b")
        third = cache.compile(make_request(0), compiler, tmp_path / "c")
    assert (first.status, second.status, third.status) == ("miss", "miss", "miss")
    assert read_dir(tmp_path / "c") == expected_files(make_request(0))
    assert compiler.calls() == 3
    assert len(_warnings(caplog)) == 1, _warnings(caplog)
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        stats = cache.stats()
    assert stats["errors"] == 3
    assert stats["misses"] == 3
    assert stats["stores"] == 0
    # The other chips still work.
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        other = make_request(0, soc_version=OTHER_SOC)
        assert cache.compile(other, compiler, tmp_path / "d").status == "miss"
        assert cache.compile(other, compiler, tmp_path / "e").status == "hit"


# -------------------------------------------------------------------------- stats


def test_stats_count_everything(tmp_path: Path, compiler: ToyCompiler) -> None:
    slow = ToyCompiler(tmp_path / "calls", sleep=0.2)
    clock = FakeClock()
    with opcache.OpCache(settings_for(tmp_path), clock=clock) as cache:
        cache.compile(make_request(0), slow, tmp_path / "a")
        cache.compile(make_request(1), slow, tmp_path / "b")
        for _ in range(3):
            cache.compile(make_request(0), slow, tmp_path / "c")
        cache.compile(make_request(0, soc_version=OTHER_SOC), slow, tmp_path / "d")
        stats = cache.stats()
        one_chip = cache.stats(SOC)
    assert (stats["hits"], stats["misses"], stats["stores"]) == (3, 3, 3)
    assert stats["entries"] == 3
    assert stats["corrupt"] == stats["errors"] == stats["evicted_entries"] == 0
    assert 0.6 <= stats["time_saved_seconds"] < 3.0
    chip = stats["chips"][SOC]
    assert (chip["hits"], chip["misses"], chip["stores"], chip["entries"]) == (3, 2, 2, 2)
    assert stats["chips"][OTHER_SOC]["misses"] == 1
    assert set(one_chip["chips"]) == {SOC}
    assert one_chip["hits"] == 3
    root = settings_for(tmp_path).root
    assert chip["bytes"] == sum(tree_bytes(p) for p in entry_dirs(root).values())
    assert stats["bytes"] == chip["bytes"] + sum(
        tree_bytes(p) for p in entry_dirs(root, OTHER_SOC).values()
    )
    for name in (
        "hits",
        "misses",
        "bypasses",
        "stores",
        "corrupt",
        "evicted_entries",
        "evicted_bytes",
        "entries",
        "bytes",
        "errors",
        "time_saved_seconds",
    ):
        assert name in stats
        assert name in chip


def test_stats_persist_after_close(tmp_path: Path, compiler: ToyCompiler) -> None:
    cache = opcache.OpCache(settings_for(tmp_path))
    cache.compile(make_request(0), compiler, tmp_path / "a")
    cache.compile(make_request(0), compiler, tmp_path / "b")
    cache.close()
    with opcache.OpCache(settings_for(tmp_path)) as reader:
        stats = reader.stats()
    assert (stats["hits"], stats["misses"], stats["stores"], stats["entries"]) == (1, 1, 1, 1)


def test_stats_reach_disk_at_normal_exit_without_close(tmp_path: Path) -> None:
    code = f"""
import helpers_cache as h, opcache
s = h.make_settings({str(tmp_path / "ops")!r}, {str(tmp_path)!r})
c = opcache.OpCache(s)
comp = h.ToyCompiler({str(tmp_path / "calls")!r})
for i in (0, 0, 0, 1):
    c.compile(h.make_request(i), comp, {str(tmp_path / "out")!r})
"""
    done = run_script(code)
    assert done.returncode == 0, done.stderr
    with opcache.OpCache(settings_for(tmp_path)) as reader:
        stats = reader.stats()
    assert (stats["hits"], stats["misses"], stats["stores"]) == (2, 2, 2)


def test_stats_reach_disk_while_the_writer_runs(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = f"""
import time, pathlib, helpers_cache as h, opcache
s = h.make_settings({str(tmp_path / "ops")!r}, {str(tmp_path)!r})
c = opcache.OpCache(s)
comp = h.ToyCompiler({str(tmp_path / "calls")!r})
for i in (0, 0, 1, 0):
    c.compile(h.make_request(i), comp, {str(tmp_path / "out")!r})
pathlib.Path({str(ready)!r}).touch()
time.sleep(60)
"""
    child = run_script(code, wait=False)
    try:
        wait_for(ready, 30)
        reader = opcache.OpCache(settings_for(tmp_path))
        deadline = time.monotonic() + 10
        stats = reader.stats()
        while stats["hits"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            stats = reader.stats()
        assert child.poll() is None  # still running: the counts came from its flushes
        assert (stats["hits"], stats["misses"], stats["stores"]) == (2, 2, 2)
        reader.close()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_zero_stats_keeps_entries_and_bytes(tmp_path: Path, compiler: ToyCompiler) -> None:
    with opcache.OpCache(settings_for(tmp_path, op_debug_level=0)) as cache:
        for i in (0, 1, 0, 1, 2):
            cache.compile(make_request(i), compiler, tmp_path / "o")
        cache.compile(make_request(0, soc_version=OTHER_SOC), compiler, tmp_path / "o")
    with opcache.OpCache(settings_for(tmp_path, op_debug_level=3)) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "o")
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        before = cache.stats()
        assert (before["hits"], before["misses"], before["bypasses"]) == (2, 4, 1)
        cache.zero_stats()
        after = cache.stats()
    assert after["entries"] == before["entries"] == 4
    assert after["bytes"] == before["bytes"] > 0
    for name in ("hits", "misses", "stores", "bypasses", "time_saved_seconds"):
        assert after[name] == 0, name
        assert after["chips"][SOC][name] == 0, name
    assert after["bypass_reasons"] == {}
    # Counting starts again from zero.
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "o")
        assert cache.stats()["hits"] == 1


def test_zero_stats_of_one_chip(tmp_path: Path, compiler: ToyCompiler) -> None:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(0), compiler, tmp_path / "o")
        cache.compile(make_request(0, soc_version=OTHER_SOC), compiler, tmp_path / "o")
        cache.zero_stats(OTHER_SOC)
        stats = cache.stats()
    assert stats["chips"][SOC]["misses"] == 1
    assert stats["chips"][OTHER_SOC]["misses"] == 0
    assert stats["chips"][OTHER_SOC]["entries"] == 1


def test_stats_from_another_process_add_up(tmp_path: Path) -> None:
    code = f"""
import helpers_cache as h, opcache
with opcache.OpCache(h.make_settings({str(tmp_path / "ops")!r}, {str(tmp_path)!r})) as c:
    comp = h.ToyCompiler({str(tmp_path / "calls")!r})
    for i in (0, 1, 2, 3):
        c.compile(h.make_request(i), comp, {str(tmp_path / "out")!r})
"""
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        compiler = ToyCompiler(tmp_path / "calls")
        cache.compile(make_request(9), compiler, tmp_path / "o")
        done = run_script(code)
        assert done.returncode == 0, done.stderr
        cache.compile(make_request(2), compiler, tmp_path / "o")
        stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["stores"], stats["entries"]) == (1, 5, 5, 5)


# ---------------------------------------------------------- clear, maintenance


def test_clear_one_chip_then_all(tmp_path: Path, root: Path, compiler: ToyCompiler) -> None:
    with opcache.OpCache(settings_for(tmp_path, env=toolkit_env(tmp_path))) as cache:
        for i in range(2):
            cache.compile(make_request(i), compiler, tmp_path / "o")
            cache.compile(make_request(i, soc_version=OTHER_SOC), compiler, tmp_path / "o")
        assert cache.clear(SOC) == [SOC]
        assert entry_dirs(root) == {}
        assert len(entry_dirs(root, OTHER_SOC)) == 2
        stats = cache.stats()
        assert stats["chips"][SOC]["entries"] == 0
        assert stats["chips"][SOC]["bytes"] == 0
        assert stats["chips"][OTHER_SOC]["entries"] == 2
        assert cache.compile(make_request(0), compiler, tmp_path / "x").status == "miss"
        assert cache.clear() == sorted([SOC, OTHER_SOC])
        assert entry_dirs(root) == entry_dirs(root, OTHER_SOC) == {}
        assert cache.stats()["entries"] == 0
        assert cache.clear() == []
        assert cache.compile(make_request(1), compiler, tmp_path / "x").status == "miss"
    assert (root / "op_cache.ini").is_file()
    assert trash_emptied(root) == []


def test_maintenance_works_in_disable_mode(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        keys = [cache.compile(make_request(i), compiler, tmp_path / "o").key for i in range(3)]
        cache.compile(make_request(0, soc_version=OTHER_SOC), compiler, tmp_path / "o")
        cache.compile(make_request(0), compiler, tmp_path / "o")
    (entry_dirs(root)[keys[1]] / "MANIFEST").write_bytes(b"garbage")
    with opcache.OpCache(settings_for(tmp_path, "disable")) as cache:
        stats = cache.stats()
        assert (stats["entries"], stats["hits"], stats["misses"]) == (4, 1, 4)
        assert cache.age().removed_entries == 0
        verified = cache.verify()
        assert verified.corrupt == 1
        assert verified.chips[SOC].entries == 2
        assert cache.clear(OTHER_SOC) == [OTHER_SOC]
        after = cache.stats()
        cache.zero_stats()
        zeroed = cache.stats()
    assert set(entry_dirs(root)) == {keys[0], keys[2]}
    assert entry_dirs(root, OTHER_SOC) == {}
    assert after["entries"] == 2
    assert after["corrupt"] == 1
    assert zeroed["hits"] == zeroed["misses"] == zeroed["corrupt"] == 0
    assert zeroed["entries"] == 2


def test_context_manager_and_close_leave_the_cache_usable(
    tmp_path: Path, compiler: ToyCompiler
) -> None:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        cache.compile(make_request(), compiler, tmp_path / "o")
    # After close, maintenance still works.
    assert cache.stats()["entries"] == 1
    assert cache.verify().chips[SOC].entries == 1


def test_store_layout_matches_the_settings(tmp_path: Path, compiler: ToyCompiler) -> None:
    settings = settings_for(tmp_path)
    with opcache.OpCache(settings) as cache:
        key = cache.compile(make_request(), compiler, tmp_path / "o").key
    assert (settings.chip_dir(SOC) / key[:2] / key / "MANIFEST").is_file()
    store = LocalStore(settings.root)
    entry = store.get(SOC, key)
    assert entry is not None
    assert entry.files == expected_files(make_request())
    manifest = read_manifest(settings.chip_dir(SOC) / key[:2] / key / "MANIFEST")
    assert manifest["key"] == key
    assert manifest["format"] == 1
    assert manifest["inputs"]["op_type"] == "Add"
    assert manifest["inputs"]["compiler"] == {"name": "toycc", "fingerprint": "toycc 1.0"}
    assert {a["name"]: a["size"] for a in manifest["artifacts"]} == {
        n: len(b) for n, b in expected_files(make_request()).items()
    }
    assert "created" in manifest


def read_manifest(path: Path) -> dict:
    _check, _nl, body = path.read_bytes().partition(b"\n")
    return json.loads(body)


def test_open_remote_the_earlier_name_of_eager_is_still_taken(tmp_path: Path) -> None:
    """A compile tool written for ``OpCache(open_remote=False)`` still opens its
    cache (as ``eager=False``: nothing imported before its use), told once that
    the name is now ``eager``."""
    done = run_script(f"""
import sys, warnings
import opcache
settings = opcache.resolve_settings(
    op_compiler_cache_mode="enable", op_compiler_cache_dir={str(tmp_path)!r},
    environ={{"HOME": {str(tmp_path)!r}}},
)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cache = opcache.OpCache(settings, open_remote=False)
cache.close()
print("opcache.explain" in sys.modules, [w.category.__name__ for w in caught])
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False ['DeprecationWarning']"


def test_an_opened_cache_imports_nothing_more_in_its_compiles(tmp_path: Path) -> None:
    """A compile tool opens the cache, then compiles: no compile pays for an import
    (where bytecode is not written, an import compiles its module, 10-15 ms each
    in every rank of a job)."""
    done = run_script(f"""
import sys
from helpers_cache import SOC, ToyCompiler
import opcache
settings = opcache.resolve_settings(
    op_compiler_cache_mode="enable", op_compiler_cache_dir={str(tmp_path)!r},
    environ={{"HOME": {str(tmp_path)!r}}},
)
requests = [opcache.OpRequest(op_type=f"Op{{i}}", soc_version=SOC) for i in range(3)]
with opcache.OpCache(settings) as cache:
    before = set(sys.modules)
    compiler = ToyCompiler({str(tmp_path / "calls")!r})
    outs = [{str(tmp_path)!r} + f"/out{{i}}" for i in range(3)]
    assert [r.status for r in cache.compile_many(requests, compiler, outs)] == ["miss"] * 3
    assert cache.compile(requests[0], compiler, {str(tmp_path / "one")!r}).status == "hit"
    print(sorted(m for m in set(sys.modules) - before if m.startswith("opcache")))
""")
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_no_counter_of_a_chip_folder_is_a_json_cann_s_aging_would_take(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    """CANN's aging takes every *.json below a chip folder for a kernel: the size
    counters (_size/NN.json) were aged with CANN's entries, and opcache's counts then
    said a chip folder held less than it did, so its own size limit was not kept."""
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        for i in range(3):
            cache.compile(make_request(i), compiler, tmp_path / f"o{i}")
    counters = list((root / SOC / "_size").iterdir())
    assert counters
    assert [p.name for p in counters if p.name.endswith(".json")] == []


def test_counts_an_older_opcache_kept_as_json_are_counted_once_and_moved(
    tmp_path: Path, root: Path, compiler: ToyCompiler
) -> None:
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        for i in range(2):
            cache.compile(make_request(i), compiler, tmp_path / f"o{i}")
        entries, size = cache.stats()["chips"][SOC]["entries"], cache.stats()["chips"][SOC]["bytes"]
    sizes = root / SOC / "_size"
    (shard,) = sizes.glob("*.count")  # (this process's)
    shard.rename(shard.with_suffix(".json"))  # as an older opcache kept it
    other = sizes / f"{(int(shard.stem) + 1) % 16:02d}.json"  # and another process's
    other.write_text('{"entries": 5, "bytes": 500}')
    with opcache.OpCache(settings_for(tmp_path)) as cache:
        chip = cache.stats()["chips"][SOC]
        assert (chip["entries"], chip["bytes"]) == (entries + 5, size + 500)
        added = cache.compile(make_request(7), compiler, tmp_path / "o7")
        chip = cache.stats()["chips"][SOC]
    assert added.status == "miss"
    one = tree_bytes(entry_dirs(root)[added.key])
    assert (chip["entries"], chip["bytes"]) == (entries + 6, size + 500 + one)
    # This process's shard took its legacy counts in: one name, counted once.
    assert not shard.with_suffix(".json").exists() and shard.exists()
    assert other.exists()  # (another process's, until it adds again)


def test_legacy_counts_outlive_a_write_that_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both an NN.json an older opcache wrote and an NN.count: folding one into the
    other and then failing to write (a full disk) lost the legacy counts for good."""
    from opcache.counters import SHARDS, CounterFiles

    counters = CounterFiles(tmp_path / "counts")
    counters.add({"entries": 1, "bytes": 5})
    index = os.getpid() % SHARDS
    (tmp_path / "counts" / f"{index:02d}.json").write_text('{"entries": 10, "bytes": 1000}')
    assert counters.totals() == {"entries": 11, "bytes": 1005}

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CounterFiles, "_write", full)
    with pytest.raises(OSError):
        counters.add({"entries": 1, "bytes": 7})
    monkeypatch.undo()
    assert counters.totals() == {"entries": 11, "bytes": 1005}
    counters.add({"entries": 1, "bytes": 7})
    assert counters.totals() == {"entries": 12, "bytes": 1012}
    assert sorted(p.name for p in (tmp_path / "counts").iterdir() if p.suffix != ".lock") == [
        f"{index:02d}.count"
    ]
