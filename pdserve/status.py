"""``pdserve status``: the command (one table, ``--json``, or ``--check ID``); what it shows is read
by status_read.py and drawn by status_table.py (``--watch``: status_watch.py)."""

from __future__ import annotations

import asyncio
import sys

import orjson

from pdserve.scheduler import InstanceInfo
from pdserve.status_read import collect, registration
from pdserve.status_table import render


def run_status(redis_url: str, cluster: str, as_json: bool, check: str | None = None) -> int:
    if check is not None:
        return check_instance(asyncio.run(registration(redis_url, cluster, check)), check, cluster)
    status = asyncio.run(collect(redis_url, cluster))
    print(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode() if as_json else render(status))
    return 0


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
