"""One forward's packed input, as plain numpy (no tensor library): what ModelRunner.prepare makes and
every platform's model reads."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class AttentionGroup:
    """Tokens ``[start, start + num_tokens)`` of the packed batch that attend together.

    Decode group: ``num_seqs`` sequences with one token each, K/V from ``num_chunks`` gathered chunks,
    or, with the in-place kernel, read through ``tables``/``lengths`` (``num_chunks == 0``, no mask).
    Prefill chunk: one sequence; ``num_chunks == 0`` means its first chunk (attend to own tokens only),
    or, with the kernels, ``tables`` [1, nblk] and ``lengths`` [1] = the chunk's end (any chunk).
    """

    start: int
    num_tokens: int
    num_seqs: int
    num_chunks: int  # rows of the step's combined gather this group owns (2 * seqs * blocks)
    mask: np.ndarray | None  # additive float32: decode [B, 1, T]; fresh prefill [n, n]; chunk [n, 1, T]
    is_decode: bool
    tables: np.ndarray | None = None  # in-place kernel: int64 [B, nblk] block tables
    lengths: np.ndarray | None = None  # in-place kernel: int64 [B] context lengths


@dataclasses.dataclass
class StepInput:
    token_ids: np.ndarray  # int64 [N]
    positions: np.ndarray  # int64 [N]
    write_rows: np.ndarray  # int64 [L, 2*N*kvh]
    gather: np.ndarray | None  # int64 [L, total chunks] for all groups, in group order
    groups: list[AttentionGroup]
    output_rows: np.ndarray  # int64 [M]: rows whose logits are needed
