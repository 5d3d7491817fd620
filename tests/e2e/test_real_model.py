"""End to end on the real model, SmolLM2-135M-Instruct (imported from its GGUF): served by one prefill
and one decode instance, and by one mixed instance, greedy chat answers are the same token for token,
and they answer the question."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.stack import Stack
from tests.e2e.test_serving import model_name, start_stack

pytestmark = pytest.mark.timeout(240)

QUESTIONS = [
    "What is the capital of France?",
    "What color is the sky on a clear day?",
    "How many legs does a spider have?",
]


def ask(stack: Stack, question: str) -> tuple[str, dict[str, Any]]:
    body = {
        "model": model_name(stack),
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 16,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = httpx.post(stack.urls[0] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-pdserve-mode"], r.json()["choices"][0]


def test_splitwise_and_mixed_give_the_same_greedy_answers(smollm2_dir: Path, redis_url: str) -> None:
    answers: dict[str, list[dict[str, Any]]] = {}
    for mode, counts in (("splitwise", {"prefill": 1, "decode": 1}), ("mixed", {"mixed": 1})):
        stack = start_stack(smollm2_dir, redis_url, **counts)
        try:
            replies = [ask(stack, q) for q in QUESTIONS]
        finally:
            assert stack.stop(grace_s=15) == []
        assert [m for m, _ in replies] == [mode] * len(QUESTIONS)
        answers[mode] = [choice for _, choice in replies]
    for question, split, mixed in zip(QUESTIONS, answers["splitwise"], answers["mixed"], strict=True):
        assert split["token_ids"] == mixed["token_ids"], question
        assert split["message"] == mixed["message"] and split["finish_reason"] == mixed["finish_reason"]
        assert split["token_ids"], question
    print({q: a["message"]["content"] for q, a in zip(QUESTIONS, answers["mixed"], strict=True)})
    assert "Paris" in answers["mixed"][0]["message"]["content"]
