"""Structured output (``SamplingParams.guided``): JSON schema, JSON object, regex and choice grammars
enforced in the sampler, on the tiny random-weight model; the router's parsing of
``response_format`` and ``guided_*``; the hand-off and migration paths that rebuild a grammar's state.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence
from pdserve.errors import EngineError, InvalidRequestError
from pdserve.router.api.input_limits import InputLimits
from pdserve.router.api.protocol import parse_chat, parse_completion

PROMPT = "Describe the server as JSON: "
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["model", "server", "cache"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "meta": {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "level": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "meta"],
    "additionalProperties": False,
}
JSON = {"kind": "json", "spec": SCHEMA}


def sampled(guided: dict, seeds, **kw) -> list[SamplingParams]:
    """Temperature 1 with each seed (None: greedy)."""
    return [
        SamplingParams(
            temperature=0.0 if s is None else 1.0,
            seed=s,
            max_tokens=kw.pop("max_tokens", 256),
            guided=guided,
            **kw,
        )
        for s in seeds
    ]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, num_blocks=1024)


# ---- the grammars, through the engine -------------------------------------------------------------
def test_json_schema_output_validates_for_20_seeds_and_greedy(llm) -> None:
    """Nested object, array, enum, required fields: every output is complete and valid."""
    gens = llm.generate([PROMPT] * 21, sampled(JSON, [*range(20), None]))
    outputs = set()
    for g in gens:
        assert g.finish_reason == "stop", (g.finish_reason, g.text)
        jsonschema.validate(json.loads(g.text), SCHEMA)
        outputs.add(g.text)
    assert len(outputs) > 10  # the seeds made different documents: the grammar steered, not forced


def test_json_object_output_parses_as_an_object(llm) -> None:
    """Any object: a random model rarely closes one, but each that the grammar ends parses, and EOS
    never cut one short (the rest run to max_tokens)."""
    gens = llm.generate([PROMPT] * 16, sampled({"kind": "json", "spec": {"type": "object"}}, range(16)))
    done = [g for g in gens if g.finish_reason == "stop"]
    assert {g.finish_reason for g in gens} <= {"stop", "length"}
    assert all(isinstance(json.loads(g.text), dict) for g in done)
    assert any(len(json.loads(g.text)) for g in done)  # not only "{}"
    assert all(g.text.startswith("{") and len(g.token_ids) == 256 for g in gens if g not in done)


def test_guided_choice_returns_one_of_the_choices(llm) -> None:
    choices = ["alpha", "beta gamma", "delta", "42"]
    gens = llm.generate([PROMPT] * 13, sampled({"kind": "choice", "spec": choices}, [*range(12), None]))
    assert all(g.finish_reason == "stop" and g.text in choices for g in gens)
    assert len({g.text for g in gens}) > 1


def test_guided_regex_output_fullmatches(llm) -> None:
    pattern = r"(yes|no), [0-9]{1,3} (cats|dogs)\."
    gens = llm.generate([PROMPT] * 13, sampled({"kind": "regex", "spec": pattern}, [*range(12), None]))
    assert all(g.finish_reason == "stop" and re.fullmatch(pattern, g.text) for g in gens), [
        g.text for g in gens
    ]


def test_eos_only_where_the_grammar_accepts_and_min_tokens_gives_way(llm) -> None:
    """``[ab]+`` accepts from the first letter: EOS may end it then, never before. A grammar that is
    complete ends the request even with min_tokens left (it allows nothing but EOS)."""
    regex, eos = {"kind": "regex", "spec": "[ab]+"}, llm.tokenizer.eos_token_ids
    gens = llm.generate([PROMPT] * 8, sampled(regex, range(8), max_tokens=12))
    for g in gens:
        assert re.fullmatch("[ab]+", g.text), g.text
        if g.finish_reason == "stop":  # [ab]+ can always go on: only EOS ends it, after a letter
            assert g.token_ids[-1] in eos and len(g.token_ids) >= 2
        else:
            assert (g.finish_reason, len(g.token_ids)) == ("length", 12)
    assert any(g.finish_reason == "stop" for g in gens)
    gens = llm.generate([PROMPT] * 8, sampled(regex, range(8), max_tokens=12, min_tokens=6))
    assert all(len(g.token_ids) >= 7 and re.fullmatch("[ab]+", g.text) for g in gens)
    [g] = llm.generate(PROMPT, sampled({"kind": "choice", "spec": ["yes"]}, [None], min_tokens=5))
    assert (g.text, g.finish_reason) == ("yes", "stop")


def test_constrained_and_plain_requests_share_a_batch(llm) -> None:
    """A constrained row leaves its neighbours' greedy fast path output unchanged."""
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPT, plain)[0].token_ids
    both = llm.generate([PROMPT, PROMPT], [plain, *sampled(JSON, [None])])
    assert both[0].token_ids == alone
    jsonschema.validate(json.loads(both[1].text), SCHEMA)


