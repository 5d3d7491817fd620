"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token scored by the model's raw
distribution at the position before it, as the sampler scores the tokens it generates; batch-invariant
(MKL_CBWR=AUTO,STRICT, set in conftest), once per request, chunked prefill or not."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import Generation
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampler import logprobs_of

PROMPT = "The router picks a prefill and a decode instance from the live set in Redis."
LONG = "Long prompts are prefilled in chunks so running decodes keep moving. " * 3
K = 5
SCORE = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K, ignore_eos=True)


def generate(engine: LLMEngine, prompts: dict[str, str | list[int]], params: SamplingParams) -> dict:
    """Run ``prompts`` together; each request's Generation and how many outputs had prompt logprobs."""
    gens, handed = {}, dict.fromkeys(prompts, 0)
    for rid, prompt in prompts.items():
        ids = prompt if isinstance(prompt, list) else None
        seq = engine.add_request(rid, None if ids else prompt, params, prompt_token_ids=ids)
        gens[rid] = Generation(rid, seq.prompt_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in gens:  # not another request of the batch
                gens[out.request_id].add(out)
                handed[out.request_id] += out.prompt_logprobs is not None
    return {rid: (gen, handed[rid]) for rid, gen in gens.items()}


def check_entries(gen: Generation, num_top: int) -> None:
    """The shape every request's prompt logprobs have: one per prompt token, the first without a
    logprob, each with ``num_top`` alternatives best first and a rank that agrees with them."""
    entries = gen.prompt_logprobs
    assert entries is not None and len(entries) == len(gen.prompt_token_ids)
    first = entries[0]
    assert first.token_id == gen.prompt_token_ids[0] and first.logprob is None and first.token
    for token, lp in zip(gen.prompt_token_ids[1:], entries[1:], strict=True):
        assert lp.token_id == token and lp.logprob is not None and lp.logprob <= 0
        assert lp.top_logprobs is not None and len(lp.top_logprobs) == num_top == len(lp.top_tokens or [])
        values = [v for _, v in lp.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert lp.rank is not None and lp.rank >= 1
        if lp.rank <= num_top:
            assert lp.top_logprobs[lp.rank - 1] == (token, lp.logprob)
        else:
            assert all(v > lp.logprob for v in values)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, num_blocks=256, prefill_chunk_size=512)


def test_prompt_logprobs_score_a_continuation_as_its_generation_did(llm: LLM) -> None:
    """Scoring P + C, where C is P's greedy continuation, gives C's tokens the logprobs (and
    alternatives) they were generated with; the prompt's first token has none."""
    gen = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=K, ignore_eos=True))[0]
    assert gen.prompt_logprobs is None  # not asked
    ids = gen.prompt_token_ids + gen.token_ids
    scored = llm.generate(ids, SCORE)[0]
    check_entries(scored, K)
    n = len(gen.prompt_token_ids)
    assert gen.logprobs is not None
    for lp, entry in zip(gen.logprobs, scored.prompt_logprobs[n:], strict=True):  # type: ignore[index]
        assert entry.token_id == lp.token_id and entry.rank == 1  # greedy: the likeliest
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-5)
        assert [t for t, _ in entry.top_logprobs] == [t for t, _ in lp.top_logprobs]  # type: ignore[union-attr]
        assert entry.top_tokens == lp.top_tokens


def test_handed_out_once_with_the_first_token(tiny_model_dir) -> None:
    engine = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=256))
    ((gen, handed),) = generate(engine, {"a": PROMPT}, SCORE).values()
    assert handed == 1 and len(gen.token_ids) == 3
    check_entries(gen, K)
    one = generate(engine, {"b": [gen.prompt_token_ids[0]]}, SCORE.replace(prompt_logprobs=0))
    ((single, handed),) = one.values()
    assert handed == 1 and [(e.logprob, e.top_logprobs) for e in single.prompt_logprobs or []] == [
        (None, None)
    ]


def test_chunked_prefill_scores_like_one_chunk(tiny_model_dir) -> None:
    """Chunks of 5 tokens (a chunk's last row scores the next chunk's first token) give the prompt
    logprobs of one chunk bit for bit: on the kernel path a row's attention does not depend on where
    its chunk starts (tests/engine/test_prefill_exactness.py)."""
    config = EngineConfig(num_blocks=256, attention="kernel")
    whole = generate(LLMEngine(tiny_model_dir, config), {"a": LONG}, SCORE)["a"][0]
    chunked = LLMEngine(tiny_model_dir, dataclasses.replace(config, prefill_chunk_size=5))
    parts = generate(chunked, {"a": LONG}, SCORE)["a"][0]
    assert len(parts.prompt_token_ids) > 10 * 5
    check_entries(parts, K)
    assert parts.token_ids == whole.token_ids
    for a, b in zip(whole.prompt_logprobs[1:], parts.prompt_logprobs[1:], strict=True):  # type: ignore[index]
        assert (a.token_id, a.rank) == (b.token_id, b.rank)
        assert b.logprob == a.logprob and b.top_logprobs == a.top_logprobs


