"""FP8 checkpoints of the Mamba2 hybrids in the layouts their publishers ship, against transformers on the
dequantised weights (tiny random models, fp32 compute on the CPU).

- Nemotron-H in NVIDIA ModelOpt FP8 (`write_fp8_folder(..., "modelopt")`: `quant_method: modelopt`, one weight
  scale per tensor, a static `input_scale` beside it, the selective recipe's dense attention, Mamba-before-attention,
  router and latent projections, FP8 KV scales `mixer.k_proj.k_scale` / `v_proj.v_scale`).
- Granite-4.0-H in compressed-tensors FP8_DYNAMIC as llm-compressor's Granite-4.0-H recipe writes it (per-channel
  scales; the stacked experts' `input_linear.weight_scale` [E, 2I, 1]; the router dense).

The reference is independent of our loader: `dequantized_folder` multiplies each FP8 weight by its scale as the
checkpoint holds them (broadcasting a per-tensor [] or stacked [E, N, 1] scale) and transformers loads that dense
folder. Our CPU path computes with exactly those dequantised weights (activations unquantised, as transformers'
`dequantize=True`), so the logits agree to fp32 rounding: the dense models' tolerance (`TOLERANCE`, 1e-4 of the
largest logit) applies unchanged, through prefill, chunks, decode and mixed batches (the shared checks). FP8 KV
is held to the same tolerance against transformers with each key and value rounded through e4m3 at the
checkpoint's scales (`e4m3_kv`): the rounding is the same arithmetic on both sides, so only fp32 rounding remains
(far below e4m3's 1/16 steps, which unrounded KV would show).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hybridcache.layers.linear import Fp8Linear
from hybridcache.models import load_model
from hybridcache.models.config import LayerKind
from hybridcache.models.fp8_folders import INPUT_SCALE, write_fp8_folder

from .granite_helpers import granite_model
from .helpers import TOLERANCE, ModelPair, PagedRunner, random_tokens, rel_err
from .hybrid_family_checks import (  # noqa: F401 - collected here, on this file's `pair`
    test_decode_after_prefill_matches_full_and_incremental_forward,
    test_mixed_batch_of_prefill_chunks_and_decodes,
    test_single_prefill_and_chunked_prefill,
    test_the_comparison_notices_a_lost_recurrent_state,
)
from .nemotron_helpers import nemotron_model

# (family, variant, folder layout)
CASES = {"nemotron-moe-modelopt": (nemotron_model, "moe-groups", "modelopt"),
         "nemotron-dense-modelopt": (nemotron_model, "pattern-bias", "modelopt"),  # M*-MM-: a Mamba2 before *
         "nemotron-latent-modelopt": (nemotron_model, "moe-latent", "modelopt"),
         "granite-moe-channel": (granite_model, "moe-nope", "channel"),
         "granite-dense-channel": (granite_model, "dense-rope", "channel")}


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def dequantized_folder(folder: Path, out: Path) -> Path:
    """The dense twin of an FP8 folder, each weight times its scale as the checkpoint holds them (no loader code):
    scales, static activation scales and KV scales dropped, the quantization_config removed."""
    from safetensors.torch import save_file

    tensors = checkpoint(folder)
    dense = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale", ".input_scale")):
            continue
        scale = tensors.get(name[: -len("weight")] + "weight_scale")
        dense[name] = tensor if scale is None else tensor.float() * scale.float()
    out.mkdir()
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def hf_from(folder: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def fp8_case(tmp: Path, case: str, **folder_options) -> tuple[torch.nn.Module, Path]:
    """(the dense transformers model, its FP8 folder in the case's layout)."""
    make, variant, kind = CASES[case]
    hf = make(variant)
    hf.save_pretrained(tmp / "dense")
    return hf, write_fp8_folder(tmp / "dense", tmp / kind, kind, **folder_options)


def fp8_modules(model: torch.nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, Fp8Linear)}


