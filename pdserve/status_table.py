"""``pdserve status``, the plain table: the status dict (status_read.py) as text, one row per
instance and router, with the cells the ``--watch`` view shares (model, inbox, device, ages, batches)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

from pdserve.status_roles import role_lines
from pdserve.status_tiers import integrity_lines, tier_lines


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
