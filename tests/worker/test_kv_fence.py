"""A KV write is fenced: a decode instance restarted under the same id, whose shared-memory
segment has the same name, is never written with the blocks its previous run reserved; a lease is
held past its deadline for a grace, and a write that cannot finish in time is not started.

The restart test runs the real `tiny` model on both sides (its tokens depend on the K/V, unlike the
stub's), real shared memory between them and a real Redis; the instances live in this process and
the test moves them step by step, so the restart falls exactly between the reservation and the write.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from router_support import run
from splitwise_support import BLOCK_BYTES, ROUTER, T0, Instance, Pair, pair, settle

from pdserve.cache_transfer.base import KVTransport, LocalCache
from pdserve.cache_transfer.shm import ShmBackend, ShmWriter
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import GenerateRequest
from pdserve.scheduler.tasks import cancel_and_wait
from pdserve.worker import decode_lease, kv_copy
from pdserve.worker.decode_lease import DecodeState

LEASE_GRACE_S = getattr(decode_lease, "LEASE_GRACE_S", 0.0)

BLOCK = 16
LONG = [(7 * i + 3) % 200 + 5 for i in range(200)]  # 13 blocks
OTHERS = [[(11 * i + 5 * k) % 180 + 20 for i in range(20 + 3 * k)] for k in range(3)]
MAX_TOKENS = 12


def tiny(model_dir, shm_name: str | None = None) -> LLMEngine:
    config = EngineConfig(
        num_blocks=96,
        block_size=BLOCK,
        max_model_len=512,
        threads=1,
        prefix_caching=False,
        shared_kv=shm_name is not None,
        shm_name=shm_name,
    )
    return LLMEngine(model_dir, config)


def whole(p: Pair, prompt: list[int], request_id: str) -> GenerateRequest:
    """A request the decode instance serves whole (no prefill instance: decoding there)."""
    return GenerateRequest(
        request_id=request_id,
        router_id=ROUTER,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        deadline=p.clock.time() + 30,
    )


def reference(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens from an engine of its own (batched equals alone: test_exactness)."""
    engine = tiny(model_dir)
    try:
        out: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", None, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), prompt)
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        return [out[f"r{i}"] for i in range(len(prompts))]
    finally:
        engine.close()


async def tokens_of(p: Pair) -> dict[str, tuple[list[int], str | None, object]]:
    """Per request id: the tokens the router got, the last finish reason, the last error."""
    got: dict[str, tuple[list[int], str | None, object]] = {}
    for e in await p.events():
        tokens, _, _ = got.get(e.request_id, ([], None, None))
        got[e.request_id] = (tokens + list(e.token_ids), e.finish_reason, e.error)
    return got


def started(decode: Instance, name: str, incarnation: str) -> None:
    """What the worker does at start: the incarnation into its context and its segment's fence."""
    decode.handler.ctx.incarnation = incarnation
    ShmBackend().open(
        LocalCache(decode.engine.kv_view(), shm_name=name, shared=True, incarnation=incarnation)
    )


async def restarted(p: Pair, old: Instance, model_dir, name: str, incarnation: str) -> Instance:
    """``old`` stops (its engine and segment go, nothing else is said) and a new decode instance
    starts under the same id, the same segment name, a new incarnation."""
    await old.engine.close()
    new = await p.instance(old.id, "decode", tiny(model_dir, name))  # type: ignore[arg-type]
    started(new, name, incarnation)
    p.decode_transfer = {"protocols": ["shm"], "endpoint": {"shm": name}, "incarnation": incarnation}
    return new


