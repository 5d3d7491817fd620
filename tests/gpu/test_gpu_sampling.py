"""The device sampler on a GPU (what tests/engine/test_device_sampling.py checks on torch's CPU
device): the numpy sampler's tokens and logprobs for every setting, with CUDA's sorts, scans and
reductions; and a step's sampling queued without the host waiting for the GPU (every shape comes
from the plan: no ``.item()``, no ``nonzero``, the copy back into pinned memory).

Skipped with the reason on a host without a GPU (conftest.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch (pip install 'pdserve[cuda]')")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
import test_device_sampling as cpu  # noqa: E402  (its cases, logits and checks)

from pdserve.engine.cuda.torch_sampler import DeviceSampler  # noqa: E402
from pdserve.engine.sample_plan import SamplingPlanner  # noqa: E402
from pdserve.engine.sampler import Sampler  # noqa: E402

pytestmark = pytest.mark.gpu


def batch_of_every_setting(round_: int) -> tuple[np.ndarray, list, list[int]]:
    """tests/engine/test_device_sampling.py's batch: grid logits, every setting, fixed seeds."""
    rng = np.random.default_rng(100 + round_)
    probe = cpu.cases(lambda i: list(range(10, 60)))
    logits = cpu.make_logits(rng, len(probe), {i for i, c in enumerate(probe) if not c.distinct})
    order = np.argsort(-logits[:, : cpu.VOCAB], axis=1, kind="stable")
    batch = cpu.cases(lambda i: [int(t) for t in order[i]])
    logits[4, cpu.EOS] = logits[4, : cpu.VOCAB].max() + 1.0
    return logits, batch, [1000 * round_ + i for i in range(len(batch))]


@pytest.mark.parametrize("round_", range(6))
def test_the_device_sampler_on_cuda_picks_the_numpy_sampler_s_tokens(round_: int) -> None:
    logits, batch, seeds = batch_of_every_setting(round_)
    sampler = Sampler(cpu.VOCAB, [cpu.EOS])
    want = sampler(logits, [c.seq(s) for c, s in zip(batch, seeds)])
    for i, (c, s) in enumerate(zip(batch, seeds)):
        cpu.assert_stable(logits[i], c, s)
    plan = SamplingPlanner(sampler).plan([c.seq(s) for c, s in zip(batch, seeds)], [])
    got = DeviceSampler(torch.device("cuda")).pick(torch.from_numpy(logits).cuda(), plan).samples(plan)
    for i, c in enumerate(batch):
        cpu.assert_same_sample(got[i], want[i], f"{c.name} (round {round_}, cuda)")


def test_sampling_is_queued_without_waiting_for_the_gpu() -> None:
    """Every setting at once, under CUDA's sync debug mode set to raise: queuing the sampling and
    its copy back makes no synchronizing call; the picks are then the numpy sampler's."""
    logits, batch, seeds = batch_of_every_setting(0)
    sampler = Sampler(cpu.VOCAB, [cpu.EOS])
    want = sampler(logits, [c.seq(s) for c, s in zip(batch, seeds)])
    plan = SamplingPlanner(sampler).plan([c.seq(s) for c, s in zip(batch, seeds)], [])
    device = DeviceSampler(torch.device("cuda"))
    on_gpu = torch.from_numpy(logits).cuda()
    device.pick(on_gpu, plan)  # once first: lazy CUDA initialisation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = device.sample(on_gpu, plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = pending.collect().samples(plan)
    assert [g.token_id for g in got] == [w.token_id for w in want]
