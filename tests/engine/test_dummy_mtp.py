"""`load_format="dummy"` with MTP speculative decoding on one rank (CPU, fp32): a folder holding only config.json
and the tokenizer serves MTP (vLLM's drafter takes the engine's load config: the head's layer count is
config.json's, its weights drawn as the target's dummy weights are), and the greedy tokens equal those of MTP off
with the same dummy target, with the head's own drafts and with partly right oracle drafts (verify rows accept
0..k drafts and roll back). The dummy head is exactly the head `write_random_mtp(seed=0)` writes, FP8 linears where
the dummy target has them; a config.json that declares no MTP layers is a ValueError saying so (it was "no
*.safetensors files"). Two ranks: tests/distributed/test_tp_dummy_mtp.py."""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.backend import fp8_quantize
from hybridcache.layers.linear import Fp8Linear
from hybridcache.models import ModelConfig, get_model_class
from hybridcache.models.loader import load_model
from hybridcache.models.mtp import MTP_LAYER_KEYS, load_mtp_head, write_random_mtp
from tests.distributed.folders import write_config_folder

from .spec_helpers import make_engine, oracle, tokens_of
from .test_cache_equivalence import run_workload

# (model type, config.json key of its MTP layer count, layers): Qwen3-Next's MoE head, a dense Qwen3.5 head of 2
FOLDERS = [("qwen3_next", MTP_LAYER_KEYS[1], 1), ("qwen3_5_text", MTP_LAYER_KEYS[0], 2)]


def config_folder(tmp_path, model_type: str, key: str, num_layers: int):
    folder = write_config_folder(tmp_path, model_type, **{key: num_layers})
    assert sorted(path.name for path in folder.iterdir()) == ["config.json", "tokenizer.json"]
    return folder


@pytest.mark.parametrize(("model_type", "key", "num_layers"), FOLDERS, ids=[f[0] for f in FOLDERS])
def test_dummy_mtp_serves_the_greedy_tokens_of_mtp_off(model_type, key, num_layers, tmp_path):
    folder = config_folder(tmp_path, model_type, key, num_layers)
    off = tokens_of(run_workload(make_engine(folder, None, load_format="dummy", enable_prefix_caching=False)))
    engine = make_engine(folder, 2, load_format="dummy")
    assert len(engine.runner.mtp_head.layers) == num_layers
    assert tokens_of(run_workload(engine, check_every_step=True)) == off  # the dummy head's own drafts
    assert engine.drafter.stats.num_draft_tokens > 0
    engine = make_engine(folder, 2, load_format="dummy")
    oracle(engine, off, seed=5)
    assert tokens_of(run_workload(engine, check_every_step=True)) == off
    stats = engine.drafter.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # accepted and rolled back


def target_of(folder, **load):
    return load_model(folder, load_format="dummy", **load)


@pytest.mark.parametrize(("model_type", "key", "num_layers"), FOLDERS, ids=[f[0] for f in FOLDERS])
def test_the_dummy_head_is_the_head_write_random_mtp_writes(model_type, key, num_layers, tmp_path):
    folder = config_folder(tmp_path / "dummy", model_type, key, num_layers)
    target = target_of(folder)
    head = load_mtp_head(folder, target, dtype=torch.float32, device="cpu", load_format="dummy")
    written = write_random_mtp(config_folder(tmp_path / "written", model_type, key, num_layers), seed=0,
                               num_layers=num_layers)
    want = load_mtp_head(written, target, dtype=torch.float32, device="cpu").state_dict()
    got = head.state_dict()
    assert got.keys() == want.keys() and len(head.layers) == num_layers
    for name, value in got.items():
        assert torch.equal(value, want[name]), name


def test_a_dummy_fp8_target_gets_a_dummy_fp8_head(tmp_path):
    """quantization="fp8" on a dense folder: the head's linears FP8 (block format) as the dummy target's are, their
    weights the dense dummy head's quantised."""
    folder = config_folder(tmp_path, "qwen3_5_text", MTP_LAYER_KEYS[0], 1)
    target = target_of(folder, quantization="fp8")
    assert any(isinstance(m, Fp8Linear) for m in target.modules())
    head = load_mtp_head(folder, target, dtype=torch.float32, device="cpu", quantization="fp8", load_format="dummy")
    dense = load_mtp_head(folder, target_of(folder), dtype=torch.float32, device="cpu", load_format="dummy")
    fp8 = {name: m for name, m in head.named_modules() if isinstance(m, Fp8Linear)}
    assert "layers.0.self_attn.q_proj" in fp8 and "layers.0.mlp.down_proj" in fp8
    dense_params = dict(dense.named_parameters())
    for name, param in head.named_parameters():
        module, _, kind = name.rpartition(".")
        if module not in fp8:
            assert torch.equal(param, dense_params[name]), name
        elif kind == "weight":
            weight, scale = fp8_quantize(dense_params[name], fp8[module].fmt)
            assert param.dtype == torch.float8_e4m3fn and torch.equal(param.float(), weight.float()), name
            assert torch.equal(fp8[module].scale, scale), name


@pytest.mark.parametrize("declared", [None, 0])
def test_dummy_mtp_without_a_layer_count_in_config_json_is_refused(declared, tmp_path):
    folder = write_config_folder(tmp_path, "qwen3_5_text", **({} if declared is None else {MTP_LAYER_KEYS[0]: 0}))
    config = ModelConfig.from_model_dir(folder)
    with torch.device("meta"):
        target = get_model_class(config.architecture)(config)
    with pytest.raises(ValueError, match=r"config\.json declares (no|0) MTP layers.*load_format 'dummy'"):
        load_mtp_head(folder, target, dtype=torch.float32, device="cpu", load_format="dummy")
