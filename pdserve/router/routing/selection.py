"""Which instances run a request: the model check, the pair rules, the transfer protocol.

Rules, in order:

1. Only live, non-draining instances of the requested model are candidates.
2. Splitwise when a prefill and a decode instance have the same KV geometry and model (:func:`kv_mismatch`)
   and share a KV transfer protocol: on one host ``shm`` or ``cuda_ipc`` when both offer it, else
   the first protocol of prefill's list that decode offers (those two never cross hosts). A prefill without any usable decode partner is skipped.
3. Otherwise one instance serves the whole request: a mixed one, else a decode one (decode-only
   fallback when there is no prefill instance). Prefill instances alone cannot serve: 503.

Pure logic over registration values, so it unit-tests without Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError
from pdserve.router.api.errors import ModelNotFoundError, NoCapacityError
from pdserve.router.routing.policies import Policy, PolicyRequest, PrefixCache, PrefixWeights, make_policy
from pdserve.router.routing.policies.peer_fetch import FetchPlan
from pdserve.router.routing.policies.prefix_cache import Estimate
from pdserve.scheduler.registration import InstanceInfo

logger = logging.getLogger(__name__)

SHM = "shm"
ONE_HOST = frozenset({SHM, "cuda_ipc"})  # protocols that reach only a cache on the same host
_WARN_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Route:
    """Where one attempt runs: ``prefill`` then ``decode`` (splitwise), or ``decode`` alone."""

    decode: InstanceInfo
    prefill: InstanceInfo | None = None
    protocol: str | None = None
    local_prefill: bool = False
    """A decode instance prefills the request itself by choice: its prefix cache holds all but a
    few of the prompt's tokens (conditional disaggregation, ``--local-prefill-tokens``)."""
    estimate: Estimate | None = None
    """What ``prefix_cache`` expected of this pick (None: another policy, or a single candidate)."""

    @property
    def entry(self) -> InstanceInfo:
        """The instance whose inbox receives the request."""
        return self.prefill or self.decode

    @property
    def fetch(self) -> FetchPlan | None:
        """The fetch from a peer the entry instance makes first (``prefix_cache``'s pick), if any."""
        return self.estimate.fetch if self.estimate is not None else None

    @property
    def instance_ids(self) -> tuple[str, ...]:
        return (self.decode.id,) if self.prefill is None else (self.prefill.id, self.decode.id)

    @property
    def mode(self) -> str:
        """``splitwise``, ``mixed``, ``local`` (a decode instance prefilling the little of the prompt
        its cache lacks) or ``aggregated`` (a decode instance serving a whole request: degraded)."""
        if self.prefill is not None:
            return "splitwise"
        if self.decode.role == "mixed":
            return "mixed"
        return "local" if self.local_prefill else "aggregated"

    def headers(self) -> dict[str, str]:
        """Response headers that say how the request was served (degraded service is visible)."""
        out = {"x-pdserve-mode": self.mode, "x-pdserve-decode-instance": self.decode.id}
        if self.prefill is not None:
            out["x-pdserve-prefill-instance"] = self.prefill.id
        return out


def transfer_protocol(prefill: InstanceInfo, decode: InstanceInfo) -> str | None:
    """How KV moves from ``prefill`` to ``decode``, or None when they share no usable protocol: on
    one host, the first one-host protocol (``shm``, ``cuda_ipc``) of prefill's list that decode
    offers, else the first other protocol of prefill's list that decode offers."""
    offered = decode.transfer.protocols
    if prefill.host == decode.host:
        local = next((p for p in prefill.transfer.protocols if p in ONE_HOST and p in offered), None)
        if local is not None:
            return local
    return next((p for p in prefill.transfer.protocols if p not in ONE_HOST and p in offered), None)


def fetch_protocol(holder: InstanceInfo, fetcher: InstanceInfo) -> str | None:
    """How ``holder`` writes blocks ``fetcher`` fetches from it, or None when it cannot: the holder
    writes over its open transports (``transfer.writes``) into a cache whose ``endpoint`` offers
    one; on one host the first one-host protocol (``shm``, ``cuda_ipc``) of the holder's, else its
    first other one. The two must hold the same model's KV in the same geometry (:func:`kv_mismatch`)."""
    offered = (fetcher.transfer.endpoint or {}).keys()
    writes = holder.transfer.writes or []
    if not offered or not writes or holder.id == fetcher.id or kv_mismatch(holder, fetcher) is not None:
        return None
    if holder.host == fetcher.host:
        local = next((p for p in writes if p in ONE_HOST and p in offered), None)
        if local is not None:
            return local
    return next((p for p in writes if p not in ONE_HOST and p in offered), None)


