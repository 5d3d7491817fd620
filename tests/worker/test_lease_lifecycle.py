"""A decode lease ends when its writer is done, on the decode instance's own clock.

A prefill's KV write is stalled on its first chunk (a gate in the real shm writer) while the
request is given up — a client disconnecting, the first-token timeout firing at the transfer
deadline, the prefill shutting down while the router retries — and the decode instance then
reserves blocks for another request. That request never gets a block the stalled write can still
land in, and once everything settles every block holds its owner's bytes. Then the same lease with
the decode host's wall clock 30 s ahead of or behind the prefill's: no early free, and a lease
whose writer died is freed within its backstop. Real Redis, real shared memory, the stub model.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from router_support import run
from splitwise_support import BLOCK_BYTES, T0, Instance, ManualClock, Pair, StubEngine, kv_byte, pair

from pdserve.cache_transfer.shm import ShmWriter
from pdserve.scheduler import Abort, GenerateRequest
from pdserve.worker import kv_copy
from pdserve.worker.clock import Clock
from pdserve.worker.decode_lease import LEASE_GRACE_S

A_PROMPT = list(range(1, 11))  # 3 blocks of 4 tokens
B_PROMPT = list(range(50, 61))  # 3 blocks


class StalledWriter(ShmWriter):
    """The real shm writer; its first write call (the first chunk of the first hand-off) waits
    until the test opens the gate, later ones go straight through. Counts the segments copied."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.entered, self.gate = threading.Event(), threading.Event()
        self.calls = 0
        self.writes_after_gate = 0

    def write(self, src, segments):
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.gate.wait(10)
        elif self.gate.is_set():
            self.writes_after_gate += 1
        return super().write(src, segments)


async def stalled_hand_off(p: Pair, prefill: Instance, decode: Instance, writer: StalledWriter):
    """Request A's write started and stalled on its first chunk; the step still running (as the
    old code ran it) and A's reserved blocks."""
    msg = p.request(A_PROMPT, transfer_s=5.0)
    await p.send(prefill, msg)
    await prefill.receive()
    await decode.receive()
    await prefill.receive()
    blocks = list(decode.lease.blocks)
    stepping = asyncio.create_task(prefill.step())
    assert await asyncio.to_thread(writer.entered.wait, 5)
    return msg, blocks, stepping


