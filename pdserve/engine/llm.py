"""Offline generation: ``LLM(model_dir).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclasses.dataclass
class Generation:
    """One prompt's whole result."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # with SamplingParams.prompt_logprobs
    error: str | None = None
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # with EngineConfig.keep_logits

    @property
    def usage(self) -> dict[str, int]:
        n, m = len(self.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        if out.logits is not None:
            self.logits.append(out.logits)
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error


class LLM:
    """A single in-process engine. ``engine_kwargs`` are EngineConfig fields."""

    def __init__(self, model: str | Path, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(model, EngineConfig(**engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Generation]:
        """Run every prompt to completion (all batched together); results in prompt order."""
        results = {g.request_id: g for g in self._submit(prompts, sampling_params)}
        for out in self._run():
            results[out.request_id].add(out)
        return list(results.values())

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield per-step deltas as they are produced."""
        self._submit(prompts, sampling_params)
        yield from self._run()

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Generation]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):  # one conversation
            batch = [conversations]
        else:
            batch = cast(list[list[dict[str, Any]]], conversations)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in batch]
        return self.generate(prompts, sampling_params)

    def _submit(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[Generation]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):  # one prompt
            batch: Sequence[Prompt] = [cast(Prompt, prompts)]
        else:
            batch = cast(Sequence[Prompt], prompts)
        params = (
            sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(batch)
        )
        if len(params) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params)} sampling_params")
        jobs = []
        for prompt, p in zip(batch, params):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            p = p or SamplingParams()
            self.engine.validate(ids, p)  # all or nothing: a bad prompt must not leave others queued
            jobs.append((ids, p))
        gens = []
        for ids, p in jobs:
            rid = f"gen-{next(self._ids)}"
            self.engine.add_request(rid, prompt_token_ids=ids, params=p)
            gens.append(Generation(rid, ids))
        return gens

    def _run(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished():
            yield from self.engine.step()
