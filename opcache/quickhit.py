"""The quick hit: a C compile's hit served from a memo checked by stat identity.

A wrap hit in a new Python costs its imports (pathlib, re, json, opcache's
modules) and its checks (settings, the compiler's identity, the header list
and every header's digest, the entry).  When a full hit of a C compile is
done (``wrap.run``), every file it consulted, or looked for and did not find,
was noted as it ran (``quickmemo.Recorder``: the ``os`` and ``open`` calls it
made), and
the memo keeps each one's stat identity: device, inode, mode, owner, and for a
file (or a folder that was listed) its size, mtime and ctime; for a path that
was missing, the error.  The next run of the same command (``serve``: its
argv, working folder, umask, user and environment give the memo's name)
checks each with one ``stat`` or ``lstat``, reads the entry's artifacts
(checked against the entry's manifest digests), puts the outputs in place as
the full hit would (each a new file in its folder, the folder the full hit
wrote into, renamed over the target), then counts the hit, stamps the entry's
access and replays stdout and stderr: all before importing more than ``os``,
``stat``, ``sys`` and ``xxhash``.  A memo that does not hold (no memo, one
identity moved, an error) gives None and the full path runs as always.  An
output that cannot be put in place (its folder gone or not writable, a
read-only file system, a full disk) runs the command as it is, with the full
path's warning, and counts nothing: the compiler writes its outputs itself,
so none is left from the cache beside one the compiler did not write.  Once
counted, an error replaying ends the run as the full path's would (never a
second count).

Safe as git's index is (its "racy" rule): a file changed after it was
recorded has another ctime (the kernel sets it on every write; ``utime``
cannot set it back).  A file changed within the same clock tick as it was
recorded could keep its times, so no memo is written while any recorded
file's mtime or ctime is within ``quickmemo.RACY_SECONDS`` of the full run's
start.
Memos are not written for a run that keyed the clock, warned, was verbose,
or in ``force``/``disable`` mode.  They live in this user's runtime folder
(``$XDG_RUNTIME_DIR/opcache-<uid>/quick``, 0700, the server's), each naming
the cache folder it serves from; ``opcache clear`` removes the entries they
point at, so every memo misses after it.
"""

from __future__ import annotations

import os
import stat
import sys

TYPE_CHECKING = False  # typing's, without importing typing on `opcache wrap`'s start-up
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

# Bumped with the memo's layout, and whenever the full path finds more a compile
# reads or refuses more compiles: a memo holds only what the rules that made it
# read, so each made before goes unused (7: asm directives in any form, include
# directives in any form, empty COMPILER_PATH and LIBRARY_PATH).
FORMAT = b"opcache-quick 8"
CLIENT_FORMAT = b"opcache-client 8"  # a memo the C client reads (opcache_client.c's)
FOLDER = "quick"
MAX_MEMO = 1 << 20
# Variables no compiler and no part of opcache reads, that change from one build
# (or one make level) to the next: left out of a memo's name.  (test_quickhit
# checks that settings.py, keyed_env.py and the compilers read none of them.)
UNKEYED_ENVIRONMENT = (
    b"MAKEFLAGS",
    b"MFLAGS",
    b"MAKE_TERMOUT",
    b"MAKE_TERMERR",
    b"_",
    b"OLDPWD",
    b"SHLVL",
)
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# An output's folder, reached as the compiler reaches it (links followed), to make and
# rename files in: O_PATH, so a folder this user may write in but not list serves too.
PLACE_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
NO_SIZE = -1  # a folder not listed: its entries changing does not matter


def runtime_folder(environ: Mapping[str, str]) -> str:
    """This user's runtime folder of opcache (server sockets, memos): never another's."""
    base = environ.get("XDG_RUNTIME_DIR", "")
    return os.path.join(base if base.startswith("/") else "/tmp", f"opcache-{os.getuid()}")


def open_own_folder(folder: str, make: bool) -> int:
    """``folder`` (made 0700 if missing and ``make``), opened without following a link.

    OSError (trust.UntrustedFolder-like, a sentence) unless it is this user's
    and no one else can enter it: a folder another user made first is not used.
    """
    if make:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            make = False  # (there already: checked below as any other)
    fd = os.open(folder, FOLDER_FLAGS)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        mode = stat.S_IMODE(st.st_mode)
        raise PermissionError(f"{folder} is not yours alone (owner uid {st.st_uid}, mode {mode:o})")
    return fd


