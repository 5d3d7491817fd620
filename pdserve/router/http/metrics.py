"""The router's Prometheus metrics: every name it exports is declared here, once.

One :class:`RouterMetrics` per app (its own ``CollectorRegistry``, so several apps in one process
never collide), served as text at ``GET /metrics``. The hot path observes through
:class:`LoopCounter` and :class:`LoopHistogram` (a dict update, a bisect: no lock, no label dict).
Gauges that mirror state (in flight, live instances) are computed when scraped. The router is one
process, so no multi-process collection is needed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pdserve.scheduler.outbox_messages import RequestDelta

if TYPE_CHECKING:
    from pdserve.router.routing.policies import PolicyRequest
    from pdserve.router.routing.selection import Route
    from pdserve.scheduler.registration import InstanceInfo
    from pdserve.scheduler.registry import LiveSetCache

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Seconds: TTFT and its parts, KV transfer."""
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)
REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0)
ESTIMATE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds: what prefix_cache expected a pick to cost (prefill, read-backs, transfer, queue)."""

disable_created_metrics()  # no *_created series: this process's metrics are pdserve's alone

NAMES = (
    "pdserve_requests_total",
    "pdserve_in_flight_requests",
    "pdserve_ttft_seconds",
    "pdserve_server_ttft_seconds",
    "pdserve_queue_time_seconds",
    "pdserve_prefill_time_seconds",
    "pdserve_kv_transfer_time_seconds",
    "pdserve_inter_token_latency_seconds",
    "pdserve_e2e_latency_seconds",
    "pdserve_retries_total",
    "pdserve_migrations_total",
    "pdserve_selections_total",
    "pdserve_live_instances",
    "pdserve_generation_tokens_total",
    "pdserve_prompt_tokens_total",
    "pdserve_prefix_lookup_tokens_total",
    "pdserve_prefix_hit_tokens_total",
    "pdserve_local_prefills_total",
    "pdserve_route_estimate_seconds",
    "pdserve_route_picks_total",
    "pdserve_instance_prefill_seconds_per_token",
    "pdserve_instance_decode_seconds_per_token",
    "pdserve_instance_read_back_seconds_per_block",
    "pdserve_instance_kv_transfer_seconds_per_block",
    "pdserve_instance_fetch_seconds_per_block",
    "pdserve_redis_round_trip_seconds",
    "pdserve_redis_errors_total",
    "pdserve_verify_total",
)
"""Every series family the router exports (as exposed: counters with ``_total``)."""

ROLES = ("prefill", "decode", "mixed")


class _LiveInstances(Collector):
    """``pdserve_live_instances{role}`` from the live set the router already caches (no Redis read)."""

    def __init__(self) -> None:
        self.live: LiveSetCache[InstanceInfo] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "pdserve_live_instances", "instances in this router's cached live set", labels=["role"]
        )
        counts = dict.fromkeys(ROLES, 0)
        for info in (self.live.cached if self.live is not None else None) or ():
            if not info.draining:
                counts[info.role] = counts.get(info.role, 0) + 1
        for role, n in counts.items():
            family.add_metric([role], n)
        yield family


class _InstanceRates(Collector):
    """The rates each live instance measured (its registration's ``rates``: what ``prefix_cache``
    weighs), from the live set the router already caches; one series per instance (and tier or
    transport), none for what an instance has not measured."""

    def __init__(self) -> None:
        self.live: LiveSetCache[InstanceInfo] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        prefill = GaugeMetricFamily(
            "pdserve_instance_prefill_seconds_per_token",
            "seconds per prompt token an instance's recent prefill steps took (its registration's rates)",
            labels=["instance"],
        )
        decode = GaugeMetricFamily(
            "pdserve_instance_decode_seconds_per_token",
            "seconds per token an instance's recent decode-only steps took (its registration's rates)",
            labels=["instance"],
        )
        read_back = GaugeMetricFamily(
            "pdserve_instance_read_back_seconds_per_block",
            "seconds per KV block an instance's recent read-backs from a tier took (read, check, copy)",
            labels=["instance", "tier"],
        )
        transfer = GaugeMetricFamily(
            "pdserve_instance_kv_transfer_seconds_per_block",
            "seconds per KV block an instance's recent writes into peers (hand-offs, fetches served) "
            "took, by transport",
            labels=["instance", "protocol"],
        )
        fetch = GaugeMetricFamily(
            "pdserve_instance_fetch_seconds_per_block",
            "seconds per KV block an instance's recent fetches from peers took, asking to checked",
            labels=["instance"],
        )
        for info in (self.live.cached if self.live is not None else None) or ():
            rates = info.rates
            if rates is None:
                continue
            if rates.prefill_s_per_token is not None:
                prefill.add_metric([info.id], rates.prefill_s_per_token)
            if rates.decode_s_per_token is not None:
                decode.add_metric([info.id], rates.decode_s_per_token)
            for tier, value in (("host", rates.host_read_s_per_block), ("disk", rates.disk_read_s_per_block)):
                if value is not None:
                    read_back.add_metric([info.id, tier], value)
            for protocol, value in (rates.transfer_s_per_block or {}).items():
                transfer.add_metric([info.id, protocol], value)
            if rates.fetch_s_per_block is not None:
                fetch.add_metric([info.id], rates.fetch_s_per_block)
        yield prefill
        yield decode
        yield read_back
        yield transfer
        yield fetch


class LoopCounter(Collector):
    """A counter, with labels or without, for code that runs on one event loop: ``inc`` is a dict
    update (prometheus_client's counters take a lock and check their labels on every call); scrapes
    run on the same loop, so they always see a consistent state."""

    def __init__(
        self, name: str, help: str, registry: CollectorRegistry, labels: tuple[str, ...] = ()
    ) -> None:
        self.name, self.help, self.labels = name, help, labels
        self.values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}
        registry.register(self)

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        """Add ``amount`` to the series of ``labels`` (one value per label name, in order)."""
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.help, labels=self.labels)
        for labels, value in self.values.items():
            family.add_metric(labels, value)
        yield family


class _Buckets:
    """One histogram series: a bisect and two additions per observation."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class LoopHistogram(Collector):
    """A histogram for code that runs on one event loop (about 5x cheaper than prometheus_client's
    locked Histogram). Without labels, :meth:`observe`; with labels, ``series(*values).observe``
    (bind the series once where the labels are known in advance)."""

    def __init__(
        self,
        name: str,
        help: str,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
        labels: tuple[str, ...] = (),
    ) -> None:
        self.name, self.help, self.labels = name, help, labels
        self.bounds = [*buckets, float("inf")]
        self._series: dict[tuple[str, ...], _Buckets] = {}
        if not labels:
            self.observe = self.series().observe
        registry.register(self)

    def series(self, *labels: str) -> _Buckets:
        found = self._series.get(labels)
        if found is None:
            found = self._series[labels] = _Buckets(self.bounds)
        return found

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.help, labels=self.labels)
        for labels, series in self._series.items():
            cumulative, buckets = 0, []
            for bound, n in zip(self.bounds, series.counts):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric(list(labels), buckets, sum_value=series.sum)
        yield family


