"""The in-place decode kernel (engine/cpu/attention.py) against the reference gather path: the same
attention on random caches and block tables, the same greedy tokens from the whole engine, and
bitwise batch invariance with the kernel on (MKL_CBWR=AUTO,STRICT, set in conftest)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from pdserve import SamplingParams
from pdserve.engine.batcher import blocks_for
from pdserve.engine.block_manager import NULL_BLOCK
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu.attention import select_attention
from pdserve.engine.cpu.compiled_attention import AttentionKernels
from pdserve.engine.cpu.gemm import PackedMkl, load_packed_mkl
from pdserve.engine.cpu.host_cpu import Kernels
from pdserve.engine.cpu.kv_cache import KVCache
from pdserve.engine.cpu.paddle_model import Model
from pdserve.engine.cpu.paddle_setup import paddle
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.model_config import ModelConfig
from pdserve.errors import ConfigError

BS = 16
TOL = 1e-5


@pytest.fixture(scope="module")
def kernel() -> AttentionKernels:
    attention = select_attention("kernel", 2)
    assert attention.impl == "kernel"
    return attention.kernel


@pytest.fixture(scope="module", params=["mkl", "paddle"])
def tiles_gemm(request) -> PackedMkl | None:
    """The causal tiles' GEMMs: MKL's sgemm called from the compiled tiles, or (no MKL) Paddle's
    matmul per tile from Python."""
    return load_packed_mkl() if request.param == "mkl" else None


def config(heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=64,
        num_layers=3,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=32,
        intermediate_size=64,
        max_position_embeddings=1024,
    )


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("lengths", [[1], [17], [15, 16, 33], [5, 48, 130, 31, 64, 7, 200, 129], [77] * 32])
def test_kernel_matches_reference(kernel, heads: int, kv_heads: int, lengths: list[int]) -> None:
    cfg = config(heads, kv_heads)
    rng = np.random.default_rng(len(lengths) * 100 + sum(lengths) + heads)
    nblocks = 1 + sum(blocks_for(n, BS) for n in lengths)
    cache = KVCache(cfg, nblocks, BS)
    data = rng.standard_normal(cache.tensor.shape, dtype=np.float32)
    data[NULL_BLOCK] = 0.0
    paddle.assign(paddle.to_tensor(data), cache.tensor)
    free = list(rng.permutation(np.arange(1, nblocks)))  # scattered block ids
    nblk = max(blocks_for(n, BS) for n in lengths)
    table = np.full((len(lengths), nblk), NULL_BLOCK, np.int64)
    for i, n in enumerate(lengths):
        table[i, : blocks_for(n, BS)] = [free.pop() for _ in range(blocks_for(n, BS))]
    lens = np.asarray(lengths, np.int64)
    q = rng.standard_normal((len(lengths), heads, cfg.head_dim), dtype=np.float32) / np.float32(
        np.sqrt(cfg.head_dim)
    )
    model = Model(cfg, {"embed": np.zeros((64, 64), np.float32)}, 8, Kernels("composed", "composed", "test"))
    mask = np.where(np.arange(nblk * BS)[None, :] < lens[:, None], 0.0, -np.inf).astype(np.float32)
    rows = cache.kv_view().reshape(-1, cfg.head_dim)
    for layer in range(cfg.num_layers):
        kv = paddle.index_select(cache.chunks, paddle.to_tensor(cache.gather_chunks(table)[layer]))
        want = model.paged_attention(
            paddle.to_tensor(q), kv, paddle.to_tensor(mask[:, None, :]), len(lengths), True
        ).numpy()
        got = kernel.decode(rows, (cfg.num_layers, BS, kv_heads), layer, q, table, lens)
        assert got.shape == (len(lengths), heads, cfg.head_dim)
        diff = np.abs(got.reshape(len(lengths), -1) - want).max()
        assert diff <= TOL, f"layer {layer}: max abs diff {diff}"


def test_kernel_ignores_what_lies_past_the_length(kernel) -> None:
    """Padding entries of a table and slots past a sequence's length are never read."""
    cfg = config(4, 2)
    cache = KVCache(cfg, 8, BS)
    rng = np.random.default_rng(1)
    paddle.assign(paddle.to_tensor(rng.standard_normal(cache.tensor.shape, dtype=np.float32)), cache.tensor)
    q = rng.standard_normal((1, 4, cfg.head_dim), dtype=np.float32)
    rows = cache.kv_view().reshape(-1, cfg.head_dim)
    shape = (cfg.num_layers, BS, 2)
    short = kernel.decode(rows, shape, 0, q, np.array([[3, 5]], np.int64), np.array([20], np.int64))
    padded = kernel.decode(rows, shape, 0, q, np.array([[3, 5, 7, 2]], np.int64), np.array([20], np.int64))
    data = cache.tensor.numpy()
    data[5, :, :, 4:] = np.nan  # slots 20.. of the second block
    data[7] = np.nan
    paddle.assign(paddle.to_tensor(data), cache.tensor)
    poisoned = kernel.decode(rows, shape, 0, q, np.array([[3, 5, 7, 2]], np.int64), np.array([20], np.int64))
    assert np.array_equal(short, padded) and np.array_equal(short, poisoned)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("n", [1, 5, 127, 128, 129, 300])