def memo_name(words: list[str], environb: Mapping[bytes, bytes], cwd: bytes, umask: int) -> str:
    """The memo of a command: its words, folder, umask, user and environment (all but
    ``UNKEYED_ENVIRONMENT``), the machine's name and the Python it runs in."""
    import xxhash

    head = [FORMAT, os.fsencode(sys.executable), sys.version.encode()]
    return "m" + xxhash.xxh3_128_hexdigest(_named(head, words, environb, cwd, umask))


def client_memo_name(
    tag: str, words: list[str], environb: Mapping[bytes, bytes], cwd: bytes, umask: int
) -> str:
    """The memo the C client reads (``opcache_client.c``, ``memo_name``, computes the same):
    the client's tag (its install and protocol) and mount namespace in place of the Python."""
    import xxhash

    head = [CLIENT_FORMAT, tag.encode(), os.readlink("/proc/self/ns/mnt").encode()]
    named = _named(head, words, environb, cwd, umask)
    return "c" + xxhash.xxh64_hexdigest(named) + xxhash.xxh64_hexdigest(named, seed=1)


def _named(
    head: list[bytes],
    words: list[str],
    environb: Mapping[bytes, bytes],
    cwd: bytes,
    umask: int,
) -> bytes:
    """What a memo's name is the digest of: ``head``, then the command and its process."""
    env = sorted(
        name + b"=" + value for name, value in environb.items() if name not in UNKEYED_ENVIRONMENT
    )
    fields = [
        *head,
        cwd,
        b"%o %d %d" % (umask, os.getuid(), os.getgid()),
        # (what may run or be read goes by them too: which() and a shared cache's trust)
        b" ".join(b"%d" % group for group in sorted(os.getgroups())),
        os.fsencode(os.uname().nodename),  # (the cache folder's name may hold it; its bytes)
        capabilities(),  # (root without CAP_DAC_OVERRIDE may not read what root may)
        b"%d" % len(words),
        *(os.fsencode(word) for word in words),
        *env,
    ]
    return b"\0".join(fields)


def proc_status(process: str) -> bytes:
    """A process's /proc status file (``process``: its /proc folder), whole: one read,
    mostly (a file object's split cost three times as much)."""
    fd = os.open(f"{process}/status", os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, 1 << 16)]
        while chunks[-1]:  # (the Groups line of a user of thousands of groups is long)
            chunks.append(os.read(fd, 1 << 16))
    finally:
        os.close(fd)
    return b"".join(chunks)


def capabilities(process: str = "/proc/self") -> bytes:
    """A process's effective capabilities as its /proc status file writes them
    (``opcache_client.c``'s ``capabilities`` reads them alike); OSError when they
    cannot be read."""
    status = proc_status(process)
    start = status.find(b"\nCapEff:") + len(b"\nCapEff:")
    if start < len(b"\nCapEff:"):
        raise OSError(f"{process}/status says no CapEff")
    end = status.find(b"\n", start)
    return status[start : end if end >= 0 else len(status)].strip()


def count_line(saved: float) -> bytes:
    """The line a quick hit appends to its chip's counts (``counters.QUICK_COUNTS``)."""
    return b"hits=1 time_saved_seconds=%r\n" % saved


def opcache_files() -> list[str]:
    """The files of opcache's modules loaded here: a memo checks them (an upgrade, or an
    edit, makes every memo miss), a server too (it ends when they change)."""
    return sorted(
        module.__file__
        for name, module in list(sys.modules.items())
        if name.split(".")[0] == "opcache" and getattr(module, "__file__", None)
    )


# -- the quick path ------------------------------------------------------------------


class Miss(Exception):
    """The memo does not hold, or cannot be used: the full path runs."""


