"""The quick hit (opcache/quickhit.py): a C compile's memo, checked by stat identity.

Each test runs opcache as a program (``python -m opcache``), as a build does: a
miss, a pause past the racy window, a full hit (which writes the memo), then
the runs under test.  A quick hit is seen by its counts, appended to the
chip's ``appended`` counter file (the full path counts in the shards).
"""

from __future__ import annotations

import errno
import grp
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_faults import NOBODY, read_only, requires_root, tmpfs
from helpers_wrap import (
    GCC,
    assembler_in_its_prefix,
    bound_by_modes,
    compiled_alone,
    compiled_script,
    fill,
    opcache,
    outputs_left,
    ran_instead,
    refusing_rename,
    relocated_gcc,
    stats,
    temporary_files,
    wrap,
    write_project,
)

from opcache import quickhit, quickmemo
from opcache.counters import FOLD_BYTES, QUICK_COUNTS, CounterFiles

pytestmark = pytest.mark.skipif(GCC is None, reason="needs gcc")
CMD = ["gcc", "-c", "k.c", "-o", "k.o", "-DOFFSET=1"]
REPO = Path(__file__).resolve().parent.parent


def _env(tmp_path: Path) -> dict[str, str]:
    env = base_env(tmp_path)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env["XDG_RUNTIME_DIR"] = str(run)  # (this test's memos, no one else's)
    return env


def _age() -> None:
    """Past the racy window: files written so far may now be recorded."""
    time.sleep(quickmemo.RACY_SECONDS + 0.3)


