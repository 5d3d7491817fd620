"""The stateless OpenAI-compatible router: validates requests, picks a prefill/decode pair from the
live set in Redis, sends one message to the pair's inbox and relays the tokens from its outbox.

Modules: ``settings`` (RouterSettings, flags, uvicorn entry point), ``protocol`` (OpenAI request
bodies -> SamplingParams), ``responses`` (response/SSE bodies), ``errors`` (exception tree ->
OpenAI error bodies), ``policies`` (round_robin, random, least_load), ``dispatch`` (pair
selection, attempts, retries, watcher), ``serving`` (the generation endpoints), ``app`` (FastAPI).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.router.settings import RouterSettings, add_router_arguments, run_router

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["RouterSettings", "add_router_arguments", "create_app", "run_router"]


def create_app(settings: RouterSettings) -> FastAPI:
    """The router application (imports FastAPI only when called)."""
    from pdserve.router.app import create_app as _create_app

    return _create_app(settings)
