"""``--max-optional-properties`` (``pdserve.grammar_limits``): the schema shape llguidance compiles and
then gives up on, found in the schema's JSON; the default pinned against the real compiler (the tiny
model's vocabulary, ``grammar.LIMITS``)."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.grammar import Grammars
from pdserve.errors import InvalidRequestError
from pdserve.grammar_limits import (
    DEFAULT_MAX_OPTIONAL_PROPERTIES,
    check_optional_properties,
    most_optional_properties,
)
from pdserve.tokenizer import Tokenizer


def obj(n: int, required: tuple[str, ...] = (), **extra) -> dict:
    schema = {"type": "object", "properties": {f"p{i}": {} for i in range(n)}, **extra}
    if required:
        schema["required"] = list(required)
    return schema


def test_optional_properties_are_counted_per_object_at_any_depth() -> None:
    assert most_optional_properties({"type": "string"}) == 0
    assert most_optional_properties(obj(7)) == 7
    assert most_optional_properties(obj(7, required=("p0", "p1", "nope"))) == 5
    nested = {
        "type": "object",
        "properties": {"a": obj(3), "b": {"type": "array", "items": obj(9)}},
        "required": ["a", "b"],
        "$defs": {"x": {"anyOf": [obj(2), obj(12)]}},
        "definitions": {"y": obj(4)},
    }
    assert most_optional_properties(nested) == 12
    # a property named "properties" is a name, not a keyword; data keywords hold no schemas
    named = {"type": "object", "properties": {"properties": {"type": "string"}}, "required": ["properties"]}
    assert most_optional_properties(named) == 0
    data = {"enum": [obj(50)], "const": obj(50), "default": obj(50), "examples": [obj(50)]}
    assert most_optional_properties(data) == 0
    deep: dict = obj(2)
    for _ in range(5000):  # iterative: no recursion limit
        deep = {"type": "array", "items": deep}
    assert most_optional_properties(deep) == 2


def test_the_refusal_names_the_field_and_the_flag() -> None:
    check_optional_properties(obj(500), 500, "response_format")
    with pytest.raises(InvalidRequestError, match=r"501 optional properties.*--max-optional-properties") as e:
        check_optional_properties(obj(501), 500, "tools[2].function.parameters")
    assert e.value.param == "tools[2].function.parameters"


def first_step_error(grammars: Grammars, schema: dict, text: str) -> str:
    """The grammar's error after ``text`` (the object's opening), or "" when it took it."""
    matcher = grammars.matcher({"kind": "json", "spec": schema})
    for token in grammars.tokenizer.encode(text, add_special_tokens=False):
        if not matcher.advance(token):
            return matcher.error or "refused"
        matcher.allowed()
        if matcher.error:
            return matcher.error
    return ""


def test_the_default_is_the_most_optional_properties_llguidance_runs(tiny_model_dir) -> None:
    """500 optional properties run; at 501 the compiled grammar fails at the object's first token
    (the parser's row bound, ~4 items a property): the shape the limit refuses is the one that
    would compile and then fail, and the default refuses nothing that runs with none required."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    grammars = Grammars(tokenizer, tokenizer.vocab_size)
    n = DEFAULT_MAX_OPTIONAL_PROPERTIES
    assert first_step_error(grammars, obj(n, additionalProperties=False), '{"p3":') == ""
    error = first_step_error(grammars, obj(n + 1, additionalProperties=False), '{"p3":')
    assert "max is 2000" in error, error
    # within an array, in $defs: the same
    wrapped = {"type": "array", "items": {"$ref": "#/$defs/o"}, "$defs": {"o": obj(n + 100)}}
    assert "max is 2000" in first_step_error(grammars, wrapped, '[{"p3":')
    assert most_optional_properties(wrapped) == n + 100
    assert len(json.dumps(obj(n + 1))) < 8 * 1024  # far within --max-grammar-bytes
