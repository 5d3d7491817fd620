"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, answered by a live instance.

The router has no tokenizer (it never loads a model), so it sends a ``Tokenize`` message to one
non-draining instance of the model (the least loaded by this router's count) and waits for the one
delta that answers it in its outbox, as a generation's would arrive. Chat input is rendered by the
model's chat template exactly as for generation (messages and tools checked by the same parser).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import orjson

from pdserve.errors import InvalidRequestError, RequestTimeoutError
from pdserve.router.api.errors import NoCapacityError, UpstreamError
from pdserve.router.api.protocol import ParsedPrompt, message_dict
from pdserve.router.api.request_fields import validate_body
from pdserve.router.api.request_models import DetokenizeRequest, TokenizeRequest
from pdserve.router.api.tools import template_tools, tool_use_of
from pdserve.router.http.asgi import (
    ClientGone,
    Receive,
    Scope,
    Send,
    read_body,
    request_id,
    send_error,
    send_json,
)
from pdserve.router.http.state import RouterState
from pdserve.router.routing.selection import model_len, resolve_model
from pdserve.sampling_params import MAX_TOKEN_ID, shown
from pdserve.scheduler.inbox_messages import Tokenize
from pdserve.scheduler.outbox_messages import RequestDelta
from pdserve.scheduler.registration import InstanceInfo

TOKENIZE_TIMEOUT_S = 30.0


class TokenizeEndpoint:
    """The raw ASGI endpoint of one of the two paths (``detokenize`` picks which)."""

    def __init__(self, state: RouterState, detokenize: bool) -> None:
        self.state = state
        self.detokenize = detokenize

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope["headers"]
        rid = uuid.uuid4().hex
        client_rid = rid
        try:
            client_rid = request_id(headers, default=rid)
            body = await read_body(headers, receive, self.state.settings.max_body_bytes)
            msg, model = self._message(body, rid)
            live = await self.state.dispatcher.live.get()
            model = resolve_model(live, model)
            if not self.detokenize:
                self._check_length(msg, model_len(live, model))
            await self.state.admission.enter()  # an instance's engine thread does the work
            try:
                delta, max_model_len = await self._ask(live, model, msg)
            finally:
                self.state.admission.leave()
        except ClientGone:
            return
        except Exception as e:
            await send_error(send, e, client_rid)
            return
        if self.detokenize:
            out: dict[str, Any] = {"prompt": delta.text}
        else:
            out = {
                "count": len(delta.token_ids),
                "max_model_len": max_model_len,
                "tokens": delta.token_ids,
                "token_strs": None,
            }
        await send_json(send, 200, orjson.dumps(out), client_rid)

    def _check_length(self, msg: Tokenize, max_model_len: int | None) -> None:
        """A prompt that can never fit is refused here, as for generation (never tokenized)."""
        if max_model_len is not None:
            prompt = ParsedPrompt(text=msg.prompt, messages=msg.messages)
            prompt.check_length(max_model_len, self.state.settings.max_prompt_chars_per_token)

    def _message(self, body: bytes, rid: str) -> tuple[Tokenize, str | None]:
        """The Tokenize message a body asks for, and the model it names."""
        router_id, deadline = self.state.settings.router_id, time.time() + TOKENIZE_TIMEOUT_S
        if self.detokenize:
            detok = validate_body(DetokenizeRequest, body)
            if not detok.tokens:
                raise InvalidRequestError("tokens must not be empty", "tokens")
            bad = next((t for t in detok.tokens if not 0 <= t <= MAX_TOKEN_ID), None)
            if bad is not None:  # a worker's message parser refuses a number past 64 bits: a 502
                raise InvalidRequestError(f"tokens must be in 0..{MAX_TOKEN_ID}, got {shown(bad)}", "tokens")
            msg = Tokenize(request_id=rid, router_id=router_id, deadline=deadline, token_ids=detok.tokens)
            return msg, detok.model
        req = validate_body(TokenizeRequest, body)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
        if req.return_token_strs:
            raise InvalidRequestError(
                "return_token_strs is not supported: tokens come as ids only", "return_token_strs"
            )
        if req.prompt is not None:
            if req.tools is not None or req.add_generation_prompt is not None:
                field = "tools" if req.tools is not None else "add_generation_prompt"
                raise InvalidRequestError(f"{field} goes with messages, not prompt", field)
            msg = Tokenize(
                request_id=rid,
                router_id=router_id,
                deadline=deadline,
                prompt=req.prompt,
                add_special_tokens=req.add_special_tokens,
            )
            return msg, req.model
        if not req.messages:
            raise InvalidRequestError("messages must be a non-empty list", "messages")
        tools = None
        if req.tools:
            tool_use_of(req.tools, None, None)  # checks names and schemas: 400s name the field
            tools = template_tools(req.tools)
        msg = Tokenize(
            request_id=rid,
            router_id=router_id,
            deadline=deadline,
            messages=[message_dict(i, m) for i, m in enumerate(req.messages)],
            tools=tools,
            add_special_tokens=req.add_special_tokens,
            add_generation_prompt=req.add_generation_prompt is not False,
        )
        return msg, req.model

    async def _ask(self, live: list[InstanceInfo], model: str, msg: Tokenize) -> tuple[RequestDelta, int]:
        """Send ``msg`` to the least busy instance of ``model``; its answer and the model's length."""
        dispatcher = self.state.dispatcher
        candidates = [i for i in live if i.model == model and not i.draining]
        if not candidates:
            raise NoCapacityError(f"no instance of {model} can take requests")
        target = min(candidates, key=lambda i: (dispatcher.in_flight.get(i.id, 0), i.id))
        queue = dispatcher.reader.subscribe(msg.request_id)
        try:
            await dispatcher.sender.send(target.id, msg)
            try:
                delta = await asyncio.wait_for(queue.get(), TOKENIZE_TIMEOUT_S)
            except TimeoutError:
                raise RequestTimeoutError(
                    f"instance {target.id} did not answer within {TOKENIZE_TIMEOUT_S:g} s"
                ) from None
        finally:
            dispatcher.reader.unsubscribe(msg.request_id)
        if delta.error is not None:
            raise UpstreamError(delta.error)
        return delta, min(i.max_model_len for i in candidates)
