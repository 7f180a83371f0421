"""Qwen3-Next's packed DeltaNet projections are read ungrouped (`PackedGatedDeltaNet`): the rows of an FP8
checkpoint's scale tensor follow the weight's rows, per channel always, per 128-row block only when every head's
rows are whole blocks (else a clear error at load, before any weight memory is used for serving).

The tiny config's DeltaNet head dims (16) are not whole blocks; test_fp8.py covers the aligned block format.
On a CUDA device the whole model runs through the CUDA backend, whose Triton kernels read the conv input, z, b and
a as column views of the packed projection's output, and is compared with transformers in fp32.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hybridcache import LLM, SamplingParams
from hybridcache.models import load_model
from hybridcache.models.fp8_folders import write_fp8_folder
from hybridcache.models.random_weights import randomize_, tiny_hf_config

from ..engine.model_folders import write_tiny_model
from .helpers import PagedRunner, random_tokens, rel_err

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


@needs_cuda
def test_cuda_engine_prompt_logprobs_equal_the_reference_engine(tmp_path):
    """fp32 (IEEE on CUDA): every prompt position's logprob of its token within 1e-3 of the CPU reference engine's
    (which test_prompt_logprobs.py holds to transformers'; the two are 4e-6 apart; a row read in the wrong order
    is off by O(1)). transformers is not run here: with flash-linear-attention installed its CPU path breaks."""
    folder = write_tiny_model(tmp_path, "qwen3_next")
    prompt = random_tokens(160, seed=4)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    logprobs = []
    for device in ("cpu", "cuda"):
        llm = LLM(folder, device=device, dtype="float32", max_num_seqs=4, gpu_memory_utilization=0.2)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        logprobs.append(torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, 160)]))
        del llm
        gc.collect()
    torch.cuda.empty_cache()
    error = (logprobs[1] - logprobs[0]).abs().max().item()
    print(f"qwen3_next on CUDA, fp32: max |prompt logprob - the reference engine's| = {error:.2e}")
    assert error <= 1e-3
