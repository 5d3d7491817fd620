"""Token selection from logits, in numpy, one row per sequence.

Order (as vLLM/HF do it): logit_bias -> grammar mask (structured output: tokens the grammar does
not allow next are -inf) -> min_tokens mask -> repetition/presence/frequency penalties -> greedy or
temperature -> top_k -> top_p -> min_p -> one uniform draw from the sequence's own generator
(inverse CDF over candidates sorted by probability, ties by id). Exactly one draw per sampled token
keeps a seeded request reproducible, and lets a decode instance continue a seeded request that a
prefill instance started by skipping the draws already made. Logprobs describe the raw model
distribution (before penalties and temperature), as OpenAI's do.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdserve.engine.sequence import Sequence

_TOP_P_CANDIDATES = 256  # top-p first looks among these; falls back to a full sort if mass is short
_LOGPROB_ROWS = 32  # logprobs_of works on this many rows at once: its float64 copy stays small


@dataclasses.dataclass
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    rank: int | None = None  # 1 + how many ids have a strictly larger logprob


def logprobs_of(logits: np.ndarray, tokens: np.ndarray | list[int], num_top: int) -> list[Sample]:
    """Per row of ``logits`` [R, V]: ``tokens[r]``'s logprob under log_softmax of the row, its rank,
    and the ``num_top`` best (id, logprob), best first, ties by id. The sampled tokens' and the
    prompt's logprobs both come from here, so they agree; each row's numbers depend on that row only
    (batch-invariant), whatever rows come with it."""
    out: list[Sample] = []
    tokens = np.asarray(tokens, np.int64)
    for start in range(0, logits.shape[0], _LOGPROB_ROWS):
        block, tok = logits[start : start + _LOGPROB_ROWS], tokens[start : start + _LOGPROB_ROWS]
        m = block.max(axis=1, keepdims=True)
        logp = block - (m + np.log(np.exp(block - m, dtype=np.float64).sum(axis=1, keepdims=True)))
        own = logp[np.arange(tok.size), tok]
        ranks = np.count_nonzero(logp > own[:, None], axis=1) + 1
        tops = np.argpartition(-logp, num_top - 1, axis=1)[:, :num_top] if num_top else None
        for i in range(tok.size):
            top = None
            if tops is not None:
                ids = tops[i][np.lexsort((tops[i], -logp[i, tops[i]]))]
                top = [(int(t), float(logp[i, t])) for t in ids]
            out.append(Sample(int(tok[i]), float(own[i]), top, int(ranks[i])))
    return out


def make_rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(None if seed is None else seed % 2**64)


class Sampler:
    def __init__(self, vocab_limit: int, eos_token_ids: list[int]) -> None:
        """``vocab_limit``: ids at or above it (padding rows of the embedding) are never sampled."""
        self.vocab_limit = vocab_limit
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: np.ndarray, seqs: list[Sequence]) -> list[Sample]:
        logits = logits[:, : self.vocab_limit]
        if all(self.is_plain_greedy(s) for s in seqs):
            return [Sample(int(t)) for t in logits.argmax(axis=1)]
        return [self._sample_row(row, seq) for row, seq in zip(logits, seqs)]

    def is_plain_greedy(self, seq: Sequence) -> bool:
        """Its next token is the argmax of its logits row below the vocabulary limit, nothing else."""
        p = seq.params
        return (
            p.is_greedy
            and p.logprobs is None
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and not p.logit_bias
            and seq.num_output_tokens >= p.min_tokens
            and seq.grammar is None
        )

    def _sample_row(self, raw: np.ndarray, seq: Sequence) -> Sample:
        p = seq.params
        row = raw.astype(np.float32, copy=True)
        if p.logit_bias:
            if seq.logit_bias is None:  # built once per sequence: the bias holds for all its tokens
                ids = np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias))
                vals = np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias))
                keep = ids < row.size  # ids of padding rows beyond the tokenizer are never sampled
                seq.logit_bias = (ids[keep], vals[keep])
            ids, vals = seq.logit_bias
            row[ids] += vals
        allowed = seq.grammar.allowed() if seq.grammar is not None else None
        if allowed is not None and allowed.any():  # none allowed: the engine fails the request
            row[~allowed] = -np.inf
        if seq.num_output_tokens < p.min_tokens:
            banned = [t for t in [*self.eos_token_ids, *p.stop_token_ids] if t < row.size]
            if allowed is None or np.delete(allowed, banned).any():  # the grammar may leave only EOS
                row[banned] = -np.inf
        self._apply_penalties(row, seq)
        token = int(row.argmax()) if p.is_greedy else self._draw(row, seq)
        if p.logprobs is not None:
            return logprobs_of(raw[None, :], [token], p.logprobs)[0]
        return Sample(token)

    @staticmethod
    def _apply_penalties(row: np.ndarray, seq: Sequence) -> None:
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(seq.all_token_ids(), dtype=np.int64))
            seen = seen[seen < row.size]
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
            ids, counts = np.unique(np.asarray(seq.output_token_ids, dtype=np.int64), return_counts=True)
            keep = ids < row.size
            ids, counts = ids[keep], counts[keep]
            row[ids] -= p.frequency_penalty * counts + p.presence_penalty

    @staticmethod
    def _draw(row: np.ndarray, seq: Sequence) -> int:
        p = seq.params
        row = row / np.float32(p.temperature)
        ids = np.arange(row.size)
        if 0 < p.top_k < row.size:
            ids = np.argpartition(-row, p.top_k - 1)[: p.top_k]
        vals = row[ids]
        probs = np.exp(vals - vals.max())
        probs /= probs.sum()
        if p.top_p < 1.0 and ids.size > _TOP_P_CANDIDATES:
            cand = np.argpartition(-probs, _TOP_P_CANDIDATES - 1)[:_TOP_P_CANDIDATES]
            if probs[cand].sum() >= p.top_p:
                ids, probs = ids[cand], probs[cand]
        order = np.lexsort((ids, -probs))  # by probability, ties by token id: deterministic
        ids, probs = ids[order], probs[order]
        keep = probs.size
        if p.top_p < 1.0:
            cum = np.cumsum(probs)
            keep = min(keep, int(np.searchsorted(cum, p.top_p, side="left")) + 1)
        if p.min_p > 0.0:
            keep = min(keep, int(np.count_nonzero(probs >= p.min_p * probs[0])))
        ids, probs = ids[: max(keep, 1)], probs[: max(keep, 1)]
        cum = np.cumsum(probs, dtype=np.float64)
        assert seq.rng is not None  # the engine gives each tracked sequence its generator
        u = seq.rng.random() * cum[-1]
        return int(ids[min(int(np.searchsorted(cum, u, side="right")), ids.size - 1)])
