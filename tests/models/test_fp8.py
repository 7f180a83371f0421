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


@pytest.mark.parametrize("block", [128, ["128", "x"], [128], [0, 128], [128.0, 128], [True, 128]],
                         ids=["an-int", "strings", "one-entry", "zero", "floats", "a-bool"])
def test_a_malformed_weight_block_size_names_config_json_and_the_field(block):
    """Was a bare TypeError ('object of type int has no len()') or int()'s ValueError naming neither."""
    from hybridcache.models.quant import checkpoint_format

    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}
    with pytest.raises(ValueError, match=r"config\.json quantization_config\.weight_block_size .* must be \[rows"):
        checkpoint_format(config)
    assert checkpoint_format({**config, "weight_block_size": [128, 64]}).block == (128, 64)


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


def _edit_tensors(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _tensor_names(folder) -> list[str]:
    from safetensors import safe_open

    (shard,) = folder.glob("*.safetensors")
    with safe_open(str(shard), framework="pt") as handle:
        return sorted(handle.keys())


def _attention_prefixes(folder) -> list[str]:
    """The checkpoint prefixes `...self_attn.` of the folder's attention layers."""
    suffix = ".self_attn.v_proj.weight"
    return [name[: -len("v_proj.weight")] for name in _tensor_names(folder) if name.endswith(suffix)]


def test_per_head_kv_scales_are_merged_into_their_max(dense_dir, tmp_path, caplog):
    """llm-compressor's `kv_cache_scheme.strategy: "attn_head"` stores k_scale / v_scale per KV head; our layers
    hold one scale each, so they take the max, as vLLM does (the first head's alone was taken: wrong outputs);
    one warning says so. A scalar scale beside them is read as it is."""
    import shutil

    folder = tmp_path / "kv"
    shutil.copytree(dense_dir, folder)
    num_kv_heads = json.loads((folder / "config.json").read_text())["num_key_value_heads"]
    first, *others = _attention_prefixes(folder)
    k_heads = torch.linspace(0.5, 2.0, num_kv_heads)  # head 0 smallest: its scale alone clips the others
    v_heads = torch.linspace(3.0, 0.25, num_kv_heads)

    def edit(tensors):
        tensors[first + "k_scale"], tensors[first + "v_scale"] = k_heads, v_heads
        for prefix in others:
            tensors[prefix + "k_scale"], tensors[prefix + "v_scale"] = torch.tensor(0.75), torch.tensor([0.125])

    _edit_tensors(folder, edit)
    with caplog.at_level("WARNING", logger="hybridcache.models.loader"):
        model = load_model(folder, kv_fp8=True)
    modules = dict(model.named_modules())
    assert (modules[first[:-1]].k_scale, modules[first[:-1]].v_scale) == (2.0, 3.0)
    for prefix in others:
        assert (modules[prefix[:-1]].k_scale, modules[prefix[:-1]].v_scale) == (0.75, 0.125)
    warnings = [r.getMessage() for r in caplog.records if "per KV head" in r.getMessage()]
    assert len(warnings) == 1 and "max" in warnings[0] and first + "k_scale" in warnings[0]


@pytest.mark.parametrize("value, message", [
    ([], r"is empty \(shape \[0\]\)"),
    ([1.0, float("nan")], r"\(shape \[2\]\) holds \[1.0, nan\]"),
    ([0.5, -1.0], r"\(shape \[2\]\) holds \[0.5, -1.0\]"),
    (0.0, r"\(shape \[\]\) holds \[0.0\]"),
    (float("inf"), r"\(shape \[\]\) holds \[inf\]"),
], ids=["empty", "nan-head", "negative-head", "zero", "inf"])
def test_malformed_kv_scales_are_refused_naming_the_tensor(dense_dir, tmp_path, value, message):
    """An empty KV scale was an IndexError naming nothing; a bad value past head 0 loaded unseen. Without
    kv_fp8 the scales are not read."""
    import shutil

    folder = tmp_path / "kv"
    shutil.copytree(dense_dir, folder)
    prefix = _attention_prefixes(folder)[0]
    _edit_tensors(folder, lambda tensors: tensors.update({prefix + "k_scale": torch.tensor(value)}))
    with pytest.raises(ValueError, match=re.escape(f"FP8 KV scale '{prefix}k_scale'") + ".*" + message):
        load_model(folder, kv_fp8=True)
    load_model(folder)


def test_an_attention_only_compressed_tensors_group_is_skipped(dense_dir, tmp_path, caplog):
    """llm-compressor's attention / KV quantisation group (targets one `...Attention` class, no weights, static
    per-head input activations) beside the FP8_DYNAMIC group: vLLM skips it with a warning; it was refused."""
    folder = write_fp8_folder(dense_dir, tmp_path / "channel", "channel")
    config = json.loads((folder / "config.json").read_text())
    acts = {"num_bits": 8, "type": "float", "strategy": "attn_head", "symmetric": True, "dynamic": False}
    config["quantization_config"]["config_groups"]["group_1"] = {
        "targets": ["Qwen3_5Attention"], "weights": None, "input_activations": acts, "output_activations": None}
    config["quantization_config"]["kv_cache_scheme"] = acts
    (folder / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="hybridcache.models.quant"):
        model = load_model(folder)
    assert any("'group_1'" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    plain = load_model(write_fp8_folder(dense_dir, tmp_path / "plain", "channel"))
    assert set(fp8_linears(model)) == set(fp8_linears(plain))
    assert {m.fmt for m in fp8_linears(model).values()} == {CHANNEL}
    config["quantization_config"]["config_groups"]["group_1"]["weights"] = {"num_bits": 4, "type": "int"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="group 'group_1': weights"):  # a group with weights is still checked
        load_model(folder)


def test_an_attention_quantisation_checkpoints_query_scales_are_not_read(dense_dir, tmp_path):
    """llm-compressor's attention scheme saves `self_attn.q_scale` (one per head) beside k_scale / v_scale: the
    folder was refused ("unexpected tensor ...q_scale"), with or without an FP8 KV cache. Queries are not
    quantised here; the KV scales are read as before."""
    folder = write_fp8_folder(dense_dir, tmp_path / "channel", "channel")
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]

    def add(tensors: dict) -> None:
        for prefix in _attention_prefixes(folder):
            tensors[prefix + "q_scale"] = torch.full((heads, 1, 1), 0.5)
            tensors[prefix + "k_scale"] = torch.full((kv_heads, 1, 1), 0.25)
            tensors[prefix + "v_scale"] = torch.full((kv_heads, 1, 1), 0.125)

    _edit_tensors(folder, add)
    load_model(folder)
    model = load_model(folder, kv_fp8=True)
    scales = {(m.k_scale, m.v_scale) for m in model.modules() if hasattr(m, "kv_dtype")}
    assert scales == {(0.25, 0.125)}


@pytest.mark.parametrize("method", ["FP8", "Compressed_Tensors"])
def test_quant_method_spellings_vllm_takes_load(dense_dir, tmp_path, method):
    """vLLM lower-cases quant_method and reads compressed_tensors as compressed-tensors; both were refused."""
    fmt = "block" if method == "FP8" else "channel"
    folder = write_fp8_folder(dense_dir, tmp_path / fmt, fmt)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["quant_method"] = method
    (folder / "config.json").write_text(json.dumps(config))
    assert fp8_linears(load_model(folder))


def test_a_missing_fp8_weight_beside_its_scale_is_named_missing(dense_dir, tmp_path):
    folder = write_fp8_folder(dense_dir, tmp_path / "block", "block")
    name = next(n for n in _tensor_names(folder) if n.endswith(".weight_scale_inv"))[: -len("_scale_inv")]
    _edit_tensors(folder, lambda tensors: tensors.pop(name))
    with pytest.raises(ValueError, match=re.escape(f"['{name}'] are missing")):  # was "are not float8_e4m3fn"
        load_model(folder)


def test_ue8m0_block_scales_load_as_their_fp32_twin(dense_dir, tmp_path):
    """Block scales stored as float8_e8m0fnu (safetensors F8_E8M0, which transformers' fine-grained FP8 reads for
    `weight_scale_inv`) are powers of two: read as fp32 they are exact, and the folder gives the logits of its twin
    with the same scales in fp32 (they were refused as "float8 without a scale"). UE8M0 anywhere else is refused."""
    import shutil

    fp32 = write_fp8_folder(dense_dir, tmp_path / "fp32", "block")
    _edit_tensors(fp32, lambda tensors: tensors.update({
        name: torch.exp2(torch.log2(t).ceil()) for name, t in tensors.items() if name.endswith(".weight_scale_inv")}))
    ue8m0 = tmp_path / "ue8m0"
    shutil.copytree(fp32, ue8m0)
    _edit_tensors(ue8m0, lambda tensors: tensors.update({
        name: t.to(torch.float8_e8m0fnu) for name, t in tensors.items() if name.endswith(".weight_scale_inv")}))
    twin, ours = load_model(fp32), load_model(ue8m0)
    assert fp8_linears(ours) and all(m.scale.dtype == torch.float32 for m in fp8_linears(ours).values())
    for (name, a), (_, b) in zip(fp8_linears(ours).items(), fp8_linears(twin).items(), strict=True):
        assert torch.equal(a.scale, b.scale), name
    tokens = random_tokens(40, 1)
    assert torch.equal(PagedRunner(ours, 16, 8).step([(0, tokens)])[0], PagedRunner(twin, 16, 8).step([(0, tokens)])[0])

    norm = next(n for n in _tensor_names(ue8m0) if n.endswith("norm.weight"))
    _edit_tensors(ue8m0, lambda t: t.update({norm: torch.ones_like(t[norm]).to(torch.float8_e8m0fnu)}))
    with pytest.raises(ValueError, match=re.escape(f"['{norm}'] are float8_e8m0fnu")):
        load_model(ue8m0)


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_fp8_twin_of_a_vl_folder_keeps_its_vision_tower_dense_and_runs(tmp_path, kind):
    """`write_fp8_folder` of an image-text folder keeps `model.visual.*` dense, as Qwen's FP8 VL releases do (it
    quantised them, and the vision loader, which reads dense weights, refused the folder); the twin's tower equals
    the dense one's, its language model is FP8, and the engine answers a prompt with an image."""
    from safetensors import safe_open

    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine
    from hybridcache.models.vision_loader import load_vision_tower
    from hybridcache.models.vl_folders import write_tiny_vl_model
    from hybridcache.multimodal import MultimodalInput
    from hybridcache.sampling import SamplingParams

    dense = write_tiny_vl_model(tmp_path / "dense")
    fp8 = write_fp8_folder(dense, tmp_path / kind, kind)
    (shard,) = fp8.glob("*.safetensors")
    with safe_open(str(shard), framework="pt") as handle:
        visual = [name for name in handle.keys() if name.startswith("model.visual.")]  # noqa: SIM118
        assert visual and not [n for n in visual if handle.get_slice(n).get_dtype().startswith("F8")]
    ours, want = load_vision_tower(fp8), load_vision_tower(dense)
    for (name, a), (_, b) in zip(ours.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert fp8_linears(load_model(fp8))

    engine = LLMEngine(fp8, EngineConfig(block_size=16, kernel_block_size=8))
    vision = engine.vision.tower.config
    grid = (1, 4, 4)
    pixels = torch.randn(16, vision.patch_dim, generator=torch.Generator().manual_seed(0))
    start = 5
    num_image_tokens = 4  # 16 patches merged 2 x 2
    ids = (random_tokens(start - 1, 2) + [vision.vision_start_token_id] + [vision.image_token_id] * num_image_tokens
           + [vision.vision_end_token_id] + random_tokens(6, 3))
    span = MultimodalInput(start, start + num_image_tokens, "img", grid=grid, merge=2, pixel_values=pixels)
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), mm_inputs=[span])
    finished = []
    while engine.has_unfinished_requests():
        finished += [output for output in engine.step() if output.finished]
    assert len(finished) == 1 and len(finished[0].outputs[0].token_ids) == 3
