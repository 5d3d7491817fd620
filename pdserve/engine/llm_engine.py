"""LLMEngine: requests in, per-step outputs out. One step = schedule, run the model, sample, detokenize.

It also carries the KV hand-off used by prefill/decode instances (``kv_handoff.KVHandoff``), the
prefix blocks it holds for a peer fetch (``prefix_pins.PrefixPins``) and the tiers below its block
pool (``tiers/tiered_cache.TieredCache``), inherited from their modules; the
model runs on the platform ``platform.select_platform`` builds (cpu/ or cuda/).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from pdserve.engine.batcher import Batch, Batcher, BatcherConfig, blocks_for
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.engine.executor import Platform
from pdserve.engine.grammar import GrammarMatcher, Grammars
from pdserve.engine.kv_handoff import KVHandoff
from pdserve.engine.memory import resident_bytes
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.weights import weights_digest
from pdserve.engine.outputs import EngineFacts, EngineLoad, RequestOutput, TokenLogprob
from pdserve.engine.platform import select_platform
from pdserve.engine.prefix_pins import PrefixPins
from pdserve.engine.rates import RateMeter
from pdserve.engine.sampler import Sample, Sampler, make_rng
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.step_sampling import StepSampling
from pdserve.engine.tiers.disk_tier import DiskTier
from pdserve.engine.tiers.host_tier import HostTier
from pdserve.engine.tiers.tier_reader import TierReader
from pdserve.engine.tiers.tiered_cache import TieredCache
from pdserve.errors import InvalidRequestError, RequestTooLongError
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    stop: StopStringMatcher
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt position, filled as its prefill chunks run; handed out with the first token."""


