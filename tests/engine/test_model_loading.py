"""Hugging Face checkpoints load into the fused layout and compute what the HF definitions compute:
Llama (rotate-half RoPE), Qwen2 (q/k/v bias), ERNIE-4.5 (interleaved RoPE, tied), sharded and bf16."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest
from safetensors.numpy import save_file

from pdserve import LLM, SamplingParams

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 4096,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


def make_checkpoint(
    folder: Path, tokenizer_from: Path, arch: str, tie: bool, bias: bool, shards: int = 1, bf16: bool = False
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    h, q, kv, inter, V = 64, 64, 32, 96, 4096
    w = {
        "model.embed_tokens.weight": rng.standard_normal((V, h), dtype=np.float32),
        "model.norm.weight": 1 + 0.1 * rng.standard_normal(h, dtype=np.float32),
    }
    for i in range(2):
        p = f"model.layers.{i}."
        for name, shape in [
            ("self_attn.q_proj", (q, h)),
            ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)),
            ("self_attn.o_proj", (h, q)),
            ("mlp.gate_proj", (inter, h)),
            ("mlp.up_proj", (inter, h)),
            ("mlp.down_proj", (h, inter)),
        ]:
            w[p + name + ".weight"] = rng.standard_normal(shape, dtype=np.float32) / np.float32(
                np.sqrt(shape[1])
            )
        if bias:
            for name, n in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]:
                w[p + f"self_attn.{name}.bias"] = 0.1 * rng.standard_normal(n, dtype=np.float32)
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(h, dtype=np.float32)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(h, dtype=np.float32)
    if not tie:
        w["lm_head.weight"] = rng.standard_normal((V, h), dtype=np.float32) / np.float32(8)
    if bf16:  # round to bf16, store raw bf16 bits (numpy has no bf16 dtype)
        w = {k: ((v.view(np.uint32) + 0x8000) >> 16 << 16).view(np.float32) for k, v in w.items()}
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_from / f, folder / f)
    cfg = {"architectures": [arch], "tie_word_embeddings": tie, **SHAPE}
    (folder / "config.json").write_bytes(orjson.dumps(cfg))
    names = sorted(w)
    parts = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {n: w[n] for n in part}
        if bf16:
            save_bf16(folder / fname, tensors)
        else:
            save_file(tensors, str(folder / fname))
        weight_map.update(dict.fromkeys(part, fname))
    if shards > 1:
        (folder / "model.safetensors.index.json").write_bytes(orjson.dumps({"weight_map": weight_map}))
    return w


def save_bf16(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = (t.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = orjson.dumps(header)
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def reference_logits(w: dict[str, np.ndarray], ids: list[int], tie: bool, interleaved: bool) -> np.ndarray:
    """The Hugging Face forward, written out densely in float64 numpy."""
    H, KVH, D = 4, 2, 16
    x = w["model.embed_tokens.weight"][ids].astype(np.float64)
    n = len(ids)
    inv = 1.0 / (10000.0 ** (np.arange(0, D, 2) / D))
    f = np.outer(np.arange(n), inv)

    def rope(t: np.ndarray) -> np.ndarray:  # t [n, heads, D]
        if interleaved:  # GPT-J style pairs (2i, 2i+1), as modeling_ernie4_5.py
            cos, sin = np.repeat(np.cos(f), 2, -1)[:, None], np.repeat(np.sin(f), 2, -1)[:, None]
            rot = np.stack([-t[..., 1::2], t[..., 0::2]], -1).reshape(t.shape)
        else:  # rotate-half, as modeling_llama.py
            cos = np.concatenate([np.cos(f)] * 2, -1)[:, None]
            sin = np.concatenate([np.sin(f)] * 2, -1)[:, None]
            rot = np.concatenate([-t[..., D // 2 :], t[..., : D // 2]], -1)
        return t * cos + rot * sin

    def rms(t: np.ndarray, g: np.ndarray) -> np.ndarray:
        return t / np.sqrt((t**2).mean(-1, keepdims=True) + 1e-5) * g

    def lin(t: np.ndarray, name: str) -> np.ndarray:
        out = t @ w[name + ".weight"].T.astype(np.float64)
        return out + w[name + ".bias"] if name + ".bias" in w else out

    for i in range(2):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope(lin(h, p + "self_attn.q_proj").reshape(n, H, D))
        k = np.repeat(rope(lin(h, p + "self_attn.k_proj").reshape(n, KVH, D)), H // KVH, 1)
        v = np.repeat(lin(h, p + "self_attn.v_proj").reshape(n, KVH, D), H // KVH, 1)
        s = np.einsum("nhd,thd->hnt", q, k) / np.sqrt(D) + np.triu(np.full((n, n), -np.inf), 1)
        prob = np.exp(s - s.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        x = x + lin(np.einsum("hnt,thd->nhd", prob, v).reshape(n, H * D), p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g, u = lin(h, p + "mlp.gate_proj"), lin(h, p + "mlp.up_proj")
        x = x + lin(g / (1 + np.exp(-g)) * u, p + "mlp.down_proj")
    head = w["model.embed_tokens.weight"] if tie else w["lm_head.weight"]
    return rms(x[-1], w["model.norm.weight"]) @ head.T.astype(np.float64)


@pytest.mark.parametrize(
    ("arch", "tie", "bias", "shards", "bf16"),
    [
        ("LlamaForCausalLM", False, False, 1, False),
        ("Qwen2ForCausalLM", True, True, 2, False),
        ("Ernie4_5ForCausalLM", True, False, 3, True),
    ],
)
def test_checkpoint_matches_reference(tmp_path, tiny_model_dir, arch, tie, bias, shards, bf16) -> None:
    w = make_checkpoint(tmp_path / "m", tiny_model_dir, arch, tie, bias, shards, bf16)
    llm = LLM(tmp_path / "m", num_blocks=32, keep_logits=True, prefill_chunk_size=16)
    ids = llm.tokenizer.encode("Rotary embeddings, fused projections and tied heads: all checked here.")
    assert len(ids) > 16  # the last chunk attends through the paged cache too
    gen = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    want = reference_logits(w, ids, tie, interleaved=arch == "Ernie4_5ForCausalLM")
    assert np.abs(gen.logits[0] - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
