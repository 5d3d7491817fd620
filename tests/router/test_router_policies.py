"""Instance selection: the policies (the registry, prefix_affinity) and the pair rules (pure logic, no Redis)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from router_support import instance

from pdserve.errors import InvalidRequestError
from pdserve.router.api.errors import ModelNotFoundError, NoCapacityError
from pdserve.router.routing.policies import POLICIES, PolicyRequest, PrefixCache, PrefixWeights, make_policy
from pdserve.router.routing.policies.least_load import LeastLoad
from pdserve.router.routing.policies.prefix_affinity import (
    MAX_EXTRA_LOAD,
    PREFIX_CHARS,
    PrefixAffinity,
    prefix_key,
    rank,
)
from pdserve.router.routing.policies.simple import Random, RoundRobin
from pdserve.router.routing.selection import Selector, kv_mismatch, resolve_model, transfer_protocol
from pdserve.scheduler.registration import KVInfo, RatesInfo

TINY = PolicyRequest("tiny")
"""A request of model tiny whose prompt the router does not know (the request-blind policies)."""


def test_round_robin_cycles_in_order() -> None:
    rr = RoundRobin()
    infos = [instance(f"d{i}", "decode") for i in range(3)]
    assert [rr.pick(infos, {}, TINY).id for _ in range(7)] == ["d0", "d1", "d2", "d0", "d1", "d2", "d0"]


def test_random_picks_every_candidate() -> None:
    policy = Random(random.Random(0))
    infos = [instance(f"d{i}", "decode") for i in range(3)]
    assert {policy.pick(infos, {}, TINY).id for _ in range(100)} == {"d0", "d1", "d2"}


def test_least_load_uses_heartbeat_load_and_in_flight() -> None:
    policy = LeastLoad("decode", random.Random(0))
    busy = instance("d0", "decode", running=3, waiting=2)
    idle = instance("d1", "decode", running=1)
    assert policy.pick([busy, idle], {}, TINY).id == "d1"
    assert policy.pick([busy, idle], {"d1": 5}, TINY).id == "d0"  # this router's own requests count too
    assert policy.pick([busy, idle], {"d1": 4}, TINY).id in ("d0", "d1")  # 5 vs 5: a tie


def test_a_prefill_instances_hand_offs_count_as_its_load() -> None:
    """``load.handing_off`` (prefills whose KV is still on its way, no longer ``waiting``) holds
    KV blocks and transfers: both policies still place a prompt on the prefill instance without."""
    handing = instance("p0", "prefill")
    handing.load.handing_off = 3
    idle = instance("p1", "prefill")
    least_load, prefix_cache = (
        LeastLoad("prefill", random.Random(0)),
        PrefixCache("prefill", rng=random.Random(0)),
    )
    request = PolicyRequest("tiny", num_tokens=100)
    assert {least_load.pick([handing, idle], {}, TINY).id for _ in range(20)} == {"p1"}  # a tie would spread
    assert {prefix_cache.pick([handing, idle], {}, request).id for _ in range(20)} == {"p1"}


def test_least_load_tiebreaks() -> None:
    decode = LeastLoad("decode", random.Random(0))
    roomy = instance("d0", "decode", free_blocks=90)
    tight = instance("d1", "decode", free_blocks=10)
    assert decode.pick([tight, roomy], {}, TINY).id == "d0"  # free KV blocks break a tie
    prefill = LeastLoad("prefill", random.Random(0))
    queued = instance("p0", "prefill", waiting_prefill_tokens=5000, free_blocks=90)
    empty = instance("p1", "prefill", waiting_prefill_tokens=0, free_blocks=10)
    assert prefill.pick([queued, empty], {}, TINY).id == "p1"  # prefill compares queued prompt tokens first
    twins = [instance("d0", "decode"), instance("d1", "decode")]
    assert {decode.pick(twins, {}, TINY).id for _ in range(50)} == {"d0", "d1"}  # exact ties spread


def test_least_load_counts_in_flight_through_the_selector() -> None:
    sel = Selector("least_load", "least_load")
    live = [instance("m0"), instance("m1")]
    picks = []
    for _ in range(4):  # what the dispatcher does per request: pick, then count it in flight
        route = sel.route(live, TINY)
        sel.in_flight[route.decode.id] = sel.in_flight.get(route.decode.id, 0) + 1
        picks.append(route.decode.id)
    assert sorted(picks) == ["m0", "m0", "m1", "m1"]


def test_make_policy() -> None:
    assert isinstance(make_policy("round_robin", "decode"), RoundRobin)
    assert isinstance(make_policy("least_load", "prefill"), LeastLoad)
    assert isinstance(make_policy("prefix_affinity", "prefill"), PrefixAffinity)
    assert isinstance(make_policy("prefix_cache", "prefill"), PrefixCache)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest", "decode")


def test_every_registered_policy_is_a_router_flag_value() -> None:
    from pdserve.router import RouterSettings

    assert list(POLICIES) == ["prefix_cache", "least_load", "prefix_affinity", "round_robin", "random"]
    for name in POLICIES:
        s = RouterSettings(prefill_policy=name, decode_policy=name)
        sel = Selector(s.prefill_policy, s.decode_policy)
        assert sel.route([instance("p0", "prefill"), instance("d0", "decode")], TINY).instance_ids == (
            "p0",
            "d0",
        )


# -- prefix_affinity -------------------------------------------------------------------------------

SYSTEM = "You are a helpful assistant. " * 20  # longer than the key's prefix


def text(prompt: str) -> PolicyRequest:
    return PolicyRequest("tiny", text=prompt)


def test_the_same_prefix_goes_to_the_same_instance_on_every_router() -> None:
    live = [instance(f"m{i}") for i in range(5)]
    a, b = PrefixAffinity("decode"), PrefixAffinity("decode")  # two routers: no shared state
    picks = {a.pick(live, {}, text(SYSTEM + tail)).id for tail in ("hi", "bye", "what is 2+2?")}
    picks |= {b.pick(live, {}, text(SYSTEM + "another question")).id}
    assert len(picks) == 1  # only the first PREFIX_CHARS characters count
    assert len(SYSTEM) > PREFIX_CHARS
    # the candidates' order does not matter, and an instance that is not preferred may leave
    preferred = picks.pop()
    assert b.pick(list(reversed(live)), {}, text(SYSTEM)).id == preferred
    assert b.pick([i for i in live if i.id in (preferred, "m0", "m1")], {}, text(SYSTEM)).id == preferred
    # token-id prompts and chats have keys too
    ids = PolicyRequest("tiny", token_ids=list(range(200)))
    assert a.pick(live, {}, ids).id == b.pick(live, {}, PolicyRequest("tiny", token_ids=list(range(100)))).id
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    later = [*chat, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert (
        a.pick(live, {}, PolicyRequest("tiny", messages=chat)).id
        == b.pick(live, {}, PolicyRequest("tiny", messages=later)).id
    )


def test_different_prefixes_spread_over_the_instances() -> None:
    live = [instance(f"m{i}") for i in range(4)]
    policy = PrefixAffinity("decode")
    counts: dict[str, int] = {}
    for i in range(400):
        pick = policy.pick(live, {}, text(f"user {i}: tell me a story"))
        counts[pick.id] = counts.get(pick.id, 0) + 1
    assert set(counts) == {"m0", "m1", "m2", "m3"}
    assert max(counts.values()) < 150, counts  # 100 each on average
    assert prefix_key(text("a")) != prefix_key(
        PolicyRequest("tiny", messages=[{"role": "user", "content": "a"}])
    )


def test_an_overloaded_preferred_instance_is_skipped() -> None:
    names = [f"m{i}" for i in range(4)]
    request = text(SYSTEM)
    key = prefix_key(request)
    assert key is not None
    first, second = (info.id for info in rank(key, [instance(n) for n in names])[:2])
    policy = PrefixAffinity("decode")

    def pick(running: dict[str, int], in_flight: dict[str, int] | None = None) -> str:
        live = [instance(n, running=running.get(n, 0)) for n in names]
        return policy.pick(live, in_flight or {}, request).id

    assert pick({first: MAX_EXTRA_LOAD}) == first  # within the bound: affinity holds
    assert pick({first: MAX_EXTRA_LOAD + 1}) == second  # above it: the prefix's next instance
    assert pick({}, {first: MAX_EXTRA_LOAD + 1}) == second  # this router's own requests count too
    busy = {n: MAX_EXTRA_LOAD + 1 for n in names if n not in (first, second)} | {first: 50, second: 50}
    assert pick(busy) not in (first, second)  # both far above the least loaded: a less busy one


def test_a_request_without_a_prompt_is_placed_by_least_load() -> None:
    policy = PrefixAffinity("decode")
    busy, idle = instance("d0", "decode", running=3), instance("d1", "decode")
    assert prefix_key(TINY) is None
    assert {policy.pick([busy, idle], {}, TINY).id for _ in range(10)} == {"d1"}


# -- pair rules ------------------------------------------------------------------------------------


def test_shm_only_on_one_host() -> None:
    p = instance("p0", "prefill", host="a", protocols=("shm", "tcp"))
    same = instance("d0", "decode", host="a", protocols=("tcp", "shm"))
    other = instance("d1", "decode", host="b", protocols=("shm", "tcp"))
    shm_only = instance("d2", "decode", host="b", protocols=("shm",))
    assert transfer_protocol(p, same) == "shm"
    assert transfer_protocol(p, other) == "tcp"
    assert transfer_protocol(p, shm_only) is None
    rdma_first = instance("p1", "prefill", host="a", protocols=("rdma", "tcp"))
    assert (
        transfer_protocol(rdma_first, instance("d3", "decode", host="b", protocols=("tcp", "rdma"))) == "rdma"
    )


def test_cuda_ipc_only_on_one_host_and_never_across() -> None:
    """cuda_ipc, like shm, reaches only a cache on the same host: across hosts the pair takes the
    first other protocol both offer, or is not made."""
    p = instance("p0", "prefill", host="a", protocols=("cuda_ipc", "tcp"))
    same = instance("d0", "decode", host="a", protocols=("tcp", "cuda_ipc"))
    other = instance("d1", "decode", host="b", protocols=("cuda_ipc", "tcp"))
    ipc_only = instance("d2", "decode", host="b", protocols=("cuda_ipc",))
    assert transfer_protocol(p, same) == "cuda_ipc"
    assert transfer_protocol(p, other) == "tcp"
    assert transfer_protocol(p, ipc_only) is None
    tcp_first = instance("p1", "prefill", host="a", protocols=("tcp", "cuda_ipc"))
    assert transfer_protocol(tcp_first, same) == "cuda_ipc"  # one host: the one-host copy first


def test_a_cpu_cache_and_a_gpu_cache_are_never_paired(caplog) -> None:
    """No transport moves bytes between host memory and a GPU cache (their layouts may match, their
    transports do not): a CPU prefill never hands off to a CUDA decode. A registration without a
    device (an older worker) is a CPU one."""
    sel = Selector("round_robin", "round_robin")
    p0 = instance("p0", "prefill", host="a", protocols=("shm", "cuda_ipc"))
    cpu = instance("d0", "decode", host="a", protocols=("shm", "cuda_ipc"))
    gpu = instance("d1", "decode", host="a", protocols=("shm", "cuda_ipc"))
    gpu.kv.device = "cuda"
    assert kv_mismatch(p0, gpu) == "p0 with d1: different KV caches (device cpu vs cuda)"
    assert kv_mismatch(p0, cpu) is None and KVInfo.model_fields["device"].default == "cpu"
    with caplog.at_level("WARNING", logger="pdserve.router.routing.selection"):
        route = sel.route([p0, gpu], TINY)
    assert route.prefill is None and route.decode.id == "d1"  # d1 serves it alone
    assert "not pairing p0 with d1: different KV caches (device cpu vs cuda)" in caplog.text
    for _ in range(4):
        route = sel.route([p0, cpu, gpu], TINY)
        assert (route.prefill.id, route.decode.id, route.protocol) == ("p0", "d0", "shm")
    p_gpu = instance("p1", "prefill", host="a", protocols=("cuda_ipc",))
    p_gpu.kv.device = "cuda"
    gpu_only = instance("d2", "decode", host="a", protocols=("cuda_ipc",))
    gpu_only.kv.device = "cuda"
    route = sel.route([p_gpu, gpu_only], TINY)
    assert (route.prefill.id, route.decode.id, route.protocol) == ("p1", "d2", "cuda_ipc")


def test_splitwise_pair_and_protocol() -> None:
    sel = Selector("round_robin", "round_robin")
    live = [instance("p0", "prefill", host="a"), instance("d0", "decode", host="a"), instance("m0", "mixed")]
    route = sel.route(live, TINY)
    assert (route.prefill.id, route.decode.id, route.protocol) == ("p0", "d0", "shm")
    assert route.entry.id == "p0" and route.instance_ids == ("p0", "d0")


def test_instances_with_different_kv_geometry_are_never_paired(caplog) -> None:
    sel = Selector("round_robin", "round_robin")
    p0 = instance("p0", "prefill", host="a")
    d16 = instance("d0", "decode", host="a")
    d32 = instance("d1", "decode", host="a")
    d32.kv.block_size = 32
    with caplog.at_level("WARNING", logger="pdserve.router.routing.selection"):
        routes = [sel.route([p0, d32], TINY) for _ in range(3)]
    assert all(r.prefill is None and r.decode.id == "d1" for r in routes)  # d1 serves it alone
    assert "not pairing p0 with d1: different KV caches (block_size 16 vs 32)" in caplog.text
    assert caplog.text.count("not pairing") == 1  # said once, not per request
    for _ in range(4):
        route = sel.route([p0, d16, d32], TINY)
        assert (route.prefill.id, route.decode.id) == ("p0", "d0")  # only the compatible partner
    d32 = d32.model_copy(deep=True)  # a new registration value (the selector checks each once)
    d32.kv.block_size, d32.kv.dtype = 16, "bfloat16"
    assert sel.route([p0, d32], TINY).prefill is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_layers", 4),  # another model under the same served name: same block size and dtype
        ("num_kv_heads", 4),
        ("head_dim", 16),
        ("block_bytes", 8192),
        ("num_layers", None),  # a worker older than the field: its geometry is not assumed equal
        ("device", "cuda"),  # a GPU cache: no transport moves bytes between it and host memory
    ],
)
def test_instances_differing_in_any_kv_geometry_are_never_paired(field: str, value, caplog) -> None:
    sel = Selector("round_robin", "round_robin")
    p0, same, other = (
        instance(i, r, host="a") for i, r in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    )
    setattr(other.kv, field, value)
    with caplog.at_level("WARNING", logger="pdserve.router.routing.selection"):
        route = sel.route([p0, other], TINY)
    assert route.prefill is None and route.decode.id == "d1"  # d1 serves it alone, never paired
    assert f"not pairing p0 with d1: different KV caches ({field} " in caplog.text
    for _ in range(4):
        route = sel.route([p0, same, other], TINY)
        assert (route.prefill.id, route.decode.id) == ("p0", "d0")  # only the same geometry pairs


def test_instances_of_two_weight_precisions_are_never_paired(caplog) -> None:
    """--weights int8 on one side: the decode side would continue on other numbers. A worker that
    does not say (None, before int8 existed) is float32."""
    sel = Selector("round_robin", "round_robin")
    p0, older, int8 = (
        instance(i, r, host="a") for i, r in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    )
    p0.kv.weights, older.kv.weights, int8.kv.weights = "f32", None, "int8"
    with caplog.at_level("WARNING", logger="pdserve.router.routing.selection"):
        route = sel.route([p0, int8], TINY)
    assert route.prefill is None and route.decode.id == "d1"
    assert "not pairing p0 with d1: different KV caches (weights f32 vs int8)" in caplog.text
    for _ in range(4):
        route = sel.route([p0, older, int8], TINY)
        assert (route.prefill.id, route.decode.id) == ("p0", "d0")
    p0 = p0.model_copy(deep=True)  # a new registration value (the selector checks each once)
    p0.kv.weights = "int8"
    assert (sel.route([p0, int8], TINY).prefill.id, sel.route([p0, int8], TINY).decode.id) == ("p0", "d1")


def test_pairs_without_a_common_protocol_are_skipped() -> None:
    sel = Selector("round_robin", "round_robin")
    lonely = instance("p0", "prefill", host="a", protocols=("shm",))
    ok = instance("p1", "prefill", host="b", protocols=("tcp",))
    d = instance("d0", "decode", host="c", protocols=("shm", "tcp"))
    for _ in range(3):
        route = sel.route([lonely, ok, d], TINY)
        assert (route.prefill.id, route.decode.id, route.protocol) == ("p1", "d0", "tcp")
    # nobody can pair: the decode instance serves the whole request
    route = sel.route([lonely, d], TINY)
    assert route.prefill is None and route.decode.id == "d0"


def test_fallbacks_without_prefill() -> None:
    sel = Selector("round_robin", "round_robin")
    assert sel.route([instance("m0", "mixed")], TINY).instance_ids == ("m0",)
    assert sel.route([instance("d0", "decode")], TINY).instance_ids == ("d0",)
    # mixed preferred to decode-only when there is no prefill
    assert sel.route([instance("d0", "decode"), instance("m0", "mixed")], TINY).instance_ids == ("m0",)
    with pytest.raises(NoCapacityError, match="no decode or mixed"):
        sel.route([instance("p0", "prefill")], TINY)


def test_aggregated_fallback_is_said_and_can_be_turned_off(caplog) -> None:
    decode, prefill_elsewhere = (
        instance("d0", "decode", host="a"),
        instance("p0", "prefill", host="b", protocols=("shm",)),
    )
    with caplog.at_level("WARNING", logger="pdserve.router.routing.selection"):
        route = Selector("round_robin", "round_robin").route([decode], TINY)
    assert route.mode == "aggregated" and route.headers() == {
        "x-pdserve-mode": "aggregated",
        "x-pdserve-decode-instance": "d0",
    }
    assert "no prefill instance is live: decode instances serve whole requests (degraded" in caplog.text
    strict = Selector("round_robin", "round_robin", aggregated_fallback=False)
    for live in ([decode], [decode, prefill_elsewhere]):
        with pytest.raises(NoCapacityError, match="--no-aggregated-fallback"):
            strict.route(live, TINY)
    assert strict.route([decode, instance("m0", "mixed")], TINY).mode == "mixed"  # mixed is not a fallback
    pair = strict.route([decode, instance("p1", "prefill", host="a")], TINY)
    assert pair.mode == "splitwise" and pair.headers()["x-pdserve-prefill-instance"] == "p1"


def test_draining_is_never_picked() -> None:
    sel = Selector("round_robin", "round_robin")
    live = [
        instance("p0", "prefill", draining=True),
        instance("p1", "prefill"),
        instance("d0", "decode", draining=True),
        instance("d1", "decode"),
        instance("m0", draining=True),
    ]
    for _ in range(5):
        assert sel.route(live, TINY).instance_ids == ("p1", "d1")
    with pytest.raises(NoCapacityError, match="draining"):
        sel.route([instance("m0", draining=True)], TINY)


def test_model_and_exclusion() -> None:
    sel = Selector("round_robin", "round_robin")
    live = [instance("a0", model="a"), instance("b0", model="b"), instance("b1", model="b")]
    assert {sel.route(live, PolicyRequest("b")).decode.id for _ in range(4)} == {"b0", "b1"}
    assert {sel.route(live, PolicyRequest("b"), exclude={"b0"}).decode.id for _ in range(4)} == {"b1"}
    assert (
        sel.route(live, PolicyRequest("b"), exclude={"b0", "b1"}).decode.model == "b"
    )  # exclusion is a preference
    assert resolve_model(live, "a") == "a"
    with pytest.raises(ModelNotFoundError):
        resolve_model(live, "c")
    with pytest.raises(InvalidRequestError, match="model is required"):
        resolve_model(live, None)
    assert resolve_model(live[:1], None) == "a"
    with pytest.raises(NoCapacityError):
        resolve_model([], "a")


# -- prefix_cache ----------------------------------------------------------------------------------


def cached(num_tokens: int, **hits: int) -> PolicyRequest:
    """A request of ``num_tokens`` prompt tokens; ``hits``: instance id -> its cached tokens."""
    return PolicyRequest("tiny", text="x", num_tokens=num_tokens, cached_tokens=hits)


def prefix_cache(**weights: float) -> PrefixCache:
    return PrefixCache("prefill", PrefixWeights(**weights), random.Random(0))


def test_prefix_cache_weighs_the_saved_prefill_against_load() -> None:
    policy = prefix_cache(load_tokens=64)
    a, b = instance("m0"), instance("m1")
    assert policy.pick([a, b], {}, cached(1000, m1=800)).id == "m1"
    # m1 saves 800 tokens; 12 more open requests cost 12 x 64 = 768 < 800: still m1; 13 cost more
    assert policy.pick([a, b], {"m1": 12}, cached(1000, m1=800)).id == "m1"
    assert policy.pick([a, b], {"m1": 13}, cached(1000, m1=800)).id == "m0"
    queued = instance("m1", waiting_prefill_tokens=900)  # a queue longer than what it saves
    assert policy.pick([a, queued], {}, cached(1000, m1=800)).id == "m0"
    assert {policy.pick([a, b], {}, cached(1000)).id for _ in range(40)} == {"m0", "m1"}  # no hits: spread


def test_prefix_cache_counts_a_host_tier_hit_at_its_read_back_cost() -> None:
    """Tokens an instance's host tier holds after its cached prefix cost ``host_tier`` of a computed
    token each: more than the pool's, far less than a recompute."""
    policy = prefix_cache(load_tokens=64, host_tier=0.1)
    a, b, c = instance("m0"), instance("m1"), instance("m2")
    tiered = dataclasses.replace(cached(1000, m1=200), tier_tokens={"m1": 600})
    assert policy.prefill_tokens(b, tiered) == 1000 - 200 - 0.9 * 600
    assert policy.pick([a, b], {}, tiered).id == "m1"
    # the same 800 tokens in m2's pool beat 200 in m1's pool and 600 in its tier
    both = dataclasses.replace(cached(1000, m1=200, m2=800), tier_tokens={"m1": 600})
    assert policy.pick([b, c], {}, both).id == "m2"
    # m1's tier saves 540 tokens of work: 8 open requests (512) are worth it, 9 (576) are not
    assert (
        policy.pick([a, b], {"m1": 8}, dataclasses.replace(cached(1000), tier_tokens={"m1": 600})).id == "m1"
    )
    assert (
        policy.pick([a, b], {"m1": 9}, dataclasses.replace(cached(1000), tier_tokens={"m1": 600})).id == "m0"
    )


