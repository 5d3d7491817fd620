"""Tenants and the prefix cache, router side, with scripted instances on a real Redis: with API keys
each key's requests carry its own prefix-cache salt to the instance (so the engines' block hashes,
and ``cached_tokens``, are per key) and prefix routing looks up the same salted hashes;
``--shared-prefix-cache``, or no keys, leaves the client's own salt alone. (The engines' side, a
real model's ``cached_tokens`` per key: tests/e2e/test_tenants.py.)"""

from __future__ import annotations

from typing import Any

import redis
from router_support import KEYS, FakeWorker, answer, instance, redis_conn, router, run

from pdserve.block_hash import chain_hashes, salt_key
from pdserve.router.http.tenants import key_digest, tenant_salt
from pdserve.scheduler import GenerateRequest

A, B = "tenant-a-key", "tenant-b-key"
PROMPT = list(range(1, 65))  # four full blocks of 16


async def salts(
    redis_url: str, overrides: dict[str, Any], requests: list[tuple[str | None, str | None]]
) -> list[Any]:
    """The ``sampling.cache_salt`` the instance got for each ``(key, client cache_salt)``, and the
    one the router's pick used (the same)."""
    out: list[Any] = []
    async with router(redis_url, **overrides) as client, redis_conn(redis_url) as r:
        generations = client.app.state.router.dispatcher.generations  # type: ignore[attr-defined]
        seen: list[tuple[GenerateRequest, Any]] = []

        async def record(worker: FakeWorker, msg: Any) -> None:
            if isinstance(msg, GenerateRequest):
                seen.append((msg, generations[msg.request_id].policy_request.cache_salt))
            await answer(worker, msg)

        worker = await FakeWorker(r, instance("m0"), record).start()
        try:
            for key, salt in requests:
                body: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
                if salt is not None:
                    body["cache_salt"] = salt
                # the header a batch worker's runner names a line's tenant in: a client's is ignored
                headers = {"x-pdserve-tenant": "forged"} | ({"Authorization": f"Bearer {key}"} if key else {})
                resp = await client.post("/v1/completions", json=body, headers=headers)
                assert resp.status_code == 200, resp.text
        finally:
            await worker.stop()
        for msg, picked in seen:
            assert picked == msg.sampling.cache_salt
            out.append(msg.sampling.cache_salt)
    return out


def test_each_key_runs_with_its_own_prefix_cache_salt(redis_url: str, redis_client: redis.Redis) -> None:
    a, b = key_digest(A.encode()), key_digest(B.encode())
    asked = [(A, None), (B, None), (A, None), (A, "mine"), (B, "mine")]
    got = run(salts(redis_url, {"api_key": f"{A},{B}"}, asked))
    assert got == [a, b, a, tenant_salt(a, "mine"), tenant_salt(b, "mine")]
    assert len(set(got)) == 4 and "mine" not in got and A not in got and B not in got


def test_shared_prefix_cache_and_no_keys_keep_the_clients_salt(
    redis_url: str, redis_client: redis.Redis
) -> None:
    shared = {"api_key": f"{A},{B}", "shared_prefix_cache": True}
    assert run(salts(redis_url, shared, [(A, None), (B, None), (B, "mine")])) == [None, None, "mine"]
    assert run(salts(redis_url, {}, [(None, None), (None, "mine")])) == [None, "mine"]


def test_prefix_routing_finds_the_keys_own_cached_blocks(redis_url: str, redis_client: redis.Redis) -> None:
    """m1's prefix index holds the prompt's blocks as key A's requests hash them: A's requests go
    there every time (the router hashes with A's salt too); m0 holds nothing."""
    hashes = chain_hashes(PROMPT, 16, salt_key(key_digest(A.encode())))
    redis_client.sadd(KEYS.prefix_index("m1"), *hashes)

    async def main() -> list[str]:
        async with router(redis_url, api_key=A) as client, redis_conn(redis_url) as r:
            workers = [await FakeWorker(r, instance(i, prefix_caching=True)).start() for i in ("m0", "m1")]
            try:
                for _ in range(6):
                    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
                    resp = await client.post(
                        "/v1/completions", json=body, headers={"Authorization": f"Bearer {A}"}
                    )
                    assert resp.status_code == 200, resp.text
            finally:
                for w in workers:
                    await w.stop()
            return [w.id for w in workers for _ in w.requests()]

    assert run(main()) == ["m1"] * 6