@pytest.fixture(scope="module", params=["nemotron-moe-modelopt", "granite-moe-channel"])
def pair(request, tmp_path_factory) -> ModelPair:
    """Our model loaded from the FP8 folder, transformers' from its dequantised twin."""
    tmp = tmp_path_factory.mktemp(request.param)
    _, folder = fp8_case(tmp, request.param)
    hf = hf_from(dequantized_folder(folder, tmp / "dequantized"))
    return ModelPair(hf.config, hf, load_model(folder))


def expected_fp8(case: str, ours: torch.nn.Module) -> set[str]:
    """The linears the case's recipe quantises, from our module tree: every linear but the embedding-side ones
    (lm_head), the routers, and with ModelOpt's recipe the attention layers, the Mamba2 layer before each, the
    latent projections."""
    linears = {name for name, module in ours.named_modules() if isinstance(module, (torch.nn.Linear, Fp8Linear))}
    dense = {"lm_head"} | {name for name in linears if name.endswith((".router", "_latent_proj"))}
    if CASES[case][2] == "modelopt":
        types = ours.config.layer_types
        attention = [i for i, kind in enumerate(types) if kind is LayerKind.FULL_ATTENTION]
        assert attention, "the recipe's cases each have attention layers"
        for i in attention:
            dense |= {name for name in linears if name.startswith(f"model.layers.{i}.")}
            if i > 0 and types[i - 1] is LayerKind.MAMBA2:
                dense |= {f"model.layers.{i - 1}.mixer.in_proj", f"model.layers.{i - 1}.mixer.out_proj"}
    return linears - dense


@pytest.mark.parametrize("case", list(CASES))
def test_the_fp8_folder_loads_by_its_tensor_names_and_equals_transformers_on_the_dequantised_weights(tmp_path, case):
    """The folder loads under its checkpoint names (`backbone.*`, ModelOpt's `input_scale` and `k_proj.k_scale`,
    Granite's stacked `input_linear.weight_scale`); exactly the recipe's linears are FP8 (the rest as dense as the
    checkpoint holds them); each FP8 linear dequantises to the checkpoint's own weight times scale; the logits of
    a 160-token prompt equal transformers' on the dequantised folder."""
    _, folder = fp8_case(tmp_path, case)
    names = checkpoint(folder)
    if CASES[case][2] == "modelopt":
        assert any(name.endswith(".input_scale") for name in names)
        assert any(name.endswith(".mixer.k_proj.k_scale") for name in names)
        assert all(names[name].shape == () for name in names if name.endswith(".weight_scale"))
    else:
        assert any(name.endswith("input_linear.weight_scale") and names[name].dim() == 3 for name in names) == (
            "moe" in case)
    ours = load_model(folder)
    assert fp8_modules(ours) == expected_fp8(case, ours)
    hf = hf_from(dequantized_folder(folder, tmp_path / "dequantized"))
    tokens = random_tokens(160, seed=5)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(160)[None], use_cache=False).logits[0]
    (got,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    assert rel_err(got, want) <= TOLERANCE


def test_per_tensor_scales_dequantise_to_the_checkpoints_weights(tmp_path):
    """A ModelOpt linear's one scale multiplies every row: our per-channel weight_scale holds it N times, and the
    dequantised weight is the checkpoint's weight times it, bit for bit."""
    _, folder = fp8_case(tmp_path, "nemotron-moe-modelopt")
    tensors = checkpoint(folder)
    modules = dict(load_model(folder).named_modules())
    for ckpt in ("backbone.layers.0.mixer.in_proj", "backbone.layers.1.mixer.experts.3.up_proj"):
        ours = modules[ckpt.replace("backbone.", "model.")]
        scale = tensors[f"{ckpt}.weight_scale"]
        assert ours.weight_scale.shape == (ours.out_features, 1) and torch.all(ours.weight_scale == scale)
        assert torch.equal(ours.weight, tensors[f"{ckpt}.weight"])
        assert torch.equal(ours.dequantized(torch.float32), tensors[f"{ckpt}.weight"].float() * scale)


def calibrated_kv_scales(hf: torch.nn.Module, tokens: list[int]) -> dict[str, tuple[float, float]]:
    """Each attention layer's (k_scale, v_scale) = amax / 448 of its keys and values over `tokens` (what ModelOpt's
    calibration writes), by the layer's checkpoint name (Nemotron-H's: `backbone.` for transformers' `model.`)."""
    amax: dict[str, list[float]] = {}
    hooks = []
    for name, module in hf.named_modules():
        if name.endswith((".k_proj", ".v_proj")):
            attention = name.rsplit(".", 1)[0]
            slot = 0 if name.endswith(".k_proj") else 1

            def record(_module, _inputs, output, attention=attention, slot=slot):
                amax.setdefault(attention, [0.0, 0.0])[slot] = float(output.abs().max())

            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(len(tokens))[None], use_cache=False)
    for hook in hooks:
        hook.remove()
    return {name.replace("model.", "backbone.", 1): (k / 448, v / 448) for name, (k, v) in amax.items()}


