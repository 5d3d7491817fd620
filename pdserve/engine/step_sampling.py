"""Where a step's tokens are picked: the one place that decides.

An executor that samples on its device (``Executor.samples_on_device``: the torch platform) gets
the step's forward launched; the sampling plan (sample_plan.py) is built on the host while the
device runs it (the grammar masks llguidance computes, the penalties' histories, one uniform per
sampled token from each sequence's generator); the sampling and the copy of its results are queued
behind the forward; the host then does the step's work that needs no token of this step (the
engine's ``meanwhile``: computed counts, the prefix cache's new blocks, the next step's block
tables) and only then waits for the ids and the logprob numbers asked for. Otherwise (the CPU
platform) the logits rows come back and the numpy sampler picks, exactly as it always has. The
engine sees samples either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from pdserve.engine.executor import Executor
from pdserve.engine.model_runner import PromptRows
from pdserve.engine.sample_plan import SamplingPlanner
from pdserve.engine.sampler import Sample, Sampler, logprobs_of
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_input import StepInput


@dataclasses.dataclass
class StepSamples:
    """One step's picks: a sample per sampling sequence (in order), the scored prompt positions of
    each span, and the sampling rows' logits where the engine keeps them (tests)."""

    samples: list[Sample]
    prompt: list[tuple[PromptRows, list[Sample]]]
    logits: np.ndarray | None


class StepSampling:
    def __init__(self, executor: Executor, sampler: Sampler, keep_logits: bool = False) -> None:
        self.executor = executor
        self.sampler = sampler
        self.keep_logits = keep_logits
        self.planner = SamplingPlanner(sampler, keep_logits)

    def run(
        self, step: StepInput, seqs: list[Sequence], spans: list[PromptRows], meanwhile: Callable[[], None]
    ) -> StepSamples | None:
        """The step's forward and its picks (None when no row samples or scores). ``meanwhile``
        runs once the forward has succeeded or, on a device that samples, is queued with the
        sampling, before the picks are waited for."""
        if self.executor.samples_on_device:
            return self._on_device(step, seqs, spans, meanwhile)
        rows = self.executor.forward(step)
        meanwhile()
        if rows is None:
            return None
        vocab = self.sampler.vocab_limit
        prompt = []
        for span in spans:  # the logprobs of the prompt tokens these rows predict
            assert span.seq.params.prompt_logprobs is not None
            first = span.first + 1
            tokens = span.seq.prompt_token_ids[first : first + span.count]
            block = rows[span.row : span.row + span.count, :vocab]
            prompt.append((span, logprobs_of(block, tokens, span.seq.params.prompt_logprobs)))
        rows = rows[: len(seqs)]
        return StepSamples(self.sampler(rows, seqs), prompt, rows if self.keep_logits else None)

    def _on_device(
        self, step: StepInput, seqs: list[Sequence], spans: list[PromptRows], meanwhile: Callable[[], None]
    ) -> StepSamples | None:
        launched = self.executor.launch(step)  # on a GPU: queued, the host goes on
        if launched is None:
            meanwhile()
            return None
        plan = self.planner.plan(seqs, spans)  # while the forward runs
        pending = self.executor.sample(launched, plan)  # queued behind it, with the copy back
        meanwhile()  # host work that needs none of this step's tokens
        picked = pending.collect()  # the one wait
        prompt = list(zip(spans, picked.prompt_samples(plan)))
        return StepSamples(picked.samples(plan), prompt, picked.logits)
