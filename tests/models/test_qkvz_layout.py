"""Qwen3-Next's packed DeltaNet projections are read ungrouped (`PackedGatedDeltaNet`): the rows of an FP8
checkpoint's scale tensor follow the weight's rows, per channel always, per 128-row block only when every head's
rows are whole blocks (else a clear error at load, before any weight memory is used for serving).

The tiny config's DeltaNet head dims (16) are not whole blocks; test_fp8.py covers the aligned block format.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.models import load_model
from hybridcache.models.fp8_folders import write_fp8_folder
from hybridcache.models.random_weights import randomize_, tiny_hf_config

from .helpers import PagedRunner, random_tokens, rel_err


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    import transformers

    config = tiny_hf_config("qwen3_next")
    model = transformers.Qwen3NextForCausalLM(config).eval()
    randomize_(model, 3)
    path = tmp_path_factory.mktemp("next-dense")
    model.save_pretrained(path)
    return path


def test_channel_scales_follow_the_ungrouped_rows(next_dir, tmp_path):
    """Per-channel FP8 with unaligned head dims: the ungrouped projection's rows keep their own scales, so the
    logits equal transformers' on the same (dequantised) FP8 weights."""
    import transformers

    folder = write_fp8_folder(next_dir, tmp_path / "channel", "channel")
    ours = load_model(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)
    ).eval()
    tokens = random_tokens(160, seed=7)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(160)[None], use_cache=False).logits[0]
    (got,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    assert rel_err(got, want) <= 1e-4


def test_block_scales_across_heads_are_refused(next_dir, tmp_path):
    folder = write_fp8_folder(next_dir, tmp_path / "block", "block")
    with pytest.raises(ValueError, match=r"in_proj_qkvz in FP8 blocks of 128 rows.*multiples of 128"):
        load_model(folder)
