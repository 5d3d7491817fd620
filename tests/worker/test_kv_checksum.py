"""Every KV hand-off is checked: one byte flipped in transit (the test hook ``kv_flip_in_transit``)
is caught in 200 of 200 hand-offs over shared memory and over Mooncake's TCP, and through the
missing-blocks path (the decode instance's prefix cache holds the prompt's first blocks, only the
rest is written); nothing is decoded from a caught hand-off, its blocks are freed, and its router
hears a retryable ``kv_checksum_mismatch`` after the prefill's first token. Without the fault,
nothing is flagged. Real Redis, real shm and Mooncake, the stub model; the real tiny model for the
missing-blocks path (its prefix cache)."""

from __future__ import annotations

import random

import pytest
from router_support import run
from splitwise_support import ROUTER, Instance, Pair, pair

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import GenerateRequest
from pdserve.worker.fault_hooks import FaultHooks

TRIALS = 200


def faulty(inst: Instance, probability: float = 1.0, seed: int = 0) -> None:
    inst.handler.ctx.faults = FaultHooks(kv_flip_in_transit=probability, rng=random.Random(seed))


async def hand_off(p: Pair, prefill: Instance, decode: Instance, msg: GenerateRequest) -> None:
    """One request up to the decode side's verdict on its KV."""
    await p.send(prefill, msg)
    await prefill.receive()
    await decode.receive()
    await prefill.receive()
    await prefill.step()  # first token, digests, the write
    await decode.receive()  # prefilled: checked, then decoded or refused


async def verdicts(p: Pair) -> dict[str, tuple[int, str | None]]:
    """Per request: the tokens its router got, and the kind of the error that ended it (if any)."""
    out: dict[str, tuple[int, str | None]] = {}
    for e in await p.events():
        n, kind = out.get(e.request_id, (0, None))
        out[e.request_id] = (n + len(e.token_ids), e.error.kind if e.error else kind)
    return out


async def trials(p: Pair, prefill: Instance, decode: Instance, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        await hand_off(p, prefill, decode, p.request(prompt, max_tokens=4, decode_id=decode.id))
        # a caught hand-off leaves nothing behind on D; a good one is decoding: finish it
        while decode.handler.owners:
            await decode.step()
        await prefill.receive()
        await decode.receive()


def check(got: dict[str, tuple[int, str | None]], decode: Instance, flipped: bool) -> None:
    assert len(got) == TRIALS
    if flipped:
        caught = [rid for rid, (n, kind) in got.items() if kind == "kv_checksum_mismatch" and n == 1]
        assert len(caught) == TRIALS, {rid: v for rid, v in got.items() if rid not in caught}
        assert decode.handler.ctx.integrity.kv_mismatches == TRIALS
    else:
        assert all(kind is None for _, kind in got.values()), got
        assert decode.handler.ctx.integrity.kv_mismatches == 0
    assert decode.handler.ctx.integrity.kv_checked == TRIALS
    assert not decode.handler.splitwise.leases and not decode.stub.reserved and not decode.handler.owners


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
@pytest.mark.parametrize("flipped", [True, False], ids=["flipped", "undisturbed"])
def test_a_byte_flipped_in_transit_is_caught_every_time(redis_url, request, transport, flipped) -> None:
    if transport == "mooncake":
        request.getfixturevalue("mooncake_ready")

    async def main() -> None:
        async with pair(redis_url, decode_blocks=64, mooncake=transport == "mooncake") as (
            p,
            prefill,
            decode,
        ):
            faulty(prefill, 1.0 if flipped else 0.0, seed=42)
            rng = random.Random(7)
            prompts = [[rng.randrange(1, 200) for _ in range(rng.randrange(1, 60))] for _ in range(TRIALS)]
            await trials(p, prefill, decode, prompts)
            check(await verdicts(p), decode, flipped)

    run(main())


BLOCK = 16
PREFIX = [(13 * i + 7) % 180 + 10 for i in range(3 * BLOCK)]  # 3 full blocks the decode instance caches


def tiny(model_dir, shm_name: str | None = None) -> LLMEngine:
    config = EngineConfig(
        num_blocks=64,
        block_size=BLOCK,
        max_model_len=256,
        threads=1,
        prefix_caching=True,
        shared_kv=shm_name is not None,
        shm_name=shm_name,
    )
    return LLMEngine(model_dir, config)


@pytest.mark.parametrize("flipped", [True, False], ids=["flipped", "undisturbed"])
def test_the_missing_blocks_path_is_checked_too(redis_url, tiny_model_dir, flipped) -> None:
    """D's prefix cache holds PREFIX (3 blocks): each request writes only its last block or two."""

    async def main() -> None:
        async with pair(redis_url) as (p, _stub_p, _stub_d):
            name = "pdserve-test-sum-" + ("f" if flipped else "u") + str(random.randrange(10**8))
            prefill = await p.instance("prefill-t", "prefill", tiny(tiny_model_dir))  # type: ignore[arg-type]
            decode = await p.instance("decode-t", "decode", tiny(tiny_model_dir, name))  # type: ignore[arg-type]
            p.decode_transfer = {"protocols": ["shm"], "endpoint": {"shm": name}}
            warm = GenerateRequest(
                request_id="warm",
                router_id=ROUTER,
                prompt_token_ids=[*PREFIX, 1],
                sampling=SamplingParams(max_tokens=1, temperature=0.0),
                deadline=p.clock.time() + 60,
            )
            await p.send(decode, warm)  # served whole on D: its prefix blocks stay cached there
            await decode.receive()
            while decode.engine.unfinished:
                await decode.step()
            faulty(prefill, 1.0 if flipped else 0.0, seed=9)
            rng = random.Random(3)
            prompts = [
                PREFIX + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 24))] for _ in range(TRIALS)
            ]
            replies = []
            original = decode.handler.splitwise.on_reserve

            async def on_reserve(msg, accepting):  # note how many blocks D's cache held for each
                await original(msg, accepting)
                lease = decode.handler.splitwise.leases.get(f"{msg.request_id}/{msg.attempt}")
                replies.append(lease.num_cached if lease else None)

            decode.handler.splitwise.on_reserve = on_reserve  # type: ignore[method-assign]
            await trials(p, prefill, decode, prompts)
            got = {rid: v for rid, v in (await verdicts(p)).items() if rid != "warm"}
            check(got, decode, flipped)
            assert replies == [3] * TRIALS  # every hand-off skipped the 3 cached blocks
            for inst in (prefill, decode):
                await inst.engine.close()

    run(main())
