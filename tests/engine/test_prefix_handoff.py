"""Splitwise with prefix caches: the decode engine shares the blocks its cache holds of an incoming
prompt and the prefill engine writes only the others, and the output is bitwise the output of one
engine that cached nothing, wherever the hits end and whichever side has them (MKL_CBWR=AUTO,STRICT,
set in conftest). The hand-off is done here as the worker does it: reserve on D, KV bytes of the
missing blocks from P's cache into D's, then D continues from P's first token."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve import SamplingParams
from pdserve.engine.llm import Generation
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.test_prefix_cache import BS, assert_same, engine, ids, run

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def prefill(p: LLMEngine, rid: str, prompt: list[int]) -> tuple[Generation, int]:
    """Run ``prompt`` prefill-only on P: its first token (with logits) and P's cached tokens."""
    p.add_request(rid, prompt_token_ids=prompt, params=PARAMS, prefill_only=True)
    gen = Generation(rid, prompt)
    while True:
        for out in p.step():
            assert out.request_id == rid and out.error is None
            gen.add(out)
            if out.prefilled:
                return gen, out.num_cached_tokens


def hand_off(
    p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int], busy: bool = False
) -> tuple[Generation, int, int]:
    """The whole splitwise path; returns the generation, D's held blocks and the bytes written."""
    gen, p_cached = prefill(p, rid, prompt)
    reserved = d.reserve_prompt(rid, prompt, PARAMS)
    assert reserved is not None
    blocks, held = reserved
    src = p.prefilled_blocks(rid)
    assert len(src) == len(blocks)
    before = d.cache.read_blocks(blocks[:held])
    data = p.cache.read_blocks(src[held:])
    d.cache.write_blocks(blocks[held:], data)
    assert d.cache.read_blocks(blocks[:held]) == before  # a shared block is never written
    p.release_prefilled(rid)
    if busy:  # D is decoding others when this one joins
        for i in range(3):
            d.add_request(f"other-{rid}-{i}", prompt_token_ids=ids(50 + i, 10 + 17 * i), params=PARAMS)
        d.step()
    d.add_prefilled(rid, prompt, gen.token_ids[0], PARAMS, p_cached)
    while d.has_unfinished():
        for out in d.step():
            if out.request_id == rid:
                gen.add(out)
    return gen, held, len(data)


def assert_same_logprobs(a: Generation, b: Generation) -> None:
    assert a.logprobs is not None and b.logprobs is not None
    assert [(lp.token_id, lp.logprob, lp.top_logprobs) for lp in a.logprobs] == [
        (lp.token_id, lp.logprob, lp.top_logprobs) for lp in b.logprobs
    ]


@pytest.mark.parametrize("hit_blocks", [1, 4, 5, 9])
@pytest.mark.parametrize("busy", [False, True])
def test_a_hit_on_decode_only_moves_the_missing_blocks_and_changes_no_bit(
    tiny_model_dir, hit_blocks: int, busy: bool
) -> None:
    """D served the previous turn (a prompt sharing ``hit_blocks`` full blocks); P caches nothing.
    D shares those blocks, P writes only the rest, and tokens, logits and logprobs are those of one
    uncached engine."""
    shared = ids(7, hit_blocks * BS)
    earlier, prompt = shared + ids(8, 21), shared + ids(9, 37)
    ((reference, _),) = run(engine(tiny_model_dir, prefix_caching=False), {"r": prompt}, PARAMS).values()
    p = engine(tiny_model_dir, prefix_caching=False)
    d = engine(tiny_model_dir, prefix_caching=True)
    run(d, {"earlier": earlier}, PARAMS)
    gen, held, written = hand_off(p, d, "r", prompt, busy)
    n_blocks = -(-len(prompt) // BS)
    assert held == hit_blocks
    assert written == (n_blocks - hit_blocks) * d.cache.block_bytes  # only the missing blocks moved
    assert_same(reference, gen)
    assert_same_logprobs(reference, gen)


def test_hits_on_both_sides_and_a_whole_prompt_held_by_decode(tiny_model_dir) -> None:
    """P reuses its own cached prefix (usage reports it), D holds a longer one; then the same
    prompt again: D holds every full block and only the partial last block moves."""
    shared = ids(11, 6 * BS)
    prompt = shared + ids(12, 3 * BS) + ids(13, 5)
    ((reference, _),) = run(engine(tiny_model_dir, prefix_caching=False), {"r": prompt}, PARAMS).values()
    p = engine(tiny_model_dir, prefix_caching=True)
    d = engine(tiny_model_dir, prefix_caching=True)
    run(p, {"p-earlier": shared + ids(14, 20)}, PARAMS)  # P holds 6 blocks
    run(d, {"d-earlier": prompt[: 8 * BS] + ids(15, 9)}, PARAMS)  # D holds 8
    first = prefill(p, "probe", prompt)[1]
    p.abort("probe")
    assert first == 6 * BS
    gen, held, written = hand_off(p, d, "r1", prompt)
    assert held == 8 and written == 2 * d.cache.block_bytes
    assert_same(reference, gen)
    again, held_again, written_again = hand_off(p, d, "r2", prompt)
    assert held_again == len(prompt) // BS == 9 and written_again == d.cache.block_bytes
    assert_same(reference, again)
    assert_same_logprobs(reference, again)


def test_a_decode_cache_without_room_refuses_and_leaks_nothing(tiny_model_dir) -> None:
    d = engine(tiny_model_dir, prefix_caching=True, num_blocks=12)  # 11 usable blocks
    prompt = ids(21, 8 * BS)
    run(d, {"a": prompt}, PARAMS)  # 8 full blocks cached (the output's block freed)
    assert d.reserve_prompt("big", ids(22, 12 * BS), PARAMS) is None  # 12 blocks never fit
    blocks, held = d.reserve_prompt("same", prompt + ids(23, 40), PARAMS)
    assert held == 8 and len(blocks) == 11
    assert d.cancel_reservation("same")
    assert d.blocks.num_free == 11 and d.blocks.lookup(d.blocks.hashes()) != []
    held_blocks = np.array(blocks[:held])
    assert d.reserve_prompt("again", prompt + ids(24, 40), PARAMS)[0][:held] == held_blocks.tolist()


def test_a_next_turn_holding_the_answer_hits_only_what_a_prefill_computed(tiny_model_dir) -> None:
    """A chat's next turn contains the previous answer, whose K/V decode steps computed with other
    kernels than a prefill: those blocks are not cached (batch-invariant mode), the prompt's are,
    and the next turn is bitwise the uncached one, mixed and through a decode instance."""
    turn1 = ids(31, 5 * BS + 3)
    warm = engine(tiny_model_dir, prefix_caching=True)
    ((answer, _),) = run(warm, {"t1": turn1}, PARAMS.replace(max_tokens=40)).values()
    turn2 = turn1 + answer.token_ids + ids(32, 20)
    ((reference, _),) = run(engine(tiny_model_dir, prefix_caching=False), {"t2": turn2}, PARAMS).values()
    ((mixed, hit),) = run(warm, {"t2": turn2}, PARAMS).values()
    assert hit == 5 * BS  # the prompt's full blocks; none of the blocks the answer filled
    assert_same(reference, mixed)
    assert_same_logprobs(reference, mixed)
    d = engine(tiny_model_dir, prefix_caching=True)
    run(d, {"t1": turn1}, PARAMS.replace(max_tokens=40))
    split, held, _ = hand_off(engine(tiny_model_dir, prefix_caching=False), d, "t2", turn2)
    assert held == 5
    assert_same(reference, split)
    assert_same_logprobs(reference, split)