@pytest.mark.parametrize("acked", [True, False], ids=["reserve-acked", "reserve-re-read"])
def test_a_decode_restarted_under_its_id_mid_prefill_gets_no_stale_kv(
    redis_url, tiny_model_dir, acked
) -> None:
    """P has D's blocks for a long prompt; D restarts under its id (same segment name) and serves
    other requests; then P's prefill ends and it writes. Those requests' text equals the reference,
    and the long one either equals it too (re-reserved on the new D) or fails retryable: never
    tokens decoded from blocks nobody wrote. ``acked``: the old D acked the reserve; otherwise the
    new D re-reads it from its inbox and reserves blocks of its own."""
    refs = reference(tiny_model_dir, [LONG, *OTHERS])

    async def main() -> None:
        async with pair(redis_url) as (p, _stub_prefill, _stub_decode):
            name = f"pdserve-test-{uuid.uuid4().hex[:10]}"
            prefill = await p.instance("prefill-t", "prefill", tiny(tiny_model_dir))  # type: ignore[arg-type]
            decode = await p.instance("decode-t", "decode", tiny(tiny_model_dir, name))  # type: ignore[arg-type]
            started(decode, name, "one")
            p.decode_transfer = {"protocols": ["shm"], "endpoint": {"shm": name}, "incarnation": "one"}
            # the old D's block ids differ from a fresh one's: something else holds its first blocks
            assert await decode.engine.try_reserve("pad", list(range(40)), SamplingParams()) is not None

            long = p.request(LONG, max_tokens=MAX_TOKENS, decode_id=decode.id, transfer_s=30)
            await p.send(prefill, long)
            await prefill.receive()  # reserve sent; the prompt queued on P
            entries = await decode.inbox.read(count=64, block_ms=0)
            for _entry_id, msg in entries:
                await decode.handler.handle(msg)
            if acked:
                await decode.inbox.ack([entry_id for entry_id, _ in entries])
            await prefill.receive()  # P holds the old D's blocks

            decode = await restarted(p, decode, tiny_model_dir, name, "two")
            for i, prompt in enumerate(OTHERS):
                await p.send(decode, whole(p, prompt, f"other-{i}"))
            await decode.receive()
            await decode.step()  # the others' prompts are in the new D's blocks, decoding
            await decode.step()

            await settle(prefill, decode, rounds=200)  # P's prefill ends: its write, then decoding
            got = await tokens_of(p)
            for i in range(len(OTHERS)):
                tokens, finish, error = got[f"other-{i}"]
                assert (tokens, finish, error) == (refs[1 + i], "length", None), f"other-{i}"
            tokens, finish, error = got[long.request_id]
            if error is None:
                assert tokens == refs[0] and finish == "length"
            else:
                assert error.retryable and error.kind in ("kv_transfer_failed", "unavailable"), error
            for inst in (prefill, decode):
                await inst.engine.close()

    run(main())


# ---- item 2: a lease outlives its deadline by a grace; a write never starts a chunk it cannot finish


class Recording(KVTransport):
    """An shm writer that takes ``seconds`` of the manual clock per segment it copies, remembers the
    clock when each one started, and can hold a write until ``go`` is set (a slow copy on a thread)."""

    protocol = "shm"

    def __init__(self, inner: ShmWriter, clock, seconds: float) -> None:
        self.inner, self.clock, self.seconds = inner, clock, seconds
        self.starts: list[float] = []
        self.go = threading.Event()
        self.go.set()
        self.copying = threading.Event()
        self.closed = False

    def write(self, src, segments) -> int:
        moved = 0
        for segment in segments:
            self.copying.set()
            assert self.go.wait(10)
            self.starts.append(self.clock.time())
            moved += self.inner.write(src, [segment])
            self.clock.advance(self.seconds)
        return moved

    def current(self) -> bool:
        return self.inner.current()

    def fence(self):
        return self.inner.fence() if hasattr(self.inner, "fence") else None

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class RecordingShm(ShmBackend):
    def __init__(self, clock, seconds: float = 0.0, hold: bool = False) -> None:
        super().__init__()
        self.clock, self.seconds, self.hold = clock, seconds, hold
        self.writers: list[Recording] = []

    def writer(self, peer) -> Recording:
        self.writers.append(Recording(ShmWriter(str(peer)), self.clock, self.seconds))
        if self.hold:
            self.writers[-1].go.clear()  # its copy waits for the test
        return self.writers[-1]


SPLIT = list(range(1, 31))  # 30 tokens: 8 stub blocks


async def blocks_ready_apart(p: Pair, prefill: Instance, decode: Instance, transfer_s: float) -> None:
    """``SPLIT``'s hand-off to blocks_ready, D's blocks never adjacent: one segment per block."""
    n = decode.stub.num_blocks
    for i in range(n):
        assert await decode.engine.try_reserve(f"pad-{i}", [1], SamplingParams()) is not None
    for i in range(0, n, 2):
        assert await decode.engine.cancel_reservation(f"pad-{i}")
    await p.send(prefill, p.request(SPLIT, max_tokens=2, transfer_s=transfer_s))
    await prefill.receive()
    await decode.receive()
    await prefill.receive()
    blocks = decode.handler.splitwise.leases[f"{prefill.prefill.msg.request_id}/0"].blocks
    assert len(blocks) == 8 and all(b % 2 == 0 for b in blocks), blocks


