"""Instance selection: the three policies and the pair rules (pure logic, no Redis)."""

from __future__ import annotations

import random

import pytest
from router_support import instance

from pdserve.errors import InvalidRequestError
from pdserve.router.errors import ModelNotFoundError, NoCapacityError
from pdserve.router.policies import LeastLoad, Random, RoundRobin, make_policy
from pdserve.router.selection import Selector, resolve_model, transfer_protocol


def test_round_robin_cycles_in_order() -> None:
    rr = RoundRobin()
    infos = [instance(f"d{i}", "decode") for i in range(3)]
    assert [rr.pick(infos, {}).id for _ in range(7)] == ["d0", "d1", "d2", "d0", "d1", "d2", "d0"]


def test_random_picks_every_candidate() -> None:
    policy = Random(random.Random(0))
    infos = [instance(f"d{i}", "decode") for i in range(3)]
    assert {policy.pick(infos, {}).id for _ in range(100)} == {"d0", "d1", "d2"}


def test_least_load_uses_heartbeat_load_and_in_flight() -> None:
    policy = LeastLoad("decode", random.Random(0))
    busy = instance("d0", "decode", running=3, waiting=2)
    idle = instance("d1", "decode", running=1)
    assert policy.pick([busy, idle], {}).id == "d1"
    assert policy.pick([busy, idle], {"d1": 5}).id == "d0"  # this router's own requests count too
    assert policy.pick([busy, idle], {"d1": 4}).id in ("d0", "d1")  # 5 vs 5: a tie


def test_least_load_tiebreaks() -> None:
    decode = LeastLoad("decode", random.Random(0))
    roomy = instance("d0", "decode", free_blocks=90)
    tight = instance("d1", "decode", free_blocks=10)
    assert decode.pick([tight, roomy], {}).id == "d0"  # free KV blocks break a tie
    prefill = LeastLoad("prefill", random.Random(0))
    queued = instance("p0", "prefill", waiting_prefill_tokens=5000, free_blocks=90)
    empty = instance("p1", "prefill", waiting_prefill_tokens=0, free_blocks=10)
    assert prefill.pick([queued, empty], {}).id == "p1"  # prefill compares queued prompt tokens first
    twins = [instance("d0", "decode"), instance("d1", "decode")]
    assert {decode.pick(twins, {}).id for _ in range(50)} == {"d0", "d1"}  # exact ties spread


def test_least_load_counts_in_flight_through_the_selector() -> None:
    sel = Selector("least_load", "least_load")
    live = [instance("m0"), instance("m1")]
    picks = []
    for _ in range(4):  # what the dispatcher does per request: pick, then count it in flight
        route = sel.route(live, "tiny")
        sel.in_flight[route.decode.id] = sel.in_flight.get(route.decode.id, 0) + 1
        picks.append(route.decode.id)
    assert sorted(picks) == ["m0", "m0", "m1", "m1"]


def test_make_policy() -> None:
    assert isinstance(make_policy("round_robin", "decode"), RoundRobin)
    assert isinstance(make_policy("least_load", "prefill"), LeastLoad)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest", "decode")


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


def test_splitwise_pair_and_protocol() -> None:
    sel = Selector("round_robin", "round_robin")
    live = [instance("p0", "prefill", host="a"), instance("d0", "decode", host="a"), instance("m0", "mixed")]
    route = sel.route(live, "tiny")
    assert (route.prefill.id, route.decode.id, route.protocol) == ("p0", "d0", "shm")
    assert route.entry.id == "p0" and route.instance_ids == ("p0", "d0")