KV_GEOMETRY = (
    "block_size",
    "block_bytes",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "layout",
    "device",
)
"""The ``KVInfo`` fields a prefill/decode pair's caches must agree on."""


def kv_mismatch(prefill: InstanceInfo, decode: InstanceInfo) -> str | None:
    """Why ``prefill``'s KV bytes cannot go into ``decode``'s blocks, or None when they can.

    The prefill side computes the decode side's byte offsets from its own KV geometry, so a pair
    whose geometry differs in anything (block size or bytes, layers, KV heads, head dim, dtype,
    layout: two models served under one name) would move wrong bytes, over other sequences'
    blocks: such a pair is never made. Nor is a cache in host memory paired with one on a GPU
    (``device``): no transport moves bytes between the two kinds. A geometry one side does not register (a worker older than
    the field) is not assumed equal. Nor are two weight precisions paired (``--weights``): the
    decode side would continue on other numbers than the prefill side computed. Nor two models
    (:func:`model_mismatch`): one served name over two checkpoints (a rolling upgrade) would have
    the decode side continue, and cache under its own hashes, K/V another model computed.
    """
    diffs = [
        f"{name} {getattr(prefill.kv, name)} vs {getattr(decode.kv, name)}"
        for name in KV_GEOMETRY
        if getattr(prefill.kv, name) is None
        or getattr(decode.kv, name) is None
        or getattr(prefill.kv, name) != getattr(decode.kv, name)
    ]
    weights = (prefill.kv.weights or "f32", decode.kv.weights or "f32")  # None: a worker before int8
    if weights[0] != weights[1]:
        diffs.append(f"weights {weights[0]} vs {weights[1]}")
    parts = [f"different KV caches ({', '.join(diffs)})"] if diffs else []
    models = model_mismatch(prefill, decode)
    if models:
        parts.append(f"different models ({', '.join(models)})")
    return f"{prefill.id} with {decode.id}: {'; '.join(parts)}" if parts else None


def model_mismatch(prefill: InstanceInfo, decode: InstanceInfo) -> list[str]:
    """How the two instances' models differ: their weights' digests (``kv.weights_digest``; one
    side without one, an older worker, is not assumed equal) and their tokenizers' (the published
    ``tokenizer`` digest: the decode side turns prefill's token ids into text)."""
    out = []
    w = (prefill.kv.weights_digest, decode.kv.weights_digest)
    if w[0] is None or w[1] is None or w[0] != w[1]:
        out.append(f"weights {_short(w[0])} vs {_short(w[1])}")
    if prefill.tokenizer != decode.tokenizer:
        out.append(f"tokenizer {_short(prefill.tokenizer)} vs {_short(decode.tokenizer)}")
    return out


def _short(digest: str | None) -> str:
    return "unknown" if digest is None else digest[:12]


def resolve_model(live: Sequence[InstanceInfo], model: str | None) -> str:
    """The model a request names, checked against the live set (404 if nobody serves it).

    Without ``model`` the cluster's only model is taken; with several, ``model`` is required.
    """
    if not live:
        raise NoCapacityError("no inference instance is registered")
    if model is None:
        models = sorted({info.model for info in live})
        if len(models) == 1:
            return models[0]
        raise InvalidRequestError(f"model is required: this cluster serves {', '.join(models)}", "model")
    if not any(info.model == model for info in live):
        raise ModelNotFoundError(model)
    return model


def vocab_size(live: Sequence[InstanceInfo], model: str) -> int | None:
    """The vocabulary every live instance of ``model`` accepts: the smallest one registered (None
    when none registers one, e.g. workers older than the field)."""
    return min((info.vocab_size for info in live if info.model == model and info.vocab_size), default=None)


def model_len(live: Sequence[InstanceInfo], model: str) -> int | None:
    """The model length every live instance of ``model`` accepts: the smallest one registered."""
    return min((info.max_model_len for info in live if info.model == model), default=None)


