"""Peer fetch between two instances (real Redis streams, real shared memory, the real tiny model):
an instance told to fetch a prompt's prefix from a peer (``GenerateRequest.fetch``) asks it, the
peer writes the blocks it holds into the fetcher's cache, the fetcher checks them against the
writer's digests, adopts them and computes only the rest: its tokens and logprobs are those of the
cold miss, bit for bit (MKL_CBWR=AUTO,STRICT). A byte flipped in transit, a peer that no longer holds
the blocks, and a peer that does not answer in time are each a counted miss: the request computes
the blocks and its tokens are still the cold miss's; the fetch's blocks stay leased until no write
into them can land, then nothing is left held on either side."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator

from router_support import run
from splitwise_support import ROUTER, Instance, Pair, pair

from pdserve.cache_transfer.base import LocalCache
from pdserve.cache_transfer.shm import ShmBackend
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import FetchedBlocks, FetchHint, GenerateRequest, Inbox, PeerInfo, RouterRegistry
from pdserve.worker.decode_lease import LEASE_GRACE_S
from pdserve.worker.engine_client import EngineClient
from pdserve.worker.fault_hooks import FaultHooks
from pdserve.worker.handler import RequestHandler
from pdserve.worker.handoff_context import Context
from pdserve.worker.kv_writers import Transports
from pdserve.worker.messenger import Messenger
from pdserve.worker.peer_fetch import fetch_budget, reply_grace

BS = 16
PREFIX = [(17 * i + 5) % 300 + 10 for i in range(5 * BS)]  # 5 full blocks the holder computes
PROMPT = [*PREFIX, 41, 42, 43, 44, 45, 46, 47]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)


def tiny(model_dir, shm_name: str | None = None) -> LLMEngine:
    config = EngineConfig(
        num_blocks=32,
        block_size=BS,
        max_model_len=256,
        threads=1,
        prefix_caching=True,
        shared_kv=shm_name is not None,
        shm_name=shm_name,
    )
    return LLMEngine(model_dir, config)


async def instance(p: Pair, instance_id: str, engine: LLMEngine, transports: Transports) -> Instance:
    client = await EngineClient.start(lambda: engine)
    ctx = Context(instance_id, client, Messenger(p.redis, p.keys, instance_id), p.clock, transports)
    ctx.incarnation = f"inc-{instance_id}"
    handler = RequestHandler(ctx, "mixed", RouterRegistry(p.redis, p.keys))
    inbox = Inbox(p.redis, p.keys, instance_id)
    await inbox.ensure_group()
    return Instance(instance_id, engine, client, handler, inbox)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def peers(redis_url: str, model_dir) -> AsyncIterator[tuple[Pair, Instance, Instance]]:
    """The holder (its cache private: it only writes) and the fetcher (its cache in a segment, its
    shm backend open over it, so the holder can write into it), both mixed."""
    async with pair(redis_url) as (p, _prefill, _decode):
        name = f"pdserve-test-fetch-{uuid.uuid4().hex[:10]}"
        fetcher_engine = tiny(model_dir, name)
        backend = ShmBackend()
        backend.open(LocalCache(fetcher_engine.kv_view(), name, shared=True, incarnation="inc-fetcher"))
        holder = await instance(p, "holder", tiny(model_dir), Transports({"shm": ShmBackend()}))
        fetcher = await instance(p, "fetcher", fetcher_engine, Transports({"shm": backend}))
        try:
            yield p, holder, fetcher
        finally:
            for inst in (holder, fetcher):
                inst.handler.ctx.transports.close()
                await inst.engine.close()


def request(
    p: Pair,
    rid: str,
    fetch: bool,
    deadline_s: float = 60.0,
    prompt: list[int] = PROMPT,
    expect_s: float | None = None,
    params: SamplingParams = PARAMS,
) -> GenerateRequest:
    hint = FetchHint(
        peer=PeerInfo(id="holder", host="h"), protocol="shm", blocks=len(PREFIX) // BS, expect_s=expect_s
    )
    return GenerateRequest(
        request_id=rid,
        router_id=ROUTER,
        prompt_token_ids=prompt,
        sampling=params,
        deadline=p.clock.time() + deadline_s,
        fetch=hint if fetch else None,
    )


async def serve_whole(inst: Instance) -> None:
    await inst.receive()
    while inst.engine.unfinished:
        await inst.step()


async def fetch_and_serve(holder: Instance, fetcher: Instance, answer: bool = True) -> None:
    """The fetcher takes its generate (which waits on the fetch); the holder serves the fetch (unless
    ``answer`` is False); the fetcher reads the answer; then the request runs to its end."""
    taking = asyncio.ensure_future(fetcher.receive())
    if answer:
        while not await holder.receive() and not taking.done():  # until the ask is there
            await asyncio.sleep(0.01)
        await asyncio.gather(*holder.handler.fetches.server._tasks)
        while not taking.done():
            await fetcher.receive()
    await taking
    while fetcher.engine.unfinished:
        await fetcher.step()


async def outcome(p: Pair, rid: str) -> tuple[list[int], list[float], int]:
    """The tokens, their logprobs and the cached tokens the request's router got."""
    tokens, logprobs, cached = [], [], -1
    for e in await p.events():
        if e.request_id == rid:
            assert e.error is None, e.error
            tokens += e.token_ids
            logprobs += [lp.logprob for lp in e.logprobs or []]
            if e.usage is not None:
                cached = e.usage.cached_tokens
    return tokens, logprobs, cached


