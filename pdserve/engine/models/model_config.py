"""Model architecture read from a Hugging Face style ``config.json``.

Supported: the Llama family (LlamaForCausalLM, Qwen2ForCausalLM with q/k/v bias, MistralForCausalLM)
and ERNIE-4.5 dense (Ernie4_5ForCausalLM, interleaved RoPE). Anything else fails at load with a
message naming the field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson

from pdserve.errors import ConfigError

# architecture -> (qkv bias default, interleaved rope)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Ernie4_5ForCausalLM": (False, True),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    rope_interleaved: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ConfigError(f"model folder {model_dir} does not exist")
        if not path.is_file():
            raise ConfigError(f"model folder {model_dir} has no config.json")
        try:
            raw = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures")
        if not archs or not isinstance(archs, list):
            raise ConfigError(f"{source}: missing field 'architectures'")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"{source}: unsupported architecture {arch!r} (field 'architectures'); "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        bias_default, interleaved = ARCHITECTURES[arch]

        def need(name: str, kind: type = int) -> Any:
            if name not in raw or raw[name] is None:
                raise ConfigError(f"{source}: missing field {name!r}")
            value = raw[name]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{source}: field {name!r} must be a positive integer, got {value!r}")
            return value

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        if head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
        scaling = raw.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ConfigError(f"{source}: unsupported rope_scaling {scaling!r} (field 'rope_scaling')")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: unsupported hidden_act {act!r} (only 'silu')")
        use_bias = bool(raw.get("use_bias", False))
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=need("intermediate_size"),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", bias_default)) or use_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) or use_bias,
            rope_interleaved=interleaved,
        )
