"""FP8 checkpoints against transformers' own FP8 loading, on tiny random models (fp32 compute on the CPU).

For each architecture (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) and each format the loader reads ("block": Qwen's
fine-grained FP8, 128 x 128 `weight_scale_inv`; "channel": compressed-tensors FP8_DYNAMIC, `weight_scale` [N, 1]),
a dense random folder is written in FP8 by `write_fp8_folder` and loaded by both. transformers refuses FP8
compute on a CPU: its fine-grained FP8 quantizer falls back to `dequantize=True` by itself there, and
compressed-tensors is loaded with `CompressedTensorsConfig(run_compressed=False)` (its forward on FP8 weights
fails on the CPU); both dequantise at load, so the comparison is weight for weight, and the logits are those of
the dequantised weights, which is what our CPU path computes.

The tiny configs keep every quantised dim a multiple of 128 or below it: transformers' dequantisation infers the
block from the scale grid (rows // scale_rows), which equals the 128 x 128 format only then; partial blocks are
checked against an explicit per-block loop instead (`test_block_format_arithmetic`).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from hybridcache.fp8_format import BLOCK, CHANNEL, Fp8Format
from hybridcache.kernels.gemm.reference import dequantize, quantize
from hybridcache.layers.linear import Fp8Linear
from hybridcache.models import ModelConfig, get_model_class, load_model, load_weights
from hybridcache.models.fp8_folders import write_fp8_folder
from hybridcache.models.quant import keeps_dtype
from hybridcache.models.random_weights import randomize_, tiny_hf_config

from .helpers import MODEL_TYPES, TOLERANCE, PagedRunner, random_tokens, rel_err

# Qwen3-Next's DeltaNet head dims are whole 128-row blocks, as in its FP8 checkpoints: the loader reads in_proj_qkvz's
# rows per head in another order (`PackedGatedDeltaNet`), and its block scales with them (see the module docstring).
ALIGNED = {"qwen3_next": {"linear_key_head_dim": 128, "linear_value_head_dim": 128}}


@pytest.fixture(scope="module", params=MODEL_TYPES)
def dense_dir(request, tmp_path_factory):
    import transformers

    config = tiny_hf_config(request.param, **ALIGNED.get(request.param, {}))
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config).eval()
    randomize_(model, 0)
    path = tmp_path_factory.mktemp(f"dense-{request.param}")
    model.save_pretrained(path)
    return path


def hf_fp8(path, kind: str):
    import transformers

    extra = {}
    if kind == "channel":
        extra["quantization_config"] = transformers.CompressedTensorsConfig(run_compressed=False)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()


def fp8_linears(model: nn.Module) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_dequantised_weights_and_logits_equal_transformers(dense_dir, tmp_path, kind):
    folder = write_fp8_folder(dense_dir, tmp_path / kind, kind)
    ours = load_model(folder)
    hf = hf_fp8(folder, kind)
    # transformers' dequantised weights, mapped onto our parameter names by our own loader (stacked experts too)
    theirs = get_model_class(hf.config.architectures[0])(ModelConfig.from_dict(hf.config.to_dict()))
    load_weights(theirs, hf.state_dict())
    dense = dict(theirs.named_parameters())
    quantized = fp8_linears(ours)
    assert quantized and any(".experts." in n for n in quantized) == ("moe" in str(dense_dir) or "next" in str(
        dense_dir))
    for name, linear in quantized.items():
        assert linear.weight.dtype == torch.float8_e4m3fn and linear.fmt.kind == kind
        assert torch.equal(linear.dequantized(torch.float32), dense[f"{name}.weight"]), name
    for name, param in ours.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if owner not in quantized:
            assert torch.equal(param, dense[name]), name
            assert not (name.endswith(".weight") and param.dim() == 2 and "embed" not in name
                        and not keeps_dtype(owner)), f"{name} should be FP8"
    tokens = random_tokens(160, seed=5)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(160)[None], use_cache=False)
    (got,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    assert rel_err(got, want.logits[0]) <= TOLERANCE


def test_greedy_tokens_equal_transformers(dense_dir, tmp_path):
    """12 greedy tokens after a 150-token prompt, decoded one step at a time from our paged state, against
    transformers' full forward over the growing sequence (block format)."""
    folder = write_fp8_folder(dense_dir, tmp_path / "block", "block")
    ours, hf = load_model(folder), hf_fp8(folder, "block")
    tokens = random_tokens(150, seed=6)
    runner = PagedRunner(ours, 16, 8)
    (logits,) = runner.step([(0, tokens)])
    generated = []
    for _ in range(12):
        generated.append(int(logits[-1].argmax()))
        (logits,) = runner.step([(0, generated[-1:])])
    sequence = list(tokens)
    with torch.no_grad():
        for _ in range(12):
            out = hf(input_ids=torch.tensor([sequence]), position_ids=torch.arange(len(sequence))[None],
                     use_cache=False)
            sequence.append(int(out.logits[0, -1].argmax()))
    assert generated == sequence[150:]