def nothing_held(*insts: Instance) -> None:
    for inst in insts:
        eng = inst.stub
        assert not eng.held and not eng.reserved and not eng.fetching  # type: ignore[attr-defined]
        assert eng.blocks.num_free == eng.blocks.capacity  # type: ignore[attr-defined]
        assert not inst.handler.fetches.leases


def test_a_prefix_fetched_from_a_peer_gives_the_cold_tokens(redis_url, tiny_model_dir) -> None:
    async def main() -> None:
        async with peers(redis_url, tiny_model_dir) as (p, holder, fetcher):
            await p.send(holder, request(p, "cold", fetch=False))  # the holder computes it: its cache
            await serve_whole(holder)
            cold = await outcome(p, "cold")
            assert cold[2] == 0 and len(cold[0]) == 4
            await p.send(fetcher, request(p, "fetched", fetch=True))
            await fetch_and_serve(holder, fetcher)
            tokens, logprobs, cached = await outcome(p, "fetched")
            assert (tokens, logprobs) == cold[:2]  # bit for bit
            assert cached == len(PREFIX)  # the whole prefix came from the peer
            got = fetcher.handler.fetches.info
            assert (got.fetches, got.hits, got.misses, got.failed) == (1, 5, 0, 0)
            assert holder.handler.fetches.info.served == 5
            assert fetcher.handler.fetches.rate.value is not None  # what routers price a fetch at
            nothing_held(holder, fetcher)

    run(main(), timeout_s=120)


def test_a_byte_flipped_in_transit_is_a_counted_miss_with_the_cold_tokens(redis_url, tiny_model_dir) -> None:
    async def main() -> None:
        async with peers(redis_url, tiny_model_dir) as (p, holder, fetcher):
            await p.send(holder, request(p, "cold", fetch=False))
            await serve_whole(holder)
            holder.handler.ctx.faults = FaultHooks(kv_flip_in_transit=1.0, rng=random.Random(5))
            await p.send(fetcher, request(p, "flipped", fetch=True))
            await fetch_and_serve(holder, fetcher)
            tokens, logprobs, cached = await outcome(p, "flipped")
            assert (tokens, logprobs) == (await outcome(p, "cold"))[:2]
            assert cached == 0  # nothing fetched was used: computed
            got = fetcher.handler.fetches.info
            assert (got.fetches, got.hits, got.misses, got.failed, got.mismatches) == (1, 0, 5, 1, 1)
            nothing_held(holder, fetcher)

    run(main(), timeout_s=120)


def test_a_peer_that_no_longer_holds_the_blocks_is_a_miss(redis_url, tiny_model_dir) -> None:
    async def main() -> None:
        async with peers(redis_url, tiny_model_dir) as (p, holder, fetcher):
            await p.send(fetcher, request(p, "unheld", fetch=True))  # the index was stale: nothing there
            await fetch_and_serve(holder, fetcher)
            tokens, _, cached = await outcome(p, "unheld")
            assert len(tokens) == 4 and cached == 0
            got = fetcher.handler.fetches.info
            assert (got.fetches, got.hits, got.misses, got.failed) == (1, 0, 5, 1)
            nothing_held(holder, fetcher)

    run(main(), timeout_s=120)


