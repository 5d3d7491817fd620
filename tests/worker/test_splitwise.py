"""The splitwise hand-off, state by state: a prefill and a decode instance in this process, a real
Redis between them, real KV bytes through real shared memory, a stub model and a manual clock."""

from __future__ import annotations

import asyncio
import threading

import pytest
from router_support import run
from splitwise_support import (
    BLOCK_BYTES,
    ROUTER,
    Instance,
    Pair,
    kv_byte,
    pair,
    settle,
    token_for,
)

from pdserve.cache_transfer.shm import ShmWriter
from pdserve.errors import EngineError, TransferError
from pdserve.scheduler import Abort, ErrorInfo, Prefilled, ReserveBlocks, RouterInfo, RouterRegistry, Tokenize
from pdserve.worker.decode_lease import LEASE_GRACE_S, DecodeState
from pdserve.worker.prefill_handoff import PrefillState
from pdserve.worker.splitwise import RESERVE_RETRY_MS

PROMPT = list(range(1, 11))  # 10 tokens: 3 blocks of 4


def all_free(inst: Instance) -> bool:
    """Nothing held: no request, prefilled sequence, reservation or table entry; every block free,
    and the load snapshot the heartbeat reports says so too."""
    stub, handler = inst.stub, inst.handler
    held = stub.requests or stub.prefilled or stub.reserved or handler.owners or len(handler.splitwise)
    free = sorted(stub.free) == list(range(stub.num_blocks))
    return not held and free and inst.engine.load.free_blocks == stub.num_blocks


async def to_blocks_ready(p: Pair, prefill: Instance, decode: Instance, **kw) -> None:
    await p.send(prefill, p.request(PROMPT, **kw))
    await prefill.receive()
    assert prefill.prefill.state is PrefillState.RESERVING
    await decode.receive()
    assert decode.lease.state is DecodeState.RESERVED
    await prefill.receive()
    assert prefill.prefill.state is PrefillState.BLOCKS_READY


async def to_first_token_ready(p: Pair, prefill: Instance, **kw) -> None:
    await p.send(prefill, p.request(PROMPT, **kw))
    await prefill.receive()
    await prefill.step()
    assert prefill.prefill.state is PrefillState.FIRST_TOKEN_READY


def assert_completed(events, prompt: list[int], n: int) -> None:
    """The router saw the prompt's n tokens (the first from prefill, the rest from decode) and one end."""
    assert [t for e in events for t in e.token_ids] == [token_for(prompt, i) for i in range(n)]
    assert [e.finish_reason for e in events] == [None] * (n - 1) + ["length"]
    assert events[-1].usage.completion_tokens == n and events[-1].error is None


def assert_failed(events, kind: str, retryable: bool = True) -> ErrorInfo:
    (event,) = events
    assert event.finish_reason == "error" and event.token_ids == []
    assert (event.error.kind, event.error.retryable) == (kind, retryable), event.error
    return event.error


