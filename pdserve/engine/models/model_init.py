"""Write a complete Hugging Face style model folder offline: trained tokenizer plus seeded random weights.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on a corpus generated here from a fixed
seed and embedded word lists, so every machine (and every Python version) gets identical bytes. Weights
are scaled so activations stay near unit size (unit embeddings, 1/sqrt(fan_in) projections), which
keeps greedy output varied instead of collapsing onto one token.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdserve.engine.models.model_folder import write_json, written_atomically
from pdserve.errors import ConfigError

logger = logging.getLogger(__name__)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2 in this order
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
TOKENIZER_VOCAB_SIZE = 4096
CORPUS_SEED = 20240517  # fixed: the tokenizer must not depend on the weight seed
CORPUS_BYTES = 1_000_000

CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}\n"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}\n"
    "{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}\n"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}\n"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '\n"
    "    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'\n"
    '    \'{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}\n'
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('Unsupported role ' ~ message['role'] ~ ': expected system, user, assistant or tool') }}\n"
    "{%- endif %}\n"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}\n"
    "{{- '<|im_start|>' + ('user' if message['role'] == 'tool' else message['role']) + '\\n' }}\n"
    "{%- if message['role'] == 'tool' %}{{- '<tool_response>\\n' }}{%- endif %}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- elif message['content'] is not none %}\n"
    "{%- for part in message['content'] %}\n"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{%- if message['role'] == 'tool' %}{{- '\\n</tool_response>' }}{%- endif %}\n"
    "{%- for call in message['tool_calls'] or [] %}\n"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}\n"
    "{{- (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
"""ChatML as Qwen2.5 writes it: ``tools`` in a system block (Hermes style), the assistant's calls as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, tool results as ``<tool_response>``."""

_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "bos_token_id": None,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "rope_scaling": None,
    "use_cache": True,
    "torch_dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": TOKENIZER_VOCAB_SIZE,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        **_COMMON,
    },
    # ERNIE-4.5-0.3B shape; the embedding is larger than the tokenizer, as in real checkpoints.
    "small": {
        "architectures": ["Ernie4_5ForCausalLM"],
        "model_type": "ernie4_5",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 18,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 103424,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "use_bias": False,
        **_COMMON,
    },
}
# Seeded random weights in the shapes of two models people serve: what speed and exactness are
# measured on where the real checkpoint cannot be fetched (written with --seeded: no weight files).
PRESETS["smollm2-shape"] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    **_COMMON,
}
PRESETS["llama3-8b-shape"] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    **_COMMON,
}
NUM_SHARDS = {"tiny": 1, "small": 2, "smollm2-shape": 1, "llama3-8b-shape": 8}
SEEDED_WEIGHTS = "seeded_weights.json"  # in a folder written with seeded=True, instead of weight files
_SEEDED_CHUNKS = 16  # a seeded tensor's rows come in this many streams (the same on any host)


