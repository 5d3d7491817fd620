"""Two hosts for real: prefill and decode in two network namespaces joined by a veth pair, the KV
cache crossing that link over Mooncake TCP; Redis and the router in the root namespace, reached by
each host over its own veth link. Greedy output must equal a mixed instance's, token for token and
(batch-invariant mode) logprob for logprob.

Needs root and iproute2 (`ip`); skips with the reason elsewhere (CI runs it as root).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import orjson
import pytest
from host_support import need_root_and

from pdserve.localredis.embedded import EmbeddedRedis, free_port
from pdserve.scheduler import Keys

pytestmark = [pytest.mark.usefixtures("mooncake_ready"), pytest.mark.timeout(300)]

KV_NET = "10.231.0"  # the link between the two hosts: P is .1, D is .2
PROMPTS = ["Hello there", "The KV cache crosses a veth link between two network namespaces. " * 3]


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts():
    """Namespaces ``P`` and ``D``: a kv link between them, and each linked to the root namespace."""
    need_root_and("ip", required_by="PDSERVE_REQUIRE_MULTIHOST")  # network namespaces
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
        sh(
            "ip",
            "link",
            "add",
            f"kvP{tag}",
            "netns",
            ns["P"],
            "type",
            "veth",
            "peer",
            "name",
            f"kvD{tag}",
            "netns",
            ns["D"],
        )
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


def completion(url: str, model: str, prompt: str | list[int], max_tokens: int = 12) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body |= {"logprobs": 2, "return_token_ids": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=90)


def choice(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.fixture(scope="module")
def redis_server(hosts, tmp_path_factory):
    """Redis in the root namespace with a password, reachable from each host over its own link."""
    server = EmbeddedRedis(
        workdir=tmp_path_factory.mktemp("redis"), bind=("127.0.0.1", "10.231.1.1", "10.231.2.1")
    )
    server.start()
    yield server
    server.close()


class Cluster:
    """A prefill instance on host P, a decode instance on host D, a router on the root namespace."""

    def __init__(self, hosts, redis: EmbeddedRedis, model, prefill_args=(), ttl: float = 6.0) -> None:
        self.name = f"c{uuid.uuid4().hex[:6]}"
        self.keys = Keys(self.name)
        self.procs = Procs()
        self.ids = {"P": f"prefill-{self.name}", "D": f"decode-{self.name}"}
        engine = ["--num-blocks", "256", "--max-model-len", "1024", "--threads", "1"]
        for side, i, last in (("P", 1, 1), ("D", 2, 2)):
            role = "prefill" if side == "P" else "decode"
            extra = list(prefill_args) if side == "P" else []
            self.procs.start(
                "worker",
                "--role",
                role,
                "--model",
                str(model),
                "--instance-id",
                self.ids[side],
                "--redis-url",
                f"redis://:multi%20host@10.231.{i}.1:{redis.port}/0",
                "--cluster",
                self.name,
                "--ttl",
                str(ttl),
                "--hostname",
                f"host-{side}",
                "--kv-transfer",
                "both",
                "--transfer-address",
                f"{KV_NET}.{last}",
                *engine,
                *extra,
                netns=hosts[side],
            )
        port = free_port()
        self.router = self.procs.start(
            "router", "--port", str(port), "--redis-url", redis.url, "--cluster", self.name, "--ttl", str(ttl)
        )
        self.url = f"http://127.0.0.1:{port}"
        self.live = {i["id"]: i for i in wait_for_instances(self.url, set(self.ids.values()), self.procs)}

    def free_blocks(self, side: str) -> int:
        return instance(self.url, self.ids[side])["kv"]["free_blocks"]

    def wait_idle(self, *sides: str) -> None:
        """Until the registrations say every block is free again on each side."""
        for side in sides:
            idle = self.live[self.ids[side]]["kv"]["free_blocks"]
            wait_until(lambda side=side, idle=idle: self.free_blocks(side) == idle)


def test_kv_crosses_hosts_over_mooncake_and_output_equals_mixed(hosts, redis_server, tiny_model_dir) -> None:
    from redis import Redis

    cluster = Cluster(hosts, redis_server, tiny_model_dir)
    solo = f"solo{uuid.uuid4().hex[:6]}"
    engine = ["--num-blocks", "256", "--max-model-len", "1024", "--threads", "1"]
    cluster.procs.start(
        "worker",
        "--role",
        "mixed",
        "--model",
        str(tiny_model_dir),
        "--instance-id",
        f"mixed-{solo}",
        "--redis-url",
        redis_server.url,
        "--cluster",
        solo,
        *engine,
    )
    port = free_port()
    cluster.procs.start("router", "--port", str(port), "--redis-url", redis_server.url, "--cluster", solo)
    mixed = f"http://127.0.0.1:{port}"
    try:
        wait_for_instances(mixed, {f"mixed-{solo}"}, cluster.procs)
        client, inbox = Redis.from_url(redis_server.url), cluster.keys.inbox(cluster.ids["P"])
        # the registration (not /v1/instances, which serves no data-plane endpoint) names the session
        decode = orjson.loads(client.get(cluster.keys.instance(cluster.ids["D"])))
        assert decode["transfer"]["endpoint"]["mooncake"]["session"].startswith(f"{KV_NET}.2:")
        model = tiny_model_dir.name
        for prompt in PROMPTS:
            before = last_added(client, inbox)
            got, want = (
                choice(completion(cluster.url, model, prompt)),
                choice(completion(mixed, model, prompt)),
            )
            assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
            assert got["logprobs"] == want["logprobs"]
            assert last_added(client, inbox) > before  # prefilled on P, not served by D alone
        client.close()
        cluster.wait_idle("P", "D")
    finally:
        bad = cluster.procs.stop()
    assert bad == []


def test_an_unreachable_decode_is_a_clear_error_and_the_link_coming_back_serves_again(
    hosts, redis_server, tiny_model_dir
) -> None:
    cluster = Cluster(hosts, redis_server, tiny_model_dir)
    link = f"kvP{hosts['P'][3:]}"
    try:
        sh("ip", "-n", hosts["P"], "link", "set", link, "down")
        t0 = time.monotonic()
        r = completion(cluster.url, tiny_model_dir.name, "Hello there")
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "kv_transfer_failed" and "mooncake write" in error["message"], error
        assert time.monotonic() - t0 < 30
        cluster.wait_idle("P", "D")  # every attempt freed its blocks on both sides
        sh("ip", "-n", hosts["P"], "link", "set", link, "up")
        assert (
            choice(completion(cluster.url, tiny_model_dir.name, "Hello there"))["finish_reason"] == "length"
        )
        cluster.wait_idle("P", "D")
    finally:
        subprocess.run(["ip", "-n", hosts["P"], "link", "set", link, "up"], capture_output=True, timeout=30)
        bad = cluster.procs.stop()
    assert bad == []


def test_decode_killed_during_the_hand_off_gives_a_clear_error_and_frees_prefill(
    hosts, redis_server, tiny_model_dir
) -> None:
    # a 900-token prompt in 2-token chunks keeps P prefilling for seconds after D reserved its blocks
    # (in 4-token chunks a fast host prefilled it in 0.9 s, before the kill)
    cluster = Cluster(
        hosts, redis_server, tiny_model_dir, prefill_args=["--prefill-chunk-size", "2"], ttl=2.0
    )
    decode = cluster.procs.procs[1]
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            pending = pool.submit(completion, cluster.url, tiny_model_dir.name, list(range(5, 905)), 4)
            time.sleep(0.6)
            os.killpg(decode.pid, signal.SIGKILL)
            decode.wait()
            r = pending.result(timeout=60)
        assert r.status_code == 503, r.text  # the only decode instance is gone: no retry can succeed
        assert r.json()["error"]["code"] in ("kv_transfer_failed", "instance_unavailable", "no_capacity"), (
            r.text
        )
        assert time.monotonic() - t0 < 60
        cluster.wait_idle("P")
    finally:
        cluster.procs.procs.remove(decode)
        bad = cluster.procs.stop()
    assert bad == []


def group_lingers(pgid: int, grace_s: float = 10) -> bool:
    """Whether a process group still has members ``grace_s`` after its leader exited (then killed).

    The grace covers multiprocessing's resource tracker, which leaves a moment after its parent."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
    return True


