"""An FP8 MTP head split for tensor parallelism, without processes: each rank of 2 reads exactly its part of the
head's FP8 weights and their scales (block and per-channel; a dense head and an MoE head), so its FP8 bytes, its
scales and its dequantised weights equal its slice of the one-rank head's; a split that cuts a 128-block of the
head is refused naming the linear. Dims as in test_fp8_sharding.py (`ALIGNED`: halves are whole 128-blocks)."""

from __future__ import annotations

import pytest
import torch

from hybridcache.layers.linear import Fp8Linear
from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import ModelConfig, get_model_class
from hybridcache.models.fp8_folders import write_fp8_folder
from hybridcache.models.loader import checkpoint_shards
from hybridcache.models.mtp import load_mtp_head

from .folders import write_folder
from .test_fp8_sharding import ALIGNED


def targets(folder) -> list:
    """Meta targets (the head takes only their config and `tp`): one rank, then ranks 0 and 1 of 2."""
    config = ModelConfig.from_model_dir(folder)
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        return [cls(config, TensorParallel(rank, size)) for rank, size in ((0, 1), (0, 2), (1, 2))]


def comparable(module) -> dict[str, torch.Tensor]:
    """Parameters (FP8 bytes as uint8) and, under `<linear>.dequantized`, each FP8 linear's dequantised weight."""
    out = {name: p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p for name, p in module.named_parameters()}
    for name, linear in module.named_modules():
        if isinstance(linear, Fp8Linear):
            out[f"{name}.dequantized"] = linear.dequantized(torch.float32)
    return out


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])  # a dense head, an MoE head
@pytest.mark.parametrize("kind", ["block", "channel"])
def test_each_rank_loads_exactly_its_part_of_an_fp8_mtp_head(tmp_path, model_type, kind):
    dense = write_folder(tmp_path / "dense", model_type, **ALIGNED)
    folder = write_fp8_folder(dense, tmp_path / kind, kind)
    one, *ranks = targets(folder)
    whole_head = load_mtp_head(folder, one, dtype=torch.float32, device="cpu")
    whole = comparable(whole_head)
    fp8 = sorted(name for name, m in whole_head.named_modules() if isinstance(m, Fp8Linear))
    assert "fc" in fp8 and "layers.0.self_attn.o_proj" in fp8
    assert any(".experts." in name for name in fp8) == (model_type == "qwen3_next")
    split_scales = set()
    for target in ranks:
        head = load_mtp_head(folder, target, dtype=torch.float32, device="cpu")
        assert sorted(n for n, m in head.named_modules() if isinstance(m, Fp8Linear)) == fp8
        shards = checkpoint_shards(head, whole_head)
        for name, linear in head.named_modules():
            if isinstance(linear, Fp8Linear) and f"{name}.weight" in shards:
                shards[f"{name}.dequantized"] = shards[f"{name}.weight"]
        split_scales |= {name for name in shards if name.endswith(("weight_scale_inv", "weight_scale"))}
        for name, param in comparable(head).items():
            shard = shards.get(name)
            assert torch.equal(param, whole[name] if shard is None else shard.take(whole[name])), name
    assert "layers.0.self_attn.o_proj.weight_scale_inv" in split_scales if kind == "block" else split_scales


def test_a_split_that_cuts_a_block_of_the_head_is_refused(tmp_path):
    """Head dims 16 (the tiny default): each rank's q rows cut the head's 128-row blocks."""
    folder = write_fp8_folder(write_folder(tmp_path / "dense", "qwen3_5_text"), tmp_path / "block", "block")
    _, rank0, _ = targets(folder)
    with pytest.raises(ValueError, match=r"self_attn\.\w_proj in FP8 blocks of 128 .*split a block"):
        load_mtp_head(folder, rank0, dtype=torch.float32, device="cpu")


@pytest.mark.slow
def test_greedy_mtp_on_two_ranks_of_an_fp8_folder_equals_one_rank_without_it(tmp_path):
    """A 2-rank engine (gloo) with MTP k = 2 on an FP8 folder (block format; FP8 target and head, each rank its
    shard) against one rank without MTP: greedy tokens and finish reasons of 150+-token prompts, `n = 2`, a stop
    string and a resend (test_tp_speculative's `long_requests`), oracle drafts so that verify rows accept and roll
    back, `check_integrity` after every step."""
    from tests.engine.spec_helpers import oracle

    from .test_tp_speculative import make_engine, run

    dense = write_folder(tmp_path / "dense", "qwen3_5_text", **ALIGNED)
    folder = write_fp8_folder(dense, tmp_path / "block", "block")
    off = run(make_engine(folder, caching=False), workload=False)
    engine = make_engine(folder, k=2, tp=2)
    try:
        oracle(engine, {rid: tokens for rid, (tokens, _) in off.items()}, seed=4)
        assert run(engine, workload=False, check_every_step=True) == off
        stats = engine.drafter.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    finally:
        engine.close()
