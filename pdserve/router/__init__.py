"""The stateless OpenAI-compatible router: validates requests, picks a prefill/decode pair from the
live set in Redis, sends one message to the pair's inbox and relays the tokens from its outbox.

Subpackages, by concern: ``api`` (the OpenAI surface: request bodies parsed and bounded, tools,
response bodies, errors as OpenAI error bodies), ``routing`` (where a request runs: policies, pair
selection, prefix lookup, the inbox sender, dispatch, one choice's attempts, the worker contract,
shadow replays) and ``http`` (the running service: settings, the ASGI/FastAPI app and endpoints,
state, admission, tenants, metrics, traffic, the Batch API).

Importing this package loads no FastAPI or uvicorn: ``create_app`` and ``run_router`` import them
when called.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pdserve.router.http.settings import RouterSettings, add_router_arguments

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["RouterSettings", "add_router_arguments", "create_app", "run_router"]


def create_app(settings: RouterSettings) -> FastAPI:
    """The router application (imports FastAPI only when called)."""
    from pdserve.router.http.app import create_app as _create_app

    return _create_app(settings)


def run_router(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve router`` (imports uvicorn only when called)."""
    from pdserve.router.http.server import run_router as _run_router

    return _run_router(args)
