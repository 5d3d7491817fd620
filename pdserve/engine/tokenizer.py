"""A model folder's tokenizer: ``tokenizers`` for text <-> ids, Jinja for chat templates.

The chat template is rendered exactly as Hugging Face transformers renders it (same sandbox, options,
``raise_exception`` and non-escaping ``tojson``), so prompts match what the model was trained on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from pdserve.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)

GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path.name} in {path.parent} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name} in {path.parent} must hold a JSON object")
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
    """Encode, decode and chat-format for one model folder. Build with :meth:`from_dir`."""

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
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise ConfigError(f"model folder {folder} has no tokenizer.json")
        try:
            raw = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise ConfigError(f"tokenizer.json in {folder} could not be loaded: {e}") from None
        cfg_path = folder / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        gen_path = folder / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else {}

        bos, eos = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
        template = _pick_chat_template(cfg.get("chat_template"), str(cfg_path))
        if template is None:
            template = _read_standalone_template(folder)
        eos_ids = _id_list(gen.get("eos_token_id"), str(gen_path), "eos_token_id")
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
            raise ConfigError(f"chat_template of {folder} does not compile: {e}") from None

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
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
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


def _id_list(value: Any, source: str, field: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{source}: field {field!r} must be an int or a list of ints, got {value!r}")
    return values


def _read_standalone_template(folder: Path) -> str | None:
    """Newer transformers save the template beside the config as chat_template.jinja or .json."""
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    json_path = folder / "chat_template.json"
    if json_path.is_file():
        return _pick_chat_template(_read_json(json_path).get("chat_template"), str(json_path))
    return None