def test_prefix_cache_picks_the_pair_jointly_and_prefers_a_decode_holding_the_prompt() -> None:
    policy = prefix_cache(load_tokens=64, transfer=0.05)
    p0, p1 = instance("p0", "prefill"), instance("p1", "prefill")
    d0, d1 = instance("d0", "decode"), instance("d1", "decode")
    pairs = [(p, d) for p in (p0, p1) for d in (d0, d1)]
    choice = policy.pick_pair(pairs, {}, cached(1200, p1=1000, d0=1100))
    assert (choice.prefill.id, choice.decode.id) == ("p1", "d0")
    # d0 saves 0.05 x 1100 = 55 tokens of transfer: one open request (64) outweighs it
    choice = policy.pick_pair(pairs, {"d0": 1}, cached(1200, p1=1000, d0=1100))
    assert (choice.prefill.id, choice.decode.id) == ("p1", "d1")
    only = policy.pick_pair([(p0, d1)], {}, cached(1200, p1=1000, d0=1100))
    assert (only.prefill.id, only.decode.id) == ("p0", "d1")  # only usable pairs are considered


def test_conditional_disaggregation_prefills_on_the_decode_that_lacks_little() -> None:
    p0, d0, d1 = instance("p0", "prefill"), instance("d0", "decode"), instance("d1", "decode")
    pairs = [(p0, d0), (p0, d1)]
    request = cached(1000, d0=960)
    off = prefix_cache(local_prefill_tokens=0).pick_pair(pairs, {}, request)
    assert off.prefill is not None  # the default never prefills on decode
    on = prefix_cache(local_prefill_tokens=64).pick_pair(pairs, {}, request)
    assert on.prefill is None and on.decode.id == "d0"
    assert prefix_cache(local_prefill_tokens=32).pick_pair(pairs, {}, request).prefill is not None  # 40 > 32
    busy = prefix_cache(local_prefill_tokens=64).pick_pair(pairs, {"d0": 30}, request)
    assert busy.prefill is not None  # a loaded decode instance does not take the prefill too


