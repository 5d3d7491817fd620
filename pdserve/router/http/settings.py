"""Router configuration: one validated dataclass and its command-line flags (the server entry point
is :func:`pdserve.router.http.server.run_router`).

Flags default from ``PDSERVE_*`` environment variables (:mod:`pdserve.flags`).
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import socket
from pathlib import Path

from pdserve.batchstore.file_object import DEFAULT_FILE_TTL_S, DEFAULT_MAX_FILE_BYTES
from pdserve.batchstore.owners import DEFAULT_QUOTA_BATCHES, DEFAULT_QUOTA_FILES, Quotas
from pdserve.errors import ConfigError
from pdserve.flags import add_flags, from_args, setting
from pdserve.grammar_limits import DEFAULT_MAX_OPTIONAL_PROPERTIES, MAX_OPTIONAL_PROPERTIES_HELP
from pdserve.priority import PREPARE_NICE, PREPARE_NICE_HELP
from pdserve.router.routing.policies import POLICY_NAMES, PrefixWeights
from pdserve.router.routing.prefix_lookup import INDEX_KINDS
from pdserve.scheduler.keys import DEFAULT_CLUSTER, validate_id
from pdserve.scheduler.redis_client import (
    DEFAULT_URL,
    NO_WAIT,
    WAIT_REPLICAS_HELP,
    WAIT_TIMEOUT_HELP,
    ReplicaWait,
)
from pdserve.scheduler.registry import DEFAULT_TTL_S

MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class RouterSettings:
    """Everything one router process needs; defaults are production defaults.

    ``router_id`` names this process's outbox stream and registration; by default it is
    ``router-<hostname>-<port>-<random>`` so replicas on one host never collide.
    """

    redis_url: str = setting(
        DEFAULT_URL,
        "Redis of the control plane: redis://, rediss:// (TLS), unix://, redis+sentinel://HOST:PORT[,...]/SERVICE[/DB] "
        "or redis+cluster://HOST:PORT[,...] (default %(default)s)",
        repr=False,
    )  # may hold a password
    cluster: str = setting(DEFAULT_CLUSTER, "cluster namespace inside Redis (default %(default)s)")
    redis_wait_replicas: int = setting(NO_WAIT.replicas, WAIT_REPLICAS_HELP)
    redis_wait_timeout_ms: int = setting(NO_WAIT.timeout_ms, WAIT_TIMEOUT_HELP)
    host: str = setting("127.0.0.1", "address to listen on (default %(default)s)")
    port: int = setting(8000, "port to listen on (default %(default)s)")
    router_id: str = setting("", "this router's id (default router-<hostname>-<port>-<random>)")
    prefill_policy: str = setting(
        "prefix_cache",
        "how to pick the prefill instance: prefix_cache weighs the prompt tokens an instance's prefix "
        "cache saves against its load and, for splitwise, picks the pair; least_load ignores caches "
        "(default %(default)s)",
        choices=POLICY_NAMES,
    )
    decode_policy: str = setting(
        "prefix_cache", "how to pick the decode or mixed instance (default %(default)s)", choices=POLICY_NAMES
    )
    prefix_load_tokens: float = setting(
        PrefixWeights.load_tokens,
        "prefix_cache: what one open request on an instance costs, in prompt tokens to compute "
        "(at the instance's measured seconds per token where it has one) (default %(default)s)",
    )
    prefix_transfer_weight: float = setting(
        PrefixWeights.transfer,
        "prefix_cache: what moving one prompt token's KV to the decode instance (or from a peer that "
        "holds it, a fetch) costs, relative to computing it, where the prefill instance has not "
        "measured its hand-offs over the pair's transport yet, nor the fetcher its fetches "
        "(default %(default)s)",
    )
    prefix_host_tier_weight: float = setting(
        PrefixWeights.host_tier,
        "prefix_cache: what reading one prompt token's KV back from an instance's host tier "
        "(--kv-host-bytes) costs, relative to computing it, where the instance has not measured its "
        "read-backs yet (default %(default)s)",
    )
    prefix_disk_tier_weight: float = setting(
        PrefixWeights.disk_tier,
        "prefix_cache: what reading one prompt token's KV back from an instance's disk tier "
        "(--kv-disk-path) costs, relative to computing it, where the instance has not measured its "
        "read-backs yet (default %(default)s)",
    )
    local_prefill_tokens: int = setting(
        PrefixWeights.local_prefill_tokens,
        "prefix_cache: a decode instance prefills a request itself, with no prefill instance or KV "
        "transfer, when its prefix cache lacks at most this many of the prompt's tokens and that is "
        "cheaper (default %(default)s: never)",
    )
    prefix_index: str = setting(
        "redis",
        "where prefix_cache learns what each instance caches: redis (the index the instances publish, "
        "shared by every router) or local (this router's record of where it sent which prompts) "
        "(default %(default)s)",
        choices=INDEX_KINDS,
    )
    request_timeout_s: float = setting(600.0, "seconds a request may take in all (default %(default)s)")
    """Every request ends (with a 504 ``timeout`` error at worst) this long after it arrived."""
    first_token_timeout_s: float = setting(
        60.0, "seconds to wait for the first token (queueing included) (default %(default)s)"
    )
    """Longest wait for the first token of an attempt, queueing included."""
    reserve_timeout_s: float = setting(
        10.0, "splitwise: seconds decode has to reserve KV blocks for a prefill (default %(default)s)"
    )
    transfer_timeout_s: float | None = setting(
        None,
        "splitwise: seconds from dispatch by which prefill has written the KV cache into decode; decode "
        "holds the reserved blocks that long (default: the first-token timeout, so a prompt waiting in a "
        "busy prefill's queue is not failed before its first-token budget is spent)",
        kind=float,
    )
    max_body_bytes: int = setting(8 * MIB, "largest request body accepted (413 above) (default %(default)s)")
    max_stop_strings: int = setting(1024, "most stop strings per request (400 above) (default %(default)s)")
    max_stop_string_len: int = setting(
        256,
        "most characters of one stop string (400 above); a worker holds back up to this much text of a "
        "stream (default %(default)s)",
    )
    max_stop_token_ids: int = setting(
        256, "most stop_token_ids per request (400 above) (default %(default)s)"
    )
    max_logit_bias: int = setting(
        300, "most logit_bias entries per request (400 above) (default %(default)s)"
    )
    max_prompts_per_request: int = setting(
        64,
        "most choices one request fans out to, prompts x n (a completions prompt may be a list); "
        "400 above (default %(default)s)",
    )
    retry_attempts: int = setting(
        2, "re-submissions to a fresh pair when an attempt fails before the first byte (default %(default)s)"
    )
    max_migrations: int = setting(
        3,
        "times one request may move to another instance when its instance dies after tokens reached "
        "the client; it continues where it stopped (default %(default)s; 0: end it with an error)",
    )
    stall_timeout_s: float = setting(
        30.0,
        "seconds a request's instance may send nothing once tokens flow before it counts as lost "
        "(the request then migrates) (default %(default)s)",
    )
    ttl_s: float = setting(DEFAULT_TTL_S, "registration TTL in seconds (default %(default)s)")
    max_prompt_chars_per_token: int = setting(
        32,
        "a prompt (or chat messages) of more characters than this many per token of the model length "
        "(the smallest max_model_len of the model's live instances) is refused with 400 "
        "context_length_exceeded before it is sent: it averages more characters per token than real "
        "vocabularies hold, so it could never fit (default %(default)s)",
    )
    max_grammar_bytes: int = setting(
        64 * 1024,
        "structured output (response_format's schema, guided_json/_regex/_choice) or tools larger than "
        "this many bytes of JSON is refused with 400 naming the field (default %(default)s)",
    )
    max_optional_properties: int = setting(DEFAULT_MAX_OPTIONAL_PROPERTIES, MAX_OPTIONAL_PROPERTIES_HELP)
    prepare_nice: int = setting(PREPARE_NICE, PREPARE_NICE_HELP)
    max_in_flight: int = setting(
        0,
        "choices this router runs at once (a request takes prompts x n of them; /tokenize one); "
        "beyond, requests queue (default 0: no limit)",
    )
    max_queued: int = setting(
        0,
        "requests that may wait for slots when --max-in-flight choices run (up to --first-token-timeout); "
        "beyond, 429 with Retry-After (default %(default)s)",
    )
    aggregated_fallback: bool = setting(
        True,
        "when no prefill/decode pair can serve, run whole requests on a decode instance, saying so in "
        "x-pdserve-mode: aggregated and the log (default on; --no-aggregated-fallback answers 503 instead)",
    )
    verify_fraction: float = setting(
        0.0,
        "shadow verification: this share (0..1) of disaggregated requests is replayed, after its client "
        "has its answer, on the aggregated path (a mixed instance, or the decode instance prefilling "
        "alone) at low priority with the same tokens and seed; tokens and logprobs are compared "
        "(bitwise where every instance runs batch-invariant), a difference is logged, counted and shown "
        "by pdserve status (default 0: off)",
    )
    live_set_max_age_s: float = 0.5
    watch_interval_s: float = 0.5
    """How often the watcher compares in-flight requests with the live set."""
    redis_wait_s: float = 30.0
    """How long startup waits for Redis before giving up."""
    background: bool = False
    """Every request this router sends is background work (a batch worker's in-process router)."""
    files_dir: str = setting(
        "",
        "keep the Batch API's file contents in this folder, which every router and batch worker must "
        "share (default: in Redis, next to their metadata: nothing to mount)",
    )
    max_file_bytes: int = setting(
        DEFAULT_MAX_FILE_BYTES, "largest file POST /v1/files accepts (413 above) (default %(default)s)"
    )
    file_ttl_s: int = setting(
        DEFAULT_FILE_TTL_S,
        "seconds a file (uploaded or a batch's output) is kept (default %(default)s: 30 days)",
    )
    quota_files: int = setting(
        DEFAULT_QUOTA_FILES,
        "most files one API key (or, without keys, everyone) may hold, uploads and batch outputs; an "
        "upload past it gets 429 quota_exceeded (default %(default)s; 0: no limit)",
    )
    quota_bytes: str = setting(
        "auto",
        "most bytes one API key's files may hold, uploads and batch outputs (a batch's output is "
        "always written, then counted): an upload past it gets 429 quota_exceeded. auto: a quarter of "
        "what Redis may hold for batch data (its maxmemory less the serving reserve) when file bytes "
        "are kept in Redis and it has a maxmemory, else no limit (default %(default)s; 0: no limit)",
    )
    quota_batches: int = setting(
        DEFAULT_QUOTA_BATCHES,
        "most batches one API key may have in flight (not yet completed, failed, expired or "
        "cancelled); POST /v1/batches past it gets 429 quota_exceeded (default %(default)s; 0: no limit)",
    )
    access_log: bool = setting(False, "log every HTTP request (default off)")
    metrics: bool = setting(
        True, "Prometheus metrics at GET /metrics, open like /health (default on; --no-metrics: off, 404)"
    )
    traffic_window_s: float = setting(
        30.0,
        "seconds of its traffic (requests, tokens, TTFT and inter-token latency histograms) the router "
        "publishes with its registration for a planner (pdserve plan) (default %(default)s)",
        name="--traffic-window",
    )
    api_key: str = setting(
        "",
        "API keys clients must send as 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
        "(comma-separated; default: none, the router is open); /health and /ready stay open",
        repr=False,
    )
    api_key_file: str = setting("", "a file of API keys, one per line (added to --api-key)")
    shared_prefix_cache: bool = setting(
        False,
        "with API keys, let requests of different keys share cached prompt blocks (default off: each "
        "key's requests reuse only their own, so usage.prompt_tokens_details.cached_tokens tells no "
        "client what another's prompts were)",
    )
    api_keys: frozenset[str] = dataclasses.field(default=frozenset(), init=False, repr=False)

    @property
    def quotas(self) -> Quotas:
        """What one API key may hold in the Batch API (``--quota-files``, ``--quota-bytes``,
        ``--quota-batches``)."""
        raw = self.quota_bytes.strip().lower()
        if raw == "auto":
            return Quotas(self.quota_files, None, self.quota_batches)
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
            raise ConfigError(f"--quota-bytes must be auto or a number of bytes (0: no limit), got {raw!r}")
        return Quotas(self.quota_files, int(raw), self.quota_batches)

    @property
    def replica_wait(self) -> ReplicaWait:
        return ReplicaWait(self.redis_wait_replicas, self.redis_wait_timeout_ms)

    def __post_init__(self) -> None:
        self.replica_wait.check_url(self.redis_url)
        keys = {k.strip() for k in self.api_key.split(",") if k.strip()}
        if self.api_key_file:
            try:
                text = Path(self.api_key_file).read_text()
            except OSError as e:
                raise ConfigError(f"--api-key-file {self.api_key_file}: {e.strerror}") from None
            keys |= {line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")}
            if not keys:
                raise ConfigError(f"--api-key-file {self.api_key_file} holds no key")
        object.__setattr__(self, "api_keys", frozenset(keys))
        if not self.router_id:
            host = socket.gethostname().split(".")[0][:64] or "host"
            object.__setattr__(self, "router_id", f"router-{host}-{self.port}-{secrets.token_hex(3)}")
        try:
            validate_id(self.router_id, "router id")
            validate_id(self.cluster, "cluster name")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        quotas = self.quotas  # ConfigError for a --quota-bytes neither auto nor a number
        for flag, value in (("--quota-files", quotas.files), ("--quota-batches", quotas.batches)):
            if value < 0:
                raise ConfigError(f"{flag} must be at least 0 (0: no limit), got {value}")
        for flag, value in (("--max-file-bytes", self.max_file_bytes), ("--file-ttl", self.file_ttl_s)):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1 (got {value})")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICY_NAMES:
                raise ConfigError(
                    f"{name} must be one of {', '.join(POLICY_NAMES)}, got {getattr(self, name)!r}"
                )
        if self.prefix_load_tokens < 0 or self.prefix_transfer_weight < 0 or self.local_prefill_tokens < 0:
            raise ConfigError(
                "prefix_load_tokens, prefix_transfer_weight and local_prefill_tokens must be >= 0"
            )
        if not 0 <= self.prefix_host_tier_weight <= 1:
            raise ConfigError(
                f"prefix_host_tier_weight must be in [0, 1], got {self.prefix_host_tier_weight}"
            )
        if not 0 <= self.prefix_disk_tier_weight <= 1:
            raise ConfigError(
                f"prefix_disk_tier_weight must be in [0, 1], got {self.prefix_disk_tier_weight}"
            )
        if self.prefix_index not in INDEX_KINDS:
            raise ConfigError(
                f"prefix_index must be one of {', '.join(INDEX_KINDS)}, got {self.prefix_index!r}"
            )
        for name in (
            "request_timeout_s",
            "first_token_timeout_s",
            "reserve_timeout_s",
            "ttl_s",
            "stall_timeout_s",
            "live_set_max_age_s",
            "watch_interval_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.transfer_timeout_s is not None and not self.transfer_timeout_s > 0:
            raise ConfigError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        for name in (
            "max_stop_strings",
            "max_stop_string_len",
            "max_stop_token_ids",
            "max_logit_bias",
            "max_prompts_per_request",
            "max_prompt_chars_per_token",
            "max_grammar_bytes",
            "max_optional_properties",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.prepare_nice <= 19:
            raise ConfigError(f"prepare_nice must be 0..19, got {self.prepare_nice}")
        if self.max_in_flight < 0 or self.max_queued < 0:
            raise ConfigError("max_in_flight and max_queued must be >= 0")
        if self.retry_attempts < 0:
            raise ConfigError(f"retry_attempts must be >= 0, got {self.retry_attempts}")
        if self.max_migrations < 0:
            raise ConfigError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if not self.traffic_window_s > 0:
            raise ConfigError(f"--traffic-window must be > 0, got {self.traffic_window_s}")
        if not 0 <= self.verify_fraction <= 1:
            raise ConfigError(f"--verify-fraction must be in 0..1, got {self.verify_fraction}")
        if not 0 <= self.port < 65536:  # 0: no listener (a batch worker's in-process router)
            raise ConfigError(f"port must be in 1..65535, got {self.port}")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``pdserve router`` flags, generated from RouterSettings; each defaults from ``PDSERVE_<FLAG>``."""
    add_flags(parser.add_argument_group("router"), RouterSettings)


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """Build (and validate) RouterSettings from parsed ``pdserve router`` flags."""
    return from_args(RouterSettings, args)
