"""An HTTP cache server as the remote tier: ``http://host[:port]/path``, ``https://...``.

The plain HTTP cache protocol ccache's HTTP storage speaks, as nginx with
WebDAV (``dav_methods PUT DELETE; create_full_put_path on;``), bazel-remote
and object stores behind a gateway serve it: one object per entry,
``GET`` to fetch (404: absent), ``HEAD`` then ``PUT`` to store (an object
already there stands: another machine stored the same key), ``DELETE`` to
drop one (a key whose object failed its checks is stored over, not
kept).  The object of a key is::

    <URL's path>/ac/<sha256 of "<prefix><soc>:<key>", 64 hex digits>

bazel-remote's layout for its action cache (start it with
``--disable_http_ac_validation``: the value is ours, not a protobuf).  The
value is Redis's (``value.py``'s ``pack``): our own header, the manifest
and artifacts, an XXH3-128 of the whole; every value is checked whole before
it is used (``RemoteCorrupt`` otherwise), so a damaged, truncated or
foreign object is never served.

Credentials: a user name in the URL (``http://ci@host/...``) with
``OPCACHE_REMOTE_PASSWORD`` (or a password in the URL) is basic auth; a
password with no user name is sent as a bearer token.  Both are masked in
every message.  A 401 is a ``RemoteError`` naming the setting; a 403 on a
write turns the client read-only with one warning (the server allows this
client reads only).

Connections are kept open and reused, one per thread; a batch of look-ups
runs on at most ``_THREADS`` threads at once.  A forked child opens its own
connections and threads, never using its parent's.  Each request has a deadline:
the timeout, plus a second per MiB of value sent or received (``MIN_RATE``),
from connecting to the answer's last byte; a request past it is cut off
(``RemoteError``), so a server that sends a byte a second costs a miss.

No claims: every machine compiles the cold keys it misses (HTTP has no
atomic create a client could hold a lease with).  ``opcache remote
stats|clear`` are not supported: the protocol cannot list objects; age them
on the server.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import os
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote, urlsplit

from .._log import get_logger
from . import Remote, RemoteCorrupt, RemoteError
from .remote import MIN_RATE, connect_in_turn, said, secrets_of
from .value import checked, pack

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..settings import RemoteSettings
    from . import Fetched

log = get_logger(__name__)

_THREADS = 8  # look-ups of one batch in flight at once
_SLACK = 1 << 20  # bytes a value may hold beyond the entry cap (header, manifest)
_ANSWER_BYTES = 64 << 10  # of an answer that is not a value (a 404's page)
_CHUNK = 64 << 10  # a value is read this much at a time, each earning its time


def connect(settings: RemoteSettings) -> HttpRemote:
    """A client of the HTTP cache ``settings.url`` names (nothing is sent yet)."""
    return HttpRemote(settings)


_CLIENTS: weakref.WeakSet[HttpRemote] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_CLIENTS):
        client._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class HttpRemote(Remote):
    """The remote tier on an HTTP cache server (see the module's docstring)."""

    def __init__(self, settings: RemoteSettings) -> None:
        super().__init__(settings)
        parts = urlsplit(settings.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)  # (an IPv6 host needs it given)
        self._timeout = settings.timeout
        self._base = parts.path.rstrip("/") + "/ac/"
        self._prefix = settings.prefix
        self._headers = {"Connection": "keep-alive"}
        # A password in the URL is percent-encoded; OPCACHE_REMOTE_PASSWORD is as it is.
        password = settings.password
        if password is None and parts.password is not None:
            password = unquote(parts.password)
        if parts.username:  # (http://:secret@host/... names no user: a bearer token)
            pair = f"{unquote(parts.username)}:{password or ''}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
        elif password:
            self._headers["Authorization"] = f"Bearer {password}"
        # (the header's credentials too, base64 for basic auth: a server may quote them)
        self.secrets = secrets_of(
            settings, self._headers.get("Authorization", "").partition(" ")[2]
        )
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()  # every thread's, for close
        self._deadlines = _Deadlines()
        self._corrupt: set[tuple[str, str]] = set()  # keys whose object failed its checks
        self._told_too_big = False  # (a 413 said once: every big entry would say it)
        _CLIENTS.add(self)

    def _forget_after_fork(self) -> None:
        """Start afresh in a forked child, never touching what the parent's are: its kept
        sockets are the parent's too (each process would read the other's answers), its
        pool counts threads the child has not got (a batch waited for them forever), and
        its locks may have been held by a thread of the parent's at the fork."""
        self._local = threading.local()
        self._pool = None
        self._pool_lock = threading.Lock()
        self._open = set()
        self._deadlines = _Deadlines()

    def _path(self, soc: str, key: str) -> str:
        name = hashlib.sha256(f"{self._prefix}{soc}:{key}".encode()).hexdigest()
        return self._base + name  # (the URL's path as written: percent-encoded already)

    # -- requests --------------------------------------------------------------------

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = kind(self._host, self._port, timeout=self._timeout)
            self._local.conn = conn
            self._local.used = False
            with self._pool_lock:
                self._open.add(conn)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._pool_lock:
                self._open.discard(conn)
            conn.close()

    def _request(
        self, method: str, path: str, body: bytes | None = None
    ) -> tuple[int, bytes | None]:
        """(status, body of a 200 GET) over this thread's kept connection.

        A kept connection the server closed meanwhile is opened again once, within
        the same deadline: the timeout bounds the request, however many tries.
        """
        deadline = time.monotonic() + self._timeout + len(body or b"") / MIN_RATE
        for attempt in (1, 2):
            conn = self._connection()
            reused = self._local.used
            try:
                try:
                    status, data, whole = self._exchange(conn, method, path, body, deadline)
                finally:
                    late = self._deadlines.forget(conn)
                if late:  # cut off: a short read ended the body, not its last byte
                    raise TimeoutError
                self._local.used = True
                if not whole:
                    self._drop_connection()  # (a page left unread leaves it unusable)
                return status, data
            except RemoteCorrupt:
                self._drop_connection()
                raise
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                self._drop_connection()
                if reused and attempt == 1 and not late:
                    continue
                raise self._error(method, e, late) from None
            except Exception as e:  # refused, timed out, a bad certificate, a bad answer
                self._drop_connection()
                raise self._error(method, e, late) from None
        raise AssertionError("unreachable")

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        method: str,
        path: str,
        body: bytes | None,
        deadline: float,
    ) -> tuple[int, bytes | None, bool]:
        """(status, body of a 200 GET, whether the connection can be used again)."""
        self._deadlines.watch(conn, deadline)
        if conn.sock is None:  # connected here, then watched again: cut off if late meanwhile
            # Each of the name's addresses within the deadline, not the whole timeout
            # each (the deadline's thread cannot cut off a connect: it has no socket of
            # the connection's yet); then the timeout for each read and write, as
            # http.client's own.
            timeout = self._timeout
            conn._create_connection = (  # type: ignore[method-assign]
                lambda address, *_: connect_in_turn(
                    socket.getaddrinfo(*address, type=socket.SOCK_STREAM), deadline, timeout
                )
            )
            conn.connect()
            self._deadlines.watch(conn, deadline)
        conn.request(method, path, body=body, headers=self._headers)
        response = conn.getresponse()
        data = None
        if method == "GET" and response.status == 200:
            data = self._read_body(response, conn, deadline)
        else:
            response.read(_ANSWER_BYTES)  # an error page: read a little, never all
        return response.status, data, not response.will_close and response.isclosed()

    def _error(self, method: str, e: Exception, late: bool) -> RemoteError:
        if late:
            why = f"no whole answer within the timeout ({self._timeout:g} s, and 1 s a MiB)"
        elif isinstance(e, ValueError) and not isinstance(e, OSError):
            # http.client's text quotes the header it refused (an SSL error is not one)
            why = f"{type(e).__name__}: a header or the path cannot be sent"
        else:  # (BadStatusLine's text is the server's status line: its bytes)
            why = said(e, self.secrets)
        return RemoteError(f"{self.where}: {method}: {why}")

    def _read_body(
        self,
        response: http.client.HTTPResponse,
        conn: http.client.HTTPConnection,
        deadline: float,
    ) -> bytes:
        """The body, at most the entry cap's worth: a server sending more is not one of ours."""
        limit = self.max_entry_bytes + _SLACK
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > limit:
            error = RemoteCorrupt(
                f"an object of {length} bytes, over the entry cap", maybe_sound=True
            )
            error.size = 0
            raise error
        chunks, got = [], 0
        while got <= limit and (chunk := response.read(_CHUNK)):
            chunks.append(chunk)
            got += len(chunk)
            self._deadlines.watch(conn, deadline + got / MIN_RATE)
        if got > limit:
            error = RemoteCorrupt("an object over the entry cap", maybe_sound=True)
            error.size = got
            raise error
        return b"".join(chunks)

    def _failure(self, method: str, status: int) -> RemoteError:
        if status == 401:
            given = "Authorization" in self._headers
            why = "refused the credentials" if given else "wants credentials"
            return RemoteError(
                f"{self.where}: the server {why} (OPCACHE_REMOTE_PASSWORD, with a user name "
                "in the URL for basic auth, without one for a bearer token)"
            )
        return RemoteError(f"{self.where}: {method} answered HTTP {status}")

    # -- entries ---------------------------------------------------------------------

    def _get_one(self, soc: str, key: str) -> Fetched | RemoteCorrupt | None:
        try:
            status, data = self._request("GET", self._path(soc, key))
        except RemoteCorrupt as e:
            self._corrupt.add((soc, key))
            return e
        if status == 404:
            return None
        if status != 200 or data is None:
            raise self._failure("GET", status)
        got = checked(key, data, self.max_entry_bytes)
        if isinstance(got, RemoteCorrupt):
            self._corrupt.add((soc, key))
        return got

    def get_many(self, soc: str, keys: list[str]) -> dict[str, Fetched | RemoteCorrupt]:
        """The objects of ``keys``, fetched on up to ``_THREADS`` kept connections at once."""
        if len(keys) == 1:
            answers = [self._get_one(soc, keys[0])]
        else:
            answers = list(self._threads().map(lambda key: self._get_one(soc, key), keys))
        return {key: got for key, got in zip(keys, answers, strict=True) if got is not None}

    def have_many(self, soc: str, keys: list[str]) -> set[str]:
        """Which of ``keys`` are there: a ``HEAD`` each, on the same bounded threads."""

        def there(key: str) -> bool:
            status, _ = self._request("HEAD", self._path(soc, key))
            if status in (200, 404):
                return status == 200
            raise self._failure("HEAD", status)

        answers = list(self._threads().map(there, keys))
        return {key for key, found in zip(keys, answers, strict=True) if found}

    def _threads(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="opcache-http")
            return self._pool

    def put(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
        return self._put(soc, key, manifest, files, keep=True)

    def replace(self, soc: str, key: str, manifest: bytes, files: dict[str, bytes]) -> int:
        """A ``PUT`` over the object there (a refused one leaves that one as it was)."""
        return self._put(soc, key, manifest, files, keep=False)

    def _put(
        self, soc: str, key: str, manifest: bytes, files: dict[str, bytes], *, keep: bool
    ) -> int:
        if self.read_only or len(manifest) + sum(map(len, files.values())) > self.max_entry_bytes:
            return 0
        path = self._path(soc, key)
        if keep and (soc, key) not in self._corrupt:  # a bad object there is replaced, not kept
            status, _ = self._request("HEAD", path)
            if status == 200:
                return 0  # another machine stored it
            if status == 401 or status >= 500:
                raise self._failure("HEAD", status)
        value = pack(key, manifest, files)
        status, _ = self._request("PUT", path, value)
        if status in (200, 201, 204):
            self._corrupt.discard((soc, key))
            return len(value)
        if status in (403, 405):
            self._refused_writes(status)
            return 0
        if status == 413:  # (nginx's default body limit is 1 MB: a big kernel stays local)
            if not self._told_too_big:
                self._told_too_big = True
                log.warning(
                    "%s refuses a value of %d bytes as too big (HTTP 413): such entries stay "
                    "local (raise its body limit, nginx's client_max_body_size)",
                    self.where,
                    len(value),
                )
            return 0
        raise self._failure("PUT", status)

    def _refused_writes(self, status: int) -> None:
        if not self.read_only:
            self.read_only = True
            log.warning(
                "%s refuses our writes (HTTP %d): only reading it from now on", self.where, status
            )

    def discard(self, soc: str, key: str) -> None:
        if self.read_only:
            return
        status, _ = self._request("DELETE", self._path(soc, key))
        if status in (403, 405):
            self._refused_writes(status)
        elif status not in (200, 202, 204, 404):
            raise self._failure("DELETE", status)

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._deadlines.stop()
        with self._pool_lock:
            conns, self._open = self._open, set()
        for conn in conns:
            conn.close()


class _Deadlines:
    """Cuts off the requests that outlive their deadline, from one thread.

    A socket's timeout bounds each read and write alone: a server sending a
    byte a second would hold a request forever.  Shutting the socket down
    wakes whatever read or write blocks on it, in whichever thread.  A forked
    child's client makes a new one: the watching thread is the parent's.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._due: dict[http.client.HTTPConnection, float] = {}
        self._cut: set[http.client.HTTPConnection] = set()
        self._watching = False
        self._number = 0  # the watching thread's: a new number ends it

    def watch(self, conn: http.client.HTTPConnection, deadline: float) -> None:
        """Cut ``conn`` off at ``deadline``, unless forgotten before."""
        with self._changed:
            if not self._watching:
                self._watching, self._number = True, self._number + 1
                thread = threading.Thread(
                    target=self._run,
                    args=(self._number,),
                    name="opcache-http-deadlines",
                    daemon=True,
                )
                thread.start()
            earliest = min(self._due.values(), default=None)
            self._due[conn] = deadline
            if earliest is None or deadline < earliest:  # (else it wakes in time anyway)
                self._changed.notify()

    def forget(self, conn: http.client.HTTPConnection) -> bool:
        """Stop watching ``conn``: True if it was cut off."""
        with self._changed:
            self._due.pop(conn, None)
            cut = conn in self._cut
            self._cut.discard(conn)
            return cut

    def stop(self) -> None:
        with self._changed:
            self._watching, self._number = False, self._number + 1
            self._changed.notify()

    def _run(self, number: int) -> None:
        with self._changed:
            while self._number == number:
                now = time.monotonic()
                for conn, deadline in list(self._due.items()):
                    if deadline <= now:
                        del self._due[conn]
                        self._cut.add(conn)
                        if conn.sock is not None:  # (else connecting: watched again after)
                            # The plain socket's shutdown: an SSL socket's own drops its
                            # TLS state under the thread reading it.
                            with contextlib.suppress(OSError):
                                socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
                next_due = min(self._due.values(), default=None)
                self._changed.wait(None if next_due is None else next_due - now)