def test_a_peer_that_answers_late_or_never_leaves_no_write_into_a_reused_block(
    redis_url, tiny_model_dir
) -> None:
    """No answer within the budget: the request computes its blocks at once; the fetch's blocks stay
    leased, so the holder's late write lands in blocks nobody uses, and are freed by its answer. A
    second fetch whose holder never answers is freed at its backstop, not before."""

    async def main() -> None:
        async with peers(redis_url, tiny_model_dir) as (p, holder, fetcher):
            await p.send(holder, request(p, "cold", fetch=False))
            await serve_whole(holder)
            cold = await outcome(p, "cold")
            await p.send(fetcher, request(p, "late", fetch=True, deadline_s=0.6))  # a 0.3 s budget
            await fetch_and_serve(holder, fetcher, answer=False)
            assert (await outcome(p, "late"))[:2] == cold[:2]
            assert len(fetcher.handler.fetches.leases) == 1 and fetcher.stub.reserved  # type: ignore[attr-defined]
            await holder.receive()  # the late write: into the still leased blocks
            await asyncio.gather(*holder.handler.fetches.server._tasks)
            await fetcher.receive()  # its answer ends the lease
            got = fetcher.handler.fetches.info
            assert (got.fetches, got.hits, got.misses, got.failed) == (1, 0, 5, 1)
            nothing_held(holder, fetcher)
            # never answered: held until the backstop on the fetcher's clock, then freed
            await p.send(fetcher, request(p, "never", fetch=True, deadline_s=0.6, prompt=[7, *PROMPT]))
            await fetch_and_serve(holder, fetcher, answer=False)
            (lease,) = fetcher.handler.fetches.leases.values()
            p.clock.advance(lease.backstop_at - p.clock.monotonic() - 0.1)
            await fetcher.handler.tick()
            assert fetcher.handler.fetches.leases and LEASE_GRACE_S > 0.1
            p.clock.advance(0.2)
            await fetcher.handler.tick()
            assert not fetcher.handler.fetches.leases
            nothing_held(fetcher)

    run(main(), timeout_s=120)


def test_a_holder_that_holds_part_of_the_prefix_sends_that_part_and_the_rest_is_computed(
    redis_url, tiny_model_dir
) -> None:
    """The holder has only the prefix's first 3 blocks: it writes those, the fetcher adopts them and
    computes the other 2: the tokens of the cold miss (computed under another cache salt, so
    nothing cached), 3 hits and 2 misses, not a failed fetch."""

    async def main() -> None:
        async with peers(redis_url, tiny_model_dir) as (p, holder, fetcher):
            salted = PARAMS.replace(cache_salt="cold")
            await p.send(holder, request(p, "cold", fetch=False, params=salted))
            await serve_whole(holder)
            cold = await outcome(p, "cold")
            assert cold[2] == 0
            await p.send(holder, request(p, "part", fetch=False, prompt=[*PREFIX[: 3 * BS], 9, 9, 9]))
            await serve_whole(holder)
            await p.send(fetcher, request(p, "fetched", fetch=True))
            await fetch_and_serve(holder, fetcher)
            tokens, logprobs, cached = await outcome(p, "fetched")
            assert (tokens, logprobs) == cold[:2]  # bit for bit
            assert cached == 3 * BS
            got = fetcher.handler.fetches.info
            assert (got.fetches, got.hits, got.misses, got.failed) == (1, 3, 2, 0)
            assert holder.handler.fetches.info.served == 3
            nothing_held(holder, fetcher)

    run(main(), timeout_s=120)


def test_a_fetchs_budget_follows_what_the_router_expected_within_bounds() -> None:
    assert fetch_budget(None, None, 60.0) == 2.0  # nothing known: the longest
    assert fetch_budget(0.6, None, 60.0) == 1.2  # twice what the router expected
    assert fetch_budget(0.05, None, 60.0) == 0.5  # never below the floor
    assert fetch_budget(5.0, None, 60.0) == 2.0  # never above the longest
    assert fetch_budget(0.6, 0.8, 60.0) == 0.8  # never longer than computing the blocks here
    assert fetch_budget(None, 0.01, 60.0) == 0.5
    assert fetch_budget(0.6, None, 1.0) == 0.5  # at most half the time the request has left
    assert (reply_grace(0.5), reply_grace(2.0)) == (0.25, 0.5)


def occupy(inst: Instance, gate: threading.Event) -> asyncio.Future[bool]:
    """A long step: ``inst``'s engine thread busy until ``gate`` is set (calls queue behind it)."""
    return asyncio.ensure_future(inst.engine._run(gate.wait))


