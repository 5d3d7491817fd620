"""``pdserve status``: the live set, the routers, the stream depths and the batches, read from Redis."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import orjson

from pdserve.batchstore.batch_queue import BatchQueue
from pdserve.batchstore.batches import BatchObject, BatchStore
from pdserve.batchstore.owners import owner_name
from pdserve.errors import NotFoundError
from pdserve.scheduler import (
    InstanceInfo,
    InstanceRegistry,
    Keys,
    PrefixIndex,
    RedisSettings,
    RouterRegistry,
    wait_for_redis,
)
from pdserve.scheduler.keys import INBOX_GROUP
from pdserve.scheduler.redis_client import redact_url
from pdserve.status_roles import last_plan, role_history, role_lines

RECENT_BATCHES = 5
"""How many final batches the status shows (the newest), besides every active one."""


async def collect(redis_url: str, cluster: str) -> dict[str, Any]:
    redis = RedisSettings.from_url(redis_url).connect()
    queue = batch_queue(redis_url, cluster)
    try:
        await wait_for_redis(redis, timeout_s=5)
        return await read(redis, cluster, queue)
    finally:
        await redis.aclose()
        if queue is not None:
            queue.connection.close()


def batch_queue(redis_url: str, cluster: str) -> BatchQueue | None:
    """The rq queue of batch jobs, whose depth the status shows; None on a Redis Cluster, where rq
    (so the Batch API) does not run."""
    settings = RedisSettings.from_url(redis_url)
    if settings.mode == "cluster":
        return None
    return BatchQueue(settings.connect_sync(), Keys(cluster))


async def read(redis: Any, cluster: str, queue: BatchQueue | None = None) -> dict[str, Any]:
    """The status from one connected client (``collect`` without the connection); the batch queue's
    depth is None without ``queue``."""
    keys = Keys(cluster)
    instances = await InstanceRegistry(redis, keys).live()
    routers = await RouterRegistry(redis, keys).live()
    pipe = redis.pipeline(transaction=False)
    for i in instances:
        pipe.xlen(keys.inbox(i.id))
        pipe.pttl(keys.instance(i.id))
        pipe.xlen(keys.dead_letters(i.id))
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
                "weights": i.kv.weights or "f32",
                "weights_digest": i.kv.weights_digest,
                "tokenizer": i.tokenizer,
                "device": i.kv.device,
                "device_name": i.kv.device_name,
                "dtype": i.kv.dtype,
                "memory_bytes": i.kv.memory_bytes,
                "host": i.host,
                "pid": i.pid,
                "running": i.load.running,
                "waiting": i.load.waiting,
                "handing_off": i.load.handing_off,
                "waiting_prefill_tokens": i.load.waiting_prefill_tokens,
                "free_blocks": i.kv.free_blocks,
                "num_blocks": i.kv.num_blocks,
                "prefix_index_blocks": indexed.get(i.id, 0) if i.kv.prefix_caching else None,
                "draining": i.draining,
                "age_s": round(now - i.started_at, 1),
                "ttl_ms": replies[3 * n + 1],
                "inbox_len": replies[3 * n],
                "inbox_pending": pending[n],
                "inbox_dead": replies[3 * n + 2],
                "kv_checked": i.integrity.kv_checked if i.integrity else 0,
                "kv_mismatches": i.integrity.kv_mismatches if i.integrity else 0,
                "tier": i.tier.model_dump() if i.tier else None,
                "disk_tier": i.disk_tier.model_dump() if i.disk_tier else None,
                "pool": i.pool.model_dump() if i.pool else None,
                "role_history": role_history(i),
            }
        )
    base = 3 * len(instances)
    out_routers = [
        {
            "id": r.id,
            "host": r.host,
            "port": r.port,
            "pid": r.pid,
            "age_s": round(now - r.started_at, 1),
            "outbox_len": replies[base + n],
            "verify": r.verify.model_dump() if r.verify else None,
        }
        for n, r in enumerate(routers)
    ]
    return {
        "cluster": cluster,
        "instances": out_instances,
        "routers": out_routers,
        "plan": await last_plan(redis, keys),
        "batches": await read_batches(redis, keys, queue),
    }


async def read_batches(redis: Any, keys: Keys, queue: BatchQueue | None) -> dict[str, Any]:
    """Every active batch and the newest final ones, newest first, and what each owner (API key
    digest) holds: files, their bytes, batches in flight."""
    store = BatchStore(redis, keys)
    active_ids = set(await store.active())
    active: list[BatchObject] = []
    recent: list[BatchObject] = []
    for batch_id in sorted(active_ids):
        try:
            active.append(await store.get(batch_id))
        except NotFoundError:  # gone between the two reads
            continue
    usage = []
    for owner in await store.owners.owners():  # each owner's newest final batches, then the newest of all
        usage.append(await store.owners.usage(owner))
        found, after = 0, None
        while found < RECENT_BATCHES:
            page, more = await store.list_batches(after, 50, owner)
            finals = [b for b in page if b.final and b.id not in active_ids][: RECENT_BATCHES - found]
            recent += finals
            found += len(finals)
            if not more:
                break
            after = page[-1].id
    recent = sorted(recent, key=lambda b: b.created_at, reverse=True)[:RECENT_BATCHES]  # stable: index order
    active.sort(key=lambda b: b.created_at, reverse=True)
    depth = None if queue is None else await asyncio.to_thread(queue.depth)
    return {
        "queue_depth": depth,
        "active": [_batch(b) for b in active if not b.final],
        "recent": [_batch(b) for b in recent],
        "usage": [
            {"owner": owner_name(u.owner), "files": u.files, "bytes": u.bytes, "batches": u.batches}
            for u in usage
        ],
    }


def _batch(b: BatchObject) -> dict[str, Any]:
    counts = b.request_counts
    return {
        "id": b.id,
        "status": b.status,
        "endpoint": b.endpoint,
        "request_counts": {"completed": counts.completed, "failed": counts.failed, "total": counts.total},
        "created_at": b.created_at,
    }


def counts_line(status: dict[str, Any]) -> str:
    """``cluster c: N instance(s), M router(s)[, K batch worker(s)]``: a batch worker registers
    its in-process router with port 0 (it listens on none)."""
    batch_workers = sum(1 for r in status["routers"] if not r["port"])
    line = (
        f"cluster {status['cluster']}: {len(status['instances'])} instance(s), "
        f"{len(status['routers']) - batch_workers} router(s)"
    )
    return line + (f", {batch_workers} batch worker(s)" if batch_workers else "")


def address(router: dict[str, Any]) -> str:
    return f"{router['host']}:{router['port']}" if router["port"] else f"{router['host']} (batch worker)"


def render(status: dict[str, Any]) -> str:
    lines = [counts_line(status)]
    if status["instances"]:
        lines.append("")
        head = (
            "INSTANCE",
            "ROLE",
            "MODEL",
            "DEVICE",
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
                _model(i),
                device(i),
                i["host"],
                str(i["running"]),
                _waiting(i),
                f"{i['free_blocks']}/{i['num_blocks']}",
                "off" if i["prefix_index_blocks"] is None else f"{i['prefix_index_blocks']} blocks",
                inbox(i),
                _age(i["age_s"]),
                "draining" if i["draining"] else "ready",
            )
            for i in status["instances"]
        ]
        lines += _table(head, rows)
    if status["routers"]:
        lines.append("")
        router_rows = [
            (r["id"], address(r), str(r["outbox_len"]), _age(r["age_s"])) for r in status["routers"]
        ]
        lines += _table(("ROUTER", "ADDRESS", "OUTBOX", "AGE"), router_rows)
    lines += integrity_lines(status)
    lines += tier_lines(status)
    lines += role_lines(status)
    lines += _batch_lines(status.get("batches"))
    return "\n".join(lines)


def tier_lines(status: dict[str, Any]) -> list[str]:
    """Each instance with a tier below its pool (``--kv-host-bytes``, ``--kv-disk-path``): a blank
    line, then per tier (its pool, host tier, disk tier) a line with its size, hit rate and
    evictions (a tier's hit rate: the blocks it served of those the tiers above it lacked)."""
    lines = []
    for i in status["instances"]:
        host, disk, pool = i.get("tier"), i.get("disk_tier"), i.get("pool")
        if not host and not disk:
            continue
        if pool:
            lines.append(
                f"pool {i['id']}: {i['num_blocks']} blocks, {i.get('prefix_index_blocks') or 0} cached; "
                f"{_rate(pool['hits'], pool['lookups'])} ({pool['hits']}/{pool['lookups']} blocks), "
                f"evicted {pool['evictions']}"
            )
        if host:
            lines.append(
                f"host tier {i['id']}: {_mib(host)}, {host['blocks']} blocks; read back {host['hits']}, "
                f"missed {host['misses']} ({_rate(host['hits'], host['hits'] + host['misses'])}), "
                f"stored {host['stores']}, evicted {host['evictions']}, corrupt {host['corrupt']}"
            )
        if disk:
            lines.append(
                f"disk tier {i['id']} ({disk['id'][:8]}): {_mib(disk)}, {disk['blocks']} blocks; read back "
                f"{disk['hits']}, missed {disk['misses']} ({_rate(disk['hits'], disk['hits'] + disk['misses'])}), "
                f"stored {disk['stores']}, evicted {disk['evictions']}, corrupt {disk['corrupt']}, "
                f"dropped {disk['dropped']}"
            )
    return ["", *lines] if lines else []


def _mib(tier: dict[str, Any]) -> str:
    return f"{tier['used_bytes'] / 2**20:.0f}/{tier['capacity_bytes'] / 2**20:.0f} MiB"


def _rate(hits: int, total: int) -> str:
    """A hit rate as a percentage ("-" before any lookup)."""
    return f"{100 * hits / total:.0f}% hit" if total else "- hit"


def integrity_lines(status: dict[str, Any]) -> list[str]:
    """What the decode instances' KV checks and the routers' shadow verification found, when they
    ran: a blank line and one line each (nothing when neither checked anything)."""
    lines = []
    checked = sum(i.get("kv_checked", 0) for i in status["instances"])
    if checked:
        bad = {i["id"]: i["kv_mismatches"] for i in status["instances"] if i.get("kv_mismatches")}
        where = f" ({', '.join(f'{k}: {v}' for k, v in bad.items())})" if bad else ""
        lines.append(f"KV hand-offs checked: {checked}; KV checksum mismatches: {sum(bad.values())}{where}")
    verified = [r for r in status["routers"] if r.get("verify")]
    if verified:
        replayed = sum(r["verify"]["checked"] for r in verified)
        mismatches = sum(r["verify"]["mismatches"] for r in verified)
        lines.append(f"shadow verification: {replayed} replayed, {mismatches} mismatch(es)")
        lines += [
            f"  {r['id']}: last mismatch: {r['verify']['last_mismatch']}"
            for r in verified
            if r["verify"].get("last_mismatch")
        ]
    return ["", *lines] if lines else []


BATCH_COLUMNS = ("BATCH", "STATUS", "ENDPOINT", "COMPLETED/FAILED/TOTAL", "CREATED")


def _batch_lines(batches: dict[str, Any] | None) -> list[str]:
    """The batches' section of the text status: nothing when there are none and no queued job."""
    if not batches or not (
        batches["active"] or batches["recent"] or batches["queue_depth"] or batches.get("usage")
    ):
        return []
    rows = [_batch_row(b) for b in (*batches["active"], *batches["recent"])]
    return ["", _batch_head(batches), *(_table(BATCH_COLUMNS, rows) if rows else []), *_usage_lines(batches)]


def _usage_lines(batches: dict[str, Any]) -> list[str]:
    """What each owner (API key digest) holds, against the quotas: files, bytes, batches in flight."""
    rows = [
        (u["owner"], str(u["files"]), f"{u['bytes'] / (1 << 20):.1f} MiB", str(u["batches"]))
        for u in batches.get("usage", [])
    ]
    return ["", *_table(("KEY DIGEST", "FILES", "BYTES", "BATCHES IN FLIGHT"), rows)] if rows else []


def _batch_head(batches: dict[str, Any]) -> str:
    depth = batches["queue_depth"]
    return (
        f"batches: {len(batches['active'])} active, {len(batches['recent'])} recently final; "
        f"queue: {'n/a' if depth is None else f'{depth} job(s) waiting'}"
    )


def _batch_row(b: dict[str, Any]) -> tuple[str, ...]:
    c = b["request_counts"]
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b["created_at"]))
    return (b["id"], b["status"], b["endpoint"], f"{c['completed']}/{c['failed']}/{c['total']}", created)


