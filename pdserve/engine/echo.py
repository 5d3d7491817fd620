"""``pdserve worker --engine echo``: the engine's interface without a model, as a benchmarking aid.

It generates exactly the requested number of tokens (the prompt's tokens, cycled) with no model
computation, so the router, Redis and the hand-off can be measured without the model being the
bottleneck: same messages, same Redis traffic, same splitwise hand-off, with a small KV payload
(one 64-byte "block" per block_size prompt tokens, in shared memory on a decode instance, moved by
the real transport). Its block bookkeeping is real (reservations, leases, frees). Not for serving.
Structured output (``response_format``, ``guided_*``) needs a model's choices: refused with a 400.
Logprobs (of the tokens, and of the prompt with ``prompt_logprobs``) are all 0: rank 1, certain.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.cache_transfer import shm
from pdserve.engine.batcher import blocks_for
from pdserve.engine.config import EngineConfig
from pdserve.engine.outputs import EngineFacts, EngineLoad, RequestOutput, TokenLogprob
from pdserve.errors import EngineError, InvalidRequestError, RequestTooLongError
from pdserve.sampling_params import SamplingParams, guided_param

log = logging.getLogger(__name__)

BLOCK_BYTES = 64
ECHO_LAYOUT = "echo"  # a block is BLOCK_BYTES stand-in bytes, not a model's K/V rows
ECHO_WEIGHTS = "echo"  # its weights digest: no weights, its stand-in bytes depend on the prompt only
DEFAULT_NUM_BLOCKS = 16384
DEFAULT_MAX_MODEL_LEN = 32768


@dataclasses.dataclass
class EchoRequest:
    key: str
    prompt: list[int]
    params: SamplingParams
    blocks: list[int]
    prefill_only: bool
    out: list[int] = dataclasses.field(default_factory=list)
    background: bool = False


class EchoEngine:
    block_bytes_per_block = BLOCK_BYTES

    def __init__(self, model_dir: str | Path | None, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks or DEFAULT_NUM_BLOCKS
        self.max_model_len = config.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.tokenizer = None
        if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
            from pdserve.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_dir(model_dir)
        nbytes = self.num_blocks * self.block_bytes_per_block
        self.segment = None
        if config.shared_kv:
            name = config.shm_name or f"pdserve-echo-{id(self):x}"
            self.segment = shm.create_segment(name, nbytes, reclaim=config.shm_name is not None)
            self.cache = np.ndarray((nbytes,), dtype=np.uint8, buffer=self.segment.buf)
        else:
            self.cache = np.zeros(nbytes, dtype=np.uint8)
        self.free = list(range(self.num_blocks))
        self.requests: dict[str, EchoRequest] = {}
        self.prefilled: dict[str, EchoRequest] = {}
        self.reserved: dict[str, list[int]] = {}
        self.pending: list[RequestOutput] = []
        log.info(
            "echo engine (no model: a benchmarking aid): %d blocks of %d tokens",
            self.num_blocks,
            self.block_size,
        )

    # ---- what the model would decide -------------------------------------------------------------
    def token(self, req: EchoRequest) -> int:
        """The next output token: the prompt's tokens, cycled."""
        return req.prompt[len(req.out) % len(req.prompt)]

    def kv_byte(self, req: EchoRequest, block: int) -> int:
        """The byte that fills the prompt's ``block``-th KV block (a stand-in payload)."""
        return (sum(req.prompt) + block + 1) % 251

    def text(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f"<{t}>" for t in tokens)
        return "".join(self.tokenizer.token_text(t) for t in tokens)

    # ---- the engine interface (engine_client.Engine) ---------------------------------------------
    def facts(self) -> EngineFacts:
        return EngineFacts(
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes_per_block,
            # no model: no layers or heads; its blocks hold stand-in bytes, paired only with its kind
            num_layers=0,
            num_kv_heads=0,
            head_dim=0,
            dtype="uint8",
            layout=ECHO_LAYOUT,
            shm_name=self.segment.name if self.segment else None,
            vocab_size=self.tokenizer.vocab_size if self.tokenizer is not None else None,
            weights_digest=ECHO_WEIGHTS,
            batch_invariant=True,  # its tokens are a function of the prompt alone
            calls_inline=True,
        )

    def load(self) -> EngineLoad:
        background = sum(r.background for r in self.requests.values())
        return EngineLoad(running=len(self.requests), free_blocks=len(self.free), background=background)

    def kv_view(self) -> np.ndarray:
        return self.cache

    def prompt_ids(
        self,
        prompt: str | None,
        messages: list[dict] | None,
        prompt_token_ids: list[int] | None,
        tools: list[dict] | None = None,
        *,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        if prompt_token_ids is not None:
            return list(prompt_token_ids)
        if messages is not None:
            prompt = "\n".join(str(m.get("content") or "") for m in messages)
        if self.tokenizer is not None:
            return self.tokenizer.encode(prompt or "")
        return [ord(c) % 100 + 1 for c in (prompt or "")]

    def prompt_text(self, prompt_token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return self.text(prompt_token_ids)
        return self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if params.guided is not None:
            raise InvalidRequestError(
                "structured output is not supported by the echo engine (it has no model)",
                guided_param(params.guided),
            )
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise RequestTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens", "prompt"
            )

    def _allocate(self, n: int) -> list[int]:
        if len(self.free) < n:
            raise EngineError(f"cannot allocate {n} KV blocks: {len(self.free)} free")
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def add_request(
        self,
        request_id: str,
        *,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        resume_token_ids: list[int] | None = None,
        background: bool = False,  # counted in the load; the echo engine runs everything at once
    ) -> None:
        if request_id in self.requests or request_id in self.prefilled:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        resume = list(resume_token_ids or ())
        blocks = self._allocate(blocks_for(len(prompt_token_ids) + len(resume), self.block_size))
        self.requests[request_id] = EchoRequest(
            request_id, list(prompt_token_ids), params, blocks, prefill_only, resume, background
        )

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        num_cached_tokens: int = 0,  # the echo engine caches nothing
        background: bool = False,
    ) -> None:
        blocks = self.reserved.pop(request_id, None)
        if blocks is None:
            raise EngineError(f"no reserved blocks for request {request_id!r}")
        self.requests[request_id] = EchoRequest(
            request_id, list(prompt_token_ids), params, blocks, False, [first_token], background
        )

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.pending)

    def step(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        for req in list(self.requests.values()):
            if not req.out:  # the prompt's step: write its (stand-in) KV
                bb = self.block_bytes_per_block
                for i, b in enumerate(req.blocks):
                    self.cache[b * bb : (b + 1) * bb] = self.kv_byte(req, i)
            token = self.token(req)
            kw = {"prompt_logprobs": self._prompt_logprobs(req)} if not req.out else {}
            req.out.append(token)
            if len(req.out) >= req.params.max_tokens:
                outputs.append(self._finish(req, "length", [token], **kw))
            elif req.prefill_only:
                del self.requests[req.key]
                self.prefilled[req.key] = req
                outputs.append(self._output(req, [token], prefilled=True, **kw))
            else:
                outputs.append(self._output(req, [token], **kw))
        return outputs

    def _logprob(self, token: int) -> TokenLogprob:
        return TokenLogprob(token, 0.0, [(token, 0.0)], self.text([token]), [self.text([token])], 1)

    def _prompt_logprobs(self, req: EchoRequest) -> list[TokenLogprob] | None:
        """With the first token: the prompt's, when asked (the first has none: nothing precedes it)."""
        if req.params.prompt_logprobs is None:
            return None
        first = TokenLogprob(req.prompt[0], None, token=self.text(req.prompt[:1]))
        return [first, *map(self._logprob, req.prompt[1:])]

    def _output(self, req: EchoRequest, tokens: list[int], **kw: Any) -> RequestOutput:
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = [self._logprob(t) for t in tokens]
        return RequestOutput(
            req.key, tokens, self.text(tokens), len(req.prompt), len(req.out), logprobs=logprobs, **kw
        )

    def _finish(
        self, req: EchoRequest, reason: str, tokens: list[int] | None = None, **kw: Any
    ) -> RequestOutput:
        del self.requests[req.key]
        self.free += req.blocks
        return self._output(req, tokens or [], finished=True, finish_reason=reason, **kw)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return self.release_prefilled(request_id) or self.cancel_reservation(request_id)
        self.pending.append(self._finish(req, reason))
        return True

    def can_reserve(self, num_prompt_tokens: int) -> bool:
        return len(self.free) >= blocks_for(num_prompt_tokens, self.block_size)

    def reserve(self, request_id: str, num_prompt_tokens: int) -> list[int]:
        if request_id in self.reserved or request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self.reserved[request_id] = self._allocate(blocks_for(num_prompt_tokens, self.block_size))
        return self.reserved[request_id]

    def reserve_prompt(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], int] | None:
        """No prefix cache here: every block is reserved, none is already held."""
        if not self.can_reserve(len(prompt_token_ids)):
            return None
        return self.reserve(request_id, len(prompt_token_ids)), 0

    # no prefix cache here: nothing to serve a peer's fetch from, nothing fetched (prefix_pins.py)
    def pin_blocks(self, key: str, hashes: list[bytes]) -> list[int]:
        return []

    def release_held(self, key: str) -> bool:
        return False

    def reserve_fetch(
        self, key: str, prompt_token_ids: list[int], params: SamplingParams, num_blocks: int
    ) -> tuple[list[bytes], list[int]]:
        return [], []

    def adopt_fetched(self, key: str, num_written: int) -> int:
        return 0

    def cancel_fetch(self, key: str) -> bool:
        return False

    def attach_held(self, key: str, request_id: str) -> None:
        pass

    def take_prefix_changes(self) -> dict[bytes, bool]:
        return {}

    def prefix_hashes(self) -> list[bytes]:
        return []

    def take_tier_changes(self) -> dict[bytes, bool]:
        return {}

    def tier_hashes(self) -> list[bytes]:
        return []

    def take_disk_changes(self) -> dict[bytes, bool]:
        return {}

    def disk_hashes(self) -> list[bytes]:
        return []

    def watch_disk(self, callback: Callable[[], None]) -> None:
        pass

    def cancel_reservation(self, request_id: str) -> bool:
        blocks = self.reserved.pop(request_id, None)
        if blocks is None:
            return False
        self.free += blocks
        return True

    def prefilled_blocks(self, request_id: str) -> list[int]:
        req = self.prefilled.get(request_id)
        if req is None:
            raise EngineError(f"request {request_id!r} is not a prefilled sequence on this engine")
        return req.blocks

    def release_prefilled(self, request_id: str) -> bool:
        req = self.prefilled.pop(request_id, None)
        if req is None:
            return False
        self.free += req.blocks
        return True

    def close(self) -> None:
        if self.segment is not None:
            del self.cache
            self.segment.close()  # the owner's close removes the segment
            self.segment = None
