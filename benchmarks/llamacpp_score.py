"""llama.cpp's greedy choices along given token sequences: the llama.cpp columns of int8_accuracy.py.

Runs with the Python of benchmarks/llamacpp_env.sh's environment (imports nothing of pdserve's):

    .llamacpp/bin/python benchmarks/llamacpp_score.py MODEL.gguf < sequences.json

Reads ``{"sequences": [[token ids], ...], "starts": [n, ...]}``; for each sequence evaluates all of
it once (``logits_all``) and prints ``RESULT {json}`` with, per sequence, the argmax token after each
position from ``start - 1`` on (the choice that predicts token ``start``, ``start + 1``, ...) and the
logits row at ``start - 1`` (the first generated token's distribution).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from llamacpp_bench import disable_repacking


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-repack", action="store_true", help="no weight repacking (see llamacpp_bench.py)")
    args = ap.parse_args()
    import numpy as np
    from llama_cpp import Llama

    if args.no_repack:
        disable_repacking()
    request = json.load(sys.stdin)
    longest = max(len(s) for s in request["sequences"])
    llm = Llama(
        model_path=args.gguf, n_ctx=longest + 8, n_batch=longest + 8, n_ubatch=longest + 8,
        n_threads=args.threads, logits_all=True, verbose=False,
    )  # fmt: skip
    out = []
    for tokens, start in zip(request["sequences"], request["starts"]):
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(tokens)
        scores = np.asarray(llm.scores[: len(tokens)], dtype=np.float32)
        out.append(
            {"argmax": scores[start - 1 : -1].argmax(-1).tolist(), "first": scores[start - 1].tolist()}
        )
    print("RESULT " + json.dumps({"gguf": os.path.basename(args.gguf), "sequences": out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
