"""A GGUF file written from a Hugging Face folder (the tiny preset) the way llama.cpp's converter
writes one: GGUF tensor names, permuted Q/K rows, gpt2 tokenizer metadata."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from pdserve.engine.models import gguf_import
from pdserve.engine.models.gguf_import import permute_rope_rows

INVERSE = {v: k for k, v in gguf_import._BLOCK_NAMES.items()}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{i}.{INVERSE[module]}.{suffix}"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[
        hf.rsplit(".", 1)[0]
    ] + ".weight"


def write_gguf(
    model_dir: Path, path: Path, quantized: tuple[str, ...] = (), raw_types: dict[str, str] | None = None
) -> dict[str, np.ndarray]:
    """The tiny model as llama.cpp's converter would write it; ``quantized`` GGUF names become Q8_0,
    ``raw_types`` {name: "I32"} stores a tensor as an integer type instead."""
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_context_length(cfg["max_position_embeddings"])
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    w.add_chat_template(tc["chat_template"])
    for hf, t in weights.items():
        name = gguf_name(hf)
        if name.endswith("attn_q.weight"):
            t = permute_rope_rows(t, cfg["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            t = permute_rope_rows(t, cfg["num_key_value_heads"])
        if name in quantized:
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif name in (raw_types or {}):
            w.add_tensor(name, np.zeros(t.shape, dtype=np.int32))
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights
