"""The CUDA platform: PyTorch runs the model on an NVIDIA GPU (``torch_executor``, ``torch_model``,
``torch_cache``, ``torch_sampler``, ``cuda_graphs``, ``replay_staging``), with Triton kernels and
their torch twins (``triton_attention``, ``layer_ops`` and the kernel modules). It never imports
Paddle, numba or ``pdserve.engine.cpu``; the engine's core reaches it only through
``pdserve.engine.platform``. Importing this package loads nothing."""