def test_tiled_causal_attention_matches_reference(
    kernel, tiles_gemm, heads: int, kv_heads: int, n: int
) -> None:
    """A first prefill chunk through the causal tiles (tile boundaries at 64) equals the reference's
    full masked attention within 1e-5."""
    cfg = config(heads, kv_heads)
    rng = np.random.default_rng(n * 10 + heads)
    q = rng.standard_normal((n, heads, cfg.head_dim), dtype=np.float32) / np.float32(np.sqrt(cfg.head_dim))
    k = rng.standard_normal((n, kv_heads, cfg.head_dim), dtype=np.float32)
    v = rng.standard_normal((n, kv_heads, cfg.head_dim), dtype=np.float32)
    weights = {"embed": np.zeros((64, 64), np.float32)}
    tiled = Model(cfg, weights, 8, Kernels("composed", "composed", "test"), kernel, tiles_gemm)
    mask = np.triu(np.full((n, n), -np.inf, np.float32), 1)
    want = tiled.dense_causal_attention(*map(paddle.to_tensor, (q, k, v, mask))).numpy()
    got = tiled.tiled_causal_attention(q, k, v)
    assert got.shape == (n, heads * cfg.head_dim)
    assert np.abs(got - want).max() <= TOL


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3)])
def test_prefill_chunk_rows_do_not_depend_on_the_chunk(kernel, tiles_gemm, heads: int, kv_heads: int) -> None:
    """A prefill chunk ``[s, e)`` read through its block table: each row is bitwise the row of the
    whole sequence's prefill (whatever the chunk's start, end or length, across tile boundaries),
    within 1e-5 of the reference's masked attention, and slots past ``e`` are never read."""
    cfg = config(heads, kv_heads)
    n, D = 300, cfg.head_dim
    rng = np.random.default_rng(heads)
    cache = KVCache(cfg, 1 + blocks_for(n, BS) + 2, BS)
    paddle.assign(paddle.to_tensor(rng.standard_normal(cache.tensor.shape, dtype=np.float32)), cache.tensor)
    table = rng.permutation(np.arange(1, cache.num_blocks))[: blocks_for(n, BS)].astype(np.int64)
    q = rng.standard_normal((n, heads, D), dtype=np.float32) / np.float32(np.sqrt(D))
    model = Model(
        cfg,
        {"embed": np.zeros((64, 64), np.float32)},
        8,
        Kernels("composed", "composed", "t"),
        kernel,
        tiles_gemm,
    )
    layer, kv = 1, cache.kv_view()
    whole = model.prefill_attention(q, kv, layer, table, n)
    k = kv[table, 0, layer].reshape(-1, kv_heads, D)[:n]
    v = kv[table, 1, layer].reshape(-1, kv_heads, D)[:n]
    mask = np.triu(np.full((n, n), -np.inf, np.float32), 1)
    want = model.dense_causal_attention(*map(paddle.to_tensor, (q, k, v, mask))).numpy()
    assert np.abs(whole - want).max() <= TOL
    assert np.array_equal(model.tiled_causal_attention(q, k, v), whole)  # K/V at hand: the same tiles
    clean = kv.copy()
    for s, e in [(0, 1), (0, 100), (16, 17), (32, 160), (120, 136), (128, 256), (255, 300), (64, 250)]:
        kv[table[blocks_for(e, BS) :]] = np.nan  # every slot past e: never read
        kv[table[(e - 1) // BS], :, :, (e - 1) % BS + 1 :] = np.nan
        got = model.prefill_attention(q[s:e], kv, layer, table, e)
        kv[...] = clean
        assert np.array_equal(got, whole[s:e]), f"[{s}, {e}): max abs diff {np.abs(got - whole[s:e]).max()}"


@pytest.mark.parametrize("start,end", [(0, 512), (200, 300), (0, 5)])
def test_causal_tiles_bits_do_not_depend_on_the_thread_count(start: int, end: int) -> None:
    """The compiled tiles deal whole (kv head, tile) tasks to numba's threads, each calling MKL on
    its own thread: one thread or two, largest tiles first or not, every row keeps its bits."""
    cfg = config(9, 3)
    rng = np.random.default_rng(end)
    D, width = cfg.head_dim, -(-end // 64) * 64
    q = rng.standard_normal((end - start, 9, D), dtype=np.float32) / np.float32(np.sqrt(D))
    kt, vt = np.zeros((width, 3, D), np.float32), np.zeros((width, 3, D), np.float32)
    kt[:end], vt[:end] = rng.standard_normal((2, end, 3, D), dtype=np.float32)
    mkl, got = load_packed_mkl(), []
    for threads in (1, 2):
        kernels = select_attention("kernel", threads).kernel
        model = Model(
            cfg,
            {"embed": np.zeros((64, 64), np.float32)},
            8,
            Kernels("composed", "composed", "t"),
            kernels,
            mkl,
        )
        got.append(model.causal_tiles(q, kt, vt, start))
    assert kernels.threads == 2 and np.array_equal(got[0], got[1])
    ref = Model(
        cfg, {"embed": np.zeros((64, 64), np.float32)}, 8, Kernels("composed", "composed", "t"), kernels
    )
    assert np.abs(ref.causal_tiles(q, kt, vt, start) - got[0]).max() <= TOL  # the Paddle-matmul tiles


def test_rope_write_is_bitwise_the_reference(kernel) -> None:
    """One pass of RoPE + K/V write gives the reference's q and cache contents bit for bit."""
    cfg = config(4, 2)
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rng = np.random.default_rng(3)
    n = 37
    model = Model(cfg, {"embed": np.zeros((64, 64), np.float32)}, 1024, Kernels("composed", "composed", "t"))
    qkv = rng.standard_normal((n, (H + 2 * KVH) * D), dtype=np.float32)
    positions = rng.permutation(1000)[:n].astype(np.int64)
    caches = [KVCache(cfg, 8, BS) for _ in range(2)]
    slots = rng.permutation(np.arange(BS, 8 * BS))[:n]  # never the null block
    write_rows = caches[0].write_rows(slots)
    layer = 1
    q_got, _, _ = kernel.rope_write(
        qkv, positions, model.rope_np, caches[0].kv_view().reshape(-1, D), write_rows[layer], (H, KVH, D)
    )
    qt, kt, vt = paddle.split(paddle.to_tensor(qkv), model.sizes, axis=-1)
    pos = paddle.to_tensor(positions)
    table = {
        name: paddle.index_select(getattr(model, name), pos).unsqueeze(1)
        for name in ("qcos", "qsin", "cos", "sin")
    }
    q_want = model._rope(qt.reshape([n, H, D]), table["qcos"], table["qsin"]).numpy()
    k_want = model._rope(kt.reshape([n, KVH, D]), table["cos"], table["sin"])
    kv = paddle.concat([k_want, vt.reshape([n, KVH, D])], 0).reshape([-1, D])
    paddle.scatter_(caches[1].rows, paddle.to_tensor(write_rows[layer]), kv, overwrite=True)
    assert np.array_equal(q_got, q_want)
    assert np.array_equal(caches[0].tensor.numpy(), caches[1].tensor.numpy())


@pytest.mark.parametrize("n,inter", [(1, 768), (37, 64), (512, 768)])
def test_swiglu_matches_paddle(kernel, n: int, inter: int) -> None:
    """numba's SwiGLU (its exp from arithmetic, see _exp32) against Paddle's fused one, gates over a
    wide range (silu's both tails): within 1e-5 relative to the output's scale."""
    from pdserve.engine.cpu.paddle_setup import functional as F

    gate_up = np.random.default_rng(n).standard_normal((n, 2 * inter), dtype=np.float32) * 8
    want = F.swiglu(paddle.to_tensor(gate_up)).numpy()
    got = kernel.swiglu(gate_up)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))


def test_serial_and_parallel_builds_have_cache_entries_of_their_own(kernel) -> None:
    """numba's cache names an entry by function, not by build options: when both builds of a kernel
    shared one, the first compiled (the serial one) was loaded for both, and every "parallel" kernel
    ran on one thread."""
    fns = kernel.compiled
    for name in ("decode", "rope_write", "swiglu", "add_rms_norm", "rms_norm"):
        parallel, serial = fns[name], fns[name + "_serial"]
        assert parallel.targetoptions["parallel"] and not serial.targetoptions.get("parallel")
        paths = {f._cache._cache_file._index_path for f in (parallel, serial)}
        assert len(paths) == 2, (name, paths)


def test_a_parallel_kernel_works_on_two_threads(kernel) -> None:
    """The parallel SwiGLU over 512 rows: the engine's second thread takes part (CPU time on a
    thread other than the caller's), which a serial build loaded in its place would not."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one usable core")
    gate_up = np.random.default_rng(0).standard_normal((512, 2 * 1536), dtype=np.float32)
    before = thread_cpu_ticks()
    threads, kernel.threads = kernel.threads, 2
    try:
        for _ in range(200):
            kernel.swiglu(gate_up)
    finally:
        kernel.threads = threads
    spent = {t: c - before.get(t, 0) for t, c in thread_cpu_ticks().items()}
    caller = str(threading.get_native_id())
    assert sum(c for t, c in spent.items() if t != caller) > 0, spent


def thread_cpu_ticks() -> dict[str, int]:
    """User + system clock ticks of each of this process's threads, by thread id."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


def test_the_kernels_exp_is_within_1e7_of_float64() -> None:
    import numba

    from pdserve.engine.cpu import attention

    select_attention("kernel", 1)  # compiles attention._exp
    exp = attention._exp

    @numba.njit
    def run(x: np.ndarray, out: np.ndarray) -> None:
        for i in range(x.size):
            out[i] = exp(x[i])

    x = np.concatenate([np.linspace(-87, 88, 200_001), [0.0, -1e-8, 1e-8]]).astype(np.float32)
    out = np.empty_like(x)
    run(x, out)
    want = np.exp(x.astype(np.float64))
    assert np.all(np.isfinite(out))
    assert np.max(np.abs(out - want) / want) < 1e-7
    run(np.array([-np.inf, -1000.0], np.float32), out[:2])
    assert np.all(out[:2] < 1e-37)  # clamped: a masked score adds nothing


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="attention"):
        select_attention("fast", 1)
    assert select_attention("reference", 1).kernel is None


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = ["Hi", "The router picks a prefill and a decode instance. " * 3, "a b c d e f g " * 30]


