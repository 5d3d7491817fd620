"""The KV hand-off between a prefill and a decode instance, as ``LLMEngine`` methods (it inherits
:class:`KVHandoff`):

* prefill side: ``add_request(..., prefill_only=True)``; the step that samples the first token
  reports ``prefilled=True`` and keeps the sequence's blocks until ``release_prefilled``;
  ``prefilled_blocks`` / ``export_kv`` give its KV in block-table order.
* decode side: ``reserve`` blocks, receive the bytes (``import_kv``, or a same-host peer writes them
  straight into this engine's shared-memory cache), then ``add_prefilled`` to continue decoding.

Apart from the engine loop because it is a protocol of its own: what the worker's splitwise code
calls on each side, over the engine's block manager, batcher and cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.block_hash import chain_hashes
from pdserve.engine.batcher import Batcher, blocks_for
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.executor import EngineCache
from pdserve.engine.grammar import GrammarMatcher
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.errors import EngineError, InvalidRequestError
from pdserve.sampling_params import SamplingParams


class KVHandoff:
    """``LLMEngine``'s hand-off methods; the attributes are the engine's (set by its ``__init__``)."""

    config: EngineConfig
    cache: EngineCache
    blocks: BlockManager
    batcher: Batcher
    requests: dict[str, Any]
    prefilled: dict[str, Sequence]  # prefill-only sequences holding blocks for hand-off
    reserved: dict[str, list[int]]  # blocks reserved for incoming KV

    if TYPE_CHECKING:  # LLMEngine's: a handed-off request continues like a resumed one

        def _grammar(self, params: SamplingParams) -> GrammarMatcher | None: ...

        def _track(self, seq: Sequence) -> Any: ...

        def _replay(self, req: Any, tokens: list[int]) -> None: ...

        def hold_prefix(self, hashes: list[bytes], spare: int = 0) -> list[int]: ...  # PrefixPins's

    # ---- prefill side -----------------------------------------------------------------------
    def prefilled_blocks(self, request_id: str) -> list[int]:
        """Blocks holding the prompt's K/V, in block-table order."""
        seq = self.prefilled.get(request_id)
        if seq is None:
            raise EngineError(f"request {request_id!r} is not a prefilled sequence on this engine")
        return seq.block_table[: blocks_for(seq.num_prompt_tokens, self.config.block_size)]

    def kv_view(self) -> Any:
        """The whole cache as bytes, zero-copy: a numpy uint8 array in host memory, a flat uint8 torch
        tensor on a GPU (the KV transport reads prefilled blocks from it)."""
        return self.cache.raw_view()

    def export_kv(self, request_id: str) -> bytes:
        return self.cache.read_blocks(self.prefilled_blocks(request_id))

    def release_prefilled(self, request_id: str) -> bool:
        seq = self.prefilled.pop(request_id, None)
        if seq is None:
            return False
        self.batcher.release(seq)
        seq.status = SequenceStatus.FINISHED
        return True

    # ---- decode side ------------------------------------------------------------------------
    def reserve(self, request_id: str, num_prompt_tokens: int) -> list[int]:
        """Reserve blocks for an incoming prompt's K/V; raises EngineError when they are not free."""
        if request_id in self.reserved or request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        need = blocks_for(num_prompt_tokens, self.config.block_size)
        if not self.blocks.can_allocate(need):
            raise EngineError(f"cannot reserve {need} KV blocks: {self.blocks.num_free} free")
        self.reserved[request_id] = self.blocks.allocate(need)
        return self.reserved[request_id]

    def reserve_prompt(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], int] | None:
        """Blocks for an incoming prompt's K/V, or None when they are not free now. The prompt's
        longest prefix this engine holds comes first: its prefix cache's blocks, shared, then those
        its tiers hold, read back into the pool (``PrefixPins.hold_prefix``); their count is the
        second value (the prefill side writes only the blocks after them). The rest is allocated."""
        if request_id in self.reserved or request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        bs = self.config.block_size
        need = blocks_for(len(prompt_token_ids), bs)
        hits = self.hold_prefix(chain_hashes(prompt_token_ids, bs, params.cache_key))
        if not self.blocks.can_allocate(need - len(hits)):
            self.blocks.free(hits[::-1])  # cached again (a tier's blocks read back stay in the pool)
            return None
        self.reserved[request_id] = hits + self.blocks.allocate(need - len(hits))
        return self.reserved[request_id], len(hits)

    def cancel_reservation(self, request_id: str) -> bool:
        blocks = self.reserved.pop(request_id, None)
        if blocks is None:
            return False
        self.blocks.free(blocks)
        return True

    def import_kv(self, request_id: str, data: bytes | memoryview) -> None:
        self.cache.write_blocks(self.reserved[request_id], data)

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        num_cached_tokens: int = 0,
        background: bool = False,
    ) -> Sequence:
        """Continue a request whose prompt K/V now sits in its reserved blocks.

        The first token was already reported by the prefill side; it is replayed through this
        engine's detokenizer, stop matcher, sampler generator and grammar (without output) so that
        text, stop holdback, seeded sampling and structured output continue exactly where the
        prefill side left them.
        """
        if request_id not in self.reserved:
            raise EngineError(f"no reserved blocks for request {request_id!r}")
        grammar = self._grammar(params)
        if grammar is not None and not grammar.advance(first_token):
            raise EngineError(
                f"the prefill's first token {first_token} does not follow the request's grammar"
            )
        blocks = self.reserved.pop(request_id)
        seq = Sequence(request_id, list(prompt_token_ids), params, background=background)
        seq.grammar = grammar
        seq.block_table = blocks
        seq.num_computed_tokens = len(prompt_token_ids)
        seq.num_cached_tokens = num_cached_tokens  # what the prefill side took from its cache
        self._replay(self._track(seq), [first_token])
        self.batcher.cache_full_blocks(seq)  # the imported prompt serves later requests here too
        self.batcher.add_running(seq)
        return seq
