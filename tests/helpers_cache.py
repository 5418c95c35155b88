"""Small compilers, a fake clock and process helpers shared by the cache tests.

The toy compiler derives its artifact names and bytes from the request's key
inputs (never from ``op_name``), as a real back-end must, and appends one line
per call to a file so that calls can be counted across processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import opcache
from opcache.key import canonical_json, digest

SOC = "Ascend910B1"
OTHER_SOC = "Ascend310P3"
T0 = 1_700_000_000.0
TESTS_DIR = Path(__file__).resolve().parent
# fork: cheap children that need not re-import anything; each child closes its
# OpCache itself (a forked multiprocessing child does not run atexit handlers).
MP = multiprocessing.get_context("fork")
_KEY = re.compile(r"[0-9a-f]{32}")


class FakeClock:
    """A clock the test moves by hand (seconds since the epoch)."""

    def __init__(self, now: float = T0) -> None:
        self.now = float(now)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def artifact_stem(request: opcache.OpRequest) -> str:
    """``<op_type>_<hash of the key inputs>``: what a back-end names its kernel."""
    parts = {
        "op_type": request.op_type,
        "soc_version": request.soc_version,
        "inputs": request.inputs,
        "outputs": request.outputs,
        "attrs": request.attrs,
        "options": request.options,
        "sources": {n: digest(b) for n, b in request.source_bytes.items()},
    }
    return f"{request.op_type}_{digest(canonical_json(parts))[:16]}"


def expected_files(request: opcache.OpRequest, size: int = 256) -> dict[str, bytes]:
    """The artifacts the toy compiler writes for ``request``."""
    stem = artifact_stem(request)
    seed = stem.encode()
    binary = (seed * (size // len(seed) + 1))[:size]
    meta = json.dumps({"kernel": stem, "op_type": request.op_type, "size": size}).encode()
    return {f"{stem}.o": binary, f"{stem}.json": meta}


class ToyCompiler:
    """A compiler for tests.

    ``name`` and ``version`` make the fingerprint; the other knobs change how
    it behaves, not what it produces: ``sleep`` (seconds spent compiling),
    ``fail`` (raise CompileError), ``half_marker`` (write the first artifact,
    create this file, then hang until killed) and ``extra`` (additional files,
    by name, to write into the workdir as they are).
    """

    def __init__(
        self,
        calls_file: str | os.PathLike[str],
        *,
        name: str = "toycc",
        version: str = "1.0",
        size: int = 256,
        sleep: float = 0.0,
        fail: bool = False,
        half_marker: str | os.PathLike[str] | None = None,
        extra: dict[str, bytes] | None = None,
    ) -> None:
        self.calls_file = Path(calls_file)
        self.name = name
        self.version = version
        self.size = size
        self.sleep = sleep
        self.fail = fail
        self.half_marker = half_marker
        self.extra = extra or {}

    def fingerprint(self) -> str:
        return f"{self.name} {self.version}"

    def compile(self, request: opcache.OpRequest, workdir: Path) -> None:
        with open(self.calls_file, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {request.op_name}\n")
        if self.fail:
            (Path(workdir) / "partial.o").write_bytes(b"half a kernel")
            raise opcache.CompileError(f"toy compiler failed on {request.op_type}")
        if self.sleep:
            time.sleep(self.sleep)
        for index, (name, data) in enumerate(sorted(expected_files(request, self.size).items())):
            (Path(workdir) / name).write_bytes(data)
            if self.half_marker is not None and index == 0:
                Path(self.half_marker).touch()
                time.sleep(3600)
        for name, data in self.extra.items():
            (Path(workdir) / name).write_bytes(data)

    def calls(self) -> int:
        try:
            return len(self.calls_file.read_text(encoding="utf-8").splitlines())
        except FileNotFoundError:
            return 0


def make_request(index: int = 0, **overrides: Any) -> opcache.OpRequest:
    """An Add request; ``index`` changes the shape, so each index is another key."""
    shape = [16, 1024 + index]
    fields: dict[str, Any] = {
        "op_type": "Add",
        "soc_version": SOC,
        "op_name": f"add_{index}",
        "inputs": [{"shape": shape, "dtype": "float16", "format": "ND"}] * 2,
        "outputs": [{"shape": shape, "dtype": "float16", "format": "ND"}],
        "attrs": {"alpha": 1.0},
        "options": {"impl_mode": "high_performance"},
        "sources": {"add.py": b"def add(x, y):\n    return x + y\n"},
    }
    fields.update(overrides)
    return opcache.OpRequest(**fields)


def make_settings(
    cache_dir: str | os.PathLike[str],
    home: str | os.PathLike[str],
    mode: str = "enable",
    env: dict[str, str] | None = None,
    **options: Any,
) -> opcache.Settings:
    """Settings from explicit options and an environment holding only HOME (+ ``env``)."""
    return opcache.resolve_settings(
        op_compiler_cache_mode=mode,
        op_compiler_cache_dir=str(cache_dir),
        environ={"HOME": str(home), **(env or {})},
        **options,
    )


def toolkit_env(base: Path) -> dict[str, str]:
    """A CANN toolkit set up under ``base`` as set_env.sh does (its compiler's and
    operator package's version.info, 8.0.RC1 both): the variables that name it."""
    home = base / "toolkit"
    for folder in (home / "compiler", home / "opp"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "version.info").write_text("Version=8.0.RC1\n")
    return {"ASCEND_HOME_PATH": str(home), "ASCEND_OPP_PATH": str(home / "opp")}


def machine(tmp_path: Path, name: str, url: str, **remote: object) -> opcache.Settings:
    """The settings of one machine: its own cache folder (``tmp_path/name``), the shared
    remote at ``url`` (with ``remote``'s options)."""
    return make_settings(tmp_path / name, tmp_path, remote={"url": url, **remote})


def compile_within(tmp_path: Path, url: str, wait: float = 60, **remote: object) -> tuple:
    """(result, stats) of machine a's compile of request 0 with the remote ``url``, run
    in a thread waited for ``wait`` seconds: a compile still waiting fails the test."""
    done = []

    def compile_one() -> None:
        with opcache.OpCache(machine(tmp_path, "a", url, **remote)) as a:
            result = a.compile(make_request(0), ToyCompiler(tmp_path / "calls"), tmp_path / "o")
            done.append((result, a.stats()))

    worker = threading.Thread(target=compile_one, daemon=True)
    worker.start()
    worker.join(wait)
    assert done, f"the compile still waits on {url} after {wait} s"
    return done[0]


def write_size_ini(root: Path, max_mb: int, ratio: int) -> Path:
    """An op_cache.ini in the cache root with both size keys."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "op_cache.ini"
    path.write_text(
        f"[op_compiler_cache]\nmax_op_cache_size={max_mb}\nremain_cache_size_ratio={ratio}\n",
        encoding="utf-8",
    )
    return path


def entry_dirs(root: Path, soc: str = SOC) -> dict[str, Path]:
    """The entry folders of a chip, by key, found by walking (independent of the code)."""
    found = {}
    chip = root / soc
    if not chip.is_dir():
        return found
    for bucket in chip.iterdir():
        if not re.fullmatch(r"[0-9a-f]{2}", bucket.name) or not bucket.is_dir():
            continue
        for entry in bucket.iterdir():
            if _KEY.fullmatch(entry.name):
                found[entry.name] = entry
    return found


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files below ``path`` (links not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if not os.path.islink(os.path.join(dirpath, name)):
                total += st.st_size
    return total


def read_dir(path: Path) -> dict[str, bytes]:
    """The regular files directly in ``path``, by name."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def wait_for(path: str | os.PathLike[str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.005)


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# --------------------------------------------------------------------- children


class _Collect(logging.Handler):
    """Keeps the warnings a child process logs, to report them to the test."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _collect_warnings() -> list[str]:
    handler = _Collect()
    logging.getLogger("opcache").addHandler(handler)
    return handler.messages


def base_spec(tmp_path: Path, **compiler: object) -> dict[str, Any]:
    """What every child process needs: the cache, HOME, its compiler, its out_dir."""
    return {
        "cache_dir": str(tmp_path / "ops"),
        "home": str(tmp_path),
        "compiler": {"calls_file": str(tmp_path / "calls"), **compiler},
        "out": str(tmp_path / "out"),
    }


def compile_child(spec: dict[str, Any]) -> None:
    """A process that compiles ``spec['requests']`` (indices) and reports as JSON.

    Waits for ``spec['go']`` to exist first when given, so that several
    children start at the same instant.
    """
    report: dict[str, Any] = {"pid": os.getpid(), "results": [], "error": None}
    report["warnings"] = _collect_warnings()
    try:
        if spec.get("go"):
            wait_for(spec["go"])
        settings = make_settings(spec["cache_dir"], spec["home"], spec.get("mode", "enable"))
        compiler = ToyCompiler(**spec["compiler"])
        with opcache.OpCache(settings, lock_timeout=spec.get("lock_timeout", 600.0)) as cache:
            for index in spec["requests"]:
                request = make_request(index)
                out = Path(spec["out"]) / f"{os.getpid()}-{index}"
                started = time.monotonic()
                result = cache.compile(request, compiler, out)
                report["results"].append(
                    {
                        "index": index,
                        "status": result.status,
                        "key": result.key,
                        "ok": read_dir(out) == expected_files(request, compiler.size),
                        "seconds": time.monotonic() - started,
                    }
                )
    except BaseException:
        report["error"] = traceback.format_exc()
    write_json(spec["result"], report)


@contextlib.contextmanager
def compiling_half_way(tmp_path: Path) -> Iterator[multiprocessing.Process]:
    """A child compiling request 0 into ``<out>/<pid>-0``, stopped after its first artifact.

    Yields once the child is there (its single-flight lock and build folder
    held); a child still alive at the end is killed.
    """
    marker = tmp_path / "half-written"
    spec = base_spec(tmp_path, half_marker=str(marker))
    spec.update(requests=[0], result=str(tmp_path / "r.json"))
    child = MP.Process(target=compile_child, args=(spec,))
    child.start()
    try:
        wait_for(marker)
        yield child
    finally:
        if child.is_alive():
            child.kill()
            child.join()


def run_python(
    args: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python <args>`` with this interpreter; its output captured as text."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def store_forever_child(spec: dict[str, Any]) -> None:
    """Store new entries one after another until killed; logs each index first."""
    settings = make_settings(spec["cache_dir"], spec["home"])
    compiler = ToyCompiler(**spec["compiler"])
    cache = opcache.OpCache(settings)
    index = spec["first"]
    Path(spec["started"]).touch()
    while True:
        with open(spec["log"], "a", encoding="utf-8") as f:
            f.write(f"{index}\n")
        cache.compile(make_request(index), compiler, Path(spec["out"]) / str(index))
        index += 1


def busy_child(spec: dict[str, Any]) -> None:
    """Compile and re-read a few requests for ``spec['seconds']``, checking every byte.

    In ``force`` mode a new OpCache is made for every round, so each round
    clears the chip folder again while the others use it.
    """
    report: dict[str, Any] = {"pid": os.getpid(), "rounds": 0, "statuses": {}, "bad": 0}
    report["error"] = None
    report["warnings"] = _collect_warnings()
    try:
        wait_for(spec["go"])
        compiler = ToyCompiler(**spec["compiler"])
        mode = spec["mode"]
        settings = make_settings(spec["cache_dir"], spec["home"], mode)
        deadline = time.monotonic() + spec["seconds"]
        cache = opcache.OpCache(settings)
        while time.monotonic() < deadline:
            if mode == "force":
                cache.close()
                cache = opcache.OpCache(settings)
            for index in spec["requests"]:
                request = make_request(index)
                out = Path(spec["out"]) / f"{os.getpid()}-{report['rounds']}-{index}"
                result = cache.compile(request, compiler, out)
                statuses = report["statuses"]
                statuses[result.status] = statuses.get(result.status, 0) + 1
                if read_dir(out) != expected_files(request, compiler.size):
                    report["bad"] += 1
            report["rounds"] += 1
        cache.close()
    except BaseException:
        report["error"] = traceback.format_exc()
    write_json(spec["result"], report)


def run_script(code: str, *, umask: int | None = None, wait: bool = True) -> Any:
    """Run ``code`` in a fresh Python that can import opcache and this module."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if p)
    preexec = None if umask is None else (lambda: os.umask(umask))
    args = [sys.executable, "-c", code]
    if wait:
        return subprocess.run(
            args, env=env, preexec_fn=preexec, capture_output=True, text=True, timeout=60
        )
    return subprocess.Popen(args, env=env, preexec_fn=preexec, text=True)


def trash_emptied(root: Path, timeout: float = 60.0) -> list[str]:
    """What is left in the trash once its background deleters are done (or time is up)."""
    trash = root / ".opcache" / "trash"
    deadline = time.monotonic() + timeout
    while True:
        left = sorted(os.listdir(trash)) if trash.exists() else []
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@contextlib.contextmanager
def fake_server(answer: Callable[[socket.socket, threading.Event], None]) -> Iterator[int]:
    """The port of a loopback server that gives each connection to ``answer`` (with an
    event set once the test ends) until then; a client hanging up ends its call."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    ended = threading.Event()

    def serve() -> None:
        while not ended.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(OSError):  # (the client hung up)
                answer(conn, ended)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        ended.set()
        thread.join(10)
        listener.close()
