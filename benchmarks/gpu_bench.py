"""pdserve on one NVIDIA GPU: speed against the hardware's bounds and HF transformers, the KV
hand-off over CUDA IPC, and exactness against a float64 reference. Prints a table, writes JSON.

Cells, grouped in jobs; each job is a child process under a time limit (a crash or a hang loses only
that job), each cell inside it under its own limit; a failed cell is recorded and the rest go on.
Jobs run in this order, so that a short --budget-s cuts the least: ceilings, the first preset's
pdserve and eager cells, handoff, exact, then the other presets' speed cells.

  ceilings          the device's copy bandwidth (one large device-to-device copy, bytes read +
                    written) and bf16 GEMM rate (8192^3), the measured ceilings the cells are held to
  pdserve/<preset>  decode tok/s at each batch size (prompts of --prompt-len random tokens,
                    --gen-len greedy tokens with ignore_eos; steady state only: the steps after every
                    sequence has its first token and after --skip-steps more, following a warm-up
                    round at the same batch size), and prefill tok/s of a --prefill-len prompt (a
                    fresh random prompt each time, prefix caching off: never a cache hit, one chunk)
  eager/<preset>    the same in HF transformers (LlamaForCausalLM, same weights, eager PyTorch,
                    DynamicCache, greedy loop with past_key_values)
  handoff           a --prefill-len prompt's KV in the llama3-8b shape (bf16) pushed by
                    pdserve.cache_transfer.cuda_ipc between two processes: per push (median of
                    --handoff-reps), GB/s, the bytes checked; beside it the same gather/scatter
                    inside one process (what the copy costs without IPC)
  exact/<preset>    float32 on the GPU (TF32 off) against benchmarks/reference_llama.py's float64
                    numpy forward: max |logits - ref| / max |ref| <= 1e-3 over prompt and decode
                    steps; bfloat16 vs float32 greedy over --agree-tokens tokens: the share of
                    positions where bf16's argmax, fed f32's tokens, is f32's token (>= 99 %), and
                    the first position where free-running bf16 greedy departs from f32's

Bounds: decode tok/s = batch / ((weight bytes + KV bytes read per step) / bandwidth), at the
vendor's 4.8 TB/s (H200 HBM3e) and at the measured copy bandwidth; prefill tok/s = rate / (2 x
matmul parameters per token), at the vendor's 989 TFLOP/s (bf16 dense) and the measured GEMM rate.

    python benchmarks/gpu_bench.py                      # on the GPU machine (--budget-s: 5 min)
    python benchmarks/gpu_bench.py --quick              # CPU dry run of every code path, tiny shapes
    python benchmarks/gpu_bench.py --only exact,handoff --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from gpu_jobs import AGREEMENT_FLOOR, EXACT_TOLERANCE, VENDOR_BANDWIDTH, VENDOR_BF16_FLOPS, Opts  # noqa: E402

JOBS = ("ceilings", "exact", "pdserve", "eager", "handoff")


# ---------------------------------------------------------------------------------------- options
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--presets",
        default=None,
        help="model presets of the speed cells (pdserve/, eager/), comma-separated; seeded random "
        "weights in the model's shape (default llama3-8b,smollm2-135m; --quick: tiny)",
    )
    ap.add_argument(
        "--exact-presets",
        default=None,
        help="presets of the exactness cells; NAME-2l is NAME cut to 2 layers (default "
        "tiny,small,smollm2-135m,llama3-8b-2l; --quick: tiny)",
    )
    ap.add_argument(
        "--batch-sizes",
        default=None,
        help="decode batch sizes, comma-separated (default 1,8,32; --quick: 1,2)",
    )
    ap.add_argument("--prompt-len", type=int, default=None, help="decode cells' prompt tokens (default 128)")
    ap.add_argument("--gen-len", type=int, default=None, help="decode cells' generated tokens (default 128)")
    ap.add_argument(
        "--skip-steps",
        type=int,
        default=None,
        help="decode steps left out after every sequence has its first token (default 4)",
    )
    ap.add_argument(
        "--prefill-len", type=int, default=None, help="prefill and hand-off prompt tokens (default 2048)"
    )
    ap.add_argument("--prefill-reps", type=int, default=None, help="timed prefills, median (default 5)")
    ap.add_argument("--handoff-reps", type=int, default=20, help="timed KV pushes, median (default 20)")
    ap.add_argument(
        "--agree-tokens",
        type=int,
        default=None,
        help="greedy tokens of the bf16-vs-f32 agreement cell (default 512; --quick: 32)",
    )
    ap.add_argument("--dtype", default="bfloat16", help="speed cells' dtype (default %(default)s)")
    ap.add_argument(
        "--device", default=None, help="cuda or cpu (default cuda; --quick: cpu, torch's CPU device)"
    )
    ap.add_argument(
        "--only",
        default=",".join(JOBS),
        help=f"jobs to run, comma-separated, among {', '.join(JOBS)} (default all)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget of the whole run; each job gets at most what is left, a job that "
        "would start with under 20 s left is recorded as skipped (default 300; --quick: 900)",
    )
    ap.add_argument(
        "--models",
        type=Path,
        default=Path(tempfile.gettempdir()) / "pdserve-gpu-models",
        help="where the seeded model folders are written (config + tokenizer, no weight files; "
        "reused when present) (default %(default)s)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "gpu_bench.json",
        help="JSON result (default %(default)s)",
    )
    ap.add_argument("--log", type=Path, default=None, help="the jobs' log (default: --out with .log)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a dry run of every code path on torch's CPU device with tiny shapes (the numbers mean "
        "nothing; the hand-off cell, which needs CUDA IPC, is skipped with its reason)",
    )
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)  # internal: run one job (JSON)
    ap.add_argument("--cells-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    q = args.quick
    defaults = {
        "presets": "tiny" if q else "llama3-8b,smollm2-135m",
        "exact_presets": "tiny" if q else "tiny,small,smollm2-135m,llama3-8b-2l",
        "batch_sizes": "1,2" if q else "1,8,32",
        "prompt_len": 16 if q else 128,
        "gen_len": 12 if q else 128,
        "skip_steps": 2 if q else 4,
        "prefill_len": 64 if q else 2048,
        "prefill_reps": 2 if q else 5,
        "agree_tokens": 32 if q else 512,
        "device": "cpu" if q else "cuda",
        "budget_s": 900.0 if q else 300.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.handoff_reps = min(args.handoff_reps, 3)
    return args


# ------------------------------------------------------------------------------------ the plan
@dataclasses.dataclass
class Job:
    kind: str
    preset: str | None
    cells: list[str]  # every cell it records, in order (what is missing after it ends: not reached)
    limit_s: float

    @property
    def name(self) -> str:
        return self.kind if self.preset is None else f"{self.kind}/{self.preset}"


def plan(o: Opts, only: list[str]) -> list[Job]:
    """The jobs in the order they run, so that a short budget cuts the least: the ceilings, the first
    preset's speed (pdserve, then eager), the hand-off, exactness, then the other presets' speed.
    Limits: what each needs on an H200 with room to spare (--quick: the slow CPU's)."""
    decode = ["load", *(f"decode_b{b}" for b in o.batch_sizes), f"prefill_{o.prefill_len}"]
    slow = 3.0 if o.quick else 1.0
    speed = [
        [
            Job("pdserve", p, decode, slow * (200 if i == 0 else 120)),
            Job("eager", p, decode, slow * (150 if i == 0 else 100)),
        ]
        for i, p in enumerate(o.presets)
    ]
    exact = [f"{p}/{c}" for p in o.exact_presets for c in ("f32_logits", "bf16_agreement")]
    jobs = [
        Job("ceilings", None, ["copy_bandwidth", "gemm"], slow * 60),
        *(speed[0] if speed else []),
        Job("handoff", None, ["cuda_ipc"], 90),
        Job("exact", None, exact, slow * 240),
        *(job for pair in speed[1:] for job in pair),
    ]
    return [j for j in jobs if j.kind in only]


# ------------------------------------------------------------------------------- the parent side
def run_job(
    job: Job, o: Opts, limit_s: float, log_file: Any, env_extra: dict[str, str]
) -> tuple[list[dict], bool]:
    """Run ``job`` in a child process for at most ``limit_s``: its cells (the missing ones filled in)
    and whether this process was interrupted meanwhile (the job is then killed)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".jsonl", delete=False) as f:
        cells_file = Path(f.name)
    spec = json.dumps({"kind": job.kind, "preset": job.preset, "opts": dataclasses.asdict(o)})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", spec, "--cells-file", str(cells_file)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
    log_file.write(f"\n===== job {job.name} (limit {limit_s:.0f} s) =====\n")
    log_file.flush()
    t0 = time.monotonic()
    ended = "exited"
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=limit_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        ended = "timeout" if isinstance(e, subprocess.TimeoutExpired) else "interrupted"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the hand-off's second process too
        rc = proc.wait()
    elapsed = time.monotonic() - t0
    seen: dict[str, dict] = {}
    for line in cells_file.read_text().splitlines():
        with contextlib.suppress(ValueError):
            cell = json.loads(line)
            seen[cell["cell"]] = cell
    cells_file.unlink(missing_ok=True)
    out = []
    for name in job.cells:
        cell = seen.get(name)
        if cell is None:
            why = f"job {ended} (rc {rc}) after {elapsed:.0f} s before this cell"
            cell = {"cell": name, "status": "timeout" if ended == "timeout" else "error", "error": why}
            if ended == "interrupted":
                cell["status"] = "skipped"
        elif cell["status"] == "running":
            why = f"job {ended} (rc {rc}) after {elapsed:.0f} s during this cell"
            cell = {**cell, "status": "timeout" if ended == "timeout" else "error", "error": why}
        out.append({"job": job.name, **cell})
    print(
        f"  {job.name}: {elapsed:.0f} s, " + ", ".join(f"{c['cell']} {c['status']}" for c in out),
        file=sys.stderr,
        flush=True,
    )
    return out, ended == "interrupted"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.job:  # this process is one job's child
        from gpu_jobs import job_main

        return job_main(args.job, args.cells_file)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    o = Opts.from_args(args)
    only = [j.strip() for j in args.only.split(",") if j.strip()]
    unknown = set(only) - set(JOBS)
    if unknown:
        print(f"--only: unknown job(s) {', '.join(sorted(unknown))}; choose among {', '.join(JOBS)}")
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.log or args.out.with_suffix(".log")
    t_start = time.monotonic()
    cells: list[dict] = []
    env_extra: dict[str, str] = {}

    def on_term(signum: int, frame: Any) -> None:  # an outer `timeout`: end the job, write what we have
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    interrupted = False
    with open(log_path, "w") as log_file:
        for job in plan(o, only):
            left = args.budget_s - (time.monotonic() - t_start)
            if left < 20 or interrupted:
                why = "interrupted (SIGTERM/SIGINT)" if interrupted else "out of --budget-s"
                cells += [{"job": job.name, "cell": c, "status": "skipped", "error": why} for c in job.cells]
                continue
            try:
                done, interrupted = run_job(job, o, min(job.limit_s, left), log_file, env_extra)
            except KeyboardInterrupt:  # between two jobs
                done, interrupted = [], True
            cells += done
            for c in done:  # the measured ceilings, for the later jobs' "of measured" figures
                if c["status"] == "ok" and c["cell"] == "copy_bandwidth":
                    env_extra["GPU_BENCH_BANDWIDTH"] = str(c["bandwidth_B_s"])
                if c["status"] == "ok" and c["cell"] == "gemm":
                    env_extra["GPU_BENCH_FLOPS"] = str(c["flop_s"])
    result = {
        "opts": dataclasses.asdict(o),
        "machine": machine_facts(o.device),
        "vendor": {"bandwidth_B_s": VENDOR_BANDWIDTH, "bf16_flop_s": VENDOR_BF16_FLOPS},
        "seconds": round(time.monotonic() - t_start, 1),
        "cells": cells,
    }
    add_ratios(cells)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"\nwrote {args.out} (log {log_path})")
    bad = [c for c in cells if c["status"] not in ("ok", "skipped")] + (
        [{"interrupted": True}] if interrupted else []
    )
    if args.quick:  # the hand-off is skipped on the CPU by design; other skips are failures here
        bad += [c for c in cells if c["status"] == "skipped" and not c["job"].startswith("handoff")]
    return 1 if bad else 0


def machine_facts(device: str) -> dict:
    facts: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    with contextlib.suppress(Exception):
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
        facts["nvidia_smi"] = out.stdout.strip()
    return facts


def add_ratios(cells: list[dict]) -> None:
    """pdserve / eager for each speed cell that both ran."""
    by = {(c["job"], c["cell"]): c for c in cells}
    for c in cells:
        if not c["job"].startswith("pdserve/") or c["status"] != "ok":
            continue
        other = by.get(("eager/" + c["job"].split("/", 1)[1], c["cell"]))
        if other and other["status"] == "ok" and other.get("tok_s"):
            c["eager_tok_s"] = other["tok_s"]
            c["vs_eager"] = round(c["tok_s"] / other["tok_s"], 3)


def _f(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def print_table(result: dict) -> None:
    cells = result["cells"]
    by = {(c["job"], c["cell"]): c for c in cells}
    ceil = {c["cell"]: c for c in cells if c["job"] == "ceilings"}
    bw = ceil.get("copy_bandwidth", {}).get("bandwidth_B_s")
    gemm = ceil.get("gemm", {}).get("flop_s")
    print(f"\n{result['machine'].get('nvidia_smi') or result['opts']['device']}")
    print(
        f"ceilings: copy {_f(bw and bw / 1e12, '.2f')} TB/s (vendor {VENDOR_BANDWIDTH / 1e12:.1f}), "
        f"GEMM {_f(gemm and gemm / 1e12, '.0f')} TFLOP/s (vendor {VENDOR_BF16_FLOPS / 1e12:.0f})"
    )
    print(
        "\nof vendor / of measured: the share of the bound at the datasheet's rate / at this run's ceilings "
        "(decode: bandwidth over weight + KV bytes per step; prefill: GEMM rate over 2 x matmul params)"
    )
    print(
        f"{'preset':<14} {'cell':<13} {'pdserve tok/s':>13} {'of vendor':>9} {'of measured':>11} "
        f"{'eager tok/s':>11} {'pdserve/eager':>13}  status"
    )
    for c in cells:
        if not c["job"].startswith("pdserve/") or c["cell"] == "load":
            continue
        preset = c["job"].split("/", 1)[1]
        eager = by.get(("eager/" + preset, c["cell"]), {})
        status = (
            c["status"] if eager.get("status", "ok") == "ok" else f"{c['status']} / eager {eager['status']}"
        )
        print(
            f"{preset:<14} {c['cell']:<13} {_f(c.get('tok_s')):>13} {_f(c.get('of_vendor_bound'), '.1%'):>9} "
            f"{_f(c.get('of_measured_bound'), '.1%'):>11} {_f(eager.get('tok_s')):>11} "
            f"{_f(c.get('vs_eager'), '.2f'):>13}  {status}"
        )
    for c in cells:
        if c["job"] == "handoff":
            print(
                f"\nhand-off cuda_ipc: {c.get('tokens', '-')} tokens, {_f(c.get('bytes') and c['bytes'] / 2**20)} MiB: "
                f"{_f(c.get('push_ms_median'), '.3f')} ms per push, {_f(c.get('GB_s'))} GB/s "
                f"(in one process {_f(c.get('local_GB_s'))} GB/s; bytes checked: {c.get('bytes_match', '-')})"
                f"  {c['status']}"
            )
    print(f"\n{'exactness':<30} {'figure':>10} {'limit':>8}  status")
    for c in cells:
        if c["job"] != "exact":
            continue
        if c["cell"].endswith("f32_logits"):
            fig, lim = _f(c.get("rel_err"), ".2e"), f"{EXACT_TOLERANCE:.0e}"
        else:
            fig, lim = _f(c.get("agreement"), ".2%"), f">={AGREEMENT_FLOOR:.0%}"
        print(f"{c['cell']:<30} {fig:>10} {lim:>8}  {c['status']}")
    failed = [c for c in cells if c["status"] not in ("ok", "skipped")]
    for c in failed + [c for c in cells if c["status"] == "skipped"]:
        print(f"  {c['job']} {c['cell']}: {c['status']}: {str(c.get('error', ''))[:300]}")


if __name__ == "__main__":
    sys.exit(main())
