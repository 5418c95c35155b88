"""Redis (or Valkey) as the remote tier, through redis-py.

Keys, under the settings' prefix (``opcache:1:`` unless set)::

    <prefix><soc>:<key>          an entry
    <prefix><soc>:<key>:claim    a claim: one client compiles the key

A value is an entry packed whole and checked whole on every read
(``value.py``).

The client waits a fraction of a second to connect (to all of a host name's
addresses together, the look-up aside: ``_connection_kinds``) and ``timeout``
seconds for an answer, plus a second per MiB of it received (``MIN_RATE``), from
sending the command to the answer's last byte (``_TimedSocket``: a server
sending a byte at a time no longer holds a compile for as long as it likes).
An answer holds at most the entry cap for each value asked, plus a little
(``_room``): a server sending more (a junk value of 500 MB under a key, a
bulk string announced at 4 GB) is cut off there, the connection dropped, a
GET's value as corrupt and any other command's as a ``RemoteError``.  It
never retries: a cache must not hold up a compile for the sake of a
remote (redis-py's defaults wait 5 s and retry ten times).  Every
failure is a ``RemoteError``: redis-py's own errors, and the others it lets
through (a host label over 63 characters is a UnicodeError from the idna
codec); a server that wants a password, or refuses the one given, is told
as such, naming ``OPCACHE_REMOTE_PASSWORD``.  A write the server's ACL
refuses turns the client read-only, with one warning.

Claims are ``SET NX PX`` with a random token.  A thread renews all the claims
this process holds in one round trip a pass (a pipeline; on a cluster, one
per primary), a pass every third of their ``seconds`` from the last one's
start: renewed one round trip each, 64 claims 150 ms away took longer than
their life, and expired under their live compiles.  A claim whose holder died
expires within its ``seconds``, and one client takes the key over.  A claim
whose entry was stored is not deleted but overwritten, after the entry, with
``stored`` for its ``seconds``: a client that looked before the store and
claims the key after it is refused, and fetches the entry instead of
compiling it again (so a client that looked less than that ago need not look
again after winning a claim: ``Claim.marks_stored``).  A claim let go without
its entry stored (its compile failed) is overwritten, if still ours, with
``failed`` for ``_FAILED_SECONDS``: a client that sees it (``watch``,
``peek_claims``) takes it for no claim held, and its ``claim`` of the key
then gives the unowned claim, so the clients waiting compile it at once,
side by side, as a local lock's waiters do (deleted, each claimed it in turn
and the next waited for its failure).  An older opcache takes ``failed`` for
a claim held (any value of a claim's key is one) and waits it out.  Only a
client closing with claims still held deletes them.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
import weakref
from urllib.parse import urlsplit

from .._log import get_logger
from ..request import is_soc_version
from .cann_names import is_cann_chip
from .local import is_key
from .remote import (
    MIN_RATE,
    Claim,
    Remote,
    RemoteCorrupt,
    RemoteError,
    connect_in_turn,
    printable,
    said,
    secrets_of,
)
from .value import checked, pack

TYPE_CHECKING = False
if TYPE_CHECKING:
    import redis as redis_py

    from ..settings import RemoteSettings
    from .entry import Entry
    from .remote import Fetched

log = get_logger(__name__)

_MGET_KEYS = 64  # keys per MGET: a batch of big kernels stays a bounded answer
# What an answer may hold beyond its values' entry caps: each key's framing, a
# claim's token, and a command's answer that holds no value (INFO, a SCAN page,
# a cluster's slot map).
_KEY_BYTES = 4 << 10
_ANSWER_BYTES = 8 << 20
_asked = threading.local()  # .room: the bytes this thread's next answers may hold
CLAIM_SUFFIX = ":claim"
_STORED = b"stored"  # a claim's value once its entry is stored
_FAILED = b"failed"  # a claim's value once its compile failed
# How long ``failed`` stays: past the next look of every client waiting (they
# look every 0.1-0.2 s), and short, as a compile asked for later claims the key.
_FAILED_SECONDS = 3.0
_FAILED_SEEN_KEPT = 10_000  # claims seen failed remembered at most (then forgotten)

# Renew a claim, mark it, or delete it, only while it holds our token.
_RENEW = """if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"""
_MARK = """if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('set', KEYS[1], ARGV[2], 'px', ARGV[3]) end return 0"""
_RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1]) end return 0"""


