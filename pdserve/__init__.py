"""pdserve: prefill/decode disaggregated LLM serving on PaddlePaddle with a Redis control plane."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.worker.llm import LLM, Generation

__all__ = ["LLM", "Generation", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # keep `import pdserve` free of Paddle's ~1 s import
    if name in ("LLM", "Generation"):
        from pdserve.worker import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
