"""Tokenizer loading, chat templates, incremental detokenization and stop strings, on the tiny model."""

from __future__ import annotations

import itertools
import json
import random
import string
import threading
import time
from pathlib import Path

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.errors import ConfigError, InvalidRequestError
from pdserve.tokenizer import Tokenizer

MIXED = "Hello, 世界! 龘 naïve café 😀🎉 中文也可以 🦜 the end"


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


# ------------------------------------------------------------------------------------------------ loading


def test_special_ids_and_sizes(tok: Tokenizer) -> None:
    im_end, endoftext = tok.raw.token_to_id("<|im_end|>"), tok.raw.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == [im_end, endoftext]
    assert tok.bos_token_id is None
    assert tok.vocab_size == 4096
    assert tok.all_special_ids == {endoftext, tok.raw.token_to_id("<|im_start|>"), im_end}
    assert tok.has_chat_template
    assert tok.pad_token_id == endoftext
    assert tok.generation_defaults == {}


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox, 42 times.",
        "中文也可以，日本語もＯＫ。",
        "emoji 😀🎉🦜👩‍👩‍👧",
        "naïve café über façade",
    ],
)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_encode_as_one_id_and_skip_on_decode(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_end|>")
    assert ids[-1] == tok.eos_token_ids[0]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"
    assert tok.token_text(ids[-1]) == "<|im_end|>"


def test_token_text_of_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("龘")  # not in the training corpus: falls back to its three UTF-8 bytes
    assert len(ids) == 3
    assert [tok.token_text(i) for i in ids] == ["\ufffd"] * 3


def test_eos_from_tokenizer_config_without_generation_config(model_copy: Path) -> None:
    (model_copy / "generation_config.json").unlink()
    tok = Tokenizer.from_dir(model_copy)
    assert tok.eos_token_ids == [tok.raw.token_to_id("<|im_end|>")]


def test_generation_config_fields(model_copy: Path) -> None:
    _edit_json(model_copy / "generation_config.json", eos_token_id=5, temperature=0.7, top_p=0.9, top_k=None)
    tok = Tokenizer.from_dir(model_copy)
    assert tok.eos_token_ids == [5]
    assert tok.generation_defaults == {"temperature": 0.7, "top_p": 0.9}


def test_add_bos_token_prepends_once(model_copy: Path) -> None:
    _edit_json(
        model_copy / "tokenizer_config.json", bos_token={"content": "<|endoftext|>"}, add_bos_token=True
    )
    (model_copy / "generation_config.json").unlink()
    tok = Tokenizer.from_dir(model_copy)
    assert tok.bos_token_id == 0
    assert tok.encode("hi") == [0, *tok.encode("hi", add_special_tokens=False)]
    assert tok.encode("<|endoftext|>hi")[:2] != [0, 0]


def test_missing_tokenizer_json(model_copy: Path) -> None:
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(model_copy)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_malformed_json_names_the_file(model_copy: Path, name: str) -> None:
    (model_copy / name).write_text("{not json")
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        Tokenizer.from_dir(model_copy)


# ---------------------------------------------------------------------------------------------- chat template


def test_chat_template_system_user(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": 'Hi <b> & "you"'}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        '<|im_start|>user\nHi <b> & "you"<|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt.endswith('"you"<|im_end|>\n')


def test_chat_template_unknown_role(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="function") as info:
        tok.apply_chat_template([{"role": "function", "content": "x"}])
    assert info.value.param == "messages"


def test_chat_template_hf_environment(model_copy: Path) -> None:
    """tojson must not HTML-escape; trim_blocks, lstrip_blocks and loop controls are on; kwargs pass."""
    template = (
        "{% for m in messages %}\n"
        "    {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{{ m | tojson }}|{{ extra }}|{{ eos_token }}\n"
        "{% endfor %}"
    )
    _edit_json(
        model_copy / "tokenizer_config.json", chat_template=[{"name": "default", "template": template}]
    )
    tok = Tokenizer.from_dir(model_copy)
    out = tok.apply_chat_template([{"role": "user", "content": "<a&b> é"}, {"role": "x"}], extra=7)
    assert out == '{"role": "user", "content": "<a&b> é"}|7|<|im_end|>\n'


def test_no_chat_template(model_copy: Path) -> None:
    _edit_json(model_copy / "tokenizer_config.json", chat_template=None)
    tok = Tokenizer.from_dir(model_copy)
    assert not tok.has_chat_template
    with pytest.raises(ConfigError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_broken_chat_template_is_a_config_error(model_copy: Path) -> None:
    _edit_json(model_copy / "tokenizer_config.json", chat_template="{% for %}")
    with pytest.raises(ConfigError, match="chat_template"):
        Tokenizer.from_dir(model_copy)


def test_encoding_a_long_text_lets_other_threads_run(tok: Tokenizer) -> None:
    """A worker tokenizes off its engine thread, which helps only if the other threads (engine
    steps, the event loop's heartbeat) run meanwhile: ``encode`` held the GIL for the whole 3 MB
    (seconds); the ids are those of ``tokenizers``' own ``encode``."""
    text = "hello world, " * 240_000
    gaps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - t0
    stop.set()
    thread.join()
    assert elapsed > 0.3, f"encoding took {elapsed:.2f} s: too short to tell"
    assert max(gaps) < 0.2, f"another thread waited {max(gaps):.2f} s while {elapsed:.2f} s of encoding"
    assert ids == tok.raw.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------------------------- detokenizer


def _stream(tok: Tokenizer, ids: list[int], **kwargs: object) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)  # type: ignore[arg-type]
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_incremental_matches_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED)
    pieces = _stream(tok, ids, prompt_ids=tok.encode("Say something:"))
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == MIXED


def test_incremental_holds_split_characters(tok: Tokenizer) -> None:
    ids = tok.encode("a龘b")  # a, three byte tokens, b
    assert "\ufffd" in tok.decode(ids[:2])  # naive per-prefix decoding would emit a broken character
    assert _stream(tok, ids) == ["a", "", "", "龘", "b", ""]


def test_incremental_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("ok<|im_end|>")
    assert "".join(_stream(tok, ids)) == "ok"
    assert "".join(_stream(tok, ids, skip_special_tokens=False)) == "ok<|im_end|>"


def test_incremental_prompt_ending_mid_character(tok: Tokenizer) -> None:
    full = tok.encode("x龘 y")
    prompt, generated = full[:2], full[2:]  # the prompt stops inside 龘
    text = "".join(_stream(tok, generated, prompt_ids=prompt))
    assert text == tok.decode(generated)
    assert not text.startswith("x")  # prompt text must never leak into the output


def test_incremental_flush_releases_trailing_partial(tok: Tokenizer) -> None:
    ids = tok.encode("hi 龘")[:-1]
    pieces = _stream(tok, ids)
    assert pieces[-1] and set(pieces[-1]) == {"\ufffd"}  # the broken tail appears only at the end
    assert "".join(pieces) == tok.decode(ids)


def test_incremental_fallback_when_decode_stream_fails(tok: Tokenizer) -> None:
    class Broken:
        def step(self, raw: object, token_id: int) -> str:
            raise Exception("Invalid prefix encountered")

    ids = tok.encode(MIXED)
    detok = IncrementalDetokenizer(tok)
    head = [detok.add(i) for i in ids[:3]]
    detok._stream = Broken()  # type: ignore[assignment]
    pieces = head + [detok.add(i) for i in ids[3:]] + [detok.flush()]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == MIXED


# ---------------------------------------------------------------------------------------------- stop strings


def _feed_all(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, bool]:
    out = []
    for chunk in chunks:
        text, matched = matcher.feed(chunk)
        out.append(text)
        if matched:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_inside_one_chunk() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc STOP def") == ("abc ", True)
    assert m.matched_stop == "STOP"
    assert m.feed("more") == ("", True)


def test_stop_spanning_chunks() -> None:
    m = StopStringMatcher(["</answer>"])
    assert m.feed("42 </an") == ("42 ", False)
    assert m.feed("sw") == ("", False)
    assert m.feed("er> tail") == ("", True)


def test_holdback_released_when_it_cannot_match() -> None:
    m = StopStringMatcher(["\n\n"])
    assert m.feed("line\n") == ("line", False)
    assert m.feed("next") == ("\nnext", False)
    assert m.feed("\n") == ("", False)
    assert m.flush() == "\n"


def test_include_stop_str_in_output() -> None:
    m = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert _feed_all(m, ["a E", "N", "D b"]) == ("a END", True)


def test_earliest_stop_wins() -> None:
    assert _feed_all(StopStringMatcher(["world", "lo"]), ["hello world"]) == ("hel", True)
    m = StopStringMatcher(["bc", "abcd"])  # "bc" completes first, whatever the chunking
    assert _feed_all(m, ["abcd"]) == ("a", True)
    assert _feed_all(StopStringMatcher(["bc", "abcd"]), list("abcd")) == ("a", True)


def test_no_stops_is_passthrough() -> None:
    m = StopStringMatcher([])
    assert m.feed("anything <|") == ("anything <|", False)
    assert m.flush() == ""


def test_flush_returns_held_text() -> None:
    m = StopStringMatcher(["###"])
    assert m.feed("result ##") == ("result ", False)
    assert m.flush() == "##"
    assert m.flush() == ""


def test_stop_strings_over_streamed_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 中文也可以 and more")
    detok, m = IncrementalDetokenizer(tok), StopStringMatcher(["也可"])
    assert _feed_all(m, [detok.add(i) for i in ids]) == ("The answer is 中文", True)


def _chunkings(text: str) -> list[list[str]]:
    """Every way of splitting ``text`` into consecutive non-empty chunks."""
    out = []
    for cuts in itertools.product((False, True), repeat=max(len(text) - 1, 0)):
        chunks, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                chunks.append(text[start:i])
                start = i
        out.append([*chunks, text[start:]])
    return out


def _reference(stops: list[str], text: str, include: bool) -> tuple[str, str | None]:
    """What the matcher must produce, by brute force: at the first position where some stop string
    ends, the longest one ending there (it starts earliest) cuts the text."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


def _held_back(stops: list[str], text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize(
    ("stops", "text", "include", "expected", "stop"),
    [
        (["bc", "abcd"], "xabcdy", False, "xa", "bc"),  # completed first wins over the longer one
        (["abcd", "bc"], "xabcdy", True, "xabc", "bc"),
        (["b", "ab"], "xaby", False, "x", "ab"),  # same end: the one that starts earlier
        (["b", "ab"], "xaby", True, "xab", "ab"),
        (["aab"], "aaaab", False, "aa", "aab"),  # a failed partial match restarts inside itself
        (["abab", "bac"], "ababac", False, "", "abab"),
        (["abc", "bcd"], "abbcd", False, "ab", "bcd"),
        (["xyz"], "xyxyx", False, "xyxyx", None),  # held back to the end, then flushed
    ],
)
def test_stop_semantics_hold_for_every_chunking(
    stops: list[str], text: str, include: bool, expected: str, stop: str | None
) -> None:
    for chunks in _chunkings(text):
        m = StopStringMatcher(stops, include_stop_str_in_output=include)
        assert _feed_all(m, chunks) == (expected, stop is not None), chunks
        assert m.matched_stop == stop


def test_matcher_agrees_with_a_naive_reference() -> None:
    """Random stop sets and texts over small alphabets (many overlaps), fed in random chunks: the cut,
    the matched string, and after every chunk exactly the text that cannot begin a stop string."""
    rng = random.Random(1234)
    for _ in range(3000):
        alphabet = "abc"[: rng.randint(1, 3)]
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
        include = rng.random() < 0.5
        expected, stop = _reference(stops, text, include)
        m = StopStringMatcher(stops, include_stop_str_in_output=include)
        emitted, pos = "", 0
        while pos < len(text) and not m.matched:
            step = rng.randint(1, 5)
            out, matched = m.feed(text[pos : pos + step])
            pos += step
            emitted += out
            if not matched:
                seen = text[:pos]
                assert emitted == seen[: len(seen) - _held_back(stops, seen)], (stops, text)
        if not m.matched:
            emitted += m.flush()
        assert (emitted, m.matched_stop) == (expected, stop), (stops, text, include)


def test_many_and_long_stop_strings() -> None:
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits + " "
    stops = ["".join(rng.choices(alphabet, k=256)) for _ in range(1000)]
    text = "".join(rng.choices(alphabet, k=3000))
    m = StopStringMatcher(stops)
    pieces = [m.feed(text[i : i + 4])[0] for i in range(0, len(text), 4)]
    assert not m.matched and "".join(pieces) + m.flush() == text
    m = StopStringMatcher(stops)
    assert _feed_all(m, [text[:1000], stops[500][:100], stops[500][100:] + "tail"]) == (text[:1000], True)
    assert m.matched_stop == stops[500]
    # failure links are computed without recursion: a stop string far longer than the recursion limit
    long_stop = "a" * 4999 + "b"
    m = StopStringMatcher([long_stop, "a" * 3000 + "c"])
    assert _feed_all(m, ["a"] * 6000 + ["b!"]) == ("a" * 1001, True)
    assert m.matched_stop == long_stop
