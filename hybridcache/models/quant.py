"""FP8 weights at load time: which checkpoint format a model folder uses, which linears hold FP8 weights, and
quantising a bf16 model's linears (`--quantization fp8`).

Formats read from `config.json`'s `quantization_config` (`checkpoint_format`):

- `quant_method: "fp8"` (Qwen's fine-grained FP8): `fmt: "e4m3"`, `activation_scheme: "dynamic"`,
  `weight_block_size: [128, 128]`; each quantized linear `X` stores `X.weight` (float8_e4m3fn) and
  `X.weight_scale_inv` [ceil(out/128), ceil(in/128)]; experts per expert (`mlp.experts.{e}.*_proj`).
- `quant_method: "compressed-tensors"`, `format: "float-quantized"`: every config group's weights 8-bit float,
  `strategy: "channel"`, symmetric, static; input activations absent or dynamic per token (FP8_DYNAMIC);
  `X.weight` (float8_e4m3fn) and `X.weight_scale` [out, 1]. Stacked experts (llm-compressor's Granite-4.0-H
  recipe) hold `input_linear.weight` [E, 2I, H] with `input_linear.weight_scale` [E, 2I, 1] and `output_linear.*`
  likewise (the loader splits them per expert). A group that targets attention modules only and quantises no
  weights (llm-compressor's attention / KV quantisation, `targets: ["Qwen3_5Attention"]`) is skipped with a
  warning, as vLLM does: FP8 KV comes from `--kv-cache-dtype fp8` and the `k_scale` / `v_scale` tensors.
- `quant_method: "modelopt"` (NVIDIA ModelOpt; Nemotron-H / Nemotron 3 FP8), in config.json's flat spelling
  (`quant_algo`, `kv_cache_scheme`, `ignore`, `config_groups`; ModelOpt 0.31-0.33 wrote it without quant_method,
  marked by `quant_library: "modelopt"` or `producer.name` "modelopt") or `hf_quant_config.json`'s nested one
  (`{"producer", "quantization": {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}}`, read when config.json
  has no quantization_config): `quant_algo` "FP8" (`X.weight` e4m3, `X.weight_scale` one number per tensor,
  `X.input_scale` one static activation scale) or "FP8_PER_CHANNEL_PER_TOKEN" (`X.weight_scale` [out]); any other
  (NVFP4, FP8_PB_WO, MIXED_PRECISION...) is a ValueError naming it. KV cache quantisation: none or FP8 (the
  attention layers' `k_proj.k_scale` / `v_proj.v_scale`, read with `--kv-cache-dtype fp8`).

All the per-channel formats run as the "channel" format (`fp8_format.CHANNEL`, the kernels unchanged): a scale of
one number (per tensor) is read as that number for every output row, a scale [out] as [out, 1]
(`channel_scale_shapes`), so the dequantised weights are exactly the checkpoint's. Static activation scales
(`X.input_scale`) are not read: activations are quantised per token at run time, as the channel format's GEMMs
always do (vLLM's per-tensor GEMMs use the static scale because cuBLAS's per-tensor FP8 GEMM takes one number; a
per-token scale is as fine or finer and never clips a token past the calibrated range), see `pop_input_scales`.

Block scales may be UE8M0 (float8_e8m0fnu, safetensors `F8_E8M0`: powers of two, as transformers' fine-grained FP8
accepts for `weight_scale_inv`); they are read as fp32 (exact), so such a folder loads as its fp32-scale twin.

Which linears are FP8 is read from the checkpoint itself: exactly those with a scale tensor beside their weight
(`fp8_modules`), so `modules_to_not_convert` / `ignore` lists need not be interpreted. `--quantization fp8` on a
bf16 checkpoint quantises every linear but those Qwen's FP8 checkpoints keep in bf16 (`keeps_dtype`: lm_head, the
router and shared-expert gates, DeltaNet's `in_proj_a`, `in_proj_b`, `in_proj_ba`) to the block format after the
weights are read (`quantize_linears_`).

Under tensor parallelism a scale's part follows its weight's part (`scale_shard`): per channel its rows, per block
the blocks the rank's rows or columns cover, which must be whole (a split that cuts a block is a ValueError).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.fp8_format import BLOCK, CHANNEL, Fp8Format
from hybridcache.layers.fused import FusedProjection
from hybridcache.layers.linear import Fp8Linear
from hybridcache.layers.parallel import Shard
from hybridcache.models.config.fields import read_json_object

_logger = logging.getLogger(__name__)
QUANTIZATIONS = ("fp8",)  # `--quantization` values: quantise a bf16 checkpoint at load
# Linears that FP8 checkpoints keep in the model dtype (Qwen3-Next-80B-A3B-FP8's modules_to_not_convert; the MoE
# routers of Granite-4.0-H, `block_sparse_moe.router(.layer)`, and Nemotron-H, `mixer.gate`, as their FP8 recipes).
_KEEPS_DTYPE = re.compile(
    r"(^lm_head$|\.mlp\.gate$|\.shared_expert_gate$|\.in_proj_(a|b|ba)$|\.block_sparse_moe\.router(\.layer)?$"
    r"|\.mixer\.gate$)")
# ModelOpt's weight formats read here (per tensor / per channel scales, both run per channel)
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")


def keeps_dtype(module_name: str) -> bool:
    """True for the linears `--quantization fp8` leaves unquantised (module docstring)."""
    return bool(_KEEPS_DTYPE.search(module_name))


def read_quantization_config(model_dir: str | Path) -> dict[str, Any] | None:
    """`quantization_config` of `<model_dir>/config.json` (or of its `text_config`); without one, ModelOpt's
    `hf_quant_config.json` beside it (as `quant_method: "modelopt"`, its nested spelling); None when neither;
    ValueError naming the file when it is not an object."""
    raw = read_json_object(Path(model_dir) / "config.json")
    text = raw.get("text_config")
    found = raw.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None)
    if found and not isinstance(found, dict):
        raise ValueError(f"config.json quantization_config {found!r} must be an object")
    sidecar = Path(model_dir) / "hf_quant_config.json"
    if not found and sidecar.is_file():
        return {"quant_method": "modelopt", **read_json_object(sidecar)}
    return found or None


def checkpoint_format(quantization_config: Mapping[str, Any] | None) -> Fp8Format | None:
    """The FP8 weight format a `quantization_config` describes (None: not quantized); ValueError naming the field
    for any variant this engine does not load (other methods, static activation scales, other block shapes...)."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    if method is None and _written_by_modelopt(quantization_config):
        method = "modelopt"
    if isinstance(method, str):  # vLLM's spellings: any case, compressed_tensors
        method = method.lower().replace("compressed_tensors", "compressed-tensors")
    if method == "fp8":
        return _fine_grained(quantization_config)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization_config)
    if method == "modelopt":
        return _modelopt(quantization_config)
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported; this engine loads 'fp8' "
                     "(Qwen's fine-grained FP8), 'compressed-tensors' (FP8, per-channel weights) and "
                     "'modelopt' (NVIDIA ModelOpt FP8)")