def decode_bytes_belong_to_their_owners(decode: Instance, owners: dict[str, list[int]]) -> None:
    """Every block of every request decode holds has its own prompt's KV bytes (the stub writes
    ``kv_byte(prompt, i)`` all over a prompt's i-th block)."""
    for key, prompt in owners.items():
        req = decode.stub.requests.get(key)
        assert req is not None, f"{key} is not decoding"
        for i, block in enumerate(req.blocks[: -(-len(prompt) // 4)]):
            got = set(decode.stub.block_bytes(block))
            assert got == {kv_byte(prompt, i)}, f"{key}'s block {i} (#{block}) holds {got}, not its own"


@pytest.mark.parametrize("trigger", ["client-disconnect", "first-token-timeout", "prefill-shutdown-retry"])
def test_a_block_still_being_written_is_never_reserved_again(redis_url, monkeypatch, trigger) -> None:
    """D's cache has 5 blocks: A holds 3 while its write stalls, so B (3 blocks) can only have
    them once A's writer is done. Before the fix D freed A's blocks at the router's abort, B got
    one of them, and A's remaining chunks (the copy went on) landed over B's KV."""
    monkeypatch.setattr(kv_copy, "WRITE_CHUNK_BYTES", BLOCK_BYTES)  # a chunk per block

    async def main() -> None:
        async with pair(redis_url, decode_blocks=5) as (p, prefill, decode):
            writer = StalledWriter(decode.engine.facts.shm_name)
            p.transports.backends["shm"].writer = lambda peer: writer
            other = await p.instance("prefill-2", "prefill", StubEngine())
            a, a_blocks, stepping = await stalled_hand_off(p, prefill, decode, writer)

            b: GenerateRequest
            stopping = None
            if trigger == "prefill-shutdown-retry":
                stopping = asyncio.create_task(prefill.handler.fail_all("instance is shutting down"))
                await asyncio.sleep(0.1)  # the failure the router retries on (published at once, before)
                for inst in (prefill, decode):
                    await p.send(inst, Abort(request_id=a.request_id, reason="retried", attempt=0))
                b = p.request(A_PROMPT, transfer_s=30.0, attempt=1).model_copy(
                    update={"request_id": a.request_id}
                )
            else:
                if trigger == "first-token-timeout":
                    p.clock.advance(5.0)  # the router's first-token timer: the transfer deadline
                for inst in (prefill, decode):  # the router's close(): Abort to the route
                    await p.send(inst, Abort(request_id=a.request_id, reason=trigger))
                b = p.request(B_PROMPT, transfer_s=30.0)
            await prefill.receive(wait_writes=False)
            await decode.receive()
            await decode.handler.tick()

            # B, through another prefill instance, asks D for blocks while A's write still stalls
            b_key = f"{b.request_id}/{b.attempt}"
            await p.send(other, b)
            await other.receive()
            await decode.receive()
            lease = decode.handler.splitwise.leases.get(b_key)
            if lease is not None:
                assert not set(lease.blocks) & set(a_blocks), f"B got {lease.blocks}, A writes {a_blocks}"

            writer.gate.set()  # A's stalled chunk lands
            await stepping
            if stopping is not None:
                await stopping
            assert writer.writes_after_gate == 0  # A's write stopped before its next chunk
            for _ in range(20):  # B asks again after D's back-off, gets blocks, writes, decodes
                await prefill.receive()
                await decode.receive()
                await other.receive()
                await other.step()
                if b_key in decode.stub.requests:
                    break
                p.clock.advance(0.25)
                await other.handler.tick()
                await decode.handler.tick()
            b_prompt = b.prompt_token_ids
            assert b_prompt is not None
            decode_bytes_belong_to_their_owners(decode, {b_key: b_prompt})
            assert list(decode.handler.splitwise.leases) == []  # A's lease ended with its writer
            await other.engine.close()

    run(main())


class SkewedClock(Clock):
    """A test double: another host's clocks. Its wall clock is ``offset_s`` off the pair's, and its
    monotonic clock counts from an origin of its own; both advance with the pair's."""

    def __init__(self, base: ManualClock, offset_s: float) -> None:
        self.base, self.offset_s = base, offset_s

    def time(self) -> float:
        return self.base.time() + self.offset_s

    def monotonic(self) -> float:
        return self.base.monotonic() + 12345.0


@pytest.mark.parametrize("skew_s", [30.0, -30.0])
def test_a_lease_holds_until_its_backstop_whatever_the_hosts_wall_clocks(redis_url, skew_s) -> None:
    """D's wall clock 30 s ahead of P's (and the router's), or behind: D frees a lease whose writer
    never says it is done exactly at its backstop (P's transfer budget + the grace, on D's own
    monotonic clock), not before it (a write may still land) and not 30 s after it."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, _decode):
            decode = await p.instance(
                "decode-skewed", "decode", StubEngine(16, shared=True), SkewedClock(p.clock, skew_s)
            )
            p.decode_transfer = {"protocols": ["shm"], "endpoint": {"shm": decode.engine.facts.shm_name}}
            await p.send(prefill, p.request(A_PROMPT, transfer_s=5.0, decode_id=decode.id))
            await prefill.receive()  # reserve sent; P then dies without a word (never stepped again)
            await decode.receive()
            (lease,) = decode.handler.splitwise.leases.values()
            for elapsed in (1.0, 4.9, 5.0 + LEASE_GRACE_S - 0.1):
                p.clock.now = T0 + elapsed
                p.clock.mono = elapsed
                await decode.handler.tick()
                assert decode.handler.splitwise.leases, f"freed {elapsed} s after the reserve: too early"
            p.clock.now, p.clock.mono = T0 + 5.0 + LEASE_GRACE_S + 0.1, 5.0 + LEASE_GRACE_S + 0.1
            await decode.handler.tick()
            assert not decode.handler.splitwise.leases and not decode.stub.reserved, lease.state
            await decode.engine.close()

    run(main())


@pytest.mark.parametrize("skew_s", [30.0, -30.0])
def test_a_skewed_decode_instance_takes_a_hand_off_written_in_time(redis_url, skew_s) -> None:
    """P writes 3 s after the reserve, within its 5 s budget, whatever D's wall clock says: D has
    held the blocks, and decodes the request's tokens from them."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, _decode):
            decode = await p.instance(
                "decode-skewed", "decode", StubEngine(16, shared=True), SkewedClock(p.clock, skew_s)
            )
            p.decode_transfer = {"protocols": ["shm"], "endpoint": {"shm": decode.engine.facts.shm_name}}
            msg = p.request(A_PROMPT, transfer_s=5.0, decode_id=decode.id, max_tokens=3)
            await p.send(prefill, msg)
            await prefill.receive()
            await decode.receive()
            await prefill.receive()
            p.clock.advance(3.0)
            await decode.handler.tick()
            await prefill.step()  # first token and the write
            await decode.receive()
            for _ in range(4):
                await decode.step()
            events = await p.events()
            assert [e.error for e in events] == [None] * len(events)
            assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == 3
            assert events[0].request_id == msg.request_id
            await decode.engine.close()

    run(main())
