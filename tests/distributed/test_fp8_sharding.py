"""FP8 weights split for tensor parallelism, without processes: each rank of 2 reads exactly its part of an FP8
folder's weights and scales (Qwen's 128 x 128 block format and compressed-tensors per-channel; Qwen3.5, Qwen3.5-MoE
and Qwen3-Next), so its dequantised weights are exactly its slice of the one-rank model's; likewise for
`load_format="dummy"` with an FP8 quantization_config and for `quantization="fp8"` (each rank quantises its own
shard); a split that cuts a 128-block is refused with an error naming the tensor and the sizes.

`ALIGNED` gives the tiny configs dims whose halves are whole 128-blocks (head dims 128, intermediate sizes 256), as
Qwen's FP8 checkpoints have at TP=2; the tiny defaults (head dims 16 and 32, expert width 32) split blocks.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridcache.fp8_format import CHANNEL
from hybridcache.layers.linear import Fp8Linear
from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import load_model
from hybridcache.models.fp8_folders import quantized_config, write_fp8_folder
from hybridcache.models.loader import checkpoint_shards, one_rank_twin

from .folders import MODEL_TYPES, write_config_folder, write_folder

ALIGNED = {"head_dim": 128, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "intermediate_size": 256,
           "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256}


@pytest.fixture(scope="module", params=MODEL_TYPES)
def dense_dir(request, tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp(f"dense-{request.param}"), request.param, **ALIGNED)


def checkpoint_order(model) -> dict[str, torch.Tensor]:
    """Every parameter of a one-rank model with its rows in its checkpoint tensor's order (an FP8 weight as its
    bytes, uint8), and under `<linear>.dequantized` each FP8 linear's dequantised weight in that order too."""
    shards = checkpoint_shards(model, model)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, linear in model.named_modules():
        if isinstance(linear, Fp8Linear):
            params[f"{name}.dequantized"] = linear.dequantized(torch.float32)
            shards[f"{name}.dequantized"] = shards.get(f"{name}.weight")
    out = {}
    for name, param in params.items():
        param = param.view(torch.uint8) if param.dtype == torch.float8_e4m3fn else param
        shard, out[name] = shards.get(name), param
        if shard is not None:
            restored, offset = torch.zeros_like(param), 0
            for start, stop in shard.ranges:
                restored.narrow(shard.dim, start, stop - start).copy_(param.narrow(shard.dim, offset, stop - start))
                offset += stop - start
            assert offset == param.shape[shard.dim], name
            out[name] = restored
    return out


