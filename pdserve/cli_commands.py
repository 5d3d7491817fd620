"""What each ``pdserve`` command does, and the helpers that turn its parsed flags into settings;
the parser that reaches them is cli.py's. Engine, worker and router code is imported only inside
the command that runs it, so ``pdserve --help`` and ``pdserve status`` load no Paddle."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import signal
import sys
import types
from pathlib import Path
from typing import NoReturn

import orjson

from pdserve.errors import ConfigError, PdserveError
from pdserve.flags import from_args
from pdserve.sampling_params import SamplingParams, declared

log = logging.getLogger("pdserve")


def engine_config(args: argparse.Namespace):
    from pdserve.engine.config import EngineConfig

    return from_args(EngineConfig, args)


def sampling_params(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SamplingParams:
    from pdserve.errors import InvalidRequestError

    flags = {f.name: name for f, how in declared() if (name := how.flag_name(f.name))}
    try:
        return SamplingParams(**{field: getattr(args, field) for field in flags})
    except InvalidRequestError as e:
        parser.error(f"{flags.get(e.param or '', e.param)}: {e.message}")


# ---- pdserve model init -------------------------------------------------------------------------
def cmd_model_init(args: argparse.Namespace) -> int:
    from pdserve.engine.models.model_init import init_model
    from pdserve.engine.models.model_store import FETCHED_PRESETS, fetch_preset

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
    from pdserve.engine.models.model_store import import_source

    path = import_source(args.source, args.dir, overwrite=args.overwrite)
    print(f"imported {args.source} to {path}")
    return 0


def resolve_model_flag(
    args: argparse.Namespace, parser: argparse.ArgumentParser, dest: str, check: bool = True
) -> str:
    """Make ``--model`` (``args.<dest>``) a folder, importing or fetching it on first use; returns
    the name clients should use for it."""
    from pdserve.engine.models.model_store import resolve_model

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
    from pdserve.scheduler.redis_client import RedisSettings

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
    from pdserve.scheduler.redis_client import redact_url

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


def stack_redis(args: argparse.Namespace) -> tuple[str, str]:
    """The Redis URL and cluster a command names, else those of the `pdserve up` running here, else
    the defaults."""
    from pdserve.scheduler.keys import DEFAULT_CLUSTER
    from pdserve.scheduler.redis_client import DEFAULT_URL
    from pdserve.stack_record import running_stack

    stack = running_stack() if args.redis_url is None else None
    redis_url = args.redis_url or (stack or {}).get("redis_url") or DEFAULT_URL
    return redis_url, args.cluster or (stack or {}).get("cluster") or DEFAULT_CLUSTER


def cmd_role(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.planner.switch import switch_role
    from pdserve.scheduler import Keys, RedisSettings, wait_for_redis

    redis_url, cluster = stack_redis(args)

    async def run() -> int:
        redis = RedisSettings.from_url(redis_url).connect()
        try:
            await wait_for_redis(redis, timeout_s=5)
            done = await switch_role(
                redis, Keys(cluster), args.instance_id, args.role, args.reason, args.wait
            )
        finally:
            await redis.aclose()
        if not done.ok:
            print(f"{args.instance_id} did not take the role {args.role}: {done.error}", file=sys.stderr)
            return 1
        print(f"{args.instance_id} is {args.role} now")
        return 0

    return asyncio.run(run())


def interrupted(signum: int, frame: types.FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


def cmd_plan(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.planner.endpoint import endpoint_app, serve_endpoint
    from pdserve.planner.loop import Planner, PlannerMetrics
    from pdserve.planner.settings import PlanSettings
    from pdserve.scheduler import Keys, RedisSettings, wait_for_redis

    settings = from_args(PlanSettings, args)
    metrics = PlannerMetrics()

    async def run() -> None:
        redis = RedisSettings.from_url(settings.redis_url).connect()
        try:
            await wait_for_redis(redis, timeout_s=30)
            planner = Planner(
                redis,
                Keys(settings.cluster),
                settings.targets,
                settings.served_model_name or None,
                settings.apply,
                metrics,
                Path(settings.record) if settings.record else None,
            )
            log.info(
                "planning %s: %s (%s)",
                settings.served_model_name or "the only model",
                settings.targets,
                "applying" if settings.apply else "deciding only",
            )
            jobs = [planner.run(settings.interval_s)]
            if settings.metrics_port:
                app = endpoint_app(metrics, lambda: planner.last)
                jobs.append(serve_endpoint(app, settings.metrics_host, settings.metrics_port))
            await asyncio.gather(*jobs)
        finally:
            await redis.aclose()

    signal.signal(signal.SIGTERM, interrupted)  # as Ctrl-C: the loop and the endpoint end
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from pdserve.status import run_status

    redis_url, cluster = stack_redis(args)
    if args.watch is not None:
        from pdserve.status_watch import watch

        return watch(redis_url, cluster, args.watch)
    if args.batch_output is not None:
        import asyncio

        return asyncio.run(write_batch_output(redis_url, cluster, args.batch_output, args.output_dir))
    return run_status(redis_url, cluster, args.json, args.check)


async def write_batch_output(redis_url: str, cluster: str, batch_id: str, folder: Path) -> int:
    """``pdserve status --batch-output``: a batch's outcomes as its output and error files stand,
    however far they were written (``OutputMove.outcomes``), in ``folder``; read in pieces."""
    from pdserve.batchstore.batches import BatchStore
    from pdserve.batchstore.files import FileStore
    from pdserve.batchstore.output_move import OutputMove
    from pdserve.scheduler import Keys, RedisSettings, wait_for_redis

    redis = RedisSettings.from_url(redis_url).connect()
    try:
        await wait_for_redis(redis, timeout_s=5)
        keys = Keys(cluster)
        batches = BatchStore(redis, keys)
        batch = await batches.get(batch_id)
        move = OutputMove(batches, FileStore(redis, keys))
        folder.mkdir(parents=True, exist_ok=True)
        for kind, name in (("out", "output"), ("err", "error")):
            path, lines = folder / f"{batch.id}_{name}.jsonl", 0
            with path.open("wb") as out:
                async for piece in move.outcomes(batch.id, kind, batch.request_counts.total):
                    out.write(piece)
                    lines += piece.count(b"\n")
            print(f"{path}: {lines} lines")
    finally:
        await redis.aclose()
    return 0
