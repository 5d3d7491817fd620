"""The offline model folder writer: deterministic tokenizer and weights, HF layout, safe overwrite."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from pdserve.engine.models.model_init import PRESETS, init_model, weight_shapes
from pdserve.errors import ConfigError


def test_tiny_folder_contents(tmp_path: Path) -> None:
    """What the writer leaves (a folder of its own: the shared one gains the weights-digest cache
    of the first worker that loads it)."""
    tiny_model_dir = tmp_path / "tiny"
    init_model(tiny_model_dir, preset="tiny")
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert not list(tiny_model_dir.parent.glob(".tiny.*"))  # no temp folder left behind


def test_tiny_config_json(tiny_model_dir: Path) -> None:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    expected = {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 4096,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0] and gen["bos_token_id"] is None


def test_tiny_tokenizer_config(tiny_model_dir: Path) -> None:
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert (cfg["eos_token"], cfg["pad_token"], cfg["bos_token"], cfg["add_bos_token"]) == (
        "<|im_end|>",
        "<|endoftext|>",
        None,
        False,
    )
    assert "<|im_start|>assistant\\n" in cfg["chat_template"]  # a Jinja string literal: backslash-n


def test_tiny_weights_names_shapes_and_scale(tiny_model_dir: Path) -> None:
    tensors = load_file(tiny_model_dir / "model.safetensors")
    expected = {name: shape for name, shape, _ in weight_shapes(PRESETS["tiny"])}
    assert {k: v.shape for k, v in tensors.items()} == expected
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (256, 256)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (128, 256)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (256, 768)
    assert tensors["lm_head.weight"].shape == (4096, 256)
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert abs(tensors["model.embed_tokens.weight"].std() - 1.0) < 0.01
    assert abs(tensors["model.layers.0.mlp.down_proj.weight"].std() - 1 / np.sqrt(768)) < 0.002
    assert abs(tensors["model.norm.weight"].mean() - 1.0) < 0.05


def test_same_seed_is_identical_other_seed_differs(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = init_model(tmp_path / "again", preset="tiny")
    other = init_model(tmp_path / "other", preset="tiny", seed=1)
    assert (again / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    first, second = load_file(tiny_model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(np.array_equal(first[k], second[k]) for k in first)
    third = load_file(other / "model.safetensors")
    assert not np.array_equal(first["model.embed_tokens.weight"], third["model.embed_tokens.weight"])
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match=str(target)):
        init_model(target)
    assert (target / "keep.txt").read_text() == "mine"
    init_model(target, overwrite=True)
    assert not (target / "keep.txt").exists() and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_empty_target_folder_is_fine(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    assert (init_model(tmp_path / "m") / "config.json").is_file()


def test_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="huge"):
        init_model(tmp_path / "m", preset="huge")
    assert not list(tmp_path.iterdir())


def test_small_preset_shapes_without_writing() -> None:
    cfg = PRESETS["small"]
    assert cfg["architectures"] == ["Ernie4_5ForCausalLM"] and cfg["tie_word_embeddings"] is True
    shapes = dict((name, shape) for name, shape, _ in weight_shapes(cfg))
    assert "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (103424, 1024)
    assert shapes["model.layers.17.self_attn.k_proj.weight"] == (128, 1024)
    assert 1.2e9 < 4 * sum(int(np.prod(s)) for s in shapes.values()) < 1.4e9


def test_the_cached_tiny_preset_is_made_again_when_its_template_is_stale(tmp_path: Path, monkeypatch) -> None:
    """The cached tiny preset (`--model tiny`) from an older pdserve (another chat template) is refreshed;
    a current one is left alone."""
    from pdserve.engine.models.model_init import CHATML_TEMPLATE
    from pdserve.engine.models.model_store import made_preset

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    path = made_preset("tiny")
    config = path / "tokenizer_config.json"
    weights = (path / "model.safetensors").read_bytes()
    stale = json.loads(config.read_text()) | {"chat_template": "{{ messages }}"}
    config.write_text(json.dumps(stale))
    assert made_preset("tiny") == path
    assert json.loads(config.read_text())["chat_template"] == CHATML_TEMPLATE
    assert (path / "model.safetensors").read_bytes() == weights  # seeded: the same model again
    mtime = config.stat().st_mtime_ns
    made_preset("tiny")
    assert config.stat().st_mtime_ns == mtime
