"""Everything that computes: ``LLMEngine`` (requests in, per-step outputs out) and its parts.

The bookkeeping (``batcher``, ``block_manager``, ``sequence``, ``outputs``) is free of the tensor
library; ``model``, ``model_runner``, ``kv_cache``, ``weights`` and ``sampler`` run Paddle;
``kernels/`` holds what is chosen per host (CPU detection, Paddle set-up, the numba attention
kernels, the packed GEMM). The engine imports no Redis, no asyncio and nothing of the worker or the
router: the instance service (``pdserve.worker``) drives it from its own thread. Importing this
package loads nothing heavy.
"""
