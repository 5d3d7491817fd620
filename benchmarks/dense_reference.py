"""The bare baseline of engine_bench.py: the model's forward over a dense per-sequence KV cache.

No batcher, no block tables, no sampling or detokenization: the same weights, norms, RoPE and MLP
as ``pdserve.engine.cpu.paddle_model.Model`` (its own methods, the same kernel choice), with K/V kept per
sequence in a dense ``[batch, kv_heads, max_len, head_dim]`` tensor per layer and greedy argmax.
What the engine adds on top of this is what the benchmark's ratio measures.
"""

from __future__ import annotations

import time

import numpy as np
from step_timing import decode_figures, median_step_ms

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu.host_cpu import choose_kernels
from pdserve.engine.cpu.paddle_executor import set_threads
from pdserve.engine.cpu.paddle_model import Model
from pdserve.engine.cpu.paddle_setup import HOST, paddle
from pdserve.engine.cpu.paddle_setup import functional as F
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.weights import load_weights


class DenseRunner:
    """Prefill one prompt, or decode a batch that shares one context length, over a dense cache."""

    def __init__(self, model: Model, batch: int, max_len: int) -> None:
        cfg = model.cfg
        self.m, self.cfg = model, cfg
        shape = [batch, cfg.num_kv_heads, max_len, cfg.head_dim]
        self.k = [paddle.zeros(shape) for _ in range(cfg.num_layers)]
        self.v = [paddle.zeros(shape) for _ in range(cfg.num_layers)]
        self.max_len = max_len

    def _logits(self, x: paddle.Tensor) -> paddle.Tensor:
        m = self.m
        x = m._norm(x, m.w["norm"])
        if self.cfg.tie_word_embeddings:
            return paddle.matmul(x, m.w["embed"], transpose_y=True)
        return paddle.matmul(x, m.w["lm_head"])

    def _mlp(self, x: paddle.Tensor, layer: int) -> paddle.Tensor:
        m = self.m
        h = m._norm(x, m.w[f"l{layer}.post_norm"])
        return x + m._linear(m._swiglu(m._linear(h, f"l{layer}.gate_up")), f"l{layer}.down")

    def _qkv(self, x: paddle.Tensor, layer: int, pos: paddle.Tensor):
        m, cfg = self.m, self.cfg
        n = x.shape[0]
        h = m._norm(x, m.w[f"l{layer}.in_norm"])
        q, k, v = paddle.split(m._linear(h, f"l{layer}.qkv"), m.sizes, axis=-1)
        qcos, qsin = (paddle.index_select(t, pos).unsqueeze(1) for t in (m.qcos, m.qsin))
        cos, sin = (paddle.index_select(t, pos).unsqueeze(1) for t in (m.cos, m.sin))
        q = m._rope(q.reshape([n, cfg.num_heads, cfg.head_dim]), qcos, qsin)
        k = m._rope(k.reshape([n, cfg.num_kv_heads, cfg.head_dim]), cos, sin)
        return q, k, v.reshape([n, cfg.num_kv_heads, cfg.head_dim])

    def prefill(self, token_ids: list[int]) -> int:
        """Whole prompt in one pass into sequence 0's cache; returns the greedy next token."""
        m, n = self.m, len(token_ids)
        x = F.embedding(paddle.to_tensor(np.asarray(token_ids, np.int64)), m.w["embed"])
        pos = paddle.arange(n, dtype="int64")
        mask = paddle.to_tensor(np.triu(np.full((n, n), -np.inf, np.float32), 1))
        for layer in range(self.cfg.num_layers):
            q, k, v = self._qkv(x, layer, pos)
            self.k[layer][0, :, :n] = k.transpose([1, 0, 2])
            self.v[layer][0, :, :n] = v.transpose([1, 0, 2])
            x = x + m._linear(m.dense_causal_attention(q, k, v, mask), f"l{layer}.o")
            x = self._mlp(x, layer)
        return int(paddle.argmax(self._logits(x[-1:]), axis=-1).numpy()[0])

    def decode(self, token_ids: list[int], position: int) -> list[int]:
        """One token for each of the batch's sequences, all at ``position``; returns greedy tokens."""
        m, cfg = self.m, self.cfg
        b, kvh, d = len(token_ids), cfg.num_kv_heads, cfg.head_dim
        g = cfg.num_heads // kvh
        x = F.embedding(paddle.to_tensor(np.asarray(token_ids, np.int64)), m.w["embed"])
        pos = paddle.full([b], position, dtype="int64")
        visible = np.where(np.arange(self.max_len) <= position, 0.0, -np.inf).astype(np.float32)
        mask = paddle.to_tensor(visible.reshape(1, 1, 1, -1))
        for layer in range(cfg.num_layers):
            q, k, v = self._qkv(x, layer, pos)
            self.k[layer][:b, :, position] = k
            self.v[layer][:b, :, position] = v
            s = paddle.matmul(q.reshape([b, kvh, g, d]), self.k[layer][:b], transpose_y=True) + mask
            o = paddle.matmul(F.softmax(s, axis=-1), self.v[layer][:b]).reshape([b, cfg.num_heads * d])
            x = x + m._linear(o, f"l{layer}.o")
            x = self._mlp(x, layer)
        return paddle.argmax(self._logits(x), axis=-1).numpy().tolist()


def bare_worker(model_dir: str, steps: int, prefill_reps: int, ctx: int, batches: tuple[int, ...]) -> dict:
    """Runs in a child process: the same measurements as engine_bench.engine_worker."""
    cfg = ModelConfig.from_dir(model_dir)
    res: dict = {"threads": set_threads(None)}
    max_len = ctx + steps + 8
    kernels = EngineConfig().kernels
    if kernels is None:  # EngineConfig.__post_init__ resolves it (the environment, else "auto")
        raise RuntimeError("EngineConfig().kernels is unresolved")
    model = Model(cfg, load_weights(model_dir, cfg), max_len, choose_kernels(kernels, HOST))
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, ctx).tolist()
    runner = DenseRunner(model, 1, max_len)
    times = []
    for _ in range(prefill_reps + 1):  # the first one warms up
        t = time.perf_counter()
        runner.prefill(prompt)
        times.append(time.perf_counter() - t)
    res["prefill_s"] = min(times[1:])
    res["prefill_tok_s"] = ctx / res["prefill_s"]
    for b in batches:
        runner = DenseRunner(model, b, max_len)  # a ctx-token history: values irrelevant for timing
        tokens = rng.integers(3, cfg.vocab_size, b).tolist()
        runner.decode(tokens, ctx), runner.decode(tokens, ctx + 1)  # warm-up

        def step(i: int, tokens: list[int] = tokens, runner: DenseRunner = runner) -> None:
            tokens[:] = runner.decode(tokens, ctx + 2 + i)  # each step feeds the tokens it sampled

        res |= decode_figures(b, median_step_ms(step, steps))
    return res
