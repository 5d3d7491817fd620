"""The generation endpoints as raw ASGI apps: the hot path skips FastAPI's parameter machinery.

A request is read (size-limited), validated, routed and sent; then either collected into one
JSON body or relayed as SSE. A stream starts only after the first delta of every choice has
arrived, so a failure before any token is a normal JSON error with the right status; a failure
later ends the stream with an error event and ``[DONE]``. A client that goes away cancels its
generations, which sends Abort to their instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from pdserve.errors import PdserveError
from pdserve.router.api.errors import UpstreamError, error_event, error_status
from pdserve.router.api.input_limits import InputLimits
from pdserve.router.api.protocol import ParsedRequest
from pdserve.router.api.responses import DONE, Choice, ResponseBuilder
from pdserve.router.api.responses import timing as timing_fields
from pdserve.router.http.asgi import (
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    read_body,
    request_id,
    send_error,
    send_json,
)
from pdserve.router.http.state import RouterState
from pdserve.router.http.tenants import tenant_of, tenant_salt
from pdserve.router.routing.generation import RoutedGeneration, open_generations
from pdserve.router.routing.selection import model_len, resolve_model, vocab_size
from pdserve.scheduler.outbox_messages import ErrorInfo, RequestDelta, Timing

logger = logging.getLogger(__name__)

DISCONNECT_WATCH_AFTER_S = 0.2
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def salt_by_tenant(parsed: ParsedRequest, tenant: str) -> None:
    """Give each choice the prefix-cache salt of ``tenant`` (``tenants.tenant_salt``): a keyed
    tenant's cached blocks are found only by its own requests, by the instances' prefix caches and
    by prefix routing alike (both hash with ``sampling.cache_salt``). The anonymous tenant keeps
    the client's own salt."""
    if not tenant:
        return
    for sampling in {id(s): s for s in parsed.samplings}.values():
        sampling.cache_salt = tenant_salt(tenant, sampling.cache_salt)