async def asked(holder: Instance) -> asyncio.Task[None]:
    """Until the holder read the fetch's ask and its task queued the pin on its engine thread."""
    while not await holder.receive():
        await asyncio.sleep(0.01)
    (serving,) = holder.handler.fetches.server._tasks
    await asyncio.sleep(0.05)
    return serving


def test_a_holder_inside_a_long_step_answers_when_it_ends_without_waiting_for_the_next(
    redis_url, tiny_model_dir
) -> None:
    """The holder's engine thread is inside a long step when the ask comes: its pin waits for that
    step, and the fetch succeeds within the budget the router's expectation set (0.5 s expected: 1
    s). The answer goes out once the blocks are written, while the holder's next step still runs
    (its pins are let go after it): the fetcher waits one step, not two. The cold tokens."""

    async def main() -> None:
        async with peers(redis_url, tiny_model_dir) as (p, holder, fetcher):
            await p.send(holder, request(p, "cold", fetch=False))
            await serve_whole(holder)
            cold = await outcome(p, "cold")
            step, next_step = threading.Event(), threading.Event()
            steps = [occupy(holder, step)]
            await p.send(fetcher, request(p, "busy", fetch=True, expect_s=0.5))
            started = time.monotonic()
            taking = asyncio.ensure_future(fetcher.receive())
            serving = await asked(holder)
            steps.append(occupy(holder, next_step))  # queued after the pin, before the release
            asyncio.get_running_loop().call_later(0.3, step.set)
            while not taking.done():
                await fetcher.receive()
                await asyncio.sleep(0.01)
            await taking
            assert 0.3 <= time.monotonic() - started < 1.0  # the step, then the write: in its budget
            assert not next_step.is_set() and holder.stub.held  # type: ignore[attr-defined]
            next_step.set()
            await asyncio.gather(serving, *steps)
            while fetcher.engine.unfinished:
                await fetcher.step()
            tokens, logprobs, cached = await outcome(p, "busy")
            assert (tokens, logprobs) == cold[:2] and cached == len(PREFIX)
            got = fetcher.handler.fetches.info
            assert (got.fetches, got.hits, got.misses, got.failed) == (1, 5, 0, 0)
            nothing_held(holder, fetcher)

    run(main(), timeout_s=120)


def test_a_holder_whose_step_outlasts_the_budget_costs_a_bounded_wait_and_pins_nothing(
    redis_url, tiny_model_dir
) -> None:
    """The holder's step outlasts the fetch's budget (0.1 s expected: the 0.5 s floor, plus a 0.25
    s grace for the answer): the fetcher computes after that wait, not after the constant 2.5 s, with
    the cold tokens and a counted miss. When the holder's engine thread gets to the pin, the budget
    has passed on its clock: it pins and reads back nothing, and its answer frees the lease."""

    async def main() -> None:
        async with peers(redis_url, tiny_model_dir) as (p, holder, fetcher):
            await p.send(holder, request(p, "cold", fetch=False))
            await serve_whole(holder)
            cold = await outcome(p, "cold")
            step = threading.Event()
            busy = occupy(holder, step)
            await p.send(fetcher, request(p, "late", fetch=True, expect_s=0.1))
            started = time.monotonic()
            taking = asyncio.ensure_future(fetcher.receive())
            serving = await asked(holder)
            await taking
            assert 0.75 <= time.monotonic() - started < 1.5
            while fetcher.engine.unfinished:
                await fetcher.step()
            assert (await outcome(p, "late"))[:2] == cold[:2]
            got = fetcher.handler.fetches.info
            assert (got.fetches, got.hits, got.misses, got.failed) == (1, 0, 5, 1)
            assert fetcher.handler.fetches.leases  # leased until the holder's answer
            p.clock.advance(1.0)  # past the holder's budget when its step ends
            step.set()
            await asyncio.gather(serving, busy)
            assert holder.handler.fetches.info.served == 0
            entries = await fetcher.inbox.read(count=8, block_ms=0)
            (answer,) = [msg for _, msg in entries]
            assert isinstance(answer, FetchedBlocks) and answer.num_blocks == 0
            assert answer.error is not None and "busy past the fetch's 0.50 s budget" in answer.error
            await fetcher.handler.handle(answer)  # it ends the lease
            await fetcher.inbox.ack([entry_id for entry_id, _ in entries])
            nothing_held(holder, fetcher)

    run(main(), timeout_s=120)
