"""The CPU platform: Paddle runs the model (``paddle_executor``, ``paddle_model`` with its causal
tiles in ``model_attention``, ``kv_cache``), with numba and MKL kernels chosen per host (``host_cpu``,
``paddle_setup``, ``attention``: the numba kernel sources, ``compiled_attention``: their compiled
calls and self-test, ``gemm``, ``int8``, ``fused_decode``). It never imports torch, Triton or ``pdserve.engine.cuda``; the engine's
core reaches it only through ``pdserve.engine.platform``. Importing this package loads nothing."""
