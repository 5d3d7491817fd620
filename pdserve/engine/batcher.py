"""Continuous batching: which tokens of which sequences run in the next step. No tensor library.

Each step takes every running decode (one token each), then prefill chunks while the token budget
lasts. Prompts are prefilled in chunks aligned to ``prefill_chunk_size`` so long prompts never
stall running decodes, and so a prompt is always cut at the same places whatever else is in the
batch (that keeps its bits batch-invariant). A waiting request is admitted only when blocks for
its whole prompt are free; when a running decode needs a block and none is free, the most recently
admitted sequence is preempted (its blocks freed, recomputed later), never corrupted.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Protocol

from pdserve.block_hash import chain_hashes
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BatcherConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 576
    prefill_chunk_size: int = 512

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.prefill_chunk_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= prefill_chunk_size "
                f"({self.prefill_chunk_size})"
            )


@dataclasses.dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last token: its logits pick the next token."""
        return self.end == self.seq.num_tokens


@dataclasses.dataclass
class Batch:
    decodes: list[Sequence]
    prefills: list[PrefillChunk]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.end - c.start for c in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class ReadBack(Protocol):
    """The tiers below the pool that blocks can be read back from (the engine's host and disk
    tiers, :class:`pdserve.engine.tiers.tier_reader.TierReader`)."""

    def plan(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` the tier holds (nothing read, nothing counted)."""
        ...

    def read(self, hashes: list[bytes]) -> list[bytes]:
        """The bytes of the leading run it holds, each checksum verified (a bad one ends the run)."""
        ...

    def write(self, blocks: list[int], data: list[bytes]) -> None:
        """Put blocks' bytes (as :meth:`read` gave them) into the pool's ``blocks``."""
        ...

    def missed(self, num_blocks: int) -> None:
        """Count full prompt blocks that neither the pool nor the tier held at an admission."""
        ...


@dataclasses.dataclass
class HitCounts:
    """Admitted prompts' full blocks by where they came from (first admissions only): the pool's
    prefix cache, the tier below it, or computed."""

    pool: int = 0
    tier: int = 0
    computed: int = 0

    @property
    def lookups(self) -> int:
        """Full blocks looked up (the pool's hit rate: ``pool / lookups``)."""
        return self.pool + self.tier + self.computed


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Batcher:
    def __init__(self, config: BatcherConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.tier: ReadBack | None = None  # the engine's host and disk tiers, when it has one
        self.hit_counts = HitCounts()

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``: online sequences ahead of every waiting background one."""
        if not seq.background:
            for i, other in enumerate(self.waiting):
                if other.background:
                    self.waiting.insert(i, seq)
                    return
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in its blocks (imported from a prefill instance)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks, last first: its cached blocks are evicted tail first, so a prefix
        shared by many prompts (and the chain a later lookup walks from its start) stays longest."""
        if seq.block_table:
            self.blocks.free(seq.block_table[::-1])
            seq.block_table = []
        self._let_go(seq)

    def _let_go(self, seq: Sequence) -> None:
        """Free the prefix blocks held for ``seq`` until its admission (a peer fetch's)."""
        if seq.held_blocks:
            self.blocks.free(seq.held_blocks[::-1])
            seq.held_blocks = []

    def schedule(self) -> Batch:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        decodes: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling:
                continue
            if not self._grow(seq, seq.num_tokens):
                continue  # seq itself was preempted
            decodes.append(seq)
            budget -= 1
        prefills: list[PrefillChunk] = []
        # background prompts are prefilled only in steps no online prompt needs
        online = any(not s.background for s in self.waiting) or any(
            s.is_prefilling and not s.background for s in self.running
        )
        for seq in self.running:
            if seq.is_prefilling and seq not in decodes and not (online and seq.background):
                chunk = self._next_chunk(seq)
                if chunk.end - chunk.start <= budget:
                    prefills.append(chunk)
                    budget -= chunk.end - chunk.start
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.background and online:
                # a preempted background sequence may be first; an online one behind it goes before
                seq = next((s for s in self.waiting if not s.background), seq)
                if seq.background:
                    break
            need = blocks_for(seq.num_tokens, cfg.block_size)
            hits = self._prefix_hits(seq)
            below = self._tier_hashes(seq, len(hits))
            planned = self.tier.plan(below) if self.tier is not None and below else 0
            chunk = self._next_chunk(seq, (len(hits) + planned) * cfg.block_size)
            if not self.blocks.can_allocate(need - len(hits), hits) or chunk.end - chunk.start > budget:
                break  # first come, first served: later requests wait behind this one
            self.waiting.remove(seq)
            # read before allocating: the allocation's evictions into the tier may push entries out
            data = self.tier.read(below[:planned]) if planned and self.tier is not None else []
            loaded = len(data)
            if loaded < planned:  # a block failed its checksum: computed from there
                chunk = self._next_chunk(seq, (len(hits) + loaded) * cfg.block_size)
            self.blocks.share(hits)
            self._let_go(seq)  # what was held for it is in its block table now (or not needed)
            fresh = self.blocks.allocate(need - len(hits))
            seq.block_table = hits + fresh
            seq.num_registered_blocks = len(hits)  # already in the cache
            if loaded:
                assert self.tier is not None
                self.tier.write(fresh[:loaded], data)
            if self.tier is not None and seq.scheduled_at is None and below:
                self.tier.missed(len(below) - loaded)
            if seq.scheduled_at is None:
                counts = self.hit_counts
                counts.pool += len(hits)
                counts.tier += loaded
                counts.computed += blocks_for(seq.num_tokens, cfg.block_size) - len(hits) - loaded
            seq.num_computed_tokens = chunk.start
            if loaded:  # the blocks read back serve later prompts from the pool again
                self.cache_full_blocks(seq)
            if seq.scheduled_at is None:  # the first admission's hit is what the request is told
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_at is None:  # not again after a preemption: queue time is the first wait
                seq.scheduled_at = time.monotonic()
            self.running.append(seq)
            prefills.append(chunk)
            budget -= chunk.end - chunk.start
        return Batch(decodes, prefills)

    def _next_chunk(self, seq: Sequence, start: int | None = None) -> PrefillChunk:
        """The next chunk from ``start`` (default: the computed tokens), cut at a multiple of the
        chunk size: the same cuts whatever the batch, and whatever prefix came from the cache."""
        size = self.config.prefill_chunk_size
        start = seq.num_computed_tokens if start is None else start
        target = seq.num_tokens - (1 if seq.output_token_ids else 0)
        return PrefillChunk(seq, start, min(target, (start // size + 1) * size))

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens the waiting sequences will compute: what their cached prefixes leave (a
        router comparing instances' queues must not count what a cache hit saves)."""
        bs = self.config.block_size
        total = 0
        for seq in self.waiting:
            hits = len(self._prefix_hits(seq))
            below = self._tier_hashes(seq, hits) if self.tier is not None else []
            total += seq.num_tokens - (hits + (self.tier.plan(below) if below and self.tier else 0)) * bs
        return total

    def step_tokens(self, queued_prefill_tokens: int) -> int:
        """At most how many tokens the next step computes: one per running decode, the prompt tokens
        the running sequences have yet to compute and the waiting ones' (``queued_prefill_tokens``),
        within the step's token budget. What a call queued behind that step on the engine thread
        waits for (a peer's fetch: docs/design.md, "Peer fetch")."""
        pending = queued_prefill_tokens
        for seq in self.running:
            if seq.is_prefilling:
                pending += seq.num_tokens - (1 if seq.output_token_ids else 0) - seq.num_computed_tokens
            else:
                pending += 1
        return min(self.config.max_num_batched_tokens, pending)

    # ---- the prefix cache -------------------------------------------------------------------
    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq``'s tokens; at least its last token is
        left to compute (its logits pick the next token). Empty for a sequence that scores its
        prompt: every prompt position's logits are wanted."""
        if not self.blocks.prefix_caching or seq.scores_prompt:
            return []
        usable = (seq.num_tokens - 1) // self.config.block_size
        self._hash_blocks(seq, usable)
        return self.blocks.lookup(seq.block_hashes[:usable])

    def _tier_hashes(self, seq: Sequence, num_hits: int) -> list[bytes]:
        """The hashes of ``seq``'s usable full blocks after the pool's ``num_hits`` (what a tier
        below the pool may hold); empty without a tier, or where the pool's lookup was not used."""
        if self.tier is None or not self.blocks.prefix_caching or seq.scores_prompt:
            return []
        usable = (seq.num_tokens - 1) // self.config.block_size
        return seq.block_hashes[num_hits:usable]

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Extend ``seq.block_hashes`` to its first ``num_blocks`` full blocks."""
        have = len(seq.block_hashes)
        if num_blocks > have:
            bs = self.config.block_size
            tokens = seq.all_token_ids()[: num_blocks * bs]
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes += chain_hashes(tokens, bs, seq.params.cache_key, start=have, parent=parent)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer ``seq``'s blocks that are now full and computed to the prefix cache (after a step,
        and for a decode instance's imported prompt)."""
        if not self.blocks.prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.config.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        self._hash_blocks(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.blocks.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered_blocks = full

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens, preempting the newest sequences if needed."""
        need = blocks_for(num_tokens, self.config.block_size) - len(seq.block_table)
        while need > 0 and not self.blocks.can_allocate(need):
            # the newest background sequence first, else the newest
            victim = next((s for s in reversed(self.running) if s.background), self.running[-1])
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        log.info("preempting %s (KV blocks exhausted); it will be recomputed", seq.request_id)
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
