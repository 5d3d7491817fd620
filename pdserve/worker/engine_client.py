"""The engine behind its one thread: the only way the service reaches the engine.

The engine's state (batcher, block tables, reservations) is touched by one thread only, the one
this client owns; the asyncio loop awaits each call and never reads engine attributes itself. The
load the heartbeat reports is a snapshot taken on that thread after every call. Any object with
the engine's methods can sit behind the client (tests use a small stub engine).

Preparing a request (chat template, tokenization, grammar compilation) only reads the engine's
tokenizer and its grammar cache (which locks itself), so it runs on a small pool of its own, whose
threads run at a lower OS priority (``--prepare-nice``, :mod:`pdserve.priority`): a large prompt or schema never holds up
decode steps, neither by the GIL (the tokenizer and llguidance release it) nor by the cores (the
kernel gives them to the engine's threads first). Its size and shape are bounded
(:class:`PrepareLimits`) before any of that work starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from pdserve.cache_transfer.regions import Region, block_regions
from pdserve.engine.outputs import EngineFacts, EngineLoad, RequestOutput
from pdserve.errors import InvalidRequestError, RequestTooLongError
from pdserve.grammar_limits import DEFAULT_MAX_OPTIONAL_PROPERTIES, check_optional_properties
from pdserve.priority import PREPARE_NICE, preparation_pool
from pdserve.sampling_params import SamplingParams, guided_param
from pdserve.scheduler.inbox_messages import GenerateRequest, Tokenize
from pdserve.worker.metrics import WorkerMetrics

T = TypeVar("T")

PREPARE_THREADS = 2  # tokenization and grammar compilation release the GIL: two overlap


@dataclasses.dataclass(frozen=True)
class PrepareLimits:
    """What one request may make this worker tokenize or compile (``--max-prompt-chars-per-token``,
    ``--max-grammar-bytes``, ``--max-optional-properties``); beyond, a 400 naming the field, before
    any work is done."""

    prompt_chars_per_token: int
    grammar_bytes: int
    optional_properties: int = DEFAULT_MAX_OPTIONAL_PROPERTIES
    """``--max-optional-properties``: see :mod:`pdserve.grammar_limits`."""


class Engine(Protocol):
    """What the service needs from an engine (``LLMEngine`` is the real one)."""

    def facts(self) -> EngineFacts: ...
    def load(self) -> EngineLoad: ...
    def prompt_ids(
        self,
        prompt: str | None,
        messages: list[dict] | None,
        prompt_token_ids: list[int] | None,
        tools: list[dict] | None = None,
        *,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...
    def prompt_text(self, prompt_token_ids: list[int]) -> str: ...
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def add_request(
        self,
        request_id: str,
        *,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        resume_token_ids: list[int] | None = None,
        background: bool = False,
    ) -> Any: ...
    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        num_cached_tokens: int = 0,
        background: bool = False,
    ) -> Any: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def abort(self, request_id: str, reason: str = "abort") -> bool: ...
    def reserve_prompt(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], int] | None: ...
    def take_prefix_changes(self) -> dict[bytes, bool]: ...
    def prefix_hashes(self) -> list[bytes]: ...
    def take_tier_changes(self) -> dict[bytes, bool]: ...
    def tier_hashes(self) -> list[bytes]: ...
    def take_disk_changes(self) -> dict[bytes, bool]: ...
    def disk_hashes(self) -> list[bytes]: ...
    def watch_disk(self, callback: Callable[[], None]) -> None: ...
    def cancel_reservation(self, request_id: str) -> bool: ...
    def pin_blocks(self, key: str, hashes: list[bytes]) -> list[int]: ...
    def release_held(self, key: str) -> bool: ...
    def reserve_fetch(
        self, key: str, prompt_token_ids: list[int], params: SamplingParams, num_blocks: int
    ) -> tuple[list[bytes], list[int]]: ...
    def adopt_fetched(self, key: str, num_written: int) -> int: ...
    def cancel_fetch(self, key: str) -> bool: ...
    def attach_held(self, key: str, request_id: str) -> None: ...
    def prefilled_blocks(self, request_id: str) -> list[int]: ...
    def release_prefilled(self, request_id: str) -> bool: ...
    def kv_view(self) -> Any: ...
    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A generate request made ready for the engine: its prompt ids and full sampling params
    (``resume_ids``: tokens already delivered by an earlier attempt, see GenerateRequest;
    ``prompt_text``: the prompt's text when the request asked for it, ``echo``)."""

    prompt_ids: list[int]
    params: SamplingParams
    resume_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_text: str | None = None
    background: bool = False


