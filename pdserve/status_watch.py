"""``pdserve status --watch``: a live rich view redrawn every interval (fewer columns below
:data:`WIDE`, the device column from :data:`WIDEST`); into a pipe, the plain table once per interval.
Redis being away is shown on the screen until it answers again."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from pdserve.scheduler import RedisSettings
from pdserve.scheduler.redis_client import redact_url
from pdserve.status_read import batch_queue, read
from pdserve.status_roles import role_lines
from pdserve.status_table import (
    BATCH_COLUMNS,
    _age,
    _batch_head,
    _batch_lines,
    _batch_row,
    _model,
    _waiting,
    address,
    counts_line,
    device,
    inbox,
    render,
)
from pdserve.status_tiers import integrity_lines, tier_lines

WIDE = 120  # from this many columns on, ``--watch`` shows every column; narrower, the essential ones
WIDEST = 150  # ... and from this many on, each instance's DEVICE too


def view(status: dict[str, Any] | None, error: str | None = None, width: int = WIDE) -> Any:
    """The ``--watch`` screen: a rich renderable of one status (or of why there is none). Narrower
    than ``WIDE`` columns (an 80-column terminal) it drops MODEL and WAIT TOK and the KV bar, and
    packs the table, so every instance id and state stays whole; DEVICE shows from ``WIDEST`` on."""
    from rich.console import Group
    from rich.text import Text

    stamp = time.strftime("%H:%M:%S")
    if status is None:
        return Text(f"{stamp}  {error}", style="bold red")
    wide = width >= WIDE
    head = Text(f"{stamp}  {counts_line(status)}    (Ctrl-C to quit)", style="bold")
    columns = [
        "INSTANCE",
        "ROLE",
        "MODEL",
        "DEVICE",
        "RUN",
        "WAIT",
        "WAIT TOK",
        "KV USED",
        "INBOX",
        "AGE",
        "STATE",
    ]
    if width < WIDEST:
        columns.remove("DEVICE")
    if not wide:
        columns = [c for c in columns if c not in ("MODEL", "WAIT TOK")]
        columns[columns.index("INBOX")] = "INBOX/PEND"  # its length / its pending count
    instances = _watch_table(columns, wide)
    for i in status["instances"]:
        used = i["num_blocks"] - i["free_blocks"]
        share = used / i["num_blocks"] if i["num_blocks"] else 0.0
        bar = "#" * round(share * 10) + "." * (10 - round(share * 10))
        state = Text("draining", style="yellow") if i["draining"] else Text("ready", style="green")
        counts = (str(i["running"]), _waiting(i))
        if wide:
            instances.add_row(
                i["id"],
                i["role"],
                _model(i),
                *([device(i)] if "DEVICE" in columns else []),
                *counts,
                str(i["waiting_prefill_tokens"]),
                f"{bar} {share:4.0%} ({used}/{i['num_blocks']})",
                inbox(i),
                _age(i["age_s"]),
                state,
            )
        else:
            instances.add_row(
                i["id"],
                i["role"],
                *counts,
                f"{share:.0%} {used}/{i['num_blocks']}",
                f"{i['inbox_len']}/{i['inbox_pending']}",  # dead letters: wide only
                _age(i["age_s"]),
                state,
            )
    routers = _watch_table(["ROUTER", "ADDRESS", "OUTBOX", "AGE"], wide)
    for r in status["routers"]:
        routers.add_row(r["id"], address(r), str(r["outbox_len"]), _age(r["age_s"]))
    integrity = [
        Text(line) for line in integrity_lines(status)[1:] + tier_lines(status)[1:] + role_lines(status)[1:]
    ]
    return Group(head, instances, routers, *integrity, *_watch_batches(status.get("batches"), wide))


def _watch_batches(batches: dict[str, Any] | None, wide: bool) -> list[Any]:
    """The ``--watch`` batches panel: a heading and a table, none when ``render`` shows none.
    Narrow, it drops ENDPOINT and CREATED (a batch id alone takes 30 columns)."""
    from rich.text import Text

    if not _batch_lines(batches):
        return []
    assert batches is not None
    columns = list(BATCH_COLUMNS) if wide else ["BATCH", "STATUS", "COMPLETED/FAILED/TOTAL"]
    table = _watch_table(columns, wide)
    for b in (*batches["active"], *batches["recent"]):
        row = dict(zip(BATCH_COLUMNS, _batch_row(b), strict=True))
        table.add_row(*(row[c] for c in columns))
    return [Text(_batch_head(batches), style="bold"), table]


def _watch_table(columns: Sequence[str], wide: bool) -> Any:
    """A ``--watch`` table: boxed when wide, else unboxed (the borders alone take 3 columns each)."""
    from rich import box
    from rich.table import Table

    table = Table(
        expand=False,
        header_style="bold",
        box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
        pad_edge=wide,
        show_edge=wide,
        padding=(0, 1),
        collapse_padding=not wide,
    )
    for column in columns:
        table.add_column(column, no_wrap=True)
    return table


def unreachable(redis_url: str, error: BaseException) -> str:
    """What ``--watch`` shows while Redis does not answer (the URL without its password)."""
    return f"cannot read {redact_url(redis_url)}: {error}"


def watch(redis_url: str, cluster: str, interval_s: float = 1.0) -> int:
    """``pdserve status --watch``: redraw the status every ``interval_s`` until Ctrl-C (exit 0).
    Redis being away is shown on the screen, and the view resumes when it answers again. When
    stdout is not a terminal (a pipe, a log file) there is nothing to redraw: it prints one plain
    snapshot (``pdserve status``'s table under a time stamp) per interval instead."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    tty = sys.stdout.isatty()

    async def loop(live: Live | None) -> None:
        redis = RedisSettings.from_url(redis_url).connect()
        queue = batch_queue(redis_url, cluster)
        try:
            while True:
                status: dict[str, Any] | None = None
                error: str | None = None
                try:
                    status = await asyncio.wait_for(read(redis, cluster, queue), 5)
                except Exception as e:
                    error = unreachable(redis_url, e)
                if live is not None:
                    live.update(view(status, error, console.width), refresh=True)
                else:
                    print(snapshot(status, error), flush=True)
                await asyncio.sleep(interval_s)
        finally:
            await redis.aclose()
            if queue is not None:
                queue.connection.close()

    try:
        if not tty:
            asyncio.run(loop(None))
            return 0
        with Live(view(None, "connecting ..."), console=console, auto_refresh=False, screen=False) as live:
            asyncio.run(loop(live))
    except KeyboardInterrupt:
        pass
    return 0


def snapshot(status: dict[str, Any] | None, error: str | None = None) -> str:
    """One ``--watch`` snapshot for a pipe: a time stamp, then the plain status (or why there is none)."""
    stamp = time.strftime("%H:%M:%S")
    return f"{stamp}  {error}\n" if status is None else f"{stamp}  {render(status)}\n"
