"""Folders opcache makes for its own work, where another user may rename folders.

A member of a team folder (an out_dir 0770, a group-shared cache 2770) may
rename any folder there, another member's private one too: a rename within one
folder needs write permission on that folder only, none on the folder renamed.
So a folder opcache made there (wrap's staging folder, a build folder, a new
chip or bucket folder) is known by its handle from its mkdir on, never by its
name, and a folder put under its name is left as it is.  Each test runs the
members as real processes of their own users (root only: run_as).
"""

from __future__ import annotations

import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers_faults import (
    CHILD_PROLOGUE,
    MEMBER_A,
    MEMBER_B,
    TEAM_GID,
    open_folder,
    requires_root,
    run_as,
)
from helpers_wrap import GCC

from opcache import fsutil
from opcache.storage import local

SECRET = b"alice's key\n"


def own(path: Path, uid: int, gid: int, mode: int) -> None:
    os.chown(path, uid, gid)
    path.chmod(mode)


def private_folder(folder: Path, name: str = "private") -> Path:
    """Member A's private folder (0700) in ``folder``, holding key.pem (0600)."""
    private = folder / name
    private.mkdir()
    (private / "key.pem").write_bytes(SECRET)
    own(private / "key.pem", MEMBER_A, MEMBER_A, 0o600)
    own(private, MEMBER_A, MEMBER_A, 0o700)
    return private


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.01)


def in_background(uid: int, code: str) -> tuple[threading.Thread, list]:
    """``run_as(uid, uid, code)`` in a thread (member of the team): (thread, [its answer])."""
    answer: list = []

    def run() -> None:
        answer.append(run_as(uid, uid, CHILD_PROLOGUE + code, groups=(TEAM_GID,)))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, answer


# B, once A's process says it is in the window: A's new folder renamed away, A's
# private folder renamed to its name.  Both renames in one folder B may write.
SWAP = """
folder, ready, go, private = Path({folder!r}), Path({ready!r}), Path({go!r}), {private!r}
deadline = time.monotonic() + 60
while not ready.exists():
    assert time.monotonic() < deadline
    time.sleep(0.01)
name = ready.read_text()
os.rename(folder / name, folder / "moved-by-b")
os.rename(folder / private, folder / name)
go.write_text(name)
print(json.dumps(name))
"""

# ------------------------------------------------ wrap's staging folder (bug: emptied)

# A gcc that, when it compiles into opcache's staging folder, says so and waits.
SLOW_GCC = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        char *at = strstr(argv[i], "/.opcache-wrap.");
        if (at == NULL)
            continue;
        char name[256];
        snprintf(name, sizeof name, "%s", at + 1);
        char *slash = strchr(name, '/');
        if (slash != NULL)
            *slash = 0;
        FILE *f = fopen(getenv("SWAP_READY"), "w");
        fputs(name, f);
        fclose(f);
        while (access(getenv("SWAP_GO"), F_OK) != 0)
            usleep(10000);
        break;
    }
    argv[0] = REAL_GCC; /* (gcc finds cc1 from the path it is run by) */
    execv(REAL_GCC, argv);
    return 127;
}
"""

WRAP_AS_A = """
from opcache.cli import main
os.environ.update(HOME={home!r}, SWAP_READY={ready!r}, SWAP_GO={go!r})
os.environ.pop("XDG_RUNTIME_DIR", None)
status = main(["wrap", "--op_compiler_cache_dir", {cache!r}, "--", {gcc!r}, "-c", {src!r},
               "-o", {obj!r}])
