"""Engine options as vLLM users pass them (`LLM(...)` keywords and the engine flags of generate / serve): vLLM's
options without a field of their own are implemented, logged as no-ops or refused naming them (one table,
`engine_args.VLLM_OPTIONS`); a host tier without a prefix cache, a bool option given a string, an unknown device
and pools larger than the machine's memory are refused before anything is allocated."""

from __future__ import annotations

import argparse
import json
import logging
import shutil

import pytest
import torch

from hybridcache import LLM, SamplingParams
from hybridcache.cli import main
from hybridcache.config import EngineConfig
from hybridcache.engine import rank_runner
from hybridcache.engine.rank_runner import check_host_memory, engine_device
from hybridcache.engine_args import VLLM_OPTIONS, add_engine_args, engine_options, resolve_engine_config
from hybridcache.model_path import resolve_model
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.tokenizer import Tokenizer

from .test_model_path import fake_hub_cache


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def resolve(**options) -> EngineConfig:
    return resolve_engine_config(ensure_builtin_model(), {"device": "cpu", **options})


# ---- 1. a host tier without a prefix cache ----------------------------------------------------------------


@pytest.mark.parametrize("options, named", [
    (dict(cache_mode="none"), "--cache-mode none"),
    (dict(enable_prefix_caching=False), "--no-enable-prefix-caching"),
    (dict(cache_mode="none", disk_cache_dir="/nowhere"), "--cache-mode none"),
])
def test_a_host_tier_without_a_prefix_cache_is_refused(options, named):
    """`host_cache_gib=0.5, cache_mode="none"` allocated a 0.5 GiB host pool nothing used; with prefix caching off
    the flag did nothing; with a disk tier it failed late saying the disk tier 'needs a host tier'."""
    with pytest.raises(ValueError, match="host_cache_gib 0.5") as error:
        EngineConfig(host_cache_gib=0.5, **options)
    assert named in str(error.value) and "--host-cache-gib" in str(error.value)


def test_the_scheduler_and_the_tiers_read_one_prefix_caching_property():
    assert EngineConfig().prefix_caching
    assert not EngineConfig(cache_mode="none").prefix_caching
    assert not EngineConfig(enable_prefix_caching=False).prefix_caching


def test_cache_mode_none_with_tiers_fails_before_the_disk_folders_are_made(tmp_path, capsys):
    disk = tmp_path / "disk"
    assert main(["generate", "--cache-mode", "none", "--host-cache-gib", "0.01", "--disk-cache-dir", str(disk)]) == 2
    assert "--cache-mode none" in capsys.readouterr().err
    assert not disk.exists()


# ---- 2. bools -----------------------------------------------------------------------------------------------


def test_none_is_the_default_of_a_bool_option():
    """`enable_prefix_caching=None` turned caching off (vLLM: None is the default, on)."""
    config = EngineConfig(enable_prefix_caching=None, enforce_eager=None, async_scheduling=None)
    assert (config.enable_prefix_caching, config.enforce_eager, config.async_scheduling) == (True, False, None)


@pytest.mark.parametrize("name", ["enable_prefix_caching", "enforce_eager", "async_scheduling"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1])
def test_a_bool_option_refuses_what_is_not_a_bool(name, value):
    """`enable_prefix_caching="no"` left caching on (a non-empty string is true)."""
    with pytest.raises(ValueError, match=f"{name} must be True, False or None"):
        EngineConfig(**{name: value})


# ---- 3. the device ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["foo", "cuda:x", "mps", "cuda:-1", ""])
def test_an_unknown_device_is_a_value_error_naming_it_and_the_accepted_ones(device):
    """`device="foo"` raised torch's RuntimeError out of `engine_device`."""
    with pytest.raises(ValueError, match="cpu, cuda, cuda:N") as error:
        resolve(device=device)
    assert repr(device) in str(error.value)
    with pytest.raises(ValueError, match=repr(device)):
        engine_device(device)


