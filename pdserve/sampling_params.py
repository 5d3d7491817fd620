"""Per-request sampling settings (OpenAI semantics and ranges): validated once by the router, carried
as a typed field of ``GenerateRequest`` and ``ReserveBlocks`` and used by the engine.

Each field is declared once, with :func:`param`: its default, its help, and where it comes from
outside (a plain field of the OpenAI request bodies, a ``pdserve generate`` flag). The router's
request models and the CLI's flags are generated from these declarations.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, ClassVar, Literal

from pdserve.block_hash import salt_key
from pdserve.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; bigger ids would not fit the engine's int tensors
MAX_TOKENS = 2**31 - 1  # no model is that long: max_tokens, min_tokens and top_k stay below it
_TOKEN_ID_DIGITS = len(str(MAX_TOKEN_ID))
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, +100 all but forces it
MAX_CACHE_SALT = 256
MIN_TEMPERATURE = 1e-5  # below it a temperature means greedy: logits / temperature would overflow
GUIDED_PARAMS = {"json": "response_format", "regex": "guided_regex", "choice": "guided_choice"}
"""Structured-output kinds (``SamplingParams.guided["kind"]``) and the request field an error about
each is reported under (a schema that came as ``guided_json`` is reported as ``response_format``)."""


@dataclasses.dataclass(frozen=True)
class SamplingField:
    """How one SamplingParams field is given from outside (``metadata["param"]`` of the field).

    ``request``: the completions and chat bodies take it as a plain field of the same name, one of
    OpenAI's or a vLLM-style extension; None: the router maps it itself (``max_tokens``,
    ``logprobs`` and ``guided`` come from fields named or shaped differently per endpoint).
    ``body_type``: its type in a request body where that is not the field's. ``flag``: ``pdserve
    generate`` has ``--<name-with-dashes>`` (or the name given) for it; ``flag_default``: the flag's
    default where it is not the field's (None: the field's).
    """

    help: str
    request: Literal["openai", "extension"] | None = None
    body_type: Any = None
    flag: bool | str = False
    flag_default: Any = None

    def flag_name(self, field: str) -> str | None:
        """``field``'s ``pdserve generate`` flag, or None."""
        if not self.flag:
            return None
        return self.flag if isinstance(self.flag, str) else "--" + field.replace("_", "-")