print(json.dumps([status, keep.messages]))
"""


@requires_root
@pytest.mark.skipif(GCC is None, reason="needs gcc")
def test_wrap_leaves_a_folder_a_member_puts_in_place_of_its_staging_folder() -> None:
    """Member B renames A's staging folder away during A's compile through ``opcache
    wrap`` and A's private folder (0700, beside it in their team's out folder) to
    its name: A's wrap neither takes files from it nor empties it.  (It deleted
    A's key.pem: the staging folder was removed by its name.)"""
    with open_folder() as base:
        gcc = base / "bin" / "gcc"
        gcc.parent.mkdir()
        subprocess.run(
            [GCC, f'-DREAL_GCC="{GCC}"', "-x", "c", "-", "-o", str(gcc)],
            input=SLOW_GCC.encode(),
            check=True,
        )
        gcc.chmod(0o755)
        (base / "x.c").write_text("int f(int x) { return x + 1; }\n")
        flags, home, out = base / "flags", base / "home", base / "out"
        for folder, mode in ((flags, 0o777), (home, 0o700), (out, 0o770)):
            folder.mkdir()
            own(folder, MEMBER_A, TEAM_GID, mode)
        private_folder(out)
        ready, go = flags / "ready", flags / "go"
        swapper, swapped = in_background(
            MEMBER_B,
            SWAP.format(folder=str(out), ready=str(ready), go=str(go), private="private"),
        )
        code = WRAP_AS_A.format(
            home=str(home),
            ready=str(ready),
            go=str(go),
            cache=str(home / "cache"),
            gcc=str(gcc),
            src=str(base / "x.c"),
            obj=str(out / "x.o"),
        )
        status, warnings = run_as(MEMBER_A, MEMBER_A, CHILD_PROLOGUE + code, groups=(TEAM_GID,))
        swapper.join(60)
        (name,) = swapped
        assert sorted(os.listdir(out / name)) == ["key.pem"]  # left as it is
        assert (out / name / "key.pem").read_bytes() == SECRET
        assert status == 0
        assert (out / "x.o").is_file()  # the command ran as it is
        assert [w for w in warnings if name in w and "not the folder opcache made" in w]


# ------------------------------------- a dead compile's build folder in an out_dir


COMPILE_AS_A = """
settings = h.make_settings({ops!r}, {home!r})
with opcache.OpCache(settings) as cache:
    result = cache.compile(h.make_request(0), h.ToyCompiler({calls!r}), Path({out!r}))
good = h.read_dir(Path({out!r})).items() >= h.expected_files(h.make_request(0)).items()
print(json.dumps([result.status, good]))
"""


@requires_root
def test_a_private_folder_a_member_renames_to_a_build_folders_name_is_not_deleted() -> None:
    """Member B renames A's private folder (0700) in their team's out folder to a name
    A's build folders have there, of a writer that is dead: A's next compile into
    that folder leaves it.  (It was deleted: only its owner could have moved it
    there, so it was taken for A's own; but a rename within one folder needs no
    permission on the folder renamed.)  A's own dead compile's folder still goes."""
    with open_folder() as base:
        home, out = base / "home", base / "out"
        home.mkdir()
        own(home, MEMBER_A, MEMBER_A, 0o755)
        out.mkdir()
        own(out, MEMBER_A, TEAM_GID, 0o770)
        private = private_folder(out)
        name = f".opcache-build.{local._HOST}.999999.deadbeef"
        run_as(
            MEMBER_B,
            MEMBER_B,
            f"import json, os\nos.rename({str(private)!r}, {str(out / name)!r})\n"
            "print(json.dumps(None))\n",
            groups=(TEAM_GID,),
        )
        # A dead compile's folder of A's, as opcache makes them: it goes.
        dead = out / f".opcache-build.{local._HOST}.999998.0badf00d"
        (dead / ".opcache-work.0badf00d").mkdir(parents=True)
        (dead / ".opcache-work.0badf00d" / "half.o").write_bytes(b"half")
        for path in (dead, dead / ".opcache-work.0badf00d"):
            own(path, MEMBER_A, MEMBER_A, 0o700)
        code = COMPILE_AS_A.format(
            ops=str(home / "ops"), home=str(home), calls=str(home / "calls"), out=str(out)
        )
        assert run_as(MEMBER_A, MEMBER_A, CHILD_PROLOGUE + code, groups=(TEAM_GID,)) == [
            "miss",
            True,
        ]
        assert (out / name / "key.pem").read_bytes() == SECRET
        assert not dead.exists()


# ------------------------------------------- a new chip folder in a group-shared cache

# A, storing into a group-shared cache: between the mkdir of the chip folder and
# what follows (its group and bits set), B is let in.
STORE_AS_A = """
real_mkdir = os.mkdir

def mkdir(path, mode=0o777, *, dir_fd=None):
    real_mkdir(path, mode, dir_fd=dir_fd)
    if path == h.SOC and os.readlink(f"/proc/self/fd/{{dir_fd}}") == {root!r}:
        Path({ready!r}).write_text(path)
        while not os.path.exists({go!r}):
            time.sleep(0.01)

os.mkdir = mkdir
settings = h.make_settings({ops!r}, {home!r}, shared_group={gid})
with opcache.OpCache(settings) as cache:
    result = cache.compile(h.make_request(0), h.ToyCompiler({calls!r}), Path({out!r}))
print(json.dumps([result.status, keep.messages]))
"""


