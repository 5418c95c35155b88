"""Read sets: what a compile read or looked for; a hit is served only while all of it is unchanged.

A tool such as CANN's ``opc`` reads files its command line does not name (the
kernel source an operator ``.py`` finds through ``BUILD_KERNEL_SRC`` or beside
itself, the headers that source includes, helper modules, the tiling library
under ``ASCEND_CUSTOM_OPP_PATH``).  On a miss the compile runs under
``strace -f``; every path any of its processes opened, executed, listed or
looked up (``stat``, ``access``, ``readlink``...) is recorded with what it is
now: a file's mode, size, times and digest; a folder's mode (and, when the
tool listed it, the digest of its names); a link's target; or that it is
missing (ENOENT, ENOTDIR: a negative entry, so a file created later earlier on
a search path is seen).  Left out: what the compile wrote, made, renamed or
deleted itself without looking at it first (its outputs and temporary files),
Python's bytecode caches (checked against their sources by Python), and the
folders ``exclude`` names (the toolkit and Python's standard library, which
the toolkit fingerprint covers, and ``/proc``, ``/sys``, ``/dev``).
A path the compile looked for and then made is recorded as missing (what it
found), one it found and then changed or deleted without reading it as there;
one it read (or moved) and then changed, or a folder whose names changed after
the compile listed them (other than by the compile), leaves the compile
unstored: what it saw is gone.

Links the compile makes itself are followed (``_links``): a path reached
through one, symbolic or hard, file or folder, is recorded as the path the link
led to when the call was made (a staged ``kernel_meta/k.cpp -> src/k.cpp`` puts
``src/k.cpp`` in the set, whether the link is still there or not), and a link
renamed (``ln -sf``'s) or in a folder renamed is followed where it went.  A file
it hard-linked counts as read; its ctime is then the link's, so the compile
is stored only if such a link is still there when it ends and the same file
(``_check_linked``).  Where what a link led to cannot be known (a hard link to a
file the compile had changed, to a symlink, or one it removed; a hard link to a
descriptor's file then read; a link swapped by ``RENAME_EXCHANGE``), the
compile is unprovable.  What ``strace -y`` named each descriptor opened to read
is checked against where its path leads at the end; for a path taken for the
compile's own (``_Own``), that it lies in a folder the compile made or at a path
it changed (else a link no traced process made led out of it).

``ReadSet.digest`` covers the paths and contents, not the times: it joins a
cache key.  ``ReadSet.unchanged()`` checks the set against the machine: one
``lstat`` per path, and a file's digest only when its stat moved.  A set can
be remembered per compile command (``Memo``), as ccache's direct mode
remembers a source's headers, so a hit costs only those stats.
"""

from __future__ import annotations

import json
import os
import re
import stat

from . import fsutil
from ._log import get_logger
from .compilers.toolchain import which
from .key import digest

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from .storage.local import LocalStore

log = get_logger(__name__)

ENV_TRACE = "OPCACHE_TRACE"  # "off": do not trace (as where strace is missing)
SYSTEM_FOLDERS = ("/proc", "/sys", "/dev")
# ... where users keep files too (tmpfs): those stay in a read set.
USER_FOLDERS = ("/dev/shm",)
# A path through a process's own folder or root names another path, which the
# read set would not hold (``cat /proc/self/cwd/k.cpp``).
# (or through one of its open folders: /proc/self/fd/N/x, /dev/fd/N/x)
_THROUGH_PROC = (
    r"(?:/proc/(?:self|thread-self|\d+)(?:/task/\d+)?/(?:cwd|root|fd/\d+)|/dev/fd/\d+)/."
)
TRACE_PREFIX = "trace"
# opcache's own folders beside a compile's outputs (staging, builds): not in a listing.
OWN_NAMES = ".opcache-"
_VARIANTS = 8  # read sets remembered per command (e.g. a kernel edited back and forth)

# strace's output with -ttt (each call's time), -xx (every string as \xNN), -y (fds and
# AT_FDCWD followed by <path>).  Patterns, compiled (re caches them) only where a trace
# is read: compiling them costs a hit, which reads none, half a millisecond.
_HEX = r"(?:\\x[0-9a-f]{2})*"
_TIME = r"(?:(\d+)\.(\d{6}) )?"
# (the path after a result: what the descriptor an open returned is, as the kernel found it)
_CALL = r"^" + _TIME + r"(\w+)\((.*)\)\s+=\s+(-?\d+|\?)(?:<(" + _HEX + r")>)?(?:\s+(E[A-Z0-9]+))?"
_PATH_ARG = r"(?:(?:AT_FDCWD|-?\d+)<(" + _HEX + r")>,\s*)?\"(" + _HEX + r")\""
_FD_ARG = r"^-?\d+<(" + _HEX + r")>"
_DIRENT_NAME = r"d_name=\"(" + _HEX + r")\""
_CWD_NOTE = r"AT_FDCWD<(" + _HEX + r")>"
# Calls that look at a path (the first one), calls that change one or two.
_LOOKS = frozenset((
    "access", "faccessat", "faccessat2", "stat", "stat64", "lstat", "lstat64", "newfstatat",
    "fstatat64", "statx", "readlink", "readlinkat", "execve", "execveat", "open", "openat",
    "openat2", "getxattr", "lgetxattr", "listxattr", "llistxattr", "uselib",
))  # fmt: skip
_CHANGES = dict.fromkeys((
    "creat", "mkdir", "mkdirat", "unlink", "unlinkat", "rmdir", "truncate", "chmod", "fchmodat",
    "lchown", "chown", "fchownat", "utime", "utimes", "utimensat", "futimesat", "mknod",
    "mknodat", "setxattr", "lsetxattr", "removexattr", "lremovexattr",
), 1)  # fmt: skip
_CHANGES |= dict.fromkeys(("rename", "renameat", "renameat2"), 2)
_SYMLINKS = frozenset(("symlink", "symlinkat"))  # the second path is the one made
_HARD_LINKS = frozenset(("link", "linkat"))  # (the source is read, the second path made)
_REMOVES = frozenset(("unlink", "unlinkat", "rmdir"))
_MAKES = frozenset(("mkdir", "mkdirat", "mknod", "mknodat"))  # (only where nothing is)
# Calls on a name, whose last part is not followed if a link: the link itself is
# made, removed or moved; and calls that look at a symlink itself.
_NAMES = _MAKES | _REMOVES | _SYMLINKS | {"rename", "renameat", "renameat2"}
_NOFOLLOW = frozenset((
    "lstat", "lstat64", "readlink", "readlinkat", "lchown", "lgetxattr", "llistxattr",
    "lsetxattr", "lremovexattr",
))  # fmt: skip
_RETIMES = frozenset(("utime", "utimes", "utimensat", "futimesat", "truncate"))
_WRITE_FLAGS = r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC"
_MISSING = ("ENOENT", "ENOTDIR")
_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir"}  # (the kinds whose times are kept)
_ITEM_TYPES = [str, str, int, int, int, int, str]  # a ReadSet item's, as JSON gives them


