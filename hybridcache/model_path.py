"""What a `model` argument names: a model folder on disk, resolved once for `LLM`, `generate` and `serve`.

`resolve_model(model)` accepts, in this order:

1. None: the built-in model (written to its cache folder on first use);
2. an existing folder: a model folder, or a Hugging Face snapshot folder (`.../snapshots/<hash>/`), used as is;
3. a Hugging Face hub id (`org/name`): the snapshot that the local Hugging Face cache holds for its `main`
   revision, found through `huggingface_hub` with `local_files_only=True`; when the cache has none it is
   downloaded into the cache, as vLLM does (the files a model folder is read from, `HUB_FILES`, with
   huggingface_hub's progress bars), unless `HF_HUB_OFFLINE` is set. `weights=False` (the simulator, the router:
   a config and a tokenizer) downloads all but the `*.safetensors`; a snapshot without them is completed when an
   engine asks for it, as is one an interrupted download left incomplete (`_missing_files`: a shard the index or a
   `-0000i-of-0000n` series names, config.json, a tokenizer file), as vLLM's `download_weights_from_hf` calls
   `snapshot_download` online; offline an incomplete snapshot is an error saying to run `hf download`. The cache
   is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, read when `resolve_model` is
   called; `download_dir` (vLLM's `--download-dir`) replaces it. `revision` (vLLM's `--revision`: a branch, tag
   or commit) is looked up and downloaded instead of `main`.

Worked example: with `HF_HUB_CACHE=/data/hub` holding
`/data/hub/models--Qwen--Qwen3.5-0.8B/refs/main` = `abc123` and `.../snapshots/abc123/config.json`,
`resolve_model("Qwen/Qwen3.5-0.8B")` is `ResolvedModel(path=/data/hub/models--Qwen--Qwen3.5-0.8B/snapshots/abc123,
name="Qwen/Qwen3.5-0.8B")`: the name is the argument as given (what a server reports by default), not the hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_logger = logging.getLogger(__name__)

# what a download fetches: the configs, weights, tokenizer and chat template a model folder is read from (not the
# original PyTorch `.bin` or GGUF copies some repositories also hold)
HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")


@dataclass(frozen=True)
class ResolvedModel:
    """A model folder (`path`, holding config.json) and the name it was asked for by (`name`)."""

    path: Path
    name: str


def hf_hub_cache() -> Path | None:
    """The Hugging Face hub cache folder the environment names now, or None for huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return None


def resolve_model(model: str | Path | None, *, weights: bool = True, revision: str | None = None,
                  download_dir: str | Path | None = None, hf_overrides: dict | None = None) -> ResolvedModel:
    """The model folder `model` names (see the module docstring), seen through `hf_overrides` when given
    (`with_hf_overrides`)."""
    resolved = _resolve(model, weights=weights, revision=revision, download_dir=download_dir)
    if hf_overrides is None:
        return resolved
    return ResolvedModel(with_hf_overrides(resolved.path, hf_overrides), resolved.name)


