"""The fused decode step (engine/cpu/fused_decode.py): bitwise the layer-by-layer path, taken by
every step of decodes and by no step with a prefill chunk, and its mode choice with its fallbacks."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.cpu import fused_decode
from pdserve.engine.cpu.attention import select_attention
from pdserve.engine.cpu.fused_decode import FusedDecode, select_decode
from pdserve.engine.cpu.gemm import load_packed_mkl
from pdserve.errors import ConfigError

PROMPTS = [
    "Hi",
    "The router picks a prefill and a decode instance from the live set in Redis.",
    "Long prompts are prefilled in chunks so running decodes keep moving. " * 6,
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def generate(model_dir, decode: str, batch_invariant: bool, counted: list[int] | None = None):
    llm = LLM(
        model_dir,
        num_blocks=128,
        prefill_chunk_size=64,
        keep_logits=True,
        decode_step=decode,
        batch_invariant=batch_invariant,
    )
    assert llm.engine.executor.decode_step.impl == decode
    if counted is not None:  # count the fused calls (the real ones run)
        fused = llm.engine.executor.model.fused
        assert fused is not None
        run = fused.run

        def counting_run(*args, **kwargs):
            counted.append(1)
            return run(*args, **kwargs)

        fused.run = counting_run  # type: ignore[method-assign]
    # staggered: the first prompt decodes while the long one is still prefilled in chunks
    return llm.generate(PROMPTS, [GREEDY.replace(max_tokens=12 + 4 * i) for i in range(len(PROMPTS))])


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["invariant", "default"])
def test_fused_decode_is_bitwise_the_layer_path(tiny_model_dir, batch_invariant: bool) -> None:
    calls: list[int] = []
    layers = generate(tiny_model_dir, "layers", batch_invariant)
    fused = generate(tiny_model_dir, "fused", batch_invariant, calls)
    for a, b in zip(layers, fused, strict=True):
        assert b.token_ids == a.token_ids
        assert len(a.logits) == len(b.logits) == len(a.token_ids)
        for la, lb in zip(a.logits, b.logits, strict=True):
            assert np.array_equal(la, lb), f"max abs diff {np.abs(la - lb).max()}"
    # Every token but each prompt's first came from a decode step; the steps with a prefill chunk
    # (3 prompts' chunks, some beside decodes) took the layer path, so fewer calls than tokens.
    decoded = sum(len(g.token_ids) - 1 for g in fused)
    assert 0 < len(calls) < decoded
    assert len(calls) >= max(len(g.token_ids) for g in fused) - 4  # the longest one's tail: decodes only


def test_modes_and_fallbacks() -> None:
    kernels = select_attention("kernel", 1).kernel
    mkl = load_packed_mkl()
    assert select_decode("layers", kernels, mkl).impl == "layers"
    chosen = select_decode("auto", kernels, mkl)
    assert chosen.impl == "fused" and isinstance(chosen.fused, FusedDecode)
    fallback = select_decode("auto", None, mkl)  # --attention reference
    assert fallback.impl == "layers" and "numba kernels" in fallback.reason
    with pytest.raises(ConfigError, match=r"decode_step=fused: .*MKL's packed GEMM"):
        select_decode("fused", kernels, None)  # --gemm paddle
    with pytest.raises(
        ConfigError, match=r"--decode-step, PDSERVE_DECODE_STEP\) must be one of auto, fused, layers"
    ):
        select_decode("fast", kernels, mkl)


def test_a_fused_step_that_disagrees_is_refused(monkeypatch) -> None:
    """The self-test compares the compiled step with the same kernels called one by one: a step whose
    logits are one ulp off is refused at start."""
    kernels = select_attention("kernel", 1).kernel
    mkl = load_packed_mkl()
    fused = select_decode("fused", kernels, mkl).fused
    assert fused is not None

    class Wrong(FusedDecode):
        def run(self, *args, **kwargs):
            logits = super().run(*args, **kwargs)
            logits[0, 0] = np.nextafter(logits[0, 0], np.float32(np.inf))  # one ulp off
            return logits

    with pytest.raises(RuntimeError, match="disagrees with the layer path"):
        fused_decode._self_test(Wrong(fused._fn, 1), kernels, mkl, None)
    fused_decode._self_test(FusedDecode(fused._fn, 1), kernels, mkl, None)  # the real one passes
