"""Two in-process instances (prefill and decode) on a real Redis, for driving the splitwise hand-off.

``StubEngine`` (pdserve's echo engine with tiny sizes) stands in for the model: a token is a
function of the prompt, KV bytes are a function of the prompt and the block; its block bookkeeping,
the KV cache bytes (the decode side's in real POSIX shared memory), the shm transport, the Redis
streams and the message handling are the real ones. The clock is a ``ManualClock`` that tests move.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from pdserve.cache_transfer.base import LocalCache
from pdserve.cache_transfer.shm import ShmBackend
from pdserve.engine.config import EngineConfig
from pdserve.engine.echo import EchoEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import (
    DisaggregateInfo,
    GenerateRequest,
    Inbox,
    InboxMessage,
    Keys,
    PeerInfo,
    PhaseDeadlines,
    RedisSettings,
    RequestDelta,
    RouterInfo,
    RouterRegistry,
    StepOutput,
    send_to_inbox,
)
from pdserve.scheduler.messages import decode_as
from pdserve.scheduler.streams import FIELD
from pdserve.worker.clock import Clock
from pdserve.worker.engine_client import EngineClient
from pdserve.worker.handler import RequestHandler
from pdserve.worker.handoff_context import Context
from pdserve.worker.kv_writers import Transports
from pdserve.worker.messenger import Messenger

BLOCK_SIZE = 4
BLOCK_BYTES = 32
MAX_MODEL_LEN = 64
ROUTER = "router-1"
T0 = 1_000_000.0  # the manual clock's wall time at the start of a test


class ManualClock(Clock):
    def __init__(self) -> None:
        self.now = T0
        self.mono = 0.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.mono += seconds


def token_for(prompt: list[int], n: int) -> int:
    """The stub model's ``n``-th output token for a prompt."""
    return (sum(prompt) + 7 * n) % 90 + 10


def kv_byte(prompt: list[int], block: int) -> int:
    """The byte the stub model writes all over the prompt's ``block``-th KV block."""
    return (sum(prompt) * 31 + block + 1) % 251


class StubEngine(EchoEngine):
    """The echo engine (pdserve's benchmarking engine: real block bookkeeping, no model) with this
    file's token and KV-byte functions, tiny sizes, and a way to make a step fail."""

    block_bytes_per_block = BLOCK_BYTES

    def __init__(self, num_blocks: int = 16, shared: bool = False) -> None:
        name = f"pdserve-test-{uuid.uuid4().hex[:10]}" if shared else None
        config = EngineConfig(
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            max_model_len=MAX_MODEL_LEN,
            shared_kv=shared,
            shm_name=name,
        )
        super().__init__(None, config)
        self.fail_next_step: str | None = None  # the next step fails every running request with this

    def token(self, req) -> int:
        return token_for(req.prompt, len(req.out))

    def kv_byte(self, req, block: int) -> int:
        return kv_byte(req.prompt, block)

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step is None:
            return super().step()
        outputs, self.pending = self.pending, []
        for req in list(self.requests.values()):
            outputs.append(self._finish(req, "error", error=self.fail_next_step))
        self.fail_next_step = None
        return outputs

    def block_bytes(self, block: int) -> bytes:
        return self.cache[block * BLOCK_BYTES : (block + 1) * BLOCK_BYTES].tobytes()


@dataclasses.dataclass
class Instance:
    id: str
    stub: StubEngine
    engine: EngineClient
    handler: RequestHandler
    inbox: Inbox

    async def receive(self, wait_writes: bool = True) -> int:
        """Handle what is in the inbox now, and (``wait_writes``) wait for the KV writes running
        here to end; the number of messages."""
        entries = await self.inbox.read(count=64, block_ms=0)
        for _entry_id, msg in entries:
            await self.handler.handle(msg)
        await self.inbox.ack([entry_id for entry_id, _ in entries])
        if wait_writes:
            await self.writes()
        return len(entries)

    async def step(self) -> int:
        """One engine step, its outputs handed over and published, and the KV writes it started
        done; the number of outputs."""
        if not self.engine.unfinished:
            return 0
        outputs = await self.engine.step()
        await self.handler.on_outputs(outputs)
        await self.writes()
        await self.handler.ctx.messenger.flush()  # the worker's engine loop steps on meanwhile
        return len(outputs)

    async def writes(self) -> None:
        """Until the KV writes running here (each a task of its own) have ended."""
        handoffs = self.handler.splitwise.prefills.values
        while running := [t for h in handoffs() if (t := getattr(h, "transfer", None)) is not None]:
            await asyncio.gather(*running, return_exceptions=True)

    @property
    def prefill(self):
        """The only prefill hand-off in progress here."""
        (handoff,) = self.handler.splitwise.prefills.values()
        return handoff

    @property
    def lease(self):
        (lease,) = self.handler.splitwise.leases.values()
        return lease


