"""Redis Cluster as the remote tier: ``redis+cluster://host:port[,host:port...]``.

``rediss+cluster://`` is the same with TLS (the ``ssl_*`` query options of
``rediss://``).  The nodes listed are where the client starts: it asks them
for the slot map and then talks to every primary itself (redis-py's
``RedisCluster``).

Keys and values are the single server's (``redis.py``): the same names, the
same checked value, the same claims (``SET NX PX`` on the claim's own key,
renewed, marked and released by a script on that one key; the claims held
renewed together, one pipeline per primary).  Names carry no hash tag:
entries spread over every primary by their own slot, and a batched look-up
is grouped by slot, one pipeline per primary (``mget_nonatomic``), never one
``MGET`` across slots (which a cluster refuses with ``CROSSSLOT``).
``opcache remote stats|clear`` scan every primary.

A primary that dies is, for its slots, a failure like a dead server's: a
``RemoteError``, so misses and a pause, never a failed compile; once its
replica took over (or it came back) the client finds the new slot map on
its next use.  The client waits as briefly as the single server's (its
connections are the single server's kind: ``connection_kind``), each answer
held to the same deadline, and never retries on its own.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlsplit

from .redis import (
    CLAIM_SUFFIX,
    RedisRemote,
    connection_kind,
    memory_of,
    no_client_setinfo,
    timed,
)
from .remote import RemoteError, said, secrets_of
from .value import checked

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..settings import RemoteSettings
    from . import Fetched, RemoteCorrupt


def connect(settings: RemoteSettings) -> RedisClusterRemote:
    """A client of the cluster whose nodes ``settings.url`` lists."""
    try:
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry
    except ImportError:
        raise RemoteError(
            "a Redis Cluster remote needs redis-py: pip install 'opcache[redis]' (or redis)"
        ) from None

    class TimedCluster(RedisCluster):
        def on_connect(self, connection):  # type: ignore[no-untyped-def]
            timed(connection)  # (the node's connections are made with this as theirs)
            super().on_connect(connection)

    parts = urlsplit(settings.url)
    _, _, hosts = parts.netloc.rpartition("@")
    try:
        options = query_options(parts.query)
    except ValueError as e:
        raise RemoteError(f"cannot use {settings.shown_url}: {e}") from None
    # The nodes' connections are ours (each connect bounded as a whole: redis.py's
    # connection_kind), TLS or not.  RedisCluster hands a connection class on only to
    # the pools of a cluster given by URL (else its nodes' Redis refuses the
    # argument), so the first node is given as one too: redis://, as the class brings
    # the TLS (rediss:// would put redis-py's own class back, and ssl=True is not a
    # connection's argument).
    options["connection_class"] = connection_kind(tls=parts.scheme == "rediss+cluster")
    if parts.username:
        options["username"] = unquote(parts.username)
    # A password in the URL is percent-encoded; OPCACHE_REMOTE_PASSWORD is as it is.
    password = settings.password
    if password is None and parts.password is not None:
        password = unquote(parts.password)
    if password is not None:
        options["password"] = password
    try:
        nodes = [_node(ClusterNode, hostport) for hostport in hosts.split(",")]
        # (the node's host as ClusterNode made it: "localhost" looked up once, not twice)
        first = nodes[0].host if ":" not in nodes[0].host else f"[{nodes[0].host}]"
        client = TimedCluster(
            url=f"redis://{first}:{nodes[0].port}",
            startup_nodes=nodes,
            retry=Retry(NoBackoff(), 0),
            socket_connect_timeout=min(0.5, settings.timeout / 4),
            socket_timeout=settings.timeout,
            health_check_interval=0,
            protocol=2,  # (as the single server's: see redis.py's connect)
            **no_client_setinfo(),
            **options,
        )
    except Exception as e:  # no node answered, a slot not served, a bad option
        why = said(e, secrets_of(settings))
        raise RemoteError(f"cannot use {settings.shown_url}: {why}") from None
    return RedisClusterRemote(client, settings)


def query_options(query: str) -> dict[str, object]:
    """The URL's query options as ``rediss://``'s are read (redis-py's parsers): given
    as they are, ``ssl_check_hostname=false`` was the string "false", true."""
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS

    options: dict[str, object] = {}
    for name, value in parse_qsl(query):
        parse = URL_QUERY_ARGUMENT_PARSERS.get(name)
        try:
            options[name] = value if parse is None else parse(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={value!r} is not a value it takes") from None
    return options


def _node(kind: type, hostport: str) -> object:
    if hostport.startswith("["):
        host, _, port = hostport[1:].partition("]")
        port = port[1:]
    else:
        host, _, port = hostport.partition(":")
    return kind(host, int(port) if port else 6379)


class RedisClusterRemote(RedisRemote):
    """The remote tier on a Redis Cluster (see the module's docstring)."""

    def _watch(
        self, soc: str, keys: list[str], claims: bool, *, too_big: bool = False
    ) -> tuple[dict[str, Fetched | RemoteCorrupt], set[str]]:
        """The entries of ``keys`` (and the keys claimed), grouped by slot: one
        pipeline per primary."""
        names = [self._name(soc, key) for key in keys]
        if claims:
            names += [name + CLAIM_SUFFIX for name in names[: len(keys)]]
        room = self._room(len(keys), len(names) - len(keys))
        values = self._fetch("MGET", room, self._redis.mget_nonatomic, names, too_big=too_big)
        found: dict[str, Fetched | RemoteCorrupt] = {}
        for at, key in enumerate(keys):
            value = values[at]
            if value is not None:
                values[at] = None  # (let go once checked, as RedisRemote.watch does)
                found[key] = checked(key, value, self.max_entry_bytes)
        if not claims:
            return found, set()
        return found, self._held(keys, names[len(keys) :], values[len(keys) :])

    def peek_claims(self, soc: str, keys: list[str]) -> set[str]:
        """The keys a claim is held on, their claims grouped by slot."""
        names = [self._name(soc, key) + CLAIM_SUFFIX for key in keys]
        tokens = self._fetch("MGET", self._room(0, len(names)), self._redis.mget_nonatomic, names)
        return self._held(keys, names, tokens)

    def _memory(self) -> dict[str, object]:
        """Every primary's memory, summed; the eviction policy if they all share one."""
        answers = self._call("INFO", self._redis.info, "memory", target_nodes=self._redis.PRIMARIES)
        each = list(answers.values()) if answers and "used_memory" not in answers else [answers]
        return memory_of(each)