def test_quantize_at_load_equals_the_block_checkpoint(dense_dir, tmp_path):
    """`quantization="fp8"` on the dense folder gives the block folder's model, bit for bit; what FP8 checkpoints
    keep dense stays an nn.Linear."""
    at_load = load_model(dense_dir, quantization="fp8")
    written = load_model(write_fp8_folder(dense_dir, tmp_path / "block", "block"))
    ours = fp8_linears(at_load)
    assert ours.keys() == fp8_linears(written).keys()
    for name, param in written.named_parameters():
        assert torch.equal(dict(at_load.named_parameters())[name], param), name
    kept = [n for n, m in at_load.named_modules() if type(m) is nn.Linear]
    assert "lm_head" in kept and all(keeps_dtype(n) for n in kept)


def test_quantize_at_load_lets_each_dense_weight_go_as_it_goes(dense_dir, monkeypatch):
    """`quantize_linears_` frees each dense weight once its FP8 copy is in place: when the i-th linear is
    quantised, the dense weights of the ones before it are gone (peak memory: the model plus one layer's FP8
    copy, not the dense model plus every FP8 copy)."""
    import weakref

    import hybridcache.kernels.backend as kernel_backend
    from hybridcache.models import quant

    model = load_model(dense_dir)
    names = quant.quantizable_linears(model)
    modules = dict(model.named_modules())
    dense = [weakref.ref(modules[name].weight) for name in names]
    del modules
    alive_at_each_call = []
    quantize_one = kernel_backend.fp8_quantize

    def counting(weight, fmt):
        alive_at_each_call.append(sum(ref() is not None for ref in dense))
        return quantize_one(weight, fmt)

    monkeypatch.setattr(kernel_backend, "fp8_quantize", counting)
    quant.quantize_linears_(model, names)
    assert alive_at_each_call == [len(names) - i for i in range(len(names))]
    assert all(ref() is None for ref in dense)


def test_dummy_weights_are_the_dense_dummy_quantised(dense_dir):
    """`load_format="dummy"` draws the same values with and without FP8: each FP8 weight is its dense twin's
    quantised (the 80B benchmark model is built this way on the device)."""
    dense = load_model(dense_dir, load_format="dummy")
    fp8 = load_model(dense_dir, load_format="dummy", quantization="fp8")
    params = dict(dense.named_parameters())
    for name, linear in fp8_linears(fp8).items():
        weight, scale = quantize(params[f"{name}.weight"], BLOCK)
        assert torch.equal(linear.weight.view(torch.uint8), weight.view(torch.uint8)), name
        assert torch.equal(linear.scale, scale), name


@pytest.mark.parametrize("fmt", [BLOCK, CHANNEL, Fp8Format("block", (64, 32))], ids=["128x128", "channel", "64x32"])
def test_block_format_arithmetic(fmt):
    """Partial blocks (200 x 300 over 128 x 128): dequantise = weight x its block's scale, by an explicit loop;
    the round trip is within e4m3's step of each block's largest value."""
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(200, 300, generator=generator) * torch.rand(200, 1, generator=generator)
    weight, scale = quantize(dense, fmt)
    assert weight.dtype == torch.float8_e4m3fn and tuple(scale.shape) == fmt.scale_shape(200, 300)
    want = torch.empty(200, 300)
    bn, bk = fmt.block if fmt.kind == "block" else (1, 300)
    for i in range(200):
        for j in range(0, 300, bk):
            s = scale[i // bn, j // bk] if fmt.kind == "block" else scale[i, 0]
            want[i, j : j + bk] = weight[i, j : j + bk].float() * s
    got = dequantize(weight, scale, fmt, torch.float32)
    assert torch.equal(got, want)
    assert ((got - dense).abs() <= dense.abs() * 2**-4 + scale.max() * 2**-9).all()
    assert weight.float().abs().max() == 448.0


def _edit_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"weight_block_size": None}, "weight_block_size"),
])
def test_unsupported_quantization_configs_are_refused(dense_dir, tmp_path, change, message):
    folder = write_fp8_folder(dense_dir, tmp_path / "block", "block")
    _edit_config(folder, **change)
    with pytest.raises(ValueError, match=message):
        load_model(folder)