def test_selector_routes_a_local_prefill_as_its_own_mode() -> None:
    sel = Selector("prefix_cache", "prefix_cache", weights=PrefixWeights(local_prefill_tokens=64))
    live = [instance("p0", "prefill"), instance("d0", "decode")]
    route = sel.route(live, cached(1000, d0=990))
    assert route.prefill is None and route.mode == "local" and route.local_prefill
    assert route.headers()["x-pdserve-mode"] == "local"
    assert sel.route(live, cached(1000, d0=100)).mode == "splitwise"
    assert sel.reads_prefix_index and not Selector("least_load", "least_load").reads_prefix_index


def test_the_default_policy_checks_a_pair_again_when_a_registration_changes() -> None:
    """The selector remembers which pairs can hand off, per registration value: a decode instance
    that re-registers with another KV geometry (or no common transport) is not paired any more, and
    one that becomes compatible again is."""
    sel = Selector("prefix_cache", "prefix_cache")
    p0, d0 = instance("p0", "prefill", host="a"), instance("d0", "decode", host="a")
    route = sel.route([p0, d0], TINY)
    assert (route.prefill.id, route.decode.id) == ("p0", "d0")
    assert sel.route([p0, d0], TINY).prefill is not None  # the remembered answer
    d0_new = d0.model_copy(deep=True)
    d0_new.kv.block_size = 32
    assert sel.route([p0, d0_new], TINY).prefill is None  # a new value: checked again
    elsewhere = d0.model_copy(deep=True)
    elsewhere.host, elsewhere.transfer.protocols = "b", ["shm"]  # another host, shm only
    assert sel.route([p0, elsewhere], TINY).prefill is None
    assert sel.route([p0, d0.model_copy(deep=True)], TINY).prefill.id == "p0"


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("weights_digest", "fedcba9876543210fedcba9876543210", "weights 0123456789ab vs fedcba987654"),
        ("weights_digest", None, "weights 0123456789ab vs unknown"),  # an older worker: not assumed equal
        ("tokenizer", "abcdef", "tokenizer unknown vs abcdef"),
    ],
)
def test_instances_of_two_models_under_one_name_are_never_paired(
    field: str, value, said: str, caplog
) -> None:
    """Same geometry and precision, another checkpoint or tokenizer (a rolling upgrade under one
    served name): the decode side would continue on, and cache, K/V another model computed."""
    sel = Selector("round_robin", "round_robin")
    p0, same, other = (
        instance(i, r, host="a") for i, r in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    )
    if field == "tokenizer":
        other.tokenizer = value
    else:
        setattr(other.kv, field, value)
    assert kv_mismatch(p0, other) == f"p0 with d1: different models ({said})"
    with caplog.at_level("WARNING", logger="pdserve.router.routing.selection"):
        route = sel.route([p0, other], TINY)
    assert route.prefill is None and route.decode.id == "d1"
    assert f"not pairing p0 with d1: different models ({said})" in caplog.text
    for _ in range(4):
        route = sel.route([p0, same, other], TINY)
        assert (route.prefill.id, route.decode.id) == ("p0", "d0")


