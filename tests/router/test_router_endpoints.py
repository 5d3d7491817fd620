"""Operator endpoints over registrations written with the real InstanceRegistry."""

from __future__ import annotations

import asyncio

import pytest
import redis
from router_support import (
    CLUSTER,
    KEYS,
    ROUTER_ID,
    FakeWorker,
    instance,
    redis_conn,
    router,
    run,
    silent,
)

import pdserve
from pdserve.scheduler import InstanceRegistry, RouterInfo, RouterRegistry


def test_health_ready_models_instances(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            reg = InstanceRegistry(r, KEYS)
            health = await client.get("/health", headers={"x-request-id": "probe"})
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert health.headers["x-request-id"] == "probe"

            ready = await client.get("/ready")
            assert (
                ready.status_code == 503 and "no instance is registered" in ready.json()["error"]["message"]
            )
            assert ready.headers["retry-after"] == "1"
            assert (await client.get("/v1/models")).json() == {"object": "list", "data": []}

            await reg.register(instance("p0", "prefill"))
            await asyncio.sleep(0.1)
            ready = await client.get("/ready")
            assert ready.status_code == 503 and "no decode or mixed" in ready.json()["error"]["message"]

            await reg.register(instance("d0", "decode", draining=True))
            await asyncio.sleep(0.1)
            assert (await client.get("/ready")).status_code == 503

            await reg.register(instance("d1", "decode"))
            await reg.register(instance("x0", "mixed", model="other"))
            await asyncio.sleep(0.1)
            ready = await client.get("/ready")
            assert ready.status_code == 200
            assert ready.json() == {"status": "ready", "router_id": ROUTER_ID, "models": ["other", "tiny"]}

            models = (await client.get("/v1/models")).json()
            assert models["object"] == "list"
            assert models["data"] == [
                {
                    "id": "other",
                    "object": "model",
                    "created": 1000,
                    "owned_by": "pdserve",
                    "max_model_len": 2048,
                },
                {
                    "id": "tiny",
                    "object": "model",
                    "created": 1000,
                    "owned_by": "pdserve",
                    "max_model_len": 2048,
                },
            ]

            one = await client.get("/v1/models/tiny")
            assert one.status_code == 200 and one.json() == models["data"][1]
            missing = await client.get("/v1/models/nope", headers={"x-request-id": "m1"})
            assert missing.status_code == 404 and missing.headers["x-request-id"] == "m1"
            assert missing.json()["error"] == {
                "message": "The model `nope` does not exist or is not served by any live instance.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            await reg.register(instance("x1", "mixed", model="org/m"))  # an id may hold a slash
            await asyncio.sleep(0.1)
            assert (await client.get("/v1/models/org/m")).json()["id"] == "org/m"
            await reg.deregister("x1")
            await asyncio.sleep(0.1)
            version = await client.get("/version")
            assert version.status_code == 200 and version.json() == {"version": pdserve.__version__}

            body = (await client.get("/v1/instances")).json()
            assert body["router_id"] == ROUTER_ID
            assert [i["id"] for i in body["instances"]] == ["d0", "d1", "p0", "x0"]
            d0 = body["instances"][0]
            assert d0["role"] == "decode" and d0["draining"] is True and d0["in_flight"] == 0
            assert d0["kv"]["free_blocks"] == 100 and d0["transfer"]["protocols"] == ["shm", "tcp"]

            await reg.deregister("d1")
            await reg.deregister("x0")
            await asyncio.sleep(0.1)
            assert (await client.get("/ready")).status_code == 503

    run(main())


def test_instances_show_in_flight_counts(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            p = await FakeWorker(r, instance("p0", "prefill"), silent).start()
            d = await FakeWorker(r, instance("d0", "decode"), silent).start()
            body = {"model": "tiny", "prompt": "hi"}
            pending = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(3)]
            await p.wait_for(lambda w: len(w.requests()) == 3)
            listing = (await client.get("/v1/instances")).json()
            assert {i["id"]: i["in_flight"] for i in listing["instances"]} == {"d0": 3, "p0": 3}
            assert listing["in_flight"] == 6 and listing["requests"] == 3
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await p.stop()
            await d.stop()

    run(main())


def test_router_registers_and_deregisters(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with redis_conn(redis_url) as r:
            routers = RouterRegistry(r, KEYS)
            async with router(redis_url):
                live = await routers.live()
                assert [x.id for x in live] == [ROUTER_ID]
                assert isinstance(live[0], RouterInfo)
            assert await routers.live() == []

    run(main())
    assert redis_client.exists(f"pdserve:{{{CLUSTER}}}:router:{ROUTER_ID}") == 0


def test_api_keys_guard_every_v1_route_and_leave_probes_open(
    redis_url: str, redis_client: redis.Redis, tmp_path
) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# one per line\nfrom-file\n")

    async def main() -> None:
        async with router(redis_url, api_key="k1, k2", api_key_file=str(keys_file)) as client:
            for path in ("/v1/models", "/v1/instances"):
                r = await client.get(path)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
                assert (await client.get(path, headers={"authorization": "Bearer wrong"})).status_code == 401
                assert (await client.get(path, headers={"authorization": "Basic k1"})).status_code == 401
                for key in ("k1", "k2", "from-file"):
                    assert (
                        await client.get(path, headers={"authorization": f"Bearer {key}"})
                    ).status_code == 200
            body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
            r = await client.post("/v1/completions", json=body, headers={"authorization": "Bearer k2"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"  # past the key check
            for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
                assert (await client.post(path, json=body)).status_code == 401  # they use an instance too
                r = await client.post(path, json=body, headers={"authorization": "Bearer k1"})
                assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity", r.text
            assert (await client.get("/health")).status_code == 200  # probes stay open
            assert (await client.get("/ready")).status_code in (200, 503)

    run(main())


def test_an_api_key_file_that_cannot_be_read_is_a_config_error(tmp_path) -> None:
    import pytest

    from pdserve.errors import ConfigError
    from pdserve.router import RouterSettings

    with pytest.raises(ConfigError, match="--api-key-file"):
        RouterSettings(api_key_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        RouterSettings(api_key_file=str(tmp_path / "empty"))


def test_generation_endpoints_are_in_the_openapi_schema(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client:
            schema = (await client.get("/openapi.json")).json()
            for path, model in (
                ("/v1/completions", "CompletionRequest"),
                ("/v1/chat/completions", "ChatCompletionRequest"),
            ):
                body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
                assert body["$ref"].endswith(model)
                assert "max_tokens" in schema["components"]["schemas"][model]["properties"]
            # still served by the raw endpoint: its own validation answers, not FastAPI's 422
            r = await client.post("/v1/completions", json={"max_tokens": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"

    run(main())


def test_every_endpoint_answers_json_and_errors_the_same_way(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Operator endpoints, FastAPI's 404/405 and the raw endpoints share one JSON/error path."""

    async def main() -> None:
        async with router(redis_url) as client:
            ok = await client.get("/health", headers={"x-request-id": "h"})
            errors = [
                await client.get("/v1/models/nope", headers={"x-request-id": "e1"}),
                await client.get("/nothing", headers={"x-request-id": "e2"}),
                await client.put("/tokenize", headers={"x-request-id": "e3"}),
                await client.post("/v1/completions", json={}, headers={"x-request-id": "e4"}),
                await client.post("/tokenize", json={}, headers={"x-request-id": "e5"}),
            ]
            assert [r.status_code for r in errors] == [404, 404, 405, 400, 400]
            for i, r in enumerate([ok, *errors]):
                assert r.headers["content-type"] == "application/json", r.headers
                assert int(r.headers["content-length"]) == len(r.content)
                assert r.headers["x-request-id"] == ("h" if i == 0 else f"e{i}")
            for r in errors:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text

    run(main())


def _with_endpoints(instance_id: str):
    """A decode registration that advertises shm and mooncake endpoints (a buffer address included)."""
    from pdserve.scheduler.registration import TransferInfo

    endpoint = {
        "shm": f"pdserve-{instance_id}",
        "mooncake": {
            "session": "10.0.0.2:15000",
            "addr": 140000000000,
            "length": 987654321,
            "protocol": "tcp",
        },
        "cuda_ipc": {"handle": "SVBDSEFORExF", "ref_counter": "L3RvcmNo", "event": "RVZFTlQ=", "pid": 42},
    }
    info = instance(instance_id, "decode")
    return info.model_copy(
        update={"transfer": TransferInfo(protocols=["shm", "mooncake", "cuda_ipc"], endpoint=endpoint)}
    )


def test_instances_hide_transfer_endpoints_and_never_serve_buffer_addresses(redis_url: str) -> None:
    """The data plane's addresses are not for any HTTP client: without API keys /v1/instances never
    shows them (not even with ?details=1); with keys, ?details=1 shows sessions but no buffer address."""

    async def listing(client, **kw) -> dict:
        r = await client.get("/v1/instances", **kw)
        assert r.status_code == 200, r.text
        assert "140000000000" not in r.text and "987654321" not in r.text  # the buffer, in no field
        assert all(h not in r.text for h in ("SVBDSEFORExF", "L3RvcmNo", "RVZFTlQ="))  # nor IPC handles
        (d0,) = r.json()["instances"]
        assert d0["transfer"]["protocols"] == ["shm", "mooncake", "cuda_ipc"]
        return d0

    def hidden(d0: dict) -> bool:
        return "endpoint" not in d0["transfer"] and "pdserve-d0" not in str(d0) and "10.0.0.2" not in str(d0)

    async def main() -> None:
        async with redis_conn(redis_url) as r:
            await InstanceRegistry(r, KEYS).register(_with_endpoints("d0"))
            async with router(redis_url) as client:
                for params in ({}, {"details": "1"}):
                    d0 = await listing(client, params=params)
                    assert hidden(d0), d0
            auth = {"authorization": "Bearer k1"}
            async with router(redis_url, api_key="k1") as client:
                d0 = await listing(client, headers=auth)
                assert hidden(d0), d0
                d0 = await listing(client, headers=auth, params={"details": "1"})
                assert d0["transfer"]["endpoint"] == {
                    "shm": "pdserve-d0",
                    "mooncake": {"session": "10.0.0.2:15000", "protocol": "tcp"},
                    "cuda_ipc": {"pid": 42},
                }
                no_key = await client.get("/v1/instances", params={"details": "1"})
                assert no_key.status_code == 401

    run(main())


def test_a_dead_outbox_reader_makes_the_router_not_ready(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """If the reader task ever dies (a bug), /ready says 503 and why, it is logged, and requests
    fail at once with a 503 instead of waiting for their deadline."""
    from pdserve.scheduler import Outbox, RequestDelta, StepOutput

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0")).start()
            assert (await client.get("/ready")).status_code == 200
            reader = client.app.state.router.reader  # type: ignore[attr-defined]

            def bug(data: bytes) -> None:
                raise SystemError("a bug in the reader")

            reader.dispatch = bug
            delta = RequestDelta(request_id="x", token_ids=[1], text="a")
            await Outbox(r, KEYS).publish(ROUTER_ID, StepOutput(instance_id="m0", items=[delta]))
            for _ in range(100):
                if not reader.alive:
                    break
                await asyncio.sleep(0.02)
            ready = await client.get("/ready")
            assert ready.status_code == 503 and "outbox reader stopped" in ready.json()["error"]["message"]
            resp = await client.post("/v1/completions", json={"prompt": "hi"})
            assert resp.status_code == 503
            await worker.stop()

    run(main())
    assert any("outbox reader stopped" in rec.getMessage() for rec in caplog.records)


def test_a_second_router_with_a_live_routers_id_is_refused(redis_url: str, redis_client: redis.Redis) -> None:
    """Two routers with one --router-id would read and trim each other's outbox: the second refuses
    to start, naming the flag; once the first is gone the id is free again."""
    from pdserve.errors import ConfigError

    async def main() -> None:
        async with router(redis_url), redis_conn(redis_url) as r:
            with pytest.raises(ConfigError, match="--router-id r-test"):
                async with router(redis_url):
                    pass
            assert await RouterRegistry(r, KEYS).get(ROUTER_ID) is not None  # the first one's, untouched
        async with router(redis_url) as client:
            assert (await client.get("/health")).status_code == 200

    run(main())
