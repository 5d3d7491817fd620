"""The job side of benchmarks/gpu_bench.py: what runs inside each job's child process.

:func:`job_main` dispatches a job to its function: here the ceilings, pdserve's and HF
transformers' speed cells and what their bounds are made of (bytes per decode step, FLOPs per
prefill token: the parent divides the ceilings this run measured by them); gpu_handoff.py and
gpu_exact.py hold the other two jobs. What the jobs share (options, the cell recorder, torch and
engine helpers) is gpu_cells.py. torch is imported inside the jobs only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gpu_cells import (
    Opts,
    Recorder,
    Skip,
    drain,
    model_dir,
    new_engine,
    random_prompts,
    run_engine,
    sync,
    torch_setup,
)


def job_main(spec_json: str, cells_file: Path) -> int:
    """Run the job ``spec_json`` describes (kind, preset, options), its cells into ``cells_file``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = json.loads(spec_json)
    o = Opts(**spec["opts"])
    rec = Recorder(cells_file)
    kind, preset = spec["kind"], spec["preset"]
    if kind == "handoff":
        from gpu_handoff import job_handoff

        job_handoff(rec, o, preset)
    elif kind == "exact":
        from gpu_exact import job_exact

        job_exact(rec, o, preset)
    else:
        {"ceilings": job_ceilings, "pdserve": job_pdserve, "eager": job_eager}[kind](rec, o, preset)
    return 0


@dataclasses.dataclass
class Shape:
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, folder: Path) -> Shape:
        c = json.loads((folder / "config.json").read_text())
        heads = c["num_attention_heads"]
        return cls(
            c["num_hidden_layers"],
            c["hidden_size"],
            c["intermediate_size"],
            heads,
            c.get("num_key_value_heads") or heads,
            c.get("head_dim") or c["hidden_size"] // heads,
            c["vocab_size"],
            bool(c.get("tie_word_embeddings")),
        )

    @property
    def layer_matmul_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.inter

    @property
    def matmul_params(self) -> int:
        """What one token multiplies through the layers (no embedding, no lm_head)."""
        return self.layers * self.layer_matmul_params

    def decode_weight_bytes(self, itemsize: int) -> int:
        """Bytes a decode step reads of the weights: every layer's matrices and the lm_head (norms
        are float32 and tiny; the embedding reads one row per token)."""
        norms = 4 * self.hidden * (2 * self.layers + 1)
        return (self.matmul_params + self.vocab * self.hidden) * itemsize + norms

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


# ---- ceilings ----------------------------------------------------------------------------------
def job_ceilings(rec: Recorder, o: Opts, preset: str | None) -> None:
    import torch

    dev = torch.device(o.device)

    def timed(fn: Callable[[], Any], reps: int) -> float:
        """Median seconds of ``fn`` (CUDA events on a GPU)."""
        for _ in range(3):
            fn()
        sync(o)
        times = []
        for _ in range(reps):
            if o.device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def copy() -> dict:
        torch_setup(o)
        nbytes = (256 << 20) if o.quick else (4 << 30)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        s = timed(lambda: dst.copy_(src), 10)
        ok = bool(torch.equal(dst[:4096], src[:4096]))
        name = torch.cuda.get_device_name(dev) if o.device == "cuda" else "cpu"
        return {
            "device_name": name,
            "bytes": nbytes,
            "seconds_median": s,
            "bandwidth_B_s": 2 * nbytes / s,
            "checked": ok,
            "note": "bytes read + bytes written over the median time of 10 copies",
        }

    def gemm() -> dict:
        n = 1024 if o.quick else 8192
        dtype = torch.float32 if o.device == "cpu" else torch.bfloat16
        a = torch.randn(n, n, dtype=dtype, device=dev)
        b = torch.randn(n, n, dtype=dtype, device=dev)
        s = timed(lambda: a @ b, 10)
        return {"n": n, "dtype": str(dtype), "seconds_median": s, "flop_s": 2 * n**3 / s}

    rec.cell("copy_bandwidth", 30, copy)
    rec.cell("gemm", 30, gemm)


