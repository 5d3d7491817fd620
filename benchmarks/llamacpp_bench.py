"""llama.cpp (through llama-cpp-python) on a GGUF file: the llama.cpp columns of engine_bench.py.

Runs with the Python of the separate environment that benchmarks/llamacpp_env.sh creates (pdserve is
not importable there, and this file imports nothing of pdserve's):

    .llamacpp/bin/python benchmarks/llamacpp_bench.py MODEL.gguf [--steps 20] [--prefill-reps 3]

The same shapes as engine_bench.engine_worker: prefill tok/s of one 512-token prompt (one ``eval``
of the whole prompt, best of ``--prefill-reps`` after a warm-up) and decode tok/s at batch 1 with
512 tokens of context (the median of ``--steps`` one-token ``eval`` calls). llama-cpp-python serves
one sequence at a time, so there is no batch 8 or 32. Threads: all cores for both phases (as
``n_threads``/``n_threads_batch``), the way llama.cpp's own ``llama-bench`` runs. ``--no-repack``
turns off llama.cpp's weight repacking into its "extra" buffer types (its ``--no-repack`` flag): on
a virtual machine that reports AMX but does not grant it, the AMX path dies by a general protection
fault (seen with Q8_0 on a Xeon VM), and engine_bench retries with this flag. Prints ``RESULT
{json}`` with engine_bench's keys.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from step_timing import decode_figures, median_step_ms

CTX = 512


def disable_repacking() -> None:
    """llama.cpp's ``--no-repack``: Llama() has no argument for it, but builds its model parameters
    from ``llama_model_default_params``."""
    from llama_cpp import llama_cpp

    defaults = llama_cpp.llama_model_default_params

    def no_repack() -> llama_cpp.llama_model_params:
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_model_default_params = no_repack


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="the model file")
    ap.add_argument("--steps", type=int, default=20, help="measured decode steps")
    ap.add_argument("--prefill-reps", type=int, default=3, help="measured 512-token prefills")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads")
    ap.add_argument("--no-repack", action="store_true", help="no weight repacking (extra buffer types)")
    args = ap.parse_args()
    import json

    from llama_cpp import Llama

    if args.no_repack:
        disable_repacking()
    llm = Llama(
        model_path=args.gguf,
        n_ctx=CTX + args.steps + 64,
        n_batch=CTX,
        n_ubatch=CTX,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    rng = random.Random(0)
    vocab = llm.n_vocab()
    prompt = [rng.randrange(3, vocab) for _ in range(CTX)]
    res: dict = {"threads": args.threads, "gguf": os.path.basename(args.gguf), "repack": not args.no_repack}
    times = []
    for _ in range(args.prefill_reps + 1):  # the first one warms up
        llm.reset()
        llm._ctx.kv_cache_clear()  # the prompt is computed again, not found in the cache
        t = time.perf_counter()
        llm.eval(prompt)
        times.append(time.perf_counter() - t)
    res["prefill_s"] = min(times[1:])
    res["prefill_tok_s"] = CTX / res["prefill_s"]
    tokens = [rng.randrange(3, vocab) for _ in range(args.steps + 1)]
    llm.eval(tokens[:1])  # warm-up at batch 1, context 513
    res |= decode_figures(1, median_step_ms(lambda i: llm.eval(tokens[i + 1 : i + 2]), args.steps))
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