def test_prefix_cache_counts_a_disk_tier_hit_at_its_read_back_cost() -> None:
    """Tokens an instance's disk tier holds after its pool and host tier cost ``disk_tier`` of a
    computed token each: a disk hit beats a recompute, a pool hit beats a disk hit."""
    policy = prefix_cache(load_tokens=64, host_tier=0.1, disk_tier=0.05)
    a, b, c = instance("m0"), instance("m1"), instance("m2")
    on_disk = dataclasses.replace(
        cached(1000, m1=100), tier_tokens={"m1": 200}, disk_tokens={"m1": 400, "m2": 800}
    )
    assert policy.prefill_tokens(b, on_disk) == 1000 - 100 - 0.9 * 200 - 0.95 * 400
    assert policy.prefill_tokens(c, on_disk) == 1000 - 0.95 * 800
    assert policy.pick([a, c], {}, on_disk).id == "m2"  # 800 tokens on disk against none
    pooled = dataclasses.replace(cached(1000, m1=800), disk_tokens={"m2": 800})
    assert policy.pick([b, c], {}, pooled).id == "m1"  # the same 800 in the pool cost less
    # m2's disk saves 760 tokens of work: 11 open requests (704) are worth it, 12 (768) are not
    disk_only = dataclasses.replace(cached(1000), disk_tokens={"m2": 800})
    assert policy.pick([a, c], {"m2": 11}, disk_only).id == "m2"
    assert policy.pick([a, c], {"m2": 12}, disk_only).id == "m0"


