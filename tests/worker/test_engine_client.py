"""The engine client's preparation of a generate request: the router validated its sampling, the
worker fills in only what needs the tokenized prompt."""

from __future__ import annotations

import asyncio
import time

import pytest
from router_support import run
from splitwise_support import MAX_MODEL_LEN, StubEngine

from pdserve.errors import InvalidRequestError, RequestTooLongError
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import GenerateRequest
from pdserve.worker.engine_client import EngineClient, PrepareLimits

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


# ---- hardening: a large request never stalls the engine thread or the event loop ---------------
BIG_SCHEMA = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}} for i in range(20000)]}


async def _loop_gap(work) -> tuple[float, object]:
    """The longest the event loop went without running a 10 ms ticker while ``work`` ran (a heartbeat
    is such a ticker), and what ``work`` returned or raised."""
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    try:
        result: object = await work
    except Exception as e:
        result = e
    tick.cancel()
    return max(gaps), result


def _big(
    prompt: str | None = None, messages: list | None = None, guided: dict | None = None
) -> GenerateRequest:
    return GenerateRequest(
        request_id="big",
        router_id="x",
        prompt=prompt,
        messages=messages,
        deadline=time.time() + 30,
        sampling=SamplingParams(max_tokens=4, guided=guided),
    )


def test_big_prompts_and_schemas_are_refused_at_once_naming_the_field(tiny_model_dir) -> None:
    """A 7 MB prompt, 7 MB of chat messages and a 1 MB schema: each a 400 naming its field within
    a second (the size bounds come before tokenizing or compiling; tokenizing 7 MB alone takes
    seconds), and the event loop never stalls meanwhile."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(num_blocks=64, max_model_len=1024, threads=1)
    limits = PrepareLimits(prompt_chars_per_token=32, grammar_bytes=65536)

    async def main() -> None:
        engine = await EngineClient.start(lambda: LLMEngine(tiny_model_dir, config), limits)
        try:
            cases = [
                (_big(prompt="hello " * 1_200_000), RequestTooLongError, "prompt"),
                (
                    _big(messages=[{"role": "user", "content": "hi " * 2_400_000}]),
                    RequestTooLongError,
                    "messages",
                ),
                (
                    _big(prompt="hi", guided={"kind": "json", "spec": BIG_SCHEMA}),
                    InvalidRequestError,
                    "response_format",
                ),
                (
                    _big(prompt="hi", guided={"kind": "regex", "spec": "a" * 70000}),
                    InvalidRequestError,
                    "guided_regex",
                ),
            ]
            for msg, kind, param in cases:
                t0 = time.perf_counter()
                gap, error = await _loop_gap(engine.prepare(msg))
                elapsed = time.perf_counter() - t0
                assert isinstance(error, kind), error
                assert error.param == param
                assert elapsed < 1.0, f"{param}: refused after {elapsed:.2f} s"
                assert gap < 0.5, f"{param}: the event loop stalled {gap:.2f} s"
            small = await engine.prepare(_big(prompt="hi"))  # the bounds leave normal requests alone
            assert small.prompt_ids
        finally:
            await engine.close()

    run(main())


def test_tokenizing_a_long_prompt_leaves_the_engine_thread_and_the_loop_free(tiny_model_dir) -> None:
    """With no size bound, a 3 MB prompt takes seconds to tokenize: meanwhile the engine thread
    answers at once (tokenization runs on the preparation threads) and the event loop keeps
    ticking (the tokenizer releases the GIL), so steps and heartbeats go on."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(num_blocks=64, max_model_len=1024, threads=1)

    async def main() -> None:
        engine = await EngineClient.start(lambda: LLMEngine(tiny_model_dir, config))
        try:
            work = asyncio.create_task(_loop_gap(engine.prepare(_big(prompt="hello world " * 250_000))))
            await asyncio.sleep(0.3)
            assert not work.done(), "tokenizing took under 0.3 s: the prompt is too short to tell"
            t0 = time.perf_counter()
            await engine.abort("nothing", "test")  # one call on the engine thread
            waited = time.perf_counter() - t0
            gap, error = await work
            assert isinstance(error, RequestTooLongError) and error.param == "prompt"
            assert waited < 0.3, f"the engine thread was busy {waited:.2f} s"
            assert gap < 0.5, f"the event loop stalled {gap:.2f} s"
        finally:
            await engine.close()

    run(main())


def test_grammars_compile_on_the_preparation_threads(tiny_model_dir) -> None:
    """A request's grammar is compiled while it is prepared (P, mixed) and before a prefilled request
    is continued (D, which compiles it again): both on the preparation threads, never on the engine
    thread, which then finds it in the cache."""
    import threading

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(num_blocks=64, max_model_len=1024, threads=1)

    async def main() -> list[str]:
        engine = await EngineClient.start(lambda: LLMEngine(tiny_model_dir, config))
        grammars = engine._engine.grammars
        compile_one = grammars._compile
        threads: list[str] = []

        def compiled(*args):
            threads.append(threading.current_thread().name)
            return compile_one(*args)

        grammars._compile = compiled
        try:
            regex = SamplingParams(max_tokens=4, guided={"kind": "regex", "spec": "[a-z]{1,3}"})
            await engine.prepare(_big(prompt="hi", guided=regex.guided))
            choice = SamplingParams(max_tokens=4, guided={"kind": "choice", "spec": ["a", "b"]})
            first = engine._engine.tokenizer.encode("a", add_special_tokens=False)[0]
            assert await engine.try_reserve("d", [5, 6, 7], choice)
            await engine.add_prefilled("d", [5, 6, 7], first, choice)
            await engine.abort("d", "test")
            return threads
        finally:
            await engine.close()

    threads = run(main())
    assert len(threads) == 2 and all(t.startswith("prepare") for t in threads), threads