def test_generate_refuses_an_unknown_device_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(rank_runner, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    assert main(["generate", "--device", "foo"]) == 2
    assert "'foo'" in capsys.readouterr().err


# ---- 4. vLLM's options ----------------------------------------------------------------------------------------


def test_every_vllm_option_is_a_flag_of_the_engine_commands():
    """The table gives generate and serve the flags vLLM command lines pass (they were 'unrecognized')."""
    args = parse("--seed", "0", "--enable-chunked-prefill", "--swap-space", "4", "--tokenizer", "x", "--revision",
                 "main", "--max-logprobs", "20", "--tokenizer-mode", "auto", "--download-dir", "/tmp",
                 "--trust-remote-code", "--disable-log-stats", "--cpu-offload-gb", "0", "--dtype", "half",
                 "--distributed-executor-backend", "mp")
    options = engine_options(args)
    assert (options["seed"], options["tokenizer"], options["dtype"]) == (0, "x", "half")
    assert (options["enable_chunked_prefill"], options["swap_space"], options["max_logprobs"]) == (True, 4.0, 20)
    assert "revision" not in options and "download_dir" not in options  # they choose the folder: model_options
    assert parse("--no-enable-chunked-prefill").enable_chunked_prefill is False
    assert {o.name for o in VLLM_OPTIONS} >= {"trust_remote_code", "swap_space", "disable_log_stats",
                                              "enable_chunked_prefill", "tokenizer_mode", "cpu_offload_gb",
                                              "max_logprobs", "revision", "download_dir",
                                              "distributed_executor_backend"}
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit, match="0"):
            main([command, "--help"])


def test_vllm_dtype_names_mean_what_vllm_says():
    assert resolve(dtype="half").dtype == "float16"
    assert resolve(dtype="float").dtype == "float32"
    assert resolve(dtype=torch.bfloat16).dtype == "bfloat16"
    assert engine_options(parse("--dtype", "float"))["dtype"] == "float"


@pytest.mark.parametrize("name, value, note", [
    ("swap_space", 4, "swap_space is ignored"),
    ("trust_remote_code", True, "trust_remote_code has no effect"),
    ("disable_log_stats", True, "disable_log_stats"),
    ("enable_chunked_prefill", True, "always chunked"),
    ("tokenizer_mode", "auto", None),
    ("cpu_offload_gb", 0, None),
    ("max_logprobs", 20, None),
    ("revision", "main", None),
    ("distributed_executor_backend", "mp", None),
    ("distributed_executor_backend", "uni", None),
])
def test_a_vllm_option_without_effect_here_is_accepted_and_logged(name, value, note, caplog):
    with caplog.at_level(logging.INFO, logger="hybridcache.engine_args"):
        assert resolve(**{name: value}) == resolve()
    if note is not None:  # a warning: `generate` shows no INFO lines, and the user gave an option that does nothing
        assert any(note in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), caplog.text