def _written_by_modelopt(qc: Mapping[str, Any]) -> bool:
    """A config.json `quantization_config` ModelOpt 0.31-0.33 wrote (flat, no quant_method): 0.33 marks it
    `quant_library: "modelopt"`, 0.31 only by `producer.name` "modelopt" (0.35 on writes quant_method)."""
    producer = qc.get("producer")
    return qc.get("quant_library") == "modelopt" or (isinstance(producer, Mapping)
                                                     and producer.get("name") == "modelopt")


def _fine_grained(qc: Mapping[str, Any]) -> Fp8Format:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (only e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported (only dynamic)")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError("config.json quantization_config.weight_block_size must be [rows, cols], got None "
                         "(per-tensor FP8 is not supported)")
    if (not isinstance(block, list) or len(block) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in block)):
        raise ValueError(f"config.json quantization_config.weight_block_size {block!r} must be [rows, cols], two "
                         "integers >= 1")
    return Fp8Format("block", (block[0], block[1]))


def _compressed_tensors(qc: Mapping[str, Any]) -> Fp8Format:
    form = qc.get("format")
    if form not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {form!r} is not supported (only float-quantized FP8)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        if _attention_only(group):
            _logger.warning("compressed-tensors group %r (targets %s) quantises attention, not linear weights: "
                            "skipped, as vLLM does (FP8 KV is --kv-cache-dtype fp8, with the checkpoint's "
                            "k_scale / v_scale)", name, group.get("targets"))
            continue
        weights = group.get("weights") or {}
        wanted = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        wrong = {key: weights.get(key) for key, value in wanted.items() if weights.get(key, value) != value}
        if wrong:
            raise ValueError(f"compressed-tensors group {name!r}: weights {wrong} not supported (FP8 e4m3, "
                             "per-channel, symmetric, static scales only)")
        acts = group.get("input_activations")
        if acts and not (acts.get("dynamic") and acts.get("strategy") == "token" and acts.get("num_bits") == 8
                         and acts.get("type") == "float"):
            raise ValueError(f"compressed-tensors group {name!r}: input_activations {acts} not supported (only "
                             "absent or dynamic FP8 per token)")
    return CHANNEL


