"""Fetch vs recompute in the ``prefix_cache`` policy (pure logic, no Redis): which peer can write
into which instance (``fetch_protocol``), when a fetch from a peer is priced below the recompute,
the pick that counts on one (the route says ``source="peer"`` and names the peer), and the router's
metrics of it."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families as parse
from router_support import instance

from pdserve.router.http.metrics import RouterMetrics
from pdserve.router.routing.policies import PolicyRequest, PrefixCache, PrefixWeights
from pdserve.router.routing.policies.peer_fetch import best_fetch
from pdserve.router.routing.selection import Selector, fetch_protocol
from pdserve.scheduler.registration import InstanceInfo, RatesInfo

SHM_ENDPOINT = {"shm": "pdserve-x"}


def fetchable(
    info: InstanceInfo, writes: tuple[str, ...] = ("shm",), endpoint: dict | None = None
) -> InstanceInfo:
    """``info`` with its transports open (``writes``) and its cache where peers write (``endpoint``)."""
    info.kv.prefix_caching = True
    info.transfer.writes = list(writes)
    info.transfer.endpoint = SHM_ENDPOINT if endpoint is None else endpoint
    return info


def held(n: int, holders: list[InstanceInfo], **pools: int) -> PolicyRequest:
    """A prompt of ``n`` tokens; ``pools``: instance id -> the leading tokens its pool holds."""
    return PolicyRequest("tiny", text="x", num_tokens=n, cached_tokens=pools, holders=holders)


def test_who_can_write_into_whom() -> None:
    a, b = fetchable(instance("m0", host="h1")), fetchable(instance("m1", host="h1"))
    assert fetch_protocol(a, b) == "shm" and fetch_protocol(b, a) == "shm"
    assert fetch_protocol(a, a) is None  # not from itself
    far = fetchable(instance("m2", host="h2"))
    assert fetch_protocol(a, far) is None  # shm does not cross hosts
    a2, far2 = (
        fetchable(instance("m0", host="h1"), ("shm", "mooncake")),
        fetchable(instance("m2", host="h2"), endpoint={"shm": "s", "mooncake": {"session": "x"}}),
    )
    assert fetch_protocol(a2, far2) == "mooncake"
    private = fetchable(instance("m3", host="h1"), endpoint={})  # its cache is not shared: no endpoint
    assert fetch_protocol(a, private) is None
    closed = fetchable(instance("m4", host="h1"), writes=())  # no transport open: it cannot write
    assert fetch_protocol(closed, b) is None
    other = fetchable(instance("m5", host="h1"))
    other.kv.weights_digest = "f" * 32  # another checkpoint under the same name
    assert fetch_protocol(other, b) is None and fetch_protocol(b, other) is None


def test_an_idle_instance_fetches_a_busy_ones_prefix_instead_of_recomputing_it() -> None:
    """m0 holds 960 of 1000 tokens but is busy; m1 is idle and can be written into: it is picked,
    counting on a fetch of m0's 60 blocks (the last token is always computed)."""
    m0, m1 = fetchable(instance("m0")), fetchable(instance("m1"))
    request = held(1000, [m0, m1], m0=960)
    sel = Selector("prefix_cache", "prefix_cache", weights=PrefixWeights(load_tokens=64, transfer=0.05))
    route = sel.route([m0, m1], request)
    assert route.decode.id == "m0"  # idle, it holds the prefix: no fetch
    assert route.fetch is None and route.estimate is not None and route.estimate.source == "cache_hit"
    sel.in_flight["m0"] = 20  # 20 x 64 tokens of queue on m0
    route = sel.route([m0, m1], request)
    assert route.decode.id == "m1" and route.fetch is not None and route.fetch.peer.id == "m0"
    assert (route.fetch.protocol, route.fetch.tokens, route.fetch.blocks) == ("shm", 960, 60)
    assert route.estimate.source == "peer"
    assert route.estimate.cost == pytest.approx(1000 - 960 + 0.05 * 960)  # in tokens: no rate measured
    # without an endpoint m1 cannot be fetched into: it recomputes all 1000 tokens, still less than
    # m0's 40 and its queue (1320); with 14 open requests on m0 (976) the queue is worth waiting
    private = fetchable(instance("m1"), endpoint={})
    request = dataclasses.replace(request, holders=[m0, private])
    route = sel.route([m0, private], request)
    assert route.decode.id == "m1" and route.fetch is None and route.estimate.source == "recompute"
    sel.in_flight["m0"] = 14
    assert sel.route([m0, private], request).decode.id == "m0"


