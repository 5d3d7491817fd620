"""``pdserve status``: the live set, the routers and the stream depths, read from Redis."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

import orjson

from pdserve.scheduler import (
    InstanceInfo,
    InstanceRegistry,
    Keys,
    PrefixIndex,
    RedisSettings,
    RouterRegistry,
    wait_for_redis,
)
from pdserve.scheduler.connection import redact_url
from pdserve.scheduler.keys import INBOX_GROUP


async def collect(redis_url: str, cluster: str) -> dict[str, Any]:
    redis = RedisSettings.from_url(redis_url).connect()
    try:
        await wait_for_redis(redis, timeout_s=5)
        return await read(redis, cluster)
    finally:
        await redis.aclose()


async def read(redis: Any, cluster: str) -> dict[str, Any]:
    """The status from one connected client (``collect`` without the connection)."""
    keys = Keys(cluster)
    instances = await InstanceRegistry(redis, keys).live()
    routers = await RouterRegistry(redis, keys).live()
    pipe = redis.pipeline(transaction=False)
    for i in instances:
        pipe.xlen(keys.inbox(i.id))
        pipe.pttl(keys.instance(i.id))
    for r in routers:
        pipe.xlen(keys.outbox(r.id))
    replies = await pipe.execute()
    indexed = await PrefixIndex(redis, keys).sizes([i.id for i in instances])
    pending = []
    for i in instances:
        try:
            pending.append(int((await redis.xpending(keys.inbox(i.id), INBOX_GROUP))["pending"]))
        except Exception:
            pending.append(0)
    now = time.time()
    out_instances = []
    for n, i in enumerate(instances):
        out_instances.append(
            {
                "id": i.id,
                "role": i.role,
                "model": i.model,
                "host": i.host,
                "pid": i.pid,
                "running": i.load.running,
                "waiting": i.load.waiting,
                "waiting_prefill_tokens": i.load.waiting_prefill_tokens,
                "free_blocks": i.kv.free_blocks,
                "num_blocks": i.kv.num_blocks,
                "prefix_index_blocks": indexed.get(i.id, 0) if i.kv.prefix_caching else None,
                "draining": i.draining,
                "age_s": round(now - i.started_at, 1),
                "ttl_ms": replies[2 * n + 1],
                "inbox_len": replies[2 * n],
                "inbox_pending": pending[n],
            }
        )
    base = 2 * len(instances)
    out_routers = [
        {
            "id": r.id,
            "host": r.host,
            "port": r.port,
            "pid": r.pid,
            "age_s": round(now - r.started_at, 1),
            "outbox_len": replies[base + n],
        }
        for n, r in enumerate(routers)
    ]
    return {"cluster": cluster, "instances": out_instances, "routers": out_routers}


def render(status: dict[str, Any]) -> str:
    lines = [
        f"cluster {status['cluster']}: {len(status['instances'])} instance(s), {len(status['routers'])} router(s)"
    ]
    if status["instances"]:
        lines.append("")
        head = (
            "INSTANCE",
            "ROLE",
            "MODEL",
            "HOST",
            "RUN",
            "WAIT",
            "FREE KV",
            "PREFIX INDEX",
            "INBOX",
            "AGE",
            "STATE",
        )
        rows = [
            (
                i["id"],
                i["role"],
                i["model"],
                i["host"],
                str(i["running"]),
                str(i["waiting"]),
                f"{i['free_blocks']}/{i['num_blocks']}",
                "off" if i["prefix_index_blocks"] is None else f"{i['prefix_index_blocks']} blocks",
                f"{i['inbox_len']} ({i['inbox_pending']} pending)",
                _age(i["age_s"]),
                "draining" if i["draining"] else "ready",
            )
            for i in status["instances"]
        ]
        lines += _table(head, rows)
    if status["routers"]:
        lines.append("")
        router_rows = [
            (r["id"], f"{r['host']}:{r['port']}", str(r["outbox_len"]), _age(r["age_s"]))
            for r in status["routers"]
        ]
        lines += _table(("ROUTER", "ADDRESS", "OUTBOX", "AGE"), router_rows)
    return "\n".join(lines)


def _table(head: tuple[str, ...], rows: Sequence[tuple[object, ...]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *rows)]


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.0f}d"  # a long-lived worker's age stays narrow


def run_status(redis_url: str, cluster: str, as_json: bool, check: str | None = None) -> int:
    if check is not None:
        return check_instance(asyncio.run(registration(redis_url, cluster, check)), check, cluster)
    status = asyncio.run(collect(redis_url, cluster))
    print(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode() if as_json else render(status))
    return 0


async def registration(redis_url: str, cluster: str, instance_id: str) -> InstanceInfo | None:
    """One instance's live registration (a health check reads this one key, not the whole cluster)."""
    redis = RedisSettings.from_url(redis_url).connect()
    try:
        await wait_for_redis(redis, timeout_s=5)
        return await InstanceRegistry(redis, Keys(cluster)).get(instance_id)
    finally:
        await redis.aclose()


