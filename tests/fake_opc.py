"""A stand-in for CANN's ``opc`` and a fake CANN toolkit folder, for the tests.

The stand-in is a small Python script (its ``#!`` line names this interpreter)
that checks its arguments as the real tool does: one operator ``.py`` source
that exists and defines ``--main_func``, an ``--input_param`` JSON file it can
read with a ``kernel_name``, a ``--soc_version`` and an ``--output`` folder.
It writes ``<kernel>.o`` and ``<kernel>.json`` (with the object's sha256) into
``--output``, prints a line on stdout and one on stderr, and appends one JSON
line per invocation (its arguments, working folder and parent pid) to ``$FAKE_OPC_LOG``.

Environment variables the tests set to steer it:

- ``FAKE_OPC_FAIL``: fail with this message on stderr and exit status
  ``$FAKE_OPC_STATUS`` (default 1);
- ``FAKE_OPC_SLEEP``: sleep this many seconds before compiling, and append when
  it slept (``start end``, seconds) to ``$FAKE_OPC_LOG.concurrent``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

SOC = "Ascend910B1"

_SCRIPT = r"""
import hashlib
import json
import os
import re
import sys
import time

KNOWN_FLAGS = {
    "main_func", "input_param", "soc_version", "output", "impl_mode", "op_mode",
    "op_debug_level", "op_debug_config", "debug_dir", "core_type", "log",
    "bin_filename", "simplified_key_mode", "op_precision_mode",
}


def die(message, status=1):
    sys.stderr.write(f"opc: error: {message}\n")
    sys.exit(status)


args = sys.argv[1:]
log = os.environ.get("FAKE_OPC_LOG")
if log:
    with open(log, "a") as f:
        f.write(json.dumps({"args": args, "cwd": os.getcwd(), "ppid": os.getppid()}) + "\n")

positional, flags = [], {}
i = 0
while i < len(args):
    arg = args[i]
    i += 1
    if arg.startswith("--"):
        name, eq, value = arg[2:].partition("=")
        if not eq:  # argparse style: --flag value
            if i >= len(args) or args[i].startswith("--"):
                die(f"flag --{name} needs a value")
            value = args[i]
            i += 1
        if name not in KNOWN_FLAGS:
            die(f"unknown flag --{name}")
        if name in flags:
            die(f"--{name} given twice")
        flags[name] = value
    else:
        positional.append(arg)

if len(positional) != 1:
    die(f"expected one operator source, got {positional}")
source = positional[0]
if not source.endswith(".py") or not os.path.isfile(source):
    die(f"operator source {source!r} is not a .py file")
for name in ("main_func", "input_param", "soc_version", "output"):
    if not flags.get(name):
        die(f"--{name} is required")
with open(source, "rb") as f:
    code = f.read()
if not re.search(rb"^def " + re.escape(flags["main_func"].encode()) + rb"\(", code, re.M):
    die(f"{source} has no function {flags['main_func']!r}")
try:
    with open(flags["input_param"], "rb") as f:
        param_bytes = f.read()
    param = json.loads(param_bytes)
except (OSError, ValueError) as e:
    die(f"cannot read --input_param {flags['input_param']}: {e}")
kernel = param.get("kernel_name") if isinstance(param, dict) else None
if not kernel or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", kernel):
    die("the parameter JSON has no valid kernel_name")
if not re.fullmatch(r"Ascend[0-9A-Za-z]+", flags["soc_version"]):
    die(f"--soc_version={flags['soc_version']} is not a known chip")

if os.environ.get("FAKE_OPC_SLEEP"):
    # Each sleeping run logs when it slept (appended: its own log, no input to a
    # traced compile, as a listing of the others' marks would be).
    slept = time.time()
    time.sleep(float(os.environ["FAKE_OPC_SLEEP"]))
    with open(f"{log}.concurrent", "a") as f:
        f.write(f"{slept} {time.time()}\n")
if os.environ.get("FAKE_OPC_FAIL"):
    die(os.environ["FAKE_OPC_FAIL"], int(os.environ.get("FAKE_OPC_STATUS", "1")))

