"""What the router sends a worker per attempt, and what it relies on from workers in return.

One choice's attempts (:mod:`pdserve.router.routing.generation`) each send the message
:func:`attempt_message` builds; the rest of this contract is what their loop counts on:

- Per attempt the router XADDs exactly ONE :class:`GenerateRequest`: to the prefill instance's
  inbox with ``disaggregate_info`` (splitwise), or to a mixed/decode instance's inbox without it
  (that instance serves the whole request, prefill included). ``request_id`` is the router's
  own uuid4 hex (``<id>-<i>`` per choice when a request has several: ``i = prompt * n + choice``),
  never the client's ``x-request-id``; ``router_id`` names the
  outbox to publish to; exactly one of ``prompt``/``prompt_token_ids``/``messages`` is set (messages
  are ``{role, content: str[, name]}``; the worker tokenizes and applies the chat template);
  ``echo`` asks for the prompt's text in the first token's delta (``prompt_text``), and
  ``sampling.prompt_logprobs`` for the prompt's logprobs there (``prompt_logprobs``; in splitwise
  the prefill instance computes them);
  ``sampling`` is the choice's validated SamplingParams, and ``fill_max_tokens`` means "up to the
  model length minus the prompt length"; ``deadline`` ends the whole request (unix s); ``attempt``
  counts from 0; ``fetch`` names a peer the entry instance takes the prompt's prefix from before it
  computes the rest (``prefix_cache`` priced it below the recompute; a fetch that fails is computed).
- Deltas for the request go to the router's outbox with the request's ``attempt``. The router
  relays the current attempt's deltas in stream order, whoever sent them: in splitwise, prefill
  publishes the first token, then decode publishes the rest. ``seq`` numbers an attempt's deltas
  0, 1, 2, ... across both: a repeat (a retried XADD) is dropped, a gap fails the attempt
  (retryable). ``text`` is the new text (the pieces
  concatenate to the completion); ``logprobs`` has one entry per token when asked. The final
  delta has ``finish_reason`` and ``usage`` (the OpenAI usage comes from it). A failure is a final
  ``RequestDelta.failure`` with an HTTP-like ``code``; ``retryable=True`` (another instance may
  succeed, e.g. no KV blocks, or the instance died) lets the router re-submit with ``attempt + 1``:
  to a fresh pair before any token, or, once tokens were delivered, to ONE mixed/decode instance
  with ``resume_token_ids`` (a migration: it continues after them). Empty non-final deltas are
  ignored; ``ANY_ATTEMPT`` applies to the current one.
- :class:`Abort` ``{request_id, reason, attempt}`` goes to every instance of an attempt the router
  gives up on (client gone, deadline, instance gone, before a retry); it may name a request the
  instance no longer (or never) had.
"""

from __future__ import annotations

from pdserve.router.api.protocol import ParsedPrompt
from pdserve.router.routing.dispatch import Dispatcher
from pdserve.router.routing.selection import Route
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.inbox_messages import DisaggregateInfo, FetchHint, GenerateRequest, PhaseDeadlines


def attempt_message(
    d: Dispatcher,
    route: Route,
    now: float,
    *,
    request_id: str,
    prompt: ParsedPrompt,
    sampling: SamplingParams,
    fill_max_tokens: bool,
    deadline: float,
    attempt: int,
    delivered: list[int],
    echo: bool,
) -> GenerateRequest:
    """The ONE message of attempt ``attempt`` of choice ``request_id`` on ``route``: to the prefill
    instance with ``disaggregate_info`` (each phase's deadline by ``now``), else to the whole
    request's instance; a migration (``delivered`` tokens) resumes after them."""
    info = None
    if route.prefill is not None:
        s = d.settings
        deadlines = PhaseDeadlines(
            reserve=min(now + s.reserve_timeout_s, deadline),
            transfer=min(now + (s.transfer_timeout_s or s.first_token_timeout_s), deadline),
            first_token=min(now + s.first_token_timeout_s, deadline),
        )
        info = DisaggregateInfo(
            request_id=request_id,
            router_id=d.router_id,
            prefill=d.peer(route.prefill),
            decode=d.peer(route.decode),
            protocol=route.protocol or "",
            deadlines=deadlines,
        )
    plan, fetch = route.fetch, None
    if plan is not None and not delivered:  # the entry instance fetches the prefix from a peer first
        fetch = FetchHint(
            peer=d.peer(plan.peer), protocol=plan.protocol, blocks=plan.blocks, expect_s=plan.expect_s
        )
    # fill_max_tokens when the client gave no max_tokens (chat): the worker then fills in
    # "model length - prompt length", which only it knows after tokenizing.
    return GenerateRequest(
        request_id=request_id,
        router_id=d.router_id,
        prompt=prompt.text,
        prompt_token_ids=prompt.token_ids,
        messages=prompt.messages,
        tools=prompt.tools,
        sampling=sampling,
        fill_max_tokens=fill_max_tokens or None,
        deadline=deadline,
        attempt=attempt,
        disaggregate_info=info,
        resume_token_ids=list(delivered) or None,
        echo=True if echo and prompt.token_ids is not None else None,
        background=True if d.settings.background else None,
        fetch=fetch,
    )