class EngineClient:
    def __init__(self, engine: Engine, executor: ThreadPoolExecutor, nice: int = PREPARE_NICE) -> None:
        self._engine = engine
        self._exec = executor
        self.facts = engine.facts()
        self.load = engine.load()
        self.unfinished = False  # as of the last call: the engine has work to step
        self.metrics: WorkerMetrics | None = None  # set by the service with --metrics-port
        self.limits: PrepareLimits | None = None  # None: unbounded (tests with a stub engine)
        self._prep = preparation_pool(PREPARE_THREADS, nice)
        self._prefix_lock = threading.Lock()
        # gathered on the engine thread after each call, per tier ("pool": the prefix cache; "host")
        self._prefix_changes: dict[str, dict[bytes, bool]] = {"pool": {}, "host": {}}

    @classmethod
    async def start(
        cls, factory: Callable[[], Engine], limits: PrepareLimits | None = None, nice: int = PREPARE_NICE
    ) -> EngineClient:
        """Build the engine on its own new thread (the thread that will run every later call);
        preparation runs ``nice`` nicer (0: at the engine's priority)."""
        executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        engine = await asyncio.get_running_loop().run_in_executor(executor, factory)
        client = await asyncio.get_running_loop().run_in_executor(executor, cls, engine, executor, nice)
        client.limits = limits
        return client

    async def _run(self, fn: Callable[[], T]) -> T:
        def call() -> T:
            try:
                return fn()
            finally:  # every call may change the blocks in use (a step, an abort, a release)
                self.unfinished = self._engine.has_unfinished()
                self.load = self._engine.load()
                if self.facts.prefix_caching and (changes := self._engine.take_prefix_changes()):
                    with self._prefix_lock:
                        self._prefix_changes["pool"].update(changes)
                if self.facts.host_tier and (changes := self._engine.take_tier_changes()):
                    with self._prefix_lock:
                        self._prefix_changes["host"].update(changes)

        if self.facts.calls_inline:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self._exec, call)

    async def _off(self, fn: Callable[[], T]) -> T:
        """Run read-only preparation (templates, tokenizer, grammar compiler) off the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn)

    def _check_prompt(
        self, prompt: str | None, messages: list[dict] | None, tools: list[dict] | None
    ) -> None:
        """Refuse a prompt whose characters cannot fit the model length (O(n), before tokenizing)."""
        if self.limits is None:
            return
        limit = self.limits.prompt_chars_per_token * self.facts.max_model_len
        if messages is None:
            chars, param = len(prompt or ""), "prompt"
        else:
            chars, param = _chars(messages) + (len(json.dumps(tools)) if tools else 0), "messages"
        if chars > limit:
            raise RequestTooLongError(
                f"this model's maximum context length is {self.facts.max_model_len} tokens; the {param} "
                f"has {chars} characters, more than the {limit} that could fit",
                param,
            )

    def _check_grammar(self, params: SamplingParams) -> None:
        """Refuse a grammar larger than ``--max-grammar-bytes``, or a JSON schema with an object of
        more than ``--max-optional-properties``, before it is compiled."""
        guided = params.guided
        if self.limits is None or guided is None:
            return
        size = len(json.dumps(guided["spec"], ensure_ascii=False, separators=(",", ":")).encode())
        if size > self.limits.grammar_bytes:
            raise InvalidRequestError(
                f"the structured output spec has {size} bytes, more than this server's limit of "
                f"{self.limits.grammar_bytes}",
                guided_param(guided),
            )
        if guided["kind"] == "json":
            check_optional_properties(guided["spec"], self.limits.optional_properties, guided_param(guided))

    # ---- requests --------------------------------------------------------------------------------
    async def tokenize(self, msg: Tokenize) -> tuple[list[int], str]:
        """``msg``'s token ids and text: its input tokenized, or its ``token_ids`` decoded."""
        if msg.token_ids is not None:
            vocab = self.facts.vocab_size
            bad = next((t for t in msg.token_ids if t < 0 or (vocab is not None and t >= vocab)), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"token id {bad} is outside the model's vocabulary of {vocab} tokens", "tokens"
                )
            ids = msg.token_ids
            return ids, await self._off(lambda: self._engine.prompt_text(ids))

        def tokenize() -> list[int]:
            self._check_prompt(msg.prompt, msg.messages, msg.tools)
            return self._engine.prompt_ids(
                msg.prompt,
                msg.messages,
                None,
                msg.tools,
                add_special_tokens=msg.add_special_tokens,
                add_generation_prompt=msg.add_generation_prompt,
            )

        return await self._off(tokenize), ""

    async def prepare(self, msg: GenerateRequest) -> Prepared:
        """Tokenize and check against the engine (the router validated the sampling settings);
        ``fill_max_tokens`` (chat without a limit) means up to the model length. Off the engine
        thread, sizes checked first."""

        def prepare() -> Prepared:
            self._check_grammar(msg.sampling)
            if msg.prompt_token_ids is None:
                self._check_prompt(msg.prompt, msg.messages, msg.tools)
            ids = self._engine.prompt_ids(msg.prompt, msg.messages, msg.prompt_token_ids, msg.tools)
            params = msg.sampling
            if msg.fill_max_tokens:
                params = params.with_max_tokens(max(1, self.facts.max_model_len - len(ids)))
            self._engine.validate(ids, params)
            resume = list(msg.resume_token_ids or ())
            if len(resume) >= params.max_tokens:
                raise InvalidRequestError(
                    f"{len(resume)} tokens to resume from leave none of max_tokens {params.max_tokens}",
                    "resume_token_ids",
                )
            text = self._engine.prompt_text(ids) if msg.echo and not resume else None
            return Prepared(ids, params, resume, text, bool(msg.background))

        return await self._off(prepare)

    async def add(
        self, key: str, prepared: Prepared, prefill_only: bool = False, hold: str | None = None
    ) -> None:
        """Queue a prepared request; ``hold``: the key of the prefix blocks a peer fetch held for it
        (given to the request, or let go when the engine refuses it)."""

        def add() -> None:
            try:
                self._engine.add_request(
                    key,
                    prompt_token_ids=prepared.prompt_ids,
                    params=prepared.params,
                    prefill_only=prefill_only,
                    resume_token_ids=prepared.resume_ids or None,
                    background=prepared.background,
                )
            except BaseException:
                if hold is not None:
                    self._engine.release_held(hold)
                raise
            if hold is not None:
                self._engine.attach_held(hold, key)

        await self._run(add)

    async def add_prefilled(
        self,
        key: str,
        prompt_ids: list[int],
        first_token: int,
        params: SamplingParams,
        num_cached: int = 0,
        background: bool = False,
    ) -> None:
        """Continue a prefilled request; its grammar is compiled (and cached) off the engine thread first."""
        await self.check_prefilled(prompt_ids, params)
        await self._run(
            lambda: self._engine.add_prefilled(key, prompt_ids, first_token, params, num_cached, background)
        )

    async def check_prefilled(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """A prefilled request's grammar checked, compiled and cached off the engine thread (the
        worker does it before the hand-over, which then finds it compiled)."""
        if params.guided is not None:
            self._check_grammar(params)
            await self._off(lambda: self._engine.validate(prompt_ids, params))

    async def step(self) -> list[RequestOutput]:
        metrics = self.metrics
        if metrics is None:
            return await self._run(self._engine.step)

        def step() -> list[RequestOutput]:
            t0 = time.perf_counter()
            outputs = self._engine.step()
            metrics.on_step(time.perf_counter() - t0, outputs, self._engine.load().preemptions)
            return outputs

        return await self._run(step)

    async def abort(self, key: str, reason: str) -> bool:
        return await self._run(lambda: self._engine.abort(key, reason))

    # ---- KV hand-off -------------------------------------------------------------------------------
    async def try_reserve(
        self, key: str, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], int] | None:
        """Blocks for an incoming prompt's KV and how many of the first ones this engine's prefix
        cache already holds (not to be written), or None when they are not free now."""
        return await self._run(lambda: self._engine.reserve_prompt(key, prompt_ids, params))

    # ---- peer fetch (engine/prefix_pins.py) -------------------------------------------------------
    async def reserve_fetch(
        self, key: str, prompt_ids: list[int], params: SamplingParams, num_blocks: int
    ) -> tuple[list[bytes], list[int]]:
        """The fetcher: hold the prompt's prefix this engine has (under ``key``) and reserve blocks
        for the rest up to ``num_blocks``: the hashes to fetch and the blocks they go into."""
        return await self._run(lambda: self._engine.reserve_fetch(key, prompt_ids, params, num_blocks))

    async def adopt_fetched(self, key: str, num_written: int) -> int:
        return await self._run(lambda: self._engine.adopt_fetched(key, num_written))

    async def cancel_fetch(self, key: str) -> bool:
        return await self._run(lambda: self._engine.cancel_fetch(key))

    async def pin_blocks(
        self, key: str, hashes: list[bytes], expired: Callable[[], bool] | None = None
    ) -> list[int]:
        """The holder: pin the leading run of ``hashes`` this engine has (pool, then tiers). When
        the engine thread gets to it after ``expired()`` (the fetch's budget ran out during a
        step), nothing: no block is pinned or read back."""
        return await self._run(
            lambda: [] if expired is not None and expired() else self._engine.pin_blocks(key, hashes)
        )

    async def release_held(self, key: str) -> bool:
        return await self._run(lambda: self._engine.release_held(key))

    # ---- the prefix index ------------------------------------------------------------------------
    def take_prefix_changes(self, tier: str = "pool") -> dict[bytes, bool]:
        """Block hashes one tier (``pool``: the prefix cache; ``host``: the host tier; ``disk``: the
        disk tier, whose writer thread records its own, taken here directly) gained (True) or lost
        (False) since the last take."""
        if tier == "disk":
            return self._engine.take_disk_changes()
        with self._prefix_lock:
            changes, self._prefix_changes[tier] = self._prefix_changes[tier], {}
        return changes

    def watch_disk(self, callback: Callable[[], None]) -> None:
        """``callback`` runs on the disk tier's writer thread after each burst of writes."""
        self._engine.watch_disk(callback)

    async def prefix_hashes(self, tier: str = "pool") -> list[bytes]:
        """Every block hash one tier holds now; its changes gathered so far are dropped (the list
        replaces them)."""

        if tier == "disk":  # the disk tier's view is its own, under its lock
            return self._engine.disk_hashes()

        def full() -> list[bytes]:
            hashes = self._engine.prefix_hashes() if tier == "pool" else self._engine.tier_hashes()
            with self._prefix_lock:
                self._prefix_changes[tier].clear()
            return hashes

        return await self._run(full)

    async def cancel_reservation(self, key: str) -> bool:
        return await self._run(lambda: self._engine.cancel_reservation(key))

    async def prefilled_blocks(self, key: str) -> list[int]:
        """Blocks holding a prefilled prompt's KV, in block-table order."""
        return await self._run(lambda: self._engine.prefilled_blocks(key))

    def kv_view(self) -> Any:
        """The whole cache as bytes: its memory, not engine state (the transport reads pinned blocks):
        a numpy uint8 array in host memory, a flat torch.uint8 tensor on a GPU (``facts.device``)."""
        return self._engine.kv_view()

    def regions(self, block_ids: list[int]) -> list[Region]:
        """Byte regions of blocks in a cache of this engine's geometry."""
        return block_regions(block_ids, self.facts.block_bytes)

    async def release_prefilled(self, key: str) -> bool:
        return await self._run(lambda: self._engine.release_prefilled(key))

    async def close(self) -> None:
        await self._run(self._engine.close)
        self._exec.shutdown(wait=True)
        self._prep.shutdown(wait=False, cancel_futures=True)


def _chars(value: Any) -> int:
    """Characters of every string in a JSON value (chat messages: contents, names, parts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 0
