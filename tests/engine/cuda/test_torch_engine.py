"""The torch platform's engine, run on torch's CPU device: the CUDA runner's own code (TorchModel,
its paged cache, ModelRunner's paged layout, the KV hand-off) checked here, where CI has no GPU.

Float32 logits against the float64 numpy reference (written from the Hugging Face architecture, not
from pdserve's code), chunked prefill against one chunk, a prefix-cache hit against a miss, the
KV hand-off between two engines against one engine, and seeded weights against themselves. What
needs a GPU (the Triton kernels compiled, CUDA graphs, CUDA IPC, speed) is in tests/gpu/.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch platform needs PyTorch (pip install 'pdserve[cuda]')")

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.cuda.torch_executor import TorchPlatform  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from reference_llama import ReferenceLlama  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(5, 12)), list(range(40, 77)), [3, 9, 27, 81, 243, 729] * 7]  # 7, 37, 42 tokens


def engine(model: Path, **kw: object) -> LLMEngine:
    config = EngineConfig(num_blocks=64, device="cpu", keep_logits=True, **kw)  # type: ignore[arg-type]
    return LLMEngine(model, config, platform=TorchPlatform("cpu"))


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> dict[str, list]:
    """Each request's (tokens, logits rows) after the engine finished them all."""
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", prompt_token_ids=ids, params=params)
    out: dict[str, list] = {f"r{i}": [[], []] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id][0].extend(o.token_ids)
            if o.logits is not None:
                out[o.request_id][1].append(o.logits)
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> ReferenceLlama:
    return ReferenceLlama(tiny_model_dir)


@pytest.fixture(scope="module")
def generated(tiny_model_dir: Path) -> dict[str, list]:
    return run(engine(tiny_model_dir), PROMPTS)


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_float32_logits_match_the_float64_reference(generated, reference, index: int) -> None:
    """Every step's logits (the prefill's and each decode step's, read through the paged cache)
    within 1e-4 of the reference relative to the logits' scale, and greedy tokens its argmax."""
    tokens, logits = generated[f"r{index}"]
    prompt = PROMPTS[index]
    want = reference.logits(prompt + tokens, slice(len(prompt) - 1, len(prompt) + len(tokens) - 1))
    got = np.stack(logits)
    assert got.shape == want.shape
    scale = np.abs(want).max()
    assert np.abs(got - want).max() / scale < 1e-4
    assert tokens == [int(t) for t in want.argmax(axis=-1)]


def test_steps_pick_on_the_device_and_only_ids_cross(tiny_model_dir: Path, generated) -> None:
    """Without logits kept, every step's tokens are picked where the logits are (a plain argmax for
    greedy rows, the device sampler's draw for sampled ones): the host-side sampler's tokens, and
    no [rows, vocab] logits on the host (tests/engine/test_device_sampling.py: every setting)."""
    eng = LLMEngine(tiny_model_dir, EngineConfig(num_blocks=64, device="cpu"), platform=TorchPlatform("cpu"))
    plans = []
    sample = eng.executor.sample
    eng.executor.sample = lambda logits, plan: plans.append(plan) or sample(logits, plan)  # type: ignore[method-assign]
    eng.executor.forward = None  # type: ignore[assignment,method-assign]  # logits to the host: never
    out = run(eng, PROMPTS)
    assert {k: v[0] for k, v in out.items()} == {k: v[0] for k, v in generated.items()}
    assert plans and all(p.plain and p.vocab_limit == eng.sampler.vocab_limit for p in plans)
    sampled = run(eng, [PROMPTS[0]], SamplingParams(temperature=0.8, seed=1, max_tokens=3))
    assert len(sampled["r0"][0]) == 3 and not plans[-1].plain and not plans[-1].greedy[0]


def test_chunked_prefill_gives_an_unchunked_prompt_s_tokens(tiny_model_dir: Path, generated) -> None:
    """Chunks of 16 (later chunks read earlier ones' K/V through the block table) against one chunk."""
    chunked = run(engine(tiny_model_dir, prefill_chunk_size=16), PROMPTS)
    for key, (tokens, logits) in generated.items():
        assert chunked[key][0] == tokens
        np.testing.assert_allclose(np.stack(chunked[key][1]), np.stack(logits), atol=2e-5, rtol=0)


def test_a_prefix_cache_hit_gives_the_tokens_a_miss_gives(tiny_model_dir: Path, generated) -> None:
    eng = engine(tiny_model_dir)
    run(eng, [PROMPTS[2]])  # fills the prefix cache with its two full blocks
    again = run(eng, [PROMPTS[2] + [5, 6]])["r0"]
    assert eng.blocks.num_cached >= 2
    fresh = run(engine(tiny_model_dir, prefix_caching=False), [PROMPTS[2] + [5, 6]])["r0"]
    assert again[0] == fresh[0]
    np.testing.assert_allclose(np.stack(again[1]), np.stack(fresh[1]), atol=2e-5, rtol=0)