def _memos(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "run" / f"opcache-{os.getuid()}" / quickhit.FOLDER
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _quick_hits(tmp_path: Path) -> int:
    (root,) = (tmp_path / "cache").glob("kernel_cache*")
    counts = root / ".opcache" / "stats" / "host" / QUICK_COUNTS
    return len(counts.read_bytes().splitlines()) if counts.exists() else 0


def _memoized(tmp_path: Path, env: dict[str, str], src: Path, cmd=CMD, prefix=()) -> None:
    """A miss, then a full hit that writes the command's memo (both run under
    ``prefix``: a memo is a process's of the same capabilities)."""
    wrap(*cmd, env=env, cwd=src, prefix=list(prefix))
    _age()
    wrap(*cmd, env=env, cwd=src, prefix=list(prefix))
    assert len(_memos(tmp_path)) == 1
    assert _quick_hits(tmp_path) == 0


def _plain(src: Path, *args: str) -> bytes:
    subprocess.run([GCC, *args, "-o", "plain.o"], cwd=src, check=True)
    return (src / "plain.o").read_bytes()


def test_a_quick_hit_gives_what_the_full_hit_gives(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    (src / "k.c").write_text(
        '#include "h.h"\nint scale(int x) { int unused; return x * FACTOR; }\n'
    )
    cmd = [*CMD, "-Wall"]
    wrap(*cmd, env=env, cwd=src)
    _age()
    full = wrap(*cmd, env=env, cwd=src)
    full_object = (src / "k.o").read_bytes()
    assert b"unused" in full.stderr
    (src / "k.o").unlink()

    quick = wrap(*cmd, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 1
    assert (quick.returncode, quick.stdout, quick.stderr) == (0, full.stdout, full.stderr)
    assert (src / "k.o").read_bytes() == full_object
    assert (src / "k.o").stat().st_mode & 0o777 == 0o666 & ~_umask()
    report = stats(env, "host")
    assert (report["hits"], report["misses"]) == (2, 1)


def test_a_quick_hit_puts_outputs_named_through_a_link_and_dotdot_where_gcc_does(
    tmp_path: Path,
) -> None:
    # The kernel resolves sub/.. through the link: the real folder's parent, not src.
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    real = tmp_path / "real"
    (real / "dir").mkdir(parents=True)
    (src / "sub").symlink_to(real / "dir")
    cmd = ["gcc", "-c", "k.c", "-o", "sub/../k.o", "-MD", "-MF", "sub/../k.d", "-DOFFSET=1"]
    _memoized(tmp_path, env, src, cmd)
    made = {name: (real / name).read_bytes() for name in ("k.o", "k.d")}
    for name in made:
        (real / name).unlink()

    wrap(*cmd, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 1
    assert {name: (real / name).read_bytes() for name in made} == made
    assert not (src / "k.o").exists() and not (src / "k.d").exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_header_edited_with_its_size_and_mtime_kept_is_no_quick_hit(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _memoized(tmp_path, env, src)
    header = src / "h.h"
    before = header.stat()
    header.write_text("#define FACTOR 5\n")  # (same size)
    os.utime(header, ns=(before.st_atime_ns, before.st_mtime_ns))  # (ctime still moves)

    wrap(*CMD, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert (src / "k.o").read_bytes() == _plain(src, "-c", "k.c", "-DOFFSET=1")


def test_a_header_made_earlier_on_the_include_path_is_no_quick_hit(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    (src / "A").mkdir()
    (src / "B").mkdir()
    (src / "h.h").rename(src / "B" / "h.h")
    (src / "k.c").write_text("#include <h.h>\nint scale(int x) { return x * FACTOR + OFFSET; }\n")
    cmd = [*CMD, "-IA", "-IB"]
    _memoized(tmp_path, env, src, cmd)
    (src / "A" / "h.h").write_text("#define FACTOR 7\n")

    wrap(*cmd, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert (src / "k.o").read_bytes() == _plain(src, "-c", "k.c", "-DOFFSET=1", "-IA", "-IB")


def test_a_compiler_put_earlier_on_path_is_no_quick_hit(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    _memoized(tmp_path, env, src)
    compiled_script(bin_dir / "gcc", f'exec {GCC} -DFACTOR_TWICE "$@"\n')

    wrap(*CMD, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert stats(env, "host")["misses"] == 2


def test_an_assembler_installed_in_the_compilers_own_prefix_is_no_quick_hit(
    tmp_path: Path,
) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    gcc = relocated_gcc(tmp_path / "toolchain")
    env["PATH"] = f"{gcc.parent}:{env['PATH']}"
    _age()  # (a compiler copied just now: its digest is noted once it is past the window)
    _memoized(tmp_path, env, src)
    assembler_in_its_prefix(gcc)

    wrap(*CMD, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert (src / "k.o").read_bytes().endswith(b"tail")


def test_a_keyed_variable_changed_is_no_quick_hit(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _memoized(tmp_path, env, src)
    wrap(*CMD, env={**env, "CPATH": str(tmp_path)}, cwd=src)
    assert _quick_hits(tmp_path) == 0
    wrap(*CMD, env={**env, "MAKEFLAGS": " -j4 --jobserver-auth=fifo:/tmp/GMfifo1"}, cwd=src)
    assert _quick_hits(tmp_path) == 1  # (make's jobserver changes each build: not in the name)


def test_op_cache_ini_written_is_no_quick_hit(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _memoized(tmp_path, env, src)
    (root,) = (tmp_path / "cache").glob("kernel_cache*")
    ini = root / "op_cache.ini"  # (none made: no toolkit; a person writes one)
    ini.write_text("[op_compiler_cache]\nmax_op_cache_size=-1\nremain_cache_size_ratio=50\n")

    wrap(*CMD, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert stats(env, "host")["hits"] == 2  # (a full hit)


@pytest.mark.parametrize("planted", ["link", "fifo", "other_user", "folder_link", "open_folder"])
def test_a_planted_memo_is_not_followed(tmp_path: Path, planted: str) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _memoized(tmp_path, env, src)
    (memo,) = _memos(tmp_path)
    if planted == "link":
        copy = tmp_path / "memo-copy"
        shutil.copy(memo, copy)
        memo.unlink()
        memo.symlink_to(copy)
    elif planted == "fifo":
        memo.unlink()
        os.mkfifo(memo)
    elif planted == "folder_link":  # the memos' folder, a link to one holding the same memo
        elsewhere = tmp_path / "elsewhere"
        memo.parent.rename(elsewhere)
        memo.parent.symlink_to(elsewhere)
    elif planted == "open_folder":  # the memos' folder, one others may write in
        memo.parent.chmod(0o777)
    else:
        if os.getuid() != 0:
            pytest.skip("needs root to give a file to another user")
        os.chown(memo, 65534, 65534)
    (src / "k.o").unlink()

    wrap(*CMD, env=env, cwd=src, flags=())
    assert _quick_hits(tmp_path) == 0
    assert (src / "k.o").read_bytes() == _plain(src, "-c", "k.c", "-DOFFSET=1")


def test_an_artifact_replaced_by_a_link_is_not_followed(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _memoized(tmp_path, env, src)
    (root,) = (tmp_path / "cache").glob("kernel_cache*")
    (artifact,) = root.glob("host/*/*/object")
    bait = tmp_path / "bait.o"
    bait.write_bytes(b"not an object")
    artifact.unlink()
    artifact.symlink_to(bait)

    wrap(*CMD, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert (src / "k.o").read_bytes() == _plain(src, "-c", "k.c", "-DOFFSET=1")


def test_clear_makes_every_memo_miss(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _memoized(tmp_path, env, src)
    opcache("clear", env=env, cwd=src)

    wrap(*CMD, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert stats(env, "host")["misses"] == 2


def test_a_date_source_gets_no_memo(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    (src / "k.c").write_text("const char *d = __DATE__;\nint f(void) { return OFFSET; }\n")
    wrap(*CMD, env=env, cwd=src)
    _age()
    wrap(*CMD, env=env, cwd=src)
    assert stats(env, "host")["hits"] == 1
    assert _memos(tmp_path) == []


def test_a_racy_header_gets_no_memo(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    wrap(*CMD, env=env, cwd=src)
    _age()
    (src / "h.h").write_text("#define FACTOR 3\n")  # (the same text, written now)
    wrap(*CMD, env=env, cwd=src)
    assert stats(env, "host")["hits"] == 1
    assert _memos(tmp_path) == []


def test_a_quick_hit_imports_none_of_the_full_path(tmp_path: Path) -> None:
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _memoized(tmp_path, env, src)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "opcache", "wrap", "--", *CMD],
        env=env,
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert _quick_hits(tmp_path) == 1
    names = [line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line]
    # (an editable install's .pth loads some of them before opcache: only what opcache pulls in)
    after = names[names.index("opcache") :]
    heavy = {"pathlib", "re", "json", "enum", "contextlib", "opcache.wrap", "opcache.settings"}
    assert heavy.isdisjoint(after), after


def test_no_part_of_opcache_reads_what_a_memo_name_leaves_out() -> None:
    """A variable a compile or opcache reads must be in the memo's name."""
    files = [
        REPO / "opcache" / "settings.py",
        REPO / "opcache" / "keyed_env.py",
        REPO / "opcache" / "wrap.py",
        REPO / "opcache" / "masquerade.py",
        *(REPO / "opcache" / "compilers").glob("*.py"),
    ]
    text = "\n".join(path.read_text() for path in files)
    for name in quickhit.UNKEYED_ENVIRONMENT:
        word = re.escape(name.decode())
        read = rf"""(getenv\(|get\(|\[)["']{word}["']"""  # (environ.get("_"), env["_"]...)
        assert not re.search(read if name == b"_" else rf"""["']{word}["']""", text), name


def test_appended_counts_are_summed_and_folded(tmp_path: Path) -> None:
    folder = tmp_path / "stats"
    counters = CounterFiles(folder)
    counters.add({"hits": 2})
    line = b"hits=1 time_saved_seconds=0.5\n"
    lines = FOLD_BYTES // len(line) + 1
    (folder / QUICK_COUNTS).write_bytes(line * lines)
    assert counters.totals() == {"hits": 2 + lines, "time_saved_seconds": 0.5 * lines}
    counters.add({"misses": 1})  # folds them into its shard
    assert not (folder / QUICK_COUNTS).exists()
    assert counters.totals() == {"hits": 2 + lines, "time_saved_seconds": 0.5 * lines, "misses": 1}
    (folder / QUICK_COUNTS).write_bytes(line)
    counters.reset()
    assert counters.totals() == {}


_STRACE = ("strace", "-f", "-qq", "-y", "-e", "trace=file", "-o")


def _imports(path: str) -> bool:
    """A path Python's import machinery looks at (opcache's modules themselves are
    recorded: an edit or an upgrade makes every memo miss)."""
    package = str(REPO / "opcache")
    name = os.path.basename(path)
    return (
        "/__pycache__" in path
        or (path.startswith(package) and (name.endswith(".so") or os.path.isdir(path)))
        or (name.startswith("python3") and name.endswith(".zip"))
        # setuptools' editable finder puts this name on sys.path, where the import
        # system stats it against the working folder (a fresh venv's `pip install -e`)
        or name.endswith(".__path_hook__")
    )


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (.ci/run installs it)")
@pytest.mark.parametrize("case", ["plain", "include_path_and_deps"])
def test_a_memo_records_every_path_a_full_hit_consults(tmp_path: Path, case: str) -> None:
    """Every path a full hit looked up or read (strace), outside Python's installation,
    opcache's own writes and the entry, is checked by the memo."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    cmd = CMD
    if case == "include_path_and_deps":
        (src / "A").mkdir()
        (src / "B").mkdir()
        (src / "h.h").rename(src / "B" / "h.h")
        (src / "B" / "more.h").write_text('#include "h.h"\n#include <string.h>\n')
        (src / "k.c").write_text(
            "#include <more.h>\n#include <stdio.h>\nint scale(int x) { return x * FACTOR; }\n"
        )
        cmd = [*CMD, "-IA", "-IB", "-MD", "-g"]
        (tmp_path / "bin").mkdir()  # (an earlier PATH folder without gcc)
        env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    wrap(*cmd, env=env, cwd=src)
    _age()
    trace = tmp_path / "trace"
    done = subprocess.run(
        [*_STRACE, str(trace), sys.executable, "-m", "opcache", "wrap", "--", *cmd],
        env=env,
        cwd=src,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (memo,) = _memos(tmp_path)
    fields = memo.read_bytes().split(b"\0")
    recorded = {
        os.path.normpath(os.path.join(src, os.fsdecode(fields[i + 1])))
        for i, field in enumerate(fields)
        if field == b"c"
    }
    (root,) = (tmp_path / "cache").glob("kernel_cache*")
    (entry,) = root.glob("host/*/*/MANIFEST")
    irrelevant = (
        sys.prefix,  # Python and what it imports: not inputs of a hit
        sys.base_prefix,
        os.path.dirname(os.__file__),
        str(REPO / "opcache") + "/__pycache__",
        str(entry.parent),  # the entry: its folder's identity and its artifacts' digests
        str(root / ".opcache" / "stats"),  # the counts a hit adds to
        str(tmp_path / "run"),  # the memos themselves
        "/proc/",
        "/dev/",
        "/etc/ld.so",  # the dynamic loader's, for Python itself
        "/lib/",
        "/usr/lib/locale",
        "/usr/share/locale",
        "/usr/lib/x86_64-linux-gnu/gconv",
        "/etc/localtime",
    )
    missed = []
    pattern = re.compile(
        r'^\d+ +(\w+)\((?:AT_FDCWD(?:<[^>]*>)?, |\d+<([^>]*)>, )?"([^"]*)"(.*)\) += (.*)$'
    )
    for line in trace.read_text().splitlines():
        match = pattern.match(line)
        if match is None:
            continue
        call, folder, path, rest, result = match.groups()
        if call in ("mkdir", "rename", "renameat", "unlink", "unlinkat", "rmdir", "getcwd"):
            continue  # (changes it makes, not what it consults)
        if "O_CREAT" in rest or "O_WRONLY" in rest or "O_RDWR" in rest or not path:
            continue
        full = os.path.normpath(os.path.join(folder or str(src), path))
        if full.startswith(irrelevant) or "/.opcache-wrap." in full:
            continue
        if _imports(full):
            continue
        if full in (str(src / "k.o"), str(src / "k.d"), str(src)):  # outputs; the folder (named)
            continue
        if full not in recorded:
            missed.append(f"{call} {full} = {result}")
    assert missed == [], "\n".join(missed)


def test_a_hit_that_asks_the_user_database_gets_no_memo(tmp_path: Path) -> None:
    """A group given by name is looked up through NSS (files, LDAP...): nothing a
    memo can check, so no memo."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    env["OPCACHE_SHARED_GROUP"] = grp.getgrgid(os.getgid()).gr_name
    wrap(*CMD, env=env, cwd=src)
    _age()
    wrap(*CMD, env=env, cwd=src)
    assert stats(env, "host")["hits"] == 1
    assert _memos(tmp_path) == []


def test_a_quick_hit_whose_reader_left_ends_as_the_full_hit_does(tmp_path: Path) -> None:
    """stderr a pipe nobody reads any more: the object is in place, the status 1, as
    the full path's (cli.run_logged) when its replay meets a closed pipe."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    source = '#include "h.h"\nint scale(int x) { int unused; return x * FACTOR; }\n'
    (src / "k.c").write_text(source)
    cmd = [*CMD, "-Wall"]

    def closed_stderr() -> int:
        read, write = os.pipe()
        os.close(read)
        try:
            return subprocess.run(
                [sys.executable, "-m", "opcache", "wrap", "--", *cmd],
                env=env,
                cwd=src,
                stderr=write,
                stdout=subprocess.DEVNULL,
                timeout=120,
            ).returncode
        finally:
            os.close(write)

    wrap(*cmd, env=env, cwd=src)
    _age()
    assert closed_stderr() == 1  # a full hit (which leaves no memo: it did not end well)
    wrap(*cmd, env=env, cwd=src)
    assert len(_memos(tmp_path)) == 1
    (src / "k.o").unlink()
    assert closed_stderr() == 1  # a quick hit
    assert _quick_hits(tmp_path) == 1
    assert stats(env, "host")["hits"] == 3  # (counted once: the full path did not run again)
    assert (src / "k.o").read_bytes() == _plain(src, "-c", "k.c", "-DOFFSET=1")


def test_files_on_a_network_file_system_get_no_memo() -> None:
    """NFS clients cache attributes: a stat there may not show another machine's edit.
    Only file systems known to be local qualify (virtiofs, a Docker Desktop mount...
    do not)."""
    mountinfo = (
        "22 27 0:21 / /proc rw,relatime - proc proc rw\n"
        "30 27 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        "31 30 0:30 / /tmp rw - tmpfs tmpfs rw\n"
        "41 30 0:52 / /home rw,relatime shared:7 - nfs4 server:/home rw,vers=4.2\n"
        "42 30 0:53 / /mnt/s rw - fuse.sshfs host:/ rw\n"
        "43 30 0:54 / /mnt/v rw - virtiofs share rw\n"
        "bad line\n"
    )
    assert quickmemo._nonlocal_devices(mountinfo) == {os.makedev(0, n) for n in (52, 53, 54)}


def test_files_on_a_read_only_image_get_no_memo() -> None:
    """squashfs, erofs, iso9660, cramfs: times, sizes and inode numbers come from the
    image, so another image mounted in its place (the same loop device) can give every
    recorded identity back."""
    kinds = ("squashfs", "erofs", "iso9660", "cramfs")
    mountinfo = "".join(
        f"{50 + n} 30 7:{n} / /mnt/{kind} ro - {kind} /dev/loop{n} ro\n"
        for n, kind in enumerate(kinds)
    )
    assert quickmemo._nonlocal_devices(mountinfo) == {os.makedev(7, n) for n in range(4)}


@pytest.mark.parametrize("fault", ["full", "short"])
def test_a_memo_that_cannot_be_written_leaves_no_temp_file(tmp_path, monkeypatch, fault):
    """A full runtime folder (ENOSPC, or a write cut short): an error, and nothing left
    behind (a served call at a time would fill the folder's inodes)."""
    folder = tmp_path / "run"
    write = os.write

    def failing(fd: int, data: bytes) -> int:
        if fault == "full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, bytes(data)[: len(data) // 2])

    monkeypatch.setattr(os, "write", failing)
    try:
        with pytest.raises(OSError):
            quickmemo.put(str(folder), "m" + "0" * 32, b"x" * 100)
    finally:
        monkeypatch.undo()
    assert list((folder / quickhit.FOLDER).iterdir()) == []


# ``opcache wrap -- CMD`` as the program runs it (the same sys.argv: the same memo), with
# a shell command run just before the memo is written (a concurrent writer's change that
# lands between the full hit's look at a path and the memo), or a smaller bound on a
# memo's size.
_DRIVER = """
import os, subprocess, sys
import opcache
from opcache import cli, quickmemo
sys.argv = [os.path.join(os.path.dirname(opcache.__file__), "__main__.py"), *sys.argv[1:]]
action = os.environ.pop("TEST_BEFORE_MEMO", "")
if "TEST_MAX_MEMO" in os.environ:
    quickmemo.MAX_MEMO = int(os.environ.pop("TEST_MAX_MEMO"))
if action:
    write_memo = quickmemo.write_memo
    def hooked(*args):
        subprocess.run(["sh", "-c", action], check=True, timeout=60)
        return write_memo(*args)
    quickmemo.write_memo = hooked
cli.main()
"""


def _driven(
    cmd: list[str], env: dict[str, str], cwd: Path, status: int = 0, **extra: str
) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, "wrap", "--", *cmd],
        env={**env, **extra},
        cwd=cwd,
        capture_output=True,
        timeout=120,
    )
    assert b"Traceback" not in done.stderr, done.stderr
    assert done.returncode == status, done.stderr
    return done


DEPS_CMD = [*CMD, "-MD", "-MF", "deps/k.d"]
STALE = b"stale: not written by this compile\n"


def _with_deps(tmp_path: Path, env: dict[str, str], src: Path, prefix=()) -> None:
    """A memo of DEPS_CMD; then k.o and deps/k.d hold STALE, so what a run leaves shows
    who wrote each (the cache, the compiler, or nobody)."""
    (src / "deps").mkdir(exist_ok=True)
    _memoized(tmp_path, env, src, DEPS_CMD, prefix)
    for output in (src / "k.o", src / "deps" / "k.d"):
        output.write_bytes(STALE)


def test_a_depfile_folder_made_read_only_runs_the_compiler_with_a_warning(tmp_path: Path) -> None:
    """The reviewer's case: ``chmod a-w deps`` (deps/k.d still writable).  The quick hit
    cannot make deps/k.d anew, so it puts nothing in place and counts nothing: gcc runs,
    writes k.d in place and k.o, and the compile succeeds as it does alone."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    bound = bound_by_modes()
    _with_deps(tmp_path, env, src, bound)
    (src / "deps").chmod(0o555)

    done = wrap(*DEPS_CMD, env=env, cwd=src, prefix=bound)
    ran_instead(done, src, "Permission denied")
    assert outputs_left(src, 0) == compiled_alone(src, DEPS_CMD[1:], bound)
    assert temporary_files(src) == []
    assert _quick_hits(tmp_path) == 0
    assert stats(env, "host")["hits"] == 1  # (the full hit that wrote the memo)


def test_opening_a_lock_file_that_is_there_consults_no_descriptor_path(tmp_path: Path) -> None:
    """A full hit's stats open the counters' lock file, there already: nothing a memo
    would record as consulted (the message of the expected EEXIST read
    /proc/self/fd/N, gone by the memo's check: about one full hit in five left no memo)."""
    from opcache import fsutil

    (tmp_path / "x.lock").write_bytes(b"")
    folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with quickmemo.Recorder() as recorder:
            fd, _, made = fsutil.made_or_opened("x.lock", os.O_RDWR, 0o600, dir_fd=folder)
        os.close(fd)
    finally:
        os.close(folder)
    assert not made
    assert list(recorder.looked) == []  # (an open to write is no input: not noted)


def test_a_full_hit_that_cannot_put_its_outputs_in_place_is_not_counted(tmp_path: Path) -> None:
    """No memo yet: the full path's hit cannot make deps/k.d anew (``chmod a-w deps``),
    so gcc runs instead; stats then count the miss and an error, not a hit that saved
    a compile (before: one hit too many, its compile seconds counted as saved)."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    (src / "deps").mkdir()
    wrap(*DEPS_CMD, env=env, cwd=src)
    (src / "deps").chmod(0o555)
    bound = bound_by_modes()

    done = wrap(*DEPS_CMD, env=env, cwd=src, prefix=bound)
    said = done.stderr.decode(errors="replace")
    assert "opcache: warning: cannot put the outputs in place: " in said, said
    assert said.endswith("/deps/k.d: Permission denied; running the command\n"), said
    assert outputs_left(src, 0) == compiled_alone(src, DEPS_CMD[1:], bound)
    counted = stats(env, "host")
    assert (counted["hits"], counted["misses"], counted["errors"]) == (0, 1, 1), counted
    assert counted["time_saved_seconds"] == 0, counted


def test_a_depfile_folder_gone_runs_the_compiler_which_fails_as_alone(tmp_path: Path) -> None:
    """-MF into a folder removed since: nothing counted, nothing put in place; gcc runs
    and fails as it does alone (k.o left as it was), with its own message."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _with_deps(tmp_path, env, src)
    shutil.rmtree(src / "deps")

    done = wrap(*DEPS_CMD, env=env, cwd=src, status=1)
    ran_instead(done, src, "No such file or directory")
    assert b"deps/k.d" in done.stderr.split(b"running the command\n", 1)[1]  # (gcc's)
    assert outputs_left(src, 1) == compiled_alone(src, DEPS_CMD[1:]) == (1, STALE, None)
    assert _quick_hits(tmp_path) == 0
    assert stats(env, "host")["hits"] == 1


@requires_root
def test_a_depfile_folder_on_a_read_only_mount_replaces_no_output(tmp_path: Path) -> None:
    """A read-only file system under deps/: gcc fails there alone, leaving k.o as it
    was; so does the quick hit, which puts no output in place before it knows it can
    put them all (before: k.o replaced from the cache, then an error, the hit counted)."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _with_deps(tmp_path, env, src)
    alone = tmp_path / "alone"
    shutil.copytree(src, alone)
    with read_only(alone / "deps"):
        done = subprocess.run([GCC, *DEPS_CMD[1:]], cwd=alone, capture_output=True, timeout=120)
        want = outputs_left(alone, done.returncode)
    with read_only(src / "deps"):
        done = wrap(*DEPS_CMD, env=env, cwd=src, status=None)
        ran_instead(done, src, "Read-only file system")
        assert outputs_left(src, done.returncode) == want == (1, STALE, STALE)
    assert temporary_files(src) == []
    assert _quick_hits(tmp_path) == 0


@requires_root
def test_a_full_disk_runs_the_compiler_which_writes_in_place(tmp_path: Path) -> None:
    """The project on a small tmpfs, filled up: the quick hit cannot write a new k.o
    beside the old one (ENOSPC); gcc, which truncates and rewrites its outputs in place,
    still can.  Nothing put in place, nothing counted, the compile succeeds."""
    env = _env(tmp_path)
    with tmpfs(tmp_path / "disk", "size=1m"):
        src = write_project(tmp_path / "disk" / "src")
        _with_deps(tmp_path, env, src)
        for output in (src / "k.o", src / "deps" / "k.d"):
            output.write_bytes(b"x" * 4096)  # (a page each, which gcc gets back)
        fill(tmp_path / "disk" / "filler")

        done = wrap(*DEPS_CMD, env=env, cwd=src)
        said = done.stderr.decode(errors="replace")
        assert "opcache: warning: cannot put the outputs in place: " in said, said
        assert "No space left on device; running the command" in said, said
        assert "opcache: error:" not in said
        (tmp_path / "disk" / "filler").unlink()
        assert outputs_left(src, 0) == compiled_alone(src, DEPS_CMD[1:])
        assert temporary_files(src) == []
    assert _quick_hits(tmp_path) == 0


@requires_root
def test_a_depfile_folder_made_a_link_by_another_user_is_not_written_through(
    tmp_path: Path,
) -> None:
    """deps/ replaced by another user's link to a folder elsewhere: not the folder the
    full hit wrote into, so the quick hit does not serve (the full path decides, as
    for any memo that does not hold)."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _with_deps(tmp_path, env, src)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (src / "deps").rename(tmp_path / "deps-was")
    (src / "deps").symlink_to(elsewhere)
    os.lchown(src / "deps", NOBODY, NOBODY)

    wrap(*DEPS_CMD, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert stats(env, "host")["hits"] == 2  # (the full path's)


@pytest.mark.parametrize("planted", ["folder", "link"])
def test_a_depfile_that_is_no_longer_a_file_is_left_to_the_full_path(
    tmp_path: Path, planted: str
) -> None:
    """deps/k.d made a folder, or a link: the quick hit does not serve (nothing put in
    place, nothing counted); the full path hands the command to gcc as it is.  (As
    before: the targets were checked before the count already.)"""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _with_deps(tmp_path, env, src)
    (src / "deps" / "k.d").unlink()
    if planted == "folder":
        (src / "deps" / "k.d").mkdir()
    else:
        (src / "deps" / "k.d").symlink_to(tmp_path / "target.d")

    done = wrap(*DEPS_CMD, env=env, cwd=src, status=None)
    status, *left = compiled_alone(src, DEPS_CMD[1:])
    assert done.returncode == status, done.stderr
    assert _quick_hits(tmp_path) == 0
    assert (src / "k.o").read_bytes() == left[0]


def test_a_rename_refused_after_another_output_was_renamed_leaves_the_compilers_outputs(
    tmp_path: Path,
) -> None:
    """k.o renamed into place, then the rename of deps/k.d refused (EPERM, as over
    another user's file in a sticky folder): gcc runs and writes both, so no output is
    left from the cache beside one that is not; nothing counted, no temporary file."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    flag = tmp_path / "refuse"
    env["LD_PRELOAD"] = str(refusing_rename(tmp_path, "k.d", flag))
    _with_deps(tmp_path, env, src)
    flag.touch()

    done = wrap(*DEPS_CMD, env=env, cwd=src)
    ran_instead(done, src, "Operation not permitted")
    assert outputs_left(src, 0) == compiled_alone(src, DEPS_CMD[1:])
    assert temporary_files(src) == []
    assert _quick_hits(tmp_path) == 0


def test_a_memo_name_holds_the_supplementary_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which compiler runs (which() asks os.access) and whose cache is trusted go by the
    groups too: a user added to or dropped from one gets another memo."""
    words, env = ["opcache", "wrap", "--", *CMD], {b"PATH": b"/usr/bin"}
    monkeypatch.setattr(os, "getgroups", lambda: [7, 5])
    name = quickhit.memo_name(words, env, b"/src", 0o22)
    monkeypatch.setattr(os, "getgroups", lambda: [5, 7])
    assert quickhit.memo_name(words, env, b"/src", 0o22) == name
    monkeypatch.setattr(os, "getgroups", lambda: [5])
    assert quickhit.memo_name(words, env, b"/src", 0o22) != name


@pytest.mark.parametrize("change", ["folder_made", "link_repointed", "header_removed"])
def test_a_path_changed_between_its_look_and_the_memo_gets_no_memo(
    tmp_path: Path, change: str
) -> None:
    """A parallel build makes a header (and its folder) earlier on the include path, or
    re-points a link to an older file, or removes a header, after the full hit looked
    and before its memo is written: the memo would certify the new state with the old
    object, so none is written, and the next run compiles what is there now."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    cmd, status = CMD, 0
    if change == "folder_made":
        for folder in ("A", "B/sub"):
            (src / folder).mkdir(parents=True)
        (src / "h.h").rename(src / "B" / "sub" / "h.h")
        (src / "k.c").write_text('#include "sub/h.h"\nint scale(int x) { return x * FACTOR; }\n')
        cmd = [*CMD, "-IA", "-IB"]
        action = "mkdir A/sub && echo '#define FACTOR 7' > A/sub/h.h"
    elif change == "link_repointed":
        (src / "hb.h").write_text("#define FACTOR 5\n")  # (old: past the racy window)
        (src / "h.h").rename(src / "ha.h")
        (src / "h.h").symlink_to("ha.h")
        action = "ln -sfn hb.h h.h"
    else:
        action, status = "rm h.h", 1
    wrap(*cmd, env=env, cwd=src)
    _age()
    _driven(cmd, env, src, TEST_BEFORE_MEMO=action)
    assert _memos(tmp_path) == []

    (src / "k.o").unlink()
    wrap(*cmd, env=env, cwd=src, status=status)
    assert _quick_hits(tmp_path) == 0
    if status == 0:
        assert (src / "k.o").read_bytes() == _plain(src, *cmd[1:3], *cmd[5:])


def test_sources_named_through_proc_self_are_checked(tmp_path: Path) -> None:
    """``/proc/self/cwd/k.c`` (Bazel's way) is an input like any other: edited, the
    next run compiles it anew."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    (src / "inc").mkdir()
    (src / "h.h").rename(src / "inc" / "h.h")
    cmd = ["gcc", "-c", "/proc/self/cwd/k.c", "-I/proc/self/cwd/inc", "-o", "k.o", "-DOFFSET=1"]
    wrap(*cmd, env=env, cwd=src)
    _age()
    wrap(*cmd, env=env, cwd=src)
    (src / "inc" / "h.h").write_text("#define FACTOR 9\n")
    (src / "k.c").write_text('#include "h.h"\nint scale(int x) { return x * FACTOR + 1; }\n')
    (src / "k.o").unlink()

    wrap(*cmd, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert (src / "k.o").read_bytes() == _plain(src, "-c", "k.c", "-Iinc", "-DOFFSET=1")


def test_a_link_made_just_now_gets_no_memo(tmp_path: Path) -> None:
    """The racy rule holds for a link too, not only for the older file it leads to."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    shutil.copy(src / "h.h", src / "ha.h")
    wrap(*CMD, env=env, cwd=src)
    _age()
    (src / "h.h").unlink()
    (src / "h.h").symlink_to("ha.h")
    wrap(*CMD, env=env, cwd=src)
    assert _memos(tmp_path) == []


def test_a_hard_link_planted_as_the_appended_counts_is_not_written(tmp_path: Path) -> None:
    """A shared cache's stats folder is the group's: a member may put there a hard link
    to a file of the user's elsewhere.  A quick hit never appends to it."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _memoized(tmp_path, env, src)
    (root,) = (tmp_path / "cache").glob("kernel_cache*")
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's own notes\n")
    os.link(notes, root / ".opcache" / "stats" / "host" / QUICK_COUNTS)
    (src / "k.o").unlink()

    wrap(*CMD, env=env, cwd=src)
    assert notes.read_text() == "the user's own notes\n"
    assert (src / "k.o").read_bytes() == _plain(src, "-c", "k.c", "-DOFFSET=1")


def test_a_header_in_a_folder_named_like_opcache_staging_is_checked(tmp_path: Path) -> None:
    """Only this run's own staging folder is left out of a memo, not every folder whose
    name starts as a staging folder's does."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    (src / ".opcache-wrap.inc").mkdir()
    (src / "h.h").rename(src / ".opcache-wrap.inc" / "h.h")
    cmd = [*CMD, "-I.opcache-wrap.inc"]
    _memoized(tmp_path, env, src, cmd)
    (src / ".opcache-wrap.inc" / "h.h").write_text("#define FACTOR 11\n")

    wrap(*cmd, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert (src / "k.o").read_bytes() == _plain(src, "-c", "k.c", *cmd[5:])


def test_a_memo_too_big_to_be_read_is_not_written(tmp_path: Path) -> None:
    """The quick path reads no memo over MAX_MEMO: a bigger one is not written at all."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    wrap(*CMD, env=env, cwd=src)
    _age()
    _driven(CMD, env, src, TEST_BEFORE_MEMO="true")
    assert len(_memos(tmp_path)) == 1
    size = _memos(tmp_path)[0].stat().st_size
    _memos(tmp_path)[0].unlink()
    _driven(CMD, env, src, TEST_BEFORE_MEMO="true", TEST_MAX_MEMO=str(size - 1))
    assert _memos(tmp_path) == []


def test_a_fold_that_cannot_lock_the_appended_counts_leaves_them(tmp_path: Path) -> None:
    """A quick hit stopped between its lock and its write (swapped out, ^Z) holds the
    file past the fold's wait: the fold leaves the file for the next one, so the
    line it then writes is not lost."""
    import fcntl

    folder = tmp_path / "stats"
    counters = CounterFiles(folder)
    counters.add({"hits": 2})
    line = b"hits=1 time_saved_seconds=0.5\n"
    lines = FOLD_BYTES // len(line) + 1
    (folder / QUICK_COUNTS).write_bytes(line * lines)
    stalled = os.open(folder / QUICK_COUNTS, os.O_WRONLY | os.O_APPEND)
    try:
        fcntl.flock(stalled, fcntl.LOCK_SH | fcntl.LOCK_NB)
        counters.add({"misses": 1})
        os.write(stalled, line)
    finally:
        os.close(stalled)
    assert counters.totals() == {
        "hits": 3 + lines,
        "time_saved_seconds": 0.5 * (lines + 1),
        "misses": 1,
    }


def test_a_memo_missing_a_record_runs_the_full_path(tmp_path: Path) -> None:
    """A memo of the right format but without its entry record (a bug, a format changed
    without a new FORMAT): the full path runs, never a traceback."""
    env, src = _env(tmp_path), write_project(tmp_path / "src")
    _memoized(tmp_path, env, src)
    (memo,) = _memos(tmp_path)
    fields = memo.read_bytes().split(b"\0")
    at = next(i for i, field in enumerate(fields) if field == b"e" and fields[i + 1][:1] == b"/")
    memo.write_bytes(b"\0".join(fields[:at] + fields[at + 6 :]))
    (src / "k.o").unlink()

    wrap(*CMD, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    assert (src / "k.o").read_bytes() == _plain(src, "-c", "k.c", "-DOFFSET=1")


def test_a_memo_that_misses_at_its_first_check_parses_none_of_the_rest(tmp_path: Path) -> None:
    """A command's memo often misses (a build folder made anew each time: scenario 10):
    its checks are taken one at a time, so the hundreds after the first that fails cost
    nothing (here they could not even be parsed)."""
    moved = [b"c", os.fsencode(tmp_path / "gone"), b"0", b"1", b"2", b"3", b"4", b"5", b"6", b"7"]
    unread = [b"c", b"/x", b"0", *[b"not a number"] * 7] * 500
    rest = [b"e", os.fsencode(tmp_path), b"1", b"2", b"manifest.json", b"-1.0"]
    rest += [b"o", os.fsencode(tmp_path / "k.o"), b"k.o", b"4", b"0" * 32, b"1", b"2"]
    rest += [b"n", os.fsencode(tmp_path), b"1", b"2", b"384", b"0.5", QUICK_COUNTS.encode()]
    with pytest.raises(quickhit.Miss):
        quickhit.Memo([*moved, *unread, *rest]).serve()


@pytest.mark.parametrize("cc", ["gcc", "clang"])
def test_a_once_only_twin_changed_is_no_quick_hit(tmp_path: Path, cc: str) -> None:
    """b/x.h holds a/x.h's #pragma once contents: gcc skips it (same mtime), clang too
    (a hard link). Edited (gcc) or made a copy (clang: another inode), it is read."""
    if shutil.which(cc) is None:
        pytest.skip(f"needs {cc}")
    env, src = _env(tmp_path), tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    a, b = src / "a" / "x.h", src / "b" / "x.h"
    a.write_text("#pragma once\nn++;\n")
    if cc == "clang":
        os.link(a, b)
    else:
        shutil.copy2(a, b)
    (src / "k.c").write_text(
        'int f(void) { int n = 0;\n#include "a/x.h"\n#include "b/x.h"\nreturn n; }\n'
    )
    cmd = [cc, "-O2", "-c", "k.c", "-o", "k.o"]
    _memoized(tmp_path, env, src, cmd)
    b.unlink()
    if cc == "clang":
        shutil.copy2(a, b)
    else:
        b.write_text("#pragma once\nn += 5;\n")

    wrap(*cmd, env=env, cwd=src)
    assert _quick_hits(tmp_path) == 0
    subprocess.run([cc, "-O2", "-c", "k.c", "-o", "plain.o"], cwd=src, check=True)
    assert (src / "k.o").read_bytes() == (src / "plain.o").read_bytes()
