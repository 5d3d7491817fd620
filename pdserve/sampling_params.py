"""Per-request sampling settings (OpenAI semantics and ranges): validated once by the router, carried in
``GenerateRequest.sampling`` and used by the engine. Part of the message schema, so it lives here."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; bigger ids would not fit the engine's int tensors
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, +100 all but forces it
GUIDED_PARAMS = {"json": "response_format", "regex": "guided_regex", "choice": "guided_choice"}
"""Structured-output kinds (``SamplingParams.guided["kind"]``) and the request field an error about
each is reported under (a schema that came as ``guided_json`` is reported as ``response_format``)."""


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy.

    ``top_k <= 0`` disables top-k; ``logprobs`` is None (off) or the number of top alternatives
    (0..20) returned with each sampled token's own logprob. ``logit_bias`` (token id -> bias in
    [-100, 100], added to the logits before anything else) takes string keys too, as JSON carries
    them; how many entries a request may give is a router setting (``--max-logit-bias``). ``guided`` (structured output) is None or
    ``{"kind": "json", "spec": <JSON schema object>}``, ``{"kind": "regex", "spec": <pattern>}`` or
    ``{"kind": "choice", "spec": [<string>, ...]}``: the output must match it. How many ``stop`` strings (and how long)
    and ``stop_token_ids`` a request may carry is a router setting (``--max-stop-strings`` ...), checked
    by the router's parser: the worker's stop matching costs the same per token whatever they are.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    guided: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _token_map(self.logit_bias) or None
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field that is out of range."""
        _number("temperature", self.temperature, lo=0.0, hi=2.0)
        _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _integer("top_k", self.top_k, lo=-1)
        _number("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _integer("seed", self.seed, lo=-(2**63), hi=2**64 - 1)
        _number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}", "repetition_penalty"
            )
        _integer("max_tokens", self.max_tokens, lo=1)
        _integer("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop sequences must be non-empty strings", "stop")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, lo=0, hi=MAX_TOKEN_ID)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        for token, bias in (self.logit_bias or {}).items():
            _integer("logit_bias", token, lo=0, hi=MAX_TOKEN_ID)
            _number("logit_bias", bias, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
        if self.guided is not None:
            _guided(self.guided)

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            name = sorted(unknown)[0]
            raise InvalidRequestError(f"unknown sampling parameter {name!r}", name)
        return cls(**data)


def _token_map(value: Any) -> dict[Any, Any]:
    """``{"17": 5}`` (JSON keys are strings) -> ``{17: 5}``; other keys are left for validate()."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {value!r}", "logit_bias")
    out = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            key = int(key)
        elif isinstance(key, str):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out[key] = bias
    return out


def guided_param(guided: dict[str, Any]) -> str:
    """The request field an error about ``guided`` names: its ``param`` (a constraint the router made
    from another field, e.g. ``tools``), else the field of its kind."""
    return guided.get("param") or GUIDED_PARAMS[guided["kind"]]


def _guided(guided: Any) -> None:
    if not isinstance(guided, dict) or not {"kind", "spec"} <= set(guided) <= {"kind", "spec", "param"}:
        raise InvalidRequestError(
            "guided must be an object with the keys kind and spec (and optionally param)", "guided"
        )
    kind, spec = guided["kind"], guided["spec"]
    if kind not in GUIDED_PARAMS:
        raise InvalidRequestError(
            f"guided.kind must be one of {', '.join(GUIDED_PARAMS)}, got {kind!r}", "guided"
        )
    if not isinstance(guided.get("param", ""), str):
        raise InvalidRequestError("guided.param must be a string", "guided")
    param = guided_param(guided)
    if kind == "json" and not isinstance(spec, dict):
        raise InvalidRequestError("a JSON schema must be an object", param)
    if kind == "regex" and (not isinstance(spec, str) or not spec):
        raise InvalidRequestError("a regex must be a non-empty string", param)
    if kind == "choice" and (
        not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec)
    ):
        raise InvalidRequestError("choices must be a non-empty list of non-empty strings", param)


def _number(name: str, value: Any, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", name)
    if lo is not None and value < lo:
        raise InvalidRequestError(f"{name} must be >= {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise InvalidRequestError(f"{name} must be <= {hi}, got {value}", name)


def _integer(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    _number(name, value, lo, hi)
