"""Prefill on the kernel path is exact across chunkings: a prompt row's bits depend only on its position
and the K/V before it, not on where its prefill chunk starts or ends (Model.causal_tiles), in
batch-invariant mode (MKL_CBWR=AUTO,STRICT, set in conftest). What a prefix cache relies on: K/V blocks
computed for one prompt are the bits another prompt sharing them would compute, and a prefill resumed
at any block boundary gives the bits of an unchunked one. (The reference path is close, not exact.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import Generation
from pdserve.engine.llm_engine import LLMEngine

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 1000, n)]


def engine(model: Path, chunk: int) -> LLMEngine:
    config = EngineConfig(
        num_blocks=128, block_size=BS, prefill_chunk_size=chunk, keep_logits=True, attention="kernel"
    )
    assert config.batch_invariant
    return LLMEngine(model, config)


def generate(model: Path, ids: list[int], chunk: int) -> Generation:
    eng = engine(model, chunk)
    eng.add_request("r", None, GREEDY, prompt_token_ids=ids)
    gen = Generation("r", ids)
    while eng.has_unfinished():
        for out in eng.step():
            gen.add(out)
    return gen


def test_chunked_prefill_is_bitwise_unchunked(tiny_model_dir) -> None:
    """300 tokens in one chunk, in chunks of 64 and 32 (block-aligned) and of 48 (across tile
    boundaries): the same logits bit for bit, the first token's and every later one's."""
    ids = prompt(300)
    whole, *parts = (generate(tiny_model_dir, ids, c) for c in (512, 64, 32, 48))
    assert len(whole.logits) == GREEDY.max_tokens
    for gen in parts:
        assert gen.token_ids == whole.token_ids
        for a, b in zip(whole.logits, gen.logits, strict=True):
            assert np.array_equal(a, b), f"max abs diff {np.abs(a - b).max()}"


@pytest.mark.slow
def test_chunked_prefill_is_bitwise_unchunked_smollm2(smollm2_dir) -> None:
    """The real model (9 query heads on 3 kv heads): 300 tokens whole and in chunks of 48."""
    ids = prompt(300, seed=1)
    whole, part = generate(smollm2_dir, ids, 512), generate(smollm2_dir, ids, 48)
    assert part.token_ids == whole.token_ids
    assert np.array_equal(part.logits[0], whole.logits[0])


def prefill_blocks(model: Path, ids: list[int], chunk: int, blocks: int) -> bytes:
    """The K/V bytes of the first ``blocks`` blocks after a prefill-only request for ``ids``."""
    eng = engine(model, chunk)
    eng.add_request("p", None, GREEDY, prompt_token_ids=ids, prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    table = eng.prefilled_blocks("p")
    assert len(table) >= blocks
    return eng.cache.read_blocks(table[:blocks])


def test_shared_full_blocks_hold_the_same_kv(tiny_model_dir) -> None:
    """Prompt A is prompt B's first 5 blocks plus 7 tokens: the 5 blocks they share hold the same K/V
    bytes (every layer), prefilled whole or in chunks of another size."""
    b = prompt(200, seed=2)
    a = b[: 5 * BS + 7]
    ref = prefill_blocks(tiny_model_dir, b, 512, 5)
    assert prefill_blocks(tiny_model_dir, a, 512, 5) == ref
    assert prefill_blocks(tiny_model_dir, a, 32, 5) == ref
    assert prefill_blocks(tiny_model_dir, b, 48, 5) == ref
