"""The torch platform's fused layer kernels (engine/cuda/layer_ops.py), the decode kernel's
variants over table widths, and what a step launches and compiles.

The torch twins are checked against float64 numpy here; the Triton kernels run in Triton's
interpreter against the twins, in one subprocess (TRITON_INTERPRET must be set before Triton
decorates a kernel; ``interpreter_checks`` below, this file run with the variable set), which also
records every launch's compile key the way Triton keys its cache (constexprs and launch options, each
unspecialised int's width, each other int's ``== 1`` and ``% 16`` and each pointer's dtype and
16-byte alignment): the keys serving produces must all be among those the warm-up produced.
Unused cache slots hold NaN, so a kernel writing where it should not shows up.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch platform's kernels need torch")

from pdserve.engine.cuda import layer_ops as lo  # noqa: E402
from pdserve.engine.cuda import triton_attention as ta  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
EPS = 1e-5
ROPE_SHAPES = {  # name -> (heads, kv heads, head_dim, block_size)
    "h4_kv2_d64_bs16": (4, 2, 64, 16),
    "h9_kv3_d32_bs8": (9, 3, 32, 8),  # GQA 3, head counts no power of 2
    "h6_kv6_d16_bs5": (6, 6, 16, 5),  # no GQA; a block size the slot arithmetic must not assume
}
DECODE_WIDTHS = (1, 5, 17, 32, 48, 67)  # blocks of 16: one split up to 32 (512 tokens), then 2, 3, 4


def rope_tables(dim: int, max_len: int = 512) -> tuple[Any, Any]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    emb = torch.outer(torch.arange(max_len, dtype=torch.float64), inv).repeat(1, 2)
    return emb.cos().float(), emb.sin().float()


def rope_case(seed: int, dtype: Any, heads: int, kv_heads: int, dim: int, block_size: int) -> dict[str, Any]:
    """7 rows of a fused qkv (a slice of wider rows: row stride > width), positions and distinct
    slots off block boundaries, and a NaN cache viewed past a leading layer (strides not a
    contiguous tensor's)."""
    rng = np.random.default_rng(seed)
    n, layers, num_blocks = 7, 2, 9
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.from_numpy(rng.standard_normal((n, width + 24)).astype(np.float32)).to(dtype)[:, :width]
    cache = torch.full((num_blocks, 2, layers + 1, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    slots = rng.choice(np.arange(block_size, num_blocks * block_size), n, replace=False)
    return {
        "qkv": qkv,
        "positions": torch.from_numpy(rng.integers(0, 500, n).astype(np.int32)),
        "slots": torch.from_numpy(slots.astype(np.int32)),
        "cache": cache[:, :, 1:],
        "layer": 1,
        "heads": heads,
        "kv_heads": kv_heads,
    }


def run_rope(fn: Any, case: dict[str, Any]) -> tuple[Any, Any]:
    qkv, cache = case["qkv"].clone(), case["cache"].clone()
    cos, sin = rope_tables(cache.shape[-1])
    fn(qkv, case["positions"], case["slots"], cos, sin, cache, case["layer"], case["heads"], case["kv_heads"])
    return qkv, cache


def rel_err(got: Any, want: Any) -> float:
    """max |got - want| / max |want| over the entries that are not NaN in both (NaN where one is)."""
    got, want = got.double(), want.double()
    if not torch.equal(got.isnan(), want.isnan()):
        return float("nan")
    seen = ~want.isnan()
    return float((got[seen] - want[seen]).abs().max() / want[seen].abs().max())


# ----------------------------------------------------------------------------------------------
# the twins against float64 numpy


def test_torch_add_rms_norm_matches_float64_numpy() -> None:
    rng = np.random.default_rng(1)
    x, r = (rng.standard_normal((5, 333)).astype(np.float32) for _ in range(2))
    w = rng.uniform(0.5, 1.5, 333).astype(np.float32)
    residual = torch.from_numpy(r.copy())
    out = lo.torch_add_rms_norm(torch.from_numpy(x), residual, torch.from_numpy(w), EPS)
    s = x.astype(np.float64) + r
    want = s / np.sqrt((s**2).mean(-1, keepdims=True) + EPS) * w
    np.testing.assert_allclose(residual.numpy(), s, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    alone = lo.torch_add_rms_norm(torch.from_numpy(x), None, torch.from_numpy(w), EPS)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS) * w
    np.testing.assert_allclose(alone.numpy(), want, rtol=1e-5, atol=1e-5)


def test_torch_rope_write_kv_rotates_in_place_and_writes_the_slots() -> None:
    heads, kv_heads, dim, block_size = ROPE_SHAPES["h9_kv3_d32_bs8"]
    case = rope_case(2, torch.float32, heads, kv_heads, dim, block_size)
    qkv, cache = run_rope(lo.torch_rope_write_kv, case)
    x = case["qkv"].double().numpy().reshape(7, heads + 2 * kv_heads, dim)
    p = case["positions"].numpy()[:, None, None].astype(np.float64)
    i = np.arange(dim // 2)
    angle = p * 10000.0 ** (-2 * i / dim)
    lo_, hi = x[..., : dim // 2], x[..., dim // 2 :]
    rotated = np.concatenate(
        [lo_ * np.cos(angle) - hi * np.sin(angle), hi * np.cos(angle) + lo_ * np.sin(angle)], -1
    )
    want = np.concatenate([rotated[:, : heads + kv_heads], x[:, heads + kv_heads :]], 1)
    np.testing.assert_allclose(qkv.numpy().reshape(want.shape), want, atol=1e-5)
    blocks, offsets = case["slots"].numpy() // block_size, case["slots"].numpy() % block_size
    np.testing.assert_allclose(
        cache[blocks, 0, 1, offsets].numpy(), want[:, heads : heads + kv_heads], atol=1e-5
    )
    np.testing.assert_array_equal(
        cache[blocks, 1, 1, offsets].numpy(), x[:, heads + kv_heads :].astype(np.float32)
    )
    written = torch.zeros(cache.shape[0] * block_size, dtype=torch.bool)
    written[case["slots"].long()] = True
    untouched = cache.permute(0, 3, 1, 2, 4, 5).reshape(-1, 2, 2, kv_heads, dim)[~written]
    assert untouched.isnan().all()  # nothing but the slots, nothing in the other layer
    assert cache[:, :, 0].isnan().all()


def test_torch_silu_mul_matches_float64_numpy() -> None:
    gu = np.random.default_rng(3).standard_normal((3, 2 * 700)).astype(np.float32)
    out = lo.torch_silu_mul(torch.from_numpy(gu))
    g, u = gu[:, :700].astype(np.float64), gu[:, 700:]
    np.testing.assert_allclose(out.numpy(), g / (1 + np.exp(-g)) * u, rtol=1e-6, atol=1e-6)


def test_layer_ops_follow_the_attention_choice() -> None:
    assert lo.select_layer_ops("triton") is lo.TRITON_LAYER_OPS
    assert lo.select_layer_ops("torch") is lo.TORCH_LAYER_OPS
    assert lo.TORCH_LAYER_OPS.add_rms_norm is lo.torch_add_rms_norm


# ----------------------------------------------------------------------------------------------
# the decode launch over table widths (pure arithmetic: no kernel)


def test_every_table_width_maps_onto_the_two_decode_variants() -> None:
    """For any batch, kv heads, SM count and width, the launch is split or not (all the kernels
    specialise on), at most 64 splits of whole tiles that cover the table and none wholly past it."""
    variants = set()
    for tile in (16, 32):
        for sms in (0, 78, 132):
            for batch in (1, 2, 3, 8, 32, 256):
                for kv_heads in (1, 2, 8):
                    for width in range(1, 513):
                        ctx = width * 16
                        launch = ta.decode_launch(batch, kv_heads, ctx, tile, sms)
                        variants.add(launch.split)
                        assert 1 <= launch.splits <= 64 and launch.split_tokens % tile == 0
                        assert (
                            (launch.splits - 1) * launch.split_tokens
                            < ctx
                            <= launch.splits * launch.split_tokens
                        )
                        if sms == 0 or batch * kv_heads >= sms:
                            assert not launch.split
    assert variants == {False, True}
    assert ta.decode_launch(1, 8, 67 * 16, 16, 132) == ta.DecodeLaunch(4, 272)
    assert ta.prefill_query_tiles(False) == [16, 32, 64] and ta.prefill_query_tiles(True) == [16, 32]


# ----------------------------------------------------------------------------------------------
# in the interpreter


def compile_key(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What Triton's JIT cache keys a launch on, from the launch alone (see the module docstring)."""
    skip = set(fn.kwargs.get("do_not_specialize") or ())
    parts: list[Any] = [fn.fn.__name__]
    for i, (name, value) in enumerate(zip(fn.arg_names, args)):
        if hasattr(value, "data_ptr"):
            parts.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, bool):
            parts.append((name, "i1"))
        elif isinstance(value, int):
            wide = not -(2**31) <= value < 2**31
            same = name in skip or i in skip
            parts.append((name, wide) if same else (name, wide, value == 1, value % 16 == 0))
        else:
            parts.append((name, type(value).__name__))
    return (*parts, tuple(sorted(kwargs.items())))


@contextlib.contextmanager
def recorded(keys: list[tuple[Any, ...]], launches: collections.Counter[str] | None = None) -> Iterator[None]:
    """Record each Triton launch's compile key; with ``launches``, count every kernel launched
    (Triton's, and torch ops that are neither views nor allocations)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    original = interpreter.InterpretedFunction.run
    inside = [False]

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        keys.append(compile_key(self, args, kwargs))
        if launches is not None:
            launches[self.fn.__name__] += 1
        inside[0] = True
        try:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            inside[0] = False

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if (
                inside[0]
                or name.startswith(("empty", "new_empty"))
                or name in ("set_", "detach", "lift_fresh")
            ):
                return out
            aliased = (
                isinstance(out, torch.Tensor)
                and out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()
            )
            if func.is_view and (aliased or not isinstance(out, torch.Tensor)):
                return out  # a view (``to`` that copies is counted)
            assert launches is not None
            launches[name] += 1
            return out

    interpreter.InterpretedFunction.run = run
    try:
        if launches is None:
            yield
        else:
            with Count():
                yield
    finally:
        interpreter.InterpretedFunction.run = original


def kernel_checks() -> dict[str, float]:
    """Each fused kernel against its twin: relative max error (and the absolute one, ``_abs``)."""
    results: dict[str, float] = {}

    def put(name: str, got: Any, want: Any) -> None:
        results[name] = rel_err(got, want)
        results[name + "_abs"] = float((got.double() - want.double()).nan_to_num(0).abs().max())

    for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        rng = np.random.default_rng(4)
        for hidden in (333, 256):
            x, r = (
                torch.from_numpy(rng.standard_normal((5, hidden)).astype(np.float32)).to(dtype)
                for _ in range(2)
            )
            w = torch.from_numpy(rng.uniform(0.5, 1.5, hidden).astype(np.float32))
            r_got, r_want = r.clone(), r.clone()
            put(
                f"add_rms_norm_{tag}_{hidden}",
                lo.triton_add_rms_norm(x, r_got, w, EPS),
                lo.torch_add_rms_norm(x, r_want, w, EPS),
            )
            put(f"add_rms_norm_{tag}_{hidden}_residual", r_got, r_want)
            put(
                f"rms_norm_{tag}_{hidden}",
                lo.triton_add_rms_norm(x, None, w, EPS),
                lo.torch_add_rms_norm(x, None, w, EPS),
            )
        for name, shape in ROPE_SHAPES.items():
            case = rope_case(5, dtype, *shape)
            (q_got, c_got), (q_want, c_want) = (
                run_rope(lo.triton_rope_write_kv, case),
                run_rope(lo.torch_rope_write_kv, case),
            )
            put(f"rope_{tag}_{name}_qkv", q_got, q_want)
            put(f"rope_{tag}_{name}_cache", c_got, c_want)  # NaN exactly where the twin left NaN
        for inter in (1500, 64):  # two column tiles, the second masked; one short tile
            gu = torch.from_numpy(rng.standard_normal((3, 2 * inter + 8)).astype(np.float32)).to(dtype)[
                :, : 2 * inter
            ]
            put(f"silu_mul_{tag}_{inter}", lo.triton_silu_mul(gu), lo.torch_silu_mul(gu))
    return results


def decode_width_checks() -> dict[str, Any]:
    """The decode kernel at each width of DECODE_WIDTHS, split as an H100-sized GPU (132 SMs) would
    split it, against the torch version; its compile keys against the warm-up's."""
    from pdserve.engine.cuda.triton_attention import _triton_decode

    results: dict[str, Any] = {}
    heads, kv_heads, dim, bs = 4, 2, 16, 16
    rng = np.random.default_rng(6)
    blocks = 2 * max(DECODE_WIDTHS) + 1
    values = torch.from_numpy(rng.standard_normal((blocks, 2, 2, bs, kv_heads, dim)).astype(np.float32))
    cache = values.clone()
    qkv = torch.from_numpy(rng.standard_normal((2, (heads + 2 * kv_heads) * dim)).astype(np.float32))
    q = qkv[:, : heads * dim].view(2, heads, dim)
    warm: list[tuple[Any, ...]] = []
    with recorded(warm):
        ta.warm_up_paged_attention(
            torch.zeros((128, (heads + 2 * kv_heads) * dim))[:, : heads * dim].view(128, heads, dim),
            cache,
            0.25,
        )
    served: list[tuple[Any, ...]] = []
    for width in DECODE_WIDTHS:
        tables = torch.from_numpy(
            rng.permutation(np.arange(1, blocks))[: 2 * width].reshape(2, width).astype(np.int32)
        )
        lengths = torch.tensor([width * bs, max(1, width * bs - 21)], dtype=torch.int32)
        cache.copy_(values)
        for p in range(int(lengths[1]), width * bs):  # the short row's slots past its length: NaN
            cache[tables[1, p // bs], :, :, p % bs] = float("nan")
        launch = ta.decode_launch(2, kv_heads, width * bs, 16, 132)
        with recorded(served):
            got = _triton_decode(q, cache, 1, tables, lengths, 0.25, num_splits=launch.splits)
        want = ta.torch_paged_decode_attention(q, cache, 1, tables, lengths, 0.25)
        results[f"decode_width_{width}"] = float((got - want).abs().max())
        results[f"decode_width_{width}_splits"] = launch.splits
    for start, n in ((0, 1), (3, 16), (20, 17), (0, 64), (40, 90)):
        table = torch.from_numpy(
            rng.permutation(np.arange(1, blocks))[: -(-(start + n) // bs)].astype(np.int32)
        )
        q_rows = torch.from_numpy(rng.standard_normal((n, (heads + 2 * kv_heads) * dim)).astype(np.float32))
        with recorded(served):
            ta.paged_prefill_attention(
                q_rows[:, : heads * dim].view(n, heads, dim), cache, 0, table, start, 0.25
            )
    results["warm_up_keys"] = len(set(warm))
    results["served_keys"] = len(set(served))
    results["served_not_warmed"] = [repr(k[:1] + k[-1:]) for k in set(served) - set(warm)]
    results["decode_variants"] = len({k for k in served if k[0] == "decode"})
    return results


def engine_checks(model_dir: str) -> dict[str, Any]:
    """The tiny model served with every kernel in the interpreter: the compile keys of its steps
    against the warm-up's, the kernels one decode step launches, and the greedy tokens."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.cuda.torch_executor import TorchPlatform
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.sampling_params import SamplingParams

    eng = LLMEngine(model_dir, EngineConfig(**ENGINE), platform=TorchPlatform("cpu"))
    ex = eng.executor
    assert ex.attention.impl == "triton" and ex.model.ops.impl == "triton", ex.attention
    warm: list[tuple[Any, ...]] = []
    with recorded(warm), torch.inference_mode():
        ex.model.warm_up(ex.cache.tensor)
    served: list[tuple[Any, ...]] = []
    counts: list[tuple[bool, dict[str, int]]] = []
    forward = ex.model.forward

    def counted(cache: Any, step: Any) -> Any:
        launches: collections.Counter[str] = collections.Counter()
        with recorded(served, launches):
            out = forward(cache, step)
        counts.append((all(g.is_decode for g in step.groups), dict(launches)))
        return out

    ex.model.forward = counted  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(ENGINE_PROMPTS):
        eng.add_request(f"r{i}", prompt_token_ids=prompt, params=params)
        tokens[f"r{i}"] = []
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id] += o.token_ids
    decode_only = [c for is_decode, c in counts if is_decode]
    mixed = [c for is_decode, c in counts if not is_decode]
    return {
        "tokens": tokens,
        "layers": ex.model.cfg.num_layers,
        "decode_step_launches": decode_only[-1],
        "prefill_step_launches": mixed[0],
        "served_not_warmed": [repr(k[:1] + k[-1:]) for k in set(served) - set(warm)],
        "warm_up_keys": len(set(warm)),
    }


ENGINE = {"num_blocks": 32, "device": "cpu", "prefill_chunk_size": 16, "max_model_len": 256}
ENGINE_PROMPTS = [list(range(5, 14)), list(range(40, 60))]  # 9 and 20 tokens: a chunk of 16, then 4


def interpreter_checks(model_dir: str) -> dict[str, Any]:
    return {**kernel_checks(), **decode_width_checks(), "engine": engine_checks(model_dir)}


@pytest.fixture(scope="module")
def interpreted(tiny_model_dir: Path) -> dict[str, Any]:
    pytest.importorskip("triton", reason="the Triton kernels need triton (its interpreter runs them here)")
    code = (
        "import json, runpy, sys\n"
        f"checks = runpy.run_path({str(Path(__file__))!r})['interpreter_checks']\n"
        "print(json.dumps(checks(sys.argv[1])))\n"
    )
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model_dir)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


KERNEL_CHECKS = [
    *(f"{op}_{{dt}}_{h}" for op in ("add_rms_norm", "rms_norm") for h in (333, 256)),
    *(f"add_rms_norm_{{dt}}_{h}_residual" for h in (333, 256)),
    *(f"rope_{{dt}}_{name}_{part}" for name in ROPE_SHAPES for part in ("qkv", "cache")),
    *(f"silu_mul_{{dt}}_{inter}" for inter in (1500, 64)),
]


@pytest.mark.parametrize("check", KERNEL_CHECKS)
@pytest.mark.parametrize(
    ("dtype", "tol"),
    # float32: the order of a sum, FMA; bfloat16: one ulp (2^-7 relative: the kernels round where
    # the twins round, so most entries are equal bit for bit)
    [("f32", 2e-6), ("bf16", 2**-7)],
)
def test_fused_kernel_matches_its_torch_twin(
    interpreted: dict[str, Any], check: str, dtype: str, tol: float
) -> None:
    name = check.format(dt=dtype)
    err = interpreted[name]
    assert err == err, f"{name}: NaN where the twin has none, or the reverse"  # NaN != NaN
    assert err <= tol, f"{name}: max relative error {err} (abs {interpreted[name + '_abs']})"


def test_decode_at_every_width_matches_the_torch_version(interpreted: dict[str, Any]) -> None:
    splits = [interpreted[f"decode_width_{w}_splits"] for w in DECODE_WIDTHS]
    assert splits == [1, 1, 1, 2, 3, 4]
    for width in DECODE_WIDTHS:
        assert interpreted[f"decode_width_{width}"] <= 1e-5, width


def test_no_width_or_chunk_compiles_a_kernel_the_warm_up_did_not(interpreted: dict[str, Any]) -> None:
    assert interpreted["decode_variants"] == 2  # split or not, whatever the split count
    assert interpreted["served_not_warmed"] == []
    engine = interpreted["engine"]
    assert engine["served_not_warmed"] == []


def test_a_decode_step_launches_nine_kernels_a_layer(interpreted: dict[str, Any]) -> None:
    """Per layer: 4 GEMMs, 2 add + RMSNorm, RoPE + K/V write, attention, SiLU x up; per step:
    the embedding, the final add + norm, lm_head and the logits' float32 copy (bfloat16 only)."""
    engine = interpreted["engine"]
    launches, layers = engine["decode_step_launches"], engine["layers"]
    assert launches["add_rms_norm"] == 2 * layers + 1
    assert launches["rope_write_kv"] == launches["decode"] == launches["silu_mul"] == layers
    assert launches["linear"] == 4 * layers + 1
    assert sum(launches.values()) == 9 * layers + 3, launches  # float32: no copy of the logits
    assert not {"index_put_", "index", "cat", "mul", "add", "pow", "rsqrt"} & set(launches)


def test_the_interpreted_engine_gives_the_torch_path_s_tokens(
    interpreted: dict[str, Any], tiny_model_dir: Path
) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.cuda.torch_executor import TorchPlatform
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.sampling_params import SamplingParams

    eng = LLMEngine(tiny_model_dir, EngineConfig(**ENGINE), platform=TorchPlatform("cpu"))
    assert eng.executor.model.ops.impl == "torch"
    want: dict[str, list[int]] = {}
    for i, prompt in enumerate(ENGINE_PROMPTS):
        eng.add_request(
            f"r{i}",
            prompt_token_ids=prompt,
            params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        )
        want[f"r{i}"] = []
    while eng.has_unfinished():
        for o in eng.step():
            want[o.request_id] += o.token_ids
    assert interpreted["engine"]["tokens"] == want