def test_a_block_read_back_from_the_host_tier_gives_the_tokens_a_miss_gives(tiny_model_dir: Path) -> None:
    """The torch platform's cache through the host tier: evicted blocks copied out of the tensor and
    written back into other blocks of it (index_copy_) continue as an uncached engine's would."""
    prompt = PROMPTS[2] + [5, 6]
    fresh = run(engine(tiny_model_dir, prefix_caching=False), [prompt])["r0"]
    config = EngineConfig(num_blocks=8, device="cpu", keep_logits=True, kv_host_bytes=16 << 20)
    eng = LLMEngine(tiny_model_dir, config, platform=TorchPlatform("cpu"))
    run(eng, [PROMPTS[2]])  # its two full blocks cached
    run(eng, [list(range(200, 306))])  # the whole pool: the cached blocks are evicted into the tier
    assert eng.host_tier is not None and eng.host_tier.num_blocks >= 2 and eng.blocks.num_evicted >= 2
    again = run(eng, [prompt])["r0"]
    assert eng.host_tier.stats.hits == 2
    assert again[0] == fresh[0]
    np.testing.assert_allclose(np.stack(again[1]), np.stack(fresh[1]), atol=2e-5, rtol=0)


def test_a_block_read_back_from_the_disk_tier_gives_the_tokens_a_miss_gives(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The torch platform's cache through the disk tier (no host tier): evicted blocks copied out
    of the tensor into files and written back into other blocks continue as an uncached engine's."""
    prompt = PROMPTS[2] + [5, 6]
    fresh = run(engine(tiny_model_dir, prefix_caching=False), [prompt])["r0"]
    config = EngineConfig(
        num_blocks=8, device="cpu", keep_logits=True, kv_disk_path=str(tmp_path), kv_disk_bytes=16 << 20
    )
    eng = LLMEngine(tiny_model_dir, config, platform=TorchPlatform("cpu"))
    run(eng, [PROMPTS[2]])  # its two full blocks cached
    run(eng, [list(range(200, 306))])  # the whole pool: the cached blocks are evicted to disk
    assert eng.disk_tier is not None and eng.host_tier is None
    eng.disk_tier.flush()
    again = run(eng, [prompt])["r0"]
    assert eng.disk_tier.stats.hits == 2 and eng.disk_tier.stats.corrupt == 0
    assert again[0] == fresh[0]
    np.testing.assert_allclose(np.stack(again[1]), np.stack(fresh[1]), atol=2e-5, rtol=0)


def test_the_kv_hand_off_between_two_engines_continues_exactly(tiny_model_dir: Path) -> None:
    """Prefill on one engine, its blocks' bytes imported into another's reserved blocks, decoding
    there: the tokens of one engine doing both (PD == mixed), bit for bit."""
    prompt, params = PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    mixed = run(engine(tiny_model_dir), [prompt], params)["r0"][0]
    prefill, decode = engine(tiny_model_dir), engine(tiny_model_dir)
    prefill.add_request("k", prompt_token_ids=prompt, params=params, prefill_only=True)
    first = None
    while first is None:
        first = next((o for o in prefill.step() if o.prefilled), None)
    decode.reserve("k", len(prompt))
    decode.import_kv("k", prefill.export_kv("k"))
    decode.add_prefilled("k", prompt, first.token_ids[0], params)
    tokens = list(first.token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            tokens.extend(o.token_ids)
    assert tokens == mixed
    assert prefill.facts().device == "cpu" and prefill.facts().dtype == "float32"


def test_decode_through_the_graph_buckets_static_buffers_gives_the_same_steps(
    tiny_model_dir, generated
) -> None:
    """Decode steps through DecodeGraphs' padded static buffers (buckets 1, 2, 4: three sequences run
    in bucket 4 with one padding row in the null block; tables as wide as the longest context),
    here uncaptured (eager): the same tokens and logits as the plain path."""
    from pdserve.engine.cuda.cuda_graphs import DecodeGraphs, bucket_for, graph_buckets

    assert graph_buckets(4) == [1, 2, 4] and graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1] and bucket_for(3, [1, 2, 4]) == 4 and bucket_for(5, [1, 2, 4]) is None
    eng = engine(tiny_model_dir, max_num_seqs=4)
    ex = eng.executor
    ex.graphs = DecodeGraphs(ex.model, ex.cache.tensor, 4, 2048 // 16)
    calls = []
    run_bucket = ex.graphs.run
    ex.graphs.run = lambda *a: calls.append(a[0].shape[0]) or run_bucket(*a)
    out = run(eng, PROMPTS)
    assert 3 in calls  # a step of three decodes went through bucket 4
    for key, (tokens, logits) in generated.items():
        assert out[key][0] == tokens
        np.testing.assert_allclose(np.stack(out[key][1]), np.stack(logits), atol=2e-5, rtol=0)


def test_the_shared_cache_is_the_shm_segment_a_same_host_writer_fills(tiny_model_dir: Path) -> None:
    """On torch's CPU device a decode cache lies in the instance's shm segment: its raw bytes are the
    tensor's (what the shm transport writes), and closing the engine removes the segment."""
    config = EngineConfig(num_blocks=8, device="cpu", shared_kv=True, shm_name="pdserve-torch-test")
    eng = LLMEngine(tiny_model_dir, config, platform=TorchPlatform("cpu"))
    view = eng.kv_view()
    assert isinstance(view, np.ndarray) and view.nbytes == eng.cache.nbytes
    view[eng.cache.block_bytes : eng.cache.block_bytes + 4] = [0, 0, 128, 63]  # 1.0 as float32
    assert eng.cache.tensor[1].flatten()[0].item() == 1.0  # type: ignore[attr-defined]
    assert Path("/dev/shm/pdserve-torch-test").exists()
    del view
    eng.close()
    assert not Path("/dev/shm/pdserve-torch-test").exists()


def test_bfloat16_on_the_cpu_device_stays_near_float32(tiny_model_dir: Path, generated) -> None:
    """The GPU's dtype, run here: bfloat16 weights and cache give the first step's logits within a
    few percent of float32's (bf16 keeps 8 bits of mantissa) and the same first token; the cache's
    blocks are half as large. (Over 512 teacher-forced tokens, benchmarks/bf16_agreement.py: 99.8 %
    of tiny's positions, 100 % of the real SmolLM2's; tests/engine/test_bf16_agreement.py runs it.)"""
    bf16 = engine(tiny_model_dir, dtype="bfloat16")
    out = run(bf16, PROMPTS)
    for key, (tokens, logits) in generated.items():
        want = logits[0]
        assert np.abs(out[key][1][0] - want).max() / np.abs(want).max() < 0.05
        assert out[key][0][0] == tokens[0]
    assert bf16.facts().dtype == "bfloat16" and bf16.facts().weights == "bf16"
    assert bf16.facts().block_bytes * 2 == engine(tiny_model_dir).facts().block_bytes


def test_a_seeded_folder_loads_the_same_weights_each_time(tmp_path: Path) -> None:
    from pdserve.engine.models.model_init import init_model
    from pdserve.engine.models.weights import hf_tensors

    a = init_model(tmp_path / "a", preset="tiny", seed=3, seeded=True)
    assert not list(a.glob("*.safetensors"))
    first, second = dict(hf_tensors(a)), dict(hf_tensors(a))
    assert first.keys() == second.keys() and "lm_head.weight" in first
    assert all(np.array_equal(first[k], second[k]) for k in first)
    other = dict(hf_tensors(init_model(tmp_path / "b", preset="tiny", seed=4, seeded=True)))
    assert not np.array_equal(first["model.norm.weight"], other["model.norm.weight"])
    out = run(engine(a), [PROMPTS[0]])["r0"]
    want = ReferenceLlama(a).logits(PROMPTS[0] + out[0], slice(len(PROMPTS[0]) - 1, -1))
    assert out[0] == [int(t) for t in want.argmax(axis=-1)]


def test_cuda_is_refused_with_the_reason_on_a_host_without_a_gpu(tiny_model_dir: Path) -> None:
    from pdserve.engine.platform import cuda_unavailable, resolve_device
    from pdserve.errors import ConfigError

    reason = cuda_unavailable()
    if reason is None:
        pytest.skip("this host has a usable GPU")
    with pytest.raises(ConfigError, match="--device cuda: "):
        LLMEngine(tiny_model_dir, EngineConfig(num_blocks=8, device="cuda"))
    assert resolve_device("auto") == "cpu"


def test_the_triton_kernels_run_the_engine_under_triton_s_interpreter(
    tiny_model_dir: Path, generated
) -> None:
    """The engine with the Triton paged-attention kernels (interpreted on the CPU: the GPU's kernels'
    own code) gives the torch attention's tokens."""
    code = (
        "import json, sys\n"
        "from pdserve.engine.config import EngineConfig\n"
        "from pdserve.engine.llm_engine import LLMEngine\n"
        "from pdserve.engine.cuda.torch_executor import TorchPlatform\n"
        "from pdserve.sampling_params import SamplingParams\n"
        "e = LLMEngine(sys.argv[1], EngineConfig(num_blocks=64, device='cpu', prefill_chunk_size=16),"
        " platform=TorchPlatform('cpu'))\n"
        "assert e.executor.attention.impl == 'triton', e.executor.attention\n"
        "p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)\n"
        "e.add_request('r1', prompt_token_ids=json.loads(sys.argv[2]), params=p)\n"
        "out = []\n"
        "while e.has_unfinished():\n"
        "    out += [t for o in e.step() for t in o.token_ids]\n"
        "print(json.dumps(out))\n"
    )
    import json
    import os

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model_dir), json.dumps(PROMPTS[1])],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == generated["r1"][0]
