"""FP8 MTP heads: a dense random folder with its head is written in FP8 (`write_fp8_folder` quantises the `mtp.*`
linears too, as Qwen's FP8 checkpoints do) in both formats the loader reads ("block": 128 x 128
`weight_scale_inv`; "channel": compressed-tensors `weight_scale` [N, 1]); the head loads with `Fp8Linear`s whose
dequantised weights are the dense head's within FP8 rounding and whose drafts (150 positions, fp32 on the CPU)
are the dequantised dense head's; `quantization="fp8"` quantises a dense head as the block folder holds it;
float8 head tensors without their scale are refused; greedy tokens with MTP on equal those with it off on an FP8
folder."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.kernels.gemm.reference import dequantize, quantize
from hybridcache.layers.linear import Fp8Linear
from hybridcache.models import load_model
from hybridcache.models.fp8_folders import write_fp8_folder
from hybridcache.models.mtp import MTP_FILE, load_mtp_head
from hybridcache.state_spec import DevicePools
from tests.engine.model_folders import write_tiny_model

# Qwen3-Next's DeltaNet head dims are whole 128-row blocks, as in its FP8 checkpoints (tests/models/test_fp8.py).
ALIGNED = {"qwen3_next": {"linear_key_head_dim": 128, "linear_value_head_dim": 128}}


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def dense_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, **ALIGNED.get(request.param, {}))


def head_fp8_linears(head) -> dict[str, Fp8Linear]:
    return {name: m for name, m in head.named_modules() if isinstance(m, Fp8Linear)}


def draft_logits(model, head, num: int = 150) -> torch.Tensor:
    """The head's logits (through `model`'s lm_head) over `num` positions in two chunks, its paged KV written as
    it goes, from random target hidden states and tokens (seeded: equal inputs for every head)."""
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (num,), generator=generator).tolist()
    target = torch.randn(num, model.config.hidden_size, generator=generator)
    backend = ReferenceBackend()
    pools = DevicePools.allocate(head.state_specs(torch.float32), num_pages=20, kernel_block_size=8, num_slots=1)
    outs = []
    for start, end in ((0, 70), (70, num)):
        batch = build_forward_batch([SeqChunk(tokens[start:end], start, list(range(10)), 0)], block_size=16,
                                    kernel_block_size=8)
        embeds = model.model.embed_tokens(batch.input_ids)
        outs.append(head(embeds, target[start:end], backend.prepare(batch), pools.layers, backend))
    return model._logits(torch.cat(outs))


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_an_fp8_head_is_the_dense_head_within_fp8_rounding(dense_dir, tmp_path, kind):
    folder = write_fp8_folder(dense_dir, tmp_path / kind, kind)
    model = load_model(dense_dir)
    dense = load_mtp_head(dense_dir, model, dtype=torch.float32, device="cpu")
    head = load_mtp_head(folder, load_model(folder), dtype=torch.float32, device="cpu")
    fp8 = head_fp8_linears(head)
    assert "fc" in fp8 and "layers.0.self_attn.q_proj" in fp8
    assert any(".experts." in name for name in fp8) == ("next" in dense_dir.name)
    dense_params = dict(dense.named_parameters())
    for name, linear in fp8.items():
        assert linear.weight.dtype == torch.float8_e4m3fn and linear.fmt.kind == kind, name
        want = dense_params[f"{name}.weight"]
        got = linear.dequantized(torch.float32)
        assert torch.equal(got, dequantize(*quantize(want, linear.fmt), linear.fmt, torch.float32)), name
        # e4m3: 3 mantissa bits (half an ulp is 2^-4 of the value), subnormals 2^-9 of the scale apart
        unit = dequantize(torch.ones_like(linear.weight), linear.scale, linear.fmt, torch.float32)
        assert ((got - want).abs() <= want.abs() / 16 + unit / 1024 + 1e-12).all(), name
        assert not torch.equal(got, want), name  # the rounding happened: the test can fail
    for name, param in head.named_parameters():  # the rest (norms, router gates) is the dense head's, exactly
        if name.rsplit(".", 1)[0] not in fp8:
            assert torch.equal(param, dense_params[name]), name

    for name, linear in fp8.items():  # the dense head with the FP8 head's dequantised weights
        dense_params[f"{name}.weight"].copy_(linear.dequantized(torch.float32))
    want = draft_logits(model, dense)
    got = draft_logits(model, head)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), float((got - want).abs().max())
    assert want.abs().max() > 0.1


def test_quantize_at_load_equals_the_block_checkpoints_head(dense_dir, tmp_path):
    """`quantization="fp8"` on the dense folder: the head's linears quantised after loading are the block-format
    folder's, byte for byte and scale for scale (the router gates stay dense in both)."""
    written = load_mtp_head(write_fp8_folder(dense_dir, tmp_path / "block", "block"), load_model(dense_dir),
                            dtype=torch.float32, device="cpu")
    quantized = load_mtp_head(dense_dir, load_model(dense_dir), dtype=torch.float32, device="cpu",
                              quantization="fp8")
    assert sorted(head_fp8_linears(quantized)) == sorted(head_fp8_linears(written))
    assert "fc" in head_fp8_linears(quantized)
    want = dict(written.named_parameters())
    for name, param in quantized.named_parameters():
        assert param.dtype == want[name].dtype, name
        assert torch.equal(param.view(torch.uint8) if param.dtype == torch.float8_e4m3fn else param,
                           want[name].view(torch.uint8) if param.dtype == torch.float8_e4m3fn else want[name]), name
    assert want.keys() == dict(quantized.named_parameters()).keys()


def test_float8_head_tensors_without_their_scale_are_refused(tmp_path):
    dense_dir = write_tiny_model(tmp_path / "dense", "qwen3_5_text")
    folder = write_fp8_folder(dense_dir, tmp_path / "block", "block")
    tensors = load_file(str(folder / MTP_FILE))
    del tensors["mtp.fc.weight_scale_inv"]
    save_file(tensors, str(folder / MTP_FILE))
    model = load_model(folder)  # the target's loading ignores mtp.*
    with pytest.raises(ValueError, match=re.escape("the MTP head (mtp.*): checkpoint tensors ['mtp.fc.weight'] are "
                                                   "float8 without a scale")):
        load_mtp_head(folder, model, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("model_type", ["qwen3_5_text", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_greedy_mtp_on_an_fp8_folder_equals_mtp_off(tmp_path, model_type):
    """The cache-equivalence workload on an FP8 folder (block format), MTP k = 2 (the FP8 head runs; oracle drafts
    so that verify rows accept 0..2 and roll back) against MTP off: token for token, the cache intact after every
    step."""
    from tests.engine.spec_helpers import make_engine, oracle, tokens_of
    from tests.engine.test_cache_equivalence import run_workload

    dense_dir = write_tiny_model(tmp_path / "dense", model_type, **ALIGNED.get(model_type, {}))
    folder = write_fp8_folder(dense_dir, tmp_path / "block", "block")
    off = tokens_of(run_workload(make_engine(folder, None, enable_prefix_caching=False)))
    engine = make_engine(folder, 2)
    assert "fc" in head_fp8_linears(engine.runner.mtp_head)  # the engine drafts with the FP8 head
    oracle(engine, off, seed=2)
    assert tokens_of(run_workload(engine, check_every_step=True)) == off
    stats = engine.drafter.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