def test_echo_engine_calls_run_on_the_loop_and_a_model_engines_on_the_engine_thread(tiny_model_dir) -> None:
    """The echo engine's calls take microseconds, so its worker makes them on the event loop (a thread
    hop per call cost more than the call); a model engine's steps run on its engine thread."""
    import threading

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.echo import EchoEngine
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(num_blocks=64, max_model_len=1024, threads=1)

    async def thread_of_a_step(factory) -> str:
        engine = await EngineClient.start(factory)
        inner = engine._engine
        step = inner.step
        seen: list[str] = []

        def recorded():
            seen.append(threading.current_thread().name)
            return step()

        inner.step = recorded
        try:
            await engine.step()
            return seen[0]
        finally:
            await engine.close()

    assert run(thread_of_a_step(lambda: EchoEngine(None))) == threading.main_thread().name
    assert run(thread_of_a_step(lambda: LLMEngine(tiny_model_dir, config))).startswith("engine")


def test_preparation_runs_at_a_lower_os_priority_than_the_engine(tiny_model_dir) -> None:
    """Grammars compile (and prompts tokenize) on threads ``--prepare-nice`` nicer than the engine
    thread that steps (Linux: a thread's own niceness), so the kernel gives the cores to decode
    first; with 0 they run at the engine's priority."""
    import os
    import threading

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(num_blocks=64, max_model_len=1024, threads=1)

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def main(nice: int) -> tuple[list[int], list[int], list[int]]:
        engine = await EngineClient.start(lambda: LLMEngine(tiny_model_dir, config), nice=nice)
        inner = engine._engine
        compile_one, step, encode = inner.grammars._compile, inner.step, inner.tokenizer.encode
        compiled: list[int] = []
        encoded: list[int] = []
        stepped: list[int] = []

        def recorded_compile(*args):
            compiled.append(niceness())
            return compile_one(*args)

        def recorded_encode(*args, **kwargs):
            encoded.append(niceness())
            return encode(*args, **kwargs)

        def recorded_step():
            stepped.append(niceness())
            return step()

        inner.grammars._compile, inner.step = recorded_compile, recorded_step
        inner.tokenizer.encode = recorded_encode
        try:
            regex = {"kind": "regex", "spec": "[a-z]{1,3}"}
            prepared = await engine.prepare(_big(prompt="hello there", guided=regex))
            await engine.add("r", prepared)
            while engine.unfinished:
                await engine.step()
            return compiled, encoded, stepped
        finally:
            await engine.close()

    base = os.getpriority(os.PRIO_PROCESS, 0)  # this process's: the engine thread inherits it
    compiled, encoded, stepped = run(main(10))
    assert compiled == [min(19, base + 10)] and encoded and set(encoded) == {min(19, base + 10)}
    assert stepped and set(stepped) == {base}
    compiled, encoded, stepped = run(main(0))
    assert compiled == [base] and set(encoded) == {base} and set(stepped) == {base}


def test_an_object_of_too_many_optional_properties_is_refused_before_it_compiles(tiny_model_dir) -> None:
    """A JSON schema with an object of more optional properties than ``--max-optional-properties``
    (500: llguidance's parser gives up at the object's first token past it) is a 400 naming the
    field at once, nothing compiled; one of 500 compiles and constrains."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(num_blocks=64, max_model_len=1024, threads=1)
    limits = PrepareLimits(prompt_chars_per_token=32, grammar_bytes=65536)

    def obj(n: int) -> dict:
        return {
            "type": "object",
            "properties": {f"p{i}": {} for i in range(n)},
            "additionalProperties": False,
        }

    async def main() -> None:
        engine = await EngineClient.start(lambda: LLMEngine(tiny_model_dir, config), limits)
        grammars = engine._engine.grammars
        try:
            for guided, param in (
                ({"kind": "json", "spec": obj(501)}, "response_format"),
                ({"kind": "json", "spec": {"type": "array", "items": obj(3000)}, "param": "tools"}, "tools"),
            ):
                t0 = time.perf_counter()
                with pytest.raises(InvalidRequestError, match="--max-optional-properties") as e:
                    await engine.prepare(_big(prompt="hi", guided=guided))
                assert e.value.param == param
                assert time.perf_counter() - t0 < 0.5
                with pytest.raises(InvalidRequestError) as e:
                    await engine.check_prefilled([5, 6, 7], SamplingParams(max_tokens=4, guided=guided))
                assert e.value.param == param
            assert grammars.num_compiled == 0
            await engine.prepare(_big(prompt="hi", guided={"kind": "json", "spec": obj(500)}))
            assert grammars.num_compiled == 1
        finally:
            await engine.close()

    run(main())