def test_a_fetch_is_planned_only_when_it_costs_less_than_the_recompute() -> None:
    """In seconds: m1 computes a token in 1 ms; a fetched block costs it what it measured."""
    policy = PrefixCache("prefill", PrefixWeights(), random.Random(0))
    policy.fetch_protocol = fetch_protocol
    m0 = fetchable(instance("m0"))
    for per_block, fetches in ((0.002, True), (0.02, False)):  # 16 ms of compute per block
        m1 = fetchable(instance("m1"))
        m1.rates = RatesInfo(prefill_s_per_token=0.001, fetch_s_per_block=per_block)
        request = held(1000, [m0, m1], m0=640)
        plan = policy.fetch_plan(m1, request, 0.001)
        assert (plan is not None) == fetches
        work = policy.prefill_work(m1, request, 0.001)
        if plan is not None:
            assert plan.cost == pytest.approx(40 * per_block) and plan.saved == pytest.approx(0.64)
            assert work == pytest.approx(0.36 + 40 * per_block)
        else:
            assert work == pytest.approx(1.0)
    # unmeasured: the holder's measured write and its host tier's read-back of what it holds there
    m0.rates = RatesInfo(transfer_s_per_block={"shm": 0.0005}, host_read_s_per_block=0.001)
    m1 = fetchable(instance("m1"))
    tiered = dataclasses.replace(held(1000, [m0, m1], m0=320), tier_tokens={"m0": 320})
    plan = best_fetch(m1, tiered, PrefixWeights(), lambda i: 0.001, True, fetch_protocol)
    assert plan is not None and plan.tokens == 640 and plan.blocks == 40
    assert plan.cost == pytest.approx(40 * 0.0005 + 20 * 0.001)


def test_a_holder_inside_a_long_step_costs_its_step_and_is_not_fetched_from() -> None:
    """The holder pins blocks between its engine steps, so a fetch first waits for the step in
    progress: its registration's ``step_tokens`` at its prefill rate. Inside a long prefill step
    (576 tokens at 1 ms: 0.576 s) the fetch (0.08 s) costs more than computing the 640 tokens on
    the fetcher (0.64 s): not planned, the fetcher computes. Decoding (a 1-token step), it is, and
    the price it was planned at (wait included) is what the fetcher's budget follows."""
    policy = PrefixCache("prefill", PrefixWeights(), random.Random(0))
    policy.fetch_protocol = fetch_protocol
    m0, m1 = fetchable(instance("m0")), fetchable(instance("m1"))
    m0.rates = RatesInfo(prefill_s_per_token=0.001)
    m1.rates = RatesInfo(prefill_s_per_token=0.001, fetch_s_per_block=0.002)
    request = held(1000, [m0, m1], m0=640)
    m0.load.step_tokens = 576
    assert policy.fetch_plan(m1, request, 0.001) is None
    assert policy.prefill_work(m1, request, 0.001) == pytest.approx(1.0)  # all computed
    m0.load.step_tokens = 1
    plan = policy.fetch_plan(m1, request, 0.001)
    assert plan is not None and plan.wait == pytest.approx(0.001)
    assert plan.cost == pytest.approx(0.001 + 40 * 0.002) and plan.expect_s == plan.cost
    # in tokens (nobody measured a prefill rate) the step's tokens are the wait: 620 + 0.05 x 640
    # > 640 computed, so not planned; and a plan in tokens tells the fetcher no seconds
    m0.rates = m1.rates = None
    m0.load.step_tokens = 620
    assert policy.fetch_plan(m1, request) is None
    m0.load.step_tokens = 64
    plan = policy.fetch_plan(m1, request)
    assert plan is not None and plan.cost == pytest.approx(64 + 0.05 * 640) and plan.expect_s is None


