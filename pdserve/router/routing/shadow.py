"""Shadow verification (``--verify-fraction``): a sampled share of disaggregated requests is
replayed, once its client has the answer, on the aggregated path, and the two are compared.

A splitwise answer is only worth having if it is the answer one engine would give; the KV digests
(``cache_transfer.checksum``) prove the bytes arrived as they were read, but not that they were
computed, landed or read right. So a sampled request, after its last delta, is sent again as a
whole request to a mixed instance of the same model (or, with none, to the decode instance that
served it, which then prefills it itself) at low priority (``background``, after online work),
with the same prompt, sampling and seed and a random ``cache_salt`` (so nothing comes from a
prefix cache: the replay recomputes the prompt). Its tokens and logprobs are compared with the
client's: bitwise where every instance involved registers ``kv.batch_invariant`` (the CPU engine
under ``MKL_CBWR=...,STRICT``), otherwise within :data:`LOGPROB_TOLERANCE`, a first differing
token counting as a near-tie (no mismatch) when the replay's own logprobs put both tokens that
close. A mismatch is logged with the first divergent position and the instances, counted
(``pdserve_verify_total{outcome}``) and shown by ``pdserve status`` (the router's registration
carries :class:`VerifyInfo`). The client's answer never waits: the replay starts after it ended.

A sampled request is sent with a seed when its draws would otherwise be random (so the replay draws
the same; the client asked for none, any seed is as good) and with logprobs when the client asked
for none (the router then leaves them out of the response, as it does any field not asked for).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import secrets
from collections.abc import Callable
from typing import Protocol

from pdserve.router.api.protocol import ParsedPrompt
from pdserve.router.http.metrics import RouterMetrics
from pdserve.router.http.settings import RouterSettings
from pdserve.router.routing.selection import Route, model_mismatch
from pdserve.router.routing.sender import InboxSender
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.inbox_messages import Abort, GenerateRequest
from pdserve.scheduler.outbox_messages import LogprobInfo
from pdserve.scheduler.outbox_reader import OutboxReader
from pdserve.scheduler.registration import InstanceInfo, VerifyInfo
from pdserve.scheduler.registry import LiveSetCache

logger = logging.getLogger(__name__)

MAX_REPLAYS = 16
"""Replays one router runs at once; a request sampled beyond is not replayed (``skipped``)."""
VERIFY_LOGPROBS = 2
"""Alternatives a replay asks for per token (the near-tie check needs the runner-up)."""
LOGPROB_TOLERANCE = 0.05
"""Nats two logprobs may differ by where some instance is not batch-invariant (bf16 on a GPU, the
CPU engine without ``MKL_CBWR=...,STRICT``): its numbers depend on the batch in their last bits."""


class ReplayHost(Protocol):
    """What a replay needs of the router's dispatcher (the dispatcher is one)."""

    reader: OutboxReader
    sender: InboxSender
    live: LiveSetCache[InstanceInfo]
    settings: RouterSettings
    router_id: str
    metrics: RouterMetrics | None
    in_flight: dict[str, int]
    clock: Callable[[], float]

    def hold(self, instance_id: str) -> None: ...
    def release(self, instance_id: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Served:
    """A disaggregated request as its client got it: what the replay sends, and what it compares."""

    request_id: str
    model: str
    prompt: ParsedPrompt
    sampling: SamplingParams
    fill_max_tokens: bool
    route: Route
    token_ids: list[int]
    logprobs: list[LogprobInfo]


class ShadowVerifier:
    def __init__(self, host: ReplayHost, fraction: float, rng: random.Random | None = None) -> None:
        self.host = host
        self.fraction = fraction
        self.rng = rng or random.Random()
        self.info = VerifyInfo()
        self._tasks: set[asyncio.Task[None]] = set()

    def sampled(self) -> bool:
        """Whether the next request is one to verify."""
        return self.rng.random() < self.fraction

    def prepare(self, sampling: SamplingParams) -> SamplingParams:
        """A sampled request's sampling as it is sent: seeded where its draws would be random, and
        asking for logprobs where the client asked none (the response leaves them out)."""
        changes: dict[str, object] = {}
        if not sampling.is_greedy and sampling.seed is None:
            changes["seed"] = self.rng.getrandbits(62)
        if sampling.logprobs is None:
            changes["logprobs"] = 0
        return sampling.replace(**changes) if changes else sampling

    def submit(self, served: Served) -> None:
        """Replay ``served`` in the background (not at all when :data:`MAX_REPLAYS` already run)."""
        if len(self._tasks) >= MAX_REPLAYS:
            self._count("skipped")
            return
        task = asyncio.get_running_loop().create_task(
            self._verify(served), name=f"verify-{served.request_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _verify(self, served: Served) -> None:
        try:
            target = await self._target(served)
            if target is None:
                self._count("skipped")
                return
            replayed = await self._replay(served, target)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("shadow verification of %s failed", served.request_id)
            self._count("failed")
            return
        if replayed is None:
            self._count("failed")
            return
        involved = [served.route.decode, target, *([served.route.prefill] if served.route.prefill else [])]
        exact = all(info.kv.batch_invariant for info in involved)
        tokens, logprobs = replayed
        found = divergence(served.token_ids, served.logprobs, tokens, logprobs, exact)
        if found is None:
            self._count("match")
            return
        route = served.route
        where = f"{route.prefill.id if route.prefill else '?'} -> {route.decode.id}"
        detail = (
            f"request {served.request_id} ({where}) vs its replay on {target.id}: {found} "
            f"({'bitwise' if exact else f'tolerance {LOGPROB_TOLERANCE}'})"
        )
        logger.error("shadow verification mismatch: %s", detail)
        self.info.last_mismatch = detail
        self._count("mismatch")

    async def _target(self, served: Served) -> InstanceInfo | None:
        """A mixed instance of the same model (the least busy here), else the decode instance that
        served the request, if still live; None when neither can take it."""
        ref = served.route.decode
        live = await self.host.live.get()
        same = [
            info
            for info in live
            if info.model == served.model
            and not info.draining
            and info.role != "prefill"
            and not model_mismatch(ref, info)
            and (info.kv.weights or "f32", info.kv.device, info.kv.dtype)
            == (ref.kv.weights or "f32", ref.kv.device, ref.kv.dtype)
        ]
        mixed = [info for info in same if info.role == "mixed"]
        if mixed:
            return min(mixed, key=lambda info: self.host.in_flight.get(info.id, 0))
        return next((info for info in same if info.id == ref.id), None)

    async def _replay(
        self, served: Served, target: InstanceInfo
    ) -> tuple[list[int], list[LogprobInfo]] | None:
        """The replay's tokens and logprobs; None when it failed or timed out (no verdict)."""
        host, prompt = self.host, served.prompt
        request_id = f"verify-{secrets.token_hex(12)}"
        alternatives = max(VERIFY_LOGPROBS, served.sampling.logprobs or 0)
        sampling = served.sampling.replace(cache_salt=secrets.token_hex(8), logprobs=alternatives)
        timeout_s = host.settings.request_timeout_s
        msg = GenerateRequest(
            request_id=request_id,
            router_id=host.router_id,
            prompt=prompt.text,
            prompt_token_ids=prompt.token_ids,
            messages=prompt.messages,
            tools=prompt.tools,
            sampling=sampling,
            fill_max_tokens=served.fill_max_tokens or None,
            deadline=host.clock() + timeout_s,
            background=True,
        )
        queue = host.reader.subscribe(request_id)
        host.hold(target.id)
        tokens: list[int] = []
        logprobs: list[LogprobInfo] = []
        finished = False
        try:
            await host.sender.send(target.id, msg)
            next_seq = 0
            async with asyncio.timeout(timeout_s):
                while not finished:
                    delta = await queue.get()
                    if delta.error is not None:
                        logger.warning(
                            "replay of %s on %s failed: %s", served.request_id, target.id, delta.error.message
                        )
                        return None
                    if delta.seq is not None:
                        if delta.seq < next_seq:
                            continue  # a repeated send
                        if delta.seq > next_seq:
                            return None  # lost events: no verdict
                        next_seq += 1
                    tokens += delta.token_ids
                    logprobs += delta.logprobs or []
                    finished = delta.finish_reason is not None
        except TimeoutError:
            logger.warning("replay of %s on %s timed out", served.request_id, target.id)
            return None
        finally:
            host.release(target.id)
            host.reader.unsubscribe(request_id)
            if not finished:
                host.sender.send_nowait(
                    target.id, Abort(request_id=request_id, reason="replay ended", attempt=0)
                )
        return tokens, logprobs

    def _count(self, outcome: str) -> None:
        if outcome in ("match", "mismatch"):
            self.info.checked += 1
        if outcome == "mismatch":
            self.info.mismatches += 1
        if self.host.metrics is not None:
            self.host.metrics.on_verify(outcome)


def divergence(
    tokens: list[int],
    logprobs: list[LogprobInfo],
    replayed: list[int],
    replayed_logprobs: list[LogprobInfo],
    exact: bool,
) -> str | None:
    """Where a replay differs from the served request (a description), or None when it agrees:
    ``exact``, every token and every chosen token's logprob equal; otherwise the logprobs within
    :data:`LOGPROB_TOLERANCE`, and tokens up to the first that differs, which is no mismatch when
    the replay's logprobs show a near-tie (both tokens within the tolerance): past it the two
    continuations may legitimately part."""
    for k in range(max(len(tokens), len(replayed))):
        a = tokens[k] if k < len(tokens) else None
        b = replayed[k] if k < len(replayed) else None
        if a != b:
            if not exact and (a is None or b is None or _near_tie(replayed_logprobs, k, a)):
                return None
            return f"token {k}: {a} served, {b} replayed"
        if k < len(logprobs) and k < len(replayed_logprobs):
            la, lb = logprobs[k].logprob, replayed_logprobs[k].logprob
            if la is None or lb is None:
                continue
            differ = la != lb if exact else abs(la - lb) > LOGPROB_TOLERANCE
            if differ:
                return f"logprob of token {k} ({a}): {la!r} served, {lb!r} replayed"
    return None


def _near_tie(replayed_logprobs: list[LogprobInfo], k: int, served_token: int) -> bool:
    """Whether, at position ``k`` of the replay, the served token was about as likely as the one the
    replay chose (both within the tolerance)."""
    if k >= len(replayed_logprobs):
        return False
    chosen = replayed_logprobs[k]
    other = next((t.logprob for t in chosen.top if t.token_id == served_token), None)
    return (
        chosen.logprob is not None and other is not None and abs(chosen.logprob - other) <= LOGPROB_TOLERANCE
    )
