"""One inference instance as a service: its lifecycle.

Connect to Redis, refuse an instance id that a live instance holds, build the engine on its own
thread (engine_client.py), register and heartbeat, then run three loops until SIGTERM has drained
the instance: the inbox loop hands each message to the request handler (handler.py), the engine
loop steps the engine and hands its outputs over, the housekeeping loop runs timers and the drain
deadline (and, with a prefix cache, a fourth keeps the instance's prefix index in Redis current:
prefix_publisher.py). A loop that dies stops the instance; every request still in flight then gets a final event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import uuid
from typing import Any

from pdserve.cache_transfer import shm, transports
from pdserve.cache_transfer.base import LocalCache
from pdserve.engine.outputs import EngineLoad
from pdserve.engine.tiers.disk_tier import tier_id
from pdserve.errors import ConfigError, ControlPlaneError, EngineError
from pdserve.scheduler import (
    DiskTierInfo,
    Heartbeat,
    Inbox,
    InstanceInfo,
    InstanceRegistry,
    IntegrityInfo,
    Keys,
    KVInfo,
    LoadInfo,
    PoolInfo,
    PrefixIndex,
    RedisSettings,
    RouterRegistry,
    TierInfo,
    TransferInfo,
    redis_errors,
    wait_for_redis,
)
from pdserve.scheduler.connection import outage_limit_s
from pdserve.scheduler.tasks import cancel_and_wait
from pdserve.tokenizer import pack_tokenizer_files, read_tokenizer_files
from pdserve.worker.clock import Clock
from pdserve.worker.engine_client import EngineClient, PrepareLimits
from pdserve.worker.fault_hooks import FaultHooks
from pdserve.worker.handler import RequestHandler
from pdserve.worker.handoff_context import Context
from pdserve.worker.kv_writers import Transports
from pdserve.worker.messenger import Messenger
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.prefix_publisher import PrefixPublisher
from pdserve.worker.roles import RoleState
from pdserve.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

# Longest the engine loop holds its next step back while messages are acted on (the inbox's current
# batch, a prepared request's hand-over: milliseconds, preparation never counts; this bounds a stall
# when Redis is slow to take replies).
INBOX_FIRST_S = 0.25
PRUNE_WRITERS_S = 1.0  # how often the KV writers of peers that left (or restarted) are closed
TOKENIZER_TTL_S = 7 * 24 * 3600
"""Expiry of the published tokenizer files (``Keys.tokenizer``): every instance using them renews it
(:data:`TOKENIZER_REFRESH_S`), so they outlive the last such instance by at most this."""
TOKENIZER_REFRESH_S = 60.0
"""How often an instance renews its published tokenizer's expiry (and publishes it again if gone)."""


