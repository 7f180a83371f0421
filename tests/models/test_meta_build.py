"""A model and a vision tower built on the meta device, as the loader builds them, draw no initial weights: their
embeddings drew `normal_` there, whose first call on a meta tensor imports torch._dynamo (~1.3 s of each server's
and tensor-parallel worker's start-up; hybridcache/layers/embedding.py). Built on the CPU, an embedding is
initialised as torch initialises `nn.Embedding`."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.layers.embedding import embedding
from hybridcache.models import ModelConfig, get_model_class
from hybridcache.models.builtin import builtin_model_dir, ensure_builtin_model
from hybridcache.models.vision import VisionTower
from hybridcache.models.vision_config import VisionConfig
from hybridcache.models.vl_folders import tiny_vl_hf_config


def test_a_meta_build_draws_no_normal_weights(monkeypatch):
    ensure_builtin_model()
    config = ModelConfig.from_model_dir(builtin_model_dir())
    vision = VisionConfig.from_dict(tiny_vl_hf_config().to_dict())
    draws = []
    monkeypatch.setattr(nn.init, "normal_", lambda tensor, *args, **kwargs: draws.append(tuple(tensor.shape)))
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
        tower = VisionTower(vision)
    assert draws == []
    tables = ((model.model.embed_tokens, config.vocab_size), (tower.pos_embed, vision.num_position_embeddings))
    for table, rows in tables:
        assert table.weight.is_meta and table.weight.shape[0] == rows
    with torch.device("cpu"):
        embedding(7, 3)
    assert draws == [(7, 3)]  # off the meta device, nn.Embedding's own initialisation


def test_an_embedding_on_the_cpu_is_torchs():
    torch.manual_seed(5)
    ours = embedding(11, 4)
    torch.manual_seed(5)
    theirs = nn.Embedding(11, 4)
    assert torch.equal(ours.weight, theirs.weight) and ours.weight.requires_grad
