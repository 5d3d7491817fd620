"""The torch platform on a real GPU: what tests/engine/cuda/test_torch_engine.py cannot check on torch's CPU
device. Float32 on CUDA (TF32 off) against the float64 numpy reference, CUDA graphs against eager
steps, bfloat16 against float32 over 512 greedy tokens, a prefix-cache hit against a miss, and the
compiled Triton paged-attention kernels against the torch versions (and inside a CUDA graph).

Skipped with the reason on a host without a GPU (conftest.py). benchmarks/gpu_bench.py measures the
same exactness on the larger presets, and the speed.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch (pip install 'pdserve[cuda]')")

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from reference_llama import ReferenceLlama, relative_error  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(5, 12)), list(range(40, 77)), [3, 9, 27, 81, 243, 729] * 7]  # 7, 37, 42 tokens
AGREE_TOKENS = 512


@contextlib.contextmanager
def cuda_engine(model: Path, **kw: object) -> Iterator[LLMEngine]:
    """An engine on cuda:0, its GPU memory handed back afterwards (tests build several in turn)."""
    config = EngineConfig(device="cuda", num_blocks=512, max_num_seqs=8, **kw)  # type: ignore[arg-type]
    eng = LLMEngine(model, config)
    try:
        yield eng
    finally:
        eng.close()
        del eng
        gc.collect()
        torch.cuda.empty_cache()


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    """Each prompt's tokens, kept logits rows, prompt logprobs and cached prompt tokens, in order."""
    out = [{"tokens": [], "logits": [], "prompt_logprobs": None, "cached": 0} for _ in prompts]
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", prompt_token_ids=ids, params=params)
    while eng.has_unfinished():
        for o in eng.step():
            r = out[int(o.request_id[1:])]
            assert o.error is None, o.error
            r["tokens"] += o.token_ids
            if o.logits is not None:
                r["logits"].append(o.logits)
            if o.prompt_logprobs is not None:
                r["prompt_logprobs"] = o.prompt_logprobs
            r["cached"] = max(r["cached"], o.num_cached_tokens)
    return out


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


# ---- the engine ----------------------------------------------------------------------------------
def test_float32_on_cuda_matches_the_float64_reference(tiny_model_dir: Path) -> None:
    """Each step's logits (the prefill's and every decode step's, attention through the compiled
    Triton kernels and the paged cache, under CUDA graphs) within 1e-3 of the reference relative to
    the logits' scale, and every greedy token the reference's argmax."""
    with cuda_engine(tiny_model_dir, dtype="float32", keep_logits=True) as eng:
        assert eng.executor.attention.impl == "triton", eng.executor.attention.reason
        assert not torch.backends.cuda.matmul.allow_tf32
        out = run(eng, PROMPTS, greedy(6))
    reference = ReferenceLlama(tiny_model_dir)
    for prompt, r in zip(PROMPTS, out):
        want = reference.logits(prompt + r["tokens"], slice(len(prompt) - 1, len(prompt) + 5))
        got = np.stack(r["logits"])
        assert got.shape == want.shape
        err = relative_error(got, want)
        print(f"prompt of {len(prompt)} tokens: max |f32 - f64| / max |f64| = {err:.2e}")
        assert err <= 1e-3
        assert r["tokens"] == [int(t) for t in want.argmax(axis=-1)]


@pytest.mark.parametrize(
    ("dtype", "max_model_len"),
    [("bfloat16", 256), ("float32", 2048)],
    ids=["bf16-one-split", "f32-split-decode"],
)
def test_cuda_graphs_on_and_off_give_the_same_greedy_tokens(
    tiny_model_dir: Path, dtype: str, max_model_len: int
) -> None:
    """A batch of 4 (a graph bucket: no padding rows) decoded through captured graphs and eagerly.
    With 256 positions the decode kernel runs one split either way (bf16 bit for bit); with 2048 the
    graph's wide tables split the context where an eager step's narrow ones do not (float32: the
    merge rounds differently, far below any greedy choice)."""
    prompts = [*PROMPTS, list(range(100, 160))]
    runs = {}
    for graphs in (True, False):
        with cuda_engine(tiny_model_dir, dtype=dtype, max_model_len=max_model_len, cuda_graphs=graphs) as eng:
            assert (eng.executor.graphs is not None) == graphs
            replays = []
            if graphs:
                real = eng.executor.graphs.run

                def counted(*args: object, real=real, replays=replays) -> object:
                    out = real(*args)
                    replays.append(out is not None)
                    return out

                eng.executor.graphs.run = counted  # type: ignore[method-assign]
            runs[graphs] = [r["tokens"] for r in run(eng, prompts, greedy(48))]
            if graphs:
                assert sum(replays) >= 40, f"{sum(replays)} decode steps replayed a graph"
    assert runs[True] == runs[False]