def test_the_two_hosts_example_serves_across_the_link(hosts, tiny_model_dir, tmp_path) -> None:
    """examples/two-hosts.sh as documented: `a` on host P (Redis, prefill, router), `b` on host D."""
    env = {
        **os.environ,
        "HOST_A": f"{KV_NET}.1",
        "HOST_B": f"{KV_NET}.2",
        "REDIS_PASSWORD": "two hosts",
        "MODEL": str(tiny_model_dir),
        "PORT": "8000",
    }
    script = str(Path(__file__).resolve().parents[2] / "examples" / "two-hosts.sh")
    sides = {}
    try:
        for side, arg in (("P", "a"), ("D", "b")):
            log = (tmp_path / f"{arg}.log").open("w")
            sides[side] = subprocess.Popen(
                ["ip", "netns", "exec", hosts[side], "bash", script, arg],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        url = f"http://{KV_NET}.1:8000"
        ask = (
            "import httpx, sys, time\n"
            "for _ in range(240):\n"
            "    try:\n"
            "        ids = [i['role'] for i in httpx.get(sys.argv[1] + '/v1/instances').json()['instances']]\n"
            "        if sorted(ids) == ['decode', 'prefill']: break\n"
            "    except (httpx.HTTPError, KeyError, ValueError): pass\n"
            "    time.sleep(0.5)\n"
            "body = {'model': sys.argv[2], 'prompt': 'two hosts', 'max_tokens': 8, 'temperature': 0}\n"
            "r = httpx.post(sys.argv[1] + '/v1/completions', json=body, timeout=60)\n"
            "print(r.status_code, r.json()['choices'][0]['finish_reason'])\n"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", hosts["P"], sys.executable, "-c", ask, url, tiny_model_dir.name],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert out.stdout.split() == ["200", "length"], (
            out.stdout + out.stderr + (tmp_path / "a.log").read_text()
        )
    finally:
        for proc in sides.values():
            proc.send_signal(signal.SIGTERM)  # the script only: its trap stops what it started
        codes = [proc.wait(60) for proc in sides.values()]
        left = [proc.args[-1] for proc in sides.values() if group_lingers(proc.pid)]
    assert codes == [130, 130] and left == [], [(tmp_path / f"{a}.log").read_text() for a in "ab"]
