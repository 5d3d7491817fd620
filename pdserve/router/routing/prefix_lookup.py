"""What the ``prefix_cache`` policy needs of one attempt: the prompt's length and each candidate's
cached prefix of it.

The prompt's token ids come from the tokenizer the instances publish (:mod:`pdserve.router.routing.prompt_ids`),
once per choice; its block hashes (:mod:`pdserve.block_hash`, the engines' own, salted with the
request's ``cache_salt``) once per block size. Each attempt then asks where they are cached: the
shared prefix index in Redis (one round trip, ``--prefix-index redis``, the default), or this router's
own record of where it sent which prompts (``--prefix-index local``, as gateways without shared
state do; kept for comparison). Any failure leaves the request as it was: the policy then places by
load, and the engines find their cached blocks themselves anyway.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from pdserve.block_hash import chain_hashes, salt_key
from pdserve.errors import ControlPlaneError
from pdserve.router.routing.policies import PolicyRequest
from pdserve.router.routing.prompt_ids import PromptTokenizer
from pdserve.router.routing.selection import Route
from pdserve.scheduler.registration import InstanceInfo

log = logging.getLogger(__name__)

IndexKind = Literal["redis", "local"]
INDEX_KINDS: tuple[IndexKind, ...] = ("redis", "local")


class BlockIndex(Protocol):
    """Where full blocks are cached: :class:`pdserve.scheduler.PrefixIndex` or :class:`LocalIndex`."""

    async def held_blocks(
        self,
        instance_ids: Sequence[str],
        hashes: Sequence[bytes],
        tiered: Sequence[str] = (),
        disks: Mapping[str, str] | None = None,
    ) -> dict[str, tuple[int, int, int]]:
        """Per instance: the leading blocks its pool holds, those its pool or host tier holds, and
        those any of them or its disk tier (``disks``: instance id -> disk tier id) holds."""
        ...


class LocalIndex:
    """One router's own guess of each instance's cache: the blocks of the prompts it sent there,
    the most recent ``num_blocks`` of them (the instance's cache size) per instance."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    async def held_blocks(
        self,
        instance_ids: Sequence[str],
        hashes: Sequence[bytes],
        tiered: Sequence[str] = (),
        disks: Mapping[str, str] | None = None,
    ) -> dict[str, tuple[int, int, int]]:
        """No tiers here: what the router sent is all it knows."""
        return {i: (n, n, n) for i, n in (await self.cached_blocks(instance_ids, hashes)).items()}

    async def cached_blocks(self, instance_ids: Sequence[str], hashes: Sequence[bytes]) -> dict[str, int]:
        out = {}
        for instance_id in instance_ids:
            held: Mapping[bytes, None] = self._held.get(instance_id, {})
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            out[instance_id] = n
        return out

    def learn(self, info: InstanceInfo, hashes: Sequence[bytes]) -> None:
        held = self._held.setdefault(info.id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > max(1, info.kv.num_blocks):
            held.popitem(last=False)


@dataclasses.dataclass
class PromptBlocks:
    """One choice's prompt as the index knows it (computed on its first attempt)."""

    token_ids: list[int] | None = None
    tried: bool = False
    hashes: dict[int, list[bytes]] = dataclasses.field(default_factory=dict)  # block size -> hashes

    def of(self, block_size: int, salt: str | None) -> list[bytes]:
        hashes = self.hashes.get(block_size)
        if hashes is None:
            assert self.token_ids is not None
            hashes = self.hashes[block_size] = chain_hashes(self.token_ids, block_size, salt_key(salt))
        return hashes


class PrefixLookup:
    """Fills ``PolicyRequest.num_tokens`` and ``cached_tokens`` for one attempt."""

    def __init__(self, tokenizer: PromptTokenizer, index: BlockIndex) -> None:
        self.tokenizer = tokenizer
        self.index = index

    async def view(
        self, live: Sequence[InstanceInfo], request: PolicyRequest, blocks: PromptBlocks
    ) -> PolicyRequest:
        """``request`` with the prompt's length and each caching candidate's cached tokens."""
        caching = [i for i in live if i.model == request.model and not i.draining and i.kv.prefix_caching]
        if not caching:
            return request
        if not blocks.tried:
            blocks.tried = True
            digest = next((i.tokenizer for i in caching if i.tokenizer), None)
            blocks.token_ids = await self.tokenizer.token_ids(digest, request)
        if blocks.token_ids is None:
            return request
        cached: dict[str, int] = {}
        tier: dict[str, int] = {}
        disk: dict[str, int] = {}
        tiered = [i.id for i in caching if i.tier is not None]
        disks = {i.id: i.disk_tier.id for i in caching if i.disk_tier is not None}
        try:
            for block_size in sorted({i.kv.block_size for i in caching}):
                ids = [i.id for i in caching if i.kv.block_size == block_size]
                hashes = blocks.of(block_size, request.cache_salt)
                found = await self.index.held_blocks(ids, hashes, tiered, disks)
                for i, (pool, host, anywhere) in found.items():
                    if pool:
                        cached[i] = pool * block_size
                    if host > pool:
                        tier[i] = (host - pool) * block_size
                    if anywhere > host:
                        disk[i] = (anywhere - host) * block_size
        except ControlPlaneError as e:
            log.debug("prefix index not read (%s); placing by load", e)
        return dataclasses.replace(
            request,
            num_tokens=len(blocks.token_ids),
            cached_tokens=cached,
            tier_tokens=tier,
            disk_tokens=disk,
            holders=caching,
        )

    def learn(self, route: Route, request: PolicyRequest, blocks: PromptBlocks) -> None:
        """With a local index: the route's instances will hold the prompt's blocks."""
        if not isinstance(self.index, LocalIndex) or blocks.token_ids is None:
            return
        for info in (route.prefill, route.decode):
            if info is not None and info.kv.prefix_caching:
                self.index.learn(info, blocks.of(info.kv.block_size, request.cache_salt))
