"""What every GPU job of benchmarks/gpu_bench.py shares: the options a job gets across the process
boundary, the :class:`Recorder` that appends each cell's state to a JSON-lines file as it changes
(a job killed at its time limit loses nothing already measured; the parent copies each new line into
its JSON at once) and bounds each cell with an interval timer, and the torch, model and engine
helpers the jobs build on. The jobs themselves: gpu_jobs.py (the dispatcher, the ceilings and the
speed cells), gpu_handoff.py, gpu_exact.py; they import this module, never each other. torch is
imported inside the jobs only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("gpu_bench")

# Datasheet figures (B/s of HBM, bf16 dense FLOP/s), by the name nvidia-smi gives the card; most
# specific first. For reference only: speed is judged against what this run measured on the card.
DATASHEETS = (
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100", 3.35e12, 989e12),  # "NVIDIA H100 80GB HBM3": the SXM card
    ("H200", 4.8e12, 989e12),
)


def datasheet(card: str) -> dict | None:
    """The datasheet's bandwidth and bf16 rate of ``card`` (nvidia-smi's name), where known."""
    for key, bandwidth, flops in DATASHEETS:
        if key in card:
            return {"card": key, "bandwidth_B_s": bandwidth, "bf16_flop_s": flops}
    return None


EXACT_TOLERANCE = 1e-3  # max |f32 - f64| / max |f64|
AGREEMENT_FLOOR = 0.99  # bf16 vs f32 greedy tokens
FIRST_ID = 3  # random prompt tokens from here up (0..2 are the presets' special tokens)

# the contract's names, then the names the presets may carry in model_init.PRESETS
ALIASES = {
    "llama3-8b": ("llama3-8b", "llama3-8b-shape"),
    "smollm2-135m": ("smollm2-135m", "smollm2-shape", "smollm2"),
}


@dataclasses.dataclass
class Opts:
    """What a job needs of the command line (JSON across the process boundary)."""

    device: str
    dtype: str
    quick: bool
    presets: list[str]
    exact_presets: list[str]
    batch_sizes: list[int]
    prompt_len: int
    gen_len: int
    skip_steps: int
    prefill_len: int
    prefill_reps: int
    handoff_reps: int
    agree_tokens: int
    models: str

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> Opts:
        def split(s: str) -> list[str]:
            return [x.strip() for x in s.split(",") if x.strip()]

        return cls(
            device=a.device,
            dtype=a.dtype,
            quick=a.quick,
            presets=split(a.presets),
            exact_presets=split(a.exact_presets),
            batch_sizes=[int(b) for b in split(a.batch_sizes)],
            prompt_len=a.prompt_len,
            gen_len=a.gen_len,
            skip_steps=a.skip_steps,
            prefill_len=a.prefill_len,
            prefill_reps=a.prefill_reps,
            handoff_reps=a.handoff_reps,
            agree_tokens=a.agree_tokens,
            models=str(a.models),
        )


class CellTimeout(BaseException):
    """A cell past its limit (a BaseException: the engine's step, which turns an Exception in the
    forward into failed requests, must not swallow it)."""


class Recorder:
    """Appends each cell's state to the cells file as it changes (so a killed job loses nothing
    already measured), and bounds each cell's time with an interval timer."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _write(self, cell: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(cell, default=float) + "\n")

    def not_run(self, names: list[str], after: dict) -> None:
        """Record ``names`` as not run because the cell ``after`` (the model's load) did not succeed."""
        status = "skipped" if after["status"] == "skipped" else "error"
        for name in names:
            self._write({"cell": name, "status": status, "error": f"{after['cell']}: {after.get('error')}"})

    def cell(self, name: str, limit_s: float, fn: Callable[[], dict]) -> dict:
        self._write({"cell": name, "status": "running"})
        log.info("cell %s (limit %.0f s)", name, limit_s)

        def on_alarm(signum: int, frame: Any) -> None:
            raise CellTimeout(f"cell ran past its {limit_s:.0f} s")

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit_s)
        t0 = time.perf_counter()
        try:
            values = fn()
            status = values.pop("status", "ok")
            cell = {"cell": name, "status": status, **values}
        except CellTimeout as e:
            cell = {"cell": name, "status": "timeout", "error": str(e)}
        except Skip as e:
            cell = {"cell": name, "status": "skipped", "error": str(e)}
        except Exception as e:
            log.exception("cell %s failed", name)
            cell = {"cell": name, "status": "error", "error": f"{type(e).__name__}: {e}"}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        cell["seconds"] = round(time.perf_counter() - t0, 2)
        log.info("cell %s: %s", name, json.dumps(cell, default=float)[:400])
        self._write(cell)
        return cell