def assert_rank_holds_its_slice(loaded, full: dict[str, torch.Tensor]) -> int:
    """Every parameter of the rank model `loaded` (FP8 bytes, scales, dense ones) and every FP8 linear's dequantised
    weight equals its shard of the one-rank model's `full` (`checkpoint_order`); returns how many FP8 scales are
    split (so a test can check that the split was exercised)."""
    shards = checkpoint_shards(loaded, one_rank_twin(loaded))
    held = dict(loaded.named_parameters())
    for name, linear in loaded.named_modules():
        if isinstance(linear, Fp8Linear):
            held[f"{name}.dequantized"] = linear.dequantized(torch.float32)
            if f"{name}.weight" in shards:
                shards[f"{name}.dequantized"] = shards[f"{name}.weight"]
    for name, param in held.items():
        param = param.view(torch.uint8) if param.dtype == torch.float8_e4m3fn else param
        shard = shards.get(name)
        assert torch.equal(param, full[name] if shard is None else shard.take(full[name])), name
    return sum(name.endswith(("weight_scale_inv", "weight_scale")) for name in shards)


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_each_rank_loads_exactly_its_part_of_the_fp8_weights(dense_dir, tmp_path, kind):
    folder = write_fp8_folder(dense_dir, tmp_path / kind, kind)
    whole = load_model(folder)
    full = checkpoint_order(whole)
    fp8 = [name for name, m in whole.named_modules() if isinstance(m, Fp8Linear)]
    assert any(".self_attn.o_proj" in n for n in fp8) and any(".linear_attn.in_proj" in n for n in fp8)
    assert any(".experts.1.down_proj" in n for n in fp8) == ("moe" in str(dense_dir) or "next" in str(dense_dir))
    for rank in range(2):
        loaded = load_model(folder, tp=TensorParallel(rank, 2))
        assert sorted(n for n, m in loaded.named_modules() if isinstance(m, Fp8Linear)) == sorted(fp8)
        split_scales = assert_rank_holds_its_slice(loaded, full)
        assert split_scales >= (len(fp8) if kind == "block" else len(fp8) // 2)  # channel: row shards only


def test_quantize_at_load_under_tp_is_the_one_rank_quantised_model_split(dense_dir):
    """`quantization="fp8"`: each rank quantises its dense shard; whole blocks, so they are the one rank's blocks."""
    full = checkpoint_order(load_model(dense_dir, quantization="fp8"))
    for rank in range(2):
        assert assert_rank_holds_its_slice(load_model(dense_dir, quantization="fp8", tp=TensorParallel(rank, 2)),
                                           full) > 0


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_each_rank_draws_its_part_of_the_one_rank_fp8_dummy_model(tmp_path, kind):
    """`load_format="dummy"` under tensor parallelism with an FP8 quantization_config in config.json (channel) or
    `quantization="fp8"` (block): each rank holds exactly its shard of the one-rank FP8 dummy model (Qwen3-Next:
    regrouped packed projections, experts, a dense layer; an odd vocabulary tied to the embedding)."""
    folder = write_config_folder(tmp_path, "qwen3_next", vocab_size=321, tie_word_embeddings=True, **ALIGNED)
    options = {"quantization": "fp8"} if kind == "block" else {}
    if kind == "channel":
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = quantized_config(CHANNEL, [])
        (folder / "config.json").write_text(json.dumps(config))
    whole = load_model(folder, load_format="dummy", **options)
    assert {m.fmt.kind for m in whole.modules() if isinstance(m, Fp8Linear)} == {kind}
    full = checkpoint_order(whole)
    for rank in range(2):
        loaded = load_model(folder, load_format="dummy", tp=TensorParallel(rank, 2), **options)
        assert assert_rank_holds_its_slice(loaded, full) > 0


def test_a_replicated_kv_head_of_less_than_a_block_is_read_whole(tmp_path):
    """One kv head of 64 rows for 2 ranks: both hold k_proj / v_proj whole (one partial block each), while the 4 q
    heads of 64 split on whole blocks (256 q_proj rows, 128 o_proj columns per rank)."""
    dense = write_folder(tmp_path / "dense", "qwen3_5_text", **{**ALIGNED, "head_dim": 64, "num_key_value_heads": 1})
    folder = write_fp8_folder(dense, tmp_path / "block", "block")
    full = checkpoint_order(load_model(folder))
    for rank in range(2):
        loaded = load_model(folder, tp=TensorParallel(rank, 2))
        assert loaded.model.layers[3].self_attn.k_proj.weight_scale_inv.shape == (1, 1)
        assert assert_rank_holds_its_slice(loaded, full) > 0


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_an_fp8_lm_head_splits_with_its_padding_rows(tmp_path, kind):
    """Qwen's checkpoints keep the lm_head dense; one stored in FP8 splits like any column-parallel weight: a
    vocabulary of 255 gives each rank 128 rows (one block), rank 1's last one zero padding."""
    from safetensors.torch import load_file, save_file

    from hybridcache.fp8_format import BLOCK
    from hybridcache.kernels.gemm.reference import quantize

    dense = write_folder(tmp_path / "dense", "qwen3_5_text", vocab_size=255, **ALIGNED)
    folder = write_fp8_folder(dense, tmp_path / kind, kind)
    fmt = BLOCK if kind == "block" else CHANNEL
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"], tensors[f"lm_head.{fmt.scale_name}"] = quantize(tensors["lm_head.weight"], fmt)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    whole = load_model(folder)
    assert isinstance(whole.lm_head, Fp8Linear)
    full = checkpoint_order(whole)
    for rank in range(2):
        loaded = load_model(folder, tp=TensorParallel(rank, 2))
        assert isinstance(loaded.lm_head, Fp8Linear) and loaded.lm_head.weight.shape == (128, 64)
        assert assert_rank_holds_its_slice(loaded, full) > 0
    rows = loaded.lm_head.dequantized(torch.float32)  # rank 1's: vocabulary rows 128-254, then the padding row
    assert rows[126].any() and not rows[127].any()


def test_a_split_block_is_refused_and_per_channel_scales_split_anywhere(tmp_path):
    """Expert width 128 at TP=2: each rank's 64 rows of an expert's gate_proj would hold half of a 128-row block (its
    scale row shared by both ranks): refused, naming the tensor and the sizes, before any weight memory is taken.
    The same model per channel, and the tiny default config (head dims 16, 32) per channel, split exactly."""
    dense = write_folder(tmp_path / "dense", "qwen3_next", **{**ALIGNED, "moe_intermediate_size": 128})
    block = write_fp8_folder(dense, tmp_path / "block", "block")
    message = (r"model\.layers\.0\.mlp\.experts\.0\.gate_proj in FP8 blocks of 128 rows: the rows this rank reads, "
               r"\[\(64, 128\)\] of 128 \(64 in all\), split a block.*multiples of 128")
    with pytest.raises(ValueError, match=message):
        load_model(block, tp=TensorParallel(1, 2))
    with pytest.raises(ValueError, match=message):
        load_model(block, tp=TensorParallel(1, 2), load_format="dummy")
    with pytest.raises(ValueError, match=r"linear_attn\.out_proj in FP8 blocks of 128 columns: the columns this rank "
                                         r"reads, \[\(0, 32\)\] of 64"):
        load_model(write_fp8_folder(write_folder(tmp_path / "small", "qwen3_5_text"), tmp_path / "small-block",
                                    "block"), tp=TensorParallel(0, 2))
    for dense_dir in (dense, tmp_path / "small"):
        channel = write_fp8_folder(dense_dir, tmp_path / f"{dense_dir.name}-channel", "channel")
        full = checkpoint_order(load_model(channel))
        for rank in range(2):
            assert assert_rank_holds_its_slice(load_model(channel, tp=TensorParallel(rank, 2)), full) > 0


def test_a_scale_shard_covers_the_blocks_of_its_weight_shard():
    """`quant.scale_shard` on hand-made shards of 128 x 128 blocks (and per channel)."""
    from hybridcache.fp8_format import BLOCK
    from hybridcache.layers.parallel import Shard, columns, rows
    from hybridcache.models.quant import scale_shard

    assert scale_shard(rows((128, 256)), BLOCK, (384, 64), "x") == rows((1, 2))
    assert scale_shard(columns((256, 512)), BLOCK, (64, 512), "x") == columns((2, 4))
    assert scale_shard(rows((0, 64)), BLOCK, (64, 64), "x") == rows((0, 1))  # held whole by every rank: one block
    assert scale_shard(rows((256, 300)), BLOCK, (300, 64), "x") == rows((2, 3))  # the weight's partial last block
    assert scale_shard(rows((512, 640), (0, 128)), BLOCK, (640, 64), "x") == rows((4, 5), (0, 1))  # regrouped rows
    # padding rows past the checkpoint's (a vocabulary split): whole padding blocks get zero scale rows
    assert scale_shard(Shard(0, ((256, 384),), padding=128), BLOCK, (384, 64), "x") == Shard(0, ((2, 3),), padding=1)
    assert scale_shard(Shard(0, ((256, 300),), padding=20), BLOCK, (300, 64), "x") == Shard(0, ((2, 3),), padding=0)
    assert scale_shard(rows((16, 48)), CHANNEL, (64, 64), "x") == rows((16, 48))  # per channel: the weight's rows
    assert scale_shard(columns((16, 48)), CHANNEL, (64, 64), "x") is None  # ... and whole for a column split
    for shard, full, what in ((rows((64, 128)), (128, 64), r"rows: the rows this rank reads, \[\(64, 128\)\] of 128"),
                              (columns((0, 192)), (64, 384), r"columns: the columns this rank reads, \[\(0, 192\)\]"),
                              (rows((0, 64), (128, 192)), (192, 64), r"rows: .*\[\(0, 64\), \(128, 192\)\] of 192")):
        with pytest.raises(ValueError, match=r"^lin in FP8 blocks of 128 " + what):
            scale_shard(shard, BLOCK, full, "lin")
