"""A prompt's prefix blocks held for a move between instances, as ``LLMEngine`` methods (it inherits
:class:`PrefixPins`): the engine's side of a peer fetch (docs/design.md, "Peer fetch") and of a
decode instance's reservation.

Both sides of a fetch hold blocks of this engine's pool under a key until the worker says the move
is over, so no eviction hands them to another request meanwhile:

* the holder (:meth:`pin_blocks`): the leading run of the asked hashes this engine has (its pool's
  blocks, then those its tiers hold, read back into fresh pool blocks: :meth:`hold_prefix`),
  pinned while a peer's writer reads them; :meth:`release_held` when the write is over.
* the fetcher (:meth:`reserve_fetch`): the prompt's prefix it has itself, held the same way, and
  fresh blocks reserved for the blocks after it, up to those the peer holds. Once the peer's write
  has landed and its digests matched, :meth:`adopt_fetched` registers the blocks written in the
  prefix cache (the rest of the reservation is freed) and :meth:`attach_held` gives every hold to
  the queued request, whose admission finds them as pool hits and lets them go once its own block
  table shares them. A fetch that fails frees its reservation with :meth:`cancel_fetch` once no
  write into it can land; the request computes those blocks.

A decode instance's reservation holds its prefix the same way (``KVHandoff.reserve_prompt``): its
pool's blocks, then its tiers' read back, so the prefill side writes only what neither holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.block_hash import chain_hashes
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.errors import InvalidRequestError
from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.batcher import Batcher
    from pdserve.engine.tiers.tier_reader import TierReader


class PrefixPins:
    """``LLMEngine``'s prefix holds; the attributes are the engine's (set by its ``__init__``)."""

    config: EngineConfig
    blocks: BlockManager
    tier_reader: TierReader | None
    batcher: Batcher
    requests: dict[str, Any]
    reserved: dict[str, list[int]]  # blocks reserved for incoming KV (a fetch's destination too)
    held: dict[str, list[int]]  # key -> blocks held (a reference each) for a move
    fetching: dict[str, list[bytes]]  # a fetch's key -> the hashes of its reserved blocks, in order

    def hold_prefix(self, hashes: list[bytes], spare: int = 0) -> list[int]:
        """The blocks holding the leading run of ``hashes`` this engine has, each with a reference
        taken (the caller frees them): its pool's, then those its tiers hold, read back (each
        checked by its tier) into fresh pool blocks and registered there, as an admission reads
        them. A pool short of room for the whole tier run reads back the leading part that fits,
        leaving ``spare`` blocks allocatable (a longer run held is never worse than none: the rest
        is computed or written by a peer, as it would be without it). Empty when the prefix cache
        is off."""
        if not self.blocks.prefix_caching:
            return []
        held = self.blocks.lookup(hashes)
        self.blocks.share(held)
        rest, reader = hashes[len(held) :], self.tier_reader
        planned = reader.plan(rest) if reader is not None and rest else 0
        fits = min(planned, max(0, self.blocks.num_free - spare))
        if reader is not None and fits:
            data = reader.read(rest[:fits])  # before allocating: its evictions may push entries out
            fresh = self.blocks.allocate(len(data))
            reader.write(fresh, data)
            for block, block_hash in zip(fresh, rest):
                self.blocks.register(block, block_hash)
            held += fresh
        return held

    def _check_key(self, key: str) -> None:
        if key in self.held or key in self.reserved:
            raise InvalidRequestError(f"key {key!r} is already in use", "request_id")

    # ---- the holder --------------------------------------------------------------------------------
    def pin_blocks(self, key: str, hashes: list[bytes]) -> list[int]:
        """A peer fetches ``hashes``: hold the leading run of them this engine has (pool, then
        tiers) under ``key`` until :meth:`release_held`; their block ids, in order. A pool short of
        room for the tiers' part holds what fits (the peer computes the rest), keeping a block per
        running sequence allocatable, so serving a peer never preempts this engine's own work."""
        self._check_key(key)
        self.held[key] = self.hold_prefix(hashes, spare=len(self.batcher.running))
        return list(self.held[key])

    def release_held(self, key: str) -> bool:
        """Let ``key``'s holds go (they stay cached, most recently used: the tail first)."""
        blocks = self.held.pop(key, None)
        if blocks is None:
            return False
        self.blocks.free(blocks[::-1])
        return True

    # ---- the fetcher -------------------------------------------------------------------------------
    def reserve_fetch(
        self, key: str, prompt_token_ids: list[int], params: SamplingParams, num_blocks: int
    ) -> tuple[list[bytes], list[int]]:
        """Get ready to fetch the prompt's blocks up to its first ``num_blocks`` from a peer: hold
        the prefix this engine has (pool, then tiers) under ``key``, and reserve fresh blocks for the
        usable full blocks after it (the last prompt token is always computed). The hashes to fetch
        and the blocks they go into, in order: empty when there is nothing to fetch, no room, or
        the request scores its prompt (every position computed)."""
        self._check_key(key)
        self.held[key] = []
        if not self.blocks.prefix_caching or params.prompt_logprobs is not None:
            return [], []
        bs = self.config.block_size
        usable = min(num_blocks, (len(prompt_token_ids) - 1) // bs)
        if usable <= 0:
            return [], []
        hashes = chain_hashes(prompt_token_ids[: usable * bs], bs, params.cache_key)
        self.held[key] = own = self.hold_prefix(hashes)
        wanted = hashes[len(own) :]
        if not wanted or not self.blocks.can_allocate(len(wanted)):
            return [], []
        self.reserved[key] = self.blocks.allocate(len(wanted))
        self.fetching[key] = wanted
        return wanted, list(self.reserved[key])

    def adopt_fetched(self, key: str, num_written: int) -> int:
        """The peer wrote the first ``num_written`` reserved blocks of ``key`` and they matched its
        digests: they join the prefix cache under their hashes and ``key``'s holds; the rest of
        the reservation is freed. How many joined."""
        blocks, hashes = self.reserved.pop(key, []), self.fetching.pop(key, [])
        n = max(0, min(num_written, len(blocks)))
        for block, block_hash in zip(blocks[:n], hashes[:n]):
            self.blocks.register(block, block_hash)
        self.held.setdefault(key, []).extend(blocks[:n])
        if blocks[n:]:
            self.blocks.free(blocks[n:])
        return n

    def cancel_fetch(self, key: str) -> bool:
        """Free a fetch's reservation (no write into it can land any more)."""
        self.fetching.pop(key, None)
        blocks = self.reserved.pop(key, None)
        if blocks is None:
            return False
        self.blocks.free(blocks)
        return True

    def attach_held(self, key: str, request_id: str) -> None:
        """Give ``key``'s holds to the queued request ``request_id``: its admission finds them (the
        prompt's prefix, registered) and frees them once its block table shares them; an abort
        before frees them too."""
        blocks = self.held.pop(key, None)
        if blocks:
            self.requests[request_id].seq.held_blocks = blocks