def _modelopt(qc: Mapping[str, Any]) -> Fp8Format:
    """NVIDIA ModelOpt, either spelling (module docstring): "FP8" (per-tensor weight scales) and
    "FP8_PER_CHANNEL_PER_TOKEN" run per channel; ValueError naming any other `quant_algo`, a KV cache quantisation
    other than FP8, or a config group that is not 8-bit float."""
    nested = qc.get("quantization")
    if nested is not None and not isinstance(nested, dict):
        raise ValueError(f"ModelOpt quantization {nested!r} must be an object")
    details = nested if nested is not None else qc
    algo = details.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in MODELOPT_ALGOS:
        raise ValueError(f"ModelOpt quant_algo {algo!r} is not supported; this engine loads {MODELOPT_ALGOS} (FP8 "
                         "e4m3 weights with per-tensor or per-channel scales)")
    kv = details.get("kv_cache_quant_algo", details.get("kv_cache_scheme"))
    kv_fp8 = (kv is None or (isinstance(kv, str) and kv.upper() == "FP8")
              or (isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float"))
    if not kv_fp8:
        raise ValueError(f"ModelOpt KV cache quantisation {kv!r} is not supported (only FP8: --kv-cache-dtype fp8 "
                         "with the checkpoint's k_scale / v_scale)")
    groups = details.get("config_groups") or {}
    for name, group in groups.items():
        for role in ("weights", "input_activations"):
            spec = (group or {}).get(role)
            if (spec or role == "weights") and not (isinstance(spec, dict) and spec.get("num_bits") == 8
                                                     and spec.get("type") == "float"):
                raise ValueError(f"ModelOpt config group {name!r}: {role} {spec} not supported (8-bit float only)")
    return CHANNEL


def _attention_only(group: Mapping[str, Any]) -> bool:
    """A compressed-tensors config group that targets attention modules only (llm-compressor's attention / KV
    quantisation, e.g. `targets: ["Qwen3_5Attention"]`) and quantises no weights: vLLM skips it
    (`CompressedTensorsConfig.from_config`: attention quantisation is coupled with the KV cache's)."""
    targets = group.get("targets") or []
    return (not group.get("weights") and bool(targets)
            and all(isinstance(target, str) and target.endswith("Attention") for target in targets))


def fp8_modules(checkpoint_names: Iterable[str], fmt: Fp8Format) -> list[str]:
    """The module names (checkpoint spelling) whose weight is FP8: those with `<name>.<fmt.scale_name>`."""
    suffix = "." + fmt.scale_name
    return sorted(name[: -len(suffix)] for name in checkpoint_names if name.endswith(suffix))


def pop_input_scales(shapes: dict[str, tuple[int, ...]], fp8: Iterable[str]) -> list[str]:
    """Take the static activation scales of the FP8 linears `fp8` (checkpoint names), `X.input_scale` (ModelOpt FP8),
    out of `shapes` and return their names: they are not read, the activations being quantised per token at run
    time (module docstring). An `input_scale` beside a weight without a scale stays in `shapes` (the loader then
    names it an unexpected tensor)."""
    names = [f"{module}.input_scale" for module in fp8 if f"{module}.input_scale" in shapes]
    for name in names:
        del shapes[name]
    return names


def channel_scale_shapes(shapes: dict[str, tuple[int, ...]], fp8: Iterable[str], fmt: Fp8Format
                         ) -> dict[str, tuple[int, ...]]:
    """The per-channel scales of the FP8 linears `fp8` (checkpoint names; `fmt` "channel") that the checkpoint holds
    in another shape than the linear's [N, 1]: one number (per tensor: ModelOpt FP8), read as that number for each
    of the N rows, or [N] (ModelOpt FP8_PER_CHANNEL_PER_TOKEN). `shapes` is updated to [N, 1] for them; returns
    their names -> [N, 1] (`expand_channel_scale` reads them). Other shapes are left for the loader to name as
    mismatched."""
    if fmt.kind != "channel":
        return {}
    out = {}
    for module in fp8:
        weight, name = shapes.get(f"{module}.weight"), f"{module}.{fmt.scale_name}"
        if weight is None or len(weight) != 2 or shapes[name] == (weight[0], 1):
            continue
        if math.prod(shapes[name]) == 1 or shapes[name] == (weight[0],):
            shapes[name] = out[name] = (weight[0], 1)
    return out


def expand_channel_scale(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A checkpoint scale of one number or [N] (`channel_scale_shapes`) as the per-channel [N, 1] `shape`."""
    return scale.reshape(shape) if scale.numel() != 1 else scale.reshape(1, 1).expand(shape)


def check_fp8_dtypes(dtypes: Mapping[str, str], fp8: Iterable[str]) -> None:
    """ValueError naming the tensors when the checkpoint's float8 tensors (safetensors dtype `F8_E4M3`) are not
    exactly the weights of the `fp8` modules: an FP8 weight without a scale (or without a quantization_config)
    would load as unscaled numbers, a scale beside a dense weight would be applied to the wrong values, a scale
    whose weight is missing has nothing to scale; and a float8_e5m2 tensor (`F8_E5M2`) is refused, since the
    formats read here are e4m3 (a cast by value would saturate past e4m3's 448). UE8M0 block scales
    (float8_e8m0fnu, `F8_E8M0`: powers of two, which transformers' fine-grained FP8 also reads as
    `weight_scale_inv`) are accepted there only; the loader reads them as their fp32 values (exact)."""
    fp8 = list(fp8)
    if e5m2 := sorted(name for name, dtype in dtypes.items() if dtype == "F8_E5M2"):
        raise ValueError(f"checkpoint tensors {e5m2[:5]} are float8_e5m2; the FP8 formats this engine reads hold "
                         "float8_e4m3fn weights")
    want = {f"{name}.weight" for name in fp8}
    if missing := sorted(want - dtypes.keys()):
        raise ValueError(f"checkpoint tensors {missing[:5]} are missing: the checkpoint holds their FP8 scales "
                         "but not the weights they scale")
    block_scales = {f"{name}.weight_scale_inv" for name in fp8}
    have = {name for name, dtype in dtypes.items()
            if dtype.startswith("F8") and not (dtype == "F8_E8M0" and name in block_scales)}
    if unscaled := sorted(name for name in have - want if dtypes[name] != "F8_E8M0"):
        raise ValueError(f"checkpoint tensors {unscaled[:5]} are float8 without a scale this engine reads (a "
                         "`weight_scale_inv` / `weight_scale` beside them and a quantization_config naming the format)")
    if ue8m0 := sorted(have - want):
        raise ValueError(f"checkpoint tensors {ue8m0[:5]} are float8_e8m0fnu (UE8M0); this engine reads that dtype "
                         "only as block scales (`weight_scale_inv` beside a float8_e4m3fn weight, quant_method fp8)")
    if dense := sorted(want - have):
        raise ValueError(f"checkpoint tensors {dense[:5]} have an FP8 scale beside them but are not float8_e4m3fn "
                         f"(they are {sorted({dtypes[name] for name in dense})})")


def quantizable_linears(model: nn.Module) -> list[str]:
    """Every `nn.Linear` of `model` that `--quantization fp8` converts (all but `keeps_dtype`)."""
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and not keeps_dtype(name)]


def convert_linears(model: nn.Module, targets: Mapping[str, Fp8Format]) -> None:
    """Replace each `nn.Linear` named in `targets` (module name -> format) by an `Fp8Linear` of the same shape on
    the same device (a meta model before loading stays meta); the layers' fused projections follow. ValueError
    naming the module when a target is not an `nn.Linear` of the model."""
    replaced: dict[int, Fp8Linear] = {}
    modules = dict(model.named_modules())
    for name, fmt in targets.items():
        linear = modules.get(name)
        if type(linear) is not nn.Linear:
            raise ValueError(f"checkpoint has FP8 weights for {name!r}, which is not a linear layer of the model")
        with torch.device(linear.weight.device):
            new = Fp8Linear(linear.in_features, linear.out_features, fmt, bias=linear.bias is not None,
                            bias_dtype=None if linear.bias is None else linear.bias.dtype)
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, new)
        replaced[id(linear)] = new
    _repoint_fused(model, replaced)


@torch.no_grad()
def quantize_linears_(model: nn.Module, names: Iterable[str], fmt: Fp8Format = BLOCK) -> None:
    """Quantise the loaded `nn.Linear`s `names` of `model` in place to `fmt` (`--quantization fp8`), one at a time,
    each dense weight let go as soon as its FP8 copy is in place (peak memory: the model as it is plus one layer's
    FP8 copy; a dense weight that something else also holds, such as a tied embedding, stays with that)."""
    replaced: dict[int, Fp8Linear] = {}
    modules = dict(model.named_modules())
    for name in names:
        linear = modules[name]
        weight, scale = kernel_backend.fp8_quantize(linear.weight, fmt)
        with torch.device("meta"):
            new = Fp8Linear(linear.in_features, linear.out_features, fmt)
        new.weight = nn.Parameter(weight, requires_grad=False)
        setattr(new, fmt.scale_name, nn.Parameter(scale, requires_grad=False))
        new.bias = linear.bias
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, new)
        replaced[id(linear)] = new
        linear.weight = None  # the old module lives on in `modules` and fused projections until they are repointed
    _repoint_fused(model, replaced)


def fp8_linears(model: nn.Module) -> dict[str, Fp8Format]:
    """Module name -> format of every `Fp8Linear` of `model` (what `convert_linears` makes of a twin of it)."""
    return {name: module.fmt for name, module in model.named_modules() if isinstance(module, Fp8Linear)}


def scale_shard(weight: Shard, fmt: Fp8Format, full_shape: tuple[int, ...], module: str) -> Shard | None:
    """The part of an FP8 weight's scale tensor that goes with the part `weight` of the weight (shape `full_shape`,
    [out, in]) of linear `module`; None when the scale is read whole (per-channel scales of a column shard).

    Per channel, the scale [out, 1] follows the weight's rows. Per block, a range of rows (columns) maps to the
    blocks it covers, so every range must start on a block boundary and stop on one or at the end of the weight
    (its last, partial block), the last range only; padding rows get zero scales (their weights are zero).
    ValueError naming the module and the sizes else: a rank whose rows or columns split a block would need part of
    a scale (vLLM refuses the same split at layer creation: "Weight output_partition_size = ... is not divisible by
    weight quantization block_n", or `input_size_per_partition` / `block_k` for a row-parallel layer)."""
    if fmt.kind == "channel":
        return weight if weight.dim == 0 else None
    block, total = fmt.block[weight.dim], full_shape[weight.dim]
    what = ("rows", "columns")[weight.dim]
    last = len(weight.ranges) - 1
    for i, (start, stop) in enumerate(weight.ranges):
        if start % block or (stop % block and not (stop == total and i == last)):
            raise ValueError(
                f"{module} in FP8 blocks of {block} {what}: the {what} this rank reads, {list(weight.ranges)} of "
                f"{total} ({weight.data_length} in all), split a block; a rank's {what}, and each head's or fused "
                f"part's, must be whole blocks (multiples of {block}): choose a tensor_parallel_size that keeps "
                "them whole, or a per-channel (compressed-tensors) checkpoint")
    ranges = tuple((start // block, -(-stop // block)) for start, stop in weight.ranges)
    held = sum(stop - start for start, stop in ranges)
    return Shard(weight.dim, ranges, padding=-(-weight.length // block) - held)


def _repoint_fused(model: nn.Module, replaced: Mapping[int, nn.Module]) -> None:
    """Every `FusedProjection` a module holds reads the replacement of a replaced linear."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, FusedProjection):
                value.linears = tuple(replaced.get(id(linear), linear) for linear in value.linears)
                value._pointers = ()
                value.fp8 = None


def describe_weights(model_dir: str | Path, config: Any) -> str:
    """What the startup line and /health say about the weights of `model_dir` under an `EngineConfig`: the
    checkpoint's FP8 format (e.g. "fp8-block128x128", "fp8-channel (modelopt)"), "<format> (quantized at load)",
    or "dense"; with "random" before it under load_format dummy."""
    qc = read_quantization_config(model_dir)
    fmt = checkpoint_format(qc)
    if fmt is not None:
        text = fmt.describe() + (" (modelopt)" if str(qc.get("quant_method", "")).lower() == "modelopt" else "")
    elif config.quantization == "fp8":
        text = f"{BLOCK.describe()} (quantized at load)"
    else:
        text = "dense"
    return f"random {text}" if config.load_format == "dummy" else text


# `<attention>.k_scale` (vLLM's, compressed-tensors') or ModelOpt's `<attention>.k_proj.k_scale`; the attention is
# `self_attn` (Qwen, Granite) or Nemotron-H's `mixer`
_KV_SCALE = re.compile(r"\.(self_attn|mixer)(\.k_proj)?\.k_scale$|\.(self_attn|mixer)(\.v_proj)?\.v_scale$")
_QUERY_SCALE = re.compile(r"\.self_attn\.q_(scale|zero_point)$")
_MODELOPT_KV_HOP = re.compile(r"\.(k_proj\.k|v_proj\.v)_scale$")


def is_kv_scale(checkpoint_name: str) -> bool:
    """A per-layer FP8 KV scale tensor (`...self_attn.k_scale` / `v_scale`, vLLM's and compressed-tensors' names;
    ModelOpt's `...k_proj.k_scale` / `...v_proj.v_scale`; Nemotron-H's attention is its layer's `mixer`)."""
    return bool(_KV_SCALE.search(checkpoint_name))


def kv_scale_name(checkpoint_name: str) -> str:
    """A KV scale's name on its attention layer: ModelOpt's `X.k_proj.k_scale` -> `X.k_scale` (others as they are)."""
    return _MODELOPT_KV_HOP.sub(lambda match: f".{match.group(1)[-1]}_scale", checkpoint_name)


def is_query_scale(checkpoint_name: str) -> bool:
    """A query quantisation tensor (`...self_attn.q_scale` / `q_zero_point`: llm-compressor's attention scheme
    writes them beside the KV scales); queries are not quantised here, so they are not read (vLLM loads them
    only for FP8 attention backends)."""
    return bool(_QUERY_SCALE.search(checkpoint_name))


def set_kv_fp8(model: nn.Module, kv_fp8: bool, scales: Mapping[str, float]) -> nn.Module:
    """With `kv_fp8`, every attention layer (a module with `kv_dtype`) stores float8_e4m3fn KV with its
    `<layer>.k_scale` / `<layer>.v_scale` from `scales` (our names), else 1.0; a scale that is not positive and
    finite is a ValueError. Returns `model`."""
    if not kv_fp8:
        return model
    for name, module in model.named_modules():
        if hasattr(module, "kv_dtype"):
            module.kv_dtype = torch.float8_e4m3fn
            for which in ("k_scale", "v_scale"):
                value = scales.get(f"{name}.{which}", 1.0)
                if not (value > 0 and value != float("inf")):
                    raise ValueError(f"checkpoint {name}.{which} is {value}: an FP8 KV scale must be positive")
                setattr(module, which, value)
    return model


_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj$")
_SHARED_EXPERT = re.compile(r"\.shared_expert\.(gate|up|down)_proj$")


@torch.no_grad()
def requantize_experts_per_channel_(model: nn.Module, shared: bool = False) -> int:
    """Re-quantise every routed expert's block-scaled `Fp8Linear` (`...experts.{e}.{gate,up,down}_proj`) per output
    channel in place (`kernels.backend.fp8_requantize_rows`: what `Fp8ExpertWeights.share` does on CUDA with
    `fp8_tiles.EXPERTS_PER_CHANNEL`, so their prefill can run torch's row-wise scaled grouped GEMM), and with
    `shared` the shared experts' too (what it does when the shared expert joins the stack,
    `fp8_tiles.SHARED_AS_EXPERT`); on any device, for measuring what the change of numerics costs
    (`benchmarks/fp8_quality.py`). Returns how many it changed."""
    replaced: dict[int, Fp8Linear] = {}
    modules = dict(model.named_modules())
    for name, linear in modules.items():
        expert = _ROUTED_EXPERT.search(name) or (shared and _SHARED_EXPERT.search(name))
        if not (isinstance(linear, Fp8Linear) and linear.fmt.kind == "block" and expert):
            continue
        weight, scale = kernel_backend.fp8_requantize_rows(linear.weight[None], linear.scale[None], linear.fmt.block)
        with torch.device("meta"):
            new = Fp8Linear(linear.in_features, linear.out_features, CHANNEL)
        new.weight = nn.Parameter(weight[0], requires_grad=False)
        new.weight_scale = nn.Parameter(scale[0, :, None], requires_grad=False)
        new.bias, new.gemm = linear.bias, linear.gemm
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child, new)
        replaced[id(linear)] = new
    _repoint_fused(model, replaced)
    return len(replaced)
