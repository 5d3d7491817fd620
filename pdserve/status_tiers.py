"""``pdserve status``, the tier lines: each instance's host and disk tier (size, hits, evictions), its
peer fetches and its KV integrity checks, as lines under the table and the ``--watch`` view."""

from __future__ import annotations

from typing import Any


def tier_lines(status: dict[str, Any]) -> list[str]:
    """Each instance with a tier below its pool (``--kv-host-bytes``, ``--kv-disk-path``): a blank
    line, then per tier (its pool, host tier, disk tier) a line with its size, hit rate and
    evictions (a tier's hit rate: the blocks it served of those the tiers above it lacked); and
    each instance that fetched from peers or served them: a line of its peer fetches (their hit
    rate: the blocks fetched of those asked for)."""
    lines = []
    for i in status["instances"]:
        host, disk, pool, fetch = i.get("tier"), i.get("disk_tier"), i.get("pool"), i.get("fetch")
        if fetch:
            lines.append(
                f"peer fetch {i['id']}: fetched {fetch['hits']} blocks, missed {fetch['misses']} "
                f"({_rate(fetch['hits'], fetch['hits'] + fetch['misses'])}); {fetch['failed']} of "
                f"{fetch['fetches']} fetches fell back ({fetch['mismatches']} mismatched); served "
                f"{fetch['served']} blocks to peers"
            )
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
