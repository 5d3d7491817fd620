"""The GPU tests (marker ``gpu``): each needs an NVIDIA GPU that PyTorch sees. On any other host every
test here is skipped, and the run says why once in its header and per test in the skip reason.

Run them alone with ``python -m pytest -q -m gpu tests/gpu`` (benchmarks/gpu_check.sh does, on the
GPU machine)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@functools.cache
def cuda_skip_reason() -> str | None:
    """Why the GPU tests cannot run here (PyTorch missing, CPU-only, no driver, no device), or None."""
    from pdserve.engine.platform import cuda_unavailable

    return cuda_unavailable()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs an NVIDIA GPU with PyTorch (CUDA); skipped with the reason elsewhere"
    )


def pytest_report_header(config: pytest.Config) -> str:
    reason = cuda_skip_reason()
    if reason is not None:
        return f"gpu tests: SKIPPED on this host: {reason}"
    import torch

    return (
        f"gpu tests: on {torch.cuda.get_device_name(0)} (torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s))"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test in this folder carries ``gpu``, and is skipped with the reason where no GPU is."""
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        reason = cuda_skip_reason()
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}"))