def connect(settings: RemoteSettings) -> RedisRemote:
    """A client of the Redis server ``settings`` names."""
    try:
        import redis as redis_py
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise RemoteError(
            "a Redis remote needs redis-py: pip install 'opcache[redis]' (or redis)"
        ) from None
    extra: dict[str, object] = {}
    if settings.password is not None:
        extra["password"] = settings.password
    scheme = urlsplit(settings.url).scheme
    if scheme in ("redis", "rediss"):  # (a unix:// socket's path has no addresses)
        extra["connection_class"] = connection_kind(tls=scheme == "rediss")
    try:
        client = redis_py.Redis.from_url(
            settings.url,
            socket_connect_timeout=min(0.5, settings.timeout / 4),
            socket_timeout=settings.timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            redis_connect_func=_connected,
            # RESP3's HELLO carries the password, which a server without HELLO (Redis 5,
            # or one that renamed it away) quotes back refusing it; and refuses us.
            protocol=2,
            **no_client_setinfo(),
            **extra,
        )
    except Exception as e:  # ValueError for a bad port, and whatever else redis-py finds
        why = said(e, secrets_of(settings))
        raise RemoteError(f"cannot use {settings.shown_url}: {why}") from None
    return RedisRemote(client, settings)


def no_client_setinfo() -> dict[str, None]:
    """redis-py's arguments for connections that send no CLIENT SETINFO: two round
    trips each, and redis-py reads its own version from the installed package's
    metadata for it (half a ms of CPU, a walk of sys.path) each time a pool makes
    one.  (``driver_info`` from redis-py 7.1, where ``lib_name`` is deprecated.)"""
    try:
        import redis.driver_info  # noqa: F401
    except ImportError:
        return {"lib_name": None, "lib_version": None}
    return {"driver_info": None}


def connection_kind(*, tls: bool) -> type[redis_py.connection.Connection]:
    """redis-py's connection class to a host and port (over TLS if ``tls``), its
    connect bounded as a whole (``_connection_kinds``)."""
    return _connection_kinds()[tls]


@functools.cache
def _connection_kinds() -> tuple[type, type]:
    """(a TCP connection, a TLS one) whose connect tries the host's addresses in turn
    within the one connect timeout.

    redis-py's gives each address the whole connect timeout: a name with 40
    unreachable addresses held a compile 40 times its half second.  (Made here, not
    at the module's top: without redis-py, ``connect`` says how to get it.)
    """
    from redis.connection import Connection, SSLConnection

    class BoundedConnection(Connection):
        def _connect(self) -> socket.socket:
            within = self.socket_connect_timeout
            if within is None:  # (not opcache's: without a limit, redis-py's own)
                return super()._connect()
            found = socket.getaddrinfo(self.host, self.port, self.socket_type, socket.SOCK_STREAM)
            # The limit runs from the look-up's answer, as redis-py's did: a slow
            # resolver is no unreachable server.
            sock = connect_in_turn(found, time.monotonic() + within, self.socket_timeout)
            try:  # (redis-py's options, which it sets before connecting: as good after)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.socket_keepalive:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    for option, value in self.socket_keepalive_options.items():
                        sock.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:
                sock.close()
                raise
            return sock

    # SSLConnection's _connect wraps its base's socket in TLS: that base is now ours.
    class BoundedSSLConnection(SSLConnection, BoundedConnection):
        pass

    return BoundedConnection, BoundedSSLConnection


_CLIENTS: weakref.WeakSet[RedisRemote] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_CLIENTS):
        client._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def timed(connection: redis_py.connection.AbstractConnection) -> None:
    """Hold the answers on a connection just made to their deadline (before its
    handshake, whose answers are held too)."""
    connection._sock = _TimedSocket(connection._sock, connection.socket_timeout)


def _connected(connection: redis_py.connection.AbstractConnection) -> None:
    timed(connection)
    connection.on_connect()


class _TooBig(Exception):
    """An answer past the bytes its command's values may hold (``_asked.room``)."""

    def __init__(self, room: int) -> None:
        super().__init__(f"an answer past {room} bytes, more than the entries asked can be")
        self.size = room


