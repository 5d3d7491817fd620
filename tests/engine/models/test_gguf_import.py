"""GGUF import: a GGUF written here from the tiny preset (llama.cpp's layout: GGUF names, permuted q/k
rows, gpt2 tokenizer metadata) converts back to the same weights, tokenizer and greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf_support import gguf_name, write_gguf
from safetensors.numpy import load_file

from pdserve.engine.models.gguf_import import import_gguf, permute_rope_rows, unpermute_rope_rows
from pdserve.engine.models.model_store import import_source
from pdserve.errors import ConfigError
from pdserve.sampling_params import SamplingParams

TEXTS = [
    "Hello world, 12345 and 3.14!",
    "  two  spaces\nnew line\ttab",
    "café über 你好 こんにちは 🙂",
    "x=42;y=7",
]


def test_permutation_round_trip() -> None:
    w = np.arange(4 * 64 * 3, dtype=np.float32).reshape(4 * 64, 3)
    p = permute_rope_rows(w, 4)
    assert not np.array_equal(p, w)
    assert np.array_equal(unpermute_rope_rows(p, 4), w)
    # llama.cpp's own formula (convert_hf_to_gguf.py LlamaModel.permute) is the forward direction
    ref = w.reshape(4, 2, 32, 3).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(p, ref)


def test_weights_and_tokenizer_round_trip(tmp_path: Path, tiny_model_dir: Path) -> None:
    quantized = ("blk.1.attn_q.weight", "blk.2.ffn_down.weight")
    original = write_gguf(tiny_model_dir, tmp_path / "m.gguf", quantized=quantized)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(original)
    for name, want in original.items():
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        if gguf_name(name) in quantized:  # Q8_0: 8-bit per block of 32, scale = absmax / 127
            err = np.abs(got[name] - want).max()
            assert 0 < err <= np.abs(want).max() / 127, (name, err)
        else:
            assert np.array_equal(got[name], want), name  # includes the un-permuted q/k of other layers

    cfg = json.loads((out / "config.json").read_text())
    ref_cfg = json.loads((tiny_model_dir / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert cfg[key] == ref_cfg[key], key
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is False

    import tokenizers

    ref = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    new = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        ids = ref.encode(text).ids
        assert new.encode(text).ids == ids, text
        assert new.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (
        tc["chat_template"]
        == json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["chat_template"]
    )
    assert tc["eos_token"] == "<|im_end|>" and tc["bos_token"] is None


def test_import_is_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_gguf(tiny_model_dir, tmp_path / "m.gguf", quantized=("blk.0.ffn_up.weight",))
    a, b = import_gguf(tmp_path / "m.gguf", tmp_path / "a"), import_gguf(tmp_path / "m.gguf", tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "generation_config.json" in names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_greedy_tokens_match_original(tmp_path: Path, tiny_model_dir: Path) -> None:
    from pdserve import LLM

    write_gguf(tiny_model_dir, tmp_path / "m.gguf")
    out = import_source(tmp_path / "m.gguf", tmp_path / "out")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The number 42 is", "café and tea,"]
    want = [g.token_ids for g in LLM(tiny_model_dir, num_blocks=32).generate(prompts, params)]
    got = [g.token_ids for g in LLM(out, num_blocks=32).generate(prompts, params)]
    assert got == want and all(len(t) == 12 for t in got)


def test_unsupported_tensor_type_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_gguf(tiny_model_dir, tmp_path / "m.gguf", raw_types={"blk.3.ffn_gate.weight": "I32"})
    with pytest.raises(ConfigError, match=r"blk\.3\.ffn_gate\.weight.*I32"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_sources(tmp_path: Path, tiny_model_dir: Path) -> None:
    copied = import_source(tiny_model_dir, tmp_path / "copy")
    assert (copied / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty.*lacks config\.json"):
        import_source(tmp_path / "empty", tmp_path / "x")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ConfigError, match=r"cannot import .*notes\.txt"):
        import_source(tmp_path / "notes.txt", tmp_path / "x")
    with pytest.raises(ConfigError, match="not empty"):
        import_source(tiny_model_dir, copied)
