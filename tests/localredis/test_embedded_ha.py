"""The local high-availability Redis (pdserve.localredis.embedded_ha and `pdserve redis --sentinel /
--cluster`), checked with redis-py's own synchronous Sentinel and Cluster clients on real processes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import quote, unquote, urlsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from pdserve.cli import main
from pdserve.localredis.embedded_ha import EmbeddedCluster, EmbeddedSentinel, cluster_info

pytestmark = pytest.mark.timeout(120)

PASSWORD = 'p@ss w:rd/%"x'  # every character a URL or a config file could trip on


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


NO_RETRY = Retry(NoBackoff(), 0)  # redis-py retries AuthenticationError (a ConnectionError) with backoff


def node_client(port: int, password: str | None = PASSWORD) -> redis.Redis:
    return redis.Redis(port=port, password=password, socket_timeout=5, decode_responses=True, retry=NO_RETRY)


def test_sentinel_replicates_fails_over_twice_and_wants_the_password() -> None:
    ha = EmbeddedSentinel(password=PASSWORD)
    try:
        ha.start()
        first, second = ha.nodes
        hosts = ",".join(f"127.0.0.1:{p}" for p in ha.sentinel_ports)
        assert ha.url == f"redis+sentinel://:{quote(PASSWORD, safe='')}@{hosts}/pdserve/0"
        assert unquote(urlsplit(ha.url).password or "") == PASSWORD
        assert ha.sentinel_addresses == [("127.0.0.1", p) for p in ha.sentinel_ports]

        sentinel = Sentinel(ha.sentinel_addresses, socket_timeout=5, password=PASSWORD)
        assert sentinel.discover_master("pdserve") == ("127.0.0.1", first.port)
        assert ha.primary() is first
        primary = sentinel.master_for("pdserve", decode_responses=True)
        primary.set("k1", "v1")
        assert primary.execute_command("WAIT", 1, 5000) == 1  # the replica has it
        replica = sentinel.slave_for("pdserve", decode_responses=True)
        assert replica.execute_command("ROLE")[0] == "slave" and replica.get("k1") == "v1"

        for password in (None, "wrong"):  # the data nodes want the password; the Sentinels do not
            stranger = Sentinel(ha.sentinel_addresses, socket_timeout=5, password=password, retry=NO_RETRY)
            with pytest.raises(redis.AuthenticationError):
                stranger.master_for("pdserve").set("k", "v")

        # round 1: the primary crashes, the Sentinels promote the replica
        assert ha.kill_primary() is first and refused(first.port)
        assert ha.wait_for_failover(first.port, timeout_s=15) is second
        primary.set("k2", "v2")  # the same master_for client finds the new primary
        assert node_client(second.port).mget("k1", "k2") == ["v1", "v2"]
        assert node_client(second.port).execute_command("ROLE")[0] == "master"

        # the old primary comes back as a replica of the new one (not as a primary the Sentinels
        # would have to demote: +convert-to-slave)
        events = [redis.Redis(port=p).pubsub() for p in ha.sentinel_ports]
        for pubsub in events:
            pubsub.subscribe("+convert-to-slave")
        ha.restart(first)
        converted = [m for e in events for m in iter(e.get_message, None) if m["type"] == "message"]
        assert not converted
        for pubsub in events:
            pubsub.close()
        role = node_client(first.port).execute_command("ROLE")
        assert role[0] == "slave" and int(role[2]) == second.port
        assert node_client(first.port).get("k2") == "v2"

        # round 2: back to the first node
        assert ha.kill_primary() is second
        assert ha.wait_for_failover(second.port, timeout_s=15) is first
        primary.set("k3", "v3")
        assert node_client(first.port).mget("k1", "k2", "k3") == ["v1", "v2", "v3"]
        assert ha.primary() is first
        assert not [f for n in ha.nodes for f in n.workdir.iterdir()]  # replication kept nothing on disk
    finally:
        ha.close()
    assert all(refused(p) for p in [first.port, *ha.sentinel_ports])
    assert not ha.workdir.exists()


def test_cluster_spreads_the_slots_over_three_primaries_and_wants_the_password() -> None:
    with pytest.raises(ValueError, match="at least 3 primaries"):
        EmbeddedCluster(2)
    ha = EmbeddedCluster(3, password=PASSWORD)
    try:
        ha.start()
        ports = [n.port for n in ha.nodes]
        assert ha.url == f"redis+cluster://:{quote(PASSWORD, safe='')}@" + ",".join(
            f"127.0.0.1:{p}" for p in ports
        )
        for port in ports:
            info = cluster_info(node_client(port))
            assert info["cluster_state"] == "ok" and info["cluster_slots_assigned"] == "16384"
            assert info["cluster_known_nodes"] == "3" and info["cluster_size"] == "3"

        client = RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports],
            password=PASSWORD,
            decode_responses=True,
        )
        owners: dict[int, str] = {}  # port -> a key whose slot that node serves
        for tag in "abcdefghijklmnopqrstuvwxyz":
            key = f"{{{tag}}}:k"
            owners.setdefault(client.get_node_from_key(key).port, key)
        assert sorted(owners) == sorted(ports)
        for port, key in owners.items():
            client.set(key, f"on {port}")
            direct = node_client(port)  # no redirection: the key lives on that node
            assert direct.get(key) == f"on {port}"
            assert direct.execute_command("CLUSTER KEYSLOT", key) == client.keyslot(key)
        client.close()

        with pytest.raises(redis.AuthenticationError):
            node_client(ports[0], password=None).get("x")
    finally:
        ha.close()
    assert all(refused(p) for p in ports) and not ha.workdir.exists()


def run_cli(processes: int, *args: str) -> tuple[subprocess.Popen[str], str, dict[int, int]]:
    """Start `pdserve redis ARGS`; return the process, the URL it prints and {port: pid} of the
    ``processes`` processes it lists after it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "redis", *args], stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    try:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"serving at (\S+);", line := proc.stderr.readline())):
            assert line and time.monotonic() < deadline, "no startup line"
        children = {}
        for _ in range(processes):
            line = proc.stderr.readline()
            m = re.search(r"on 127\.0\.0\.1:(\d+) \(pid (\d+)\)", line)
            assert m, line
            children[int(m[1])] = int(m[2])
    except BaseException:  # a failed check or pytest-timeout: leave no Redis behind
        stop(proc)
        raise
    return proc, found[1], children


