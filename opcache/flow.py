"""One key's steps: the parts ``OpCache.compile`` and ``compile_many`` are made of.

``OpCache.compile`` reads them top-down (bypass, key, chip, look, hit, the
remote, lock, fill); ``shared_work`` orders the same steps for a batch.  Each
step keeps the cache's promise on its own: a cache folder that cannot be
read or written is reported (``CacheErrors``) and the compile goes on.
"""

from __future__ import annotations

import _thread  # threading's primitives, without importing threading on wrap's start-up
import contextlib
import errno
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import fsutil, locks, stats
from ._log import get_logger
from .aging import STAMP_GRANULARITY
from .errors import CompileError
from .key import canonical_json, digest, key_inputs
from .request import CompileResult, is_plain_name
from .storage.entry import MANIFEST, NO_MODES, CorruptEntry, Entry, make_manifest
from .storage.local import Workdir, new_build_folder, remove_abandoned

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from typing import TypeVar

    from .chips import ChipFolders
    from .compilers.protocol import Compiler
    from .readset import ReadSet
    from .remote_tier import RemoteTier
    from .request import OpRequest, Status
    from .settings import Settings
    from .stats import StatsRecorder
    from .storage import Claim
    from .storage.local import LocalStore

    # Given why no build folder could be made in an out_dir: another to compile into, or None.
    NextOut = Callable[[OSError], Path | None]
    # A compile's artifacts: their bytes, and the permission bits of those a new file
    # would not have (Entry.modes).
    Made = tuple[dict[str, bytes], dict[str, int]]
    _T = TypeVar("_T")

log = get_logger(__name__)

UNUSABLE = "not stored: the cache is unusable"
# A hit's file, made with the mode open(path, "wb") gives.  O_NONBLOCK: a FIFO
# in its place must not hang the open; no O_TRUNC before it is known to be ours.
_OUT_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# What an open for writing over an out file meets that a rename replaces (_open_own).
_REPLACED = frozenset(
    {errno.ELOOP, errno.ENXIO, errno.EACCES, errno.EEXIST, errno.EAGAIN, errno.ETXTBSY}
)
_EUID = os.geteuid()
# Whether the last hit delivered had to make its out folder: the next one makes
# its folder first, rather than after a first open that fails for want of it
# (a system call, a sixth of delivering a batch's 4 KB hit into new folders).
# Only an order of system calls: each file is still opened as _open_own says.
_make_out_first = False
# Whether the last file a hit delivered was there already (hits into the out
# folder of earlier ones): the next is opened as one that is there, checked,
# and written over, without an open that fails to make it first.
_files_there = False
# Compiles run in <out_dir>/.opcache-build.<host>.<pid>.<random>/.opcache-work.<random>,
# the outer folder locked while they run (the inner one marks it as opcache's).
_BUILD_LABEL = ".opcache-build"
# An out_dir is looked through for the build folders of dead compiles at most this
# often per process: a listing per miss made each miss into a folder of N files
# cost O(N) (CANN's kernel_meta holds a whole model's kernels: 10,000 files made
# a miss 4.5 ms of CPU, not 0.9).  A dead compile's folder waits a minute more.
_SWEEP_EVERY = 60.0
_SWEPT_MOST = 4096  # out_dirs remembered (then forgotten all at once: a sweep each again)
_swept: dict[str, float] = {}  # out_dir as given -> when this process last looked through it
_sweep_clock = time.monotonic
# Tries to make a build folder, or a hit's file, in an out_dir that vanishes
# meanwhile: each compile failing into it removes the out folder it made, which
# another just found there.
_OUT_TRIES = 8
# The pathlib of 3.10 and 3.11 parses a name joined to a path again, in Python (a
# tenth of delivering a 4 KB hit); its own maker of the children it lists takes
# a plain name as it is.  (3.12 on join without parsing.)
_PARSING_PATHLIB = sys.version_info < (3, 12)


