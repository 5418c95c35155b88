"""``OpCache.compile_many``: a batch of operators, each compiled once among the
processes that need it.  It orders one key's steps (``flow.KeyFlow``) and the
remote's (``remote_tier.RemoteTier``) for many keys at once.

The ranks of a job ask for the same operators at the same moment.  With single
flight alone they all wait on the first operator while one of them compiles
it, then all on the second: the work is done one operator at a time, slower
than one process alone.  Here each process

1. delivers every hit at once;
2. claims the missing keys no one is compiling (a non-blocking try of the
   key's single-flight lock) and compiles them, ``jobs`` at a time, in an
   order of its own (shuffled), so that ranks starting together go for
   different keys;
3. then collects the keys others were compiling as their locks come free
   (one listing of the lock files for all of them a round, the entries stored
   meanwhile delivered as hits with no lock taken; a real try now and then,
   for holders that died), and compiles any whose holder died or failed.

The rules of ``OpCache.compile`` hold for every operator: modes, bypasses,
stats, and a cache that cannot be read or written never fails a compile.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ._log import get_logger
from .flow import UNUSABLE, deliver, out_path
from .key import compute_key, key_inputs
from .request import CompileResult, OpRequest
from .storage import UNCLAIMED

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .compilers.protocol import Compiler
    from .flow import KeyFlow, Made
    from .locks import KeyLock
    from .request import Status
    from .storage import Fetched
    from .storage.entry import Entry

    OutDirs = Sequence[str | os.PathLike[str]] | Callable[[OpRequest], str | os.PathLike[str]]

log = get_logger(__name__)

_State = str
_DONE, _LATER, _PARKED = "done", "later", "parked"  # what became of a job taken

# Checks of the keys other processes of this machine hold (one listing of
# their lock files for all of them): the first soon (a compile may be short),
# then less and less often while none comes free.
_FIRST_CHECK = 0.01
_LAST_CHECK = 0.1
# A lock file that is still there is held, unless its holder died: try the
# lock itself this often to find those.
_TRY_EVERY = 1.0
# A fresh key whose lock file a listing this recent names is watched, not tried.
_LISTED_FOR = 0.005
# How long a thread looks through the chip folder and buckets it opened.
_READ_FOR = 0.01


class _Job:
    """One compile of a batch: the requests (by index) that share its key."""

    __slots__ = (
        "held",
        "indices",
        "key",
        "lock",
        "lock_dir",
        "plain",
        "remote_wait",
        "request",
        "since",
        "timed_out",
        "tried",
    )

    def __init__(
        self,
        index: int,
        request: OpRequest,
        key: str = "",
        plain: tuple[Status, str | None] | None = None,
    ) -> None:
        self.indices = [index]
        self.request = request
        self.key = key
        self.plain = plain  # (status, reason) of a compile that keeps the cache out
        self.lock: KeyLock | None = None
        self.lock_dir = ""  # the folder of its lock file, as text
        self.held: KeyLock | None = None  # the lock, while this process holds it
        self.remote_wait = False  # held here, while another machine compiles it
        self.timed_out = False  # waited lock_timeout for that machine: compile here
        self.tried = 0.0  # when the lock was last tried
        self.since = 0.0  # when another process was first found holding it


class _Watch:
    """Taken from the schedule: look at the lock files of this machine for every
    job another process of it holds, at once."""

    __slots__ = ()


WATCH = _Watch()
# Looks at the remote for parked jobs: often at first, then less and less.
_FIRST_POLL = 0.01
_LAST_POLL = 0.1
# After a job is parked, the claims of the next fresh keys are looked at: at most
# this often, unless the next key was not among those looked at last; and only
# this many (one MGET), the next ones taken (a look at all of a batch's, hundreds
# of claims every 50 ms, was half a cold cluster's Redis commands).
_PEEK_EVERY = 0.05
_PEEK_KEYS = 64


class _Schedule:
    """Fresh jobs first, then jobs others hold, as they come free.

    A job whose key another process of this machine holds stays in hand
    (busy) while one ``WATCH`` now and then lists the lock files for all of
    them; a job whose key another machine compiles is parked, and a poller
    thread (``next_poll``) looks at the remote for all of them in one round
    trip now and then.  Either gives back the jobs worth another try, first
    of all.

    The poller is not one of the ``jobs`` threads: a parked job holds its
    key's local lock, which this machine's other processes wait on, and its
    entry must be taken as soon as the remote has it, not once a thread is
    done compiling.
    """

    def __init__(self, fresh: list[_Job]) -> None:
        self._fresh = deque(fresh)
        self._held: list[_Job] = []  # jobs others of this machine hold (busy)
        self._watch_at: float | None = None  # when their lock files are next listed
        self._watch_delay = _FIRST_CHECK
        self._watching = False  # a thread is listing them
        self._busy = 0  # jobs taken (held or parked) and not yet finished or put back
        self._poll_at: float | None = None  # when the parked jobs are next looked at
        self._poll_delay = _FIRST_POLL
        self._poller = False  # whether the poller was started
        self._stopped = False
        mutex = threading.Lock()
        self._cond = threading.Condition(mutex)  # (the workers wait on it)
        self._poll_due = threading.Condition(mutex)  # (the poller waits on it)

    def take(self) -> tuple[_Job | _Watch, bool] | None:
        """(a job, whether it is fresh), or (WATCH, False), or None when all is done."""
        with self._cond:
            while True:
                if self._stopped:
                    return None
                now = time.monotonic()
                watch_at = None if self._watching else self._watch_at
                if watch_at is not None and watch_at <= now:
                    self._watch_at = None
                    self._watching = True
                    return WATCH, False
                if self._fresh:
                    self._busy += 1
                    return self._fresh.popleft(), True
                if watch_at is not None:
                    self._cond.wait(watch_at - now)
                elif self._busy or self._watching:
                    self._cond.wait()  # a job in hand may come back
                else:
                    return None

    def next_poll(self) -> bool:
        """For the poller: wait until a look at the parked jobs is due (True), or
        the batch ends (False: ``stop``)."""
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                if self._poll_at is not None and self._poll_at <= now:
                    self._poll_at = None
                    return True
                self._poll_due.wait(None if self._poll_at is None else self._poll_at - now)
            return False

    def stop(self) -> None:
        """No more jobs for anyone (Ctrl-C, or the batch is done): every ``take``
        and ``next_poll`` returns at once."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            self._poll_due.notify()

    def finished(self, jobs: int = 1) -> None:
        with self._cond:
            self._busy -= jobs
            self._cond.notify_all()

    def fresh_keys(self, soc: str, most: int) -> list[str]:
        """The keys of the next ``most`` fresh jobs of chip ``soc`` not tried yet."""
        keys: list[str] = []
        with self._cond:
            for job in self._fresh:
                if len(keys) == most:
                    break
                if job.plain is None and not job.remote_wait and job.request.soc_version == soc:
                    keys.append(job.key)
        return keys

    def later(self, job: _Job) -> None:
        """Keep a job another process of this machine holds, until a ``WATCH`` finds
        it worth another try; one is due soon, if none is."""
        with self._cond:
            self._held.append(job)
            if self._watch_at is None and not self._watching:
                self._watch_delay = _FIRST_CHECK
                self._watch_at = time.monotonic() + self._watch_delay
                self._cond.notify_all()

    def take_held(self) -> list[_Job]:
        """For a ``WATCH``: the jobs others hold (given back through ``watched``)."""
        with self._cond:
            held, self._held = self._held, []
            return held

    def watched(self, settled: int, again: list[_Job], still: list[_Job]) -> None:
        """After a watch: ``settled`` jobs are done, ``again`` go back to be tried
        (first of all), ``still`` stay held, and while any do the next watch is due."""
        with self._cond:
            self._watching = False
            self._busy -= settled + len(again)
            self._fresh.extendleft(again)
            self._held.extend(still)
            if self._held:
                progress = settled or again
                delay = _FIRST_CHECK if progress else min(self._watch_delay * 2, _LAST_CHECK)
                self._watch_delay = delay
                due = time.monotonic() + delay
                self._watch_at = due if self._watch_at is None else min(self._watch_at, due)
            self._cond.notify_all()

    def parked(self) -> bool:
        """A job was parked: a poll is due soon, if none is.  True the first time:
        the caller starts the poller."""
        with self._cond:
            if self._poll_at is None:
                self._poll_delay = _FIRST_POLL
                self._poll_at = time.monotonic() + self._poll_delay
                self._poll_due.notify()
            start, self._poller = not self._poller, True
            return start

    def polled(self, settled: int, again: list[_Job], parked: bool) -> None:
        """After a poll: ``settled`` jobs are done, ``again`` go back to be tried
        (first of all), and while jobs stay ``parked`` the next poll is due."""
        with self._cond:
            self._busy -= settled + len(again)
            self._fresh.extendleft(again)
            if parked:
                # Progress halves the wait rather than ending it: where entries
                # come every few ms (a cold cluster), a poll every 10 ms finds a
                # few each, and costs a round trip each.
                progress = settled or again
                self._poll_delay = (
                    max(self._poll_delay / 2, _FIRST_POLL)
                    if progress
                    else min(self._poll_delay * 2, _LAST_POLL)
                )
                due = time.monotonic() + self._poll_delay
                # (A job parked during this poll may have made one due sooner.)
                self._poll_at = due if self._poll_at is None else min(self._poll_at, due)
            self._cond.notify_all()


