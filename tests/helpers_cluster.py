"""A real Redis Cluster for the tests: three primaries on loopback ports.

Three ``redis-server`` processes (``helpers_redis``'s binary) with
``cluster-enabled yes``, each in a folder of its own (its ``nodes.conf``),
made one cluster by ``redis-cli --cluster create``.  ``kill`` stops one
primary as a crash would; ``restart`` starts it again on its port from its
``nodes.conf``, and waits until every node says the cluster is whole.  With
``replicas``, each primary has a replica, and ``wait_failed_over`` waits
until a killed primary's replica serves its slots.  With ``tls`` (certificates
of ``helpers_tls``, and a server binary built with TLS), the nodes speak TLS
only, to their clients, on their cluster bus and to their replicas, and
want a client certificate of the CA (the helpers' clients give theirs):
``url`` is then ``rediss+cluster://`` with the CA and that certificate.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from helpers_redis import RedisServer, free_port
from helpers_tls import Certificates, TlsRedisServer, tls_query

NODES = 3
_CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
_CLUSTER_ARGS += ("--cluster-node-timeout", "3000")
# A replica takes over however long ago it last heard its primary (the default, 10
# node timeouts, can leave a test's idle replica unfit to stand in).
_CLUSTER_ARGS += ("--cluster-replica-validity-factor", "0")
_TLS_ARGS = ("--tls-cluster", "yes", "--tls-replication", "yes")


def find_cli(server_binary: str) -> str | None:
    """The ``redis-cli`` beside the server binary, else on PATH."""
    beside = Path(server_binary).parent / "redis-cli"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


def _cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it) is free and exists too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port


class Cluster:
    """Three primaries (and a replica of each, with ``replicas``): every slot served,
    each node by its own folder.  With replicas, ``nodes[:3]`` are the primaries."""

    def __init__(
        self,
        server_binary: str,
        cli: str,
        folder: Path,
        *,
        replicas: bool = False,
        tls: Certificates | None = None,
    ) -> None:
        self.cli = cli
        self.replicas = replicas
        self.tls = tls
        count = NODES * 2 if replicas else NODES
        self.nodes: list[RedisServer] = [
            RedisServer(server_binary, folder / f"node{i}")
            if tls is None
            else TlsRedisServer(server_binary, folder / f"node{i}", tls, clients_need_certs=True)
            for i in range(count)
        ]
        for node in self.nodes:
            node.port = _cluster_port()  # (with TLS, its TLS port: the bus is 10000 above)
        self.args = _CLUSTER_ARGS + (_TLS_ARGS if tls else ())

    @property
    def hosts(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def url(self) -> str:
        if self.tls is None:
            return "redis+cluster://" + self.hosts
        client = self.tls.client
        query = tls_query(self.tls, ssl_certfile=client.cert, ssl_keyfile=client.key)
        return "rediss+cluster://" + self.hosts + query

    def start(self) -> None:
        try:
            for node in self.nodes:
                self._start_first(node)
            argv = [self.cli, "--cluster", "create"]
            if self.tls is not None:
                argv += ["--tls", "--cacert", str(self.tls.ca.cert)]
                argv += ["--cert", str(self.tls.client.cert), "--key", str(self.tls.client.key)]
            argv += [f"127.0.0.1:{n.port}" for n in self.nodes]
            argv += ["--cluster-replicas", "1" if self.replicas else "0", "--cluster-yes"]
            subprocess.run(argv, check=True, capture_output=True, timeout=60)
            self.wait_whole()
        except BaseException:
            self.stop()
            raise

    def _start_first(self, node: RedisServer, tries: int = 3) -> None:
        """Start ``node`` on a free port, another one if its port or bus port was taken
        meanwhile (a port is free when picked, then any process's connection may take
        it: the node exits at once)."""
        for left in range(tries - 1, -1, -1):
            try:
                node.start(*self.args)
                return
            except RuntimeError:
                if left == 0 or node.proc is None or node.proc.poll() is None:
                    raise
                node.port = _cluster_port()

    def wait_whole(self, timeout: float = 60) -> None:
        """Until every running node says cluster_state:ok (all slots served)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(
                    n.client().execute_command("CLUSTER INFO").get("cluster_state") == "ok"
                    for n in self.nodes
                    if n.proc is not None
                ):
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the cluster was not whole within {timeout} s")

    def flush(self) -> None:
        for node in self.nodes:
            node.client().flushall()

    def ready(self) -> None:
        """Every node up (a test may have killed one) and emptied."""
        for index, node in enumerate(self.nodes):
            if node.proc is None:
                self.restart(index)
        self.flush()

    def kill(self, index: int) -> None:
        self.nodes[index].kill()

    def wait_failed_over(self, index: int, timeout: float = 60) -> None:
        """Until the live nodes serve every slot without node ``index`` (its replica
        promoted) and say the cluster is whole."""
        dead = self.nodes[index].port
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                live = [n for n in self.nodes if n.proc is not None]
                slots = live[0].client().execute_command("CLUSTER SLOTS")
                if all(int(row[2][1]) != dead for row in slots):
                    self.wait_whole(timeout)
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no failover within {timeout} s")

    def restart(self, index: int) -> None:
        self.nodes[index].start(*self.args)
        self.wait_whole()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