def init_model(
    path: str | Path, preset: str = "tiny", seed: int = 0, overwrite: bool = False, seeded: bool = False
) -> Path:
    """Write ``preset`` into ``path`` atomically (temp folder + rename) and return the path.
    ``seeded``: no weight files; the folder records the seed and every load generates the same
    weights (:func:`seeded_tensor`), so an 8B-shaped model costs no disk."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    target = Path(path).absolute()
    start = time.perf_counter()
    with written_atomically(target, overwrite) as tmp:
        config = copy.deepcopy(PRESETS[preset])
        _write_tokenizer(tmp, config["max_position_embeddings"])
        write_json(tmp / "config.json", config)
        write_json(
            tmp / "generation_config.json",
            {"bos_token_id": None, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID},
        )
        if seeded:
            write_json(tmp / SEEDED_WEIGHTS, {"seed": seed, "format": 1})
        else:
            _write_weights(tmp, config, seed, NUM_SHARDS[preset])
    elapsed = time.perf_counter() - start
    logger.info("model %s (preset %s, seed %d) written in %.1fs", target, preset, seed, elapsed)
    return target


# ---------------------------------------------------------------------------------------------- tokenizer


def _write_tokenizer(folder: Path, max_len: int) -> None:
    (folder / "tokenizer.json").write_text(trained_tokenizer_json(), encoding="utf-8")
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_len,
            "chat_template": CHATML_TEMPLATE,
        },
    )


@functools.lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """The tokenizer.json text; trained once per process (~1 s) since it never depends on the seed."""
    start = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    if tok.get_vocab_size() != TOKENIZER_VOCAB_SIZE or tok.token_to_id(IM_END) != IM_END_ID:
        raise RuntimeError(f"tokenizer training produced vocab {tok.get_vocab_size()}, expected 4096")
    logger.info("trained byte-level BPE tokenizer in %.2fs", time.perf_counter() - start)
    return tok.to_str(pretty=True)


_WORDS_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had by
not word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him two has
look more day could go come did number sound no most people my over know water than call first who may
down side been now find any new work part take get place made live where after back little only round man
year came show every good me give our under name very through just form sentence great think say help low
line differ turn cause much mean before move right boy old too same tell does set three want air well also
play small end put home read hand port large spell add even land here must big high such follow act why
ask men change went light kind off need house picture try us again animal point mother world near build
self earth father head stand own page should country found answer school grow study still learn plant
cover food sun four between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter until
mile river car feet care second book carry took science eat room friend began idea fish mountain stop once
base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red list
though feel talk bird soon body dog family direct pose leave song measure door product black short numeral
class wind question happen complete ship area half rock order fire south problem piece told knew pass since
top whole king space heard best hour better true during hundred five remember step early hold west ground
interest reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay
against pattern slow center love person money serve appear road map rain rule govern pull cold notice voice
unit power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green oh quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing course stay
wheel full force blue object decide surface deep moon island foot system busy test record boat common gold
possible plane stead dry wonder laugh thousand ago ran check game shape equate hot miss brought heat snow
tire bring yes distant fill east paint language among grand ball yet wave drop heart am present heavy dance
engine position arm wide sail material size vary settle speak weight general ice matter circle pair include
divide syllable felt perhaps pick sudden count square reason length represent art subject region energy
model server request token cache memory queue batch stream decode prefill latency throughput cluster
"""

_ACCENTED_TEXT = (
    "café naïve über façade résumé jalapeño piñata crème brûlée déjà vu Zürich São Paulo Ångström"
)
_CJK = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好"
    "都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此"
    "实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真"
    "听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路"
)
_KANA = (
    "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをん"
    "アイウエオカキクケコサシスセソ"
)
_HANGUL = "가나다라마바사아자차카타파하한국어대학교사람시간"
_EMOJI_TEXT = "😀 😂 🙂 😉 😍 🤔 👍 🎉 🔥 🚀 ✨ ❤️ 🌍 🍕 ☕ 📚 💡 ✅ ⚡ 🐍"
_WORDS, _ACCENTED, _EMOJI = _WORDS_TEXT.split(), _ACCENTED_TEXT.split(), _EMOJI_TEXT.split()
_CODE = [
    "def {a}_{b}({c}, {d}):",
    "    return {c} + {d} * {n}",
    "    {a}_{b} = [{n}, {n}, {n}]",
    "for i in range({n}):",
    '    print(f"{a} {{i}}: {b}")',
    "if ({a} == {n}) {{ return {b}; }}",
    "const {a}{B} = {{{c}: {n}, {d}: '{b}'}};",
    "import {a}.{b} as {c}",
    "class {A}{B}({C}):",
    "    # {a} the {b} before {c}",
    '{{"{a}": {n}, "{b}": "{c}", "ok": true}}',
    "SELECT {a}, {b} FROM {c} WHERE {d} > {n};",
    "x[{n}] = {a}.{b}({c}) - {n}.{n}",
    '<div class="{a}-{b}">{C} {d}</div>',
]


