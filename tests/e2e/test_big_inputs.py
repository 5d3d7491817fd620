"""End to end: a large request never takes an instance out (hardening, acceptance 1).

A prompt of 7 MB (under the router's 8 MiB body limit) and a 1 MB pathological JSON schema are
refused with a 400 naming the field within 2 s, while another client's small requests every 0.5 s
all succeed and neither instance ever leaves the live set. Before, the worker tokenized the prompt
on its engine thread holding the GIL (13 s for 7 MB): no step ran, the heartbeat starved, the
instance dropped out after its TTL, and the router retried the request on the next instance.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import pytest

from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import GenerateRequest, Keys, RedisSettings, RouterInfo, RouterRegistry, StepOutput
from pdserve.scheduler.messages import decode_as
from pdserve.scheduler.streams import FIELD, send_to_inbox
from tests.e2e.test_serving import start_stack

pytestmark = pytest.mark.timeout(240)

BIG_PROMPT = "hello " * 1_200_000  # 7.2 MB
BIG_SCHEMA = {
    "type": "object",
    "anyOf": [
        {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]} for i in range(16000)
    ],
}  # ~1 MB


@pytest.fixture(scope="module")
def splitwise(tiny_model_dir, redis_url):
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=1)
    yield stack
    assert stack.stop(grace_s=15) == []


class Background:
    """A small completion every 0.5 s, and the live set polled every 0.1 s, until stopped."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.done = 0
        self.live_sets: list[set[str]] = []
        self.threads = [threading.Thread(target=self._small), threading.Thread(target=self._watch)]

    def __enter__(self) -> Background:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _small(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self.stop.is_set():
                body = {"model": self.model, "prompt": "Hi", "max_tokens": 4, "temperature": 0}
                try:
                    r = http.post(self.url + "/v1/completions", json=body)
                    if r.status_code == 200:
                        self.done += 1
                    else:
                        self.failures.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.stop.wait(0.5)

    def _watch(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.stop.is_set():
                instances = http.get(self.url + "/v1/instances").json()["instances"]
                self.live_sets.append({i["id"] for i in instances})
                self.stop.wait(0.1)


def _refused(http: httpx.Client, path: str, body: dict, param: str) -> None:
    t0 = time.monotonic()
    r = http.post(path, json=body)
    elapsed = time.monotonic() - t0
    assert r.status_code == 400, r.text[:300]
    assert (r.json()["error"]["param"] or "").startswith(param), r.text[:300]
    assert elapsed < 2.0, f"{param}: refused after {elapsed:.1f} s"


def test_big_prompts_and_schemas_are_refused_while_small_requests_go_on(splitwise) -> None:
    url, model = splitwise.urls[0], splitwise.spec.model.name
    ids = {i["id"] for i in httpx.get(url + "/v1/instances").json()["instances"]}
    assert len(ids) == 2
    with Background(url, model) as bg, httpx.Client(base_url=url, timeout=60) as http:
        time.sleep(1.0)
        for _ in range(2):
            completion = {"model": model, "prompt": BIG_PROMPT, "max_tokens": 4}
            _refused(http, "/v1/completions", completion, "prompt")
            chat = {"model": model, "messages": [{"role": "user", "content": BIG_PROMPT}], "max_tokens": 4}
            _refused(http, "/v1/chat/completions", chat, "messages")
            schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG_SCHEMA}}
            guided = {"model": model, "prompt": "Hi", "max_tokens": 4, "response_format": schema}
            _refused(http, "/v1/completions", guided, "response_format")
        time.sleep(4.0)  # past the instances' 3 s TTL: a starved heartbeat would show now
    assert not bg.failures, bg.failures
    assert bg.done >= 8
    assert bg.live_sets and all(live == ids for live in bg.live_sets), [
        live for live in bg.live_sets if live != ids
    ]


async def _refused_by_worker(redis_url: str, cluster: str, instance_id: str, msg: GenerateRequest) -> str:
    """Send ``msg`` straight into the instance's inbox (past the router, which has bounds of its
    own); within 2 s its final event must be the refusal: the field it names."""
    redis = RedisSettings.from_url(redis_url).connect()
    keys = Keys(cluster)
    try:
        await RouterRegistry(redis, keys, ttl_s=30).register(
            RouterInfo(id=msg.router_id, host="h", pid=1, port=1, started_at=0.0)
        )
        t0 = time.monotonic()
        await send_to_inbox(redis, keys, instance_id, msg)
        last = b"0-0"
        while time.monotonic() - t0 < 2.0:
            reply = await redis.xread({keys.outbox(msg.router_id): last}, block=200)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    for delta in decode_as(StepOutput, fields[FIELD]).items:
                        if delta.request_id == msg.request_id and delta.is_final:
                            assert delta.error is not None, delta
                            return delta.error.param or ""
        raise AssertionError(f"{instance_id} did not refuse {msg.request_id} within 2 s")
    finally:
        await redis.aclose()


def test_the_workers_own_bounds_keep_them_live(splitwise, redis_url) -> None:
    """The same big inputs sent straight to each worker's inbox (a router that let them through):
    each worker refuses them within 2 s naming the field, and stays live while the small requests
    go on."""
    url, model = splitwise.urls[0], splitwise.spec.model.name
    instances = httpx.get(url + "/v1/instances").json()["instances"]
    ids = {i["id"] for i in instances}
    router_id = f"direct-{uuid.uuid4().hex[:6]}"

    def big(**kw: object) -> GenerateRequest:
        return GenerateRequest(
            request_id=uuid.uuid4().hex,
            router_id=router_id,
            deadline=time.time() + 30,
            sampling=kw.pop("sampling", SamplingParams(max_tokens=4)),  # type: ignore[arg-type]
            **kw,  # type: ignore[arg-type]
        )

    schema = SamplingParams(max_tokens=4, guided={"kind": "json", "spec": BIG_SCHEMA})
    with Background(url, model) as bg:
        time.sleep(1.0)
        for instance in sorted(ids):
            for msg, param in [
                (big(prompt=BIG_PROMPT), "prompt"),
                (big(messages=[{"role": "user", "content": BIG_PROMPT}]), "messages"),
                (big(prompt="Hi", sampling=schema), "response_format"),
            ]:
                got = asyncio.run(_refused_by_worker(redis_url, splitwise.spec.cluster, instance, msg))
                assert got == param, (instance, got)
        time.sleep(4.0)  # past the instances' 3 s TTL
    assert not bg.failures, bg.failures
    assert bg.live_sets and all(live == ids for live in bg.live_sets), [
        live for live in bg.live_sets if live != ids
    ]
