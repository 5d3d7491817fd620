"""One client choice routed over its attempts: pick a pair, send ONE message, relay its deltas, retry.

Every way a request can end arrives as a final :class:`RequestDelta` in its queue, so a
generation has a single loop: worker deltas (from the OutboxReader), a timer's ``timeout``, the
watcher's ``instance_unavailable``, a client disconnect, a Redis outage (``ANY_ATTEMPT``).

What it sends a worker per attempt and relies on in return is
:mod:`pdserve.router.routing.worker_contract`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.errors import (
    ClientDisconnectedError,
    ControlPlaneError,
    InstanceLostError,
    PdserveError,
    RequestTimeoutError,
    UnavailableError,
)
from pdserve.router.api.protocol import ParsedPrompt, ParsedRequest
from pdserve.router.routing.dispatch import Dispatcher
from pdserve.router.routing.policies import PolicyRequest
from pdserve.router.routing.prefix_lookup import PromptBlocks
from pdserve.router.routing.selection import Route
from pdserve.router.routing.shadow import Served
from pdserve.router.routing.worker_contract import attempt_message
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.inbox_messages import GenerateRequest
from pdserve.scheduler.outbox_messages import ANY_ATTEMPT, ErrorInfo, LogprobInfo, RequestDelta, Usage

logger = logging.getLogger(__name__)

SEND_RETRY_FIRST_S = 0.05
SEND_RETRY_MAX_S = 1.0


async def open_generations(
    dispatcher: Dispatcher, parsed: ParsedRequest, request_id: str, model: str, arrived: float | None = None
) -> list[RoutedGeneration]:
    """Start one generation per choice, in OpenAI's choice order (``n`` per prompt), each
    sending its message; on failure none stays open. ``arrived``: time.monotonic() of the
    request's arrival (its TTFT and its deadline count from there: time spent waiting for
    admission is part of the request's time)."""
    waited = max(0.0, time.monotonic() - arrived) if arrived is not None else 0.0
    deadline = dispatcher.clock() - waited + dispatcher.settings.request_timeout_s
    choices = parsed.choices()
    ids = [request_id] if len(choices) == 1 else [f"{request_id}-{i}" for i in range(len(choices))]
    gens: list[RoutedGeneration] = []
    try:
        for rid, (prompt, sampling) in zip(ids, choices):
            gen = RoutedGeneration(dispatcher, rid, parsed, prompt, sampling, model, deadline)
            if arrived is not None:
                gen.arrived = arrived
            gens.append(gen)
        if len(gens) == 1:
            await gens[0].start()
        else:
            await asyncio.gather(*(gen.start() for gen in gens))
    except BaseException:
        for gen in gens:
            gen.close("the request failed to start")
        raise
    return gens


