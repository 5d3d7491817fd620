"""A model folder's tokenizer: ``tokenizers`` for text <-> ids, Jinja for chat templates.

The chat template is rendered exactly as Hugging Face transformers renders it (same sandbox, options,
``raise_exception`` and non-escaping ``tojson``), so prompts match what the model was trained on.

A leaf every layer may use: the engine tokenizes what it runs, and a router computes the same
prompt ids (:meth:`Tokenizer.prompt_ids`) for prefix-cache routing from the tokenizer files a worker
publishes (:func:`pack_tokenizer_files`; the router never reads a model folder). A tokenizer is
built from its files' texts by one code path, :meth:`Tokenizer.from_files`, whether they come from
a folder (:meth:`Tokenizer.from_dir`) or from Redis. Imports only ``pdserve.errors``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import orjson
import tokenizers

from pdserve.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)

GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k")

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
TOKENIZER_FILES = (
    TOKENIZER_JSON,
    TOKENIZER_CONFIG,
    GENERATION_CONFIG,
    CHAT_TEMPLATE_JINJA,
    CHAT_TEMPLATE_JSON,
)
"""The files of a model folder a :class:`Tokenizer` is built from (only ``tokenizer.json`` is required)."""
DIGEST_HEX_CHARS = 32
"""Length of a tokenizer digest (:func:`pack_tokenizer_files`): blake2b, 16 bytes, in hex."""


def read_tokenizer_files(model_dir: str | Path) -> dict[str, str]:
    """The texts of a folder's :data:`TOKENIZER_FILES` that exist, by file name."""
    folder = Path(model_dir)
    if not (folder / TOKENIZER_JSON).is_file():
        raise ConfigError(f"model folder {folder} has no tokenizer.json")
    files = {}
    for name in TOKENIZER_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            files[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{name} in {folder} is not valid UTF-8: {e}") from None
    return files


def pack_tokenizer_files(files: Mapping[str, str]) -> tuple[bytes, str]:
    """One blob holding ``files`` (JSON ``{file name: text}``, keys sorted) and its content digest
    (:data:`DIGEST_HEX_CHARS` hex characters): equal files give an equal blob and digest anywhere."""
    blob = orjson.dumps(dict(files), option=orjson.OPT_SORT_KEYS)
    return blob, tokenizer_digest(blob)


def tokenizer_digest(blob: bytes) -> str:
    return hashlib.blake2b(blob, digest_size=DIGEST_HEX_CHARS // 2).hexdigest()


def unpack_tokenizer_files(blob: bytes) -> dict[str, str]:
    """The files :func:`pack_tokenizer_files` packed into ``blob`` (ConfigError when it is no such blob)."""
    try:
        files = orjson.loads(blob)
    except orjson.JSONDecodeError as e:
        raise ConfigError(f"the tokenizer blob is not valid JSON: {e}") from None
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise ConfigError("the tokenizer blob must map file names to their texts")
    return files


def _parse_json(text: str, name: str, source: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} in {source} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{name} in {source} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """Special tokens appear as plain strings or as AddedToken dicts ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _pick_chat_template(value: Any, source: str) -> str | None:
    """A string, or HF's list of ``{"name", "template"}`` from which the "default" one is used."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    raise ConfigError(f"{source}: field 'chat_template' must be a string or a list of named templates")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which changes the prompt; transformers overrides it too.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile with the environment transformers uses (trim_blocks, lstrip_blocks, loop controls)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Encode, decode and chat-format for one model folder. Build with :meth:`from_dir` (a folder) or
    :meth:`from_files` (its files' texts, e.g. as a worker published them)."""

    def __init__(
        self,
        raw: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        generation_defaults: dict[str, Any] | None = None,
    ) -> None:
        raw.no_truncation()  # a tokenizer.json may ship truncation/padding; a server must never apply them
        raw.no_padding()
        self.raw = raw
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.add_bos_token = add_bos_token
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.pad_token_id = raw.token_to_id(pad_token) if pad_token else None
        self.generation_defaults = dict(generation_defaults or {})
        self.vocab_size = raw.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = {i for i, t in raw.get_added_tokens_decoder().items() if t.special}
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        self._token_text: dict[int, str] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and generation_config.json (the last two optional)."""
        folder = Path(model_dir)
        return cls.from_files(read_tokenizer_files(folder), source=str(folder))

    @classmethod
    def from_files(cls, files: Mapping[str, str], source: str = "the tokenizer files") -> Tokenizer:
        """Build from the texts of a folder's :data:`TOKENIZER_FILES` by file name (``source`` names
        where they came from in errors): what :meth:`from_dir` does with the folder's files."""
        tok_text = files.get(TOKENIZER_JSON)
        if tok_text is None:
            raise ConfigError(f"no tokenizer.json in {source}")
        try:
            raw = tokenizers.Tokenizer.from_str(tok_text)
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise ConfigError(f"tokenizer.json in {source} could not be loaded: {e}") from None
        cfg_text, gen_text = files.get(TOKENIZER_CONFIG), files.get(GENERATION_CONFIG)
        cfg = _parse_json(cfg_text, TOKENIZER_CONFIG, source) if cfg_text is not None else {}
        gen = _parse_json(gen_text, GENERATION_CONFIG, source) if gen_text is not None else {}
        cfg_where, gen_where = f"{source}/{TOKENIZER_CONFIG}", f"{source}/{GENERATION_CONFIG}"

        bos, eos = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
        template = _pick_chat_template(cfg.get("chat_template"), cfg_where)
        if template is None:
            template = _standalone_template(files, source)
        eos_ids = _id_list(gen.get("eos_token_id"), gen_where, "eos_token_id")
        if not eos_ids and eos and (eos_id := raw.token_to_id(eos)) is not None:
            eos_ids = [eos_id]
        bos_id = gen.get("bos_token_id")
        if bos_id is None and bos:
            bos_id = raw.token_to_id(bos)
        try:
            return cls(
                raw,
                chat_template=template,
                bos_token=bos,
                eos_token=eos,
                pad_token=_token_content(cfg.get("pad_token")),
                add_bos_token=bool(cfg.get("add_bos_token", False)),
                eos_token_ids=eos_ids,
                bos_token_id=bos_id,
                generation_defaults={k: gen[k] for k in GENERATION_DEFAULT_FIELDS if gen.get(k) is not None},
            )
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"chat_template of {source} does not compile: {e}") from None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; BOS is prepended only when tokenizer_config.json sets ``add_bos_token``.

        Encode rendered chat prompts with ``add_special_tokens=False``: templates insert BOS themselves.
        ``encode_batch`` of one text gives ``encode``'s ids but releases the GIL while it works, so a
        long prompt does not stop the worker's other threads (its heartbeat, the engine's steps).
        """
        ids = self.raw.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if not isinstance(ids, list):
            ids = list(ids)
        return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs display (cached); a lone partial UTF-8 byte shows as U+FFFD."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.raw.decode([token_id], skip_special_tokens=False)
        return text

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the prompt text; template errors (bad role, missing field) are the request's fault."""
        if self._template is None:
            raise ConfigError(
                "model has no chat_template in tokenizer_config.json (nor chat_template.jinja); "
                "use the completions API with a raw prompt instead"
            )
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "tools": None,  # transformers passes these as None, which templates test with `is none`
            "documents": None,
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}", param="messages") from None

    def prompt_ids(
        self,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt as token ids: given ids as they are, chat messages (and tools) rendered by the
        template. ``add_special_tokens`` None: yes for a prompt, no for a rendered chat (the
        template writes them). The engine's prompts and a router's prefix routing both use this."""
        if prompt_token_ids is not None:
            return list(prompt_token_ids)
        if messages is not None:
            text = self.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools or None
            )
            return self.encode(text, bool(add_special_tokens))
        return self.encode(prompt or "", add_special_tokens is not False)


def _id_list(value: Any, source: str, field: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{source}: field {field!r} must be an int or a list of ints, got {value!r}")
    return values


def _standalone_template(files: Mapping[str, str], source: str) -> str | None:
    """Newer transformers save the template beside the config as chat_template.jinja or .json."""
    jinja_text = files.get(CHAT_TEMPLATE_JINJA)
    if jinja_text is not None:
        return jinja_text
    json_text = files.get(CHAT_TEMPLATE_JSON)
    if json_text is not None:
        data = _parse_json(json_text, CHAT_TEMPLATE_JSON, source)
        return _pick_chat_template(data.get("chat_template"), f"{source}/{CHAT_TEMPLATE_JSON}")
    return None