def test_a_fetch_starts_after_what_the_instance_holds_itself_and_the_best_peer_wins() -> None:
    m0, m1, m2 = fetchable(instance("m0")), fetchable(instance("m1")), fetchable(instance("m2"))
    request = dataclasses.replace(held(1000, [m0, m1, m2], m0=480, m1=800, m2=160), tier_tokens={"m2": 160})
    plan = best_fetch(m2, request, PrefixWeights(transfer=0.05), lambda i: 1.0, False, fetch_protocol)
    assert plan is not None and plan.peer.id == "m1"  # the longer run
    assert plan.tokens == 800 - 320  # after m2's own pool and host tier
    short = held(40, [m0, m1], m0=32)
    assert best_fetch(m1, short, PrefixWeights(), lambda i: 1.0, False, fetch_protocol) is not None
    assert (
        best_fetch(m1, held(16, [m0, m1], m0=16), PrefixWeights(), lambda i: 1.0, False, fetch_protocol)
        is None
    )


def test_a_prefill_instance_fetches_what_its_decode_instance_holds() -> None:
    """Splitwise: D holds a chat's earlier turns, P (restarted, or its pool evicted them) none: P
    fetches them from D instead of computing them, and writes D only what D lacks."""
    p0 = fetchable(instance("p0", "prefill"))
    d0 = fetchable(instance("d0", "decode"))
    sel = Selector("prefix_cache", "prefix_cache")
    route = sel.route([p0, d0], held(1000, [p0, d0], d0=960))
    assert (route.prefill.id, route.decode.id) == ("p0", "d0")
    assert route.fetch is not None and route.fetch.peer.id == "d0" and route.estimate.source == "peer"
    unfetchable = fetchable(instance("p0", "prefill"), endpoint={})  # a P started without --switchable
    route = sel.route([unfetchable, d0], held(1000, [unfetchable, d0], d0=960))
    assert route.fetch is None and route.estimate.source == "recompute"


def test_a_decode_instances_tiers_are_read_back_not_moved() -> None:
    """A pair's transfer counts only what D's pool and tiers lack; its tiers at their read-back."""
    policy = PrefixCache("prefill", PrefixWeights(transfer=0.05, host_tier=0.1), random.Random(0))
    p0, d0 = instance("p0", "prefill"), instance("d0", "decode")
    plain = PolicyRequest("tiny", text="x", num_tokens=1000)
    tiered = dataclasses.replace(plain, tier_tokens={"d0": 640})
    assert policy.transfer_cost(p0, d0, plain) == pytest.approx(0.05 * 1000)
    assert policy.transfer_cost(p0, d0, tiered) == pytest.approx(0.05 * 360 + 0.1 * 640)


def test_the_router_counts_a_pick_that_fetches_as_source_peer() -> None:
    m0, m1 = fetchable(instance("m0")), fetchable(instance("m1"))
    m1.rates = RatesInfo(prefill_s_per_token=0.001, fetch_s_per_block=0.002)
    metrics = RouterMetrics()
    metrics.watch_live(SimpleNamespace(cached=[m0, m1]))
    sel = Selector("prefix_cache", "prefix_cache")
    sel.in_flight["m0"] = 20
    request = held(1000, [m0, m1], m0=960)
    route = sel.route([m0, m1], request)
    assert route.fetch is not None
    metrics.on_prefix(route, request)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in parse(metrics.render().decode())
        for s in f.samples
    }
    assert samples[("pdserve_route_picks_total", (("priced", "measured"), ("source", "peer")))] == 1
    assert samples[("pdserve_instance_fetch_seconds_per_block", (("instance", "m1"),))] == 0.002
    # 40 tokens computed at 1 ms, 60 blocks fetched at 2 ms
    assert samples[("pdserve_route_estimate_seconds_sum", ())] == pytest.approx(0.04 + 0.12)
