"""The torch platform's fused layer kernels, warm-up, staging and flash prefill on a real GPU: what
tests/engine/cuda/test_layer_ops.py, tests/engine/cuda/test_replay_staging.py and
tests/engine/cuda/test_torch_prefill_attention.py check on the CPU (the interpreter, CPU tensors) and
cannot check there: the compiled kernels against their twins, no Triton compile after start while
serving widths and chunks of every size, the kernels a decode step launches, a replay staged through
pinned memory without a sync, and the flash kernel for a first chunk (with its time at 2048 tokens).

Skipped with the reason on a host without a GPU (conftest.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch (pip install 'pdserve[cuda]')")

from pdserve.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.test_gpu_engine import cuda_engine  # noqa: E402

pytestmark = pytest.mark.gpu


def compiled_kernels() -> int:
    """Kernels Triton has compiled in this process for the torch platform's jit functions."""
    from pdserve.engine.cuda import triton_layer_kernels as lk
    from pdserve.engine.cuda import triton_paged_kernels as pk

    total = 0
    for fn in (lk.add_rms_norm, lk.rope_write_kv, lk.silu_mul, pk.decode, pk.merge_splits, pk.prefill):
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps its compiled kernels where the test does not look")
        total += sum(len(entry[0]) for entry in caches.values())
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_compiled_fused_kernels_match_their_twins(dtype: Any) -> None:
    from pdserve.engine.cuda import layer_ops as lo

    g = torch.Generator(device="cuda").manual_seed(0)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2**-7}
    for hidden in (576, 4096, 333):
        x, r = (torch.randn((37, hidden), generator=g, device="cuda").to(dtype) for _ in range(2))
        w = torch.rand(hidden, generator=g, device="cuda") + 0.5
        r1, r2 = r.clone(), r.clone()
        torch.testing.assert_close(
            lo.triton_add_rms_norm(x, r1, w, 1e-5), lo.torch_add_rms_norm(x, r2, w, 1e-5), **tol
        )
        torch.testing.assert_close(r1, r2, atol=0, rtol=0)  # one rounding of one sum: bit for bit
    for heads, kv_heads, dim in ((32, 8, 128), (9, 3, 64), (4, 4, 64)):
        n, bs, layers, blocks = 37, 16, 3, 12
        qkv = torch.randn((n, (heads + 2 * kv_heads) * dim), generator=g, device="cuda").to(dtype)
        cache = torch.full((blocks, 2, layers, bs, kv_heads, dim), float("nan"), dtype=dtype, device="cuda")
        slots = torch.randperm(blocks * bs - bs, generator=g, device="cuda")[:n].add_(bs).int()
        positions = torch.randint(0, 2000, (n,), generator=g, device="cuda").int()
        inv = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        emb = torch.outer(torch.arange(2048, dtype=torch.float64), inv).repeat(1, 2)
        cos, sin = emb.cos().float().cuda(), emb.sin().float().cuda()
        q1, c1, q2, c2 = qkv.clone(), cache.clone(), qkv.clone(), cache.clone()
        lo.triton_rope_write_kv(q1, positions, slots, cos, sin, c1, 1, heads, kv_heads)
        lo.torch_rope_write_kv(q2, positions, slots, cos, sin, c2, 1, heads, kv_heads)
        torch.testing.assert_close(q1, q2, **tol)
        assert torch.equal(c1.isnan(), c2.isnan())
        torch.testing.assert_close(c1.nan_to_num(0), c2.nan_to_num(0), **tol)
    for inter in (1536, 14336, 1500):
        gu = torch.randn((37, 2 * inter), generator=g, device="cuda").to(dtype)
        torch.testing.assert_close(lo.triton_silu_mul(gu), lo.torch_silu_mul(gu), **tol)


def test_serving_compiles_no_triton_kernel_after_start(tiny_model_dir: Path) -> None:
    """Prompts of many lengths, chunked, decoding beside each other's chunks: eager mixed steps whose
    decode tables have every width up to 2048 tokens (and split counts with them), later chunks of
    every length, and replayed decode steps. Everything was compiled by the engine's warm-up."""
    with cuda_engine(tiny_model_dir, dtype="bfloat16", max_model_len=2048, prefill_chunk_size=96) as eng:
        start = compiled_kernels()
        assert start > 0
        rng = np.random.default_rng(0)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for i, n in enumerate((5, 130, 700, 1500, 33, 1000)):
            eng.add_request(
                f"r{i}", prompt_token_ids=[int(t) for t in rng.integers(10, 3000, n)], params=params
            )
            for _ in range(3 * i):
                eng.step()
        while eng.has_unfinished():
            eng.step()
        assert compiled_kernels() == start