def _table(head: tuple[str, ...], rows: Sequence[tuple[object, ...]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *rows)]


def _waiting(instance: dict[str, Any]) -> str:
    """Requests waiting, and a prefill instance's KV hand-offs in flight after them (``+2 kv``)."""
    handing_off = instance["handing_off"]
    return f"{instance['waiting']} +{handing_off} kv" if handing_off else str(instance["waiting"])


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
WIDEST = 150  # ... and from this many on, each instance's DEVICE too


def _model(instance: dict[str, Any]) -> str:
    """The served model, its identity (:func:`model_id`) and its weights' precision where it is not
    the default float32: ``tiny 3f9c2a1b``, ``tiny (int8) 3f9c2a1b``."""
    weights = instance.get("weights", "f32")
    name = instance["model"] if weights == "f32" else f"{instance['model']} ({weights})"
    ident = model_id(instance)
    return f"{name} {ident}" if ident else name


def model_id(instance: dict[str, Any]) -> str:
    """8 hex of a digest of the weights' and the tokenizer's digests: two instances of one served
    name with different ids are two models, which the router never pairs ("" for a worker that
    does not say: an older one)."""
    weights = instance.get("weights_digest")
    if not weights:
        return ""
    both = f"{weights}/{instance.get('tokenizer') or ''}".encode()
    return hashlib.blake2b(both, digest_size=4).hexdigest()


def inbox(instance: dict[str, Any]) -> str:
    """Its inbox's length, the entries delivered and not yet acked, and its dead letters."""
    dead = instance.get("inbox_dead") or 0
    return f"{instance['inbox_len']} ({instance['inbox_pending']} pending, {dead} dead)"


DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def device(instance: dict[str, Any]) -> str:
    """Where the KV cache lives, its element type and the device memory the instance holds, in one
    short cell: ``cuda bf16 71.3G``, ``cpu f32`` (an older worker says no device: cpu)."""
    dtype = instance.get("dtype") or "?"
    cell = f"{instance.get('device') or 'cpu'} {DTYPES.get(dtype, dtype)}"
    memory = instance.get("memory_bytes")
    return f"{cell} {memory / 2**30:.1f}G" if memory else cell


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
