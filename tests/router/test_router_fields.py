"""Every field of OpenAI's request models, as the installed `openai` package types them, is honoured,
accepted as an advisory no-op, or rejected with a 400 naming it; anything else is a 400 too."""

from __future__ import annotations

import typing

import openai.types
import openai.types.chat
import pytest
import redis
from router_support import FakeWorker, instance, redis_conn, router, run

from pdserve.router.api import request_models
from pdserve.router.api.request_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    EXTRAS,
    MESSAGE_FIELDS,
    STREAM_OPTIONS_FIELDS,
    TEXT_PART_FIELDS,
    FieldPolicy,
)

COMPLETION = {"model": "tiny", "prompt": "hi"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
GUIDED = {"guided_grammar"}  # vLLM's, rejected (the other guided_* are honoured extras)

ADVISORY_VALUES = {
    "user": "user-1",
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "auto",
    "safety_identifier": "hashed-id",
    "prompt_cache_key": "key",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"},
}


def openai_fields(*types: typing.Any) -> set[str]:
    """The keys of TypedDicts and of unions of them (the streaming and non-streaming variants)."""
    out: set[str] = set()
    for t in types:
        for member in typing.get_args(t) or (t,):
            out |= set(typing.get_type_hints(member))
    return out


CASES = [
    (
        "completions",
        COMPLETION_FIELDS,
        request_models.CompletionRequest,
        openai_fields(openai.types.CompletionCreateParams),
    ),
    (
        "chat",
        CHAT_FIELDS,
        request_models.ChatCompletionRequest,
        openai_fields(openai.types.chat.CompletionCreateParams),
    ),
    (
        "message",
        MESSAGE_FIELDS,
        request_models.ChatMessage,
        openai_fields(openai.types.chat.ChatCompletionMessageParam),
    ),
    (
        "stream_options",
        STREAM_OPTIONS_FIELDS,
        request_models.StreamOptions,
        openai_fields(openai.types.chat.ChatCompletionStreamOptionsParam),
    ),
    (
        "text part",
        TEXT_PART_FIELDS,
        request_models.ContentPart,
        openai_fields(openai.types.chat.ChatCompletionContentPartTextParam),
    ),
]


@pytest.mark.parametrize(("name", "policy", "model", "theirs"), CASES, ids=[c[0] for c in CASES])
def test_every_openai_field_is_in_exactly_one_class(
    name: str, policy: FieldPolicy, model: type, theirs: set[str]
) -> None:
    classes = {"honoured": policy.honoured, "advisory": policy.advisory, "rejected": set(policy.rejected)}
    for field in sorted(theirs | policy.fields):
        owners = [c for c, fields in classes.items() if field in fields]
        assert len(owners) == 1, f"{name}.{field} is in {owners or 'no class'}"
    assert theirs <= policy.fields, f"{name}: unaccounted OpenAI fields {sorted(theirs - policy.fields)}"
    # the pydantic model takes exactly the declared fields (others are refused as unknown) ...
    assert set(model.model_fields) == policy.fields
    # ... and the ones OpenAI does not have are the documented extensions
    assert policy.fields - theirs <= EXTRAS | GUIDED, sorted(policy.fields - theirs - EXTRAS - GUIDED)
    assert all(why for why in policy.rejected.values())


def test_each_rejected_field_is_a_400_naming_it(redis_url: str, redis_client: redis.Redis) -> None:
    """No worker is needed: parsing refuses them before any routing."""
    cases = [("/v1/completions", {**COMPLETION, f: 1}, f) for f in COMPLETION_FIELDS.rejected]
    cases += [("/v1/chat/completions", {**CHAT, f: 1}, f) for f in CHAT_FIELDS.rejected]
    message = {"role": "assistant", "content": "ok"}
    cases += [
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [CHAT["messages"][0], {**message, f: 1}]},
            f"messages[1].{f}",
        )
        for f in MESSAGE_FIELDS.rejected
    ]
    cases += [
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),  # and no tools
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            },
            "tools[0].function.parameters",
        ),
        ("/v1/completions", {**COMPLETION, "suffix": ""}, "suffix"),
        ("/v1/completions", {**COMPLETION, "no_such_field": None}, "no_such_field"),
        ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),  # vLLM's chat extra: not ours
        ("/v1/chat/completions", {**CHAT, "prompt": "hi"}, "prompt"),
        ("/v1/completions", {**COMPLETION, "messages": []}, "messages"),
    ]

    async def main() -> None:
        async with router(redis_url) as client:
            for path, body, param in cases:
                resp = await client.post(path, json=body)
                assert resp.status_code == 400, (body, resp.text)
                error = resp.json()["error"]
                assert (error["type"], error["param"]) == ("invalid_request_error", param), body
                assert param in error["message"]

    run(main())


def test_advisory_fields_and_default_values_are_accepted_and_change_nothing(
    redis_url: str, redis_client: redis.Redis
) -> None:
    assert set(ADVISORY_VALUES) == CHAT_FIELDS.advisory and COMPLETION_FIELDS.advisory == {"user"}
    chat = {
        **CHAT,
        **ADVISORY_VALUES,
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "tools": None,
        "stream_options": {"include_obfuscation": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {}}]}
        ],
    }
    completion = {**COMPLETION, "user": "user-1", "best_of": 1, "suffix": None, "guided_json": None}

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            for path, plain, body in (
                ("/v1/chat/completions", CHAT, chat),
                ("/v1/completions", COMPLETION, completion),
            ):
                for b in (plain, body):
                    resp = await client.post(path, json=b)
                    assert resp.status_code == 200, resp.text
            reqs = worker.requests()
            assert [m.messages for m in reqs[:2]] == [[{"role": "user", "content": "hi"}]] * 2
            assert reqs[0].sampling == reqs[1].sampling and reqs[2].sampling == reqs[3].sampling
            assert reqs[2].prompt == reqs[3].prompt == "hi"
            await worker.stop()

    run(main())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", "1e309"),
        ("repetition_penalty", "Infinity"),
        ("temperature", "NaN"),
        ("top_p", "-1e309"),
        ("presence_penalty", "1e999"),
        ("min_p", "1e309"),
        ("logit_bias", '{"5": 1e309}'),
    ],
)
def test_non_finite_numbers_are_a_400_naming_the_field(field: str, value: str) -> None:
    """JSON has no infinities, but 1e309 parses as one (and pydantic-core takes Infinity/NaN): the
    router refuses them rather than let a worker meet them."""
    from pdserve.errors import InvalidRequestError
    from pdserve.router.api.input_limits import InputLimits
    from pdserve.router.api.protocol import parse_completion

    body = f'{{"prompt": "hi", "{field}": {value}}}'.encode()
    with pytest.raises(InvalidRequestError) as info:
        parse_completion(body, InputLimits(16, 256, 16, 300, 64))
    assert info.value.param == field


def test_a_tiny_temperature_is_greedy() -> None:
    """logits / 1e-45 overflow float32 (NaN probabilities): below MIN_TEMPERATURE means greedy."""
    from pdserve.sampling_params import MIN_TEMPERATURE, SamplingParams

    assert SamplingParams(temperature=1e-45).is_greedy and SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).is_greedy
