"""``--model`` values made into model folders: a .gguf file imported once into the cache (keyed by its
bytes), a Hugging Face hub id from the hub cache (offline), presets, and errors that say what to do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_support import write_gguf

from pdserve.engine.models import model_store
from pdserve.engine.models.model_store import import_source, resolve_model
from pdserve.errors import ConfigError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> Path:
    """A Hugging Face hub cache holding ``pdserve-test/tiny`` (its real layout: refs/main names the
    snapshot), with the hub switched off: huggingface_hub answers from the cache or not at all."""
    home = tmp_path / "hf"
    repo = home / "hub" / "models--pdserve-test--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # read once, at import
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"))
    return repo / "snapshots" / commit


def test_a_gguf_file_is_imported_once_keyed_by_its_bytes(
    cache: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    gguf = tmp_path / "m.gguf"
    write_gguf(tiny_model_dir, gguf)
    first = resolve_model(gguf)
    assert first.name == "m" and first.path.parent == cache / "models"
    assert (first.path / "model.safetensors").is_file()
    stamp = (first.path / "model.safetensors").stat().st_mtime_ns
    again = resolve_model(str(gguf))
    assert again == first and (first.path / "model.safetensors").stat().st_mtime_ns == stamp  # not redone
    write_gguf(tiny_model_dir, gguf, quantized=("token_embd.weight",))  # other bytes: another import
    other = resolve_model(gguf)
    assert other.path != first.path and (other.path / "config.json").is_file()


def test_a_folder_is_used_where_it_is_and_checked(cache: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    assert resolve_model(tiny_model_dir).path == tiny_model_dir
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"lacks tokenizer\.json"):
        resolve_model(broken)
    assert not (cache / "models").exists()  # nothing imported for a folder


def test_made_presets_are_written_once_into_the_cache(cache: Path) -> None:
    tiny = resolve_model("tiny")
    assert tiny.name == "tiny" and tiny.path == cache / "models" / "tiny"
    stamp = (tiny.path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny") == tiny and (tiny.path / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_hub_id_comes_from_the_hub_cache(cache: Path, hub_cache: Path, tmp_path: Path) -> None:
    resolved = resolve_model("pdserve-test/tiny")
    assert resolved.name == "pdserve-test/tiny"
    assert resolved.path.resolve() == hub_cache.resolve()
    copied = import_source("pdserve-test/tiny", tmp_path / "copy")
    assert (copied / "model.safetensors").read_bytes() == (hub_cache / "model.safetensors").read_bytes()


def test_an_unreachable_hub_id_names_hf_hub_offline_and_the_way_out(cache: Path, hub_cache: Path) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_model("pdserve-test/absent")
    assert "HF_HUB_OFFLINE" in e.value.message and "folder or .gguf file" in e.value.message


def test_what_is_none_of_these_is_named(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"not a model folder, a \.gguf file, a preset \(smollm2-135m, tiny"
    ):
        resolve_model("no-such-thing")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ConfigError, match=r"a file must be a \.gguf model"):
        resolve_model(tmp_path / "notes.txt")


def test_a_file_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "w.whl"
    f.write_bytes(b"not the wheel")
    with pytest.raises(ConfigError, match="is not the pinned"):
        model_store._check_sha256(f, model_store.FETCHED_PRESETS["smollm2-135m"].wheel_sha256, "w.whl")


def test_generate_takes_a_gguf_file(cache: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    """`pdserve generate --model m.gguf`: imported on first use, then served like a folder."""
    gguf = tmp_path / "m.gguf"
    write_gguf(tiny_model_dir, gguf)
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--model", str(gguf), "--prompt", "Hello"]
    cmd += ["--max-tokens", "4", "--json", "--num-blocks", "64", "--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(cache))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["usage"]["completion_tokens"] == 4
    assert len(list((cache / "models").glob("m-*"))) == 1


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "PDSERVE_CACHE_DIR": str(cache)}
