"""A stand-in for CANN's ``op_compiler`` (torchair's static kernels), for the tests.

It takes the flags torchair passes (``-p <op-info dir> -v <soc> -j <n> -o <out>
[-l level] [-f true]``, plus ``--enable_super_kernel`` and
``--super_kernel_options``, in short or long spelling), reads every ``*.json``
of ``-p`` as op-info, and writes ``static_kernel_<datetime>_<pid>.run`` into
``-o``: an executable shell script, as the real package is, whose body depends
on the op-info contents, the soc and the output-changing flags.  Run, the
package prints ``installed <its name> <digest>``.  It prints a line on stdout
and on stderr, and appends one JSON line per invocation (its arguments) to
``$FAKE_OP_COMPILER_LOG``; ``FAKE_OP_COMPILER_FAIL`` makes it fail with that message
(written into ``op_compiler_error.log`` in ``-o`` too),
``FAKE_OP_COMPILER_SUBDIR`` write ``kernel_meta/k.o`` beside the package, and
``FAKE_OP_COMPILER_EDIT`` append a line to that file once it has read the op-info,
and ``FAKE_OP_COMPILER_REWRITE`` empty that file before it reads the op-info and
write its bytes back after (a generator's ``FORCE`` rule, while it runs).
Files under ``$ASCEND_CUSTOM_OPP_PATH`` join the package's digest, as a custom
operator's implementation would.
"""

from __future__ import annotations

from pathlib import Path

from fake_opc import write_tool

_SCRIPT = r"""
import datetime
import hashlib
import json
import os
import sys

SHORT = {"-p": "op_params_dir", "-v": "soc_version", "-j": "job", "-o": "output", "-l": "log",
         "-f": "follow_op_params_jit"}
VALUES = set(SHORT.values()) | {"super_kernel_options"}


def die(message):
    sys.stderr.write(f"op_compiler: error: {message}\n")
    sys.exit(2)


args = sys.argv[1:]
log = os.environ.get("FAKE_OP_COMPILER_LOG")
if log:
    with open(log, "a") as f:
        f.write(json.dumps({"args": args, "cwd": os.getcwd()}) + "\n")
flags = {}
i = 0
while i < len(args):
    arg = args[i]
    i += 1
    name, eq, value = arg[2:].partition("=") if arg.startswith("--") else (SHORT.get(arg), "", "")
    if name == "enable_super_kernel":
        flags[name] = "on"
        continue
    if name not in VALUES:
        die(f"unknown option {arg}")
    if name in flags:
        die(f"{arg} given twice")
    if not eq:
        if i >= len(args):
            die(f"{arg} needs a value")
        value = args[i]
        i += 1
    flags[name] = value
for needed in ("op_params_dir", "soc_version", "output"):
    if needed not in flags:
        die(f"--{needed} is required")
if os.environ.get("FAKE_OP_COMPILER_FAIL"):
    os.makedirs(flags["output"], exist_ok=True)
    with open(os.path.join(flags["output"], "op_compiler_error.log"), "w") as f:
        f.write(os.environ["FAKE_OP_COMPILER_FAIL"] + "\n")
    die(os.environ["FAKE_OP_COMPILER_FAIL"])
rewritten = os.environ.get("FAKE_OP_COMPILER_REWRITE")
if rewritten:  # (truncated, read empty, then the same bytes again)
    with open(rewritten, "rb") as f:
        saved = f.read()
    open(rewritten, "wb").close()
ops = sorted(n for n in os.listdir(flags["op_params_dir"]) if n.endswith(".json"))
h = hashlib.sha256()
for name in ops:
    with open(os.path.join(flags["op_params_dir"], name), "rb") as f:
        h.update(name.encode() + b"\0" + f.read() + b"\0")
for folder in filter(None, os.environ.get("ASCEND_CUSTOM_OPP_PATH", "").split(":")):
    for top, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            with open(os.path.join(top, name), "rb") as f:
                h.update(f.read())
if rewritten:
    with open(rewritten, "wb") as f:
        f.write(saved)
for name in ("soc_version", "enable_super_kernel", "super_kernel_options", "follow_op_params_jit"):
    h.update(f"{name}={flags.get(name)}\0".encode())
stamp = datetime.datetime.now().strftime("%Y%m%d%H%M%S%f")
package = f"static_kernel_{stamp}_{os.getpid()}"
os.makedirs(flags["output"], exist_ok=True)
path = os.path.join(flags["output"], package + ".run")
body = f"# {package}: {len(ops)} static kernels\necho installed {package} {h.hexdigest()}\n"
with open(path, "w") as f:
    f.write("#!/bin/sh\n" + body)
os.chmod(path, 0o755)
if os.environ.get("FAKE_OP_COMPILER_SUBDIR"):  # (a folder of its own in the output)
    os.makedirs(os.path.join(flags["output"], "kernel_meta"), exist_ok=True)
    with open(os.path.join(flags["output"], "kernel_meta", "k.o"), "w") as f:
        f.write("kernel\n")
if os.environ.get("FAKE_OP_COMPILER_EDIT"):  # (another process edits an op-info file)
    with open(os.environ["FAKE_OP_COMPILER_EDIT"], "a") as f:
        f.write("\n")
sys.stdout.write(f"op_compiler: compiled {len(ops)} operators into {package}.run\n")
sys.stderr.write(f"op_compiler: warning: {flags['soc_version']} is a stand-in\n")
"""


def write_op_compiler(folder: Path) -> Path:
    """Write the stand-in ``op_compiler`` into ``folder`` (made if needed); returns its path."""
    return write_tool(folder, "op_compiler", _SCRIPT)
