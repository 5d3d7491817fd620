"""Preparation never holds a decode step: a worker compiling a slow JSON schema
keeps stepping the streams it runs (the tiny model, real Redis, the worker service in this process)."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

from redis_support import sync_client
from test_worker_service import ROUTER, router_registered, started

from pdserve.engine.config import EngineConfig
from pdserve.engine.grammar import Grammars
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import GenerateRequest, send_to_inbox
from pdserve.scheduler.messages import decode_as
from pdserve.scheduler.streams import FIELD, StepOutput
from pdserve.tokenizer import Tokenizer
from pdserve.worker.service import WorkerService
from pdserve.worker.settings import WorkerSettings


def slow_schema(tag: str, properties: int = 5000) -> dict:
    """Optional properties, none allowed beside them: llguidance's compile time grows with their
    square (~2 s at 5,000 here, 59 KB: within the default --max-grammar-bytes of 64 KiB). Its
    parser then gives up at the first token (ParserTooComplex): the request fails after its
    seconds of preparation, which is all this needs (``--max-optional-properties`` refuses it by
    default, before it compiles: raised here)."""
    return {
        "type": "object",
        "properties": {f"{tag}{i}": {} for i in range(properties)},
        "additionalProperties": False,
    }


def generate(request_id: str, max_tokens: int, schema: dict | None = None) -> GenerateRequest:
    guided = None if schema is None else {"kind": "json", "spec": schema}
    return GenerateRequest(
        request_id=request_id,
        router_id=ROUTER,
        prompt_token_ids=[7, 8, 9],
        deadline=time.time() + 120,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, guided=guided),
    )


async def arrivals(redis, outbox: str, request_ids: set[str], timeout_s: float) -> dict[str, list]:
    """Each request's deltas as (the Redis time of their outbox entry in seconds, delta), until
    every one has its final event."""
    got: dict[str, list] = {r: [] for r in request_ids}
    done: set[str] = set()
    last = b"0-0"
    deadline = time.monotonic() + timeout_s
    while done != request_ids:
        assert time.monotonic() < deadline, f"no final event for {request_ids - done}"
        for _, entries in await redis.xread({outbox: last}, block=500) or []:
            for entry_id, fields in entries:
                last = entry_id
                at = int(entry_id.split(b"-")[0]) / 1000
                for delta in decode_as(StepOutput, fields[FIELD]).items:
                    if delta.request_id in got:
                        got[delta.request_id].append((at, delta))
                        if delta.is_final:
                            done.add(delta.request_id)
    return got


def test_a_slow_schema_does_not_hold_a_running_stream(redis_url, tmp_path, tiny_model_dir) -> None:
    """A running stream's tokens keep coming while two requests' schemas compile for seconds: no
    gap between its deltas near the compile time. Before, the inbox loop awaited each request's
    preparation and the engine loop held every step back for it (up to 1 s a step)."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    t0 = time.perf_counter()
    Grammars(tokenizer, tokenizer.vocab_size).compile({"kind": "json", "spec": slow_schema("probe")})
    compile_s = time.perf_counter() - t0  # what one such schema costs on this machine
    assert compile_s > 0.3, f"the schema compiled in {compile_s:.2f} s: too fast to show a stall"
    cluster = f"prep{uuid.uuid4().hex[:6]}"

    async def main() -> tuple[dict[str, list], float]:
        service = WorkerService(
            WorkerSettings(
                model_dir=tiny_model_dir,
                role="mixed",
                redis_url=redis_url,
                cluster=cluster,
                ttl_s=5.0,
                instance_id=f"mixed-{uuid.uuid4().hex[:6]}",
                engine=EngineConfig(max_model_len=2048, num_blocks=512),
                max_optional_properties=10_000,  # let it through: the compile is what this needs
            )
        )
        redis, keys = await router_registered(redis_url, cluster)
        task = await started(service)
        try:
            ids = {"stream", "schema-0", "schema-1"}
            reading = asyncio.create_task(arrivals(redis, keys.outbox(ROUTER), ids, 120))
            await send_to_inbox(redis, keys, service.id, generate("stream", 2000))
            await asyncio.sleep(1.0)  # the stream decodes
            sent_at = time.time()  # the clock of Redis's entry ids: same host
            for i in range(2):
                await send_to_inbox(
                    redis, keys, service.id, generate(f"schema-{i}", 4, slow_schema(f"s{i}x"))
                )
            return await reading, sent_at
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 60)
            await redis.aclose()
            client = sync_client(redis_url)
            for key in client.scan_iter(f"pdserve:{cluster}:*"):
                client.delete(key)
            client.close()

    got, sent_at = asyncio.run(main())
    assert got["stream"][-1][1].error is None
    # The stream's deltas from the slow requests' arrival until both had their first token (their
    # compiles all done) or the stream ended: the window where preparation ran beside it. The
    # compiles run at --prepare-nice (10), so beside a busy engine they may outlast the stream.
    start = sent_at
    end = max(at for r in ("schema-0", "schema-1") for at, _ in got[r][:1])
    stream = [at for at, _ in got["stream"]]
    window = [at for at in stream if start <= at <= end]
    gaps = [b - a for a, b in itertools.pairwise(window)]
    assert len(window) > 5, window
    bound = min(0.5, compile_s / 3)
    assert max(gaps) < bound, (
        f"the stream's deltas stopped for {max(gaps):.2f} s while schemas compiled "
        f"({compile_s:.2f} s each; bound {bound:.2f} s)"
    )
