"""Sampling defaults from the model folder's generation_config.json (vLLM's `--generation-config auto|vllm`):
read, validated, applied offline only where the caller gives no sampling params, and ignored with "vllm"."""

import json
import shutil

import pytest

from hybridcache import LLM, SamplingParams
from hybridcache.cli import main
from hybridcache.generation_config import GenerationConfigSource, SamplingDefaults
from hybridcache.models.builtin import ensure_builtin_model

SMALL = dict(block_size=16, kernel_block_size=8, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4)


@pytest.fixture
def folder(tmp_path):
    """A copy of the built-in model whose generation_config.json asks for greedy sampling and 5 new tokens."""
    shutil.copytree(ensure_builtin_model(), tmp_path / "model")
    path = tmp_path / "model"
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.0, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.05, max_new_tokens=5,
                  do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_the_file_gives_the_defaults_and_vllm_ignores_it(folder):
    defaults = SamplingDefaults.from_model_dir(folder)
    assert defaults == SamplingDefaults(temperature=0.0, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.05,
                                        max_tokens=5)
    assert SamplingDefaults.from_model_dir(folder, "vllm") == SamplingDefaults()
    assert SamplingDefaults.from_model_dir(folder, GenerationConfigSource.VLLM).as_dict() == {}
    (folder / "generation_config.json").unlink()
    assert SamplingDefaults.from_model_dir(folder) == SamplingDefaults()
    with pytest.raises(ValueError):
        SamplingDefaults.from_model_dir(folder, "hf")


def test_pick_prefers_the_request(folder):
    defaults = SamplingDefaults.from_model_dir(folder)
    assert defaults.pick("temperature", 0.7, 1.0) == 0.7
    assert defaults.pick("temperature", None, 1.0) == 0.0
    assert SamplingDefaults().pick("temperature", None, 1.0) == 1.0


@pytest.mark.parametrize("content, needle", [
    ('{"temperature": -1}', "temperature must be a finite number >= 0"),
    ('{"max_new_tokens": 0}', "max_tokens must be an integer >= 1"),
])
def test_a_bad_value_is_an_error_naming_it(folder, content, needle):
    (folder / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=needle) as error:
        SamplingDefaults.from_model_dir(folder)
    assert "generation_config.json" in str(error.value)
    assert SamplingDefaults.from_model_dir(folder, "vllm") == SamplingDefaults()


@pytest.mark.parametrize("content, needle", [
    ("{not json", "is not valid JSON"),
    ("[1]", "must hold a JSON object"),
    ('{"temperature": 0.6, "top_p": 0.95,}', "is not valid JSON"),
])
def test_an_unreadable_file_is_a_warning_and_no_defaults(folder, content, needle, caplog):
    """As vLLM's try_get_generation_config (an OSError falls back to the model config): the folder still serves,
    in auto and in vllm mode, with SamplingParams' defaults and config.json's EOS ids."""
    (folder / "generation_config.json").write_text(content)
    with caplog.at_level("WARNING"):
        assert SamplingDefaults.from_model_dir(folder) == SamplingDefaults()
    assert "generation_config.json" in caplog.text and needle in caplog.text
    for source in ("auto", "vllm"):
        llm = LLM(folder, generation_config=source, **SMALL)
        assert llm.get_default_sampling_params() == SamplingParams()
        assert llm.generate([5, 6, 7], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_offline_defaults_apply_only_without_sampling_params(folder):
    llm = LLM(folder, **SMALL)
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.05, max_tokens=5)
    prompt = [5, 6, 7, 8]
    default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    explicit = llm.generate(prompt, llm.get_default_sampling_params(), use_tqdm=False)[0].outputs[0]
    assert default.token_ids == explicit.token_ids and len(default.token_ids) <= 5
    own = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert len(own[0].outputs[0].token_ids) == 7  # the caller's params are used as given
    ignored = LLM(folder, generation_config="vllm", **SMALL)
    assert ignored.get_default_sampling_params() == SamplingParams()


def test_generate_command_takes_the_defaults(folder, capsys):
    assert main(["generate", str(folder), "--prompt", "hi", "--ignore-eos", "--block-size", "16",
                 "--max-model-len", "256"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["num_tokens"] == 5
    assert main(["generate", str(folder), "--prompt", "hi", "--ignore-eos", "--block-size", "16",
                 "--max-model-len", "256", "--generation-config", "vllm"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["num_tokens"] == 32
