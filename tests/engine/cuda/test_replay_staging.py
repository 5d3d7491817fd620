"""The staging of replayed decode steps (engine/cuda/replay_staging.py) and DecodeGraphs' use of it, on
CPU tensors: each bucket's layout, padding rows and stale table entries, one copy per step, and the
views a bucket's step reads. (Pinned memory and the copy's event need CUDA: tests/gpu.)"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch platform needs PyTorch")

from pdserve.engine.block_manager import NULL_BLOCK  # noqa: E402
from pdserve.engine.cuda.cuda_graphs import DecodeGraphs, graph_buckets  # noqa: E402
from pdserve.engine.cuda.replay_staging import FIELD_ALIGN, FIELDS, ReplayStaging, bucket_layout  # noqa: E402

BS = 16


def staging(buckets: list[int], width: int) -> ReplayStaging:
    return ReplayStaging(buckets, width, torch.device("cpu"), NULL_BLOCK, BS)


def decode_step(rng: np.random.Generator, n: int, width: int) -> dict[str, np.ndarray]:
    lengths = rng.integers(1, width * BS + 1, n)
    tables = rng.integers(1, 500, (n, width))
    return {
        "token_ids": rng.integers(0, 4000, n),
        "positions": lengths - 1,
        "slots": tables[np.arange(n), (lengths - 1) // BS] * BS + (lengths - 1) % BS,
        "tables": tables,
        "lengths": lengths,
    }


def stage(s: ReplayStaging, rows: int, step: dict[str, np.ndarray]) -> Any:
    return s.stage(rows, step["token_ids"], step["positions"], step["slots"], step["tables"], step["lengths"])


@pytest.mark.parametrize("width", [1, 3, 128])
def test_every_field_of_every_bucket_starts_on_128_bytes_and_none_overlap(width: int) -> None:
    buckets = graph_buckets(20)
    s = staging(buckets, width)
    assert s.device_buffer.data_ptr() % 64 == 0
    for b in buckets:
        offsets, end = bucket_layout(b, width)
        assert list(offsets) == list(FIELDS) and end <= s.device_buffer.numel()
        sizes = [b, b, b, b, b * width]
        spans = sorted((offsets[f], offsets[f] + size) for f, size in zip(FIELDS, sizes))
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
        views = s.views[b]
        for name in FIELDS:
            view = getattr(views, name)
            assert offsets[name] % FIELD_ALIGN == 0
            assert (view.data_ptr() - s.device_buffer.data_ptr()) == 4 * offsets[name]
            assert view.dtype == torch.int32 and view.is_contiguous()
        assert views.tables.shape == (b, width) and views.lengths.shape == (b,)


def test_a_step_fills_its_bucket_and_pads_the_rest_with_the_null_block() -> None:
    rng = np.random.default_rng(0)
    s = staging([1, 2, 4, 8], 6)
    wide = decode_step(rng, 4, 6)
    stage(s, 4, wide)
    narrow = decode_step(rng, 3, 2)  # fewer rows and narrower tables than the last step in bucket 4
    v = stage(s, 4, narrow)
    for name in ("token_ids", "positions", "slots", "lengths"):
        np.testing.assert_array_equal(getattr(v, name)[:3].numpy(), narrow[name])
    np.testing.assert_array_equal(v.token_ids[3:].numpy(), [0])
    np.testing.assert_array_equal(v.positions[3:].numpy(), [0])
    np.testing.assert_array_equal(v.slots[3:].numpy(), [NULL_BLOCK * BS])
    np.testing.assert_array_equal(v.lengths[3:].numpy(), [1])
    tables = v.tables.numpy()
    np.testing.assert_array_equal(tables[:3, :2], narrow["tables"])
    assert (tables[:3, 2:] == NULL_BLOCK).all() and (tables[3:] == NULL_BLOCK).all()  # no stale entry
    again = decode_step(rng, 1, 6)  # another bucket over the same buffer: its own layout, filled
    other = stage(s, 2, again)
    np.testing.assert_array_equal(other.tables.numpy(), [again["tables"][0], [NULL_BLOCK] * 6])
    np.testing.assert_array_equal(other.lengths.numpy(), [again["lengths"][0], 1])


def test_a_step_is_one_copy_of_one_contiguous_range() -> None:
    """Staging a step dispatches a single copy (host buffer prefix -> device buffer prefix); the
    rest is numpy writes into the host buffer and views."""
    from torch.utils._python_dispatch import TorchDispatchMode

    copies: list[tuple[int, int]] = []
    others: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten.copy_.default:
                dst, src = args[0], args[1]
                assert dst.is_contiguous() and src.is_contiguous()
                copies.append((dst.data_ptr(), src.numel()))
            elif not func.is_view:
                others.append(str(func))
            return func(*args, **(kwargs or {}))

    s = staging([1, 2, 4, 8], 40)
    with Spy():
        stage(s, 8, decode_step(np.random.default_rng(1), 5, 17))
    assert others == []
    assert copies == [(s.device_buffer.data_ptr(), bucket_layout(8, 40)[1])]


def test_a_step_that_does_not_fit_its_bucket_is_refused() -> None:
    s = staging([1, 2, 4], 3)
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError, match="does not fit"):
        stage(s, 2, decode_step(rng, 3, 2))
    with pytest.raises(ValueError, match="does not fit"):
        stage(s, 4, decode_step(rng, 2, 4))


class FakeModel:
    """Records the step DecodeGraphs runs uncaptured; logits row i = the row's token id."""

    def __init__(self) -> None:
        self.steps: list[Any] = []

    def forward(self, cache: Any, step: Any) -> Any:
        self.steps.append(step)
        return step.token_ids.float()[:, None].repeat(1, 3)


def test_decode_graphs_run_a_bucket_on_its_staged_views() -> None:
    cache = torch.zeros((64, 2, 1, BS, 1, 4))
    model = FakeModel()
    graphs = DecodeGraphs(model, cache, 20, 8)  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    step = decode_step(rng, 11, 5)
    out = graphs.run(step["token_ids"], step["positions"], step["slots"], step["tables"], step["lengths"])
    assert out is not None and out.shape == (11, 3)
    np.testing.assert_array_equal(out[:, 0].numpy(), step["token_ids"])
    ran = model.steps[-1]
    views = graphs.staging.views[16]  # 11 decodes run in bucket 16
    assert ran.token_ids is views.token_ids and ran.slots is views.slots and ran.positions is views.positions
    group = ran.groups[0]
    assert (
        group.is_decode
        and group.count == 16
        and group.tables is views.tables
        and group.lengths is views.lengths
    )
    too_many = decode_step(rng, 21, 2)
    assert (
        graphs.run(*(too_many[k] for k in ("token_ids", "positions", "slots", "tables", "lengths"))) is None
    )
    too_wide = decode_step(rng, 2, 9)
    assert (
        graphs.run(*(too_wide[k] for k in ("token_ids", "positions", "slots", "tables", "lengths"))) is None
    )


def test_decode_graphs_refuse_a_cache_whose_slots_overflow_int32() -> None:
    cache = torch.empty((2**27, 2, 1, BS, 1, 1), device="meta")
    with pytest.raises(ValueError, match="int32"):
        DecodeGraphs(FakeModel(), cache, 4, 8)  # type: ignore[arg-type]
