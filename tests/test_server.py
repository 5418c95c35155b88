"""opcache's C client and ``opcache server``: a served hit is the Python path's hit.

The client is built here with the machine's gcc, falling back on a stand-in
``opcache`` program that notes each start (``wrap`` or ``server``) and then
runs opcache: a call the server served leaves no ``wrap`` line.  Every other
outcome (a miss, a failure, an uncacheable call, no server, a dead or stale
socket, a socket or folder that is not the user's own, a server gone
mid-request, a reply that makes no sense) must be what ``opcache wrap`` alone
gives: same exit status, stdout, stderr, object and stats.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_opc import base_env
from helpers_faults import IS_ROOT, NEEDS_ROOT, NOBODY
from helpers_wrap import GCC, K_C, lines, link_compilers, opcache, stats, wrap, write_project

from opcache import quickhit, quickmemo, server
from opcache.counters import QUICK_COUNTS

pytestmark = pytest.mark.skipif(GCC is None, reason="gcc is needed to build the client")

COMPILE = ["-O2", "-DOFFSET=4", "-c", "k.c", "-o", "k.o"]
WAIT = 60.0  # bound on waiting for a server to come or go (never a figure asserted)


class Served:
    """A client built against a counting ``opcache``, its links, and an environment."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.starts = tmp_path / "starts.log"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        self.program = bin_dir / "opcache"
        self.program.write_text(
            f"#!{sys.executable}\n"
            "import sys\n"
            f"with open({str(self.starts)!r}, 'a') as f:\n"
            "    f.write((sys.argv[1:2] or [''])[0] + '\\n')\n"
            "from opcache.cli import main\n"
            "sys.exit(main())\n"
        )
        self.program.chmod(0o755)
        self.links = tmp_path / "links"
        self.links.mkdir()
        self.env = {
            **base_env(tmp_path),
            "XDG_RUNTIME_DIR": str(tmp_path / "run"),
            server.ENV_IDLE: "120",
        }
        (tmp_path / "run").mkdir(mode=0o700)
        self.client = server.build_client(self.links, str(self.program), self.env)
        link_compilers(self.links, self.client, "gcc")
        self.env["PATH"] = f"{self.links}{os.pathsep}{self.env['PATH']}"
        self.folder = Path(quickhit.runtime_folder(self.env))
        self.socket = self.socket_of(self.env)
        self.src = write_project(tmp_path / "src")
        self.prefix: list[str] = []  # what the client runs under (bound_by_modes)

    def socket_of(self, env: dict[str, str]) -> Path:
        """The socket of the server for a client run with ``env`` (its start-up's own)."""
        environb = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
        return self.folder / server.socket_name(str(self.program), environb)

    def gcc(
        self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.prefix, "gcc", *args],
            env=env or self.env,
            cwd=cwd or self.src,
            capture_output=True,
            timeout=120,
        )

    def gcc_unread(self, *args: str) -> subprocess.CompletedProcess:
        """``gcc`` with its stderr a pipe nobody reads any more."""
        read, write = os.pipe()
        os.close(read)
        try:
            return subprocess.run(
                ["gcc", *args],
                env=self.env,
                cwd=self.src,
                stdout=subprocess.DEVNULL,
                stderr=write,
                timeout=120,
            )
        finally:
            os.close(write)

    def by_hand(self, socket: Path | None = None, **kwargs) -> subprocess.Popen:  # type: ignore[no-untyped-def]
        """``opcache server`` started by hand on ``socket`` (this one's by default)."""
        return subprocess.Popen(
            [self.program, "server", "--socket", str(socket or self.socket)],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs,
        )  # fmt: skip

    def fallbacks(self) -> int:
        return lines(self.starts).count("wrap")

    def server_pid(self) -> int | None:
        try:
            return int((self.socket.with_suffix(".lock")).read_text())
        except (OSError, ValueError):
            return None

    def wait_for_server(self) -> int:
        """The server's pid once it listens (the first compile started it)."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            pid = self.server_pid()
            if pid and self.socket.exists() and answers(self.socket):
                return pid
            time.sleep(0.05)
        pytest.fail(f"no server on {self.socket} after {WAIT} s")

    def stop(self) -> None:
        pid = self.server_pid()
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)


def connected(path: Path) -> socket.socket:
    """A connection to the socket ``path``, reached through its folder as the client
    does (a long test folder's path does not fit in a socket address); OSError if none."""
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        conn = socket.socket(socket.AF_UNIX)
        try:
            conn.connect(f"/proc/self/fd/{folder}/{path.name}")
        except OSError:
            conn.close()
            raise
        return conn
    finally:
        os.close(folder)


def answers(path: Path) -> bool:
    """Whether a server listens on ``path``."""
    try:
        connected(path).close()
    except OSError:
        return False
    return True


def bind_at(listener: socket.socket, path: Path) -> None:
    """Bind ``listener`` to ``path`` through its folder, as the server does (a long test
    folder's path does not fit in a socket address)."""
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        listener.bind(f"/proc/self/fd/{folder}/{path.name}")
    finally:
        os.close(folder)


def processes_of(socket_path: Path) -> list[int]:
    """The server and its workers: every process started for ``socket_path``."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            named = str(socket_path).encode() in (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if named:
            found.append(int(entry.name))
    return found


def counted(env: dict[str, str], name: str, expected: int) -> dict:
    """The host chip's stats once ``name`` reaches ``expected`` (or after WAIT): a worker
    writes a served hit's counts just after its client has the reply."""
    deadline = time.monotonic() + WAIT
    while (host := stats(env, "host")).get(name) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return host


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def served(tmp_path):
    setup = Served(tmp_path)
    yield setup
    setup.stop()


def warmed(served: Served, *args: str) -> subprocess.CompletedProcess:
    """Compile once (a miss, which starts the server) and wait for the server."""
    first = served.gcc(*args)
    served.wait_for_server()
    return first


def python_path(served: Served, *args: str) -> subprocess.CompletedProcess:
    """The same compile through ``opcache wrap`` alone, on the same cache."""
    return wrap("gcc", *args, env=served.env, cwd=served.src, status=None)


def test_a_hit_is_served_with_the_python_hit_s_bytes_and_counts(served):
    (served.src / "k.c").write_text(K_C + "int unused(void) { int x; return 0; }\n")
    args = ["-Wall", *COMPILE]
    first = warmed(served, *args)
    assert first.returncode == 0 and b"unused variable" in first.stderr
    assert served.fallbacks() == 1 and lines(served.starts).count("server") >= 1
    made = (served.src / "k.o").read_bytes()
    before = served.fallbacks()
    hit = served.gcc(*args)
    assert served.fallbacks() == before, "the hit was not served"
    (served.src / "k.o").unlink()
    alone = python_path(served, *args)
    assert (hit.returncode, hit.stdout, hit.stderr) == (0, alone.stdout, alone.stderr)
    assert b"unused variable" in hit.stderr  # the compiler's warning, replayed
    assert (served.src / "k.o").read_bytes() == made
    host = counted(served.env, "hits", 2)
    assert (host["misses"], host["hits"]) == (1, 2)


def _other_day_zone() -> str:
    """A POSIX TZ whose local date is not UTC's now, and whose midnight is hours away."""
    hour = time.gmtime().tm_hour
    ahead = 12 - hour + (24 if hour >= 12 else -24)  # (local noon of the next or last day)
    return f"XYZ{-ahead:+d}"  # (POSIX counts west: XYZ-13 is 13 hours ahead of UTC)


def test_a_served_date_macro_is_keyed_by_the_client_s_time_zone(served):
    """A worker read the date in its server's zone (TZ is read at tzset, never called):
    where the client's TZ has another day (Asia/Shanghai from 00:00 to 08:00 beside a
    UTC system), it looked for another key than the Python path's: yesterday's entry,
    stale, once it crossed its own midnight; a miss, handed back, until then."""
    warmed(served, *COMPILE)
    (served.src / "d.c").write_text("const char *built = __DATE__;\n")
    env = {**served.env, "TZ": _other_day_zone()}
    args = ["-c", "d.c", "-o", "d.o"]
    assert served.gcc(*args, env=env).returncode == 0  # a miss: opcache stores it
    stored = (served.src / "d.o").read_bytes()
    before = served.fallbacks()
    (served.src / "d.o").unlink()
    assert served.gcc(*args, env=env).returncode == 0
    assert served.fallbacks() == before, "the hit was not served"
    assert (served.src / "d.o").read_bytes() == stored
    local = time.strftime("%b %e %Y", time.gmtime(time.time() - _hours(env["TZ"]) * 3600))
    assert local.encode() in stored


def _hours(zone: str) -> int:
    return int(zone[3:])


def test_a_served_hit_whose_reader_left_ends_with_1_as_the_python_path(served):
    """stderr a pipe nobody reads: the client died of SIGPIPE replaying the server's
    reply (status -13), where the Python path and the client's own memo hit end with 1."""
    (served.src / "k.c").write_text(K_C + "int unused(void) { int x; return 0; }\n")
    args = ["-Wall", *COMPILE]
    warmed(served, *args)
    before = served.fallbacks()
    done = served.gcc_unread(*args)
    assert served.fallbacks() == before, "the hit was not served"
    assert done.returncode == 1


def test_a_runtime_folder_whose_base_is_gone_starts_no_server(served):
    """XDG_RUNTIME_DIR naming a folder that is not there (after su, or a logout): each
    compile started a server that could not make its folder, beside opcache itself."""
    env = {**served.env, "XDG_RUNTIME_DIR": str(served.tmp / "gone")}
    for _ in range(2):
        assert served.gcc(*COMPILE, env=env).returncode == 0
    assert lines(served.starts).count("server") == 0
    assert served.fallbacks() == 2


def test_calls_at_once_are_each_served_once(served):
    warmed(served, *COMPILE)
    made = (served.src / "k.o").read_bytes()
    before, hits = served.fallbacks(), stats(served.env, "host")["hits"]
    calls = [
        subprocess.Popen(["gcc", *COMPILE[:-1], f"k{i}.o"], env=served.env, cwd=served.src)
        for i in range(8)
    ]
    assert [call.wait(timeout=120) for call in calls] == [0] * 8
    assert served.fallbacks() == before
    assert all((served.src / f"k{i}.o").read_bytes() == made for i in range(8))
    assert counted(served.env, "hits", hits + 8)["hits"] == hits + 8


def test_nothing_of_one_call_stays_for_the_next(served):
    """A worker serves calls one after another: each gets its own folder, umask,
    environment and descriptors, as each Python path run does."""
    warmed(served, *COMPILE)
    other = served.tmp / "other"
    shutil.copytree(served.src, other)
    served.gcc(*COMPILE, cwd=other)  # (its first call: a miss there)
    before = served.fallbacks()
    modes = {}
    for umask, folder, verbose in (
        (0o077, served.src, "1"),
        (0o022, other, ""),
        (0o027, served.src, ""),
    ):
        (folder / "k.o").unlink()
        env = {**served.env, "OPCACHE_VERBOSE": verbose}
        done = subprocess.run(
            ["gcc", *COMPILE], env=env, cwd=folder, capture_output=True, umask=umask, timeout=120
        )
        assert done.returncode == 0
        assert (b"opcache: info: hit" in done.stderr) == bool(verbose), done.stderr
        modes[umask] = (folder / "k.o").stat().st_mode & 0o777
    assert served.fallbacks() == before  # all three served
    assert modes == {0o077: 0o600, 0o022: 0o644, 0o027: 0o640}


def test_a_served_hit_says_what_opcache_v_says(served):
    warmed(served, *COMPILE)
    verbose = {**served.env, "OPCACHE_VERBOSE": "1"}
    before = served.fallbacks()
    hit = served.gcc(*COMPILE, env=verbose)
    assert served.fallbacks() == before
    alone = wrap("gcc", *COMPILE, env=verbose, cwd=served.src)
    assert hit.stderr.decode().splitlines()[-1] == alone.stderr.decode().splitlines()[-1]
    assert "hit" in hit.stderr.decode()


@pytest.mark.parametrize(
    "case",
    ["miss", "compile error", "uncacheable", "disabled", "usage"],
)
def test_what_is_not_a_hit_is_the_python_path_s_own(served, case):
    warmed(served, "-c", "k.c", "-o", "warm.o")
    env = dict(served.env)
    args = list(COMPILE)
    if case == "compile error":
        (served.src / "k.c").write_text("int f(void) { return nope; }\n")
    elif case == "uncacheable":
        args = ["-E", "k.c"]
    elif case == "disabled":
        env["OPCACHE_DISABLE"] = "1"
    elif case == "usage":
        env["OPCACHE_MODE"] = "sometimes"  # a bad variable: warned, compiled without the cache
    before = served.fallbacks()
    got = served.gcc(*args, env=env)
    assert served.fallbacks() == before + 1
    made = (served.src / "k.o").read_bytes() if (served.src / "k.o").exists() else None
    counts = stats(served.env)
    # The same call again through the Python path alone gives the same, counted once more.
    (served.src / "k.o").unlink(missing_ok=True)
    alone = wrap("gcc", *args, env=env, cwd=served.src, status=None)
    if case == "miss":  # (now a hit: compare with plain gcc's object)
        subprocess.run([GCC, *args], cwd=served.src, check=True)
    assert (got.returncode, got.stdout) == (alone.returncode, alone.stdout)
    if case != "usage":  # (the warning shows once an hour: the second run is silent)
        assert got.stderr == alone.stderr
    else:
        assert b"sometimes" in got.stderr
    if made is not None:
        assert (served.src / "k.o").read_bytes() == made
    again = stats(served.env)
    once_more = {"miss": "hits", "uncacheable": "uncacheable"}
    for name in ("misses", "hits", "stores", "uncacheable", "errors"):
        grew = again.get(name, 0) - counts.get(name, 0)
        assert grew == (name == once_more.get(case)), name
    if case == "uncacheable":  # (counted once by the client's call, not twice)
        assert counts["uncacheable"] == 1


def test_a_dead_server_s_socket_costs_one_python_compile_then_a_new_server(served):
    warmed(served, *COMPILE)
    old = served.wait_for_server()
    deadline = time.monotonic() + WAIT
    while len(processes_of(served.socket)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # (the server, and a worker waiting for a call)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + WAIT
    while processes_of(served.socket) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of(served.socket) == []  # its waiting worker went with it
    assert served.socket.exists()  # left behind: stale
    before = served.fallbacks()
    done = served.gcc(*COMPILE)
    assert done.returncode == 0 and served.fallbacks() == before + 1
    # (It once did not come up in one CI run in four: the test's own probe of the old
    # server had made a worker busy, which outlived it holding its lock, so the new
    # one took the lock as another server's and exited.  Workers hold no lock now.)
    assert served.wait_for_server() != old
    started = served.fallbacks()
    assert started == before + 1
    served.gcc(*COMPILE)
    assert served.fallbacks() == started  # served again


def gone(pid: int) -> bool:
    """Whether ``pid`` ended (a zombie no one has reaped yet counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def server_killed_while_a_worker_is_busy(served: Served) -> socket.socket:
    """The server SIGKILLed while one of its workers has taken a call (this connection,
    the request not sent yet): the worker outlives it until the call ends."""
    warmed(served, *COMPILE)
    old = served.wait_for_server()
    call = connected(served.socket)
    call.settimeout(WAIT)
    assert call.recv(1) == server.TAKEN
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + WAIT
    while not gone(old) and time.monotonic() < deadline:
        time.sleep(0.05)
    return call


def test_a_worker_that_outlives_its_server_leaves_its_socket(served):
    """The call ends once the server is gone: the worker ends, and leaves the socket as
    the killed server did (stale: the next call starts a server), never running the
    server's clean-up (it unlinked the socket and killed the workers it knew of)."""
    call = server_killed_while_a_worker_is_busy(served)
    worker = struct.unpack("=i", call.recv(4))[0]
    call.close()
    deadline = time.monotonic() + WAIT
    while not gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(worker) and served.socket.exists()
    before = served.fallbacks()
    assert served.gcc(*COMPILE).returncode == 0
    assert served.fallbacks() == before + 1
    served.wait_for_server()
    assert served.gcc(*COMPILE).returncode == 0
    assert served.fallbacks() == before + 1  # served by the new server


def test_a_worker_that_outlives_its_server_does_not_keep_a_new_one_from_starting(served):
    """The lock a server holds is not held by its workers: one still busy with a call
    of the killed server does not make the next server think another serves."""
    call = server_killed_while_a_worker_is_busy(served)
    with served.by_hand() as by_hand:
        try:
            deadline = time.monotonic() + WAIT
            while served.server_pid() != by_hand.pid and time.monotonic() < deadline:
                assert by_hand.poll() is None, "it took the lock as held: it did not start"
                time.sleep(0.05)
            call.close()  # (the old worker ends)
            served.wait_for_server()
            before = served.fallbacks()
            assert served.gcc(*COMPILE).returncode == 0
            assert served.fallbacks() == before  # served
        finally:
            by_hand.kill()


class FakeServer:
    """Listens on the client's socket (as a server of the user's would) and misbehaves."""

    def __init__(self, path: Path, reply: bytes | None) -> None:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        self.listener = socket.socket(socket.AF_UNIX)
        bind_at(self.listener, path)
        self.listener.listen(4)
        self.listener.settimeout(WAIT)
        self.reply = reply

    def answer_one(self) -> None:
        import threading

        def run() -> None:
            conn, _ = self.listener.accept()
            with conn:
                conn.settimeout(WAIT)
                conn.sendall(server.TAKEN + struct.pack("=i", os.getpid()))
                conn.recv(4)  # the request's length, then leave (killed mid-request)
                if self.reply is not None:
                    conn.sendall(self.reply)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


@pytest.mark.parametrize(
    "reply",
    [None, b"S\0\0\0\0\1\5\0\0\0hel", b"garbage", b"N"],
    ids=["gone mid-request", "cut short", "not the protocol", "not served"],
)
def test_a_server_that_does_not_serve_leaves_the_compile_to_opcache(served, reply):
    fake = FakeServer(served.socket, reply)
    fake.answer_one()
    done = served.gcc("-Wall", *COMPILE)
    fake.thread.join(WAIT)
    assert not fake.thread.is_alive()
    assert done.returncode == 0 and served.fallbacks() == 1
    assert done.stdout == b""  # nothing of the fake's reply written
    subprocess.run([GCC, *COMPILE, "-o", "plain.o"], cwd=served.src, check=True)
    assert (served.src / "k.o").read_bytes() == (served.src / "plain.o").read_bytes()
    fake.listener.close()


def test_a_worker_stopped_after_taking_the_call_is_killed_and_opcache_runs_itself(served):
    """A worker that took the call and then stops (SIGSTOP, a frozen cgroup, a
    debugger) says no more "alive": the client kills it, waits until it is gone,
    and runs opcache itself, instead of hanging the build."""
    served.folder.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as listener:
        bind_at(listener, served.socket)
        listener.listen(4)
        worker = subprocess.Popen(  # the listener's child, as the server's workers are
            [
                sys.executable,
                "-c",
                "import os, signal, socket, struct, sys\n"
                "conn, _ = socket.socket(fileno=int(sys.argv[1])).accept()\n"
                "conn.sendall(b'T' + struct.pack('=i', os.getpid()))\n"
                "conn.recv(1 << 16)\n"
                "os.kill(os.getpid(), signal.SIGSTOP)\n",
                str(listener.fileno()),
            ],
            pass_fds=[listener.fileno()],
        )
        try:
            done = served.gcc(*COMPILE)  # (hung until killed by the timeout, before)
            assert worker.wait(WAIT) == -signal.SIGKILL
        finally:
            worker.kill()
            worker.wait(WAIT)
    assert done.returncode == 0, done.stderr
    assert served.fallbacks() == 1
    subprocess.run([GCC, *COMPILE[:-1], "plain.o"], cwd=served.src, check=True)
    assert (served.src / "k.o").read_bytes() == (served.src / "plain.o").read_bytes()


# The stand-in ``opcache`` of a server whose workers, while ``gate`` (a FIFO) exists, hold
# the rename that puts k.o in place until the test opens the FIFO: ``reached`` (the
# worker's pid) says one is held there, ``done`` that the rename returned or raised.
HELD_RENAME = """
import os
import sys
with open({starts!r}, "a") as f:
    f.write((sys.argv[1:2] or [""])[0] + "\\n")
if sys.argv[1:2] == ["server"]:
    def holding(rename):
        def held(src, dst, *args, **kwargs):
            name = os.fsdecode(dst)
            if not (name in ("k.o", "/k.o") or name.endswith("/k.o")) or not os.path.exists(
                {gate!r}
            ):
                return rename(src, dst, *args, **kwargs)
            with open({reached!r}, "w") as f:
                f.write(str(os.getpid()))
            with open({gate!r}):
                pass
            try:
                return rename(src, dst, *args, **kwargs)
            finally:
                open({done!r}, "w").close()
        return held
    os.replace, os.rename = holding(os.replace), holding(os.rename)
from opcache.cli import main
sys.exit(main())
"""


def waited_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path.name}: not after {WAIT} s"


def opened_to_write(fifo: Path) -> int:
    """``fifo`` opened to write once its reader is there (ENXIO until then)."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("ended_by", [signal.SIGINT, signal.SIGKILL])
@pytest.mark.parametrize("hit", ["full hit", "quick hit"])
def test_a_client_killed_mid_call_has_no_output_put_in_place_after_it_ended(served, hit, ended_by):
    """The client is ended while its worker still serves the call: by SIGKILL at once;
    by a Ctrl-C once its worker let the call go (it tells the worker, and waits).  The
    build goes on: a newer k.o is written (the source edited, compiled by hand), then
    the worker reaches its rename.  It must not put the old object over the newer
    one, and a Ctrl-C's status must not come before the worker is done with the
    outputs.  The window is held open by the stand-in server (HELD_RENAME), not by a
    delay: the worker waits at the rename until the test lets it go."""
    marks = {name: served.tmp / name for name in ("gate", "reached", "done")}
    served.program.write_text(
        f"#!{sys.executable}\n"
        + HELD_RENAME.format(starts=str(served.starts), **{k: str(v) for k, v in marks.items()})
    )
    warmed(served, *COMPILE)
    old = (served.src / "k.o").read_bytes()
    if hit == "quick hit":  # a memo the worker serves the call from (quickhit.py)
        time.sleep(quickmemo.RACY_SECONDS + 0.3)
        line = [str(served.program), "wrap", "--", str(served.links / "gcc"), *COMPILE]
        subprocess.run(line, env=served.env, cwd=served.src, check=True, timeout=120)
    os.mkfifo(marks["gate"])
    before = served.fallbacks()
    client = subprocess.Popen(["gcc", *COMPILE], env=served.env, cwd=served.src)
    try:
        waited_for(marks["reached"])  # its worker is at the rename
        client.send_signal(ended_by)
        if ended_by == signal.SIGKILL:
            assert client.wait(WAIT) == -signal.SIGKILL
        else:
            with pytest.raises(subprocess.TimeoutExpired):  # (the worker holds the call)
                client.wait(0.5)
        newer_line = [word.replace("OFFSET=4", "OFFSET=5") for word in COMPILE]
        subprocess.run([GCC, *newer_line], cwd=served.src, check=True)  # (by hand, as make)
        newer = (served.src / "k.o").read_bytes()
        assert newer != old
        os.close(opened_to_write(marks["gate"]))  # the worker goes on
        assert client.wait(WAIT) == -ended_by
    finally:
        client.kill()
        client.wait(WAIT)
    waited_for(marks["done"])
    assert (served.src / "k.o").read_bytes() == newer
    assert served.fallbacks() == before  # (the call was the worker's)
    # Nothing of the call is left in the build folder (its staging folder, a new file).
    deadline = time.monotonic() + WAIT
    while list(served.src.glob(".opcache-wrap*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(served.src.glob(".opcache-wrap*")) == []
    # The next call is served as before (by another worker).
    marks["gate"].unlink()
    (served.src / "k.o").unlink()
    assert served.gcc(*COMPILE).returncode == 0
    assert (served.src / "k.o").read_bytes() == old


def hostile_cases(served: Served, case: str, victim: Path) -> None:
    """Plant ``case`` where the client looks for its server (folder or socket)."""
    if case == "socket is a link":
        real = victim / "real.sock"
        FakeServer(real, b"S\0\0\0\0\0\0\0\0\0")  # would answer "served, status 0"
        served.folder.mkdir(mode=0o700)
        served.socket.symlink_to(real)
    elif case == "socket is a FIFO":
        served.folder.mkdir(mode=0o700)
        os.mkfifo(served.socket)
    elif case == "folder is a link":
        served.folder.symlink_to(victim)
    elif case == "folder others can enter":
        served.folder.mkdir(mode=0o755)
        served.folder.chmod(0o755)
    elif case == "folder of another user":
        served.folder.mkdir(mode=0o700)
        os.chown(served.folder, NOBODY, NOBODY)
    elif case == "socket of another user":
        served.folder.mkdir(mode=0o700)
        FakeServer(served.socket, b"S\0\0\0\0\0\0\0\0\0")
        os.chown(served.socket, NOBODY, NOBODY, follow_symlinks=False)


HOSTILE = [
    "socket is a link",
    "socket is a FIFO",
    "folder is a link",
    "folder others can enter",
    pytest.param(
        "folder of another user", marks=pytest.mark.skipif(not IS_ROOT, reason=NEEDS_ROOT)
    ),
    pytest.param(
        "socket of another user", marks=pytest.mark.skipif(not IS_ROOT, reason=NEEDS_ROOT)
    ),
]


def snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    found = {}
    for path in [folder, *folder.rglob("*")]:
        st = path.lstat()
        found[str(path)] = (st.st_mode, st.st_uid, st.st_size)
    return found


@pytest.mark.parametrize("case", HOSTILE)
def test_a_planted_socket_or_folder_is_never_used_nor_touched(served, case, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / "keep").write_text("mine")
    hostile_cases(served, case, victim)
    before = snapshot(served.folder if not served.folder.is_symlink() else victim)
    for _ in range(2):
        done = served.gcc(*COMPILE)
        assert done.returncode == 0, done.stderr
    assert served.fallbacks() == 2  # neither compile served
    assert lines(served.starts).count("server") == 0  # nor a server started there
    assert snapshot(served.folder if not served.folder.is_symlink() else victim) == before
    subprocess.run([GCC, *COMPILE, "-o", "plain.o"], cwd=served.src, check=True)
    assert (served.src / "k.o").read_bytes() == (served.src / "plain.o").read_bytes()


# (not a socket of another user in its own folder: the server replaces it, as any left there)
@pytest.mark.parametrize("case", HOSTILE[2:5])
def test_opcache_server_refuses_a_folder_that_is_not_the_user_s_own(served, case, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    hostile_cases(served, case, victim)
    done = subprocess.run(
        [served.program, "server", "--socket", str(served.socket)],
        env=served.env,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("opcache: error: ") and len(done.stderr.splitlines()) == 1
    assert list(victim.iterdir()) == []


@pytest.mark.skipif(
    not IS_ROOT or shutil.which("unshare") is None, reason="needs root and unshare(1)"
)
def test_a_client_in_another_mount_namespace_is_not_served(served):
    """As a container sharing /tmp (or the runtime folder) with the host: the files the
    server sees by the client's paths may not be the client's."""
    warmed(served, *COMPILE)
    before = served.fallbacks()
    done = subprocess.run(
        ["unshare", "--mount", "gcc", *COMPILE],
        env=served.env,
        cwd=served.src,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert served.fallbacks() == before + 1
    served.gcc(*COMPILE)
    assert served.fallbacks() == before + 1  # (the same call outside it is served)


def test_the_server_exits_when_idle(served):
    served.env[server.ENV_IDLE] = "1"
    warmed(served, *COMPILE)
    pid = served.wait_for_server()
    served.gcc(*COMPILE)
    deadline = time.monotonic() + WAIT
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)
    assert not served.socket.exists()  # its socket gone with it
    assert not served.socket.with_suffix(".lock").exists()  # and its lock file


def test_a_lock_taken_on_a_lock_file_removed_meanwhile_is_taken_on_the_new_one(
    tmp_path, monkeypatch
):
    """A server removes its lock file as it ends, holding it: one starting meanwhile
    that opened the old file and locks it once free holds no server's lock, and
    locks the file of that name instead (two servers never serve one socket)."""
    import fcntl

    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    real, locked = fcntl.flock, []

    def flock(fd: int, how: int) -> None:
        if not locked:  # (the ending server: between this open and this lock)
            os.unlink("s.lock", dir_fd=dir_fd)
        locked.append(fd)
        real(fd, how)

    monkeypatch.setattr(fcntl, "flock", flock)
    try:
        lock = server._lock("s.lock", dir_fd)
        assert lock is not None and len(locked) == 2
        assert os.fstat(lock).st_ino == (tmp_path / "s.lock").stat().st_ino
        os.close(lock)
    finally:
        os.close(dir_fd)


def test_a_changed_opcache_ends_the_server_and_the_compile_falls_back(served, tmp_path):
    warmed(served, *COMPILE)
    pid = served.wait_for_server()
    # As an upgrade does: one of the server's loaded files is replaced.
    import opcache.server as module

    path = Path(module.__file__)
    saved = tmp_path / "saved.py"
    shutil.copy2(path, saved)
    try:
        replacement = path.with_name(".server-replacement.py")
        shutil.copy2(path, replacement)
        os.replace(replacement, path)  # (same bytes, a new file)
        before = served.fallbacks()
        assert served.gcc(*COMPILE).returncode == 0
        assert served.fallbacks() == before + 1
        deadline = time.monotonic() + WAIT
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
    finally:
        shutil.copy2(saved, path)


def test_masquerade_client_builds_it_and_links_to_it(tmp_path):
    env = {**base_env(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    links = tmp_path / "links"
    done = opcache(
        "masquerade", "--client", str(links), env=env, cwd=tmp_path, text=True, timeout=WAIT * 2
    )
    client = links / "opcache-client"
    assert os.access(client, os.X_OK)
    assert os.path.realpath(links / "gcc") == str(client)
    assert f"links point at {client}" in done.stdout


def test_masquerade_client_without_a_c_compiler_says_so_once_and_links_opcache(tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "opc").write_text("#!/bin/sh\nexit 0\n")  # a compiler name, but no C compiler
    (tools / "opc").chmod(0o755)
    env = {**base_env(tmp_path), "PATH": f"{tools}{os.pathsep}{os.path.dirname(sys.executable)}"}
    links = tmp_path / "links"
    done = opcache(
        "masquerade", "--client", str(links), env=env, cwd=tmp_path, text=True, timeout=WAIT
    )
    assert done.stderr.count("opcache: warning: no C compiler") == 1, done.stderr
    assert "the links run opcache itself" in done.stderr
    assert not (links / "opcache-client").exists()
    assert os.path.basename(os.path.realpath(links / "opc")) == "opcache"


# A launcher that gives its program an environment naming variables twice: execve
# takes any list of entries, while subprocess (a mapping) cannot.
EXECVE_LIST = """
import ctypes, os, sys
split = sys.argv.index("--")
given = [os.fsencode(entry) for entry in sys.argv[1:split]]
env = given + [name + b"=" + value for name, value in os.environb.items()]
argv = [os.fsencode(word) for word in sys.argv[split + 1 :]]
def array(words):
    return (ctypes.c_char_p * (len(words) + 1))(*words, None)
ctypes.CDLL(None, use_errno=True).execve(argv[0], array(argv), array(env))
sys.exit(127)
"""


def run_with_entries(served, entries: list[str], argv: list) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    """``argv`` run in the build folder with ``entries`` (``NAME=value``, a name may come
    twice) before the served environment's, through EXECVE_LIST."""
    launcher = served.tmp / "execve_list.py"
    launcher.write_text(EXECVE_LIST)
    return subprocess.run(
        [sys.executable, launcher, *entries, "--", *argv],
        env=served.env,
        cwd=served.src,
        capture_output=True,
        timeout=120,
    )


def test_a_variable_given_twice_is_taken_as_the_compiler_takes_it(served):
    """CPATH=<a> then CPATH=<b>: gcc's getenv and the Python path take the first; a
    served hit must not be the object of the second."""
    for name, value in (("a", 1), ("b", 2)):
        (served.tmp / name).mkdir()
        (served.tmp / name / "v.h").write_text(f"#define V {value}\n")
    (served.src / "v.c").write_text("#include <v.h>\nint v(void) { return V; }\n")
    args = ["-c", "v.c", "-o", "v.o"]
    env_b = {**served.env, "CPATH": str(served.tmp / "b")}
    assert served.gcc(*args, env=env_b).returncode == 0  # stored (the miss starts the server)
    served.wait_for_server()
    before = served.fallbacks()
    assert served.gcc(*args, env=env_b).returncode == 0
    assert served.fallbacks() == before  # CPATH=<b> alone is served
    twice = [f"CPATH={served.tmp / 'a'}", f"CPATH={served.tmp / 'b'}"]
    done = run_with_entries(served, twice, [served.links / "gcc", *args])
    assert done.returncode == 0, done.stderr
    plain = run_with_entries(served, twice, [GCC, *args[:-1], "plain.o"])
    assert plain.returncode == 0, plain.stderr
    assert (served.src / "v.o").read_bytes() == (served.src / "plain.o").read_bytes()


def environ_of(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def test_the_server_keeps_neither_the_first_compile_s_folder_nor_its_environment(served):
    """A server lives for minutes: in the first compile's folder it would keep a mount
    busy (or a deleted folder's inode), and that compile's variables would stay in it."""
    build = served.src / "build"
    build.mkdir()
    env = {**served.env, "A_SECRET_OF_THE_BUILD": "s3cret", "LANG": "C.UTF-8"}
    done = served.gcc("-DOFFSET=4", "-c", "../k.c", "-o", "k.o", env=env, cwd=build)
    assert done.returncode == 0, done.stderr
    pid = served.wait_for_server()
    assert os.readlink(f"/proc/{pid}/cwd") == "/"
    environ = environ_of(pid)
    assert not [entry for entry in environ if b"s3cret" in entry or entry.startswith(b"PWD=")]
    assert b"LANG=C.UTF-8" in environ  # (what its Python's start-up needs stays)
    before = served.fallbacks()
    assert served.gcc(*COMPILE, env=env).returncode == 0
    assert served.gcc(*COMPILE, env=env).returncode == 0
    assert served.fallbacks() == before + 1  # a miss, then served: it serves as before


def test_opcache_server_run_by_hand_leaves_its_folder(served):
    served.folder.mkdir(mode=0o700)
    with served.by_hand(cwd=served.src) as started:
        try:
            assert served.wait_for_server() == started.pid
            assert os.readlink(f"/proc/{started.pid}/cwd") == "/"
        finally:
            started.kill()


@pytest.mark.parametrize("closed", [">&-", "2>&-", ">&- 2>&-"])
def test_a_compile_with_stdout_or_stderr_closed_gives_the_compiler_s_status(served, closed):
    """``gcc ... >&-``: the client leaves it to opcache, which must neither fail it nor
    print a traceback (Python's sys.stdout is None then), on a miss and on a hit."""
    (served.src / "k.c").write_text(K_C + "int unused(void) { int x; return 0; }\n")
    args = ["-Wall", *COMPILE]
    for command in (["gcc"], [str(served.program), "wrap", "--", "gcc"]) * 2:
        done = subprocess.run(
            ["sh", "-c", f'exec "$@" {closed}', "sh", *command, *args],
            env=served.env,
            cwd=served.src,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert b"Traceback" not in done.stderr
        assert (b"unused variable" in done.stderr) == ("2>&-" not in closed)
    subprocess.run([GCC, *args[:-1], "plain.o"], cwd=served.src, check=True)
    assert (served.src / "k.o").read_bytes() == (served.src / "plain.o").read_bytes()
    assert stats(served.env, "host")["hits"] == 3


def test_a_stopped_server_costs_a_python_compile_not_a_hung_build(served):
    """SIGSTOP (a frozen cgroup, a debugger): the call sits in the socket's backlog.
    The client gives the server a moment to take it, then runs opcache itself; the
    worker that takes it once it runs again finds no request and writes nothing."""
    warmed(served, *COMPILE)
    pid = served.wait_for_server()
    deadline = time.monotonic() + WAIT
    while len(processes_of(served.socket)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # (the server, and a worker waiting for a call)
    made = (served.src / "k.o").read_bytes()
    before, hits = served.fallbacks(), stats(served.env, "host")["hits"]
    os.kill(pid, signal.SIGSTOP)  # (first: then it forks no other worker)
    stopped = processes_of(served.socket)
    for worker in stopped:
        os.kill(worker, signal.SIGSTOP)
    try:
        (served.src / "k.o").unlink()
        done = served.gcc(*COMPILE)  # (hung until killed by the timeout, before)
        assert done.returncode == 0, done.stderr
        assert served.fallbacks() == before + 1
        assert (served.src / "k.o").read_bytes() == made
    finally:
        for process in stopped:
            os.kill(process, signal.SIGCONT)
    # The worker now takes the call the client gave up: nothing is served or counted.
    assert served.gcc(*COMPILE).returncode == 0
    assert served.fallbacks() == before + 1  # (served again)
    assert counted(served.env, "hits", hits + 2)["hits"] == hits + 2


def test_a_server_that_takes_no_call_and_a_full_backlog_cost_a_python_compile(served):
    """A server listening but taking no calls: the first call waits in its backlog
    (then for the "taken" byte), the next cannot even connect; neither may hang."""
    served.folder.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as listener:
        bind_at(listener, served.socket)
        listener.listen(0)  # (room for one call waiting)
        for number in (1, 2, 3):
            (served.src / "k.o").unlink(missing_ok=True)
            done = served.gcc(*COMPILE)
            assert done.returncode == 0, done.stderr
            assert served.fallbacks() == number
    subprocess.run([GCC, *COMPILE[:-1], "plain.o"], cwd=served.src, check=True)
    assert (served.src / "k.o").read_bytes() == (served.src / "plain.o").read_bytes()


def test_a_served_call_takes_the_quick_hit_first(served):
    """A memo the program wrote (quickhit.py) serves the client's call too, before the
    worker's full hit: the same object, counted as a quick hit."""
    warmed(served, *COMPILE)
    made = (served.src / "k.o").read_bytes()
    time.sleep(quickmemo.RACY_SECONDS + 0.3)  # (past the racy window: a memo may be written)
    # (the line the client runs opcache with when it is not served: the link's path)
    line = [str(served.program), "wrap", "--", str(served.links / "gcc"), *COMPILE]
    subprocess.run(line, env=served.env, cwd=served.src, check=True, timeout=120)
    (served.src / "k.o").unlink()
    before = served.fallbacks()

    hit = served.gcc(*COMPILE)
    assert (hit.returncode, served.fallbacks()) == (0, before), "the hit was not served"
    assert (served.src / "k.o").read_bytes() == made
    (root,) = (served.tmp / "cache").glob("kernel_cache*")
    appended = root / ".opcache" / "stats" / "host" / QUICK_COUNTS
    assert len(appended.read_bytes().splitlines()) == 1
    assert counted(served.env, "hits", 2)["hits"] == 2


def test_a_served_full_hit_leaves_a_memo_for_the_next_call(served):
    warmed(served, *COMPILE)
    made = (served.src / "k.o").read_bytes()
    time.sleep(quickmemo.RACY_SECONDS + 0.3)
    before = served.fallbacks()
    served.gcc(*COMPILE)  # a full hit in the worker: it writes the memo
    (root,) = (served.tmp / "cache").glob("kernel_cache*")
    appended = root / ".opcache" / "stats" / "host" / QUICK_COUNTS
    assert not appended.exists()
    (served.src / "k.o").unlink()

    hit = served.gcc(*COMPILE)
    assert (hit.returncode, served.fallbacks()) == (0, before), "the hits were not served"
    assert (served.src / "k.o").read_bytes() == made
    assert len(appended.read_bytes().splitlines()) == 1


@pytest.mark.parametrize("lang", [None, "xx_YY.UTF-8"])
def test_a_client_without_locale_variables_is_served(served, lang):
    """No LANG, LC_ALL or LC_CTYPE (as in many containers), or a LANG naming a locale the
    machine lacks (ssh's, in a container): CPython sets LC_CTYPE to a UTF-8 locale as
    ``opcache`` starts (PEP 538), and opcache keys it; the worker takes the client's
    environment as that ``opcache`` would see it, so its hit is served."""
    env = {k: v for k, v in served.env.items() if k not in ("LANG", "LC_ALL", "LC_CTYPE")}
    if lang is not None:
        env["LANG"] = lang
    assert served.gcc(*COMPILE, env=env).returncode == 0
    served.wait_for_server()
    before = served.fallbacks()
    (served.src / "k.o").unlink()
    hit = served.gcc(*COMPILE, env=env)
    assert (hit.returncode, served.fallbacks()) == (0, before), "the hit was not served"
    python = wrap("gcc", *COMPILE[:-1], "alone.o", env=env, cwd=served.src)
    assert (served.src / "k.o").read_bytes() == (served.src / "alone.o").read_bytes()
    assert (hit.stdout, hit.stderr) == (python.stdout, python.stderr)


def test_a_module_a_call_loads_is_no_upgrade():
    """A worker's call may import a module of opcache the start did not (a miss's
    explain, trash): the server goes on serving; before, every such call ended it."""
    code = (
        "import sys\nfrom opcache import server\nfiles = server._opcache_files()\n"
        "assert 'opcache.explain' not in sys.modules\nimport opcache.explain\n"
        "print(server._upgraded(files))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_the_group_ids_of_a_user_of_thousands_of_groups_are_read_whole(tmp_path) -> None:
    # (a /proc status of a user in 20,000 groups is over 64 KB: the Groups line
    # cut short would refuse the very caller it describes, or match a wrong one)
    groups = " ".join(str(g) for g in range(20_000))
    status = (
        f"Name:\tcc\nUid:\t1\t1\t1\t1\nGid:\t5\t5\t5\t5\nGroups:\t{groups}\nVmPeak:\t1 kB\n"
        "CapEff:\t0000000000000000\n"
    )
    (tmp_path / "status").write_text(status)
    (tmp_path / "limits").write_text("Max file size             unlimited  unlimited  bytes\n")
    (tmp_path / "ns").mkdir()
    (tmp_path / "ns" / "uts").symlink_to("uts:[4026531838]")
    gids, got, capabilities, _, uts = server._ids(str(tmp_path))
    assert gids == [b"5"] * 4 and uts == "uts:[4026531838]"
    assert capabilities == b"0000000000000000"
    assert got == sorted(str(g).encode() for g in range(20_000))


def test_without_a_locale_gcc_s_messages_are_its_own_on_every_path(served):
    """Python in a C or POSIX locale (no LANG: a container, a CI job, ``env -i``) sets
    LC_CTYPE to C.UTF-8 in its own environment as it starts (PEP 538), and the gcc
    opcache ran inherited it (the server did so on purpose, to match): its messages
    came with UTF-8 quotes where gcc alone writes ASCII ones, on a miss, a served hit
    and the client's memo alike."""
    for name in ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES"):
        served.env.pop(name, None)
    served.socket = served.socket_of(served.env)
    (served.src / "k.c").write_text(K_C + "int unused(void) { int x; return 0; }\n")
    args = ["-Wall", *COMPILE]
    alone = subprocess.run(
        [GCC, *args], env=served.env, cwd=served.src, capture_output=True, timeout=120
    )
    assert b"unused variable 'x'" in alone.stderr, alone.stderr
    first = warmed(served, *args)
    before = served.fallbacks()
    hits = [served.gcc(*args) for _ in range(3)]  # served, then from the client's memo
    assert served.fallbacks() == before, "the hits were not served"
    python = python_path(served, *args)
    for done in (first, *hits, python):
        assert (done.returncode, done.stderr) == (0, alone.stderr)


def test_a_file_size_limit_is_met_as_gcc_alone_meets_it(served):
    """Under ``ulimit -f`` the client's memo hit was killed by SIGXFSZ half way (exit
    153, no message, its temporary file left), and a served hit wrote the object with
    the worker's limits (exit 0) where gcc alone fails."""
    import resource

    warmed(served, *COMPILE)
    for _ in range(2):  # served, then from the client's memo
        assert served.gcc(*COMPILE).returncode == 0
    limit = (served.src / "k.o").stat().st_size // 2

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    def run(program: str) -> subprocess.CompletedProcess:
        (served.src / "k.o").unlink(missing_ok=True)
        return subprocess.run(
            [program, *COMPILE], env=served.env, cwd=served.src, capture_output=True,
            preexec_fn=limited, timeout=120,
        )  # fmt: skip

    alone = run(GCC)
    assert alone.returncode != 0
    left = (served.src / "k.o").exists()
    for _ in range(2):
        done = run("gcc")  # (the client, on PATH)
        assert done.returncode == alone.returncode, done.stderr
        assert (served.src / "k.o").exists() == left
        assert not list(served.src.glob(".opcache-wrap.*"))


@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason=NEEDS_ROOT)
def test_root_without_the_capability_to_read_any_file_is_not_served_what_root_read(served):
    """A header of another user's (0600) that root read for the first compile: root
    without CAP_DAC_OVERRIDE may not read it, and gcc alone fails; the client's memo
    (named by uid, gid and groups alone) and the server (which compared those) served
    the object all the same."""
    (served.src / "k.h").write_text("#define FROM_K_H 1\n")
    os.chown(served.src / "k.h", NOBODY, NOBODY)
    os.chmod(served.src / "k.h", 0o600)
    (served.src / "k.c").write_text('#include "k.h"\n' + K_C)
    args = COMPILE
    warmed(served, *args)
    for _ in range(2):  # served, then from the client's memo
        assert served.gcc(*args).returncode == 0
    drop = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
            "--bounding-set=-dac_override,-dac_read_search", "--"]  # fmt: skip
    run = {"env": served.env, "cwd": served.src, "capture_output": True, "timeout": 120}
    alone = subprocess.run([*drop, GCC, *args], **run)
    assert alone.returncode != 0 and b"Permission denied" in alone.stderr
    for _ in range(2):
        done = subprocess.run([*drop, "gcc", *args], **run)
        assert (done.returncode, b"Permission denied" in done.stderr) == (alone.returncode, True)
