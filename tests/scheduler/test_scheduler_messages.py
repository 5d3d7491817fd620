"""Message schemas: round trips, compact encoding, and clear rejection of what cannot be used."""

from __future__ import annotations

import time

import orjson
import pytest
from pydantic import BaseModel

from pdserve.errors import EngineError, MessageError, RequestTooLongError, TransferError
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import (
    SCHEMA_VERSION,
    Abort,
    DisaggregateInfo,
    ErrorInfo,
    FetchBlocks,
    FetchedBlocks,
    FetchHint,
    FetchInfo,
    GenerateRequest,
    InstanceInfo,
    KVInfo,
    LogprobInfo,
    PeerInfo,
    PhaseDeadlines,
    Prefilled,
    RequestDelta,
    ReserveBlocks,
    ReserveReply,
    RouterInfo,
    StepOutput,
    TopLogprob,
    Usage,
    decode_as,
    decode_message,
    encode,
)

NOW = 1_700_000_000.0
DEADLINES = PhaseDeadlines(reserve=NOW + 1, transfer=NOW + 5, first_token=NOW + 10)


def _disagg() -> DisaggregateInfo:
    return DisaggregateInfo(
        request_id="req-1",
        router_id="r1",
        prefill=PeerInfo(id="p0", host="10.0.0.1", transfer={"shm": "pdserve-p0"}),
        decode=PeerInfo(id="d0", host="10.0.0.1", transfer={"shm": "pdserve-d0"}),
        protocol="shm",
        deadlines=DEADLINES,
    )


def _step(n: int = 32) -> StepOutput:
    items = [
        RequestDelta(request_id=f"chatcmpl-{i:032x}", token_ids=[1000 + i], text=" tok") for i in range(n)
    ]
    return StepOutput(instance_id="decode-0", items=items)


MESSAGES: list[BaseModel] = [
    GenerateRequest(
        request_id="req-1",
        router_id="r1",
        messages=[{"role": "user", "content": "héllo"}],
        sampling=SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"], seed=3, prompt_logprobs=2),
        fill_max_tokens=True,
        deadline=NOW + 30,
        attempt=1,
        disaggregate_info=_disagg(),
    ),
    GenerateRequest(request_id="req-2", router_id="r1", prompt_token_ids=[1, 2, 3], deadline=NOW + 30),
    GenerateRequest(  # the prefix fetched from a peer first
        request_id="req-3",
        router_id="r1",
        prompt_token_ids=list(range(40)),
        deadline=NOW + 30,
        fetch=FetchHint(
            peer=PeerInfo(id="d0", host="h", transfer={"writes": ["shm"]}), protocol="shm", blocks=2
        ),
    ),
    FetchBlocks(
        request_id="req-3/0#fetch",
        reply_to="m1",
        fetcher=PeerInfo(
            id="m1", host="h", transfer={"endpoint": {"shm": "pdserve-m1"}, "incarnation": "i1"}
        ),
        protocol="shm",
        block_hashes="AAAAAAAAAAAAAAAAAAAAAA==",
        block_ids=[7],
        lease="l1",
        incarnation="i1",
        budget_s=2.0,
        namespace="ab" * 16,
    ),
    FetchedBlocks(
        request_id="req-3/0#fetch",
        lease="l1",
        num_blocks=1,
        kv_digests="AAAAAAAAAAA=",
        kv_digest_algo="xxh3_64",
    ),
    FetchedBlocks(request_id="req-3/0#fetch", lease="l1", error="not held"),
    ReserveBlocks(
        request_id="req-1",
        router_id="r1",
        num_tokens=3,
        reply_to="p0",
        deadline=NOW + 30,
        deadlines=DEADLINES,
        sampling=SamplingParams(max_tokens=8, logit_bias={7: -1.5}),
        prompt_token_ids=[1, 2, 3],
    ),
    ReserveReply(request_id="req-1", ok=True, block_ids=[4, 9]),
    ReserveReply(request_id="req-1", ok=False, error="no free blocks", retry_after_ms=50),
    Prefilled(
        request_id="req-1",
        first_token=42,
        prompt_token_ids=[1, 2, 3],
        error=ErrorInfo.of(TransferError("segment gone"), retryable=True),
    ),
    Abort(request_id="req-1", reason="client disconnected"),
    StepOutput(
        instance_id="d0",
        items=[
            RequestDelta(request_id="a", token_ids=[5, 6], text="xy"),
            RequestDelta(
                request_id="b",
                token_ids=[2],
                finish_reason="stop",
                usage=Usage(prompt_tokens=3, completion_tokens=4),
            ),
            RequestDelta.failure("c", EngineError("CUDA on fire"), retryable=True, attempt=2),
            RequestDelta(  # a prompt's first token has no logprob (left out of the JSON, None again)
                request_id="d",
                token_ids=[9],
                prompt_logprobs=[
                    LogprobInfo(token_id=1, token="a"),
                    LogprobInfo(
                        token_id=2,
                        token="b",
                        logprob=-1.5,
                        rank=3,
                        top=[TopLogprob(token_id=4, token="c", logprob=-0.5)],
                    ),
                ],
            ),
        ],
    ),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: BaseModel) -> None:
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode_message(data)
    assert type(back) is type(msg)
    assert back == msg
    raw = orjson.loads(data)
    assert raw["v"] == SCHEMA_VERSION and raw["type"] == msg.type  # type: ignore[attr-defined]


