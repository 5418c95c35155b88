"""The maintenance commands as a cron job uses them: exit codes, output, JSON."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from helpers_cache import SOC, ToyCompiler, entry_dirs, make_request, run_script
from helpers_cann import base

import opcache
from opcache.cli import main
from opcache.storage.local import LocalStore

__all__ = ["base"]  # the fixture, from helpers_cann

REQUIRED_STATS_KEYS = {
    "hits",
    "misses",
    "bypasses",
    "stores",
    "corrupt",
    "evicted_entries",
    "evicted_bytes",
    "entries",
    "bytes",
    "chips",
}


@pytest.fixture
def cache_dir(base: Path) -> Path:
    """The cache folder, HOME in the test's folder and no CANN variables (``base``)."""
    return base.parent / "ops"


def fill(cache_dir: Path, tmp_path: Path, count: int, *, clock: float | None = None) -> list[str]:
    settings = opcache.resolve_settings(
        op_compiler_cache_mode="enable",
        op_compiler_cache_dir=str(cache_dir),
        environ={"HOME": str(tmp_path)},
    )
    compiler = ToyCompiler(tmp_path / "calls", size=200 * 1024)
    now = time.time() if clock is None else clock
    with opcache.OpCache(settings, clock=lambda: now) as cache:
        return [
            cache.compile(make_request(i), compiler, tmp_path / "out" / str(i)).key
            for i in range(count)
        ]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_age_is_quiet_when_nothing_is_removed(cache_dir, tmp_path, capsys) -> None:
    fill(cache_dir, tmp_path, 3)
    assert run(capsys, "age", "--op_compiler_cache_dir", str(cache_dir)) == (0, "", "")


def test_age_reports_what_it_removed_and_exits_0(cache_dir, tmp_path, capsys) -> None:
    fill(cache_dir, tmp_path, 8, clock=time.time() - 7200)  # 1.6 MB, all two hours old
    root = cache_dir / "kernel_cache"
    (root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=1\nremain_cache_size_ratio=50\n"
    )
    status, out, err = run(capsys, "age", "--op_compiler_cache_dir", str(cache_dir))
    assert (status, err) == (0, "")
    assert out.startswith(f"{SOC}: removed ")
    assert len(entry_dirs(root)) < 8


def test_age_dry_run_json_removes_nothing(cache_dir, tmp_path, capsys) -> None:
    fill(cache_dir, tmp_path, 8, clock=time.time() - 7200)
    root = cache_dir / "kernel_cache"
    (root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=1\nremain_cache_size_ratio=50\n"
    )
    args = ("age", "--dry-run", "--json", "--op_compiler_cache_dir", str(cache_dir))
    status, out, _ = run(capsys, *args)
    report = json.loads(out)
    assert status == 0
    assert report["removed_entries"] > 0 and report["freed_bytes"] > 0
    assert set(report["chips"][SOC]) >= {"bytes_before", "bytes_after", "removed_entries"}
    assert len(entry_dirs(root)) == 8


def test_stats_json_has_every_key_in_total_and_per_chip(cache_dir, tmp_path, capsys) -> None:
    fill(cache_dir, tmp_path, 2)
    fill(cache_dir, tmp_path, 2)
    status, out, _ = run(capsys, "stats", "--json", "--op_compiler_cache_dir", str(cache_dir))
    report = json.loads(out)
    assert status == 0
    assert set(report) >= REQUIRED_STATS_KEYS
    assert REQUIRED_STATS_KEYS - {"chips"} <= set(report["chips"][SOC])
    assert (report["hits"], report["misses"], report["stores"], report["entries"]) == (2, 2, 2, 2)


def test_stats_zero_json_is_json_and_keeps_entries(cache_dir, tmp_path, capsys) -> None:
    fill(cache_dir, tmp_path, 2)
    flags = ("--op_compiler_cache_dir", str(cache_dir))
    status, out, _ = run(capsys, "stats", "--zero", "--json", *flags)
    assert (status, json.loads(out)) == (0, {"zeroed": True})
    report = json.loads(run(capsys, "stats", "--json", *flags)[1])
    assert (report["misses"], report["entries"]) == (0, 2)


def test_verify_reports_and_repairs(cache_dir, tmp_path, capsys) -> None:
    keys = fill(cache_dir, tmp_path, 3)
    root = cache_dir / "kernel_cache"
    damaged = next(p for p in entry_dirs(root)[keys[0]].iterdir() if p.suffix == ".o")
    damaged.write_bytes(b"garbage")
    status, out, _ = run(capsys, "verify", "--json", "--op_compiler_cache_dir", str(cache_dir))
    report = json.loads(out)
    assert (status, report["corrupt"], report["errors"]) == (0, 1, 0)
    assert report["chips"][SOC]["entries"] == 2
    assert set(entry_dirs(root)) == set(keys[1:])


