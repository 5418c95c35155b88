"""``opcache cann stats|age|verify`` over CANN's own kernel_cache, built as CANN writes it.

The folders are written by ``helpers_cann`` the way CANN's graph engine writes
them (lock, binary, header, json, each through a ``.temp`` and a rename), with
access times set as CANN's hits set them.  Locks are held by real other
processes with CANN's fcntl locks; one writer is really killed half way.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_cann import (
    SOC,
    base,
    cann,
    cann_json,
    held_by_other_process,
    kernel_name,
    lock_probe,
    set_access,
    set_times,
    store_entry,
    store_mix_entry,
    store_prebuild,
    temp_name,
    write_ini,
    writer_killed_before_json,
)

import opcache
from opcache import cann_cache, cann_format, fsutil
from opcache.cli import main

__all__ = ["base"]  # the fixture, from helpers_cann

KIB = 1024
ENTRY = 300 * KIB  # every entry's binaries: the other files are tiny beside them
HOUR = 3600


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def open_cache(base: Path, **kw) -> cann_cache.CannCache:
    settings = opcache.resolve_settings(op_compiler_cache_dir=str(base))
    return cann_cache.open_cann_cache(settings, environ={}, **kw)


class Folder:
    """A chip folder with entries whose last access is known."""

    def __init__(self, base: Path) -> None:
        self.root = base / "kernel_cache"
        self.chip = self.root / SOC
        self.now = time.time()
        self.entries: dict[str, list[Path]] = {}
        self.killed_pid = 0

    def entry(self, label: str, hours_ago: float, **kw: object) -> str:
        kernel = kernel_name("Add", label)
        paths = store_entry(self.chip, kernel, os.urandom(ENTRY), **kw)  # type: ignore[arg-type]
        set_access(paths[:2], self.now - hours_ago * HOUR)
        self.entries[label] = paths
        return kernel

    def mix(self, label: str, hours_ago: float) -> str:
        kernel = kernel_name("MatMul", label)
        paths = store_mix_entry(self.chip, kernel, os.urandom(ENTRY // 2), os.urandom(ENTRY // 2))
        set_access(paths, self.now - hours_ago * HOUR)
        self.entries[label] = paths
        return kernel

    def names(self) -> set[str]:
        return {p.name for p in self.chip.iterdir()}

    def atimes(self) -> dict[str, int]:
        return {p.name: p.stat().st_atime_ns for p in self.chip.iterdir()}


def aging_folder(base: Path) -> Folder:
    """Entries oldest first: old1, mix, old2, locked, old3, badsha, recent (10 min), fresh.

    Beside them CANN's small files that aging never touches: a header, a
    prebuild result, lock files, a killed writer's orphan and temp.
    """
    f = Folder(base)
    f.entry("old1", 5, header=b"// header\n")
    f.mix("mix", 4.5)
    f.entry("old2", 4)
    f.entry("locked", 3)
    f.entry("old3", 2)
    f.entry("badsha", 1, sha256="0" * 64)
    f.entry("recent", 10 / 60)  # touched 10 minutes ago
    f.entry("fresh", 0)
    set_access([store_prebuild(f.chip, kernel_name("Add", "old1"))], f.now - 6 * HOUR)
    writer_killed_before_json(f.chip, kernel_name("Add", "killed"), os.urandom(4 * KIB))
    return f


def files_of(f: Folder, *labels: str) -> set[str]:
    return {p.name for label in labels for p in f.entries[label]} - {
        p.name for p in f.entries["old1"] if p.suffix == ".h"
    }


# -- aging ------------------------------------------------------------------------------


def test_age_removes_exactly_what_cann_removes_and_nothing_young_or_locked(base, capsys):
    f = aging_folder(base)
    write_ini(f.root, max_mb=1, ratio=50)  # keep 512 KiB: far less than the old entries
    before = f.names()
    used = sum(p.stat().st_size for p in f.chip.iterdir())
    lock = f.chip / f"{kernel_name('Add', 'locked')}.lock"
    with held_by_other_process(lock):
        status, report = cann_json(capsys, base, "age")
    assert status == 0
    chip = report["chips"][SOC]
    gone = files_of(f, "old1", "mix", "old2", "old3", "badsha")
    assert f.names() == before - gone | {cann_format.DEL_LOCK}  # made as CANN makes it
    assert chip["removed"] == [kernel_name(*k) for k in (
        ("Add", "old1"), ("MatMul", "mix"), ("Add", "old2"), ("Add", "old3"), ("Add", "badsha"),
    )]  # fmt: skip
    assert chip["kept_locked"] == [kernel_name("Add", "locked")]
    assert (chip["removed_count"], chip["kept_locked_count"], chip["names_listed"]) == (5, 1, True)
    assert chip["stopped_at_recent"] is True  # "recent" (10 minutes) ended the pass
    assert chip["used_bytes"] == used
    assert chip["to_free"] == used - 1024 * KIB * 50 // 100
    assert chip["removed_bytes"] == used - sum(p.stat().st_size for p in f.chip.iterdir())
    # CANN never ages headers, prebuild results, locks, temps or orphans:
    assert f"{kernel_name('Add', 'old1')}.h" in f.names()
    assert f"{kernel_name('Add', 'old1')}_pre.json" in f.names()
    assert f"{kernel_name('Add', 'killed')}.o" in f.names()
    assert any(n.endswith(".temp") for n in f.names())


def test_age_stops_once_enough_is_freed(base, capsys):
    f = aging_folder(base)
    write_ini(f.root, max_mb=2, ratio=80)  # to free: used - 1.6 MiB, about 2.6 entries
    before = f.names()
    status, out, err = cann(capsys, base, "age")
    assert (status, err) == (0, "")
    assert f.names() == before - files_of(f, "old1", "mix", "old2") | {cann_format.DEL_LOCK}
    assert out.startswith(f"{SOC}: removed 3 entries, ")


def test_age_counts_what_it_removes_and_names_it_with_verbose_or_json(base, capsys):
    """A cron job's report is counts and sizes: naming every entry removed held about
    80 bytes each, 54-87 MB at a million entries."""
    f = aging_folder(base)
    write_ini(f.root, max_mb=2, ratio=80)  # 3 entries go, as above
    gone = [kernel_name(*k) for k in (("Add", "old1"), ("MatMul", "mix"), ("Add", "old2"))]
    status, out, err = cann(capsys, base, "age", "--dry-run")
    assert (status, err) == (0, "")
    assert out.startswith(f"{SOC}: would remove 3 entries, ") and out.count("\n") == 1
    status, out, _ = cann(capsys, base, "age", "--dry-run", "-v")
    named = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("  would")]
    assert status == 0 and named == gone
    chip = cann_json(capsys, base, "age", "--dry-run")[1]["chips"][SOC]
    assert (chip["removed"], chip["removed_count"]) == (gone, 3)
    with held_by_other_process(f.chip / f"{kernel_name('Add', 'old2')}.lock"):
        status, out, _ = cann(capsys, base, "age")
    assert out.startswith(f"{SOC}: removed 3 entries, ") and "kept 1 entry a writer holds" in out
    assert f.names().isdisjoint(files_of(f, "old1", "mix", "locked"))


def test_age_under_the_limit_or_with_aging_off_removes_nothing_and_says_nothing(base, capsys):
    f = aging_folder(base)
    before = f.names()
    assert cann(capsys, base, "age") == (0, "", "")  # 2.4 MB under the default 500 MB
    write_ini(f.root, max_mb=-1, ratio=50)
    status, report = cann_json(capsys, base, "age")
    assert status == 0
    assert report["chips"][SOC]["skipped"] == "aging is off (max_op_cache_size -1)"
    assert f.names() == before


def test_age_never_chmods_a_file_linked_in_as_its_aging_lock(base, tmp_path, capsys):
    """A member of a shared cache who links a file of ours from elsewhere in as
    op_cache_file_del.lock does not get our aging to narrow its mode (CANN's 0640)."""
    f = aging_folder(base)
    write_ini(f.root, max_mb=1, ratio=50)
    notes = tmp_path / "team-notes.txt"
    notes.write_text("the team writes here\n")
    notes.chmod(0o660)
    os.link(notes, f.chip / cann_format.DEL_LOCK)
    status, report = cann_json(capsys, base, "age")
    assert status == 0 and report["chips"][SOC]["removed"]  # (the lock is still taken)
    assert notes.stat().st_mode & 0o7777 == 0o660


def test_age_never_chmods_a_file_of_ours_moved_in_as_its_aging_lock(base, capsys):
    """A member who may rename in a shared chip folder moves a secret of ours (0600)
    in as op_cache_file_del.lock, and back once our chmod (CANN's 0640) opened it
    to the group: only a lock file the pass made is chmodded."""
    f = aging_folder(base)
    write_ini(f.root, max_mb=1, ratio=50)
    secret = f.chip / cann_format.DEL_LOCK
    secret.write_text("a private key\n")
    secret.chmod(0o600)
    status, report = cann_json(capsys, base, "age")
    assert status == 0 and report["chips"][SOC]["removed"]  # (the lock is still taken)
    assert secret.stat().st_mode & 0o7777 == 0o600


def test_age_skips_while_another_process_holds_cann_s_aging_lock(base, capsys):
    f = aging_folder(base)
    write_ini(f.root, max_mb=1, ratio=50)
    with held_by_other_process(f.chip / cann_format.DEL_LOCK):
        before = f.names()
        status, report = cann_json(capsys, base, "age")
        assert status == 0
        assert "another process holds op_cache_file_del.lock" in report["chips"][SOC]["skipped"]
        assert f.names() == before
        status, report = cann_json(capsys, base, "age", "--dry-run")
        assert report["chips"][SOC]["skipped"] and f.names() == before
    assert cann_json(capsys, base, "age")[1]["chips"][SOC]["removed"]  # free again: it ages


def test_age_takes_the_aging_lock_as_cann_does(base, capsys):
    f = aging_folder(base)
    write_ini(f.root, max_mb=1, ratio=50)
    cann(capsys, base, "age")
    lock = f.chip / cann_format.DEL_LOCK
    assert lock.stat().st_mode & 0o777 == 0o640 and lock.stat().st_size == 0
    # A CANN process aging at the same time holds an fcntl lock on the same file:
    code = (
        "import fcntl, sys\n"
        f"f = open({str(lock)!r}, 'a+')\n"
        "fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "print('locked', flush=True); sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    try:
        f.entry("later", 3)
        f.entry("later2", 3)  # over the limit again
        assert cann_json(capsys, base, "age")[1]["chips"][SOC]["skipped"]
    finally:
        holder.communicate("")


def test_age_keeps_an_entry_accessed_after_it_was_collected(base):
    f = aging_folder(base)
    write_ini(f.root, max_mb=1, ratio=50)
    old1 = f.entries["old1"][0]
    calls = []

    def clock() -> float:
        if not calls:  # CANN's hit on old1 between the collection and the deletion
            set_access([old1], time.time())
        calls.append(1)
        return time.time()

    report = open_cache(base, clock=clock).age()["chips"][SOC]
    assert report["kept_accessed"] == [kernel_name("Add", "old1")]
    assert old1.exists() and kernel_name("Add", "old1") not in report["removed"]
    assert kernel_name("Add", "old2") in report["removed"]


def test_age_dry_run_removes_nothing_and_reports_what_it_would(base, capsys):
    f = aging_folder(base)
    write_ini(f.root, max_mb=1, ratio=50)
    before = f.names()
    status, out, err = cann(capsys, base, "age", "--dry-run")
    assert (status, err) == (0, "") and f.names() == before
    assert out.startswith(f"{SOC}: would remove 6 entries, ")  # "locked" is free here
    assert cann_json(capsys, base, "age", "--dry-run")[1]["chips"][SOC]["dry_run"] is True


def test_age_dry_run_on_a_read_only_mount_says_what_a_pass_would_remove(base, capsys, monkeypatch):
    """A folder mounted read-only (a backup, a snapshot): the dry run opened the aging
    lock to write, failed with EROFS, and said "would remove 0 entries"."""
    f = aging_folder(base)
    write_ini(f.root, max_mb=1, ratio=50)
    (f.chip / cann_format.DEL_LOCK).touch()  # (left by CANN before the mount)
    real_open = fsutil.open_regular

    def read_only(path, flags=os.O_RDONLY, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(fsutil, "open_regular", read_only)
    status, out, err = cann(capsys, base, "age", "--dry-run")
    assert (status, err) == (0, "")
    assert out.startswith(f"{SOC}: would remove 6 entries, ")


# -- reading without disturbing -------------------------------------------------------------


def test_stats_verify_and_age_never_move_an_access_time(base, capsys):
    """On this relatime mount a plain read of these files moves their atime (atime < ctime)."""
    f = aging_folder(base)
    write_ini(f.root, max_mb=3, ratio=99)  # over the limit, but every entry stays
    before = f.atimes()
    cann(capsys, base, "stats")
    cann(capsys, base, "verify")
    cann(capsys, base, "age", "--dry-run")
    assert f.atimes() == before


def test_links_are_never_followed_counted_or_deleted(base, tmp_path, capsys):
    f = Folder(base)
    f.entry("old", 5)
    outside = tmp_path / "outside"
    outside.mkdir()
    big = outside / "big.o"
    big.write_bytes(b"x" * ENTRY)
    planted = store_entry(outside, "te_add_planted", b"y" * ENTRY)
    set_access(planted, f.now - 9 * HOUR)
    (f.chip / "te_add_planted.json").symlink_to(planted[0])
    (f.chip / "te_add_planted.o").symlink_to(planted[1])
    (f.chip / "te_add_big.o").symlink_to(big)
    (f.root / "Ascend310P3").symlink_to(outside)  # a linked chip folder
    write_ini(f.root, max_mb=1, ratio=1)
    report = cann_json(capsys, base, "stats")[1]
    chip = report["chips"][SOC]
    assert chip["links"] == 3 and chip["used_bytes"] < 2 * ENTRY
    assert "Ascend310P3" not in report["chips"]
    cann(capsys, base, "age")
    cann(capsys, base, "verify", "--fix")
    assert big.exists() and all(p.exists() for p in planted)
    assert all(p.is_symlink() for p in (f.chip / "te_add_planted.json", f.chip / "te_add_big.o"))


def test_subfolders_are_counted_as_cann_counts_them_but_left_alone(base, capsys):
    f = Folder(base)
    f.entry("old", 5)
    sub = f.chip / "stray" / "deeper"
    sub.mkdir(parents=True)
    (sub / "te_x.json").write_text("{}")
    (sub / "data.bin").write_bytes(b"z" * 3 * ENTRY)
    set_times([sub / "te_x.json"], f.now - 9 * HOUR)
    write_ini(f.root, max_mb=1, ratio=1)
    chip = cann_json(capsys, base, "stats")[1]["chips"][SOC]
    assert (chip["subfolder_files"], chip["subfolder_bytes"]) == (2, 3 * ENTRY + 2)
    assert chip["used_bytes"] > 1024 * KIB  # over the limit only with the subfolder counted
    status, out, _ = cann(capsys, base, "age")
    assert status == 0 and out.startswith(f"{SOC}: removed 1 entry, ")  # one, in the singular
    assert not [p for p in f.entries["old"] if p.exists()]
    assert (sub / "te_x.json").exists() and (sub / "data.bin").exists()


# -- stats ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [(), ("--check",)], ids=["by name", "check"])
def test_stats_counts_every_kind_of_file_as_cann_counts_them(base, capsys, flags):
    f = aging_folder(base)
    (f.chip / f"{kernel_name('Add', 'gone')}.o").write_bytes(b"o" * 100)  # an orphan
    (f.chip / "notes.txt").write_text("hello")
    status, report = cann_json(capsys, base, "stats", *flags)
    assert status == 0 and report["checked"] == bool(flags)
    chip = report["chips"][SOC]
    every_file = list(f.chip.iterdir())
    assert chip["used_bytes"] == sum(p.stat().st_size for p in every_file)
    assert chip["files"] == len(every_file)
    assert chip["entries"] == 8 and chip["idle_entries"] == 6  # all but "recent" and "fresh"
    # Whether CANN reuses an entry needs its json read (sha256 is verify's job).
    assert chip["broken_entries"] == report["total"]["broken_entries"] == (0 if flags else None)
    # What aging deletes with the entries; told by name, a mix entry's main binary
    # too (CANN's aging leaves it: only its json says it is no sub-json's).
    aged = files_of(f, *f.entries)
    mix_main = f.chip / f"{kernel_name('MatMul', 'mix')}.o"
    by_name = {mix_main.name} if not flags else set()
    assert chip["entry_bytes"] == sum((f.chip / n).stat().st_size for n in aged | by_name)
    header = f.chip / f"{kernel_name('Add', 'old1')}.h"
    assert (chip["headers"], chip["header_bytes"]) == (1, header.stat().st_size)
    assert chip["prebuild"] == 1
    assert chip["locks"] == 10  # 8 entries, the prebuild result, the killed writer
    assert chip["temps"] == 1 and chip["orphans"] == 2 and chip["other"] == 1
    assert (
        chip["orphan_bytes"] == 100 + (f.chip / f"{kernel_name('Add', 'killed')}.o").stat().st_size
    )
    assert chip["oldest_access"] == int(f.now - 5 * HOUR)
    assert chip["newest_access"] == int(f.now)
    assert chip["limit_bytes"] == 500 * 1024 * KIB and chip["over_limit"] is False
    assert report["total"]["entries"] == 8
    status, out, _ = cann(capsys, base, "stats", *flags)
    assert f"{SOC}: 8 entries" in out and "orphans: 2" in out and "note: access times" in out
    assert ("0 unusable" in out) == bool(flags) != ("note: files told by their names" in out)


def test_stats_without_check_reads_no_file(base, capsys, monkeypatch):
    """Counting needs names and lstat only: a json parsed cost 74 us an entry (74 s of
    CPU at a million), an unusable one is told only by --check."""
    f = aging_folder(base)
    f.entry("unusable", 2, sha256="")
    opened = []
    monkeypatch.setattr(cann_format, "open_quietly", lambda fd, name: opened.append(name))
    status, report = cann_json(capsys, base, "stats")
    assert (status, opened) == (0, [])
    assert report["chips"][SOC]["entries"] == 9
    monkeypatch.undo()
    status, report = cann_json(capsys, base, "stats", "--check")
    assert (status, report["chips"][SOC]["broken_entries"]) == (0, 1)


def test_a_file_name_holding_a_nul_is_a_damaged_entry_never_a_traceback(base, capsys):
    """A json whose binFileName (or a sub-json's, or a jsonFileName) holds a NUL names
    no file: os calls raise ValueError on it.  The entry is damaged, as CANN's hit
    check finds it; verify, stats --check and age go on."""
    f = Folder(base)
    f.entry("good", 1)
    f.chip.joinpath("k.json").write_text(
        json.dumps({"binFileName": "k\0", "binFileSuffix": ".o", "kernelName": "k", "sha256": "00"})
    )
    f.chip.joinpath("k.o").write_bytes(b"k" * 10)
    f.chip.joinpath("m.json").write_text(
        json.dumps(
            {
                "jsonList": [{"jsonFileName": "m\0.json"}, {"jsonFileName": "s.json"}],
                **{"binFileName": "m", "binFileSuffix": ".o", "kernelName": "m", "sha256": "00"},
            }
        )
    )
    f.chip.joinpath("s.json").write_text(json.dumps({"binFileName": "s\0", "binFileSuffix": ".o"}))
    f.chip.joinpath("m.o").write_bytes(b"m" * 10)
    status, report = cann_json(capsys, base, "verify")
    assert status == 1
    why = {x["name"]: x["why"] for x in report["chips"][SOC]["faults"] if x["kind"] == "corrupt"}
    assert "NUL" in why["k"] and "NUL" in why["s"]
    assert "m" in why  # (its sha256)
    status, report = cann_json(capsys, base, "stats", "--check")
    assert (status, report["chips"][SOC]["broken_entries"]) == (0, 2)  # (not m: its sha256)
    assert cann(capsys, base, "age")[0] == 0
    status, report = cann_json(capsys, base, "verify", "--fix")
    assert not f.chip.joinpath("k.json").exists()
    assert all(p.exists() for p in f.entries["good"])


def test_stats_never_follows_opens_or_waits_on_planted_files(base, tmp_path):
    """A link, a FIFO named as an entry json or as a binary, another user's entry: counted
    by lstat, never followed nor opened (a FIFO's open would wait for a writer forever);
    each run is a real process, bounded by a timeout."""
    f = Folder(base)
    f.entry("one", 1)
    f.entry("theirs", 1)
    for path in f.entries["theirs"]:
        path.chmod(0o600)
        if os.geteuid() == 0:  # (only root can give a file to another user)
            os.chown(path, 65534, 65534)
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (f.chip / f"{kernel_name('Add', 'link')}.json").symlink_to(outside)
    os.mkfifo(f.chip / f"{kernel_name('Add', 'fifo')}.json")
    os.mkfifo(f.chip / f"{kernel_name('Add', 'one')}.so")
    for flags in ((), ("--check",)):
        done = subprocess.run(
            [sys.executable, "-m", "opcache", "cann", "stats", "--json", *flags,
             "--op_compiler_cache_dir", str(base)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        chip = json.loads(done.stdout)["chips"][SOC]
        assert (chip["entries"], chip["links"]) == (2, 3), flags
        regular = [p for p in f.chip.iterdir() if p.is_file() and not p.is_symlink()]
        assert chip["used_bytes"] == sum(p.stat().st_size for p in regular)
        assert chip["entry_bytes"] == sum(
            p.stat().st_size for label in ("one", "theirs") for p in f.entries[label]
        )
    assert outside.read_text() == "{}"


def test_limits_follow_cann_s_ini_rules(base, capsys, monkeypatch):
    f = Folder(base)
    f.entry("one", 1)
    limits = cann_json(capsys, base, "stats")[1]["limits"]
    assert (limits["max_op_cache_size_mb"], limits["remain_cache_size_ratio"]) == (500, 50)
    monkeypatch.setenv("ASCEND_MAX_OP_CACHE_SIZE", "7")
    assert cann_json(capsys, base, "stats")[1]["limits"]["max_op_cache_size_mb"] == 7
    # A hand-made ini with only the size keys: CANN ignores it, and so does this.
    (f.root / "op_cache.ini").write_text(
        "[op_compiler_cache]\nmax_op_cache_size=3\nremain_cache_size_ratio=20\n"
    )
    limits = cann_json(capsys, base, "stats")[1]["limits"]
    assert limits["max_op_cache_size_mb"] == 7 and "ignored" in limits["ini_ignored"]
    write_ini(f.root, max_mb=3, ratio=20)  # as CANN writes it, plus the size keys
    limits = cann_json(capsys, base, "stats")[1]["limits"]
    assert (limits["max_op_cache_size_mb"], limits["remain_cache_size_ratio"]) == (3, 20)
    assert limits["sources"]["max_op_cache_size_mb"] == "op_cache.ini"
    assert limits["ini_ignored"] is None


# -- verify -----------------------------------------------------------------------------------


def faulty_folder(base: Path) -> Folder:
    f = Folder(base)
    f.entry("good", 1, header=b"// h\n")
    f.mix("mix", 1)
    f.entry("badsha", 1, sha256="0" * 64)
    f.killed_pid = writer_killed_before_json(f.chip, kernel_name("Add", "killed"), b"k" * 4000)
    killed = [p for p in f.chip.iterdir() if p.name.startswith(kernel_name("Add", "killed"))]
    set_times(killed, f.now - 300)  # killed five minutes ago
    garbled = f.chip / f"{kernel_name('Add', 'garbled')}.json"
    garbled.write_text('{"binFileName": ')
    (f.chip / f"{kernel_name('Add', 'garbled')}.o").write_bytes(b"g" * 10)
    store_entry(f.chip, kernel_name("Add", "nobin"), b"n" * 10)
    (f.chip / f"{kernel_name('Add', 'nobin')}.o").unlink()
    orphan = f.chip / f"{kernel_name('Add', 'orphan')}.o"
    orphan.write_bytes(b"o" * 10)
    set_times([orphan], f.now - 2 * HOUR)
    (f.chip / f"{kernel_name('Add', 'young')}.o").write_bytes(b"y" * 10)  # being written
    live = f.chip / temp_name(f"{kernel_name('Add', 'live')}.o")  # this process: alive
    live.write_bytes(b"t")
    old_live = f.chip / temp_name(f"{kernel_name('Add', 'slow')}.o", usec=1)
    old_live.write_bytes(b"t")
    set_times([old_live], f.now - 2 * HOUR)
    set_times(
        [store_prebuild(f.chip, kernel_name("Add", "good"))], f.now - 2 * HOUR
    )  # has its entry
    set_times([store_prebuild(f.chip, kernel_name("Add", "lonely"))], f.now - 2 * HOUR)
    store_prebuild(f.chip, kernel_name("Add", "new"))  # no entry, but just written
    f.entry("lockedbad", 1, sha256="1" * 64)
    return f


EXPECTED_FAULTS = {
    ("corrupt", "badsha"),
    ("corrupt", "garbled"),
    ("corrupt", "nobin"),
    ("corrupt", "lockedbad"),
    ("orphan", "killed"),
    ("orphan", "orphan"),
    ("stale temp", "killed"),
    ("stale temp", "slow"),
    ("old prebuild", "lonely"),
}


def found_faults(chip: dict) -> set[tuple[str, str]]:
    labels = {
        kernel_name("Add", x): x
        for x in ("badsha", "garbled", "nobin", "lockedbad", "killed", "orphan", "slow", "lonely")
    }
    out = set()
    for fault in chip["faults"]:
        kernel = next(k for k in labels if fault["name"].startswith(k))
        out.add((fault["kind"], labels[kernel]))
    return out


def test_verify_finds_every_fault_and_fix_removes_them_but_not_a_locked_one(base, capsys):
    f = faulty_folder(base)
    lock = f.chip / f"{kernel_name('Add', 'lockedbad')}.lock"
    before = f.names()
    status, report = cann_json(capsys, base, "verify")
    assert status == 1  # faults found and left: a cron job notices
    chip = report["chips"][SOC]
    assert found_faults(chip) == EXPECTED_FAULTS
    assert f.names() == before
    why = {found_faults({"faults": [x]}).pop(): x["why"] for x in chip["faults"]}
    assert "sha256" in why[("corrupt", "badsha")]
    assert "does not parse" in why[("corrupt", "garbled")]
    assert "missing" in why[("corrupt", "nobin")]
    assert why[("stale temp", "killed")] == f"its writer (pid {f.killed_pid}) is not running"
    assert why[("stale temp", "slow")] == "untouched for 120 minutes"
    assert why[("old prebuild", "lonely")].endswith("unused for 120 minutes")

    with held_by_other_process(lock):
        status, report = cann_json(capsys, base, "verify", "--fix")
    assert status == 1  # the locked entry is still there
    chip = report["chips"][SOC]
    kept = [x for x in chip["faults"] if not x["removed"]]
    assert [(x["kind"], x["kept"]) for x in kept] == [
        ("corrupt", f"{kernel_name('Add', 'lockedbad')}.lock is held by a writer")
    ]
    left = f.names()
    for label in ("good", "mix", "young", "live", "new"):
        assert any(n.startswith(kernel_name("Add" if label != "mix" else "MatMul", label))
                   for n in left), label  # fmt: skip
    assert not any(n.startswith(kernel_name("Add", "badsha")) and not n.endswith(".lock")
                   for n in left)  # fmt: skip
    assert f"{kernel_name('Add', 'killed')}.o" not in left
    assert f"{kernel_name('Add', 'good')}_pre.json" in left
    assert f"{kernel_name('Add', 'lonely')}_pre.json" not in left

    status, out, err = cann(capsys, base, "verify", "--fix")
    assert (status, err) == (0, "")
    assert f"{SOC}: " in out and "1 fault, 1 removed" in out
    assert cann(capsys, base, "verify")[0] == 0  # clean now


def test_a_root_cann_never_compiled_in_loses_nothing(base, capsys):
    """A folder of yours put under the root's name (another member of a team folder
    renames the cache away and yours in), or a project named kernel_cache: its
    folders are named as chips may be (src, build) and its files look like a
    CANN entry's orphans.  Without op_cache.ini, which CANN writes at its first
    compile, cann verify --fix and cann age delete nothing; reading still works."""
    root = base / "kernel_cache"
    files = {
        root / "src" / "util.h": b"int f(void);\n",
        root / "build" / "main.o": b"\x7fELF main",
        root / "build" / "libx.so": b"\x7fELF lib",
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    set_times(list(files), time.time() - 10 * HOUR)
    for action in (("verify", "--fix"), ("age",)):
        status, out, err = cann(capsys, base, *action)
        assert (status, out) == (1, ""), err
        assert err == (
            f"opcache: error: no CANN kernel cache at {root}: it holds no op_cache.ini, "
            f"which CANN writes at its first compile there, so nothing in it is "
            f"{'fixed' if action[0] == 'verify' else 'aged'}\n"
        )
    assert all(path.read_bytes() == data for path, data in files.items())
    status, report = cann_json(capsys, base, "verify")
    assert report["chips"]["build"]["faults"]  # (found, and left: no --fix)
    assert cann_json(capsys, base, "age", "--dry-run")[0] == 0
    assert all(path.read_bytes() == data for path, data in files.items())
    # An admin's shared op_cache.ini, linked in, is CANN's mark all the same (its
    # sizes are not read through the link: a warning says so).
    write_ini(base.parent / "shared")
    (root / "op_cache.ini").symlink_to(base.parent / "shared" / "op_cache.ini")
    cann(capsys, base, "verify", "--fix")
    assert not (root / "build" / "main.o").exists()


def test_verify_never_removes_an_orphan_whose_writer_holds_the_lock(base, capsys):
    f = Folder(base)
    kernel = kernel_name("Add", "writing")
    binary = f.chip / f"{kernel}.o"
    f.chip.mkdir(parents=True)
    write_ini(f.chip.parent)  # (as its compile session began)
    binary.write_bytes(b"w" * 100)
    set_times([binary], f.now - HOUR)  # a slow writer: its binary is there, its json not yet
    (f.chip / f"{kernel}.lock").touch()
    with held_by_other_process(f.chip / f"{kernel}.lock"):
        status, report = cann_json(capsys, base, "verify", "--fix")
    assert status == 1 and binary.exists()
    assert report["chips"][SOC]["faults"][0]["kept"] == f"{kernel}.lock is held by a writer"


def test_verify_checks_the_sha256_of_every_binary(base, capsys):
    f = Folder(base)
    f.entry("a", 1)
    f.mix("m", 1)
    status, report = cann_json(capsys, base, "verify")
    assert (status, report["chips"][SOC]["checked"], report["chips"][SOC]["faults"]) == (0, 2, [])
    aic = f.chip / f"{kernel_name('MatMul', 'm')}_mix_aic.o"
    aic.write_bytes(b"flipped" + aic.read_bytes()[7:])  # CANN's hit reads the main binary only
    assert cann_json(capsys, base, "verify")[1]["chips"][SOC]["faults"] == []
    main = f.chip / f"{kernel_name('MatMul', 'm')}.o"
    main.write_bytes(b"flipped" + main.read_bytes()[7:])
    binary = f.entries["a"][1]
    data = binary.read_bytes()  # (random bytes: a last byte set to "!" was one once in 256)
    binary.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    faults = cann_json(capsys, base, "verify")[1]["chips"][SOC]["faults"]
    assert sorted(x["name"] for x in faults) == [
        kernel_name("Add", "a"),
        kernel_name("MatMul", "m"),
    ]


# -- where the cache is, and what is refused -------------------------------------------------


def test_ascend_cache_path_is_used_as_cann_uses_it_without_a_host_suffix(
    base, tmp_path, capsys, monkeypatch
):
    shared = tmp_path / "shared"  # (not the test's usual base: found through the variable)
    Folder(shared).entry("one", 1)
    monkeypatch.setenv("ASCEND_CACHE_PATH", str(shared))
    status, out, err = run(capsys, "cann", "stats", "--json")
    assert status == 0, err
    report = json.loads(out)
    assert report["root"] == str(shared / "kernel_cache") and report["total"]["entries"] == 1
    monkeypatch.delenv("ASCEND_CACHE_PATH")
    Folder(tmp_path / "atc_data").entry("two", 1)
    assert json.loads(run(capsys, "cann", "stats", "--json")[1])["root"] == str(
        tmp_path / "atc_data" / "kernel_cache"
    )


def test_a_folder_without_a_cann_cache_says_so_and_exits_1(base, capsys):
    status, out, err = cann(capsys, base, "age")
    assert (status, out) == (1, "")
    where = base / "kernel_cache"
    assert err == f"opcache: error: no CANN kernel cache at {where}: no such folder\n"
    (base / "kernel_cache").mkdir(parents=True)
    status, _, err = cann(capsys, base, "stats")
    assert status == 1 and err.count("\n") == 1 and "holds no chip folder" in err
    Folder(base).entry("one", 1)
    status, _, err = cann(capsys, base, "verify", "--soc_version", "Ascend310P3")
    assert status == 1 and "no CANN kernel cache for Ascend310P3" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["cann", "clean"],
        ["cann"],
        ["cann", "stats", "--fix"],
        ["cann", "age", "--check"],
        ["cann", "verify", "--dry-run"],
        ["cann", "age", "--soc_version", "../etc"],
        ["cann", "age", "--op_compiler_cache_dir", "/tmp/with space"],
    ],
)
def test_user_errors_are_one_line_and_exit_2(base, capsys, argv):
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    assert err.startswith("opcache: error: ") and err.count("\n") == 1, err


def test_folders_others_can_write_are_refused(base, capsys):
    f = aging_folder(base)
    write_ini(f.root, max_mb=1, ratio=50)
    before = f.names()
    f.chip.chmod(0o777)
    status, report = cann_json(capsys, base, "age")
    assert status == 1 and "writable by others" in report["chips"][SOC]["error"]
    assert f.names() == before
    f.chip.chmod(0o750)
    f.root.chmod(0o777)
    status, out, err = cann(capsys, base, "verify", "--fix")
    assert status == 1 and out == "" and "writable by others" in err
    assert err.startswith("opcache: error: ") and f.names() == before


def test_a_json_report_with_stdout_closed_ends_quietly(base) -> None:
    # (cron may start it so: nothing to print to is no traceback)
    Folder(base).entry("one", 1)
    done = subprocess.run(
        ["sh", "-c", '"$0" -m opcache cann stats --json --op_compiler_cache_dir "$1" >&-',
         sys.executable, str(base)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")


def _age_asking_for_the_lock(base, monkeypatch, aging_lock):  # type: ignore[no-untyped-def]
    """One ``cann age`` of the chip, another process asked before each removal whether
    ``aging_lock`` is held: (the chip's report, each answer)."""
    seen = []
    remove = cann_cache._remove

    def probing(fd, names, errors):  # type: ignore[no-untyped-def]
        seen.append(lock_probe(aging_lock))
        return remove(fd, names, errors)

    monkeypatch.setattr(cann_cache, "_remove", probing)
    return open_cache(base).age(SOC)["chips"][SOC], seen


def test_age_keeps_its_aging_lock_past_entries_whose_lock_is_that_file(base, monkeypatch):
    f = Folder(base)
    write_ini(f.root, max_mb=1, ratio=10)
    aging_lock = f.chip / cann_format.DEL_LOCK
    named = store_entry(f.chip, "op_cache_file_del", os.urandom(ENTRY))  # its lock is aging's
    set_access(named, f.now - 6 * HOUR)
    linked = f.entry("linked", 5)
    os.unlink(f.chip / f"{linked}.lock")
    os.link(aging_lock, f.chip / f"{linked}.lock")  # a hard link to the aging lock
    after = f.entry("after", 4)
    f.entry("fresh", 0)
    chip, seen = _age_asking_for_the_lock(base, monkeypatch, aging_lock)
    assert chip["removed"] == [after] and seen == ["held"]
    assert chip["kept_locked"] == ["op_cache_file_del", linked]
    assert (f.chip / "op_cache_file_del.json").exists() and (f.chip / f"{linked}.json").exists()


@pytest.mark.parametrize("linked", ["json", "sub-json"])
def test_age_keeps_its_aging_lock_past_an_entry_json_that_is_that_file(base, monkeypatch, linked):
    """A json (or a jsonList's sub-json) that is a hard link to op_cache_file_del.lock:
    reading it and closing it would let go of the aging lock in the middle of the pass."""
    f = Folder(base)
    write_ini(f.root, max_mb=1, ratio=10)
    aging_lock = f.chip / cann_format.DEL_LOCK
    f.chip.mkdir(parents=True)
    aging_lock.touch(0o640)
    if linked == "json":
        planted = f.chip / "te_aaa.json"
        os.link(aging_lock, planted)
        set_access([planted], f.now - 6 * HOUR)
        kernel = "te_aaa"
    else:
        kernel = f.mix("mix", 6)
        planted = f.chip / f"{kernel}_mix_aic.json"
        planted.unlink()
        os.link(aging_lock, planted)
        set_access([f.chip / f"{kernel}.json", planted], f.now - 6 * HOUR)
    after = f.entry("after", 4)
    f.entry("fresh", 0)
    f.entry("fresh2", 0)
    f.entry("fresh3", 0)
    before = f.names()
    chip, seen = _age_asking_for_the_lock(base, monkeypatch, aging_lock)
    assert chip["removed"] == [after] and seen == ["held"]
    assert before - f.names() == {p.name for p in f.entries["after"]}  # the planted: kept
    assert planted.exists() and aging_lock.exists()
    (error,) = chip["errors"]
    assert error.startswith(f"{kernel}: not aged: ") and "op_cache_file_del.lock" in error


def test_no_file_read_or_locked_while_the_aging_lock_is_held_lets_go_of_it(base):
    """Under the aging lock (held by age, pull, import), another name of its file is
    neither read (a json, a binary hashed: open_quietly) nor locked again as an entry's
    lock: closing it, or locking it shared, would let go of the aging lock."""
    chip = base / "kernel_cache" / SOC
    chip.mkdir(parents=True)
    fd = os.open(chip, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with cann_format.del_lock(fd, False) as busy:
            assert busy is None
            os.link(chip / cann_format.DEL_LOCK, chip / "te_x.o")
            with pytest.raises(OSError, match=r"op_cache_file_del\.lock, which opcache holds"):
                cann_format.open_quietly(fd, "te_x.o")
            os.unlink(chip / "te_x.o")
            os.rename(chip / cann_format.DEL_LOCK, chip / "te_y.lock")  # its one name now
            with cann_format.kernel_lock(fd, "te_y") as free:
                assert not free
            assert lock_probe(chip / "te_y.lock") == "held"
        assert cann_format._held == [] and cann_format._parked == []
    finally:
        os.close(fd)
