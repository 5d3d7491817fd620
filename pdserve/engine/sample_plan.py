"""A step's sampling as plain arrays, for a sampler that runs where the logits are (the torch
platform's device), and what comes back from it. numpy only: the engine stays device-free.

The plan carries everything the numpy sampler (sampler.py) reads besides the logits, in its order:
logit_bias, the grammar's allowed tokens (a bitmask, only for constrained rows), min_tokens' banned
ids, the penalties' token histories, then greedy or temperature / top-k / top-p / min-p and one
uniform per sampled token, drawn here from the sequence's own generator exactly as the numpy
sampler draws it (so seeded requests reproduce, and a replay elsewhere skips one draw per token).
Logprobs (a sampled row's and the prompt's) describe the raw model distribution, as
``logprobs_of`` does. What comes back (:class:`Picked`) is token ids and the logprob numbers asked
for, never the ``[rows, vocab]`` logits (unless the engine keeps them, in tests).
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from pdserve.engine.model_runner import PromptRows
from pdserve.engine.sampler import Sample, Sampler
from pdserve.engine.sequence import Sequence


@dataclasses.dataclass
class RowEdits:
    """Sparse per-row edits: ``rows[i]``'s id ``ids[i]`` takes ``values[i]`` (ids unique per row)."""

    rows: np.ndarray  # int64 [E]
    ids: np.ndarray  # int64 [E]
    values: np.ndarray  # [E]: float32 (bias) or float64 (penalty amounts); unused for bans

    @classmethod
    def gather(cls, parts: list[tuple[int, np.ndarray, np.ndarray]], dtype: type) -> RowEdits | None:
        if not parts:
            return None
        rows = np.concatenate([np.full(ids.size, r, np.int64) for r, ids, _ in parts])
        ids = np.concatenate([ids for _, ids, _ in parts]).astype(np.int64, copy=False)
        values: np.ndarray = np.concatenate([v for _, _, v in parts]).astype(dtype, copy=False)
        return cls(rows, ids, values)


@dataclasses.dataclass
class PromptScore:
    """Logits rows ``row .. row + count - 1`` score ``tokens`` with ``num_top`` alternatives."""

    row: int
    tokens: np.ndarray  # int64 [count]
    num_top: int


@dataclasses.dataclass
class SamplingPlan:
    """Per sampling row ``i`` (logits row ``i``) of a step, what picks its token."""

    vocab_limit: int
    plain: bool  # every row the argmax of its raw logits, nothing else (no edit, no draw)
    greedy: np.ndarray  # bool [R]: the argmax after the edits
    temperature: np.ndarray  # float32 [R] (1 where greedy)
    top_k: np.ndarray  # int64 [R] (0: off)
    top_p: np.ndarray  # float64 [R] (compared with float32 sums as numpy compares a Python float)
    min_p: np.ndarray  # float32 [R] (0: off)
    uniform: np.ndarray  # float64 [R]: the row's draw from its generator (0 where greedy)
    logprobs: np.ndarray  # int64 [R]: alternatives wanted (-1: no logprobs)
    bias: RowEdits | None  # float32 biases, added
    grammar_rows: np.ndarray  # int64 [G]: constrained rows whose grammar allows something
    grammar_bits: np.ndarray  # uint8 [G, ceil(vocab_limit / 8)]: allowed ids, bit i of byte i // 8
    bans: RowEdits | None  # min_tokens: ids set to -inf
    repetition: np.ndarray  # float32 [R] (1: off)
    seen: RowEdits | None  # repetition penalty: every id of the sequence (prompt and output)
    penalty: RowEdits | None  # presence/frequency: float64 amounts subtracted
    prompt: list[PromptScore]
    keep_logits: bool  # the logits rows come back too (tests)

    @property
    def num_rows(self) -> int:
        return int(self.greedy.size)


