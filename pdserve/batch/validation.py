"""Checking a batch's input file line by line, as the online endpoints check a body, so a batch
that starts can only fail line by line for reasons an online request would meet too."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import orjson

from pdserve.batchstore.batches import ENDPOINTS, BatchError
from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.router.api.input_limits import InputLimits
from pdserve.router.api.protocol import parse_chat, parse_completion
from pdserve.router.routing.selection import model_len, resolve_model, vocab_size
from pdserve.scheduler.registration import InstanceInfo

logger = logging.getLogger(__name__)

MAX_ERRORS = 100
"""Validation stops listing errors after this many (the batch fails either way)."""
MAX_REASON_CHARS = 300
"""How much of an unexpected exception's text a line's error quotes."""
LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})


@dataclass
class Line:
    """One line of an input file, checked."""

    custom_id: str
    url: str
    body: bytes
    model: str


def dump_body(body: dict) -> bytes:
    """``body`` as JSON, in bytes of its own size: ``orjson.dumps`` keeps the capacity it grew to
    (16 KiB for a 2 KiB body), and a worker keeps every line of a few batches (``InputLines``)."""
    return memoryview(orjson.dumps(body)).tobytes()


def split_lines(content: bytes) -> list[bytes]:
    """The lines of a JSONL file (trailing blank lines dropped)."""
    return content.rstrip().split(b"\n") if content.strip() else []


def check_lines(
    content: bytes, live: list[InstanceInfo], limits: InputLimits, max_lines: int
) -> tuple[list[Line], str, list[BatchError]]:
    """``(lines, model, errors)``: every line checked; ``model`` is the one model all lines use
    ('' for several); ``errors`` name the lines (1-based) that fail, at most :data:`MAX_ERRORS`.
    Whatever a line raises is that line's error: an exception from outside pdserve's tree (a bug
    a line's content meets) is logged and reported as ``internal_error`` on its line, rather than
    crashing the validation job (which rq would fail and the reaper run again, on the same line)."""
    raw_lines = split_lines(content)
    if not raw_lines:
        return [], "", [BatchError(code="empty_file", message="the input file has no lines")]
    if len(raw_lines) > max_lines:
        message = f"the input file has {len(raw_lines)} lines; a batch may hold {max_lines}"
        return [], "", [BatchError(code="too_many_lines", message=message)]
    errors: list[BatchError] = []
    lines: list[Line] = []
    seen: set[str] = set()
    for number, raw in enumerate(raw_lines, 1):
        try:
            lines.append(check_line(raw, live, limits, seen))
        except InvalidRequestError as e:
            errors.append(BatchError(code=e.kind, message=e.message, param=e.param, line=number))
        except Exception as e:
            logger.exception("batch line %d could not be checked", number)
            reason = f"{type(e).__name__}: {e}"[:MAX_REASON_CHARS]
            message = f"the line could not be checked ({reason})"
            errors.append(BatchError(code=PdserveError.kind, message=message, line=number))
        if len(errors) >= MAX_ERRORS:
            break
    models = {line.model for line in lines}
    return lines, models.pop() if len(models) == 1 else "", errors


def check_line(raw: bytes, live: list[InstanceInfo], limits: InputLimits, seen: set[str]) -> Line:
    """One line as the online endpoint would check it. Unlike OpenAI, a line's ``url`` may be
    either endpoint (a file may mix chat and completions lines): it runs where it says."""
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise _line_error(f"the line is not valid JSON: {e}", None, "invalid_json_line") from None
    if not isinstance(item, dict):
        raise InvalidRequestError("the line must be a JSON object", None)
    unknown = sorted(set(item) - LINE_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown field {unknown[0]!r}", unknown[0])
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidRequestError("custom_id must be a non-empty string", "custom_id")
    if custom_id in seen:
        raise InvalidRequestError(f"custom_id {custom_id!r} appears more than once", "custom_id")
    seen.add(custom_id)
    if item.get("method") != "POST":
        raise InvalidRequestError("method must be 'POST'", "method")
    url = item.get("url")
    if url not in ENDPOINTS:
        raise InvalidRequestError(f"url must be one of {', '.join(ENDPOINTS)} (got {url!r})", "url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise InvalidRequestError("body must be a JSON object", "body")
    if body.get("stream"):
        raise InvalidRequestError("a batch line cannot stream", "body.stream")
    encoded = dump_body(body)
    parse = parse_chat if url == "/v1/chat/completions" else parse_completion
    try:
        parsed = parse(encoded, limits)
        model = resolve_model(live, parsed.model)
        parsed.check_vocab(vocab_size(live, model))
        parsed.check_length(model_len(live, model), limits.chars_per_token)
    except PdserveError as e:
        raise _line_error(e.message, f"body.{e.param}" if e.param else "body", e.kind) from None
    return Line(custom_id, url, encoded, model)


def read_lines(content: bytes, default_model: str) -> list[Line]:
    """The lines of a file validation accepted, read again (a worker that did not validate it)."""
    lines = []
    for item in map(orjson.loads, split_lines(content)):
        model = item["body"].get("model") or default_model
        lines.append(Line(item["custom_id"], item["url"], dump_body(item["body"]), model))
    return lines


def _line_error(message: str, param: str | None, code: str) -> InvalidRequestError:
    """A line's validation error whose ``kind`` is the batch error code (``model_not_found``…)."""
    error = InvalidRequestError(message, param)
    error.kind = code  # type: ignore[misc]  # an instance's code, not a new class per code
    return error
