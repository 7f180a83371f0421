"""How a model is split, without processes: the head split rules, the ranks' shards partition every split
weight, the loader reads exactly each rank's part (from safetensors files and from transformers' in-memory
stacked experts), and a step's message survives the trip to a worker."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridcache.cache.plan import CopyKind
from hybridcache.distributed.messages import Op, encode, receive
from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.forward_batch import DeviceCopyOp
from hybridcache.layers.parallel import HeadSplit, Shard, TensorParallel
from hybridcache.models import ModelConfig, get_model_class, load_model, load_weights
from hybridcache.models.random_weights import tiny_hf_config
from tests.models.helpers import make_pair

from .folders import MODEL_TYPES, write_config_folder, write_folder


def test_heads_split_and_groups_replicate_when_fewer_than_ranks():
    assert TensorParallel(1, 2).split_heads(8, 4, "q heads", "kv heads") == HeadSplit(4, 8, 2, 4, 2)
    assert TensorParallel(1, 2).split_heads(8, 1, "q heads", "kv heads") == HeadSplit(4, 8, 0, 1, 8)
    assert TensorParallel(3, 4).split_heads(8, 2, "q heads", "kv heads") == HeadSplit(6, 8, 1, 2, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide q heads"):
        TensorParallel(0, 3).split_heads(8, 2, "q heads", "kv heads")
    with pytest.raises(ValueError, match="one must divide the other"):
        TensorParallel(0, 4).split_heads(12, 6, "q heads", "kv heads")


def test_head_counts_that_do_not_split_name_their_config_fields():
    """A DeltaNet's key heads were called "value groups" (hunt 168)."""
    from hybridcache.layers.attention import GatedAttention
    from hybridcache.layers.gated_deltanet import GatedDeltaNet

    def deltanet(k_heads: int, v_heads: int) -> GatedDeltaNet:
        return GatedDeltaNet(64, num_k_heads=k_heads, num_v_heads=v_heads, k_head_dim=16, v_head_dim=16,
                             conv_kernel_size=4, eps=1e-6, tp=TensorParallel(0, 2))

    with pytest.raises(ValueError, match=r"and 3 DeltaNet key heads \(linear_num_key_heads\): one must divide"):
        deltanet(3, 6)
    with pytest.raises(ValueError, match=r"does not divide DeltaNet value heads \(linear_num_value_heads\) \(3\)"):
        deltanet(3, 3)
    with pytest.raises(ValueError, match=r"and 3 KV heads \(num_key_value_heads\): one must divide"):
        GatedAttention(64, num_heads=6, num_kv_heads=3, head_dim=16, bias=False, eps=1e-6, tp=TensorParallel(0, 2))


def test_an_mlp_width_that_does_not_split_names_its_config_field():
    """The dense, expert and shared-expert widths each name their config.json field (all three said "the MLP
    intermediate size")."""
    from hybridcache.layers.mlp import MLP, SparseMoeBlock

    with pytest.raises(ValueError, match=r"does not divide the MLP width \(config.json's intermediate_size\) \(129\)"):
        MLP(8, 129, TensorParallel(0, 2))
    for moe, shared, field in ((33, 48, "moe_intermediate_size"), (32, 47, "shared_expert_intermediate_size")):
        with pytest.raises(ValueError, match=f"config.json's {field}"):
            SparseMoeBlock(8, num_experts=2, top_k=1, moe_intermediate_size=moe,
                           shared_expert_intermediate_size=shared, norm_topk_prob=True, tp=TensorParallel(0, 2))


def test_a_vocabulary_that_does_not_divide_is_padded_on_the_last_ranks():
    assert TensorParallel(0, 2).split_padded(321) == Shard(0, ((0, 161),), padding=0)
    assert TensorParallel(1, 2).split_padded(321) == Shard(0, ((161, 321),), padding=1)
    assert [TensorParallel(r, 4).split_padded(5) for r in range(4)] == [
        Shard(0, ((0, 2),)), Shard(0, ((2, 4),)), Shard(0, ((4, 5),), padding=1), Shard(0, ((5, 5),), padding=2)]
    assert TensorParallel(1, 2).split_padded(320) == Shard(0, ((160, 320),))
    full = torch.arange(12.0).view(6, 2)
    taken = Shard(0, ((4, 6),), padding=1).take(full)
    assert torch.equal(taken, torch.tensor([[8.0, 9.0], [10.0, 11.0], [0.0, 0.0]]))


