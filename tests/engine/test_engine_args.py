"""Engine command-line options: defaults match EngineConfig; the deprecated --state-cache-budget alias
says so and never silently overrides --num-checkpoint-slots."""

from __future__ import annotations

import argparse

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine_args import add_engine_args, engine_options


def parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_options(parser.parse_args(argv))


def test_defaults_are_the_engine_configs():
    assert EngineConfig(**parse()) == EngineConfig()


def test_state_cache_budget_is_a_deprecated_alias(capsys):
    assert parse("--num-checkpoint-slots", "5")["num_checkpoint_slots"] == 5
    assert capsys.readouterr().err == ""
    assert parse("--state-cache-budget", "7")["num_checkpoint_slots"] == 7
    assert "deprecated" in capsys.readouterr().err
    assert parse("--state-cache-budget", "7", "--num-checkpoint-slots", "7")["num_checkpoint_slots"] == 7
    with pytest.raises(ValueError, match="disagree"):
        parse("--state-cache-budget", "7", "--num-checkpoint-slots", "8")


def test_gpu_memory_options():
    options = parse("--gpu-memory-utilization", "0.5", "--enforce-eager")
    assert (options["gpu_memory_utilization"], options["enforce_eager"]) == (0.5, True)
    config = EngineConfig(**options)
    assert (config.gpu_memory_utilization, config.enforce_eager) == (0.5, True)
    assert EngineConfig().num_checkpoint_slots is None  # 32 on the CPU, from the budget on CUDA
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
