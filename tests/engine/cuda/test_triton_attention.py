"""Paged attention on the torch platform (engine/cuda/triton_attention.py).

The torch versions are checked against a float64 numpy attention over dense per-sequence K/V; the
Triton kernels run in Triton's interpreter on CPU tensors and are checked against the torch
versions. TRITON_INTERPRET must be set before Triton decorates a kernel, so the interpreter checks
run in one subprocess (``interpreter_checks`` below, this file run with the variable set) and
each test reads its own result. Cache slots no sequence uses hold NaN, so a kernel that reads or
weights one shows up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.engine.cuda import triton_attention as ta
from pdserve.errors import ConfigError

torch = pytest.importorskip("torch", reason="the torch platform's paged attention needs torch")

REPO = Path(__file__).resolve().parents[3]
SCALE = 0.125


def make_cache(
    rng: np.random.Generator,
    lengths: list[int],
    max_blocks: int,
    *,
    block_size: int = 16,
    kv_heads: int = 2,
    dim: int = 64,
    layers: int = 2,
    num_blocks: int = 24,
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(cache, tables, dense): each sequence's K/V ``dense[i]`` [2, layers, length, kvh, D] (float32)
    scattered into blocks drawn at random from 1.. (block 0 is the null block, which a row of
    length 1 and no blocks of its own reads slot 0 of); every other slot is NaN. The cache is a
    view that skips a leading layer, so its strides are not those of a contiguous tensor."""
    cache = np.full((num_blocks, 2, layers + 1, block_size, kv_heads, dim), np.nan, dtype=np.float32)
    cache[0, :, :, 0] = rng.standard_normal((2, layers + 1, kv_heads, dim))
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(lengths), max_blocks), dtype=np.int32)
    dense = []
    for i, n in enumerate(lengths):
        if n == 1 and i == len(lengths) - 1:  # the padding row: block 0, slot 0
            dense.append(cache[0, :, 1:, :1].copy())
            continue
        kv = rng.standard_normal((2, layers, n, kv_heads, dim)).astype(np.float32)
        for p in range(n):
            if p % block_size == 0:
                tables[i, p // block_size] = free.pop()
            cache[tables[i, p // block_size], :, 1:, p % block_size] = kv[:, :, p]
        dense.append(kv)
    return cache[:, :, 1:], tables, dense


def numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float64 attention: q [n, H, D] at ``positions`` over k, v [T, kvh, D], causal."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = np.zeros(q.shape)
    for i, pos in enumerate(positions):
        for h in range(q.shape[1]):
            s = k[: pos + 1, h // group] @ q[i, h] * SCALE
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[: pos + 1, h // group]
    return out


DECODE_LENGTHS = [37, 64, 5, 1]  # partial blocks, a full table, one block, the padding row last


def decode_case(seed: int, dtype: Any, **shape: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    heads = shape.pop("heads", 4)
    max_blocks = -(-max(DECODE_LENGTHS) // shape.get("block_size", 16))
    cache, tables, dense = make_cache(rng, DECODE_LENGTHS, max_blocks, **shape)
    dim = cache.shape[-1]
    # q as a slice of a fused QKV output: not contiguous either
    qkv = torch.from_numpy(rng.standard_normal((len(DECODE_LENGTHS), heads + 4, dim)).astype(np.float32))
    return {
        "q": qkv[:, :heads].to(dtype),
        "cache": torch.from_numpy(cache).to(dtype),
        "tables": torch.from_numpy(tables),
        "lengths": torch.tensor(DECODE_LENGTHS, dtype=torch.int32),
        "dense": dense,
    }


def prefill_case(seed: int, dtype: Any, start: int, n: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    cache, tables, dense = make_cache(rng, [start + n], 8)
    return {
        "q": torch.from_numpy(rng.standard_normal((n, 4, cache.shape[-1])).astype(np.float32)).to(dtype),
        "cache": torch.from_numpy(cache).to(dtype),
        "table": torch.from_numpy(tables[0, : -(-(start + n) // 16)]),
        "start": start,
        "dense": dense[0],
    }


def decode_args(case: dict[str, Any], layer: int) -> tuple[Any, Any, int, Any, Any, float]:
    return case["q"], case["cache"], layer, case["tables"], case["lengths"], SCALE


def prefill_args(case: dict[str, Any], layer: int) -> tuple[Any, Any, int, Any, int, float]:
    return case["q"], case["cache"], layer, case["table"], case["start"], SCALE


def max_err(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max())


# ----------------------------------------------------------------------------------------------
# the torch versions against float64 numpy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_decode_matches_float64_numpy(dtype: str) -> None:
    case = decode_case(1, getattr(torch, dtype))
    out = ta.torch_paged_decode_attention(*decode_args(case, 1))
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    q = case["q"].float().numpy()
    for b, n in enumerate(DECODE_LENGTHS):
        k, v = (torch.from_numpy(x).to(case["q"].dtype).float().numpy() for x in case["dense"][b][:, 1])
        want = numpy_attention(q[b : b + 1], k, v, np.array([n - 1]))[0]
        tol = 1e-5 if dtype == "float32" else 1e-2  # bf16: the output's own rounding
        np.testing.assert_allclose(out[b].float().numpy(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("start", "n"), [(0, 21), (29, 12)])
def test_torch_prefill_matches_float64_numpy(start: int, n: int) -> None:
    case = prefill_case(2, torch.float32, start, n)
    out = ta.torch_paged_prefill_attention(*prefill_args(case, 0))
    assert out.dtype == torch.float32 and out.shape == case["q"].shape
    k, v = case["dense"][:, 0]
    want = numpy_attention(case["q"].numpy(), k, v, np.arange(start, start + n))
    np.testing.assert_allclose(out.numpy(), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# the Triton kernels in the interpreter, against the torch versions


def interpreter_checks() -> dict[str, Any]:
    """Run in the subprocess (TRITON_INTERPRET=1): check name -> max abs error against the torch
    version (or another result)."""
    from pdserve.engine.cuda.triton_attention import _triton_decode

    results: dict[str, Any] = {}
    for name, dtype, shape in [
        ("decode_f32", torch.float32, {}),
        ("decode_bf16", torch.bfloat16, {}),
        (
            "decode_d128_bs8_group4",
            torch.float32,
            {"dim": 128, "block_size": 8, "heads": 8, "num_blocks": 40},
        ),
    ]:
        case = decode_case(3, dtype, **shape)
        want = ta.torch_paged_decode_attention(*decode_args(case, 1))
        got = ta.paged_decode_attention(*decode_args(case, 1))
        results[name] = max_err(got, want)
        results[name + "_finite"] = bool(torch.isfinite(got).all())
        results[name + "_dtype"] = str(got.dtype)
        if name == "decode_f32":  # split-K: 2 splits of 32 tokens (rows of 5 and 1 leave the second empty)
            results[name + "_splits"] = max_err(_triton_decode(*decode_args(case, 1), num_splits=2), want)
    for name, dtype, start, n in [
        ("prefill_f32_first_chunk", torch.float32, 0, 21),
        (
            "prefill_f32_later_chunk",
            torch.float32,
            40,
            50,
        ),  # 2 query tiles: unmasked key tiles, then the diagonal
        ("prefill_bf16", torch.bfloat16, 45, 20),
    ]:
        case = prefill_case(4, dtype, start, n)
        want = ta.torch_paged_prefill_attention(*prefill_args(case, 0))
        got = ta.paged_prefill_attention(*prefill_args(case, 0))
        results[name] = max_err(got, want)
        results[name + "_dtype"] = str(got.dtype)
    results["selected"] = ta.select_paged_attention("cpu", "triton").impl
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    pytest.importorskip("triton", reason="the Triton kernels need triton (its interpreter runs them here)")
    code = (
        "import json, runpy, sys\n"
        f"checks = runpy.run_path({str(Path(__file__))!r})['interpreter_checks']\n"
        "print(json.dumps(checks()))\n"
    )
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("check", "tol"),
    [
        ("decode_f32", 1e-5),
        ("decode_f32_splits", 1e-5),
        ("decode_d128_bs8_group4", 1e-5),
        # bf16 (ulp 2^-7 near 1): the kernel rounds probabilities to bf16 before P @ V
        ("decode_bf16", 2e-2),
        ("prefill_f32_first_chunk", 1e-5),
        ("prefill_f32_later_chunk", 1e-5),
        ("prefill_bf16", 2e-2),
    ],
)
def test_triton_kernel_matches_torch_version(interpreted: dict[str, Any], check: str, tol: float) -> None:
    assert interpreted[check] <= tol, f"{check}: max abs error {interpreted[check]}"


def test_triton_outputs_keep_q_dtype_and_padding_rows_finite(interpreted: dict[str, Any]) -> None:
    for name in ("decode_f32", "decode_bf16", "decode_d128_bs8_group4"):
        assert interpreted[name + "_finite"], name
    assert interpreted["decode_bf16_dtype"] == interpreted["prefill_bf16_dtype"] == "torch.bfloat16"
    assert interpreted["decode_f32_dtype"] == interpreted["prefill_f32_first_chunk_dtype"] == "torch.float32"


def test_interpreter_makes_triton_selectable_on_cpu(interpreted: dict[str, Any]) -> None:
    assert interpreted["selected"] == "triton"


# ----------------------------------------------------------------------------------------------
# the choice


def test_forced_triton_on_cpu_without_interpreter_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    why = ta.triton_unavailable("cpu")
    assert why is not None
    with pytest.raises(ConfigError, match="paged_attention=triton") as e:
        ta.select_paged_attention("cpu", "triton")
    assert why in str(e.value)


def test_auto_falls_back_to_torch_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    chosen = ta.select_paged_attention(torch.device("cpu"), "auto")
    assert chosen.impl == "torch"
    assert chosen.decode is ta.torch_paged_decode_attention
    assert chosen.prefill is ta.torch_paged_prefill_attention
    assert str(ta.triton_unavailable("cpu")) in chosen.reason
    forced = ta.select_paged_attention("cpu", "torch")
    assert forced.impl == "torch" and forced.decode is ta.torch_paged_decode_attention
    with pytest.raises(ConfigError, match="must be one of auto, triton, torch"):
        ta.select_paged_attention("cpu", "cuda")
    assert ta.PAGED_ATTENTION_MODES == ("auto", "triton", "torch")


def test_interpreter_makes_triton_available_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ta.triton_unavailable("cpu") is None


def test_kernels_refuse_a_head_dim_that_is_not_a_power_of_2() -> None:
    case = decode_case(5, torch.float32, dim=48)
    with pytest.raises(ValueError, match="power-of-2 head_dim"):
        ta.paged_decode_attention(*decode_args(case, 0))


def test_importing_the_module_loads_neither_torch_nor_triton_nor_paddle() -> None:
    code = (
        "import sys, pdserve.engine.cuda.triton_attention\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton', 'paddle'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
