"""Tool calling: a chat request's ``tools`` / ``tool_choice`` (their request models and checks), and the
model's output read as calls.

``tool_choice`` ``required`` and a named function are enforced by the structured-output grammar
(``SamplingParams.guided``: the worker's llguidance, the path ``response_format`` takes, so it holds in
splitwise serving too). A named function's output *is* its arguments: a JSON object under the
function's ``parameters`` schema. ``required`` makes a JSON array of ``{"name", "parameters"}``
objects, each one of the given functions with its arguments. ``auto`` leaves the model free and
reads Hermes-style blocks out of its text, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
the format of Qwen's and Hermes' chat templates (and of the tiny model's); text before the first
block is the message's content. ``none`` (the default without tools) renders no tools and reads none.

The chat template receives ``tools`` as Hugging Face templates expect (the request's tool entries),
and earlier calls in the conversation with their ``arguments`` as objects, not JSON text (templates
write ``arguments | tojson``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Literal

from pdserve.errors import InvalidRequestError
from pdserve.router.api.jsonlimits import check_depth, load_json
from pdserve.router.api.strict import StrictModel

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for function names."""
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_JSON_TOOLS = "tools"  # the field a grammar error names: the schemas came from the tools


# -- the request's tool objects (parts of a chat request body) ---------------------------------


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object (none: the function takes no arguments)."""
    strict: bool | None = None
    """Accepted; where pdserve enforces arguments (``tool_choice`` required or named) it always does."""


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(StrictModel):
    name: str
    arguments: str
    """The arguments object as JSON text (as OpenAI returns it)."""


class ToolCall(StrictModel):
    """A call in an earlier assistant message of the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall


# -- reading the output ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ToolUse:
    """How one chat request's output becomes tool calls (``tool_choice`` other than ``none``)."""

    mode: Literal["auto", "required", "named"]
    schemas: dict[str, dict[str, Any]]
    """Function name -> the JSON schema of its arguments."""
    name: str | None = None
    """The function ``tool_choice`` names (mode ``named``)."""
    parallel: bool = True
    """``parallel_tool_calls``: False allows one call."""

    def guided(self) -> dict[str, Any] | None:
        """The grammar that enforces ``required`` or a named function (``auto``: none)."""
        if self.mode == "named":
            return {"kind": "json", "spec": self.schemas[self.name or ""], "param": _JSON_TOOLS}
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in self.schemas.items()
            ]
            spec = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                spec["maxItems"] = 1
            return {"kind": "json", "spec": spec, "param": _JSON_TOOLS}
        return None

    def read(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output as ``message.content`` and ``message.tool_calls`` (no calls: the text)."""
        if self.mode == "named":
            return None, [_call(self.name or "", text)]
        if self.mode == "required":
            calls = _array_calls(text)
        else:
            start = text.find(CALL_OPEN)
            calls = _hermes_calls(text[start:], self.schemas) if start >= 0 else []
            if calls:
                text = text[:start]
        if not calls:
            return text, []
        return (text.strip() or None) if self.mode == "auto" else None, calls[: None if self.parallel else 1]

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice's text turned into ``delta`` fields as it arrives.

    A named function streams its arguments as they come; ``auto`` streams content until a
    ``<tool_call>`` begins (holding back what may be the start of one), then keeps the rest and
    sends whole calls with the last delta; ``required`` sends its calls with the last delta.
    """

    __slots__ = ("_held", "_rest", "_use", "called")

    def __init__(self, use: ToolUse) -> None:
        self._use = use
        self._held = ""  # auto: text that may be the start of CALL_OPEN; required: everything
        self._rest: str | None = None  # auto: the text from the first CALL_OPEN on
        self.called = False  # a call went out (the finish reason becomes tool_calls)

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """The delta fields for ``text`` (``final``: the choice's last text; then calls go out)."""
        use = self._use
        if use.mode == "named":
            if not text and not (final and not self.called):
                return {}
            if self.called:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            self.called = True
            return {"tool_calls": [{"index": 0, **_call(use.name or "", text)}]}
        if use.mode == "required":
            self._held += text
            return self._calls(_array_calls(self._held), self._held) if final else {}
        if self._rest is not None:
            self._rest += text
            content = ""
        else:
            pending = self._held + text
            start = pending.find(CALL_OPEN)
            if start >= 0:
                content, self._rest, self._held = pending[:start], pending[start:], ""
            else:
                keep = _open_prefix(pending)
                content, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        if not final:
            return {"content": content} if content else {}
        if self._rest is None:
            content += self._held
            return {"content": content} if content else {}
        out = self._calls(_hermes_calls(self._rest, use.schemas), self._rest)
        if content:
            out["content"] = content + out.get("content", "")
        return out

    def _calls(self, calls: list[dict[str, Any]], text: str) -> dict[str, Any]:
        if not calls:
            return {"content": text} if text else {}
        self.called = True
        calls = calls[: None if self._use.parallel else 1]
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}


def tool_use_of(
    tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool | None
) -> ToolUse | None:
    """Check ``tools`` / ``tool_choice`` (400s name the field); None when no tool may be called."""
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise InvalidRequestError("tool_choice needs tools: give the functions in tools", "tool_choice")
        return None
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn, where = tool.function, f"tools[{i}].function"
        if not _NAME.fullmatch(fn.name):
            raise InvalidRequestError(
                f"{where}.name must be 1-64 letters, digits, underscores or dashes, got {fn.name!r}",
                f"{where}.name",
            )
        if fn.name in schemas:
            raise InvalidRequestError(f"{where}.name {fn.name!r} is given twice", f"{where}.name")
        params = fn.parameters
        check_depth(params, f"{where}.parameters")
        if params is not None and params.get("type", "object") != "object":
            raise InvalidRequestError(
                f"{where}.parameters must be the JSON schema of an object", f"{where}.parameters"
            )
        schemas[fn.name] = params if params else _NO_ARGUMENTS
    if choice == "none":
        return None
    if isinstance(choice, str):
        return ToolUse(choice, schemas, parallel=parallel is not False)  # type: ignore[arg-type]
    name = choice.function.name
    if name not in schemas:
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not in tools", "tool_choice.function.name"
        )
    return ToolUse("named", schemas, name=name, parallel=False)


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The request's tool entries as chat templates take them (``GenerateRequest.tools``)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def template_call(call: ToolCall, where: str) -> dict[str, Any]:
    """An earlier assistant call as chat templates take it: ``arguments`` as an object."""
    text = call.function.arguments
    arguments = load_json(text, f"{where}.function.arguments") if text.strip() else {}
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _arguments(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _array_calls(text: str) -> list[dict[str, Any]]:
    """``required``'s output: a JSON array of {"name", "parameters"} (anything else: no calls)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) for c in items
    ):
        return []
    return [_call(c["name"], _arguments(c.get("parameters", {}))) for c in items]


def _hermes_calls(text: str, schemas: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``<tool_call>`` blocks of ``text`` that hold a known function's name and an arguments
    object (a block the output ended inside counts when its JSON is whole)."""
    calls = []
    for block in text.split(CALL_OPEN)[1:]:
        body = block.split(CALL_CLOSE, 1)[0].strip()
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if not isinstance(call, dict) or call.get("name") not in schemas:
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                continue
        if isinstance(arguments, dict):
            calls.append(_call(call["name"], _arguments(arguments)))
    return calls


def _open_prefix(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for k in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return k
    return 0
