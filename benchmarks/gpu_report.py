"""The report of benchmarks/gpu_bench.py: the figures derived from its cells (each speed cell's
bound at the ceilings this run measured and at the card's datasheet, pdserve against eager) and the
tables it prints at the end. The run's record itself (jobs, cells, the JSON) is gpu_bench.py's."""

from __future__ import annotations

from typing import Any

from gpu_cells import AGREEMENT_FLOOR, EXACT_TOLERANCE
from harness import fmt as _f
from harness import print_table as harness_table


def add_bounds(cells: list[dict], measured: dict, sheet: dict | None) -> None:
    """Each speed cell's bound at this run's measured ceilings (``bound_tok_s``, ``of_bound``) and at
    the card's datasheet (``datasheet_bound_tok_s``, ``of_datasheet``), from what the cell recorded."""
    bw, flops = measured.get("copy_bandwidth_B_s"), measured.get("gemm_flop_s")
    for c in cells:
        if c["status"] != "ok" or not c.get("tok_s"):
            continue
        if "bytes_per_step" in c:  # decode: bandwidth-bound
            rates = {"": bw, "datasheet_": sheet and sheet["bandwidth_B_s"]}
            per = {k: r and c["batch"] * r / c["bytes_per_step"] for k, r in rates.items()}
        elif "flop_per_token" in c:  # prefill: compute-bound
            rates = {"": flops, "datasheet_": sheet and sheet["bf16_flop_s"]}
            per = {k: r and r / c["flop_per_token"] for k, r in rates.items()}
        else:
            continue
        if per[""]:
            c["bound_tok_s"], c["of_bound"] = per[""], c["tok_s"] / per[""]
        if per["datasheet_"]:
            c["datasheet_bound_tok_s"], c["of_datasheet"] = per["datasheet_"], c["tok_s"] / per["datasheet_"]


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


def print_table(doc: dict) -> None:
    cells = doc["cells"]
    by = {(c["job"], c["cell"]): c for c in cells}
    m, sheet = doc["measured"], doc["datasheet"]
    bw, gemm = m.get("copy_bandwidth_B_s"), m.get("gemm_flop_s")
    print(f"\ncard: {doc['card']}")
    print(
        f"measured this run: copy {_f(bw and bw / 1e12, '.2f')} TB/s (read + written), "
        f"GEMM {_f(gemm and gemm / 1e12, '.0f')} TFLOP/s"
        + (
            f"; datasheet ({sheet['card']}): {sheet['bandwidth_B_s'] / 1e12:.2f} TB/s, "
            f"{sheet['bf16_flop_s'] / 1e12:.0f} TFLOP/s bf16"
            if sheet
            else ""
        )
    )
    print(
        "\nbound: tok/s at this run's measured ceilings (decode: batch x copy bandwidth / (weight + KV "
        "bytes per step); prefill: GEMM rate / (2 x matmul params per token)); of sheet: of the datasheet's"
    )
    speed: list[list[Any]] = []
    for c in cells:
        if not c["job"].startswith("pdserve/") or c["cell"] == "load":
            continue
        preset = c["job"].split("/", 1)[1]
        eager = by.get(("eager/" + preset, c["cell"]), {})
        status = (
            c["status"] if eager.get("status", "ok") == "ok" else f"{c['status']} / eager {eager['status']}"
        )
        speed.append(
            [
                preset,
                c["cell"],
                _f(c.get("tok_s")),
                _f(c.get("bound_tok_s")),
                _f(c.get("of_bound"), ".1%"),
                _f(c.get("of_datasheet"), ".1%"),
                _f(eager.get("tok_s")),
                _f(c.get("vs_eager"), ".2f"),
                status,
            ]
        )
    harness_table(
        [
            "preset",
            "cell",
            "pdserve tok/s",
            "bound tok/s",
            "of bound",
            "of sheet",
            "eager tok/s",
            "pdserve/eager",
            "status",
        ],
        speed,
    )
    for c in cells:
        if c["job"] == "handoff":
            print(
                f"\nhand-off cuda_ipc: {c.get('tokens', '-')} tokens, {_f(c.get('bytes') and c['bytes'] / 2**20)} MiB: "
                f"{_f(c.get('push_ms_median'), '.3f')} ms per push, {_f(c.get('GB_s'))} GB/s "
                f"(in one process {_f(c.get('local_GB_s'))} GB/s; bytes checked: {c.get('bytes_match', '-')})"
                f"  {c['status']}"
            )
    exact: list[list[Any]] = []
    for c in cells:
        if not c["job"].startswith("exact/"):
            continue
        name = f"{c['job'].split('/', 1)[1]}/{c['cell']}"
        if c["cell"] == "f32_logits":
            fig, lim = _f(c.get("rel_err"), ".2e"), f"{EXACT_TOLERANCE:.0e}"
        else:
            fig, lim = _f(c.get("agreement"), ".2%"), f">={AGREEMENT_FLOOR:.0%}"
        exact.append([name, fig, lim, c["status"]])
    print()
    harness_table(["exactness", "figure", "limit", "status"], exact)
    print(
        "\njobs: "
        + ", ".join(f"{j['job']} {j['status']} {_f(j.get('seconds'), '.0f')} s" for j in doc["jobs"])
    )
    for c in cells:
        if c["status"] not in ("ok",):
            print(f"  {c['job']} {c['cell']}: {c['status']}: {str(c.get('error', ''))[:300]}")
