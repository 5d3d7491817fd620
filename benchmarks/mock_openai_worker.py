"""A mock OpenAI-compatible engine for SGLang's and vLLM's routers in PD mode (router_overhead.py).

It answers what those routers call on a worker (health, model and server info, loads, metrics,
tokenize/render) and serves /v1/completions, /v1/chat/completions and /generate, streaming or not,
with `max_tokens` fake tokens and no model: the router in front is what gets measured. A prefill
worker asked for a remote decode (vLLM's `kv_transfer_params.do_remote_decode`) returns fake
NIXL-style transfer parameters; `--bootstrap-port` opens a second listener that answers any GET
(the Mooncake-style `/query`).

    python benchmarks/mock_openai_worker.py --port 18001 --role prefill --bootstrap-port 18901
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


def make_app(role: str, model: str, port: int, model_path: str) -> Starlette:
    def js(obj, status: int = 200) -> Response:
        return Response(orjson.dumps(obj), status_code=status, media_type="application/json")

    async def ok(_: Request) -> Response:
        return js({"status": "ok"})

    async def models(_: Request) -> Response:
        return js({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "mock"}]})

    async def model_info(_: Request) -> Response:
        return js({"model_path": model_path, "tokenizer_path": model_path, "is_generation": True})

    async def server_info(_: Request) -> Response:
        return js({"model_path": model_path, "disaggregation_mode": role, "tp_size": 1, "dp_size": 1})

    async def load(_: Request) -> Response:
        return js({"load": 0, "num_reqs": 0, "num_waiting_reqs": 0})

    async def metrics(_: Request) -> Response:
        return Response("vllm:num_requests_running 0\n", media_type="text/plain")

    async def tokenize(request: Request) -> Response:
        body = orjson.loads(await request.body() or b"{}")
        text = body.get("prompt") or " ".join(str(m.get("content")) for m in body.get("messages", []))
        tokens = list(range(1, len(str(text).split()) + 1))
        return js({"tokens": tokens, "count": len(tokens), "max_model_len": 32768})

    async def generate(request: Request) -> Response:
        body = orjson.loads(await request.body())
        chat = request.url.path.endswith("/chat/completions")
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        kv = body.get("kv_transfer_params") or {}
        extra = {}
        if role == "prefill" and kv.get("do_remote_decode"):
            n = 1
            extra["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": f"mock-engine-{port}",
                "remote_block_ids": [0, 1, 2],
                "remote_host": "127.0.0.1",
                "remote_port": port + 1000,
                "tp_size": 1,
            }
        rid, created = f"mock-{uuid.uuid4().hex}", int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            choice = {"index": 0, "finish_reason": "length", "logprobs": None}
            choice |= (
                {"message": {"role": "assistant", "content": " tok" * n}} if chat else {"text": " tok" * n}
            )
            usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
            return js(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                    **extra,
                }
            )

        async def events():
            head = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created, "model": model}
            for i in range(n):
                piece = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
                choice = {
                    "index": 0,
                    **piece,
                    "logprobs": None,
                    "finish_reason": "length" if i == n - 1 else None,
                }
                yield b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"
                await asyncio.sleep(0)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
                yield b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route(p, ok) for p in ("/health", "/health_generate", "/flush_cache")]
    routes += [
        Route("/v1/models", models),
        Route("/model_info", model_info),
        Route("/get_model_info", model_info),
    ]
    routes += [Route(p, server_info) for p in ("/server_info", "/get_server_info")]
    routes += [Route(p, load) for p in ("/get_load", "/get_loads", "/v1/loads")]
    routes += [Route("/metrics", metrics), Route("/tokenize", tokenize, methods=["POST"])]
    routes += [
        Route(p, tokenize, methods=["POST"])
        for p in ("/v1/completions/render", "/v1/chat/completions/render")
    ]
    routes += [
        Route(p, generate, methods=["POST"]) for p in ("/v1/completions", "/v1/chat/completions", "/generate")
    ]
    return Starlette(routes=routes)


async def serve(args: argparse.Namespace) -> None:
    app = make_app(args.role, args.model, args.port, args.model_path)
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=args.port,
                log_level="warning",
                access_log=False,
                loop="uvloop",
                http="httptools",
            )
        )
    ]
    if args.bootstrap_port:
        boot = Starlette(routes=[Route("/{path:path}", lambda r: Response(b'{"engine_id": "mock"}'))])
        servers.append(
            uvicorn.Server(
                uvicorn.Config(
                    boot, host="127.0.0.1", port=args.bootstrap_port, log_level="warning", access_log=False
                )
            )
        )
    await asyncio.gather(*(s.serve() for s in servers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--role", choices=["prefill", "decode", "mixed"], default="mixed")
    ap.add_argument("--model", default="mock-llama", help="served model name (default %(default)s)")
    ap.add_argument(
        "--model-path", default=".", help="what /model_info reports (a local folder: no hub lookups)"
    )
    ap.add_argument("--bootstrap-port", type=int, default=None, help="a second listener answering any GET")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
