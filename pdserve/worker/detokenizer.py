"""Streaming text out of generated ids: incremental detokenization and stop-string matching.

Both are per-request state machines fed one step at a time, so each emits only text that no later token
can change: no half UTF-8 characters, and no text that might still turn out to be a stop string.
"""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from pdserve.worker.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Prompt ids fed to the stream as context, so the first generated token decodes with its real leading
# space (Metaspace/SentencePiece decoders strip it at the start of a string). A few tokens are enough.
PREFILL_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns generated ids into text deltas via ``tokenizers``' DecodeStream.

    ``add`` returns "" while a character is split across tokens; concatenating every ``add`` result
    plus ``flush`` equals ``tokenizer.decode(generated_ids)``.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = self._usable_context(prompt_ids)
        self._stream = DecodeStream(context or None, skip_special_tokens=skip_special_tokens)
        self._context = context  # ids before the pending ones, for flush()
        self._pending: list[int] = []
        self._generated: list[int] = []
        self._num_emitted_chars = 0
        self._fallback_chars: int | None = None  # set once DecodeStream failed: decode position reached

    def _usable_context(self, prompt_ids: list[int] | None) -> list[int]:
        # DecodeStream emits the prefill text itself if it ends in a partial character, so drop it then.
        context = list(prompt_ids[-PREFILL_CONTEXT_TOKENS:]) if prompt_ids else []
        if context and self.tokenizer.decode(context, self.skip_special_tokens).endswith("\ufffd"):
            return []
        return context

    def add(self, token_id: int) -> str:
        """The text this token completes ("" while a multi-byte character is still incomplete)."""
        self._generated.append(token_id)
        if self._fallback_chars is not None:
            return self._add_by_full_decode()
        try:
            text = self._stream.step(self.tokenizer.raw, token_id)
        except Exception as e:  # DecodeStream's InvalidPrefix: the decoder rewrote earlier text
            logger.warning("DecodeStream failed (%s); decoding this request in full from now on", e)
            self._fallback_chars = self._num_emitted_chars
            return self._add_by_full_decode()
        if text is None:
            self._pending.append(token_id)
            return ""
        self._context = [*self._pending, token_id][-PREFILL_CONTEXT_TOKENS:]
        self._pending = []
        self._num_emitted_chars += len(text)
        return text

    def _add_by_full_decode(self) -> str:
        """Slow path: O(n) per token, used only after DecodeStream gave up on this request."""
        assert self._fallback_chars is not None
        full = self.tokenizer.decode(self._generated, self.skip_special_tokens)
        if full.endswith("\ufffd"):
            return ""
        text = full[self._fallback_chars :]
        self._fallback_chars = len(full)
        return text

    def flush(self) -> str:
        """Text still held when generation ends: a trailing partial character, shown as U+FFFD."""
        if self._fallback_chars is not None:
            full = self.tokenizer.decode(self._generated, self.skip_special_tokens)
            text, self._fallback_chars = full[self._fallback_chars :], len(full)
            return text
        if not self._pending:
            return ""
        base = self.tokenizer.decode(self._context, self.skip_special_tokens)
        full = self.tokenizer.decode(self._context + self._pending, self.skip_special_tokens)
        self._pending = []
        return full[len(base) :] if full.startswith(base) else full


class StopStringMatcher:
    """Holds back text that may begin a stop string; cuts the output at the first stop string.

    When stop strings overlap, the one that is completed first in the text wins (ties: the one that starts
    earlier). That choice gives the same result however the text is split into chunks.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in dict.fromkeys(stop) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched_stop: str | None = None
        self._max_hold = max((len(s) - 1 for s in self.stop), default=0)
        self._prefixes = {s[:i] for s in self.stop for i in range(1, len(s))}
        self._held = ""

    @property
    def matched(self) -> bool:
        return self.matched_stop is not None

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string has matched)."""
        if self.matched_stop is not None:
            return "", True
        if not self.stop:
            return text, False
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            end, start, self.matched_stop = best
            self._held = ""
            return buf[: end if self.include_stop_str_in_output else start], True
        hold = self._holdback(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0

    def flush(self) -> str:
        """Release held text when generation ends for another reason (EOS, max_tokens)."""
        text, self._held = self._held, ""
        return text
