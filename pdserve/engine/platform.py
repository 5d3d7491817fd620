"""Which platform runs the model: Paddle on the CPU (``cpu/``), or PyTorch on an NVIDIA GPU
(``cuda/``): the engine's one seam to them.

``select_platform`` builds the :class:`~pdserve.engine.executor.Platform` that ``--device`` names,
importing ``pdserve.engine.cpu`` or ``pdserve.engine.cuda`` inside the function: no other module of
the engine's core names a platform package. Light to import: it loads neither Paddle nor torch, and
``auto`` decides without importing torch on a host that has no NVIDIA driver, so the CPU path never
loads torch and the CUDA path never loads Paddle.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.config import DEVICES, EngineConfig

if TYPE_CHECKING:
    from pdserve.engine.executor import Platform

log = logging.getLogger(__name__)


def nvidia_driver_present() -> bool:
    """A cheap look for an NVIDIA driver (no CUDA initialised, torch not imported)."""
    return Path("/proc/driver/nvidia/gpus").is_dir() or any(Path("/dev").glob("nvidia[0-9]*"))


def cuda_unavailable() -> str | None:
    """Why ``--device cuda`` cannot run on this host, or None when it can (imports torch only when a
    driver is there)."""
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed (pip install 'pdserve[cuda]')"
    if not nvidia_driver_present() and os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return "no NVIDIA driver on this host (/proc/driver/nvidia and /dev/nvidia* are missing)"
    import torch

    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no CUDA device (CUDA_VISIBLE_DEVICES, driver)"
    return None


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when a GPU is usable here, else ``cpu``; ``cuda`` checked, with the reason."""
    from pdserve.errors import ConfigError

    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return "cpu"
    reason = cuda_unavailable()
    if device == "cuda" and reason is not None:
        raise ConfigError(f"--device cuda: {reason}")
    if device == "auto" and reason is not None:
        log.info("device: cpu (%s)", reason)
        return "cpu"
    return "cuda"


def select_platform(config: EngineConfig) -> Platform:
    """The platform ``config.device`` names (``auto`` resolved here)."""
    assert config.device is not None  # EngineConfig.__post_init__ resolves it
    device = resolve_device(config.device)
    if device == "cuda":
        from pdserve.engine.cuda.torch_executor import TorchPlatform

        return TorchPlatform(f"cuda:{config.gpu or 0}")
    from pdserve.engine.cpu.paddle_executor import PaddlePlatform

    return PaddlePlatform()