class CacheErrors:
    """Failures of the cache folder, for one OpCache: counted in stats, warned once.

    One compile that meets a broken cache at every step (read, lock, store)
    is one error in stats, not three (``one_per_compile``).
    """

    def __init__(self, recorder: StatsRecorder, root: Path) -> None:
        self._stats = recorder
        self._root = root
        self._mutex = _thread.allocate_lock()
        self._warned: set[str] = set()
        # Threads inside a compile, and whether the cache folder failed them yet.
        self._compiling: dict[int, bool] = {}

    def one_per_compile(self, soc: str) -> _OnePerCompile:
        """Around one compile: however often the cache folder fails it, one error."""
        return _OnePerCompile(self, soc)

    def report(self, kind: str, message: str, soc: str) -> None:
        """Count a failure of the cache folder (``kind``: lock, read, write...).

        The warning is logged once per OpCache whatever the kind: an unwritable
        cache fails the lock, the store and the stats at once, and the user
        needs to hear about it once.  Later ones go to the debug log.
        """
        me = _thread.get_ident()
        if me in self._compiling:
            self._compiling[me] = True
        else:
            self._stats.add(soc, "errors")
        self.warn_once("cache", f"{message} (the compile goes on without the cache)")

    def warn_once(self, kind: str, message: str) -> None:
        with self._mutex:
            if kind in self._warned:
                log.debug("%s", message)
                return
            self._warned.add(kind)
        # The topic, not the message (which names a key): opcache wrap shows it once an hour.
        log.warning("%s", message, topic=f"{kind} {self._root}")


class _OnePerCompile:
    """``CacheErrors.one_per_compile``: a class, not a generator context manager
    (1.2 -> 0.4 us, around every look of a batch)."""

    __slots__ = ("_errors", "_me", "_outer", "_soc")

    def __init__(self, errors: CacheErrors, soc: str) -> None:
        self._errors = errors
        self._soc = soc

    def __enter__(self) -> None:
        me = self._me = _thread.get_ident()
        compiling = self._errors._compiling
        self._outer = compiling.get(me)  # a compiler that compiles through the cache itself
        compiling[me] = False

    def __exit__(self, *exc: object) -> None:
        compiling = self._errors._compiling
        if compiling.pop(self._me):
            self._errors._stats.add(self._soc, "errors")
        if self._outer is not None:
            compiling[self._me] = self._outer


class Filled:
    """What ``KeyFlow.fill`` came to: an entry (and its tier), or a compile's files."""

    __slots__ = ("artifacts", "entry", "files", "modes", "note", "tier")

    def __init__(
        self,
        entry: Entry | None,
        tier: str,
        files: dict[str, Path] | None = None,
        note: str | None = None,
        made: Made | None = None,
    ) -> None:
        self.entry = entry
        self.tier = tier
        self.files = files or {}
        self.note = note  # why the compile was not stored, if it was not
        self.artifacts, self.modes = made or ({}, NO_MODES)