def test_compiled_grammars_are_cached_per_engine(llm) -> None:
    """Compiled once per (kind, spec): three requests with one regex compile it once; a schema
    with its keys in another order is the same entry; every request still gets its own matcher."""
    grammars = llm.engine.grammars
    regex = {"kind": "regex", "spec": "cached-[0-9]"}
    before = grammars.num_compiled
    gens = llm.generate([PROMPT] * 3, sampled(regex, [1, 2, None]))
    assert grammars.num_compiled == before + 1
    assert all(re.fullmatch("cached-[0-9]", g.text) for g in gens)
    grammars.compile(JSON)
    before = grammars.num_compiled
    grammars.compile({"kind": "json", "spec": dict(reversed(list(SCHEMA.items())))})
    assert grammars.num_compiled == before


@pytest.mark.parametrize(
    ("guided", "param", "text"),
    [
        ({"kind": "json", "spec": {"type": "frob"}}, "response_format", "frob"),
        ({"kind": "json", "spec": {"type": "object", "properties": 5}}, "response_format", "JSON schema"),
        ({"kind": "regex", "spec": "[ab"}, "guided_regex", "regex"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_400(llm, guided, param, text) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.validate(ids, SamplingParams(max_tokens=8, guided=guided))
    assert e.value.param == param and text in e.value.message


def test_a_resumed_request_continues_in_its_grammar(tiny_model_dir, llm) -> None:
    """A migration replays the delivered tokens into the matcher: the rest equals the undisturbed
    run's, greedy and seeded; tokens that break the grammar are refused."""
    for params in sampled(JSON, [None, 7]):
        whole = llm.generate(PROMPT, params)[0]
        cut = len(whole.token_ids) // 2
        engine = llm.engine
        seq = engine.add_request("resumed", PROMPT, params, resume_token_ids=whole.token_ids[:cut])
        rest, text = [], ""
        while engine.has_unfinished():
            for out in engine.step():
                rest += out.token_ids
                text += out.text
        assert seq.output_token_ids == whole.token_ids and rest == whole.token_ids[cut:]
        assert whole.text.endswith(text) and text
    bad = llm.tokenizer.encode("not json")
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request("bad", PROMPT, sampled(JSON, [None])[0], resume_token_ids=bad)
    assert e.value.param == "resume_token_ids" and "bad" not in llm.engine.requests


def test_a_prefilled_request_continues_in_its_grammar(tiny_model_dir, llm) -> None:
    """The decode side rebuilds the grammar from the spec plus the first token (add_prefilled)."""
    params = sampled(JSON, [None])[0]
    want = llm.generate(PROMPT, params)[0]
    prefill = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=64))
    decode = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=64))
    seq = prefill.add_request("r", PROMPT, params, prefill_only=True)
    outs = []
    while not outs:
        outs = [o for o in prefill.step() if o.prefilled]
    first = outs[0].token_ids[0]
    decode.reserve("r", seq.num_prompt_tokens)
    decode.import_kv("r", prefill.export_kv("r"))
    with pytest.raises(EngineError, match="does not follow"):
        decode.add_prefilled("r", seq.prompt_token_ids, llm.tokenizer.encode("x")[0], params)
    assert "r" in decode.reserved  # the refused hand-off kept its blocks
    decode.add_prefilled("r", seq.prompt_token_ids, first, params)
    tokens, text = [first], outs[0].text
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.token_ids
            text += o.text
            reason = o.finish_reason
    assert tokens == want.token_ids and text == want.text and reason == "stop"