def real_smollm2() -> Path:
    """The real SmolLM2-135M-Instruct where this machine's pdserve model cache holds its import
    (PDSERVE_CACHE_DIR; never fetched here: the GPU machine reaches no package index)."""
    from pdserve.engine.models.model_store import FETCHED_PRESETS, models_dir

    key = f"smollm2-135m-{FETCHED_PRESETS['smollm2-135m'].member_sha256[:12]}"
    found = sorted(models_dir().glob(f"{key}-v*/config.json"))
    if not found:
        pytest.skip(f"the real SmolLM2-135M is not imported in {models_dir()} on this machine")
    return found[-1].parent


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_bfloat16_greedy_agrees_with_float32_on_512_tokens(tiny_model_dir: Path, model: str) -> None:
    """float32 greedy for 512 tokens; bfloat16 then reads those tokens as its prompt (teacher forcing:
    a free-running comparison would count every token after the first near-tie as a miss) and its
    argmax at each position (the rank of float32's token in its prompt logprobs) must be float32's
    token at >= 99 % of the positions. On the random tiny model 28 % of the positions are within
    0.1 nats of a tie (torch's CPU device: 99.8 %, one miss); the real SmolLM2, from a chat prompt,
    is the check that means something (CPU: 100 %; benchmarks/bf16_agreement.py)."""
    folder = tiny_model_dir if model == "tiny" else real_smollm2()
    prompt = list(range(20, 44))
    if model != "tiny":
        from pdserve.tokenizer import Tokenizer

        text = "Write a long, detailed essay on the history of the printing press in Europe."
        prompt = Tokenizer.from_dir(folder).prompt_ids(messages=[{"role": "user", "content": text}])
    with cuda_engine(folder, dtype="float32", max_model_len=1024) as eng:
        f32 = run(eng, [prompt], greedy(AGREE_TOKENS))[0]["tokens"]
    assert len(f32) == AGREE_TOKENS
    with cuda_engine(folder, dtype="bfloat16", max_model_len=1024) as eng:
        forced = run(eng, [prompt + f32[:-1]], greedy(1, prompt_logprobs=0))[0]
    ranks = [lp.rank for lp in forced["prompt_logprobs"][len(prompt) :]]
    hits = [rank == 1 for rank in ranks] + [forced["tokens"][0] == f32[-1]]
    assert len(hits) == AGREE_TOKENS
    agreement = sum(hits) / len(hits)
    print(f"bf16 argmax = f32 token at {agreement:.2%} of {len(hits)} positions")
    assert agreement >= 0.99, [i for i, h in enumerate(hits) if not h]


def test_a_prefix_cache_hit_gives_the_tokens_a_miss_gives(tiny_model_dir: Path) -> None:
    """float32 (TF32 off): a prompt whose 3 full blocks are cached, and one that shares only its
    first 2, continue exactly as the same prompts on an engine without prefix caching."""
    base = list(range(200, 253))  # 3 full blocks of 16 and 5 tokens more
    other = base[:32] + list(range(900, 921))  # shares 2 blocks
    with cuda_engine(tiny_model_dir, dtype="float32") as eng:
        first = run(eng, [base], greedy(16))[0]
        hits = run(eng, [base, other], greedy(16))
    with cuda_engine(tiny_model_dir, dtype="float32", prefix_caching=False) as eng:
        fresh = run(eng, [base, other], greedy(16))
    assert first["cached"] == 0
    assert hits[0]["cached"] == 48 and hits[1]["cached"] == 32
    assert first["tokens"] == fresh[0]["tokens"]
    assert hits[0]["tokens"] == fresh[0]["tokens"]
    assert hits[1]["tokens"] == fresh[1]["tokens"]


