"""Byte regions of KV blocks, in logical (block-table) order on both sides of a transfer.

Region lists are NEVER sorted by offset: with different block ids on P and D, sorting silently
pairs the wrong blocks (measured: wrong tokens, logits off by up to 6.0). Only ranges adjacent in
logical order are merged.
"""

from __future__ import annotations

from collections.abc import Iterable

Region = tuple[int, int]  # (byte offset, length)
Segment = tuple[int, int, int]  # (src offset, dst offset, length)


def block_regions(block_ids: Iterable[int], block_bytes: int) -> list[Region]:
    """Regions of a block-major cache holding ``block_ids`` in the given order."""
    out: list[Region] = []
    for b in block_ids:
        off = int(b) * block_bytes
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + block_bytes)
        else:
            out.append((off, block_bytes))
    return out


def pair_regions(src: list[Region], dst: list[Region]) -> list[Segment]:
    """Align two region lists describing the same logical byte stream into copy segments."""
    out: list[Segment] = []
    i = j = si = dj = 0
    while i < len(src) and j < len(dst):
        n = min(src[i][1] - si, dst[j][1] - dj)
        so, do = src[i][0] + si, dst[j][0] + dj
        if out and out[-1][0] + out[-1][2] == so and out[-1][1] + out[-1][2] == do:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((so, do, n))
        si += n
        dj += n
        if si == src[i][1]:
            i, si = i + 1, 0
        if dj == dst[j][1]:
            j, dj = j + 1, 0
    if i != len(src) or j != len(dst):
        raise ValueError(
            f"region lists differ in total size: {sum(r[1] for r in src)} vs {sum(r[1] for r in dst)} bytes"
        )
    return out
