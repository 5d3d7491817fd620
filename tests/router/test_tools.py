"""Tool calling: ``tools`` / ``tool_choice`` parsed into a grammar and a reader, the output read back
as calls (whole and streamed at every split), the chat template's rendering, and the grammars on the
tiny model. Served through the official client: tests/e2e/test_serving.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve import LLM, SamplingParams
from pdserve.errors import InvalidRequestError
from pdserve.router.api.input_limits import InputLimits
from pdserve.router.api.protocol import parse_chat
from pdserve.router.api.tools import ToolUse
from pdserve.tokenizer import Tokenizer

LIMITS = InputLimits(1024, 256, 256, 300, 64)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: takes none
]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode()


def use_of(**fields) -> ToolUse | None:
    return parse_chat(chat(tools=TOOLS, **fields), LIMITS).tool_use


# ---- parsing ---------------------------------------------------------------------------------------
def test_tool_choice_modes() -> None:
    auto = parse_chat(chat(tools=TOOLS), LIMITS)
    assert auto.tool_use.mode == "auto" and not auto.samplings[0].guided
    assert auto.prompts[0].tools == TOOLS  # rendered by the template as the client gave them
    named = parse_chat(chat(tools=TOOLS, tool_choice=NAMED), LIMITS)
    assert named.tool_use.mode == "named" and named.samplings[0].guided["spec"] == WEATHER
    assert named.samplings[0].guided["param"] == "tools"
    required = parse_chat(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), LIMITS)
    spec = required.samplings[0].guided["spec"]
    assert spec["type"] == "array" and spec["maxItems"] == 1 and len(spec["items"]["anyOf"]) == 2
    none = parse_chat(chat(tools=TOOLS, tool_choice="none"), LIMITS)
    assert none.tool_use is None and none.prompts[0].tools is None  # no tools rendered, none read
    assert parse_chat(chat(), LIMITS).tool_use is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    *MESSAGES,
                    {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
                ]
            },
            "messages[1].function_call",
        ),
    ],
)
def test_bad_tool_fields_are_a_400_naming_them(fields, param) -> None:
    with pytest.raises(InvalidRequestError) as e:
        parse_chat(chat(**fields), LIMITS)
    assert e.value.param == param, e.value.message


def test_earlier_calls_reach_the_template_with_arguments_as_objects() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    parsed = parse_chat(chat(tools=TOOLS, messages=messages), LIMITS)
    rendered = parsed.prompts[0].messages
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "X"}
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


# ---- reading the output ----------------------------------------------------------------------------
def stream_at(use: ToolUse, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Feed ``text`` split at ``cuts``; the content and the calls the deltas carry."""
    stream, content, calls = use.stream(), "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for i, piece in enumerate(pieces):
        fields = stream.feed(piece, i == len(pieces) - 1)
        content += fields.get("content", "")
        for d in fields.get("tool_calls", []):
            if d["index"] == len(calls):
                calls.append({"name": d["function"]["name"], "arguments": d["function"]["arguments"]})
            else:
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


AUTO_TEXT = (
    'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    '\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
)


def test_auto_reads_hermes_blocks_whole_and_streamed_at_every_split() -> None:
    use = use_of()
    content, calls = use.read(AUTO_TEXT)
    assert content == "Let me look."
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'},
        {"name": "ping", "arguments": "{}"},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    expected = [c["function"] for c in calls]
    for cut in range(len(AUTO_TEXT) + 1):
        for cuts in ([cut], [cut // 2, cut] if cut > 1 else [cut]):
            assert stream_at(use, AUTO_TEXT, cuts) == ("Let me look.", expected), cuts
    assert stream_at(use, AUTO_TEXT, list(range(1, len(AUTO_TEXT)))) == ("Let me look.", expected)
    # parallel_tool_calls false: the first call only
    assert len(use_of(parallel_tool_calls=False).read(AUTO_TEXT)[1]) == 1


@pytest.mark.parametrize(
    "text",
    [
        "no call at all, but a < and a <tool",
        'a call to an unknown function <tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        "broken <tool_call>{not json</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',  # cut off by max_tokens
    ],
)
def test_auto_text_without_a_valid_call_is_content_unchanged(text) -> None:
    use = use_of()
    assert use.read(text) == (text, [])
    for cut in range(len(text) + 1):
        assert stream_at(use, text, [cut]) == (text, [])


def test_named_streams_arguments_as_they_come_and_required_reads_the_array() -> None:
    named = use_of(tool_choice=NAMED)
    args = '{"city":"Oslo","unit":"f"}'
    content, calls = named.read(args)
    assert content is None and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": args}]
    stream = named.stream()
    first = stream.feed('{"ci', False)["tool_calls"][0]
    assert first["index"] == 0 and first["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert stream.feed('ty":"Oslo","unit":"f"}', True) == {
        "tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Oslo","unit":"f"}'}}]
    }
    assert stream.called

    required = use_of(tool_choice="required")
    text = '[{"name":"ping","parameters":{}},{"name":"get_weather","parameters":{"city":"Rome","unit":"c"}}]'
    content, calls = required.read(text)
    assert content is None and [c["function"]["name"] for c in calls] == ["ping", "get_weather"]
    assert stream_at(required, text, [5, 40]) == ("", [c["function"] for c in calls])
    assert required.read('[{"name":"ping","param') == ('[{"name":"ping","param', [])  # cut off: as text


# ---- the template and the grammars -----------------------------------------------------------------
def test_the_tiny_template_renders_tools_calls_and_results(tiny_model_dir) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    plain = tok.apply_chat_template(MESSAGES)
    assert "<tools>" not in plain
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}}
    rendered = tok.apply_chat_template(
        [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        ],
        tools=TOOLS,
    )
    assert json.dumps(TOOLS[0]) in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>' in rendered
    assert "<tool_response>\nsunny\n</tool_response>" in rendered and rendered.endswith("assistant\n")


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, num_blocks=512)


def test_named_and_required_grammars_give_valid_calls_on_the_random_model(llm) -> None:
    """The constraint the router builds, on the engine: 8 seeds each; every output reads as calls
    whose arguments validate against their function's schema."""
    for fields in ({"tool_choice": NAMED}, {"tool_choice": "required", "parallel_tool_calls": False}):
        use = use_of(**fields)
        params = [
            SamplingParams(temperature=1.0, seed=s, max_tokens=160, guided=use.guided()) for s in range(8)
        ]
        for out in llm.generate(["Call a tool: "] * 8, params):
            assert out.finish_reason == "stop", out.text
            _, calls = use.read(out.text)
            assert len(calls) == 1, out.text
            fn = calls[0]["function"]
            schema = WEATHER if fn["name"] == "get_weather" else {"type": "object", "maxProperties": 0}
            jsonschema.validate(json.loads(fn["arguments"]), schema)