@pytest.mark.parametrize("kernels", ["auto", "composed"])
def test_alone_equals_batched_bitwise(tiny_model_dir, kernels: str) -> None:
    """Batch-invariant mode: a request's prompt logprobs are the same bits alone or next to other
    requests decoding and prefilling (chunked too), and asking for them changes no bit of the
    logits its first token is sampled from."""
    config = EngineConfig(num_blocks=256, prefill_chunk_size=16, keep_logits=True, kernels=kernels)
    assert config.batch_invariant
    mine = {"short": PROMPT, "long": LONG}
    alone = {
        rid: generate(LLMEngine(tiny_model_dir, config), {rid: p}, SCORE)[rid][0] for rid, p in mine.items()
    }
    engine = LLMEngine(tiny_model_dir, config)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, text in enumerate(["a b c d e f g " * n for n in (1, 5, 9)]):  # one scores its prompt too
        engine.add_request(f"other-{i}", text, plain.replace(prompt_logprobs=2 if i == 1 else None))
    engine.step(), engine.step()  # the others are decoding or still prefilling when ours join
    batched = generate(engine, mine, SCORE)
    for rid, gen in alone.items():
        got, handed = batched[rid]
        assert handed == 1 and got.prompt_logprobs == gen.prompt_logprobs  # exact floats
        assert got.token_ids == gen.token_ids
        assert all(np.array_equal(a, b) for a, b in zip(gen.logits, got.logits, strict=True))
    unscored = generate(
        LLMEngine(tiny_model_dir, config), {"long": LONG}, SCORE.replace(prompt_logprobs=None)
    )
    assert np.array_equal(unscored["long"][0].logits[0], alone["long"].logits[0])


def test_not_again_after_a_preemption_nor_for_a_resumed_request(tiny_model_dir) -> None:
    """Scarce blocks preempt sequences, mid-prefill and after their first token, and recompute them:
    each request still gets its prompt logprobs once, the same bits as with room for all. A resumed
    request (a migration) gets none."""
    prompts = {f"r{i}": f"request number {i} says " + "hello " * (3 * i) for i in range(5)}
    params = SCORE.replace(max_tokens=20)
    roomy = generate(
        LLMEngine(tiny_model_dir, EngineConfig(num_blocks=256, prefill_chunk_size=8)), prompts, params
    )
    scarce = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=8, prefill_chunk_size=8))
    preempted: list[int] = []  # output tokens of each victim when it was preempted
    preempt = scarce.batcher._preempt
    scarce.batcher._preempt = lambda seq: (preempted.append(seq.num_output_tokens), preempt(seq))  # type: ignore[method-assign]
    got = generate(scarce, prompts, params)
    assert 0 in preempted and max(preempted) > 0
    for rid, (gen, handed) in got.items():
        assert handed == 1 and gen.prompt_logprobs == roomy[rid][0].prompt_logprobs
        assert gen.token_ids == roomy[rid][0].token_ids
    engine = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=256))
    engine.add_request("m", PROMPT, params, resume_token_ids=roomy["r0"][0].token_ids[:2])
    while engine.has_unfinished():
        assert all(out.prompt_logprobs is None for out in engine.step())


def test_logprobs_of_is_log_softmax_with_ranks_and_ties_by_id() -> None:
    """The sampler's and the prompt's logprobs: log_softmax of a row, rank = 1 + strictly likelier
    ids, alternatives best first with ties by id; a row's numbers do not depend on the other rows."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((40, 300)).astype(np.float32)
    logits[3, [5, 9, 200]] = 9.0  # a three-way tie for the best
    tokens = rng.integers(0, 300, 40)
    tokens[3] = 9
    got = logprobs_of(logits, tokens, 4)
    x = logits.astype(np.float64)
    want = x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)
    for i, s in enumerate(got):
        assert s.logprob == pytest.approx(want[i, tokens[i]], abs=1e-6)
        assert s.rank == 1 + int((want[i] > want[i, tokens[i]]).sum())
        order = sorted(range(300), key=lambda t: (-want[i, t], t))[:4]
        assert [t for t, _ in s.top_logprobs or []] == order
        assert s == logprobs_of(logits[i : i + 1], tokens[i : i + 1], 4)[0]  # alone: the same bits
    assert (got[3].rank, [t for t, _ in got[3].top_logprobs or []][:3]) == (1, [5, 9, 200])
    assert logprobs_of(logits[:1], tokens[:1], 0)[0].top_logprobs is None


def test_echo_engine_gives_zeros_for_the_prompt() -> None:
    """The benchmarking engine scores every prompt token 0 (certain), as it does generated ones."""
    from pdserve.engine.echo import EchoEngine

    engine = EchoEngine(None, EngineConfig(num_blocks=16))
    engine.add_request("e", prompt_token_ids=[5, 6, 7], params=SCORE)
    first = engine.step()[0]
    assert first.prompt_logprobs == [
        TokenLogprob(5, None, token="<5>"),
        TokenLogprob(6, 0.0, [(6, 0.0)], "<6>", ["<6>"], 1),
        TokenLogprob(7, 0.0, [(7, 0.0)], "<7>", ["<7>"], 1),
    ]
    assert all(out.prompt_logprobs is None for out in engine.step())
