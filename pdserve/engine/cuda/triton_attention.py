"""Paged attention for the torch platform, over the block-major KV cache in place.

``cache`` is [num_blocks, 2, num_layers, block_size, num_kv_heads, head_dim]: K of (block b, layer
l, slot s, kv head h) is ``cache[b, 0, l, s, h]``, V is ``cache[b, 1, l, s, h]``; position p of a
sequence sits in block ``table[p // block_size]``, slot ``p % block_size``; query head i reads kv
head ``i // (num_heads // num_kv_heads)`` (GQA).

Two implementations with one signature each. The Triton kernels (``triton_paged_kernels``; CUDA,
or Triton's interpreter on CPU tensors) walk the block tables and read only a sequence's own rows:
decode is flash-decoding (one program per sequence and kv head, the query heads of its group
padded to 16 rows of one ``tl.dot``; the context optionally split over more programs and merged
by a second kernel when the batch alone cannot fill the GPU), prefill is flash-attention over one
sequence's chunk. Both accumulate in float32 with an online softmax. The decode launch reads
nothing from the device (no ``.item()``, grid and split from shapes only) so it can be captured
in a CUDA graph; lengths bound the loops inside the kernel. Nothing that varies while serving
(batch, table width, split count, chunk length, layer) is a compile-time constant, so the
variants are few and ``warm_up_paged_attention`` compiles them all at start. The torch versions
gather the blocks and compute densely in float32: slow, any device, and the reference the kernels
are tested against.

``select_paged_attention`` picks one the way ``kernel_choice`` picks every fast path. torch is imported
inside the functions and the kernel module on first use, so importing this one is cheap (settings
may read ``PAGED_ATTENTION_MODES`` on a host without torch or Triton).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.engine.kernel_choice import check_mode, load_or_fall_back

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PAGED_ATTENTION_MODES: tuple[str, ...] = ("auto", "triton", "torch")

# Launch shapes, chosen so that no variant spills registers on sm_90 (ptxas, Triton 3.6; not yet
# timed on a GPU). Decode (tokens per loop iteration, warps): a tile may span several blocks or part
# of one, so block_size is free; 32 bf16 tokens of a 128-wide head are 8 KiB each of K and V.
# float32 (the exactness mode: FMA dots, twice the bytes) takes half the tile. Prefill (query tile,
# key tile, warps): 64 x 32 at 8 warps is ~130 registers at D=64 and ~230 at D=128.
_DECODE = {False: (32, 4, 8), True: (16, 4, 8)}  # float32 -> (tile, warps at D <= 64, at D = 128)
_PREFILL = {False: (64, 32, 8), True: (32, 16, 8)}  # float32 -> (BLOCK_M, BLOCK_N, warps)
_STAGES = 2
_MIN_QUERY_TILE = 16  # a prefill chunk of n rows takes the tile next_pow2(n) within [16, BLOCK_M]
# Split-K: only when batch x kv heads leaves SMs idle, each split at least this many tokens so the
# merge stays cheap next to the work, and at most this many splits. The split count is a runtime
# argument (the kernels specialise only on split or not), so no table width compiles a new kernel.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# torch reference


def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax over the last axis of the entries ``mask`` allows; a row with none gives zeros, not NaN."""
    import torch

    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    e = torch.exp(scores - torch.where(torch.isfinite(top), top, 0.0))
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, 1.0)


def torch_paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode token per sequence: q [B, H, D] attends to positions 0..lengths[b]-1 of the
    blocks in ``tables[b]``; returns [B, H, D] in q's dtype (float32 inside)."""
    import torch

    batch, heads, dim = q.shape
    _, _, _, block_size, kv_heads, _ = cache.shape
    group = heads // kv_heads
    kv = cache[:, :, layer][tables.long()]  # [B, max_blocks, 2, block_size, kvh, D]
    ctx = tables.shape[1] * block_size
    k = kv[:, :, 0].reshape(batch, ctx, kv_heads, dim)
    v = kv[:, :, 1].reshape(batch, ctx, kv_heads, dim)
    valid = torch.arange(ctx, device=q.device)[None, :] < lengths.to(q.device).long()[:, None]  # [B, T]
    # slots past a length may hold anything (even NaN): zero them, or 0 * NaN would reach the output
    k = torch.where(valid[:, :, None, None], k.float(), 0.0)
    v = torch.where(valid[:, :, None, None], v.float(), 0.0)
    scores = torch.einsum("bkgd,btkd->bkgt", q.reshape(batch, kv_heads, group, dim).float(), k) * scale
    probs = _softmax(scores, valid[:, None, None, :])
    return torch.einsum("bkgt,btkd->bkgd", probs, v).reshape(batch, heads, dim).to(q.dtype)


