"""Write FP8 model folders from dense ones, in the layouts the loader reads (tests and benchmarks).

    write_fp8_folder(dense_dir, out_dir, "block")     Qwen's fine-grained FP8 (`quant_method: fp8`)
    write_fp8_folder(dense_dir, out_dir, "channel")   compressed-tensors FP8_DYNAMIC (per-channel weights)
    write_fp8_folder(dense_dir, out_dir, "modelopt")  NVIDIA ModelOpt FP8 (per-tensor weights), Nemotron's recipe

Every 2-D `X.weight` of a linear layer is quantised (`kernels/gemm/reference.py::quantize`) except those Qwen's FP8
checkpoints keep dense (`quant.keeps_dtype`: lm_head, the router and shared-expert gates, DeltaNet's in_proj_a/b/ba;
Granite's and Nemotron-H's routers), the embedding and a VL folder's vision tower (`model.visual.*`, dense in Qwen's
FP8 VL releases and read dense by `vision_loader.py`); `X.weight_scale_inv` (block) or `X.weight_scale` (channel) is
written beside it, and `config.json` gets the matching `quantization_config` (with the kept modules in
`modules_to_not_convert` or `ignore`). Other files (tokenizer, generation config) are copied.

"channel" also quantises stacked experts (Granite-4.0-H's `block_sparse_moe.input_linear.weight` [E, 2I, H] and
`output_linear.weight` [E, H, I]) per expert per row, their scales [E, rows, 1]: llm-compressor's Granite-4.0-H
recipe (`examples/quantization_w8a8_fp8/README_granite4.md`: experts quantised as 2-D linears, saved back in 3-D).
"block" keeps them dense.

"modelopt" follows NVIDIA's selective recipe of its Nemotron 3 FP8 checkpoints (ModelOpt `quant_algo: FP8`;
NVIDIA-Nemotron-Nano-9B-v2-FP8's model card names only the attention layers and conv1d as kept in BF16): each
quantised linear `X` gets `X.weight` e4m3 with one scale for the whole tensor
(`X.weight_scale`, shape [], amax / 448) and a static activation scale `X.input_scale` (shape [];
`INPUT_SCALE`, not calibrated: the loader never reads it); kept dense besides the above are every attention layer
(`q/k/v/o_proj`) and the Mamba2 layer just before each (its `in_proj`, `out_proj`), and the MoE latent projections
(`fc1/fc2_latent_proj`, as Nemotron 3 Super's recipe keeps them); each attention layer gets its FP8 KV scales
`<attention>.k_proj.k_scale` / `v_proj.v_scale` (shape [], `kv_scales`, default 1.0). config.json gets config.json's
flat ModelOpt spelling (`quant_method: modelopt`, `quant_algo: FP8`, `kv_cache_scheme`, `ignore`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

import hybridcache.kernels.backend as kernel_backend
from hybridcache.fp8_format import BLOCK, CHANNEL, Fp8Format
from hybridcache.models.loader import is_stacked_experts
from hybridcache.models.quant import keeps_dtype

FORMATS = {"block": BLOCK, "channel": CHANNEL, "modelopt": CHANNEL}
INPUT_SCALE = 0.01  # the static activation scale "modelopt" folders hold (never read: activations are per token)
MODELOPT_GROUP = {"weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                  "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"}}
_LAYER = re.compile(r"^(?P<stem>.*\.layers\.)(?P<index>\d+)\.(?P<rest>.+)$")


def quantized_config(fmt: Fp8Format, kept: list[str]) -> dict:
    """The `quantization_config` of a folder in `fmt` whose linears `kept` stay dense."""
    if fmt.kind == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(fmt.block), "modules_to_not_convert": kept}
    scheme = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                          "dynamic": False, "group_size": None, "block_structure": None, "actorder": None,
                          "observer": "minmax", "observer_kwargs": {}},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                    "dynamic": True, "group_size": None, "block_structure": None, "actorder": None,
                                    "observer": None, "observer_kwargs": {}},
              "output_activations": None, "targets": ["Linear"], "format": "float-quantized"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": kept, "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}}


def modelopt_config(kept: list[str]) -> dict:
    """The `quantization_config` of a "modelopt" folder (config.json's flat ModelOpt spelling) whose linears `kept`
    stay dense."""
    return {"quant_method": "modelopt", "quant_algo": "FP8", "producer": {"name": "modelopt", "version": "0.39.0"},
            "config_groups": {"group_0": MODELOPT_GROUP}, "ignore": kept,
            "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}


def attention_modules(names: list[str]) -> list[str]:
    """The attention layers of a checkpoint (tensor names): the modules holding a `k_proj` and a `q_proj`."""
    return sorted(name[: -len(".k_proj.weight")] for name in names
                  if name.endswith(".k_proj.weight") and name.replace(".k_proj.", ".q_proj.") in names)


def modelopt_dense(names: list[str]) -> set[str]:
    """The linears (module names) NVIDIA's selective FP8 recipe keeps dense beyond `keeps_dtype` (module
    docstring): every attention layer's, the Mamba2 layer's just before it (`in_proj`, `out_proj`), the MoE latent
    projections."""
    dense = set()
    for attention in attention_modules(names):
        dense |= {f"{attention}.{proj}" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")}
        layer = _LAYER.match(attention)
        if layer is not None:
            before = f"{layer['stem']}{int(layer['index']) - 1}.{layer['rest']}"
            dense |= {f"{before}.{proj}" for proj in ("in_proj", "out_proj") if f"{before}.{proj}.weight" in names}
    return dense | {name[: -len(".weight")] for name in names if name.endswith(("_latent_proj.weight",))}


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (weight [N, K] e4m3, scale [] fp32): one scale for the tensor, its largest |value| at 448 (the
    per-channel quantisation of W as one row)."""
    q, scale = kernel_backend.fp8_quantize(weight.reshape(1, -1), CHANNEL)
    return q.reshape(weight.shape), scale.reshape(())


