"""The engine client's preparation of a generate request: the router validated its sampling, the
worker fills in only what needs the tokenized prompt."""

from __future__ import annotations

import time

import pytest
from router_support import run
from splitwise_support import MAX_MODEL_LEN, StubEngine

from pdserve.errors import InvalidRequestError
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import GenerateRequest
from pdserve.worker.engine_client import EngineClient

UNSET = 2**31 - 1  # the router's placeholder for "no max_tokens"


def _request(sampling: SamplingParams, fill: bool) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        router_id="x",
        prompt_token_ids=[1, 2, 3],
        deadline=time.time() + 30,
        sampling=sampling,
        fill_max_tokens=fill or None,
    )


def test_fill_max_tokens_is_the_room_the_prompt_leaves() -> None:
    async def main() -> None:
        engine = await EngineClient.start(StubEngine)
        try:
            msg = _request(SamplingParams(max_tokens=UNSET), fill=True)
            prepared = await engine.prepare(msg)
            assert prepared.params.max_tokens == MAX_MODEL_LEN - 3
            assert msg.sampling.max_tokens == UNSET  # the message's own object is left as it came
            given = SamplingParams(max_tokens=5, temperature=0.0)
            assert (await engine.prepare(_request(given, fill=False))).params is given
            too_many = _request(SamplingParams(max_tokens=UNSET, min_tokens=MAX_MODEL_LEN), fill=True)
            with pytest.raises(
                InvalidRequestError, match=r"min_tokens \(64\) must not exceed max_tokens \(61\)"
            ) as e:
                await engine.prepare(too_many)
            assert e.value.param == "min_tokens"
        finally:
            await engine.close()

    run(main())