def with_hf_overrides(folder: Path, overrides: Any) -> Path:
    """`folder` with its config.json's items replaced by `overrides` (vLLM's `--hf-overrides`, a JSON object;
    a nested object is merged into the config's: `{"text_config": {"rope_parameters": ...}}` replaces one item of
    `text_config`): a folder of the same name under `$HYBRIDCACHE_HOME/overrides/<hash>/` (hash of the folder's path
    and the overrides) holding the merged config.json and a link to every other file of `folder`, so everything that
    reads the model folder (the config, the weights, the tokenizer, the disk tier's model key) sees one model. Safe
    for processes that build the same overlay at once (data-parallel replicas): a link made meanwhile is taken as it
    is, and config.json is replaced whole.

        {"max_position_embeddings": 1010000}  ->  .../overrides/3f2a.../Qwen3.5-0.8B/config.json with that item"""
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object of config.json items, got {type(overrides).__name__}")
    from hybridcache.models.builtin import cache_home

    config = json.loads((folder / "config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{folder / 'config.json'} is not a JSON object")
    merged = _merged(config, overrides)
    digest = hashlib.sha256(json.dumps([str(folder.resolve()), overrides], sort_keys=True).encode()).hexdigest()
    overlay = cache_home() / "overrides" / digest[:16] / folder.name
    overlay.mkdir(parents=True, exist_ok=True)
    for entry in folder.iterdir():
        link = overlay / entry.name
        if entry.name != "config.json" and not link.is_symlink():
            with contextlib.suppress(FileExistsError):  # another process (a replica) made the same link meanwhile
                link.symlink_to(entry.resolve())
    # written whole, then renamed into place: a process that reads the overlay meanwhile sees one config or the other
    partial = overlay / f".config.json.{os.getpid()}"
    partial.write_text(json.dumps(merged, indent=2))
    os.replace(partial, overlay / "config.json")
    _logger.info("model %s: config.json items overridden (--hf-overrides): %s; the folder used is %s", folder,
                 ", ".join(sorted(overrides)), overlay)
    return overlay


def _merged(config: dict, overrides: dict) -> dict:
    out = dict(config)
    for key, value in overrides.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _resolve(model: str | Path | None, *, weights: bool, revision: str | None,
             download_dir: str | Path | None) -> ResolvedModel:
    """The model folder `model` names (see the module docstring; `weights`: whether the caller reads the weights,
    which a hub id then downloads; `revision`, `download_dir`: the hub revision and cache folder of a hub id).
    Raises FileNotFoundError, naming what was tried, when it is neither a folder nor a hub id the local Hugging Face
    cache holds or the hub gives."""
    if model is None and (revision, download_dir) != (None, None):
        raise ValueError("--revision and --download-dir choose a hub model's files: name a hub id as the model")
    if model is None:
        from hybridcache.models.builtin import BUILTIN_NAME, ensure_builtin_model

        return ResolvedModel(ensure_builtin_model(), BUILTIN_NAME)
    name = str(model)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {name!r} has no config.json")
        if (revision, download_dir) != (None, None):
            _logger.warning("model %s is a folder: --revision and --download-dir (hub options) are ignored", name)
        return ResolvedModel(path, name)
    if path.exists():
        raise FileNotFoundError(f"model {name!r} is a file; pass the folder that holds config.json")
    if not _looks_like_hub_id(name):
        raise FileNotFoundError(f"model folder {name!r} does not exist")
    cache = Path(download_dir).expanduser() if download_dir is not None else hf_hub_cache()
    return ResolvedModel(_hub_snapshot(name, weights, revision, cache), name)


def _looks_like_hub_id(name: str) -> bool:
    """`org/name` or `name`: no leading dot or slash, at most one slash, no backslash."""
    return bool(name) and not name.startswith((".", "/", "~")) and name.count("/") <= 1 and "\\" not in name


def _hub_offline() -> bool:
    """`HF_HUB_OFFLINE` as huggingface_hub reads it, read now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _hub_snapshot(repo_id: str, weights: bool, revision: str | None, cache: Path | None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (None: main) in the Hugging Face cache `cache` (None: the
    default), downloaded into it first when the cache has none, or none with weights when `weights` (unless
    offline). Raises FileNotFoundError naming the cache, the hub's answer and what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    where = str(cache) if cache is not None else "the default Hugging Face cache (~/.cache/huggingface/hub)"
    if revision is not None:
        where += f" (revision {revision!r})"
    try:
        folder = snapshot_download(repo_id, local_files_only=True, cache_dir=cache, revision=revision)
    except HFValidationError as error:
        raise FileNotFoundError(f"model {repo_id!r} is neither a folder nor a Hugging Face hub id: {error}") from None
    except LocalEntryNotFoundError:
        if _hub_offline():
            raise FileNotFoundError(
                f"model {repo_id!r} is not a folder, and the Hugging Face cache at {where} holds no snapshot of it "
                f"(HF_HUB_OFFLINE is set, so it is not downloaded); download it first (`hf download {repo_id}`) "
                "or pass the model folder"
            ) from None
        folder = _download(repo_id, cache, where, weights, revision)
    else:
        missing = _missing_files(Path(folder), weights)
        # (a tokenizer may come from `tokenizer=`: a snapshot without one is used as it is, with a warning, online
        # too: asking the hub would make every start wait on it)
        needed = [m for m in missing if not m.startswith(_NO_TOKENIZER)]
        if needed and not _hub_offline():  # an interrupted download, or one without weights (by weights=False):
            _logger.warning("the cached snapshot of %s at %s is incomplete (%s)", repo_id, folder, "; ".join(missing))
            folder = _download(repo_id, cache, where, weights, revision)  # fetches what it lacks, as vLLM's
        elif needed:  # download_weights_from_hf
            command = " ".join(["hf download", repo_id, *(["--revision", revision] if revision else []),
                                *(["--cache-dir", str(cache)] if cache is not None else [])])
            raise FileNotFoundError(
                f"incomplete snapshot of {repo_id!r} at {folder} ({'; '.join(missing)}; HF_HUB_OFFLINE is set, so "
                f"it is not completed): run `{command}` to complete it, or pass a complete model folder")
        elif missing:
            _logger.warning("the cached snapshot of %s at %s has %s", repo_id, folder, missing[0])
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the cached snapshot of {repo_id!r} at {path} has no config.json")
    return path


_NO_TOKENIZER = "no tokenizer file"
# files any of which makes a tokenizer (transformers' fast, sentencepiece, BPE vocabularies)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<index>\d+)-of-(?P<count>\d+)\.safetensors$")


def _missing_files(folder: Path, weights: bool) -> list[str]:
    """What a hub snapshot folder lacks (an interrupted download keeps only the files it finished), one line each:
    config.json; a tokenizer file (`_TOKENIZER_FILES`); with `weights`, any *.safetensors, a shard the index names,
    or a shard of a `-0000i-of-0000n` series. [] when complete as far as these tell."""
    missing = [] if (folder / "config.json").is_file() else ["no config.json"]
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        missing.append(f"{_NO_TOKENIZER} ({', '.join(_TOKENIZER_FILES)})")
    if not weights:
        return missing
    present = {path.name for path in folder.glob("*.safetensors") if path.is_file()}
    if not present:
        return [*missing, "no *.safetensors"]
    wanted = set()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
            wanted = {os.path.normpath(f) for f in weight_map.values()} if isinstance(weight_map, dict) else set()
        except (ValueError, AttributeError, TypeError):  # the loader names a malformed index
            wanted = set()
    for name in present:
        shard = _SHARD.match(name)
        if shard:
            count, width = int(shard["count"]), len(shard["index"])
            wanted |= {f"{shard['stem']}-{i:0{width}d}-of-{shard['count']}.safetensors" for i in range(1, count + 1)}
    absent = sorted(name for name in wanted if not (folder / name).is_file())
    if absent:
        more = ", ..." if len(absent) > 3 else ""
        missing.append(f"{len(absent)} weight file(s) missing: {', '.join(absent[:3])}{more}")
    return missing


def _download(repo_id: str, cache: Path | None, where: str, weights: bool, revision: str | None) -> str:
    """Download `repo_id`'s `HUB_FILES` at `revision` (without `*.safetensors` unless `weights`) into the cache; its
    snapshot folder."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    _logger.warning("downloading %s from the Hugging Face hub into %s", repo_id, where)
    try:
        patterns = [p for p in HUB_FILES if weights or p != "*.safetensors"]
        return snapshot_download(repo_id, cache_dir=cache, allow_patterns=patterns, revision=revision)
    except RepositoryNotFoundError as error:  # also a gated or private repository without a token
        raise FileNotFoundError(
            f"model {repo_id!r} is not a folder, not in the Hugging Face cache at {where}, and the hub has no model "
            f"of that name that this machine may read (a private or gated model needs `hf auth login`): {error}"
        ) from None
    except OSError as error:  # no connection, an HTTP error, a full disk
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the Hugging Face cache at {where} and could not be downloaded: "
            f"{type(error).__name__}: {error}; download it with `hf download {repo_id}` or pass the model folder"
        ) from None
