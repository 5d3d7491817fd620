"""pdserve on one NVIDIA GPU: speed against the bounds this run measures on the card, beside HF
transformers eager; the KV hand-off over CUDA IPC; exactness against a float64 reference. Prints a
table naming the card, and keeps a JSON file that is rewritten whenever a cell or a job ends.

Cells, grouped in jobs; each job is a child process under a time limit (a crash or a hang loses only
that job), each cell inside it under its own limit; a failed cell is recorded and the rest go on.
Jobs run in this order, so that a short --budget-s (or a kill) cuts what matters least:

  ceilings          seconds: the card's copy bandwidth (one large device-to-device copy, bytes read +
                    written) and bf16 GEMM rate (8192^3), the ceilings every speed cell is judged by
  pdserve/<preset>  every preset in turn (llama3-8b, then smollm2-135m): decode tok/s at each batch
                    size (prompts of --prompt-len random tokens, --gen-len greedy tokens with
                    ignore_eos; steady state only: the steps after every sequence has its first token
                    and after --skip-steps more, following a warm-up round at the same batch size),
                    and prefill tok/s of a --prefill-len prompt (a fresh random prompt each time,
                    prefix caching off: never a cache hit, one chunk)
  handoff           a --prefill-len prompt's KV in the llama3-8b shape (bf16) pushed by
                    pdserve.cache_transfer.cuda_ipc between two processes: per push (median of
                    --handoff-reps), GB/s, the bytes checked; beside it the same gather/scatter
                    inside one process (what the copy costs without IPC)
  exact/<preset>    float32 on the GPU (TF32 off) against benchmarks/reference_llama.py's float64
                    numpy forward: max |logits - ref| / max |ref| <= 1e-3 over prompt and decode
                    steps; bfloat16 vs float32 greedy over --agree-tokens tokens: the share of
                    positions where bf16's argmax, fed f32's tokens, is f32's token (>= 99 %), and
                    the first position where free-running bf16 greedy departs from f32's
  eager/<preset>    last, the reference: the speed cells in HF transformers (LlamaForCausalLM, same
                    weights, eager PyTorch, sdpa attention, DynamicCache, greedy with past_key_values)

Bounds: decode tok/s <= batch x (measured copy bandwidth) / (weight bytes + KV bytes read per step);
prefill tok/s <= (measured GEMM rate) / (2 x matmul parameters per token). The datasheet's figures of
the card (where nvidia-smi's name is one of gpu_cells.DATASHEETS) are shown beside, for reference.

    python benchmarks/gpu_bench.py --out gpu-out/gpu_bench.json     # on the GPU machine
    python benchmarks/gpu_bench.py --device cpu                     # the dry run: torch's CPU device,
                                                                    # tiny shapes, every code path
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
from typing import IO, Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from gpu_cells import Opts, datasheet  # noqa: E402
from gpu_report import add_bounds, add_ratios, print_table  # noqa: E402
from harness import cpu_model, write_json  # noqa: E402

from pdserve.localredis.embedded import dies_with_parent  # noqa: E402

JOBS = ("ceilings", "pdserve", "handoff", "exact", "eager")
MIN_JOB_S = 20  # a job that would start with less of --budget-s left is cut, not started


# ---------------------------------------------------------------------------------------- options
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda (default), or cpu: the dry run on torch's CPU device with tiny shapes (the numbers "
        "mean nothing; the hand-off cell, which needs CUDA IPC, is skipped with its reason)",
    )
    ap.add_argument("--quick", action="store_true", help="the same as --device cpu")
    ap.add_argument(
        "--presets",
        default=None,
        help="model presets of the speed cells (pdserve/, eager/), comma-separated, in the order they "
        "run; seeded random weights in the model's shape (default llama3-8b,smollm2-135m; cpu: tiny)",
    )
    ap.add_argument(
        "--exact-presets",
        default=None,
        help="presets of the exactness jobs; NAME-2l is NAME cut to 2 layers (default "
        "smollm2-135m,llama3-8b-2l: tests/gpu checks tiny; cpu: tiny)",
    )
    ap.add_argument(
        "--batch-sizes",
        default=None,
        help="decode batch sizes, comma-separated (default 1,8,32; cpu: 1,2)",
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
        help="greedy tokens of the bf16-vs-f32 agreement cell (default 512; cpu: 32)",
    )
    ap.add_argument("--dtype", default="bfloat16", help="speed cells' dtype (default %(default)s)")
    ap.add_argument(
        "--only",
        default=",".join(JOBS),
        help=f"kinds of job to run, comma-separated, among {', '.join(JOBS)} (default all)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"wall-clock budget of the whole run; each job gets at most what is left, and one that "
        f"would start with under {MIN_JOB_S} s left is cut (default 300; cpu: 240)",
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
        help="the JSON result, rewritten as cells and jobs end (default %(default)s)",
    )
    ap.add_argument("--log", type=Path, default=None, help="the jobs' log (default: --out with .log)")
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)  # internal: run one job (JSON)
    ap.add_argument("--cells-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.device = "cpu"
    q = args.quick = args.device == "cpu"
    defaults = {
        "presets": "tiny" if q else "llama3-8b,smollm2-135m",
        "exact_presets": "tiny" if q else "smollm2-135m,llama3-8b-2l",
        "batch_sizes": "1,2" if q else "1,8,32",
        "prompt_len": 16 if q else 128,
        "gen_len": 12 if q else 128,
        "skip_steps": 2 if q else 4,
        "prefill_len": 64 if q else 2048,
        "prefill_reps": 2 if q else 5,
        "agree_tokens": 32 if q else 512,
        "budget_s": 240.0 if q else 300.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if q:
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
    """The jobs in the order they run, so that a short budget or a kill cuts what matters least: the
    ceilings (seconds, and every speed figure's yardstick), pdserve's speed at each preset, the
    hand-off, exactness per preset, and the eager reference last. Limits: each job's need on an H100
    with room to spare, guessed (the GPU has not run them yet); the dry run's for 2 slow CPU cores."""
    speed = ["load", *(f"decode_b{b}" for b in o.batch_sizes), f"prefill_{o.prefill_len}"]

    def limit(gpu_s: float) -> float:
        return 120.0 if o.quick else gpu_s

    def big(preset: str) -> bool:
        return preset.startswith("llama3-8b")

    jobs = [
        Job("ceilings", None, ["copy_bandwidth", "gemm"], limit(40)),
        *(Job("pdserve", p, speed, limit(150 if big(p) else 60)) for p in o.presets),
        Job("handoff", None, ["cuda_ipc"], limit(45)),
        *(
            Job("exact", p, ["f32_logits", "bf16_agreement"], limit(120 if big(p) else 60))
            for p in o.exact_presets
        ),
        *(Job("eager", p, speed, limit(120 if big(p) else 60)) for p in o.presets),
    ]
    return [j for j in jobs if j.kind in only]


# ------------------------------------------------------------------------------------ the record
class Results:
    """The JSON file, rewritten whole whenever a cell or a job ends (into a temporary file, then
    renamed: a reader, or a kill at any moment, finds the previous version or the next, never half
    of one). A run killed at any point keeps every figure it had measured."""

    def __init__(
        self, path: Path, jobs: list[Job], head: dict, args: argparse.Namespace | None = None
    ) -> None:
        self.path, self.head, self.t0, self.args = path, head, time.monotonic(), args
        self.jobs = {j.name: {"job": j.name, "status": "pending", "limit_s": j.limit_s} for j in jobs}
        self.cells: dict[str, list[dict]] = {j.name: [] for j in jobs}
        self.complete = False
        self.write()

    def start(self, job: Job, limit_s: float) -> None:
        self.jobs[job.name].update(status="running", limit_s=round(limit_s), started_s=self.elapsed())
        self.write()

    def partial(self, job: Job, cells: list[dict]) -> None:
        """The cells a running job has recorded so far (its child appends them to a file)."""
        self.cells[job.name] = [{"job": job.name, **c} for c in cells]
        self.write()

    def end(self, job: Job, status: str, cells: list[dict], seconds: float | None = None) -> None:
        self.jobs[job.name]["status"] = status
        if seconds is not None:
            self.jobs[job.name]["seconds"] = round(seconds, 1)
        self.cells[job.name] = [{"job": job.name, **c} for c in cells]
        self.write()

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def measured(self) -> dict:
        """The ceilings this run measured (none until the ceilings job has run)."""
        out: dict[str, Any] = {}
        for c in self.cells.get("ceilings", []):
            if c["status"] == "ok" and c["cell"] == "copy_bandwidth":
                out["copy_bandwidth_B_s"] = c["bandwidth_B_s"]
                out["device_name"] = c.get("device_name")
            if c["status"] == "ok" and c["cell"] == "gemm":
                out["gemm_flop_s"] = c["flop_s"]
        return out

    def document(self) -> dict:
        measured = self.measured()
        card = self.head["card"] or measured.get("device_name") or "unknown"
        sheet = datasheet(card) if self.head["device"] == "cuda" else None
        cells = [dict(c) for name in self.jobs for c in self.cells[name]]
        add_bounds(cells, measured, sheet)
        add_ratios(cells)
        return {
            **self.head,
            "card": card,
            "datasheet": sheet,
            "measured": measured,
            "complete": self.complete,
            "seconds": self.elapsed(),
            "jobs": list(self.jobs.values()),
            "cells": cells,
        }

    def write(self) -> dict:
        return write_json(self.path, self.document(), self.args, quiet=True)


def read_cells(path: Path) -> list[dict]:
    """A job's cells file: each cell's latest state, in the order they started."""
    seen: dict[str, dict] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                cell = json.loads(line)
                seen[cell["cell"]] = cell
    return list(seen.values())


# ------------------------------------------------------------------------------- the parent side
def run_job(job: Job, o: Opts, limit_s: float, log_file: IO[str], results: Results) -> bool:
    """Run ``job`` in a child process for at most ``limit_s``, copying its cells into ``results``
    as they come; whether this process was interrupted meanwhile (the job is then killed)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".jsonl", delete=False) as f:
        cells_file = Path(f.name)
    spec = json.dumps({"kind": job.kind, "preset": job.preset, "opts": dataclasses.asdict(o)})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", spec, "--cells-file", str(cells_file)]
    log_file.write(f"\n===== job {job.name} (limit {limit_s:.0f} s) =====\n")
    log_file.flush()
    results.start(job, limit_s)
    t0 = time.monotonic()
    ended, size = "exited", 0
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # its own session (killed whole at its limit); SIGTERM when this process dies, even by SIGKILL
    proc = subprocess.Popen(
        cmd,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=dies_with_parent(),
    )
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 >= limit_s:
                ended = "timeout"
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=min(1.0, max(0.05, limit_s - (time.monotonic() - t0))))
            with contextlib.suppress(FileNotFoundError):
                if cells_file.stat().st_size != size:  # a cell started or ended: into the JSON now
                    size = cells_file.stat().st_size
                    results.partial(job, read_cells(cells_file))
    except KeyboardInterrupt:
        ended = "interrupted"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the hand-off's second process too
        rc = proc.wait()
    elapsed = time.monotonic() - t0
    seen = {c["cell"]: c for c in read_cells(cells_file)}
    cells_file.unlink(missing_ok=True)
    out = []
    for name in job.cells:
        cell = seen.get(name)
        status = {"timeout": "timeout", "interrupted": "cut"}.get(ended, "error")
        if cell is None:
            cell = {
                "cell": name,
                "status": status,
                "error": f"job {ended} (rc {rc}) after {elapsed:.0f} s before this cell",
            }
        elif cell["status"] == "running":
            cell = {
                **cell,
                "status": status,
                "error": f"job {ended} (rc {rc}) after {elapsed:.0f} s during this cell",
            }
        out.append(cell)
    job_status = ended if ended != "exited" else ("ok" if rc == 0 else f"error (rc {rc})")
    results.end(job, job_status, out, elapsed)
    print(
        f"  {job.name}: {elapsed:.0f} s, " + ", ".join(f"{c['cell']} {c['status']}" for c in out),
        file=sys.stderr,
        flush=True,
    )
    return ended == "interrupted"


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

    def on_signal(signum: int, frame: Any) -> None:  # an outer `timeout` or Ctrl-C: end the job, write
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the rest of the run is the tidy-up
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    jobs = plan(o, only)
    head = {
        "card": card_name(o.device),
        "device": o.device,
        "dry_run": o.quick,
        "budget_s": args.budget_s,
        "opts": dataclasses.asdict(o),
    }
    results = Results(args.out, jobs, head, args)
    print(
        f"gpu_bench on {head['card']}: {len(jobs)} jobs, budget {args.budget_s:.0f} s; {args.out}", flush=True
    )
    interrupted = False
    with open(log_path, "w") as log_file:
        for job in jobs:
            left = args.budget_s - results.elapsed()
            if interrupted or left < MIN_JOB_S:
                why = (
                    "interrupted (SIGTERM/SIGINT)"
                    if interrupted
                    else f"out of --budget-s ({left:.0f} s left)"
                )
                results.end(job, "cut", [{"cell": c, "status": "cut", "error": why} for c in job.cells])
                continue
            try:
                interrupted = run_job(job, o, min(job.limit_s, left), log_file, results)
            except KeyboardInterrupt:  # between two jobs, or while the record was written
                interrupted = True
    results.complete = True
    doc = results.write()
    print_table(doc)
    print(f"\nwrote {args.out} (log {log_path}) in {doc['seconds']:.0f} s of a {args.budget_s:.0f} s budget")
    cells = doc["cells"]
    bad = [c for c in cells if c["status"] not in ("ok", "skipped", "cut")]
    if o.quick:  # the dry run reaches every job within its budget; a Skip says why it cannot run here
        bad += [c for c in cells if c["status"] == "cut"]
    return 1 if bad or interrupted else 0


def card_name(device: str) -> str | None:
    """What ran the cells: the GPU's name (nvidia-smi; else the ceilings job's torch name, later),
    or this CPU's model for the dry run."""
    if device == "cpu":
        return f"cpu: {cpu_model()} (dry run: the figures mean nothing)"
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        if names:
            return names[0]
    return None


if __name__ == "__main__":
    sys.exit(main())
