"""Model resolution: a folder, a Hugging Face snapshot folder, or a hub id found in a (fake) local Hugging Face
cache laid out as huggingface_hub lays it out, offline, or downloaded into it (a fake hub: no test reaches the
network); LLM(model=...) and `hybridcache generate MODEL` use it."""

from __future__ import annotations

import json
import shutil
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

from hybridcache import LLM, SamplingParams
from hybridcache.cli import main
from hybridcache.model_path import HUB_FILES, resolve_model
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
    with pytest.raises(FileNotFoundError, match="holds no snapshot.*HF_HUB_OFFLINE is set.*hf download acme/other"):
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


class FakeHub:
    """`huggingface_hub.snapshot_download` against a hub that holds the built-in model as any repo id: a local
    lookup finds what an earlier download laid into the cache; a download lays it out (or raises `fail`)."""

    def __init__(self, fail: Exception | None = None, source: Path | None = None) -> None:
        self.downloads: list[tuple[str, list[str]]] = []
        self.fail = fail
        self.source = source  # the repository's files (default: the built-in model's)

    def __call__(self, repo_id, *, cache_dir=None, local_files_only=False, allow_patterns=None, **_):
        snapshot = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        if local_files_only:
            if not snapshot.is_dir():
                raise LocalEntryNotFoundError(f"{repo_id} is not cached")
            return str(snapshot)
        self.downloads.append((repo_id, list(allow_patterns)))
        if self.fail is not None:
            raise self.fail
        for file in (self.source or ensure_builtin_model()).iterdir():
            if any(fnmatch(file.name, pattern) for pattern in allow_patterns) and not (snapshot / file.name).is_file():
                snapshot.mkdir(parents=True, exist_ok=True)
                shutil.copy(file, snapshot / file.name)
        (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
        (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
        return str(snapshot)


@pytest.fixture
def online(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_a_hub_id_the_cache_lacks_is_downloaded_into_it_once(online, tmp_path, monkeypatch):
    hub = FakeHub()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    first = resolve_model("acme/new-model")
    assert first.path == tmp_path / "hub" / "models--acme--new-model" / "snapshots" / COMMIT
    assert first.name == "acme/new-model"
    assert hub.downloads == [("acme/new-model", list(HUB_FILES))]
    assert {"*.json", "*.safetensors"} <= set(HUB_FILES)  # config.json, the weights, tokenizer.json
    assert resolve_model("acme/new-model") == first  # cached now: no second download
    assert len(hub.downloads) == 1
    assert any(first.path.glob("*.safetensors")) and (first.path / "tokenizer.json").is_file()
    params = SamplingParams(temperature=0, max_tokens=3)
    assert LLM("acme/new-model").generate("abc", params, use_tqdm=False)[0].outputs[0].token_ids


ANSWER = SimpleNamespace(headers={}, request=None)  # what huggingface_hub's HTTP errors read of the hub's answer


@pytest.mark.parametrize(("fail", "said"), [
    (RepositoryNotFoundError("404 Client Error", response=ANSWER), "the hub has no model .*hf auth login"),
    (GatedRepoError("403 Client Error: gated", response=ANSWER), "the hub has no model .*hf auth login.*gated"),
    (LocalEntryNotFoundError("cannot reach huggingface.co"),
     "could not be downloaded: LocalEntryNotFoundError: cannot reach huggingface.co; .*hf download acme/gone"),
])
def test_a_failed_download_names_its_cause(online, monkeypatch, fail, said):
    hub = FakeHub(fail)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    with pytest.raises(FileNotFoundError, match=f"^model 'acme/gone' .*{said}"):
        resolve_model("acme/gone")
    assert len(hub.downloads) == 1


def test_without_weights_a_download_skips_them_until_an_engine_asks(online, monkeypatch):
    """The simulator and the router read a config and a tokenizer: an 80B model's weights are not fetched for them;
    an engine asking for the same id later completes the snapshot."""
    hub = FakeHub()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    light = resolve_model("acme/big", weights=False)
    assert (light.path / "config.json").is_file() and (light.path / "tokenizer.json").is_file()
    assert not any(light.path.glob("*.safetensors"))
    assert hub.downloads == [("acme/big", [p for p in HUB_FILES if p != "*.safetensors"])]
    assert resolve_model("acme/big", weights=False) == light and len(hub.downloads) == 1
    full = resolve_model("acme/big")
    assert full.path == light.path and any(full.path.glob("*.safetensors"))
    assert hub.downloads[1] == ("acme/big", list(HUB_FILES))
    assert resolve_model("acme/big") == full and len(hub.downloads) == 2


def sharded_repo(root: Path) -> Path:
    """The built-in model with its weights in two indexed shards (what the hub holds)."""
    from safetensors.torch import load_file, save_file

    repo = shutil.copytree(ensure_builtin_model(), root)
    tensors = load_file(str(repo / "model.safetensors"))
    (repo / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({name: tensors[name] for name in part}, str(repo / file))
    weight_map = {name: file for file, part in shards.items() for name in part}
    (repo / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return repo


def interrupted_snapshot(root: Path, repo: Path, lost: tuple[str, ...]) -> Path:
    """A cache snapshot of `repo` as an interrupted download leaves it: every file but those `lost` matches."""
    snapshot = root / "models--acme--sharded" / "snapshots" / COMMIT
    shutil.copytree(repo, snapshot, ignore=lambda folder, names: [n for n in names
                                                                  if any(fnmatch(n, pattern) for pattern in lost)])
    (root / "models--acme--sharded" / "refs").mkdir()
    (root / "models--acme--sharded" / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_an_interrupted_download_is_completed_online(online, tmp_path, monkeypatch):
    """The cache holds shard 1 of 2 (the download stopped): it was taken as complete (some *.safetensors) and the
    engine failed on the missing shard; as vLLM's download_weights_from_hf (snapshot_download online) the hub now
    completes it, once."""
    repo = sharded_repo(tmp_path / "repo")
    snapshot = interrupted_snapshot(tmp_path / "hub", repo, ("model-00002-of-00002.safetensors",))
    hub = FakeHub(source=repo)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    resolved = resolve_model("acme/sharded")
    assert resolved.path == snapshot and (snapshot / "model-00002-of-00002.safetensors").is_file()
    assert hub.downloads == [("acme/sharded", list(HUB_FILES))]
    assert resolve_model("acme/sharded") == resolved and len(hub.downloads) == 1  # complete now
    params = SamplingParams(temperature=0, max_tokens=3)
    assert LLM("acme/sharded").generate("abc", params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(("lost", "said"), [
    (("model-00002-of-00002.safetensors",), "1 weight file.s. missing: model-00002-of-00002.safetensors"),
    (("model-00002-of-00002.safetensors", "model.safetensors.index.json"),  # the index not there either: the
     "1 weight file.s. missing: model-00002-of-00002.safetensors"),  # -of-00002 names tell
    (("*.safetensors",), "no \\*.safetensors"),
    (("config.json",), "no config.json"),
], ids=["a-shard-the-index-names", "a-shard-of-a-series", "no-weights", "no-config"])
def test_offline_an_incomplete_snapshot_says_how_to_complete_it(tmp_path, monkeypatch, lost, said):
    repo = sharded_repo(tmp_path / "repo")
    interrupted_snapshot(tmp_path / "hub", repo, lost)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=f"incomplete snapshot of 'acme/sharded' .*{said}.*HF_HUB_OFFLINE.*"
                                                f"run `hf download acme/sharded --cache-dir {tmp_path / 'hub'}`"):
        resolve_model("acme/sharded")


@pytest.mark.parametrize("offline", [True, False], ids=["offline", "online"])
def test_a_snapshot_without_a_tokenizer_file_is_a_warning(tmp_path, monkeypatch, caplog, offline):
    """A tokenizer may come from `tokenizer=`: a snapshot without one resolves, with a warning, and the hub is not
    asked (online, a hub that accepts connections and never answers held every start; before the completion of
    interrupted downloads no start asked it)."""
    repo = sharded_repo(tmp_path / "repo")
    lost = tuple(f.name for f in repo.iterdir() if f.name.startswith(("tokenizer", "vocab")))
    snapshot = interrupted_snapshot(tmp_path / "hub", repo, lost)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub = FakeHub(source=repo)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    with caplog.at_level("WARNING", logger="hybridcache.model_path"):
        assert resolve_model("acme/sharded").path == snapshot
    assert "has no tokenizer file" in caplog.text
    assert hub.downloads == []
