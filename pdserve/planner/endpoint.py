"""The planner's HTTP endpoint (``--metrics-port``): what autoscalers and Prometheus read.

* ``GET /desired``: the last decision's desired instances as JSON (``prefill``, ``decode``,
  ``mixed``; ``workers`` = prefill + decode; ``switchable`` = those of the workers that must be
  instances able to take any role, i.e. less the live ones that cannot switch) with its action,
  reason and time; 503 before the first decision. KEDA's ``metrics-api`` trigger reads one of them
  (``valueLocation: switchable`` for a pool of switchable workers).
* ``GET /metrics``: the same in Prometheus' format (``pdserve_plan_desired_instances{role}``), for
  an HPA through a metrics adapter, and the pressures and decision counts besides.
* ``GET /health``: the process answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from pdserve.planner.loop import PlannerMetrics
from pdserve.planner.records import Decision

log = logging.getLogger(__name__)


def desired_view(decision: Decision) -> dict[str, object]:
    d = decision.desired
    workers = d.get("prefill", 0) + d.get("decode", 0)
    return {
        "at": decision.at,
        "action": decision.action,
        "reason": decision.reason,
        "prefill": d.get("prefill", 0),
        "decode": d.get("decode", 0),
        "mixed": d.get("mixed", 0),
        "workers": workers,
        "switchable": max(0, workers - int(decision.inputs.get("unswitchable", 0))),
        "current": decision.current,
    }


def endpoint_app(metrics: PlannerMetrics, last: Callable[[], Decision | None]) -> Starlette:
    async def desired(request: Request) -> Response:
        decision = last()
        if decision is None:
            body = {"error": {"message": "no decision yet", "type": "unavailable", "code": "no_decision"}}
            return JSONResponse(body, status_code=503)
        return JSONResponse(desired_view(decision))

    async def exposition(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    routes = [Route("/desired", desired), Route("/metrics", exposition), Route("/health", health)]
    return Starlette(routes=routes)


async def serve_endpoint(app: Starlette, host: str, port: int, started: asyncio.Event | None = None) -> None:
    """Serve ``app`` until cancelled (``started`` is set once it listens)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                await task  # its error (the port taken, say)
                raise OSError(f"the planner's endpoint did not start on {host}:{port}")
            await asyncio.sleep(0.02)
        log.info("planner endpoint on http://%s:%d (/desired, /metrics)", host, port)
        if started is not None:
            started.set()
        await task
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
