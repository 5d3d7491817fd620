"""Structured output: a request's grammar (``SamplingParams.guided``) as a per-sequence matcher.

llguidance compiles a JSON schema, a regex or a list of choices against the tokenizer's vocabulary
and answers, at each step, which tokens may come next (a bitmask) and whether the grammar is
complete. EOS is in the mask only where the grammar accepts; once the grammar can take no more
(``done``) the engine ends the request with ``finish_reason "stop"``.

Compiling is the costly part (the lexer is built against the whole vocabulary), so ``Grammars``
keeps the freshly compiled matcher of each ``(kind, spec)`` (LRU) and hands every request a copy.
One instance per engine, used from the engine thread and from the worker's preparation threads
(compilation drops the GIL and runs there, off the engine thread and at a lower OS priority, the
first mask too): the cache takes a lock, the compiler works outside it, and :data:`LIMITS` bounds
its work.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from pdserve.errors import InvalidRequestError
from pdserve.grammar_limits import MAX_ITEMS_IN_ROW
from pdserve.sampling_params import guided_param
from pdserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only, not at runtime

CACHE_SIZE = 64  # compiled grammars kept per engine
MAX_ERROR_CHARS = 500
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=1_000_000, max_grammar_size=500_000, max_items_in_row=MAX_ITEMS_IN_ROW
)
"""llguidance's compile bounds (lexer "fuel" is work, ~50k per ms; grammar symbols): a grammar past
them is a 400 ("fuel exhausted", "schema too large"); and its parser's (items in one row: past it,
a step fails, which ``--max-optional-properties`` keeps schemas from, see ``grammar_limits``).
Pinned at llguidance 0.23's defaults so an upgrade cannot loosen them; the worker's
``--max-grammar-bytes`` and ``--max-optional-properties`` come first."""
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
"""Compact JSON (``,`` and ``:`` with no free whitespace): models otherwise can pad with whitespace
forever. A schema's own ``x-guidance`` options override it (llguidance applies defaults, then
``x-guidance``)."""


class GrammarMatcher:
    """One sequence's place in its grammar."""

    __slots__ = ("_matcher", "_vocab_limit")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_limit: int) -> None:
        self._matcher = matcher
        self._vocab_limit = vocab_limit

    def allowed(self) -> np.ndarray:
        """Which of the sampler's ``vocab_limit`` token ids may come next (numpy bool)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, count=self._vocab_limit, bitorder="little").view(bool)

    def advance(self, token: int) -> bool:
        """Take the sampled (or replayed) token; False when the grammar does not allow it."""
        return self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no more tokens (only EOS)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class Grammars:
    """Compiles ``SamplingParams.guided`` specs for one tokenizer, with a cache of compiled ones."""

    def __init__(self, tokenizer: Tokenizer, vocab_limit: int, cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_limit = vocab_limit
        self.cache_size = cache_size
        self._compiled: collections.OrderedDict[tuple[str, str], llguidance.LLMatcher] = (
            collections.OrderedDict()
        )
        self._lltok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # the cache and the lazily built tokenizer
        self.num_compiled = 0  # compilations done (cache misses), for tests and logs

    def matcher(self, guided: dict[str, Any]) -> GrammarMatcher:
        """A fresh matcher for ``guided``; raises InvalidRequestError (naming the request field)
        when it does not compile."""
        return GrammarMatcher(self.compile(guided).deep_copy(), self.vocab_limit)

    def compile(self, guided: dict[str, Any]) -> llguidance.LLMatcher:
        """The compiled grammar of ``guided`` (from the cache when it is there): a matcher at its
        start, never advanced; copy it to use it."""
        kind, spec = guided["kind"], guided["spec"]
        key = (kind, json.dumps(spec, sort_keys=True, separators=(",", ":")))
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                return template
        template = self._compile(kind, spec, guided_param(guided))  # two threads may both compile it
        with self._lock:
            self._compiled[key] = template
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
            self.num_compiled += 1
        return template

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltok is None:  # built on first use: a large vocabulary takes ~1 s
                tok = self.tokenizer
                self._lltok = llguidance.LLTokenizer(
                    tok.raw.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids or None
                )
            return self._lltok

    def _compile(self, kind: str, spec: Any, param: str) -> llguidance.LLMatcher:
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec)
            else:  # choice: the alternatives as Lark string literals (JSON escapes are Lark's)
                grammar = llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in spec)
                )
        except ValueError as e:
            raise InvalidRequestError(f"invalid {param}: {_short(str(e))}", param) from None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            what = {"json": "the JSON schema", "regex": "the regex", "choice": "the choices"}[kind]
            raise InvalidRequestError(
                f"{what} cannot be used for structured output: {_short(matcher.get_error())}", param
            )
        # The first mask builds the lexer's states at the grammar's start, shared by every copy: here,
        # on a preparation thread, not on the engine thread at the request's first step (0.2 s for
        # a 64 KB schema of optional properties).
        matcher.compute_bitmask()
        return matcher


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 1] + "…"
