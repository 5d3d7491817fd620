"""The stateless OpenAI-compatible router: validates requests, picks a prefill/decode pair from the
live set in Redis, sends one message to the pair's inbox and relays the tokens from its outbox.

Modules: ``settings`` (RouterSettings, flags), ``server`` (``pdserve router``: uvicorn), ``app``
(FastAPI app, route registration, operator endpoints), ``state`` (RouterState: what the lifespan
builds), ``asgi`` (request id, body, the one JSON/error path), ``protocol`` (OpenAI request bodies ->
SamplingParams), ``request_models`` (the bodies' pydantic models), ``request_fields`` (each field
honoured, advisory or rejected; bad fields named), ``input_limits`` (size bounds), ``tools`` (tool
models and calls), ``responses`` (response/SSE bodies), ``errors`` (exception tree -> OpenAI error
bodies), ``policies`` (the policy registry: round_robin, random, least_load, prefix_affinity),
``selection`` (model check, pair rules), ``dispatch`` (shared routing state, the watcher),
``generation`` (one choice's attempts, retries, migrations), ``serving`` and ``tokenize`` (the raw
ASGI endpoints).

Importing this package loads no FastAPI or uvicorn: ``create_app`` and ``run_router`` import them
when called.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pdserve.router.settings import RouterSettings, add_router_arguments

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["RouterSettings", "add_router_arguments", "create_app", "run_router"]


def create_app(settings: RouterSettings) -> FastAPI:
    """The router application (imports FastAPI only when called)."""
    from pdserve.router.app import create_app as _create_app

    return _create_app(settings)


def run_router(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve router`` (imports uvicorn only when called)."""
    from pdserve.router.server import run_router as _run_router

    return _run_router(args)
