"""CANN's ``opc`` as an operator compiler (Ascend machines).

The toolkit is found through ``ASCEND_HOME_PATH``, ``ASCEND_TOOLKIT_HOME``,
``ASCEND_OPP_PATH`` or ``opc`` on PATH.  The fingerprint covers the toolkit's
version files, the opc executable, the Python that runs it (opc is a Python
script: the interpreter its ``#!`` line names, not opcache's own), the tuning
knowledge base and the NPU driver's ``version.info`` (when a driver is
installed), the environment the operator scripts read and the custom operator
packages (as `opcache wrap -- opc` keys them), so an upgrade or a re-tune gives
new keys instead of stale kernels.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from .. import fsutil
from ..errors import CompileError, ConfigError
from ..ini import TOOLKIT_VARIABLES
from ..key import digest
from ..keyed_env import OPC_KEY_ENVIRONMENT, OPC_READS_ENVIRONMENT
from ..request import OpRequest
from ..storage.entry import READS_CHECKED
from .toolchain import environment_key, file_identity, kernel_name, tool_changed, which

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from ..readset import ReadSet
    from ..storage.local import LocalStore

HOME_VARIABLES = TOOLKIT_VARIABLES
DRIVER_VARIABLE = "ASCEND_DRIVER_PATH"
INSTALL_INFO = "/etc/ascend_install.info"
# Options that are opc's own arguments, not flags passed through.
_MAIN_FUNC = "main_func"
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_MAX_BANK_FILES = 100_000
_MAX_SHEBANG = 256


def find_toolkit(
    environ: Mapping[str, str], tool: str = "opc"
) -> tuple[Path | None, str | None, str]:
    """(toolkit home, path of its ``tool``, what was looked at)."""
    looked = []
    for name in HOME_VARIABLES:
        value = environ.get(name)
        looked.append(f"{name}={value if value else '(unset)'}")
        if not value:
            continue
        home = Path(value).parent if name == "ASCEND_OPP_PATH" else Path(value)
        for candidate in (home / "bin" / tool, home / "compiler" / "bin" / tool):
            if os.access(candidate, os.X_OK):
                return home, str(candidate), ", ".join(looked)
    found = which(tool, environ)
    looked.append(f"PATH ({f'{tool} at ' + found if found else f'no {tool}'})")
    if found:
        return Path(found).resolve().parent.parent, found, ", ".join(looked)
    return None, None, ", ".join(looked)


def configured(environ: Mapping[str, str]) -> bool:
    """True when CANN's environment is set and opc can be run (``auto`` picks CANN)."""
    home, opc, _ = find_toolkit(environ)
    return home is not None and opc is not None and any(environ.get(v) for v in HOME_VARIABLES)


