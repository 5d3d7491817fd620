"""The sizes of request fields the router bounds, checked before anything reaches a worker.

Router settings bound ``stop``, ``stop_token_ids``, ``logit_bias``, the choices one request fans
out to and the structured-output constraints, by size and by the shape that compiles for seconds
only to fail (:class:`InputLimits`, :mod:`pdserve.grammar_limits`); a prompt's length is bounded
in characters, without a tokenizer (:func:`check_prompt_chars`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

import orjson

from pdserve.errors import InvalidRequestError, RequestTooLongError
from pdserve.grammar_limits import DEFAULT_MAX_OPTIONAL_PROPERTIES, check_optional_properties
from pdserve.router.api.request_models import CommonRequest

if TYPE_CHECKING:
    from pdserve.router.http.settings import RouterSettings


@dataclasses.dataclass(frozen=True, slots=True)
class InputLimits:
    """Sizes of request fields that the router bounds (from ``--max-stop-strings`` and friends)."""

    max_stop_strings: int
    max_stop_string_len: int
    max_stop_token_ids: int
    max_logit_bias: int
    max_prompts: int
    """Most choices (prompts x n) one request fans out to."""
    max_grammar_bytes: int = 64 * 1024
    """Largest structured-output constraint or ``tools``, in bytes of JSON (a worker compiles it)."""
    chars_per_token: int = 32
    """``--max-prompt-chars-per-token``: see :func:`check_prompt_chars`."""
    max_optional_properties: int = DEFAULT_MAX_OPTIONAL_PROPERTIES
    """``--max-optional-properties``: the most optional properties of an object in a JSON schema."""

    @classmethod
    def of(cls, settings: RouterSettings) -> InputLimits:
        return cls(
            settings.max_stop_strings,
            settings.max_stop_string_len,
            settings.max_stop_token_ids,
            settings.max_logit_bias,
            settings.max_prompts_per_request,
            settings.max_grammar_bytes,
            settings.max_prompt_chars_per_token,
            settings.max_optional_properties,
        )

    def check(self, req: CommonRequest) -> None:
        """Raise InvalidRequestError naming ``stop``, ``stop_token_ids``, ``logit_bias`` or a grammar
        field when one is too large."""
        self.check_grammars(req)
        given = req.given_sampling()
        stop, stop_token_ids, logit_bias = (
            given.get("stop"),
            given.get("stop_token_ids"),
            given.get("logit_bias"),
        )
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > self.max_stop_strings:
            raise InvalidRequestError(
                f"at most {self.max_stop_strings} stop strings are allowed, got {len(stops)}", "stop"
            )
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_string_len:
            raise InvalidRequestError(
                f"a stop string may be at most {self.max_stop_string_len} characters, got {longest}", "stop"
            )
        if stop_token_ids is not None and len(stop_token_ids) > self.max_stop_token_ids:
            raise InvalidRequestError(
                f"at most {self.max_stop_token_ids} stop_token_ids are allowed, got {len(stop_token_ids)}",
                "stop_token_ids",
            )
        if logit_bias is not None and len(logit_bias) > self.max_logit_bias:
            raise InvalidRequestError(
                f"at most {self.max_logit_bias} logit_bias entries are allowed, got {len(logit_bias)}",
                "logit_bias",
            )

    def check_grammars(self, req: CommonRequest) -> None:
        """Raise InvalidRequestError naming the structured-output field (or ``tools``) whose JSON is
        larger than ``max_grammar_bytes`` (a worker compiles it, and a huge schema stalls its engine),
        or whose schema has an object of more than ``max_optional_properties`` (it would compile
        for seconds and then fail at its first token)."""
        fmt = req.response_format
        tools = getattr(req, "tools", None)  # chat only
        for param, value in (
            (
                "response_format.json_schema.schema",
                fmt.json_schema.schema_ if fmt and fmt.json_schema else None,
            ),
            ("guided_json", req.guided_json),
            ("guided_regex", req.guided_regex),
            ("guided_choice", req.guided_choice),
            ("tools", [t.model_dump(exclude_none=True) for t in tools] if tools else None),
        ):
            if value is not None and (size := json_bytes(value)) > self.max_grammar_bytes:
                raise InvalidRequestError(
                    f"{param} is {size} bytes of JSON; at most {self.max_grammar_bytes} are allowed "
                    "(--max-grammar-bytes)",
                    param,
                )
        schemas: list[tuple[str, Any]] = [
            (
                "response_format.json_schema.schema",
                fmt.json_schema.schema_ if fmt and fmt.json_schema else None,
            ),
            ("guided_json", _loaded(req.guided_json)),
        ]
        choice = getattr(req, "tool_choice", None)  # only a call it forces is compiled
        named = None if choice is None or isinstance(choice, str) else choice.function.name
        schemas += [
            (f"tools[{i}].function.parameters", t.function.parameters)
            for i, t in enumerate(tools or ())
            if choice == "required" or t.function.name == named
        ]
        for param, schema in schemas:
            if schema is not None:
                check_optional_properties(schema, self.max_optional_properties, param)

    def check_choices(self, num_prompts: int, n: int) -> None:
        """Raise InvalidRequestError naming ``prompt`` (or ``n``) when prompts x n is above the bound."""
        if num_prompts * n > self.max_prompts:
            what = f"{num_prompts} prompts x n = {n}" if num_prompts > 1 else f"n = {n}"
            raise InvalidRequestError(
                f"a request may ask for at most {self.max_prompts} choices (prompts x n), got {what}",
                "prompt" if num_prompts > 1 else "n",
            )


def _loaded(schema: Any) -> Any:
    """``guided_json``'s schema (a string holding one is parsed; a malformed one is left for the
    parser to name)."""
    if not isinstance(schema, str):
        return schema
    try:
        return orjson.loads(schema)
    except orjson.JSONDecodeError:
        return None


def json_bytes(value: Any) -> int:
    """The size of ``value`` as compact JSON (a string: its UTF-8 bytes)."""
    if isinstance(value, str):
        return len(value.encode())
    try:
        return len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):  # an integer past 64 bits, nesting past 255
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def check_prompt_chars(chars: int, param: str, max_model_len: int | None, chars_per_token: int) -> None:
    """Raise RequestTooLongError naming ``param`` when ``chars`` characters cannot fit into
    ``max_model_len`` tokens (None: no instance said, nothing to check).

    Judged without a tokenizer: the prompt would need tokens of more than ``chars_per_token``
    characters *on average*; real text averages about 4 and no usual vocabulary has tokens near 32,
    so a prompt that could fit is never refused. Refusing here keeps a worker from tokenizing
    megabytes on its engine thread only to refuse them (it would stall, and be retried elsewhere).
    """
    if max_model_len is not None and chars > max_model_len * chars_per_token:
        raise RequestTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; {param} holds {chars} "
            f"characters, more than {max_model_len} tokens of up to {chars_per_token} characters "
            "(--max-prompt-chars-per-token) can hold",
            param,
        )
