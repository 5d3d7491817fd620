"""Weight loading keeps each weight once: the resident size of an engine on the real SmolLM2 (in a
fresh process), the start-up log's figures, the embedding left in the checkpoint's page cache, and a
truncated checkpoint refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.memory import page_empty
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.weights import SafetensorsFile, iter_weights, release_pages
from pdserve.errors import ConfigError

GB = 1e9

# Run in a fresh process: resident size before and after building the engine (the runtime's own
# memory, Paddle + numba kernels + MKL, measured first), and after one short generation.
ENGINE_MEMORY = r"""
import json, logging, sys
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu.attention import select_attention
from pdserve.engine.cpu.gemm import select_gemm
from pdserve.engine.cpu.paddle_setup import paddle  # the runtime: loaded with the engine otherwise
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams

path, gemm = sys.argv[1], sys.argv[2]

def resident_bytes():  # VmRSS, read apart from the engine's own helper
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith("VmRSS:")).split()[1])

records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("pdserve.engine.llm_engine").addHandler(handler)
logging.getLogger("pdserve.engine.llm_engine").setLevel(logging.INFO)
select_attention("auto", 1), select_gemm(gemm)  # compiled or loaded once, before the baseline
runtime = resident_bytes()
engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.25, threads=1, gemm=gemm))
loaded = resident_bytes()
engine.add_request("r", prompt_token_ids=list(range(1, 33)), params=SamplingParams(max_tokens=8, temperature=0))
while engine.has_unfinished():
    engine.step()
print(json.dumps({
    "runtime": runtime, "loaded": loaded, "generated": resident_bytes(),
    "weights": engine.executor.weight_bytes, "cache": engine.cache.nbytes,
    "ready": [m for m in records if m.startswith("engine ready")],
}))
"""


def parameter_bytes(folder: Path) -> int:
    """float32 bytes of every tensor in the checkpoint (read from its header alone)."""
    st = SafetensorsFile(folder / "model.safetensors")
    return sum(4 * int(np.prod(shape)) for _, shape, _ in st.tensors.values())


@pytest.mark.parametrize("gemm", ["auto", "paddle"])
def test_engine_holds_each_weight_once(smollm2_dir: Path, gemm: str) -> None:
    """Building the engine adds about the weights and the KV cache to the process, nothing like a
    second copy of the weights (before: +1.27 GB for 0.54 GB of weights and a 0.27 GB cache)."""
    run = subprocess.run(
        [sys.executable, "-c", ENGINE_MEMORY, str(smollm2_dir), gemm],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    weights, cache = m["weights"], m["cache"]
    assert weights == parameter_bytes(smollm2_dir)  # the tied lm_head counted once
    assert cache == pytest.approx(0.25 * 2**30, rel=0.01)
    # what else building the engine adds: the tokenizer (~0.04 GB), RoPE tables, packing slack
    allowance = 0.08 * GB
    for stage in ("loaded", "generated"):
        added = m[stage] - m["runtime"]
        assert added <= weights + cache + allowance, (
            f"{stage}: +{added / GB:.3f} GB for {weights / GB:.3f} GB of weights and a "
            f"{cache / GB:.3f} GB cache (runtime {m['runtime'] / GB:.3f} GB)"
        )
    # the start-up log reports the same figures
    (line,) = m["ready"]
    found = re.search(r"resident ([\d.]+) GB \(weights ([\d.]+) GB, KV cache ([\d.]+) GB\)", line)
    assert found, line
    resident, logged_weights, logged_cache = map(float, found.groups())
    assert resident == pytest.approx(m["loaded"] / GB, abs=0.02)
    assert (logged_weights, logged_cache) == (round(weights / GB, 2), round(cache / GB, 2))


def rss_file() -> int:
    """Resident bytes of this process's file-backed pages."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("RssFile:"))
    return int(line.split()[1]) * 1024


def test_float32_embedding_is_the_file_mapped_and_released(smollm2_dir: Path) -> None:
    """A float32 embedding is not copied: reading it all makes the file's pages resident here, and
    release_pages drops them again while the values stay readable (from the page cache)."""
    name, embed = next(iter_weights(smollm2_dir, ModelConfig.from_dir(smollm2_dir)))
    assert name == "embed" and embed.dtype == np.float32
    before = rss_file()
    total = float(embed.sum(dtype=np.float64))  # reads every page
    touched = rss_file() - before
    assert touched >= 0.9 * embed.nbytes  # file-backed, not anonymous memory
    release_pages(embed)
    assert rss_file() - before <= 0.1 * embed.nbytes
    assert float(embed.sum(dtype=np.float64)) == total


def test_release_pages_leaves_other_arrays_alone() -> None:
    """Anonymous memory would lose its data to MADV_DONTNEED: release_pages must not touch it."""
    a = page_empty((1024, 1024))
    a[...] = 3.0
    release_pages(a)
    release_pages(a[10:20])
    assert a.ctypes.data % 4096 == 0 and bool((a == 3.0).all())


def test_truncated_checkpoint_is_refused(model_copy: Path) -> None:
    path = model_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4096])
    with pytest.raises(ConfigError, match="ends past the end of the file"):
        list(iter_weights(model_copy, ModelConfig.from_dir(model_copy)))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Ernie4_5ForCausalLM"])
def test_untransposed_weights_are_the_transposed_ones_rows(model_copy: Path, arch: str) -> None:
    """The torch platform's layout (``transposed=False``: ``[out, in]``, fused by rows) holds the
    very numbers of the CPU engine's ``[in, out]`` one, interleaved-RoPE rows permuted alike."""
    config = json.loads((model_copy / "config.json").read_text())
    config["architectures"] = [arch]
    (model_copy / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(model_copy)
    assert cfg.rope_interleaved == (arch != "LlamaForCausalLM")
    plain = dict(iter_weights(model_copy, cfg))
    rows = dict(iter_weights(model_copy, cfg, transposed=False))
    assert plain.keys() == rows.keys()
    for name, array in plain.items():
        linear = name.split(".")[-1] in ("qkv", "o", "gate_up", "down") or name == "lm_head"
        assert np.array_equal(rows[name], array.T if linear else array), name