@requires_root
def test_a_new_chip_folder_swapped_for_a_members_private_folder_is_left_as_it_is() -> None:
    """Between A's mkdir of a new chip folder in a group-shared cache and setting its
    group and bits, B renames it away and A's private folder there (0700) to its
    name: A's private folder keeps its bits (B cannot read it) and is not used;
    the compile goes on uncached.  (It was made 2770, group team, by name.)"""
    with open_folder() as base:
        home, flags = base / "home", base / "flags"
        home.mkdir()
        own(home, MEMBER_A, TEAM_GID, 0o755)
        flags.mkdir()
        own(flags, MEMBER_A, TEAM_GID, 0o777)
        settings_root = base / "ops" / "kernel_cache"  # (make_settings' root for ops)
        settings_root.mkdir(parents=True)
        for path in (base / "ops", settings_root):
            own(path, MEMBER_A, TEAM_GID, 0o2770)
        private = private_folder(settings_root, "notes by alice")
        os.chown(private, MEMBER_A, TEAM_GID)  # (made in a setgid folder)
        ready, go = flags / "ready", flags / "go"
        swapper, swapped = in_background(
            MEMBER_B,
            SWAP.format(
                folder=str(settings_root), ready=str(ready), go=str(go), private=private.name
            ),
        )
        code = STORE_AS_A.format(
            root=str(settings_root),
            ready=str(ready),
            go=str(go),
            ops=str(base / "ops"),
            home=str(home),
            gid=TEAM_GID,
            calls=str(home / "calls"),
            out=str(home / "out"),
        )
        status, warnings = run_as(MEMBER_A, MEMBER_A, CHILD_PROLOGUE + code, groups=(TEAM_GID,))
        swapper.join(60)
        (name,) = swapped
        now = settings_root / name
        assert os.stat(now).st_mode & 0o7777 == 0o700
        assert os.stat(now).st_gid == TEAM_GID
        assert sorted(os.listdir(now)) == ["key.pem"]
        assert status == "miss"  # compiled, not stored
        assert any("not the folder opcache made" in w for w in warnings), warnings
        read = (
            "import json\ntry:\n"
            f"    open({str(now / 'key.pem')!r}).read()\n    got = 'read'\n"
            "except PermissionError:\n    got = 'refused'\nprint(json.dumps(got))\n"
        )
        assert run_as(MEMBER_B, MEMBER_B, read, groups=(TEAM_GID,)) == "refused"


# --------------------------------- the window between a mkdir and its open, in-process


def swap_after_mkdir(monkeypatch: pytest.MonkeyPatch, victim: Path) -> list[str]:
    """Each folder ``fsutil`` makes is renamed away at once and ``victim`` (beside it)
    renamed to its name, as another user who may write there can; returns the names."""
    real = os.mkdir
    names: list[str] = []

    def mkdir(path, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        real(path, mode, dir_fd=dir_fd)
        if not names:
            names.append(os.fspath(path))
            os.rename(path, f"{path}.moved", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.rename(victim.name, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    monkeypatch.setattr(fsutil.os, "mkdir", mkdir)
    return names


@pytest.mark.parametrize("bits", [0o700, 0o700 | stat.S_ISVTX])  # (MARK)
def test_a_folder_swapped_in_before_the_open_is_not_taken_for_the_one_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, bits: int
) -> None:
    victim = tmp_path / "private"
    victim.mkdir(mode=0o700)
    (victim / "key.pem").write_bytes(SECRET)
    os.utime(victim, (1e9, 1e9))  # (written long ago)
    time.sleep(3 * fsutil.CLOCK_LAG_NS / 1e9)  # (its file too: its ctime cannot be set)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = swap_after_mkdir(monkeypatch, victim)
        assert fsutil.make_folder("new", bits, fd) is None
    finally:
        os.close(fd)
    assert names == ["new"]
    assert (tmp_path / "new" / "key.pem").read_bytes() == SECRET
    assert [r for r in caplog.records if "not the folder opcache made" in r.getMessage()]


def test_a_new_folder_another_process_fills_at_once_is_still_the_one_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes of a group-shared cache make one chip folder at once: the other
    finds it made and puts a bucket in it before this one opens it.  It is still
    this one's to set the bits of."""
    real = os.mkdir

    def mkdir(path, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        real(path, mode, dir_fd=dir_fd)
        real(f"{path}/ab", dir_fd=dir_fd)

    monkeypatch.setattr(fsutil.os, "mkdir", mkdir)
    fd = fsutil.make_folder(tmp_path / "chip", 0o750)
    assert fd is not None
    os.close(fd)