def decode_round(
    engine: Any, vocab: int, batch: int, prompt_len: int, gen: int, skip: int, seed: int
) -> dict:
    """One batch of ``batch`` greedy requests; the timed steady-state steps: those that start with
    every sequence past its first token, less the first ``skip``."""
    from pdserve.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    ids = [f"d{seed}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(rng, batch, prompt_len, vocab)):
        engine.add_request(rid, prompt_token_ids=prompt, params=params)
    started: set[str] = set()
    steady: list[tuple[float, int]] = []
    try:
        while engine.has_unfinished():
            all_started = len(started) == batch
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            n = 0
            for out in outs:
                if out.error:
                    raise RuntimeError(f"{out.request_id}: {out.error}")
                n += len(out.token_ids)
                if out.token_ids:
                    started.add(out.request_id)
            if all_started and n:
                steady.append((dt, n))
    except BaseException:
        drain(engine)
        raise
    timed = steady[skip:]
    if not timed:
        raise RuntimeError(f"no steady decode step to time ({len(steady)} steady steps, skip {skip})")
    secs, tokens = sum(t for t, _ in timed), sum(n for _, n in timed)
    return {
        "tok_s": tokens / secs,
        "step_ms_median": statistics.median(t for t, _ in timed) * 1e3,
        "steps": len(timed),
        "tokens": tokens,
        "mean_context": prompt_len + 1 + skip + len(timed) / 2,
    }


def decode_cost(shape: Shape, itemsize: int, batch: int, mean_context: float) -> dict:
    """What bounds a decode step: the bytes it must read (every weight once, each sequence's KV at
    its mean context). The parent divides the run's measured bandwidth by it (gpu_bench.add_bounds)."""
    kv = batch * mean_context * shape.kv_bytes_per_token(itemsize)
    return {"bytes_per_step": int(shape.decode_weight_bytes(itemsize) + kv)}


def prefill_cost(shape: Shape) -> dict:
    """What bounds a prefill: 2 x the matmul parameters per token (no attention, no lm_head)."""
    return {"flop_per_token": 2 * shape.matmul_params, "matmul_params": shape.matmul_params}


def itemsize_of(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def job_pdserve(rec: Recorder, o: Opts, preset: str) -> None:
    holder: dict[str, Any] = {}

    def load() -> dict:
        torch_setup(o)
        folder = model_dir(o, preset)
        t0 = time.perf_counter()
        top = max(o.batch_sizes)
        engine = new_engine(
            o,
            folder,
            dtype=o.dtype,
            max_num_seqs=top,
            max_model_len=max(o.prompt_len + o.gen_len, o.prefill_len + 1) + 16,
            prefill_chunk_size=max(o.prefill_len, 512),
            max_num_batched_tokens=max(o.prefill_len, 512) + top,
            prefix_caching=False,
            **({} if o.device == "cuda" else {"kv_cache_gb": 0.25}),
        )
        holder.update(engine=engine, folder=folder, shape=Shape.of(folder), vocab=engine.tokenizer.vocab_size)
        return {"load_s": time.perf_counter() - t0}

    load_cell = rec.cell("load", 150 if not o.quick else 300, load)
    if load_cell["status"] != "ok":
        rec.not_run([f"decode_b{b}" for b in o.batch_sizes] + [f"prefill_{o.prefill_len}"], load_cell)
        return
    engine, shape, vocab = holder["engine"], holder["shape"], holder["vocab"]
    itemsize = itemsize_of(o.dtype)
    for b in o.batch_sizes:

        def decode(b: int = b) -> dict:
            # warm-up at this batch size: kernels compiled, graphs (captured at start) replayed once
            decode_round(engine, vocab, b, o.prompt_len, o.skip_steps + 4, 0, seed=1000 + b)
            r = decode_round(engine, vocab, b, o.prompt_len, o.gen_len, o.skip_steps, seed=b)
            return {"batch": b, **r, **decode_cost(shape, itemsize, b, r["mean_context"])}

        rec.cell(f"decode_b{b}", 60 if not o.quick else 300, decode)

    def prefill() -> dict:
        from pdserve.sampling_params import SamplingParams

        rng = np.random.default_rng(7)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        times = []
        for i in range(o.prefill_reps + 1):  # the first is a warm-up
            prompt = random_prompts(rng, 1, o.prefill_len, vocab)[0]  # a fresh prompt: no cache hit
            t0 = time.perf_counter()
            r = run_engine(engine, {f"p{i}": (prompt, params)})
            times.append(time.perf_counter() - t0)
            assert len(r[f"p{i}"]["token_ids"]) == 1
        s = statistics.median(times[1:])
        tok_s = o.prefill_len / s
        return {
            "tokens": o.prefill_len,
            "seconds_median": s,
            "tok_s": tok_s,
            "reps": o.prefill_reps,
            **prefill_cost(shape),
        }

    rec.cell(f"prefill_{o.prefill_len}", 60 if not o.quick else 300, prefill)


# ---- HF transformers eager ---------------------------------------------------------------------
def job_eager(rec: Recorder, o: Opts, preset: str) -> None:
    import torch

    holder: dict[str, Any] = {}
    dev = torch.device(o.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[o.dtype]

    def load() -> dict:
        torch_setup(o)
        try:
            import transformers
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as e:
            raise Skip(f"transformers is not installed ({e})") from None
        from pdserve.engine.models.weights import hf_tensors
        from pdserve.tokenizer import Tokenizer

        folder = model_dir(o, preset)
        shape = Shape.of(folder)
        t0 = time.perf_counter()
        cfg = LlamaConfig.from_pretrained(folder)
        cfg._attn_implementation = "sdpa"  # transformers' default: PyTorch's fused attention kernels
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(dev):
                model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(old)
        params = dict(model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, array in hf_tensors(folder):
                params[name].copy_(torch.from_numpy(np.ascontiguousarray(array)))
                loaded.add(name)
        missing = set(params) - loaded - ({"lm_head.weight"} if shape.tied else set())
        if missing:
            raise RuntimeError(f"weights missing from the folder: {sorted(missing)[:5]}")
        model.eval()
        holder.update(model=model, shape=shape, vocab=Tokenizer.from_dir(folder).vocab_size)
        return {
            "load_s": time.perf_counter() - t0,
            "transformers": transformers.__version__,
            "attn_implementation": "sdpa",
        }

    load_cell = rec.cell("load", 150 if not o.quick else 300, load)
    if load_cell["status"] != "ok":
        rec.not_run([f"decode_b{b}" for b in o.batch_sizes] + [f"prefill_{o.prefill_len}"], load_cell)
        return
    model, shape, vocab = holder["model"], holder["shape"], holder["vocab"]
    itemsize = itemsize_of(o.dtype)

    def generate(ids: Any, steps: int, skip: int) -> tuple[float, int]:
        """Greedy: a prefill of ``ids`` then ``steps - 1`` decode steps with past_key_values; the
        seconds of the decode steps after the first ``skip``."""
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            t0, timed = 0.0, 0
            for i in range(steps - 1):
                if i == skip:
                    sync(o)
                    t0 = time.perf_counter()
                out = model(input_ids=tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                timed += i >= skip
            sync(o)
            return time.perf_counter() - t0, timed

    for b in o.batch_sizes:

        def decode(b: int = b) -> dict:
            rng = np.random.default_rng(b)
            ids = torch.tensor(random_prompts(rng, b, o.prompt_len, vocab), device=dev)
            generate(ids, o.skip_steps + 4, 0)  # warm-up
            secs, steps = generate(ids, o.gen_len, o.skip_steps)
            tok_s = b * steps / secs
            ctx = o.prompt_len + 1 + o.skip_steps + steps / 2
            return {
                "batch": b,
                "tok_s": tok_s,
                "step_ms_mean": secs / steps * 1e3,
                "steps": steps,
                "mean_context": ctx,
                **decode_cost(shape, itemsize, b, ctx),
            }

        rec.cell(f"decode_b{b}", 90 if not o.quick else 300, decode)

    def prefill() -> dict:
        rng = np.random.default_rng(7)
        times = []
        with torch.inference_mode():
            for _ in range(o.prefill_reps + 1):
                ids = torch.tensor(random_prompts(rng, 1, o.prefill_len, vocab), device=dev)
                sync(o)
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=True, logits_to_keep=1).logits.argmax(-1).tolist()
                times.append(time.perf_counter() - t0)
        s = statistics.median(times[1:])
        tok_s = o.prefill_len / s
        return {
            "tokens": o.prefill_len,
            "seconds_median": s,
            "tok_s": tok_s,
            **prefill_cost(shape),
        }

    rec.cell(f"prefill_{o.prefill_len}", 60 if not o.quick else 300, prefill)
