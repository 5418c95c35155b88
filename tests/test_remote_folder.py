"""The shared-folder remote (file:///path, opcache/storage/folder.py).

The folder is on a second mount (a tmpfs mounted for the test) when the
machine lets us mount one (root), else a plain folder.  It is held to the
local store's rules: entries checked whole, no link followed, a writer
killed mid-store leaves nothing visible, read-only clients never write.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers_cache import (
    MP,
    SOC,
    ToyCompiler,
    expected_files,
    machine,
    make_request,
    read_dir,
)

import opcache
from opcache.settings import RemoteSettings
from opcache.storage import RemoteCorrupt, RemoteError
from opcache.storage.entry import make_manifest
from opcache.storage.folder import connect

KEY = "0123456789abcdef" * 2
OTHER = "fedcba9876543210" * 2


@pytest.fixture
def share(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The shared folder: a tmpfs of its own when we may mount one, else a folder."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs", str(mount)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    folder = mount / "opcache"
    folder.mkdir()
    yield folder
    if mounted:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def settings(folder: Path, **options: object) -> RemoteSettings:
    given = {"password": None, "read_only": False, "prefix": "opcache:1:", "ttl": None}
    given |= {"max_entry_mb": 64, "timeout": 2.0, **options}
    return RemoteSettings(url=f"file://{folder}", **given)  # type: ignore[arg-type]


def entry(key: str = KEY, **files: bytes) -> tuple[bytes, dict[str, bytes]]:
    files = files or {"k.o": b"\x7fELF" + bytes(range(256)) * 8, "k.json": b'{"a": 1}'}
    return make_manifest(key, files, 1.5, {"op_type": "Add"}, 1000.0), files


def test_entries_round_trip_and_two_clients_share_them(share: Path) -> None:
    writer, reader = connect(settings(share)), connect(settings(share))
    manifest, files = entry()
    assert writer.put(SOC, KEY, manifest, files) == len(manifest) + sum(map(len, files.values()))
    got, got_manifest = reader.get(SOC, KEY)
    assert got.files == files and got_manifest == manifest and got.compile_seconds == 1.5
    assert reader.get(SOC, OTHER) is None
    found = reader.get_many(SOC, [KEY, OTHER])
    assert list(found) == [KEY] and found[KEY][2] > sum(map(len, files.values()))
    assert writer.put(SOC, KEY, manifest, files) == 0  # the first writer's stands


def test_damaged_and_truncated_files_are_corrupt_never_served(share: Path) -> None:
    r = connect(settings(share))
    r.put(SOC, KEY, *entry())
    r.put(SOC, OTHER, *entry(OTHER))
    damaged = share / SOC / KEY[:2] / KEY / "k.o"
    data = bytearray(damaged.read_bytes())
    data[10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    truncated = share / SOC / OTHER[:2] / OTHER / "k.o"
    truncated.write_bytes(truncated.read_bytes()[:-1])
    found = r.get_many(SOC, [KEY, OTHER])
    assert all(isinstance(v, RemoteCorrupt) for v in found.values()) and len(found) == 2
    with pytest.raises(RemoteCorrupt):
        r.get(SOC, KEY)


def test_an_entry_over_the_readers_cap_is_corrupt_its_files_never_read(share: Path) -> None:
    """The cap was never applied to a folder's entries: a manifest saying 3 GB (a sparse
    file beside it) was read whole, 5.7 GB of memory, before its digest failed."""
    big = {"k.o": os.urandom(2 << 20)}
    assert connect(settings(share)).put(SOC, KEY, *entry(**big)) > 0
    assert connect(settings(share)).get(SOC, KEY)[0].files == big
    with pytest.raises(RemoteCorrupt, match="over"):
        connect(settings(share, max_entry_mb=1)).get(SOC, KEY)


def test_links_and_fifos_planted_in_the_folder_are_never_followed(
    share: Path, tmp_path: Path
) -> None:
    r = connect(settings(share))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, share / SOC)  # the chip folder: a link to another folder
    with pytest.raises(RemoteError):
        r.put(SOC, KEY, *entry())
    assert list(elsewhere.iterdir()) == []
    os.unlink(share / SOC)
    r.put(SOC, KEY, *entry())
    fifo = share / SOC / KEY[:2] / KEY / "k.o"
    fifo.unlink()
    os.mkfifo(fifo)  # a read that would block for ever
    assert isinstance(r.get_many(SOC, [KEY])[KEY], RemoteCorrupt)


def test_a_folder_others_can_write_is_not_trusted(share: Path) -> None:
    r = connect(settings(share))
    r.put(SOC, KEY, *entry())
    os.chmod(share / SOC, 0o777)
    with pytest.raises(RemoteError, match="writable by others"):
        r.get(SOC, KEY)


def _killed_before_publishing(folder: Path) -> None:
    from opcache.storage.local import LocalStore

    def die(*_args: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    LocalStore._publish_counted = die  # type: ignore[method-assign]
    connect(settings(folder)).put(SOC, KEY, *entry(**{"big.o": os.urandom(4 << 20)}))


def test_a_writer_killed_mid_store_leaves_nothing_visible(share: Path) -> None:
    child = MP.Process(target=_killed_before_publishing, args=(share,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    r = connect(settings(share))
    assert r.get(SOC, KEY) is None  # its files were all written, never published
    assert any((share / ".opcache" / "tmp").iterdir())
    assert r.put(SOC, KEY, *entry()) > 0
    assert r.get(SOC, KEY) is not None
    r.clear()
    assert not any((share / ".opcache" / "tmp").iterdir())  # the dead writer's folder


def test_a_read_only_client_never_writes(share: Path) -> None:
    connect(settings(share)).put(SOC, OTHER, *entry(OTHER))
    before = sorted(p.relative_to(share) for p in share.rglob("*"))
    reader = connect(settings(share, read_only=True))
    assert reader.put(SOC, KEY, *entry()) == 0
    reader.discard(SOC, OTHER)
    assert reader.get(SOC, OTHER) is not None
    assert reader.claim(SOC, KEY, 5).owned is False  # no claims: it compiles its own
    with pytest.raises(RemoteError, match="read-only"):
        reader.clear()
    assert sorted(p.relative_to(share) for p in share.rglob("*")) == before


def test_a_folder_that_is_not_there_is_an_error_never_created(tmp_path: Path) -> None:
    with pytest.raises(RemoteError, match="mount it or create it"):
        connect(settings(tmp_path / "not-mounted"))
    assert not (tmp_path / "not-mounted").exists()


def test_usage_and_clear(share: Path) -> None:
    r = connect(settings(share))
    r.put(SOC, KEY, *entry())
    r.put("Ascend310P3", OTHER, *entry(OTHER))
    usage = r.usage()
    assert sorted(usage["chips"]) == ["Ascend310P3", SOC]
    assert usage["chips"][SOC]["entries"] == 1
    assert r.clear(SOC) == 1
    assert r.get(SOC, KEY) is None and r.get("Ascend310P3", OTHER) is not None


def test_clear_of_a_folder_named_one_level_too_high_takes_only_entries(tmp_path: Path) -> None:
    """OPCACHE_REMOTE=file://$HOME (or a share's top folder) by mistake: one store
    makes .opcache there, and every folder of it is named as a chip may be.  clear
    removes the entries stored, never Documents/ nor src/db/ (named as a bucket is)."""
    home = tmp_path / "home"
    mine = {
        home / "Documents" / "thesis.tex": b"\\begin{document}\n",
        home / "src" / "db" / "schema.sql": b"create table t (x int);\n",
        home / SOC / "notes.txt": b"a folder of yours named as a chip\n",
    }
    for path, data in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    r = connect(settings(home))
    r.put(SOC, KEY, *entry())
    assert (home / ".opcache").is_dir()
    assert r.clear() == 1
    assert r.get(SOC, KEY) is None
    assert all(path.read_bytes() == data for path, data in mine.items())


def test_two_machines_share_compiles_through_the_folder(share: Path, tmp_path: Path) -> None:
    compiler = ToyCompiler(tmp_path / "calls")
    request = make_request(0)

    def machine(name: str) -> opcache.OpCache:
        return opcache.OpCache(
            opcache.resolve_settings(
                op_compiler_cache_mode="enable",
                op_compiler_cache_dir=str(tmp_path / name),
                remote={"url": f"file://{share}"},
                environ={"HOME": str(tmp_path)},
            )
        )

    with machine("a") as a:
        assert a.compile(request, compiler, tmp_path / "out-a").status == "miss"
    with machine("b") as b:
        result = b.compile(request, compiler, tmp_path / "out-b")
        assert (result.status, result.tier) == ("hit", "remote")
        assert b.compile(request, compiler, tmp_path / "out-b2").tier == "local"
    assert compiler.calls() == 1
    assert read_dir(tmp_path / "out-b") == expected_files(request)


@pytest.mark.parametrize("damage", ["a byte flipped", "a link in its place"])
def test_a_damaged_entry_is_replaced_by_the_next_compile(
    share: Path, tmp_path: Path, damage: str
) -> None:
    """A damaged entry stood for good (the next store's rename found the name taken), so
    every machine compiled the key again; a link planted in an entry's place made the
    store fail as 'the chip folder keeps disappearing', which paused the remote.  The
    next compile's entry replaces either; the link goes, never what it points to."""
    compiler = ToyCompiler(tmp_path / "calls")
    request = make_request(0)
    with opcache.OpCache(machine(tmp_path, "a", f"file://{share}")) as a:
        key = a.compile(request, compiler, tmp_path / "out-a").key
    stored = share / SOC / key[:2] / key
    kept = tmp_path / "elsewhere"
    if damage == "a link in its place":
        shutil.move(stored, kept)  # (out of the share's mount)
        stored.symlink_to(kept)
    else:
        (artifact,) = [p for p in stored.iterdir() if p.suffix == ".o"]
        artifact.write_bytes(bytes([artifact.read_bytes()[0] ^ 1]) + artifact.read_bytes()[1:])
    with opcache.OpCache(machine(tmp_path, "b", f"file://{share}")) as b:
        result = b.compile(request, compiler, tmp_path / "out-b")
        stats = b.stats()
    assert (result.status, stats["remote_corrupt"], stats["remote_errors"]) == ("miss", 1, 0)
    assert stats["remote_stores"] == 1 and not stored.is_symlink()
    with opcache.OpCache(machine(tmp_path, "c", f"file://{share}")) as c:
        result = c.compile(request, compiler, tmp_path / "out-c")
    assert (result.status, result.tier, compiler.calls()) == ("hit", "remote", 2)
    assert read_dir(tmp_path / "out-c") == expected_files(request)
    if damage == "a link in its place":
        assert (kept / "MANIFEST").is_file()


def opcache_command(
    tmp_path: Path, share: Path, *args: str, **more: str
) -> subprocess.CompletedProcess[str]:
    """``opcache <args>`` run in a process of its own, the share as its remote (and
    ``more`` variables)."""
    env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"], "OPCACHE_REMOTE": f"file://{share}"}
    env |= more
    done = subprocess.run(
        [sys.executable, "-m", "opcache", *args],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return done


def test_remote_stats_and_clear_commands_on_a_folder(share: Path, tmp_path: Path) -> None:
    r = connect(settings(share))
    r.put(SOC, KEY, *entry())
    r.put(SOC, OTHER, *entry(OTHER))
    stats = opcache_command(tmp_path, share, "remote", "stats")
    assert f"{SOC}" in stats.stdout and "2" in stats.stdout
    assert "memory" not in stats.stdout and stats.stderr == ""  # no Redis eviction advice
    assert "removed 2 entries" in opcache_command(tmp_path, share, "remote", "clear").stdout
    assert r.get(SOC, KEY) is None


def test_remote_stats_and_clear_count_and_remove_what_cann_push_stored(
    share: Path, tmp_path: Path
) -> None:
    """`opcache cann push` stores under the chips cann:<soc> (its index) and
    cann:<soc>:<namespace>: a folder remote's stats left them out, and its clear
    left them in the share, where Redis's counts and deletes them."""
    from helpers_cann import kernel_name, store_entry, write_ini

    from opcache import cann_transfer

    (tmp_path / "driver").mkdir()
    (tmp_path / "driver" / "version.info").write_text("Version=24.1.rc2\n")
    env = {"ASCEND_DRIVER_PATH": str(tmp_path / "driver")}
    base = tmp_path / "atc"  # a CANN cache built with that driver
    write_ini(base / "kernel_cache")
    for i in range(3):
        store_entry(base / "kernel_cache" / SOC, kernel_name("Add", f"k{i}"), os.urandom(1000))
    push = ["cann", "push", "--op_compiler_cache_dir", str(base), "--json"]
    pushed = json.loads(opcache_command(tmp_path, share, *push, **env).stdout)
    assert pushed["chips"][SOC]["sent"] == 3, json.dumps(pushed)
    connect(settings(share)).put(SOC, KEY, *entry())  # and an entry of opcache's own
    (share / f"cann:{SOC}:notes").mkdir()  # (named as no chip: someone else's)

    chips = json.loads(opcache_command(tmp_path, share, "remote", "stats", "--json").stdout)
    counted = {chip: row["entries"] for chip, row in chips["chips"].items()}
    namespace = f"cann:{SOC}:{pushed['chips'][SOC]['namespace']['id']}"
    # (the index: its head, and beside the kernels the parts naming them)
    parts = len({cann_transfer._shard_of(kernel_name("Add", f"k{i}")) for i in range(3)})
    assert counted == {SOC: 1, f"cann:{SOC}": 1, namespace: 3 + parts}, chips
    removed = f"removed {5 + parts} entries"
    assert removed in opcache_command(tmp_path, share, "remote", "clear").stdout
    assert sorted(p.name for p in share.iterdir()) == [".opcache", f"cann:{SOC}:notes"]


_CHILD = """
import json
from opcache.settings import RemoteSettings
from opcache.storage import RemoteError
from opcache.storage.entry import make_manifest
from opcache.storage.folder import connect
key, files = {key!r}, {{"k.o": b"shared kernel"}}
try:
    r = connect(RemoteSettings("file://{share}", None, False, "opcache:1:", None, 64, 2.0))
    if {write!r}:
        print(json.dumps(r.put("{soc}", key, make_manifest(key, files, 1.0, {{}}, 0.0), files)))
    else:
        got = r.get("{soc}", key)
        print(json.dumps(None if got is None else got[0].files["k.o"].decode()))
except RemoteError as e:
    print(json.dumps("error: " + str(e)))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as other users")
def test_a_group_shared_folder_is_shared_by_its_group_and_no_one_else() -> None:
    import shutil
    import tempfile

    from helpers_faults import MEMBER_A, MEMBER_B, NOBODY, TEAM_GID, run_as

    group, writer, reader, outsider = TEAM_GID, MEMBER_A, MEMBER_B, NOBODY
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        share = base / "share"
        share.mkdir()
        os.chown(share, 0, group)
        os.chmod(share, 0o2770)  # setgid, the group's: shared as a group-shared cache
        code = {"key": KEY, "share": share, "soc": SOC}
        assert run_as(writer, writer, _CHILD.format(write=True, **code), groups=(group,)) > 0
        got = run_as(reader, reader, _CHILD.format(write=False, **code), groups=(group,))
        assert got == "shared kernel"
        got = run_as(outsider, outsider, _CHILD.format(write=False, **code))
        assert got.startswith("error: ")  # not in the group: not even readable
        entry_dir = share / SOC / KEY[:2] / KEY
        assert entry_dir.stat().st_gid == group and entry_dir.stat().st_uid == writer
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as other users")
@pytest.mark.parametrize("mode", [0o2777, 0o3777])
def test_a_group_shared_folder_anyone_may_write_is_refused(mode: int) -> None:
    """A setgid folder of the team that others can write gives the team's id to whatever
    anyone makes in it: an outsider planted an entry there, and a member's read
    served its kernel.  The same folder no outsider can write, held in /tmp (1777,
    not setgid), is shared by members with no name (a pod of a Kubernetes fsGroup)."""
    import tempfile

    from helpers_faults import MEMBER_A, MEMBER_B, NOBODY, TEAM_GID, copy_as, open_folder, run_as

    def member(uid: int, write: bool) -> Any:
        code = _CHILD.format(write=write, key=KEY, share=share, soc=SOC)
        return run_as(uid, uid, code, groups=(TEAM_GID,))

    share = Path(tempfile.mkdtemp(dir="/tmp"))  # held in /tmp itself
    try:
        os.chown(share, 0, TEAM_GID)
        os.chmod(share, mode)
        with open_folder() as base:
            manifest, files = entry(**{"k.o": b"planted kernel"})
            for name, data in {"MANIFEST": manifest, **files}.items():
                (base / name).write_bytes(data)
                os.chmod(base / name, 0o644)
            assert copy_as(NOBODY, base, share / SOC / KEY[:2] / KEY) == TEAM_GID
        got = member(MEMBER_B, write=False)
        assert got.startswith("error: "), got
        assert f"{share} is writable by others, so anyone could plant" in got, got
        # (nor stored: a member's entry there would be as open to the outsider)
        got = member(MEMBER_A, write=True)
        assert "writable by others" in got, got

        shutil.rmtree(share / SOC)
        os.chmod(share, 0o2770)
        assert member(MEMBER_A, write=True) > 0
        assert member(MEMBER_B, write=False) == "shared kernel"
    finally:
        shutil.rmtree(share)


_UNREADABLE_SHARE = """
import contextlib, io, json, os
from opcache.cli import main
os.environ.update(HOME={home!r}, OPCACHE_REMOTE="file://{share}")
said = []
for command in ("stats", "clear"):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["remote", command])
    said.append([status, err.getvalue()])
print(json.dumps(said))
"""


def test_a_shared_folder_this_user_cannot_read_is_an_error_not_an_empty_remote() -> None:
    # Before: "0 entries" and "removed 0 entries", exit 0.
    from helpers_faults import NOBODY, open_folder, run_as

    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another user")
    with open_folder() as base:
        share = base / "share"
        share.mkdir(mode=0o700)  # (root's)
        (base / "home").mkdir()
        os.chown(base / "home", NOBODY, NOBODY)
        code = _UNREADABLE_SHARE.format(home=str(base / "home"), share=share)
        for status, err in run_as(NOBODY, NOBODY, code):
            assert status != 0 and "Permission denied" in err, (status, err)
            assert "Traceback" not in err, err


_READER = """
base = Path({base!r})
settings = h.machine(base, "reader", "file://{share}")
compiler = h.ToyCompiler(base / "calls")
report = {{}}
with opcache.OpCache(settings) as cache:
    for i in (9, 0, 1, 2):  # a key the share lacks, then three it holds
        result = cache.compile(h.make_request(i), compiler, base / "reader" / str(i))
        good = h.read_dir(base / "reader" / str(i)) == h.expected_files(h.make_request(i))
        report[str(i)] = [result.status, result.tier, good]
    report["stats"] = {{k: v for k, v in cache.stats().items() if k.startswith("remote_")}}
report["warnings"] = keep.messages
print(json.dumps(report))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount and to run as another user")
@pytest.mark.parametrize("where", ["a read-only mount", "a folder this user cannot write"])
def test_a_folder_this_user_cannot_write_is_still_read(tmp_path: Path, where: str) -> None:
    """A store refused (EROFS, EACCES) was a remote error: the remote paused, reads too,
    and every entry the share held missed.  It turns read-only, with one warning."""
    from helpers_faults import CHILD_PROLOGUE, NOBODY, open_folder, read_only, run_as

    with open_folder() as base:
        share = base / "share"
        share.mkdir()
        with opcache.OpCache(machine(tmp_path, "writer", f"file://{share}")) as writer:
            for i in (0, 1, 2):
                writer.compile(make_request(i), ToyCompiler(tmp_path / "calls"), tmp_path / "w")
        for dirpath, _dirs, files in os.walk(share):  # (whatever this umask made them)
            os.chmod(dirpath, 0o755)
            for name in files:
                os.chmod(os.path.join(dirpath, name), 0o644)
        (base / "calls").touch()
        os.chmod(base / "calls", 0o666)
        (base / "reader").mkdir()
        code = CHILD_PROLOGUE + _READER.format(base=str(base), share=share)
        if where == "a read-only mount":
            with read_only(share):
                report = run_as(0, 0, code)
        else:
            os.chown(base / "reader", NOBODY, NOBODY)
            report = run_as(NOBODY, NOBODY, code)  # the share: root's, 0755
    assert report["9"] == ["miss", "", True]
    for i in ("0", "1", "2"):
        assert report[i] == ["hit", "remote", True], json.dumps(report)
    (warning,) = report["warnings"]
    assert warning.startswith(f"file://{share}: cannot write (") and "only reading" in warning
    stats = report["stats"]
    assert (stats["remote_hits"], stats["remote_errors"], stats["remote_stores"]) == (3, 0, 0)