def e4m3_kv(hf: torch.nn.Module, scales: dict[str, tuple[float, float]]) -> list:
    """Round every attention layer's keys and values of transformers' model `hf` as an FP8 KV cache stores them:
    x -> e4m3(clamp(x / scale, +-448)) * scale with the layer's (k_scale, v_scale) (by checkpoint name, as
    `calibrated_kv_scales`). Nemotron-H's attention has no rotary embedding, so its keys are k_proj's output.
    Returns the hooks (to remove)."""
    hooks = []
    for name, module in hf.named_modules():
        if name.endswith((".k_proj", ".v_proj")):
            scale = scales[name.rsplit(".", 1)[0].replace("model.", "backbone.", 1)][name.endswith(".v_proj")]

            def rounded(_module, _inputs, output, scale=scale):
                stored = (output.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                return (stored.float() * scale).to(output.dtype)

            hooks.append(module.register_forward_hook(rounded))
    return hooks


def test_fp8_kv_reads_modelopts_kv_scales_and_rounds_as_e4m3(tmp_path):
    """`kv_fp8`: the attention layers store e4m3 KV with the checkpoint's `mixer.k_proj.k_scale` / `v_proj.v_scale`
    (calibrated here as ModelOpt does: amax / 448). The logits equal transformers' on the dequantised weights
    with each key and value rounded through e4m3 at those scales (`e4m3_kv`), to fp32 rounding (TOLERANCE); they
    differ from transformers' unrounded KV, and from rounding at scale 1.0 (the scales are used). Without
    `kv_fp8` the scales are not read and the KV stays fp32."""
    tokens = random_tokens(160, seed=7)
    make, variant, _ = CASES["nemotron-moe-modelopt"]
    hf_dense = make(variant)
    scales = calibrated_kv_scales(hf_dense, tokens)
    assert list(scales) == ["backbone.layers.2.mixer"]
    hf_dense.save_pretrained(tmp_path / "dense")
    folder = write_fp8_folder(tmp_path / "dense", tmp_path / "modelopt", "modelopt", kv_scales=scales)
    hf = hf_from(dequantized_folder(folder, tmp_path / "dequantized"))

    @torch.no_grad()
    def hf_logits(kv_scales: dict[str, tuple[float, float]] | None) -> torch.Tensor:
        hooks = e4m3_kv(hf, kv_scales) if kv_scales is not None else []
        logits = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(160)[None], use_cache=False).logits
        for hook in hooks:
            hook.remove()
        return logits[0]

    ours = load_model(folder, kv_fp8=True)
    attention = dict(ours.named_modules())["model.layers.2.mixer"]
    assert (attention.k_scale, attention.v_scale) == pytest.approx(scales["backbone.layers.2.mixer"], rel=1e-6)
    assert ours.state_specs(torch.float32, torch.float32)[2].dtype == torch.float8_e4m3fn
    (got,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    assert rel_err(got, hf_logits(scales)) <= TOLERANCE
    assert rel_err(got, hf_logits(None)) > 10 * TOLERANCE
    assert rel_err(got, hf_logits({name: (1.0, 1.0) for name in scales})) > 10 * TOLERANCE
    plain = load_model(folder)
    assert plain.state_specs(torch.float32, torch.float32)[2].dtype == torch.float32
    (got,) = PagedRunner(plain, 16, 8).step([(0, tokens)])
    assert rel_err(got, hf_logits(None)) <= TOLERANCE


def test_granite_fp8_kv_reads_self_attn_kv_scales(tmp_path):
    """Granite's attention (`self_attn`) stores FP8 KV too: compressed-tensors' `self_attn.k_scale` names and
    ModelOpt's `self_attn.k_proj.k_scale` both reach the layer."""
    _, folder = fp8_case(tmp_path, "granite-dense-channel")
    tensors = checkpoint(folder)
    layers = sorted({name.rsplit(".k_proj.", 1)[0] for name in tensors if ".self_attn.k_proj." in name})
    assert len(layers) == 2
    tensors[f"{layers[0]}.k_scale"], tensors[f"{layers[0]}.v_scale"] = torch.tensor(0.03), torch.tensor(0.02)
    tensors[f"{layers[1]}.k_proj.k_scale"], tensors[f"{layers[1]}.v_proj.v_scale"] = (torch.tensor([0.05]),
                                                                                      torch.tensor(0.04))
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    modules = dict(load_model(folder, kv_fp8=True).named_modules())
    assert (modules[layers[0]].k_scale, modules[layers[0]].v_scale) == pytest.approx((0.03, 0.02))
    assert (modules[layers[1]].k_scale, modules[layers[1]].v_scale) == pytest.approx((0.05, 0.04))
    assert modules[layers[0]].kv_dtype == torch.float8_e4m3fn
    load_model(folder)  # (the scales unread without kv_fp8)


def test_hf_quant_config_json_alone_describes_the_checkpoint(tmp_path):
    """Older ModelOpt exports keep the config in `hf_quant_config.json` (nested: `quantization.quant_algo`,
    `kv_cache_quant_algo`, `exclude_modules`) and none in config.json: the folder loads the same FP8 linears."""
    _, folder = fp8_case(tmp_path, "nemotron-moe-modelopt")
    want = fp8_modules(load_model(folder))
    config = json.loads((folder / "config.json").read_text())
    flat = config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    nested = {"producer": flat["producer"], "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": flat["ignore"]}}
    (folder / "hf_quant_config.json").write_text(json.dumps(nested))
    assert fp8_modules(load_model(folder)) == want


