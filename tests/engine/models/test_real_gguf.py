"""GGUF import of the real model (SmolLM2-135M-Instruct, Q4_1): the imported weights are the ``gguf``
package's own dequantization with Q and K un-permuted, tensor by tensor, and the imported tokenizer
gives the ids of a reference byte-level BPE built here straight from the GGUF's vocabulary and merges.

The reference code (names, un-permutation, tokenizer) is written independently of gguf_import's.
"""

from __future__ import annotations

import itertools
import random
import re
import shutil
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import load_file

from pdserve.engine.models.gguf_import import import_gguf
from pdserve.tokenizer import Tokenizer

BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}


@pytest.fixture(scope="module")
def reader(smollm2_gguf: Path) -> GGUFReader:
    return GGUFReader(smollm2_gguf)


@pytest.fixture(scope="module")
def imported(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The GGUF imported by the code under test (fresh, not the user's cache); removed afterwards
    (540 MB)."""
    folder = import_gguf(smollm2_gguf, tmp_path_factory.mktemp("import") / "smollm2")
    yield folder
    shutil.rmtree(folder)


def field(reader: GGUFReader, key: str) -> Any:
    f = reader.get_field(key)
    assert f is not None, key
    return f.contents()


def hf_name(name: str) -> str:
    if name in TOP:
        return TOP[name]
    blk, layer, kind, suffix = name.split(".")
    assert blk == "blk" and suffix == "weight", name
    return f"model.layers.{layer}.{BLOCK[kind]}.weight"


def rotate_half_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row gather that undoes llama.cpp's Q/K permutation: in each head of d rows, llama.cpp stores
    HF's row j (j < d/2) at 2j and HF's row d/2 + j at 2j + 1."""
    d = n_rows // n_head
    return np.array([h * d + 2 * j + odd for h in range(n_head) for odd in (0, 1) for j in range(d // 2)])


def test_weights_equal_the_gguf_packages_dequantization(reader: GGUFReader, imported: Path) -> None:
    n_head, n_kv = field(reader, "llama.attention.head_count"), field(reader, "llama.attention.head_count_kv")
    assert (n_head, n_kv) == (9, 3)
    got = load_file(str(imported / "model.safetensors"))
    assert sorted(got) == sorted(hf_name(t.name) for t in reader.tensors)
    assert len(got) == 272  # 30 layers x 9 + embeddings + final norm; lm_head is tied
    worst: dict[str, float] = {}
    for t in reader.tensors:
        want = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        kind = t.name.split(".")[-2]
        if kind in ("attn_q", "attn_k"):
            rows = rotate_half_rows(want.shape[0], n_head if kind == "attn_q" else n_kv)
            assert not np.array_equal(want[rows], want), t.name  # the un-permutation is no no-op here
            want = want[rows]
            kind += " (un-permuted)"
        name = hf_name(t.name)
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        diff = float(np.max(np.abs(got[name].astype(np.float64) - want.astype(np.float64))))
        key = f"{t.tensor_type.name} {kind}"
        worst[key] = max(worst.get(key, 0.0), diff)
    print("max abs difference by GGML type and tensor:", worst)
    assert {k.split()[0] for k in worst} == {"Q8_0", "Q4_1", "F32"}
    assert worst == dict.fromkeys(worst, 0.0)


def test_importing_twice_gives_the_same_bytes(smollm2_gguf: Path, imported: Path, tmp_path: Path) -> None:
    again = import_gguf(smollm2_gguf, tmp_path / "again")
    try:
        names = sorted(p.name for p in imported.iterdir())
        assert names == sorted(p.name for p in again.iterdir())
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
        for name in names:
            assert (imported / name).read_bytes() == (again / name).read_bytes(), name
    finally:
        shutil.rmtree(again)


# ---- a reference tokenizer: llama.cpp's "smollm" pre-tokenizer and GPT-2's byte-level BPE ------------
def char_class(category_prefix: str) -> str:
    """A regex character class body holding every code point whose category starts with the prefix."""
    ranges, start = [], None
    for cp in range(sys.maxunicode + 2):
        inside = cp <= sys.maxunicode and unicodedata.category(chr(cp)).startswith(category_prefix)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            lo, hi = re.escape(chr(start)), re.escape(chr(cp - 1))
            ranges.append(lo if start == cp - 1 else f"{lo}-{hi}")
            start = None
    return "".join(ranges)


class ReferenceBPE:
    """Encodes as llama.cpp does for tokenizer.ggml.pre = "smollm": control tokens matched whole; every
    \\p{N} character on its own; GPT-2's regex on the rest; each piece's UTF-8 bytes spelled with GPT-2's
    byte alphabet, then merged pair by pair, lowest merge rank first."""

    def __init__(self, tokens: list[str], merges: list[str], types: list[int]) -> None:
        letter, number = char_class("L"), char_class("N")
        space = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"  # White_Space
        self.number = re.compile(f"[{number}]")
        self.gpt2 = re.compile(
            rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letter}]+| ?[{number}]+| ?[^{space}{letter}{number}]+"
            rf"|[{space}]+(?![^{space}])|[{space}]+"
        )
        self.ids = {tok: i for i, tok in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(merges)}
        controls = sorted(
            (t for t, kind in zip(tokens, types, strict=True) if kind == 3), key=len, reverse=True
        )
        self.control = re.compile("|".join(map(re.escape, controls)))
        printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        shifted = iter(range(0x100, 0x200))
        self.byte_char = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
        self.cache: dict[str, list[int]] = {}

    def merge(self, word: str) -> list[int]:
        parts = list(word)
        while len(parts) > 1:
            ranked = [(self.ranks[p], p) for p in itertools.pairwise(parts) if p in self.ranks]
            if not ranked:
                break
            _, (a, b) = min(ranked)
            out: list[str] = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        return [self.ids[p] for p in parts]

    def pieces(self, text: str) -> Iterator[str]:
        start = 0
        for m in self.number.finditer(text):
            yield from self.gpt2.findall(text[start : m.start()])
            yield m.group()
            start = m.end()
        yield from self.gpt2.findall(text[start:])

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for m in [*self.control.finditer(text), None]:
            for piece in self.pieces(text[start : m.start() if m else len(text)]):
                word = "".join(self.byte_char[b] for b in piece.encode("utf-8"))
                if word not in self.cache:
                    self.cache[word] = self.merge(word)
                ids += self.cache[word]
            if m:
                ids.append(self.ids[m.group()])
                start = m.end()
        return ids


FIXED = [
    # digits and numbers (each digit is its own token for "smollm")
    *["0", "7", "42", "007", "1234567890", "3.14159", "-12,345.67", "1e-9", "v2.0.1", "2024-06-01", "0x1F"],
    *["12:30pm", "+1 (555) 010-9999", "100%", "$1,000,000", "x1y2z3", "H2O", "²³", "½ ¾", "١٢٣", "Ⅻ", "①②"],
    "In 1969, 3 astronauts flew 384400 km.",
    # whitespace: runs of spaces, tabs, newlines; leading and trailing
    *[
        " ",
        "  ",
        "   ",
        "\t",
        "\t\t",
        "\n",
        "\n\n",
        "\n\n\n",
        "\r\n",
        " \t \n ",
        "\u00a0",
        "\u3000",
        "\u2009",
    ],
    *["a  b", "a   b", "a\t\tb", "a\n\nb", "a \n b", "   x", "x   ", " x ", "  leading", "trailing\n"],
    *["\n\nHello", "Hello\n\n", "line1\r\nline2\r\n", "tab\tseparated\tvalues", " \u00a0 x"],
    # punctuation and contractions
    *["Hello, world!", "...", "?!", "!!!", "«quoted»", "“smart quotes”", "—dash—", "(a) [b] {c}", "a/b\\c"],
    *["don't", "I'm", "you're", "they've", "she'll", "we'd", "it's", "IT'S", "it’s", "'s", "O'Neil"],
    # code
    "def f(x):\n    return x**2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2.5, null, true], "s": "v\\n"}',
    "SELECT * FROM t WHERE id = 42;",
    '<div class="x">&amp;</div>',
    "https://example.com/path?q=1&r=two#frag",
    "user.name+tag@example.org",
    "| a | b |\n|---|---|\n| 1 | 2 |",
    # emoji: plain, skin tone, ZWJ sequences, flags, variation selectors, keycaps
    *["🙂", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🧑🏾‍💻", "🇫🇷", "🇯🇵🇰🇷", "❤️", "1️⃣", "☕ coffee", "I ❤ NY", "😀😃😄😁"],
    # CJK, Korean, other scripts
    *[
        "你好，世界",
        "日本語のテキスト",
        "東京タワーへ行く",
        "中文 English 混合",
        "안녕하세요 세계",
        "한국어 123",
    ],
    *["Привет, мир", "Γειά σου", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีครับ"],
    # accented Latin, composed and decomposed
    *["café", "naïve résumé", "über Straße", "ÅÄÖ åäö", "Ærøskøbing", "ñandú", "e\u0301", "cafe\u0301"],
    # control tokens, whole and next to text
    *["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<|im_start|><|im_end|>"],
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    *["x<|im_end|>y", " <|im_start|> ", "<|im_start", "im_start|>", "<|IM_START|>", "<|endoftext|>42"],
]
FRAGMENTS = [
    *["the", "The", "quick", "brown", "fox", "jumps", "over", " lazy", "dog", "Hello", "world", "tokenizer"],
    *["0", "19", "2024", "3.5", "1,000", "42nd", "x86_64", "½"],
    *[",", ".", "!", "?", "...", "'s", "n't", "(", ")", "-", "--", '"', "#", "@", "=>", "::"],
    *[
        "🙂",
        "👍🏽",
        "👩‍🔬",
        "🇩🇪",
        "✨",
        "你好",
        "世界",
        "テスト",
        "한국",
        "café",
        "naïve",
        "Ω",
        "ß",
        "e\u0301",
    ],
    *["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
]
SEPARATORS = ["", " ", " ", " ", "  ", "\n", "\t", "\n\n", " \n", "   "]


def corpus() -> list[str]:
    """The fixed strings, then 250 seeded random mixes of fragments and separators."""
    rng = random.Random(2024)
    mixed = []
    for _ in range(250):
        words = rng.choices(FRAGMENTS, k=rng.randint(1, 9))
        text = "".join(w + rng.choice(SEPARATORS) for w in words)
        mixed.append(rng.choice(SEPARATORS[:4]) + text)
    return [*FIXED, *mixed]


@pytest.fixture(scope="module")
def reference(reader: GGUFReader) -> ReferenceBPE:
    return ReferenceBPE(
        field(reader, "tokenizer.ggml.tokens"),
        field(reader, "tokenizer.ggml.merges"),
        field(reader, "tokenizer.ggml.token_type"),
    )


def test_reference_tokenizer_reads_the_vocabulary_as_llama_cpp(
    reader: GGUFReader, reference: ReferenceBPE
) -> None:
    assert field(reader, "tokenizer.ggml.pre") == "smollm"
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert [tokens[i] for i in reference.encode("12345")] == list("12345")
    assert reference.encode("<|im_start|>user<|im_end|>") == [1, *reference.encode("user"), 2]
    assert "".join(tokens[i] for i in reference.encode(" hello world")) == "ĠhelloĠworld"


def test_tokenizer_gives_the_ids_of_the_gguf_vocabulary(imported: Path, reference: ReferenceBPE) -> None:
    texts = corpus()
    assert len(set(texts)) > 300
    tok = Tokenizer.from_dir(imported)
    differ = [
        (t, ids, want)
        for t in texts
        if (ids := tok.encode(t, add_special_tokens=False)) != (want := reference.encode(t))
    ]
    print(f"tokenizer agrees with the reference on {len(texts) - len(differ)}/{len(texts)} strings")
    assert differ == []
    for special, token_id in [("<|im_start|>", 1), ("<|im_end|>", 2), ("<|endoftext|>", 0)]:
        assert tok.encode(special, add_special_tokens=False) == [token_id]
        assert tok.encode(f"{special}user", add_special_tokens=False)[0] == token_id