def test_a_lease_is_held_past_its_deadline_for_the_grace(redis_url) -> None:
    """P started its write in time, on its clock; D must not free (and hand out) the blocks the
    moment the deadline passes on its own: the write may still land. Before the fix D freed them at
    the deadline itself."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await p.send(prefill, p.request(list(range(1, 11)), transfer_s=1.0))
            await prefill.receive()
            await decode.receive()
            p.clock.advance(1.5)  # past the deadline, within the grace
            await decode.handler.tick()
            leases = decode.handler.splitwise.leases.values()
            assert [lease.state for lease in leases] == [DecodeState.RESERVED]
            p.clock.advance(LEASE_GRACE_S)
            await decode.handler.tick()
            assert not decode.handler.splitwise.leases and not decode.stub.reserved

    run(main())


def test_no_chunk_of_a_write_starts_after_the_transfer_deadline(redis_url, monkeypatch) -> None:
    """A copy slow enough to cross the deadline stops there, between blocks: nothing is copied past
    it (D may free the blocks after the grace), and the hand-off fails retryable. Before the fix
    the deadline was checked once, before the whole copy."""
    monkeypatch.setattr(kv_copy, "WRITE_CHUNK_BYTES", BLOCK_BYTES)

    async def main() -> None:
        async with pair(redis_url, decode_blocks=32) as (p, prefill, decode):
            backend = RecordingShm(p.clock, seconds=1.0)
            p.transports.backends["shm"] = backend
            await blocks_ready_apart(p, prefill, decode, transfer_s=3.5)
            await prefill.step()  # first token: the write, one second per block
            deadline = T0 + 3.5
            (writer,) = backend.writers
            assert writer.starts and all(t <= deadline for t in writer.starts), writer.starts
            (event,) = [e for e in await p.events() if e.finish_reason]
            assert event.error is not None and event.error.kind == "kv_transfer_failed"
            assert event.error.retryable
            await settle(prefill, decode)

    run(main())


# ---- item 6: writers close only when idle


def test_shutdown_does_not_close_a_writer_while_its_copy_runs(redis_url) -> None:
    """Shutdown cancels the loops (the write's coroutine with them) and closes the writers; a copy
    still running on its thread keeps its writer (and the backends) open until it returns. Before
    the fix the cancelled coroutine let go of the writer, which closed under the copy."""

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            backend = RecordingShm(p.clock, hold=True)
            p.transports.backends["shm"] = backend
            await p.send(prefill, p.request(list(range(1, 11)), transfer_s=30))
            await prefill.receive()
            await decode.receive()
            await prefill.receive()
            stepping = asyncio.create_task(prefill.step())
            while not backend.writers:
                await asyncio.sleep(0.01)
            (writer,) = backend.writers
            await asyncio.to_thread(writer.copying.wait, 5)
            await cancel_and_wait(stepping)  # shutdown cancels the engine loop
            p.transports.close()
            assert not writer.closed  # the copy still runs
            writer.go.set()
            for _ in range(200):
                if writer.closed:
                    break
                await asyncio.sleep(0.01)
            assert writer.closed  # closed by the copy's end

    run(main())


def test_decode_refuses_prefilled_for_a_lease_it_does_not_hold_and_tells_the_router(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            await p.send(prefill, p.request(list(range(1, 11))))
            await prefill.receive()
            await decode.receive()
            await prefill.receive()
            prefill.prefill.lease = "not-this-one"  # as if written for another run's reservation
            await prefill.step()
            await decode.receive()
            assert not decode.handler.splitwise.leases and not decode.stub.reserved
            assert not decode.handler.owners  # not continued from blocks nobody wrote
            (end,) = [e for e in await p.events() if e.finish_reason]
            assert end.error is not None and end.error.kind == "kv_transfer_failed" and end.error.retryable

    run(main())


def test_a_write_that_cannot_end_by_the_deadline_at_the_known_rate_is_not_started(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            backend = RecordingShm(p.clock)
            p.transports.backends["shm"] = backend
            p.transports.observe("shm", 10, 1.0)  # 10 B/s: 3 blocks of 32 B take ~10 s
            await p.send(prefill, p.request(list(range(1, 11)), transfer_s=5.0))
            await prefill.receive()
            await decode.receive()
            await prefill.receive()
            await prefill.step()
            assert not backend.writers or not backend.writers[0].starts  # nothing copied
            (end,) = [e for e in await p.events() if e.finish_reason]
            assert end.error is not None and "cannot end before its deadline" in end.error.message

    run(main())