class _TimedSocket:
    """A connection's socket whose reads of an answer end at a deadline: the timeout
    from the command's last byte sent, plus a second per MiB received since; and
    at the bytes the thread sending the command gave it room for (``_asked``).

    redis-py's socket timeout bounds each read alone: a server sending a byte
    within each held a command forever (an answer of 200 bytes at 0.2 s a byte
    took 40 s with a timeout of 2 s).  redis-py reads through ``recv`` on this
    thread, so each read waits no longer than what is left; past the deadline
    it is a timeout, as any other.  A second a MiB let a fast server's answer
    run on: a GET answered ``$4000000000`` and zeros held a compile 131 s with
    a timeout of 2 s, its memory grown to 11.7 GB.  Past its room a read is
    ``_TooBig``, which redis-py lets through after dropping the connection (a
    cluster's pipeline drops those of the other nodes it has not read yet).
    Everything else is the socket's.
    """

    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        self._sock = sock
        self._timeout = timeout
        self._wanted = sock.gettimeout()  # redis-py's own, which it changes for a poll
        self._due = float("inf")
        self._room = self._left = _ANSWER_BYTES

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)

    def settimeout(self, value: float | None) -> None:
        self._wanted = value
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._wanted

    def sendall(self, data: bytes, *flags: int) -> None:
        self._sock.sendall(data, *flags)
        if self._timeout is not None:
            self._due = time.monotonic() + self._timeout
        self._room = self._left = getattr(_asked, "room", _ANSWER_BYTES)

    def recv(self, size: int, *flags: int) -> bytes:
        data = self._read(self._sock.recv, size, *flags)
        self._got(len(data))
        return data

    def recv_into(self, buffer: bytearray, *args: int) -> int:  # (hiredis's parser's)
        got = self._read(self._sock.recv_into, buffer, *args)
        self._got(got)
        return got

    def _got(self, size: int) -> None:
        self._due += size / MIN_RATE
        self._left -= size
        if self._left < 0:
            raise _TooBig(self._room)

    def _read(self, read, *args):  # type: ignore[no-untyped-def]
        wanted = self._wanted
        left = self._due - time.monotonic()
        if wanted == 0 or (wanted is not None and left >= wanted):  # a poll, or time enough
            return read(*args)
        if left <= 0:
            raise TimeoutError("no whole answer within the timeout (and 1 s a MiB)")
        self._sock.settimeout(left)
        try:
            return read(*args)
        finally:
            self._sock.settimeout(wanted)


