"""Observability: the router's /metrics and the workers' --metrics-port, read after real traffic
through a real splitwise stack (Redis, worker processes, router), parsed as Prometheus text."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from redis_support import run

from pdserve.localredis.embedded import free_port
from pdserve.router.http import metrics as router_metrics
from pdserve.router.http.app import create_app
from pdserve.router.http.settings import RouterSettings
from pdserve.scheduler import Keys, RouterRegistry
from pdserve.scheduler.registration import TrafficInfo
from pdserve.worker import metrics as worker_metrics
from tests.e2e.test_serving import client, model_name, start_stack

pytestmark = pytest.mark.timeout(240)

N = 9


def scrape(url: str) -> dict[str, Metric]:
    """Family name -> its family as exposed at ``url``."""
    text = httpx.get(url, timeout=10).raise_for_status().text
    return {f.name: f for f in text_string_to_metric_families(text)}


def exposed_names(families: dict[str, Metric]) -> set[str]:
    """The names as declared in pdserve (the parser strips a counter's ``_total``)."""
    return {name + "_total" if f.type == "counter" else name for name, f in families.items()}


def total(families: dict[str, Metric], sample: str, **labels: str) -> float:
    """The sum of the samples called ``sample`` whose labels include ``labels``."""
    return sum(
        s.value
        for f in families.values()
        for s in f.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def run_traffic(stack, n: int) -> int:
    """``n`` requests (stream and not, chat and completions); the completion tokens clients got.

    Greedy, so that no request samples its end of text as its first token: one that did would end on
    the prefill instance, with no KV hand-off to count."""
    c = client(stack)
    tokens = 0
    for i in range(n):
        kind = i % 3
        if kind == 0:
            r = c.completions.create(
                model=model_name(stack), prompt=f"hello {i}", max_tokens=5 + i, temperature=0
            )
            tokens += r.usage.completion_tokens
        elif kind == 1:
            r = c.chat.completions.create(
                model=model_name(stack),
                messages=[{"role": "user", "content": f"hi {i}"}],
                max_tokens=4 + i,
                temperature=0,
            )
            tokens += r.usage.completion_tokens
        else:
            stream = c.completions.create(
                model=model_name(stack),
                prompt=f"stream {i}",
                max_tokens=3 + i,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [chunk.usage for chunk in stream if chunk.usage is not None]
            tokens += usage[-1].completion_tokens
    return tokens


def asked_max_tokens(n: int) -> int:
    """The max_tokens ``run_traffic`` sets over its ``n`` requests."""
    return sum((5, 4, 3)[i % 3] + i for i in range(n))


def published_traffic(stack, n: int) -> TrafficInfo:
    """The router's traffic window as its registration publishes it, once it counts ``n`` arrivals
    and ``n`` finished requests (a heartbeat between the last arrival and the last finish publishes
    a window that counts the one but not the other)."""

    async def read(redis) -> TrafficInfo | None:
        routers = await RouterRegistry(redis, Keys(stack.spec.cluster)).live()
        return routers[0].traffic if routers else None

    deadline = time.monotonic() + 10
    while True:
        traffic = run(stack.redis_url, read)
        if (
            traffic is not None and min(traffic.arrivals, traffic.requests) >= n
        ) or time.monotonic() > deadline:
            assert traffic is not None
            return traffic
        time.sleep(0.2)


def check_stack_metrics(stack, n: int, tokens: int) -> tuple[dict, list[dict]]:
    router = scrape(stack.urls[0] + "/metrics")
    ok = total(router, "pdserve_requests_total", status="200", error_kind="")
    assert ok == n
    assert total(router, "pdserve_requests_total") == n
    assert total(router, "pdserve_generation_tokens_total") == tokens
    for hist in (
        "pdserve_ttft_seconds",
        "pdserve_server_ttft_seconds",
        "pdserve_kv_transfer_time_seconds",
        "pdserve_e2e_latency_seconds",
    ):
        assert total(router, hist + "_count") >= n, hist
    assert total(router, "pdserve_inter_token_latency_seconds_count") >= 1
    assert total(router, "pdserve_ttft_seconds_count") == n
    assert total(router, "pdserve_selections_total", role="prefill") == n
    assert total(router, "pdserve_selections_total", role="decode") == n
    assert total(router, "pdserve_route_picks_total") == n  # prefix_cache (the default) said why, each time
    assert total(router, "pdserve_live_instances", role="prefill") == 1
    assert total(router, "pdserve_live_instances", role="decode") == 1
    assert total(router, "pdserve_in_flight_requests") == 0
    # every request's messages went out in a pipelined round trip; the live set was read
    assert 1 <= total(router, "pdserve_redis_round_trip_seconds_count", op="inbox_send") <= 2 * n
    assert total(router, "pdserve_redis_round_trip_seconds_count", op="live_set") >= 1
    assert total(router, "pdserve_redis_errors_total") == 0

    workers = [scrape(f"http://127.0.0.1:{port}/metrics") for port in stack.metrics_ports.values()]
    assert len(workers) == 2
    generated = sum(total(w, "pdserve_worker_generation_tokens_total") for w in workers)
    assert generated == tokens  # prefill made each first token, decode the rest
    sent = sum(total(w, "pdserve_worker_kv_sent_bytes_total", protocol="shm") for w in workers)
    received = sum(total(w, "pdserve_worker_kv_received_bytes_total") for w in workers)
    assert sent > 0 and sent == received
    assert sum(total(w, "pdserve_worker_kv_transfer_seconds_count", role="prefill") for w in workers) == n
    assert all(total(w, "pdserve_worker_step_seconds_count") > 0 for w in workers)
    assert all(total(w, "pdserve_worker_kv_blocks_total") > 0 for w in workers)
    lag = [total(w, "pdserve_worker_inbox_lag_seconds_count") for w in workers]
    assert all(count >= n for count in lag)  # prefill: generate; decode: reserve and prefilled (at least)
    return router, workers


@pytest.mark.parametrize("engine_kind", ["echo", "model"])
def test_metrics_after_traffic(tiny_model_dir, redis_url, engine_kind) -> None:
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=1, engine_kind=engine_kind, metrics=True)
    try:
        tokens = run_traffic(stack, N)
        router, workers = check_stack_metrics(stack, N, tokens)
        # what arrived, in the window the planner reads: every choice, its max_tokens, and of the
        # finished ones what was asked and generated (the prompts' lengths where it tokenized them)
        traffic = published_traffic(stack, N)
        assert (traffic.arrivals, traffic.arrival_max_known, traffic.requests) == (N, N, N)
        assert traffic.arrival_max_tokens == traffic.finished_asked == asked_max_tokens(N)
        assert traffic.finished_generated == tokens
        if engine_kind == "model":
            assert traffic.arrival_prompt_known == N and traffic.arrival_prompt_tokens > N
        # every family the declaration modules name is exposed, and nothing undeclared is
        assert set(router_metrics.NAMES) == exposed_names(router)
        for w in workers:
            assert set(worker_metrics.NAMES) == exposed_names(w)
        if engine_kind == "model":
            assert sum(total(w, "pdserve_worker_prompt_tokens_total") for w in workers) > 0
        # an error is counted with its status and kind
        with pytest.raises(openai.NotFoundError):
            client(stack).completions.create(model="no-such-model", prompt="x", max_tokens=2)
        router = scrape(stack.urls[0] + "/metrics")
        assert total(router, "pdserve_requests_total", status="404") == 1
        assert total(router, "pdserve_requests_total") == N + 1
        if engine_kind == "model":  # the prefix cache: a prompt sent twice is found the second time
            prompt = "A prompt sent twice is prefilled once and then found in the prefix cache. " * 4
            for _ in range(2):
                client(stack).completions.create(model=model_name(stack), prompt=prompt, max_tokens=2)
            workers = [scrape(f"http://127.0.0.1:{port}/metrics") for port in stack.metrics_ports.values()]
            assert sum(total(w, "pdserve_worker_prefix_cache_hit_tokens_total") for w in workers) >= 16
            assert all(total(w, "pdserve_worker_kv_blocks_cached") > 0 for w in workers)
    finally:
        assert stack.stop(grace_s=15) == []


def test_metrics_off_and_open_with_api_keys(tiny_model_dir, redis_url) -> None:
    """/metrics stays open when API keys guard /v1/*; --no-metrics turns it into a 404."""
    for on in (True, False):
        settings = RouterSettings(redis_url=redis_url, port=free_port(), api_key="secret", metrics=on)
        app = create_app(settings)
        transport = httpx.ASGITransport(app=app)

        async def get(app=app, transport=transport):
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(transport=transport, base_url="http://r") as c,
            ):
                return (await c.get("/metrics")), (await c.get("/v1/models"))

        metrics, models = asyncio.run(get())
        assert models.status_code == 401
        if on:
            assert metrics.status_code == 200
            assert metrics.headers["content-type"].startswith("text/plain")
            assert router_metrics.NAMES[0] in metrics.text
        else:
            assert metrics.status_code == 404


def test_loop_histogram_matches_prometheus_client() -> None:
    """The router's lock-free histogram exposes what prometheus_client's Histogram would."""
    from prometheus_client import CollectorRegistry, Histogram

    from pdserve.router.http.metrics import ITL_BUCKETS, LoopHistogram

    mine, theirs = CollectorRegistry(), CollectorRegistry()
    a = LoopHistogram("pdserve_x_seconds", "x", ITL_BUCKETS, mine)
    b = Histogram("pdserve_x_seconds", "x", buckets=ITL_BUCKETS, registry=theirs)
    for v in (0.0, 0.0005, 0.00051, 0.001, 0.3, 5.0, 7.5, 1e9, *ITL_BUCKETS):
        a.observe(v)
        b.observe(v)

    assert _samples(mine) == _samples(theirs)


def test_loop_counters_and_labelled_histograms_match_prometheus_client() -> None:
    """The router's lock-free counters (with and without labels) and labelled histograms expose what
    prometheus_client's Counter and Histogram would, zero-valued unlabelled counter included."""
    from prometheus_client import CollectorRegistry, Counter, Histogram

    from pdserve.router.http.metrics import REDIS_BUCKETS, LoopCounter, LoopHistogram

    mine, theirs = CollectorRegistry(), CollectorRegistry()
    plain = LoopCounter("pdserve_a", "a", mine)
    LoopCounter("pdserve_never", "never", mine)  # exposed at 0, as prometheus_client does
    labelled = LoopCounter("pdserve_b", "b", mine, ("op", "error"))
    hist = LoopHistogram("pdserve_c_seconds", "c", REDIS_BUCKETS, mine, ("op",))
    plain_ = Counter("pdserve_a", "a", registry=theirs)
    Counter("pdserve_never", "never", registry=theirs)
    labelled_ = Counter("pdserve_b", "b", ["op", "error"], registry=theirs)
    hist_ = Histogram("pdserve_c_seconds", "c", ["op"], buckets=REDIS_BUCKETS, registry=theirs)
    for amount in (1, 2.5, 16):
        plain.inc(amount=amount)
        plain_.inc(amount)
    for op, error in (("send", "TimeoutError"), ("read", "ConnectionError"), ("send", "TimeoutError")):
        labelled.inc(op, error)
        labelled_.labels(op, error).inc()
    for op, value in (("send", 0.0002), ("read", 0.3), ("send", 5.0), ("send", 0.0001)):
        hist.series(op).observe(value)
        hist_.labels(op).observe(value)

    assert _samples(mine) == _samples(theirs)


def _samples(registry) -> list[tuple[str, tuple, float]]:
    """Every sample a registry exposes, sorted (no ``_created``)."""
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.name.endswith("_created")
    )