def stop(proc: subprocess.Popen[str]) -> None:
    """After a failed check: SIGTERM, so that it still stops its children."""
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)


def hosts_of(url: str) -> list[tuple[str, int]]:
    netloc = urlsplit(url).netloc
    return [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in netloc.split(","))]


def test_cli_sentinel_serves_until_sigint_then_stops_every_process() -> None:
    proc, url, children = run_cli(5, "--sentinel")
    try:
        assert url.startswith("redis+sentinel://127.0.0.1:") and url.endswith("/pdserve/0")
        sentinels = hosts_of(url)
        assert len(sentinels) == 3 and {p for _, p in sentinels} < set(children)
        primary = Sentinel(sentinels, socket_timeout=5).master_for("pdserve", decode_responses=True)
        primary.set("k", "v")
        assert primary.get("k") == "v"
        primary.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        stop(proc)
    assert all(gone(pid) for pid in children.values())
    assert all(refused(port) for port in children)


def test_cli_cluster_serves_until_sigterm_then_stops_every_process() -> None:
    proc, url, children = run_cli(3, "--cluster", "3")
    try:
        assert url.startswith("redis+cluster://127.0.0.1:")
        nodes = hosts_of(url)
        assert len(nodes) == 3 and sorted(children) == sorted(p for _, p in nodes)
        client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], decode_responses=True)
        for key in ("{a}", "{b}", "{c}"):
            client.set(key, key)
        assert client.mget_nonatomic("{a}", "{b}", "{c}") == ["{a}", "{b}", "{c}"]
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        stop(proc)
    assert all(gone(pid) for pid in children.values())
    assert all(refused(port) for port in children)


def test_cli_refuses_ha_modes_beyond_loopback_too_small_clusters_and_both_at_once(capsys) -> None:
    assert main(["redis", "--sentinel", "--bind", "0.0.0.0", "--password", "pw"]) == 2
    assert "--bind 0.0.0.0" in capsys.readouterr().err
    assert main(["redis", "--cluster", "3", "--bind", "10.1.2.3"]) == 2
    assert "--bind 10.1.2.3" in capsys.readouterr().err
    assert main(["redis", "--cluster", "2"]) == 2
    assert "at least 3 primaries" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["redis", "--sentinel", "--cluster", "3"])
    assert exited.value.code == 2 and "not allowed with" in capsys.readouterr().err
