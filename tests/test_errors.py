"""Bad model folders, impossible requests and invalid sampling values fail early and name the problem."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.errors import ConfigError, InvalidRequestError, RequestTooLongError


def edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    cfg = orjson.loads(path.read_bytes())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_bytes(orjson.dumps(cfg))


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (lambda d: (d / "config.json").unlink(), "config.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json"),
        (lambda d: edit_config(d, hidden_size=None), "hidden_size"),
        (lambda d: edit_config(d, num_hidden_layers="four"), "num_hidden_layers"),
        (lambda d: edit_config(d, architectures=["GPT2LMHeadModel"]), "architectures"),
        (lambda d: edit_config(d, num_key_value_heads=3), "num_key_value_heads"),
        (lambda d: edit_config(d, num_hidden_layers=5), "model.layers.4"),  # weight missing
        (lambda d: edit_config(d, intermediate_size=700), "mlp.gate_proj.weight"),  # wrong shape
        (lambda d: (d / "model.safetensors").unlink(), "safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 4), "safetensors"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json"),
    ],
)
def test_bad_model_folder(model_copy, breakage, expected: str) -> None:
    breakage(model_copy)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        LLM(model_copy, num_blocks=16)


def test_missing_folder(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(tmp_path / "nope")


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, num_blocks=32, max_model_len=256)


def test_prompt_longer_than_model(llm) -> None:
    with pytest.raises(RequestTooLongError, match="maximum context length is 256") as e:
        llm.generate("word " * 300, SamplingParams(max_tokens=4))
    assert e.value.param == "prompt"


def test_prompt_plus_max_tokens_too_long(llm) -> None:
    with pytest.raises(RequestTooLongError, match="max_tokens") as e:
        llm.generate("hello", SamplingParams(max_tokens=255))
    assert e.value.param == "max_tokens"


def test_request_larger_than_kv_cache(tiny_model_dir) -> None:
    small = LLM(tiny_model_dir, num_blocks=4)  # 3 usable blocks = 48 tokens
    with pytest.raises(RequestTooLongError, match="KV blocks"):
        small.generate("hello", SamplingParams(max_tokens=60))


def test_failed_request_leaves_others_untouched(llm) -> None:
    with pytest.raises(RequestTooLongError):
        llm.generate(["fine", "word " * 300], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate("fine", SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("temperature", "hot"),
        ("max_tokens", 2.5),
        ("seed", "x"),
    ],
)
def test_invalid_sampling_value(field: str, value) -> None:
    with pytest.raises(InvalidRequestError, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(InvalidRequestError, match="min_tokens") as e:
        SamplingParams(max_tokens=3, min_tokens=5)
    assert e.value.param == "min_tokens"


def test_bad_engine_config() -> None:
    with pytest.raises(ConfigError, match="num_blocks"):
        EngineConfig(num_blocks=1)
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "1.5"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_cli_names_the_flag(tiny_model_dir, flags, expected: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "hi",
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert expected in proc.stderr


def test_cli_bad_model_folder(tmp_path) -> None:
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--model", str(tmp_path), "--prompt", "hi"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "config.json" in proc.stderr and "Traceback" not in proc.stderr