@dataclasses.dataclass
class Picked:
    """What a device sampler hands back: token ids, and the logprob numbers asked for."""

    tokens: np.ndarray  # int64 [R]
    logprob: np.ndarray  # float64 [R] (nan where not asked)
    rank: np.ndarray  # int64 [R]
    top_ids: np.ndarray  # int64 [R, N]
    top_logprobs: np.ndarray  # float64 [R, N]
    prompt: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]  # per PromptScore: the same four
    logits: np.ndarray | None = None  # float32 [R, vocab] where plan.keep_logits

    def samples(self, plan: SamplingPlan) -> list[Sample]:
        return [self._sample(i, int(n)) for i, n in enumerate(plan.logprobs)]

    def _sample(self, i: int, num_top: int) -> Sample:
        token = int(self.tokens[i])
        if num_top < 0:
            return Sample(token)
        return _scored(token, self.logprob[i], self.rank[i], self.top_ids[i], self.top_logprobs[i], num_top)

    def prompt_samples(self, plan: SamplingPlan) -> list[list[Sample]]:
        out = []
        for score, (own, rank, ids, values) in zip(plan.prompt, self.prompt):
            out.append(
                [
                    _scored(int(t), own[j], rank[j], ids[j], values[j], score.num_top)
                    for j, t in enumerate(score.tokens)
                ]
            )
        return out


def _scored(token: int, own: float, rank: int, ids: np.ndarray, values: np.ndarray, num_top: int) -> Sample:
    top = [(int(ids[j]), float(values[j])) for j in range(num_top)] if num_top else None
    return Sample(token, float(own), top, int(rank))