def _with_quantization_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("field, value, message", [
    ("quant_algo", "NVFP4", "ModelOpt quant_algo 'NVFP4' is not supported"),
    ("quant_algo", "FP8_PB_WO", "ModelOpt quant_algo 'FP8_PB_WO' is not supported"),
    ("quant_algo", "MIXED_PRECISION", "ModelOpt quant_algo 'MIXED_PRECISION' is not supported"),
    ("kv_cache_scheme", {"num_bits": 4, "type": "float"}, "ModelOpt KV cache quantisation .* not supported"),
    ("config_groups", {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}},
     "ModelOpt config group 'group_0': weights .* not supported"),
], ids=["nvfp4", "fp8-pb-wo", "mixed", "kv-fp4", "group-fp4"])
def test_a_modelopt_config_not_understood_is_a_clear_error(tmp_path, field, value, message):
    _, folder = fp8_case(tmp_path, "nemotron-dense-modelopt")
    _with_quantization_config(folder, lambda qc: qc.update({field: value}))
    with pytest.raises(ValueError, match=message):
        load_model(folder)


def test_malformed_modelopt_tensors_are_clear_errors(tmp_path):
    """A weight scale of two numbers is neither per tensor nor per channel (named as mismatched); a static
    activation scale beside a dense linear has no FP8 weight to go with (named as unexpected)."""
    from safetensors.torch import save_file

    _, folder = fp8_case(tmp_path, "nemotron-dense-modelopt")
    good = checkpoint(folder)
    scale = "backbone.layers.3.mixer.in_proj.weight_scale"  # (layer 0's Mamba2 stays dense: before attention)
    save_file({**good, scale: torch.tensor([0.1, 0.2])}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"shape mismatch for tensor '{scale}': checkpoint [2]")):
        load_model(folder)
    stray = "backbone.layers.1.mixer.q_proj.input_scale"  # the attention stays dense in the recipe
    save_file({**good, stray: torch.tensor(INPUT_SCALE)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"unexpected tensor '{stray}'")):
        load_model(folder)


