"""`load_format="dummy"` with MTP speculative decoding under tensor parallelism (CPU, gloo, 2 ranks, fp32), on a
folder holding only config.json and the tokenizer.

Without processes: each rank's dummy head is exactly its shard of the one-rank dummy head (every full tensor drawn
in `randomize_`'s order, the rank's part kept, as the target's dummy shards are), for Qwen3-Next's MoE head and a
dense Qwen3.5 head of 2 layers; a config.json that declares no MTP layers is refused before any worker starts (it was
"no *.safetensors files"). On two ranks (a spawned worker: ~8 s): MTP k = 2 gives the greedy tokens of one rank with
MTP and of one rank with MTP off, over the same dummy target. One rank alone: tests/engine/test_dummy_mtp.py."""

from __future__ import annotations

import multiprocessing
import random

import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import ModelConfig, get_model_class
from hybridcache.models.mtp import MTP_LAYER_KEYS, load_mtp_head
from hybridcache.sampling import SamplingParams
from tests.engine.spec_helpers import spec

from .folders import write_config_folder

# (model type, config.json key of its MTP layer count, layers): Qwen3-Next's MoE head, a dense Qwen3.5 head of 2
FOLDERS = [("qwen3_next", MTP_LAYER_KEYS[1], 1), ("qwen3_5_text", MTP_LAYER_KEYS[0], 2)]


def config_folder(tmp_path, model_type: str, key: str | None, num_layers: int = 1, **extra):
    folder = write_config_folder(tmp_path, model_type, **({} if key is None else {key: num_layers}), **extra)
    assert sorted(path.name for path in folder.iterdir()) == ["config.json", "tokenizer.json"]
    return folder


@pytest.mark.parametrize(("model_type", "key", "num_layers"), FOLDERS, ids=[f[0] for f in FOLDERS])
def test_each_rank_draws_exactly_its_part_of_the_one_rank_dummy_head(model_type, key, num_layers, tmp_path):
    folder = config_folder(tmp_path, model_type, key, num_layers)
    config = ModelConfig.from_model_dir(folder)
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        targets = [cls(config, TensorParallel(rank, size)) for rank, size in ((0, 1), (0, 2), (1, 2))]

    def head_of(target):
        return load_mtp_head(folder, target, dtype=torch.float32, device="cpu", load_format="dummy")

    whole = dict(head_of(targets[0]).named_parameters())
    split = set()
    for target in targets[1:]:
        head = head_of(target)
        assert len(head.layers) == num_layers
        shards = head.shards()
        split |= set(shards)
        for name, param in head.named_parameters():
            shard = shards.get(name)
            assert torch.equal(param, whole[name] if shard is None else shard.take(whole[name])), name
    assert "layers.0.self_attn.q_proj.weight" in split and "layers.0.self_attn.o_proj.weight" in split
    assert any(".experts." in name for name in split) == (model_type == "qwen3_next")


def make_engine(folder, k: int | None, tp: int = 1) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(
        block_size=16, kernel_block_size=8, max_num_batched_tokens=96, max_num_seqs=4, tensor_parallel_size=tp,
        load_format="dummy", speculative_config=spec(k) if k else None))


def test_dummy_mtp_without_a_layer_count_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    folder = config_folder(tmp_path, "qwen3_next", None)

    def no_process(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(multiprocessing, "get_context", no_process)
    with pytest.raises(ValueError, match=r"declares no MTP layers.*load_format 'dummy'"):
        make_engine(folder, 2, tp=2)


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out = {}
    while engine.has_unfinished_requests():
        out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [out[str(i)] for i in range(len(prompts))]


def test_two_ranks_of_dummy_mtp_give_one_ranks_greedy_tokens(tmp_path):
    # packed DeltaNet projections, MoE (the head's too) and a dense layer; an odd vocabulary (padded lm_head shards)
    folder = config_folder(tmp_path, "qwen3_next", MTP_LAYER_KEYS[1], vocab_size=321)
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 40, 150)]
    off = generate(make_engine(folder, None), prompts)
    assert generate(make_engine(folder, 2), prompts) == off
    engine = make_engine(folder, 2, tp=2)
    try:
        assert generate(engine, prompts) == off
        assert engine.drafter.stats.num_draft_tokens > 0
    finally:
        engine.runner.shutdown()
