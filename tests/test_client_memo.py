"""The C client serves a quick hit itself, from the memo a server's worker wrote for it.

The client computes the memo's name as ``quickhit.client_memo_name`` does,
checks each recorded path as ``quickhit.Memo.serve`` does, and checks each
artifact's xxh64: a hit it serves involves no server and no Python.  Here the
server is stopped (its socket gone) before the client's own hit: a call the
client does not serve runs the stand-in ``opcache`` (a ``wrap`` line in its
log), which must then give the right object.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
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
    write_project,
)
from test_server import (
    COMPILE,
    EXECVE_LIST,
    WAIT,
    Served,
    alive,
    answers,
    counted,
    run_with_entries,
    warmed,
)

from opcache import quickhit, quickmemo, server
from opcache.counters import QUICK_COUNTS

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed to build the client")


@pytest.fixture
def served(tmp_path):
    setup = Served(tmp_path)
    yield setup
    setup.stop()


def quick_folder(served: Served) -> Path:
    return served.folder / quickhit.FOLDER


def client_memos(served: Served) -> list[Path]:
    folder = quick_folder(served)
    return sorted(folder.glob("c*")) if folder.is_dir() else []


def appended(served: Served) -> int:
    (root,) = (served.tmp / "cache").glob("kernel_cache*")
    counts = root / ".opcache" / "stats" / "host" / QUICK_COUNTS
    return len(counts.read_bytes().splitlines()) if counts.exists() else 0


def memoized(served: Served, *args: str, stop: bool = True) -> bytes:
    """A miss, then a hit served by the server, whose worker writes the client's memo;
    then (unless not ``stop``) the server is stopped and its socket removed.  The
    object's bytes.

    (On a busy machine the server may not take a call within the client's 2 s: opcache
    serves that one itself, and writes no memo for the client.  The next call then.)"""
    args = args or tuple(COMPILE)
    warmed(served, *args)
    time.sleep(quickmemo.RACY_SECONDS + 0.3)  # (past the racy window: a memo may be written)
    deadline = time.monotonic() + WAIT
    while not client_memos(served) and time.monotonic() < deadline:
        done = served.gcc(*args)
        assert done.returncode == 0, done.stderr
        written = time.monotonic() + 5
        while not client_memos(served) and time.monotonic() < written:
            time.sleep(0.05)  # (the worker writes it once its reply is sent)
    assert len(client_memos(served)) == 1
    if stop:
        stop_server(served)
    return (served.src / "k.o").read_bytes()


def served_by_the_client_alone(served: Served) -> None:
    """A memo made, the object removed: the client alone writes it back, silently, with
    no opcache and no server started."""
    made = memoized(served)
    (served.src / "k.o").unlink()
    starts = served.starts.read_text()
    done = served.gcc(*COMPILE)
    assert (done.returncode, done.stderr) == (0, b"")
    assert (served.src / "k.o").read_bytes() == made
    assert served.starts.read_text() == starts


def stop_server(served: Served) -> None:
    pid = served.server_pid()
    served.stop()
    deadline = time.monotonic() + WAIT
    while pid and alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    served.socket.unlink(missing_ok=True)


def plain(served: Served, *args: str) -> bytes:
    subprocess.run([GCC, *args, "-o", "plain.o"], cwd=served.src, check=True)
    return (served.src / "plain.o").read_bytes()


def test_the_client_alone_serves_the_hit_once_the_server_is_gone(served):
    made = memoized(served)
    before, starts = served.fallbacks(), served.starts.read_text()
    (served.src / "k.o").unlink()

    for number in (1, 2):
        hit = served.gcc(*COMPILE)
        assert (hit.returncode, hit.stdout, hit.stderr) == (0, b"", b"")
        assert served.starts.read_text() == starts, "opcache or a server was started"
        assert (served.src / "k.o").read_bytes() == made
        assert appended(served) == number
    umask = os.umask(0o022)
    os.umask(umask)
    assert (served.src / "k.o").stat().st_mode & 0o777 == 0o666 & ~umask
    host = stats(served.env, "host")
    assert (host["misses"], host["hits"]) == (1, 3)  # (each hit counted once)
    assert served.fallbacks() == before and not served.socket.exists()


def test_a_warning_is_replayed_and_a_reader_that_left_ends_the_run_with_1(served):
    """stderr a pipe nobody reads any more: the object in place, the hit counted once, 1
    (as the Python path's quick hit ends)."""
    (served.src / "k.c").write_text(
        '#include "h.h"\nint scale(int x) { int unused; return x * FACTOR + OFFSET; }\n'
    )
    args = ["-Wall", *COMPILE]
    made = memoized(served, *args)
    before = served.fallbacks()
    alone = served.gcc(*args)
    assert alone.returncode == 0 and b"unused" in alone.stderr
    assert (served.fallbacks(), appended(served)) == (before, 1)
    (served.src / "k.o").unlink()

    done = served.gcc_unread(*args)
    assert done.returncode == 1
    assert (served.fallbacks(), appended(served)) == (before, 2)
    assert (served.src / "k.o").read_bytes() == made


STALE = [
    "header_edited_same_size_and_mtime",
    "header_made_earlier_on_the_include_path",
    "compiler_earlier_on_path",
    "keyed_variable_changed",
    "cleared",
    "artifact_corrupted_same_size",
    "ini_written",
    "specs_file_made",
    "once_only_twin_edited",
    "assembler_put_in_the_compilers_prefix",
]


@pytest.mark.parametrize("case", STALE)
def test_what_changed_since_the_memo_is_never_served_by_the_client(served, case):
    args = list(COMPILE)
    env = dict(served.env)
    if case == "header_made_earlier_on_the_include_path":
        for name in ("A", "B"):
            (served.src / name).mkdir()
        (served.src / "h.h").rename(served.src / "B" / "h.h")
        (served.src / "k.c").write_text(
            "#include <h.h>\nint scale(int x) { return x * FACTOR + OFFSET; }\n"
        )
        args += ["-IA", "-IB"]
    if case == "compiler_earlier_on_path":
        extra = served.tmp / "extra"
        extra.mkdir()
        # (after the client's links: the compiler the masquerade wraps is the first after them)
        served.env["PATH"] = served.env["PATH"].replace(
            f"{served.links}{os.pathsep}", f"{served.links}{os.pathsep}{extra}{os.pathsep}"
        )
        env = dict(served.env)
    if case == "specs_file_made":
        (served.tmp / "lib").mkdir()
        served.env["LIBRARY_PATH"] = str(served.tmp / "lib")  # (gcc looks there for specs)
        env = dict(served.env)
    if case == "once_only_twin_edited":
        # (b/x.h: a/x.h's #pragma once contents and mtime, which gcc skips unnamed)
        for name in ("a", "b"):
            (served.src / name).mkdir()
        (served.src / "a" / "x.h").write_text("#pragma once\nn++;\n")
        shutil.copy2(served.src / "a" / "x.h", served.src / "b" / "x.h")
        (served.src / "k.c").write_text(
            '#include "h.h"\nint scale(int x) { int n = 0;\n#include "a/x.h"\n'
            '#include "b/x.h"\nreturn x * FACTOR + OFFSET + n; }\n'
        )
    elif case == "assembler_put_in_the_compilers_prefix":
        gcc = relocated_gcc(served.tmp / "toolchain")
        served.env["PATH"] = served.env["PATH"].replace(
            f"{served.links}{os.pathsep}", f"{served.links}{os.pathsep}{gcc.parent}{os.pathsep}"
        )
        env = dict(served.env)
        time.sleep(quickmemo.RACY_SECONDS + 0.3)  # (a compiler copied just now: noted after)
    memoized(served, *args)
    # (a header list not remembered takes cc -M, which no server runs: the client's memo
    # may then come from a Python memo a server served, a quick hit counted)
    before, counted = served.fallbacks(), appended(served)
    (root,) = (served.tmp / "cache").glob("kernel_cache*")

    if case == "header_edited_same_size_and_mtime":
        header = served.src / "h.h"
        kept = header.stat()
        header.write_text("#define FACTOR 5\n")  # (same size)
        os.utime(header, ns=(kept.st_atime_ns, kept.st_mtime_ns))  # (ctime still moves)
    elif case == "header_made_earlier_on_the_include_path":
        (served.src / "A" / "h.h").write_text("#define FACTOR 7\n")
    elif case == "compiler_earlier_on_path":
        compiled_script(served.tmp / "extra" / "gcc", f'exec {GCC} -DFACTOR_TWICE "$@"\n')
    elif case == "keyed_variable_changed":
        env["CPATH"] = str(served.tmp)
    elif case == "cleared":
        opcache("clear", env=served.env, cwd=served.src)
    elif case == "artifact_corrupted_same_size":
        (artifact,) = root.glob("host/*/*/object")
        data = bytearray(artifact.read_bytes())
        data[-1] ^= 0xFF
        artifact.chmod(0o644)
        artifact.write_bytes(bytes(data))
    elif case == "ini_written":
        ini = root / "op_cache.ini"  # (none made: no toolkit; a person writes one)
        ini.write_text("[op_compiler_cache]\nmax_op_cache_size=-1\nremain_cache_size_ratio=50\n")
    elif case == "specs_file_made":
        (served.tmp / "lib" / "specs").write_text("*cc1_options:\n+ -DSPECS_READ\n\n")
    elif case == "once_only_twin_edited":
        (served.src / "b" / "x.h").write_text("#pragma once\nn += 5;\n")
    elif case == "assembler_put_in_the_compilers_prefix":
        assembler_in_its_prefix(gcc)

    done = served.gcc(*args, env=env)
    assert done.returncode == 0, done.stderr
    assert served.fallbacks() == before + 1, "the client served a memo that does not hold"
    assert appended(served) == counted
    if case == "assembler_put_in_the_compilers_prefix":
        assert (served.src / "k.o").read_bytes().endswith(b"tail")
    elif case != "compiler_earlier_on_path":
        compile_only = [arg for arg in args if arg not in ("-o", "k.o")]
        assert (served.src / "k.o").read_bytes() == plain(served, *compile_only)


def test_a_variable_the_name_leaves_out_changed_is_still_served(served):
    made = memoized(served)
    before = served.fallbacks()
    env = {**served.env, "MAKEFLAGS": " -j4 --jobserver-auth=fifo:/tmp/GMfifo1", "SHLVL": "9"}
    assert served.gcc(*COMPILE, env=env).returncode == 0
    assert (served.fallbacks(), appended(served)) == (before, 1)
    assert (served.src / "k.o").read_bytes() == made


def hostile(served: Served, case: str, memo: Path) -> None:
    if case == "memo_a_link":
        kept = memo.with_name("kept")
        memo.rename(kept)
        memo.symlink_to(kept)
    elif case == "memo_a_fifo":
        memo.unlink()
        os.mkfifo(memo, 0o600)
    elif case == "memo_another_user_s":
        os.chown(memo, NOBODY, -1)
    elif case == "quick_folder_group_writable":
        quick_folder(served).chmod(0o770)
    elif case == "runtime_folder_group_writable":
        served.folder.chmod(0o770)


HOSTILE = [
    "memo_a_link",
    "memo_a_fifo",
    pytest.param("memo_another_user_s", marks=requires_root),
    "quick_folder_group_writable",
    "runtime_folder_group_writable",
]


@pytest.mark.parametrize("case", HOSTILE)
def test_a_planted_or_exposed_memo_is_never_read(served, case):
    made = memoized(served)
    before = served.fallbacks()
    (memo,) = client_memos(served)
    hostile(served, case, memo)
    (served.src / "k.o").unlink()

    done = subprocess.run(
        ["gcc", *COMPILE], env=served.env, cwd=served.src, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert served.fallbacks() == before + 1, "the client served a memo it must not read"
    assert (served.src / "k.o").read_bytes() == made


def built_for_tests(tmp_path: Path, program: str) -> Path:
    """The client built with its test main (OPCACHE_TEST) for ``program``."""
    built = tmp_path / "client-test"
    flags = ["-O2", "-Wno-unused-function", "-DOPCACHE_TEST", *server.client_defines(program)]
    subprocess.run(
        [GCC, *flags, "-o", built, str(server.CLIENT_SOURCE)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return built


def test_python_s_xxh64_and_memo_name_are_the_client_s(tmp_path):
    """The client's C, built for its tests, against Python's xxhash and quickhit."""
    program = str(tmp_path / "opcache")
    built = built_for_tests(tmp_path, program)
    for size in [*range(101), 1000, 100_000]:
        data = os.urandom(size)
        for seed in (0, 1):
            for offset in (0, 3):  # (unaligned)
                got = subprocess.run(
                    [built, "xxh64", str(seed), str(offset)],
                    input=data,
                    capture_output=True,
                    check=True,
                ).stdout.strip()
                assert got.decode() == xxhash.xxh64_hexdigest(data, seed=seed), (size, seed)

    words = [program, "wrap", "--", "/usr/bin/gcc", "-c", "k.c", "-o", "k \u00e9.o"]
    env = {
        "PATH": os.environ["PATH"],
        "CPATH": "/a=b",
        "Z": "",
        **{os.fsdecode(name): "changes" for name in quickhit.UNKEYED_ENVIRONMENT},
    }
    umask = os.umask(0o022)
    os.umask(umask)
    for cwd in (tmp_path, Path("/")):
        got = subprocess.run(
            [built, "name", *words], env=env, cwd=cwd, capture_output=True, check=True
        ).stdout.strip()
        environb = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
        want = quickhit.client_memo_name(
            server.client_tag(program), words, environb, os.fsencode(cwd), umask
        )
        assert got.decode() == want


def test_a_client_that_cannot_name_its_memo_gets_none_written(served):
    """A variable given twice: the server keeps its first, the client cannot tell its memo's
    name as the server would; it does not serve, and asks for no memo, so the server's
    worker writes none (its work would be lost at every call)."""
    warmed(served, *COMPILE)
    time.sleep(quickmemo.RACY_SECONDS + 0.3)
    twice = ["TWICE=1", "TWICE=2"]
    for number in (1, 2):  # a full hit in a worker, which writes the Python memo; its quick hit
        done = run_with_entries(served, twice, [served.links / "gcc", *COMPILE])
        assert done.returncode == 0, done.stderr
        counted(served.env, "hits", number)
    # (at least one served by the server: a busy machine may leave one to opcache)
    assert served.fallbacks() <= 2
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        assert client_memos(served) == []
        time.sleep(0.1)


DEPS = [*COMPILE, "-MD", "-MF", "deps/k.d"]
STALE = b"stale: not written by this compile\n"


def memoized_with_deps(served: Served) -> None:
    """The client's memo of DEPS; then k.o and deps/k.d hold STALE (what a run leaves
    shows who wrote each: the cache, the compiler, or nobody)."""
    (served.src / "deps").mkdir(exist_ok=True)
    memoized(served, *DEPS)
    for output in (served.src / "k.o", served.src / "deps" / "k.d"):
        output.write_bytes(STALE)


def left_to_opcache(served: Served, done: subprocess.CompletedProcess, before: int) -> None:
    """The client served nothing and counted nothing: opcache ran (once), no server did
    (the client's fallback may start one; it serves no call here), and left no file."""
    assert served.fallbacks() == before + 1, done.stderr
    assert appended(served) == 0
    assert temporary_files(served.src) == []


def test_a_depfile_folder_made_read_only_is_left_to_opcache_which_runs_the_compiler(served):
    """The reviewer's case through the client: ``chmod a-w deps`` (deps/k.d writable).
    The client cannot make deps/k.d anew: it puts nothing in place and counts nothing;
    opcache runs gcc (the Python path's warning), which writes k.d in place: 0.  (All of
    it bound by modes: a memo, and a server, serve callers of their capabilities.)"""
    bound = served.prefix = bound_by_modes()
    memoized_with_deps(served)
    (served.src / "deps").chmod(0o555)
    before = served.fallbacks()

    done = subprocess.run(
        [*bound, "gcc", *DEPS], env=served.env, cwd=served.src, capture_output=True, timeout=120
    )
    ran_instead(done, served.src, "Permission denied")
    assert outputs_left(served.src, done.returncode) == compiled_alone(served.src, DEPS, bound)
    assert done.returncode == 0
    left_to_opcache(served, done, before)


def test_an_output_folder_gone_after_the_memo_is_left_to_opcache_which_fails_as_gcc(served):
    """-MF into a folder removed since: the client puts nothing in place (k.o stays as
    it was) and counts nothing; opcache runs gcc, which fails as it does alone."""
    memoized_with_deps(served)
    shutil.rmtree(served.src / "deps")
    before = served.fallbacks()

    done = served.gcc(*DEPS)
    ran_instead(done, served.src, "No such file or directory")
    assert outputs_left(served.src, done.returncode) == compiled_alone(served.src, DEPS)
    assert outputs_left(served.src, done.returncode) == (1, STALE, None)
    left_to_opcache(served, done, before)


@requires_root
def test_a_depfile_folder_on_a_read_only_mount_is_left_to_opcache(served):
    """deps/ read-only (a mount): gcc alone fails, leaving k.o as it was; the client
    replaces no output before it knows it can put them all (before: k.o replaced from
    the cache, then an error, the hit counted)."""
    memoized_with_deps(served)
    alone = served.tmp / "alone"
    shutil.copytree(served.src, alone)
    with read_only(alone / "deps"):
        plain_run = subprocess.run([GCC, *DEPS], cwd=alone, capture_output=True, timeout=120)
        want = outputs_left(alone, plain_run.returncode)
    before = served.fallbacks()
    with read_only(served.src / "deps"):
        done = served.gcc(*DEPS)
        ran_instead(done, served.src, "Read-only file system")
        assert outputs_left(served.src, done.returncode) == want == (1, STALE, STALE)
    left_to_opcache(served, done, before)


@requires_root
def test_a_full_disk_is_left_to_opcache_which_runs_the_compiler(served):
    """The project on a small tmpfs, filled up: no new k.o can be made beside the old
    one (ENOSPC), while gcc, which rewrites its outputs in place, can: 0."""
    with tmpfs(served.src, "size=1m"):
        write_project(served.src / "p")  # (a tmpfs is mounted over src: the project again)
        for name in ("k.c", "h.h"):
            (served.src / "p" / name).rename(served.src / name)
        (served.src / "p").rmdir()
        memoized_with_deps(served)
        for output in (served.src / "k.o", served.src / "deps" / "k.d"):
            output.write_bytes(b"x" * 4096)  # (a page each, which gcc gets back)
        fill(served.src / "filler")
        before = served.fallbacks()

        done = served.gcc(*DEPS)
        said = done.stderr.decode(errors="replace")
        assert "opcache: warning: cannot put the outputs in place: " in said, said
        assert "No space left on device; running the command" in said, said
        assert "opcache: error:" not in said, said
        (served.src / "filler").unlink()
        assert outputs_left(served.src, done.returncode) == compiled_alone(served.src, DEPS)
        assert done.returncode == 0
        left_to_opcache(served, done, before)


@requires_root
def test_a_depfile_folder_made_a_link_by_another_user_is_not_written_through(served):
    """deps/ replaced by another user's link to a folder elsewhere: not the folder the
    full hit wrote into, so the client does not serve (opcache decides)."""
    memoized_with_deps(served)
    elsewhere = served.tmp / "elsewhere"
    elsewhere.mkdir()
    (served.src / "deps").rename(served.tmp / "deps-was")
    (served.src / "deps").symlink_to(elsewhere)
    os.lchown(served.src / "deps", NOBODY, NOBODY)
    before = served.fallbacks()

    done = served.gcc(*DEPS)
    assert done.returncode == 0, done.stderr
    assert served.fallbacks() == before + 1
    assert appended(served) == 0


def test_a_worker_whose_quick_hit_cannot_put_an_output_leaves_the_call_to_opcache(served):
    """The server up, the client without a memo of its own: the worker's quick hit (the
    Python memo) cannot put deps/k.d in place; running gcc is more than a hit, so the
    worker gives the call back (its warning unsent) and opcache runs gcc: one warning,
    gcc's status, nothing counted."""
    (served.src / "deps").mkdir()
    memoized(served, *DEPS, stop=False)
    for memo in client_memos(served):
        memo.unlink()
    assert list(quick_folder(served).glob("m*"))  # (the worker's own memo)
    shutil.rmtree(served.src / "deps")
    (served.src / "k.o").write_bytes(STALE)
    before, hits = served.fallbacks(), stats(served.env, "host")["hits"]

    done = served.gcc(*DEPS)
    ran_instead(done, served.src, "No such file or directory")
    assert outputs_left(served.src, done.returncode) == (1, STALE, None)
    left_to_opcache(served, done, before)
    assert stats(served.env, "host")["hits"] == hits


def test_a_rename_refused_after_another_output_was_renamed_is_left_to_opcache(served):
    """k.o renamed into place, then the rename of deps/k.d refused (EPERM, as over
    another user's file in a sticky folder): the client counts nothing and removes its
    temporary file; opcache runs gcc, which writes both outputs (none is left from the
    cache beside one that is not)."""
    flag = served.tmp / "refuse"
    served.env["LD_PRELOAD"] = str(refusing_rename(served.tmp, "k.d", flag))
    memoized_with_deps(served)
    flag.touch()
    before = served.fallbacks()

    done = served.gcc(*DEPS)
    ran_instead(done, served.src, "Operation not permitted")
    assert outputs_left(served.src, done.returncode) == compiled_alone(served.src, DEPS)
    assert done.returncode == 0
    left_to_opcache(served, done, before)


def test_a_client_without_locale_variables_serves_its_memo_too(served):
    """No LANG (the worker takes LC_CTYPE as CPython would set it): the memo is still
    named by the client's own environment, so the client finds it."""
    for name in ("LANG", "LC_ALL", "LC_CTYPE"):
        served.env.pop(name, None)
    made = memoized(served)
    before = served.fallbacks()
    (served.src / "k.o").unlink()
    assert served.gcc(*COMPILE).returncode == 0
    assert (served.fallbacks(), appended(served)) == (before, 1)
    assert (served.src / "k.o").read_bytes() == made


def test_a_caller_whose_python_start_up_differs_from_the_server_s_is_left_to_opcache(served):
    """A server on a caller's socket, but started by hand with another PYTHONPATH than the
    caller's (the caller's program would load another opcache than the server runs): it
    leaves each such call to opcache, and writes no client memo (one named by that
    PYTHONPATH would certify what the server's modules did)."""
    warmed(served, *COMPILE)
    time.sleep(quickmemo.RACY_SECONDS + 0.3)
    env = {**served.env, "PYTHONPATH": str(served.tmp / "elsewhere")}
    socket = served.socket_of(env)
    with served.by_hand(socket) as by_hand:
        try:
            deadline = time.monotonic() + WAIT
            while not (socket.exists() and answers(socket)) and time.monotonic() < deadline:
                time.sleep(0.05)
            before = served.fallbacks()
            for number in (1, 2, 3):
                done = served.gcc(*COMPILE, env=env)
                assert done.returncode == 0, done.stderr
                assert served.fallbacks() == before + number
            assert by_hand.poll() is None  # (it was the server asked, and it said no)
        finally:
            by_hand.kill()
    assert client_memos(served) == []


def test_each_start_up_environment_gets_a_server_of_its_own(served):
    """Two clients with different HOMEs (a user site-packages each: maybe another
    opcache): each call starts, or is served by, a server started with its own HOME;
    after each one's first call, both are served hits, none is left to opcache."""
    other_home = served.tmp / "other-home"
    other_home.mkdir()
    envs = [served.env, {**served.env, "HOME": str(other_home)}]
    assert served.socket_of(envs[0]) != served.socket_of(envs[1])
    warmed(served, *COMPILE)  # (the miss, and the first HOME's server)
    (served.src / "k.o").unlink()
    assert served.gcc(*COMPILE, env=envs[1]).returncode == 0  # (it starts the second's)
    second = served.socket_of(envs[1])
    try:
        deadline = time.monotonic() + WAIT
        while not answers(second) and time.monotonic() < deadline:
            time.sleep(0.05)
        before, hits = served.fallbacks(), stats(served.env, "host")["hits"]
        for env in envs * 2:
            done = served.gcc("-DSERVED", *COMPILE, env=env)  # (no memo of either holds yet)
            assert done.returncode == 0, done.stderr
        assert served.fallbacks() == before + 1  # (the first of -DSERVED: a miss)
        assert counted(served.env, "hits", hits + 3)["hits"] == hits + 3
        for env in envs:
            pid = int(served.socket_of(env).with_suffix(".lock").read_text())
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"HOME=" + env["HOME"].encode() in environ
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(second.with_suffix(".lock").read_text()), signal.SIGKILL)


def _servers_up(folder: Path) -> list[int]:
    """The pids of the servers up in ``folder``: those holding their lock."""
    import fcntl

    up = []
    for lock in folder.glob("*.lock"):
        with open(lock, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                up.append(int(f.read() or 0))
    return up


def test_a_build_that_gives_each_compile_its_own_home_starts_no_more_than_four_servers(served):
    """(one per compile, each living minutes, would be a server per test of a test
    suite that makes a HOME per test): past four up, a call takes opcache's own path."""
    envs = []
    for n in range(6):
        home = served.tmp / f"home-{n}"
        home.mkdir()
        envs.append({**served.env, "HOME": str(home)})
    try:
        for n, env in enumerate(envs):
            done = served.gcc(*COMPILE, env=env)
            assert done.returncode == 0, done.stderr
            deadline = time.monotonic() + (WAIT if n < 4 else 2)
            while not answers(served.socket_of(env)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(_servers_up(served.folder)) == min(n + 1, 4)
    finally:
        for pid in _servers_up(served.folder):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_the_start_up_variables_compared_are_those_the_client_starts_a_server_with():
    """In the same order: the socket's name hashes their values in it."""
    source = server.CLIENT_SOURCE.read_text()
    listed = source.split("SERVER_ENV[] = {", 1)[1].split("}", 1)[0]
    names = [name.encode() for name in re.findall(r'"([A-Z0-9_]+)"', listed)]
    startup = [name for name in names if name == b"HOME" or name.startswith(b"PYTHON")]
    assert list(server.STARTUP_ENVIRONMENT) == startup


def test_python_s_socket_name_is_the_client_s(tmp_path):
    """The client's C, built for its tests, names the socket of its start-up environment
    as ``server.socket_name`` does: set, empty, unset, given twice, not UTF-8."""
    program = str(tmp_path / "opcache")
    built = built_for_tests(tmp_path, program)
    cases = [
        {},
        {b"HOME": b"/home/a"},
        {b"HOME": b""},
        {b"HOME": b"/home/b", b"PYTHONPATH": b"/x:/y", b"PYTHONDONTWRITEBYTECODE": b"1"},
        {b"HOME": b"/h\xff\xfe", b"PYTHONUTF8": b"1", b"PYTHONNOUSERSITE": b"", b"LANG": b"C"},
    ]
    for env in cases:
        got = subprocess.run([built, "socket"], env=env, capture_output=True, check=True)
        assert got.stdout.strip().decode() == server.socket_name(program, env), env
    launcher = tmp_path / "execve_list.py"
    launcher.write_text(EXECVE_LIST)
    twice = [sys.executable, launcher, "HOME=/first", "HOME=/second", "--", built, "socket"]
    got = subprocess.run(twice, env={}, capture_output=True, check=True)
    assert got.stdout.strip().decode() == server.socket_name(program, {b"HOME": b"/first"})


NO_GETRANDOM = r"""
#include <errno.h>
#include <sys/types.h>
ssize_t getrandom(void *buffer, size_t size, unsigned int flags) {
    (void)buffer, (void)size, (void)flags;
    errno = ENOSYS; /* (a seccomp allow-list without it, a kernel before 3.17) */
    return -1;
}
"""


def test_a_hit_the_client_counts_never_fails_for_want_of_getrandom(served):
    """The temp names of the outputs need no getrandom(2): without it the client's hit
    is served (counted once, the object written), as the Python path serves it."""
    shim = served.tmp / "no_getrandom.so"
    source = served.tmp / "no_getrandom.c"
    source.write_text(NO_GETRANDOM)
    subprocess.run([GCC, "-shared", "-fPIC", "-o", shim, source], check=True, timeout=120)
    served.env["LD_PRELOAD"] = str(shim)  # (every process: Python falls back to /dev/urandom)
    served_by_the_client_alone(served)
    assert appended(served) == 1


NAMED_IN_ITS_OWN_UTS = """
import os, socket, subprocess, sys
from opcache import quickhit
socket.sethostname(b"build\\xff")
built, tag, *words = sys.argv[1:]
got = subprocess.run([built, "name", *words], capture_output=True, check=True).stdout
umask = os.umask(0o022)
os.umask(umask)
print(got.decode().strip(), quickhit.client_memo_name(tag, words, os.environb, os.getcwdb(), umask))
"""


@requires_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_host_name_that_is_not_utf8_names_the_memo_as_the_client_does(tmp_path):
    """The host name's bytes as they are (no exception naming the memo in the worker,
    which then served its call, and the C's name)."""
    program = str(tmp_path / "opcache")
    built = built_for_tests(tmp_path, program)
    words = [program, "wrap", "--", "/usr/bin/gcc", "-c", "k.c"]
    script = [sys.executable, "-c", NAMED_IN_ITS_OWN_UTS, built, server.client_tag(program)]
    done = subprocess.run(
        ["unshare", "--uts", *script, *words],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got, want = done.stdout.split()
    assert got == want


def test_an_error_after_the_count_to_a_closed_stderr_ends_with_1(served):
    """Delivered and counted, the hit's stdout cannot be written (a full device), and
    the error line meets a reader that left: 1, as the Python quick hit's, not a death
    by SIGPIPE (nor a second count, nor opcache run)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    tools = served.tmp / "tools"
    tools.mkdir()
    compiled_script(  # (a compile that says something on stdout: replayed by a hit)
        tools / "gcc", f'case " $* " in *" -c "*) echo compiled;; esac\nexec {GCC} "$@"\n'
    )
    served.env["PATH"] = served.env["PATH"].replace(
        f"{served.links}{os.pathsep}", f"{served.links}{os.pathsep}{tools}{os.pathsep}"
    )
    time.sleep(quickmemo.RACY_SECONDS + 0.3)  # (a compiler made just now: noted after)
    made = memoized(served)
    (served.src / "k.o").unlink()
    starts = served.starts.read_text()
    read, write = os.pipe()
    os.close(read)
    try:
        with open("/dev/full", "wb") as full:
            done = subprocess.run(
                ["gcc", *COMPILE], env=served.env, cwd=served.src, stdout=full, stderr=write,
                timeout=120,
            )  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 1
    assert served.starts.read_text() == starts
    assert appended(served) == 1
    assert (served.src / "k.o").read_bytes() == made


def test_a_client_built_with_ubsan_serves_empty_streams(served):
    """Nearly every hit has an empty stdout and stderr: no null pointer reaches memcpy,
    xxh64 or memmem for them (a client built with -fsanitize=undefined stops on one)."""
    build = subprocess.run(
        [
            GCC,
            "-O2",
            "-fsanitize=undefined",
            "-fno-sanitize-recover=all",
            *server.client_defines(str(served.program)),
            "-o",
            served.client,
            str(server.CLIENT_SOURCE),
        ],
        capture_output=True,
        timeout=120,
    )
    if build.returncode != 0:
        pytest.skip(f"no UBSan here: {build.stderr.decode(errors='replace')[-200:]}")
    served_by_the_client_alone(served)  # (the client is on the paths a memo checks: built first)


@requires_root
@pytest.mark.skipif(
    not (shutil.which("setpriv") and shutil.which("unshare")), reason="needs setpriv, unshare"
)
@pytest.mark.parametrize(
    "how",
    [
        ["setpriv", "--groups", "4242"],
        ["setpriv", "--regid", "4242", "--keep-groups"],
        ["unshare", "--uts"],
    ],
)
def test_a_caller_with_other_groups_or_host_than_the_server_s_is_left_to_opcache(served, how):
    """After newgrp, sg or setpriv (other groups), or in its own UTS namespace: a worker
    would check the paths with the server's groups, and name the client's memo with the
    server's; the caller runs opcache itself (with its own), and no memo is written."""
    warmed(served, *COMPILE)
    time.sleep(quickmemo.RACY_SECONDS + 0.3)
    before = served.fallbacks()
    for number in (1, 2):
        done = subprocess.run(
            [*how, served.links / "gcc", *COMPILE],
            env=served.env,
            cwd=served.src,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert served.fallbacks() == before + number
    assert client_memos(served) == []


def test_a_memo_the_client_serves_is_renewed_so_it_is_not_cleaned_while_in_use(served):
    """The server never sees the calls the client serves: the client renews its memo's
    time (a day at a time), or every memo of a project would go after MEMO_DAYS at once."""
    memoized(served)
    (memo,) = client_memos(served)
    old = time.time() - 3 * 86400
    os.utime(memo, (old, old))
    (served.src / "k.o").unlink()
    assert served.gcc(*COMPILE).returncode == 0
    assert appended(served) == 1
    assert memo.stat().st_mtime > old + 2 * 86400