def test_the_route_model_and_its_inputs_are_exposed() -> None:
    """What prefix_cache expected of each pick (seconds, where rates exist), its picks by source and
    pricing, and the rates the live instances measured (from the router's cached live set)."""
    import dataclasses
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families as parse

    from pdserve.router.http.metrics import RouterMetrics
    from pdserve.router.routing.policies import PolicyRequest
    from pdserve.router.routing.selection import Selector
    from pdserve.scheduler.registration import RatesInfo
    from tests.router_support import instance

    fast = instance("m0")
    fast.rates = RatesInfo(prefill_s_per_token=0.001, decode_s_per_token=0.004, host_read_s_per_block=0.0016)
    fresh = instance("m1")
    p0 = instance("p0", "prefill")
    p0.rates = RatesInfo(prefill_s_per_token=0.002, transfer_s_per_block={"shm": 0.0001})
    metrics = RouterMetrics()
    metrics.watch_live(SimpleNamespace(cached=[fast, fresh, p0]))  # the live set as the router caches it
    sel = Selector("prefix_cache", "prefix_cache")
    request = PolicyRequest("tiny", text="x", num_tokens=1000, cached_tokens={"m0": 200})
    tiered = dataclasses.replace(request, tier_tokens={"m0": 640})
    for r in (tiered, request):
        metrics.on_prefix(sel.route([fast, fresh], r), r)  # m0 both times: by its rates, then its pool
    plain = [instance("m0"), instance("m1")]  # no rates: the weights, in tokens
    metrics.on_prefix(sel.route(plain, PolicyRequest("tiny", text="x", num_tokens=10)), request)

    families = {f.name: f for f in parse(metrics.render().decode())}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    assert samples[("pdserve_route_estimate_seconds_count", ())] == 2  # the tokens-priced pick is not in it
    assert samples[("pdserve_route_estimate_seconds_sum", ())] == pytest.approx(0.16 + 0.064 + 0.8)
    picks = {k[1]: v for k, v in samples.items() if k[0] == "pdserve_route_picks_total"}
    assert picks == {
        (("priced", "measured"), ("source", "host_tier")): 1,
        (("priced", "measured"), ("source", "cache_hit")): 1,
        (("priced", "weights"), ("source", "recompute")): 1,
    }
    assert samples[("pdserve_instance_prefill_seconds_per_token", (("instance", "m0"),))] == 0.001
    assert samples[("pdserve_instance_decode_seconds_per_token", (("instance", "m0"),))] == 0.004
    assert (
        "pdserve_instance_prefill_seconds_per_token",
        (("instance", "m1"),),
    ) not in samples  # not measured
    assert (
        samples[("pdserve_instance_read_back_seconds_per_block", (("instance", "m0"), ("tier", "host")))]
        == 0.0016
    )
    assert (
        samples[("pdserve_instance_kv_transfer_seconds_per_block", (("instance", "p0"), ("protocol", "shm")))]
        == 0.0001
    )
