"""FP8 folders served on two CPU ranks (gloo) compute what one rank computes from the same folder: 8 greedy
tokens after a 170-token prompt equal, and every sampled row's logits within 1e-4 (relative), for Qwen's 128 x 128
block format and compressed-tensors per-channel, on tiny Qwen3-Next, Qwen3.5 and Qwen3.5-MoE models whose halves
are whole blocks (`test_fp8_sharding.ALIGNED`). A folder whose split would cut a block fails to start with the
loader's error naming the tensor before any worker process starts.

Each case starts a 2-rank engine (a spawned worker: seconds); Qwen3-Next in the block format (packed DeltaNet
projections, MoE with per-expert FP8 weights, a dense layer, attention biases) runs in the default suite, the
other cases are slow, as is the same comparison for `load_format="dummy"` with `quantization="fp8"`.
"""

from __future__ import annotations

import multiprocessing
import random

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.models.fp8_folders import write_fp8_folder

from .folders import write_config_folder, write_folder
from .test_fp8_sharding import ALIGNED
from .test_tensor_parallel import assert_two_ranks_match_one

SLOW = pytest.mark.slow
CASES = ["qwen3_next-block", pytest.param("qwen3_next-channel", marks=SLOW),
         pytest.param("qwen3_5_text-block", marks=SLOW), pytest.param("qwen3_5_text-channel", marks=SLOW),
         pytest.param("qwen3_5_moe_text-block", marks=SLOW), pytest.param("qwen3_5_moe_text-channel", marks=SLOW)]


@pytest.fixture(scope="module", params=CASES)
def fp8_dir(request, tmp_path_factory):
    model_type, _, kind = request.param.partition("-")
    bias = {"attention_bias": model_type == "qwen3_next"}  # an FP8 o_proj with a bias: added once, after the reduce
    dense = write_folder(tmp_path_factory.mktemp(f"dense-{model_type}"), model_type, **ALIGNED, **bias)
    return write_fp8_folder(dense, tmp_path_factory.mktemp(request.param), kind)


def test_two_ranks_match_one_rank_on_an_fp8_folder(fp8_dir):
    single = assert_two_ranks_match_one(fp8_dir, "fp8", [random.Random(13).randrange(256) for _ in range(170)])
    assert single.weight_format.startswith("fp8-")


@SLOW  # two engines, one of them 2-rank
def test_two_ranks_of_fp8_dummy_weights_match_one_rank(tmp_path):
    """`load_format="dummy"` with `quantization="fp8"` (what `tp_bench.py --load-format dummy --quantization fp8`
    serves): no weights on disk, every rank keeps its part of the one-rank model's quantised draws."""
    folder = write_config_folder(tmp_path, "qwen3_next", **ALIGNED)
    prompt = [random.Random(3).randrange(256) for _ in range(160)]
    assert_two_ranks_match_one(folder, "dummy", prompt, load_format="dummy", quantization="fp8")


def test_a_split_block_fails_before_any_worker_starts(tmp_path, monkeypatch):
    """Expert width 128: each rank's 64 rows would cut the experts' 128-row blocks (`loader.check_split`, read from
    the headers on a meta model)."""
    dense = write_folder(tmp_path / "dense", "qwen3_next", **{**ALIGNED, "moe_intermediate_size": 128})
    block = write_fp8_folder(dense, tmp_path / "block", "block")

    def no_process(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(multiprocessing, "get_context", no_process)
    with pytest.raises(ValueError, match=r"mlp\.experts\.0\.gate_proj in FP8 blocks of 128 rows: the rows this rank "
                                         r"reads, \[\(0, 64\)\] of 128"):
        LLMEngine(block, EngineConfig(tensor_parallel_size=2))
