"""Sampling controls and stop conditions, end to end through the engine on the tiny model."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence

PROMPT = "Once upon a time there was a small model that"


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, num_blocks=128)


@pytest.fixture(scope="module")
def baseline(llm):
    """Greedy continuation with no stop rule: the other tests cut it at chosen places."""
    gen = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert len(set(gen.token_ids)) > 10  # a varied continuation, or the cuts below prove little
    return gen


def test_seeded_sampling_reproduces(llm) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    first = llm.generate(PROMPT, params)[0].token_ids
    again = llm.generate(PROMPT, params)[0].token_ids
    in_batch = llm.generate([PROMPT, "another prompt", PROMPT], [params, params.replace(seed=9), params])
    other_seed = llm.generate(PROMPT, params.replace(seed=4321))[0].token_ids
    assert first == again == in_batch[0].token_ids == in_batch[2].token_ids
    assert other_seed != first


def test_unseeded_sampling_varies(llm) -> None:
    params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    outs = {tuple(g.token_ids) for g in llm.generate([PROMPT] * 4, params)}
    assert len(outs) > 1


def test_max_tokens(llm) -> None:
    gen = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(gen.token_ids) == 7 and gen.finish_reason == "length"
    assert gen.usage == {
        "prompt_tokens": len(gen.prompt_token_ids),
        "completion_tokens": 7,
        "total_tokens": len(gen.prompt_token_ids) + 7,
    }


def test_stop_string_cuts_text(llm, baseline) -> None:
    tail = baseline.text[10:]
    stop = next(
        tail[i : i + 3] for i in range(len(tail)) if tail[i : i + 3].strip() and tail[i : i + 3].isprintable()
    )
    cut = baseline.text.index(stop)
    gen = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True))[0]
    assert gen.finish_reason == "stop"
    assert gen.text == baseline.text[:cut]
    assert gen.token_ids == baseline.token_ids[: len(gen.token_ids)] and len(gen.token_ids) < 40
    kept = llm.generate(
        PROMPT,
        SamplingParams(
            temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True, ignore_eos=True
        ),
    )[0]
    assert kept.text == baseline.text[: cut + len(stop)]


def test_stop_string_streaming_never_leaks_a_stop_prefix(llm, baseline) -> None:
    stop = baseline.text[12:20]
    pieces = [o.text for o in llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))]
    assert "".join(pieces) == baseline.text[: baseline.text.index(stop)]


def test_stop_token_ids(llm, baseline) -> None:
    target = baseline.token_ids[5]
    first = baseline.token_ids.index(target)
    gen = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[target]))[0]
    assert gen.finish_reason == "stop"
    assert gen.token_ids == baseline.token_ids[: first + 1]
    assert gen.text == llm.tokenizer.decode(baseline.token_ids[:first])  # the stop token's text is not shown


def test_min_tokens_holds_back_stop_tokens(llm, baseline) -> None:
    target = baseline.token_ids[2]
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=8, stop_token_ids=[target])
    gen = llm.generate(PROMPT, params)[0]
    assert len(gen.token_ids) >= 8
    assert target not in gen.token_ids[:8]


def test_eos_ends_generation(model_copy, baseline) -> None:
    eos = baseline.token_ids[4]
    cfg_path = model_copy / "generation_config.json"
    cfg = orjson.loads(cfg_path.read_bytes())
    cfg["eos_token_id"] = [eos]
    cfg_path.write_bytes(orjson.dumps(cfg))
    llm = LLM(model_copy, num_blocks=64)
    gen = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40))[0]
    first = baseline.token_ids.index(eos)
    assert gen.finish_reason == "stop" and gen.token_ids == baseline.token_ids[: first + 1]
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert ignored.token_ids == baseline.token_ids and ignored.finish_reason == "length"


def test_logprobs(llm, baseline) -> None:
    gen = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=20, ignore_eos=True))[0]
    assert gen.token_ids == baseline.token_ids[:5]
    for token, lp in zip(gen.token_ids, gen.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top_logprobs) == 20
        values = [v for _, v in lp.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert lp.top_logprobs[0] == (token, lp.logprob)  # greedy picks the most likely token
        assert sum(np.exp(values)) <= 1.0 + 1e-5


def test_logit_bias_forces_bans_and_nudges(llm, baseline) -> None:
    """+100 on one token makes greedy output it every time; -100 bans the greedy choice (the
    baseline's first token); a bias in a batch applies to its own sequence only."""
    forced = baseline.token_ids[7]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={str(forced): 100})
    banned = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logit_bias={baseline.token_ids[0]: -100}
    )
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    gens = llm.generate([PROMPT] * 3, [params, banned, plain])
    assert gens[0].token_ids == [forced] * 6
    assert gens[1].token_ids[0] != baseline.token_ids[0]
    assert gens[2].token_ids == baseline.token_ids[:6]
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logit_bias={forced: 100})
    assert llm.generate(PROMPT, seeded)[0].token_ids == [forced] * 6  # sampling too, not only greedy


