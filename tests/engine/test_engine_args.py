"""Engine command-line options: defaults match EngineConfig (with auto dtype/device resolved on a CPU machine);
vLLM spellings and the old ones mean the same; the removed checkpoint-slot flags are refused; every flag's help
states its default; auto dtype/device rules."""

from __future__ import annotations

import argparse

import pytest

from hybridcache import engine_args
from hybridcache.cli import build_parser
from hybridcache.config import EngineConfig
from hybridcache.engine_args import (
    add_engine_args,
    auto_dtype,
    engine_options,
    model_argument,
    resolve_engine_config,
)
from hybridcache.models.builtin import ensure_builtin_model


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def parse(*argv: str) -> dict:
    return engine_options(parse_args(*argv))


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(engine_args, "auto_device", lambda: "cpu")


def test_defaults_are_the_engine_configs(no_gpu):
    assert resolve_engine_config(ensure_builtin_model(), parse()) == EngineConfig()


def test_auto_device_and_dtype(monkeypatch):
    folder = ensure_builtin_model()  # its config.json says float32
    monkeypatch.setattr(engine_args, "auto_device", lambda: "cuda")
    config = resolve_engine_config(folder, parse())
    assert (config.device, config.dtype) == ("cuda", "bfloat16")
    assert resolve_engine_config(folder, parse("--dtype", "float16")).dtype == "float16"
    assert resolve_engine_config(folder, parse("--device", "cpu")).dtype == "float32"
    assert [auto_dtype("cpu", "bfloat16"), auto_dtype("cuda:1", "float16"), auto_dtype("cuda", "bfloat16"),
            auto_dtype("cuda", "float32")] == ["float32", "float16", "bfloat16", "bfloat16"]


def test_prefix_caching_flags_vllm_spelling_and_alias():
    assert parse()["enable_prefix_caching"] is True
    assert parse("--enable-prefix-caching")["enable_prefix_caching"] is True
    assert parse("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert parse("--no-prefix-cache")["enable_prefix_caching"] is False


def test_eviction_value_is_spelled_with_a_hyphen_and_the_old_spelling_still_works():
    assert parse("--eviction", "flop-aware")["eviction"] == "flop-aware"
    assert parse("--eviction", "flop_aware")["eviction"] == "flop-aware"
    assert EngineConfig(eviction="flop_aware").eviction == "flop-aware"
    with pytest.raises(SystemExit):
        parse("--eviction", "random")


def test_model_is_positional_or_a_flag():
    assert model_argument(parse_args()) is None
    assert model_argument(parse_args("org/name")) == "org/name"
    assert model_argument(parse_args("--model", "org/name")) == "org/name"
    assert model_argument(parse_args("org/name", "--model", "org/name")) == "org/name"
    with pytest.raises(ValueError, match="given twice"):
        model_argument(parse_args("org/a", "--model", "org/b"))


@pytest.mark.parametrize("command", ["generate", "serve", "simulate", "bench", "router"])
def test_every_flag_help_states_its_default(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, action.option_strings
        assert action.required or "default" in formatter._get_help_string(action).lower(), action.option_strings


def test_block_size_without_a_power_of_two_gets_a_fitting_kernel_page():
    assert EngineConfig(block_size=48).kernel_block_size == 16
    assert EngineConfig(block_size=128).kernel_block_size == 64
    assert EngineConfig(block_size=16).kernel_block_size == 16
    with pytest.raises(ValueError, match="kernel_block_size"):  # the user sent it: it is named
        EngineConfig(block_size=48, kernel_block_size=32)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig(block_size=0)


def test_a_step_budget_below_one_token_per_sequence_is_refused():
    """As vLLM: a step that cannot hold one token of each running sequence starves decodes (they would wait
    for one another's tokens); the error names both flags' values."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be greater than or equal to "
                                         r"max_num_seqs \(16\)"):
        EngineConfig(max_num_batched_tokens=8, max_num_seqs=16)
    assert EngineConfig(max_num_batched_tokens=16, max_num_seqs=16).max_num_seqs == 16


def test_checkpoint_slot_flags_are_gone(capsys):
    """Checkpoint states live in blocks of the one pool (--num-blocks): a separate count would mean nothing, so the
    old flags are refused rather than silently ignored."""
    for flag in ("--num-checkpoint-slots", "--state-cache-budget"):
        with pytest.raises(SystemExit):
            parse(flag, "5")
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_gpu_memory_options(no_gpu):
    options = parse("--gpu-memory-utilization", "0.5", "--enforce-eager")
    assert (options["gpu_memory_utilization"], options["enforce_eager"]) == (0.5, True)
    config = resolve_engine_config(ensure_builtin_model(), options)
    assert (config.gpu_memory_utilization, config.enforce_eager) == (0.5, True)
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)


def test_host_tier_flags_take_vllm_and_sglang_spellings():
    import argparse

    from hybridcache.engine_args import add_engine_args, engine_options

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_options(parser.parse_args([]))["host_cache_gib"] == 0.0
    assert engine_options(parser.parse_args(["--host-cache-gib", "3"]))["host_cache_gib"] == 3.0
    assert engine_options(parser.parse_args(["--kv-offloading-size", "2"]))["host_cache_gib"] == 2.0  # vLLM: GiB
    sglang = engine_options(parser.parse_args(["--hicache-size", "1"]))["host_cache_gib"]  # SGLang: GB
    assert abs(sglang - 1e9 / (1 << 30)) < 1e-12


def test_disk_tier_flags_reach_the_engine_config():
    import argparse

    from hybridcache.engine_args import add_engine_args, engine_options

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert (engine_options(parser.parse_args([]))["disk_cache_dir"], engine_options(parser.parse_args([]))[
        "disk_cache_gib"]) == (None, 64.0)
    options = engine_options(parser.parse_args(["--disk-cache-dir", "/d", "--disk-cache-gib", "5"]))
    assert (options["disk_cache_dir"], options["disk_cache_gib"]) == ("/d", 5.0)


def test_host_cache_gib_must_be_a_finite_number_at_least_zero():
    import pytest

    from hybridcache.config import EngineConfig

    for bad in (-1.0, float("inf"), "2"):
        with pytest.raises(ValueError, match="host_cache_gib"):
            EngineConfig(host_cache_gib=bad)


def test_stream_interval_flag_and_its_refusals():
    """vLLM's `--stream-interval N` (default 1: every step) reaches the engine config; an interval below 1, or not
    an integer, is refused naming the option."""
    assert parse("--stream-interval", "8")["stream_interval"] == 8
    assert parse()["stream_interval"] == EngineConfig().stream_interval == 1
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(ValueError, match="stream_interval must be a positive integer"):
            EngineConfig(stream_interval=bad)
