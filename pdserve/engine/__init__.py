"""Everything that computes: ``LLMEngine`` (requests in, per-step outputs out) and its parts.

The modules here are the core: the engine loop, scheduling (``batcher``, ``block_manager``,
``sequence``), sampling, grammars, outputs and settings, free of any tensor library. Around it:
``models/`` (every model source: config, weights, presets, GGUF import), ``tiers/`` (the host and
disk KV tiers), ``cpu/`` (the Paddle platform with its numba and MKL kernels) and ``cuda/`` (the
PyTorch platform with its Triton kernels). The core reaches a platform only through ``platform``
(``select_platform``), so the CPU path never loads torch and the CUDA path never loads Paddle. The
engine imports no Redis, no asyncio and nothing of the worker or the router: the instance service
(``pdserve.worker``) drives it from its own thread. Importing this package loads nothing heavy.
"""
