"""A first prefill chunk's attention on the torch platform (TorchModel._causal): what PyTorch's
fused kernels require of its inputs, and its numbers against the former 3-D call.

On a GPU, ``scaled_dot_product_attention`` takes its flash kernel only for 4-D inputs (3-D ones run
the math path: bf16 upcast, an n x n mask, ~2x slower at 2048 tokens); whether CUDA picks flash
cannot be asked without a GPU (tests/gpu times it), so this checks the inputs' shape here."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch platform needs PyTorch")

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from pdserve.engine.cuda import torch_model  # noqa: E402

SCALE = 0.125


def fresh_chunk(
    dtype: Any, n: int = 45, heads: int = 8, kv_heads: int = 2, dim: int = 64
) -> tuple[Any, Any, Any]:
    """q [n, H, D], k/v [n, KVH, D] as the model has them: views of one fused qkv row each."""
    rng = np.random.default_rng(7)
    qkv = torch.from_numpy(rng.standard_normal((n, (heads + 2 * kv_heads) * dim)).astype(np.float32)).to(
        dtype
    )
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)


def causal(q: Any, k: Any, v: Any) -> Any:
    return torch_model.TorchModel._causal(types.SimpleNamespace(scale=SCALE), q, k, v)  # type: ignore[arg-type]


def former_3d(q: Any, k: Any, v: Any) -> Any:
    """The call as it was: [H, n, D] tensors (the math path on a GPU)."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=SCALE, enable_gqa=True
    )
    return o.transpose(0, 1)


def test_the_first_chunk_gives_flash_its_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """4-D [1, H, n, D] views with a unit last stride, GQA by ``enable_gqa`` (K/V heads not
    repeated), causal by flag with no mask: each of flash's requirements that a host can see."""
    seen: dict[str, Any] = {}
    real = F.scaled_dot_product_attention

    def spy(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        seen.update(q=q, k=k, v=v, args=args, kwargs=kwargs)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch_model.F, "scaled_dot_product_attention", spy)
    q, k, v = fresh_chunk(torch.bfloat16)
    out = causal(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert seen["q"].shape == (1, 8, 45, 64) and seen["k"].shape == seen["v"].shape == (1, 2, 45, 64)
    assert all(seen[x].stride(-1) == 1 for x in "qkv")
    assert seen["args"] == () and seen["kwargs"] == {"is_causal": True, "scale": SCALE, "enable_gqa": True}


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_the_first_chunk_matches_the_former_3d_math_path(dtype: Any, tol: float) -> None:
    """Against the former 3-D call forced onto the math backend (what a GPU ran): float32 within
    float32's rounding, bfloat16 within its own (the math path upcasts; flash keeps bf16 inputs)."""
    q, k, v = fresh_chunk(dtype)
    with sdpa_kernel(SDPBackend.MATH):
        want = former_3d(q, k, v)
    got = causal(q, k, v)
    assert got.dtype == dtype
    assert float((got.float() - want.float()).abs().max()) <= tol
