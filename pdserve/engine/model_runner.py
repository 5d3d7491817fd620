"""Turns a scheduled Batch into the packed StepInput of one forward (numpy index math, once a step).

In batch-invariant mode decodes are grouped by their context length in blocks, rounded up to a
bucket that depends only on that length (≤ 12.5 % padding with the all-zero null block, masked), so
a sequence's attention shape is the same alone or in any batch while a batch of mixed lengths still
needs only a handful of attention groups. Otherwise all decodes form one group padded to the longest
context: the fewest ops, as the bare model does it. With the in-place decode kernel
(cpu/attention.py) all decodes form one group in either mode and carry their block tables and
lengths instead of gather ids and a mask: the kernel reads each sequence over exactly its own
length, so padding the table changes no bits and the buckets are not needed.
Prefill chunks on the kernel path carry their block table and end the same way, whatever their start
(Model.causal_tiles reads the cache through it), so a chunked prompt gets an unchunked one's bits.

The logits rows of a step: one per sequence that samples, then (prompt logprobs) every prompt
position of the prefill chunks of sequences that score their prompt (:class:`PromptRows`).
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from pdserve.engine.batcher import Batch, blocks_for
from pdserve.engine.block_manager import NULL_BLOCK
from pdserve.engine.kv_layout import RunnerCache
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_input import AttentionGroup, StepInput

_NEG_INF = np.float32(-np.inf)


# MKL (2019.5, in Paddle's CPU wheel) splits a GEMM's rows evenly over its threads and then picks a
# micro-kernel per group of 4 rows: rows in a trailing partial group, and every row of a matrix with
# fewer than 8 rows, get other bits than the same row inside a full group — even under
# MKL_CBWR=AUTO,STRICT (measured on every layer shape of tiny and ERNIE-0.3B, 1 and 2 threads).
# Batch-invariant mode therefore pads each step, and the logits rows, to at least 8 rows and a
# multiple of 4 x threads; then a row's bits never depend on its neighbours.
def padded_rows(n: int, threads: int) -> int:
    quantum = 4 * max(1, threads)
    return max(8, -(-n // quantum) * quantum)


def decode_bucket(num_blocks: int) -> int:
    """Padded block count for a decode context of ``num_blocks`` blocks."""
    if num_blocks <= 8:
        return num_blocks
    granule = 1 << (num_blocks.bit_length() - 4)
    return -(-num_blocks // granule) * granule


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """Logits rows ``row .. row + count - 1`` of a step: ``seq``'s prompt positions ``first ..
    first + count - 1``, whose distributions score its prompt tokens ``first + 1 .. first + count``."""

    seq: Sequence
    row: int
    first: int
    count: int


class ModelRunner:
    def __init__(
        self, cache: RunnerCache, batch_invariant: bool = False, threads: int = 1, paged_kernel: bool = False
    ) -> None:
        self.cache = cache
        self.paged_kernel = paged_kernel  # decode groups carry block tables for the in-place kernel
        self.batch_invariant = batch_invariant
        self.threads = threads
        self.block_size = cache.block_size
        self._causal: dict[int, np.ndarray] = {}
        self._tables: weakref.WeakKeyDictionary[Sequence, _BlockTable] = weakref.WeakKeyDictionary()

    def block_table(self, seq: Sequence) -> np.ndarray:
        """``seq.block_table`` as int64 numpy, kept per sequence: a list is only ever extended (a
        release or an admission gives the sequence a new list), so only blocks appended since the
        last step are converted (32 decodes of 2k tokens: ~170 -> ~90 us a step here)."""
        cached = self._tables.get(seq)
        if cached is None or cached.source is not seq.block_table or cached.size > len(seq.block_table):
            cached = self._tables[seq] = _BlockTable(seq.block_table)
        return cached.array(seq.block_table)

    def prepare(self, batch: Batch) -> tuple[StepInput, list[Sequence], list[PromptRows]]:
        """Pack the batch; returns the step input, the sequences that sample (logits rows 0, 1, ...,
        in order) and the prompt positions scored (the rows after those)."""
        bs = self.block_size
        ids: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        gathers: list[np.ndarray] = []
        groups: list[AttentionGroup] = []
        out_rows: list[int] = []
        out_seqs: list[Sequence] = []
        prompt_rows: list[int] = []  # packed rows whose logits score the next prompt token
        scored: list[tuple[Sequence, int, int, int]] = []  # (seq, index in prompt_rows, first, count)
        start = 0

        by_bucket: dict[int, list[Sequence]] = {}
        if self.batch_invariant and not self.paged_kernel:
            for seq in batch.decodes:
                by_bucket.setdefault(decode_bucket(blocks_for(seq.num_tokens, bs)), []).append(seq)
        elif batch.decodes:  # fastest: one group padded to the longest context
            by_bucket[max(blocks_for(s.num_tokens, bs) for s in batch.decodes)] = batch.decodes
        for nblk, seqs in sorted(by_bucket.items()):
            n = len(seqs)
            lengths = np.fromiter((s.num_tokens for s in seqs), np.int64, n)
            table = np.full((n, nblk), NULL_BLOCK, np.int64)
            for i, s in enumerate(seqs):
                used = blocks_for(s.num_tokens, bs)
                table[i, :used] = self.block_table(s)[:used]
            p = lengths - 1
            ids.append(np.fromiter((s.token_at(s.num_tokens - 1) for s in seqs), np.int64, n))
            pos.append(p)
            slots.append(table[np.arange(n), p // bs] * bs + p % bs)
            if self.paged_kernel:
                groups.append(AttentionGroup(start, n, n, 0, None, True, tables=table, lengths=lengths))
            else:
                gathers.append(self.cache.gather_chunks(table))
                mask = np.where(np.arange(nblk * bs)[None, :] < lengths[:, None], 0.0, _NEG_INF)
                groups.append(
                    AttentionGroup(start, n, n, 2 * n * nblk, mask.astype(np.float32)[:, None, :], True)
                )
            out_rows.extend(range(start, start + n))
            out_seqs.extend(seqs)
            start += n

        for chunk in batch.prefills:
            seq, n = chunk.seq, chunk.end - chunk.start
            p = np.arange(chunk.start, chunk.end, dtype=np.int64)
            table = self.block_table(seq)
            all_ids = seq.prompt_token_ids if chunk.end <= seq.num_prompt_tokens else seq.all_token_ids()
            ids.append(np.asarray(all_ids[chunk.start : chunk.end], np.int64))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if self.paged_kernel:  # causal tiles at absolute positions over the cache (Model.causal_tiles)
                nblk = blocks_for(chunk.end, bs)
                ends = np.array([chunk.end], np.int64)
                groups.append(
                    AttentionGroup(start, n, 1, 0, None, False, tables=table[None, :nblk], lengths=ends)
                )
            elif chunk.start == 0:
                groups.append(AttentionGroup(start, n, 1, 0, self._causal_mask(n), False))
            else:
                nblk = blocks_for(chunk.end, bs)
                gathers.append(self.cache.gather_chunks(table[None, :nblk]))
                mask = np.where(np.arange(nblk * bs)[None, :] <= p[:, None], 0.0, _NEG_INF).astype(np.float32)
                groups.append(AttentionGroup(start, n, 1, 2 * nblk, mask[:, None, :], False))
            if chunk.samples:
                out_rows.append(start + n - 1)
                out_seqs.append(seq)
            count = min(chunk.end, seq.num_prompt_tokens - 1) - chunk.start
            if seq.scores_prompt and count > 0:
                scored.append((seq, len(prompt_rows), chunk.start, count))
                prompt_rows.extend(range(start, start + count))
            start += n

        pad = padded_rows(start, self.threads) - start if self.batch_invariant else 0
        if pad > 0:  # dummy tokens attending only to the null block, where their K/V land
            ids.append(np.zeros(pad, np.int64))
            pos.append(np.arange(pad, dtype=np.int64))
            slots.append(NULL_BLOCK * bs + np.arange(pad) % bs)
            if self.paged_kernel:  # a decode group: a step of decodes stays one fused call
                table = np.full((pad, blocks_for(pad, bs)), NULL_BLOCK, np.int64)
                lengths = np.arange(1, pad + 1, dtype=np.int64)
                groups.append(AttentionGroup(start, pad, pad, 0, None, True, tables=table, lengths=lengths))
            else:
                groups.append(AttentionGroup(start, pad, 1, 0, self._causal_mask(pad), False))
        spans = [PromptRows(seq, len(out_rows) + i, first, count) for seq, i, first, count in scored]
        out_rows += prompt_rows
        if out_rows and self.batch_invariant:
            out_rows.extend([out_rows[-1]] * (padded_rows(len(out_rows), self.threads) - len(out_rows)))
        all_slots = np.concatenate(slots)
        step = StepInput(
            token_ids=np.concatenate(ids),
            positions=np.concatenate(pos),
            write_rows=self.cache.write_rows(all_slots),
            gather=np.concatenate(gathers, axis=1) if gathers else None,
            groups=groups,
            output_rows=np.asarray(out_rows, np.int64),
        )
        return step, out_seqs, spans

    def _causal_mask(self, n: int) -> np.ndarray:
        mask = self._causal.get(n)
        if mask is None:
            mask = np.triu(np.full((n, n), _NEG_INF, np.float32), 1)
            if len(self._causal) < 64:
                self._causal[n] = mask
        return mask


class _BlockTable:
    """One block-table list as a growing int64 array."""

    __slots__ = ("_data", "size", "source")

    def __init__(self, source: list[int]) -> None:
        self.source = source
        self._data = np.zeros(max(16, 2 * len(source)), np.int64)
        self.size = 0

    def array(self, source: list[int]) -> np.ndarray:
        n = len(source)
        if n > self.size:
            if n > self._data.size:
                self._data = np.concatenate([self._data[: self.size], np.zeros(n, np.int64)])
            self._data[self.size : n] = source[self.size : n]
            self.size = n
        return self._data[:n]
