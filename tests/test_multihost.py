"""Two hosts for real: prefill and decode in two network namespaces joined by a veth pair, the KV
cache crossing that link over Mooncake TCP; Redis and the router in the root namespace, reached by
each host over its own veth link. Greedy output must equal a mixed instance's, token for token and
(batch-invariant mode) logprob for logprob.

Needs root and iproute2 (`ip`); skips with the reason elsewhere (CI runs it as root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from pdserve.scheduler import Keys
from pdserve.scheduler.embedded import EmbeddedRedis, free_port

pytestmark = [pytest.mark.usefixtures("mooncake_ready"), pytest.mark.timeout(300)]

KV_NET = "10.231.0"  # the link between the two hosts: P is .1, D is .2
PROMPTS = ["Hello there", "The KV cache crosses a veth link between two network namespaces. " * 3]


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts():
    """Namespaces ``P`` and ``D``: a kv link between them, and each linked to the root namespace."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        reason = "network namespaces need root and iproute2 (`ip`)"
        if os.environ.get("PDSERVE_REQUIRE_MULTIHOST"):
            pytest.fail(reason)
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    ns = {"P": f"pdP{tag}", "D": f"pdD{tag}"}
    try:
        for i, (side, name) in enumerate(ns.items(), start=1):
            sh("ip", "netns", "add", name)
            sh("ip", "-n", name, "link", "set", "lo", "up")
            root_end, host_end = f"cp{side}{tag}", f"cp{side}i{tag}"  # control-plane link to the root
            sh("ip", "link", "add", root_end, "type", "veth", "peer", "name", host_end, "netns", name)
            sh("ip", "addr", "add", f"10.231.{i}.1/30", "dev", root_end)
            sh("ip", "link", "set", root_end, "up")
            sh("ip", "-n", name, "addr", "add", f"10.231.{i}.2/30", "dev", host_end)
            sh("ip", "-n", name, "link", "set", host_end, "up")
        sh("ip", "link", "add", f"kvP{tag}", "netns", ns["P"], "type", "veth", "peer", "name", f"kvD{tag}",
           "netns", ns["D"])  # fmt: skip
        for side, last in (("P", 1), ("D", 2)):
            sh("ip", "-n", ns[side], "addr", "add", f"{KV_NET}.{last}/24", "dev", f"kv{side}{tag}")
            sh("ip", "-n", ns[side], "link", "set", f"kv{side}{tag}", "up")
        yield ns
    finally:
        for name in ns.values():  # deleting a namespace deletes its veth ends, and so their peers
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


class Procs:
    """Child processes this test started, stopped by pid (SIGTERM: workers drain)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, netns: str | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        proc = subprocess.Popen(cmd, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> list[str]:
        """SIGTERM all; what did not end on its own (a worker not exiting 0, anything killed)."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        bad = []
        for p in self.procs:
            try:
                code = p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                code = p.wait()
            # workers drain and exit 0; uvicorn re-raises SIGTERM after its graceful shutdown
            if code not in ((0, -signal.SIGTERM) if "router" in p.args else (0,)):
                bad.append(f"{' '.join(map(str, p.args))}: exit {code}")
        return bad


def wait_for_instances(url: str, ids: set[str], procs: Procs, timeout_s: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs.procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode}"
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            instances = httpx.get(url + "/v1/instances", timeout=2).json()["instances"]
            if ids <= {i["id"] for i in instances}:
                return instances
        time.sleep(0.3)
    raise AssertionError(f"instances {ids} not live after {timeout_s} s")


def instance(url: str, instance_id: str) -> dict:
    instances = httpx.get(url + "/v1/instances", timeout=2).json()["instances"]
    return next(i for i in instances if i["id"] == instance_id)


def wait_until(predicate, timeout_s: float = 15) -> None:
    """Registrations refresh every ttl/3: poll what they say."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.3)


def last_added(client, key: str) -> tuple[int, ...]:
    """Id of the last entry ever added to a stream (inbox entries are deleted once handled)."""
    last = client.xinfo_stream(key)["last-generated-id"] if client.exists(key) else b"0-0"
    return tuple(int(part) for part in last.split(b"-"))


def completion(url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"logprobs": 2, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_kv_crosses_hosts_over_mooncake_and_output_equals_mixed(hosts, tiny_model_dir, tmp_path) -> None:
    from redis import Redis

    def redis_client(url: str) -> Redis:
        return Redis.from_url(url)

    redis = EmbeddedRedis(workdir=tmp_path, bind=("127.0.0.1", "10.231.1.1", "10.231.2.1"))
    redis.start()
    procs = Procs()
    engine = ["--num-blocks", "256", "--max-model-len", "1024", "--threads", "1"]
    try:
        split, solo = f"split{uuid.uuid4().hex[:6]}", f"solo{uuid.uuid4().hex[:6]}"
        for side, i, last in (("P", 1, 1), ("D", 2, 2)):
            role = "prefill" if side == "P" else "decode"
            procs.start(
                "worker", "--role", role, "--model", str(tiny_model_dir), "--instance-id", f"{role}-{split}",
                "--redis-url", f"redis://10.231.{i}.1:{redis.port}/0", "--cluster", split,
                "--hostname", f"host-{side}", "--kv-transfer", "both", "--transfer-address", f"{KV_NET}.{last}",
                *engine, netns=hosts[side],
            )  # fmt: skip
        procs.start("worker", "--role", "mixed", "--model", str(tiny_model_dir), "--instance-id", f"mixed-{solo}",
                    "--redis-url", redis.url, "--cluster", solo, *engine)  # fmt: skip
        urls = {}
        for cluster in (split, solo):
            port = free_port()
            procs.start("router", "--port", str(port), "--redis-url", redis.url, "--cluster", cluster)
            urls[cluster] = f"http://127.0.0.1:{port}"
        live = wait_for_instances(urls[split], {f"prefill-{split}", f"decode-{split}"}, procs)
        wait_for_instances(urls[solo], {f"mixed-{solo}"}, procs)
        decode = next(i for i in live if i["role"] == "decode")
        assert decode["transfer"]["endpoint"]["mooncake"]["session"].startswith(f"{KV_NET}.2:")
        client, inbox = redis_client(redis.url), Keys(split).inbox(f"prefill-{split}")
        model = tiny_model_dir.name
        for prompt in PROMPTS:
            before = last_added(client, inbox)
            got, want = completion(urls[split], model, prompt), completion(urls[solo], model, prompt)
            assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
            assert got["logprobs"] == want["logprobs"]
            assert last_added(client, inbox) > before  # prefilled on P, not served by D alone
        client.close()
        idle = decode["kv"]["free_blocks"]
        wait_until(lambda: instance(urls[split], f"decode-{split}")["kv"]["free_blocks"] == idle)
    finally:
        bad = procs.stop()
        redis.close()
    assert bad == []
