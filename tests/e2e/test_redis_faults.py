"""Redis crashes under load: SIGKILL the control plane's Redis mid-stream, bring it back empty on
the same port, three times. Workers and routers ride it out, every stream ends clearly, and the
cluster serves again once the instances have re-registered."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from pdserve.localredis.embedded import EmbeddedRedis
from tests.e2e.test_serving import model_name, start_stack

pytestmark = pytest.mark.timeout(400)

STREAMS = 100
OUTAGE_S = 5.0


async def one_stream(hc: httpx.AsyncClient, url: str, body: dict, seen: list[int], i: int) -> str:
    """'finished', 'error: <code>' (an error event, or an error status before the stream started)."""
    async with hc.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            error = orjson.loads(await resp.aread())["error"]
            return f"error: {error['code']} ({error['message'][:60]})"
        events = []
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                seen[i] += 1
    assert events[-1] == "[DONE]", events[-3:]
    last = orjson.loads(events[-2])
    if "error" in last:
        return f"error: {last['error']['code']} ({last['error']['message'][:60]}, after {len(events) - 2} events)"
    assert last["choices"][0]["finish_reason"] == "length", last
    return "finished"


def port_outside_the_ephemeral_range() -> int:
    """A free port below Linux's ephemeral range: clients reconnecting while Redis is down can never
    self-connect to it (a TCP simultaneous open that would hold the port Redis must get back)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, min(low, 30000)), 50):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError("no free port below the ephemeral range")


def test_workers_ride_out_redis_crashes_under_load(tiny_model_dir, tmp_path) -> None:
    server = EmbeddedRedis(port=port_outside_the_ephemeral_range(), workdir=tmp_path)
    server.start()
    stack = start_stack(tiny_model_dir, server.url, prefill=1, decode=2)
    url = stack.urls[0] + "/v1/completions"
    body = {
        "model": model_name(stack),
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    outcomes: list[list[str]] = []
    try:
        for _ in range(3):

            async def round_trip() -> list[str]:
                seen = [0] * STREAMS
                async with httpx.AsyncClient(timeout=120) as hc:
                    tasks = [
                        asyncio.create_task(
                            one_stream(hc, url, {**body, "prompt": f"stream {i} " * 3}, seen, i)
                        )
                        for i in range(STREAMS)
                    ]
                    while sum(n > 2 for n in seen) < STREAMS // 4:
                        await asyncio.sleep(0.01)
                    server.stop(kill=True)
                    await asyncio.sleep(OUTAGE_S)
                    server.start()
                    return await asyncio.wait_for(asyncio.gather(*tasks), 120)

            outcomes.append(asyncio.run(round_trip()))
            dead = [(name, p.returncode) for name, p in stack.workers + stack.routers if p.poll() is not None]
            assert dead == [], f"processes died: {dead}"
            time.sleep(2 * stack.spec.ttl_s)
            for i in range(8):
                r = httpx.post(
                    url, json={**body, "stream": False, "max_tokens": 8, "prompt": f"after {i}"}, timeout=60
                )
                assert r.status_code == 200, r.text
        clear = {
            "finished",
            "error: control_plane_unavailable",
            "error: control_plane_restarted",
            "error: no_capacity",
        }
        for round_outcomes in outcomes:
            assert len(round_outcomes) == STREAMS
            assert {o.split(" (")[0] for o in round_outcomes} <= clear, sorted(set(round_outcomes))
    finally:
        stack.stop(grace_s=15)
        server.close()


class CuttableProxy:
    """A TCP proxy to Redis whose links can be cut: every connection is dropped and new ones are
    refused until ``restore`` (a network blip, with the same Redis behind it). Own thread and loop."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = port_outside_the_ephemeral_range()
        self.cut_off = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        started.wait(5)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        started.set()
        self._loop.run_forever()
        server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    def cut(self) -> None:
        def drop() -> None:
            self.cut_off = True
            for w in list(self._writers):
                w.transport.abort()

        self._loop.call_soon_threadsafe(drop)

    def restore(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "cut_off", False)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_a_redis_blip_loses_no_token(tiny_model_dir, redis_url) -> None:
    """Every process reaches Redis through a proxy that drops every link for 2 s mid-stream (the
    same Redis stays behind it): the workers' sends are retried until it answers, so each stream
    completes and equals its undisturbed text: no gap, no duplicate, no worker lost."""
    proxy = CuttableProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    stack = start_stack(tiny_model_dir, proxy.url, prefill=1, decode=1)
    body = {"model": model_name(stack), "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    prompts = [f"blip {i} " * (2 + i) for i in range(8)]
    try:
        url = stack.urls[0] + "/v1/completions"
        reference = [
            httpx.post(url, json={**body, "prompt": p}, timeout=60).json()["choices"][0]["text"]
            for p in prompts
        ]

        async def stream(hc: httpx.AsyncClient, i: int, seen: list[int]) -> str:
            text = []
            async with hc.stream("POST", url, json={**body, "prompt": prompts[i], "stream": True}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = orjson.loads(line[6:])
                        assert "error" not in chunk, chunk
                        text.append(chunk["choices"][0]["text"])
                        seen[i] += 1
            return "".join(text)

        async def main() -> list[str]:
            seen = [0] * len(prompts)
            async with httpx.AsyncClient(timeout=120) as hc:
                tasks = [asyncio.create_task(stream(hc, i, seen)) for i in range(len(prompts))]
                while min(seen) < 3:
                    await asyncio.sleep(0.01)
                proxy.cut()
                await asyncio.sleep(2.0)
                proxy.restore()
                return await asyncio.gather(*tasks)

        assert asyncio.run(main()) == reference
        assert [p.poll() for _, p in stack.workers + stack.routers] == [None] * 3
    finally:
        stack.stop(grace_s=15)
        proxy.close()