def test_a_decode_step_launches_about_ten_kernels_a_layer(tiny_model_dir: Path) -> None:
    """One eager decode step of the model (4 sequences), its CUDA kernels counted by the profiler:
    per layer 4 GEMMs, 2 norms, RoPE + K/V write, attention (+ a merge when split), SiLU x up."""
    from torch.profiler import ProfilerActivity, profile

    from pdserve.engine.cuda.torch_model import DeviceGroup, DeviceStep

    with cuda_engine(tiny_model_dir, dtype="bfloat16", cuda_graphs=False) as eng:
        model, cache = eng.executor.model, eng.executor.cache.tensor
        i32 = {"dtype": torch.int32, "device": "cuda"}
        ids = torch.arange(4, **i32)
        group = DeviceGroup(0, 4, True, torch.zeros((4, 1), **i32), torch.ones(4, **i32), 0)
        step = DeviceStep(ids, torch.zeros(4, **i32), torch.zeros(4, **i32), [group], None)
        with torch.inference_mode():
            model.forward(cache, step)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model.forward(cache, step)
                torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e.name for e in prof.events() if e.device_type == cuda and "memcpy" not in e.name.lower()]
    layers = model.cfg.num_layers
    print(f"{len(kernels)} kernels for {layers} layers: {sorted(set(kernels))}")
    fused = {
        name: sum(k.startswith(name) for k in kernels)
        for name in ("add_rms_norm", "rope_write_kv", "silu_mul", "decode")
    }
    assert fused == {
        "add_rms_norm": 2 * layers + 1,
        "rope_write_kv": layers,
        "silu_mul": layers,
        "decode": layers,
    }
    rest = len(kernels) - sum(
        fused.values()
    )  # GEMMs (cuBLAS may add a split-K reduction), embedding, logits copy
    assert rest <= 2 * (4 * layers + 1) + 2, sorted(set(kernels))


def test_a_replayed_step_is_staged_through_pinned_memory_without_a_sync(tiny_model_dir: Path) -> None:
    with cuda_engine(tiny_model_dir, dtype="bfloat16") as eng:
        graphs = eng.executor.graphs
        assert graphs is not None and graphs.staging.host.is_pinned()
        n, width = 3, 4
        tables = np.zeros((n, width), np.int64)
        tables[:, :2] = [[1, 2], [3, 4], [5, 6]]
        lengths = np.array([20, 31, 9])
        slots = tables[np.arange(n), (lengths - 1) // 16] * 16 + (lengths - 1) % 16
        args = (np.array([7, 8, 9]), lengths - 1, slots, tables, lengths)
        with torch.inference_mode():
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = graphs.run(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert out is not None
            replayed = out.clone()
            eager = eng.executor.model.forward(graphs.cache, graphs._step(4))
        assert eager is not None  # the same kernels on the same staged inputs (cuBLAS may pick others)
        torch.testing.assert_close(replayed, eager[:n], atol=5e-2, rtol=2e-2)


def test_a_first_chunk_runs_the_flash_kernel_and_its_time_at_2048_tokens() -> None:
    """The 8B shape (32 heads, 8 kv heads, 128 wide) at 2048 tokens in bfloat16: the 4-D call runs
    a flash kernel; printed: its time against the former 3-D call's (the math path)."""
    import types

    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from pdserve.engine.cuda.torch_model import TorchModel

    n, heads, kv_heads, dim = 2048, 32, 8, 128
    qkv = torch.randn((n, (heads + 2 * kv_heads) * dim), device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)
    me = types.SimpleNamespace(scale=dim**-0.5)

    def new() -> Any:
        return TorchModel._causal(me, q, k, v)  # type: ignore[arg-type]

    def old() -> Any:
        t = (x.transpose(0, 1) for x in (q, k, v))
        return F.scaled_dot_product_attention(*t, is_causal=True, scale=me.scale, enable_gqa=True).transpose(
            0, 1
        )

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        new()
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any(word in name for name in names for word in ("flash", "fmha")), names  # flash, or cuDNN's
    assert not any("softmax" in name for name in names), names  # the math path's
    torch.testing.assert_close(new(), old(), atol=2e-2, rtol=2e-2)
    for name, fn in (("4-D (flash)", new), ("3-D (former)", old)):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        print(f"first chunk of {n} tokens, {name}: {(time.perf_counter() - t0) * 100:.3f} ms per layer")