def default_jobs() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compile_many(
    flow: KeyFlow,
    requests: Sequence[OpRequest],
    compiler: Compiler,
    out_dirs: OutDirs,
    jobs: int | None,
    on_result: Callable[[int, CompileResult], None] | None = None,
) -> list[CompileResult]:
    """See ``OpCache.compile_many``."""
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs={jobs} is not valid; use 1 or more")
    if callable(out_dirs):
        outs = [out_path(out_dirs(request)) for request in requests]
    elif len(out_dirs) == len(requests):
        outs = [out_path(out) for out in out_dirs]
    else:
        raise ValueError(f"{len(requests)} requests but {len(out_dirs)} output folders")
    batch = _Batch(flow, requests, compiler, outs, on_result)
    fresh = batch.first_look()
    random.Random().shuffle(fresh)  # ranks that start together go for different keys
    schedule = _Schedule(fresh)
    workers = [
        threading.Thread(target=batch.work, args=(schedule,), name=f"opcache-compile-{n}")
        for n in range(min(jobs, len(fresh)) - 1)
    ]
    for worker in workers:
        worker.start()
    try:
        batch.work(schedule)  # this thread works too
    except BaseException as e:  # (a second Ctrl-C as its work ends: its first stopped it)
        batch.stop(schedule, e)
    _finish(batch, schedule, workers)
    if batch.stopped_by is not None and not isinstance(batch.stopped_by, Exception):
        raise batch.stopped_by  # Ctrl-C, an exit: the caller's, once every thread is done
    return batch.results  # type: ignore[return-value]  # every slot is filled by now