class Selector:
    """Applies the rules with one policy for prefill and one for decode (mixed uses decode's).

    ``in_flight`` (this router's open requests per instance id) is shared with the dispatcher,
    which keeps it current; least_load reads it.
    """

    def __init__(
        self,
        prefill_policy: str | Policy,
        decode_policy: str | Policy,
        aggregated_fallback: bool = True,
        weights: PrefixWeights | None = None,
    ) -> None:
        self.aggregated_fallback = aggregated_fallback
        self.prefill_policy = (
            make_policy(prefill_policy, "prefill", weights)
            if isinstance(prefill_policy, str)
            else prefill_policy
        )
        self.decode_policy = (
            make_policy(decode_policy, "decode", weights) if isinstance(decode_policy, str) else decode_policy
        )
        self.in_flight: dict[str, int] = {}
        for policy in (self.prefill_policy, self.decode_policy):
            if isinstance(policy, PrefixCache):  # it prices a fetch from a peer against the recompute
                policy.fetch_protocol = self._fetch_protocol
        self._fetchable: dict[tuple[str, str], tuple[InstanceInfo, InstanceInfo, str | None]] = {}
        """(holder id, fetcher id) -> the registrations last checked and the fetch's protocol."""
        self._warned_at = float("-inf")
        self._mismatch_warned: dict[str, float] = {}  # reason -> when it was last logged
        self._pairable: dict[tuple[str, str], tuple[InstanceInfo, InstanceInfo, str | None]] = {}
        """(P id, D id) -> the registrations last checked and their hand-off protocol, None: they do
        not pair (checked again when either is a new value: the live set is re-read every 0.5 s)."""
        self._live: Sequence[InstanceInfo] | None = None
        self._live_by_id: Sequence[InstanceInfo] = ()

    def route(
        self, live: Sequence[InstanceInfo], request: PolicyRequest, exclude: Collection[str] = ()
    ) -> Route:
        """Where to run ``request`` (of ``request.model``), avoiding ``exclude`` when anything else
        can serve.

        Raises NoCapacityError saying why when nothing can.
        """
        model = request.model
        candidates = [info for info in self._by_id(live) if info.model == model and not info.draining]
        if exclude:
            route = self._route([info for info in candidates if info.id not in exclude], request)
            if route is not None:
                return route
        route = self._route(candidates, request)
        if route is None:
            raise NoCapacityError(no_route_reason(live, model, self.aggregated_fallback))
        return route

    def route_whole(
        self, live: Sequence[InstanceInfo], request: PolicyRequest, exclude: Collection[str] = ()
    ) -> Route:
        """Where a migrated request continues: one mixed (preferred) or decode instance, never a
        pair (it recomputes prompt + delivered tokens itself), avoiding ``exclude`` when it can."""
        model = request.model
        candidates = [
            info
            for info in self._by_id(live)
            if info.model == model and not info.draining and info.role != "prefill"
        ]
        candidates = [info for info in candidates if info.id not in exclude] or candidates
        if not candidates:
            raise NoCapacityError(f"no decode or mixed instance of model {model!r} is live to continue on")
        mixed = [info for info in candidates if info.role == "mixed"]
        return Route(decode=self.decode_policy.pick(mixed or candidates, self.in_flight, request))

    def _by_id(self, live: Sequence[InstanceInfo]) -> Sequence[InstanceInfo]:
        """``live`` sorted by id (round robin needs a stable order; the registry lists by expiry),
        sorted once per live-set refresh."""
        if live is not self._live:
            self._live, self._live_by_id = live, sorted(live, key=lambda info: info.id)
        return self._live_by_id

    def _route(self, candidates: list[InstanceInfo], request: PolicyRequest) -> Route | None:
        prefills = [info for info in candidates if info.role == "prefill"]
        decodes = [info for info in candidates if info.role == "decode"]
        if prefills and decodes:
            route = self._pair(prefills, decodes, request)
            if route is not None:
                return route
        mixed = [info for info in candidates if info.role == "mixed"]
        if mixed:
            return self._whole(mixed, request)
        if not decodes or not self.aggregated_fallback:
            return None
        self._warn_aggregated(bool(prefills))
        return self._whole(decodes, request)

    def _whole(self, candidates: list[InstanceInfo], request: PolicyRequest) -> Route:
        """One of ``candidates`` serves the whole request (with ``prefix_cache``'s estimate)."""
        if isinstance(self.decode_policy, PrefixCache):
            info, estimate = self.decode_policy.choose(candidates, self.in_flight, request)
            return Route(decode=info, estimate=estimate)
        return Route(decode=self.decode_policy.pick(candidates, self.in_flight, request))

    @property
    def reads_prefix_index(self) -> bool:
        """A policy places by cached prefix: requests need ``num_tokens`` and ``cached_tokens``."""
        return isinstance(self.prefill_policy, PrefixCache) or isinstance(self.decode_policy, PrefixCache)

    def _pair(
        self, prefills: list[InstanceInfo], decodes: list[InstanceInfo], request: PolicyRequest
    ) -> Route | None:
        if isinstance(self.prefill_policy, PrefixCache):  # it picks P and D together
            pairs = [(p, d) for p in prefills for d in decodes if self._protocol(p, d)]
            if not pairs:
                return None
            choice = self.prefill_policy.pick_pair(pairs, self.in_flight, request, self._protocol)
            if choice.prefill is None:
                return Route(decode=choice.decode, local_prefill=True, estimate=choice.estimate)
            protocol = self._protocol(choice.prefill, choice.decode)
            return Route(choice.decode, choice.prefill, protocol, estimate=choice.estimate)
        while prefills:
            prefill = self.prefill_policy.pick(prefills, self.in_flight, request)
            usable = {d.id: p for d in decodes if (p := self._protocol(prefill, d))}
            if usable:
                decode = self.decode_policy.pick(
                    [d for d in decodes if d.id in usable], self.in_flight, request
                )
                return Route(decode=decode, prefill=prefill, protocol=usable[decode.id])
            prefills = [p for p in prefills if p is not prefill]  # no partner: skip this prefill
        return None

    def _protocol(self, prefill: InstanceInfo, decode: InstanceInfo) -> str | None:
        """How ``prefill`` hands off to ``decode``, or None when it cannot (the same instance, another
        KV geometry or precision, no common transport); checked once per pair of registration values."""
        key = (prefill.id, decode.id)
        seen = self._pairable.get(key)
        if seen is not None and seen[0] is prefill and seen[1] is decode:
            return seen[2]
        protocol = None
        if decode.id != prefill.id and self._kv_compatible(prefill, decode):
            protocol = transfer_protocol(prefill, decode)
        if len(self._pairable) > 4096:  # ids of instances long gone
            self._pairable.clear()
        self._pairable[key] = (prefill, decode, protocol)
        return protocol

    def _fetch_protocol(self, holder: InstanceInfo, fetcher: InstanceInfo) -> str | None:
        """:func:`fetch_protocol`, checked once per pair of registration values."""
        key = (holder.id, fetcher.id)
        seen = self._fetchable.get(key)
        if seen is not None and seen[0] is holder and seen[1] is fetcher:
            return seen[2]
        if len(self._fetchable) > 4096:  # ids of instances long gone
            self._fetchable.clear()
        protocol = fetch_protocol(holder, fetcher)
        self._fetchable[key] = (holder, fetcher, protocol)
        return protocol

    def _kv_compatible(self, prefill: InstanceInfo, decode: InstanceInfo) -> bool:
        reason = kv_mismatch(prefill, decode)
        if reason is not None:
            now = time.monotonic()
            if now - self._mismatch_warned.get(reason, -_WARN_EVERY_S) >= _WARN_EVERY_S:
                self._mismatch_warned[reason] = now
                logger.warning("not pairing %s: its KV would be wrong on the decode side", reason)
        return reason is None

    def _warn_aggregated(self, prefills_live: bool) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            why = (
                "no prefill/decode pair shares a KV transfer protocol and KV geometry"
                if prefills_live
                else "no prefill instance is live"
            )
            logger.warning(
                "%s: decode instances serve whole requests (degraded; --no-aggregated-fallback fails them)",
                why,
            )


def no_route_reason(live: Sequence[InstanceInfo], model: str, aggregated_fallback: bool = True) -> str:
    serving = [info for info in live if info.model == model]
    if not aggregated_fallback and any(i.role == "decode" and not i.draining for i in serving):
        return (
            f"model {model!r} has no usable prefill/decode pair now, and serving whole requests on decode "
            "instances is off (--no-aggregated-fallback)"
        )
    if serving and all(info.draining for info in serving):
        return f"every instance of model {model!r} is draining"
    if serving and all(info.role == "prefill" for info in serving if not info.draining):
        return f"model {model!r} has prefill instances but no decode or mixed instance to generate with"
    return f"no instance can serve model {model!r} now"
