"""Offline prefill/decode disaggregation: a prefill engine in a child process hands each prompt's
KV cache to a decode engine in this process, which finishes generation.

The decode side reserves blocks first; the prefill side prefills, moves the KV bytes into exactly
those blocks (``shm``: written straight into the decode engine's shared-memory cache; ``bytes``:
copied out, sent over a pipe and imported), then reports the first token. This is the hand-off the
served system uses, minus Redis.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
from pathlib import Path
from typing import Any, TypedDict

from pdserve.cache_transfer.regions import Region, pair_regions
from pdserve.cache_transfer.shm import ShmWriter
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import Generation, Prompt
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import EngineError
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
TRANSFERS = ("shm", "bytes")


class _Job(TypedDict):
    """One prompt handed to the prefill process, with the decode side's blocks for its KV."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    dst_regions: list[Region]


def _prefill_process(model_dir: str, config: EngineConfig, conn: Any, log_level: int) -> None:
    """Child: prefill each job, move its KV into the decode side's blocks, report the first token."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[prefill]: %(message)s")
    try:
        engine = LLMEngine(model_dir, config)
        conn.send(("ready", None))
        writer: ShmWriter | None = None
        while (msg := conn.recv()) is not None:
            jobs, shm_name = msg
            if shm_name and writer is None:
                writer = ShmWriter(shm_name)
            dst = {}
            for job in jobs:
                engine.add_request(
                    job["request_id"],
                    prompt_token_ids=job["prompt_token_ids"],
                    params=SamplingParams.from_dict(job["params"]),
                    prefill_only=True,
                )
                dst[job["request_id"]] = job["dst_regions"]
            while engine.has_unfinished():
                for out in engine.step():
                    payload = None
                    if out.prefilled:
                        rid = out.request_id
                        src = engine.cache.regions(engine.prefilled_blocks(rid))
                        if writer is not None:
                            writer.write(engine.cache.raw_view(), pair_regions(src, dst[rid]))
                        else:
                            payload = engine.export_kv(rid)
                        engine.release_prefilled(rid)
                    conn.send(("output", (out, payload)))
            conn.send(("done", None))
        if writer is not None:
            writer.close()
    except Exception as e:  # report, never hang the parent
        log.exception("prefill process failed")
        conn.send(("error", f"{type(e).__name__}: {e}"))


def generate_disaggregated(
    model_dir: str | Path,
    prompts: list[Prompt],
    params: list[SamplingParams],
    config: EngineConfig | None = None,
    transfer: str = "shm",
    decode_engine: LLMEngine | None = None,
) -> list[Generation]:
    """Generate through a prefill process and a decode engine; results in prompt order."""
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
    config = config or EngineConfig()
    own_engine = decode_engine is None
    decode = decode_engine or LLMEngine(model_dir, dataclasses.replace(config, shared_kv=transfer == "shm"))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_prefill_process,
        args=(
            str(model_dir),
            dataclasses.replace(config, shared_kv=False),
            child,
            logging.getLogger().getEffectiveLevel(),
        ),
    )
    proc.start()
    try:
        _expect(_recv(parent, proc), "ready")
        gens: dict[str, Generation] = {}
        jobs: list[_Job] = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids = decode.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            decode.validate(ids, p)
            rid = f"pd-{i}"
            blocks = decode.reserve(rid, len(ids))
            gens[rid] = Generation(rid, ids)
            jobs.append(
                {
                    "request_id": rid,
                    "prompt_token_ids": ids,
                    "params": p.to_dict(),
                    "dst_regions": decode.cache.regions(blocks),
                }
            )
        parent.send((jobs, decode.cache.shm_name if transfer == "shm" else None))
        while True:
            kind, body = _recv(parent, proc)
            if kind == "done":
                break
            if kind == "error":
                raise EngineError(f"prefill process failed: {body}")
            out: RequestOutput
            out, payload = body
            gens[out.request_id].add(out)
            if out.prefilled:
                if payload is not None:
                    decode.import_kv(out.request_id, payload)
                job = next(j for j in jobs if j["request_id"] == out.request_id)
                decode.add_prefilled(
                    out.request_id,
                    job["prompt_token_ids"],
                    out.token_ids[0],
                    SamplingParams.from_dict(job["params"]),
                )
            else:
                decode.cancel_reservation(out.request_id)  # finished on its first token
        while decode.has_unfinished():
            for out in decode.step():
                gens[out.request_id].add(out)
        parent.send(None)
        return list(gens.values())
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        if own_engine:
            decode.close()


def _recv(conn: Any, proc: Any) -> tuple[str, Any]:
    """Next message from the prefill process; a crashed child (even a segfault) is an error, not a hang."""
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise EngineError(f"prefill process exited with code {proc.exitcode}")
    return conn.recv()


def _expect(message: tuple[str, Any], kind: str) -> None:
    got, body = message
    if got == "error":
        raise EngineError(f"prefill process failed: {body}")
    if got != kind:
        raise EngineError(f"prefill process sent {got!r}, expected {kind!r}")