class Unprovable(Exception):
    """What the compile read cannot be known (the message says why): do not store it."""


def strace_program(environ: Mapping[str, str]) -> str | None:
    """The strace to trace compiles with; None where there is none or tracing is off."""
    if environ.get(ENV_TRACE, "").strip().lower() in ("off", "0", "no", "false"):
        return None
    return which("strace", environ)


def traced_command(strace: str, trace_dir: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run under strace, one trace file per process in ``trace_dir``."""
    out = os.path.join(trace_dir, TRACE_PREFIX)
    calls = "trace=%file,fchdir,chdir,getdents,getdents64"
    # -ttt: when each call was made, to tell a file read and then rewritten from one made and read;
    # -q, not -qq: each process's exit is noted in its file (run_traced reads the command's)
    options = ["-f", "-ff", "-q", "-ttt", "-xx", "-y", "-s", "65535", "-e", calls]
    # -I2: a SIGINT makes it let go of its processes and end (with -o and a command its
    # default, 3, blocks it): run_traced's way out of a process left running
    options += ["-e", "signal=none", "-I2"]
    # a listing's names, not "/* 5 entries */": what the compile saw of a folder
    options += ["-e", "abbrev=!getdents,getdents64"]
    return [strace, *options, "-o", out, "--", *argv]


# After the traced command's own process ends, how long the processes it started get
# before strace lets go of them (strace -f waits for every one: a server a compile
# starts in the background kept the build waiting for as long as it ran).
_LINGER_SECONDS = 1.0


def run_traced(
    argv: Sequence[str], trace_dir: str, env: Mapping[str, str], cwd: str | None = None
) -> tuple[int, bytes, bytes, str | None]:
    """Run ``traced_command``'s ``argv`` (in ``cwd``): (the command's exit status, its
    stdout, its stderr, why its read set is not known, or None).

    Once the command's own process has ended, the processes it started get
    ``_LINGER_SECONDS``; any still running then is let go by strace (it runs on,
    untraced) and the compile is not stored.  Its output goes to files, not
    pipes, so a process holding them does not keep this waiting either.
    """
    import signal
    import subprocess
    import tempfile
    import time

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        strace = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=dict(env), cwd=cwd
        )
        top, ended, outlived = None, None, None
        while True:
            try:
                status = strace.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                pass
            if top is None:
                top = _command_process(trace_dir)
            elif ended is None:
                ended = time.monotonic() if _exit_status(trace_dir, top) is not None else None
            elif time.monotonic() - ended > _LINGER_SECONDS:
                strace.send_signal(signal.SIGINT)  # (strace detaches and ends)
                strace.wait()
                outlived = "a process it started outlived it"
                status = _exit_status(trace_dir, top) or 0
                break
        out.seek(0)
        err.seek(0)
        return status, out.read(), err.read(), outlived


def _command_process(trace_dir: str) -> int | None:
    """The traced command's own process: the first any trace file notes a call of
    (strace makes its file before any other's, as it runs before any other); None
    until one is noted."""
    first: tuple[float, int] | None = None
    for name in os.listdir(trace_dir):
        pid = name[len(TRACE_PREFIX) + 1 :]
        try:
            with open(os.path.join(trace_dir, name), "rb") as f:
                when = float(f.read(24).split(b" ", 1)[0])
        except (OSError, ValueError):
            continue
        if pid.isdigit() and (first is None or when < first[0]):
            first = (when, int(pid))
    return None if first is None else first[1]


def _exit_status(trace_dir: str, pid: int) -> int | None:
    """The exit status its trace file gives a process that ended, else None."""
    try:
        with open(os.path.join(trace_dir, f"{TRACE_PREFIX}.{pid}"), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 200))
            tail = f.read()
    except OSError:
        return None
    found = re.search(rb"\+\+\+ (?:exited with (\d+)|killed by (SIG[A-Z0-9]+))", tail)
    if found is None:
        return None
    if found.group(1):
        return int(found.group(1))
    import signal

    try:  # (as subprocess gives a process a signal ended: its negative number)
        return -signal.Signals[found.group(2).decode()].value
    except KeyError:
        return -signal.SIGKILL


class ReadSet:
    """The files one compile read or looked for, as they were (or are) on the machine.

    ``items``: ``[path, kind, mode, size, mtime_ns, ctime_ns, content]`` sorted
    by path, ``kind`` one of ``file`` (content: its digest), ``dir`` (content:
    the digest of its names when it was listed, else ""), ``link`` (content:
    its target; the path's item as followed comes next, under ``path + "\\0"``),
    ``missing``, ``there`` (something the compile found and then changed: only
    that something is there), ``other`` (a FIFO, socket or device: its type), ``error``
    (content: the error's text).
    """

    def __init__(self, items: list[list]) -> None:
        self.items = items
        self.moved = False  # set by unchanged(): a stat moved, the contents did not

    @property
    def digest(self) -> str:
        """Of the paths and what they hold, not their times: a part of a key."""
        rows = [[i[0], i[1], i[2], _size(i), i[6]] for i in self.items]
        # canonical_json's bytes for rows of strings and numbers (no mapping to check or
        # sort), without its walk over every value: a hit computes this for each path.
        # (a name that is not UTF-8 holds surrogates, written as JSON's escape of them)
        text = json.dumps(rows, ensure_ascii=False, separators=(",", ":"))
        return digest(text.encode("utf-8", "backslashreplace"))

    def unchanged(self) -> bool:
        """True while every path is as recorded (stat first, a digest only when it moved)."""
        for item in self.items:
            path, kind = item[0], item[1]
            follow = path.endswith("\0")
            real = path[:-1] if follow else path
            if kind in ("file", "dir"):
                # The common case in one stat, without _facts' record: the cost of a hit.
                try:
                    st = os.stat(real) if follow else os.lstat(real)
                except OSError:
                    return False
                if (
                    _KINDS.get(stat.S_IFMT(st.st_mode)) != kind
                    or stat.S_IMODE(st.st_mode) != item[2]
                ):
                    return False
                if kind == "dir" and item[6] == "":
                    # A folder the compile did not list: only that it is one.  Its times move
                    # with any name made in it (the hit's own staging in its output folder).
                    continue
                if not _same_access(real, item):
                    return False
                if [st.st_size, st.st_mtime_ns, st.st_ctime_ns] == item[3:6]:
                    continue  # (a folder's names change its mtime)
            elif kind in ("missing", "there"):
                # Still nothing there (the other errors, or a path that now exists, differ);
                # still something there.
                try:
                    os.stat(real) if follow else os.lstat(real)
                except (FileNotFoundError, NotADirectoryError):
                    if kind == "missing":
                        continue
                    return False
                except OSError:
                    return False
                if kind == "there":
                    continue
                return False
            now = _facts(real, follow, listed=kind == "dir", cheap=kind not in ("file", "dir"))
            if now[1] != kind or now[2] != item[2]:
                return False
            if _size(now) != _size(item) or now[6] != item[6]:
                return False
            if now[3:6] != item[3:6]:
                item[3:6] = now[3:6]  # (remembered, the next hit needs no digest)
                self.moved = True
        return True

    def to_json(self) -> list:
        return self.items

    @classmethod
    def from_json(cls, data: object) -> ReadSet | None:
        """The set written by ``to_json``; None when it is not one."""
        if not isinstance(data, list):
            return None
        for item in data:
            if type(item) is not list or list(map(type, item)) != _ITEM_TYPES:
                return None
            # Notes and entries are files others may write: a NUL anywhere but as the
            # mark of a followed link is no path (os calls raise ValueError on it).
            if "\0" in item[0][:-1]:
                return None
        # Nor is a lone surrogate no file name has (all paths in one encode: a hit's).
        if not _encodes("".join(item[0] for item in data)):
            return None
        return cls(data)


def of_files(paths: Sequence[str], started_ns: int) -> ReadSet:
    """The read set of files a compile read, named by the compiler itself (a
    dependency list): each as it is now, followed through links.  Unprovable
    when one changed since ``started_ns`` (the compile may have read the old
    contents or the new) or is gone."""
    items = []
    for path in sorted(set(paths)):
        for item in _facts_with_link(path, listed=False):
            if item[1] == "file" and max(item[4], item[5]) >= started_ns - fsutil.CLOCK_LAG_NS:
                raise Unprovable(f"{path} changed while the compile ran")
            if item[1] in ("missing", "error"):
                raise Unprovable(f"{path} was read and is gone")
            items.append(item)
    return ReadSet(items)


SAME, MOVED, CHANGED = "same", "moved", "changed"  # (reads_now's answers)


def reads_now(items: object) -> str | None:
    """An entry's read set (``ReadSet.to_json``) against the machine: SAME as
    recorded; MOVED, the same files whose stat moved (``items`` now hold their
    times here, worth keeping: the next check then needs no digest); CHANGED;
    None when ``items`` is no read set."""
    reads = ReadSet.from_json(items)
    if reads is None:
        return None
    if not reads.unchanged():
        return CHANGED
    return MOVED if reads.moved else SAME


def _encodes(path: str) -> bool:
    try:
        os.fsencode(path)
    except UnicodeError:
        return False
    return True


def traced(trace_dir: str) -> bool:
    """Whether strace wrote a trace into ``trace_dir`` (it could start the command)."""
    try:
        return any(n.startswith(TRACE_PREFIX + ".") for n in os.listdir(trace_dir))
    except OSError:
        return False


def record(
    trace_dir: str, started_ns: int, exclude: Sequence[str], keep: Sequence[str] = ()
) -> ReadSet:
    """The read set of the compile whose trace files are in ``trace_dir``.

    Paths under ``exclude`` and the system folders are left out, unless they
    are under ``keep`` or in a ``site-packages`` / ``dist-packages`` folder
    right below an ``exclude`` folder (a Python's standard library is left
    out, its installed packages are not).  Everything the compile changed is
    left out too.  Unprovable when there is no trace, or a file it read
    changed after ``started_ns`` (it may have read the old contents or the
    new), or was changed by the compile after it read it (what it read is
    gone), or a relative path cannot be placed (a process moved before the
    trace noted its folder).
    """
    from ._links import LinkUnknown

    try:
        trace = _parse(trace_dir)
    except LinkUnknown as e:
        raise Unprovable(str(e)) from None
    if not trace.looked and not trace.changed:
        raise Unprovable("strace recorded nothing (it may not be allowed to trace here)")
    skip = [_folder(p) for p in (*exclude, *SYSTEM_FOLDERS)]
    kept = tuple(_folder(p) for p in (*keep, *USER_FOLDERS))
    made_dirs = tuple(_folder(p) for p in trace.made)
    own = _Own(trace)
    through_proc = re.compile(_THROUGH_PROC)
    own_names = trace.changed_names()
    items = []
    for path in sorted(trace.looked):
        norm = os.path.normpath(path)
        if through_proc.match(norm):
            raise Unprovable(f"{path}: a file reached through /proc is not known by its name")
        if _skipped(norm, skip, kept):
            continue
        if norm in trace.blind:
            raise Unprovable(f"{path}: read through a hard link to a file with no name")
        if norm.startswith(made_dirs):
            own.check(path, norm)
            continue
        if _bytecode(norm) and (norm in trace.changed or norm.endswith("__pycache__")):
            continue  # (a .pyc Python only read may be one it used though stale: kept)
        as_it_was = _kept_as_it_was(norm, trace, started_ns)
        linked = norm in trace.linked
        if norm in trace.changed and not as_it_was:
            if linked and trace.changed[norm] <= trace.linked[norm]:
                raise Unprovable(
                    f"{path}: the compile linked a file it had changed (what the link held"
                    " is not known)"
                )
            found = _as_found(path, norm, trace)
            if found is not None:
                items.append(found)
            else:
                own.check(path, norm)
            continue
        _led_where_named(path, norm, trace)
        if linked:
            _check_linked(path, norm, trace)
        for item in _facts_with_link(path, listed=norm in trace.listed):
            # (a file kept as it was by its contents: its mode, owner and so its ctime
            # may be the compile's, as CANN's lock files are chmodded when opened; one
            # the compile hard-linked has the ctime of its link, checked above)
            when = item[4] if as_it_was or linked else max(item[4], item[5])
            if item[1] == "file" and when >= started_ns - fsutil.CLOCK_LAG_NS:
                raise Unprovable(f"{path} changed while the compile ran")
            if item[1] == "missing" and norm in trace.first_read:
                # Read, then deleted by another process before this record: "missing"
                # would let the next run, with no such file, hit on what it held.
                raise Unprovable(f"{path} was read and is gone")
            if item[1] == "dir" and item[0].rstrip("\0") == path:
                real = os.path.realpath(norm)  # (strace -y names a listing's folder so)
                if real in trace.listings:
                    _check_listings(real, trace.listings[real], own_names.get(real, set()))
            items.append(item)
    return ReadSet(items)


def _led_where_named(path: str, norm: str, trace: _Trace) -> None:
    """Unprovable when a file the compile opened at ``path`` was not the one the path
    leads to now, as ``strace -y`` named the descriptor: a link on the way moved while
    it ran, or ``..`` after a link led elsewhere than the name says."""
    opened = trace.opened.get(norm)
    if opened and opened - {os.path.realpath(norm), real_folder(norm) + "\0"}:
        raise Unprovable(f"{path} led to another file when the compile opened it")


class _Own:
    """Where the compile's own files are: the real paths of the folders it made, and
    of the paths it changed (their folders' links resolved, their names as they are)."""

    def __init__(self, trace: _Trace) -> None:
        self.trace = trace
        self._made: tuple[str, ...] | None = None
        self._changed: set[str] | None = None

    def check(self, path: str, norm: str) -> None:
        """Unprovable when a path taken for the compile's own (in a folder it made, or
        changed before it looked at it) was opened to read a file elsewhere, as
        ``strace -y`` named it: reached through a link opcache did not see made (by
        a process it does not trace), whose file the read set would not hold."""
        opened = self.trace.opened.get(norm)
        if not opened:
            return
        if self._made is None:
            self._made = tuple(_folder(os.path.realpath(d)) for d in self.trace.made)
            real: dict[str, str] = {}  # (by folder: a compile changes many files in few)
            self._changed = set()
            for changed in self.trace.changed:
                folder, name = os.path.split(changed)
                if folder not in real:
                    real[folder] = os.path.realpath(folder)
                self._changed.add(os.path.join(real[folder], name))
        for there in opened:
            there = there.rstrip("\0")
            if not (_folder(there).startswith(self._made) or there in self._changed):
                raise Unprovable(f"{path} led to a file the compile did not make: {there}")


def _check_linked(path: str, norm: str, trace: _Trace) -> None:
    """Unprovable unless ``path``, a file the compile hard-linked, is provably the file
    it linked, unchanged since.

    Its ctime is the compile's (each link made, moved or removed moves it), so it
    cannot tell a change by another process while the compile ran, as it does for
    any other file; its mtime can be set back (``cp -p`` onto it).  What does: one
    of those links still there at the end and the same file (no file renamed over
    the name, no link on its way re-pointed), and its ctime no later than the
    compile's last link, move or unlink of it (a write since moved it).  A link the
    compile removed leaves nothing to tell a change between its link and its
    unlink: unprovable, as is a hard link to a symlink (not followed: one more
    symlink, whose text is read from its own folder).
    """
    links = trace.links.hard.get(norm, [])
    try:
        st = os.lstat(norm)
        if stat.S_ISLNK(st.st_mode):
            if not all(link.follow for link in links):
                raise Unprovable(f"{path}: the compile hard-linked a symlink")
            st = os.stat(norm)
    except OSError:
        return  # (its item says so: read and gone)
    last = max(max(link.start, link.end or 0) for link in links) if links else 0
    if st.st_ctime_ns > last * 1000 + fsutil.CLOCK_LAG_NS:
        raise Unprovable(f"{path} changed while the compile ran")
    for link in links:
        if link.end is None:
            try:
                there = os.lstat(link.name)
            except OSError:
                continue
            if (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino):
                return
    raise Unprovable(
        f"{path}: the compile read it through a hard link it removed (or that is another"
        " file now): what the link held cannot be checked"
    )


def _as_found(path: str, norm: str, trace: _Trace) -> list | None:
    """The item of a path the compile changed, as the compile found it; None when it
    changed it before looking at it (its own output, a temporary file)."""
    if trace.read_then_changed(norm):
        raise Unprovable(f"{path} changed while the compile ran (it wrote what it had read)")
    if norm in trace.updated and os.path.lexists(norm):
        if norm in trace.appended:
            return None  # (a log or lock file opened to append: the compile's own)
        # Opened read-write (and changed): what it read is gone.  (One it made so, a
        # database, is read unchanged by the next run, which is stored.)
        raise Unprovable(f"{path} was opened read-write and changed by the compile")
    found = trace.found_before_changing(norm)
    if found is None:
        return None
    if not found:
        return [path, "missing", 0, 0, 0, 0, ""]
    if norm in trace.first_read or norm in trace.updated or norm in trace.moved:
        # What it held was read, or is under another name now: gone from this path.
        raise Unprovable(f"{path} was there, and the compile read or moved it and changed it")
    return [path, "there", 0, 0, 0, 0, ""]  # (a marker it removed, an old output it replaced)


def _bytecode(norm: str) -> bool:
    """A ``__pycache__`` folder or a ``.pyc`` in one: Python reads one only while it
    matches its source (which is in the read set), and makes and replaces them as
    it pleases: no input, else a compile that writes them would miss twice."""
    folder, name = os.path.split(norm)
    return name == "__pycache__" or (
        name.endswith(".pyc") and os.path.basename(folder) == "__pycache__"
    )


def _check_listings(path: str, listings: list[tuple[bool, set[str]]], own: set[str]) -> None:
    """Unprovable when a folder's names now differ from what a listing of the compile
    found, other than by names the compile itself changed: the record would hold
    names it never saw (a file another process added after the listing)."""
    try:
        now = {n for n in os.listdir(path) if not n.startswith(OWN_NAMES)}
    except OSError:
        return  # (its item says it cannot be listed)
    for complete, names in listings:
        names = {n for n in names if not n.startswith(OWN_NAMES)} - {".", ".."}
        moved = (names ^ now if complete else names - now) - own
        if moved:
            raise Unprovable(
                f"{path}: its names changed after the compile listed them ({sorted(moved)[0]})"
            )


def _same_access(path: str, item: list) -> bool:
    """Whether this user may read ``path`` now as when it was recorded: a stat does not
    say (the user joined or left its group), and the compile read it, or failed to.
    Asked only of what not everyone may read."""
    was_denied = item[6].startswith(("unreadable:", "unlistable:"))
    if not was_denied and item[2] & 0o004:
        return True
    return os.access(path, os.R_OK) != was_denied


def _kept_as_it_was(norm: str, trace: _Trace, started_ns: int) -> bool:
    """Whether a path opened read-write but not truncated (a database, a lock file)
    is a file whose contents the compile did not change: it was read, and is
    recorded as such.  Its contents go by its mtime, which every write sets and
    only a utime or truncate by the compile could set back; a chmod (CANN's lock
    files) moves the ctime alone."""
    if norm not in trace.updated or norm in trace.retimed:
        return False
    try:
        st = os.lstat(norm)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_mtime_ns < started_ns - fsutil.CLOCK_LAG_NS


def _folder(path: str) -> str:
    return os.path.normpath(path).rstrip("/") + "/"


def _skipped(norm: str, skip: list[str], kept: tuple[str, ...]) -> bool:
    inside = norm + "/"
    if inside.startswith(kept):
        return False
    for folder in skip:
        if inside.startswith(folder):
            rest = inside[len(folder) :]
            return not rest.startswith(("site-packages/", "dist-packages/"))
    return False


def _size(item: list) -> int:
    """A file's size; a folder's (its blocks, not its names) is no part of it."""
    return item[3] if item[1] == "file" else 0


def _facts_with_link(path: str, *, listed: bool) -> list[list]:
    """The items of ``path``: as it is, and as followed when it is a link."""
    first = _facts(path, False, listed=listed, cheap=False)
    if first[1] != "link":
        return [first]
    return [first, _facts(path, True, listed=listed, cheap=False)]


def _facts(path: str, follow: bool, *, listed: bool, cheap: bool) -> list:
    """``[name, kind, mode, size, mtime_ns, ctime_ns, content]``; ``cheap``: no content read."""
    name = path + "\0" if follow else path
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as e:
        code = e.errno or 0
        error = os.strerror(code) if code else str(e)
        kind = "missing" if _errno_name(code) in _MISSING else "error"
        return [name, kind, 0, 0, 0, 0, "" if kind == "missing" else error]
    mode = stat.S_IMODE(st.st_mode)
    times = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    if stat.S_ISLNK(st.st_mode):
        try:
            return [name, "link", mode, 0, 0, 0, os.readlink(path)]
        except OSError as e:
            return [name, "error", 0, 0, 0, 0, e.strerror or str(e)]
    if stat.S_ISDIR(st.st_mode):
        content = ""
        if listed and not cheap:
            try:
                names = sorted(n for n in os.listdir(path) if not n.startswith(OWN_NAMES))
                content = digest("\0".join(names).encode(errors="surrogateescape"))
            except OSError as e:
                content = f"unlistable: {e.strerror or e}"
        return [name, "dir", mode, *times, content]
    if stat.S_ISREG(st.st_mode):
        content = ""
        if not cheap:
            try:
                content = digest(fsutil.read_input(path))
            except OSError as e:
                content = f"unreadable: {e.strerror or e}"
        return [name, "file", mode, *times, content]
    return [name, "other", mode, 0, 0, 0, str(stat.S_IFMT(st.st_mode))]


def _errno_name(code: int) -> str:
    import errno

    return errno.errorcode.get(code, "")


class _Trace:
    """What a compile's trace files say, for ``record``."""

    def __init__(self) -> None:
        self.looked: set[str] = set()  # paths looked at
        self.listed: set[str] = set()  # folders opened to read
        self.made: set[str] = set()  # folders made
        self.updated: set[str] = set()  # opened read-write without truncating
        self.moved: set[str] = set()  # renamed away
        self.appended: set[str] = set()  # opened read-write to append
        self.retimed: set[str] = set()  # given times or a size (utime, truncate)
        # When (µs) each path was first opened to read, first looked at (and whether
        # something was there), first changed: the processes' files interleave only by
        # their times.  (No time: before anything, as a tie is.)  The keys of
        # ``first_read`` are the paths opened to read, of ``changed`` those changed.
        self.first_read: dict[str, int] = {}
        self.first_look: dict[str, tuple[int, bool]] = {}
        self.changed: dict[str, int] = {}  # (written, made, renamed or deleted)
        # Each folder's listings (getdents): (read to its end, the names found).
        self.listings: dict[str, list[tuple[bool, set[str]]]] = {}
        # What each path opened to read named when it was opened, as the kernel found
        # it (strace -y); a link's own, with O_NOFOLLOW, marked with a NUL.
        self.opened: dict[str, set[str]] = {}
        # The links the compile made (paths are followed through them), the files it
        # hard-linked (when first), the paths it reached through a hard link to a file
        # with no name (an O_TMPFILE's), whose contents cannot be checked.
        from ._links import Links  # (a miss's only: a hit does not load it)

        self.links = Links()
        self.linked: dict[str, int] = {}
        self.blind: set[str] = set()

    def read_then_changed(self, path: str) -> bool:
        """Whether the compile read ``path`` and then changed it (a path it changed)."""
        when = self.changed[path]
        return self.first_read.get(path, when + 1) <= when

    def found_before_changing(self, path: str) -> bool | None:
        """Whether something was at ``path`` when the compile first looked at it, before
        it changed it; None when it changed it first."""
        look = self.first_look.get(path)
        if look is None or look[0] > self.changed[path]:
            return None
        return look[1]

    def changed_names(self) -> dict[str, set[str]]:
        """The names the compile changed, by folder."""
        names: dict[str, set[str]] = {}
        for path in self.changed:
            folder, name = os.path.split(path)
            # (by its real path, as strace -y names a listing's folder)
            names.setdefault(os.path.realpath(folder), set()).add(name)
        return names

    def look(self, path: str, when: int, found: bool) -> None:
        self.looked.add(path)
        if path not in self.first_look or when < self.first_look[path][0]:
            self.first_look[path] = (when, found)

    def change(self, path: str, when: int) -> None:
        self.changed[path] = min(self.changed.get(path, when), when)


def _parse(trace_dir: str) -> _Trace:
    """What every process of the compile looked at, listed, read and changed.

    Each process's calls are placed first (in its folder as each call found it),
    then all of them are taken in the order of their times, so that a path is
    followed through the links the compile had made by then (``_links``),
    whichever of its processes made them.
    """
    import heapq

    from ._links import Link

    trace = _Trace()
    patterns = (_CALL, _PATH_ARG, _FD_ARG, _CWD_NOTE, _WRITE_FLAGS, _DIRENT_NAME)
    call_re, path_re, fd_re, cwd_re, write_re, dirent_re = map(re.compile, patterns)
    try:
        names = [n for n in os.listdir(trace_dir) if n.startswith(TRACE_PREFIX + ".")]
    except OSError:
        names = []
    processes = []
    for number, name in enumerate(names):
        try:
            with open(os.path.join(trace_dir, name), "rb") as f:
                lines = f.read().decode("ascii", "replace").splitlines()
        except OSError:
            continue
        calls = [match.groups() for match in map(call_re.match, lines) if match]
        processes.append(list(_placed(calls, number, path_re, fd_re, cwd_re)))
    links = trace.links
    # Each process's listings under way, by folder.
    reading: dict[int, dict[str, set[str]]] = {}
    for when, number, _, call, args, result, opened, error, placed, target in heapq.merge(
        *processes
    ):
        ok = result not in ("-1", "?")
        if call in ("getdents", "getdents64"):
            fd = fd_re.match(args)
            if fd and ok:
                folder = os.path.normpath(_unhex(fd.group(1)))
                found = reading.setdefault(number, {}).setdefault(folder, set())
                found.update(map(_unhex, dirent_re.findall(args)))
                if result == "0":  # (its end)
                    whole = reading[number].pop(folder)
                    trace.listings.setdefault(folder, []).append((True, whole))
            continue
        # Each path as the kernel took it: through the links the compile made (a hard
        # link stands for the file it links), its last part followed or not by the call.
        resolved = [
            links.resolve(p, f) if p else ("", "")
            for p, f in zip(placed, _finals(call, args), strict=False)
        ]
        paths = [path for path, _ in resolved]
        kinds = [kind for _, kind in resolved]
        trace.blind.update(p for p, kind in resolved if kind == "blind")
        found = ok or error not in _MISSING
        done: list[str] = []
        if call in _SYMLINKS:
            if ok and paths:
                done = paths[:1]
                links.add(Link(paths[0], when, target=target))
            elif paths:  # (failed: what it found at the new name decided that)
                trace.look(paths[0], when, found)
        elif call in _HARD_LINKS:
            if ok and paths:
                done = paths[-1:]
                _hard_link(trace, when, args, paths, kinds)
            for path in [p for p in paths if p] if not ok else ():
                trace.look(path, when, found)
        elif call in _CHANGES and ok:
            done = paths[: _CHANGES[call]]
            if paths and call != "creat":
                # Its success says what was there: nothing for mkdir and mknod,
                # something for the rest (a remove, a rename, a chmod).
                trace.look(paths[0], when, call not in _MAKES)
            if call in ("mkdir", "mkdirat"):
                trace.made.update(paths[:1])
            elif call in ("rename", "renameat", "renameat2"):
                trace.moved.update(paths[:1])
                if len(paths) == 2:
                    links.renamed(paths[0], paths[1], when, "RENAME_EXCHANGE" in args)
            elif call in _RETIMES:
                trace.retimed.update(paths[:1])
            elif call in _REMOVES:
                links.remove(paths[0], when)
        elif call in _CHANGES:
            if paths:  # (failed: what it found there decided that)
                trace.look(paths[0], when, found)
        elif call in _LOOKS and paths:
            if ok and call.startswith("open") and write_re.search(args):
                done = paths[:1]
                if "O_RDWR" in args and "O_TRUNC" not in args and "O_EXCL" not in args:
                    trace.looked.add(paths[0])  # (read too, if it was there)
                    trace.updated.add(paths[0])
                    if "O_APPEND" in args:
                        trace.appended.add(paths[0])
                    if "O_CREAT" not in args:  # (with it, it may have made it)
                        trace.look(paths[0], when, True)
            else:
                trace.look(paths[0], when, found)
                if ok and call.startswith("open"):
                    first = trace.first_read.get(paths[0], when)
                    trace.first_read[paths[0]] = min(first, when)
                    # (through a hard link, the descriptor is named by the link: its
                    # file is made sure of otherwise, _check_linked)
                    if opened and kinds[0] not in ("hard", "blind"):
                        real = os.path.normpath(_unhex(opened))
                        if "O_NOFOLLOW" in args:  # (the descriptor is a link's own)
                            real += "\0"
                        trace.opened.setdefault(paths[0], set()).add(real)
                    # A folder opened to read is listed, O_DIRECTORY or not
                    # (os.fwalk's opens): its names are taken when it is one.
                    if "O_PATH" not in args:
                        trace.listed.add(paths[0])
                if ok and call in ("execve", "execveat"):
                    # The kernel runs a script's #! interpreter with no call of its own.
                    for interpreter in _interpreters(paths[0]):
                        trace.look(interpreter, when, True)
                        trace.first_read.setdefault(interpreter, when)
        for path in done:
            trace.change(path, when)
    for under_way in reading.values():  # (stopped before the end: a part of it)
        for folder, found in under_way.items():
            trace.listings.setdefault(folder, []).append((False, found))
    return trace


def _placed(
    calls: list[tuple], number: int, path_re: re.Pattern, fd_re: re.Pattern, cwd_re: re.Pattern
):
    """A process's calls as ``(when (µs), number, index, call, args, result, opened,
    error, paths, target)``: each path placed in the folder the call was made in
    (``..`` and links as named), a symlink's target apart (its text, no path)."""
    # A process's folder: known from each AT_FDCWD<...>; chdir moves it.  Its calls
    # before the first note ran where it started (its parent's folder at the fork).
    here = _start_folder(calls, cwd_re)
    for index, (seconds, micros, call, args, result, opened, error) in enumerate(calls):
        when = int(seconds) * 1_000_000 + int(micros) if seconds else 0
        if call in ("getdents", "getdents64"):
            yield (when, number, index, call, args, result, opened, error, [], "")
            continue
        cwd_note = cwd_re.search(args)
        if cwd_note:
            here = _unhex(cwd_note.group(1))
        named = path_re.findall(args)
        target = ""
        if call in _SYMLINKS and named:
            target = _unhex(named.pop(0)[1])
        if call in _HARD_LINKS and named and not named[0][1]:
            named[0] = ("", "")  # (AT_EMPTY_PATH: a descriptor's file, kept as "")
        paths = [_place(here, folder, text) if text else "" for folder, text in named]
        paths = [p for p in paths if p or call in _HARD_LINKS]
        if call in ("chdir", "fchdir") and result not in ("-1", "?"):
            fd = fd_re.match(args)
            if call == "fchdir" and fd:
                here = _unhex(fd.group(1))
            elif paths:
                here = paths[0]
            continue
        yield (when, number, index, call, args, result, opened, error, paths, target)


def _finals(call: str, args: str) -> list[str]:
    """Whether each path of a call follows its last part if that is a link: ``follow``
    (``open``, ``stat``), ``nofollow`` (``lstat``: a symlink's own, a hard link's
    file), ``name`` (``unlink``, ``rename``, a new link's name: the name itself)."""
    if call in _HARD_LINKS:
        return ["follow" if "AT_SYMLINK_FOLLOW" in args else "nofollow", "name"]
    if call in _NAMES:
        return ["name", "name"]
    if call in _NOFOLLOW or "NOFOLLOW" in args or ("O_CREAT" in args and "O_EXCL" in args):
        return ["nofollow"]  # (AT_SYMLINK_NOFOLLOW, O_NOFOLLOW; strings are all \xNN)
    return ["follow"]


def _hard_link(trace: _Trace, when: int, args: str, paths: list[str], kinds: list[str]) -> None:
    """A hard link the compile made (``paths``: its source, its new name): the new name
    stands for the source, which the compile read by linking it (the link's bytes
    are the source's, whatever reads them later)."""
    from ._links import Link

    name, links = paths[-1], trace.links
    source = paths[0] if len(paths) == 2 and "AT_EMPTY_PATH" not in args else ""
    system = _folder(source).startswith(tuple(map(_folder, SYSTEM_FOLDERS)))
    if system and not _folder(source).startswith(tuple(map(_folder, USER_FOLDERS))):
        source = ""
    if not source or kinds[0] == "blind":
        # A descriptor's file (O_TMPFILE's, /proc/self/fd/N, /dev/stdin): no name to check.
        links.add(Link(name, when, unknown=f"a hard link to a descriptor's file ({name})"))
        return
    made = links.at(source)
    if made is not None and made.target is not None:  # (a link to a symlink: a copy of it)
        links.add(Link(name, when, target=made.target))
        return
    links.add(Link(name, when, source=source, follow="AT_SYMLINK_FOLLOW" in args))
    trace.look(source, when, True)
    trace.first_read[source] = min(trace.first_read.get(source, when), when)
    trace.linked[source] = min(trace.linked.get(source, when), when)


def real_folder(path: str) -> str:
    """``path`` with its folder's links resolved, its last part as it is (what an open
    with O_NOFOLLOW names)."""
    folder, name = os.path.split(path)
    return os.path.join(os.path.realpath(folder), name)


def _interpreters(path: str) -> list[str]:
    """The ``#!`` interpreters the kernel runs for the script ``path`` (one may be a
    script too: up to four, as Linux's own limit)."""
    found: list[str] = []
    for _ in range(4):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            break
        try:
            head = os.read(fd, 256) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        finally:
            os.close(fd)
        words = head[2:].split(b"\n", 1)[0].split() if head.startswith(b"#!") else []
        if not words:
            break
        path = os.fsdecode(words[0])
        if not os.path.isabs(path):  # (found from the folder of the process, not noted here)
            raise Unprovable(f"a script's #! interpreter is a relative path: {path}")
        found.append(os.path.normpath(path))
    return found


def _start_folder(calls: list[tuple], cwd_re: re.Pattern[str]) -> str | None:
    """A process's folder when it started: its first AT_FDCWD<...> note; None when it
    moved before any (or none is noted)."""
    for call in calls:
        cwd_note = cwd_re.search(call[3])
        if cwd_note:
            return _unhex(cwd_note.group(1))
        if call[2] in ("chdir", "fchdir") and call[4] not in ("-1", "?"):
            return None
    return None


def _place(here: str | None, folder: str, text: str) -> str:
    """A call's path: in its dirfd's ``folder`` when noted, else in the process's ``here``."""
    path = _unhex(text)
    if folder:
        return os.path.join(_unhex(folder), path)
    if here is None and not os.path.isabs(path):
        raise Unprovable(f"a relative path the trace cannot place: {path}")
    return os.path.join(here or "", path)


def _unhex(text: str) -> str:
    return os.fsdecode(bytes.fromhex(text.replace("\\x", "")))


class Memo:
    """The read sets seen for a compile command, newest first, in the cache's notes.

    Keyed by everything that decides which files the command looks for (the
    command's key inputs, its environment, its working folder): ``matching``
    gives the first set that is still as recorded, whose digest then joins the
    key.
    """

    def __init__(self, store: LocalStore | None) -> None:
        self.store = store  # None: nothing is remembered

    def recall(self, memo_key: str) -> list[ReadSet]:
        raw = self.store.read_note("reads", memo_key[:2], memo_key) if self.store else None
        try:
            # Not _json.loads: its depth walk and number checks cost a hit more than the
            # stats of the set.  from_json takes only lists of exactly the items' shape,
            # checked without recursion, and the numbers are only compared with stat's.
            variants = json.loads(raw) if raw else []
        except (ValueError, RecursionError):
            return []
        if not isinstance(variants, list):
            return []
        found = [ReadSet.from_json(v) for v in variants]
        return [v for v in found if v is not None]

    def matching(self, memo_key: str) -> ReadSet | None:
        """The newest remembered set that still holds, or None."""
        found = next((v for v in self.recall(memo_key) if v.unchanged()), None)
        if found is not None and found.moved:
            self.remember(memo_key, found)  # its new times: the next check reads nothing
        return found

    def remember(self, memo_key: str, reads: ReadSet) -> None:
        if self.store is None:
            return
        others = [v for v in self.recall(memo_key) if v.digest != reads.digest]
        variants = [reads, *others][:_VARIANTS]
        try:
            data = json.dumps([v.to_json() for v in variants]).encode()
            self.store.write_note(data, "reads", memo_key[:2], memo_key)
        except (OSError, ValueError) as e:
            log.debug("cannot remember what %s read: %s", memo_key, e)