class GenerateEndpoint:
    """``POST /v1/completions`` (``parse`` = parse_completion) or ``/v1/chat/completions``."""

    def __init__(
        self, state: RouterState, parse: Callable[[bytes, InputLimits], ParsedRequest], path: str = ""
    ) -> None:
        self.state = state
        self.parse = parse
        self.path = path  # the requests_total label
        self.limits = InputLimits.of(state.settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        headers = scope["headers"]
        # The router's own id routes the tokens; the client's x-request-id is only echoed (and
        # logged), so the same id sent to two routers, or twice, never mixes two requests up.
        rid, client_rid = uuid.uuid4().hex, ""
        try:
            client_rid = request_id(headers, default=rid)
            parsed = self.parse(
                await read_body(headers, receive, self.state.settings.max_body_bytes), self.limits
            )
            if not self.state.settings.shared_prefix_cache:
                salt_by_tenant(parsed, tenant_of(scope))
            dispatcher = self.state.dispatcher
            live = await dispatcher.live.get()
            model = resolve_model(live, parsed.model)
            parsed.check_vocab(vocab_size(live, model))
            parsed.check_length(model_len(live, model), self.limits.chars_per_token)
            cost = len(parsed.prompts) * parsed.n  # admission counts choices
            await self.state.admission.enter(cost, "prompt" if len(parsed.prompts) > 1 else "n")
        except ClientGone:
            if self.state.metrics is not None:
                self.state.metrics.on_request(self.path, "", 499, "client_disconnected")
            return
        except Exception as e:
            await send_error(send, e, client_rid or rid)
            if self.state.metrics is not None:
                self.state.metrics.on_request(self.path, "", error_status(e)[0], error_kind(e))
            return
        metrics = self.state.metrics
        if metrics is None:
            try:
                await self._serve(send, receive, parsed, rid, client_rid, model, arrived)
            finally:
                self.state.admission.leave(cost)
            return
        metrics.active += 1
        status = StatusSend(send)
        try:
            error = await self._serve(status, receive, parsed, rid, client_rid, model, arrived)
        finally:
            metrics.active -= 1
            self.state.admission.leave(cost)
        metrics.on_request(self.path, model, status.status, error)

    async def _serve(
        self,
        send: Send,
        receive: Receive,
        parsed: ParsedRequest,
        rid: str,
        client_rid: str,
        model: str,
        arrived: float | None = None,
    ) -> str:
        """Serve an admitted request; returns the kind of the error that ended it ('' for none)."""
        try:
            gens = await open_generations(self.state.dispatcher, parsed, rid, model, arrived)
        except Exception as e:
            await send_error(send, e, client_rid)
            return error_kind(e)
        if client_rid != rid:
            logger.debug("x-request-id %s is request %s", client_rid, rid)
        builder = ResponseBuilder(
            parsed.kind,
            rid,
            model,
            logprobs=parsed.logprobs,
            return_token_ids=parsed.return_token_ids,
            include_usage=parsed.include_usage,
            n=parsed.n,
            tool_use=parsed.tool_use,
            echo=parsed.echo,
            prompt_logprobs=parsed.prompt_logprobs,
        )
        watch = DisconnectWatch(receive, gens)
        try:
            if parsed.stream:
                await _stream(send, client_rid, gens, builder)
            else:
                await _complete(send, client_rid, gens, builder)
        except Exception as e:  # a bug; this endpoint runs outside FastAPI's error middleware
            logger.exception("request %s (x-request-id %s) failed", rid, client_rid)
            with contextlib.suppress(Exception):  # fails if the response had started
                await send_error(send, e, client_rid)
        finally:
            watch.stop()
            for gen in gens:
                gen.close()
        return next((gen.error.kind for gen in gens if gen.error is not None), "")


def error_kind(exc: BaseException) -> str:
    """The wire kind of an exception (the requests_total label)."""
    if isinstance(exc, UpstreamError):
        return exc.info.kind
    return exc.kind if isinstance(exc, PdserveError) else "internal_error"


class StatusSend:
    """``send`` that remembers the response's status (499: none was sent, the client left first)."""

    __slots__ = ("send", "status")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status = 499

    def __call__(self, message: Message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        return self.send(message)


class DisconnectWatch:
    """Cancels the generations when the client disconnects (their instances then get Abort).

    Listening needs a task blocked in ``receive()``; it is started only once a request has run
    for :data:`DISCONNECT_WATCH_AFTER_S`, so short requests (most of them) pay for a timer only.
    """

    __slots__ = ("_gens", "_receive", "_task", "_timer")

    def __init__(self, receive: Receive, gens: list[RoutedGeneration]) -> None:
        self._receive = receive
        self._gens = gens
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(DISCONNECT_WATCH_AFTER_S, self._start)

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()

    def _start(self) -> None:
        self._task = asyncio.ensure_future(self._listen())

    async def _listen(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        for gen in self._gens:
            gen.cancel("the client disconnected")


async def _collect(gen: RoutedGeneration) -> Choice:
    choice = Choice()
    while True:
        delta = await gen.next()
        if delta.error is not None:
            raise UpstreamError(delta.error)
        choice.add(delta)
        if delta.finish_reason is not None:
            return choice


async def _complete(send: Send, rid: str, gens: list[RoutedGeneration], builder: ResponseBuilder) -> None:
    try:
        if len(gens) == 1:
            choices = [await _collect(gens[0])]
        else:
            choices = await _gather([_collect(gen) for gen in gens])
    except Exception as e:
        await send_error(send, e, rid)
        return
    headers = route_headers(gens[0]) | (timing_headers(choices[0].timing) or {})
    await send_json(send, 200, builder.response(choices), rid, headers)


def route_headers(gen: RoutedGeneration) -> dict[str, str]:
    """Which instances served the request and how (``x-pdserve-mode``: splitwise, mixed, aggregated)."""
    return gen.route.headers() if gen.route is not None else {}


def timing_headers(timing: Timing | None) -> dict[str, str] | None:
    """The ``timing`` field as headers too (non-stream responses: a stream's headers go before it)."""
    if timing is None:
        return None
    return {
        f"x-pdserve-{name[:-3].replace('_', '-')}-ms": f"{ms:.3f}"
        for name, ms in timing_fields(timing).items()
        if ms is not None
    }


async def _gather(coros: list[Awaitable[Choice]]) -> list[Choice]:
    """gather() that cancels the others when one fails (each waits on its queue otherwise forever)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def _stream(send: Send, rid: str, gens: list[RoutedGeneration], builder: ResponseBuilder) -> None:
    try:
        firsts = [await gen.next() for gen in gens]
    except Exception as e:
        await send_error(send, e, rid)
        return
    failed = next((d.error for d in firsts if d.error is not None), None)
    if failed is not None:
        await send_error(send, UpstreamError(failed), rid)
        return
    headers = [*_SSE_HEADERS, (b"x-request-id", rid.encode())]
    headers += [(k.encode(), v.encode()) for k, v in route_headers(gens[0]).items()]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    choices = [Choice() for _ in gens]
    out = bytearray()
    if builder.chat:
        for i in range(len(gens)):
            out += builder.role_chunk(i)
    error: ErrorInfo | Exception | None
    try:
        for i, delta in enumerate(firsts):
            choices[i].note(delta)
            out += builder.delta_chunk(i, delta, choices[i].timing)
        if len(gens) == 1:
            error = await _relay_one(send, out, gens[0], choices[0], builder)
        else:
            error = await _relay_many(send, out, gens, choices, builder)
    except Exception as e:  # a bug: still end the stream properly
        logger.exception("request %s: stream failed", rid)
        error = e
    if error is not None:
        out += error_event(error)  # never a silent cut: the client learns why the stream ended
    elif builder.include_usage:
        out += builder.usage_chunk(choices)
    await send({"type": "http.response.body", "body": bytes(out + DONE), "more_body": False})


async def _relay_one(
    send: Send, out: bytearray, gen: RoutedGeneration, choice: Choice, builder: ResponseBuilder
) -> ErrorInfo | None:
    """Relay one choice until its final delta; returns the ErrorInfo that ended it, if any. What is
    left in ``out`` (the last chunks) goes with the stream's end, in one write."""
    delta = None
    while not gen.finished:
        delta = gen.poll() if out else None
        if delta is None:
            if out:
                await send({"type": "http.response.body", "body": bytes(out), "more_body": True})
                out.clear()
            delta = await gen.next()
        if delta.error is not None:
            break
        choice.note(delta)
        out += builder.delta_chunk(0, delta, choice.timing)
    return delta.error if delta is not None and delta.error is not None else None


async def _relay_many(
    send: Send, out: bytearray, gens: list[RoutedGeneration], choices: list[Choice], builder: ResponseBuilder
) -> ErrorInfo | Exception | None:
    """Relay n choices through one queue; the first error ends the whole stream."""
    merged: asyncio.Queue[tuple[int, RequestDelta | Exception]] = asyncio.Queue()

    async def pump(index: int, gen: RoutedGeneration) -> None:
        try:
            while True:
                delta = await gen.next()
                merged.put_nowait((index, delta))
                if delta.is_final:
                    return
        except Exception as e:
            merged.put_nowait((index, e))

    pumps = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(gens) if not gen.finished]
    try:
        await send({"type": "http.response.body", "body": bytes(out), "more_body": True})
        out.clear()
        remaining = len(pumps)
        while remaining:
            index, delta = await merged.get()
            if isinstance(delta, Exception):
                return delta
            if delta.error is not None:
                return delta.error
            choices[index].note(delta)
            chunk = builder.delta_chunk(index, delta, choices[index].timing)
            if chunk:  # empty: a tool call being read is held back
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            remaining -= delta.is_final
        return None
    finally:
        for task in pumps:
            task.cancel()
