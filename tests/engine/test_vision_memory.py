"""The vision encoder's share of the CUDA memory plan, by its arithmetic (the measurement itself runs on CUDA: the
engine's start-up line, `benchmarks/vision_bench.py`): the processor's largest image, the largest tower call, the
encoder cache's bytes, and no reserve off CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from hybridcache.engine.vision_encoder import MAX_PATCHES_PER_CALL, VisionEncoder, largest_call_patches
from hybridcache.mm_processor import ImageProcessor
from hybridcache.models.vision import VisionTower
from hybridcache.models.vision_config import VisionConfig
from hybridcache.models.vl_folders import PREPROCESSOR, TINY_VISION

pytest.importorskip("PIL.Image")


def qwen35_processor(tmp_path) -> ImageProcessor:
    """Qwen3.5's preprocessor settings (patch 16, merge 2, 65,536 to 16,777,216 pixels) beside a 9B tower config."""
    preprocessor = {**PREPROCESSOR, "patch_size": 16, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return ImageProcessor(tmp_path, VisionConfig.from_dict({"vision_config": {"out_hidden_size": 4096}}))


def test_largest_image_of_qwen35_processor(tmp_path):
    processor = qwen35_processor(tmp_path)
    assert processor.max_patches == 65_536  # 4,096 x 4,096 pixels in patches of 16
    from PIL import Image

    image = processor.process([Image.new("RGB", (8000, 6000))])[0]  # resized down to at most 16.7 M pixels
    t, h, w = image.grid
    assert t == 1 and h * w <= processor.max_patches


def test_largest_call_and_cache_bytes():
    assert largest_call_patches(65_536) == 65_536  # a larger image runs alone
    assert largest_call_patches(256) == MAX_PATCHES_PER_CALL  # small images are grouped up to the cap
    config = VisionConfig.from_dict({"vision_config": {**TINY_VISION, "out_hidden_size": 48}})
    encoder = VisionEncoder(VisionTower(config).to(torch.bfloat16), capacity_tokens=1000)
    assert encoder.cache_bytes() == 1000 * 48 * 2
    assert encoder.reserve_bytes(256) == 0  # no budget off CUDA: nothing is measured or reserved


def test_dummy_load_format_draws_the_tower_too(tmp_path):
    """A folder without weights serves images with load_format="dummy" (the benchmarks' 9B folder): the tower's
    weights are drawn like the language model's, and an image prompt runs."""
    import numpy as np
    from PIL import Image

    from hybridcache.llm import LLM
    from hybridcache.models.vl_folders import tiny_vl_hf_config, write_vl_files
    from hybridcache.sampling import SamplingParams

    folder = write_vl_files(tmp_path, tiny_vl_hf_config(), PREPROCESSOR)
    assert not list(folder.glob("*.safetensors"))
    with LLM(folder, load_format="dummy", max_num_seqs=2) as llm:
        tower = llm.engine.vision.tower
        assert tower.blocks[0].attn.qkv.weight.std() > 0 and tower.attention_name == "reference"
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8))
        chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}]
        out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 3 and llm.engine.vision.num_encoded_images == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_reserves_the_encoder_before_the_pool(tmp_path):
    """On CUDA the plan takes the measured reserve (activations of the largest call + the encoder cache) first and
    the start-up line names it."""
    from hybridcache.llm import LLM
    from hybridcache.models.vl_folders import write_tiny_vl_model

    with LLM(write_tiny_vl_model(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=4) as llm:
        plan, vision = llm.engine.memory_plan, llm.engine.vision
        assert vision.tower.attention_name == "flash_varlen"
        assert plan.encoder_bytes > vision.cache_bytes()  # the activation peak is not nothing
        assert "vision encoder" in plan.describe()


def test_a_step_may_feed_a_whole_image_past_the_budget_and_the_plan_knows(tmp_path):
    """A chunk never ends inside an image, so a step may feed up to max_num_batched_tokens - 1 tokens and then the
    largest image whole: `max_step_tokens`, the forward whose activations a CUDA plan keeps out of the pools
    (it took max_num_batched_tokens alone, and a 16,384-token image over a 512 budget could run out of memory)."""
    import numpy as np
    from PIL import Image

    from hybridcache.llm import LLM
    from hybridcache.models.vl_folders import write_tiny_vl_model
    from hybridcache.sampling import SamplingParams

    with LLM(write_tiny_vl_model(tmp_path), max_num_batched_tokens=16, max_num_seqs=2) as llm:
        engine = llm.engine
        assert engine.image_processor.max_image_tokens == 64  # 4,096 pixels in patches of 4, merged by 4
        assert engine.max_step_tokens == 16 - 1 + 64
        fed: list[int] = []
        execute = engine.runner.execute

        def counting(batch, *args, **kwargs):
            fed.append(batch.positions.numel())
            return execute(batch, *args, **kwargs)

        engine.runner.execute = counting
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
        chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}]
        llm.chat(chat, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert 16 < max(fed) <= engine.max_step_tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_plan_measures_the_activations_of_the_largest_step(tmp_path, monkeypatch):
    from hybridcache.engine import rank_runner
    from hybridcache.llm import LLM
    from hybridcache.models.vl_folders import write_tiny_vl_model

    measured: list[int] = []
    measure = rank_runner.measure_activation_bytes

    def recording(*args, num_tokens: int, **kwargs):
        measured.append(num_tokens)
        return measure(*args, num_tokens=num_tokens, **kwargs)

    monkeypatch.setattr(rank_runner, "measure_activation_bytes", recording)
    with LLM(write_tiny_vl_model(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=4,
             max_num_batched_tokens=16) as llm:
        assert measured == [llm.engine.max_step_tokens] == [16 - 1 + 64]
