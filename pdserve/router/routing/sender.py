"""Sending inbox messages, coalesced: everything sent during one event-loop iteration travels in
ONE pipelined round trip.

Under load many requests reach their send in the same iteration (uvicorn starts a task per
request and they run back to back), and one pipeline of N ``XADD``+``EXPIRE`` pairs costs the
client far less CPU than N pipelines; a lone request still goes out at the end of its own
iteration, so no latency is added.

Each message is encoded when it is queued, not when the batch goes out: one that cannot be
encoded fails only its own send (a 400), never the batch it would have joined.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pdserve.errors import ControlPlaneError, InvalidRequestError
from pdserve.scheduler.inbox_messages import InboxMessage
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.lean_redis import lean_connection, pack
from pdserve.scheduler.messages import encode
from pdserve.scheduler.redis_client import NO_WAIT, RedisClient, ReplicaWait
from pdserve.scheduler.redis_server import RedisObserver
from pdserve.scheduler.streams import pack_inbox_send, send_to_inbox

logger = logging.getLogger(__name__)

_Batch = list[tuple[str, InboxMessage, bytes, "asyncio.Future[None] | None"]]


class InboxSender:
    """``await send(instance_id, msg)`` (raises ControlPlaneError, or InvalidRequestError when ``msg``
    cannot be encoded) or ``send_nowait`` (logs failures)."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        observe: RedisObserver | None = None,
        wait: ReplicaWait = NO_WAIT,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.wait = wait  # a batch counts as sent once this many replicas hold it
        self.observe = observe  # op "inbox_send": one pipelined round trip per batch
        self.num_batches = 0
        self.num_messages = 0
        self._pending: _Batch = []
        self._flushing: set[asyncio.Task[None]] = set()
        self._lean = lean_connection(redis, "the inbox sender")
        """Batches go out on this dedicated connection (lean_redis.py; None: redis-py's pipeline)."""

    async def send(self, instance_id: str, msg: InboxMessage) -> None:
        """XADD ``msg`` to the instance's inbox with whatever else is sent in this iteration."""
        data = _encode(msg)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._add(instance_id, msg, data, future)
        await future

    def send_nowait(self, instance_id: str, msg: InboxMessage) -> None:
        """Queue ``msg`` without waiting (best effort, e.g. Abort from a ``finally``)."""
        try:
            data = _encode(msg)
        except InvalidRequestError as e:
            logger.warning("could not send %s of %s: %s", msg.type, msg.request_id, e)
            return
        self._add(instance_id, msg, data, None)

    async def drain(self, timeout_s: float = 2.0) -> None:
        """Wait until every queued message has been sent (shutdown)."""
        await asyncio.sleep(0)
        if self._flushing:
            await asyncio.wait(set(self._flushing), timeout=timeout_s)

    def _add(
        self, instance_id: str, msg: InboxMessage, data: bytes, future: asyncio.Future[None] | None
    ) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((instance_id, msg, data, future))

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.ensure_future(self._execute(batch))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

    async def _execute(self, batch: _Batch) -> None:
        self.num_batches += 1
        self.num_messages += len(batch)
        starts: list[int] = []  # index of each message's XADD among the staged commands
        t0 = time.perf_counter()
        try:
            results, waits = await self._round_trip(batch, starts)
            if waits:
                self.wait.check(results[-1], f"sending {len(batch)} messages to inboxes")
        except Exception as e:  # the round trip failed, or was not replicated: every message failed
            starts, results = [0] * len(batch), [e]
        if self.observe is not None:
            failed = next((r for r in results if isinstance(r, Exception)), None)
            self.observe("inbox_send", time.perf_counter() - t0, failed)
        for start, (instance_id, msg, _, future) in zip(starts, batch):
            result = results[start]
            if isinstance(result, Exception):
                error = (
                    result
                    if isinstance(result, ControlPlaneError)
                    else ControlPlaneError(
                        f"Redis failed while sending to the inbox of {instance_id}: {result}"
                    )
                )
                if future is None:
                    logger.warning("could not send %s of %s: %s", msg.type, msg.request_id, error)
                elif not future.done():
                    future.set_exception(error)
            elif future is not None and not future.done():
                future.set_result(None)

    async def _round_trip(self, batch: _Batch, starts: list[int]) -> tuple[list[Any], bool]:
        """Every message's XADD + EXPIRE (then WAIT, if asked) in one round trip: the replies, each
        error in its place, and whether the last one is WAIT's. Fills ``starts`` (each XADD's index)."""
        if self._lean is None:
            pipe = self.redis.pipeline(transaction=False)
            for instance_id, msg, data, _ in batch:
                starts.append(len(pipe))
                await send_to_inbox(self.redis, self.keys, instance_id, msg, pipeline=pipe, data=data)
            waits = self.wait.stage(pipe)
            return await pipe.execute(raise_on_error=False), waits
        commands = []
        for i, (instance_id, _, data, _) in enumerate(batch):
            starts.append(2 * i)
            commands.append(pack_inbox_send(self.keys.inbox(instance_id), data))
        waits = bool(self.wait.replicas)
        if waits:
            commands.append(pack(b"WAIT", self.wait.replicas, self.wait.timeout_ms))
        count = 2 * len(batch) + waits
        return await self._lean.call(b"".join(commands), count, raise_on_error=False), waits

    def close(self) -> None:
        """Close the dedicated connection (after :meth:`drain`)."""
        if self._lean is not None:
            self._lean.close()


def _encode(msg: InboxMessage) -> bytes:
    """``msg`` as inbox bytes; InvalidRequestError when it cannot be serialized (the request's fault:
    the parser bounds what a client sends, so this is the last line of defence)."""
    try:
        return encode(msg)
    except (ValueError, RecursionError) as e:  # PydanticSerializationError is a ValueError
        raise InvalidRequestError(f"the request cannot be encoded: {e}", None) from None