@pytest.mark.parametrize("name, value, message", [
    ("enable_chunked_prefill", False, "cannot be turned off"),
    ("cpu_offload_gb", 4, "offloading weights to the CPU is not supported"),
    ("max_logprobs", 5, "fixed at 20"),
    ("max_logprobs", -1, "fixed at 20"),
    ("tokenizer_mode", "slow", "tokenizer_mode 'slow' is not supported"),
    ("distributed_executor_backend", "ray", "distributed_executor_backend 'ray' is not supported"),
])
def test_a_vllm_option_that_cannot_be_done_is_refused_naming_it(name, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(**{name: value})


def test_an_unknown_keyword_names_llm_not_engine_config():
    """`LLM(foo=1)` said 'EngineConfig.__init__() got an unexpected keyword argument'."""
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'num_gpu_blocks_override'"):
        resolve(num_gpu_blocks_override=4)


def test_the_engine_seed_makes_unseeded_sampling_reproducible():
    """vLLM's engine seed (default 0): requests without a seed of their own sample the same tokens in every run
    that adds them in the same order; before, `seed=` was a TypeError and unseeded runs always differed."""
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    prompts = ["The quick brown fox", "Once upon a time"]

    def run(**options) -> list[list[int]]:
        with LLM(**options) as llm:
            first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert first != second  # later requests draw later seeds
        return first

    assert run(seed=5) == run(seed=5)
    assert run(seed=5) != run(seed=6)
    assert run() == run(seed=None) == run(seed=0)  # None is vLLM V1's default, 0


def test_a_separate_tokenizer_folder(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        resolve(tokenizer=str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_builtin_model() / name, folder / name)
    assert resolve(tokenizer=str(folder)).tokenizer == str(folder)


def test_a_separate_tokenizer_folder_without_tokenizer_json(tmp_path):
    """A folder of vocab.json + merges.txt and a tokenizer_config.json naming their class loads as a model folder's
    tokenizer (transformers converts it); as `tokenizer=` it was refused for want of tokenizer.json."""
    folder = tmp_path / "tok"
    folder.mkdir()
    built = json.loads((ensure_builtin_model() / "tokenizer.json").read_text())
    (folder / "vocab.json").write_text(json.dumps(built["model"]["vocab"]))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    assert resolve(tokenizer=str(folder)).tokenizer == str(folder)
    assert Tokenizer(folder).encode("hi") == Tokenizer(ensure_builtin_model()).encode("hi")


def test_revision_and_download_dir_choose_the_hub_snapshot(tmp_path, monkeypatch, capsys):
    """`--revision` and `--download-dir` (and LLM's `revision=`, `download_dir=`) were refused; they now pick the
    snapshot and the cache folder."""
    root = tmp_path / "elsewhere"
    main_snapshot = fake_hub_cache(root)
    repo = main_snapshot.parent.parent
    other = "fedcba9876543210fedcba9876543210fedcba98"
    shutil.copytree(main_snapshot, repo / "snapshots" / other)
    (repo / "refs" / "v1").write_text(other)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("acme/tiny-hybrid", download_dir=root).path == main_snapshot
    assert resolve_model("acme/tiny-hybrid", download_dir=root, revision="v1").path == repo / "snapshots" / other
    with pytest.raises(FileNotFoundError, match="revision 'v2'"):
        resolve_model("acme/tiny-hybrid", download_dir=root, revision="v2")
    assert main(["generate", "acme/tiny-hybrid", "--download-dir", str(root), "--revision", "v1", "--prompt", "a",
                 "--max-tokens", "1"]) == 0
    assert '"num_tokens": 1' in capsys.readouterr().out
    with LLM("acme/tiny-hybrid", download_dir=str(root), revision="v1") as llm:  # LLM's keywords, as vLLM's
        assert llm.engine.model_path == repo / "snapshots" / other
    with pytest.raises(FileNotFoundError, match="revision 'v2'"):
        LLM("acme/tiny-hybrid", download_dir=str(root), revision="v2")


# ---- 10. pools larger than the memory -------------------------------------------------------------------------


def test_cpu_pools_beyond_the_available_memory_are_refused_with_the_bytes():
    check_host_memory(1 << 29, 1 << 28, EngineConfig(), available=1 << 30)
    check_host_memory(1 << 40, 1 << 40, EngineConfig(), available=None)  # unknown: nothing refused
    with pytest.raises(ValueError, match=r"need 1,610,612,736 bytes but 1,073,741,824 bytes") as error:
        check_host_memory(1 << 30, 1 << 29, EngineConfig(), available=1 << 30)
    assert "--max-num-seqs" in str(error.value) and "host tier" in str(error.value)


@pytest.mark.parametrize("version", ["v1", "v2", "unlimited"])
def test_the_memory_available_is_bounded_by_the_containers_cgroup(tmp_path, version):
    """In a container MemAvailable is the machine's: a pool past the cgroup's limit passed the check and was killed
    by the OOM killer with no log line (hunt 196). The memory cgroup's limit less its usage bounds it now."""
    proc, fs = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 33554432 kB\nMemAvailable: 25165824 kB\n")  # 24 GiB
    if version == "v2":
        (proc / "self" / "cgroup").write_text("0::/kubepods/pod1/c1\n")
        (fs / "kubepods/pod1/c1").mkdir(parents=True)
        (fs / "kubepods/pod1/c1/memory.max").write_text(f"{3 << 30}\n")
        (fs / "kubepods/pod1/c1/memory.current").write_text(f"{1 << 30}\n")
    else:
        (proc / "self" / "cgroup").write_text("9:cpu,cpuacct:/c1\n5:memory:/c1\n1:name=systemd:/\n")
        (fs / "memory/c1").mkdir(parents=True)
        limit = (1 << 63) - 4096 if version == "unlimited" else 3 << 30
        (fs / "memory/c1/memory.limit_in_bytes").write_text(f"{limit}\n")
        (fs / "memory/c1/memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    wanted = 24 << 30 if version == "unlimited" else 2 << 30
    assert rank_runner.available_host_bytes(str(proc), str(fs)) == wanted
    (proc / "meminfo").unlink()  # MemAvailable unreadable: the cgroup's alone
    assert rank_runner.available_host_bytes(str(proc), str(fs)) == (None if version == "unlimited" else 2 << 30)


def test_generate_with_a_million_sequences_on_the_cpu_is_refused_not_a_hang(capsys):
    """`--max-num-seqs 1000000` on the CPU sized a pool of 16 TB and hung allocating it."""
    assert main(["generate", "--device", "cpu", "--max-num-seqs", "1000000", "--max-num-batched-tokens", "1000000",
                 "--max-tokens", "1"]) == 2
    assert "bytes of memory are available" in capsys.readouterr().err