DENSE_PREFIXES = ("model.visual.",)  # the vision tower: Qwen's FP8 VL releases keep it dense, as vision_loader reads it


def is_quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """A linear layer's 2-D weight that the FP8 folders quantise (not the vision tower's: `DENSE_PREFIXES`)."""
    return (name.endswith(".weight") and tensor.dim() == 2 and not _embedding(name)
            and not name.startswith(DENSE_PREFIXES) and not keeps_dtype(name[: -len(".weight")]))


def _embedding(name: str) -> bool:
    """The input embedding (`embed_tokens`, Nemotron-H's `backbone.embeddings`)."""
    return "embed_tokens" in name or name.endswith(".embeddings.weight")


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: Fp8Format, kind: str = "",
                     kv_scales: Mapping[str, tuple[float, float]] | None = None
                     ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A dense state dict -> (the FP8 one in `fmt` (`kind` "modelopt": that layout, module docstring), the linear
    weights kept dense, as module names). `kv_scales`: "modelopt" attention module -> (k_scale, v_scale)."""
    out: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    names = list(tensors)
    dense = modelopt_dense(names) if kind == "modelopt" else set()
    for name, tensor in tensors.items():
        module = name[: -len(".weight")]
        if is_quantized_weight(name, tensor) and module not in dense:
            weight, scale = quantize_per_tensor(tensor) if kind == "modelopt" else kernel_backend.fp8_quantize(
                tensor, fmt)
            out[name], out[f"{module}.{fmt.scale_name}"] = weight.contiguous(), scale.contiguous()
            if kind == "modelopt":
                out[f"{module}.input_scale"] = torch.tensor(INPUT_SCALE)
        elif kind == "channel" and tensor.dim() == 3 and is_stacked_experts(name):  # per expert, per row
            weight, scale = zip(*(kernel_backend.fp8_quantize(expert, fmt) for expert in tensor), strict=True)
            out[name], out[f"{module}.{fmt.scale_name}"] = torch.stack(weight), torch.stack(scale)
        else:
            out[name] = tensor
            if name.endswith(".weight") and (tensor.dim() == 2 or is_stacked_experts(name)) and not _embedding(name):
                kept.append(module)
    if kind == "modelopt":
        for attention in attention_modules(names):
            k_scale, v_scale = (kv_scales or {}).get(attention, (1.0, 1.0))
            out[f"{attention}.k_proj.k_scale"] = torch.tensor(float(k_scale))
            out[f"{attention}.v_proj.v_scale"] = torch.tensor(float(v_scale))
    return out, kept


def write_fp8_folder(dense_dir: str | Path, out_dir: str | Path, kind: str,
                     kv_scales: Mapping[str, tuple[float, float]] | None = None) -> Path:
    """Write the FP8 (`kind` "block", "channel" or "modelopt") twin of the dense model folder `dense_dir` to
    `out_dir`; `kv_scales` ("modelopt"): attention module (checkpoint name) -> (k_scale, v_scale), else 1.0."""
    from safetensors.torch import load_file, save_file

    if kind not in FORMATS:
        raise ValueError(f"FP8 folder format {kind!r} unknown; choose one of {sorted(FORMATS)}")
    fmt = FORMATS[kind]
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = sorted(dense_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {dense_dir}")
    kept: list[str] = []
    weight_map: dict[str, str] = {}
    for file in files:
        tensors, file_kept = quantize_tensors(load_file(str(file)), fmt, kind, kv_scales)
        kept += file_kept
        save_file(tensors, str(out_dir / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file.name))
    if (dense_dir / "model.safetensors.index.json").is_file():
        (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for other in dense_dir.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(other, out_dir / other.name)
    config = json.loads((dense_dir / "config.json").read_text())
    kept = sorted(kept)
    config["quantization_config"] = modelopt_config(kept) if kind == "modelopt" else quantized_config(fmt, kept)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
