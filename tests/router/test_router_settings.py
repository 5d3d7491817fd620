"""Router settings, flags from PDSERVE_* variables, and the real server (uvloop, httptools, TCP_NODELAY)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import redis
import uvicorn
from router_support import CLUSTER

from pdserve.errors import ConfigError
from pdserve.localredis.embedded import free_port
from pdserve.router import RouterSettings, add_router_arguments
from pdserve.router.http.server import uvicorn_config
from pdserve.router.http.settings import settings_from_args


def test_defaults_and_router_id() -> None:
    s = RouterSettings(port=9000)
    assert s.router_id.startswith(f"router-{socket.gethostname().split('.')[0][:64]}-9000-")
    assert RouterSettings(port=9000).router_id != s.router_id  # random suffix: replicas never collide
    assert (s.request_timeout_s, s.first_token_timeout_s, s.max_body_bytes, s.retry_attempts) == (
        600.0,
        60.0,
        8 * 1024 * 1024,
        2,
    )
    assert (s.prefill_policy, s.decode_policy, s.access_log) == ("prefix_cache", "prefix_cache", False)
    assert s.url == "http://127.0.0.1:9000"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prefill_policy", "fastest", "prefill_policy must be one of"),
        ("request_timeout_s", 0, "request_timeout_s must be > 0"),
        ("first_token_timeout_s", -1, "first_token_timeout_s"),
        ("transfer_timeout_s", 0, "transfer_timeout_s must be > 0"),
        ("max_body_bytes", 10, "max_body_bytes"),
        ("retry_attempts", -1, "retry_attempts"),
        ("router_id", "has:colon", "invalid router id"),
        ("cluster", "{x}", "invalid cluster name"),
        ("port", 65536, "port"),  # 0 is valid: a batch worker's router listens on none
        ("max_stop_strings", 0, "max_stop_strings must be >= 1"),
        ("max_stop_string_len", 0, "max_stop_string_len"),
        ("max_stop_token_ids", -1, "max_stop_token_ids"),
    ],
)
def test_invalid_settings(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterSettings(**{field: value})


def test_flags_default_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PORT", "9123")
    monkeypatch.setenv("PDSERVE_DECODE_POLICY", "round_robin")
    monkeypatch.setenv("PDSERVE_FIRST_TOKEN_TIMEOUT", "7.5")
    monkeypatch.setenv("PDSERVE_ACCESS_LOG", "true")
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    args = parser.parse_args(["--retry-attempts", "0", "--router-id", "r1"])
    s = settings_from_args(args)
    assert (s.port, s.decode_policy, s.first_token_timeout_s, s.access_log) == (
        9123,
        "round_robin",
        7.5,
        True,
    )
    assert (s.retry_attempts, s.router_id, s.prefill_policy) == (0, "r1", "prefix_cache")
    assert "PDSERVE_MAX_BODY_BYTES" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-policy", "fastest"])


def test_input_limit_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    s = RouterSettings(port=9000)
    assert (s.max_stop_strings, s.max_stop_string_len, s.max_stop_token_ids) == (1024, 256, 256)
    monkeypatch.setenv("PDSERVE_MAX_STOP_STRINGS", "7")
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    s = settings_from_args(parser.parse_args(["--max-stop-string-len", "64", "--max-stop-token-ids", "3"]))
    assert (s.max_stop_strings, s.max_stop_string_len, s.max_stop_token_ids) == (7, 64, 3)
    help_text = " ".join(parser.format_help().split())
    for flag in ("--max-stop-strings", "--max-stop-string-len", "--max-stop-token-ids"):
        var = "PDSERVE_" + flag[2:].upper().replace("-", "_")
        assert re.search(rf"{flag} {var[8:]} [^\[]*\[env {var}\]", help_text), flag


def test_uvicorn_config_uses_uvloop_httptools_and_sets_tcp_nodelay() -> None:
    """Serve a probe app with the router's uvicorn configuration and read TCP_NODELAY off the
    accepted socket (uvicorn hands the app bound methods of its per-request cycle)."""
    seen: dict[str, int] = {}

    async def probe(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        sock = send.__self__.transport.get_extra_info("socket")
        seen["nodelay"] = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    settings = RouterSettings(port=free_port())
    config = uvicorn_config(settings, probe)
    assert (config.loop, config.http, config.access_log) == ("uvloop", "httptools", False)
    config.lifespan = "off"
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert httpx.get(f"{settings.url}/").text == "ok"
        assert seen["nodelay"] != 0
    finally:
        server.should_exit = True
        thread.join(10)


def test_run_router_serves_and_shuts_down_cleanly(redis_url: str, redis_client: redis.Redis) -> None:
    port = free_port()
    code = (
        "import argparse, logging, sys; from pdserve.router import add_router_arguments, run_router; "
        "logging.basicConfig(level='INFO'); p = argparse.ArgumentParser(); add_router_arguments(p); "
        "sys.exit(run_router(p.parse_args()))"
    )
    env = {
        **os.environ,
        "PDSERVE_REDIS_URL": redis_url,
        "PDSERVE_CLUSTER": CLUSTER,
        "PDSERVE_PORT": str(port),
        "PDSERVE_ROUTER_ID": "r-proc",
    }
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
                time.sleep(0.1)
        assert resp.json() == {"status": "ok", "router_id": "r-proc"}
        assert redis_client.exists(f"pdserve:{{{CLUSTER}}}:router:r-proc") == 1
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    # uvicorn re-raises the captured SIGINT after its graceful shutdown (cli.main turns it into 130)
    assert proc.returncode in (0, -signal.SIGINT), stderr
    assert "Application shutdown complete" in stderr
    assert f"listening on http://127.0.0.1:{port}" in stderr
    assert redis_client.exists(f"pdserve:{{{CLUSTER}}}:router:r-proc") == 0  # deregistered on shutdown