class WorkerService:
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

    async def _publish_tokenizer(self) -> None:
        """Publish the model's tokenizer files for routers (they compute its prompts' token ids for
        prefix-cache routing), before the first registration names their digest.

        The key is the files' content digest, so the instances of one model share one value: it is
        written (``SET … EX`` :data:`TOKENIZER_TTL_S`) only when missing, and every
        :data:`TOKENIZER_REFRESH_S` each instance renews its expiry with one ``EXPIRE``, writing the
        value again if that finds it gone (Redis restarted or evicted it). The registration, renewed
        every heartbeat, only carries the digest: megabytes are sent at most once per start or loss.
        A failure here is logged, not fatal (routing works without it) and retried at the next
        renewal. The echo engine publishes nothing: its prompt ids are not its tokenizer's."""
        if self.settings.engine_kind == "echo":
            return
        model_dir = self.settings.model_dir
        assert model_dir is not None  # WorkerSettings requires it
        try:
            packed = await asyncio.to_thread(lambda: pack_tokenizer_files(read_tokenizer_files(model_dir)))
        except (ConfigError, OSError) as e:
            log.warning("not publishing the tokenizer for routers: %s", e)
            return
        self._tokenizer_blob, self.tokenizer_digest = packed
        try:
            await self._renew_tokenizer()
        except ControlPlaneError as e:
            log.warning("could not publish the tokenizer for routers (will retry): %s", e)

    async def _renew_tokenizer(self) -> None:
        """Renew the published tokenizer's expiry; publish it again when it is gone."""
        if self.tokenizer_digest is None:
            return
        key = self.keys.tokenizer(self.tokenizer_digest)
        with redis_errors("publishing the tokenizer"):
            if not await self.redis.expire(key, TOKENIZER_TTL_S):
                await self.redis.set(key, self._tokenizer_blob, ex=TOKENIZER_TTL_S)
                log.info("published the tokenizer for routers: %s (%d bytes)", key, len(self._tokenizer_blob))

    @property
    def _shared_cache(self) -> bool:
        """The cache lives in shared memory, written by peers: a decode instance's, or any role's
        when it may become one (``--switchable``)."""
        return self.settings.role == "decode" or self.settings.switchable

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

    @property
    def protocols(self) -> list[str]:
        """The KV transports this instance offers, in the order it prefers them."""
        return list(self.transports.backends)

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

    async def _push_heartbeat(self) -> None:
        """Publish the registration now (draining, a new role): routers see it within their
        live-set age instead of a heartbeat interval."""
        try:
            await self.registry.heartbeat(self.info())
        except ControlPlaneError as e:
            log.warning("could not publish the registration: %s", e)

    def info(self) -> InstanceInfo:
        """The registration the heartbeat refreshes, from the engine's last load snapshot."""
        assert self.engine is not None and self.handler is not None
        facts, load = self.engine.facts, self.engine.load
        roles = self.handler.roles
        return InstanceInfo(
            id=self.id,
            role=roles.role,
            model=self.settings.served_model_name,
            version="1",
            host=self.settings.host,
            pid=os.getpid(),
            started_at=self.started_at,
            kv=KVInfo(
                block_size=facts.block_size,
                num_blocks=facts.num_blocks,
                free_blocks=load.free_blocks,
                dtype=facts.dtype,
                layout=facts.layout,
                block_bytes=facts.block_bytes,
                num_layers=facts.num_layers,
                num_kv_heads=facts.num_kv_heads,
                head_dim=facts.head_dim,
                prefix_caching=facts.prefix_caching,
                weights=facts.weights,
                weights_digest=facts.weights_digest,
                batch_invariant=facts.batch_invariant,
                device=facts.device,
                device_name=facts.device_name,
                memory_bytes=facts.memory_bytes or None,
            ),
            load=load_info(load, self.handler.handing_off()),
            transfer=TransferInfo(
                protocols=[] if roles.role == "mixed" else self.protocols,  # a mixed one is never paired
                endpoint=self._endpoint() or None,
                incarnation=self.incarnation,
            ),
            max_model_len=facts.max_model_len,
            draining=self.handler.draining,
            vocab_size=facts.vocab_size,
            max_num_seqs=self.settings.engine.max_num_seqs,
            tokenizer=self.tokenizer_digest,
            integrity=self._integrity(),
            tier=TierInfo(**dataclasses.asdict(load.tier)) if load.tier is not None else None,
            disk_tier=self._disk_tier_info(),
            pool=PoolInfo(hits=load.pool_hits, lookups=load.pool_lookups, evictions=load.pool_evictions)
            if facts.prefix_caching
            else None,
            switchable=self._shared_cache or None,  # a decode instance's start prepared every role
            roles=list(roles.history) or None,
            last_switch=roles.last_switch,
        )

    @property
    def disk_tier_id(self) -> str | None:
        """The id of the disk tier this instance shares (its host and directory), or None."""
        assert self.engine is not None
        directory = self.engine.facts.disk_tier
        return tier_id(self.settings.host, directory) if directory else None

    def _disk_tier_info(self) -> DiskTierInfo | None:
        """The disk tier's id, directory and counters, from the engine's last load snapshot."""
        assert self.engine is not None
        tier, directory = self.engine.load.disk, self.engine.facts.disk_tier
        if tier is None or directory is None or (tid := self.disk_tier_id) is None:
            return None
        return DiskTierInfo(id=tid, path=directory, **dataclasses.asdict(tier))

    def _integrity(self) -> IntegrityInfo | None:
        """A decode instance's KV checks so far (None before the first: nothing to show)."""
        assert self.handler is not None
        integrity = self.handler.ctx.integrity
        return integrity.model_copy() if integrity.kv_checked or integrity.kv_mismatches else None

    def _endpoint(self) -> dict[str, Any]:
        """Where peers write into this instance's cache: only a decode instance is written into."""
        if self.handler is None or self.handler.role != "decode":
            return {}
        endpoints = {protocol: b.endpoint() for protocol, b in self.transports.backends.items()}
        return {protocol: endpoint for protocol, endpoint in endpoints.items() if endpoint is not None}

    # ---- loops -----------------------------------------------------------------------------------
    def _running(self) -> tuple[EngineClient, RequestHandler]:
        """The engine and the request handler: run() builds both before any loop starts."""
        assert self.engine is not None and self.handler is not None
        return self.engine, self.handler

    async def _inbox_loop(self) -> None:
        _, handler = self._running()
        failures = 0
        while True:
            await handler.room()  # no more reading while many messages are still handled as tasks
            try:
                entries = await self.inbox.read(count=64, block_ms=500)
                failures = 0
                if entries and self.metrics is not None:
                    self.metrics.on_inbox_read([entry_id for entry_id, _ in entries])
            except ControlPlaneError as e:
                failures += 1
                handler.control_plane_failed()
                log.warning("reading the inbox failed (%s); retry %d", e, failures)
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))
                continue
            with handler.acting():  # preparations go on as tasks (handler.dispatch)
                for _entry_id, msg in entries:
                    try:
                        await handler.dispatch(msg)
                    except Exception:
                        log.exception("handling %s for %s failed", msg.type, msg.request_id)
            if entries:
                try:
                    await self.inbox.ack([entry_id for entry_id, _ in entries])
                except ControlPlaneError as e:  # they stay pending: a restart re-reads them
                    log.warning("acking %d inbox entries failed: %s", len(entries), e)
                self._wake.set()

    async def _engine_loop(self) -> None:
        engine, handler = self._running()
        while True:
            if not engine.unfinished:
                self._wake.clear()
                if handler.draining and not handler.in_flight():
                    self._stop.set()
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                continue
            if not handler.idle.is_set():
                # Messages first: each one that needs the engine (a reserve, a prepared generate, a
                # prefilled hand-off) would otherwise wait for a whole step, one step per message, and
                # a busy prefill's 512-token steps made a batch of reserves miss their deadline. Never
                # a preparation: a large schema compiles for seconds (handler.dispatch).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(handler.idle.wait(), timeout=INBOX_FIRST_S)
            await handler.on_outputs(await engine.step())
            if self.prefix_publisher is not None:
                self.prefix_publisher.wake.set()

    async def _housekeeping_loop(self) -> None:
        _, handler = self._running()
        pruned_at = tokenizer_at = self.clock.monotonic()
        while True:
            await asyncio.sleep(0.1)
            try:
                await handler.tick()
                if self.clock.monotonic() - pruned_at >= PRUNE_WRITERS_S:
                    pruned_at = self.clock.monotonic()
                    await self._prune_writers()
                if self.clock.monotonic() - tokenizer_at >= TOKENIZER_REFRESH_S:
                    tokenizer_at = self.clock.monotonic()
                    await self._renew_tokenizer()
            except ControlPlaneError as e:
                log.warning("housekeeping: %s", e)
            if handler.draining and self.clock.monotonic() > self._drain_deadline:
                log.warning("drain timeout: failing %d requests still in flight", handler.in_flight())
                self._stop.set()

    async def _prune_writers(self) -> None:
        """Close the KV writers of peers no longer registered (or restarted), so that a dead
        decode instance's cache is not kept mapped here (it would hold /dev/shm's memory)."""
        peers = self.transports.peers
        alive = await self.registry.alive(peers) if peers else set()
        self.transports.prune([p for p in peers if p not in alive])


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


def load_info(load: EngineLoad, handing_off: int) -> LoadInfo:
    """The load a heartbeat publishes: the engine's sequences, and the prefills handing off their
    KV apart (``handing_off``). Counted as ``waiting`` they looked like online work to the batch
    workers (no ``background`` flag covers them), which then ran at ``--busy-concurrency`` on every
    P/D stack, their own lines' hand-offs enough to keep it there."""
    return LoadInfo(
        running=load.running,
        waiting=load.waiting,
        waiting_prefill_tokens=load.waiting_prefill_tokens,
        background=load.background,
        handing_off=handing_off,
    )
