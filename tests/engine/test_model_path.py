"""Model resolution: a folder, a Hugging Face snapshot folder, or a hub id found in a (fake) local Hugging Face
cache laid out as huggingface_hub lays it out, offline; LLM(model=...) and `hybridcache generate MODEL` use it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybridcache import LLM, SamplingParams
from hybridcache.cli import main
from hybridcache.model_path import resolve_model
from hybridcache.models.builtin import BUILTIN_NAME, ensure_builtin_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path, repo_id: str = "acme/tiny-hybrid") -> Path:
    """`root` laid out like a Hugging Face hub cache holding the built-in model as `repo_id` at `main`;
    returns the snapshot folder."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(ensure_builtin_model(), snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    snapshot = fake_hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_none_is_the_builtin_model():
    resolved = resolve_model(None)
    assert (resolved.path, resolved.name) == (ensure_builtin_model(), BUILTIN_NAME)


def test_a_folder_is_used_as_is_and_named_as_given(hub):
    assert resolve_model(str(hub)).path == hub  # a snapshot folder is a folder
    assert resolve_model(str(hub)).name == str(hub)


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub):
    resolved = resolve_model("acme/tiny-hybrid")
    assert resolved.path == hub
    assert resolved.name == "acme/tiny-hybrid"  # not the snapshot hash


def test_hf_home_names_the_cache_when_hf_hub_cache_is_unset(tmp_path, monkeypatch):
    snapshot = fake_hub_cache(tmp_path / "home" / "hub")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model("acme/tiny-hybrid").path == snapshot


def test_unknown_models_say_what_was_tried(hub, tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no snapshot.*hf download acme/other"):
        resolve_model("acme/other")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("./relative/missing/folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="neither a folder nor a Hugging Face hub id"):
        resolve_model("not a repo!")


def test_llm_and_generate_take_a_hub_id(hub, capsys):
    params = SamplingParams(temperature=0, max_tokens=3)
    by_id = LLM("acme/tiny-hybrid").generate("abc", params, use_tqdm=False)
    builtin = LLM().generate("abc", params, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == builtin[0].outputs[0].token_ids
    assert LLM(model="acme/tiny-hybrid").model_name == "acme/tiny-hybrid"
    assert main(["generate", "acme/tiny-hybrid", "--prompt", "abc", "--max-tokens", "3"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["num_tokens"] == 3 or record["finish_reason"] == "stop"


def test_generate_reports_a_missing_model_as_an_error(hub, capsys):
    assert main(["generate", "acme/missing", "--prompt", "abc"]) == 2
    assert "acme/missing" in capsys.readouterr().err
