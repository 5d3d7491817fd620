"""Numbers of any length in a body answer a 400 naming their field, never a 500: Python's ``int()``
raises a ValueError past 4300 digits, and a ``logit_bias`` key or a ``completion_window`` count used
to reach it unbounded; pydantic-core refused a long number in a body without naming it."""

from __future__ import annotations

import json

import pytest
import redis
from router_support import router, run

LONG = "9" * 5000
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "prompt": "hi"}
JSON = {"content-type": "application/json"}


def with_fields(body: dict, fields: str) -> bytes:
    """``body`` as JSON with ``fields``, JSON text (numbers no JSON encoder writes), added."""
    return (json.dumps(body)[:-1] + ", " + fields + "}").encode()


CASES = [
    ("logit_bias", f'"logit_bias": {{"{LONG}": 1}}'),
    ("logit_bias.17", f'"logit_bias": {{"17": {LONG}}}'),
    ("max_tokens", f'"max_tokens": {LONG}'),
    ("temperature", f'"temperature": {LONG}.5'),
    ("seed", f'"seed": -{LONG}'),
    ("n", f'"n": {LONG}'),
    ("guided_json", f'"guided_json": "{{\\"type\\": \\"integer\\", \\"maximum\\": {LONG}}}"'),
]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_long_numbers_in_a_generation_body_are_a_400_naming_the_field(
    redis_url: str, redis_client: redis.Redis, endpoint: str
) -> None:
    base = CHAT if endpoint == "/v1/chat/completions" else COMPLETION

    async def main() -> None:
        async with router(redis_url) as client:
            for param, fields in CASES:
                resp = await client.post(endpoint, content=with_fields(base, fields), headers=JSON)
                assert resp.status_code == 400, (param, resp.status_code, resp.text[:300])
                error = resp.json()["error"]
                assert (error["type"], error["param"]) == ("invalid_request_error", param), error
                assert LONG not in error["message"], error["message"][:300]
            if endpoint == "/v1/completions":
                ids = with_fields({"model": "tiny"}, f'"prompt": [1, {LONG}]')
                resp = await client.post(endpoint, content=ids, headers=JSON)
                assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt[1]", resp.text

    run(main())


def test_a_long_completion_window_is_a_400_naming_it(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client:
            for window in (LONG + "h", "0" * 20 + "24h"):
                body = {"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": window}
                resp = await client.post("/v1/batches", json=body)
                assert resp.status_code == 400, resp.text[:300]
                error = resp.json()["error"]
                assert error["param"] == "completion_window" and LONG not in error["message"], error

    run(main())


def test_a_token_id_past_64_bits_to_detokenize_is_a_400_naming_tokens(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A worker's message parser refuses an integer past 64 bits: sent on, it answered 502."""

    async def main() -> None:
        async with router(redis_url) as client:
            for tokens in ([1, 2**64], [-1], [int("9" * 4000)]):
                resp = await client.post("/detokenize", json={"model": "tiny", "tokens": tokens})
                assert resp.status_code == 400, resp.text[:300]
                error = resp.json()["error"]
                assert error["param"] == "tokens" and "9" * 100 not in error["message"], error

    run(main())