out = flags["output"]
os.makedirs(out, exist_ok=True)
# The "binary" depends on everything that is not an output location; a flag
# naming a file by that file's contents, as the real tool reads it.
inputs = {}
for name, value in sorted(flags.items()):
    if name in ("output", "debug_dir", "input_param"):
        continue
    if os.path.isfile(value):
        with open(value, "rb") as f:
            value = hashlib.sha256(f.read()).hexdigest()
    inputs[name] = value
obj = b"FAKEOPC\0" + hashlib.sha256(
    code + b"\0" + param_bytes + b"\0" + json.dumps(inputs, sort_keys=True).encode()
).digest() * 4
with open(os.path.join(out, kernel + ".o"), "wb") as f:
    f.write(obj)
description = {
    "kernelName": kernel,
    "binFileName": kernel + ".o",
    "sha256": hashlib.sha256(obj).hexdigest(),
    "socVersion": flags["soc_version"],
    "opType": param.get("op_type", flags["main_func"]),
}
with open(os.path.join(out, kernel + ".json"), "w") as f:
    json.dump(description, f, sort_keys=True)
if flags.get("debug_dir"):
    os.makedirs(flags["debug_dir"], exist_ok=True)
    with open(os.path.join(flags["debug_dir"], kernel + ".cce"), "w") as f:
        f.write("// debug\n")
sys.stdout.write(f"opc: compiled {kernel}\n")
sys.stderr.write(f"opc: warning: {kernel} is a stand-in\n")
"""


def write_opc(folder: Path) -> Path:
    """Write the stand-in ``opc`` into ``folder`` (made if needed); returns its path."""
    return write_tool(folder, "opc", _SCRIPT)


def write_tool(folder: Path, name: str, script: str) -> Path:
    """Write ``script`` as the executable ``folder/name`` run by this Python; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{script}")
    path.chmod(0o755)
    return path


def make_toolkit(root: Path, version: str = "7.0.RC1") -> Path:
    """A fake CANN toolkit: ``root/bin/opc``, ``root/version.info``, ``root/opp/version.info``."""
    write_opc(root / "bin")
    (root / "version.info").write_text(f"Version={version}\n")
    (root / "opp").mkdir(parents=True, exist_ok=True)
    (root / "opp" / "version.info").write_text(f"Version={version}\n")
    return root


def invocations(log: Path) -> list[dict[str, Any]]:
    """Every recorded run of the stand-in (empty when it never ran)."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line]


def base_env(tmp_path: Path, *extra_path: Path) -> dict[str, str]:
    """A clean environment for subprocesses: HOME and the cache under ``tmp_path``.

    ``extra_path`` folders come first on PATH; no ASCEND_* variable is set and
    no folder holding a real ``opc`` stays on PATH.
    """
    system = os.environ.get("PATH", os.defpath).split(os.pathsep)
    system = [p for p in system if p and not os.access(os.path.join(p, "opc"), os.X_OK)]
    path = [str(p) for p in extra_path] + system
    return {
        "PATH": os.pathsep.join(path),
        "HOME": str(tmp_path),
        "ASCEND_CACHE_PATH": str(tmp_path / "cache"),
        "FAKE_OPC_LOG": str(tmp_path / "opc.log"),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


OP_SOURCE = '''\
def add(x, y, z, kernel_name="add"):
    """An operator's entry point, as a TBE .py defines it."""
    return x + y
'''


def write_operator(folder: Path, kernel: str = "add_kernel", **param: Any) -> tuple[Path, Path]:
    """``folder/add.py`` and ``folder/p.json`` (kernel_name ``kernel`` plus ``param``)."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "add.py"
    source.write_text(OP_SOURCE)
    data = {
        "kernel_name": kernel,
        "op_type": "Add",
        "inputs": [{"shape": [16, 1024], "dtype": "float16", "format": "ND"}] * 2,
        "outputs": [{"shape": [16, 1024], "dtype": "float16", "format": "ND"}],
        **param,
    }
    p = folder / "p.json"
    p.write_text(json.dumps(data, sort_keys=True))
    return source, p