def test_blocks_then_first_token_moves_the_real_kv_bytes(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await to_blocks_ready(p, prefill, decode)
            dst = decode.lease.blocks
            await prefill.step()  # the prompt's step: first token, then straight to the transfer
            assert not prefill.handler.splitwise.prefills  # DONE, and out of the table
            assert_kv_arrived(decode, dst)
            await decode.receive()  # prefilled: decode takes the request over
            assert list(decode.handler.owners) == ["req-0/0"]
            await settle(prefill, decode)
            assert_completed(await p.events(), PROMPT, 4)
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_first_token_then_blocks(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await to_first_token_ready(p, prefill)
            assert await p.events() == []  # the first token waits for the hand-off
            await decode.receive()
            await prefill.receive()  # the reply: transfer at once
            assert not prefill.handler.splitwise.prefills
            await settle(prefill, decode)
            assert_completed(await p.events(), PROMPT, 4)
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_finished_on_its_first_token_frees_the_decode_reservation(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await p.send(prefill, p.request(PROMPT, max_tokens=1))
            await prefill.receive()
            await prefill.step()
            assert not prefill.handler.splitwise.prefills
            await settle(prefill, decode)  # decode reserves, then hears the abort
            assert_completed(await p.events(), PROMPT, 1)
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_engine_failure_on_the_prompt_step_reaches_the_router(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await p.send(prefill, p.request(PROMPT))
            await prefill.receive()
            prefill.stub.fail_next_step = "model step failed: boom"
            await prefill.step()
            await settle(prefill, decode)
            error = assert_failed(await p.events(), "engine_error", retryable=False)
            assert "boom" in error.message
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_refused_then_asked_again_after_the_back_off(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            decode.stub.reserve("someone-else", 14 * 4)  # 2 of 16 blocks left; the prompt needs 3
            await to_first_token_ready(p, prefill)
            await decode.receive()
            await prefill.receive()  # refused, with retry_after_ms
            handoff = prefill.prefill
            assert handoff.state is PrefillState.FIRST_TOKEN_READY and handoff.retry_at is not None
            decode.stub.cancel_reservation("someone-else")
            await prefill.handler.tick()
            assert await decode.receive() == 0  # not before the back-off
            p.clock.advance(RESERVE_RETRY_MS / 1000)
            await prefill.handler.tick()
            await settle(prefill, decode)
            assert_completed(await p.events(), PROMPT, 4)
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_refused_until_the_reserve_deadline_fails_retryable(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            decode.stub.reserve("someone-else", 14 * 4)
            await p.send(prefill, p.request(PROMPT, reserve_s=1.0))
            await prefill.receive()
            rounds = 0
            while prefill.handler.splitwise.prefills:
                await settle(prefill, decode)
                p.clock.advance(0.25)  # past each 200 ms back-off
                await prefill.handler.tick()
                rounds += 1
            assert rounds == 4  # asked again at 0.25, 0.5 and 0.75 s; failed at the 1 s deadline
            error = assert_failed(await p.events(), "unavailable")
            assert "before the deadline" in error.message
            await settle(prefill, decode)
            assert all_free(prefill)
            assert decode.stub.reserved.keys() == {"someone-else"} and not len(decode.handler.splitwise)

    run(main())


def test_a_refusal_without_retry_fails_at_once(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            decode.handler.draining = True
            await p.send(prefill, p.request(PROMPT))
            await settle(prefill, decode)
            error = assert_failed(await p.events(), "unavailable")
            assert "draining" in error.message
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_a_decode_instance_that_never_answers_times_out_at_the_reserve_deadline(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, _decode):
            await to_first_token_ready(p, prefill, decode_id="decode-gone")
            await prefill.handler.tick()
            assert prefill.prefill.state is PrefillState.FIRST_TOKEN_READY
            p.clock.advance(2.01)
            await prefill.handler.tick()
            assert_failed(await p.events(), "timeout")
            assert all_free(prefill)

    run(main())


def test_a_reply_too_late_is_ignored_and_its_blocks_freed(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await to_first_token_ready(p, prefill)
            await decode.receive()  # reserved; its reply waits in the prefill's inbox
            p.clock.advance(2.01)
            await prefill.handler.tick()
            assert_failed(await p.events(), "timeout")
            await settle(prefill, decode)  # the late reply finds nothing; decode hears the abort
            assert len(await p.events()) == 1
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_a_transfer_error_fails_retryable_and_frees_both_sides(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            missing = {"endpoint": {"shm": "pdserve-test-no-such-segment"}}
            await to_blocks_ready(p, prefill, decode, transfer=missing)
            await prefill.step()
            error = assert_failed(await p.events(), "kv_transfer_failed")
            assert "not found" in error.message
            await decode.receive()  # prefilled with the error: the reservation goes
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_a_passed_transfer_deadline_fails_the_transfer(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await to_blocks_ready(p, prefill, decode, transfer_s=1.0)
            p.clock.advance(1.5)
            await prefill.step()
            error = assert_failed(await p.events(), "kv_transfer_failed")
            assert "deadline" in error.message
            await settle(prefill, decode)
            assert all_free(prefill) and all_free(decode)

    run(main())


@pytest.mark.parametrize(
    "state", [PrefillState.RESERVING, PrefillState.BLOCKS_READY, PrefillState.FIRST_TOKEN_READY]
)
def test_abort_in_each_state_frees_everything(redis_url, state) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            if state is PrefillState.FIRST_TOKEN_READY:
                await to_first_token_ready(p, prefill)  # decode has not answered yet
            elif state is PrefillState.BLOCKS_READY:
                await to_blocks_ready(p, prefill, decode)
            else:
                await p.send(prefill, p.request(PROMPT))
                await prefill.receive()
                await decode.receive()
            assert prefill.prefill.state is state
            for inst in (prefill, decode):  # as the router aborts: both sides, every attempt
                await p.send(inst, Abort(request_id="req-0", reason="client disconnected"))
            await settle(prefill, decode)
            assert await p.events() == []
            assert all_free(prefill) and all_free(decode)

    run(main())


class GatedTransport(ShmWriter):
    """The real shm writer, held at the start of each write until the test opens the gate."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.entered, self.gate = threading.Event(), threading.Event()

    def write(self, src, segments):
        self.entered.set()
        assert self.gate.wait(5)
        return super().write(src, segments)


def test_abort_while_transferring_frees_after_the_write(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            gated = GatedTransport(decode.engine.facts.shm_name)
            p.transports.backends["shm"].writer = lambda peer: gated
            await to_blocks_ready(p, prefill, decode)
            stepping = asyncio.create_task(prefill.step())
            await asyncio.to_thread(gated.entered.wait, 5)
            assert prefill.prefill.state is PrefillState.TRANSFERRING
            await p.send(prefill, Abort(request_id="req-0", reason="client disconnected"))
            await prefill.receive(wait_writes=False)  # the inbox loop is not held by the write
            assert prefill.stub.prefilled  # the write still reads these blocks
            gated.gate.set()
            await stepping
            assert not prefill.handler.splitwise.prefills
            await settle(prefill, decode)
            assert await p.events() == []  # no first token after the abort
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_a_router_that_is_gone_loses_its_hand_offs_and_decode_hears_it(redis_url) -> None:
    """Gone = its key missing in every check for one TTL: then its hand-offs are freed, decode hears
    it, and its outbox gets a retryable control_plane_unavailable (read by nobody if it is dead)."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await to_blocks_ready(p, prefill, decode, reserve_s=60, transfer_s=60)
            ttl_s = prefill.handler.routers.ttl_s
            await RouterRegistry(p.redis, p.keys).deregister(ROUTER)
            await prefill.handler.tick()  # the first check that finds the key missing: no proof yet
            p.clock.advance(ttl_s - 1)  # (the routers are checked once a second)
            await prefill.handler.tick()
            assert prefill.prefill.state is PrefillState.BLOCKS_READY
            p.clock.advance(1)
            await prefill.handler.tick()
            assert all_free(prefill)
            await settle(prefill, decode)
            assert all_free(decode)
            assert_failed(await p.events(), "control_plane_unavailable")

    run(main())


def test_a_router_key_lost_with_redis_for_less_than_a_ttl_loses_nothing(redis_url) -> None:
    """A restarted or failed-over Redis lacks the router's key until its next heartbeat: a key
    missing for less than a TTL, or missing since the worker's own Redis failure, drops no work."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await to_blocks_ready(p, prefill, decode, reserve_s=60, transfer_s=60)
            ttl_s = prefill.handler.routers.ttl_s
            registry = RouterRegistry(p.redis, p.keys)
            await registry.deregister(ROUTER)
            await prefill.handler.tick()
            p.clock.advance(ttl_s - 1)
            prefill.handler.control_plane_failed()  # Redis failed this worker: the clock starts again
            await prefill.handler.tick()
            p.clock.advance(ttl_s - 1)
            await prefill.handler.tick()
            assert prefill.prefill.state is PrefillState.BLOCKS_READY
            await registry.register(RouterInfo(id=ROUTER, host="h", pid=1, port=1, started_at=0.0))
            p.clock.advance(ttl_s)
            await prefill.handler.tick()  # seen again: the missing time is forgotten
            await settle(prefill, decode)
            assert_completed(await p.events(), PROMPT, 4)

    run(main())


def test_a_generate_from_a_router_that_is_gone_gets_a_retryable_answer(redis_url) -> None:
    """Not dropped in silence: a router that Redis only forgot retries it instead of waiting out its
    first-token timeout."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, _decode):
            await RouterRegistry(p.redis, p.keys).deregister(ROUTER)
            await p.send(prefill, p.request(PROMPT))
            await prefill.receive()  # missing for the first time: served
            assert len(prefill.handler.splitwise.prefills) == 1
            p.clock.advance(prefill.handler.routers.ttl_s)
            await p.send(prefill, p.request(PROMPT, reserve_s=60, transfer_s=60))
            await prefill.receive()
            assert len(prefill.handler.splitwise.prefills) == 1  # the second one is not started
            (event,) = [e for e in await p.events() if e.request_id == "req-1"]
            assert (event.error.kind, event.error.retryable) == ("control_plane_unavailable", True)

    run(main())


def test_shutdown_fails_hand_offs_as_retryable(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await to_blocks_ready(p, prefill, decode)
            await prefill.handler.fail_all("instance is shutting down")
            assert_failed(await p.events(), "unavailable")
            assert not prefill.handler.splitwise.prefills

    run(main())


# ---- decode side alone -------------------------------------------------------------------------------
def reserve_msg(p: Pair, num_tokens: int = 10, transfer_s: float = 5.0) -> ReserveBlocks:
    req = p.request(PROMPT, transfer_s=transfer_s)
    return ReserveBlocks(
        request_id=req.request_id,
        router_id=ROUTER,
        num_tokens=num_tokens,
        reply_to="prefill",
        deadline=req.deadline,
        deadlines=req.disaggregate_info.deadlines,
        sampling=req.sampling,
        prompt_token_ids=PROMPT,
    )


def test_a_repeated_ask_gets_the_same_blocks(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            msg = reserve_msg(p)
            await p.send(decode, msg)
            await p.send(decode, msg)
            await decode.receive()
            replies = [m for _id, m in await prefill.inbox.read(block_ms=0)]
            assert [r.ok for r in replies] == [True, True]
            assert replies[0].block_ids == replies[1].block_ids and len(replies[0].block_ids) == 3
            assert len(decode.stub.free) == 13

    run(main())


def test_a_lease_expires_a_grace_after_the_transfer_deadline(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, _prefill, decode):
            await p.send(decode, reserve_msg(p, transfer_s=1.0))
            await decode.receive()
            await decode.handler.tick()
            assert decode.lease.state is DecodeState.RESERVED
            p.clock.advance(1.01)
            await decode.handler.tick()
            assert decode.lease.state is DecodeState.RESERVED  # a write P started in time may land
            p.clock.advance(LEASE_GRACE_S)
            await decode.handler.tick()
            assert all_free(decode)

    run(main())


def test_a_failed_prefill_frees_the_lease_and_a_late_one_is_ignored(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, _prefill, decode):
            msg = reserve_msg(p)
            await p.send(decode, msg)
            await decode.receive()
            failed = Prefilled(
                request_id=msg.request_id,
                first_token=5,
                prompt_token_ids=PROMPT,
                error=ErrorInfo.of(TransferError("wire cut")),
            )
            await p.send(decode, failed)
            await decode.receive()
            assert all_free(decode)
            await p.send(decode, failed.model_copy(update={"error": None}))
            await decode.receive()  # no reservation any more: logged and dropped
            assert all_free(decode)

    run(main())


def test_a_prefilled_request_that_decode_cannot_continue_fails_and_frees_the_lease(redis_url) -> None:
    """E.g. a first token that does not follow the request's grammar there: the router hears the
    engine's error after the first token, not silence until the stall timeout."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await to_blocks_ready(p, prefill, decode)

            def refuse(*args, **kwargs):
                raise EngineError("the prefill's first token 7 does not follow the request's grammar")

            decode.stub.add_prefilled = refuse
            await prefill.step()
            await decode.receive()
            first, failure = await p.events()
            assert first.token_ids == [token_for(PROMPT, 0)] and first.finish_reason is None
            assert failure.finish_reason == "error" and failure.error.kind == "engine_error"
            assert "does not follow" in failure.error.message
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_a_full_decode_cache_refuses_with_a_retry_hint(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url, decode_blocks=2) as (p, prefill, decode):
            await p.send(decode, reserve_msg(p, num_tokens=10))
            await decode.receive()
            ((_id, reply),) = await prefill.inbox.read(block_ms=0)
            assert (reply.ok, reply.retry_after_ms) == (False, RESERVE_RETRY_MS)
            assert "10-token room" in reply.error
            assert all_free(decode)

    run(main())


# ---- over mooncake ---------------------------------------------------------------------------------
def assert_kv_arrived(decode: Instance, dst: list[int]) -> None:
    """Decode's reserved blocks hold the prompt's KV bytes, block by block."""
    assert [decode.stub.block_bytes(b) for b in dst] == [
        bytes([kv_byte(PROMPT, i)]) * BLOCK_BYTES for i in range(len(dst))
    ]


def test_the_hand_off_over_mooncake_moves_the_real_bytes(redis_url, mooncake_ready) -> None:
    async def main() -> None:
        async with pair(redis_url, mooncake=True) as (p, prefill, decode):
            await to_blocks_ready(p, prefill, decode)
            dst = decode.lease.blocks
            await prefill.step()
            assert_kv_arrived(decode, dst)
            await settle(prefill, decode)
            assert_completed(await p.events(), PROMPT, 4)
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_a_gpu_cache_over_mooncake_lands_through_the_landing_pool(redis_url, mooncake_ready) -> None:
    """Both caches as GPU caches (torch's CPU device standing in): D reserves room in its bounded
    landing pool with the blocks and says where (``staging_offset``), P writes there, D lands the
    bytes into its blocks on ``prefilled``, checks them and decodes; the room is free again after."""
    torch = pytest.importorskip("torch", reason="staging a GPU cache needs PyTorch")
    from pdserve.cache_transfer.base import LocalCache
    from pdserve.cache_transfer.mooncake import MooncakeBackend
    from pdserve.worker.kv_writers import Transports

    async def main() -> None:
        async with pair(redis_url, mooncake=True) as (p, prefill, decode):
            for inst in (prefill, decode):
                p.backends.pop(inst.id).close()
                staged = MooncakeBackend("127.0.0.1", staging_mb=1)
                view = torch.from_numpy(inst.stub.cache)  # the "device" cache: the stub's own bytes
                staged.open(LocalCache(view, device="cuda", block_bytes=BLOCK_BYTES, shared=inst is decode))
                p.backends[inst.id] = staged
                inst.handler.ctx.transports = Transports({"mooncake": staged})
            p.transports = prefill.handler.ctx.transports
            pool = p.backends["decode"].staging
            p.decode_transfer = {
                "protocols": ["mooncake"],
                "endpoint": {"mooncake": p.backends["decode"].endpoint()},
            }
            await to_blocks_ready(p, prefill, decode)
            lease = decode.lease
            assert lease.landing is not None and prefill.prefill.staging_offset == lease.landing.offset
            assert pool.free_bytes == pool.nbytes - 3 * BLOCK_BYTES
            dst = lease.blocks
            await prefill.step()  # into D's pool, not its blocks
            await decode.receive()  # prefilled: landed into the blocks, checked, decoding
            assert_kv_arrived(decode, dst)
            assert pool.free_bytes == pool.nbytes
            assert (
                decode.handler.ctx.integrity.kv_checked == 1
                and decode.handler.ctx.integrity.kv_mismatches == 0
            )
            await settle(prefill, decode)
            assert_completed(await p.events(), PROMPT, 4)
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_a_decode_cache_gone_from_mooncake_fails_the_hand_off_and_frees_both(
    redis_url, mooncake_ready
) -> None:
    async def main() -> None:
        async with pair(redis_url, mooncake=True) as (p, prefill, decode):
            await to_blocks_ready(p, prefill, decode)
            p.backends["decode"].close()  # the decode side stops accepting writes (as when it goes away)
            await prefill.step()
            error = assert_failed(await p.events(), "kv_transfer_failed")
            assert "mooncake write" in error.message
            await settle(prefill, decode)
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_echo_sends_the_prompt_text_with_the_first_token_only(redis_url) -> None:
    """``echo``: the delta with the first token carries the prompt's text, from prefill in a
    hand-off (also when it ends on that token) and from the instance serving a whole request."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            text = "".join(f"<{t}>" for t in PROMPT)  # the stub engine's text of a token
            for max_tokens in (4, 1):
                msg = p.request(PROMPT, max_tokens)
                msg.echo = True
                await p.send(prefill, msg)
                await settle(prefill, decode)
            whole = p.request(PROMPT, 3).model_copy(update={"disaggregate_info": None, "echo": True})
            await p.send(decode, whole)
            await settle(decode)
            events = await p.events()
            by_request: dict[str, list] = {}
            for e in events:
                by_request.setdefault(e.request_id, []).append(e.prompt_text)
            assert by_request == {
                "req-0": [text, None, None, None],
                "req-1": [text],
                "req-2": [text, None, None],
            }
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_prompt_logprobs_come_from_prefill_with_the_first_token_only(redis_url) -> None:
    """``prompt_logprobs``: the prefill instance scores the prompt and its first-token delta carries
    them (also when it ends on that token); decode's deltas never do; a whole request's first does."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            for max_tokens in (4, 1):
                msg = p.request(PROMPT, max_tokens)
                msg.sampling.prompt_logprobs = 2
                await p.send(prefill, msg)
                await settle(prefill, decode)
            whole = p.request(PROMPT, 3).model_copy(update={"disaggregate_info": None})
            whole.sampling.prompt_logprobs = 0
            await p.send(decode, whole)
            await settle(decode)
            by_request: dict[str, list] = {}
            for e in await p.events():
                scored = e.prompt_logprobs
                by_request.setdefault(e.request_id, []).append(
                    scored and [(x.token_id, x.logprob) for x in scored]
                )
            prompt = [(PROMPT[0], None)] + [(t, 0.0) for t in PROMPT[1:]]  # the stub's: all certain
            assert by_request == {
                "req-0": [prompt, None, None, None],
                "req-1": [prompt],
                "req-2": [prompt, None, None],
            }
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_decode_continues_with_the_logit_bias_prefill_sampled_with(redis_url) -> None:
    """The bias crosses to decode in ReserveBlocks' sampling (JSON: string keys) and is what
    decode's engine request runs with, so both sides sample the same way."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            msg = p.request(PROMPT)
            msg.sampling.logit_bias = {7: 100.0, 9: -3}
            await p.send(prefill, msg)
            await prefill.receive()
            assert prefill.stub.requests["req-0/0"].params.logit_bias == {7: 100.0, 9: -3}
            await decode.receive()
            await prefill.receive()
            await prefill.step()  # first token, KV written, prefilled sent
            await decode.receive()
            assert decode.stub.requests["req-0/0"].params.logit_bias == {7: 100.0, 9: -3}
            await settle(prefill, decode)
            assert_completed(await p.events(), PROMPT, 4)

    run(main())


def test_deltas_are_numbered_across_prefill_and_decode(redis_url) -> None:
    """Prefill publishes delta 0, decode goes on from 1: the router can drop repeats and see gaps."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await p.send(prefill, p.request(PROMPT))
            await settle(prefill, decode)
            events = await p.events()
            assert_completed(events, PROMPT, 4)
            assert [e.seq for e in events] == [0, 1, 2, 3]

    run(main())


async def send_again(p: Pair, inst: Instance) -> None:
    """XADD the inbox's newest entry a second time, field for field (what a retried XADD does)."""
    [(_entry_id, fields)] = await p.redis.xrevrange(p.keys.inbox(inst.id), count=1)
    await p.redis.xadd(p.keys.inbox(inst.id), fields)


def test_a_repeated_generate_is_ignored_and_the_request_stays_abortable(redis_url) -> None:
    """The same generate twice in the inbox (a retried XADD): the first runs, the second is ignored
    (no 400 for the live request, no second run), and an abort still stops the first."""

    async def main() -> None:
        async with pair(redis_url) as (p, _prefill, decode):
            whole = p.request(PROMPT, max_tokens=8).model_copy(update={"disaggregate_info": None})
            await p.send(decode, whole)
            await send_again(p, decode)
            assert await decode.receive() == 2
            assert list(decode.handler.owners) == ["req-0/0"] and len(decode.stub.requests) == 1
            await decode.step()
            await decode.step()
            events = await p.events()
            assert [(e.seq, e.error) for e in events] == [(0, None), (1, None)]
            await p.send(decode, Abort(request_id="req-0", reason="client disconnected"))
            await decode.receive()
            await settle(decode)
            assert all_free(decode) and await p.events() == events  # nothing after the abort
            await p.send(decode, whole)  # once more, after its end (acked entries are gone): not run again
            await decode.receive()
            assert all_free(decode) and await p.events() == events

    run(main())


class FailingTransport(ShmWriter):
    """A writer that fails with an error from outside pdserve's tree (a bug, a library's error)."""

    def write(self, src, segments):
        raise ZeroDivisionError("a bug in the transport")


def test_a_foreign_error_in_the_transfer_fails_the_request_and_frees_both(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            backend = p.transports.backends["shm"]
            real_writer = backend.writer
            backend.writer = lambda peer: FailingTransport(peer)
            await to_blocks_ready(p, prefill, decode)
            await prefill.step()  # the transfer raises inside: the step's caller must not see it
            assert not prefill.handler.splitwise.prefills  # not stuck in TRANSFERRING
            error = assert_failed(await p.events(), "kv_transfer_failed")
            assert "ZeroDivisionError" in error.message
            await decode.receive()  # prefilled with the error: the reservation goes
            assert all_free(prefill) and all_free(decode)
            backend.writer = real_writer  # and the instance keeps serving
            await p.send(prefill, p.request(PROMPT))
            await settle(prefill, decode)
            assert_completed((await p.events())[1:], PROMPT, 4)
            assert all_free(prefill) and all_free(decode)

    run(main())


def test_a_foreign_error_handling_a_request_ends_it_at_once(redis_url) -> None:
    """E.g. a chat request to a model without a chat template: its generate or tokenize ends with an
    internal error event at once (not a router timeout), and the instance keeps serving."""

    async def main() -> None:
        async with pair(redis_url) as (p, _prefill, decode):
            plain = decode.stub.prompt_ids

            def no_template(prompt, messages, *args, **kwargs):
                if messages is not None:
                    raise ValueError("this tokenizer has no chat template")
                return plain(prompt, messages, *args, **kwargs)

            decode.stub.prompt_ids = no_template
            chat = [{"role": "user", "content": "hi"}]
            whole = p.request(PROMPT).model_copy(
                update={"disaggregate_info": None, "prompt_token_ids": None, "messages": chat}
            )
            await p.send(decode, whole)
            await p.send(
                decode, Tokenize(request_id="tok-1", router_id=ROUTER, deadline=whole.deadline, messages=chat)
            )
            assert await decode.receive() == 2
            events = await p.events()
            assert [(e.request_id, e.finish_reason) for e in events] == [
                ("req-0", "error"),
                ("tok-1", "error"),
            ]
            for event in events:
                assert (event.error.kind, event.error.retryable) == ("internal_error", False)
                assert "ValueError" in event.error.message
            assert all_free(decode)
            await p.send(decode, p.request(PROMPT).model_copy(update={"disaggregate_info": None}))
            await settle(decode)
            assert_completed((await p.events())[2:], PROMPT, 4)

    run(main())
