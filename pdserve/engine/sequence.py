"""One request's state inside the engine. Pure Python: the batcher and tests need no Paddle."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING

import numpy as np

from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # admitted to the engine, holds no KV blocks yet
    RUNNING = "running"  # holds blocks; prefilling (in chunks) or decoding
    PREFILLED = "prefilled"  # prefill-only run done: blocks kept for hand-off until released
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    background: bool = False  # a batch line: prefilled only when no online prompt waits, preempted first
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    block_table: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    rng: np.random.Generator | None = None
    scheduled_at: float | None = None  # time.monotonic() of its first prefill chunk (queue time)
    logit_bias: tuple[np.ndarray, np.ndarray] | None = (
        None  # params.logit_bias as (ids, biases), by the sampler
    )
    grammar: GrammarMatcher | None = None  # structured output: where the output is in its grammar
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (first admission)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # chain hashes of full blocks
    num_registered_blocks: int = 0  # leading blocks of block_table offered to the prefix cache
    held_blocks: list[int] = dataclasses.field(default_factory=list)
    """Its prompt's prefix blocks held for it until its admission shares them (a peer fetch's:
    ``prefix_pins.PrefixPins.attach_held``); freed then, or when it leaves before."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """True until every token except the last sampled one has its K/V in the cache."""
        return self.num_computed_tokens < self.num_tokens - (1 if self.output_token_ids else 0)

    @property
    def scores_prompt(self) -> bool:
        """Its prefill also yields its prompt's logprobs: asked for, and no token out yet (a
        recompute after a preemption, or a resumed request, delivered them already)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
