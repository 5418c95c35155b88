"""Helpers for the security and fault-injection tests: mounts, other users, plants.

Mounting and changing owners need root (or the right capabilities); the
helpers skip the calling test with the reason when the machine refuses.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers_cache import TESTS_DIR, make_settings

import opcache
from opcache.key import canonical_json, digest
from opcache.storage.entry import MANIFEST

IS_ROOT = os.geteuid() == 0
NEEDS_ROOT = "needs root: only root can give files to another user or group"
# Users and a group that exist on no test machine's real accounts, for children
# that drop their privileges (root only).
NOBODY = 65534
MEMBER_A = 64001
MEMBER_B = 64002
TEAM_GID = 64000

requires_root = pytest.mark.skipif(not IS_ROOT, reason=NEEDS_ROOT)


def settings_for(tmp_path: Path, mode: str = "enable", **options: Any) -> opcache.Settings:
    return make_settings(tmp_path / "ops", tmp_path, mode, **options)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def file_mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def listing(path: Path) -> dict[str, bytes | None]:
    """Every path below ``path`` with its bytes (None for folders and links)."""
    found: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            full = Path(dirpath) / name
            rel = str(full.relative_to(path))
            found[rel] = full.read_bytes() if full.is_file() and not full.is_symlink() else None
    return found


def plant(entry: Path, files: dict[str, bytes]) -> None:
    """Make ``entry`` a *valid* entry (good manifest, checksums) holding ``files``.

    What someone able to write into the cache could do: a hit on it would serve
    these bytes, so only the trust rule keeps them out.
    """
    _check, _nl, body = (entry / MANIFEST).read_bytes().partition(b"\n")
    old = json.loads(body)
    for path in entry.iterdir():
        path.unlink()
    for name, data in files.items():
        (entry / name).write_bytes(data)
    body = canonical_json(
        {
            **old,
            "artifacts": [
                {"name": name, "size": len(data), "xxh3": digest(data)}
                for name, data in sorted(files.items())
            ],
        }
    )
    (entry / MANIFEST).write_bytes(digest(body).encode() + b"\n" + body)


def evil(files: dict[str, bytes]) -> dict[str, bytes]:
    """The same artifact names with other bytes: a planted kernel."""
    return {name: b"planted kernel " + name.encode() for name in files}


# ------------------------------------------------------------------- mounts


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=False, timeout=30)


def unmount(path: Path) -> None:
    done = _run("umount", str(path))
    if done.returncode != 0:
        _run("umount", "-l", str(path))  # busy (an fd a failing test leaked): detach


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` for the duration; skips the test if not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    done = _run("mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})")
    try:
        yield path
    finally:
        unmount(path)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` bind-mounted onto itself read-only; skips the test if not permitted."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    done = _run("mount", "--bind", str(path), str(path))
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({done.stderr.strip() or done.returncode})")
    try:
        done = _run("mount", "-o", "remount,bind,ro", str(path))
        if done.returncode != 0:
            pytest.skip(f"cannot remount read-only here ({done.stderr.strip()})")
        probe = path / ".probe"
        with contextlib.suppress(OSError):
            probe.touch()
            probe.unlink()
            pytest.skip("the read-only mount is writable (no remount support)")
        yield path
    finally:
        unmount(path)


# --------------------------------------------------------------- other users


NO_OPEN_FOLDER = (
    "no temporary folder here that every user may enter (TMPDIR, /tmp, /var/tmp and "
    "/dev/shm each sit under a folder others cannot search), so no other user can be tested"
)


def _enterable_by_all(path: Path) -> bool:
    """True when every folder from / down to ``path`` may be searched by any user."""
    try:
        return all(os.stat(p).st_mode & stat.S_IXOTH for p in (path, *path.parents))
    except OSError:
        return False


@functools.cache
def _open_parent() -> Path | None:
    """Where folders for other users can be made: the temp folder, else a public one."""
    for candidate in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        path = Path(candidate).resolve()
        if _enterable_by_all(path) and os.access(path, os.W_OK | os.X_OK):
            return path
    return None


def _new_open_folder(prefix: str) -> Path:
    parent = _open_parent()
    if parent is None:
        pytest.skip(NO_OPEN_FOLDER)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o755)
    return path


@contextlib.contextmanager
def open_folder() -> Iterator[Path]:
    """A fresh folder every user may enter (pytest's tmp_path is private to root)."""
    path = _new_open_folder("opcache-faults-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def team_cache(base: Path) -> tuple[Path, Path]:
    """In ``base``, what two members of the team share: ``ops``, the cache folder as an
    administrator sets one up (root's, group TEAM_GID, 2770), ``calls``, a file any
    member's stand-in compiler counts its runs in, and ``a`` and ``b``, output folders
    anyone may write.  Returns ``ops`` and ``calls``."""
    ops = base / "ops"
    ops.mkdir()
    os.chown(ops, 0, TEAM_GID)
    os.chmod(ops, 0o2770)
    calls = base / "calls"
    calls.touch()
    os.chmod(calls, 0o666)
    for name in ("a", "b"):
        (base / name).mkdir()
        os.chmod(base / name, 0o777)
    return ops, calls


@functools.cache
def _child_imports() -> Path:
    """A copy of opcache and the test helpers that every user may read.

    The checkout (and so ``tests/`` and an editable opcache) may sit in a folder
    other users cannot enter, such as root's home or a ``mktemp -d`` folder.
    """
    folder = _new_open_folder("opcache-child-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(opcache.__file__).parent, folder / "opcache", ignore=ignore)
    shutil.copy(TESTS_DIR / "helpers_cache.py", folder)
    for dirpath, _dirs, files in os.walk(folder):
        os.chmod(dirpath, 0o755)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)
    return folder


PRELOAD = (
    "argparse",
    "atexit",
    "collections.abc",
    "concurrent.futures",
    "concurrent.futures.thread",
    "configparser",
    "contextlib",
    "dataclasses",
    "encodings.ascii",
    "encodings.idna",
    "encodings.latin_1",
    "encodings.utf_8",
    "encodings.utf_8_sig",
    "errno",
    "fcntl",
    "functools",
    "glob",
    "grp",
    "hashlib",
    "heapq",
    "importlib.metadata",
    "ipaddress",
    "json",
    "logging",
    "math",
    "multiprocessing",
    "multiprocessing.util",
    "pathlib",
    "platformdirs",
    "pwd",
    "random",
    "re",
    "secrets",
    "shlex",
    "shutil",
    "signal",
    "socket",
    "stat",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "threading",
    "time",
    "traceback",
    "typing",
    "urllib.parse",
    "weakref",
    "xxhash",
    "zlib",
)


def run_as(
    uid: int,
    gid: int,
    code: str,
    *,
    groups: tuple[int, ...] = (),
    umask: int = 0o022,
    timeout: float = 120,
):
    """Run ``code`` in a fresh Python as ``uid``/``gid`` (root only), opcache importable.

    The privileges are dropped before anything of opcache is imported (the trust
    rule reads the effective uid at import).  The last line the child prints
    to stdout is returned parsed as JSON.
    """
    prologue = (
        "import os, sys\n"
        # Python itself may live where the other user cannot read (root's home):
        # what opcache and the helpers import is loaded while still root.
        f"import {', '.join(PRELOAD)}\n"
        f"os.setgroups({list(groups)!r})\n"
        f"os.setgid({gid})\n"
        f"os.setuid({uid})\n"
        f"os.umask({umask})\n"
        "sys.dont_write_bytecode = True\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_child_imports()), env.get("PYTHONPATH", "")) if p
    )
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", prologue + code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def copy_as(uid: int, source: Path, target: Path) -> int:
    """Copy the files of the folder ``source`` (every user may read them) into a new
    folder ``target`` as ``uid`` would (umask 007, setgid 2770 asked); returns the group
    id the new folder got: an outsider planting a kernel where it may write."""
    code = (
        "import json, os, shutil\n"
        f"os.makedirs({str(target)!r}, mode=0o2770)\n"
        f"for name in os.listdir({str(source)!r}):\n"
        f"    shutil.copyfile(os.path.join({str(source)!r}, name), "
        f"os.path.join({str(target)!r}, name))\n"
        f"print(json.dumps(os.stat({str(target)!r}).st_gid))\n"
    )
    return run_as(uid, uid, code, umask=0o007)


# Code a child runs first: warnings collected, helpers imported.
CHILD_PROLOGUE = """
import json, logging, os, time
from pathlib import Path
import helpers_cache as h
import opcache

class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
    def emit(self, record):
        self.messages.append(record.getMessage())

keep = _Keep()
logging.getLogger().addHandler(keep)
"""


# ---------------------------------------------------------- child processes


def index_of(entry: Path) -> int:
    """The make_request index an entry was stored for (from its manifest's inputs)."""
    _check, _nl, body = (entry / MANIFEST).read_bytes().partition(b"\n")
    return json.loads(body)["inputs"]["inputs"][0]["shape"][1] - 1024


def reader_child(spec: dict[str, Any]) -> None:
    """Read every visible entry over and over until ``spec['stop']`` exists.

    Each read must give nothing (gone) or the whole, right entry; anything else
    (CorruptEntry: a partial entry, or wrong bytes) is counted as bad.
    """
    from helpers_cache import SOC, entry_dirs, expected_files, make_request, write_json

    from opcache.storage.entry import CorruptEntry
    from opcache.storage.local import LocalStore

    report: dict[str, Any] = {"reads": 0, "entries_read": 0, "bad": [], "error": None}
    try:
        root = Path(spec["root"])
        store = LocalStore(root)
        Path(spec["ready"]).touch()
        while not os.path.exists(spec["stop"]):
            for key, path in entry_dirs(root).items():
                report["reads"] += 1
                try:
                    entry = store.get(SOC, key)
                except CorruptEntry as e:
                    report["bad"].append(f"{key}: {e}")
                    continue
                if entry is None:
                    continue
                try:
                    index = index_of(path)
                except OSError:
                    continue  # removed since the read
                report["entries_read"] += 1
                if entry.files != expected_files(make_request(index), spec["size"]):
                    report["bad"].append(f"{key}: wrong bytes")
    except BaseException:
        import traceback

        report["error"] = traceback.format_exc()
    write_json(spec["result"], report)


def publish_then_hang_child(spec: dict[str, Any]) -> None:
    """Store one entry and stop dead just before or just after its rename into place.

    ``spec['when']`` is "before" (a complete build folder left in .opcache/tmp)
    or "after" (the entry visible, and counted before the rename): what a
    SIGKILL at those instants leaves.
    """
    import time

    from helpers_cache import ToyCompiler, make_request, make_settings

    from opcache.storage.local import is_key

    real_rename = os.rename

    def rename_and_hang(src, dst, *args, **kwargs):
        publishing = is_key(os.path.basename(os.fspath(dst)))
        if publishing and spec["when"] == "before":
            Path(spec["marker"]).touch()
            time.sleep(3600)
        real_rename(src, dst, *args, **kwargs)
        if publishing:
            Path(spec["marker"]).touch()
            time.sleep(3600)

    os.rename = rename_and_hang
    settings = make_settings(spec["cache_dir"], spec["home"])
    cache = opcache.OpCache(settings)
    compiler = ToyCompiler(spec["calls"], size=spec["size"])
    cache.compile(make_request(spec["index"]), compiler, Path(spec["out"]))


def count_then_hang_child(spec: dict[str, Any]) -> None:
    """Store one entry and stop dead while rewriting a counter file.

    Killed there, the writer leaves the counter's temp file (written, never
    renamed over the shard) next to the shards.
    """
    import time

    from helpers_cache import ToyCompiler, make_request, make_settings

    real_replace = os.replace

    def replace_or_hang(src, dst, *args, **kwargs):
        if os.fspath(dst).endswith(".count") and os.path.basename(os.fspath(src)).startswith("."):
            Path(spec["marker"]).touch()
            time.sleep(3600)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace_or_hang
    settings = make_settings(spec["cache_dir"], spec["home"])
    cache = opcache.OpCache(settings)
    compiler = ToyCompiler(spec["calls"])
    cache.compile(make_request(spec["index"]), compiler, Path(spec["out"]))
