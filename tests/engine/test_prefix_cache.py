"""The prefix cache: full blocks kept by their chain hash after their request, reused by a later
prompt with the same prefix; reference counts and LRU eviction never leak or overwrite a block, and a
cache hit changes no bit of the output (MKL_CBWR=AUTO,STRICT, set in conftest)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve import SamplingParams
from pdserve.block_hash import block_hash, chain_hashes
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import Generation
from pdserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BS = 16


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict:
    gens, cached = {}, {}
    for rid, ids in prompts.items():
        engine.add_request(rid, prompt_token_ids=ids, params=params)
        gens[rid] = Generation(rid, ids)
    while engine.has_unfinished():
        for out in engine.step():
            gens[out.request_id].add(out)
            cached[out.request_id] = out.num_cached_tokens
    return {rid: (g, cached[rid]) for rid, g in gens.items()}


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]


# ---- hashes and the block manager -----------------------------------------------------------------
def test_chain_hashes_depend_on_everything_before() -> None:
    a, b = ids(1, 64), ids(1, 64)
    b[40] += 1  # block 2 differs: blocks 0, 1 agree, 2 and 3 do not
    ha, hb = chain_hashes(a, BS), chain_hashes(b, BS)
    assert len(ha) == 4 and ha[:2] == hb[:2] and ha[2] != hb[2] and ha[3] != hb[3]
    assert chain_hashes(a[:70], BS) == ha  # a partial block has no hash
    assert chain_hashes(a, BS, extra=b"salt")[0] != ha[0]  # a cache salt separates
    assert block_hash(None, a[:BS]) == ha[0] and len(ha[0]) == 16  # the same in every process


def test_blocks_are_kept_shared_and_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(6, prefix_caching=True)  # 5 usable blocks
    a = bm.allocate(2)
    for blk, h in zip(a, (b"h0", b"h1")):
        bm.register(blk, h)
    assert bm.lookup([b"h0", b"h1", b"h2"]) == a
    bm.free(a)
    assert bm.num_free == 5 and bm.num_cached == 2  # cached blocks still count as free space
    assert bm.can_allocate(3, reused=a) and not bm.can_allocate(4, reused=a)
    bm.share(a)  # a later request takes them from the cache
    assert bm.num_free == 3
    other = bm.allocate(3)
    assert not set(other) & set(a)  # never a block in use
    bm.free(other)
    bm.free([a[1]])
    bm.free([a[0]])  # a[0] freed last: a[1] goes first
    got = bm.allocate(4)
    assert a[1] in got and a[0] not in got and bm.lookup([b"h0"]) == [a[0]] and bm.lookup([b"h1"]) == []
    assert bm.num_evicted == 1


def test_off_means_nothing_is_kept() -> None:
    bm = BlockManager(4)
    a = bm.allocate(1)
    bm.register(a[0], b"h0")
    assert bm.lookup([b"h0"]) == []


# ---- the engine -----------------------------------------------------------------------------------
def engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(
        model_dir, EngineConfig(**{"num_blocks": 96, "prefill_chunk_size": 64, "keep_logits": True, **kw})
    )


def assert_same(a: Generation, b: Generation) -> None:
    assert b.token_ids == a.token_ids
    for la, lb in zip(a.logits, b.logits, strict=True):
        assert np.array_equal(la, lb), f"max abs diff {np.abs(la - lb).max()}"


@pytest.mark.parametrize("hit_blocks", [1, 4, 5, 9])
def test_a_hit_reuses_the_prefix_and_changes_no_bit(tiny_model_dir, hit_blocks: int) -> None:
    """A second prompt sharing the first ``hit_blocks`` full blocks of an earlier one computes only
    the rest (cached_tokens says how many it reused) and gives the same tokens and logits as an
    engine that computed everything; hits end inside and at the end of a 64-token chunk."""
    shared = ids(7, hit_blocks * BS)
    first, second = shared + ids(8, 21), shared + ids(9, 37)
    cold = run(engine(tiny_model_dir, prefix_caching=False), {"b": second})
    warm_engine = engine(tiny_model_dir, prefix_caching=True)
    ((_first, cached_a),) = run(warm_engine, {"a": first}).values()
    ((gen_b, cached_b),) = run(warm_engine, {"b": second}).values()
    assert cached_a == 0 and cached_b == hit_blocks * BS
    assert_same(cold["b"][0], gen_b)


@pytest.mark.parametrize("hit_blocks", [2, 5])
def test_a_hit_inside_a_batch_changes_no_bit(tiny_model_dir, hit_blocks: int) -> None:
    """The cached request joins a batch of others (decoding, and prefilling prompts of other
    lengths, one with its own hit): tokens, logits and logprobs are those of an uncached engine
    running it alone."""
    params = GREEDY.replace(logprobs=2)
    shared = ids(17, hit_blocks * BS)
    prompt = shared + ids(18, 29)
    ((alone, _),) = run(engine(tiny_model_dir, prefix_caching=False), {"b": prompt}, params).values()
    warm = engine(tiny_model_dir, prefix_caching=True)
    run(warm, {"a": shared + ids(19, 7)}, params)
    others = {f"o{i}": ids(40 + i, 9 + 23 * i) for i in range(3)} | {"o-hit": shared + ids(20, 50)}
    got = run(warm, {**others, "b": prompt}, params)
    gen, cached = got["b"]
    assert cached == hit_blocks * BS and got["o-hit"][1] == hit_blocks * BS
    assert_same(alone, gen)
    assert [(lp.token_id, lp.logprob, lp.top_logprobs) for lp in gen.logprobs] == [
        (lp.token_id, lp.logprob, lp.top_logprobs) for lp in alone.logprobs
    ]


def test_the_whole_prompt_cached_still_computes_its_last_token(tiny_model_dir) -> None:
    prompt = ids(3, 4 * BS)  # exactly 4 blocks: 3 come from the cache, the last is recomputed
    eng = engine(tiny_model_dir, prefix_caching=True)
    ((first, _),) = run(eng, {"a": prompt}).values()
    ((again, cached),) = run(eng, {"b": prompt}).values()
    assert cached == 3 * BS
    assert_same(first, again)


def test_filling_and_draining_many_times_leaks_nothing(tiny_model_dir) -> None:
    """Waves of requests with shared prefixes through a small cache (eviction, preemption): every
    block comes back, no reference is left, and outputs equal those of an engine without a cache."""
    cfg = dict(num_blocks=16, max_num_seqs=4)
    warm = engine(tiny_model_dir, prefix_caching=True, **cfg)
    cold = engine(tiny_model_dir, prefix_caching=False, **cfg)
    rng = random.Random(0)
    stems = [ids(100 + i, rng.randrange(1, 3) * BS) for i in range(3)]
    long = GREEDY.replace(max_tokens=24)  # decodes outgrow the cache: the newest is preempted
    for wave in range(3):
        prompts = {
            f"w{wave}-{i}": rng.choice(stems) + ids(1000 * wave + i, rng.randrange(1, 40)) for i in range(4)
        }
        got, want = run(warm, prompts, long), run(cold, prompts, long)
        for rid in prompts:
            assert got[rid][0].token_ids == want[rid][0].token_ids, rid
        bm = warm.blocks
        assert bm.num_free == bm.capacity and not any(bm._refs), f"wave {wave} leaked"
    assert warm.blocks.num_evicted > 0 and warm.batcher.num_preemptions > 0  # both paths were taken
    assert sum(c for g, c in got.values()) > 0


def test_prompt_logprobs_requests_compute_every_position(tiny_model_dir) -> None:
    prompt = ids(5, 3 * BS + 4)
    eng = engine(tiny_model_dir, prefix_caching=True)
    run(eng, {"a": prompt})
    ((gen, cached),) = run(eng, {"b": prompt}, GREEDY.replace(prompt_logprobs=0)).values()
    assert cached == 0 and len(gen.prompt_logprobs) == len(prompt)


def test_the_queued_prefill_work_leaves_out_cached_prefixes(tiny_model_dir) -> None:
    """Routers compare instances' queues by ``waiting_prefill_tokens``: a queued prompt whose prefix
    is cached counts only what it will compute."""
    shared = ids(61, 4 * BS)
    eng = engine(tiny_model_dir, prefix_caching=True)
    run(eng, {"a": shared + ids(62, 5)})
    hit, cold = shared + ids(63, 11), ids(64, 30)
    eng.add_request("hit", prompt_token_ids=hit, params=GREEDY)
    eng.add_request("cold", prompt_token_ids=cold, params=GREEDY)
    assert eng.load().waiting == 2
    assert eng.load().waiting_prefill_tokens == (len(hit) - 4 * BS) + len(cold)
