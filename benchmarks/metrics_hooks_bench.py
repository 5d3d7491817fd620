"""CPU cost of the router's metrics hooks per request, isolated from everything else.

End to end (``router_overhead.py --systems pdserve,pdserve-nometrics``), the difference is smaller
than the run-to-run noise of a loaded 2-core machine; here the hooks a 16-token streamed request
triggers run alone in a loop, in one process: one ``on_route`` (prefill + decode selection), 16
``on_delta`` (the first observes TTFT, the others ITL, the last its timing, usage and E2E), one
Redis round-trip observation, the ``StatusSend`` wrapper around 9 ASGI sends, the in-flight
counter and ``on_request``. The same loop without the hooks (the monotonic reads and the sends the
router does anyway) is subtracted. Prints a table, writes JSON.

    python benchmarks/metrics_hooks_bench.py [--requests 20000] [--rounds 5] [--router-cpu-ms 4.3] [--out PATH]

``--router-cpu-ms``: the router's CPU per request with metrics off (from router_overhead.py), to
print the hooks' share of it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from harness import print_table, run_rounds, write_json

from pdserve.router.http.asgi import Message
from pdserve.router.http.metrics import RouterMetrics
from pdserve.router.http.serving import StatusSend
from pdserve.router.routing.selection import Route
from pdserve.scheduler.outbox_messages import RequestDelta, Timing, Usage
from pdserve.scheduler.registration import InstanceInfo

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 16
SENDS = 9  # ASGI sends of a 16-token stream (the router coalesces chunks; measured with strace)


async def _noop(message: Message) -> None:
    return None


async def with_hooks(metrics: RouterMetrics, n: int) -> float:
    # on_route reads only each instance's id and role: the rest of a registration is left out
    route = Route(
        prefill=InstanceInfo.model_construct(id="prefill-0", role="prefill"),
        decode=InstanceInfo.model_construct(id="decode-0", role="decode"),
    )
    delta = RequestDelta(request_id="r", token_ids=[5], text="a")
    final = RequestDelta(
        request_id="r",
        token_ids=[5],
        text="a",
        finish_reason="length",
        usage=Usage(prompt_tokens=8, completion_tokens=TOKENS),
        timing=Timing(s_ttft_s=0.01, queue_s=0.001, kv_transfer_s=0.002),
    )
    body = {"type": "http.response.body"}
    start = time.process_time()
    for _ in range(n):
        arrived = time.monotonic()
        metrics.on_route(route)
        metrics.on_redis("inbox_send", 0.0002, None)
        for i in range(TOKENS - 1):
            metrics.on_delta(delta, i == 0, arrived, arrived, time.monotonic())
        metrics.on_delta(final, False, arrived, arrived, time.monotonic())
        send = StatusSend(_noop)
        metrics.active += 1
        for _ in range(SENDS):
            await send(body)
        metrics.active -= 1
        metrics.on_request("/v1/chat/completions", "tiny", send.status, "")
    return (time.process_time() - start) / n


async def without_hooks(n: int) -> float:
    body = {"type": "http.response.body"}
    start = time.process_time()
    for _ in range(n):
        for _ in range(TOKENS + 1):
            time.monotonic()
        for _ in range(SENDS):
            await _noop(body)
    return (time.process_time() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--requests", type=int, default=20000, help="simulated requests per round (default %(default)s)"
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="rounds, alternating the two loops (default %(default)s)"
    )
    ap.add_argument(
        "--router-cpu-ms",
        type=float,
        default=None,
        help="router CPU ms per request with metrics off, to print the hooks' share",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "metrics_hooks.json")
    args = ap.parse_args()
    metrics = RouterMetrics()
    pairs = run_rounds(
        args.rounds,
        lambda _: (
            asyncio.run(with_hooks(metrics, args.requests)),
            asyncio.run(without_hooks(args.requests)),
        ),
    )
    hooks, base = [h for h, _ in pairs], [b for _, b in pairs]
    cost_us = statistics.median(h - b for h, b in zip(hooks, base, strict=True)) * 1e6
    print_table(
        ["loop", f"CPU us/request (median of {args.rounds})"],
        [
            ["with hooks", f"{statistics.median(hooks) * 1e6:.1f}"],
            ["without", f"{statistics.median(base) * 1e6:.1f}"],
            ["hooks cost", f"{cost_us:.1f}"],
        ],
    )
    report: dict[str, Any] = {
        "requests": args.requests,
        "rounds": args.rounds,
        "hooks_us": cost_us,
        "with_us": [h * 1e6 for h in hooks],
        "without_us": [b * 1e6 for b in base],
    }
    if args.router_cpu_ms:
        share = cost_us / (args.router_cpu_ms * 1e3) * 100
        report["share_of_router_cpu_percent"] = share
        print(f"= {share:.2f} % of {args.router_cpu_ms:g} ms router CPU per request")
    write_json(args.out, report, args)


if __name__ == "__main__":
    main()
