"""Engine behaviour: continuous batching under block pressure, abort, hand-off API, offline CLI."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import Generation
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import EngineError

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def run(engine: LLMEngine, prompts: dict[str, str], params: SamplingParams = GREEDY) -> dict[str, Generation]:
    gens = {}
    for rid, text in prompts.items():
        seq = engine.add_request(rid, text, params)
        gens[rid] = Generation(rid, seq.prompt_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            gens[out.request_id].add(out)
    return gens


PROMPTS = {f"r{i}": f"request number {i} says " + "hello " * (3 * i) for i in range(6)}


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, Generation]:
    return run(LLMEngine(tiny_model_dir, EngineConfig(num_blocks=256)), PROMPTS)


def test_scarce_blocks_make_requests_wait_not_fail(tiny_model_dir, reference) -> None:
    """With room for about two sequences, the rest wait (or get preempted) and all finish correctly."""
    engine = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=8))
    got = run(engine, PROMPTS)
    assert engine.blocks.num_free == engine.blocks.capacity  # every block came back
    for rid, gen in got.items():
        assert gen.finish_reason == "length" and len(gen.token_ids) == 20
        assert gen.token_ids == reference[rid].token_ids


def test_the_engine_measures_what_a_prompt_token_and_an_answer_token_cost(tiny_model_dir) -> None:
    """Its load says seconds per token of its prefilling steps and of its decode-only steps (the
    planner weighs one against the other); neither before a step of its kind was timed."""
    engine = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=64))
    assert engine.load().prefill_s_per_token is None and engine.load().decode_s_per_token is None
    for rid in ("a", "b"):  # the first step of each kind is dropped (cold caches)
        run(engine, {rid: f"prompt {rid}"})
    load = engine.load()
    assert load.prefill_s_per_token is not None and load.prefill_s_per_token > 0
    assert load.decode_s_per_token is not None and load.decode_s_per_token > 0


def test_abort_frees_blocks_and_reports(tiny_model_dir) -> None:
    engine = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=64))
    engine.add_request("keep", "keep going", GREEDY)
    engine.add_request("drop", "stop me", GREEDY)
    engine.step(), engine.step()
    assert engine.abort("drop")
    outs = engine.step()
    dropped = [o for o in outs if o.request_id == "drop"]
    assert dropped and dropped[0].finished and dropped[0].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free == engine.blocks.capacity
    assert not engine.abort("unknown")


def test_handoff_bytes_between_engines(tiny_model_dir, reference) -> None:
    prefill = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=64))
    decode = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=64))
    decode.reserve("other", 100)  # different block ids on the decode side
    seq = prefill.add_request("r3", PROMPTS["r3"], GREEDY, prefill_only=True)
    outs = []
    while not outs:
        outs = [o for o in prefill.step() if o.prefilled]
    payload = prefill.export_kv("r3")
    assert len(payload) == len(prefill.prefilled_blocks("r3")) * prefill.cache.block_bytes
    blocks = decode.reserve("r3", seq.num_prompt_tokens)
    assert blocks != prefill.prefilled_blocks("r3")
    decode.import_kv("r3", payload)
    assert prefill.release_prefilled("r3") and prefill.blocks.num_free == prefill.blocks.capacity
    decode.add_prefilled("r3", seq.prompt_token_ids, outs[0].token_ids[0], GREEDY)
    tokens = list(outs[0].token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.token_ids
    assert tokens == reference["r3"].token_ids


def test_reserve_refuses_when_full(tiny_model_dir) -> None:
    decode = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=4))
    with pytest.raises(EngineError, match="cannot reserve"):
        decode.reserve("big", 200)
    assert decode.blocks.num_free == decode.blocks.capacity


def test_generate_cli_disaggregate_prints_the_same_tokens(tiny_model_dir) -> None:
    base = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "--log-level",
        "WARNING",
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "first prompt",
        "--prompt",
        "a second, longer prompt " * 5,
        "--max-tokens",
        "12",
        "--json",
        "--num-blocks",
        "128",
        "--prompt-logprobs",
        "1",
    ]
    single = subprocess.run(base, capture_output=True, text=True, timeout=120, check=True).stdout
    split = subprocess.run(
        [*base, "--disaggregate"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    a = [orjson.loads(line) for line in single.splitlines()]
    b = [orjson.loads(line) for line in split.splitlines()]
    assert len(a) == 2 and [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
    assert [x["text"] for x in a] == [x["text"] for x in b]
    assert all(x["usage"]["completion_tokens"] == len(x["token_ids"]) for x in a + b)
    assert [x["prompt_logprobs"] for x in a] == [x["prompt_logprobs"] for x in b]  # the prefill process's
    assert all(len(x["prompt_logprobs"]) == x["usage"]["prompt_tokens"] for x in a)
    first, second = a[0]["prompt_logprobs"][:2]
    assert first["logprob"] is None and len(second["top_logprobs"]) == 1


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        SamplingParams(
            temperature=0.9, top_p=0.9, seed=7, frequency_penalty=0.5, max_tokens=20, ignore_eos=True
        ),
    ],
    ids=["greedy", "seeded"],
)
def test_a_resumed_request_continues_exactly_where_the_first_left_off(tiny_model_dir, params) -> None:
    """Migration's worker half: given the tokens an earlier attempt delivered, the engine recomputes
    prompt + those tokens and continues with the same tokens and text the undisturbed run produced
    after them (seeded draws, penalties and detokenizer state included); usage counts all of them."""
    engine = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=64))
    prompt = "a request that moves to another instance halfway through"
    engine.add_request("whole", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == 20
    for k in (1, 9, 19):
        engine.add_request(f"resumed{k}", prompt, params, resume_token_ids=tokens[:k])
        rest = []
        while engine.has_unfinished():
            rest += engine.step()
        assert [t for o in rest for t in o.token_ids] == tokens[k:]
        assert "".join(o.text for o in rest) == "".join(o.text for o in outs[k:])
        assert (rest[-1].finish_reason, rest[-1].num_output_tokens) == ("length", 20)
    assert engine.blocks.num_free == engine.blocks.capacity