def test_clear_one_chip_and_on_a_missing_cache(cache_dir, tmp_path, capsys) -> None:
    flags = ("--op_compiler_cache_dir", str(cache_dir))
    assert run(capsys, "clear", *flags)[:2] == (1, "")
    assert not cache_dir.exists()  # clearing creates nothing
    fill(cache_dir, tmp_path, 2)
    root = cache_dir / "kernel_cache"
    # A chip not there (not compiled for here yet, or mistyped in a cron line) is said.
    for command in ("clear", "stats", "age", "verify"):
        status, _, err = run(capsys, command, "--soc_version", "Ascend310P3", *flags)
        assert (status, err) == (0, f"opcache: warning: no chip folder {root / 'Ascend310P3'}\n")
    assert run(capsys, "clear", "--soc_version", "Ascend310P3", *flags)[:2] == (
        0,
        "nothing to clear\n",
    )
    status, out, _ = run(capsys, "clear", "--soc_version", SOC, *flags)
    assert (status, out) == (0, f"cleared {SOC}\n")
    assert entry_dirs(cache_dir / "kernel_cache") == {}


def _tree(folder: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


def test_a_root_that_opcache_never_stored_in_is_not_changed(base, tmp_path, capsys) -> None:
    """A project that happens to be named kernel_cache (or a folder another member of a
    team folder renamed into the root's place): its folders are named as chips may be,
    but it holds no .opcache.  verify, age and stats --zero refuse it as clear does,
    and write nothing there (verify made the .opcache that clear then trusted)."""
    project = tmp_path / "work"
    root = project / "kernel_cache"
    (root / "src").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "src" / "main.c").write_text("int main(void) { return 0; }\n")
    (root / "docs" / "notes.txt").write_text("notes\n")
    before = _tree(root)
    flags = ("--op_compiler_cache_dir", str(project))
    for command in (["verify"], ["age"], ["stats", "--zero"], ["clear"], ["verify"], ["clear"]):
        status, out, err = run(capsys, *command, *flags)
        assert (status, out) == (1, ""), (command, err)
        assert err.startswith(f"opcache: error: no cache in {root}: it holds no .opcache")
        assert err.count("\n") == 1
    assert _tree(root) == before
    # Reading changes nothing, and is still allowed.
    assert run(capsys, "stats", *flags)[0] == 0
    assert run(capsys, "age", "--dry-run", *flags)[0] == 0
    assert _tree(root) == before


@pytest.mark.parametrize("command", [["verify"], ["age"], ["stats", "--zero"], ["clear"]])
def test_a_folder_put_in_the_roots_place_after_the_check_gets_nothing(
    cache_dir, tmp_path, capsys, monkeypatch, command
) -> None:
    """Another member of a team folder renames the cache away and a private folder
    into its name just after the command checked the root: nothing is written in
    it, nor deleted (the command fails with one line)."""
    from opcache import commands

    fill(cache_dir, tmp_path, 2)
    root = cache_dir / "kernel_cache"
    private = tmp_path / "private"
    (private / "src").mkdir(parents=True)
    (private / "src" / "main.c").write_text("int main;\n")
    real = commands.OpCache

    def swapped(settings, *args, **kwargs):  # type: ignore[no-untyped-def]
        root.rename(tmp_path / "cache.away")
        private.rename(root)
        return real(settings, *args, **kwargs)

    monkeypatch.setattr(commands, "OpCache", swapped)
    status, _, err = run(capsys, *command, "--op_compiler_cache_dir", str(cache_dir))
    assert _tree(root) == {"src": None, "src/main.c": b"int main;\n"}
    assert status in (0, 1) and "Traceback" not in err, err


