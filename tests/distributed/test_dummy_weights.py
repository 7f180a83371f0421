"""`load_format="dummy"` under tensor parallelism on the CPU (gloo, 2 ranks): a folder with no weights, each rank
drawing its shard of the one-rank dummy model, gives one rank's greedy tokens and logits (within 1e-4, relative).
The rank-by-rank tensor equality is `test_sharding.py`'s (default suite); this runs the model end to end
(slow: a spawned worker)."""

from __future__ import annotations

import random

import pytest

from .folders import write_config_folder
from .test_tensor_parallel import assert_two_ranks_match_one


@pytest.mark.slow  # a spawned worker: ~20-25 s on 2 busy cores
def test_two_ranks_of_dummy_weights_match_one_rank(tmp_path):
    # packed DeltaNet projections (regrouped rows), MoE and a dense layer; an odd vocabulary tied to the embedding
    folder = write_config_folder(tmp_path, "qwen3_next", vocab_size=321, tie_word_embeddings=True)
    assert not list(folder.glob("*.safetensors"))
    prompt = [random.Random(3).randrange(256) for _ in range(160)]
    assert_two_ranks_match_one(folder, "dummy", prompt, load_format="dummy")
