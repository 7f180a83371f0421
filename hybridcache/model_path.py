"""What a `model` argument names: a model folder on disk, resolved once for `LLM`, `generate` and `serve`.

`resolve_model(model)` accepts, in this order:

1. None: the built-in model (written to its cache folder on first use);
2. an existing folder: a model folder, or a Hugging Face snapshot folder (`.../snapshots/<hash>/`), used as is;
3. a Hugging Face hub id (`org/name`): the snapshot that the local Hugging Face cache holds for its `main`
   revision, found through `huggingface_hub` with `local_files_only=True` (nothing is downloaded, so it works
   offline and with `HF_HUB_OFFLINE=1`). The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
   `~/.cache/huggingface/hub`, read when `resolve_model` is called.

Worked example: with `HF_HUB_CACHE=/data/hub` holding
`/data/hub/models--Qwen--Qwen3.5-0.8B/refs/main` = `abc123` and `.../snapshots/abc123/config.json`,
`resolve_model("Qwen/Qwen3.5-0.8B")` is `ResolvedModel(path=/data/hub/models--Qwen--Qwen3.5-0.8B/snapshots/abc123,
name="Qwen/Qwen3.5-0.8B")`: the name is the argument as given (what a server reports by default), not the hash.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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


def resolve_model(model: str | Path | None) -> ResolvedModel:
    """The model folder `model` names (see the module docstring). Raises FileNotFoundError, naming what was
    tried, when it is neither a folder nor a hub id held by the local Hugging Face cache."""
    if model is None:
        from hybridcache.models.builtin import BUILTIN_NAME, ensure_builtin_model

        return ResolvedModel(ensure_builtin_model(), BUILTIN_NAME)
    name = str(model)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {name!r} has no config.json")
        return ResolvedModel(path, name)
    if path.exists():
        raise FileNotFoundError(f"model {name!r} is a file; pass the folder that holds config.json")
    if not _looks_like_hub_id(name):
        raise FileNotFoundError(f"model folder {name!r} does not exist")
    return ResolvedModel(_cached_snapshot(name), name)


def _looks_like_hub_id(name: str) -> bool:
    """`org/name` or `name`: no leading dot or slash, at most one slash, no backslash."""
    return bool(name) and not name.startswith((".", "/", "~")) and name.count("/") <= 1 and "\\" not in name


def _cached_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hf_hub_cache()
    where = str(cache) if cache is not None else "the default Hugging Face cache (~/.cache/huggingface/hub)"
    try:
        folder = snapshot_download(repo_id, local_files_only=True, cache_dir=cache)
    except HFValidationError as error:
        raise FileNotFoundError(f"model {repo_id!r} is neither a folder nor a Hugging Face hub id: {error}") from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r} is not a folder, and the Hugging Face cache at {where} holds no snapshot of it; "
            f"download it first (`hf download {repo_id}`) or pass the model folder"
        ) from None
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the cached snapshot of {repo_id!r} at {path} has no config.json")
    return path
