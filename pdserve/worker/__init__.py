"""One inference instance: engine (Paddle model, paged KV cache, batcher, sampler, tokenizer)."""
