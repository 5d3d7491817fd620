"""pdserve: prefill/decode disaggregated LLM serving on PaddlePaddle with a Redis control plane.

The public names load on first use: ``import pdserve`` (and so importing any submodule) loads
neither Paddle (~1 s) nor redis-py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM, Generation
    from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "Generation", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":
        from pdserve.sampling_params import SamplingParams

        return SamplingParams
    if name in ("LLM", "Generation"):
        from pdserve.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
