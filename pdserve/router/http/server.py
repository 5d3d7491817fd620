"""``pdserve router``: the router app served by uvicorn until interrupted."""

from __future__ import annotations

import argparse
import logging

import uvicorn
from starlette.types import ASGIApp

from pdserve.errors import ConfigError
from pdserve.router.http.app import create_app
from pdserve.router.http.settings import RouterSettings, settings_from_args
from pdserve.scheduler.redis_client import RedisSettings

logger = logging.getLogger(__name__)


def uvicorn_config(settings: RouterSettings, app: ASGIApp) -> uvicorn.Config:
    """The uvicorn configuration of a router: uvloop + httptools (uvloop sets TCP_NODELAY on every
    accepted socket; ``tests/router/test_router_settings.py`` checks it), access log off unless asked,
    and with it the proxy-headers middleware (the forwarded client address is the access log's only)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=settings.access_log,
        proxy_headers=settings.access_log,
        log_config=None,
        timeout_keep_alive=75,
        server_header=False,
    )


def run_router(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve router``: serve until interrupted; returns the exit status."""
    settings = settings_from_args(args)
    if settings.port == 0:
        raise ConfigError("--port must be in 1..65535 (0 is for routers without a listener)")
    server = uvicorn.Server(uvicorn_config(settings, create_app(settings)))
    logger.info(
        "router %s listening on %s (Redis %s, cluster %s)",
        settings.router_id,
        settings.url,
        _redacted(settings.redis_url),
        settings.cluster,
    )
    server.run()
    return 0 if server.started else 1


def _redacted(url: str) -> str:
    try:
        return RedisSettings.from_url(url).display_url
    except ConfigError:
        return "<invalid url>"
