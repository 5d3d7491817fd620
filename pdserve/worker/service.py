"""One inference instance as a service: its lifecycle, from start to drain and shutdown.

Connect to Redis, refuse an instance id that a live instance holds, build the engine on its own
thread (engine_client.py), publish the tokenizer, register and heartbeat (what is published:
presence.py), then run three loops until SIGTERM has drained the instance (loops.py: the inbox loop
hands each message to the request handler, handler.py; the engine loop steps the engine; the
housekeeping loop runs timers and the drain deadline; and, with a prefix cache, a fourth keeps the
instance's prefix index in Redis current: prefix_publisher.py). A loop that dies stops the instance;
every request still in flight then gets a final event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import uuid

from pdserve.cache_transfer import shm, transports
from pdserve.cache_transfer.base import LocalCache
from pdserve.errors import ConfigError, EngineError
from pdserve.scheduler import (
    Heartbeat,
    Inbox,
    InstanceRegistry,
    Keys,
    PrefixIndex,
    RedisSettings,
    RouterRegistry,
    wait_for_redis,
)
from pdserve.scheduler.redis_server import outage_limit_s
from pdserve.scheduler.tasks import cancel_and_wait
from pdserve.worker.clock import Clock
from pdserve.worker.engine_client import EngineClient, PrepareLimits
from pdserve.worker.fault_hooks import FaultHooks
from pdserve.worker.handler import RequestHandler
from pdserve.worker.handoff_context import Context
from pdserve.worker.kv_writers import Transports
from pdserve.worker.loops import Loops
from pdserve.worker.messenger import Messenger
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.prefix_publisher import PrefixPublisher
from pdserve.worker.roles import RoleState
from pdserve.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class WorkerService(Loops):
    def __init__(self, settings: WorkerSettings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.id = settings.instance_id
        self.keys = Keys(settings.cluster)
        self.clock = clock or Clock()
        self.started_at = self.clock.time()
        self.incarnation = uuid.uuid4().hex[:12]  # this start's: peers reopen their writers to a new one
        self.redis = RedisSettings.from_url(settings.redis_url).connect()  # connects on first use
        self.registry = InstanceRegistry(self.redis, self.keys, ttl_s=settings.ttl_s)
        self.inbox = Inbox(self.redis, self.keys, self.id, max_deliveries=settings.max_deliveries)
        self.heartbeat = Heartbeat(self.registry, self.info)
        self.transports = Transports()  # its backends: the KV transports this instance offers
        self.engine: EngineClient | None = None  # built by run(), on the engine thread
        self.handler: RequestHandler | None = None  # built by run(), once the engine is up
        self.metrics: WorkerMetrics | None = None  # with --metrics-port
        self.prefix_publisher: PrefixPublisher | None = None  # with a prefix cache
        self._drain_deadline = float("inf")
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.failed: str | None = None  # the loop that died, if one did (the process then exits 1)
        self.tokenizer_digest: str | None = None  # of the tokenizer files published for routers
        self._tokenizer_blob = b""

    async def run(self) -> None:
        try:
            await wait_for_redis(self.redis)
            if await self.registry.get(self.id) is not None:
                raise ConfigError(
                    f"--instance-id {self.id} is registered by a live instance; pick another id"
                )
            limits = PrepareLimits(
                self.settings.max_prompt_chars_per_token,
                self.settings.max_grammar_bytes,
                self.settings.max_optional_properties,
            )
            self.engine = await EngineClient.start(self._build_engine, limits, self.settings.prepare_nice)
            await self._publish_tokenizer()
            await self._start_transfer()
            self._start_metrics()
            messenger = Messenger(
                self.redis,
                self.keys,
                self.id,
                # at least as long as routers wait for Redis (a Sentinel failover, with replica waits)
                give_up_after_s=max(
                    self.settings.ttl_s,
                    await outage_limit_s(self.redis, self.settings.redis_wait_replicas > 0),
                ),
                wait=self.settings.replica_wait,
            )
            ctx = Context(
                self.id,
                self.engine,
                messenger,
                self.clock,
                self.transports,
                self.metrics,
                self.incarnation,
                kv_checksum=self.settings.kv_checksum,
                faults=FaultHooks.from_env(),
            )
            routers = RouterRegistry(self.redis, self.keys, ttl_s=self.settings.ttl_s)
            roles = RoleState(
                self.settings.role,
                shared_cache=self._shared_cache,
                transports=lambda: bool(self.transports.backends),
                now=self.clock.time,
                switchable=self.settings.switchable,
            )
            self.handler = RequestHandler(
                ctx,
                roles,
                routers,
                self.settings.stream_interval_s,
                wake=self._wake,
                on_role_change=self._push_heartbeat,
            )
            await self.inbox.ensure_group()
            if self.engine.facts.prefix_caching:
                index = PrefixIndex(self.redis, self.keys, self.settings.ttl_s)
                self.prefix_publisher = PrefixPublisher(index, self.id, self.engine, self.disk_tier_id)
                if self.disk_tier_id is not None:  # its writes land after the step: publish them then
                    loop, wake = asyncio.get_running_loop(), self.prefix_publisher.wake

                    def written() -> None:
                        with contextlib.suppress(RuntimeError):  # the loop closed: nothing to tell
                            loop.call_soon_threadsafe(wake.set)

                    self.engine.watch_disk(written)
            await self.heartbeat.start()
            await self._serve()
        finally:
            await self._shutdown()

    def _start_metrics(self) -> None:
        """With ``--metrics-port``: the metrics, their hooks, and their HTTP server thread."""
        if not self.settings.metrics_port:
            return
        engine = self.engine
        assert engine is not None
        metrics = WorkerMetrics(self.settings.role, self.id)
        metrics.watch(lambda: engine.load, engine.facts)
        metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
        engine.metrics = self.metrics = metrics

    def _build_engine(self):
        """On the engine thread: a decode instance's cache lives in shm, so same-host prefills write
        into it; first it removes the segments of dead instances, whose memory its own may need."""
        model_dir = self.settings.model_dir
        assert model_dir is not None  # WorkerSettings requires it
        shared = self._shared_cache
        if shared:
            shm.sweep_dead_segments()
        config = dataclasses.replace(
            self.settings.engine, shared_kv=shared, shm_name=f"pdserve-{self.id}" if shared else None
        )
        if self.settings.engine_kind == "echo":
            from pdserve.engine.echo import EchoEngine

            return EchoEngine(model_dir, config)
        from pdserve.engine.llm_engine import LLMEngine

        return LLMEngine(model_dir, config)

    async def _start_transfer(self) -> None:
        """Open the local side of each KV transport ``--kv-transfer`` asks for (a mixed instance:
        none, unless ``--switchable``: it may take another role)."""
        s = self.settings
        if s.role == "mixed" and not s.switchable:
            return
        assert self.engine is not None
        facts = self.engine.facts
        options = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}  # each backend reads its own
        options["device"] = facts.device  # where the cache lives: which transports can move it
        protocols = transports.configured(s.kv_transfer, options)
        local = LocalCache(
            self.engine.kv_view(),
            facts.shm_name,
            device=facts.device,
            block_bytes=facts.block_bytes,
            shared=self._shared_cache,  # peers write into a decode instance's cache only
            incarnation=self.incarnation,  # written where peers write (shm: the segment's fence)
        )
        backends = await asyncio.to_thread(transports.open_backends, protocols, options, local)
        self.transports.backends.update(backends)
        log.info(
            "KV transfer: %s%s", ", ".join(protocols), " (auto)" if s.kv_transfer == transports.AUTO else ""
        )

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain)
        log.info(
            "%s (%s) serving %s; inbox %s",
            self.id,
            self.settings.role,
            self.settings.served_model_name,
            self.inbox.key,
        )
        self._tasks = [
            asyncio.create_task(self._inbox_loop(), name="inbox"),
            asyncio.create_task(self._engine_loop(), name="engine"),
            asyncio.create_task(self._housekeeping_loop(), name="housekeeping"),
        ]
        if self.prefix_publisher is not None:
            self._tasks.append(asyncio.create_task(self.prefix_publisher.run(), name="prefix-index"))
        for task in self._tasks:
            task.add_done_callback(self._task_done)
        await self._stop.wait()

    def _task_done(self, task: asyncio.Task) -> None:
        """A loop that dies takes the instance down (clearly, failing what is in flight), never half-alive."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("%s loop failed; stopping", task.get_name(), exc_info=task.exception())
        self.failed = task.get_name()
        self._stop.set()

    def begin_drain(self) -> None:
        """SIGTERM: stop taking new work (routers see ``draining``), finish or fail what is in flight."""
        assert self.handler is not None
        if self.handler.draining:
            log.warning("second signal: stopping now")
            self._stop.set()
            return
        log.info(
            "draining: no new requests; %d in flight (up to %.0f s)",
            self.handler.in_flight(),
            self.settings.drain_timeout_s,
        )
        self.handler.draining = True
        self._drain_deadline = self.clock.monotonic() + self.settings.drain_timeout_s
        asyncio.get_running_loop().create_task(self._push_heartbeat())
        self._wake.set()

    async def _shutdown(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        if self.handler is not None:
            await self.handler.fail_all("instance is shutting down")
            await self.handler.ctx.messenger.flush()  # the last steps' tokens, posted but maybe not sent
            self.handler.ctx.messenger.close()
        self.transports.close()
        await self.heartbeat.stop(deregister=True)  # only what it registered: not a live id we were refused
        if self.prefix_publisher is not None:
            await self.prefix_publisher.remove()
        self.transports.close_backends()  # before the cache's memory goes
        if self.metrics is not None:
            self.metrics.close()
        if self.engine is not None:
            await self.engine.close()
        await self.redis.aclose()
        log.info("%s stopped", self.id)


def run_worker(settings: WorkerSettings) -> int:
    """Entry point of ``pdserve worker``: run until SIGTERM/SIGINT has drained the instance.

    Exits 1 when a loop died (a supervisor should restart the instance), 0 after a drain."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    service = WorkerService(settings)
    try:
        asyncio.run(service.run())
    except EngineError as e:
        log.error("%s", e)
        return 1
    return 1 if service.failed else 0