# ---- the sampler ----------------------------------------------------------------------------------
class FixedGrammar:
    def __init__(self, allowed: list[int], vocab: int) -> None:
        self.mask = np.zeros(vocab, dtype=bool)
        self.mask[allowed] = True

    def allowed(self) -> np.ndarray:
        return self.mask


def test_the_sampler_masks_a_constrained_row_and_keeps_the_fast_path_for_the_rest() -> None:
    sampler = Sampler(vocab_limit=8, eos_token_ids=[0])
    logits = np.arange(16, dtype=np.float32)[None].repeat(2, axis=0)  # id 15 is best, 8.. are padding
    plain = Sequence("a", [1], SamplingParams(temperature=0))
    constrained = Sequence("b", [1], SamplingParams(temperature=0))
    assert sampler.is_plain_greedy(plain)
    constrained.grammar = FixedGrammar([2, 3], 8)
    assert not sampler.is_plain_greedy(constrained)
    assert [s.token_id for s in sampler(logits, [plain, constrained])] == [7, 3]
    seeded = Sequence("c", [1], SamplingParams(temperature=1.0, seed=3), grammar=FixedGrammar([2, 5], 8))
    seeded.rng = np.random.default_rng(3)
    assert {sampler(logits[:1], [seeded])[0].token_id for _ in range(20)} <= {2, 5}


# ---- the echo engine, the wire format, the router --------------------------------------------------
def test_the_echo_engine_refuses_structured_output() -> None:
    from pdserve.engine.echo import EchoEngine

    with pytest.raises(InvalidRequestError) as e:
        EchoEngine(None).validate([1, 2], SamplingParams(guided={"kind": "choice", "spec": ["a"]}))
    assert e.value.param == "guided_choice" and "echo engine" in e.value.message


def test_guided_crosses_the_wire_and_is_checked() -> None:
    p = SamplingParams(guided=JSON)
    assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    for guided, param in (
        ({"kind": "json"}, "guided"),
        ({"kind": "grammar", "spec": "x"}, "guided"),
        ({"kind": "json", "spec": True}, "response_format"),
        ({"kind": "regex", "spec": ""}, "guided_regex"),
        ({"kind": "choice", "spec": ["a", 3]}, "guided_choice"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(guided=guided)
        assert e.value.param == param


LIMITS = InputLimits(16, 64, 16, 300, 64)


def chat(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


@pytest.mark.parametrize(
    ("fields", "guided"),
    [
        ({"response_format": {"type": "json_object"}}, {"kind": "json", "spec": {"type": "object"}}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": SCHEMA, "strict": True},
                }
            },
            JSON,
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": SCHEMA}, JSON),
        ({"guided_json": json.dumps(SCHEMA)}, JSON),
        ({"guided_regex": "[0-9]+"}, {"kind": "regex", "spec": "[0-9]+"}),
        ({"guided_choice": ["a", "b"]}, {"kind": "choice", "spec": ["a", "b"]}),
    ],
)
def test_the_router_parses_structured_output_into_sampling(fields, guided) -> None:
    assert parse_chat(chat(**fields), LIMITS).samplings[0].guided == guided
    body = json.dumps({"prompt": "x", "n": 2, **fields}).encode()
    assert [s.guided for s in parse_completion(body, LIMITS).samplings] == [guided, guided]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {}, "strict": "y"},
                }
            },
            "response_format.json_schema.strict",
        ),
        ({"guided_json": 5}, "guided_json"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"guided_json": "{"}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice[1]"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_malformed_structured_output_is_a_400_naming_the_field(fields, param) -> None:
    with pytest.raises(InvalidRequestError) as e:
        parse_chat(chat(**fields), LIMITS)
    assert e.value.param == param, e.value.message