def test_every_inbox_message_names_its_request_and_step_items_do() -> None:
    for msg in MESSAGES:
        if isinstance(msg, StepOutput):
            assert all(item.request_id for item in msg.items)
        else:
            assert msg.request_id  # type: ignore[attr-defined]


def test_encoding_is_orjson_compatible_and_drops_none() -> None:
    msg = MESSAGES[-1]
    data = encode(msg)
    assert orjson.loads(data) == orjson.loads(orjson.dumps(msg.model_dump(exclude_none=True)))
    item = orjson.loads(data)["items"][0]
    assert "error" not in item and "usage" not in item and "logprobs" not in item


def test_registration_values_round_trip() -> None:
    info = InstanceInfo(
        id="p0",
        role="prefill",
        model="tiny",
        version="0.1.0",
        host="h",
        pid=1,
        started_at=NOW,
        kv=KVInfo(block_size=16, num_blocks=100, free_blocks=90, dtype="float32", layout="block_major"),
        max_model_len=2048,
    )
    assert decode_as(InstanceInfo, encode(info)) == info
    assert info.load.running == 0 and info.transfer.protocols == [] and not info.draining
    assert info.transfer.writes is None and info.fetch is None  # an older worker's: nothing to fetch from
    fetching = info.model_copy(update={"fetch": FetchInfo(fetches=2, hits=9, misses=1, failed=1, served=4)})
    assert decode_as(InstanceInfo, encode(fetching)) == fetching
    router = RouterInfo(id="r1", host="h", pid=2, port=8000, started_at=NOW)
    assert decode_as(RouterInfo, encode(router)) == router


def test_unknown_type_is_rejected() -> None:
    with pytest.raises(MessageError, match=r"unknown message type 'tokens'; known types: \['abort'"):
        decode_message(b'{"v":1,"type":"tokens","request_id":"x"}')
    with pytest.raises(MessageError, match="unknown message type None"):
        decode_message(b'{"v":1,"request_id":"x"}')


def test_newer_major_version_is_rejected() -> None:
    data = orjson.dumps({**orjson.loads(encode(MESSAGES[6])), "v": SCHEMA_VERSION + 1})
    with pytest.raises(
        MessageError,
        match=rf"schema v{SCHEMA_VERSION + 1} is newer than this pdserve understands \(v{SCHEMA_VERSION}\)",
    ):
        decode_message(data)
    with pytest.raises(MessageError, match="newer"):
        newer = SCHEMA_VERSION + 1
        decode_as(RouterInfo, b'{"v":%d,"id":"r","host":"h","pid":1,"port":1,"started_at":0}' % newer)