def test_logit_bias_is_validated_and_crosses_the_wire_as_json() -> None:
    import orjson

    from pdserve.errors import InvalidRequestError
    from pdserve.scheduler.inbox_messages import GenerateRequest
    from pdserve.scheduler.messages import decode_message, encode

    params = SamplingParams(logit_bias={"17": 5, 3: -100.0})
    assert params.logit_bias == {17: 5, 3: -100.0}
    data = encode(GenerateRequest(request_id="r", router_id="x", prompt="p", deadline=1.0, sampling=params))
    wire = orjson.loads(data)["sampling"]
    assert wire["logit_bias"] == {"17": 5, "3": -100.0}  # JSON keys are strings
    assert decode_message(data).sampling == params
    assert SamplingParams.from_dict(wire) == params
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad, text in (
        ({"x": 1}, "keys must be token ids"),
        ({"-1": 1}, "keys must be token ids"),
        ({5: 100.5}, "logit_bias must be <= 100.0"),
        ({5: -101}, "logit_bias must be >= -100.0"),
        ({5: "1"}, "logit_bias must be a number"),
        ([5], "must map token ids"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(logit_bias=bad)
        assert e.value.param == "logit_bias" and text in e.value.message


# ---- sampler unit checks on hand-made logits -------------------------------------------------------
def _seq(**params) -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(**params))
    seq.rng = np.random.default_rng(0)
    return seq


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = np.random.default_rng(3).standard_normal((1, 500)).astype(np.float32)
    sampler = Sampler(500, eos_token_ids=[0])
    best = int(logits.argmax())
    for _ in range(20):
        assert sampler(logits, [_seq(temperature=1.0, top_k=1)])[0].token_id == best
        assert sampler(logits, [_seq(temperature=1.0, top_p=1e-6)])[0].token_id == best
        assert sampler(logits, [_seq(temperature=1.0, min_p=1.0)])[0].token_id == best


def test_penalties_change_the_choice() -> None:
    logits = np.zeros((1, 10), np.float32)
    logits[0, 3], logits[0, 4] = 2.0, 1.9
    sampler = Sampler(10, eos_token_ids=[0])
    seq = _seq(temperature=0, presence_penalty=1.0)
    assert sampler(logits, [seq])[0].token_id == 3
    seq.output_token_ids.append(3)
    assert sampler(logits, [seq])[0].token_id == 4
    rep = _seq(temperature=0, repetition_penalty=1.5)  # prompt [1, 2, 3] contains 3
    assert sampler(logits, [rep])[0].token_id == 4


def test_logit_bias_comes_before_penalties_and_is_not_the_greedy_fast_path() -> None:
    logits = np.zeros((2, 10), np.float32)
    logits[:, 3] = 2.0
    sampler = Sampler(10, eos_token_ids=[0])
    biased = _seq(temperature=0, logit_bias={5: 1.5, 12: 100})  # 12: a padding row, ignored
    assert [s.token_id for s in sampler(logits, [_seq(temperature=0), biased])] == [3, 3]
    nudged = _seq(temperature=0, logit_bias={5: 2.5})
    assert [s.token_id for s in sampler(logits, [nudged, _seq(temperature=0)])] == [5, 3]
    # the bias, then the penalty: 5 has 2.5 - 1.0 after being generated once, below 3's 2.0
    penalised = _seq(temperature=0, logit_bias={5: 2.5}, presence_penalty=1.0)
    penalised.output_token_ids.append(5)
    assert sampler(logits[:1], [penalised])[0].token_id == 3


def test_vocab_padding_rows_are_never_sampled() -> None:
    logits = np.zeros((1, 20), np.float32)
    logits[0, 15] = 100.0  # beyond the tokenizer's 10 ids
    assert Sampler(10, eos_token_ids=[0])(logits, [_seq(temperature=0)])[0].token_id < 10
