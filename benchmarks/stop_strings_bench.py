"""Decode time with no stop strings vs 1000 stop strings of the longest length the router allows.

A real engine on the tiny model (created in a temp dir unless --model): a batch of requests decodes
--tokens tokens each (greedy, ignore_eos), once with ``stop=[]`` and once with 1000 random stop
strings of ``--max-stop-string-len`` characters (256 by default) that never match. They are drawn
from the characters the model generates, so the automaton leaves its root on most characters: the
expensive case short of a match. Each round runs both variants back to back in one process (in
alternating order); decode time is the engine steps after every request's first token, as wall
time and as this process's CPU time (less disturbed by other load on the host), and the figure is
the median over rounds of each round's ratio. The matchers' setup (``add_request``) is timed apart.
Both variants must generate the same text.

Then the matcher alone, per token over the same generated text: the Aho–Corasick matcher and the
previous one (a ``find`` of every stop string in every chunk plus a prefix set; kept below as a
reference), their construction times, and their time per token as a share of the decode time per
token without stop strings. Prints a table, writes JSON.

    python benchmarks/stop_strings_bench.py [--batch 8] [--tokens 128] [--rounds 15] [--threads N] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
NUM_STOPS = 1000
PROMPT_LEN = 32


def router_default(name: str) -> int:
    from pdserve.router.http.settings import RouterSettings

    default = next(f.default for f in dataclasses.fields(RouterSettings) if f.name == name)
    if not isinstance(default, int):
        raise TypeError(f"RouterSettings.{name}: its default {default!r} is not an int")
    return default


class PreviousMatcher:
    """The matcher before the Aho–Corasick one, verbatim: O(total stop length) per chunk."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in dict.fromkeys(stop) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched_stop: str | None = None
        self._max_hold = max((len(s) - 1 for s in self.stop), default=0)
        self._prefixes = {s[:i] for s in self.stop for i in range(1, len(s))}
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if self.matched_stop is not None:
            return "", True
        if not self.stop:
            return text, False
        buf = self._held + text
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            end, start, self.matched_stop = best
            self._held = ""
            return buf[: end if self.include_stop_str_in_output else start], True
        hold = self._holdback(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _holdback(self, buf: str) -> int:
        for k in range(min(len(buf), self._max_hold), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0

    def flush(self) -> str:
        text, self._held = self._held, ""
        return text


def run_batch(engine, prompts: list[list[int]], params, tag: str) -> dict:
    """Add the batch, prefill it, then time the decode steps until every request finished."""
    t = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt_token_ids=prompt, params=params)
    setup_s = time.perf_counter() - t
    texts: dict[str, list[str]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    reasons: dict[str, str] = {}

    def take(outputs) -> None:
        for out in outputs:
            texts[out.request_id].append(out.text)
            if out.finished:
                reasons[out.request_id] = out.finish_reason

    while any(not pieces for pieces in texts.values()):  # prefill: every request's first token
        take(engine.step())
    steps, t, cpu = 0, time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        take(engine.step())
        steps += 1
    decode_s, cpu_s = time.perf_counter() - t, time.process_time() - cpu
    return {
        "setup_s": setup_s,
        "decode_s": decode_s,
        "cpu_s": cpu_s,
        "steps": steps,
        "texts": texts,
        "reasons": reasons,
    }


def per_token_us(make, stops: list[str], tokens: list[list[str]], reps: int) -> tuple[float, float]:
    """(µs per token fed, ms to construct one matcher), best of ``reps``."""
    feed, build = [], []
    n = sum(map(len, tokens))
    for _ in range(reps):
        t = time.perf_counter()
        matchers = [make(stops) for _ in tokens]
        build.append((time.perf_counter() - t) / len(tokens))
        t = time.perf_counter()
        for m, pieces in zip(matchers, tokens):
            for piece in pieces:
                if m.feed(piece)[1]:
                    raise AssertionError("a stop string matched: the benchmark's strings must not")
        feed.append(time.perf_counter() - t)
    return min(feed) / n * 1e6, min(build) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8, help="requests decoding together (default %(default)s)")
    ap.add_argument(
        "--tokens", type=int, default=128, help="tokens each request decodes (default %(default)s)"
    )
    ap.add_argument("--rounds", type=int, default=15, help="rounds of both variants (default %(default)s)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="engine threads (default: all cores; 1 is steadier on a busy host)",
    )
    ap.add_argument(
        "--max-stop-string-len",
        type=int,
        default=router_default("max_stop_string_len"),
        help="length of each stop string (default: the router's limit, %(default)s)",
    )
    ap.add_argument("--model", type=Path, default=None, help="a model folder (default: a fresh tiny one)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stop_strings.json")
    args = ap.parse_args()
    if args.rounds < 1 or args.batch < 1 or args.tokens < 2:
        ap.error("--rounds and --batch must be >= 1, --tokens >= 2")
    from pdserve import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.detokenizer import StopStringMatcher
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.models.model_init import init_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or Path(tmp) / "tiny"
        if args.model is None:
            print("creating the tiny model ...", file=sys.stderr, flush=True)
            init_model(model_dir, preset="tiny")
        blocks = args.batch * (-(-(PROMPT_LEN + args.tokens + 16) // 16)) + 16
        engine = LLMEngine(
            model_dir, EngineConfig(num_blocks=blocks, max_num_seqs=args.batch, threads=args.threads)
        )
        rng = random.Random(0)
        vocab = engine.tokenizer.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(args.batch)]
        plain = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        warm = run_batch(engine, prompts, plain, "warm")
        generated = "".join("".join(pieces) for pieces in warm["texts"].values())
        alphabet = sorted(set(generated))
        stops = ["".join(rng.choices(alphabet, k=args.max_stop_string_len)) for _ in range(NUM_STOPS)]
        assert not any(s in generated for s in stops)
        variants = {"none": plain, "stops": plain.replace(stop=stops)}
        rounds: dict[str, list[dict]] = {name: [] for name in variants}
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                print(f"round {r + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
                res = run_batch(engine, prompts, variants[name], f"{name}{r}")
                assert set(res["reasons"].values()) == {"length"}, res["reasons"]
                texts = ["".join(pieces) for pieces in res["texts"].values()]
                assert texts == ["".join(p) for p in warm["texts"].values()], f"{name}: other text"
                rounds[name].append({k: res[k] for k in ("setup_s", "decode_s", "cpu_s", "steps")})
        tokens = list(warm["texts"].values())
        matcher = {
            "none": per_token_us(StopStringMatcher, [], tokens, 5),
            "aho_corasick": per_token_us(StopStringMatcher, stops, tokens, 5),
            "previous": per_token_us(PreviousMatcher, stops, tokens, 1),
        }
    decode = {name: statistics.median(r["decode_s"] for r in runs) for name, runs in rounds.items()}
    ratio = {
        key: statistics.median(s[key] / n[key] for s, n in zip(rounds["stops"], rounds["none"]))
        for key in ("decode_s", "cpu_s")
    }
    setup = {name: statistics.median(r["setup_s"] for r in runs) for name, runs in rounds.items()}
    steps = rounds["none"][0]["steps"]
    report = {
        "machine": {"cpus": os.cpu_count(), "threads": engine.threads},
        "model": str(args.model or "tiny preset"),
        "batch": args.batch,
        "tokens": args.tokens,
        "stop_strings": NUM_STOPS,
        "stop_string_len": args.max_stop_string_len,
        "alphabet": len(alphabet),
        "statistic": "medians over rounds, ratios per round (matcher: best of repetitions)",
        "decode_s": decode,
        "decode_ms_per_step": {name: 1e3 * s / steps for name, s in decode.items()},
        "decode_ratio": ratio["decode_s"],
        "decode_cpu_ratio": ratio["cpu_s"],
        "setup_s": setup,
        "matcher_us_per_token": {name: v[0] for name, v in matcher.items()},
        "matcher_build_ms": {name: v[1] for name, v in matcher.items()},
        "matcher_share_of_decode": {  # matcher time per token / decode time per token without stops
            name: v[0] / (1e6 * decode["none"] / steps / args.batch) for name, v in matcher.items()
        },
        "rounds": rounds,
    }
    print_report(report)
    write_json(args.out, report, args)
    return 0


def print_report(r: dict) -> None:
    label = f"{r['stop_strings']} stops x {r['stop_string_len']} chars"
    print_table(
        ["variant", "decode s", "ms/step", "setup ms", "vs none", "cpu vs"],
        [
            [
                shown,
                f"{r['decode_s'][name]:.3f}",
                f"{r['decode_ms_per_step'][name]:.2f}",
                f"{1e3 * r['setup_s'][name]:.2f}",
                f"{vs:.3f}",
                f"{cpu:.3f}",
            ]
            for name, shown, vs, cpu in (
                ("none", "no stop strings", 1.0, 1.0),
                ("stops", label, r["decode_ratio"], r["decode_cpu_ratio"]),
            )
        ],
        title=f"\n{r['model']}, batch {r['batch']}, {r['tokens']} tokens each, threads {r['machine']['threads']}; "
        f"{r['statistic']}",
    )
    print_table(
        ["matcher", "us/token", "build ms", "of decode"],
        [
            [
                shown,
                f"{r['matcher_us_per_token'][name]:.2f}",
                f"{r['matcher_build_ms'][name]:.2f}",
                f"{100 * r['matcher_share_of_decode'][name]:.2f}%",
            ]
            for name, shown in (
                ("none", "no stop strings"),
                ("aho_corasick", f"Aho-Corasick, {label}"),
                ("previous", f"previous, {label}"),
            )
        ],
        title=f"\nmatcher alone over the generated text ({r['alphabet']} distinct characters)",
    )


if __name__ == "__main__":
    sys.exit(main())
