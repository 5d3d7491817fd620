"""Kernels chosen by the CPU: the floor check, the MKL tuning, and fused == composed numerically.

The composed path is what an AVX2-only CPU runs; ``kernels="composed"`` forces it on any CPU, so
both paths are exercised wherever the suite runs (the exactness tests run in both, too).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu import host_cpu as cpu
from pdserve.engine.cpu.paddle_setup import HOST, TUNING, paddle
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import ConfigError

HAS_FUSED_NORM = not HOST.missing(cpu.FUSED_RMS_NORM_NEEDS) and HOST.is_x86


def impl(k: cpu.Kernels) -> tuple[str, str]:
    return k.rms_norm, k.swiglu


def cpuinfo_text(vendor: str, model: str, flags: str) -> str:
    block = f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: {model}\nflags\t\t: {flags}\n"
    return block + "\n" + block.replace("processor\t: 0", "processor\t: 1")


ZEN3 = cpu.parse_cpuinfo(cpuinfo_text("AuthenticAMD", "AMD EPYC 7763", "fpu sse4_2 avx avx2 fma"), "x86_64")
SAPPHIRE = cpu.parse_cpuinfo(
    cpuinfo_text("GenuineIntel", "Intel Xeon Platinum 8480", "avx avx2 fma avx512f avx512bw amx_tile"),
    "x86_64",
)
SANDY = cpu.parse_cpuinfo(cpuinfo_text("GenuineIntel", "Intel Xeon E5-2670", "sse4_2 avx"), "x86_64")
ARM = cpu.parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd\n", "aarch64")


def test_cpuinfo_is_parsed_from_the_first_processor() -> None:
    assert ZEN3.vendor == "AuthenticAMD" and ZEN3.model == "AMD EPYC 7763" and ZEN3.is_amd
    assert "avx2" in ZEN3.flags and "avx512f" not in ZEN3.flags
    assert cpu.detect().arch  # this machine's own /proc/cpuinfo reads without error


def test_floor_refuses_a_cpu_without_avx2_naming_what_is_missing() -> None:
    with pytest.raises(ConfigError, match=r"Xeon E5-2670.*lacks avx2, fma"):
        cpu.check_floor(SANDY)
    for ok in (ZEN3, SAPPHIRE, ARM):
        cpu.check_floor(ok)


def test_auto_picks_fused_rms_norm_only_with_avx512f() -> None:
    assert impl(cpu.choose_kernels("auto", SAPPHIRE)) == ("fused", "fused")
    assert impl(cpu.choose_kernels("auto", ZEN3)) == ("composed", "fused")
    assert cpu.choose_kernels("auto", ARM).rms_norm == "composed"
    for host in (SAPPHIRE, ZEN3, ARM):
        assert impl(cpu.choose_kernels("composed", host)) == ("composed", "composed")


def test_forcing_fused_on_a_cpu_without_it_is_an_error_not_a_signal() -> None:
    with pytest.raises(ConfigError, match="fused_rms_norm needs avx512f"):
        cpu.choose_kernels("fused", ZEN3)
    with pytest.raises(ConfigError, match="PDSERVE_KERNELS"):
        cpu.choose_kernels("fastest", ZEN3)


def test_mkl_is_told_to_use_its_avx2_kernels_on_amd_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert cpu.tune_environment(ZEN3, env) == ["MKL_DEBUG_CPU_TYPE=5"] and env["MKL_DEBUG_CPU_TYPE"] == "5"
    mine = {"MKL_DEBUG_CPU_TYPE": ""}
    assert cpu.tune_environment(ZEN3, mine) == [] and mine == {"MKL_DEBUG_CPU_TYPE": ""}
    intel: dict[str, str] = {}
    assert cpu.tune_environment(SAPPHIRE, intel) == [] and intel == {}


def test_this_process_was_tuned_before_paddle_loaded() -> None:
    code = "import os, pdserve.engine.cpu.paddle_setup as s; print(os.environ.get('MKL_DEBUG_CPU_TYPE'), s.TUNING)"
    env = {k: v for k, v in __import__("os").environ.items() if k != "MKL_DEBUG_CPU_TYPE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    if HOST.is_amd:
        assert out.stdout.split()[0] == "5" and "MKL_DEBUG_CPU_TYPE=5" in out.stdout
    else:
        assert out.stdout.startswith("None [") and "MKL_DEBUG_CPU_TYPE" not in out.stdout


SHARED_TEAM = """
import os, numba, numpy as np
from pdserve.engine.cpu.paddle_setup import TUNING, paddle
from pdserve.engine.cpu.gemm import load_packed_mkl
paddle.base.core.set_num_threads(2)
mkl = load_packed_mkl()
mkl.matmul(np.ones((256, 256), np.float32), mkl.pack(np.ones((256, 256), np.float32)))
before = len(os.listdir("/proc/self/task"))
@numba.njit(parallel=True)
def total(a):
    s = 0.0
    for i in numba.prange(a.shape[0]):
        s += a[i]
    return s
numba.set_num_threads(2)
assert total(np.ones(100_000)) == 100_000
print(numba.threading_layer(), len(os.listdir("/proc/self/task")) - before, TUNING)
"""


@pytest.mark.parametrize("layer", [None, "workqueue"])
def test_numba_kernels_share_mkls_openmp_team_unless_the_user_chose(layer: str | None) -> None:
    """numba's parallel kernels run on Paddle's libiomp5 (paddle_setup.share_openmp): a parallel
    call after an MKL GEMM starts no thread of its own. A threading layer the user chose is kept."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_THREADING_LAYER"}
    env |= {"NUMBA_THREADING_LAYER": layer} if layer else {}
    out = subprocess.run(
        [sys.executable, "-c", SHARED_TEAM], capture_output=True, text=True, env=env, check=True
    )
    used, added, tuning = out.stdout.split(maxsplit=2)
    if layer is None:
        assert (used, added) == ("omp", "0") and "libiomp5" in tuning
    else:
        assert used == layer and int(added) >= 1 and "libiomp5" not in tuning


def test_sharing_openmp_needs_paddles_libiomp5(tmp_path) -> None:
    from pdserve.engine.cpu.paddle_setup import share_openmp

    assert share_openmp(tmp_path, {}) is None  # no libiomp5.so there
    assert share_openmp(tmp_path, {"NUMBA_THREADING_LAYER": "tbb"}) is None


def test_a_cpu_below_the_floor_gets_a_clear_error_from_the_cli(tiny_model_dir) -> None:
    """The floor check runs before Paddle is imported: exit 2 and a message, never SIGILL."""
    fake = cpuinfo_text("GenuineIntel", "Intel Xeon E5-2670", "sse4_2 avx")
    code = (
        "import sys, pdserve.engine.cpu.host_cpu as c\n"
        f"c.detect = lambda: c.parse_cpuinfo({fake!r}, 'x86_64')\n"
        "from pdserve.cli import main\n"
        f"sys.exit(main(['generate', '--model', {str(tiny_model_dir)!r}, '--prompt', 'hi']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "lacks avx2, fma" in out.stderr and "Traceback" not in out.stderr
    assert "paddle" not in out.stderr.lower().split("error:")[0]


def test_engine_logs_the_path_it_chose(tiny_model_dir, caplog) -> None:
    caplog.set_level("INFO", logger="pdserve.engine.cpu.paddle_executor")
    LLMEngine(tiny_model_dir, EngineConfig(num_blocks=16, kernels="composed"))
    line = next(r.getMessage() for r in caplog.records if "kernels" in r.getMessage())
    assert "rms_norm=composed, swiglu=composed" in line and HOST.describe() in line
    if TUNING:
        assert "MKL_DEBUG_CPU_TYPE=5" in line


def test_kernels_from_the_environment(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_KERNELS", "composed")
    assert LLMEngine(tiny_model_dir, EngineConfig(num_blocks=16)).executor.kernels.swiglu == "composed"


def rows(rng: np.random.Generator, m: int, h: int) -> paddle.Tensor:
    return paddle.to_tensor(rng.standard_normal((m, h), dtype=np.float32) * 3)


@pytest.mark.skipif(not HAS_FUSED_NORM, reason=f"fused_rms_norm needs avx512f; this CPU: {HOST.describe()}")
@pytest.mark.parametrize("m", [1, 5, 64])
def test_fused_and_composed_rms_norm_agree(m: int) -> None:
    from pdserve.engine.cpu.paddle_model import Model
    from pdserve.engine.models.model_config import ModelConfig

    cfg = ModelConfig("LlamaForCausalLM", 16, 256, 1, 4, 2, 64, 256, 8, rms_norm_eps=1e-6)
    model = Model(cfg, {"embed": np.zeros((16, 256), np.float32)}, 8, cpu.choose_kernels("auto", HOST))
    rng = np.random.default_rng(m)
    x, w = rows(rng, m, 256), paddle.to_tensor(rng.standard_normal(256, dtype=np.float32))
    fused, composed = model._fused_norm(x, w).numpy(), model._composed_norm(x, w).numpy()
    assert np.abs(fused - composed).max() <= 1e-5


@pytest.mark.parametrize("m", [1, 5, 64])
def test_fused_and_composed_swiglu_agree(m: int) -> None:
    from pdserve.engine.cpu.paddle_model import Model
    from pdserve.engine.cpu.paddle_setup import functional as F

    x = rows(np.random.default_rng(m), m, 512)
    assert np.abs(F.swiglu(x).numpy() - Model._composed_swiglu(x).numpy()).max() <= 1e-5


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_model_logits_agree_between_kernel_paths(tiny_model_dir, batch: int) -> None:
    """The whole model, prefill and decode, several prompts batched: max abs logit diff <= 1e-5."""
    prompts = [f"prompt {i}: " + "tokens to prefill and decode " * (1 + 3 * i) for i in range(batch)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    logits: dict[str, list[list[np.ndarray]]] = {}
    tokens: dict[str, list[list[int]]] = {}
    paths = set()
    for mode in ("auto", "composed"):
        engine = LLMEngine(
            tiny_model_dir,
            EngineConfig(num_blocks=128, keep_logits=True, kernels=mode, attention="reference"),
        )
        paths.add(impl(engine.executor.kernels))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy)
        per = [[] for _ in prompts]
        toks = [[] for _ in prompts]
        while engine.has_unfinished():
            for out in engine.step():
                toks[int(out.request_id)] += out.token_ids
                if out.logits is not None:
                    per[int(out.request_id)] += list(out.logits)
        logits[mode], tokens[mode] = per, toks
    assert len(paths) == 2  # two different code paths ran
    assert tokens["auto"] == tokens["composed"]
    diff = max(
        float(np.abs(a - b).max())
        for pa, pb in zip(logits["auto"], logits["composed"], strict=True)
        for a, b in zip(pa, pb, strict=True)
    )
    assert diff <= 1e-5, f"max abs logit diff {diff:.2e}"