@pytest.mark.parametrize("vocab_size", [None, 321], ids=["even-vocab", "odd-vocab"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_ranks_shards_partition_every_split_weight(model_type, vocab_size):
    extra = {} if vocab_size is None else {"vocab_size": vocab_size}
    config = ModelConfig.from_dict(tiny_hf_config(model_type, **extra).to_dict())
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        full = dict(cls(config).named_parameters())
        ranks = [cls(config, TensorParallel(rank, 2)) for rank in range(2)]
    shards = [model.shards() for model in ranks]
    assert shards[0].keys() == shards[1].keys() and "lm_head.weight" in shards[0]
    assert any(".experts.3.down_proj" in name for name in shards[0]) == (config.mlp.num_experts > 0)
    for name in shards[0]:
        covered = sorted(r for shard in (shards[0][name], shards[1][name]) for r in shard.ranges)
        dim = shards[0][name].dim
        assert covered[0][0] == 0 and covered[-1][1] == full[name].shape[dim], name
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), (name, covered)  # no gap, no overlap
        for model, shard in zip(ranks, (shards[0][name], shards[1][name])):
            assert dict(model.named_parameters())[name].shape[dim] == shard.length, name


@pytest.mark.parametrize(("model_type", "extra"), [
    ("qwen3_next", {}), ("qwen3_5_moe_text", {}),  # packed and separate projections
    ("qwen3_5_text", {"vocab_size": 321, "tie_word_embeddings": True}),  # padded lm_head rows, from the embedding
])
def test_each_rank_loads_exactly_its_part(model_type, extra, tmp_path):
    pair = make_pair(model_type, **extra)  # transformers' in-memory state dict holds the experts stacked
    config = pair.ours.config
    folder = write_folder(tmp_path, model_type, **extra)
    whole = load_model(folder)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        from_files = load_model(folder, tp=tp)
        from_memory = get_model_class(config.architecture)(config, tp)
        load_weights(from_memory, pair.hf.state_dict())
        for loaded, source in ((from_files, whole), (from_memory, pair.ours)):
            shards, full = loaded.shards(), checkpoint_order(source)
            assert shards
            for name, param in loaded.named_parameters():
                shard = shards.get(name)
                assert torch.equal(param, full[name] if shard is None else shard.take(full[name])), name


@pytest.mark.parametrize(("model_type", "extra"), [
    ("qwen3_next", {}), ("qwen3_5_moe_text", {}),
    ("qwen3_5_text", {"vocab_size": 321, "tie_word_embeddings": True}),
])
def test_each_rank_draws_exactly_its_part_of_the_one_rank_dummy_model(model_type, extra, tmp_path):
    """`load_format="dummy"` with tensor parallelism: each rank holds exactly its shard of the one-rank dummy model
    (the same seed), read through its checkpoint row order, padding rows zero; no weights on disk."""
    folder = write_config_folder(tmp_path, model_type, **extra)
    full = checkpoint_order(load_model(folder, load_format="dummy"))
    for rank in range(2):
        loaded = load_model(folder, tp=TensorParallel(rank, 2), load_format="dummy")
        shards = loaded.shards()
        assert shards
        for name, param in loaded.named_parameters():
            shard = shards.get(name)
            assert torch.equal(param, full[name] if shard is None else shard.take(full[name])), name


def checkpoint_order(model) -> dict[str, torch.Tensor]:
    """Every parameter of an unsharded model (a tied lm_head too) with its rows in its checkpoint tensor's order: a
    layer may keep a parameter's rows reordered, and its `shards()` then says which checkpoint rows it read, in
    order (Qwen3-Next's packed DeltaNet projections, ungrouped)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = dict(params)
    for name, shard in model.shards().items():
        param, restored, offset = params[name], torch.full_like(params[name], float("nan")), 0
        for start, stop in shard.ranges:
            restored.narrow(shard.dim, start, stop - start).copy_(param.narrow(shard.dim, offset, stop - start))
            offset += stop - start
        assert offset == param.shape[shard.dim] and not restored.isnan().any(), name  # a permutation of every row
        out[name] = restored
    return out


def test_a_step_travels_to_a_worker_unchanged():
    import multiprocessing

    chunks = [SeqChunk(token_ids=[5, 6, 7], start=0, block_ids=[3], slot=1),
              SeqChunk(token_ids=[9], start=70, block_ids=[0, 2], slot=0)]
    copies = (DeviceCopyOp(CopyKind.STATE_SAVE, torch.tensor([1]), torch.tensor([4])),)
    batch = build_forward_batch(chunks, block_size=64, kernel_block_size=32)
    batch = dataclasses.replace(batch, copies=copies, embed_rows=torch.tensor([1]),
                                embeds=torch.randn(1, 8).to(torch.bfloat16))
    sender, receiver = multiprocessing.Pipe()
    sender.send_bytes(encode(Op.EXECUTE, batch))
    op, got = receive(receiver)
    assert op is Op.EXECUTE
    for field in dataclasses.fields(batch):
        want, have = getattr(batch, field.name), getattr(got, field.name)
        if isinstance(want, torch.Tensor):
            assert want.dtype == have.dtype and torch.equal(want, have), field.name
        elif field.name == "copies":
            assert have[0].kind is CopyKind.STATE_SAVE
            assert torch.equal(have[0].src_ids, want[0].src_ids) and torch.equal(have[0].dst_ids, want[0].dst_ids)
        else:
            assert want == have, field.name
