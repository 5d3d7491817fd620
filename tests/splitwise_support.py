"""Two in-process instances (prefill and decode) on a real Redis, for driving the splitwise hand-off.

``StubEngine`` is the one test double: it stands in for the model (a token is a function of the
prompt, KV bytes are a function of the prompt and the block), while its block bookkeeping, the
KV cache bytes (the decode side's in real POSIX shared memory), the shm transport, the Redis
streams and the message handling are the real ones. The clock is a ``ManualClock`` that tests move.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from pdserve.cache_transfer import shm
from pdserve.errors import InvalidRequestError, RequestTooLongError
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
from pdserve.scheduler.sampling_params import SamplingParams
from pdserve.scheduler.streams import FIELD
from pdserve.worker.clock import Clock
from pdserve.worker.engine_client import EngineClient
from pdserve.worker.handler import RequestHandler
from pdserve.worker.messenger import Messenger
from pdserve.worker.outputs import EngineFacts, EngineLoad, RequestOutput
from pdserve.worker.splitwise import Context, Transports

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


@dataclasses.dataclass
class _StubRequest:
    key: str
    prompt: list[int]
    params: SamplingParams
    blocks: list[int]
    prefill_only: bool
    out: list[int] = dataclasses.field(default_factory=list)


class StubEngine:
    """Test double for ``LLMEngine``: the engine's methods the service uses, with real block bookkeeping."""

    def __init__(self, num_blocks: int = 16, shared: bool = False) -> None:
        self.num_blocks = num_blocks
        self.segment = None
        if shared:
            self.segment = shm.create_segment(
                f"pdserve-test-{uuid.uuid4().hex[:10]}", num_blocks * BLOCK_BYTES
            )
            self.cache = np.ndarray((num_blocks * BLOCK_BYTES,), dtype=np.uint8, buffer=self.segment.buf)
        else:
            self.cache = np.zeros(num_blocks * BLOCK_BYTES, dtype=np.uint8)
        self.free = list(range(num_blocks))
        self.requests: dict[str, _StubRequest] = {}
        self.prefilled: dict[str, _StubRequest] = {}
        self.reserved: dict[str, list[int]] = {}
        self.pending: list[RequestOutput] = []
        self.fail_next_step: str | None = None  # the next step fails every running request with this

    # ---- what the client reads --------------------------------------------------------------------
    def facts(self) -> EngineFacts:
        name = self.segment.name if self.segment else None
        return EngineFacts(MAX_MODEL_LEN, BLOCK_SIZE, self.num_blocks, BLOCK_BYTES, shm_name=name)

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self.requests), free_blocks=len(self.free))

    def kv_view(self) -> np.ndarray:
        return self.cache

    def block_bytes(self, block: int) -> bytes:
        return self.cache[block * BLOCK_BYTES : (block + 1) * BLOCK_BYTES].tobytes()

    # ---- requests ---------------------------------------------------------------------------------
    def prompt_ids(self, prompt, messages, prompt_token_ids) -> list[int]:
        if prompt_token_ids is not None:
            return list(prompt_token_ids)
        return [ord(c) % 100 for c in (prompt or "")]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(prompt_token_ids) + params.max_tokens > MAX_MODEL_LEN:
            raise RequestTooLongError(
                f"this model's maximum context length is {MAX_MODEL_LEN} tokens", "prompt"
            )

    def _allocate(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def add_request(self, request_id, *, prompt_token_ids, params, prefill_only=False) -> None:
        blocks = self._allocate(-(-len(prompt_token_ids) // BLOCK_SIZE))
        self.requests[request_id] = _StubRequest(request_id, prompt_token_ids, params, blocks, prefill_only)

    def add_prefilled(self, request_id, prompt_token_ids, first_token, params) -> None:
        blocks = self.reserved.pop(request_id)
        req = _StubRequest(request_id, list(prompt_token_ids), params, blocks, False, [first_token])
        self.requests[request_id] = req

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.pending)

    def step(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        for req in list(self.requests.values()):
            if self.fail_next_step:
                outputs.append(self._finish(req, "error", error=self.fail_next_step))
                continue
            if not req.out:  # the prompt's step: write its KV
                for i, b in enumerate(req.blocks):
                    self.cache[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES] = kv_byte(req.prompt, i)
            req.out.append(token_for(req.prompt, len(req.out)))
            token = req.out[-1]
            if len(req.out) >= req.params.max_tokens:
                outputs.append(self._finish(req, "length", [token]))
            elif req.prefill_only:
                del self.requests[req.key]
                self.prefilled[req.key] = req
                outputs.append(self._output(req, [token], prefilled=True))
            else:
                outputs.append(self._output(req, [token]))
        self.fail_next_step = None
        return outputs

    def _output(self, req: _StubRequest, tokens: list[int], **kw: Any) -> RequestOutput:
        text = "".join(f"<{t}>" for t in tokens)
        return RequestOutput(req.key, tokens, text, len(req.prompt), len(req.out), **kw)

    def _finish(
        self, req: _StubRequest, reason: str, tokens: list[int] | None = None, **kw: Any
    ) -> RequestOutput:
        del self.requests[req.key]
        self.free += req.blocks
        return self._output(req, tokens or [], finished=True, finish_reason=reason, **kw)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return self.release_prefilled(request_id) or self.cancel_reservation(request_id)
        self.pending.append(self._finish(req, reason))
        return True

    # ---- hand-off ---------------------------------------------------------------------------------
    def can_reserve(self, num_prompt_tokens: int) -> bool:
        return len(self.free) >= -(-num_prompt_tokens // BLOCK_SIZE)

    def reserve(self, request_id: str, num_prompt_tokens: int) -> list[int]:
        self.reserved[request_id] = self._allocate(-(-num_prompt_tokens // BLOCK_SIZE))
        return self.reserved[request_id]

    def cancel_reservation(self, request_id: str) -> bool:
        blocks = self.reserved.pop(request_id, None)
        if blocks is None:
            return False
        self.free += blocks
        return True

    def prefilled_blocks(self, request_id: str) -> list[int]:
        return self.prefilled[request_id].blocks

    def release_prefilled(self, request_id: str) -> bool:
        req = self.prefilled.pop(request_id, None)
        if req is None:
            return False
        self.free += req.blocks
        return True

    def close(self) -> None:
        if self.segment is not None:
            del self.cache
            self.segment.close()
            self.segment.unlink()
            self.segment = None


@dataclasses.dataclass
class Instance:
    id: str
    stub: StubEngine
    engine: EngineClient
    handler: RequestHandler
    inbox: Inbox

    async def receive(self) -> int:
        """Handle what is in the inbox now; the number of messages."""
        entries = await self.inbox.read(count=64, block_ms=0)
        for _entry_id, msg in entries:
            await self.handler.handle(msg)
        await self.inbox.ack([entry_id for entry_id, _ in entries])
        return len(entries)

    async def step(self) -> int:
        """One engine step, its outputs handed over; the number of outputs."""
        if not self.engine.unfinished:
            return 0
        outputs = await self.engine.step()
        await self.handler.on_outputs(outputs)
        return len(outputs)

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
        self.transports = Transports()
        self.decode_transfer: dict[str, Any] = {}  # the decode instance's registered TransferInfo

    async def instance(self, instance_id: str, role: str, stub: StubEngine) -> Instance:
        engine = await EngineClient.start(lambda: stub)
        ctx = Context(
            instance_id, engine, Messenger(self.redis, self.keys, instance_id), self.clock, self.transports
        )
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
            protocol="shm",
            deadlines=deadlines,
        )
        return GenerateRequest(
            request_id=request_id,
            router_id=ROUTER,
            prompt_token_ids=prompt,
            sampling={"max_tokens": max_tokens, "temperature": 0.0},
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
async def pair(redis_url: str, decode_blocks: int = 16) -> AsyncIterator[tuple[Pair, Instance, Instance]]:
    """A live router registration, a prefill instance and a decode instance (its cache in shm)."""
    redis = RedisSettings.from_url(redis_url).connect()
    keys = Keys(f"splitwise-{uuid.uuid4().hex[:8]}")
    clock = ManualClock()
    p = Pair(redis, keys, clock)
    await RouterRegistry(redis, keys).register(RouterInfo(id=ROUTER, host="h", pid=1, port=1, started_at=0.0))
    prefill = await p.instance("prefill", "prefill", StubEngine())
    decode = await p.instance("decode", "decode", StubEngine(decode_blocks, shared=True))
    p.decode_transfer = {"protocols": ["shm"], "endpoint": {"shm": decode.engine.facts.shm_name}}
    try:
        yield p, prefill, decode
    finally:
        p.transports.close()
        for inst in (prefill, decode):
            await inst.engine.close()
        await redis.aclose()