class Asked:
    """What clients asked for, counted as their choices start and finish: not exported, only
    published in the router's traffic window (``traffic.py``), where the planner reads the demand
    arriving (prompt tokens and answer tokens per second) before the requests finish."""

    __slots__ = (
        "arrivals",
        "finished_asked",
        "finished_generated",
        "max_known",
        "max_tokens",
        "prompt_known",
        "prompt_tokens",
    )

    def __init__(self) -> None:
        self.arrivals = 0
        """Choices whose first attempt was placed."""
        self.prompt_tokens = self.prompt_known = 0
        """Their prompt tokens, of the ``prompt_known`` whose length the router knew."""
        self.max_tokens = self.max_known = 0
        """Their ``max_tokens``, of the ``max_known`` whose client set one."""
        self.finished_asked = self.finished_generated = 0
        """Of the finished choices whose client set ``max_tokens``: the tokens asked, and generated."""


class RouterMetrics:
    """The router's metrics; the dispatcher and the endpoints call the ``on_*`` hooks."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.active = 0
        """Client requests being served now (past admission)."""
        self._requests = LoopCounter(
            "pdserve_requests",
            "client requests answered, by endpoint, served model, HTTP status and error kind ('' for success)",
            r,
            ("endpoint", "model", "status", "error_kind"),
        )
        Gauge("pdserve_in_flight_requests", "client requests being served", registry=r).set_function(
            lambda: self.active
        )
        self.ttft = LoopHistogram(
            "pdserve_ttft_seconds",
            "router-measured time to first token: request arrival to the first delta relayed",
            LATENCY_BUCKETS,
            r,
        )
        self.server_ttft = LoopHistogram(
            "pdserve_server_ttft_seconds", "S_TTFT the worker measured (timing.s_ttft_s)", LATENCY_BUCKETS, r
        )
        self.queue_time = LoopHistogram(
            "pdserve_queue_time_seconds",
            "time in the engine's queue before the first prefill chunk (timing.queue_s)",
            LATENCY_BUCKETS,
            r,
        )
        self.prefill_time = LoopHistogram(
            "pdserve_prefill_time_seconds", "S_TTFT minus queue time", LATENCY_BUCKETS, r
        )
        self.kv_transfer = LoopHistogram(
            "pdserve_kv_transfer_time_seconds",
            "splitwise KV write as the prefill worker timed it (timing.kv_transfer_s)",
            LATENCY_BUCKETS,
            r,
        )
        self.itl = LoopHistogram(
            "pdserve_inter_token_latency_seconds",
            "time between relayed deltas divided by the tokens of the later one",
            ITL_BUCKETS,
            r,
        )
        self.e2e = LoopHistogram(
            "pdserve_e2e_latency_seconds",
            "request arrival to its final delta (finished choices)",
            E2E_BUCKETS,
            r,
        )
        self._retries = LoopCounter(
            "pdserve_retries",
            "attempts re-sent to a fresh pair before any token, by the error kind that caused it",
            r,
            ("kind",),
        )
        self.migrations = LoopCounter(
            "pdserve_migrations", "generations moved to another instance after tokens flowed", r
        )
        self._selections = LoopCounter(
            "pdserve_selections", "attempts sent, by role and instance picked", r, ("role", "instance")
        )
        self.generation_tokens = LoopCounter(
            "pdserve_generation_tokens", "completion tokens of finished choices (their final usage)", r
        )
        self.prompt_tokens = LoopCounter(
            "pdserve_prompt_tokens", "prompt tokens of finished choices (their final usage)", r
        )
        self.prefix_lookup_tokens = LoopCounter(
            "pdserve_prefix_lookup_tokens",
            "prompt tokens of attempts placed by cached prefix (the router tokenized them)",
            r,
        )
        self.prefix_hit_tokens = LoopCounter(
            "pdserve_prefix_hit_tokens",
            "of those, the tokens the prefix index said the instance picked to prefill holds (the "
            "hit rate routing expects: this over pdserve_prefix_lookup_tokens)",
            r,
        )
        self.local_prefills = LoopCounter(
            "pdserve_local_prefills",
            "attempts a decode instance prefilled itself, its cache holding all but a few prompt "
            "tokens (--local-prefill-tokens)",
            r,
        )
        self.route_estimate = LoopHistogram(
            "pdserve_route_estimate_seconds",
            "what prefix_cache expected the instance (or pair) it picked to take for the prompt: "
            "compute, tier read-backs, KV transfer and its queue, from the instances' measured rates "
            "(only where some candidate had measured its prefill rate)",
            ESTIMATE_BUCKETS,
            r,
        )
        self._route_picks = LoopCounter(
            "pdserve_route_picks",
            "prefix_cache's picks by where the picked instance gets the prompt's KV beyond computing it "
            "(source: peer, a fetch from another instance; host_tier or disk_tier, a read-back; "
            "cache_hit; recompute) and how it was priced "
            "(priced: measured, its own rates; median, the candidates' median prefill rate; weights, "
            "no candidate had measured one: the --prefix-* weights in tokens)",
            r,
            ("source", "priced"),
        )
        self._redis_time = LoopHistogram(
            "pdserve_redis_round_trip_seconds",
            "the router's Redis round trips by operation: inbox_send (one round trip per event-loop "
            "batch), live_set",
            REDIS_BUCKETS,
            r,
            ("op",),
        )
        self._redis_errors = LoopCounter(
            "pdserve_redis_errors",
            "failed Redis calls by operation (inbox_send, live_set, outbox_read) and exception type",
            r,
            ("op", "error"),
        )
        self._verify = LoopCounter(
            "pdserve_verify",
            "disaggregated requests sampled for shadow verification (--verify-fraction), by outcome: "
            "match, mismatch (its replay on the aggregated path differed), failed (the replay did not "
            "finish), skipped (no instance to replay on, or too many replays running)",
            r,
            ("outcome",),
        )
        self.asked = Asked()
        self._live = _LiveInstances()
        r.register(self._live)
        self._rates = _InstanceRates()
        r.register(self._rates)

    def watch_live(self, live: LiveSetCache[InstanceInfo]) -> None:
        self._live.live = live
        self._rates.live = live

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- hooks -----------------------------------------------------------------------------------
    def on_request(self, endpoint: str, model: str, status: int, error_kind: str) -> None:
        self._requests.inc(endpoint, model, str(status), error_kind)

    def on_arrival(self, prompt_tokens: int | None, max_tokens: int | None) -> None:
        """A choice placed for the first time: its prompt's length and its ``max_tokens``, where
        known (None: a text prompt the router did not tokenize; no ``max_tokens`` from the client)."""
        asked = self.asked
        asked.arrivals += 1
        if prompt_tokens is not None:
            asked.prompt_tokens += prompt_tokens
            asked.prompt_known += 1
        if max_tokens is not None:
            asked.max_tokens += max_tokens
            asked.max_known += 1

    def on_delta(
        self,
        delta: RequestDelta,
        first: bool,
        arrived: float,
        last: float,
        now: float,
        max_tokens: int | None = None,
    ) -> None:
        """One accepted, non-error delta of a generation (``first``: its first visible one;
        ``max_tokens``: the client's, None when it set none)."""
        if first:
            self.ttft.observe(now - arrived)
        elif delta.token_ids:
            self.itl.observe((now - last) / len(delta.token_ids))
        timing = delta.timing
        if timing is not None:
            self.server_ttft.observe(timing.s_ttft_s)
            if timing.queue_s is not None:
                self.queue_time.observe(timing.queue_s)
                self.prefill_time.observe(max(0.0, timing.s_ttft_s - timing.queue_s))
            if timing.kv_transfer_s is not None:
                self.kv_transfer.observe(timing.kv_transfer_s)
        usage = delta.usage
        if usage is not None and delta.finish_reason is not None:
            self.generation_tokens.inc(amount=usage.completion_tokens)
            self.prompt_tokens.inc(amount=usage.prompt_tokens)
            self.e2e.observe(now - arrived)
            if max_tokens is not None:
                self.asked.finished_asked += max_tokens
                self.asked.finished_generated += usage.completion_tokens

    def on_redis(self, op: str, seconds: float | None, error: BaseException | None) -> None:
        """A Redis round trip (``RedisObserver``)."""
        if error is not None:
            self._redis_errors.inc(op, type(error).__name__)
        elif seconds is not None:
            self._redis_time.series(op).observe(seconds)

    def on_verify(self, outcome: str) -> None:
        self._verify.inc(outcome)

    def on_retry(self, kind: str) -> None:
        self._retries.inc(kind)

    def on_prefix(self, route: Route, request: PolicyRequest) -> None:
        """An attempt placed with the prompt's length known (prefix routing)."""
        if route.local_prefill:
            self.local_prefills.inc()
        estimate = route.estimate
        if estimate is not None:
            if estimate.seconds:
                self.route_estimate.observe(estimate.cost)
            priced = "measured" if estimate.measured else "median" if estimate.seconds else "weights"
            self._route_picks.inc(estimate.source, priced)
        if request.num_tokens is not None:
            self.prefix_lookup_tokens.inc(amount=request.num_tokens)
            hit = request.cached_tokens.get(route.entry.id, 0)
            if hit:
                self.prefix_hit_tokens.inc(amount=hit)

    def on_route(self, route: Route) -> None:
        if route.prefill is not None:
            self._selections.inc("prefill", route.prefill.id)
        self._selections.inc(route.decode.role, route.decode.id)
