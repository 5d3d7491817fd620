"""benchmarks/bf16_agreement.py, the measurement docs/design.md quotes, runs and measures: bfloat16
against float32 greedy on torch's CPU device, teacher-forced, on the tiny model (48 tokens here;
the script's default is 512 on every preset small enough for a CPU, and the real SmolLM2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch platform needs PyTorch (pip install 'pdserve[cuda]')")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bf16_agreement.py"


def test_the_bf16_agreement_script_measures_the_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "agreement.json"
    args = ["--presets", "tiny", "--tokens", "48", "--models", str(tiny_model_dir.parent), "--out", str(out)]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    assert r["preset"] == "tiny" and r["tokens"] == 48
    assert r["f32_self_agreement"] == 1.0  # f32's prefill and decode steps pick the same tokens
    assert r["agreement"] >= 0.95 and r["f32_token_changes"] > 0.5  # varied text, not a collapse
    assert r["f32_top2_gap_median_nats"] > 0 and "bf16 argmax = f32 token at" in done.stderr
