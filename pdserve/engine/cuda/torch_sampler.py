"""The numpy sampler's choices made where the logits are: a :class:`SamplingPlan` applied to a step's
logits rows on the torch device, and only token ids (and the logprob numbers asked for) copied
back: a 128k vocabulary's float32 logits are 16 MB a step at batch 32, its ids 256 bytes.

Same order and arithmetic as sampler.py, row by row: logit_bias (float32 add), the grammar's
bitmask (-inf where not allowed), min_tokens' bans, the repetition penalty (float32 divide or
multiply), presence/frequency (float64 subtract, rounded to float32), then greedy (argmax, first
of equals) or ``logits / temperature`` (float32), top-k (the k best, ties by id), probabilities
over the candidates, sorted by probability with ties by id, top-p (float32 cumulative sum against
the float64 ``top_p``), min-p, and the inverse CDF at the host's uniform (float64 cumulative sum,
``searchsorted(..., "right")``). Logprobs: log_softmax in float64 of the raw row, rank = 1 + ids
strictly above, the best ``n`` by (logprob, id).

Where it can differ from numpy: sums taken in another order (numpy's pairwise and sequential sums,
the device's trees and scans) round differently in the last bits, so a uniform within ~1e-7 of a
cumulative boundary, or a ``top_p`` / ``min_p`` cut within as much, can fall on the other side;
numpy's top-k and top-n keep an arbitrary member of a tie at the cut, this keeps the lowest id.
No step waits for the device before the final copy: every shape here comes from the plan.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.sample_plan import Picked, SamplingPlan

_SCORE_ROWS = 32  # log_softmax in float64 over this many rows at once (32 x 128k x 8 B = 32 MB)
_NEG_INF = float("-inf")


class DeviceSampler:
    """Runs :class:`SamplingPlan` s on one torch device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._shifts = torch.arange(8, dtype=torch.uint8, device=device)

    def pick(self, logits: torch.Tensor, plan: SamplingPlan) -> Picked:
        """The plan's tokens from ``logits`` (float32 [rows, vocab] on the device, sampling rows
        first, then the prompt rows it scores), on the host."""
        return self.sample(logits, plan).collect()

    def sample(self, logits: torch.Tensor, plan: SamplingPlan) -> DevicePicks:
        """Queue the sampling and the copy of its results to the host; nothing here waits for the
        device (every shape comes from the plan), so the host may work until :meth:`DevicePicks.collect`."""
        return DevicePicks(self._results(logits, plan), plan)

    def _results(self, logits: torch.Tensor, plan: SamplingPlan) -> list[torch.Tensor]:
        """Every result on the device, in the order :meth:`DevicePicks.collect` reads them."""
        n, vocab = plan.num_rows, plan.vocab_limit
        head = logits[:n, :vocab]
        tokens = head.argmax(dim=1) if plan.plain else self._choose(head, plan)
        out = [tokens]
        asked = np.flatnonzero(plan.logprobs >= 0)
        if asked.size:
            rows = self._index(asked)
            out += self._score(
                head.index_select(0, rows), tokens.index_select(0, rows), int(plan.logprobs.max())
            )
        for score in plan.prompt:
            count = score.tokens.size
            out += self._score(
                logits[score.row : score.row + count, :vocab], self._put(score.tokens), score.num_top
            )
        if plan.keep_logits:
            out.append(logits[:n])
        return out

    # ---- choosing -------------------------------------------------------------------------------
    def _choose(self, head: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
        x = head.clone()
        self._edit(x, plan)
        tokens = x.argmax(dim=1)
        drawn = np.flatnonzero(~plan.greedy)
        if drawn.size == 0:
            return tokens
        rows = self._index(drawn)
        got = self._draw(x.index_select(0, rows), plan, drawn)
        return tokens.index_copy(0, rows, got)

    def _edit(self, x: torch.Tensor, plan: SamplingPlan) -> None:
        """The numpy sampler's edits before the choice, in its order, on the float32 rows ``x``."""
        if plan.bias is not None:
            rows, ids = self._put(plan.bias.rows), self._put(plan.bias.ids)
            x[rows, ids] = x[rows, ids] + self._put(plan.bias.values)
        if plan.grammar_rows.size:
            rows = self._put(plan.grammar_rows)
            bits = self._put(plan.grammar_bits)
            allowed = (bits.unsqueeze(-1) >> self._shifts).bitwise_and_(1).bool()
            allowed = allowed.flatten(1)[:, : x.shape[1]]
            x[rows] = x.index_select(0, rows).masked_fill_(~allowed, _NEG_INF)
        if plan.bans is not None:
            x[self._put(plan.bans.rows), self._put(plan.bans.ids)] = _NEG_INF
        if plan.seen is not None:
            rows, ids = self._put(plan.seen.rows), self._put(plan.seen.ids)
            vals = x[rows, ids]
            rp = self._put(plan.repetition).index_select(0, rows)  # a device tensor: a true division
            x[rows, ids] = torch.where(vals > 0, vals / rp, vals * rp)
        if plan.penalty is not None:
            rows, ids = self._put(plan.penalty.rows), self._put(plan.penalty.ids)
            x[rows, ids] = (x[rows, ids].double() - self._put(plan.penalty.values)).float()

    def _draw(self, x: torch.Tensor, plan: SamplingPlan, which: np.ndarray) -> torch.Tensor:
        """One token per row of ``x`` (the edited rows ``which`` of the plan) by its uniform."""
        x = x / self._put(plan.temperature[which]).unsqueeze(1)
        k = plan.top_k[which]
        limited = np.flatnonzero(k > 0)
        if limited.size == which.size:
            probs, ids, count = self._top_k_probs(x, k)
        elif limited.size == 0:
            probs, ids, count = self._full_probs(x)
        else:  # some rows with top-k, some without: each group alone, then back in order
            everything = self._index(np.flatnonzero(k == 0))
            some = self._index(limited)
            p_all, i_all, c_all = self._full_probs(x.index_select(0, everything))
            p_k, i_k, c_k = self._top_k_probs(x.index_select(0, some), k[limited])
            width = p_all.shape[1]
            probs = x.new_zeros((x.shape[0], width)).index_copy(0, everything, p_all)
            probs[some, : p_k.shape[1]] = p_k
            ids = torch.zeros((x.shape[0], width), dtype=torch.long, device=x.device)
            ids = ids.index_copy(0, everything, i_all)
            ids[some, : i_k.shape[1]] = i_k
            count = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
            count = count.index_copy(0, everything, c_all).index_copy(0, some, c_k)
        return self._inverse_cdf(probs, ids, count, plan, which)

    def _full_probs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every id a candidate: probabilities over the row, sorted, ties by id."""
        probs = torch.exp(x - x.max(dim=1, keepdim=True).values)
        probs = probs / probs.sum(dim=1, keepdim=True)
        sorted_probs, ids = torch.sort(probs, dim=1, descending=True, stable=True)  # stable: ties by id
        count = torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
        return sorted_probs, ids, count

    def _top_k_probs(self, x: torch.Tensor, k: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The k best of each row (ties by id) as candidates: their probabilities over them alone,
        sorted, ties by id; columns past a row's k hold probability 0."""
        width = int(k.max())
        vals, ids = best_first(x, width)  # by value, ties by id
        count = self._put(k)
        outside = torch.arange(width, device=x.device).unsqueeze(0) >= count.unsqueeze(1)
        vals = vals.masked_fill(outside, _NEG_INF)
        probs = torch.exp(vals - vals[:, :1])
        probs = probs / probs.sum(dim=1, keepdim=True)
        # numpy orders by probability, ties by id (two values can round to one probability): by id
        # first, then a stable sort by probability
        ids, by_id = torch.sort(ids, dim=1)
        probs, order = torch.sort(probs.gather(1, by_id), dim=1, descending=True, stable=True)
        return probs, ids.gather(1, order), count

    def _inverse_cdf(
        self,
        probs: torch.Tensor,
        ids: torch.Tensor,
        count: torch.Tensor,
        plan: SamplingPlan,
        which: np.ndarray,
    ) -> torch.Tensor:
        """top-p and min-p cut the sorted candidates; the uniform picks among those kept."""
        keep = count
        top_p = plan.top_p[which]
        if (top_p < 1.0).any():
            cum = probs.cumsum(dim=1).double()
            cut = (cum < self._put(top_p).unsqueeze(1)).sum(dim=1) + 1
            keep = torch.where(self._put(top_p < 1.0), torch.minimum(keep, cut), keep)
        min_p = plan.min_p[which]
        if (min_p > 0.0).any():
            floor = self._put(min_p) * probs[:, 0]  # float32, as numpy's min_p * probs[0]
            cut = (probs >= floor.unsqueeze(1)).sum(dim=1)
            keep = torch.where(self._put(min_p > 0.0), torch.minimum(keep, cut), keep)
        keep = keep.clamp(min=1)
        inside = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0) < keep.unsqueeze(1)
        cum64 = torch.where(inside, probs, 0.0).double().cumsum(dim=1)
        target = self._put(plan.uniform[which]) * cum64.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)
        at = ((cum64 <= target.unsqueeze(1)) & inside).sum(dim=1)  # searchsorted(cum, u, "right")
        at = torch.minimum(at, keep - 1)
        return ids.gather(1, at.unsqueeze(1)).squeeze(1)

    # ---- logprobs -------------------------------------------------------------------------------
    def _score(self, rows: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[torch.Tensor]:
        """``logprobs_of`` on the device: each row's token's logprob, its rank, and the ``num_top``
        best (ids, logprobs), best first, ties by id."""
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for start in range(0, rows.shape[0], _SCORE_ROWS):
            block, tok = rows[start : start + _SCORE_ROWS], tokens[start : start + _SCORE_ROWS]
            m = block.max(dim=1, keepdim=True).values
            lse = m.double() + torch.log(torch.exp((block - m).double()).sum(dim=1, keepdim=True))
            logp = block.double() - lse
            own = logp.gather(1, tok.unsqueeze(1))
            parts[0].append(own.squeeze(1))
            parts[1].append((logp > own).sum(dim=1) + 1)
            if num_top:
                vals, ids = best_first(logp, num_top)
            else:
                vals = logp.new_zeros((block.shape[0], 0))
                ids = torch.zeros((block.shape[0], 0), dtype=torch.long, device=block.device)
            parts[2].append(ids)
            parts[3].append(vals)
        return [torch.cat(p) for p in parts]

    # ---- host -> device ---------------------------------------------------------------------------
    def _put(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

    def _index(self, rows: np.ndarray) -> torch.Tensor:
        return self._put(rows.astype(np.int64, copy=False))


def best_first(values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``n`` best (values, ids) by value, ties by the lower id, in that order: the values
    above the row's n-th largest and, of those equal to it, the lowest ids (torch.topk keeps an
    arbitrary member of a tie)."""
    nth = torch.topk(values, n, dim=1).values[:, n - 1 :]
    above = values > nth
    tied = values == nth
    room = n - above.sum(dim=1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(dim=1) <= room))  # exactly n per row
    ids = torch.topk(chosen.to(torch.float32), n, dim=1).indices  # the n chosen (all equal to 1)
    ids, _ = torch.sort(ids, dim=1)
    vals = values.gather(1, ids)
    vals, order = torch.sort(vals, dim=1, descending=True, stable=True)  # stable: ties stay by id
    return vals, ids.gather(1, order)


class DevicePicks:
    """A step's picks on their way to the host: packed into one float64 vector (ids and ranks are
    exact below 2**53), its copy queued into pinned memory on a GPU, and an event recorded after it."""

    def __init__(self, results: list[torch.Tensor], plan: SamplingPlan) -> None:
        self.plan = plan
        kept = results.pop() if plan.keep_logits else None
        self.shapes = [tuple(t.shape) for t in results]
        packed = torch.cat([t.reshape(-1).double() for t in results])
        self.done: torch.cuda.Event | None = None
        if packed.device.type == "cuda":  # to pinned memory: the copy is queued, not waited for
            self.host = packed.to("cpu", non_blocking=True)
            self.logits = None if kept is None else kept.to("cpu", non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host, self.logits = packed, kept

    def collect(self) -> Picked:
        """The picks on the host: the one wait for the device."""
        if self.done is not None:
            self.done.synchronize()
        flat, plan = self.host.numpy(), self.plan
        host, at = [], 0
        for shape in self.shapes:
            size = int(np.prod(shape))
            host.append(flat[at : at + size].reshape(shape))
            at += size
        tokens = host[0].astype(np.int64)
        n = tokens.size
        logprob = np.full(n, np.nan)
        rank = np.zeros(n, np.int64)
        width = int(plan.logprobs.max(initial=0))
        top_ids = np.zeros((n, width), np.int64)
        top_vals = np.zeros((n, width), np.float64)
        at = 1
        asked = np.flatnonzero(plan.logprobs >= 0)
        if asked.size:
            own, ranks, ids, vals = host[at : at + 4]
            logprob[asked], rank[asked] = own, ranks
            top_ids[asked, : ids.shape[1]], top_vals[asked, : vals.shape[1]] = ids, vals
            at += 4
        prompt = []
        for _ in plan.prompt:
            own, ranks, ids, vals = host[at : at + 4]
            prompt.append((own, ranks.astype(np.int64), ids.astype(np.int64), vals))
            at += 4
        logits = None if self.logits is None else self.logits.float().numpy().copy()
        return Picked(tokens, logprob, rank, top_ids, top_vals, prompt, logits)