class SamplingPlanner:
    """Builds a step's :class:`SamplingPlan`. Keeps each sequence's token history as numpy (its
    prompt's distinct ids once, its output grown by the tokens appended since), so a penalised row
    costs a sort of its ids, not a conversion of its whole history, each step."""

    def __init__(self, sampler: Sampler, keep_logits: bool = False) -> None:
        self.sampler = sampler
        self.keep_logits = keep_logits
        self._histories: weakref.WeakKeyDictionary[Sequence, _History] = weakref.WeakKeyDictionary()

    def plan(self, seqs: list[Sequence], spans: list[PromptRows]) -> SamplingPlan:
        """The plan of a step whose logits rows 0.. sample ``seqs`` and whose later rows score
        ``spans``. Draws one uniform from each non-greedy sequence's generator (the numpy
        sampler's one draw)."""
        sampler = self.sampler
        n, vocab = len(seqs), sampler.vocab_limit
        greedy = np.ones(n, bool)
        temperature = np.ones(n, np.float32)
        top_k = np.zeros(n, np.int64)
        top_p = np.ones(n, np.float64)
        min_p = np.zeros(n, np.float32)
        uniform = np.zeros(n, np.float64)
        logprobs = np.full(n, -1, np.int64)
        repetition = np.ones(n, np.float32)
        bias: list[tuple[int, np.ndarray, np.ndarray]] = []
        bans: list[tuple[int, np.ndarray, np.ndarray]] = []
        seen: list[tuple[int, np.ndarray, np.ndarray]] = []
        penalty: list[tuple[int, np.ndarray, np.ndarray]] = []
        grammar_rows: list[int] = []
        grammar_bits: list[np.ndarray] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.logprobs is not None:
                logprobs[i] = p.logprobs
            if sampler.is_plain_greedy(seq):
                continue
            if p.logit_bias:
                ids, vals = _bias(seq, vocab)
                bias.append((i, ids, vals))
            allowed = seq.grammar.allowed() if seq.grammar is not None else None
            if allowed is not None and allowed.any():  # none allowed: the engine fails the request
                grammar_rows.append(i)
                grammar_bits.append(np.packbits(allowed[:vocab], bitorder="little"))
            if seq.num_output_tokens < p.min_tokens:
                banned = [t for t in [*sampler.eos_token_ids, *p.stop_token_ids] if t < vocab]
                if allowed is None or np.delete(allowed, banned).any():  # the grammar may leave only EOS
                    ids = np.asarray(banned, np.int64)
                    bans.append((i, ids, np.zeros(ids.size, np.float32)))
            if p.repetition_penalty != 1.0 or (
                (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids
            ):
                history = self._history(seq)
                if p.repetition_penalty != 1.0:
                    ids, _ = distinct(np.concatenate([history.prompt, history.output(seq)]))
                    repetition[i] = p.repetition_penalty
                    ids = ids[ids < vocab]
                    seen.append((i, ids, np.zeros(ids.size, np.float32)))
                if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
                    ids, counts = distinct(history.output(seq))
                    keep = ids < vocab
                    ids, counts = ids[keep], counts[keep]
                    amount = p.frequency_penalty * counts + p.presence_penalty  # float64, as numpy's
                    penalty.append((i, ids, amount))
            if p.is_greedy:
                continue
            greedy[i] = False
            temperature[i] = p.temperature
            top_k[i] = p.top_k if 0 < p.top_k < vocab else 0
            top_p[i], min_p[i] = p.top_p, p.min_p
            assert seq.rng is not None  # the engine gives each tracked sequence its generator
            uniform[i] = seq.rng.random()
        prompt = []
        for span in spans:
            assert span.seq.params.prompt_logprobs is not None
            first = span.first + 1
            tokens = np.asarray(span.seq.prompt_token_ids[first : first + span.count], np.int64)
            prompt.append(PromptScore(span.row, tokens, span.seq.params.prompt_logprobs))
        return SamplingPlan(
            vocab_limit=vocab,
            plain=all(map(sampler.is_plain_greedy, seqs)),
            greedy=greedy,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            uniform=uniform,
            logprobs=logprobs,
            bias=RowEdits.gather(bias, np.float32),
            grammar_rows=np.asarray(grammar_rows, np.int64),
            grammar_bits=np.stack(grammar_bits) if grammar_bits else np.zeros((0, -(-vocab // 8)), np.uint8),
            bans=RowEdits.gather(bans, np.float32),
            repetition=repetition,
            seen=RowEdits.gather(seen, np.float32),
            penalty=RowEdits.gather(penalty, np.float64),
            prompt=prompt,
            keep_logits=self.keep_logits,
        )

    def _history(self, seq: Sequence) -> _History:
        history = self._histories.get(seq)
        if history is None:
            history = self._histories[seq] = _History(np.asarray(seq.prompt_token_ids, np.int64))
        return history


class _History:
    """A sequence's distinct prompt ids, and its output ids as a growing numpy array."""

    def __init__(self, prompt: np.ndarray) -> None:
        self.prompt, _ = distinct(prompt)
        self._out = np.zeros(64, np.int64)
        self._n = 0

    def output(self, seq: Sequence) -> np.ndarray:
        """Its output ids so far (tokens are only ever appended to ``output_token_ids``)."""
        if len(seq.output_token_ids) < self._n:  # never expected: start again rather than be wrong
            self._n = 0
        new = seq.output_token_ids[self._n :]
        if new:
            end = self._n + len(new)
            if end > self._out.size:
                self._out = np.concatenate([self._out[: self._n], np.zeros(2 * end, np.int64)])
            self._out[self._n : end] = new
            self._n = end
        return self._out[: self._n]


def distinct(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_counts=True)`` by a sort (2k ids: ~50 us here, where numpy 2.4's
    plain ``np.unique`` takes ~170 us)."""
    s = np.sort(ids)
    first = np.ones(s.size, bool)
    first[1:] = s[1:] != s[:-1]
    starts = np.flatnonzero(first)
    return s[starts], np.diff(np.append(starts, s.size))


def _bias(seq: Sequence, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``params.logit_bias`` as (ids, float32 biases) below ``vocab``, built once per sequence (the
    same cache, and the same arrays, as the numpy sampler's)."""
    if seq.logit_bias is None:
        bias = seq.params.logit_bias or {}
        ids = np.fromiter(bias.keys(), np.int64, len(bias))
        vals = np.fromiter(bias.values(), np.float32, len(bias))
        keep = ids < vocab  # ids of padding rows beyond the tokenizer are never sampled
        seq.logit_bias = (ids[keep], vals[keep])
    return seq.logit_bias