def _finish(batch: _Batch, schedule: _Schedule, workers: list[threading.Thread]) -> None:
    """Wait for the workers (after a stop, each ends with its current compile), end
    the poller, then let go of what the batch still holds (``_Batch.end``).

    A Ctrl-C meanwhile (a second one, when the first seemed slow to act)
    stops the batch and is held off until then: the process may go on (a
    notebook, a framework that catches it), and the local locks of the keys
    parked for other machines must not stay held there, nor a thread of the
    batch call on_result once compile_many has raised.  SIGINT is blocked in
    this thread meanwhile (as ``RemoteTier._stop_copier`` does), but a worker
    thread may take it for the process: Python then raises it in this thread
    at its next instruction, wherever that is, and it stops the batch all the
    same; the waits and the release are gone through again (each may be).
    """
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        while True:
            try:
                for worker in workers:
                    worker.join()
                if batch.poller is not None:  # (started by a worker: all are done)
                    schedule.stop()  # (none is parked any more, unless the batch was stopped)
                    batch.poller.join()
                batch.end()
                return
            except BaseException as e:
                batch.stop(schedule, e)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class _Batch:
    """One compile_many call: its requests, results, and the work on its jobs."""

    def __init__(
        self,
        flow: KeyFlow,
        requests: Sequence[OpRequest],
        compiler: Compiler,
        outs: list[Path],
        on_result: Callable[[int, CompileResult], None] | None,
    ) -> None:
        self.flow = flow
        self.requests = requests
        self.compiler = compiler
        self.outs = outs
        self.results: list[CompileResult | None] = [None] * len(requests)
        self.stopped_by: BaseException | None = None  # what stopped the batch, if anything
        self.jobs: list[_Job] = []  # the jobs left after the first look
        self.on_result = on_result
        self.poller: threading.Thread | None = None  # started once a job is parked
        # Jobs whose key another machine compiles, by (chip, key); their local lock held.
        self._parked: dict[tuple[str, str], _Job] = {}
        self._parked_lock = threading.Lock()
        self._readers = threading.local()  # each thread's (when, ExitStack, reader) by chip
        self._listed: dict[str, tuple[float, set[str]]] = {}  # lock folder: (when, names)
        # When each chip's fresh claims were last looked at, and whose.
        self._peeked: dict[str, tuple[float, frozenset[str]]] = {}

    def first_look(self) -> list[_Job]:
        """Deliver every hit; return the jobs left: one per missing key or plain compile."""
        fingerprint = self.flow.fingerprint(self.compiler) if self.requests else ""
        jobs: list[_Job] = []
        by_key: dict[str, _Job | Entry] = {}  # (a key is of one chip: its inputs name it)
        with contextlib.ExitStack() as held:
            # Each chip's folders opened and trusted once for the whole pass, not per
            # key; None for a chip whose folder must not be used (``chip_ready``,
            # asked once a pass too).
            readers: dict[str, Callable[[str], Entry | None] | None] = {}

            def reader(soc: str) -> Callable[[str], Entry | None] | None:
                if soc not in readers:
                    ready = self.flow.chip_ready(soc)
                    readers[soc] = held.enter_context(self.flow.reading(soc)) if ready else None
                return readers[soc]

            for index, request in enumerate(self.requests):
                started = time.perf_counter()
                try:
                    job = self._first_look(index, request, fingerprint, by_key, started, reader)
                except Exception as e:  # one operator's failure does not stop the others
                    self._set(index, _failed("", e, started))
                    continue
                if job is not None:
                    jobs.append(job)
        self.jobs = jobs if self.flow.remote is None else self._from_remote(jobs)
        return list(self.jobs)

    def _from_remote(self, jobs: list[_Job]) -> list[_Job]:
        """Deliver the local misses the remote has (one batch per chip); the jobs left."""
        remote = self.flow.remote
        assert remote is not None
        by_soc: dict[str, list[_Job]] = {}
        for job in jobs:
            if job.plain is None:
                by_soc.setdefault(job.request.soc_version, []).append(job)
        for soc, missing in by_soc.items():
            started = time.perf_counter()
            found = remote.fetch_many(soc, [job.key for job in missing])
            # Served now, kept in the cache folder in the background (no local
            # lock is held on them: nobody here waits for those copies).
            try:  # (the copier woken once they are delivered, not to compete with them)
                remote.backfill_later(soc, found, wake=False)
                hits = ((job, found[job.key][0]) for job in missing if job.key in found)
                self._hits(soc, hits, started, "remote")
            finally:
                remote.copy_pending()
        return [job for job in jobs if self.results[job.indices[0]] is None]

    def _first_look(
        self,
        index: int,
        request: OpRequest,
        fingerprint: str,
        by_key: dict[str, _Job | Entry],
        started: float,
        reader: Callable[[str], Callable[[str], Entry | None] | None],
    ) -> _Job | None:
        """A new job for ``request``, or None when it is a hit or joins a job of its key."""
        flow = self.flow
        plain = flow.bypass(request)
        if plain is not None:
            return _Job(index, request, plain=plain)
        soc = request.soc_version
        key = compute_key(request, self.compiler.name, fingerprint)[0]
        read = reader(soc)
        if read is None:
            return _Job(index, request, key, plain=("miss", UNUSABLE))
        known = by_key.get(key)
        if isinstance(known, _Job):
            known.indices.append(index)  # the same kernel under another name
            return None
        if known is None:
            with flow.one_error(soc):
                known = flow.look(soc, key, read)
        if known is not None:
            by_key[key] = known
            self._set(index, flow.hit(known, soc, self.outs[index], started, "local"))
            return None
        job = by_key[key] = _Job(index, request, key)
        return job

    def work(self, schedule: _Schedule) -> None:
        """Take jobs until none is left.  Anything a job's own handling does not
        catch (a poll, the schedule, ``on_result``, Ctrl-C) stops every thread
        after its current compile, and ``compile_many`` ends: never a batch that
        waits forever for a thread that is gone."""
        try:
            self._work(schedule)
        finally:
            self.close_readers()

    def _work(self, schedule: _Schedule) -> None:
        try:
            while (taken := schedule.take()) is not None:
                job, fresh = taken
                if isinstance(job, _Watch):
                    self._watch(schedule)
                    continue
                state = _DONE
                try:
                    state = self._try(job, fresh)
                except Exception as e:  # one operator's failure does not stop the others
                    self._fail(job, e)
                finally:
                    if state is _DONE:
                        schedule.finished()
                    elif state is _LATER:
                        schedule.later(job)
                    else:
                        if schedule.parked():
                            self._start_poller(schedule)
                        self._peek(schedule, job.request.soc_version)
        except BaseException as e:
            self.stop(schedule, e)

    def stop(self, schedule: _Schedule, error: BaseException) -> None:
        """Stop every thread after its current job: ``error`` ends the batch (unless
        another ended it first, the one kept)."""
        schedule.stop()
        if self.stopped_by is None:  # (the first of threads stopping at once)
            self.stopped_by = error

    def end(self) -> None:
        """After every thread is done: if one stopped the batch, let go of the locks
        still held, and (unless Ctrl-C or an exit stopped it) give each request
        not done the error as its result."""
        error = self.stopped_by
        if error is None:
            return
        for job in self.jobs:
            if job.held is not None:
                job.held.release()
        if not isinstance(error, Exception):
            return
        undone = sum(result is None for result in self.results)
        log.warning(
            "compile_many stopped, %d of %d operators not compiled: %s: %s",
            undone, len(self.results), type(error).__name__, error,
        )  # fmt: skip
        for job in self.jobs:
            self._fail(job, error)

    def _start_poller(self, schedule: _Schedule) -> None:
        poller = threading.Thread(target=self._poll_parked, args=(schedule,), name="opcache-poll")
        poller.start()
        self.poller = poller

    def _poll_parked(self, schedule: _Schedule) -> None:
        """The poller: a look at the remote for the parked jobs whenever one is due
        (``_poll``), until the batch ends; anything it does not catch stops the batch."""
        try:
            while schedule.next_poll():
                self._poll(schedule)
        except BaseException as e:
            self.stop(schedule, e)

    def _park(self, job: _Job) -> _State:
        """Keep ``job`` (and its local lock) until another machine's compile of it is done."""
        if not job.remote_wait:
            job.remote_wait, job.since = True, time.monotonic()
        with self._parked_lock:
            self._parked[(job.request.soc_version, job.key)] = job
        return _PARKED

    def _peek(self, schedule: _Schedule, soc: str) -> None:
        """After a job was parked (another machine compiles its key): unless the
        next fresh key of the chip was looked at a moment ago, look in one round
        trip which of the next fresh keys others claimed too, so that those are
        parked without a claim refused each."""
        keys = schedule.fresh_keys(soc, _PEEK_KEYS)
        if not keys:
            return
        now = time.monotonic()
        when, seen = self._peeked.get(soc, (-_PEEK_EVERY, frozenset()))
        if now - when < _PEEK_EVERY and keys[0] in seen:
            return
        self._peeked[soc] = now, frozenset(keys)
        remote = self.flow.remote
        assert remote is not None
        remote.peek_claims(soc, keys)

    def _poll(self, schedule: _Schedule) -> None:
        """One look at the remote for every parked job: deliver what is there; what
        no one compiles any more (its holder died or failed) goes back to be tried."""
        remote = self.flow.remote
        assert remote is not None
        with self._parked_lock:
            parked = dict(self._parked)
        by_soc: dict[str, list[str]] = {}
        for soc, key in parked:
            by_soc.setdefault(soc, []).append(key)
        settled, again = 0, []
        for soc, keys in by_soc.items():
            started = time.perf_counter()
            found, claimed = remote.poll(soc, keys)
            for key in keys:
                job = parked[(soc, key)]
                waited = time.monotonic() - job.since >= self.flow.lock_timeout
                if key not in found and key in claimed and not waited:
                    continue
                with self._parked_lock:
                    del self._parked[(soc, key)]
                if key not in found:
                    job.timed_out = waited
                    again.append(job)
            # Kept (in one batch) before the local locks go: this machine's other
            # processes waiting on them find the entries, not a claim to try.
            jobs_of = {key: parked[(soc, key)] for key in found}
            entries = self._backfilled(soc, found, jobs_of)
            settled += len(found)
            for key, entry in entries.items():
                job = jobs_of[key]
                try:
                    if job.held is not None:
                        job.held.release()
                    self._hits(soc, [(job, entry)], started, "remote")
                except Exception as e:  # one operator's failure does not stop the others
                    self._fail(job, e)
        with self._parked_lock:
            still = bool(self._parked)
        schedule.polled(settled, again, still)

    def _backfilled(
        self, soc: str, found: dict[str, Fetched], jobs: dict[str, _Job]
    ) -> dict[str, Entry]:
        """The remote's entries ``found``, kept in the cache folder in one batch now;
        if that fails unexpectedly, their ``jobs`` fail with it."""
        if not found:
            return {}
        remote = self.flow.remote
        assert remote is not None
        try:
            return remote.backfill_many(soc, found)
        except Exception as e:
            for job in jobs.values():
                self._fail(job, e)
            return {}

    def _set(self, index: int, result: CompileResult) -> None:
        self.results[index] = result
        if self.on_result is not None:
            self.on_result(index, result)

    def _fail(self, job: _Job, error: BaseException) -> None:
        """Let go of the job's lock; its requests not settled yet failed with ``error``."""
        if job.held is not None:
            job.held.release()
        for index in job.indices:
            if self.results[index] is None:
                self._set(index, _failed(job.key, error, time.perf_counter()))

    def _try(self, job: _Job, fresh: bool) -> _State:
        """Settle ``job`` if it can be now (_DONE); _LATER when another process of
        this machine holds its key, _PARKED when another machine compiles it."""
        flow, request = self.flow, job.request
        soc = request.soc_version
        started = time.perf_counter()
        out = self.outs[job.indices[0]]
        if job.plain is not None:
            result = flow.plain(request, self.compiler, out, started, *job.plain, job.key)
            self._settle(job, result)
            return _DONE
        with flow.one_error(soc):
            if not job.remote_wait:
                # Another process may have stored it since the first look (a look
                # through this thread's open folders costs an open).
                entry = flow.look(soc, job.key, self._reader(soc))
                if entry is not None:  # another process compiled it
                    self._hits(soc, [(job, entry)], started, "local")
                    return _DONE
                lock = self._claim(job, fresh)
                if lock is False:
                    return _LATER
                job.held = lock
            claim = None
            if flow.remote is not None:
                if job.timed_out:
                    log.warning(
                        "waited %.3g s for another machine compiling %s/%s; compiling it here too",
                        flow.lock_timeout,
                        soc,
                        job.key,
                    )
                    claim = UNCLAIMED
                else:
                    entry, claim = flow.remote.step(soc, job.key, look_first=job.remote_wait)
                    if entry is not None:
                        if job.held is not None:
                            job.held.release()
                        self._hits(soc, [(job, entry)], started, "remote")
                        return _DONE
                    if claim is None:
                        return self._park(job)  # another machine compiles it
            # The key's inputs, for the entry's manifest: made again for the few keys
            # compiled, not kept for every key of the batch since its first look.
            try:
                inputs = key_inputs(request, self.compiler.name, flow.fingerprint(self.compiler))
            except BaseException:
                # (a fingerprint that fails now: a tool gone unreadable.  Kept, the claim
                # was renewed for the process's life, every other machine waiting on it.)
                if claim is not None:
                    claim.release()
                raise
            skipped: list[tuple[int, OSError]] = []

            def next_out(error: OSError) -> Path | None:
                # The first request's out_dir failed: its failure alone, not the
                # other requests' of the key, which get the compile.
                if len(job.indices) == 1:
                    return None
                skipped.append((job.indices.pop(0), error))
                return self.outs[job.indices[0]]

            try:
                filled = flow.fill(
                    job.held, request, self.compiler, job.key, inputs, out, claim, next_out
                )
            finally:
                for index, error in skipped:
                    self._set(index, _failed(job.key, error, started))
        if filled.entry is not None:
            self._hits(soc, [(job, filled.entry)], started, filled.tier)
            return _DONE
        made = filled.artifacts, filled.modes
        self._settle(job, flow.missed(filled, soc, job.key, started), made)
        return _DONE

    def _hits(
        self, soc: str, hits: Iterable[tuple[_Job, Entry]], started: float, tier: str
    ) -> None:
        """Deliver each job's entry into the out_dir of each of its requests; the hits
        counted at once (a count per hit was a tenth of a batch's bookkeeping)."""
        served, saved, outs = 0, 0.0, self.outs
        try:
            for job, entry in hits:
                for index in job.indices:
                    args = (entry, soc, outs[index], started, tier)
                    if self._each(job, index, self.flow.served, *args):
                        served += 1
                        saved += entry.compile_seconds
        finally:
            if served:
                self.flow.count_hits(soc, served, saved)

    def _each(
        self, job: _Job, index: int, result: Callable[..., CompileResult], *args: object
    ) -> bool:
        """Request ``index`` of the job gets ``result(*args)``, or its own error: a
        failure to deliver into its out_dir is not the other requests' failure.
        True if ``result`` gave one."""
        started = time.perf_counter()
        gave = False
        try:
            got = result(*args)
            gave = True
            self._set(index, got)
        except Exception as e:
            self._set(index, _failed(job.key, e, started))
        return gave

    def _watch(self, schedule: _Schedule) -> None:
        """One listing of the lock files for every job another process of this
        machine holds: those whose file is gone are delivered if their entry is
        there (``_local_hits``), else go back to be tried.

        A holder deletes its lock file when done (stored or failed): while the
        file is there, the key is most likely still being compiled.  Its holder
        may have died, though: the lock itself is tried now and then.  (A name
        only decides when to look: a folder swapped for a link meanwhile leads
        to a look or a try, which are safe, and to nothing else.)
        """
        held = schedule.take_held()
        now = time.monotonic()
        listed: dict[str, set[str]] = {}
        due, still = [], []
        for job in held:
            names = listed.get(job.lock_dir)
            if names is None:
                names = listed[job.lock_dir] = _names_in(job.lock_dir)
            if job.key not in names or now - job.tried >= _TRY_EVERY:
                due.append(job)
            else:
                still.append(job)
        settled, again = self._local_hits(due)
        schedule.watched(settled, again, still)

    def _local_hits(self, jobs: list[_Job]) -> tuple[int, list[_Job]]:
        """Deliver the jobs whose entry another process stored meanwhile, each chip's
        folders opened once for all of them: (how many were, the jobs still missing).

        No lock is taken for a hit: the store's entry appears whole or not at
        all, and is checked as any other.  The jobs still missing go back to
        be claimed (and looked at again under their lock).
        """
        flow = self.flow
        settled, again = 0, []
        for job in jobs:
            soc, started = job.request.soc_version, time.perf_counter()
            try:
                with flow.one_error(soc):
                    entry = flow.look(soc, job.key, self._reader(soc))
                if entry is None:
                    again.append(job)
                    continue
                self._hits(soc, [(job, entry)], started, "local")
            except Exception as e:  # one operator's failure does not stop the others
                self._fail(job, e)
            settled += 1
        return settled, again

    def _reader(self, soc: str) -> Callable[[str], Entry | None]:
        """This thread's reader of the chip folder (``KeyFlow.reading``): its folders
        opened and trusted once for the looks of the next ``_READ_FOR`` seconds,
        not once per key; then opened anew, as a folder force or clear renamed
        away meanwhile is left for the one in its place."""
        mine = self._readers.__dict__  # (this thread's)
        now = time.monotonic()
        got = mine.get(soc)
        if got is None or now - got[0] >= _READ_FOR:
            if got is not None:
                got[1].close()
            held = contextlib.ExitStack()
            got = mine[soc] = (now, held, held.enter_context(self.flow.reading(soc)))
        return got[2]

    def close_readers(self) -> None:
        """Close this thread's readers (at the end of its work)."""
        mine = self._readers.__dict__
        while mine:
            mine.popitem()[1][1].close()

    def _claim(self, job: _Job, fresh: bool) -> KeyLock | bool | None:
        """The key's lock, now held; None to go on without one; False if another holds it."""
        flow, soc = self.flow, job.request.soc_version
        now = time.monotonic()
        if job.lock is None:
            job.lock = flow.key_lock(soc, job.key)
            job.lock_dir = str(job.lock.path.parent)
            if job.key in self._held_now(job.lock_dir, now):
                # Its lock file is there: another process holds it (or died holding
                # it, which the watch's tries find).  Tried as if, for less.
                job.tried = job.since = now
                job.lock.waited = True
                return False
        elif now - job.since >= flow.lock_timeout:
            log.warning(
                "waited %.3g s for another process compiling %s/%s; compiling it here too",
                flow.lock_timeout,
                soc,
                job.key,
            )
            return None
        job.tried = now
        try:
            if job.lock.try_acquire():
                return job.lock
        except OSError as e:
            flow.cache_error("lock", f"cannot lock {soc}/{job.key}: {e}", soc)
            return None
        if not job.since:  # (once: a retry the watch sends back is taken as fresh)
            job.since = now
        return False

    def _held_now(self, lock_dir: str, now: float) -> set[str]:
        """The lock files of ``lock_dir``, listed at most every ``_LISTED_FOR`` s
        (a name only decides whether a fresh key is tried now or watched)."""
        listed = self._listed.get(lock_dir)
        if listed is None or now - listed[0] >= _LISTED_FOR:
            listed = self._listed[lock_dir] = (now, _names_in(lock_dir))
        return listed[1]

    def _settle(self, job: _Job, result: CompileResult, made: Made | None = None) -> None:
        """The job's first request gets ``result``; the others of its key a copy (a hit)."""
        first, *others = job.indices
        self._set(first, result)
        for index in others:
            if made is None or result.status == "error":
                self._set(index, result)
            else:
                self._each(job, index, self._copy, job, index, made, result.seconds)

    def _copy(self, job: _Job, index: int, made: Made, saved: float) -> CompileResult:
        started = time.perf_counter()
        files = deliver(self.outs[index], *made)
        self.flow.count(job.request.soc_version, "hits")
        seconds = time.perf_counter() - started
        return CompileResult("hit", job.key, files, seconds, saved_seconds=saved, tier="local")


def _names_in(folder: str) -> set[str]:
    """The names in ``folder`` (none, if it cannot be listed)."""
    try:
        return set(os.listdir(folder))
    except OSError:
        return set()


def _failed(key: str, error: BaseException, started: float) -> CompileResult:
    return CompileResult("error", key, {}, time.perf_counter() - started, str(error), error=error)
