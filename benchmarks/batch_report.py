"""What benchmarks/batch_bench.py reports: online TTFT pooled over the rounds' phases, the B/A
ratios against the goal, and the tables (phases; where the time went: the prefill side of TTFT, each
worker's steps, each process's CPU)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from harness import print_table as harness_table

from pdserve import bench

GOAL = 1.10  # the acceptance: online TTFT with a batch running within 10 % of without
OTHERS_WARN = 0.15  # cores used by processes not of this benchmark past which a phase is flagged


def pooled(rows: list[dict], kind: str) -> dict[str, Any]:
    values = [x for r in rows if r["phase"] == kind for x in r["ttft_ms"]]
    s = ttft(values)
    return {"requests": len(values), "p50": s["p50"], "p99": s["p99"]}


def ttft(values: list[float]) -> dict[str, float]:
    return bench.stats(values, (50, 99)) if values else {"p50": float("nan"), "p99": float("nan")}


def summary_line(row: dict) -> str:
    s = ttft(row["ttft_ms"])
    text = f"{row['requests']} requests, TTFT p50 {s['p50']:.1f} ms, p99 {s['p99']:.1f} ms"
    if row["phase"] == "B":
        text += f", {row['batch_lines_done']} batch lines done" + (
            "" if row["valid"] else f" (VOID: {row['void_reason']})"
        )
    return text


def print_table(result: dict, args: argparse.Namespace, layout: str) -> None:
    a, p = result["pooled"]["A"], result["pooled"]["B"]
    rows = result["phases"]
    tokens_in = sum(r["prompt_tokens_mean"] * r["requests"] for r in rows) / max(
        1, sum(r["requests"] for r in rows)
    )
    print(
        f"\ntiny model, {layout}, {os.cpu_count()} cores; {args.clients} closed-loop online clients (streaming chat, "
        f"{tokens_in:.0f} prompt tokens on average, {args.max_tokens} out); B: a {args.batch_lines}-line batch "
        f"(lines alike), batch worker --max-load {args.max_load} --concurrency {args.batch_concurrency}; "
        f"{args.phase_s:.0f} s measured per phase"
    )
    head = (
        "phase",
        "round",
        "online req",
        "TTFT p50 ms",
        "p99 ms",
        "p50 B/A",
        "p99 B/A",
        "batch lines",
        "stall s",
        "note",
    )
    table = []
    for r in rows:
        s, b = ttft(r["ttft_ms"]), r["phase"] == "B"
        table.append(
            (
                r["phase"],
                str(r["round"]),
                str(r["requests"]) + (f" ({r['failed']} failed)" if r["failed"] else ""),
                f"{s['p50']:.1f}",
                f"{s['p99']:.1f}",
                f"{s['p50'] / a['p50']:.3f}" if b else "",
                f"{s['p99'] / a['p99']:.3f}" if b else "",
                str(r["batch_lines_done"]) if b else "-",
                f"{r['batch_longest_stall_s']:.0f}" if b else "",
                ("ok" if r["valid"] else f"VOID: {r['void_reason']}") if b else "",
            )
        )
    pooled = result["pooled"]
    done = sum(r["batch_lines_done"] for r in rows if r["phase"] == "B")
    table.append(
        ("A pooled", "all", str(a["requests"]), f"{a['p50']:.1f}", f"{a['p99']:.1f}", "", "", "-", "", "")
    )
    table.append(
        (
            "B pooled",
            "all",
            str(p["requests"]),
            f"{p['p50']:.1f}",
            f"{p['p99']:.1f}",
            f"{pooled['ratio_p50']:.3f}",
            f"{pooled['ratio_p99']:.3f}",
            str(done),
            "",
            "ok" if pooled["all_b_valid"] else "VOID: a B phase's batch did not run throughout",
        )
    )
    harness_table(head, table)
    verdict = "met" if max(pooled["ratio_p50"], pooled["ratio_p99"]) <= GOAL else "NOT met"
    void = "" if pooled["all_b_valid"] else " (void: the batch did not run throughout every B phase)"
    print(f"goal, B/A of TTFT p50 and p99 <= {GOAL:.2f}: {verdict}{void}")
    busy = [
        f"{r['phase']}{r['round']} {r['cpu_cores']['others']:.2f}"
        for r in rows
        if r["cpu_cores"]["others"] > OTHERS_WARN
    ]
    if busy:
        print(
            f"WARNING: other processes on this host used CPU during phases (cores): {', '.join(busy)}; "
            "the comparison is skewed by them"
        )
    t = result["batch_alone"]
    print(
        f"batch alone (no online load): {t['completed']} of {t['lines']} lines in {t['duration_s']:.1f} s from "
        f"creation to completed ({t['validating_s']:.1f} s validating): {t['lines_per_s']:.2f} lines/s, "
        f"{t['tokens_per_s']:.1f} generated tok/s ({t['completion_tokens']} tokens)"
    )
    print(
        "\nwhere the time went, per phase: the prefill instance's side of TTFT p50/p99 ms (timing: s_ttft = "
        "its engine queue + prefill); each worker's mean step ms / mean batch size / share of time in steps; "
        "CPU in cores (clients: this process; host: all busy CPU, steal: taken by the hypervisor)"
    )
    for r in [*rows, {"phase": "alone", "round": "-", **t}]:
        side = ""
        if "s_ttft_ms" in r:
            side = " ".join(
                f"{key} {r[f'{key}_ms']['p50']:.1f}/{r[f'{key}_ms']['p99']:.1f}"
                for key in ("s_ttft", "queue")
            )
            side = f"{side} | "
        engine = "  ".join(
            f"{name} {e['step_ms'] or 0:.1f}/{e['batch_size']:.1f}/{e['busy']:.0%}"
            for name, e in r["engine"].items()
        )
        cpu = " ".join(f"{name} {c:.2f}" for name, c in r["cpu_cores"].items())
        print(f"  {r['phase']:<5} {r['round']!s:>2}: {side}{engine} | CPU {cpu}")
