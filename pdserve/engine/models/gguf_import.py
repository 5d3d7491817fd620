"""Convert a Llama-family GGUF file (llama.cpp's format) into a Hugging Face model folder.

Every tensor is dequantized to float32 with llama.cpp's own reader (the ``gguf`` package), the rows of
``attn_q``/``attn_k`` are put back in Hugging Face's rotate-half order (llama.cpp's converter permutes
them for its adjacent-pair rope), names are mapped to the ones weights.py loads, and config.json,
tokenizer.json (byte-level BPE rebuilt from the vocabulary, merges and token types),
tokenizer_config.json (chat template) and generation_config.json are written from the metadata.
The output is deterministic: the same GGUF gives the same bytes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from pdserve.engine.models.model_folder import check_target, write_json, written_atomically
from pdserve.errors import ConfigError

logger = logging.getLogger(__name__)

SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
)

# GGUF tokenizer.ggml.pre -> whether single digits are split off before GPT-2's byte-level regex.
# "llama-bpe" (Llama 3) uses its own regex instead; see _pre_tokenizer.
GPT2_STYLE_PRE = {"gpt2": False, "default": False, "smollm": True}
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE = (*GPT2_STYLE_PRE, "llama-bpe")

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; unknown names are errors."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{suffix}"
    raise ConfigError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's forward permutation (convert_hf_to_gguf.py ``LlamaModel.permute``): per head, rows
    go from HF's rotate-half order (2, d/2) to llama.cpp's adjacent-pair order (d/2, 2)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute_rope_rows`: view rows as (heads, d/2, 2), swap, flatten."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Meta:
    def __init__(self, reader: GGUFReader, source: Path) -> None:
        self.reader, self.source = reader, source

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{self.source}: GGUF metadata key {key!r} is missing")
        return value


def _dequantized(tensor: Any, source: Path) -> np.ndarray:
    qtype = GGMLQuantizationType(int(tensor.tensor_type))
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ConfigError(
            f"{source}: tensor {tensor.name} has GGML type {qtype.name}, which pdserve cannot import "
            f"(supported: {names})"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGML lists dims innermost first
    out = dequantize(np.asarray(tensor.data), qtype).astype(np.float32, copy=False)
    return np.ascontiguousarray(out.reshape(shape))


def _pre_tokenizer(pre: str, source: Path) -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre in GPT2_STYLE_PRE:
        if not GPT2_STYLE_PRE[pre]:
            return byte_level
        digits = {"type": "Digits", "individual_digits": True}
        return {"type": "Sequence", "pretokenizers": [digits, byte_level]}
    if pre == "llama-bpe":
        split = {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False}
        return {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": False}]}
    raise ConfigError(
        f"{source}: unsupported tokenizer.ggml.pre {pre!r}; supported: {', '.join(SUPPORTED_PRE)}"
    )


def _tokenizer_json(meta: _Meta) -> tuple[dict[str, Any], list[str]]:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ConfigError(
            f"{meta.source}: unsupported tokenizer.ggml.model {model!r}; only 'gpt2' (byte-level BPE)"
        )
    tokens: list[str] = meta.need("tokenizer.ggml.tokens")
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre", "default")
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": types[i] == TOKEN_TYPE_USER_DEFINED,
            "special": types[i] == TOKEN_TYPE_CONTROL,
        }
        for i, tok in enumerate(tokens)
        if types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(pre, meta.source),
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }
    return data, tokens


def import_gguf(source: str | Path, target: str | Path, overwrite: bool = False) -> Path:
    """Write the Hugging Face folder for the GGUF file ``source`` into ``target`` (atomically)."""
    source, target = Path(source), check_target(target, overwrite)  # before the dequantizing
    start = time.perf_counter()
    try:
        reader = GGUFReader(source)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{source} is not a readable GGUF file: {e}") from None
    meta = _Meta(reader, source)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{source}: unsupported general.architecture {arch!r} (only 'llama')")
    tok_json, tokens = _tokenizer_json(meta)
    n_head = int(meta.need("llama.attention.head_count"))
    n_kv = int(meta.get("llama.attention.head_count_kv", n_head))
    hidden = int(meta.need("llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    head_dim = int(meta.get("llama.attention.key_length") or hidden // n_head)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.need("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.need("llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": len(tokens),
        "max_position_embeddings": int(meta.get("llama.context_length", 4096)),
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
        "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }

    tensors: dict[str, np.ndarray] = {}
    for count, tensor in enumerate(reader.tensors, start=1):
        name = hf_name(tensor.name)
        w = _dequantized(tensor, source)
        if tensor.name.endswith("attn_q.weight"):
            w = unpermute_rope_rows(w, n_head)
        elif tensor.name.endswith("attn_k.weight"):
            w = unpermute_rope_rows(w, n_kv)
        tensors[name] = w
        logger.debug("tensor %d/%d: %s -> %s", count, len(reader.tensors), tensor.name, name)
        if count % 50 == 0 or count == len(reader.tensors):
            logger.info("dequantized %d/%d tensors", count, len(reader.tensors))

    def token(key: str) -> str | None:
        idx = meta.get(key)
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    generation = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }

    with written_atomically(target, overwrite) as tmp:
        write_json(tmp / "config.json", config)
        write_json(tmp / "generation_config.json", generation)
        write_json(tmp / "tokenizer_config.json", tok_config)
        write_json(tmp / "tokenizer.json", tok_json)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
    logger.info(
        "imported %s (%d tensors) into %s in %.1fs", source, len(tensors), target, time.perf_counter() - start
    )
    return target
