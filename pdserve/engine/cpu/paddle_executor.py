"""The CPU platform: the model in Paddle with numba kernels and MKL's GEMMs, the KV cache in host
memory (a shared-memory segment on a decode instance, which a same-host prefill writes into)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu.attention import select_attention
from pdserve.engine.cpu.fused_decode import select_decode
from pdserve.engine.cpu.gemm import select_gemm
from pdserve.engine.cpu.host_cpu import choose_kernels, usable_cores
from pdserve.engine.cpu.int8 import select_weights
from pdserve.engine.cpu.kv_cache import KVCache
from pdserve.engine.cpu.paddle_model import Model
from pdserve.engine.cpu.paddle_setup import HOST, TUNING, paddle
from pdserve.engine.executor import Executor
from pdserve.engine.kv_layout import block_bytes
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.weights import iter_weights
from pdserve.engine.step_input import StepInput
from pdserve.errors import ConfigError

log = logging.getLogger(__name__)


def set_threads(n: int | None) -> int:
    """Paddle pins OpenMP to one thread at import; raise it (there is no public setter). Default:
    the cores this process may run on (``usable_cores``), not the machine's."""
    n = n or usable_cores()
    paddle.base.core.set_num_threads(n)
    return n


def kv_blocks(config: EngineConfig, block_bytes: int) -> int:
    """``--num-blocks``, else as many blocks as ``--kv-cache-gb`` holds (at least 2)."""
    num_blocks = config.num_blocks or int(config.kv_cache_gb * 2**30 // block_bytes)
    if num_blocks < 2:
        raise ConfigError(f"kv_cache_gb={config.kv_cache_gb} holds fewer than 2 KV blocks")
    return num_blocks


class PaddleExecutor(Executor):
    """The CPU engine's model, cache and runner, with the kernels this host runs."""

    cache: KVCache
    device = "cpu"
    device_name = None
    dtype = "float32"

    def __init__(self, model_dir: Path, mc: ModelConfig, config: EngineConfig, max_model_len: int) -> None:
        if config.dtype not in (None, "auto", "float32"):
            raise ConfigError(f"--dtype {config.dtype}: the CPU engine computes in float32 only")
        # Paddle's eager mode is per thread, on only in the thread that first imported it: this one
        # may be another (a worker builds its engine on the engine thread, which runs every step)
        paddle.disable_static()
        self.threads = set_threads(config.threads)
        # EngineConfig.__post_init__ resolves each kernel setting left unset (environment or "auto")
        assert config.kernels and config.attention and config.gemm and config.decode_step and config.weights
        self.kernels = choose_kernels(config.kernels, HOST)
        log.info(
            "CPU %s: kernels %s%s",
            HOST.describe(),
            self.kernels.describe(),
            f"; applied {', '.join(TUNING)}" if TUNING else "",
        )
        self.attention = select_attention(config.attention, self.threads)
        log.info("attention: %s (%s)", self.attention.impl, self.attention.reason)
        self.gemm = select_gemm(config.gemm)
        self.int8 = select_weights(config.weights, self.threads)
        if self.int8 is None:
            log.info("gemm: %s (%s)", self.gemm.impl, self.gemm.reason)
        else:
            log.info("weights: int8 per output channel (numba dot products, MKL's sgemm above 4 rows)")
        self.weights = str(config.weights)
        self.decode_step = select_decode(config.decode_step, self.attention.kernel, self.gemm.mkl, self.int8)
        log.info("decode step: %s (%s)", self.decode_step.impl, self.decode_step.reason)
        self.model = Model(
            mc,
            iter_weights(model_dir, mc),  # streamed: each packed weight's plain copy freed at once
            max_model_len,
            self.kernels,
            self.attention.kernel,
            self.gemm.mkl,
            self.decode_step.fused,
            self.int8,
        )
        self.weight_bytes = self.model.weight_bytes
        self.num_blocks = kv_blocks(config, block_bytes(mc, config.block_size))
        self.cache = KVCache(
            mc, self.num_blocks, config.block_size, shared=config.shared_kv, shm_name=config.shm_name
        )
        self.batch_invariant = bool(config.batch_invariant)
        self.runner = ModelRunner(
            self.cache,
            batch_invariant=self.batch_invariant,
            threads=self.threads,
            paged_kernel=self.attention.kernel is not None,
        )

    def forward(self, step: StepInput) -> np.ndarray | None:
        return self.model.forward(self.cache, step)


class PaddlePlatform:
    name = "cpu"

    def executor(
        self, model_dir: Path, mc: ModelConfig, config: EngineConfig, max_model_len: int
    ) -> PaddleExecutor:
        return PaddleExecutor(model_dir, mc, config, max_model_len)
