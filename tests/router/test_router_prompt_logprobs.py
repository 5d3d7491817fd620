"""Prompt logprobs through the router against a scripted worker: OpenAI's legacy ``echo`` +
``logprobs`` shape (what lm-eval's local-completions reads) and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import redis
from router_support import FakeWorker, deltas_for, instance, redis_conn, router, run, sse_events

from pdserve.scheduler import GenerateRequest, InboxMessage, LogprobInfo, TopLogprob


def text(t: int) -> str:
    return f"<{t}>"


def prompt_entries(ids: list[int], num_top: int) -> list[LogprobInfo]:
    """What a worker sends: the first token without a logprob, then each with ``num_top``
    alternatives (token 1 and up, logprob -0.1 each) and rank 2."""
    tops = [TopLogprob(token_id=a, token=text(a), logprob=-0.1) for a in range(1, num_top + 1)]
    first = LogprobInfo(token_id=ids[0], token=text(ids[0]))
    return [first] + [
        LogprobInfo(token_id=t, token=text(t), logprob=-float(t), rank=2, top=tops) for t in ids[1:]
    ]


async def scoring(worker: FakeWorker, msg: InboxMessage) -> None:
    """ "Hello world" whose first delta carries the prompt's logprobs (when asked) and text (echo)."""
    if isinstance(msg, GenerateRequest):
        assert msg.prompt_token_ids is not None
        deltas = deltas_for(msg, ["Hello", " world"][: msg.sampling.max_tokens], prompt_tokens=3)
        if msg.sampling.prompt_logprobs is not None:
            deltas[0].prompt_logprobs = prompt_entries(msg.prompt_token_ids, msg.sampling.prompt_logprobs)
        if msg.echo:
            deltas[0].prompt_text = "".join(map(text, msg.prompt_token_ids))
        for delta in deltas:
            await worker.publish(msg.router_id, delta)


def legacy(ids: list[int], completion: list[str], num_top: int = 1) -> dict:
    """OpenAI's legacy logprobs of an echoed prompt ``ids`` then ``completion`` (the fake's tokens)."""
    tokens = [text(t) for t in ids] + completion
    offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    top = {text(a): -0.1 for a in range(1, num_top + 1)}
    return {
        "tokens": tokens,
        "token_logprobs": [None] + [-float(t) for t in ids[1:]] + [-0.5] * len(completion),
        "top_logprobs": [None] + [top] * (len(ids) - 1) + [{c: -0.5} for c in completion],
        "text_offset": offsets,
    }


def test_echo_with_logprobs_puts_the_prompts_logprobs_first(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The worker is asked for ``prompt_logprobs`` = ``logprobs``; the choice's legacy logprobs cover
    the prompt (first token null) then the completion, offsets over both texts; streamed, the
    prompt's go in the first chunk. n > 1: every choice has them."""

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), scoring).start()
            body = {"prompt": [7, 8, 9], "echo": True, "logprobs": 1, "max_tokens": 2}
            choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
            assert choice["text"] == "<7><8><9>Hello world"
            assert choice["logprobs"] == legacy([7, 8, 9], ["Hello", " world"])
            assert "prompt_logprobs" not in choice  # vLLM's field only when asked for
            sent = worker.requests()[0].sampling
            assert (sent.logprobs, sent.prompt_logprobs) == (1, 1)
            events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
            assert [e["choices"][0]["logprobs"] for e in events[:-1]] == [
                legacy([7, 8, 9], ["Hello"]),
                {
                    "tokens": [" world"],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{" world": -0.5}],
                    "text_offset": [14],
                },
            ]
            resp = await client.post("/v1/completions", json={**body, "n": 2, "logprobs": 3, "seed": 5})
            assert [c["logprobs"] for c in resp.json()["choices"]] == [
                legacy([7, 8, 9], ["Hello", " world"], 3)
            ] * 2
            plain = await client.post("/v1/completions", json={"prompt": [7, 8], "logprobs": 1})
            assert plain.json()["choices"][0]["logprobs"]["tokens"] == [
                "Hello",
                " world",
            ]  # no echo: no prompt
            assert worker.requests()[-1].sampling.prompt_logprobs is None
            await worker.stop()

    run(main())


