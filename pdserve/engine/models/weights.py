"""Load Hugging Face safetensors checkpoints into the fused float32 layout the model runs on.

Linear weights arrive as ``[out, in]`` (torch) and are stored ``[in, out]`` contiguous so that
every matmul reads a dense operand (matmul on a transposed view is ~100x slower in Paddle on CPU).
q/k/v are fused into one ``qkv`` weight and gate/up into one ``gate_up`` weight at load time.
Interleaved-RoPE checkpoints (ERNIE-4.5) get their q/k rows permuted per head so that one
rotate-half RoPE serves every architecture; q·k is unchanged by the shared permutation.

Memory: each weight exists once. Every checkpoint tensor is mapped from its file on its own and
copied (transposed, fused) straight into its final buffer, one page-backed mapping per weight
(:func:`page_empty`), with no intermediate copy; the tensor's mapping is dropped once used.
:func:`iter_weights` hands the weights over one at a time, so a consumer that repacks them (the
model's packed GEMM) frees each plain one before the next is built. A float32 embedding is not
copied at all: the embedding table stays a (copy-on-write) mapping of the checkpoint file, so only
the rows looked up become resident, out of the page cache every worker on the host shares. A mapped
file must not be rewritten in place while an engine runs on it (pdserve's own writers never do:
they replace a model folder by a rename, which leaves the mapped file intact).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import mmap
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson

from pdserve.engine.memory import page_empty
from pdserve.engine.models.model_config import ModelConfig
from pdserve.errors import ConfigError

log = logging.getLogger(__name__)

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


class _FileMap(mmap.mmap):
    """A private mapping of part of a checkpoint file (see :func:`release_pages`)."""


def release_pages(array: np.ndarray) -> None:
    """When ``array`` views a checkpoint tensor's file mapping, drop that mapping's pages from this
    process's resident set (e.g. after reading all of it once): the data stays in the page cache and
    a later read maps a page back in. Any other array (anonymous memory would lose its data): nothing."""
    base: object = array
    while isinstance(base, np.ndarray | memoryview):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    if isinstance(base, _FileMap) and hasattr(mmap, "MADV_DONTNEED"):
        base.madvise(mmap.MADV_DONTNEED)  # private and never written: the file's data is kept


class SafetensorsFile:
    """One safetensors file: its header read at once, each tensor mapped only when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            try:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = orjson.loads(f.read(header_len))
            except (struct.error, orjson.JSONDecodeError) as e:
                raise ConfigError(f"{path} is not a valid safetensors file: {e}") from None
            size = os.fstat(f.fileno()).st_size
        if not isinstance(header, dict):
            raise ConfigError(f"{path} is not a valid safetensors file: its header is not an object")
        self.data_start = 8 + header_len
        self.tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}  # name: (dtype, shape, offset)
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(meta["dtype"])
            if dtype is None:
                raise ConfigError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
            start, end = meta["data_offsets"]
            shape = tuple(int(n) for n in meta["shape"])
            if end - start != math.prod(shape) * np.dtype(dtype).itemsize or start < 0:
                raise ConfigError(f"{path}: tensor {name} has data_offsets {start}..{end} for shape {shape}")
            if self.data_start + end > size:
                raise ConfigError(f"{path}: tensor {name} ends past the end of the file (truncated?)")
            self.tensors[name] = (meta["dtype"], shape, self.data_start + start)

    def _map(self, name: str) -> np.ndarray:
        """The tensor's bytes as an array over a private mapping of just its own pages."""
        kind, shape, offset = self.tensors[name]
        dtype = np.dtype(_DTYPES[kind])
        count = math.prod(shape)
        if count == 0:
            return np.empty(shape, dtype)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = offset - start + count * dtype.itemsize
        with self.path.open("rb") as f:
            buf = _FileMap(f.fileno(), length, offset=start, access=mmap.ACCESS_COPY)
        return np.frombuffer(buf, dtype, count, offset - start).reshape(shape)

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32: a mapping of the file when it is stored as F32 (nothing copied),
        else widened into a page-backed array (bf16 bit-exactly, which numpy can't do)."""
        raw = self._map(name)
        if raw.dtype == np.float32:
            return raw
        out = page_empty(raw.shape)
        if self.tensors[name][0] == "BF16":
            bits = out.view(np.uint32)
            bits[...] = raw
            bits <<= 16
        else:
            out[...] = raw  # F16, F64: the same rounding as astype(np.float32)
        return out


class SeededTensors:
    """The weights of a folder written by ``init_model(..., seeded=True)``, generated as read; the
    same interface as :class:`SafetensorsFile` (``tensors``, ``read``)."""

    def __init__(self, model_dir: Path) -> None:
        from pdserve.engine.models.model_init import SEEDED_WEIGHTS, weight_shapes

        try:
            self.seed = int(orjson.loads((model_dir / SEEDED_WEIGHTS).read_bytes())["seed"])
            config = orjson.loads((model_dir / "config.json").read_bytes())
            specs = weight_shapes(config)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{model_dir / SEEDED_WEIGHTS} or its config.json is malformed: {e}") from None
        self.tensors: dict[str, tuple[str, tuple[int, ...], int]] = {
            name: ("F32", shape, i) for i, (name, shape, _) in enumerate(specs)
        }
        self._kind = {name: kind for name, _, kind in specs}

    def read(self, name: str) -> np.ndarray:
        from pdserve.engine.models.model_init import seeded_tensor

        _, shape, index = self.tensors[name]
        return seeded_tensor(self.seed, index, shape, self._kind[name])


def checkpoint_sources(model_dir: Path) -> dict[str, SafetensorsFile | SeededTensors]:
    """Tensor name → where it is read from: its safetensors file, or a seeded folder's generator."""
    from pdserve.engine.models.model_init import SEEDED_WEIGHTS

    if (model_dir / SEEDED_WEIGHTS).is_file():
        seeded = SeededTensors(model_dir)
        return dict.fromkeys(seeded.tensors, seeded)
    files: dict[str, SafetensorsFile | SeededTensors] = {}
    for path in checkpoint_files(model_dir):
        st = SafetensorsFile(path)
        files.update(dict.fromkeys(st.tensors, st))
    return files


def hf_tensors(model_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every checkpoint tensor under its Hugging Face name, float32 in torch's ``[out, in]`` layout
    (to load the very same weights into another implementation, e.g. an eager reference)."""
    for name, source in checkpoint_sources(Path(model_dir)).items():
        yield name, source.read(name)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = orjson.loads(index.read_bytes())["weight_map"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{index} is malformed: expected a 'weight_map' object") from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ConfigError(
                f"{model_dir}: shard(s) listed in {index.name} are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model folder {model_dir} has no *.safetensors weights")
    return files


def _copy_rows_t(dst: np.ndarray, src: np.ndarray, heads: int | None, head_dim: int) -> None:
    """``dst[:, j] = src[j]`` (``src`` [out, in], ``dst`` [in, out]); with ``heads``, ``src``'s rows
    are taken in rotate-half order per head (interleaved-RoPE checkpoints): each head's even rows,
    then its odd rows. Strided views only, no temporary."""
    if heads is None:
        dst[...] = src.T
        return
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        even, odd = dst[:, rows][:, : head_dim // 2], dst[:, rows][:, head_dim // 2 :]
        even[...], odd[...] = src[rows][0::2].T, src[rows][1::2].T


def _copy_bias(dst: np.ndarray, src: np.ndarray, heads: int | None, head_dim: int) -> None:
    """``dst[:] = src`` along the first axis (a bias, or a weight's rows), in rotate-half order per
    head as :func:`_copy_rows_t` with ``heads``."""
    if heads is None:
        dst[...] = src
        return
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        dst[rows][: head_dim // 2], dst[rows][head_dim // 2 :] = src[rows][0::2], src[rows][1::2]


def iter_weights(
    model_dir: str | Path, cfg: ModelConfig, transposed: bool = True
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield the fused float32 weights one at a time (see :func:`load_weights` for the names),
    ``embed`` first. Checks every tensor's presence and shape before yielding any. ``transposed``
    False: the linear weights (``lm_head`` too) stay in the checkpoint's ``[out, in]`` layout, fused
    by rows (row copies, no transposing: the torch platform multiplies either layout as fast)."""
    model_dir = Path(model_dir)
    files = checkpoint_sources(model_dir)

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    D = cfg.head_dim
    heads = (cfg.num_heads, cfg.num_kv_heads) if cfg.rope_interleaved else (None, None)
    expected: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if cfg.qkv_bias:
            expected |= {p + f"self_attn.{x}_proj.bias": (n,) for x, n in (("q", q), ("k", kv), ("v", kv))}
        if p + "self_attn.o_proj.bias" in files:
            expected[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            expected |= {p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,)}
            expected[p + "mlp.down_proj.bias"] = (h,)
    expected["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        expected["lm_head.weight"] = (cfg.vocab_size, h)
    for name, shape in expected.items():
        if name not in files:
            raise ConfigError(f"{model_dir}: weight {name!r} is missing from the checkpoint")
        found = files[name].tensors[name][1]
        if found != shape:
            raise ConfigError(f"{model_dir}: weight {name!r} has shape {found}, expected {shape}")

    def take(name: str) -> np.ndarray:
        return files[name].read(name)

    def copy(name: str) -> np.ndarray:
        src = take(name)
        out = page_empty(src.shape)
        out[...] = src
        return out

    def fused_t(names: list[str], row_heads: list[int | None]) -> np.ndarray:
        """The row-wise concatenation of ``names`` transposed, [in, sum(out)], into one buffer (not
        transposed: [sum(out), in])."""
        parts = [take(n) for n in names]
        rows = sum(p.shape[0] for p in parts)
        out = page_empty((parts[0].shape[1], rows) if transposed else (rows, parts[0].shape[1]))
        at = 0
        for part, nh in zip(parts, row_heads):
            if transposed:
                _copy_rows_t(out[:, at : at + part.shape[0]], part, nh, D)
            else:
                _copy_bias(out[at : at + part.shape[0]], part, nh, D)
            at += part.shape[0]
        return out

    def fused_bias(names: list[str], row_heads: list[int | None]) -> np.ndarray:
        parts = [take(n) for n in names]
        out = page_empty(sum(p.shape[0] for p in parts))
        at = 0
        for part, nh in zip(parts, row_heads):
            _copy_bias(out[at : at + part.shape[0]], part, nh, D)
            at += part.shape[0]
        return out

    yield "embed", take("model.embed_tokens.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv_heads = [heads[0], heads[1], None]
        yield f"l{i}.in_norm", copy(p + "input_layernorm.weight")
        yield f"l{i}.qkv", fused_t([p + f"self_attn.{x}_proj.weight" for x in "qkv"], qkv_heads)
        if cfg.qkv_bias:
            yield f"l{i}.qkv_bias", fused_bias([p + f"self_attn.{x}_proj.bias" for x in "qkv"], qkv_heads)
        yield f"l{i}.o", fused_t([p + "self_attn.o_proj.weight"], [None])
        if p + "self_attn.o_proj.bias" in expected:
            yield f"l{i}.o_bias", copy(p + "self_attn.o_proj.bias")
        yield f"l{i}.post_norm", copy(p + "post_attention_layernorm.weight")
        yield f"l{i}.gate_up", fused_t([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [None, None])
        yield f"l{i}.down", fused_t([p + "mlp.down_proj.weight"], [None])
        if cfg.mlp_bias:
            yield (
                f"l{i}.gate_up_bias",
                fused_bias([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"], [None] * 2),
            )
            yield f"l{i}.down_bias", copy(p + "mlp.down_proj.bias")
    yield "norm", copy("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head", fused_t(["lm_head.weight"], [None])
    log.info("loaded %d tensors from %s", len(expected), model_dir)


def load_weights(model_dir: str | Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Return fused float32 weights: ``embed``, ``l{i}.{in_norm,qkv,qkv_bias,o,o_bias,post_norm,
    gate_up,gate_up_bias,down,down_bias}``, ``norm`` and ``lm_head`` ([hidden, vocab], untied only)."""
    return dict(iter_weights(model_dir, cfg))


DIGEST_CACHE = ".pdserve-weights-digest.json"
"""Beside the weights in a model folder: each weight file's content digest, keyed by the file's
name, size, mtime and inode, so that a later start reads no weight bytes to identify them."""


def weights_digest(model_dir: str | Path) -> str:
    """The identity of the numbers a model computes: blake2b-128 (hex) of its ``config.json`` and
    its weights' content (each weight file's bytes, by name; a seeded folder: its seed record, from
    which every load generates the same weights). Two folders with the same digest compute the same
    K/V for the same tokens; one changed tensor changes it.

    Hashing a file's bytes costs about a second per GB, once: the file digests are cached in
    :data:`DIGEST_CACHE` beside the weights, each under the file's (size, mtime, inode), so a later
    start stats the files instead of reading them; a replaced or rewritten file is hashed again. A
    folder that cannot be written (read-only mount) is hashed at every start."""
    from pdserve.engine.models.model_init import SEEDED_WEIGHTS

    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    config = model_dir / "config.json"
    h.update(b"config.json\0" + (config.read_bytes() if config.is_file() else b""))
    if (model_dir / SEEDED_WEIGHTS).is_file():
        h.update(b"\0" + SEEDED_WEIGHTS.encode() + b"\0" + (model_dir / SEEDED_WEIGHTS).read_bytes())
        return h.hexdigest()
    cache_path = model_dir / DIGEST_CACHE
    try:
        cached = orjson.loads(cache_path.read_bytes())
        if not isinstance(cached, dict):
            cached = {}
    except (OSError, orjson.JSONDecodeError):
        cached = {}
    fresh: dict[str, dict[str, object]] = {}
    for path in sorted(checkpoint_files(model_dir), key=lambda p: p.name):
        st = path.stat()
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
        entry = cached.get(path.name)
        if isinstance(entry, dict) and {k: entry.get(k) for k in stamp} == stamp and "digest" in entry:
            digest = str(entry["digest"])
        else:
            t0 = time.perf_counter()
            digest = _file_digest(path)
            log.info("hashed %s (%.2f GB) in %.1f s", path, st.st_size / 1e9, time.perf_counter() - t0)
        fresh[path.name] = {**stamp, "digest": digest}
        h.update(b"\0" + path.name.encode() + b"\0" + digest.encode())
    if fresh != cached:
        _write_digest_cache(cache_path, fresh)
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def _write_digest_cache(path: Path, entries: dict[str, dict[str, object]]) -> None:
    """Replace the digest cache by a rename (concurrent starts each write a whole one); a folder
    that cannot be written keeps none, which costs only the hashing."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(orjson.dumps(entries))
        os.replace(tmp, path)
    except OSError as e:
        log.info("not caching the weights' digest in %s: %s", path.parent, e)
        with contextlib.suppress(OSError):
            tmp.unlink()