# ---- the paged-attention kernels -----------------------------------------------------------------
def paged_inputs(
    lengths: list[int],
    dtype: torch.dtype,
    *,
    heads: int = 8,
    kv_heads: int = 2,
    dim: int = 128,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache, tables, lengths) on cuda:0: each sequence's blocks drawn at random from 1.., every slot
    no sequence uses NaN (a kernel that reads one shows it), tables padded with the null block."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    block_size, layers = 16, 2
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 8
    cache = torch.full(
        (num_blocks, 2, layers, block_size, kv_heads, dim), float("nan"), dtype=dtype, device="cuda"
    )
    perm = torch.randperm(num_blocks - 1, generator=g, device="cuda").add_(1).tolist()
    tables = torch.zeros((len(lengths), max(need)), dtype=torch.int32)
    rows, slots = [], []
    for i, (n, k) in enumerate(zip(lengths, need)):
        blocks = [perm.pop() for _ in range(k)]
        tables[i, :k] = torch.tensor(blocks)
        rows += [blocks[p // block_size] for p in range(n)]
        slots += [p % block_size for p in range(n)]
    values = torch.randn((len(rows), 2, layers, kv_heads, dim), generator=g, device="cuda")
    cache[torch.tensor(rows, device="cuda"), :, :, torch.tensor(slots, device="cuda")] = values.to(dtype)
    return cache, tables.cuda(), torch.tensor(lengths, dtype=torch.int32, device="cuda")


TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "lengths",
    [[1, 15, 16, 17, 100, 333], [int(n) for n in np.random.default_rng(1).integers(1, 700, 40)]],
    ids=["edges", "batch40-split"],
)
def test_triton_decode_attention_matches_torch(dtype: torch.dtype, lengths: list[int]) -> None:
    """Decode over the paged cache: block edges, a partial last block, and a batch small enough that
    the kernel splits each context over several programs and merges them."""
    from pdserve.engine.cuda import triton_attention as ta

    assert ta.triton_unavailable(torch.device("cuda:0")) is None
    cache, tables, lens = paged_inputs(lengths, dtype)
    q = torch.randn((len(lengths), 8, 128), device="cuda").to(dtype)
    for layer in (0, 1):
        got = ta.paged_decode_attention(q, cache, layer, tables, lens, 128**-0.5)
        want = ta.torch_paged_decode_attention(q, cache, layer, tables, lens, 128**-0.5)
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize(("start", "n"), [(0, 64), (200, 100), (37, 1)], ids=["first", "later", "one"])
def test_triton_prefill_attention_matches_torch(dtype: torch.dtype, start: int, n: int) -> None:
    """A prefill chunk at ``start`` attending causally to everything before it through the table."""
    from pdserve.engine.cuda import triton_attention as ta

    cache, tables, _ = paged_inputs([start + n], dtype, dim=64, seed=3)
    q = torch.randn((n, 8, 64), device="cuda").to(dtype)
    got = ta.paged_prefill_attention(q, cache, 1, tables[0], start, 0.125)
    want = ta.torch_paged_prefill_attention(q, cache, 1, tables[0], start, 0.125)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


def test_triton_decode_attention_replays_in_a_cuda_graph() -> None:
    """Captured once for a batch and table width, replayed with other lengths: the eager call's output."""
    from pdserve.engine.cuda import triton_attention as ta

    cache, tables, lens = paged_inputs([40, 300, 7, 129], torch.bfloat16, seed=5)
    q = torch.randn((4, 8, 128), device="cuda").to(torch.bfloat16)
    static_lens = lens.clone()
    ta.paged_decode_attention(q, cache, 0, tables, static_lens, 0.1)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.paged_decode_attention(q, cache, 0, tables, static_lens, 0.1)
    for new in ([40, 300, 7, 129], [1, 17, 7, 64], [33, 299, 2, 128]):
        static_lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        want = ta.paged_decode_attention(q, cache, 0, tables, static_lens, 0.1)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