def test_unsupported_compressed_tensors_and_options_are_refused(dense_dir, tmp_path):
    folder = write_fp8_folder(dense_dir, tmp_path / "channel", "channel")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="strategy"):
        load_model(folder)
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        load_model(dense_dir, quantization="int4")


def test_fp8_linear_keeps_its_dtypes_when_the_model_is_cast(dense_dir):
    model = load_model(dense_dir, quantization="fp8")
    linear = next(iter(fp8_linears(model).values()))
    before = linear.weight.clone(), linear.scale.clone()
    model.to(torch.bfloat16)
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.scale.dtype == torch.float32
    assert torch.equal(linear.weight.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(linear.scale, before[1])


@pytest.mark.parametrize("fmt, sizes, fused", [
    (BLOCK, (256, 128, 40), True),      # every projection but the last fills whole 128-row blocks
    (BLOCK, (64, 64), False),           # a block would straddle two projections: one GEMM each
    (CHANNEL, (64, 40, 8), True),
], ids=["block-aligned", "block-unaligned", "channel"])
def test_fused_fp8_projections_equal_separate_ones(fmt, sizes, fused):
    from hybridcache.layers.fused import FusedProjection
    from hybridcache.models.quant import quantize_linears_

    generator = torch.Generator().manual_seed(len(sizes))
    holder = nn.Module()
    for i, size in enumerate(sizes):
        setattr(holder, f"p{i}", nn.Linear(96, size, bias=False))
        getattr(holder, f"p{i}").weight.data = torch.randn(size, 96, generator=generator)
    holder.fused = FusedProjection(*(getattr(holder, f"p{i}") for i in range(len(sizes))))
    quantize_linears_(holder, [f"p{i}" for i in range(len(sizes))], fmt)
    x = torch.randn(5, 96, generator=generator)
    separate = [getattr(holder, f"p{i}")(x) for i in range(len(sizes))]
    together = holder.fused(x)
    assert (holder.fused.fp8 is not None) == fused
    for a, b in zip(together, separate, strict=True):
        assert rel_err(a, b) <= 1e-5  # fp32 sums in another order
    assert all(isinstance(linear, Fp8Linear) for linear in holder.fused.linears)


def test_float8_weights_without_their_scales_are_refused(dense_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_fp8_folder(dense_dir, tmp_path / "block", "block")
    tensors = load_file(str(folder / "model.safetensors"))
    scale = next(name for name in tensors if name.endswith(".weight_scale_inv"))
    del tensors[scale]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(scale.replace("_scale_inv", "")) + ".* are float8 without a scale"):
        load_model(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="are float8 without a scale"):
        load_model(folder)


def test_float8_e5m2_weights_are_refused(dense_dir, tmp_path):
    """The FP8 formats read here hold float8_e4m3fn weights; an e5m2 one was cast by value to e4m3 (past 448 it
    saturates) without a word."""
    from safetensors.torch import load_file, save_file

    folder = write_fp8_folder(dense_dir, tmp_path / "block", "block")
    tensors = load_file(str(folder / "model.safetensors"))
    name = next(name for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn)
    tensors[name] = tensors[name].to(torch.float8_e5m2)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(name) + ".* float8_e5m2"):
        load_model(folder)

def test_fp8_tensors_of_ignored_modules_are_ignored(dense_dir, tmp_path):
    """An FP8 `mtp.*` head (and its scale) is skipped like any tensor of an ignored prefix."""
    from safetensors.torch import load_file, save_file

    folder = write_fp8_folder(dense_dir, tmp_path / "block", "block")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["mtp.fc.weight"], tensors["mtp.fc.weight_scale_inv"] = quantize(torch.randn(64, 128), BLOCK)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert fp8_linears(load_model(folder))