class Skip(Exception):
    """A cell that cannot run here (its reason recorded, not a failure)."""


def torch_setup(o: Opts) -> Any:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 is float32 (exactness cells)
    torch.backends.cudnn.allow_tf32 = False
    if o.device == "cuda" and not torch.cuda.is_available():
        raise Skip(f"torch {torch.__version__} sees no CUDA device")
    return torch


def sync(o: Opts) -> None:
    if o.device == "cuda":
        import torch

        torch.cuda.synchronize()


def free_memory(o: Opts) -> None:
    gc.collect()
    if o.device == "cuda":
        import torch

        torch.cuda.empty_cache()


# ---- models ------------------------------------------------------------------------------------
def preset_name(want: str) -> str:
    """The model_init preset for ``want`` (the contract's name or the one the presets carry)."""
    from pdserve.engine.models.model_init import PRESETS

    for name in ALIASES.get(want, (want,)):
        if name in PRESETS:
            return name
    raise Skip(f"no model preset {want!r} (model_init.PRESETS has {', '.join(PRESETS)})")


def model_dir(o: Opts, want: str) -> Path:
    """A seeded folder of preset ``want`` (``NAME-2l``: NAME with 2 layers), made once under --models."""
    from pdserve.engine.models.model_init import init_model

    layers = None
    if want.endswith("-2l"):
        want, layers = want[:-3], 2
    name = preset_name(want)
    path = Path(o.models) / (name + (f"-{layers}l" if layers else ""))
    if not (path / "config.json").is_file():
        init_model(path, preset=name, overwrite=True, seeded=True)
        if layers:
            cfg_path = path / "config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["num_hidden_layers"] = layers
            cfg_path.write_text(json.dumps(cfg, indent=2))
    return path


# ---- pdserve -----------------------------------------------------------------------------------
def new_engine(o: Opts, folder: Path, **config: Any) -> Any:
    """An LLMEngine on the torch platform: cuda, or torch's CPU device (--quick)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    if o.device == "cpu":
        from pdserve.engine.cuda.torch_executor import TorchPlatform

        return LLMEngine(folder, EngineConfig(device="cpu", **config), platform=TorchPlatform("cpu"))
    return LLMEngine(folder, EngineConfig(device="cuda", **config))


def random_prompts(rng: np.random.Generator, n: int, length: int, vocab: int) -> list[list[int]]:
    return [rng.integers(FIRST_ID, vocab, length).tolist() for _ in range(n)]


def run_engine(engine: Any, requests: dict[str, tuple[list[int], Any]]) -> dict[str, dict]:
    """Add ``requests`` (id -> (prompt ids, SamplingParams)) and step until all finish; per id its
    tokens, kept logits rows, prompt logprobs and error."""
    out: dict[str, dict[str, Any]] = {
        rid: {"token_ids": [], "logits": [], "prompt_logprobs": None, "error": None} for rid in requests
    }
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, prompt_token_ids=ids, params=params)
    while engine.has_unfinished():
        for o in engine.step():
            r = out.get(o.request_id)
            if r is None:
                continue
            r["token_ids"] += o.token_ids
            if o.logits is not None:
                r["logits"].append(np.asarray(o.logits))
            if o.prompt_logprobs is not None:
                r["prompt_logprobs"] = o.prompt_logprobs
            if o.error:
                r["error"] = o.error
    errors = [f"{rid}: {r['error']}" for rid, r in out.items() if r["error"]]
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    return out


def drain(engine: Any) -> None:
    """Abort whatever a timed-out cell left in the engine, so the next cell starts empty."""
    for rid in list(getattr(engine, "requests", {})):
        engine.abort(rid)
    for _ in range(100):
        if not engine.has_unfinished():
            return
        engine.step()