def test_a_store_while_clear_takes_the_parts_is_counted(
    cache_dir, tmp_path, capsys, monkeypatch
) -> None:
    """clear moves a chip's buckets, then its counters: a store of another process
    in between waits for it (the counting lock), then is stored and counted."""
    from opcache.storage import local

    fill(cache_dir, tmp_path, 3)
    root = cache_dir / "kernel_cache"
    key = "ee" + "0" * 30
    storer = []
    rename = local._rename_if_there

    def counters_last(src, src_dir_fd, dst, dst_dir_fd):  # type: ignore[no-untyped-def]
        if src == local.SIZE_FOLDER and not storer:
            storer.append(
                run_script(
                    "import time\n"
                    "from opcache.storage.entry import make_manifest\n"
                    "from opcache.storage.local import LocalStore\n"
                    f"store, files = LocalStore({str(root)!r}), {{'a.o': b'x' * 1000}}\n"
                    f"manifest = make_manifest({key!r}, files, 1.0, {{}}, time.time())\n"
                    f"store.put({SOC!r}, {key!r}, manifest, files, now=time.time())\n",
                    wait=False,
                )
            )
            time.sleep(0.5)  # (time for it to store, if nothing holds it off)
        return rename(src, src_dir_fd, dst, dst_dir_fd)

    monkeypatch.setattr(local, "_rename_if_there", counters_last)
    names = local._names
    monkeypatch.setattr(local, "_names", lambda fd: sorted(names(fd), key=lambda n: n == "_size"))
    assert run(capsys, "clear", "--op_compiler_cache_dir", str(cache_dir))[0] == 0
    assert storer[0].wait(timeout=60) == 0
    store = LocalStore(root)
    assert (root / SOC / "ee" / key).is_dir()  # (there, and served)
    assert store.used(SOC)[0] == 1


def test_clear_takes_only_what_opcache_made_in_a_chip_folder(cache_dir, tmp_path, capsys) -> None:
    """A cache root shared with CANN (its kernels beside opcache's buckets), or a root
    named by mistake that one compile stored in (a home: ~/db/schema.sql): clear
    removes opcache's entries and counters, and nothing else."""
    keys = fill(cache_dir, tmp_path, 3)
    root = cache_dir / "kernel_cache"
    chip = root / SOC
    mine = {
        chip / "te_add_1.json": b"{}",  # CANN's, beside opcache's
        chip / "te_add_1.o": b"\x7fELF",
        chip / "db" / "schema.sql": b"create table t (x int);\n",  # named as a bucket is
        chip / keys[0][:2] / "notes.txt": b"mine\n",  # in one of opcache's buckets
        root / "Documents" / "thesis.tex": b"\\begin{document}\n",
    }
    for path, data in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (chip / "_size" / "appended").write_bytes(b"")  # (the quick hits' counts: opcache's)
    status, out, err = run(capsys, "clear", "--op_compiler_cache_dir", str(cache_dir))
    assert (status, out) == (0, f"cleared {SOC}\n"), err
    assert all(path.read_bytes() == data for path, data in mine.items())
    left = {key for key in keys if (chip / key[:2] / key).exists()}
    assert left == {keys[0]}  # (its bucket holds a file of yours: left whole)
    assert f"{chip}: left" in err
    status, out, _ = run(capsys, "stats", "--json", "--op_compiler_cache_dir", str(cache_dir))
    assert json.loads(out)["chips"][SOC]["entries"] == 1  # (counted again: the one kept)


def test_folders_named_as_no_chip_are_left_alone(cache_dir, tmp_path, capsys) -> None:
    """A cache root on its own file system holds ``lost+found``; people keep notes beside
    the chips.  No soc_version has such a name: clear, age, verify and stats leave them."""
    keys = fill(cache_dir, tmp_path, 2)
    root = cache_dir / "kernel_cache"
    others = [root / "lost+found", root / "notes by alice"]
    for folder in others:
        (folder / keys[0][:2] / keys[0]).mkdir(parents=True)
        (folder / "keep.txt").write_text("mine\n")
    flags = ("--op_compiler_cache_dir", str(cache_dir))
    for command in ("stats", "verify", "age"):
        status, out, err = run(capsys, command, *flags)
        assert status == 0, err
        assert "lost+found" not in out + err and "alice" not in out + err
    status, out, _ = run(capsys, "clear", *flags)
    assert (status, out) == (0, f"cleared {SOC}\n")
    assert entry_dirs(root) == {}
    for folder in others:
        assert (folder / "keep.txt").read_text() == "mine\n"
        assert (folder / keys[0][:2] / keys[0]).is_dir()


def test_a_cache_folder_that_is_a_file_is_one_error_line_exit_1(tmp_path, capsys) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    for command in ("stats", "age", "verify", "clear"):
        status, _, err = run(capsys, command, "--op_compiler_cache_dir", str(blocker / "x"))
        lines = err.strip().splitlines()
        assert status in (0, 1), command  # nothing there (0) or cannot look (1)
        if status == 1:
            assert len(lines) == 1 and lines[0].startswith("opcache: error: "), command
        assert "Traceback" not in err


MAINTENANCE = (["stats"], ["stats", "--json"], ["age"], ["age", "--dry-run"], ["verify"], ["clear"])


