"""A worker's Prometheus metrics: every name it exports is declared here, once.

Built only with ``--metrics-port`` (0, the default: no metrics, no hooks run). One
:class:`WorkerMetrics` per service, in its own ``CollectorRegistry``, served by prometheus_client's
HTTP server on a daemon thread. Every series carries ``role`` and ``instance`` (children bound
once). Step metrics are observed on the engine thread; gauges read the engine client's load
snapshot when scraped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from pdserve.engine.outputs import EngineFacts, EngineLoad, RequestOutput

log = logging.getLogger(__name__)

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

disable_created_metrics()  # no *_created series: this process's metrics are pdserve's alone

NAMES = (
    "pdserve_worker_step_seconds",
    "pdserve_worker_batch_size",
    "pdserve_worker_step_tokens",
    "pdserve_worker_running",
    "pdserve_worker_waiting",
    "pdserve_worker_kv_blocks_free",
    "pdserve_worker_kv_blocks_cached",
    "pdserve_worker_kv_blocks_total",
    "pdserve_worker_preemptions_total",
    "pdserve_worker_kv_sent_bytes_total",
    "pdserve_worker_kv_received_bytes_total",
    "pdserve_worker_kv_blocks_not_sent_total",
    "pdserve_worker_kv_transfer_seconds",
    "pdserve_worker_kv_checks_total",
    "pdserve_worker_generation_tokens_total",
    "pdserve_worker_prompt_tokens_total",
    "pdserve_worker_prefix_cache_hit_tokens_total",
    "pdserve_worker_inbox_lag_seconds",
    "pdserve_worker_peer_fetches_total",
    "pdserve_worker_peer_fetch_blocks_total",
)
"""Every series family a worker exports (as exposed: counters with ``_total``)."""

LABELS = ("role", "instance")


class WorkerMetrics:
    def __init__(self, role: str, instance_id: str) -> None:
        self.registry = r = CollectorRegistry()
        ids = (role, instance_id)
        self._load: Callable[[], EngineLoad] = EngineLoad
        self._facts: EngineFacts | None = None

        def bound(kind: type, name: str, help: str, extra: Sequence[str] = (), **kw: Any) -> Any:
            metric = kind(name, help, [*LABELS, *extra], registry=r, **kw)
            return metric if extra else metric.labels(*ids)

        self.ids = ids
        self.step = bound(
            Histogram, "pdserve_worker_step_seconds", "wall time of one engine step", buckets=STEP_BUCKETS
        )
        self.batch = bound(
            Histogram,
            "pdserve_worker_batch_size",
            "requests that got output in one step",
            buckets=SIZE_BUCKETS,
        )
        self.step_tokens = bound(
            Histogram, "pdserve_worker_step_tokens", "tokens generated in one step", buckets=SIZE_BUCKETS
        )
        self.generation_tokens = bound(
            Counter, "pdserve_worker_generation_tokens", "tokens this engine generated"
        )
        self.prompt_tokens = bound(
            Counter, "pdserve_worker_prompt_tokens", "prompt tokens this engine prefilled"
        )
        self.cached_prompt_tokens = bound(
            Counter,
            "pdserve_worker_prefix_cache_hit_tokens",
            "prompt tokens taken from the prefix cache instead of prefilled (hit rate: this over it plus "
            "pdserve_worker_prompt_tokens)",
        )
        self._kv_sent = bound(
            Counter, "pdserve_worker_kv_sent_bytes", "KV bytes written to decode peers", ["protocol"]
        )
        self._kv_time = bound(
            Histogram,
            "pdserve_worker_kv_transfer_seconds",
            "time of one KV write to a decode peer",
            ["protocol"],
            buckets=TRANSFER_BUCKETS,
        )
        self._kv_children: dict[str, tuple[Any, Any]] = {}
        self.kv_blocks_not_sent = bound(
            Counter,
            "pdserve_worker_kv_blocks_not_sent",
            "prompt KV blocks not written to decode peers because their prefix cache held them",
        )
        self.preemptions = bound(
            Counter, "pdserve_worker_preemptions", "sequences preempted (blocks freed, recomputed later)"
        )
        self._preempted = 0
        self.inbox_lag = bound(
            Histogram,
            "pdserve_worker_inbox_lag_seconds",
            "a message's wait in this "
            "instance's inbox: from its XADD (the entry id's time, Redis's clock) to "
            "this worker reading it",
            buckets=STEP_BUCKETS,
        )
        self.kv_received = bound(
            Counter,
            "pdserve_worker_kv_received_bytes",
            "KV bytes prefill peers wrote into this cache (decode)",
        )
        self._kv_checks = bound(
            Counter,
            "pdserve_worker_kv_checks",
            "KV hand-offs received, by what their blocks' check against the writer's digests found: ok, "
            "mismatch (never decoded: the request was retried), unchecked (no digests sent, or "
            "--no-kv-checksum)",
            ["outcome"],
        )
        self._peer_fetches = bound(
            Counter,
            "pdserve_worker_peer_fetches",
            "prefix fetches from peers this instance made, by outcome: ok (blocks came and matched their "
            "digests), refused (the peer wrote none), timeout, mismatch (never used); all but ok are "
            "computed instead",
            ["outcome"],
        )
        self._peer_blocks = bound(
            Counter,
            "pdserve_worker_peer_fetch_blocks",
            "prefix blocks moved by peer fetches: fetched (into this cache, used), missed (asked for, "
            "computed instead), served (written from this cache into fetching peers)",
            ["result"],
        )
        gauges = (
            ("pdserve_worker_running", "sequences in the running batch", lambda: self._load().running),
            (
                "pdserve_worker_waiting",
                "sequences queued, plus prefills awaiting hand-over",
                lambda: self._load().waiting,
            ),
            (
                "pdserve_worker_kv_blocks_free",
                "KV cache blocks an allocation can take (free, or cached and unused)",
                lambda: self._load().free_blocks,
            ),
            (
                "pdserve_worker_kv_blocks_cached",
                "KV cache blocks holding a registered prefix (in use or kept for reuse)",
                lambda: self._load().cached_blocks,
            ),
            (
                "pdserve_worker_kv_blocks_total",
                "KV cache blocks",
                lambda: self._facts.num_blocks if self._facts else 0,
            ),
        )
        for name, help, fn in gauges:
            bound(Gauge, name, help).set_function(fn)
        self._server: Any = None

    def on_inbox_read(self, entry_ids: Sequence[bytes | str]) -> None:
        """Observe each read entry's lag (``<ms>-<seq>`` ids carry Redis's time of the XADD)."""
        now_ms = time.time() * 1e3
        for entry_id in entry_ids:
            ms = entry_id.split(b"-", 1)[0] if isinstance(entry_id, bytes) else entry_id.split("-", 1)[0]
            self.inbox_lag.observe(max(0.0, now_ms - int(ms)) / 1e3)

    def watch(self, load: Callable[[], EngineLoad], facts: EngineFacts) -> None:
        """Where the gauges read the engine's load snapshot and facts."""
        self._load, self._facts = load, facts

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve /metrics on ``host:port`` (``--metrics-host``: loopback unless told)."""
        self._server, _ = start_http_server(port, host, registry=self.registry)
        log.info("worker metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---- hooks -----------------------------------------------------------------------------------
    def on_step(self, seconds: float, outputs: list[RequestOutput], preemptions: int) -> None:
        """On the engine thread, after a step (``preemptions``: the engine's count so far)."""
        self.step.observe(seconds)
        if preemptions > self._preempted:
            self.preemptions.inc(preemptions - self._preempted)
            self._preempted = preemptions
        tokens = prompt = cached = 0
        for out in outputs:
            n = len(out.token_ids)
            tokens += n
            if n and out.num_output_tokens == n:  # a fresh request's first token: its prompt ran
                prompt += out.num_prompt_tokens - out.num_cached_tokens
                cached += out.num_cached_tokens
        self.batch.observe(len(outputs))
        self.step_tokens.observe(tokens)
        if tokens:
            self.generation_tokens.inc(tokens)
        if prompt:
            self.prompt_tokens.inc(prompt)
        if cached:
            self.cached_prompt_tokens.inc(cached)

    def on_kv_check(self, outcome: str) -> None:
        self._kv_checks.labels(*self.ids, outcome).inc()

    def on_kv_sent(self, protocol: str, nbytes: int, seconds: float, blocks_not_sent: int = 0) -> None:
        children = self._kv_children.get(protocol)
        if children is None:
            children = self._kv_children[protocol] = (
                self._kv_sent.labels(*self.ids, protocol),
                self._kv_time.labels(*self.ids, protocol),
            )
        children[0].inc(nbytes)
        children[1].observe(seconds)
        if blocks_not_sent:
            self.kv_blocks_not_sent.inc(blocks_not_sent)

    def on_peer_fetch(self, outcome: str, fetched: int, missed: int) -> None:
        self._peer_fetches.labels(*self.ids, outcome).inc()
        if fetched:
            self._peer_blocks.labels(*self.ids, "fetched").inc(fetched)
        if missed:
            self._peer_blocks.labels(*self.ids, "missed").inc(missed)

    def on_peer_fetch_served(self, blocks: int) -> None:
        self._peer_blocks.labels(*self.ids, "served").inc(blocks)
