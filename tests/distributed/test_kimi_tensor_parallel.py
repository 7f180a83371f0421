"""Kimi Linear under tensor parallelism (`models/kimi_linear.py`): its KDA and MLA layers split by head, its MLPs and
experts by their intermediate dim. The ranks' shards partition every split weight; each rank loads exactly its part
(the KDA conv's q / k / v row blocks too), also of the dummy model; and on the CPU (gloo, 2 ranks) two ranks give
one rank's greedy tokens and logits (1e-4 relative), and the cache-equivalence workload an uncached single rank's;
the same on 2 GPUs where a machine has them."""

from __future__ import annotations

import gc
import importlib.util
import random

import pytest
import torch

from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import ModelConfig, get_model_class, load_model, load_weights
from tests.engine.hybrid_family_checks import write_tiny_folder
from tests.engine.test_cache_equivalence import CUDA_FP32, assert_same, make_engine, run_workload
from tests.models.kimi_helpers import checkpoint_state_dict, kimi_config, kimi_model

from .test_sharding import checkpoint_order
from .test_tensor_parallel import assert_two_ranks_match_one

# Both tiny variants with head counts 2 divides: "moe-groups" (2 KDA heads, 4 MLA heads, a full-rank query, one
# shared expert), "qlora-dense2" with 2 KDA heads of 8 (a low-rank query, two dense layers, two shared experts)
VARIANTS = {
    "moe-groups": {},
    "qlora-dense2": {"linear_attn_config": {"kda_layers": [2, 3], "full_attn_layers": [1, 4], "num_heads": 2,
                                            "head_dim": 8, "short_conv_kernel_size": 3}},
}


def model_pair(variant: str, **extra):
    return kimi_model(variant, 0, vocab_size=320, eos_token_id=258, **VARIANTS[variant], **extra)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_ranks_shards_partition_every_split_weight(variant):
    config = ModelConfig.from_dict(kimi_config(variant, **VARIANTS[variant]).to_dict())
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        full = dict(cls(config).named_parameters())
        ranks = [cls(config, TensorParallel(rank, 2)) for rank in range(2)]
    shards = [model.shards() for model in ranks]
    assert shards[0].keys() == shards[1].keys()
    for kind in ("conv1d.weight", "A_log", "kv_b_proj.weight", "experts.3.w2.weight", "shared_experts.up_proj"):
        assert any(kind in name for name in shards[0]), kind
    for name in shards[0]:
        dim = shards[0][name].dim
        covered = sorted(r for shard in (shards[0][name], shards[1][name]) for r in shard.ranges)
        assert covered[0][0] == 0 and covered[-1][1] == full[name].shape[dim], name
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), (name, covered)  # no gap, no overlap
        for model, shard in zip(ranks, (shards[0][name], shards[1][name])):
            assert dict(model.named_parameters())[name].shape[dim] == shard.length, name
    replicated = (".kv_a_proj_with_mqa.weight", ".kv_a_layernorm.weight", ".f_a_proj.weight", ".g_a_proj.weight",
                  ".o_norm.weight", ".gate.weight", ".gate.e_score_correction_bias")
    assert not [name for name in shards[0] if name.endswith(replicated)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_rank_loads_exactly_its_part(variant, tmp_path):
    """From the folder transformers saves and from the released checkpoints' names (the conv as q_conv1d /
    k_conv1d / v_conv1d row blocks, read whole and cut to the rank's rows)."""
    hf = model_pair(variant)
    folder = write_tiny_folder(hf, tmp_path)
    whole = checkpoint_order(load_model(folder))
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        from_files = load_model(folder, tp=tp)
        from_memory = get_model_class(from_files.config.architecture)(from_files.config, tp)
        load_weights(from_memory, checkpoint_state_dict(hf))
        for loaded in (from_files, from_memory):
            shards = loaded.shards()
            for name, param in loaded.named_parameters():
                shard = shards.get(name)
                assert torch.equal(param, whole[name] if shard is None else shard.take(whole[name])), name


def test_each_rank_draws_exactly_its_part_of_the_one_rank_dummy_model(tmp_path):
    """`load_format="dummy"`: each rank holds its shard of the one-rank dummy model of the same seed."""
    kimi_config("qlora-dense2", vocab_size=320, **VARIANTS["qlora-dense2"]).to_json_file(str(tmp_path / "config.json"))
    full = checkpoint_order(load_model(tmp_path, load_format="dummy"))
    for rank in range(2):
        loaded = load_model(tmp_path, tp=TensorParallel(rank, 2), load_format="dummy")
        shards = loaded.shards()
        assert "model.layers.1.self_attn.A_log" in shards
        for name, param in loaded.named_parameters():
            shard = shards.get(name)
            assert torch.equal(param, full[name] if shard is None else shard.take(full[name])), name


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def kimi_dir(request, tmp_path_factory):
    return write_tiny_folder(model_pair(request.param), tmp_path_factory.mktemp(request.param))


def test_two_ranks_match_one_rank(kimi_dir):
    prompt = [random.Random(7).randrange(256) for _ in range(170)]
    assert_two_ranks_match_one(kimi_dir, "kimi", prompt, max_tokens=10)


def test_cache_workload_on_two_ranks_matches_an_uncached_single_rank(kimi_dir):
    engine = make_engine(kimi_dir, tensor_parallel_size=2)
    try:
        uncached = make_engine(kimi_dir, caching=False)
        out_uncached = run_workload(uncached)
        out_cached = run_workload(engine, check_every_step=True)
        assert_same(engine, uncached, out_cached, out_uncached)
        assert sum(o.num_cached_tokens for o in out_cached.values()) > 0
    finally:
        engine.runner.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("fla") is None,
                    reason="needs 2 CUDA devices and the cuda extra")
def test_cuda_two_ranks_match_one_and_the_cache_workload_an_uncached_gpu(kimi_dir):
    """The same on 2 GPUs (NCCL; the CUDA kernels, fp32): one GPU's greedy tokens and logits, and the cache
    workload's tokens and logits of an uncached single GPU."""
    options = {**CUDA_FP32, "gpu_memory_utilization": 0.25}  # (at most three engines hold GPU 0 at once)
    prompt = [random.Random(7).randrange(256) for _ in range(170)]
    single = assert_two_ranks_match_one(kimi_dir, "kimi-cuda", prompt, max_tokens=10, **options)
    del single
    gc.collect()
    engine = make_engine(kimi_dir, tensor_parallel_size=2, **options)
    try:
        uncached = make_engine(kimi_dir, caching=False, **options)
        assert_same(engine, uncached, run_workload(engine, check_every_step=True), run_workload(uncached))
    finally:
        engine.runner.shutdown()