def build_corpus() -> list[str]:
    """About 1 MB of deterministic lines: English prose, code, numbers, accented words, CJK and emoji."""
    rng = np.random.default_rng(CORPUS_SEED)
    words = _WORDS
    weights = 1.0 / np.arange(1, len(words) + 1, dtype=np.float64)  # Zipf-like, as in real text
    cdf = np.cumsum(weights) / weights.sum()
    lines: list[str] = []
    size = 0
    while size < CORPUS_BYTES:
        kind = int(rng.integers(0, 10))
        if kind <= 4:
            line = _sentence(rng, words, cdf)
        elif kind <= 6:
            line = _code_line(rng, words)
        elif kind == 7:
            line = _number_line(rng, words, cdf)
        else:
            line = _cjk_line(rng)
        lines.append(line)
        size += len(line.encode("utf-8")) + 1
    return lines


def _pick(rng: np.random.Generator, items: list[str] | str) -> str:
    return items[int(rng.integers(0, len(items)))]


def _zipf_words(rng: np.random.Generator, words: list[str], cdf: np.ndarray, n: int) -> list[str]:
    idx = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), len(words) - 1)
    return [words[i] for i in idx]


def _sentence(rng: np.random.Generator, words: list[str], cdf: np.ndarray) -> str:
    picked = _zipf_words(rng, words, cdf, int(rng.integers(5, 18)))
    for _ in range(int(rng.integers(0, 3))):
        picked[int(rng.integers(0, len(picked)))] = _pick(rng, _ACCENTED)
    if rng.random() < 0.3:
        picked.insert(int(rng.integers(1, len(picked))), ",")
    text = " ".join(picked).replace(" ,", ",")
    text = text[0].upper() + text[1:] + _pick(rng, [".", ".", ".", "?", "!", "...", ":", ";"])
    if rng.random() < 0.15:
        text += " " + _pick(rng, _EMOJI)
    if rng.random() < 0.1:
        text = f'"{text}" {_pick(rng, ["she said", "he asked", "they wrote"])}.'
    return text


def _code_line(rng: np.random.Generator, words: list[str]) -> str:
    a, b, c, d = (_pick(rng, words).lower() for _ in range(4))
    fields = {"a": a, "b": b, "c": c, "d": d, "A": a.title(), "B": b.title(), "C": c.title()}
    template = _pick(rng, _CODE)
    while "{n}" in template:
        template = template.replace("{n}", str(int(rng.integers(0, 1000))), 1)
    return template.format(**fields)


def _number_line(rng: np.random.Generator, words: list[str], cdf: np.ndarray) -> str:
    w = _zipf_words(rng, words, cdf, 4)
    n = rng.integers(0, 100000, size=4)
    year, month, day = int(rng.integers(1900, 2030)), int(rng.integers(1, 13)), int(rng.integers(1, 29))
    return _pick(
        rng,
        [
            f"In {year} the {w[0]} had {n[0]:,} {w[1]}s and {n[1] % 100}% of the {w[2]}.",
            f"{year}-{month:02d}-{day:02d} {n[0] % 24:02d}:{n[1] % 60:02d} {w[0]}={n[2] / 100:.2f} ({w[1]})",
            f"Total: ${n[0]}.{n[1] % 100:02d}, {n[2]} {w[3]}s, {n[3] % 1000} ms.",
            f"{n[0]} + {n[1]} = {n[0] + n[1]}; {n[2] % 97} * {n[3] % 89} = {(n[2] % 97) * (n[3] % 89)}",
        ],
    )