def check_instance(info: InstanceInfo | None, instance_id: str, cluster: str) -> int:
    """A health check: 0 when the instance is registered (its TTL key alive) and not draining."""
    if info is None:
        print(f"{instance_id}: not registered in cluster {cluster}", file=sys.stderr)
        return 1
    if info.draining:
        print(f"{instance_id}: draining", file=sys.stderr)
        return 1
    kv = info.kv
    print(
        f"{instance_id}: ready ({info.load.running} running, {kv.free_blocks}/{kv.num_blocks} KV blocks free)"
    )
    return 0


WIDE = 120  # from this many columns on, ``--watch`` shows every column; narrower, the essential ones


def view(status: dict[str, Any] | None, error: str | None = None, width: int = WIDE) -> Any:
    """The ``--watch`` screen: a rich renderable of one status (or of why there is none). Narrower
    than ``WIDE`` columns (an 80-column terminal) it drops MODEL and WAIT TOK and the KV bar, and
    packs the table, so every instance id and state stays whole."""
    from rich.console import Group
    from rich.text import Text

    stamp = time.strftime("%H:%M:%S")
    if status is None:
        return Text(f"{stamp}  {error}", style="bold red")
    wide = width >= WIDE
    head = Text(
        f"{stamp}  cluster {status['cluster']}: {len(status['instances'])} instance(s), "
        f"{len(status['routers'])} router(s)    (Ctrl-C to quit)",
        style="bold",
    )
    columns = ["INSTANCE", "ROLE", "MODEL", "RUN", "WAIT", "WAIT TOK", "KV USED", "INBOX", "AGE", "STATE"]
    if not wide:
        columns = [c for c in columns if c not in ("MODEL", "WAIT TOK")]
        columns[columns.index("INBOX")] = "INBOX/PEND"  # its length / its pending count
    instances = _watch_table(columns, wide)
    for i in status["instances"]:
        used = i["num_blocks"] - i["free_blocks"]
        share = used / i["num_blocks"] if i["num_blocks"] else 0.0
        bar = "#" * round(share * 10) + "." * (10 - round(share * 10))
        state = Text("draining", style="yellow") if i["draining"] else Text("ready", style="green")
        counts = (str(i["running"]), str(i["waiting"]))
        if wide:
            instances.add_row(
                i["id"],
                i["role"],
                i["model"],
                *counts,
                str(i["waiting_prefill_tokens"]),
                f"{bar} {share:4.0%} ({used}/{i['num_blocks']})",
                f"{i['inbox_len']} ({i['inbox_pending']} pending)",
                _age(i["age_s"]),
                state,
            )
        else:
            instances.add_row(
                i["id"],
                i["role"],
                *counts,
                f"{share:.0%} {used}/{i['num_blocks']}",
                f"{i['inbox_len']}/{i['inbox_pending']}",
                _age(i["age_s"]),
                state,
            )
    routers = _watch_table(["ROUTER", "ADDRESS", "OUTBOX", "AGE"], wide)
    for r in status["routers"]:
        routers.add_row(r["id"], f"{r['host']}:{r['port']}", str(r["outbox_len"]), _age(r["age_s"]))
    return Group(head, instances, routers)


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
        try:
            while True:
                status: dict[str, Any] | None = None
                error: str | None = None
                try:
                    status = await asyncio.wait_for(read(redis, cluster), 5)
                except Exception as e:
                    error = unreachable(redis_url, e)
                if live is not None:
                    live.update(view(status, error, console.width), refresh=True)
                else:
                    print(snapshot(status, error), flush=True)
                await asyncio.sleep(interval_s)
        finally:
            await redis.aclose()

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