def test_modelopt_per_channel_scales_load_as_the_channel_format(tmp_path):
    """ModelOpt's FP8_PER_CHANNEL_PER_TOKEN keeps a weight scale [N] (no input_scale): read as [N, 1]."""
    from safetensors.torch import save_file

    from hybridcache.fp8_format import CHANNEL
    from hybridcache.kernels.gemm.reference import quantize

    _, folder = fp8_case(tmp_path, "nemotron-dense-modelopt")
    tensors = checkpoint(folder)
    for name in [name for name in tensors if name.endswith(".weight_scale")]:
        module = name[: -len(".weight_scale")]
        weight, scale = quantize(tensors[f"{module}.weight"].float() * tensors[name], CHANNEL)
        tensors[f"{module}.weight"], tensors[name] = weight, scale.reshape(-1)
        del tensors[f"{module}.input_scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    _with_quantization_config(folder, lambda qc: qc.update(quant_algo="FP8_PER_CHANNEL_PER_TOKEN"))
    modules = dict(load_model(folder).named_modules())
    ours = modules["model.layers.3.mixer.in_proj"]
    assert torch.equal(ours.weight_scale[:, 0], tensors["backbone.layers.3.mixer.in_proj.weight_scale"])
    assert torch.equal(ours.weight, tensors["backbone.layers.3.mixer.in_proj.weight"])


def test_quantization_fp8_at_load_keeps_the_routers_dense(tmp_path):
    """`--quantization fp8` on a dense folder of either family: every linear FP8 (128 x 128 blocks) but the lm_head
    and the MoE routers (Granite's `block_sparse_moe.router`; Nemotron-H's router is no linear); the logits are
    those of the dense model holding the dequantised weights."""
    for case in ("granite-moe-channel", "nemotron-moe-modelopt"):
        make, variant, _ = CASES[case]
        make(variant).save_pretrained(tmp_path / case)
        ours = load_model(tmp_path / case, quantization="fp8")
        linears = {name for name, m in ours.named_modules() if isinstance(m, (torch.nn.Linear, Fp8Linear))}
        dense = {name for name in linears if name == "lm_head" or name.endswith(".router")}
        quantized = {name: m for name, m in ours.named_modules() if isinstance(m, Fp8Linear)}
        assert set(quantized) == linears - dense and {m.fmt.kind for m in quantized.values()} == {"block"}
        twin = load_model(tmp_path / case)
        with torch.no_grad():
            for name, module in twin.named_modules():
                if name in quantized:
                    module.weight.copy_(quantized[name].dequantized(torch.float32))
        tokens = random_tokens(150, seed=2)
        (got,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
        (want,) = PagedRunner(twin, 16, 8).step([(0, tokens)])
        assert rel_err(got, want) <= TOLERANCE


def test_the_modelopt_folder_writes_config_jsons_flat_spelling(tmp_path):
    """The recipe's folder copies the tokenizer files and writes config.json's flat ModelOpt spelling, the dense
    linears in `ignore`."""
    make, variant, _ = CASES["nemotron-dense-modelopt"]
    make(variant).save_pretrained(tmp_path / "dense")
    (tmp_path / "dense" / "tokenizer.json").write_text("{}")
    folder = write_fp8_folder(tmp_path / "dense", tmp_path / "out", "modelopt")
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "FP8") and "lm_head" in qc["ignore"]
    assert {"backbone.layers.1.mixer.q_proj", "backbone.layers.0.mixer.in_proj"} <= set(qc["ignore"])
    assert (folder / "tokenizer.json").is_file()