def test_lm_eval_loglikelihood_request(redis_url: str, redis_client: redis.Redis) -> None:
    """What lm-eval's local-completions sends for loglikelihood: a batch of token-id prompts, echo,
    logprobs 1, max_tokens 1; it reads token_logprobs and top_logprobs of each choice."""

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), scoring).start()
            prompts = [[7, 8], [9, 10, 11]]
            body = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1}
            body |= {"logprobs": 1, "seed": 1234, "echo": True}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            choices = resp.json()["choices"]
            assert [c["logprobs"] for c in choices] == [legacy(p, ["Hello"]) for p in prompts]
            await worker.stop()

    run(main())


def test_echo_with_max_tokens_0_scores_the_prompt_only(redis_url: str, redis_client: redis.Redis) -> None:
    """OpenAI's scoring request: the worker generates one token, which the client never sees."""

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), scoring).start()
            body = {
                "prompt": [7, 8, 9],
                "echo": True,
                "logprobs": 2,
                "max_tokens": 0,
                "return_token_ids": True,
            }
            got = (await client.post("/v1/completions", json=body)).json()
            assert got["choices"][0] == {
                "index": 0,
                "text": "<7><8><9>",
                "logprobs": legacy([7, 8, 9], [], 2),
                "finish_reason": "length",
                "token_ids": [],
            }
            assert (got["usage"]["prompt_tokens"], got["usage"]["completion_tokens"]) == (3, 0)
            assert worker.requests()[0].sampling.max_tokens == 1
            events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
            (only,) = [e["choices"][0] for e in events[:-1]]
            assert (only["text"], only["logprobs"], only["finish_reason"]) == (
                "<7><8><9>",
                legacy([7, 8, 9], [], 2),
                "length",
            )
            await worker.stop()

    run(main())


def test_vllm_prompt_logprobs_field(redis_url: str, redis_client: redis.Redis) -> None:
    """vLLM's extra: each choice's ``prompt_logprobs`` (null first, then token id -> logprob, rank,
    decoded_token for the prompt token and its alternatives); streamed, in the first chunk only;
    chat too. Without echo no legacy logprobs are made of them."""
    want = [
        None,
        {
            "8": {"logprob": -8.0, "rank": 2, "decoded_token": "<8>"},
            "1": {"logprob": -0.1, "rank": 1, "decoded_token": "<1>"},
            "2": {"logprob": -0.1, "rank": 2, "decoded_token": "<2>"},
        },
        {
            "2": {"logprob": -2.0, "rank": 2, "decoded_token": "<2>"},  # its own rank, not its place
            "1": {"logprob": -0.1, "rank": 1, "decoded_token": "<1>"},
        },
    ]

    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            worker = await FakeWorker(r, instance("m0"), scoring).start()
            body = {"prompt": [7, 8, 2], "prompt_logprobs": 2}
            choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
            assert choice["prompt_logprobs"] == want and choice["logprobs"] is None
            assert worker.requests()[0].sampling.prompt_logprobs == 2
            events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
            assert [e["choices"][0].get("prompt_logprobs") for e in events[:-1]] == [want, None]
            both = {**body, "echo": True, "logprobs": 0, "max_tokens": 1}  # the body's prompt_logprobs wins
            choice = (await client.post("/v1/completions", json=both)).json()["choices"][0]
            assert choice["prompt_logprobs"] == want
            assert choice["logprobs"]["top_logprobs"][1] == {"<1>": -0.1, "<2>": -0.1}
            chat = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 2}
            worker.handler = chat_scoring
            choice = (await client.post("/v1/chat/completions", json=chat)).json()["choices"][0]
            assert choice["prompt_logprobs"] == want and choice["message"]["content"] == "Hello world"
            events = sse_events(
                (await client.post("/v1/chat/completions", json={**chat, "stream": True})).text
            )
            assert [e["choices"][0].get("prompt_logprobs") for e in events[:-1]] == [None, want, None]
            await worker.stop()

    async def chat_scoring(worker: FakeWorker, msg: InboxMessage) -> None:
        await scoring(worker, msg.model_copy(update={"messages": None, "prompt_token_ids": [7, 8, 2]}))

    run(main())