class KeyFlow:
    """The steps of one key, over one cache folder (and its remote, if set).

    Thread-safe.  ``lock_timeout`` bounds how long a step waits for another
    process (or machine) compiling the same key before compiling it too.
    """

    def __init__(
        self,
        settings: Settings,
        store: LocalStore,
        recorder: StatsRecorder,
        folders: ChipFolders,
        errors: CacheErrors,
        *,
        lock_timeout: float,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.lock_timeout = lock_timeout
        self._store = store
        self._stats = recorder
        self._folders = folders
        self._errors = errors
        self._clock = clock
        self._fingerprints: dict[int, tuple[Compiler, str]] = {}
        self.remote: RemoteTier | None = None
        if settings.remote is not None and settings.mode != "disable":
            from .remote_tier import RemoteTier  # only with a remote: not on wrap's start-up

            self.remote = RemoteTier(
                settings.remote,
                store,
                recorder,
                keep=self._keep_fetched,
                clock=clock,
                lock_timeout=lock_timeout,
            )

    # -- before the cache folder is read -----------------------------------------------

    def bypass(self, request: OpRequest) -> tuple[Status, str | None] | None:
        """(status, reason) when the mode or a debug option keeps the cache out; else None."""
        if self.settings.mode == "disable":
            return "disabled", None
        reason = self.settings.bypass_reason(request.op_name, request.op_type)
        if reason is not None:
            return "bypass", reason
        return None

    def fingerprint(self, compiler: Compiler) -> str:
        """``compiler.fingerprint()``: asked at every compile of a built-in back-end, which
        remembers its own while its tools are the same files (``toolchain.tool_changed``,
        a stat each: a tool upgraded in place under a long-lived compiler object gives
        new keys); once per object of any other (a plug-in's may run its tool)."""
        if getattr(compiler, "checks_its_tools", False):
            return compiler.fingerprint()
        known = self._fingerprints.get(id(compiler))
        if known is None or known[0] is not compiler:
            known = (compiler, compiler.fingerprint())
            self._fingerprints[id(compiler)] = known
        return known[1]

    def chip_ready(self, soc: str) -> bool:
        """The chip folder's first touch (``ChipFolders.ready``); False: do not use it."""
        return self._folders.ready(soc)

    def one_error(self, soc: str) -> contextlib.AbstractContextManager[None]:
        """Around one compile: however often the cache folder fails it, one error."""
        return self._errors.one_per_compile(soc)

    def cache_error(self, kind: str, message: str, soc: str) -> None:
        """Report a failure of the cache folder (``CacheErrors.report``)."""
        self._errors.report(kind, message, soc)

    def count(self, soc: str, name: str, value: float = 1) -> None:
        """Add to one of the chip's stats counters."""
        self._stats.add(soc, name, value)

    # -- the local tier ----------------------------------------------------------------

    def look(
        self, soc: str, key: str, reader: Callable[[str], Entry | None] | None = None
    ) -> Entry | None:
        """The cache folder's entry of ``key``, or None: absent, unreadable, or corrupt
        (then removed and counted).  ``reader``: a ``reading`` of the chip, for a
        batch that looks at many keys in a row."""
        try:
            entry = self._store.get(soc, key) if reader is None else reader(key)
            if entry is None or entry.reads is None or self._reads_hold(soc, entry):
                return entry
        except CorruptEntry as e:
            log.warning("corrupt cache entry %s/%s removed: %s", soc, key, e)
            self._stats.add(soc, "corrupt")
            self._discard(soc, key, "a corrupt entry")
        except OSError as e:
            self.cache_error("read", f"cannot read the cache at {self._store.root}: {e}", soc)
        return None

    def _reads_hold(self, soc: str, entry: Entry) -> bool:
        """Whether the files the entry's compile read beyond its key are as they were;
        an entry of files changed since is removed (its key's compile then stores the
        new one), and counted.  CorruptEntry when the read set is no read set."""
        from .readset import CHANGED, reads_now  # (only for entries that have one)

        now = reads_now(entry.reads)
        if now is None:
            raise CorruptEntry("the manifest gives a bad read set")
        if now == CHANGED:
            log.info("cache entry %s/%s not used: a file its compile read changed", soc, entry.key)
            self._stats.add(soc, stats.STALE_READS)
            self._discard(soc, entry.key, "an entry of files changed since")
            return False
        return True

    def _discard(self, soc: str, key: str, what: str) -> None:
        try:
            self._store.discard(soc, key)
        except OSError as err:
            self.cache_error("write", f"cannot remove {what}: {err}", soc)

    def reading(self, soc: str) -> contextlib.AbstractContextManager[Callable[[str], Entry | None]]:
        """A reader of many keys of the chip folder in a row, for ``look``
        (``LocalStore.reading``: each folder opened and trusted once)."""
        return self._store.reading(soc)

    def hit(self, entry: Entry, soc: str, out: Path, started: float, tier: str) -> CompileResult:
        """Deliver ``entry`` into ``out``; the hit is counted and its access stamped."""
        result = self.served(entry, soc, out, started, tier)
        self.count_hits(soc, 1, entry.compile_seconds)
        return result

    def count_hits(self, soc: str, hits: int, saved: float) -> None:
        """Count ``hits`` hits of a chip and the compile seconds they ``saved``."""
        self._stats.add_counts(soc, {"hits": hits, "time_saved_seconds": saved})

    def served(self, entry: Entry, soc: str, out: Path, started: float, tier: str) -> CompileResult:
        """``hit`` but for its count, for a batch that counts its hits at once
        (``count_hits``)."""
        files = deliver(out, entry.files, entry.modes)
        # (CANN: with aging off, a hit writes nothing.  A remote hit's local copy is
        # stamped when it is made: the remote's entry has no stamp of its own.)
        if tier != "remote" and self.settings.aging_enabled:
            now = self._clock()
            if now - entry.stamp >= STAMP_GRANULARITY:
                try:
                    self._store.touch(soc, entry.key, now)
                except OSError as e:
                    self.cache_error("stamp", f"cannot record an access: {e}", soc)
        seconds = time.perf_counter() - started
        saved = entry.compile_seconds
        return CompileResult("hit", entry.key, files, seconds, saved_seconds=saved, tier=tier)

    def key_lock(self, soc: str, key: str) -> locks.KeyLock:
        """The key's single-flight lock, not taken.  Each try opens (and makes) its
        folder one level at a time and trusts it: an OSError then, not here."""
        store = self._store
        path = store.locks_dir / soc / key
        return locks.KeyLock(path, store.modes, open_dir=lambda: store.open_folder("locks", soc))

    def acquire(self, soc: str, key: str) -> locks.KeyLock | None:
        """The key's single-flight lock, held; None to compile without it."""
        try:
            lock = self.key_lock(soc, key)
            if lock.acquire(self.lock_timeout):
                return lock
            log.warning(
                "waited %.3g s for another process compiling %s/%s; compiling it here too",
                self.lock_timeout,
                soc,
                key,
            )
        except OSError as e:
            self.cache_error("lock", f"cannot lock {soc}/{key}: {e}", soc)
        return None

    def keep(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int | None:
        """Store an entry in the cache folder: the bytes it added, or None when another
        writer stored the key first.  A folder that cannot take it is reported (a
        warning, counted) and the OSError raised: the caller goes on without it."""
        try:
            return self._store.put(soc, key, manifest, files, now=self._clock())
        except OSError as e:
            self.cache_error("write", f"cannot store in the cache at {self._store.root}: {e}", soc)
            raise

    def _keep_fetched(self, soc: str, entries: list[tuple[str, bytes, dict[str, bytes]]]) -> None:
        """A remote's entries (key, manifest, files), kept in the cache folder too
        (``RemoteTier``'s backfill): several in one batch."""
        try:
            if len(entries) == 1:
                sizes = [self.keep(soc, *entries[0])]
            else:
                sizes = self._store.put_many(soc, entries, now=self._clock())
        except OSError as e:
            if len(entries) > 1:  # (keep reported its own)
                self.cache_error(
                    "write", f"cannot store in the cache at {self._store.root}: {e}", soc
                )
            return  # (the entries are served all the same)
        stored = sum(size for size in sizes if size is not None)
        if stored:
            self._folders.after_store(soc, stored)

    # -- a miss ------------------------------------------------------------------------

    def fill(
        self,
        lock: locks.KeyLock | None,
        request: OpRequest,
        compiler: Compiler,
        key: str,
        inputs: dict,
        out: Path,
        claim: Claim | None = None,
        next_out: NextOut | None = None,
    ) -> Filled:
        """With the key's lock held (or none to be had): the entry, if another process
        stored it meanwhile, else this process's compile.  Releases the lock.

        With a remote, the compile is claimed in the whole cluster first (or
        ``claim`` was taken already): while another client of the remote
        compiles the key, this waits for its entry, up to ``lock_timeout``.

        ``next_out``: where no build folder can be made in ``out`` (the compiler
        not run yet), given the error, another out_dir to compile into instead
        (a batch's next request of the key), or None to raise the error.
        """
        soc = request.soc_version
        stored = None
        try:
            # Another process may have stored it since our first look,
            # whether we waited for its lock or it was done before we came.
            entry = self.look(soc, key) if lock else None
            if entry is not None:
                return Filled(entry, "local")
            if claim is None and self.remote is not None:
                entry, claim = self.remote.claim_or_wait(soc, key)
                if entry is not None:
                    return Filled(entry, "remote")
            failed_before = claim is not None and claim.failed_before
            if lock and ((lock.waited and not lock.inherited) or failed_before):
                # Its compile failed (or could not be stored), here or on another
                # machine: compile here, but let the other waiters do the same at
                # once instead of one after another.  (Its holder died instead:
                # one compile, the lock kept.)
                lock.release()
            files, note, stored, made = self._compile_and_keep(
                request, compiler, key, inputs, out, claim, next_out
            )
        finally:
            if claim is not None:
                claim.release()
            if lock:
                lock.release()
        if stored is not None:
            self._folders.after_store(soc, stored)  # not under the key's lock
        return Filled(None, "", files, note, made)

    def missed(self, filled: Filled, soc: str, key: str, started: float) -> CompileResult:
        """The result of a fill that compiled (``filled.entry`` None), counted as a miss."""
        self._stats.add(soc, "misses")
        seconds = time.perf_counter() - started
        return CompileResult("miss", key, filled.files, seconds, filled.note)

    def plain(
        self,
        request: OpRequest,
        compiler: Compiler,
        out: Path,
        started: float,
        status: Status,
        reason: str | None,
        key: str = "",
    ) -> CompileResult:
        """A compile that keeps the cache out: a mode, a debug option, an unusable cache."""
        files = _compile_into(request, compiler, out)[0]  # (whatever it read: nothing kept)
        if status == "bypass":
            self._stats.add(request.soc_version, stats.BYPASS_PREFIX + str(reason))
            op = request.op_type  # (a wrapped C compile has no op_name)
            name = f"{request.op_name} ({op})" if request.op_name else op
            log.debug("bypassing the cache for %s: %s", name, reason)
        elif status == "miss":
            self._stats.add(request.soc_version, "misses")
        return CompileResult(status, key, files, time.perf_counter() - started, reason)

    def _compile_and_keep(
        self,
        request: OpRequest,
        compiler: Compiler,
        key: str,
        inputs: dict,
        out: Path,
        claim: Claim | None,
        next_out: NextOut | None,
    ) -> tuple[dict[str, Path], str | None, int | None, Made]:
        """(files in ``out``, or the one ``next_out`` gave, why not stored, bytes
        stored, the files' bytes and modes); the remote's ``claim`` let go as
        stored once the remote has the entry.

        The compiler works beside ``out_dir``, never in the cache: a full or
        broken cache disk can fail the store, not the compile.
        """
        soc = request.soc_version
        try:
            compile_started = time.perf_counter()
            files, made, said = _compile_into(request, compiler, out, next_out)
        except CompileError:
            self._stats.add(soc, "compile_errors")
            raise
        unknown = said if isinstance(said, str) else None
        if unknown is None and self._key_now(request, compiler) != key:
            # A tool upgraded in place since the key was taken: its output is not the
            # key's, and another process still on the old tool would be served it.
            unknown = "the compiler changed while it compiled"
        if unknown is not None:
            # The compiler read what the key does not hold: served, never stored.
            self._stats.add(soc, stats.UNCACHEABLE_PREFIX + unknown)
            log.info("not stored: %s", unknown)
            return files, f"not stored: {unknown}", None, made
        seconds = time.perf_counter() - compile_started
        # A compiler whose compile ran before its key was known (wrap's traced opc) says how long.
        seconds = getattr(compiler, "compile_seconds", None) or seconds
        artifacts, modes = made
        if MANIFEST in artifacts:
            self._errors.warn_once(
                "manifest-name", f"an artifact named {MANIFEST} cannot be cached"
            )
            return files, f"not stored: an artifact is named {MANIFEST}", None, made
        self._explain_miss(request, key, inputs, getattr(compiler, "explain_names", None))
        reads = None if said is None else said.to_json()  # type: ignore[union-attr]
        manifest = make_manifest(key, artifacts, seconds, inputs, self._clock(), modes, reads)
        if self.remote is not None:
            self.remote.store(soc, key, manifest, artifacts, claim)
        try:
            size = self.keep(soc, key, manifest, artifacts)
        except OSError:
            return files, "not stored: the cache is not writable", None, made
        if size is not None:
            self._stats.add(soc, "stores")
        return files, None, size, made

    def _key_now(self, request: OpRequest, compiler: Compiler) -> str:
        """The key of ``request`` with the compiler's fingerprint as it is now."""
        return digest(
            canonical_json(key_inputs(request, compiler.name, self.fingerprint(compiler)))
        )

    def _explain_miss(self, request: OpRequest, key: str, inputs: dict, names: dict | None) -> None:
        """Note the key's parts (and the compiler's ``explain_names``) for ``opcache
        explain``, and count the miss as a new key of an operator seen before or as
        one never seen."""
        from . import explain  # on a miss only: not on a hit's start-up

        seen = explain.record(self._store, request, key, inputs, now=self._clock(), names=names)
        if seen is not None:
            self._stats.add(
                request.soc_version, stats.MISSES_NEW_KEY if seen else stats.MISSES_NEVER_SEEN
            )


def out_path(out: str | os.PathLike[str]) -> Path:
    """An out_dir as a Path; one given as a Path is kept (immutable): Path(path) parses
    it again, 2 us a hit."""
    return out if isinstance(out, Path) else Path(out)


def deliver(
    out: Path, files: dict[str, bytes], modes: dict[str, int] = NO_MODES
) -> dict[str, Path]:
    """Write a hit's ``files`` into ``out``, those in ``modes`` with their permission
    bits (narrowed by the umask, as the compile's would be).

    A name that is free, or holds a file of this user's with no other name, is
    written in place.  Anything else there (a link or a file with other links
    someone put in a folder others write to, another user's file, a FIFO) is
    replaced as a miss replaces it, never written through (``_replace_into``).
    """
    paths = {}
    others = {}
    folder = str(out)  # (text: a Path made per file was a tenth of a hit)
    global _make_out_first
    if _make_out_first:  # (the last hit's folder was new: a batch's, likely this one's too)
        try:
            os.mkdir(folder)
        except OSError:  # there already (or its parents are not): the usual way
            _make_out_first = False
    for name, data in files.items():
        opened = _open_own(out, f"{folder}/{name}")
        if opened is None:
            others[name] = data
            continue
        fd, held = opened
        try:
            fsutil.write_all(fd, data)
            if held > len(data):  # (the rest of the bytes it held)
                os.ftruncate(fd, len(data))
            if modes:
                _set_mode(fd, modes.get(name))
        except BaseException:
            _drop_partial(fd, f"{folder}/{name}")
            raise
        finally:
            os.close(fd)
        paths[name] = out._make_child_relpath(name) if _PARSING_PATHLIB else out / name
    if others:
        paths.update(_replace_into(out, others, modes))
    return paths


def _set_mode(fd: int, mode: int | None) -> None:
    """Give a hit's file (open as ``fd``) the bits its compile gave it, narrowed by the
    umask as the compile's would be; with none kept, it keeps its own (a new file's,
    or those of a file of this user's it was written over, as a compiler writing
    over a file keeps them: never widened)."""
    if mode is not None:
        os.fchmod(fd, mode & ~fsutil.UMASK)


def _drop_partial(fd: int, path: str) -> None:
    """A file a failed hit half wrote (a full disk, a quota, Ctrl-C), open as ``fd``:
    emptied, and its name removed while it is still this file, as gcc removes an
    output it failed to write: no build may take new bytes on an old file's
    tail, at a new mtime, for an output."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        st, named = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(path)


def _open_own(out: Path, path: str) -> tuple[int, int] | None:
    """(``path``, a file of ``out``, open for writing, the bytes it held) if it was
    free or is this user's own file with no other name, else None."""
    global _make_out_first, _files_there
    # os.open, not open(): no isatty, lseek and fstat for each file of every hit.
    try:
        try:
            if _files_there:  # (the last hit's files were there: likely this one's too)
                fd = os.open(path, _OUT_FLAGS, 0o666)
            else:
                # A file made now is ours, plain and empty: nothing to check.
                return os.open(path, _NEW_FLAGS, 0o666), 0
        except FileNotFoundError:  # (asked only then: a stat per hit on a slow disk)
            fd = _made_again_if_it_vanishes(lambda: _new_file_in(out, path))
            _make_out_first, _files_there = True, False
            return fd, 0
        except FileExistsError:
            fd = os.open(path, _OUT_FLAGS, 0o666)
            _files_there = True
    except OSError as e:
        # A link; a FIFO nobody reads; a file we may not write, one another holds a
        # lease on (EAGAIN) or a program running (ETXTBSY): a rename still replaces it.
        if e.errno in _REPLACED:
            return None
        raise
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == _EUID:
        if not st.st_size:
            _files_there = False  # (made now, most likely: new files again)
        return fd, st.st_size
    os.close(fd)
    return None


def _new_file_in(out: Path, path: str) -> int:
    """``path``, a file of ``out`` (made where it is missing), made now, open for writing."""
    out.mkdir(parents=True, exist_ok=True)
    return os.open(path, _NEW_FLAGS, 0o666)


def _replace_into(out: Path, files: dict[str, bytes], modes: dict[str, int]) -> dict[str, Path]:
    """Put ``files`` into ``out`` as a miss puts its compile's: written in a build
    folder of its own, then moved in (``_move_out``)."""
    build, _ = _build_folder_in(out)
    try:
        for name, data in files.items():
            with open(os.open(name, _NEW_FLAGS, 0o666, dir_fd=build.fd), "wb") as f:
                f.write(data)
                if modes:
                    _set_mode(f.fileno(), modes.get(name))
        return {name: _move_out(build, name, out) for name in files}
    finally:
        build.close()


def _move_out(build: Workdir, name: str, out: Path) -> Path:
    """Move the file ``name`` of ``build`` into ``out``, the folder it was made in.

    A rename: whatever had that name in ``out`` (a link someone put there in a
    folder others write to, a file with other names) is replaced, never
    written through.
    """
    os.replace(name, name, src_dir_fd=build.fd, dst_dir_fd=build.parent_fd)
    return out / name


def _compile_into(
    request: OpRequest, compiler: Compiler, out: Path, next_out: NextOut | None = None
) -> tuple[dict[str, Path], Made, str | ReadSet | None]:
    """Compile in a private folder beside ``out`` and move the artifacts into ``out``.

    Returns (artifact paths in ``out``, their bytes and modes, what
    ``compiler.compile`` said: why they must not be stored, or what it read
    beyond the key, or None).  The artifacts are
    the plain files the compiler wrote; folders and links it left are dropped.
    Build folders that killed compiles left in ``out`` go first; a failed
    compile leaves no ``out`` it created.  Where no build folder can be made
    in ``out``, ``next_out`` (``KeyFlow.fill``) may give another out_dir.
    """
    while True:
        try:
            build, made = _build_folder_in(out)
            break
        except OSError as e:
            other = None if next_out is None else next_out(e)
            if other is None:
                raise
            out = other
    try:
        said = compiler.compile(request, build.path)
        if not isinstance(said, str) and not _is_read_set(said):
            said = None  # (a plug-in's stray return: nothing said)
        files, artifacts, modes = {}, {}, NO_MODES
        # The umask now (a program may set its own after importing opcache; a server's
        # worker sets its caller's): the bits a new file gets, and a hit's narrowed by.
        fsutil.UMASK = fsutil.umask_now()
        new_file = 0o666 & ~fsutil.UMASK
        for entry in os.scandir(build.path):
            if entry.is_file(follow_symlinks=False) and is_plain_name(entry.name):
                artifacts[entry.name], mode = _read_artifact(build.fd, entry.name)
                if mode != new_file:  # (what a hit gives unless told: an executable is not)
                    if modes is NO_MODES:
                        modes = {}
                    modes[entry.name] = mode
                files[entry.name] = _move_out(build, entry.name, out)
            else:
                log.debug("ignoring %s: not a plain file", entry.path)
    except BaseException:
        build.close()
        for folder in made:  # deepest first; one not empty holds something else now
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    build.close()
    return files, (artifacts, modes), said


def _is_read_set(value: object) -> bool:
    """Whether a compiler returned what its compile read beyond the key (``ReadSet``)."""
    if value is None or isinstance(value, str):
        return False
    from .readset import ReadSet  # (a miss only: not on a hit's start-up)

    return isinstance(value, ReadSet)


def _build_folder_in(out: Path) -> tuple[Workdir, list[Path]]:
    """A new build folder in ``out``, and the folders made for it (``out`` and its
    parents that were missing, deepest first)."""
    made: list[Path] = []

    def make() -> Workdir:
        missing = _missing_folders(out)
        if missing:
            out.mkdir(parents=True, exist_ok=True)
            if len(missing) > len(made):
                made[:] = missing
        else:
            _sweep(out)
        # Marked: only a folder holding the mark is taken for a dead compile's there.
        return new_build_folder(out, _BUILD_LABEL, 0o700, marked=True)

    return _made_again_if_it_vanishes(make), made


def _sweep(out: Path) -> None:
    """Remove the build folders dead compiles left in ``out``, unless this process
    looked through it less than ``_SWEEP_EVERY`` seconds ago."""
    now = _sweep_clock()
    name = str(out)
    last = _swept.get(name)
    if last is not None and now - last < _SWEEP_EVERY:
        return
    if len(_swept) >= _SWEPT_MOST:
        _swept.clear()
    _swept[name] = now
    remove_abandoned(out, time.time(), _BUILD_LABEL)


def _made_again_if_it_vanishes(make: Callable[[], _T]) -> _T:
    """``make()``, which makes an out folder where it is missing and then something
    in it; tried again, a bounded number of times, where the folder vanished
    meanwhile (FileNotFoundError)."""
    tries = _OUT_TRIES
    while True:
        try:
            return make()
        except FileNotFoundError:
            # A failed compile into the same out_dir removed the folder it had
            # made, the moment this one found it there (or made it too).
            tries -= 1
            if not tries:
                raise


def _read_artifact(build_fd: int, name: str) -> tuple[bytes, int]:
    """What the compiler wrote to ``name`` in its build folder (open as ``build_fd``),
    and its permission bits; through the handle, not a file object (its fstat,
    ioctl and lseeks, per file)."""
    fd, st = fsutil.open_regular(name, dir_fd=build_fd)
    try:
        chunks = []
        # Its size and a byte more, then on to the end (a read may stop short of it).
        while chunk := os.read(fd, st.st_size + 1 if not chunks else 1 << 20):
            chunks.append(chunk)
        # (not set-user-ID and the like: no hit makes a file that runs as another)
        return b"".join(chunks), st.st_mode & 0o777
    finally:
        os.close(fd)


def _missing_folders(out: Path) -> list[Path]:
    """``out`` and its parents that do not exist yet, deepest first."""
    missing = []
    folder = Path(os.path.abspath(out))
    while not folder.is_dir() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing
