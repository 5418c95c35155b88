"""CANN-format kernel_cache folders for the tests, written the way CANN's graph engine writes them.

From hicann/ge (``te_cache_manager.cc``, ``te_cache_utils.cc``, ``common_utils.cc``):
a store takes ``<chip>/<kernel>.lock`` (``fopen("a+")``, chmod 0640, a
non-blocking whole-file fcntl write lock), then copies the binary, the header
and the json last, each into ``<dst>_<pid>_<usec>_<rand>.temp`` (0640) renamed
over ``<dst>``.  A hit sets the access time of the json and the binary to now,
keeping their modification time.

Run as a script, this module is a real other process:

- ``hold <lock file>``: holds CANN's write lock on the file, prints ``held``,
  and lets go when its stdin closes;
- ``die-storing <chip> <kernel>``: stores an entry as CANN does but stops in
  the middle of writing the json (prints ``stopped``) so the test can kill it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from opcache.cli import main

SOC = "Ascend910B1"
MODE = 0o640
PREBUILD = {"coreType": "VectorCore", "pattern": "Broadcast", "prebuilt_options": ""}


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME in the test's folder and no CANN variables; returns the cache base folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("ASCEND_CACHE_PATH", "ASCEND_MAX_OP_CACHE_SIZE", "ASCEND_REMAIN_CACHE_SIZE_RATIO"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "atc"


def cann(capsys: pytest.CaptureFixture[str], base: Path, action: str, *flags: str) -> tuple:
    """``opcache cann <action> --op_compiler_cache_dir <base> <flags>``: (status, out, err)."""
    status = main(["cann", action, "--op_compiler_cache_dir", str(base), *flags])
    out, err = capsys.readouterr()
    return status, out, err


def cann_json(capsys: pytest.CaptureFixture[str], base: Path, action: str, *flags: str) -> tuple:
    """(status, report) of ``cann`` with ``--json``; nothing on stderr."""
    status, out, err = cann(capsys, base, action, "--json", *flags)
    assert err == "", err
    return status, json.loads(out)


def kernel_name(op_type: str, seed: str) -> str:
    """``te_<optype>_<sha256 hex>``, lowercased, as CANN names single-op kernels."""
    return f"te_{op_type}_{hashlib.sha256(seed.encode()).hexdigest()}".lower()


def temp_name(dst: str, pid: int | None = None, usec: int | None = None) -> str:
    """CANN's ``ConstructTempFileName``: ``<dst>_<pid>_<usec since epoch>_<rand()>.temp``."""
    pid = os.getpid() if pid is None else pid
    usec = time.time_ns() // 1000 if usec is None else usec
    return f"{dst}_{pid}_{usec}_{random.randint(0, 2**31 - 1)}.temp"


def _copy_into(chip: Path, dst: str, data: bytes, *, stop_half_way: bool = False) -> None:
    """CANN's ``CopyFileToCacheDir``: a temp file, 0640 whatever the umask, then rename."""
    tmp = chip / temp_name(dst)
    fd = os.open(tmp, os.O_CREAT | os.O_RDWR, MODE)
    os.fchmod(fd, MODE)
    if stop_half_way:
        os.write(fd, data[: len(data) // 2])
        print("stopped", flush=True)
        time.sleep(3600)  # killed here by the test
    os.write(fd, data)
    os.close(fd)
    os.rename(tmp, chip / dst)


@contextmanager
def cann_lock(path: Path) -> Iterator[int]:
    """CANN's ``LockAndOpenCacheFile``: fopen a+, chmod 0640, F_SETLK F_WRLCK (non-blocking)."""
    f = open(path, "a+")  # noqa: SIM115  (held for the block, as CANN holds its FILE*)
    os.chmod(path, MODE)
    fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        yield f.fileno()
    finally:
        fcntl.lockf(f.fileno(), fcntl.LOCK_UN)
        f.close()


def kernel_json(kernel: str, binary: bytes, *, header: bool = False, **fields: object) -> dict:
    """An entry's json as CANN writes it (fields from CANN's own test fixture)."""
    data: dict[str, object] = {
        "KBHit": False,
        "binFileName": kernel,
        "binFileSuffix": ".o",
        "blockDim": 40,
        "core_type": "AIV",
        "kernelName": f"{kernel}_1__kernel0",
        "magic": "RT_DEV_BINARY_MAGIC_ELF_AIVEC",
        "parameters": [0, 0, 0],
        "sha256": hashlib.sha256(binary).hexdigest(),
    }
    if header:
        data["headerFileSuffix"] = ".h"
    data.update(fields)
    return data


def _session(chip: Path) -> None:
    """The chip folder, and op_cache.ini as a CANN compile session writes it first where
    there is none (``DelCachedFiles``)."""
    chip.mkdir(parents=True, exist_ok=True)
    if not os.path.lexists(chip.parent / "op_cache.ini"):
        write_ini(chip.parent)


def store_entry(
    chip: Path,
    kernel: str,
    binary: bytes,
    *,
    header: bytes | None = None,
    stop_in_json: bool = False,
    **fields: object,
) -> list[Path]:
    """Store one entry as CANN does; returns [json, binary(, header)]."""
    _session(chip)
    data = kernel_json(kernel, binary, header=header is not None, **fields)
    with cann_lock(chip / f"{kernel}.lock"):
        _copy_into(chip, f"{kernel}.o", binary)
        if header is not None:
            _copy_into(chip, f"{kernel}.h", header)
        _copy_into(chip, f"{kernel}.json", json.dumps(data).encode(), stop_half_way=stop_in_json)
    paths = [chip / f"{kernel}.json", chip / f"{kernel}.o"]
    return paths + ([chip / f"{kernel}.h"] if header is not None else [])


def store_mix_entry(
    chip: Path, kernel: str, aic: bytes, aiv: bytes, main: bytes | None = b"mix kernel"
) -> list[Path]:
    """A mix-core entry: a main json whose ``jsonList`` names two sub-jsons, each with a binary.

    With ``main``, the main json also names ``<kernel>.o`` with its sha256, which
    CANN's hit check needs (``ParseCompileResult`` reads the main json's
    ``binFileName`` only); without, CANN never reuses the entry.  Returns the
    files CANN's aging deletes with it: the main json, the sub-jsons and their
    binaries, not the main binary.
    """
    _session(chip)
    paths = [chip / f"{kernel}.json"]
    with cann_lock(chip / f"{kernel}.lock"):
        subs = []
        for part, binary in (("mix_aic", aic), ("mix_aiv", aiv)):
            name = f"{kernel}_{part}"
            _copy_into(chip, f"{name}.o", binary)
            _copy_into(chip, f"{name}.json", json.dumps(kernel_json(name, binary)).encode())
            subs.append({"jsonFileName": f"{name}.json"})
            paths += [chip / f"{name}.json", chip / f"{name}.o"]
        data: dict[str, object] = {"kernelName": f"{kernel}__kernel0", "core_type": "MIX"}
        if main is not None:
            _copy_into(chip, f"{kernel}.o", main)
            data = kernel_json(kernel, main, **data)
        data["jsonList"] = subs
        _copy_into(chip, f"{kernel}.json", json.dumps(data).encode())
    return paths


def store_prebuild(chip: Path, kernel: str) -> Path:
    """``<kernel>_pre.json`` under ``<kernel>_pre.lock``, as ``SetPreCompileResult`` writes it."""
    _session(chip)
    with cann_lock(chip / f"{kernel}_pre.lock"):
        _copy_into(chip, f"{kernel}_pre.json", json.dumps(PREBUILD, indent=4).encode())
    return chip / f"{kernel}_pre.json"


def set_access(paths: list[Path], when: float) -> None:
    """CANN's ``UpdateFileAccessTime`` at ``when``: atime set, mtime kept."""
    for path in paths:
        os.utime(path, (when, path.stat().st_mtime))


def set_times(paths: list[Path], when: float) -> None:
    """Both times at ``when``: a file written (and last read) then."""
    for path in paths:
        os.utime(path, (when, when))


def write_ini(root: Path, max_mb: int | None = None, ratio: int | None = None) -> Path:
    """op_cache.ini as CANN creates it (versions), plus size keys when given."""
    root.mkdir(parents=True, exist_ok=True)
    text = "[op_compiler_cache]\nadk_version=7.0.RC1\nops_version=7.0.RC1\n"
    if max_mb is not None:
        text += f"max_op_cache_size={max_mb}\nremain_cache_size_ratio={ratio}\n"
    path = root / "op_cache.ini"
    path.write_text(text)
    return path


_PROBE = (
    "import fcntl, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDWR)\n"
    "try:\n"
    "    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "    print('free')\n"
    "except OSError:\n"
    "    print('held')\n"
)


def lock_probe(lock: Path) -> str:
    """ "held" when a process holds an fcntl lock on ``lock``, else "free" (asked from
    a new process: this one's own locks never stop its own tries)."""
    probe = [sys.executable, "-c", _PROBE, str(lock)]
    return subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()


@contextmanager
def held_by_other_process(lock: Path) -> Iterator[int]:
    """Another process holds CANN's fcntl write lock on ``lock`` for the block; yields its pid."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "hold", str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()


def writer_killed_before_json(chip: Path, kernel: str, binary: bytes) -> int:
    """A real CANN-style writer, SIGKILLed half way through the json; returns its (dead) pid.

    It leaves ``<kernel>.o`` (an orphan), ``<kernel>.lock`` and a half-written
    ``<kernel>.json_<pid>_<usec>_<rand>.temp``.
    """
    proc = subprocess.Popen(
        [sys.executable, __file__, "die-storing", str(chip), kernel, binary.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "stopped\n"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.pid


def _main(argv: list[str]) -> None:
    if argv[0] == "hold":
        with cann_lock(Path(argv[1])):
            print("held", flush=True)
            sys.stdin.read()
    elif argv[0] == "die-storing":
        store_entry(Path(argv[1]), argv[2], bytes.fromhex(argv[3]), stop_in_json=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
