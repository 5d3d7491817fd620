"""A prompt's token ids on the router, exactly as a worker will compute them (prefix-cache routing).

Prefix-aware routing compares the KV block hashes (:mod:`pdserve.block_hash`) of a prompt with what
instances cache, so the router needs the prompt's ids as the instance's engine makes them. Instances
publish their tokenizer's files in Redis under their content digest (``InstanceInfo.tokenizer``,
``Keys.tokenizer(digest)``; the worker's service); :class:`PromptTokenizer` fetches each digest's
files once (one GET, shared by concurrent first requests), builds the same
:class:`~pdserve.tokenizer.Tokenizer` the engine uses, keeps a few, and tokenizes with
:meth:`Tokenizer.prompt_ids`, the engine's own code.

Routing is only a hint: whatever goes wrong (no digest, key missing, Redis down, a template that
rejects the chat) gives None, never an error for the client. The worker still tokenizes what it runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import orjson

from pdserve.errors import ConfigError
from pdserve.priority import PREPARE_NICE, preparation_pool
from pdserve.router.routing.policies.base import PolicyRequest
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.redis_server import redis_errors
from pdserve.tokenizer import Tokenizer, tokenizer_digest, unpack_tokenizer_files

logger = logging.getLogger(__name__)

MAX_TOKENIZERS = 4
"""Tokenizers kept (least recently used dropped first): one per model a cluster serves, usually."""
RETRY_AFTER_S = 5.0
"""After a failed fetch (key missing, Redis error, bad blob) the digest gives None this long before
the next try: a missing tokenizer costs no GET per request."""
LONG_PROMPT_CHARS = 4096
"""Prompts above this many characters are tokenized on a thread (``encode_batch`` releases the GIL),
so the router's event loop keeps serving; shorter ones inline (a thread hop costs more than them).
Those threads run ``--prepare-nice`` nicer than the router's (:mod:`pdserve.priority`): a prompt of
the model length in characters is CPU-seconds that would otherwise take a core from the decode
steps of a worker on the same host, and from the router's own relaying."""
PREPARE_THREADS = 2


def prompt_chars(request: PolicyRequest) -> int:
    """Characters the tokenizer will read: the text, or the chat's contents plus its tools' JSON."""
    if request.text is not None:
        return len(request.text)
    chars = 0
    for message in request.messages or ():
        content = message.get("content")
        chars += len(content) if isinstance(content, str) else len(str(content or ""))
    if request.tools:
        chars += len(orjson.dumps(request.tools))
    return chars


def build_tokenizer(blob: bytes, digest: str) -> Tokenizer:
    """The tokenizer of a published blob, checked against its digest (ConfigError when it differs)."""
    if tokenizer_digest(blob) != digest:
        raise ConfigError(f"the published tokenizer {digest} does not match its digest")
    return Tokenizer.from_files(unpack_tokenizer_files(blob), source=f"the published tokenizer {digest}")


class PromptTokenizer:
    """The instances' tokenizers by digest, fetched from Redis on first need, and the prompt ids they give."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        *,
        max_tokenizers: int = MAX_TOKENIZERS,
        retry_after_s: float = RETRY_AFTER_S,
        long_prompt_chars: int = LONG_PROMPT_CHARS,
        clock: Callable[[], float] = time.monotonic,
        nice: int = PREPARE_NICE,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.max_tokenizers = max_tokenizers
        self.retry_after_s = retry_after_s
        self.long_prompt_chars = long_prompt_chars
        self.clock = clock
        self.nice = nice
        self._pool: ThreadPoolExecutor | None = None  # started by the first long prompt
        self._tokenizers: OrderedDict[str, Tokenizer] = OrderedDict()
        self._fetches: dict[str, asyncio.Task[Tokenizer | None]] = {}
        self._failed_at: dict[str, float] = {}
        """digest -> when its last fetch failed (cleared by a success)."""
        self.fetches = 0
        """GETs made so far (tests and metrics)."""

    async def tokenizer(self, digest: str) -> Tokenizer | None:
        """The tokenizer published under ``digest``, or None (not published, or fetched without
        success less than ``retry_after_s`` ago). Concurrent callers share one fetch."""
        tok = self._tokenizers.get(digest)
        if tok is not None:
            self._tokenizers.move_to_end(digest)
            return tok
        failed_at = self._failed_at.get(digest)
        if failed_at is not None and self.clock() - failed_at < self.retry_after_s:
            return None
        fetch = self._fetches.get(digest)
        if fetch is None:
            fetch = self._fetches[digest] = asyncio.create_task(self._fetch(digest))
        return await asyncio.shield(fetch)  # a caller that goes away does not cancel it for the others

    async def _fetch(self, digest: str) -> Tokenizer | None:
        try:
            self.fetches += 1
            key = self.keys.tokenizer(digest)
            with redis_errors(f"reading the tokenizer {digest}"):
                blob = await self.redis.get(key)
            if blob is None:
                raise LookupError(f"no tokenizer published under {key}")
            assert isinstance(blob, bytes)  # the control plane's clients answer bytes
            tok = await asyncio.to_thread(build_tokenizer, blob, digest)
        except Exception as e:
            logger.warning(
                "prompt ids of tokenizer %s unavailable for %g s: %s", digest, self.retry_after_s, e
            )
            if len(self._failed_at) >= 64:  # digests come from registrations: few; bound it anyway
                self._failed_at.clear()
            self._failed_at[digest] = self.clock()
            return None
        finally:
            self._fetches.pop(digest, None)
        self._failed_at.pop(digest, None)
        self._tokenizers[digest] = tok
        while len(self._tokenizers) > self.max_tokenizers:
            self._tokenizers.popitem(last=False)
        return tok

    async def token_ids(self, digest: str | None, request: PolicyRequest) -> list[int] | None:
        """The prompt's token ids exactly as an instance publishing ``digest`` computes them, or None
        when they cannot be had (no digest, not published, a chat its template rejects, anything).
        A token-id prompt is its ids, whatever the digest."""
        if request.token_ids is not None:
            return list(request.token_ids)
        if digest is None or (request.text is None and request.messages is None):
            return None
        try:
            tok = await self.tokenizer(digest)
            if tok is None:
                return None
            encode = functools.partial(
                tok.prompt_ids,
                prompt=request.text,
                messages=request.messages,
                tools=request.tools,
                add_special_tokens=request.add_special_tokens,
                add_generation_prompt=request.add_generation_prompt,
            )
            if prompt_chars(request) > self.long_prompt_chars:
                if self._pool is None:
                    self._pool = preparation_pool(PREPARE_THREADS, self.nice, "prompt-ids")
                return await asyncio.get_running_loop().run_in_executor(self._pool, encode)
            return encode()
        except Exception as e:  # a hint only: the worker reports the request's own errors
            logger.debug("no prompt ids for routing (tokenizer %s): %s", digest, e)
            return None
