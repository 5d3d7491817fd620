"""A float64 numpy Llama forward written from the Hugging Face architecture alone (not from pdserve's
model code): the exactness reference of benchmarks/gpu_bench.py and tests/gpu/.

The same forward as tests/engine/test_float64_reference.py's ``ReferenceLlama`` (token embedding,
per layer RMSNorm -> q/k/v -> RoPE -> grouped-query causal attention -> o + residual, RMSNorm ->
SwiGLU MLP + residual; final RMSNorm and lm_head), widened to every preset pdserve writes: an untied
``lm_head``, q/k/v and MLP biases, and ERNIE-4.5's interleaved RoPE (each pair of adjacent
dimensions rotated together, as transformers' Ernie4_5 does it; pdserve instead permutes q/k rows
at load and rotates halves, so the two paths are independent). Weights come under their Hugging
Face names from ``pdserve.engine.models.weights.hf_tensors`` (seeded presets included). No KV cache: one causal forward over
prompt + generated tokens gives the logits of every step at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pdserve.engine.models.weights import hf_tensors

INTERLEAVED_ROPE = {"Ernie4_5ForCausalLM"}


class ReferenceLlama:
    """A float64 Llama forward over a model folder (config.json + weights)."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        self.layers = cfg["num_hidden_layers"]
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or 0
        self.kv_heads = self.kv_heads or self.heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps, self.theta = cfg.get("rms_norm_eps", 1e-5), cfg.get("rope_theta", 10000.0)
        self.interleaved = cfg["architectures"][0] in INTERLEAVED_ROPE
        scaling = cfg.get("rope_scaling")
        assert cfg.get("hidden_act", "silu") == "silu", "SwiGLU with SiLU only"
        assert not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default")
        self.w = {k: np.asarray(v, dtype=np.float64) for k, v in hf_tensors(folder)}
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.w.values())

    def rms_norm(self, x: np.ndarray, weight: str) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.w[weight]

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x [T, heads, D]. Rotate-half (Llama): dimension i pairs with i + D/2; interleaved
        (ERNIE-4.5): dimension 2i pairs with 2i + 1. Both at angle position * theta^(-2i/D)."""
        D = self.head_dim
        inv_freq = 1.0 / self.theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
        angles = np.outer(positions, inv_freq)[:, None, :]  # [T, 1, D/2]
        cos, sin = np.cos(angles), np.sin(angles)
        if self.interleaved:
            even, odd = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2] = even * cos - odd * sin
            out[..., 1::2] = odd * cos + even * sin
            return out
        first, second = x[..., : D // 2], x[..., D // 2 :]
        return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)

    def linear(self, h: np.ndarray, name: str) -> np.ndarray:
        out = h @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return out if bias is None else out + bias

    def attention(self, h: np.ndarray, p: str) -> np.ndarray:
        T, D = h.shape[0], self.head_dim
        q = self.linear(h, p + "q_proj").reshape(T, self.heads, D)
        k = self.linear(h, p + "k_proj").reshape(T, self.kv_heads, D)
        v = self.linear(h, p + "v_proj").reshape(T, self.kv_heads, D)
        positions = np.arange(T, dtype=np.float64)
        q, k = self.rope(q, positions), self.rope(k, positions)
        group = self.heads // self.kv_heads  # query head i reads kv head i // group
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(T, self.heads * D)
        return self.linear(out, p + "o_proj")

    def mlp(self, h: np.ndarray, p: str) -> np.ndarray:
        gate, up = self.linear(h, p + "gate_proj"), self.linear(h, p + "up_proj")
        return self.linear(gate / (1.0 + np.exp(-gate)) * up, p + "down_proj")

    def logits(self, token_ids: list[int], rows: slice = slice(None)) -> np.ndarray:
        """float64 [len(rows), vocab]: the logits predicting the token after each position ``rows``
        of ``token_ids``."""
        x = self.w["model.embed_tokens.weight"][np.asarray(token_ids)]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            x = x + self.attention(self.rms_norm(x, p + "input_layernorm.weight"), p + "self_attn.")
            x = x + self.mlp(self.rms_norm(x, p + "post_attention_layernorm.weight"), p + "mlp.")
        return self.rms_norm(x[rows], "model.norm.weight") @ self.lm_head.T


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|: the exactness figure of the GPU checks."""
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))
