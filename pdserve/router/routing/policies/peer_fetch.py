"""Fetch vs recompute: what taking a prompt's prefix from a peer costs the instance that prefills it,
against computing it there (``prefix_cache`` adds the cheaper to that instance's prefill cost).

An instance *i* holds the prompt's first ``own(i)`` tokens itself (its pool, host and disk tiers, by
the prefix index). A peer *j* of the same model and KV namespace that holds a longer leading run
(pool, host or disk tier), and can write into *i*'s cache over some transport (``fetch_protocol``:
*j*'s open transports, ``transfer.writes``, against *i*'s ``endpoint``), could write the blocks
after ``own(i)`` up to the last usable full block (the last prompt token is always computed). That
fetch of ``f`` tokens costs, in seconds: ``f / block_size`` × *i*'s measured seconds per fetched
block (``rates.fetch_s_per_block``: asking to checked, end to end), else *j*'s measured seconds per
block written over that transport plus its read-back of the blocks it holds below its pool, else
the transfer weight × ``f`` × p(i) (and the tier weights for *j*'s tiers); in tokens (nobody
measured a prefill rate) the weights alone. To that comes *j*'s wait: it pins the blocks between
its engine steps, so the fetch first waits for the step in progress, at most ``step_tokens(j)``
(its registration's load: its running decodes and the prompt tokens it has yet to compute, within
its step budget) × p(j) (in tokens, ``step_tokens(j)``): a holder inside a long prefill step costs
that step. It is planned only when the whole, wait included, is below computing those tokens on
*i* (``f × p(i)``); among peers, the one that saves most. The price in seconds travels to *i*
(``FetchHint.expect_s``), whose wait for the answer follows it (bounded: ``worker/peer_fetch.py``),
so a fetch that fails costs a bounded wait and then the recompute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pdserve.router.routing.policies.base import PolicyRequest, PrefixWeights
from pdserve.scheduler.registration import InstanceInfo

FetchProtocol = Callable[[InstanceInfo, InstanceInfo], "str | None"]
"""``(holder, fetcher)`` -> the transport the holder writes into the fetcher's cache over, or None
when it cannot (another model or KV geometry, no common transport)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FetchPlan:
    """A fetch ``prefix_cache`` priced below the recompute: ``peer`` writes ``tokens`` prompt
    tokens (whole blocks, after the fetcher's own) over ``protocol``."""

    peer: InstanceInfo
    protocol: str
    tokens: int
    blocks: int
    """The prompt's leading full blocks the peer holds (what the worker is told: it asks for those
    past its own)."""
    cost: float
    """The fetch's price (seconds, or tokens when nobody measured a prefill rate), ``wait``
    included."""
    saved: float
    """Computing those tokens on the fetcher instead (same unit)."""
    wait: float = 0.0
    """Of ``cost``, the peer's step in progress, which the fetch waits for (same unit)."""
    seconds: bool = False
    """``cost`` and ``saved`` are seconds (else tokens)."""

    @property
    def expect_s(self) -> float | None:
        """The seconds the fetch is expected to take, wait included (None: priced in tokens)."""
        return self.cost if self.seconds else None


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def best_fetch(
    target: InstanceInfo,
    request: PolicyRequest,
    weights: PrefixWeights,
    price: Callable[[InstanceInfo], float],
    seconds: bool,
    protocol: FetchProtocol,
) -> FetchPlan | None:
    """The fetch that saves ``target`` most against computing the same tokens, or None when no
    peer's holds beat its own or every fetch costs more. ``price(i)``: seconds per prompt token on
    *i* (1 when ``seconds`` is False: costs in tokens)."""
    n, bs = request.num_tokens, target.kv.block_size
    if not n or not bs or not request.holders:
        return None
    own = sum(m.get(target.id, 0) for m in (request.cached_tokens, request.tier_tokens, request.disk_tokens))
    usable = (n - 1) // bs * bs
    p = price(target)
    best: FetchPlan | None = None
    for peer in request.holders:
        if peer.id == target.id or peer.kv.block_size != bs:
            continue
        pool = request.cached_tokens.get(peer.id, 0)
        host = request.tier_tokens.get(peer.id, 0)
        held = pool + host + request.disk_tokens.get(peer.id, 0)
        span = (own, min(held, usable))
        tokens = span[1] - span[0]
        if tokens < bs:
            continue
        proto = protocol(peer, target)
        if proto is None:
            continue
        from_host, from_disk = _overlap(span, (pool, pool + host)), _overlap(span, (pool + host, held))
        wait = peer.load.step_tokens * price(peer)
        cost = wait + _price(target, peer, proto, tokens, from_host, from_disk, weights, price, seconds)
        saved = tokens * p
        if cost < saved and (best is None or saved - cost > best.saved - best.cost):
            best = FetchPlan(peer, proto, tokens, held // bs, cost, saved, wait, seconds)
    return best


def _price(
    target: InstanceInfo,
    peer: InstanceInfo,
    protocol: str,
    tokens: int,
    from_host: int,
    from_disk: int,
    w: PrefixWeights,
    price: Callable[[InstanceInfo], float],
    seconds: bool,
) -> float:
    """What fetching ``tokens`` from ``peer`` costs ``target`` (``from_host``, ``from_disk``: of
    them, those the peer holds in its host and disk tier)."""
    bs = target.kv.block_size
    if not seconds:
        return w.transfer * tokens + w.host_tier * from_host + w.disk_tier * from_disk
    mine, theirs = target.rates, peer.rates
    if mine is not None and mine.fetch_s_per_block is not None:  # end to end: it covers the peer's reads
        return tokens / bs * mine.fetch_s_per_block
    written = (theirs.transfer_s_per_block or {}).get(protocol) if theirs is not None else None
    move = tokens / bs * written if written is not None else w.transfer * tokens * price(target)
    host_read = theirs.host_read_s_per_block if theirs is not None else None
    disk_read = theirs.disk_read_s_per_block if theirs is not None else None
    move += from_host / bs * host_read if host_read is not None else w.host_tier * from_host * price(peer)
    move += from_disk / bs * disk_read if disk_read is not None else w.disk_tier * from_disk * price(peer)
    return move
