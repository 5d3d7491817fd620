"""What an instance does with each inbox message and each engine output (docs/design.md, "Request flow").

Roles:

* ``mixed`` (and ``decode`` when asked to serve a whole request): generate, publish every step's
  tokens to the routers' outboxes (one XADD per router per step).
* ``prefill``: the prefill side of the splitwise hand-off (prefill_handoff.py).
* ``decode``: the decode side (decode_lease.py): reserve blocks on request, take the prefilled
  sequence over and decode it as an ordinary request of this instance.

Every request ends with an event in its router's outbox, those of a router that is gone too (a
retryable failure nobody may read: if Redis only lost the router's key, the router retries); which
routers are gone is router_watch.py's. The instance's lifecycle (Redis, drain) is service.py's job,
its loops loops.py's, its registration presence.py's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator

from pdserve.engine.outputs import RequestOutput
from pdserve.errors import (
    InvalidRequestError,
    PdserveError,
    RequestTimeoutError,
    UnavailableError,
)
from pdserve.scheduler import (
    Abort,
    FetchBlocks,
    FetchedBlocks,
    GenerateRequest,
    InboxMessage,
    Prefilled,
    RequestDelta,
    ReserveBlocks,
    ReserveReply,
    RouterRegistry,
    SetRole,
    Timing,
    Tokenize,
    Usage,
)
from pdserve.worker.engine_client import Prepared
from pdserve.worker.handoff_context import Context
from pdserve.worker.messenger import Owner, engine_key, merge_deltas, to_delta
from pdserve.worker.peer_fetch import PeerFetch
from pdserve.worker.roles import RoleState
from pdserve.worker.router_watch import ROUTER_CHECK_S, RouterWatch
from pdserve.worker.splitwise import Splitwise

log = logging.getLogger(__name__)

SEEN_GENERATES = 65536  # how many recent (request id, attempt) pairs a repeated generate is checked against
MAX_DISPATCHED = 64
"""Messages handled as tasks of their own (:meth:`RequestHandler.dispatch`) at most at once: beyond,
the inbox loop reads no more (:meth:`RequestHandler.room`) until some are done."""


class RequestHandler(RouterWatch):
    def __init__(
        self,
        ctx: Context,
        role: str | RoleState,
        routers: RouterRegistry,
        stream_interval_s: float = 0.0,
        wake: asyncio.Event | None = None,
        on_role_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``role``: the instance's role (a RoleState where it may change: ``SetRole``);
        ``on_role_change``: called after a switch (the service publishes the new role at once)."""
        self.ctx = ctx
        self.roles = role if isinstance(role, RoleState) else _fixed(role)
        self.on_role_change = on_role_change
        self.wake = wake or asyncio.Event()
        """Set whenever messages were acted on (:meth:`acting`): a prepared request handed to an idle
        engine must wake the engine loop, which otherwise sleeps until its next poll."""
        self.routers = routers
        self.stream_interval_s = stream_interval_s
        """A request's tokens are published at most this often: those of the steps in between wait
        for the next step and go as one delta (its first token and its end never wait)."""
        self.owners: dict[str, Owner] = {}  # engine key -> router request, for requests this engine decodes
        self.splitwise = Splitwise(ctx)
        self.fetches = PeerFetch(ctx)  # prefix blocks fetched from peers, and served to them
        self.draining = False
        self._started: dict[
            str, float
        ] = {}  # engine key -> monotonic time its generate arrived, until token 1
        self._echo: dict[str, str] = {}  # engine key -> its prompt's text, sent with token 1 (echo)
        self._seqs: dict[str, int] = {}  # engine key -> the seq of its next delta (owners only)
        self._held: dict[str, RequestDelta] = {}  # engine key -> its tokens not published yet
        self._sent_at: dict[str, float] = {}  # engine key -> monotonic time of its latest delta
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()  # generates taken
        self._routers_seen: dict[str, float] = {}  # router id -> monotonic time its key was last seen
        self._routers_checked_at = float("-inf")
        self._routers_missing_since: dict[str, float] = {}
        """router id -> monotonic time its key was first found missing, in checks Redis answered
        since the last failure: a router is gone once that is one TTL ago."""
        self.idle = asyncio.Event()
        """Set while no message is being acted on (preparation aside): the engine loop holds its next
        step back until it is (:meth:`acting`), so that messages come before steps."""
        self.idle.set()
        self._acting = 0
        self._chains: dict[str, asyncio.Task] = {}  # request id -> the last task handling its messages
        self._dispatched: dict[asyncio.Task, InboxMessage] = {}  # those tasks, each with its message
        self._room = asyncio.Event()  # set while fewer than MAX_DISPATCHED tasks are in flight
        self._room.set()

    def in_flight(self) -> int:
        return len(self.owners) + len(self.splitwise) + len(self._dispatched)

    def handing_off(self) -> int:
        """Prefills waiting for their hand-off (``load.handing_off`` in the load report)."""
        return len(self.splitwise.prefills)

    @contextlib.contextmanager
    def acting(self) -> Iterator[None]:
        """Messages are being acted on (not prepared) meanwhile: :attr:`idle` is clear."""
        self._acting += 1
        self.idle.clear()
        try:
            yield
        finally:
            self._acting -= 1
            if not self._acting:
                self.idle.set()
            self.wake.set()

    async def room(self) -> None:
        """Wait until fewer than :data:`MAX_DISPATCHED` messages are handled as tasks."""
        await self._room.wait()

    async def dispatch(self, msg: InboxMessage) -> None:
        """Act on one inbox message as the inbox loop reads it, never waiting on a preparation.

        A ``generate`` (chat template, tokenizing, grammar compilation: seconds for a large schema),
        a ``tokenize`` and a ``prefilled`` hand-off (its grammar compiled before the engine takes it
        over) run as tasks of their own, as does every later message of a request that still has
        one: a request's messages keep their order (an abort never overtakes its generate), while
        other requests' messages and the engine's steps go on. Preparations run several at once on
        the engine client's preparation threads; only their hand-over to the engine counts as
        acting (:meth:`acting`). Everything else is handled here and now."""
        request_id = msg.request_id
        prior = self._chains.get(request_id)
        if prior is None and not isinstance(msg, (GenerateRequest, Tokenize, Prefilled)):
            await self.handle(msg)
            return
        task = asyncio.get_running_loop().create_task(self._after(prior, msg))
        self._chains[request_id] = task
        self._dispatched[task] = msg
        if len(self._dispatched) >= MAX_DISPATCHED:
            self._room.clear()
        task.add_done_callback(self._dispatch_done)

    def _dispatch_done(self, task: asyncio.Task) -> None:
        msg = self._dispatched.pop(task)
        if self._chains.get(msg.request_id) is task:
            del self._chains[msg.request_id]
        if len(self._dispatched) < MAX_DISPATCHED:
            self._room.set()

    async def _after(self, prior: asyncio.Task | None, msg: InboxMessage) -> None:
        """Handle ``msg`` once ``prior`` (the previous message of its request) is done: its
        preparation first, off the engine's way, then the rest as :meth:`acting`."""
        if prior is not None:
            await asyncio.wait([prior])  # its outcome is its own: this one only comes after it
        try:
            if isinstance(msg, GenerateRequest):
                ready = await self._prepare_generate(msg)
                if ready is not None:
                    hold = await self.fetches.before_admit(msg, ready[0])  # not acting: it waits on a peer
                    with self.acting():
                        await self._admit(msg, *ready, hold=hold)
                return
            if isinstance(msg, Prefilled):
                lease = self.splitwise.leases.get(engine_key(msg.request_id, msg.attempt))
                if lease is not None and msg.error is None:
                    # its grammar compiled (and cached) first; an error is the hand-over's to report
                    with contextlib.suppress(PdserveError):
                        await self.ctx.engine.check_prefilled(list(msg.prompt_token_ids), lease.msg.sampling)
            elif isinstance(msg, Tokenize):
                await self._handle(msg)
                return
        except Exception as e:
            log.exception("handling %s for %s failed", msg.type, msg.request_id)
            await self._failed(msg, e)
            return
        with self.acting():
            await self.handle(msg)

    async def handle(self, msg: InboxMessage) -> None:
        """Act on one inbox message and wait for it, preparation included (:meth:`dispatch` does
        not wait on preparations); whatever it raises ends its request with a final error event
        (and frees what it held), never the loop that called."""
        try:
            await self._handle(msg)
        except Exception as e:
            log.exception("handling %s for %s failed", msg.type, msg.request_id)
            await self._failed(msg, e)

    async def _handle(self, msg: InboxMessage) -> None:
        if isinstance(msg, GenerateRequest):
            await self.on_generate(msg)
        elif isinstance(msg, ReserveBlocks):
            await self.splitwise.on_reserve(msg, accepting=not self.draining)
        elif isinstance(msg, ReserveReply):
            await self.splitwise.on_reserve_reply(msg)
        elif isinstance(msg, Prefilled):
            key = engine_key(msg.request_id, msg.attempt)
            if key in self.owners:  # a send prefill repeated (its replica wait failed): decoding already
                log.info("ignoring a repeated prefilled for %s (attempt %d)", msg.request_id, msg.attempt)
                return
            owner = await self.splitwise.on_prefilled(msg)
            if owner is not None:
                self.owners[key] = owner
                self._seqs[key] = msg.next_seq  # prefill published the deltas before
                self._sent_at[key] = self.ctx.clock.monotonic()  # ... its first token just now
        elif isinstance(msg, Abort):
            await self.on_abort(msg)
        elif isinstance(msg, Tokenize):
            await self.on_tokenize(msg)
        elif isinstance(msg, (FetchBlocks, FetchedBlocks)):
            await self.fetches.handle(msg)
        elif isinstance(msg, SetRole):
            outcome = self.roles.switch(msg, self.draining)
            if outcome.ok and self.on_role_change is not None:
                await self.on_role_change()

    @property
    def role(self) -> str:
        """What routers send this instance now (its registration's ``role``)."""
        return self.roles.role

    async def on_tokenize(self, msg: Tokenize) -> None:
        """Answer ``POST /tokenize`` or ``/detokenize`` with one final delta (even while draining:
        it takes no KV)."""
        owner = Owner(msg.router_id, msg.request_id, 0)
        try:
            ids, text = await self.ctx.engine.tokenize(msg)
        except InvalidRequestError as e:
            await self.ctx.messenger.fail(owner, e)
            return
        usage = Usage(prompt_tokens=len(ids), completion_tokens=0)
        delta = RequestDelta(
            request_id=msg.request_id, token_ids=ids, text=text, finish_reason="stop", usage=usage
        )
        await self.ctx.messenger.deliver(owner, delta)

    async def _failed(self, msg: InboxMessage, e: Exception) -> None:
        """The final error event of the request whose message raised ``e``; frees what it held."""
        error = e if isinstance(e, PdserveError) else self._internal(e)
        try:
            if isinstance(msg, Tokenize):
                await self.ctx.messenger.fail(Owner(msg.router_id, msg.request_id, 0), error)
            elif isinstance(msg, GenerateRequest):
                owner = Owner(msg.router_id, msg.request_id, msg.attempt)
                await self._end(engine_key(msg.request_id, msg.attempt), error, owner)
            elif isinstance(msg, (Prefilled, ReserveReply)):
                # a prefilled is its writer's last word: the lease need not wait for its backstop
                key = engine_key(msg.request_id, msg.attempt)
                await self._end(key, error, None, writer_done=isinstance(msg, Prefilled))
            elif isinstance(msg, ReserveBlocks):
                refusal = ReserveReply(request_id=msg.request_id, ok=False, attempt=msg.attempt)
                refusal.error = error.message
                await self.ctx.messenger.send(msg.reply_to, refusal)
        except Exception:
            log.exception("could not end %s after its failure", msg.request_id)

    def _internal(self, e: BaseException) -> PdserveError:
        """A foreign error as the client sees it: its type only (the details are in this log)."""
        return PdserveError(f"instance {self.ctx.instance_id} failed the request ({type(e).__name__})")

    async def _end(
        self, key: str, error: PdserveError, owner: Owner | None, writer_done: bool = False
    ) -> None:
        """Fail the request ``key`` wherever it is (hand-off or engine), free its blocks, tell its router."""
        if await self.splitwise.fail(key, error, writer_done):
            return  # its hand-off told the router (and decode)
        owner = self._forget(key) or owner
        await self.ctx.engine.abort(key, "failed")
        if owner is not None:
            await self.ctx.messenger.fail(owner, error)

    def _forget(self, key: str) -> Owner | None:
        """Drop what this handler keeps of an engine request; its owner, if it had one."""
        self._started.pop(key, None)
        self._echo.pop(key, None)
        self._seqs.pop(key, None)
        self._held.pop(key, None)
        self._sent_at.pop(key, None)
        return self.owners.pop(key, None)

    def _repeated(self, key: str) -> bool:
        """Whether a generate for ``key`` came before (Redis retries may deliver one twice)."""
        if key in self._seen or key in self.owners or key in self.splitwise.prefills:
            return True
        self._seen[key] = None
        if len(self._seen) > SEEN_GENERATES:
            self._seen.popitem(last=False)
        return False

    async def on_generate(self, msg: GenerateRequest) -> None:
        ready = await self._prepare_generate(msg)
        if ready is not None:
            await self._admit(msg, *ready, hold=await self.fetches.before_admit(msg, ready[0]))

    async def _prepare_generate(self, msg: GenerateRequest) -> tuple[Prepared, float] | None:
        """A generate's checks and preparation (off the engine thread): what to admit and when it
        arrived, or None when its request already got its final event (or is a repeat)."""
        received = self.ctx.clock.monotonic()
        owner = Owner(msg.router_id, msg.request_id, msg.attempt)
        messenger = self.ctx.messenger
        if self._repeated(engine_key(msg.request_id, msg.attempt)):
            log.info("ignoring a repeated generate for %s (attempt %d)", msg.request_id, msg.attempt)
            return None
        if self.draining:
            error = UnavailableError(f"instance {self.ctx.instance_id} is draining")
            await messenger.fail(owner, error, retryable=True)
            return None
        if self.ctx.clock.time() > msg.deadline:
            await messenger.fail(
                owner, RequestTimeoutError("the request's deadline passed before it started")
            )
            return None
        if not await self._router_alive(msg.router_id):
            log.info("dropping %s: router %s is gone", msg.request_id, msg.router_id)
            await messenger.fail(owner, self._router_gone_error(), retryable=True)
            return None
        try:
            prepared = await self.ctx.engine.prepare(msg)
        except InvalidRequestError as e:
            if msg.messages is not None and e.param == "prompt":
                e.param = "messages"  # the field the client sent
            await messenger.fail(owner, e)
            return None
        return prepared, received

    async def _admit(
        self, msg: GenerateRequest, prepared: Prepared, received: float, hold: str | None = None
    ) -> None:
        """Hand a prepared generate to the engine (or to its prefill hand-off); ``hold``: the key of
        the prefix blocks held for it (a peer fetch's, peer_fetch.py)."""
        owner = Owner(msg.router_id, msg.request_id, msg.attempt)
        info = msg.disaggregate_info
        if info is not None and info.decode.id != self.ctx.instance_id:
            # split, sent here: this instance's part is the prefill, as the router chose when it
            # sent it (whatever its role since)
            await self.splitwise.start_prefill(msg, prepared, hold)
        else:
            key = engine_key(msg.request_id, msg.attempt)
            self.owners[key] = owner
            self._seqs[key] = 0
            if not prepared.resume_ids:  # a resumed request's first token is not its TTFT
                self._started[key] = received
            if prepared.prompt_text is not None:
                self._echo[key] = prepared.prompt_text
            try:
                await self.ctx.engine.add(key, prepared, hold=hold)
            except InvalidRequestError as e:  # e.g. resumed tokens that do not follow its grammar
                self._forget(key)
                await self.ctx.messenger.fail(owner, e)
                return

    async def on_abort(self, msg: Abort) -> None:
        prefix = f"{msg.request_id}/"
        keys = [k for k in {*self.owners, *self.splitwise.keys()} if k.startswith(prefix)]
        if msg.attempt is not None:
            keys = [k for k in keys if k == engine_key(msg.request_id, msg.attempt)]
        for key in keys:
            if self._forget(key) is not None:
                await self.ctx.engine.abort(key, msg.reason)
            await self.splitwise.abort(key, msg.reason, writer_done=bool(msg.writer_done))
        if keys:
            log.info("aborted %s (%s)", msg.request_id, msg.reason)

    async def on_outputs(self, outputs: Iterable[RequestOutput]) -> None:
        """One step's outputs: tokens to routers (one entry per router), hand-offs to their machines."""
        deltas: dict[str, list[RequestDelta]] = collections.defaultdict(list)
        handoffs = []
        failed: list[tuple[str, PdserveError, Owner | None]] = []
        for out in outputs:
            if out.request_id in self.splitwise.prefills:
                handoffs.append(out)
                continue
            owner = self.owners.get(out.request_id)
            if owner is None:
                continue  # aborted meanwhile
            try:
                delta = self._delta(out, owner)
            except Exception as e:
                log.exception("publishing the output of %s failed", out.request_id)
                failed.append((out.request_id, self._internal(e), owner))
            else:
                if delta is not None:
                    deltas[owner.router_id].append(delta)
        sent = self.ctx.messenger.post(deltas)  # the next step runs while it is sent...
        if handoffs or self.ctx.messenger.backlogged:  # ... unless a hand-off must follow it, or Redis fails
            await sent
        for out in handoffs:
            try:
                await self.splitwise.on_output(out)
            except Exception as e:
                log.exception("the hand-off of %s failed", out.request_id)
                failed.append((out.request_id, self._internal(e), None))
        for key, error, maybe_owner in failed:
            await self._end(key, error, maybe_owner)

    def _delta(self, out: RequestOutput, owner: Owner) -> RequestDelta | None:
        """The event of one output of a request this engine serves (numbered within its attempt),
        or None while its tokens wait for the stream interval (:attr:`stream_interval_s`)."""
        key = out.request_id
        now = self.ctx.clock.monotonic()
        delta = to_delta(out, owner, 0)
        started = self._started.pop(key, None)
        if started is not None:
            delta.timing = Timing(s_ttft_s=now - started, queue_s=out.queue_s)
        delta.prompt_text = self._echo.pop(key, None)
        held = self._held.pop(key, None)
        if held is not None:
            delta = merge_deltas(held, delta)
        if not out.finished and now - self._sent_at.get(key, float("-inf")) < self.stream_interval_s:
            self._held[key] = delta
            return None
        return self._numbered(key, delta, now, out.finished)

    def _numbered(self, key: str, delta: RequestDelta, now: float, final: bool) -> RequestDelta:
        """``delta``, numbered, as it leaves: the request is forgotten after its final one."""
        delta.seq = self._seqs.get(key, 0)
        if final:
            self._forget(key)
        else:
            self._seqs[key] = delta.seq + 1
            self._sent_at[key] = now
        return delta

    def _post_due(self, now: float) -> None:
        """Post the held tokens whose interval passed (a request the engine stopped stepping for a
        while, preempted or waiting, does not keep them until its next step)."""
        due: dict[str, list[RequestDelta]] = collections.defaultdict(list)
        for key in [
            k for k in self._held if now - self._sent_at.get(k, float("-inf")) >= self.stream_interval_s
        ]:
            delta, owner = self._held.pop(key), self.owners.get(key)
            if owner is not None:
                due[owner.router_id].append(self._numbered(key, delta, now, False))
        if due:
            self.ctx.messenger.post(due)

    async def tick(self) -> None:
        """Timers of the hand-offs and of held tokens; once a second, drop the work of routers
        that are gone."""
        await self.splitwise.tick()
        await self.fetches.tick()
        now = self.ctx.clock.monotonic()
        if self._held:
            self._post_due(now)
        if now - self._routers_checked_at >= ROUTER_CHECK_S:
            self._routers_checked_at = now
            await self._drop_orphans()

    async def fail_all(self, message: str) -> None:
        """Every request still here gets a clear final event (retryable if no token went out yet);
        messages still handled as tasks are stopped first."""
        dispatched = dict(self._dispatched)
        for task in dispatched:
            task.cancel()
        await asyncio.gather(*dispatched, return_exceptions=True)
        owners = [(owner, False) for owner in self.owners.values()]
        handing_off = self.splitwise.keys()
        for msg in dispatched.values():  # those not handed to the engine yet (no token went out)
            if isinstance(msg, (GenerateRequest, Tokenize)):
                attempt = msg.attempt if isinstance(msg, GenerateRequest) else 0
                key = engine_key(msg.request_id, attempt)
                if key not in self.owners and key not in handing_off:
                    owners.append((Owner(msg.router_id, msg.request_id, attempt), True))
        owners += [(owner, True) for owner in await self.splitwise.stop_all(message)]
        await self.fetches.stop_all()
        self.owners.clear()
        self._started.clear()
        self._echo.clear()
        self._seqs.clear()
        self._held.clear()
        self._sent_at.clear()
        if owners:
            await self.ctx.messenger.fail_many(owners, UnavailableError(message))


def _fixed(role: str) -> RoleState:
    """The role of an instance that never switches (tests; the service passes its RoleState)."""
    return RoleState(role, shared_cache=role == "decode", transports=lambda: role != "mixed", now=lambda: 0.0)