class RoutedGeneration:
    """One choice of one client request, over its attempts. Use ``start``, then ``next`` until a
    final delta, then ``close`` (always: it releases counts and aborts unfinished work)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        request_id: str,
        parsed: ParsedRequest,
        prompt: ParsedPrompt,
        sampling: SamplingParams,
        model: str,
        deadline: float,
    ) -> None:
        self.dispatcher = dispatcher
        self.request_id = request_id
        self.parsed = parsed
        self.prompt = prompt
        shadow = dispatcher.shadow
        self.verify = shadow is not None and not parsed.echo_only and shadow.sampled()
        """Replayed on the aggregated path once answered, if served disaggregated (``--verify-fraction``)."""
        if self.verify and shadow is not None:
            sampling = shadow.prepare(sampling)
        self.sampling = sampling
        self._echo = parsed.echo
        """Still to prefix the first text with the prompt's (``echo``); done once over all attempts."""
        self.model = model
        # A GenerateRequest carries no add_special_tokens / add_generation_prompt: the worker
        # tokenizes it with the defaults (special tokens for a text prompt, a generation prompt).
        self.policy_request = PolicyRequest(
            model,
            prompt.text,
            prompt.token_ids,
            prompt.messages,
            tools=prompt.tools,
            add_special_tokens=None,
            add_generation_prompt=True,
            cache_salt=sampling.cache_salt,
        )
        """What the policies see of this choice (the same for all its attempts)."""
        self._prompt_tokens = len(prompt.token_ids) if prompt.token_ids is not None else None
        """The prompt's length in tokens where known (a token-id prompt, or one the router tokenized)."""
        self._max_tokens = None if parsed.fill_max_tokens else sampling.max_tokens
        """The client's ``max_tokens`` (None: it set none; the worker fills the model length in)."""
        self.deadline = deadline
        self.attempt = 0
        self.route: Route | None = None
        self.watched: tuple[str, ...] = ()
        """Instances whose death ends the current attempt (prefill only until the first token)."""
        self.has_tokens = False
        """The current attempt has produced tokens."""
        self.next_seq = 0
        """The ``seq`` the current attempt's next numbered delta must have (duplicates and gaps)."""
        self.last_delta_at = 0.0
        """time.monotonic() of the current attempt's latest token handed to the caller."""
        self.delivered: list[int] = []
        """Token ids handed to the caller over all attempts: where a migration resumes."""
        self.retries = 0
        self.migrations = 0
        self.arrived = time.monotonic()
        """When the client's request arrived (TTFT and end-to-end latency count from it)."""
        self.error: ErrorInfo | None = None
        """What ended the generation, if it failed."""
        self.finished = False
        self.succeeded = False
        self._exclude: set[str] = set()
        self._blamed: tuple[str, ...] = ()
        self._pending_retry: ErrorInfo | None = None
        self._held: list[str] = []
        self._end_reason = "the client went away"
        self._closed = False
        self._cancelled = False
        self._timers: list[asyncio.TimerHandle] = []
        self._first_token_timer: asyncio.TimerHandle | None = None
        self._blocks = PromptBlocks()  # the prompt's ids and block hashes, for prefix routing
        self._logprobs: list[LogprobInfo] = []  # the attempt's, when it is to be verified
        self.queue = dispatcher.reader.subscribe(request_id)  # the router's own id: never in use
        dispatcher.generations[request_id] = self

    async def start(self) -> None:
        """Send the first attempt (raises NoCapacityError/ControlPlaneError when it cannot be sent)."""
        delay = self.deadline - self.dispatcher.clock()
        self._timers.append(
            asyncio.get_running_loop().call_later(
                delay,
                self._expire,
                f"the request did not finish within {self.dispatcher.settings.request_timeout_s:g} s",
            )
        )
        route = await self._pick()
        d = self.dispatcher
        if d.metrics is not None:  # the demand arriving, for the planner (traffic.py)
            d.metrics.on_arrival(self._prompt_tokens, self._max_tokens)
        await self._submit(route)

    async def next(self) -> RequestDelta:
        """The next delta of the current attempt. Retryable failures are retried here, so the caller
        sees either tokens, a final delta, or (before any token) an exception from a failed retry."""
        while True:
            if self._pending_retry is not None:
                error, self._pending_retry = self._pending_retry, None
                try:
                    await self._retry(error)
                except PdserveError as e:
                    if not self.delivered:
                        self.error = ErrorInfo.of(e)
                        raise
                    logger.warning("request %s could not be migrated: %s", self.request_id, e)
                    self.finished = True
                    self.error = error
                    self._end_reason = f"{error.kind}: {error.message}"
                    return RequestDelta(
                        request_id=self.request_id, finish_reason="error", error=error, attempt=self.attempt
                    )
            delta = self._accept(await self.queue.get())
            if delta is not None:
                return delta

    def poll(self) -> RequestDelta | None:
        """The next delta if one is already queued, else None (never waits; lets a stream batch
        the deltas that arrived together into one write)."""
        while self._pending_retry is None and not self.queue.empty():
            delta = self._accept(self.queue.get_nowait())
            if delta is not None:
                return delta
        return None

    def _accept(self, delta: RequestDelta) -> RequestDelta | None:
        """Book-keep one queued delta; None when the caller should skip it (stale, empty, or retried)."""
        if delta.attempt != self.attempt and delta.attempt != ANY_ATTEMPT:
            return None  # from a superseded attempt
        if delta.seq is not None and delta.error is None:
            if delta.seq < self.next_seq:
                logger.debug("request %s: dropped repeated delta %d", self.request_id, delta.seq)
                return None  # a send Redis or the worker repeated
            if delta.seq > self.next_seq:
                delta = self._gap(delta.seq)
            else:
                self.next_seq += 1
        error = delta.error
        if error is not None:
            if self._may_retry(error):
                self._pending_retry = error
                return None
            self.finished = True
            self.error = error
            self._end_reason = f"{error.kind}: {error.message}"
            return delta
        if delta.finish_reason is not None:
            self.finished = self.succeeded = True
        elif not (delta.token_ids or delta.text):
            return None  # nothing a client could see
        if self.parsed.echo_only:
            _prompt_only(delta)
        if self._echo:
            self._echo = False
            echo = self.prompt.text if self.prompt.text is not None else delta.prompt_text
            if echo is None:
                logger.warning("request %s: the worker sent no prompt text to echo", self.request_id)
            delta.text = (echo or "") + delta.text
        if self.verify and delta.logprobs:
            self._logprobs += delta.logprobs
        now = time.monotonic()
        metrics = self.dispatcher.metrics
        if metrics is not None:
            metrics.on_delta(
                delta,
                not self.delivered and not self.has_tokens,
                self.arrived,
                self.last_delta_at,
                now,
                self._max_tokens,
            )
        self.delivered += delta.token_ids
        self.last_delta_at = now
        if not self.has_tokens:
            self._first_token()
        return delta

    def _gap(self, seq: int) -> RequestDelta:
        """A delta went missing (a send that was given up): this attempt's text cannot be trusted,
        so it fails retryably (a retry or a migration resumes from what the client has)."""
        where = "/".join(self.watched) or "its instance"
        logger.warning(
            "request %s attempt %d: delta %d came after %d; %s lost events",
            self.request_id,
            self.attempt,
            seq,
            self.next_seq,
            where,
        )
        self._blamed = self.watched
        error = UnavailableError(f"{where} lost events of this request (delta {self.next_seq} never came)")
        return RequestDelta.failure(self.request_id, error, retryable=True, attempt=self.attempt)

    def progress_at(self) -> float:
        """time.monotonic() of the worker's latest progress on the current attempt: when the router
        RECEIVED its latest delta (the watcher's stall check), so a client that reads slowly never
        looks like a stalled worker; ``inf`` once its final delta is here (nothing to wait for)."""
        latest = self.last_delta_at
        for attempt in (self.attempt, ANY_ATTEMPT):
            received_at, final = self.queue.received.get(attempt, (0.0, False))
            if final:
                return float("inf")
            latest = max(latest, received_at)
        return latest

    def lost(self, instance_id: str, why: str = "stopped responding") -> None:
        """The watcher saw ``instance_id``, which this attempt depends on, leave the live set or stall."""
        if self.finished or instance_id not in self.watched:
            return
        self.watched = ()  # report once per attempt
        self._blamed = (instance_id,)
        logger.warning("request %s: instance %s %s", self.request_id, instance_id, why)
        self._inject(InstanceLostError(f"instance {instance_id} {why}"), True, self.attempt)

    def cancel(self, reason: str) -> None:
        """End the generation from outside (client disconnect): its next delta is a final error."""
        if not self.finished and not self._closed and not self._cancelled:
            self._cancelled = True
            self._end_reason = reason
            self._inject(ClientDisconnectedError(reason), False, ANY_ATTEMPT)

    def close(self, reason: str | None = None) -> None:
        """Release everything; send Abort to the current instances unless the request finished well."""
        if self._closed:
            return
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        if self._first_token_timer is not None:
            self._first_token_timer.cancel()
        self._release_all()
        d = self.dispatcher
        if d.generations.get(self.request_id) is self:
            del d.generations[self.request_id]
        d.reader.unsubscribe(self.request_id)
        if not self.succeeded and self.route is not None:
            d.abort_soon(self.route, self.request_id, self.attempt, reason or self._end_reason)
        elif (
            self.verify and self.route is not None and self.route.prefill is not None and not self.migrations
        ):
            assert d.shadow is not None  # self.verify says so
            d.shadow.submit(
                Served(
                    self.request_id,
                    self.model,
                    self.prompt,
                    self.sampling,
                    self.parsed.fill_max_tokens,
                    self.route,
                    list(self.delivered),
                    self._logprobs,
                )
            )

    # -- attempts ----------------------------------------------------------------------------------

    async def _pick(self) -> Route:
        d = self.dispatcher
        live = await d.live.get()
        if self.delivered:  # a migration: continue on one instance after what the client has
            return d.selector.route_whole(live, self.policy_request, self._exclude)
        request = self.policy_request
        if d.selector.reads_prefix_index:
            request = await d.prefix.view(live, request, self._blocks)
            if request.num_tokens is not None:
                self._prompt_tokens = request.num_tokens
        route = d.route(live, request, self._exclude)
        d.prefix.learn(route, request, self._blocks)
        if d.metrics is not None:
            d.metrics.on_prefix(route, request)
        return route

    async def _submit(self, route: Route) -> None:
        d = self.dispatcher
        now = d.clock()
        msg = self._message(route, now)
        self.route, self.watched, self._blamed = route, route.instance_ids, ()
        if d.metrics is not None:
            d.metrics.on_route(route)
        for instance_id in route.instance_ids:
            d.hold(instance_id)
            self._held.append(instance_id)
        first_token_in = min(d.settings.first_token_timeout_s, self.deadline - now)
        self._first_token_timer = asyncio.get_running_loop().call_later(
            first_token_in, self._expire, f"no first token within {first_token_in:g} s", self.attempt
        )
        await self._send(route.entry.id, msg, now + first_token_in)

    async def _send(self, instance_id: str, msg: GenerateRequest, give_up_at: float) -> None:
        """Send the attempt's message. With ``--redis-wait-replicas`` a send that fails (Redis
        unreachable during a failover, or not yet replicated: a new primary has no replica until the
        Sentinels point one at it) is sent again with backoff until the attempt's first-token deadline
        (``give_up_at``, by ``clock``) or an outage the reader reports; the instance drops a message
        that comes twice (``(request_id, attempt)``). Without replica waits the first failure raises."""
        d = self.dispatcher
        delay = SEND_RETRY_FIRST_S
        while True:
            try:
                await d.sender.send(instance_id, msg)
                return
            except ControlPlaneError as e:
                if (
                    not d.settings.redis_wait_replicas
                    or d.stopping
                    or self._cancelled
                    or not d.reader.healthy
                    or d.clock() + delay >= give_up_at
                ):
                    raise
                if delay == SEND_RETRY_FIRST_S:
                    logger.warning(
                        "request %s: sending attempt %d to %s failed (%s); retrying",
                        self.request_id,
                        self.attempt,
                        instance_id,
                        e,
                    )
            await asyncio.sleep(delay)
            delay = min(2 * delay, SEND_RETRY_MAX_S)

    def _message(self, route: Route, now: float) -> GenerateRequest:
        return attempt_message(
            self.dispatcher,
            route,
            now,
            request_id=self.request_id,
            prompt=self.prompt,
            sampling=self.sampling,
            fill_max_tokens=self.parsed.fill_max_tokens,
            deadline=self.deadline,
            attempt=self.attempt,
            delivered=self.delivered,
            echo=self._echo,
        )

    def _may_retry(self, error: ErrorInfo) -> bool:
        """Retry before any token (up to retry_attempts), migrate after (up to max_migrations)."""
        d = self.dispatcher
        if not error.retryable or self._closed or self._cancelled or d.stopping or d.clock() >= self.deadline:
            return False
        if self.delivered:
            return self.migrations < d.settings.max_migrations
        return self.retries < d.settings.retry_attempts

    async def _retry(self, error: ErrorInfo) -> None:
        d = self.dispatcher
        route = self.route
        assert route is not None
        where = "/".join(route.instance_ids)
        migrating = bool(self.delivered)  # tokens reached the client: resume elsewhere, else start over
        if migrating:
            self.migrations += 1
            d.num_migrations += 1
        else:
            self.retries += 1
            d.num_retries += 1
        if d.metrics is not None and migrating:
            d.metrics.migrations.inc()
        elif d.metrics is not None:
            d.metrics.on_retry(error.kind)
        logger.warning(
            "request %s attempt %d on %s failed%s (%s: %s); %s",
            self.request_id,
            self.attempt,
            where,
            f" after {len(self.delivered)} tokens" if migrating else "",
            error.kind,
            error.message,
            "migrating it" if migrating else "retrying on a fresh pair",
        )
        self._exclude.update(self._blamed or route.instance_ids)
        d.live.invalidate()
        self._release_all()  # the failed attempt is no load on its instances: the pick must not count it
        next_route = await self._pick()  # raises when nothing can take it: this attempt stays current
        d.abort_soon(route, self.request_id, self.attempt, f"retried elsewhere after {error.kind}")
        if self._first_token_timer is not None:
            self._first_token_timer.cancel()
        self.attempt += 1
        self.has_tokens = False
        self.next_seq = 0
        old = self.queue
        d.reader.unsubscribe(self.request_id)  # a Redis outage may have dropped the subscription
        self.queue = d.reader.subscribe(self.request_id)
        while not old.empty():  # a timeout or disconnect queued behind the failure still counts
            delta = old.get_nowait()
            if delta.attempt == ANY_ATTEMPT and delta.error is not None and not delta.error.retryable:
                self.queue.put_nowait(delta)
        await self._submit(next_route)

    def _first_token(self) -> None:
        self.has_tokens = True
        if self._first_token_timer is not None:
            self._first_token_timer.cancel()
            self._first_token_timer = None
        route = self.route
        if route is not None and route.prefill is not None:
            self.watched = (route.decode.id,)  # prefill's part is done
            if route.prefill.id in self._held:
                self._held.remove(route.prefill.id)
                self.dispatcher.release(route.prefill.id)

    def _release_all(self) -> None:
        for instance_id in self._held:
            self.dispatcher.release(instance_id)
        self._held = []

    def _expire(self, message: str, attempt: int = ANY_ATTEMPT) -> None:
        if attempt not in (ANY_ATTEMPT, self.attempt):
            return
        self._inject(RequestTimeoutError(message), False, ANY_ATTEMPT)

    def _inject(self, error: PdserveError, retryable: bool, attempt: int) -> None:
        self.queue.put_nowait(
            RequestDelta.failure(self.request_id, error, retryable=retryable, attempt=attempt)
        )


def _prompt_only(delta: RequestDelta) -> None:
    """``echo`` with ``max_tokens`` 0: the one token the worker had to generate is left out (its
    text, id and logprob); the choice holds the prompt only and ends with ``length``."""
    delta.text, delta.token_ids = "", []
    if delta.logprobs is not None:
        delta.logprobs = []
    if delta.finish_reason is not None:
        delta.finish_reason = "length"
    if delta.usage is not None:
        delta.usage = Usage(prompt_tokens=delta.usage.prompt_tokens, completion_tokens=0)