def test_instances_with_different_kv_geometry_are_never_paired(caplog) -> None:
    sel = Selector("round_robin", "round_robin")
    p0 = instance("p0", "prefill", host="a")
    d16 = instance("d0", "decode", host="a")
    d32 = instance("d1", "decode", host="a")
    d32.kv.block_size = 32
    with caplog.at_level("WARNING", logger="pdserve.router.selection"):
        routes = [sel.route([p0, d32], "tiny") for _ in range(3)]
    assert all(r.prefill is None and r.decode.id == "d1" for r in routes)  # d1 serves it alone
    assert "not pairing p0 with d1: different KV caches (block_size 16 vs 32)" in caplog.text
    assert caplog.text.count("not pairing") == 1  # said once, not per request
    for _ in range(4):
        route = sel.route([p0, d16, d32], "tiny")
        assert (route.prefill.id, route.decode.id) == ("p0", "d0")  # only the compatible partner
    d32.kv.block_size, d32.kv.dtype = 16, "bfloat16"
    assert sel.route([p0, d32], "tiny").prefill is None


def test_pairs_without_a_common_protocol_are_skipped() -> None:
    sel = Selector("round_robin", "round_robin")
    lonely = instance("p0", "prefill", host="a", protocols=("shm",))
    ok = instance("p1", "prefill", host="b", protocols=("tcp",))
    d = instance("d0", "decode", host="c", protocols=("shm", "tcp"))
    for _ in range(3):
        route = sel.route([lonely, ok, d], "tiny")
        assert (route.prefill.id, route.decode.id, route.protocol) == ("p1", "d0", "tcp")
    # nobody can pair: the decode instance serves the whole request
    route = sel.route([lonely, d], "tiny")
    assert route.prefill is None and route.decode.id == "d0"


def test_fallbacks_without_prefill() -> None:
    sel = Selector("round_robin", "round_robin")
    assert sel.route([instance("m0", "mixed")], "tiny").instance_ids == ("m0",)
    assert sel.route([instance("d0", "decode")], "tiny").instance_ids == ("d0",)
    # mixed preferred to decode-only when there is no prefill
    assert sel.route([instance("d0", "decode"), instance("m0", "mixed")], "tiny").instance_ids == ("m0",)
    with pytest.raises(NoCapacityError, match="no decode or mixed"):
        sel.route([instance("p0", "prefill")], "tiny")


def test_aggregated_fallback_is_said_and_can_be_turned_off(caplog) -> None:
    decode, prefill_elsewhere = (
        instance("d0", "decode", host="a"),
        instance("p0", "prefill", host="b", protocols=("shm",)),
    )
    with caplog.at_level("WARNING", logger="pdserve.router.selection"):
        route = Selector("round_robin", "round_robin").route([decode], "tiny")
    assert route.mode == "aggregated" and route.headers() == {
        "x-pdserve-mode": "aggregated",
        "x-pdserve-decode-instance": "d0",
    }
    assert "no prefill instance is live: decode instances serve whole requests (degraded" in caplog.text
    strict = Selector("round_robin", "round_robin", aggregated_fallback=False)
    for live in ([decode], [decode, prefill_elsewhere]):
        with pytest.raises(NoCapacityError, match="--no-aggregated-fallback"):
            strict.route(live, "tiny")
    assert strict.route([decode, instance("m0", "mixed")], "tiny").mode == "mixed"  # mixed is not a fallback
    pair = strict.route([decode, instance("p1", "prefill", host="a")], "tiny")
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
        assert sel.route(live, "tiny").instance_ids == ("p1", "d1")
    with pytest.raises(NoCapacityError, match="draining"):
        sel.route([instance("m0", draining=True)], "tiny")


def test_model_and_exclusion() -> None:
    sel = Selector("round_robin", "round_robin")
    live = [instance("a0", model="a"), instance("b0", model="b"), instance("b1", model="b")]
    assert {sel.route(live, "b").decode.id for _ in range(4)} == {"b0", "b1"}
    assert {sel.route(live, "b", exclude={"b0"}).decode.id for _ in range(4)} == {"b1"}
    assert sel.route(live, "b", exclude={"b0", "b1"}).decode.model == "b"  # exclusion is a preference
    assert resolve_model(live, "a") == "a"
    with pytest.raises(ModelNotFoundError):
        resolve_model(live, "c")
    with pytest.raises(InvalidRequestError, match="model is required"):
        resolve_model(live, None)
    assert resolve_model(live[:1], None) == "a"
    with pytest.raises(NoCapacityError):
        resolve_model([], "a")