def torch_paged_prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    table: torch.Tensor,
    start: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's prefill chunk: q [n, H, D] at positions start..start+n-1, each attending
    causally to positions 0..its own (the chunk's K/V already in the cache); returns [n, H, D]."""
    import torch

    n, heads, dim = q.shape
    kv_heads = cache.shape[4]
    group = heads // kv_heads
    total = start + n
    kv = cache[:, :, layer][table.long()]  # [nblk, 2, block_size, kvh, D]
    k = kv[:, 0].reshape(-1, kv_heads, dim)[:total].float()  # every one of them written: no garbage
    v = kv[:, 1].reshape(-1, kv_heads, dim)[:total].float()
    causal = (
        torch.arange(total, device=q.device)[None, :] <= torch.arange(start, total, device=q.device)[:, None]
    )
    scores = torch.einsum("nkgd,tkd->nkgt", q.reshape(n, kv_heads, group, dim).float(), k) * scale
    probs = _softmax(scores, causal[:, None, None, :])
    return torch.einsum("nkgt,tkd->nkgd", probs, v).reshape(n, heads, dim).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Triton


def triton_unavailable(device: Any) -> str | None:
    """Why the Triton kernels cannot run on tensors on ``device`` (a torch.device or its name),
    or None when they can: Triton must import, and the device must be CUDA (compute capability
    8.0+, for the bf16 tensor-core dot) unless TRITON_INTERPRET=1 runs them in the interpreter."""
    import torch

    dev = torch.device(device)
    try:
        import triton  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install failing its own imports
        return f"triton is not importable ({type(e).__name__}: {e})"
    kernels = sys.modules.get("pdserve.engine.cuda.triton_paged_kernels")
    if kernels is not None and _interpreting() != kernels.INTERPRETED:
        was = "interpreted" if kernels.INTERPRETED else "compiled"
        return (
            f"this process defined the kernels {was} before TRITON_INTERPRET changed (Triton reads it once)"
        )
    if _interpreting():
        return None
    if dev.type != "cuda":
        return f"device {dev} is not CUDA and TRITON_INTERPRET is not 1 (Triton's interpreter is off)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        return f"{torch.cuda.get_device_name(dev)} has compute capability {major}.{minor} (8.0+ needed for bf16 tl.dot)"
    return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels() -> Any:
    """The kernel module, imported on first use (so importing this one imports no Triton)."""
    from pdserve.engine.cuda import triton_paged_kernels

    return triton_paged_kernels


def _check_shapes(q: torch.Tensor, cache: torch.Tensor) -> tuple[int, int, int]:
    """(group, block_size, head_dim) once the kernels' shape requirements hold."""
    if cache.dim() != 6 or cache.shape[1] != 2:
        raise ValueError(
            f"cache must be [num_blocks, 2, layers, block_size, kv_heads, D], got {tuple(cache.shape)}"
        )
    _, _, _, block_size, kv_heads, dim = cache.shape
    heads = q.shape[1]
    if q.shape[-1] != dim:
        raise ValueError(f"q's head_dim {q.shape[-1]} is not the cache's {dim}")
    if not _is_pow2(dim) or dim < 16:
        raise ValueError(f"the Triton kernels need a power-of-2 head_dim >= 16, got {dim}")
    if not _is_pow2(block_size):
        raise ValueError(f"the Triton kernels need a power-of-2 block_size, got {block_size}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    return heads // kv_heads, block_size, dim


def _interpreted_bf16(cache: torch.Tensor) -> bool:
    # the interpreter computes bf16 dots on the raw bits: the kernels then dot float32 copies
    import torch

    return bool(_kernels().INTERPRETED) and cache.dtype == torch.bfloat16


@functools.lru_cache(maxsize=16)
def _sm_count(index: int | None) -> int:
    import torch

    return int(torch.cuda.get_device_properties(index if index is not None else 0).multi_processor_count)


def _device_sms(device: torch.device) -> int:
    """SMs a decode launch may fill; 0 off CUDA (the interpreter: no split unless asked)."""
    return _sm_count(device.index) if device.type == "cuda" else 0


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """One decode call's launch: ``splits`` programs per sequence and kv head, each over
    ``split_tokens`` tokens (a multiple of the tile; no split wholly past the table's capacity).
    ``split`` is all the kernels specialise on, so every launch is one of two compiled variants."""

    splits: int
    split_tokens: int

    @property
    def split(self) -> bool:
        return self.splits > 1


def decode_launch(
    batch: int, kv_heads: int, max_ctx: int, tile: int, sms: int, num_splits: int | None = None
) -> DecodeLaunch:
    """The launch for a batch and table capacity (``max_ctx`` = width x block size): from shapes and
    the SM count only, so a CUDA graph captured for (batch, width) replays it for any lengths.
    Split only when batch x kv heads leaves SMs idle (``num_splits`` forces a count, for tests)."""
    if num_splits is None:
        programs = batch * kv_heads
        num_splits = 1
        if programs < sms:
            num_splits = max(1, min(_cdiv(2 * sms, programs), max_ctx // _MIN_SPLIT_TOKENS))
    splits = max(1, min(num_splits, _MAX_SPLITS))
    split_tokens = _cdiv(_cdiv(max_ctx, splits), tile) * tile
    return DecodeLaunch(max(1, _cdiv(max_ctx, split_tokens)), split_tokens)


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The Triton decode kernel; same contract as ``torch_paged_decode_attention``. tables int32
    [B, max_blocks] (rows padded with block 0), lengths int32 [B] (>= 1 and <= max_blocks *
    block_size; the current token's K/V already written). CUDA-graph safe."""
    return _triton_decode(q, cache, layer, tables, lengths, scale, num_splits=None)


def _triton_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    num_splits: int | None,
) -> torch.Tensor:
    import torch

    group, block_size, dim = _check_shapes(q, cache)
    batch, heads, _ = q.shape
    kv_heads = cache.shape[4]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    fp32 = cache.dtype == torch.float32
    tile, warps_64, warps_128 = _DECODE[fp32]
    launch = decode_launch(
        batch, kv_heads, tables.shape[1] * block_size, tile, _device_sms(q.device), num_splits
    )
    splits = launch.splits
    if launch.split:
        m = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
        l_s = torch.empty_like(m)
        acc = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=q.device)
    else:
        m = l_s = acc = out  # unused by the unsplit variant
    k = _kernels()
    k.decode[(batch, kv_heads, splits)](
        q,
        cache,
        tables,
        lengths,
        out,
        m,
        l_s,
        acc,
        layer,
        scale * _LOG2E,
        launch.split_tokens,
        splits,
        *q.stride(),
        *cache.stride(),
        tables.stride(0),
        *out.stride(),
        GROUP=group,
        GROUP_PAD=max(16, _next_pow2(group)),
        D=dim,
        BLOCK_SIZE=block_size,
        TILE=tile,
        SPLIT=launch.split,
        DOT_PREC="ieee" if fp32 else "tf32",
        DOT_F32=_interpreted_bf16(cache),
        num_warps=warps_64 if dim <= 64 else warps_128,
        num_stages=_STAGES,
    )
    if launch.split:
        k.merge_splits[(batch, heads)](
            m,
            l_s,
            acc,
            out,
            splits,
            *out.stride(),
            SPLITS_PAD=_MAX_SPLITS,
            D=dim,
            num_warps=4,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    table: torch.Tensor,
    start: int,
    scale: float,
) -> torch.Tensor:
    """The Triton prefill kernel; same contract as ``torch_paged_prefill_attention``. table int32
    [nblk] covering positions 0..start+n-1."""
    import torch

    group, block_size, dim = _check_shapes(q, cache)
    n, heads, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    fp32 = cache.dtype == torch.float32
    block_m, block_n, warps = _PREFILL[fp32]
    block_m = min(block_m, max(_MIN_QUERY_TILE, _next_pow2(n)))  # a short chunk: a short query tile
    _kernels().prefill[(_cdiv(n, block_m), heads)](
        q,
        cache,
        table,
        out,
        layer,
        start,
        n,
        scale * _LOG2E,
        *q.stride(),
        *cache.stride(),
        *out.stride(),
        GROUP=group,
        D=dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PREC="ieee" if fp32 else "tf32",  # float32: full-precision dots, never TF32's 10 bits
        DOT_F32=_interpreted_bf16(cache),
        num_warps=warps,
        num_stages=_STAGES,
    )
    return out


def prefill_query_tiles(fp32: bool) -> list[int]:
    """Every query tile (BLOCK_M) the prefill kernel compiles: 16 up to the dtype's largest."""
    return [1 << i for i in range(_MIN_QUERY_TILE.bit_length() - 1, _PREFILL[fp32][0].bit_length())]


def warm_up_paged_attention(q: torch.Tensor, cache: torch.Tensor, scale: float) -> int:
    """Launch each kernel variant a serving step can launch once, so that Triton compiles them all
    now (~1 s each) and none on the engine thread while serving: decode unsplit and split (with the
    merge), prefill at every query tile. ``q`` [rows, H, D] is laid out as the model's (a view of
    its qkv rows), at least the largest tile's rows; only the null block is read. Returns the
    number of calls."""
    import torch

    fp32 = cache.dtype == torch.float32
    block_size, dev = cache.shape[3], q.device
    width = _cdiv(2 * _DECODE[fp32][0], block_size)  # room for two splits of one tile
    tables = torch.zeros((1, width), dtype=torch.int32, device=dev)
    lengths = torch.ones(1, dtype=torch.int32, device=dev)
    calls = 0
    for splits in (1, 2):
        _triton_decode(q[:1], cache, 0, tables, lengths, scale, num_splits=splits)
        calls += 1
    for rows in prefill_query_tiles(fp32):
        table = torch.zeros(_cdiv(rows, block_size), dtype=torch.int32, device=dev)
        paged_prefill_attention(q[:rows], cache, 0, table, 0, scale)
        calls += 1
    return calls


# ----------------------------------------------------------------------------------------------
# choice


@dataclasses.dataclass(frozen=True)
class PagedAttentionImpl:
    """Which paged attention the torch model runs, and why (one log line)."""

    impl: str  # "triton" | "torch"
    reason: str
    decode: Callable[..., torch.Tensor] = dataclasses.field(repr=False)
    prefill: Callable[..., torch.Tensor] = dataclasses.field(repr=False)


def select_paged_attention(device: Any, mode: str) -> PagedAttentionImpl:
    """``auto``: the Triton kernels where they can run on ``device``, else the torch versions (one
    warning); ``triton``: the kernels or a ConfigError saying why not; ``torch``: the torch versions."""
    check_mode("paged_attention", mode, PAGED_ATTENTION_MODES)
    if mode == "torch":
        return PagedAttentionImpl(
            "torch",
            "torch paged attention forced",
            torch_paged_decode_attention,
            torch_paged_prefill_attention,
        )

    def load() -> str:
        why = triton_unavailable(device)
        if why is not None:
            raise RuntimeError(why)
        _kernels()
        return "interpreter" if _interpreting() else "compiled"

    how, why = load_or_fall_back(
        "paged_attention",
        mode,
        load,
        (RuntimeError, ImportError),
        "the Triton paged-attention kernels cannot run",
        "torch paged attention (gather and dense float32)",
    )
    if how is None:
        return PagedAttentionImpl("torch", why, torch_paged_decode_attention, torch_paged_prefill_attention)
    return PagedAttentionImpl(
        "triton",
        f"Triton paged-attention kernels ({how}) on {device}",
        paged_decode_attention,
        paged_prefill_attention,
    )
