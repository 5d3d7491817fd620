"""The control-plane messages' versioned schema: what every message and registration value shares
(``v``, the compatibility rule, the base models). Pydantic v2 models as compact JSON, never pickle;
the values themselves are in registration.py, inbox_messages.py and outbox_messages.py, the codec
in messages.py.

Every stream message carries ``v`` (the schema's major version), ``type`` (the discriminator) and
``request_id``. Compatibility rule: adding an optional field keeps ``v``; readers ignore fields they
do not know. Removing, renaming or retyping a field bumps ``v``, and readers reject messages with a
``v`` newer than :data:`SCHEMA_VERSION` instead of misreading them.

The outbox message :class:`StepOutput` batches one engine step's output for many requests of one
router, so it has no top-level ``request_id``: each of its items carries its own.

Optional fields default to ``None`` (and ``None`` means "absent"), so :func:`encode` drops them to
keep entries small; decoding restores the defaults.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 3
"""The newest message schema (major) version this code reads and writes.

2: ``ErrorInfo`` carries the exception tree's ``kind`` and ``param`` instead of ``code``/``type``;
fields nothing produced or read are gone (``detokenize``, ``arrival_time``, ``first_logprobs``,
``num_cached_tokens``). Additive since: ``RequestDelta.timing``, ``GenerateRequest.echo`` with
``RequestDelta.prompt_text``, ``RequestDelta.seq`` with ``Prefilled.next_seq`` (older readers
ignore them).

3: ``GenerateRequest.sampling`` and ``ReserveBlocks.sampling`` are a typed ``SamplingParams``
(``None`` fields left out; unknown keys refused); a request without ``max_tokens`` says
``GenerateRequest.fill_max_tokens`` instead of ``sampling.max_tokens = null``. Additive since:
the registration's KV geometry (``KVInfo.block_bytes``, ``num_layers``, ``num_kv_heads``,
``head_dim``: a registration without them is read, but never paired), ``InstanceInfo.tokenizer``
(the digest of the tokenizer files the instance published; an older router ignores it),
``KVInfo.prefix_caching``, ``TransferInfo.incarnation`` (peers' writers are keyed by it), ``RequestDelta.prompt_logprobs`` with
``LogprobInfo.rank``, ``ReserveReply.num_cached_blocks`` (an older prefill side writes those
blocks too, with the same bytes), ``SamplingParams.cache_salt`` (refused by an older worker as
any unknown sampling key) (a ``LogprobInfo`` without ``logprob`` occurs only as a prompt's first entry,
inside the field an older reader skips; the sampling field that asks for it is refused by an older
worker, as any unknown sampling key is), ``ReserveBlocks.transfer_budget_s`` (an older decode side
frees by the deadline on its own wall clock), ``Abort.writer_done``, ``ReserveBlocks.protocol`` with ``ReserveReply.staging_offset`` (an older
prefill writes at the blocks' offsets, which a staged endpoint refuses), ``Prefilled.kv_digests`` with
``kv_digest_algo`` (an older decode side does not check them), ``InstanceInfo.integrity`` and
``RouterInfo.verify``, the ``SetRole`` message with ``InstanceInfo.switchable``, ``roles`` and
``last_switch`` (an older instance dead-letters a ``set_role``; an older router ignores the fields),
``GenerateRequest.fetch`` with the ``fetch_blocks`` and ``fetched`` messages, ``TransferInfo.writes``,
``InstanceInfo.fetch`` and ``RatesInfo.fetch_s_per_block`` (an older instance ignores the hint and
computes the prefix; it is never asked to serve a fetch: it registers no ``writes``).
"""

Role = Literal["prefill", "decode", "mixed"]
_M = TypeVar("_M", bound=BaseModel)


class _Model(BaseModel):
    # extra="ignore": fields added by a newer minor revision are skipped, not fatal.
    model_config = ConfigDict(extra="ignore")


class _Message(_Model):
    v: int = Field(default=SCHEMA_VERSION, ge=1)
