"""One inference instance as a service: the engine loop plus its Redis inbox, outbox and heartbeat.

Roles (docs/design.md, "Request flow"):

* ``mixed`` (and ``decode`` when asked to serve a whole request): generate, publish every step's
  tokens to the routers' outboxes (one XADD per router per step).
* ``prefill``: tokenize, ask the decode instance to reserve blocks while prefilling, write the
  prompt's KV straight into the reserved blocks, publish the first token, tell decode "prefilled".
* ``decode``: reserve blocks on request (refusing at once when it cannot), take the prefilled
  sequence over and decode it.

The engine runs in one dedicated thread; every engine call goes through it, so engine state is
never touched concurrently, while this asyncio loop keeps reading and writing Redis. Every phase
has a deadline and every failure ends as an event in the router's outbox.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdserve.cache_transfer.base import KVTransport
from pdserve.cache_transfer.connect import open_transport
from pdserve.errors import (
    ConfigError,
    ControlPlaneError,
    EngineError,
    InvalidRequestError,
    PdserveError,
    RequestTimeoutError,
    TransferError,
    UnavailableError,
)
from pdserve.scheduler import (
    Abort,
    ErrorInfo,
    GenerateRequest,
    Heartbeat,
    Inbox,
    InstanceInfo,
    InstanceRegistry,
    Keys,
    KVInfo,
    LoadInfo,
    Outbox,
    Prefilled,
    RedisSettings,
    RequestDelta,
    ReserveBlocks,
    ReserveReply,
    RouterRegistry,
    StepOutput,
    TokenLogprob,
    TopLogprob,
    TransferInfo,
    Usage,
    send_to_inbox,
    wait_for_redis,
)
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.scheduler.tasks import cancel_and_wait
from pdserve.worker.engine import LLMEngine, RequestOutput
from pdserve.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

RESERVE_RETRY_MS = 200  # a decode instance without free blocks asks to be asked again after this


@dataclasses.dataclass
class _Owner:
    """Who gets the outputs of one engine request."""

    router_id: str
    request_id: str
    attempt: int


@dataclasses.dataclass
class _Split:
    """Prefill side of one splitwise request, until its KV and first token are handed over."""

    msg: GenerateRequest
    key: str
    prompt_ids: list[int]
    params: SamplingParams
    dst_blocks: list[int] | None = None
    first: RequestOutput | None = None
    next_reserve_at: float | None = None
    done: bool = False


@dataclasses.dataclass
class _Lease:
    """Decode side: blocks reserved for a prefill that has not arrived yet (freed at its deadline)."""

    msg: ReserveBlocks
    key: str
    expires_at: float


def engine_key(request_id: str, attempt: int) -> str:
    """Engine-side id: a retried request (new attempt) never collides with its old attempt."""
    return f"{request_id}/{attempt}"


class WorkerService:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.id = settings.instance_id
        self.keys = Keys(settings.cluster)
        self.engine: LLMEngine | None = None
        self.started_at = time.time()
        self.draining = False
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self.owners: dict[str, _Owner] = {}
        self.splits: dict[str, _Split] = {}
        self.leases: dict[str, _Lease] = {}
        self._transports: dict[str, KVTransport] = {}
        self._tasks: list[asyncio.Task] = []
        self._orphans_checked_at = 0.0
        self._routers_seen: dict[str, float] = {}  # router id -> when its key was last seen

    # ---- lifecycle ----------------------------------------------------------------------------
    async def run(self) -> None:
        s = self.settings
        shared = s.role == "decode"  # its cache lives in shm so that same-host prefills write into it
        config = dataclasses.replace(
            s.engine, shared_kv=shared, shm_name=f"pdserve-{self.id}" if shared else None
        )
        self.redis = RedisSettings.from_url(s.redis_url).connect()
        await wait_for_redis(self.redis)
        self.registry = InstanceRegistry(self.redis, self.keys, ttl_s=s.ttl_s)
        if await self.registry.get(self.id) is not None:
            raise ConfigError(f"--instance-id {self.id} is registered by a live instance; pick another id")
        self.engine = await self._call(LLMEngine, s.model_dir, config)
        self.routers = RouterRegistry(self.redis, self.keys, ttl_s=s.ttl_s)
        self.inbox = Inbox(self.redis, self.keys, self.id)
        await self.inbox.ensure_group()
        self.outbox = Outbox(self.redis, self.keys)
        self.heartbeat = Heartbeat(self.registry, self.info)
        await self.heartbeat.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain)
        log.info("%s (%s) serving %s; inbox %s", self.id, s.role, s.served_model_name, self.inbox.key)
        self._tasks = [
            asyncio.create_task(self._inbox_loop(), name="inbox"),
            asyncio.create_task(self._engine_loop(), name="engine"),
            asyncio.create_task(self._housekeeping_loop(), name="housekeeping"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_done)
        try:
            await self._stop.wait()
        finally:
            await self._shutdown()

    def _task_done(self, task: asyncio.Task) -> None:
        """A loop that dies takes the instance down (clearly, failing what is in flight), never half-alive."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("%s loop failed; stopping", task.get_name(), exc_info=task.exception())
        self._stop.set()

    def begin_drain(self) -> None:
        """SIGTERM: stop taking new work (routers see ``draining``), finish or fail what is in flight."""
        if self.draining:
            log.warning("second signal: stopping now")
            self._stop.set()
            return
        log.info(
            "draining: no new requests; %d in flight (up to %.0f s)",
            self._in_flight(),
            self.settings.drain_timeout_s,
        )
        self.draining = True
        self._drain_deadline = time.monotonic() + self.settings.drain_timeout_s
        asyncio.get_running_loop().create_task(self._push_heartbeat())
        self._wake.set()

    async def _shutdown(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        await self._fail_all("instance is shutting down")
        await self.heartbeat.stop(deregister=True)
        for t in self._transports.values():
            t.close()
        if self.engine is not None:
            await self._call(self.engine.close)
        self._exec.shutdown(wait=True)
        await self.redis.aclose()
        log.info("%s stopped", self.id)

    def _in_flight(self) -> int:
        return len(self.owners) + len(self.splits) + len(self.leases)

    async def _push_heartbeat(self) -> None:
        try:
            await self.registry.heartbeat(self.info())
        except ControlPlaneError as e:
            log.warning("could not publish draining state: %s", e)

    def info(self) -> InstanceInfo:
        e = self.engine
        assert e is not None
        waiting = list(e.batcher.waiting)
        endpoint = {"shm": e.cache.shm_name} if e.cache.shm_name else None
        return InstanceInfo(
            id=self.id,
            role=self.settings.role,
            model=self.settings.served_model_name,
            version="1",
            host=self.settings.host,
            pid=os.getpid(),
            started_at=self.started_at,
            kv=KVInfo(
                block_size=e.config.block_size,
                num_blocks=e.blocks.num_blocks,
                free_blocks=e.blocks.num_free,
                dtype="float32",
                layout="block_major",
            ),
            load=LoadInfo(
                running=len(e.batcher.running),
                waiting=len(waiting) + len(self.splits),
                waiting_prefill_tokens=sum(s.num_prompt_tokens for s in waiting),
            ),
            transfer=TransferInfo(protocols=["shm"], endpoint=endpoint),
            max_model_len=e.max_model_len,
            draining=self.draining,
        )

    async def _call(self, fn, *args, **kwargs):
        """Run ``fn`` on the engine thread (the only thread that touches the engine)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._exec, lambda: fn(*args, **kwargs))

    # ---- inbox --------------------------------------------------------------------------------
    async def _inbox_loop(self) -> None:
        failures = 0
        while True:
            try:
                entries = await self.inbox.read(count=64, block_ms=500)
                failures = 0
            except ControlPlaneError as e:
                failures += 1
                log.warning("reading the inbox failed (%s); retry %d", e, failures)
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))
                continue
            for _entry_id, msg in entries:
                try:
                    await self._handle(msg)
                except Exception:
                    log.exception("handling %s for %s failed", msg.type, msg.request_id)
            if entries:
                await self.inbox.ack([entry_id for entry_id, _ in entries])
                self._wake.set()

    async def _handle(self, msg: Any) -> None:
        if isinstance(msg, GenerateRequest):
            await self._on_generate(msg)
        elif isinstance(msg, ReserveBlocks):
            await self._on_reserve(msg)
        elif isinstance(msg, ReserveReply):
            await self._on_reserve_reply(msg)
        elif isinstance(msg, Prefilled):
            await self._on_prefilled(msg)
        elif isinstance(msg, Abort):
            await self._on_abort(msg)

    async def _on_generate(self, msg: GenerateRequest) -> None:
        owner = _Owner(msg.router_id, msg.request_id, msg.attempt)
        if self.draining:
            return await self._fail(
                owner, UnavailableError(f"instance {self.id} is draining"), retryable=True
            )
        if time.time() > msg.deadline:
            return await self._fail(
                owner, RequestTimeoutError("the request's deadline passed before it started")
            )
        if not await self._router_alive(msg.router_id):
            log.info("dropping %s: router %s is gone", msg.request_id, msg.router_id)
            return None
        try:
            ids = self._prompt_ids(msg)
            params = self._sampling(msg.sampling, len(ids))
            self.engine.validate(ids, params)
        except InvalidRequestError as e:
            if msg.messages is not None and e.param == "prompt":
                e.param = "messages"  # the field the client sent
            return await self._fail(owner, e)
        key = engine_key(msg.request_id, msg.attempt)
        info = msg.disaggregate_info
        if info is not None and self.settings.role == "prefill" and info.decode.id != self.id:
            split = _Split(msg, key, ids, params)
            self.splits[key] = split
            await self._ask_reserve(split)
            await self._call(
                self.engine.add_request, key, prompt_token_ids=ids, params=params, prefill_only=True
            )
        else:
            self.owners[key] = owner
            await self._call(self.engine.add_request, key, prompt_token_ids=ids, params=params)

    def _prompt_ids(self, msg: GenerateRequest) -> list[int]:
        tok = self.engine.tokenizer
        if msg.prompt_token_ids is not None:
            return list(msg.prompt_token_ids)
        if msg.messages is not None:
            return tok.encode(tok.apply_chat_template(msg.messages, add_generation_prompt=True), False)
        return tok.encode(msg.prompt or "")

    def _sampling(self, sampling: dict[str, Any], num_prompt_tokens: int) -> SamplingParams:
        """``max_tokens`` None (chat without a limit) means: up to the model length."""
        fields = dict(sampling)
        if fields.get("max_tokens") is None:
            fields["max_tokens"] = max(1, self.engine.max_model_len - num_prompt_tokens)
        return SamplingParams.from_dict(fields)

    async def _ask_reserve(self, split: _Split) -> None:
        msg, info = split.msg, split.msg.disaggregate_info
        reserve = ReserveBlocks(
            request_id=msg.request_id,
            router_id=msg.router_id,
            num_tokens=len(split.prompt_ids),
            reply_to=self.id,
            deadline=msg.deadline,
            deadlines=info.deadlines,
            sampling=split.params.to_dict(),
            prompt_token_ids=split.prompt_ids,
            attempt=msg.attempt,
        )
        split.next_reserve_at = None
        await send_to_inbox(self.redis, self.keys, info.decode.id, reserve)

    async def _on_reserve(self, msg: ReserveBlocks) -> None:
        key = engine_key(msg.request_id, msg.attempt)
        reply = ReserveReply(request_id=msg.request_id, ok=False, attempt=msg.attempt)
        if self.draining:
            reply.error = f"decode instance {self.id} is draining"
        elif key in self.leases:  # a repeated ask: answer with what is reserved
            reply.ok, reply.block_ids = True, self.engine.reserved[key]
        elif not self.engine.can_reserve(msg.num_tokens):
            reply.error = f"decode instance {self.id} has no {msg.num_tokens}-token room in its KV cache now"
            reply.retry_after_ms = RESERVE_RETRY_MS
        else:
            try:
                reply.block_ids = await self._call(self.engine.reserve, key, msg.num_tokens)
                reply.ok = True
                self.leases[key] = _Lease(msg, key, msg.deadlines.transfer)
            except PdserveError as e:
                reply.error, reply.retry_after_ms = str(e), RESERVE_RETRY_MS
        await send_to_inbox(self.redis, self.keys, msg.reply_to, reply)

    async def _on_reserve_reply(self, msg: ReserveReply) -> None:
        split = self.splits.get(engine_key(msg.request_id, msg.attempt))
        if split is None or split.done:
            return
        if msg.ok:
            split.dst_blocks = msg.block_ids
            await self._hand_over(split)
        elif msg.retry_after_ms is not None and time.time() < split.msg.disaggregate_info.deadlines.reserve:
            split.next_reserve_at = time.monotonic() + msg.retry_after_ms / 1000
        else:
            await self._abort_split(
                split, UnavailableError(msg.error or "decode instance refused"), retryable=True
            )

    async def _on_prefilled(self, msg: Prefilled) -> None:
        key = engine_key(msg.request_id, msg.attempt)
        lease = self.leases.pop(key, None)
        if lease is None:
            log.warning("prefilled %s arrived without a reservation (expired?)", key)
            return
        if msg.error is not None:
            await self._call(self.engine.cancel_reservation, key)
            return
        params = SamplingParams.from_dict(lease.msg.sampling)
        self.owners[key] = _Owner(lease.msg.router_id, msg.request_id, msg.attempt)
        await self._call(self.engine.add_prefilled, key, list(msg.prompt_token_ids), msg.first_token, params)

    async def _on_abort(self, msg: Abort) -> None:
        prefix = f"{msg.request_id}/"
        keys = [k for k in {*self.owners, *self.splits, *self.leases} if k.startswith(prefix)]
        if msg.attempt is not None:
            keys = [k for k in keys if k == engine_key(msg.request_id, msg.attempt)]
        for key in keys:
            self.owners.pop(key, None)
            self.leases.pop(key, None)
            split = self.splits.pop(key, None)
            if split is not None:
                split.done = True
            await self._call(self.engine.abort, key, msg.reason)
        if keys:
            log.info("aborted %s (%s)", msg.request_id, msg.reason)

    # ---- engine loop ----------------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                if self.draining and not self._in_flight():
                    self._stop.set()
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                continue
            outputs = await self._call(self.engine.step)
            deltas: dict[str, list[RequestDelta]] = collections.defaultdict(list)
            handovers = []
            for out in outputs:
                split = self.splits.get(out.request_id)
                if split is not None:
                    if out.prefilled:
                        split.first = out
                        handovers.append(split)
                    elif out.finished:  # finished on its first token (EOS, stop, max_tokens=1) or failed
                        self.splits.pop(out.request_id)
                        split.done = True
                        m = split.msg
                        deltas[m.router_id].append(self._delta(out, m.request_id, m.attempt))
                        await self._send_abort(split, "finished on prefill")
                    continue
                owner = self.owners.get(out.request_id)
                if owner is None:
                    continue  # aborted meanwhile
                if out.finished:
                    del self.owners[out.request_id]
                deltas[owner.router_id].append(self._delta(out, owner.request_id, owner.attempt))
            if deltas:
                try:
                    await self.outbox.publish_many(self.id, deltas)
                except ControlPlaneError as e:
                    log.error("could not publish a step (%d routers): %s", len(deltas), e)
            for split in handovers:
                await self._hand_over(split)

    def _delta(self, out: RequestOutput, request_id: str, attempt: int) -> RequestDelta:
        delta = RequestDelta(request_id=request_id, token_ids=out.token_ids, text=out.text, attempt=attempt)
        if out.logprobs is not None:
            delta.logprobs = [self._logprob(lp) for lp in out.logprobs]
        if out.finished:
            delta.finish_reason = out.finish_reason
            delta.usage = Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens)
            if out.error:
                delta.error = ErrorInfo.of(EngineError(out.error))
        return delta

    def _logprob(self, lp) -> TokenLogprob:
        text = self.engine.tokenizer.token_text
        top = [TopLogprob(token_id=t, token=text(t), logprob=v) for t, v in (lp.top_logprobs or [])]
        return TokenLogprob(token_id=lp.token_id, token=text(lp.token_id), logprob=lp.logprob, top=top)

    # ---- prefill -> decode hand-over ------------------------------------------------------------
    async def _hand_over(self, split: _Split) -> None:
        """Once both the first token and decode's blocks are there: KV, first token, "prefilled"."""
        if split.done or split.first is None or split.dst_blocks is None:
            return
        split.done = True
        m, info, key = split.msg, split.msg.disaggregate_info, split.key
        try:
            if time.time() > info.deadlines.transfer:
                raise TransferError("the KV transfer deadline passed")
            transport = self._transport(info.protocol, info.decode.id, info.decode.transfer)
            src = await self._call(self.engine.prefilled_blocks, key)
            cache = self.engine.cache
            if len(src) != len(split.dst_blocks):
                raise TransferError(f"decode reserved {len(split.dst_blocks)} blocks for {len(src)}")
            moved = await asyncio.to_thread(
                transport.write_blocks, cache.raw_view(), cache.regions(src), cache.regions(split.dst_blocks)
            )
            log.debug("%s: %d KV bytes -> %s", key, moved, info.decode.id)
        except PdserveError as e:
            log.warning("KV hand-over of %s to %s failed: %s", key, info.decode.id, e)
            self._transports.pop(info.decode.id, None)
            self.splits.pop(key, None)
            await self._call(self.engine.release_prefilled, key)
            failure = TransferError(f"KV transfer to {info.decode.id} failed: {e}")
            await self._tell_decode(split, error=failure)
            return await self._fail(_Owner(m.router_id, m.request_id, m.attempt), failure, retryable=True)
        first = split.first
        await self.outbox.publish(m.router_id, self._step([self._delta(first, m.request_id, m.attempt)]))
        await self._tell_decode(split)
        self.splits.pop(key, None)
        await self._call(self.engine.release_prefilled, key)

    async def _tell_decode(self, split: _Split, error: TransferError | None = None) -> None:
        m, first = split.msg, split.first
        msg = Prefilled(
            request_id=m.request_id,
            first_token=first.token_ids[0] if first else 0,
            prompt_token_ids=split.prompt_ids,
            attempt=m.attempt,
            error=ErrorInfo.of(error) if error else None,
        )
        await send_to_inbox(self.redis, self.keys, m.disaggregate_info.decode.id, msg)

    def _transport(self, protocol: str, peer_id: str, transfer: dict[str, Any]) -> KVTransport:
        """One cached transport per decode peer; ``transfer`` is the peer's registered TransferInfo."""
        transport = self._transports.get(peer_id)
        if transport is None:
            transport = self._transports[peer_id] = open_transport(protocol, transfer.get("endpoint"))
        return transport

    async def _abort_split(self, split: _Split, error: PdserveError, retryable: bool) -> None:
        split.done = True
        self.splits.pop(split.key, None)
        await self._call(self.engine.abort, split.key, "failed")
        await self._send_abort(split, error.message)
        m = split.msg
        await self._fail(_Owner(m.router_id, m.request_id, m.attempt), error, retryable=retryable)

    async def _send_abort(self, split: _Split, reason: str) -> None:
        m = split.msg
        abort = Abort(request_id=m.request_id, reason=reason, attempt=m.attempt)
        await send_to_inbox(self.redis, self.keys, m.disaggregate_info.decode.id, abort)

    # ---- deadlines, dead routers, draining ----------------------------------------------------------
    async def _housekeeping_loop(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            try:
                await self._housekeeping()
            except ControlPlaneError as e:
                log.warning("housekeeping: %s", e)

    async def _housekeeping(self) -> None:
        now, mono = time.time(), time.monotonic()
        for split in list(self.splits.values()):
            dl = split.msg.disaggregate_info.deadlines
            if split.next_reserve_at is not None and mono >= split.next_reserve_at:
                if now < dl.reserve:
                    await self._ask_reserve(split)
                else:
                    await self._abort_split(
                        split,
                        UnavailableError("no decode instance could reserve KV blocks before the deadline"),
                        True,
                    )
            elif split.dst_blocks is None and now > dl.reserve:
                await self._abort_split(
                    split, RequestTimeoutError("the decode instance did not answer in time"), True
                )
        for key, lease in list(self.leases.items()):
            if now > lease.expires_at:  # the prefill never came: a lease, not a leak
                log.warning("reservation %s expired without a prefill; freeing its blocks", key)
                del self.leases[key]
                await self._call(self.engine.cancel_reservation, key)
        if mono - self._orphans_checked_at >= 1.0:  # once a second: drop work of routers that are gone
            self._orphans_checked_at = mono
            await self._drop_orphans()
        if self.draining and mono > self._drain_deadline:
            log.warning("drain timeout: failing %d requests still in flight", self._in_flight())
            self._stop.set()

    async def _drop_orphans(self) -> None:
        routers = {o.router_id for o in self.owners.values()} | {
            s.msg.router_id for s in self.splits.values()
        }
        if not routers:
            return
        alive = await self.routers.alive(routers)
        for key, owner in list(self.owners.items()):
            if owner.router_id not in alive:
                log.info("router %s is gone: aborting %s", owner.router_id, owner.request_id)
                self.owners.pop(key, None)
                await self._call(self.engine.abort, key, "router gone")
        for split in list(self.splits.values()):
            if split.msg.router_id not in alive:
                split.done = True
                self.splits.pop(split.key, None)
                await self._call(self.engine.abort, split.key, "router gone")
                await self._send_abort(split, "router gone")

    async def _router_alive(self, router_id: str) -> bool:
        """Checked at most once a second per router: new work of a router that is gone is dropped."""
        now = time.monotonic()
        if now - self._routers_seen.get(router_id, -10.0) < 1.0:
            return True
        try:
            alive = router_id in await self.routers.alive([router_id])
        except ControlPlaneError:
            return True  # Redis trouble is not evidence that the router died
        if alive:
            self._routers_seen[router_id] = now
        return alive

    async def _fail_all(self, message: str) -> None:
        """Every request still here gets a clear final event (retryable if no token went out yet)."""
        failures: dict[str, list[RequestDelta]] = collections.defaultdict(list)
        for owner in self.owners.values():
            failures[owner.router_id].append(
                RequestDelta.failure(owner.request_id, UnavailableError(message), attempt=owner.attempt)
            )
        for split in self.splits.values():
            m = split.msg
            failures[m.router_id].append(
                RequestDelta.failure(
                    m.request_id, UnavailableError(message), retryable=True, attempt=m.attempt
                )
            )
        self.owners.clear()
        self.splits.clear()
        if failures:
            try:
                await self.outbox.publish_many(self.id, failures)
            except ControlPlaneError as e:
                log.error("could not tell routers about %d failed requests: %s", len(failures), e)

    async def _fail(self, owner: _Owner, error: PdserveError, retryable: bool = False) -> None:
        delta = RequestDelta.failure(owner.request_id, error, retryable=retryable, attempt=owner.attempt)
        await self.outbox.publish(owner.router_id, self._step([delta]))

    def _step(self, items: list[RequestDelta]) -> StepOutput:
        return StepOutput(instance_id=self.id, items=items)


def run_worker(settings: WorkerSettings) -> int:
    """Entry point of ``pdserve worker``: run until SIGTERM/SIGINT has drained the instance."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    try:
        asyncio.run(WorkerService(settings).run())
    except EngineError as e:
        log.error("%s", e)
        return 1
    return 0
