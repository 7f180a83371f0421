"""Write FP8 model folders from dense ones, in the two formats the loader reads (tests and benchmarks).

    write_fp8_folder(dense_dir, out_dir, "block")     Qwen's fine-grained FP8 (`quant_method: fp8`)
    write_fp8_folder(dense_dir, out_dir, "channel")   compressed-tensors FP8_DYNAMIC (per-channel weights)

Every 2-D `X.weight` of a linear layer is quantised (`kernels/gemm/reference.py::quantize`) except those Qwen's FP8
checkpoints keep dense (`quant.keeps_dtype`: lm_head, the router and shared-expert gates, DeltaNet's in_proj_a/b/ba),
the embedding and a VL folder's vision tower (`model.visual.*`, dense in Qwen's FP8 VL releases and read dense by
`vision_loader.py`); `X.weight_scale_inv` (block) or `X.weight_scale` (channel) is written beside it, and
`config.json` gets the matching `quantization_config` (with the kept modules in `modules_to_not_convert` or
`ignore`). Other files (tokenizer, generation config) are copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import hybridcache.kernels.backend as kernel_backend
from hybridcache.fp8_format import BLOCK, CHANNEL, Fp8Format
from hybridcache.models.quant import keeps_dtype

FORMATS = {"block": BLOCK, "channel": CHANNEL}


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


DENSE_PREFIXES = ("model.visual.",)  # the vision tower: Qwen's FP8 VL releases keep it dense, as vision_loader reads it


def is_quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """A linear layer's 2-D weight that the FP8 folders quantise (not the vision tower's: `DENSE_PREFIXES`)."""
    return (name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name
            and not name.startswith(DENSE_PREFIXES) and not keeps_dtype(name[: -len(".weight")]))


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: Fp8Format) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A dense state dict -> (the FP8 one, the 2-D linear weights kept dense, as module names)."""
    out: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    for name, tensor in tensors.items():
        if is_quantized_weight(name, tensor):
            weight, scale = kernel_backend.fp8_quantize(tensor, fmt)
            module = name[: -len(".weight")]
            out[name] = weight.contiguous()
            out[f"{module}.{fmt.scale_name}"] = scale.contiguous()
        else:
            out[name] = tensor
            if name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name:
                kept.append(name[: -len(".weight")])
    return out, kept


def write_fp8_folder(dense_dir: str | Path, out_dir: str | Path, kind: str) -> Path:
    """Write the FP8 (`kind` "block" or "channel") twin of the dense model folder `dense_dir` to `out_dir`."""
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
        tensors, file_kept = quantize_tensors(load_file(str(file)), fmt)
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
    config["quantization_config"] = quantized_config(fmt, sorted(kept))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