# -- prefix_cache with measured rates (the registration's ``rates``) ------------------------------------


def rated(info, **rates):
    """``info`` with the rates it measured (seconds per prompt token, per block read back or moved)."""
    info.rates = RatesInfo(**rates)
    return info


def test_a_measured_read_back_beats_a_recompute_only_when_it_is_faster() -> None:
    """Costs are seconds from the instances' own rates: a slow instance whose host tier holds most of
    the prompt beats a fast empty one when its measured read-back is quick, and loses when it is
    slow; the weights alone (no rates) always take the tier."""
    policy = prefix_cache(load_tokens=64, host_tier=0.1)
    request = dataclasses.replace(cached(1000), tier_tokens={"m1": 960})

    def fleet(host_read_s: float):
        fast = rated(instance("m0"), prefill_s_per_token=0.0001)  # 1000 tokens: 0.1 s
        slow = rated(instance("m1"), prefill_s_per_token=0.001, host_read_s_per_block=host_read_s)
        return [fast, slow]

    # m1: 40 tokens computed (0.04 s) + 60 blocks read at 0.5 ms (0.03 s) = 0.07 s < 0.1 s
    assert policy.prefill_cost(fleet(0.0005)[1], {}, request, 0.001) == pytest.approx(0.07)
    assert policy.pick(fleet(0.0005), {}, request).id == "m1"
    # at 2 ms a block the read-back alone takes 0.12 s: recomputing on m0 is faster
    assert policy.pick(fleet(0.002), {}, request).id == "m0"
    assert policy.pick([instance("m0"), instance("m1")], {}, request).id == "m1"  # by the weights