def test_bad_fields_are_named() -> None:
    with pytest.raises(MessageError, match=r"invalid step message: items\.0\.token_ids\.0: "):
        decode_message(
            b'{"v":1,"type":"step","instance_id":"d0","items":[{"request_id":"a","token_ids":["x"]}]}'
        )
    with pytest.raises(MessageError, match=r"invalid abort message: reason: Field required"):
        decode_message(b'{"v":1,"type":"abort","request_id":"a"}')
    with pytest.raises(MessageError, match=r"v: Input should be greater than or equal to 1"):
        decode_message(b'{"v":0,"type":"abort","request_id":"a","reason":"x"}')


def test_generate_needs_exactly_one_prompt() -> None:
    base = {"v": 1, "type": "generate", "request_id": "a", "router_id": "r", "deadline": NOW}
    with pytest.raises(MessageError, match="exactly one of prompt_token_ids, prompt, messages"):
        decode_message(orjson.dumps(base))
    with pytest.raises(MessageError, match="exactly one of"):
        decode_message(orjson.dumps({**base, "prompt": "hi", "prompt_token_ids": [1]}))


def test_not_json_or_not_an_object() -> None:
    with pytest.raises(MessageError, match="not valid JSON"):
        decode_message(b"\x80\x04pickle")
    with pytest.raises(MessageError, match="must be a JSON object, got list"):
        decode_message(b"[1]")


def test_sampling_is_typed_checked_for_types_only_and_strict_about_keys() -> None:
    """The router validated the values; the wire form leaves out None fields; an unknown key is
    refused, so a worker never ignores a setting it does not know."""
    base = {"v": SCHEMA_VERSION, "type": "generate", "request_id": "a", "router_id": "r", "deadline": NOW}
    sampling = SamplingParams(temperature=0.5, logit_bias={"7": 2})
    raw = orjson.loads(encode(GenerateRequest(**base, prompt="hi", sampling=sampling)))
    assert "seed" not in raw["sampling"] and raw["sampling"]["logit_bias"] == {"7": 2.0}
    msg = decode_message(orjson.dumps({**base, "prompt": "hi", "sampling": {"temperature": 5, "top_k": 3}}))
    assert isinstance(msg, GenerateRequest) and isinstance(msg.sampling, SamplingParams)
    assert (msg.sampling.temperature, msg.sampling.top_k, msg.sampling.seed) == (5.0, 3, None)
    with pytest.raises(MessageError, match=r"invalid generate message: sampling\.top_a: "):
        decode_message(orjson.dumps({**base, "prompt": "hi", "sampling": {"top_a": 0.1}}))
    with pytest.raises(MessageError, match=r"sampling\.temperature: "):
        decode_message(orjson.dumps({**base, "prompt": "hi", "sampling": {"temperature": "hot"}}))


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    msg = decode_message(
        b'{"v":%d,"type":"abort","request_id":"a","reason":"x","added_later":true}' % SCHEMA_VERSION
    )
    assert msg == Abort(request_id="a", reason="x")


def test_delta_helpers() -> None:
    failed = RequestDelta.failure("a", RequestTooLongError("too long", "prompt"), retryable=True)
    assert failed.is_final and failed.finish_reason == "error"
    assert failed.error == ErrorInfo(
        kind="context_length_exceeded", message="too long", param="prompt", retryable=True
    )
    assert not RequestDelta(request_id="a", token_ids=[1]).is_final


def test_step_codec_is_fast() -> None:
    """A 32-item step must encode + decode well under a millisecond (it is ~50 µs on a laptop)."""
    step = _step(32)
    data = encode(step)
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        decode_message(encode(step))
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 1e-3, f"{per_call * 1e6:.0f} µs per encode+decode of {len(data)} bytes"
