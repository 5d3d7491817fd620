"""Load Hugging Face safetensors checkpoints into the fused float32 layout the model runs on.

Linear weights arrive as ``[out, in]`` (torch) and are stored ``[in, out]`` contiguous so that
every matmul reads a dense operand (matmul on a transposed view is ~100x slower in Paddle on CPU).
q/k/v are fused into one ``qkv`` weight and gate/up into one ``gate_up`` weight at load time.
Interleaved-RoPE checkpoints (ERNIE-4.5) get their q/k rows permuted per head so that one
rotate-half RoPE serves every architecture; q·k is unchanged by the shared permutation.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import numpy as np
import orjson

from pdserve.engine.model_config import ModelConfig
from pdserve.errors import ConfigError

log = logging.getLogger(__name__)

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file as float32 arrays (bf16 widened bit-exactly, which numpy can't do)."""
    with path.open("rb") as f:
        try:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = orjson.loads(f.read(header_len))
        except (struct.error, orjson.JSONDecodeError) as e:
            raise ConfigError(f"{path} is not a valid safetensors file: {e}") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ConfigError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        raw = np.frombuffer(data[start:end], dtype=dtype).reshape(meta["shape"])
        if meta["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.astype(np.float32, copy=False)
    return out


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = orjson.loads(index.read_bytes())["weight_map"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{index} is malformed: expected a 'weight_map' object") from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ConfigError(
                f"{model_dir}: shard(s) listed in {index.name} are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model folder {model_dir} has no *.safetensors weights")
    return files


def _interleaved_to_half(w: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
    """Reorder rows of a q/k projection so GPT-J-style (interleaved) RoPE becomes rotate-half."""
    perm = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    rows = (np.arange(num_heads)[:, None] * head_dim + perm[None, :]).reshape(-1)
    return w[rows]


def load_weights(model_dir: str | Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Return fused float32 weights: ``embed``, ``l{i}.{in_norm,qkv,qkv_bias,o,o_bias,post_norm,
    gate_up,gate_up_bias,down,down_bias}``, ``norm`` and ``lm_head`` ([hidden, vocab], untied only)."""
    model_dir = Path(model_dir)
    raw: dict[str, np.ndarray] = {}
    for path in checkpoint_files(model_dir):
        raw.update(_read_safetensors(path))

    def take(name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if name not in raw:
            raise ConfigError(f"{model_dir}: weight {name!r} is missing from the checkpoint")
        t = raw[name]
        if shape is not None and tuple(t.shape) != shape:
            raise ConfigError(f"{model_dir}: weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    w: dict[str, np.ndarray] = {
        "embed": np.ascontiguousarray(take("model.embed_tokens.weight", (cfg.vocab_size, h)))
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        wq, wk = take(p + "self_attn.q_proj.weight", (q, h)), take(p + "self_attn.k_proj.weight", (kv, h))
        wv = take(p + "self_attn.v_proj.weight", (kv, h))
        if cfg.rope_interleaved:
            wq = _interleaved_to_half(wq, cfg.num_heads, cfg.head_dim)
            wk = _interleaved_to_half(wk, cfg.num_kv_heads, cfg.head_dim)
        w[f"l{i}.in_norm"] = take(p + "input_layernorm.weight", (h,))
        w[f"l{i}.qkv"] = np.ascontiguousarray(np.concatenate([wq, wk, wv], axis=0).T)
        if cfg.qkv_bias:
            bq, bk = take(p + "self_attn.q_proj.bias", (q,)), take(p + "self_attn.k_proj.bias", (kv,))
            if cfg.rope_interleaved:
                bq = _interleaved_to_half(bq, cfg.num_heads, cfg.head_dim)
                bk = _interleaved_to_half(bk, cfg.num_kv_heads, cfg.head_dim)
            w[f"l{i}.qkv_bias"] = np.concatenate([bq, bk, take(p + "self_attn.v_proj.bias", (kv,))])
        w[f"l{i}.o"] = np.ascontiguousarray(take(p + "self_attn.o_proj.weight", (h, q)).T)
        if p + "self_attn.o_proj.bias" in raw:
            w[f"l{i}.o_bias"] = take(p + "self_attn.o_proj.bias", (h,))
        w[f"l{i}.post_norm"] = take(p + "post_attention_layernorm.weight", (h,))
        gate, up = take(p + "mlp.gate_proj.weight", (inter, h)), take(p + "mlp.up_proj.weight", (inter, h))
        w[f"l{i}.gate_up"] = np.ascontiguousarray(np.concatenate([gate, up], axis=0).T)
        w[f"l{i}.down"] = np.ascontiguousarray(take(p + "mlp.down_proj.weight", (h, inter)).T)
        if cfg.mlp_bias:
            w[f"l{i}.gate_up_bias"] = np.concatenate(
                [take(p + "mlp.gate_proj.bias", (inter,)), take(p + "mlp.up_proj.bias", (inter,))]
            )
            w[f"l{i}.down_bias"] = take(p + "mlp.down_proj.bias", (h,))
    w["norm"] = take("model.norm.weight", (h,))
    if not cfg.tie_word_embeddings:
        w["lm_head"] = np.ascontiguousarray(take("lm_head.weight", (cfg.vocab_size, h)).T)
    log.info("loaded %d tensors from %s", len(raw), model_dir)
    return w
