"""One inference instance: engine (Paddle model, paged KV cache, batcher, sampler, tokenizer)."""

import warnings

# Paddle warns about a missing ccache (a C++ extension build cache) at import; it means nothing here.
warnings.filterwarnings("ignore", message=".*ccache.*")