class LLMEngine(KVHandoff, PrefixPins, TieredCache):
    def __init__(
        self, model_dir: str | Path, config: EngineConfig | None = None, platform: Platform | None = None
    ) -> None:
        """``platform``: the one ``config.device`` names unless given (tests run the torch platform
        on torch's CPU device this way)."""
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.weights_digest = weights_digest(self.model_dir)  # which checkpoint: pairs only with its own
        mc = self.model_config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        t0 = time.perf_counter()
        platform = platform or select_platform(config)
        self.executor = ex = platform.executor(self.model_dir, mc, config, self.max_model_len)
        self.cache, self.runner, self.threads = ex.cache, ex.runner, ex.threads
        num_blocks = ex.num_blocks
        self.blocks = BlockManager(num_blocks, prefix_caching=config.prefix_caching)
        self.batcher = Batcher(
            BatcherConfig(
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.step_tokens,
                prefill_chunk_size=config.prefill_chunk_size,
            ),
            self.blocks,
        )
        self.host_tier: HostTier | None = None
        self.disk_tier: DiskTier | None = None
        self.tier_reader: TierReader | None = None  # reads the tiers back (and times it)
        self.prefill_rate = RateMeter(skip=1)
        """Seconds per token of the steps that prefilled: their forward and picks over their rows
        (a decode row in such a step counts as one token); the first is dropped (cold caches)."""
        self.decode_rate = RateMeter(skip=1)
        """Seconds per token of the steps that only decoded (one token per row, at the batch sizes
        it ran lately): what a token of an answer costs here, which the planner weighs against what
        a prompt token costs (``prefill_rate``) to split instances between the roles."""
        if config.prefix_caching:
            self._tiers(config, ex)
        elif config.kv_host_bytes or config.kv_disk_bytes:
            log.warning(
                "--kv-host-bytes and --kv-disk-bytes are ignored: the tiers keep what the prefix cache "
                "evicts, which is off"
            )
        self.sampler = Sampler(min(mc.vocab_size, self.tokenizer.vocab_size), self.tokenizer.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, self.sampler.vocab_limit)  # structured output
        self.picking = StepSampling(ex, self.sampler, config.keep_logits)  # where tokens are picked
        # A decode step computes a token's K/V with other kernels than a prefill does (the last bits
        # differ), so in batch-invariant mode only blocks a prefill computed are cached: a hit then
        # changes no bit. Otherwise the blocks decoding fills are cached too (more hits).
        self._cache_decoded_blocks = not ex.batch_invariant
        self.requests: dict[str, _Request] = {}
        self.prefilled: dict[str, Sequence] = {}  # prefill-only sequences holding blocks for hand-off
        self.reserved: dict[str, list[int]] = {}  # blocks reserved for incoming KV
        self.held: dict[str, list[int]] = {}  # prefix blocks held for a peer fetch (prefix_pins.py)
        self.fetching: dict[str, list[bytes]] = {}  # a fetch's reserved blocks' hashes
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        log.info(
            "engine ready on %s: %s, %d layers, max_model_len %d, %d KV blocks (%s), %d threads (%.1f s); "
            "resident %.2f GB (weights %.2f GB, KV cache %.2f GB)",
            ex.device_name or ex.device,
            mc.architecture,
            mc.num_layers,
            self.max_model_len,
            num_blocks,
            ex.dtype,
            self.threads,
            time.perf_counter() - t0,
            resident_bytes() / 1e9,
            ex.weight_bytes / 1e9,
            self.cache.nbytes / 1e9,
        )

    def facts(self) -> EngineFacts:
        return EngineFacts(
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            num_blocks=self.blocks.num_blocks,
            block_bytes=self.cache.block_bytes,
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            shm_name=self.cache.shm_name,
            vocab_size=self.model_config.vocab_size,
            prefix_caching=self.blocks.prefix_caching,
            weights=self.executor.weights,
            weights_digest=self.weights_digest,
            batch_invariant=self.executor.batch_invariant,
            dtype=self.executor.dtype,
            device=self.executor.device,
            device_name=self.executor.device_name,
            memory_bytes=self.executor.weight_bytes + self.cache.nbytes,
            host_tier=self.host_tier is not None,
            disk_tier=str(self.disk_tier.dir) if self.disk_tier is not None else None,
        )

    def load(self) -> EngineLoad:
        waiting = self.batcher.waiting
        queued = self.batcher.queued_prefill_tokens()
        return EngineLoad(
            running=len(self.batcher.running),
            waiting=len(waiting),
            background=sum(s.background for s in self.batcher.running) + sum(s.background for s in waiting),
            waiting_prefill_tokens=queued,
            step_tokens=self.batcher.step_tokens(queued),
            free_blocks=self.blocks.num_free,
            preemptions=self.batcher.num_preemptions,
            cached_blocks=self.blocks.num_cached,
            tier=self.host_tier.snapshot() if self.host_tier is not None else None,
            disk=self.disk_tier.snapshot() if self.disk_tier is not None else None,
            pool_hits=self.batcher.hit_counts.pool,
            pool_lookups=self.batcher.hit_counts.lookups,
            pool_evictions=self.blocks.num_evicted,
            prefill_s_per_token=self.prefill_rate.value,
            decode_s_per_token=self.decode_rate.value,
            host_read_s_per_block=reader.host_rate.value if (reader := self.tier_reader) else None,
            disk_read_s_per_block=reader.disk_rate.value if reader else None,
        )

    # ---- requests ---------------------------------------------------------------------------
    def prompt_ids(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        prompt_token_ids: list[int] | None = None,
        tools: list[dict] | None = None,
        *,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt as token ids (:meth:`Tokenizer.prompt_ids`, which routers use too): given ids
        as they are, chat messages (and tools) rendered by the template. ``add_special_tokens``
        None: yes for a prompt, no for a rendered chat (the template writes them)."""
        return self.tokenizer.prompt_ids(
            prompt,
            messages,
            prompt_token_ids,
            tools,
            add_special_tokens=add_special_tokens,
            add_generation_prompt=add_generation_prompt,
        )

    def prompt_text(self, prompt_token_ids: list[int]) -> str:
        """A prompt's text as echoed to the client (special tokens kept: it is what the model read)."""
        return self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise if this request can never run here (checked before anything is queued)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary", "prompt")
        if n + params.max_tokens > self.max_model_len:
            raise RequestTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} "
                f"tokens and max_tokens is {params.max_tokens} ({n + params.max_tokens} in total)",
                "max_tokens" if n < self.max_model_len else "prompt",
            )
        need = blocks_for(n + params.max_tokens, self.config.block_size)
        if need > self.blocks.capacity:
            raise RequestTooLongError(
                f"prompt + max_tokens = {n + params.max_tokens} tokens needs {need} KV blocks but the cache "
                f"has only {self.blocks.capacity}",
                "max_tokens",
            )
        if params.guided is not None:
            self.grammars.compile(params.guided)  # a grammar that does not compile is a 400 here
        if params.prompt_logprobs is not None:
            beyond = next((t for t in prompt_token_ids if t >= self.sampler.vocab_limit), None)
            if beyond is not None:
                raise InvalidRequestError(
                    f"prompt token id {beyond} has no logprob: the tokenizer has no such token "
                    "(prompt_logprobs)",
                    "prompt",
                )

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        prefill_only: bool = False,
        resume_token_ids: list[int] | None = None,
        background: bool = False,
    ) -> Sequence:
        """Queue a request. ``resume_token_ids``: output an earlier attempt already delivered (a
        migration); they are recomputed with the prompt, like a preempted sequence's, and the
        request continues after them. ``background``: a batch line, scheduled after online work."""
        if request_id in self.requests or request_id in self.prefilled:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("either prompt or prompt_token_ids is required", "prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        self.validate(prompt_token_ids, params)
        resume = list(resume_token_ids or ())
        if any(not 0 <= t < self.sampler.vocab_limit for t in resume):
            raise InvalidRequestError(
                "a token id to resume from is outside the vocabulary", "resume_token_ids"
            )
        grammar = self._grammar(params)
        if grammar is not None and not all(map(grammar.advance, resume)):
            raise InvalidRequestError(
                "the tokens to resume from do not follow the request's grammar", "resume_token_ids"
            )
        seq = Sequence(
            request_id, list(prompt_token_ids), params, prefill_only=prefill_only, background=background
        )
        seq.grammar = grammar
        req = self._track(seq)
        self._replay(req, resume)
        if seq.scores_prompt:  # the first prompt token has no logprob: nothing precedes it
            first = seq.prompt_token_ids[0]
            req.prompt_logprobs = [TokenLogprob(first, None, token=self.tokenizer.token_text(first))]
            req.prompt_logprobs += [None] * (seq.num_prompt_tokens - 1)
        self.batcher.add(seq)
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request wherever it is; its final output (finish_reason "abort") comes from step()."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return self.release_prefilled(request_id) or self.cancel_reservation(request_id)
        self.batcher.remove(req.seq)
        req.seq.status = SequenceStatus.FINISHED
        self._pending.append(self._output(req, [], "", None, finish_reason=reason))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        batch = self.batcher.schedule()
        if not batch:
            return outputs
        t0 = time.perf_counter()
        step_input, out_seqs, prompt_rows = self.runner.prepare(batch)
        try:  # the forward, then the picks: the numpy sampler's, or the device's (step_sampling.py)
            picked = self.picking.run(step_input, out_seqs, prompt_rows, lambda: self._computed(batch))
        except Exception as e:  # a Paddle or torch failure must end these requests, not hang them
            log.exception("model step failed")
            return outputs + self._fail_batch(batch, f"model step failed: {e}")
        if batch.prefills:  # what computing a prompt token costs here (routers weigh it)
            self.prefill_rate.add(time.perf_counter() - t0, batch.num_tokens)
        else:  # and an answer's token (the planner weighs both)
            self.decode_rate.add(time.perf_counter() - t0, len(batch.decodes))
        if picked is None:
            return outputs
        for span, scored in picked.prompt:  # before the samples: the first token hands them out
            req = self.requests[span.seq.request_id]
            assert req.prompt_logprobs is not None  # a recompute writes the same places again
            req.prompt_logprobs[span.first + 1 : span.first + 1 + span.count] = map(
                self._token_logprob, scored
            )
        for i, (seq, sample) in enumerate(zip(out_seqs, picked.samples)):
            out = self._append(self.requests[seq.request_id], sample)
            if picked.logits is not None:
                out.logits = picked.logits[i].copy()
            outputs.append(out)
        return outputs

    def _computed(self, batch: Batch) -> None:
        """The step's K/V is in the cache (or queued there on a GPU, whose failure after this is a
        fault every later step meets too): count it, offer the blocks it filled to the prefix cache."""
        for seq in batch.decodes:
            seq.num_computed_tokens = seq.num_tokens
            if self._cache_decoded_blocks:
                self.batcher.cache_full_blocks(seq)
        for chunk in batch.prefills:
            chunk.seq.num_computed_tokens = chunk.end
            self.batcher.cache_full_blocks(chunk.seq)

    def _append(self, req: _Request, sample: Sample) -> RequestOutput:
        seq, p = req.seq, req.seq.params
        token = sample.token_id
        if seq.grammar is not None and not seq.grammar.advance(token):  # its mask allowed nothing
            self._finish(req)
            error = f"structured output: the grammar allows no next token ({seq.grammar.error})"
            return self._output(req, [], "", None, finish_reason="error", error=error)
        seq.output_token_ids.append(token)
        logprobs = None
        if p.logprobs is not None:
            assert sample.logprob is not None  # the sampler computes it whenever logprobs are asked for
            logprobs = [self._token_logprob(sample)]
        text, reason = self._advance_text(req, token)
        if reason is None:
            if seq.grammar is not None and seq.grammar.done:  # the grammar is complete
                end = "stop"
            elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                end = "length"
            else:
                end = None
            if end is not None:
                tail, matched = req.stop.feed(req.detok.flush())
                text += tail if matched else tail + req.stop.flush()
                reason = "stop" if matched else end
        queued: dict[str, Any] = {}
        if seq.num_output_tokens == 1 and seq.scheduled_at is not None:
            queued["queue_s"] = seq.scheduled_at - seq.arrival_time
        if req.prompt_logprobs is not None:  # set until handed out with the first token
            assert all(req.prompt_logprobs)  # its prefill scored every position
            queued["prompt_logprobs"], req.prompt_logprobs = req.prompt_logprobs, None
        if reason is not None:
            self._finish(req)
            return self._output(req, [token], text, logprobs, finish_reason=reason, **queued)
        if seq.prefill_only:
            self.batcher.running.remove(seq)
            seq.status = SequenceStatus.PREFILLED
            self.prefilled[seq.request_id] = seq
            del self.requests[seq.request_id]
            return self._output(req, [token], text, logprobs, prefilled=True, **queued)
        return self._output(req, [token], text, logprobs, **queued)

    def _token_logprob(self, sample: Sample) -> TokenLogprob:
        """A sampled or prompt token's logprob (the sampler's numbers) with the texts of its tokens."""
        text_of, top = self.tokenizer.token_text, sample.top_logprobs
        return TokenLogprob(
            sample.token_id,
            sample.logprob,
            top,
            text_of(sample.token_id),
            [text_of(t) for t, _ in top] if top else None,
            sample.rank,
        )

    def _advance_text(self, req: _Request, token: int) -> tuple[str, str | None]:
        """Detokenize one token and apply EOS / stop-token / stop-string rules."""
        p = req.seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids):
            return req.stop.flush(), "stop"  # text held back as a possible stop prefix is released
        text, matched = req.stop.feed(req.detok.add(token))
        return text, ("stop" if matched else None)

    def _finish(self, req: _Request) -> None:
        self.batcher.remove(req.seq)
        req.seq.status = SequenceStatus.FINISHED
        self.requests.pop(req.seq.request_id, None)

    def _fail_batch(self, batch: Batch, message: str) -> list[RequestOutput]:
        out: list[RequestOutput] = []
        for seq in {*(batch.decodes), *(c.seq for c in batch.prefills)}:
            req = self.requests.get(seq.request_id)
            if req is not None:
                self._finish(req)
                out.append(self._output(req, [], "", None, finish_reason="error", error=message))
        return out

    def _output(
        self,
        req: _Request,
        tokens: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None,
        **kw: Any,
    ) -> RequestOutput:
        seq = req.seq
        finished = "finish_reason" in kw
        return RequestOutput(
            seq.request_id,
            tokens,
            text,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            finished=finished,
            logprobs=logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            **kw,
        )

    def _track(self, seq: Sequence) -> _Request:
        p = seq.params
        seq.rng = make_rng(p.seed)
        req = _Request(
            seq,
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.skip_special_tokens),
            StopStringMatcher(p.stop, p.include_stop_str_in_output),
        )
        self.requests[seq.request_id] = req
        return req

    # ---- the prefix index: what the cache holds, for routers --------------------------------
    def take_prefix_changes(self) -> dict[bytes, bool]:
        """Block hashes the prefix cache gained (True) or lost (False) since the last call."""
        return self.blocks.take_changes()

    def prefix_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache holds; the changes recorded so far are dropped (this
        list replaces them)."""
        self.blocks.take_changes()
        return self.blocks.hashes()

    def _grammar(self, params: SamplingParams) -> GrammarMatcher | None:
        """A constrained request's matcher at the grammar's start (None: no grammar). Tokens
        generated elsewhere (resumed, or the prefill's first token) are replayed into it too."""
        return None if params.guided is None else self.grammars.matcher(params.guided)

    def _replay(self, req: _Request, tokens: list[int]) -> None:
        """Take ``tokens`` as generated elsewhere: through the detokenizer, the stop matcher and
        the sequence's generator (one draw each, as when they were sampled), without output."""
        seq = req.seq
        for token in tokens:
            seq.output_token_ids.append(token)
            if not seq.params.is_greedy:
                assert seq.rng is not None  # set by _track
                seq.rng.random()
            req.stop.feed(req.detok.add(token))

    def close(self) -> None:
        if self.disk_tier is not None:
            self.disk_tier.close()  # the queued writes land: the next run finds them
        self.executor.close()
