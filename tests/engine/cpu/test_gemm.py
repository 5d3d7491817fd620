"""MKL's packed GEMM (engine/cpu/gemm.py): the products against float64 numpy, bitwise rows at any row
count under MKL_CBWR=AUTO,STRICT (set in conftest), the mode choice and its fallback, and the model
keeping only the packed copies."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pdserve.engine.cpu.gemm import PackedMkl, load_packed_mkl, select_gemm
from pdserve.engine.cpu.host_cpu import Kernels
from pdserve.engine.cpu.paddle_model import LINEARS, Model
from pdserve.engine.cpu.paddle_setup import paddle
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.weights import load_weights
from pdserve.errors import ConfigError


@pytest.fixture(scope="module")
def mkl() -> PackedMkl:
    return load_packed_mkl()


def operands(rng: np.random.Generator, k: int, n: int, transposed: bool, mkl: PackedMkl):
    w = rng.standard_normal((k, n), dtype=np.float32)
    return w, mkl.pack(np.ascontiguousarray(w.T), transposed=True) if transposed else mkl.pack(w)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("k,n", [(64, 48), (37, 53), (1024, 1280)])
@pytest.mark.parametrize("m", [1, 7, 32, 200])
def test_packed_product_matches_float64(mkl, m: int, k: int, n: int, transposed: bool) -> None:
    rng = np.random.default_rng(m * k + n)
    w, packed = operands(rng, k, n, transposed, mkl)
    x = rng.standard_normal((m, k), dtype=np.float32)
    got = mkl.matmul(x, packed)
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert got.shape == (m, n) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5 * np.sqrt(k) * np.abs(want).max()
    # Paddle's matmul on the same operands agrees as closely (a different MKL kernel, not other bits of x)
    assert np.allclose(got, paddle.matmul(paddle.to_tensor(x), paddle.to_tensor(w)).numpy(), atol=1e-4)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_rows_bits_do_not_depend_on_the_row_count(mkl, transposed: bool) -> None:
    """What lets batch-invariant mode skip the row padding Paddle's matmul needs."""
    rng = np.random.default_rng(1)
    _, packed = operands(rng, 1024, 1280, transposed, mkl)
    x = rng.standard_normal((300, 1024), dtype=np.float32)
    first = mkl.matmul(x, packed)
    for m in [*range(1, 41), 63, 128, 129, 257]:
        assert np.array_equal(mkl.matmul(x[:m], packed), first[:m]), f"{m} rows"


def test_non_contiguous_input_and_a_wrong_width(mkl) -> None:
    rng = np.random.default_rng(2)
    w, packed = operands(rng, 16, 8, False, mkl)
    x = rng.standard_normal((5, 32), dtype=np.float32)[:, ::2]  # a strided view
    assert np.allclose(mkl.matmul(x, packed), x @ w, atol=1e-5)
    with pytest.raises(ValueError, match="columns"):
        mkl.matmul(np.ones((2, 15), np.float32), packed)


def test_modes_and_the_fallback(tmp_path, caplog) -> None:
    with pytest.raises(ConfigError, match="--gemm"):
        select_gemm("fast")
    assert select_gemm("paddle").mkl is None
    assert select_gemm("auto").impl == "packed"  # Paddle's CPU wheel bundles MKL
    missing = tmp_path / "libmklml_intel.so"
    with pytest.raises(ConfigError, match=r"gemm=packed.*not found"):
        select_gemm("packed", missing)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.cpu.gemm"):
        fallback = select_gemm("auto", missing)
    assert fallback.impl == "paddle" and fallback.mkl is None
    assert "Paddle's matmul" in caplog.text
    not_mkl = tmp_path / "libnotmkl.so"
    not_mkl.write_bytes(b"not a shared library")
    assert select_gemm("auto", not_mkl).impl == "paddle"  # OSError from the loader, not a crash


def test_the_model_keeps_only_the_packed_copies(mkl, tiny_model_dir) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir)
    model = Model(
        cfg, load_weights(tiny_model_dir, cfg), 64, Kernels("composed", "composed", "test"), gemm=mkl
    )
    linears = {f"l{i}.{n}" for i in range(cfg.num_layers) for n in LINEARS}
    assert set(model.packed) == linears | {"lm_head"}
    assert not linears & set(model.w) and "embed" in model.w  # the embedding stays for the lookup