def param(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = None, **how: Any) -> Any:
    """A SamplingParams field: its default (or ``factory``) and how it is given (:class:`SamplingField`)."""
    meta = {"param": SamplingField(help, **how)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def declared() -> list[tuple[dataclasses.Field[Any], SamplingField]]:
    """Every SamplingParams field with its declaration, in order."""
    return [(f, f.metadata["param"]) for f in dataclasses.fields(SamplingParams)]


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature`` 0 (or below MIN_TEMPERATURE) means greedy.

    ``top_k <= 0`` disables top-k; ``logprobs`` is None (off) or the number of top alternatives
    (0..20) returned with each sampled token's own logprob; ``prompt_logprobs`` likewise for every
    prompt token (vLLM's extension; the first has no logprob: nothing precedes it). ``logit_bias`` (token id -> bias in
    [-100, 100], added to the logits before anything else) takes string keys too, as JSON carries
    them; how many entries a request may give is a router setting (``--max-logit-bias``). ``guided`` (structured output) is None or
    ``{"kind": "json", "spec": <JSON schema object>}``, ``{"kind": "regex", "spec": <pattern>}`` or
    ``{"kind": "choice", "spec": [<string>, ...]}``: the output must match it. How many ``stop`` strings (and how long)
    and ``stop_token_ids`` a request may carry is a router setting (``--max-stop-strings`` ...), checked
    by the router's parser: the worker's stop matching costs the same per token whatever they are.

    Constructing one validates it. As a field of a control-plane message (scheduler/inbox_messages.py)
    pydantic checks only its types, and unknown keys are refused: the router validated the values,
    and a worker must not ignore a setting it does not know.
    """

    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid"}  # a message's unknown key: refused

    temperature: float = param(
        1.0, "0 = greedy (as is anything below 1e-5)", request="openai", flag=True, flag_default=0.0
    )
    top_p: float = param(1.0, "nucleus sampling mass in (0, 1]", request="openai", flag=True)
    top_k: int = param(-1, "sample among the k best tokens (-1: off)", request="extension", flag=True)
    min_p: float = param(
        0.0, "drop tokens below min-p x the best probability", request="extension", flag=True
    )
    seed: int | None = param(None, "makes sampling reproducible", request="openai", flag=True)
    presence_penalty: float = param(0.0, "in [-2, 2]", request="openai", flag=True)
    frequency_penalty: float = param(0.0, "in [-2, 2]", request="openai", flag=True)
    repetition_penalty: float = param(1.0, "> 0; 1 = off", request="extension", flag=True)
    max_tokens: int = param(16, "tokens to generate at most", flag=True, flag_default=64)
    min_tokens: int = param(
        0, "tokens to generate before EOS/stop may end it", request="extension", flag=True
    )
    stop: list[str] = param(
        help="stop string (repeatable)", factory=list, request="openai", body_type=str | list[str], flag=True
    )
    stop_token_ids: list[int] = param(
        help="stop token id (repeatable)", factory=list, request="extension", flag="--stop-token-id"
    )
    ignore_eos: bool = param(False, "keep generating past EOS", request="extension", flag=True)
    logprobs: int | None = param(None, "return each token's logprob and N alternatives", flag=True)
    prompt_logprobs: int | None = param(
        None,
        "return each prompt token's logprob (its rank too) and N alternatives",
        request="extension",
        flag=True,
    )
    skip_special_tokens: bool = param(True, "leave special tokens out of the text", request="extension")
    include_stop_str_in_output: bool = param(
        False, "end the text with the stop string that ended it", request="extension"
    )
    logit_bias: dict[int, float] | None = param(
        None,
        "token id (a string, as JSON keys are) -> bias in [-100, 100], added to the logits",
        request="openai",
        body_type=dict[str, float],
    )
    guided: dict[str, Any] | None = param(None, "structured output: the grammar the text must match")
    cache_salt: str | None = param(
        None,
        "reuse cached prompt KV only among requests with the same salt (vLLM's cache_salt)",
        request="extension",
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _token_map(self.logit_bias) or None
        self.validate()

    @property
    def cache_key(self) -> bytes:
        """The extra key of this request's block hashes (:mod:`pdserve.block_hash`): its salt."""
        return salt_key(self.cache_salt)

    @property
    def is_greedy(self) -> bool:
        """Below :data:`MIN_TEMPERATURE` the logits / temperature overflow float32 (NaN
        probabilities): such a temperature means greedy."""
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field that is out of range."""
        _number("temperature", self.temperature, lo=0.0, hi=2.0)
        _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _integer("top_k", self.top_k, lo=-1, hi=MAX_TOKENS)
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
        _integer("max_tokens", self.max_tokens, lo=1, hi=MAX_TOKENS)
        _integer("min_tokens", self.min_tokens, lo=0, hi=MAX_TOKENS)
        self._check_min_tokens()
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop sequences must be non-empty strings", "stop")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, lo=0, hi=MAX_TOKEN_ID)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        for token, bias in (self.logit_bias or {}).items():
            _integer("logit_bias", token, lo=0, hi=MAX_TOKEN_ID)
            _number("logit_bias", bias, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
        if self.guided is not None:
            _guided(self.guided)
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT
        ):
            raise InvalidRequestError(
                f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters", "cache_salt"
            )

    def _check_min_tokens(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens"
            )

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy that generates at most ``max_tokens`` (>= 1): the worker's fill-in for a request that
        set no limit. Only what the change can break is checked again (``min_tokens``)."""
        params = copy.copy(self)
        params.max_tokens = max_tokens
        params._check_min_tokens()
        return params

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """As a message field: the fields' types are checked, ``__post_init__`` (validation) is not run."""
        return {**handler(source), "post_init": False}

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
    """``{"17": 5}`` (JSON keys are strings) -> ``{17: 5}``; other keys are left for validate(). A
    key of more digits than any token id has is refused before ``int()`` sees it (past 4300 digits
    ``int()`` raises a ValueError of its own)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {value!r}", "logit_bias")
    out = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            if len(key.lstrip("0")) > _TOKEN_ID_DIGITS:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids in 0..{MAX_TOKEN_ID}, got one of {len(key)} digits",
                    "logit_bias",
                )
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
        raise InvalidRequestError(f"{name} must be a number, got {shown(value)}", name)
    if isinstance(value, float) and not math.isfinite(value):  # e.g. 1e309 in JSON parses as inf
        raise InvalidRequestError(f"{name} must be a finite number, got {value}", name)
    if lo is not None and value < lo:
        raise InvalidRequestError(f"{name} must be >= {lo}, got {shown(value)}", name)
    if hi is not None and value > hi:
        raise InvalidRequestError(f"{name} must be <= {hi}, got {shown(value)}", name)


def shown(value: Any) -> str:
    """``value`` for an error message: an integer of thousands of digits (a body may hold up to
    4300) as its length, not as itself."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**24:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _integer(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    _number(name, value, lo, hi)