def script_interpreter(path: str, environ: Mapping[str, str]) -> str | None:
    """The interpreter a script's ``#!`` line runs it with; None when it has none.

    ``#!/usr/bin/env python3`` is looked up on the environment's PATH, as env
    does when the script runs with that environment.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(_MAX_SHEBANG)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if not words:
        return None
    if os.path.basename(words[0]) != "env":
        return words[0]
    # env [-S] [-i] [NAME=value]... program [args]
    names = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    return which(names[0], environ) if names else None


def interpreter_identity(tool: str, environ: Mapping[str, str]) -> str:
    """The Python a tool script runs with (not opcache's own): its binary's path, size and mtime.

    Not its digest, as ccache's default ``compiler_check`` does: hashing a
    7 MB interpreter would cost every ``opcache wrap -- opc`` about 5 ms, and
    an upgrade rewrites the binary (new size or mtime) or installs a new path.
    """
    interpreter = script_interpreter(tool, environ)
    if interpreter is None:
        return f"none: {os.path.basename(tool)} is not a script, or its interpreter is not found"
    try:
        st = os.stat(interpreter)
    except OSError as e:
        return f"{interpreter}: {e.strerror or e}"
    return f"{os.path.realpath(interpreter)}:{st.st_size}:{st.st_mtime_ns}"


def main_func(request: OpRequest) -> str:
    """The operator's entry function: ``options['main_func']``, else op_type in snake_case."""
    name = request.options.get(_MAIN_FUNC)
    return str(name) if name else _CAMEL.sub("_", request.op_type).lower()


def version_files(home: Path | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The digests of a toolkit's version files: its home's and the operator package's."""
    if home is None:
        return {}
    paths = [home / "version.cfg", home / "version.info"]
    paths += sorted(home.glob("*/version.info"))
    opp = environ.get("ASCEND_OPP_PATH")
    if opp:
        paths.append(Path(opp) / "version.info")
    found = {}
    for path in paths:
        try:
            # (never a wait: a FIFO at a version file's name would hang every compile)
            found[str(path)] = digest(fsutil.read_input(path))
        except OSError:
            continue
    return found


def toolkit_fingerprint(
    name: str,
    tool: str,
    home: Path | None,
    environ: Mapping[str, str],
    notes: LocalStore | None = None,
) -> str:
    """The identity of CANN's tool ``name`` (opc, op_compiler) at ``tool`` and of its
    toolkit: the tool's digest, the Python it runs with, the toolkit's version
    files, the tuning knowledge base.  ``notes``: where file digests are
    remembered between processes (``file_identity``)."""
    parts = {
        name: file_identity(tool, notes),
        "versions": version_files(home, environ),
        "python": interpreter_identity(tool, environ),
        "tune_bank": tune_bank_digest(environ, notes),
    }
    try:
        driver = driver_version(environ, strict=True)
    except OSError:
        driver = _unread_driver(environ)
    if driver is not None:  # (no driver installed, as on a build machine: nothing joins)
        parts["driver"] = driver
    return json.dumps(parts, sort_keys=True)


def _unread_driver(environ: Mapping[str, str]) -> str:
    """What stands in a key for a driver whose ``version.info`` this user cannot read
    (a driver folder of another group): where it is on this host, which no other
    host's is (taken for 'no driver', two machines' drivers passed for one), and
    which an upgrade moves (a new file, or its folder's times)."""
    folder = driver_folder(environ)
    for path in (folder / "version.info", folder):
        try:
            st = os.stat(path)
        except OSError:
            continue
        where = f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"
        return f"unread on {os.uname().nodename}: {where}"
    return f"unread on {os.uname().nodename}"


def keyed_environment(environ: Mapping[str, str]) -> str:
    """The environment an opc compile's key holds: ``OPC_KEY_ENVIRONMENT`` and the
    variables ``OPCACHE_KEY_ENV`` names (``toolchain.environment_key``)."""
    return environment_key(environ, OPC_KEY_ENVIRONMENT)


def driver_folder(environ: Mapping[str, str]) -> Path:
    """The NPU driver's folder: ``ASCEND_DRIVER_PATH``, else where CANN's installers
    look (``Driver_Install_Path_Param`` in /etc/ascend_install.info, plus
    ``/driver``), else /usr/local/Ascend/driver."""
    if environ.get(DRIVER_VARIABLE):
        return Path(environ[DRIVER_VARIABLE])
    try:
        with open(INSTALL_INFO, "rb") as f:
            info = f.read(1 << 16).decode(errors="replace")
    except OSError:
        info = ""
    for line in info.splitlines():
        name, eq, value = line.partition("=")
        if eq and name.strip() == "Driver_Install_Path_Param" and value.strip():
            return Path(value.strip()) / "driver"
    return Path("/usr/local/Ascend/driver")


def driver_version(environ: Mapping[str, str], *, strict: bool = False) -> str | None:
    """The digest of the driver's ``version.info`` (CANN requires equal drivers for
    servers that share a cache); None when there is none.  One there that cannot be
    read (a driver folder of another group, a FIFO) is None too, unless ``strict``:
    OSError then (two machines' unreadable drivers must not pass for one)."""
    try:
        return digest(fsutil.read_input(driver_folder(environ) / "version.info"))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        if strict:
            raise
        return None


def custom_opp_folders(environ: Mapping[str, str], home: Path | None = None) -> list[str]:
    """The folders of the custom operator packages CANN loads: ``ASCEND_CUSTOM_OPP_PATH``'s,
    and the ``vendors`` folder of the operator package (``ASCEND_OPP_PATH``'s, and that
    of the toolkit at ``home``), each as named (a read is matched by its path)."""
    folders = [p for p in environ.get("ASCEND_CUSTOM_OPP_PATH", "").split(os.pathsep) if p]
    if home is not None:
        folders.append(str(Path(home) / "opp" / "vendors"))
    opp = environ.get("ASCEND_OPP_PATH")
    if opp:
        folders.append(os.path.join(opp, "vendors"))
    return folders


def trace_folders(
    opc: str, home: Path | None, environ: Mapping[str, str], cwd: str
) -> tuple[list[str], list[str]]:
    """(folders left out of a read set of opc's, folders under them kept in it), for
    an opc at ``opc`` of the toolkit at ``home`` run in ``cwd``.

    Left out: the toolkit (when it has the version files its fingerprint
    holds) and the standard library of the Python opc runs with (its
    ``site-packages`` stay in).  Kept: the custom operator folders, which
    users change without changing the toolkit.
    """
    import glob

    # Only a toolkit's own folder, with its own version files (not the operator
    # package's, which ASCEND_OPP_PATH names), and not the user's work: an opc
    # found on PATH in a project's bin/ (or a shim in ~/bin) names it as home.
    ours = home is not None and not os.path.join(cwd, "").startswith(os.path.join(str(home), ""))
    exclude = [str(home)] if ours and version_files(home, {}) else []
    interpreter = script_interpreter(opc, environ)
    if interpreter:
        for path in {interpreter, os.path.realpath(interpreter)}:
            prefix = os.path.dirname(os.path.dirname(path))
            exclude += glob.glob(os.path.join(glob.escape(prefix), "lib*", "python3*"))
    return exclude, custom_opp_folders(environ, home)


# What a digest of custom packages reads at most; past it, it is no key (OSError).
MAX_PACKAGE_FILES = 100_000
_MAX_PACKAGE_BYTES = 4 << 30


def custom_opp_digest(
    environ: Mapping[str, str],
    home: Path | None = None,
    stats: dict[str, os.stat_result] | None = None,
) -> str | None:
    """Digest of the custom operator packages' files (each one's path in its package
    folder and contents, through links), or None when there is none; ``stats`` takes
    the fstat of each file read, taken as it was read.

    CANN names a custom operator's kernel by the operator's description, not its
    implementation: two machines' kernels are the same only with the same packages.
    The bytecode Python writes beside an implementation it imports (``__pycache__``)
    is left out: it differs from machine to machine and after every first import
    (a ``.pyc`` elsewhere is a module shipped without its source, and counts).
    OSError when the packages are more than a key can read (a link to /).
    """
    lines = []
    budget = [_MAX_PACKAGE_BYTES]
    named = [f for f in custom_opp_folders(environ, home) if os.path.isdir(f)]
    folders = list({os.path.realpath(f): f for f in named}.values())  # (each once)
    seen = set()  # (every folder walked once, whatever names lead to it)
    for place, folder in enumerate(folders):
        for top, subfolders, files in os.walk(folder, followlinks=True):
            try:
                st = os.stat(top)
            except OSError as e:
                lines.append(f"{place}/{os.path.relpath(top, folder)}\0{e.strerror or e}")
                continue
            if (st.st_dev, st.st_ino) in seen:  # (a link back up: walked once)
                subfolders.clear()
                continue
            seen.add((st.st_dev, st.st_ino))
            subfolders[:] = sorted(f for f in subfolders if f != "__pycache__")
            for name in sorted(files):
                if len(lines) >= MAX_PACKAGE_FILES:
                    raise OSError(f"the custom operator packages hold over {len(lines)} files")
                path = os.path.join(top, name)
                contents = _contents(path, budget, stats)
                lines.append(f"{place}/{os.path.relpath(path, folder)}\0{contents}")
    return digest("\n".join(lines).encode()) if lines else None


def _contents(path: str, budget: list[int], stats: dict[str, os.stat_result] | None = None) -> str:
    """The XXH3 of a regular file's bytes, read as its size says (a FIFO, a device or
    a /proc file that never ends is not read through), or what kept it from being
    read; OSError once ``budget`` bytes in all are spent.  ``stats`` takes the
    fstat of a file read."""
    import xxhash

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return "not a regular file"  # (a FIFO or a device is never opened)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # (swapped in meanwhile)
            return "not a regular file"
        budget[0] -= st.st_size
        if budget[0] < 0:
            raise OSError(f"the custom operator packages hold over {_MAX_PACKAGE_BYTES} bytes")
        if stats is not None:
            stats[path] = st
        hasher, left = xxhash.xxh3_128(), st.st_size + 1
        try:
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                hasher.update(chunk)
                left -= len(chunk)
        except OSError as e:  # (a /proc file that takes no such read)
            return f"unreadable: {e.strerror or e}"
        return hasher.hexdigest() if left == 1 else "its size is not what it reads"
    finally:
        os.close(fd)


def tune_bank_digest(environ: Mapping[str, str], notes: LocalStore | None = None) -> str:
    """Digest of the tuning knowledge base's files (names and contents), or "none"."""
    banks = [environ["TUNE_BANK_PATH"]] if environ.get("TUNE_BANK_PATH") else []
    if not banks and environ.get("ASCEND_CACHE_PATH", "").strip():
        # CANN trims the variable for its kernel cache; whether its tuning does too is
        # not known here: a bank under either spelling is keyed (a miss, never stale).
        given = environ["ASCEND_CACHE_PATH"]
        banks = [os.path.join(path, "aoe_data") for path in dict.fromkeys((given.strip(), given))]
    banks = [bank for bank in banks if os.path.isdir(bank)]
    if not banks:
        return "none"
    listing = []
    for bank in banks:
        for count, path in enumerate(sorted(Path(bank).rglob("*"))):
            if count > _MAX_BANK_FILES:
                break
            if path.is_file():
                listing.append(f"{path.relative_to(bank)}:{file_identity(path, notes)}")
    return digest("\n".join(listing).encode())


class CannCompiler:
    """Runs ``opc <op.py> --main_func=... --input_param=... --soc_version=... --output=...``.

    The request's options other than ``main_func`` are passed as ``--name=value``
    flags (``impl_mode``, ``op_mode``...).
    """

    name = "cann"

    def __init__(
        self,
        opc: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        notes: LocalStore | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        home, found, looked = find_toolkit(env)
        if opc is None and found is None:
            raise ConfigError(f"cann: no CANN toolkit found; looked at {looked}")
        if opc is not None:
            # A bare name is looked up on PATH, as the shell would run it.
            resolved = opc if os.sep in opc else which(opc, env)
            if resolved is None or not os.access(resolved, os.X_OK):
                raise ConfigError(f"cann: opc={opc!r} is not an executable")
            opc = resolved
        self.opc = opc or found
        self.home = home
        self._environ = dict(env)
        self._notes = notes  # where tool digests are remembered (opcache wrap's cache)
        self._fingerprint: str | None = None
        # Looked at (a stat each) at every compile: an upgrade in place rewrites them,
        # a package installed or removed changes its folder.  (A file edited in place
        # in a custom package is found by the next compiler object: its digest.)
        version_files = [] if home is None else [home / "version.cfg", home / "version.info"]
        if env.get("ASCEND_OPP_PATH"):
            version_files.append(Path(env["ASCEND_OPP_PATH"]) / "version.info")
        interpreter = script_interpreter(self.opc, env)
        self._tools = [
            self.opc,
            *version_files,
            *([interpreter] if interpreter else []),
            *custom_opp_folders(env, home),
        ]

    @classmethod
    def usable(cls, environ: Mapping[str, str]) -> tuple[bool, str]:
        _home, opc, looked = find_toolkit(environ)
        return (True, f"opc at {opc}") if opc else (False, f"no toolkit; looked at {looked}")

    checks_its_tools = True  # (KeyFlow asks the fingerprint at every compile)

    def fingerprint(self) -> str:
        changed = tool_changed(self, *self._tools)  # (first: it notes them the first time)
        if self._fingerprint is None or changed:
            toolkit = toolkit_fingerprint("opc", self.opc, self.home, self._environ, self._notes)
            # What the operator's Python finds beside the toolkit, as wrap keys an opc line.
            custom = custom_opp_digest(self._environ, self.home) or "none"
            # With the variables that move where opc's Python finds modules: wrap picks
            # its remembered read sets by them; here they join the key.
            names = (*OPC_KEY_ENVIRONMENT, *OPC_READS_ENVIRONMENT)
            parts = [toolkit, environment_key(self._environ, names), custom, READS_CHECKED]
            self._fingerprint = json.dumps(parts)
        return self._fingerprint

    def compile(self, request: OpRequest, workdir: Path) -> str | ReadSet:
        """Run opc into ``workdir``, traced: what it read beyond the key (a hit checks
        it), or why its kernel must not be stored (what it read is not known)."""
        import tempfile  # a compile only: `opcache wrap` plans opc lines with this module

        workdir = Path(os.path.abspath(workdir))  # the tool runs in another folder
        sources = request.source_bytes
        scripts = [name for name in sources if name.endswith(".py")] or list(sources)
        if not scripts:
            raise CompileError(f"cann: {request.op_type}: the request has no operator source")
        kernel = kernel_name(request)
        param = {
            "kernel_name": kernel,
            "op_type": request.op_type,
            "inputs": list(request.inputs),
            "outputs": list(request.outputs),
            "attrs": dict(request.attrs),
        }
        with tempfile.TemporaryDirectory(prefix="opcache-opc-") as src:
            for name, data in sources.items():
                Path(src, name).write_bytes(data)
            param_path = Path(src, f"{kernel}_param.json")
            param_path.write_text(json.dumps(param, sort_keys=True))
            argv = [
                self.opc,
                str(Path(src, scripts[0])),
                f"--main_func={main_func(request)}",
                f"--input_param={param_path}",
                f"--soc_version={request.soc_version}",
                f"--output={workdir}",
            ]
            for name, value in sorted(request.options.items()):
                if name != _MAIN_FUNC:
                    argv.append(f"--{name}={value}")
            # The operator's ``.py`` finds its kernel source, helper modules and tiling
            # through paths and variables no key names: traced, as wrap traces a miss.
            from . import traced  # (a compile only, as tempfile: not on a wrap hit's start-up)

            exclude, keep = trace_folders(self.opc, self.home, self._environ, src)
            return traced.run(
                argv,
                cwd=src,
                workdir=workdir,
                environ=self._environ,
                what=f"opc {request.op_type}",
                tool="opc",
                exclude=exclude,
                keep=keep,
            )