@pytest.mark.parametrize("command", MAINTENANCE, ids=" ".join)
def test_a_folder_without_a_cache_is_one_error_line_naming_the_root(
    cache_dir, tmp_path, capsys, command
) -> None:
    cache_dir.mkdir()  # a folder, but no cache in it
    status, out, err = run(capsys, *command, "--op_compiler_cache_dir", str(cache_dir))
    assert (status, out) == (1, "")
    (line,) = err.splitlines()
    root = cache_dir / "kernel_cache"
    assert line.startswith(f"opcache: error: no cache in {root} (from --op_compiler_cache_dir ")
    host_root = opcache.resolve_settings(environ={"ASCEND_CACHE_PATH": str(cache_dir)}).root
    assert f"ASCEND_CACHE_PATH={cache_dir} would name {host_root})" in line
    assert os.listdir(cache_dir) == []  # looking created nothing


def test_the_error_says_which_setting_named_the_root_and_where_the_other_points(
    cache_dir, tmp_path, capsys, monkeypatch
) -> None:
    fill(cache_dir, tmp_path, 1)  # in <dir>/kernel_cache: what --op_compiler_cache_dir names
    monkeypatch.setenv("ASCEND_CACHE_PATH", str(cache_dir))
    status, out, err = run(capsys, "stats")
    host_root = opcache.resolve_settings().root
    assert (status, out) == (1, "")
    assert err == (
        f"opcache: error: no cache in {host_root} (from ASCEND_CACHE_PATH={cache_dir}, "
        "which names <path>/kernel_cache_<host>; "
        f"--op_compiler_cache_dir {cache_dir} would name {cache_dir / 'kernel_cache'}, "
        "which holds a cache)\n"
    )
    monkeypatch.delenv("ASCEND_CACHE_PATH")
    status, out, err = run(capsys, "age")
    assert status == 1
    assert f"no cache in {tmp_path / 'atc_data' / 'kernel_cache'} (the default, " in err
    status, out, err = run(capsys, "stats", "--op_compiler_cache_dir", str(cache_dir))
    assert (status, err) == (0, "")
    assert out.startswith(f"cache folder: {cache_dir / 'kernel_cache'} (from --op_compiler")


def test_age_dry_run_or_verbose_says_one_line_when_nothing_would_go(
    cache_dir, tmp_path, capsys
) -> None:
    fill(cache_dir, tmp_path, 3)
    flags = ("--op_compiler_cache_dir", str(cache_dir))
    assert run(capsys, "age", "--dry-run", *flags) == (
        0,
        "in all: would remove 0 entries, 0 B, of 1 chip folder (dry run: nothing was removed)\n",
        "",
    )
    status, out, _ = run(capsys, "age", "--verbose", *flags)
    assert status == 0
    assert out.splitlines()[-1] == "in all: removed 0 entries, 0 B, of 1 chip folder"


def test_verify_says_the_counters_were_wrong_only_when_they_were(
    cache_dir, tmp_path, capsys
) -> None:
    keys = fill(cache_dir, tmp_path, 3)
    root = cache_dir / "kernel_cache"
    flags = ("--op_compiler_cache_dir", str(cache_dir))
    damaged = next(p for p in entry_dirs(root)[keys[0]].iterdir() if p.suffix == ".o")
    damaged.write_bytes(b"garbage")
    status, out, _ = run(capsys, "verify", *flags)
    lines = out.splitlines()
    assert status == 0
    assert lines[0].startswith(f"{SOC}: 3 entries checked, 1 corrupt removed, 2 entries kept, ")
    assert "counters" not in out  # verify's own removal is no drift
    assert lines[1] == "removed 0 leftovers of interrupted writers"
    LocalStore(root).set_used(SOC, 7, 1000)  # counters that drifted
    status, out, _ = run(capsys, "verify", *flags)
    assert out.splitlines()[0].endswith(
        "; the counters were wrong (they said 7 entries, 1000 B) and now match"
    )
    shutil.rmtree(entry_dirs(root)[keys[1]])
    LocalStore(root).set_used(SOC, 1, LocalStore(root).used(SOC)[1])
    status, out, _ = run(capsys, "verify", *flags)
    assert out.startswith(f"{SOC}: 1 entry checked, 0 corrupt removed, 1 entry kept, ")


def test_one_of_a_thing_is_said_in_the_singular(cache_dir, tmp_path, capsys) -> None:
    fill(cache_dir, tmp_path, 6, clock=time.time() - 7200)  # 1.2 MB, all two hours old
    (cache_dir / "kernel_cache" / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=1\nremain_cache_size_ratio=100\n"
    )
    status, out, err = run(capsys, "age", "-v", "--op_compiler_cache_dir", str(cache_dir))
    assert status == 0
    assert f"{SOC}: removed 1 entry, " in out
    assert "in all: removed 1 entry, " in out and "of 1 chip folder" in out
    assert "aged " in err  # the -v record of the pass
    assert not re.search(r"\b1 (entries|leftovers|chip folders|errors)\b", out + err)