def _cjk_line(rng: np.random.Generator) -> str:
    alphabet = _pick(rng, [_CJK, _CJK, _CJK, _KANA, _HANGUL])
    chars = [_pick(rng, alphabet) for _ in range(int(rng.integers(6, 30)))]
    for _ in range(int(rng.integers(0, 3))):
        chars.insert(int(rng.integers(1, len(chars))), _pick(rng, "，、。"))
    line = "".join(chars) + _pick(rng, "。！？")
    if rng.random() < 0.3:
        line += _pick(rng, _EMOJI)
    return line


# ------------------------------------------------------------------------------------------------ weights


def weight_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(Hugging Face name, torch-layout shape, init kind) in the fixed order the RNG fills them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    vocab = config["vocab_size"]
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "embed")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,), "norm"),
            (p + "self_attn.q_proj.weight", (q_dim, hidden), "linear"),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden), "linear"),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden), "linear"),
            (p + "self_attn.o_proj.weight", (hidden, q_dim), "linear"),
            (p + "post_attention_layernorm.weight", (hidden,), "norm"),
            (p + "mlp.gate_proj.weight", (inter, hidden), "linear"),
            (p + "mlp.up_proj.weight", (inter, hidden), "linear"),
            (p + "mlp.down_proj.weight", (hidden, inter), "linear"),
        ]
    out.append(("model.norm.weight", (hidden,), "norm"))
    if not config["tie_word_embeddings"]:
        out.append(("lm_head.weight", (vocab, hidden), "linear"))
    return out


def _init_tensor(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    w = rng.standard_normal(shape, dtype=np.float32)
    if kind == "norm":
        w *= np.float32(0.1)
        w += np.float32(1.0)
    elif kind == "linear":
        w *= np.float32(1.0 / math.sqrt(shape[1]))  # torch layout [out, in]: fan_in is the last dim
    return w


def seeded_tensor(seed: int, index: int, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Tensor ``index`` of :func:`weight_shapes` in a seeded folder: its rows filled by
    ``_SEEDED_CHUNKS`` independent streams at once (numpy releases the GIL while it fills), scaled
    as :func:`_init_tensor` scales them."""
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.engine.memory import page_empty

    out = page_empty(shape)
    rows = shape[0]
    step = -(-rows // _SEEDED_CHUNKS)

    def fill(i: int) -> None:
        part = out[i * step : (i + 1) * step]
        if part.size:
            np.random.default_rng([seed, index, i]).standard_normal(part.shape, np.float32, out=part)

    with ThreadPoolExecutor(min(_SEEDED_CHUNKS, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, range(_SEEDED_CHUNKS)))
    if kind == "norm":
        out *= np.float32(0.1)
        out += np.float32(1.0)
    elif kind == "linear":
        out *= np.float32(1.0 / math.sqrt(shape[1]))
    return out


def _write_weights(folder: Path, config: dict[str, Any], seed: int, num_shards: int) -> None:
    """Fill tensors in a fixed order from one seeded stream, one shard in memory at a time."""
    specs = weight_shapes(config)
    sizes = [4 * math.prod(shape) for _, shape, _ in specs]
    total = sum(sizes)
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    running = 0
    for idx, size in enumerate(sizes):
        shards[min(num_shards - 1, running * num_shards // total)].append(idx)
        running += size
    rng = np.random.default_rng(seed)
    weight_map: dict[str, str] = {}
    for k, members in enumerate(shards, start=1):
        name = "model.safetensors" if num_shards == 1 else f"model-{k:05d}-of-{num_shards:05d}.safetensors"
        tensors = {specs[i][0]: _init_tensor(rng, specs[i][1], specs[i][2]) for i in members}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        (folder / name).chmod(0o644)  # safetensors creates files owner-only; the model is meant to be shared
        weight_map.update(dict.fromkeys(tensors, name))
        mb = sum(sizes[i] for i in members) / 2**20
        logger.info("wrote %s (%d tensors, %.0f MB)", name, len(tensors), mb)
        del tensors
    if num_shards > 1:
        write_json(
            folder / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        )