def test_a_measured_disk_read_back_is_weighed_against_a_recompute() -> None:
    policy = prefix_cache(load_tokens=64)
    request = dataclasses.replace(cached(1000, m0=200), disk_tokens={"m1": 800})
    same = {"prefill_s_per_token": 0.001}
    # m0 computes 800 tokens (0.8 s); m1 computes 200 (0.2 s) and reads 50 blocks from disk
    quick = [rated(instance("m0"), **same), rated(instance("m1"), **same, disk_read_s_per_block=0.01)]
    assert policy.pick(quick, {}, request).id == "m1"  # 0.2 + 0.5 s
    slow = [rated(instance("m0"), **same), rated(instance("m1"), **same, disk_read_s_per_block=0.02)]
    assert policy.pick(slow, {}, request).id == "m0"  # 0.2 + 1.0 s


def test_an_instance_without_rates_is_priced_at_the_fleets_median() -> None:
    """A fleet where some measured and some did not: the others' token costs are converted at the
    median measured prefill rate, so the weights' trade-offs hold in seconds too."""
    policy = prefix_cache(load_tokens=64)
    a = rated(instance("m0"), prefill_s_per_token=0.001)
    b = instance("m1")  # not measured yet: taken for a typical instance, 1 ms a token
    assert policy.token_price(b, 0.001) == 0.001 and policy.token_price(a, None) == 1.0
    assert policy.pick([a, b], {}, cached(1000, m1=800)).id == "m1"
    # the same thresholds as in tokens: 12 open requests (768 tokens) < 800 saved, 13 are more
    assert policy.pick([a, b], {"m1": 12}, cached(1000, m1=800)).id == "m1"
    assert policy.pick([a, b], {"m1": 13}, cached(1000, m1=800)).id == "m0"
    # m1 unmeasured, m0 slow and m2 fast: m1 is priced at their median (2 ms), between the two
    slow, fast = (
        rated(instance("m0"), prefill_s_per_token=0.003),
        rated(instance("m2"), prefill_s_per_token=0.001),
    )
    _, estimate = policy.choose([slow, b, fast], {}, cached(1000))
    assert (
        estimate.cost == pytest.approx(1.0) and estimate.measured and estimate.seconds
    )  # m2, by its own rate
    assert policy.prefill_cost(b, {}, cached(1000), 0.002) == pytest.approx(2.0)