def generate(engine: LLMEngine, prompts: list[str]) -> dict[str, tuple[list[int], list[np.ndarray]]]:
    for i, text in enumerate(prompts):
        engine.add_request(f"r{i}", text, GREEDY)
    got: dict[str, tuple[list[int], list[np.ndarray]]] = {f"r{i}": ([], []) for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, logits = got[out.request_id]
            tokens.extend(out.token_ids)
            if out.logits is not None:
                logits.append(out.logits)
    return got


# The engines compared: the default (kernel attention, packed GEMM), the reference attention, and the
# kernel attention on Paddle's matmul (the GEMM fallback, whose batch invariance needs row padding).
PATHS = {
    "kernel": {"attention": "kernel", "gemm": "packed"},
    "reference": {"attention": "reference", "gemm": "packed"},
    "paddle_gemm": {"attention": "kernel", "gemm": "paddle"},
}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    cfg = {"num_blocks": 256, "prefill_chunk_size": 64, "keep_logits": True}
    made = {name: LLMEngine(tiny_model_dir, EngineConfig(**path, **cfg)) for name, path in PATHS.items()}
    yield made
    for engine in made.values():
        engine.close()


@pytest.mark.parametrize("other", ["reference", "paddle_gemm"])
def test_engine_kernel_equals_reference_greedy(engines, other: str) -> None:
    """The default path against the reference attention and against Paddle's GEMM: same greedy
    tokens, logits within 1e-3."""
    ex = {name: engine.executor for name, engine in engines.items()}
    assert ex["kernel"].attention.impl == "kernel" and ex["kernel"].gemm.impl == "packed"
    assert ex["reference"].attention.impl == "reference"
    assert ex["paddle_gemm"].gemm.impl == "paddle" and "l0.qkv" in ex["paddle_gemm"].model.w
    kernel, reference = generate(engines["kernel"], PROMPTS), generate(engines[other], PROMPTS)
    for rid in kernel:
        assert kernel[rid][0] == reference[rid][0], rid
        assert len(kernel[rid][0]) == GREEDY.max_tokens
        diff = max(np.abs(a - b).max() for a, b in zip(kernel[rid][1], reference[rid][1], strict=True))
        assert diff < 1e-3, f"{rid}: logits differ by {diff}"


@pytest.mark.parametrize("mode", list(PATHS))
def test_batch_invariant(engines, mode: str) -> None:
    """A sequence's logits are bitwise the same alone and next to others of other lengths, on every
    path (the exactness tests run the default, the kernels; the fallbacks must hold it too)."""
    engine = engines[mode]
    assert engine.runner.batch_invariant
    alone = [generate(engine, [p])["r0"] for p in PROMPTS]
    batched = generate(engine, PROMPTS)
    for i, (tokens, logits) in enumerate(alone):
        assert batched[f"r{i}"][0] == tokens
        for a, b in zip(logits, batched[f"r{i}"][1], strict=True):
            assert np.array_equal(a, b), f"prompt {i}: max abs diff {np.abs(a - b).max()}"


def test_auto_falls_back_without_numba() -> None:
    """A host where numba does not import gets the reference path and a reason, never a crash."""
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "from pdserve.errors import ConfigError\n"
        "from pdserve.engine.cpu.attention import select_attention\n"
        "a = select_attention('auto', 2)\n"
        "assert a.impl == 'reference' and a.kernel is None and 'numba' in a.reason, a\n"
        "try:\n"
        "    select_attention('kernel', 2)\n"
        "except ConfigError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused: attention=kernel" in out.stdout
    assert "reference attention" in out.stderr  # the one warning line