class RedisRemote(Remote):
    """The remote tier on one Redis server (see the module's docstring)."""

    def __init__(self, client: redis_py.Redis, settings: RemoteSettings) -> None:
        import redis as redis_py

        super().__init__(settings)
        self._redis = client
        self._denied = redis_py.exceptions.NoPermissionError
        self._refused = redis_py.exceptions.AuthenticationError
        self._password_given = settings.password is not None or bool(
            urlsplit(settings.url).password
        )
        self._prefix = settings.prefix
        self._ttl = settings.ttl
        self._mark = client.register_script(_MARK)
        self._release = client.register_script(_RELEASE)
        self._claims: dict[str, _Claim] = {}
        # Claims seen marked failed (their names), when (``time.monotonic``): ``claim``
        # gives the unowned claim for those, the mark being what refused it.
        self._failed_seen: dict[str, float] = {}
        self._claims_lock = threading.Lock()
        self._renewer: threading.Thread | None = None
        self._closed = threading.Event()
        _CLIENTS.add(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: the claims held are the parent's (the child's close must not
        release them), and the renewer is the parent's thread, absent here (the child's own
        claims were never renewed, and expired under its compiles).  Its lock may have been
        held at the fork.  (redis-py opens the child's connections itself.)"""
        self._claims = {}
        self._claims_lock = threading.Lock()
        self._renewer = None
        closed, self._closed = self._closed.is_set(), threading.Event()
        if closed:
            self._closed.set()

    def _name(self, soc: str, key: str) -> str:
        return f"{self._prefix}{soc}:{key}"

    def _call(self, what: str, func, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return func(*args, **kwargs)
        except Exception as e:  # (not only redis-py's own: see the module's docstring)
            raise self._failure(what, e) from None

    def _room(self, values: int, keys: int = 0) -> int:
        """The bytes the answers to commands asking ``values`` values (and ``keys`` keys'
        that are no values: claims) may hold."""
        return values * self.max_entry_bytes + (values + keys) * _KEY_BYTES + _ANSWER_BYTES

    def _fetch(self, what: str, room: int, func, *args, too_big: bool = False):  # type: ignore[no-untyped-def]
        """``_call``, its answers given ``room`` bytes (``too_big``: past them, _TooBig
        for the caller, not a RemoteError)."""
        _asked.room = room
        try:
            return func(*args)
        except _TooBig as e:
            if too_big:
                raise
            raise self._failure(what, e) from None
        except Exception as e:  # (not only redis-py's own: see the module's docstring)
            raise self._failure(what, e) from None
        finally:
            _asked.room = _ANSWER_BYTES

    def _get(self, name: str) -> bytes | RemoteCorrupt | None:
        """The value of ``name``: one over the entry cap is a RemoteCorrupt, cut off
        before it is read whole (as a bad value is, it is then stored over)."""
        _asked.room = self._room(1)
        try:
            return self._redis.get(name)
        except _TooBig as e:
            corrupt = RemoteCorrupt(f"a value over the entry cap: {e}", maybe_sound=True)
            corrupt.size = e.size
            return corrupt
        except Exception as e:
            raise self._failure("GET", e) from None
        finally:
            _asked.room = _ANSWER_BYTES

    def _failure(self, what: str, error: Exception) -> RemoteError:
        """The RemoteError for ``error``, in the server's words made fit for a message
        (``said``); a refused login says which setting to look at (redis-py's words for
        it name none)."""
        if not isinstance(error, self._refused):
            return RemoteError(f"{self.where}: {what}: {said(error, self.secrets)}")
        if self._password_given:
            why = "the server refused the user name or password"
            why += " (from OPCACHE_REMOTE_PASSWORD or the URL)"
        else:
            why = "the server wants a password: set OPCACHE_REMOTE_PASSWORD"
        return RemoteError(f"{self.where}: {why}")

    # -- entries ---------------------------------------------------------------------

    def get(self, soc: str, key: str) -> tuple[Entry, bytes] | None:
        value = self._get(self._name(soc, key))
        if value is None:
            return None
        got = (
            value if isinstance(value, RemoteCorrupt) else checked(key, value, self.max_entry_bytes)
        )
        if isinstance(got, RemoteCorrupt):
            raise got
        return got[0], got[1]

    def get_many(self, soc: str, keys: list[str]) -> dict[str, Fetched | RemoteCorrupt]:
        """The entries of ``keys`` that are there, by key (a bad value as its RemoteCorrupt)."""
        return self.watch(soc, keys, claims=False)[0]

    def have_many(self, soc: str, keys: list[str]) -> set[str]:
        """Which of ``keys`` are there: one EXISTS each, in one pipeline (no value sent)."""
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name(soc, key))
        answers = self._call("EXISTS", pipe.execute)
        return {key for key, there in zip(keys, answers, strict=True) if there}

    def watch(
        self, soc: str, keys: list[str], *, claims: bool = True
    ) -> tuple[dict[str, Fetched | RemoteCorrupt], set[str]]:
        """(the entries of ``keys`` that are there, the keys claimed), in one round trip.

        An answer past what the entry cap allows its values (``_TooBig``) holds a
        value another client with a bigger cap may have stored, sound to it: such
        values are found by their length (STRLEN) and are this client's corrupt
        ones (never read, stored over by its compile), the others asked again;
        not a remote error, which would pause the remote for every key."""
        try:
            return self._watch(soc, keys, claims, too_big=True)
        except _TooBig as e:
            cut = e
        lengths = self._lengths([self._name(soc, key) for key in keys])
        if lengths is None:  # (a server that cannot say: the answer past its room it is)
            raise self._failure("MGET", cut) from None
        big = {k for k, n in zip(keys, lengths, strict=True) if n > self._room(1) - _ANSWER_BYTES}
        found: dict[str, Fetched | RemoteCorrupt] = {}
        for key in big:
            found[key] = RemoteCorrupt("a value over the entry cap", maybe_sound=True)
        rest = [key for key in keys if key not in big]
        claimed: set[str] = set()
        if rest:  # (none big any more, a value replaced meanwhile: a remote error)
            more, claimed = self._watch(soc, rest, claims)
            found.update(more)
        return found, claimed

    def _lengths(self, names: list[str]) -> list[int] | None:
        """Each value's length (STRLEN, one pipeline), or None when the server will not
        say (an error, an answer that is no list of numbers)."""
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
        try:
            lengths = pipe.execute()
        except Exception as e:  # (as _call's: any failure is the remote's)
            log.debug("%s: STRLEN: %s", self.where, e)
            return None
        ok = len(lengths) == len(names) and all(type(n) is int for n in lengths)
        return lengths if ok else None

    def _watch(
        self, soc: str, keys: list[str], claims: bool, *, too_big: bool = False
    ) -> tuple[dict[str, Fetched | RemoteCorrupt], set[str]]:
        """``watch``, in one round trip (``too_big``: ``_fetch``'s)."""
        if len(keys) == 1 and not claims:  # a plain GET: a pipeline costs a hit 0.1 ms more
            value = self._get(self._name(soc, keys[0]))
            if value is None:
                return {}, set()
            if isinstance(value, RemoteCorrupt):
                return {keys[0]: value}, set()
            return {keys[0]: checked(keys[0], value, self.max_entry_bytes)}, set()
        pipe = self._redis.pipeline(transaction=False)
        batches = [keys[start : start + _MGET_KEYS] for start in range(0, len(keys), _MGET_KEYS)]
        prefix = self._name(soc, "")
        for batch in batches:
            names = [prefix + key for key in batch]
            # A batch's claims in its values' MGET: one command a poll, not two.
            pipe.mget(names + [name + CLAIM_SUFFIX for name in names] if claims else names)
        room = self._room(len(keys), len(keys) if claims else 0)
        answers = self._fetch("MGET", room, pipe.execute, too_big=too_big)
        found: dict[str, Fetched | RemoteCorrupt] = {}
        claimed: set[str] = set()
        for batch, values in zip(batches, answers, strict=True):
            if not isinstance(values, list):  # (a server answering an MGET with no list)
                raise RemoteError(f"{self.where}: MGET: the server's answer is no list")
            names = [prefix + key for key in batch]
            for key, value in zip(batch, values, strict=False):
                if value is not None:
                    found[key] = checked(key, value, self.max_entry_bytes)
            if claims:
                claim_names = [name + CLAIM_SUFFIX for name in names]
                claimed |= self._held(batch, claim_names, values[len(batch) :])
            # The batch's values let go once checked: the next batch's entries then
            # take their memory, where every value kept to the end grew the heap by
            # as much (a page fault per 4 KB: 2,000 4 KB hits made 5,100, 2,000 now).
            values.clear()
        return found, claimed

    def put(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
        if self.read_only:
            return 0
        value = self._value(soc, key, manifest, files)
        if value is None:
            return 0
        stored = self._write("SET", self._redis.set, self._name(soc, key), value, ex=self._ttl)
        return len(value) if stored else 0

    def replace(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
        """``put``: ``SET`` writes over the value there (a refused one leaves it)."""
        return self.put(soc, key, manifest, files)

    def put_claimed(
        self, soc: str, key: str, manifest: bytes, files: dict[str, bytes], claim: Claim | None
    ) -> int:
        """The entry and its claim marked stored, in one round trip (in that order)."""
        if not isinstance(claim, _Claim) or claim._released or claim._remote is not self:
            return super().put_claimed(soc, key, manifest, files, claim)
        value = None if self.read_only else self._value(soc, key, manifest, files)
        if value is None:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self._name(soc, key), value, ex=self._ttl)
        pipe.set(claim.name, _STORED, px=claim.millis)
        stored = self._write("SET", pipe.execute)
        if not stored or not stored[0]:
            return 0  # (the claim still ours: released as after any unsent store)
        claim._released = True
        with self._claims_lock:
            self._claims.pop(claim.token, None)
        return len(value)

    def put_many(self, soc: str, entries: list[tuple[str, bytes, dict[str, bytes]]]) -> list[int]:
        """Store several entries in one pipeline; the bytes sent for each (0: not sent)."""
        if self.read_only:
            return [0] * len(entries)
        values = [self._value(soc, *entry) for entry in entries]
        pipe = self._redis.pipeline(transaction=False)
        for (key, _, _), value in zip(entries, values, strict=True):
            if value is not None:
                pipe.set(self._name(soc, key), value, ex=self._ttl)
        stored = iter(self._write("SET", pipe.execute) or ())
        return [len(v) if v is not None and next(stored, False) else 0 for v in values]

    def _value(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> bytes | None:
        """The stored value of an entry, or None when it is over the size cap."""
        if len(manifest) + sum(map(len, files.values())) > self.max_entry_bytes:
            log.debug("%s/%s is over the remote's size cap: kept local only", soc, key)
            return None
        return pack(key, manifest, files)

    def discard(self, soc: str, key: str) -> None:
        if not self.read_only:
            self._write("DEL", self._redis.delete, self._name(soc, key))

    def _write(self, what: str, func, *args, **kwargs) -> object:  # type: ignore[no-untyped-def]
        """Run a write; False when the server's ACL refuses writes (we turn read-only)."""
        try:
            return func(*args, **kwargs)
        except self._denied as e:
            if not self.read_only:
                self.read_only = True
                log.warning(
                    "%s refuses our writes (%s): only reading it from now on",
                    self.where,
                    said(e, self.secrets),
                )
            return False
        except Exception as e:
            raise self._failure(what, e) from None

    # -- claims ----------------------------------------------------------------------

    def claim(self, soc: str, key: str, seconds: float) -> _Claim | None:
        """The key for one compile in the cluster, or None when another client holds it;
        the unowned claim (compile it unclaimed) when its last compile failed."""
        name = self._name(soc, key) + CLAIM_SUFFIX
        unowned = _Claim(self, name, "", 0, owned=False)
        seen = self._failed_seen.pop(name, None)
        if seen is not None and time.monotonic() - seen < _FAILED_SECONDS:
            unowned.failed_before = True
            return unowned  # (the mark refuses a claim: not asked for one)
        token = f"{os.uname().nodename}:{os.getpid()}:{os.urandom(8).hex()}"
        millis = max(int(seconds * 1000), 1)
        if not self.read_only:
            taken = self._write("SET NX", self._redis.set, name, token, nx=True, px=millis)
            if taken:
                return self._hold(_Claim(self, name, token, millis, owned=True), seconds)
            if not self.read_only:
                # Another client holds it, or its compile failed: a look at it
                # (``watch``, ``peek_claims``) says which.
                return None
        # Read-only: wait for a writer's claim; with none, compile unclaimed.
        if self._held([key], [name], [self._call("GET", self._redis.get, name)]):
            return None
        unowned.failed_before = self._failed_seen.pop(name, None) is not None
        return unowned

    def _hold(self, claim: _Claim, seconds: float) -> _Claim:
        with self._claims_lock:
            self._claims[claim.token] = claim
            if self._renewer is None:
                self._renewer = threading.Thread(
                    target=self._renew_claims, args=(seconds / 3,), name="opcache-claims",
                    daemon=True,
                )  # fmt: skip
                self._renewer.start()
        return claim

    def _held(self, keys: list[str], names: list[str], values: list[bytes | None]) -> set[str]:
        """Of ``keys``, those whose claim (named ``names``, holding ``values``) is held.
        One marked failed is not, and is remembered for ``claim``."""
        held = set()
        for key, name, value in zip(keys, names, values, strict=True):
            if value == _FAILED:
                seen = self._failed_seen
                if len(seen) > _FAILED_SEEN_KEPT:
                    seen.clear()  # (the keys of batches gone: a mark lasts seconds)
                seen[name] = time.monotonic()
            elif value:
                held.add(key)
        return held

    def peek_claims(self, soc: str, keys: list[str]) -> set[str]:
        """The keys a claim is held on: one MGET of their claims (in batches, one pipeline)."""
        names = [self._name(soc, key) + CLAIM_SUFFIX for key in keys]
        return self._held(keys, names, self._mget("MGET", names))

    def _mget(self, what: str, names: list[str]) -> list[bytes | None]:
        """The values of ``names``, ``_MGET_KEYS`` a command in one pipeline."""
        pipe = self._redis.pipeline(transaction=False)
        for start in range(0, len(names), _MGET_KEYS):
            pipe.mget(names[start : start + _MGET_KEYS])
        answers = self._fetch(what, self._room(0, len(names)), pipe.execute)
        return [value for values in answers for value in values]

    def claimed(self, soc: str, key: str) -> bool:
        name = self._name(soc, key) + CLAIM_SUFFIX
        return bool(self._held([key], [name], [self._call("GET", self._redis.get, name)]))

    def _renew_claims(self, every: float) -> None:
        """The renewer: a pass over the claims held every ``every`` seconds, counted from
        the last pass's start (counted from its end, a slow pass delayed the next)."""
        due = time.monotonic() + every
        while not self._closed.wait(max(due - time.monotonic(), 0.0)):
            due = time.monotonic() + every
            with self._claims_lock:
                held = list(self._claims.values())
            if held:
                self._renew_all(held)

    def _renew_all(self, held: list[_Claim]) -> None:
        """Renew ``held`` in one round trip (on a cluster, one per primary, side by side):
        one each, a pass of 64 claims 150 ms away took 9.6 s, longer than their life."""
        pipe = self._redis.pipeline(transaction=False)
        for claim in held:
            # EVAL, not the registered script's EVALSHA: redis-py checks a pipeline's
            # scripts first with a round trip of its own, and a cluster's pipeline
            # refuses EVALSHA (and its ``eval`` method, not the command).
            pipe.execute_command("EVAL", _RENEW, 1, claim.name, claim.token, claim.millis)
        try:
            pipe.execute()
        except Exception as e:  # they expire, and other clients compile their keys too
            log.debug("cannot renew %d claims: %s", len(held), said(e, self.secrets))

    def _drop(self, claim: _Claim, mark: bytes | None) -> None:
        """Let go of ``claim``: overwritten with ``mark`` (``_STORED``, ``_FAILED``), or
        deleted (None)."""
        with self._claims_lock:
            self._claims.pop(claim.token, None)
        try:
            if mark == _STORED:
                # Whoever holds the name now (us, or another client after ours
                # expired), the entry is there to fetch.
                self._redis.set(claim.name, _STORED, px=claim.millis)
            elif mark == _FAILED:
                # Only ours: another client's live compile, after ours expired, may
                # yet store the entry.
                millis = int(_FAILED_SECONDS * 1000)
                self._mark(keys=[claim.name], args=[claim.token, _FAILED, millis])
            else:
                self._release(keys=[claim.name], args=[claim.token])
        except Exception as e:  # it expires by itself
            log.debug("cannot release the claim %s: %s", claim.name, said(e, self.secrets))

    # -- maintenance -----------------------------------------------------------------

    def _scan(self, soc: str | None) -> list[bytes]:
        """This cache's names (of one chip): another cache's prefix may begin with ours."""
        pattern = _glob_escape(self._prefix) + (f"{_glob_escape(soc)}:*" if soc else "*")
        names = self._call("SCAN", lambda: list(self._redis.scan_iter(match=pattern, count=1000)))
        start = len(self._prefix.encode())
        return [name for name in names if _ours(name[start:])]

    def usage(self, soc: str | None = None) -> dict[str, object]:
        """Entries and bytes per chip under the prefix, and the server's memory settings."""
        chips: dict[str, dict[str, int]] = {}
        names = [n for n in self._scan(soc) if not n.endswith(CLAIM_SUFFIX.encode())]
        cut = len(self._prefix.encode())  # (bytes, not characters: a prefix may be é)
        for start in range(0, len(names), 1000):
            batch = names[start : start + 1000]
            pipe = self._redis.pipeline(transaction=False)
            for name in batch:
                pipe.strlen(name)
            sizes = self._call("STRLEN", pipe.execute)
            for name, size in zip(batch, sizes, strict=True):
                if type(size) is not int:  # (a proxy, or not a Redis: anything at all)
                    answer = said(repr(size), self.secrets)
                    raise RemoteError(f"{self.where}: STRLEN answered {answer}, not a length")
                # (a name anyone with write access chose: printed by `opcache remote stats`)
                chip = printable(name[cut:].decode(errors="replace").rpartition(":")[0], 100)
                row = chips.setdefault(chip, {"entries": 0, "bytes": 0})
                row["entries"] += 1
                row["bytes"] += int(size)
        return {"chips": dict(sorted(chips.items())), **self._memory()}

    def _memory(self) -> dict[str, object]:
        """The server's memory: used, its limit, its eviction policy."""
        return memory_of([self._call("INFO", self._redis.info, "memory")])

    def clear(self, soc: str | None = None) -> int:
        """Delete this cache's entries and claims (of one chip): never another's keys."""
        if self.read_only:
            raise RemoteError(f"{self.where}: the remote is read-only here")
        names = list(self._scan(soc))
        for start in range(0, len(names), 1000):
            self._call("UNLINK", self._redis.unlink, *names[start : start + 1000])
        return len([n for n in names if not n.endswith(CLAIM_SUFFIX.encode())])

    def warm_up(self) -> None:
        """Connect now (a PING), as the first command would."""
        self._call("PING", self._redis.ping)

    def close(self) -> None:
        self._closed.set()
        with self._claims_lock:
            held = list(self._claims.values())
        for claim in held:
            # Compiles still running (or left) at the close, not failed: one client
            # takes each over, as after a holder's death.
            claim._let_go(None)
        try:
            self._redis.close()
        except Exception as e:  # a connection that never was, or is gone already
            log.debug("cannot close the connection to %s: %s", self.where, said(e, self.secrets))


class _Claim(Claim):
    """A claim on a key; ``owned`` False for one a read-only client goes on without."""

    marks_stored = True

    def __init__(self, remote: RedisRemote, name: str, token: str, millis: int, *, owned: bool):
        self._remote = remote
        self.name = name
        self.token = token
        self.millis = millis
        self.owned = owned
        self._released = not owned

    def release(self) -> None:
        self._let_go(_FAILED)

    def stored(self) -> None:
        self._let_go(_STORED)

    def _let_go(self, mark: bytes | None) -> None:
        if not self._released:
            self._released = True
            self._remote._drop(self, mark)


def memory_of(servers: list[dict]) -> dict[str, object]:
    """The memory ``INFO`` of a server, or of each primary of a cluster, summed, as
    ``usage`` reports it: used, the limit (0: none, as soon as one has none), the
    eviction policy ("mixed" where they differ).  A server (a proxy, another program
    speaking RESP) may answer anything, which ``opcache remote stats`` prints: what
    is not a count is None, a policy is printed safe."""

    def counts(name: str) -> list[int | None]:
        return [v if type(v := node.get(name)) is int and v >= 0 else None for node in servers]

    used, limits = counts("used_memory"), counts("maxmemory")
    policies = {node.get("maxmemory_policy") for node in servers}
    policy = policies.pop() if len(policies) == 1 else "mixed"
    return {
        "used_memory": None if None in used else sum(used),  # type: ignore[arg-type]
        "maxmemory": None if None in limits else 0 if 0 in limits else sum(limits),  # type: ignore[arg-type]
        # (None: it says none, as a server that is no Redis: `remote stats` says nothing)
        "maxmemory_policy": None if policy is None else printable(str(policy), 100),
    }


def _ours(name: bytes) -> bool:
    """Whether ``name``, the prefix taken off, is one this cache writes: ``<soc>:<key>``,
    CANN's ``cann:<soc>:#index`` (an older opcache's), ``cann:<soc>:#index2`` and
    ``cann:<soc>:<namespace>:<kernel>`` (or ``:#index-<xx>``, a part of the index)
    (``cann_transfer.py``; its chips are ``is_cann_chip``'s), each maybe with its
    claim's suffix.  Another cache's prefix beginning with ours (``opcache:1:teamB:``
    under ``opcache:1:``) gives its names a part more: ``opcache remote clear``
    deleted them."""
    parts = name.split(b":")
    if parts[0] == b"cann" and len(parts) >= 3:
        index = parts[2] in (b"#index", b"#index2")
        if not index and len(parts) < 4:
            return False
        chip = b":".join(parts[:2] if index else parts[:3])
        return is_cann_chip(chip.decode(errors="replace"))
    # A chip and a key of opcache's own shapes: under a prefix shared with another
    # program (an empty one, ``app:``), its ``session:abc`` or ``user:42`` are not.
    soc, _, key = name.removesuffix(CLAIM_SUFFIX.encode()).partition(b":")
    return is_soc_version(soc.decode(errors="replace")) and is_key(key.decode(errors="replace"))


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