def test_a_pair_is_priced_at_the_prefill_instances_measured_transfer_rate() -> None:
    """P's measured seconds per block over each pair's protocol: shm to a decode instance on its host
    is quick, tcp to another host slow, so a busier decode instance on P's host wins; by the weights
    (every transfer alike) the idle one does."""
    policy = prefix_cache(load_tokens=64, transfer=0.05)
    p0 = instance("p0", "prefill", host="h1")
    near, far = instance("d0", "decode", host="h1"), instance("d1", "decode", host="h2")
    pairs = [(p0, near), (p0, far)]
    in_flight = {"d0": 2}
    by_weights = policy.pick_pair(pairs, in_flight, cached(1000), transfer_protocol)
    assert by_weights.decode.id == "d1" and not by_weights.estimate.seconds
    rated(p0, prefill_s_per_token=0.001, transfer_s_per_block={"shm": 0.0001, "tcp": 0.05})
    choice = policy.pick_pair(pairs, in_flight, cached(1000), transfer_protocol)
    assert choice.decode.id == "d0" and choice.estimate.seconds and choice.estimate.measured
    # 1 s of prefill, 62.5 blocks by shm at 0.1 ms, 2 x 64 tokens of load on d0 at the median 1 ms
    assert choice.estimate.cost == pytest.approx(1.0 + 0.00625 + 0.128)
    assert choice.estimate.source == "recompute"


def test_the_route_carries_what_the_policy_expected() -> None:
    sel = Selector("prefix_cache", "prefix_cache")
    live = [
        rated(instance("m0"), prefill_s_per_token=0.001),
        rated(instance("m1"), prefill_s_per_token=0.001, host_read_s_per_block=0.0016),
    ]
    request = dataclasses.replace(cached(1000, m1=200), tier_tokens={"m1": 640})
    route = sel.route(live, request)
    assert route.decode.id == "m1" and route.estimate is not None
    # 160 tokens computed + 40 blocks read back at 1.6 ms
    assert route.estimate.cost == pytest.approx(0.16 + 0.064)
    assert (route.estimate.source, route.estimate.seconds, route.estimate.measured) == (
        "host_tier",
        True,
        True,
    )
    plain = sel.route([instance("m0"), instance("m1")], cached(1000, m1=200))
    assert plain.estimate is not None and not plain.estimate.seconds and plain.estimate.cost == 800
    assert plain.estimate.source == "cache_hit"
    assert Selector("least_load", "least_load").route(live, request).estimate is None