class Pair:
    """A prefill and a decode instance, a router's outbox, one manual clock."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, clock: ManualClock) -> None:
        self.redis, self.keys, self.clock = redis, keys, clock
        self.ids = itertools.count()
        self.transports = Transports({"shm": ShmBackend()})  # writers only: shm's local side needs nothing
        self.decode_transfer: dict[str, Any] = {}  # the decode instance's registered TransferInfo
        self.protocol = "shm"  # how requests' KV moves
        self.backends: dict[str, Any] = {}  # instance id -> its open MooncakeBackend (mooncake pairs)

    async def instance(
        self, instance_id: str, role: str, stub: StubEngine, clock: Clock | None = None
    ) -> Instance:
        """``clock``: the instance's own (another host's), instead of the pair's."""
        engine = await EngineClient.start(lambda: stub)
        messenger = Messenger(self.redis, self.keys, instance_id)
        ctx = Context(instance_id, engine, messenger, clock or self.clock, self.transports)
        handler = RequestHandler(ctx, role, RouterRegistry(self.redis, self.keys))
        inbox = Inbox(self.redis, self.keys, instance_id)
        await inbox.ensure_group()
        return Instance(instance_id, stub, engine, handler, inbox)

    async def send(self, to: Instance | str, msg: InboxMessage) -> None:
        await send_to_inbox(self.redis, self.keys, to if isinstance(to, str) else to.id, msg)

    def request(
        self,
        prompt: list[int],
        max_tokens: int = 4,
        *,
        decode_id: str = "decode",
        transfer: dict[str, Any] | None = None,
        reserve_s: float = 2.0,
        transfer_s: float = 5.0,
        attempt: int = 0,
    ) -> GenerateRequest:
        """A generate request as a router sends it to the prefill instance."""
        now, request_id = self.clock.time(), f"req-{next(self.ids)}"
        deadlines = PhaseDeadlines(
            reserve=now + reserve_s, transfer=now + transfer_s, first_token=now + transfer_s
        )
        info = DisaggregateInfo(
            request_id=request_id,
            router_id=ROUTER,
            prefill=PeerInfo(id="prefill", host="h"),
            decode=PeerInfo(
                id=decode_id, host="h", transfer=transfer if transfer is not None else self.decode_transfer
            ),
            protocol=self.protocol,
            deadlines=deadlines,
        )
        return GenerateRequest(
            request_id=request_id,
            router_id=ROUTER,
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            deadline=now + 30,
            attempt=attempt,
            disaggregate_info=info,
        )

    async def events(self) -> list[RequestDelta]:
        """Everything published to the router's outbox so far, in order."""
        entries = await self.redis.xrange(self.keys.outbox(ROUTER))
        return [item for _id, fields in entries for item in decode_as(StepOutput, fields[FIELD]).items]


async def settle(*instances: Instance, rounds: int = 50) -> None:
    """Deliver messages and step engines until nothing moves (or ``rounds`` passes)."""
    for _ in range(rounds):
        moved = 0
        for inst in instances:
            moved += await inst.receive()
            moved += await inst.step()
        if not moved:
            return
    raise AssertionError(f"still moving after {rounds} rounds")


@contextlib.asynccontextmanager
async def pair(
    redis_url: str, decode_blocks: int = 16, mooncake: bool = False
) -> AsyncIterator[tuple[Pair, Instance, Instance]]:
    """A live router registration, a prefill instance and a decode instance (its cache in shm);
    ``mooncake``: each cache registered with its own Mooncake agent, the KV over loopback TCP."""
    redis = RedisSettings.from_url(redis_url).connect()
    keys = Keys(f"splitwise-{uuid.uuid4().hex[:8]}")
    clock = ManualClock()
    p = Pair(redis, keys, clock)
    await RouterRegistry(redis, keys).register(RouterInfo(id=ROUTER, host="h", pid=1, port=1, started_at=0.0))
    prefill = await p.instance("prefill", "prefill", StubEngine())
    decode = await p.instance("decode", "decode", StubEngine(decode_blocks, shared=True))
    p.decode_transfer = {"protocols": ["shm"], "endpoint": {"shm": decode.engine.facts.shm_name}}
    if mooncake:
        from pdserve.cache_transfer.mooncake import MooncakeBackend

        for inst in (prefill, decode):
            p.backends[inst.id] = MooncakeBackend("127.0.0.1")
            p.backends[inst.id].open(LocalCache(inst.stub.cache))
        p.transports.backends["mooncake"], p.protocol = p.backends["prefill"], "mooncake"
        p.decode_transfer = {
            "protocols": ["mooncake"],
            "endpoint": {"mooncake": p.backends["decode"].endpoint()},
        }
    try:
        yield p, prefill, decode
    finally:
        for backend in p.backends.values():
            backend.close()  # before the caches go
        p.transports.close()
        for inst in (prefill, decode):
            await inst.engine.close()
        await redis.aclose()
