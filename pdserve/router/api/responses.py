"""OpenAI response bodies and SSE chunks, built as plain dicts and serialized with orjson.

No pydantic on the output path: a response is a handful of dict literals per delta.

A prompt's logprobs (on the first token's delta) appear in two shapes: completions with ``echo``
put them before the completion's in OpenAI's legacy ``logprobs`` (the first token's logprob and
alternatives null); vLLM's ``prompt_logprobs`` field, when asked, carries them per choice as a list
(null first) of ``{token id: {logprob, rank, decoded_token}}``. Streams send them in the first chunk.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from pdserve.router.api.tools import ToolStream, ToolUse
from pdserve.scheduler.outbox_messages import LogprobInfo, RequestDelta, Timing, Usage

DONE = b"data: [DONE]\n\n"


class Choice:
    """What a response accumulates for one choice, over all its attempts (a migrated one continues)."""

    __slots__ = (
        "finish_reason",
        "logprobs",
        "num_tokens",
        "prompt_logprobs",
        "texts",
        "timing",
        "token_ids",
        "usage",
    )

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.logprobs: list[LogprobInfo] = []
        self.prompt_logprobs: list[LogprobInfo] | None = None
        self.num_tokens = 0
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.timing: Timing | None = None

    def note(self, delta: RequestDelta) -> None:
        """Count a streamed delta (its text went to the client): tokens, finish, usage, timing."""
        self.num_tokens += len(delta.token_ids)
        self.timing = delta.timing or self.timing
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage

    def add(self, delta: RequestDelta) -> None:
        if delta.text:
            self.texts.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.token_ids.extend(delta.token_ids)
        self.num_tokens += len(delta.token_ids)
        self.timing = delta.timing or self.timing
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage


class ResponseBuilder:
    """Builds the bodies of one request (``kind`` = ``completion`` or ``chat``)."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        *,
        logprobs: bool,
        include_usage: bool,
        return_token_ids: bool = False,
        n: int = 1,
        tool_use: ToolUse | None = None,
        echo: bool = False,
        prompt_logprobs: bool = False,
    ) -> None:
        """``echo`` (completions): legacy ``logprobs`` start with the prompt's; ``prompt_logprobs``:
        each choice carries vLLM's ``prompt_logprobs``."""
        self.chat = kind == "chat"
        self.tool_use = tool_use  # chat with tools: the output is read as tool calls
        self._tool_streams: dict[int, ToolStream] = {}
        self.n = n  # choices per prompt: usage counts each prompt once
        self.return_token_ids = return_token_ids
        self.logprobs = logprobs
        self.echo = echo and not self.chat
        self.prompt_logprobs = prompt_logprobs
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.model = model
        self._text_offsets: dict[int, int] = {}
        chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        self._chunk_head = {"id": self.id, "object": chunk_object, "created": self.created, "model": model}

    # -- non-stream --------------------------------------------------------------------------------

    def response(self, choices: list[Choice]) -> bytes:
        out = []
        for index, c in enumerate(choices):
            text = "".join(c.texts)
            lp = self._logprobs(c.logprobs, 0, c.prompt_logprobs) if self.logprobs else None
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish = c.finish_reason
                if self.tool_use is not None:
                    message["content"], calls = self.tool_use.read(text)
                    if calls:
                        message["tool_calls"] = calls
                        finish = "tool_calls" if finish == "stop" else finish
                out.append({"index": index, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                out.append({"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
            if self.return_token_ids:
                out[-1]["token_ids"] = c.token_ids
            if self.prompt_logprobs:
                out[-1]["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_logprobs)
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": usage(choices, self.n),
        }
        if choices and choices[0].timing is not None:
            body["timing"] = timing(choices[0].timing)
        return orjson.dumps(body)

    # -- stream ------------------------------------------------------------------------------------

    def role_chunk(self, index: int) -> bytes:
        """Chat streams open each choice with the assistant role (OpenAI's first chunk)."""
        return self._chunk(
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def delta_chunk(self, index: int, delta: RequestDelta, choice_timing: Timing | None = None) -> bytes:
        """One chunk per delta; the last one carries ``finish_reason`` (and the choice's ``timing``)."""
        lp = None
        prompt = delta.prompt_logprobs
        if self.logprobs and (delta.logprobs or (self.echo and prompt)):
            lp = self._logprobs(delta.logprobs or [], self._text_offsets.get(index, 0), prompt)
        if not self.chat:
            if self.logprobs:
                self._text_offsets[index] = self._text_offsets.get(index, 0) + len(delta.text)
            choice = {
                "index": index,
                "text": delta.text,
                "logprobs": lp,
                "finish_reason": delta.finish_reason,
            }
        elif self.tool_use is not None:
            stream = self._tool_streams.get(index) or self._tool_streams.setdefault(
                index, self.tool_use.stream()
            )
            fields = stream.feed(delta.text, delta.finish_reason is not None)
            finish = delta.finish_reason
            if finish is None and not fields and lp is None and not self.return_token_ids and not prompt:
                return b""  # held back (a call being read): nothing to say yet
            if finish == "stop" and stream.called:
                finish = "tool_calls"
            choice = {"index": index, "delta": fields, "logprobs": lp, "finish_reason": finish}
        else:
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            choice = {"index": index, "delta": content, "logprobs": lp, "finish_reason": delta.finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        if self.prompt_logprobs and prompt is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt)
        extra = (
            {"timing": timing(choice_timing)} if delta.finish_reason is not None and choice_timing else None
        )
        return self._chunk(choice, extra)

    def usage_chunk(self, choices: list[Choice]) -> bytes:
        """The extra last chunk of ``stream_options.include_usage``: no choices, the request's usage."""
        return (
            b"data: "
            + orjson.dumps({**self._chunk_head, "choices": [], "usage": usage(choices, self.n)})
            + b"\n\n"
        )

    def _chunk(self, choice: dict[str, Any], extra: dict[str, Any] | None = None) -> bytes:
        body = {**self._chunk_head, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        if extra:
            body |= extra
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _logprobs(
        self, items: list[LogprobInfo], offset: int, prompt: list[LogprobInfo] | None = None
    ) -> dict[str, Any]:
        """``items``' logprobs; with ``echo`` (legacy), ``prompt``'s first. ``text_offset``: from
        ``offset``, the lengths of the tokens' texts added up."""
        if self.chat:
            return {"content": [_chat_logprob(t) for t in items]}
        if self.echo and prompt:
            items = prompt + items
        offsets = []
        for t in items:
            offsets.append(offset)
            offset += len(t.token)
        return {
            "tokens": [t.token for t in items],
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [
                None if t.logprob is None else {top.token: top.logprob for top in t.top} for t in items
            ],
            "text_offset": offsets,
        }


def vllm_prompt_logprobs(items: list[LogprobInfo] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (null for the first, which has none), its own
    and its alternatives' ``{logprob, rank, decoded_token}`` by token id (a string, as JSON keys are)."""
    if items is None:
        return None
    out: list[dict[str, Any] | None] = []
    for t in items:
        if t.logprob is None:
            out.append(None)
            continue
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.token}}
        for rank, top in enumerate(t.top, 1):
            entry.setdefault(
                str(top.token_id), {"logprob": top.logprob, "rank": rank, "decoded_token": top.token}
            )
        out.append(entry)
    return out


def _chat_logprob(t: LogprobInfo) -> dict[str, Any]:
    return {
        "token": t.token,
        "logprob": t.logprob,
        "bytes": list(t.token.encode()),
        "top_logprobs": [
            {"token": top.token, "logprob": top.logprob, "bytes": list(top.token.encode())} for top in t.top
        ],
    }


def timing(t: Timing) -> dict[str, float | None]:
    """pdserve's extra ``timing`` field (docs/design.md): the server's own time to the first token,
    and its phases (engine queue, prefill, splitwise KV transfer; null where not measured)."""
    return {
        "s_ttft_ms": _ms(t.s_ttft_s),
        "queue_ms": _ms(t.queue_s),
        "prefill_ms": _ms(None if t.queue_s is None else t.s_ttft_s - t.queue_s),
        "kv_transfer_ms": _ms(t.kv_transfer_s),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def usage(choices: list[Choice], n: int = 1) -> dict[str, Any]:
    """OpenAI ``usage`` from the workers' final Usage: each prompt counted once (choices ``p * n``
    to ``p * n + n - 1`` share prompt ``p``), completions summed; ``cached_tokens``: the prompt
    tokens the instances took from their prefix caches (per prompt, as its prompt tokens).

    A final delta without usage (should not happen) counts the tokens the router saw.
    """
    prompt = completion = cached = 0
    for i, c in enumerate(choices):
        if c.usage is not None:
            completion += c.usage.completion_tokens
            if i % n == 0:
                prompt += c.usage.prompt_tokens
                cached += c.usage.cached_tokens
        else:
            completion += c.num_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