class Undelivered(Exception):
    """An output cannot be put in place (``error``, naming it): nothing is counted, none
    of the outputs is left from the cache, and the command runs as it is."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


def serve(words: list[str]) -> int | None:
    """Serve ``words`` (the command line, ``sys.argv``'s form) from its memo: the exit
    status, or None when there is no memo or it does not hold (the full path runs:
    nothing was done that it does not do again, outputs it puts in place itself
    included).  An output that cannot be put in place: the command's own status."""
    try:
        return _serve(words)
    except Undelivered as e:
        return _run_instead(words, e.error)
    except Exception:  # (nothing visible done that the full path does not redo)
        return None


def _run_instead(words: list[str], error: OSError) -> int | None:
    """Run the compile ``words`` stands for as it is, as the full path does when it
    cannot put a hit's outputs in place (``wrap._run_planned``), with its warning:
    the compiler writes every output itself, as it would alone.  None when the
    command or its compiler cannot be told (the full path runs and says why)."""
    try:
        from . import masquerade
        from .errors import sentence

        command: list[str] | None = None
        if masquerade.compiler_kind(words[0]):  # a link named like the compiler (cli.main)
            command = words
        elif words[1:2] == ["wrap"] and "--" in words[2:]:  # (cli._wrap_main)
            command = words[words.index("--", 2) + 1 :]
        elif words[1:2] and masquerade.compiler_kind(words[1]):  # `opcache gcc ...` (cli._run)
            command = words[1:]
        real = masquerade.find_compiler(command[0], os.environ) if command else None
        if command is None or real is None:
            return None
        env = masquerade.compiler_environ(os.environ, real)
        why = sentence(error)
    except Exception:
        return None
    import contextlib

    with contextlib.suppress(OSError, ValueError):  # (stderr itself failed: the command runs)
        print(
            f"opcache: warning: cannot put the outputs in place: {why}; running the command",
            file=sys.stderr,
            flush=True,
        )
    return masquerade.run_plain([real, *command[1:]], env)


def _serve(words: list[str]) -> int:
    cwd = os.getcwdb()
    umask = os.umask(0o077)
    os.umask(umask)
    name = memo_name(words, os.environb, cwd, umask)
    folder = open_own_folder(os.path.join(runtime_folder(os.environ), FOLDER), False)
    try:
        fd = os.open(name, READ, dir_fd=folder)
    finally:
        os.close(folder)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > MAX_MEMO:
            raise Miss
        data = os.read(fd, st.st_size + 1)
    finally:
        os.close(fd)
    fields = data.split(b"\0")
    if fields[0] != FORMAT or fields[-1] != b"end":
        raise Miss
    status = Memo(fields[1:-1]).serve()
    if status == 0:
        last_memo[:] = [data]
    return status


# The memo this process last served a hit from or wrote (quickmemo): a server's worker
# writes the C client's memo from it (quickmemo.client_memo).
last_memo: list[bytes] = []


class Memo:
    """A memo's records, parsed (Miss if one is unknown): ``serve`` checks and serves it.

    The checks (the memo's first records, as it is written) are parsed one at a time
    as ``serve`` takes them: a memo that misses costs the checks up to the first that
    fails, not the parsing of hundreds.
    """

    def __init__(self, fields: list[bytes]) -> None:
        self.fields = fields
        # target, artifact, size, digest, and the folder the full hit wrote it in
        self.outputs: list[tuple[bytes, bytes, int, str, tuple[int, int]]] = []
        self.streams: list[tuple[int, bytes, int, str]] = []  # 1 or 2, artifact, size, digest
        at = 0
        while fields[at : at + 1] == [b"c"]:
            at += 10  # (a check: its tag, path, follow ("1" or "0") and 7 numbers)
        self.checks_end = at  # (fields[:checks_end]: the checks)
        while at < len(fields):
            tag = fields[at]
            if tag == b"e":
                self.entry = fields[at + 1]
                self.entry_id = (int(fields[at + 2]), int(fields[at + 3]))
                self.manifest = fields[at + 4]
                self.stamp_every = float(fields[at + 5])  # <0: aging off, no stamp
                at += 6
            elif tag == b"o":
                size = int(fields[at + 3])
                folder = (int(fields[at + 5]), int(fields[at + 6]))
                self.outputs.append(
                    (fields[at + 1], fields[at + 2], size, fields[at + 4].decode(), folder)
                )
                at += 7
            elif tag == b"s":
                size = int(fields[at + 3])
                self.streams.append(
                    (int(fields[at + 1]), fields[at + 2], size, fields[at + 4].decode())
                )
                at += 5
            elif tag == b"n":
                self.counters = fields[at + 1]
                self.counters_id = (int(fields[at + 2]), int(fields[at + 3]))
                self.counters_mode = int(fields[at + 4])
                self.saved = float(fields[at + 5])
                self.appended = fields[at + 6]
                at += 7
            else:
                raise Miss
        if not self.outputs:
            raise Miss

    def serve(self) -> int:
        """Everything that can be checked first (Miss if anything does not hold); then the
        outputs are put in place (Undelivered if one cannot be: none is left from the
        cache), and only then is the hit counted, as one delivered.  From then on an
        error ends the run as the full path's would: ``opcache: error: ...``, 1, never
        a second count."""
        fields = self.fields
        for at in range(0, self.checks_end, 10):
            want = tuple(map(int, fields[at + 3 : at + 10]))
            if identity(fields[at + 1], fields[at + 2] == b"1", want[4] == NO_SIZE) != want:
                raise Miss
        entry = open_same(self.entry, self.entry_id)
        places: list[tuple[int, bytes, bytes, bytes]] = []  # folder, name, target, data
        try:
            outputs = [
                (target, self.artifact(entry, name, size, want), folder)
                for target, name, size, want, folder in self.outputs
            ]
            streams = [(number, self.artifact(entry, *rest)) for number, *rest in self.streams]
            if any(b"\x1b[" in data for _, data in streams):
                raise Miss  # (colour taken out where it cannot show: the full path's work)
            for target, data, folder in outputs:
                fd, name = _open_place(target, folder)
                places.append((fd, name, target, data))
            _deliver(places, self._count)
            return _finish(self._stamp, entry, streams)
        finally:
            os.close(entry)
            for fd, *_ in places:
                os.close(fd)

    @staticmethod
    def artifact(entry: int, name: bytes, size: int, want: str) -> bytes:
        """The artifact ``name`` in the folder ``entry``, if regular, that size and digest."""
        import xxhash

        fd = os.open(name, READ, dir_fd=entry)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise Miss
            chunks, left = [], size
            while left > 0:
                chunk = os.read(fd, left)
                if not chunk:
                    raise Miss
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if xxhash.xxh3_128_hexdigest(data) != want:
            raise Miss
        return data

    def _count(self) -> None:
        """One hit (and the time it saved) on the chip's counters, as one appended line."""
        folder = open_same(self.counters, self.counters_id)
        try:
            line = count_line(self.saved)
            flags = os.O_WRONLY | os.O_APPEND | READ
            try:
                fd, made = os.open(self.appended, flags, dir_fd=folder), False
            except FileNotFoundError:
                # Made here, so its mode is set here: never another file's (a hard link).
                fd = os.open(self.appended, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=folder)
                made = True
        finally:
            os.close(folder)
        try:
            import fcntl

            st = os.fstat(fd)
            # One link: not a hard link another member of a shared cache made to a
            # file of ours elsewhere (the next full-path count folds it away).
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size >= MAX_MEMO:
                raise Miss
            # Shared: a fold (CounterFiles) takes it exclusively once it has renamed the
            # file, so an append either lands before the fold reads or is not made.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            if os.fstat(fd).st_nlink != 1:
                raise Miss
            if made and stat.S_IMODE(st.st_mode) != self.counters_mode:
                os.fchmod(fd, self.counters_mode)
            os.write(fd, line)
        finally:
            os.close(fd)

    def _stamp(self, entry: int) -> None:
        """The entry's access, as a full hit stamps it (aging must see the use)."""
        if self.stamp_every < 0:
            return
        import time

        now, manifest = time.time(), self.manifest
        if now - os.stat(manifest, dir_fd=entry, follow_symlinks=False).st_mtime < self.stamp_every:
            return
        try:
            os.utime(manifest, (now, now), dir_fd=entry, follow_symlinks=False)
        except PermissionError:  # (another member's entry in a shared cache: "now" needs less)
            os.utime(manifest, dir_fd=entry, follow_symlinks=False)


def _finish(
    stamp: Callable[[int], None],
    entry: int,
    streams: list[tuple[int, bytes]],
) -> int:
    """A delivered, counted hit's visible rest: it ends here, whatever fails (the full
    path's status)."""
    try:  # noqa: SIM105 (contextlib, which a quick hit does not load)
        stamp(entry)
    except OSError:
        pass  # (aging's stamp is a hint: the full path's does not fail a hit either)
    try:
        for number, data in sorted(streams):
            stream = sys.stdout if number == 1 else sys.stderr
            if data and stream is not None:
                stream.flush()
                stream.buffer.write(data)
                stream.buffer.flush()
    except BrokenPipeError:
        # The reader left, as the full path's (cli.run_logged) says: nothing more, 1.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        from .errors import sentence

        try:
            why = sentence(e) if isinstance(e, OSError) else str(e)
            print(f"opcache: error: {why}", file=sys.stderr)
        except (OSError, ValueError):
            pass  # (stderr itself failed)
        return 1
    return 0


def unreplaceable(path: bytes | str, st: os.stat_result) -> bool:
    """Whether this user may not rename over the file ``path`` (``st``: its lstat),
    though the compiler may write into it: another user's, in a sticky folder (as
    /tmp) that is not this user's either.  Never for root."""
    if st.st_uid == os.geteuid() or not os.geteuid():
        return False
    try:
        folder = os.stat(os.path.dirname(path) or ".")
    except OSError:
        return False  # (the rename says why)
    return _unreplaceable_in(folder, st)


def _unreplaceable_in(folder: os.stat_result, st: os.stat_result) -> bool:
    """``unreplaceable`` of a file ``st`` in the folder ``folder`` (both stat results)."""
    euid = os.geteuid()
    if st.st_uid == euid or not euid:
        return False
    return bool(folder.st_mode & stat.S_ISVTX) and folder.st_uid != euid


def identity(path: bytes, follow: bool, folder_only: bool) -> tuple[int, ...]:
    """What a memo records of a path: its stat identity, or the error looking it up gave."""
    try:
        st = _stat(path, follow_symlinks=follow)
    except OSError as e:
        return (-(e.errno or 1), 0, 0, 0, 0, 0, 0)
    if folder_only and stat.S_ISDIR(st.st_mode):
        return (st.st_dev, st.st_ino, st.st_mode, st.st_uid, NO_SIZE, 0, 0)
    return (
        st.st_dev,
        st.st_ino,
        st.st_mode,
        st.st_uid,
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
    )


# os.stat as at import: the real one also while quickmemo.Recorder wraps os's (it takes
# each path's identity, through this, as the path is consulted).
_stat = os.stat


def open_same(path: bytes, identity: tuple[int, int]) -> int:
    """The folder at ``path``, opened without following a link, if it is still the one
    the full path used (the same device and inode)."""
    fd = os.open(path, FOLDER_FLAGS)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != identity:
        os.close(fd)
        raise Miss
    return fd


def _open_place(target: bytes, folder_id: tuple[int, int]) -> tuple[int, bytes]:
    """The folder of the output ``target``, reached as the compiler reaches it (links
    followed) and opened once (O_PATH), and the target's name in it: the output is
    made and renamed there, whatever is moved meanwhile.

    Miss when it is not the folder the full hit wrote into (``folder_id``: device and
    inode; replaced, a link re-pointed), or the target is there and not a regular
    file this user may rename over (the full path's work: it says why).
    Undelivered when the folder cannot be reached or searched (gone, its mode).
    """
    head, _, name = target.rpartition(b"/")
    try:
        fd = os.open(head or b"/", PLACE_FLAGS)
    except OSError as e:
        raise Undelivered(_naming(e, target)) from None
    try:
        folder = os.fstat(fd)
        if (folder.st_dev, folder.st_ino) != folder_id:
            raise Miss
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return fd, name
        except OSError as e:  # (a folder this user may not search)
            raise Undelivered(_naming(e, target)) from None
        if not stat.S_ISREG(st.st_mode) or _unreplaceable_in(folder, st):
            raise Miss
        return fd, name
    except BaseException:
        os.close(fd)
        raise


def _naming(error: OSError, target: bytes) -> OSError:
    """``error`` naming the output ``target`` (a warning names what could not be put)."""
    return OSError(error.errno, error.strerror, os.fsdecode(target))


def _deliver(places: list[tuple[int, bytes, bytes, bytes]], count: Callable[[], None]) -> None:
    """Put each output in place as the full path puts it: a new file (0666 less the
    umask) in its folder, renamed over the target; then ``count`` the hit.

    Every output is written in full before any is renamed, so an error making one
    (a folder not writable, a read-only file system, a full disk) replaces none;
    it is raised as Undelivered, every temporary file removed (as it is if a rename
    fails: the command then rewrites the outputs already renamed).  A Ctrl-C waits
    until the outputs are in place and counted, or none is half made.
    """
    import _signal

    held = _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})
    temps: list[tuple[int, bytes]] = []  # (folder, name): made and not renamed yet
    try:
        try:
            for fd, _name, target, data in places:
                temp = b".opcache-wrap.%d.%s" % (os.getpid(), os.urandom(4).hex().encode())
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    out = os.open(temp, flags, 0o666, dir_fd=fd)
                except OSError as e:
                    raise _naming(e, target) from None
                temps.append((fd, temp))
                try:
                    view = memoryview(data)
                    while view:
                        written = os.write(out, view)
                        if not written:
                            from errno import ENOSPC

                            raise OSError(ENOSPC, os.strerror(ENOSPC))
                        view = view[written:]
                except OSError as e:
                    raise _naming(e, target) from None
                finally:
                    try:
                        os.close(out)
                    except OSError as e:  # (NFS reports a full disk here)
                        raise _naming(e, target) from None
            for fd, name, target, _data in places:
                temp = temps[0][1]  # (made in the same order)
                try:
                    os.rename(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
                except OSError as e:
                    raise _naming(e, target) from None
                del temps[0]
        except BaseException as e:
            for fd, temp in temps:
                try:  # noqa: SIM105 (contextlib, which a quick hit does not load)
                    os.unlink(temp, dir_fd=fd)  # (none left in the user's folder)
                except OSError:
                    pass
            if isinstance(e, OSError):
                raise Undelivered(e) from None
            raise
        count()
    finally:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, held)
