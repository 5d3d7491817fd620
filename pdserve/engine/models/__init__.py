"""Every model source, device-free: a model folder's config and files (``model_config``,
``model_folder``), presets and fetching (``model_store``), random and GGUF-imported checkpoints
(``model_init``, ``gguf_import``) and the safetensors weights as numpy arrays (``weights``). Both
platforms load from here; nothing here imports Paddle, torch or a platform package."""
