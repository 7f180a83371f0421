"""benchmarks/gpu_bench.py's model presets on the CPU (the presets themselves run on an H100 / H200, never here):
every preset builds its transformers config and model on the meta device with the parameter count its docstring
table states (`PRESETS`, within 10%), and hybridcache reads the config.json its folder would get; three families
run the script's smoke path (`--device cpu`, as `tiny` does) on a folder of the preset's fields shrunk."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_bench  # noqa: E402

from hybridcache.models import ModelConfig  # noqa: E402

PRESETS = [name for name in gpu_bench.MODELS if name != "tiny"]


def meta_model(name: str, fields: dict | None = None):
    """The preset's transformers config (as `build_model` makes it) and model on the meta device."""
    import transformers

    config_class, model_class, preset_fields = gpu_bench.MODELS[name]
    config = getattr(transformers, config_class)(**(preset_fields if fields is None else fields), eos_token_id=258,
                                                 dtype="bfloat16")
    config.architectures = [model_class]
    with torch.device("meta"):
        return config, getattr(transformers, model_class)(config)


def test_every_preset_but_tiny_names_its_released_model_and_size():
    assert sorted(gpu_bench.PRESETS) == sorted(PRESETS)
    for name in PRESETS:  # each preset's row in the module docstring, with its parameter count
        row = next((line for line in gpu_bench.__doc__.splitlines() if f"`{name}`" in line), "")
        assert f"{gpu_bench.PRESETS[name][1]}B" in row, name


@pytest.mark.parametrize("name", PRESETS)
def test_preset_builds_on_meta_at_its_stated_size_and_hybridcache_reads_its_config(name):
    config, model = meta_model(name)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    stated = gpu_bench.PRESETS[name][1]
    assert abs(params - stated) <= 0.1 * stated, (name, params, stated)
    model_class = gpu_bench.MODELS[name][1]
    ours = ModelConfig.from_dict({**config.to_dict(), "architectures": [model_class]})
    assert ours.vocab_size == config.vocab_size and ours.num_hidden_layers == config.num_hidden_layers


# Three families shrunk (their preset's fields, then these): Mamba2 + MoE with a shared expert, Mamba2 + relu^2 MoE
# by pattern, short conv + MoE after dense layers
SHRUNK = {
    "granite-4h-tiny": dict(
        vocab_size=320, hidden_size=64, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, shared_intermediate_size=32, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_chunk_size=32),
    "nemotron3-nano": dict(
        vocab_size=320, hidden_size=64, num_hidden_layers=5, hybrid_override_pattern="ME*ME", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
        chunk_size=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48),
    "lfm2-8b-a1b": dict(
        vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
        layer_types=["conv", "full_attention", "conv", "conv"]),
}


ROUTER_BIASES = {"granite-4h-tiny": 0, "nemotron3-nano": 2, "lfm2-8b-a1b": 3}  # (the MoE layers of each, shrunk)


@pytest.mark.parametrize("name", list(SHRUNK))
def test_shrunk_preset_runs_the_smoke_path(name, tmp_path, monkeypatch):
    config_class, model_class, fields = gpu_bench.MODELS[name]
    monkeypatch.setitem(gpu_bench.MODELS, name, (config_class, model_class, {**fields, **SHRUNK[name]}))
    folder = gpu_bench.build_model(name, tmp_path / "model")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == [model_class] and not (folder / "mtp.safetensors").exists()
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:  # the routers' biases: 0, not unset memory
        keys = [key for key in weights.keys() if key.endswith(("correction_bias", "expert_bias"))]  # noqa: SIM118
        biases = [weights.get_tensor(key) for key in keys]
    assert len(biases) == ROUTER_BIASES[name] and all(not b.any() for b in biases)
    out = tmp_path / "out"
    monkeypatch.setitem(gpu_bench.SCALE, "value", 1.0)  # (main sets it from --scale)
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--model", name, "--device", "cpu", "--phases", "B,C",
                                      "--scale", "0.02", "--model-dir", str(folder), "--out", str(out)])
    gpu_bench.main()  # in this process: the script's imports cost seconds a subprocess
    result = json.loads((out / f"gpu_bench_{name}.json").read_text())
    assert not result.get("errors"), result.get("errors")
    assert result["phases"]["B"]["requests"] == 3 and result["phases"]["B"]["cached_per_request"][1] > 0
    assert result["phases"]["C"]["cached_per_request"][1] > 0  # the + 200 request hit the cold prompt's prefix
