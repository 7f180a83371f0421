"""Loading the vision tower (`model.visual.*` tensors) of a multimodal model folder into `VisionTower`.

Kept apart from `hybridcache.models.loader` (which builds the language model and skips `model.visual.`): every
tensor named `model.visual.X` must match our parameter `X` in name and shape, every parameter must be present, and
tensors under other prefixes are ignored. A mismatch raises ValueError naming the tensors, before any weight
memory is taken. `load_format="dummy"` (as the language model's loader) reads no tensors: random weights are
drawn on the device (`randomize_`, seed 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from hybridcache.models.config.fields import read_json_object
from hybridcache.models.vision import VisionTower
from hybridcache.models.vision_config import VisionConfig

PREFIX = "model.visual."


def _plan(tower: VisionTower, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """Our parameter name -> checkpoint name; ValueError on a missing, unexpected or mis-shaped tensor."""
    expected = {name: tuple(p.shape) for name, p in tower.named_parameters()}
    plan, problems = {}, []
    for raw_name, shape in shapes.items():
        if not raw_name.startswith(PREFIX):
            continue
        name = raw_name[len(PREFIX):]
        if name not in expected:
            problems.append(f"unexpected tensor {raw_name!r} with shape {list(shape)}")
        elif tuple(shape) != expected[name]:
            problems.append(f"shape mismatch for tensor {raw_name!r}: checkpoint {list(shape)}, "
                            f"model {list(expected[name])}")
        else:
            plan[name] = raw_name
    problems += [f"missing tensor {PREFIX + name!r} (model shape {list(shape)})"
                 for name, shape in expected.items() if name not in plan]
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(f"checkpoint does not match the vision tower:\n  {shown}{more}")
    return plan


@torch.no_grad()
def load_vision_weights(tower: VisionTower, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy in-memory tensors (full checkpoint names, e.g. a transformers model's `state_dict()`) into `tower`."""
    plan = _plan(tower, {name: tuple(t.shape) for name, t in tensors.items()})
    if integral := sorted(name for name in plan.values() if not tensors[name].is_floating_point()):
        raise ValueError(f"tensor {integral[0]!r} has dtype {tensors[integral[0]].dtype}; a weight must be a float "
                         "tensor")
    params = dict(tower.named_parameters())
    for name, source in plan.items():
        params[name].copy_(tensors[source])


def has_vision_tower(model_dir: str | Path) -> bool:
    """Whether the folder's config.json has a `vision_config` (`load_vision_tower` then loads a tower)."""
    return VisionConfig.from_dict(read_json_object(Path(model_dir) / "config.json")) is not None


def load_vision_tower(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    load_format: str = "auto",
) -> VisionTower | None:
    """The folder's vision tower in eval mode, parameters in `dtype` on `device`, attending with the device's
    default encoder attention ("flash_varlen" on CUDA in fp16 / bf16, else "reference"); None
    when config.json has no `vision_config` (a text model)."""
    model_dir = Path(model_dir)
    config = VisionConfig.from_dict(read_json_object(model_dir / "config.json"))
    if config is None:
        return None
    with torch.device("meta"):
        tower = VisionTower(config)
    if load_format == "dummy":
        from hybridcache.models.random_weights import randomize_

        tower = tower.to(dtype=dtype).to_empty(device=device)
        randomize_(tower, seed=0, draw_device=device)
    else:
        tower = _read_weights(tower, model_dir, dtype, device)
    tower.use_attention(None)
    return tower.eval()


def _read_weights(tower: VisionTower, model_dir: Path, dtype: torch.dtype, device: torch.device | str) -> VisionTower:
    """The meta-device `tower` materialised on `device` in `dtype` with the folder's `model.visual.*` tensors."""
    from safetensors import safe_open

    from hybridcache.models.loader import _read_headers, check_float_dtypes, safetensors_files

    location, shapes, dtypes = _read_headers(safetensors_files(model_dir))
    location = {name: file for name, file in location.items() if name.startswith(PREFIX)}
    plan = _plan(tower, {name: shapes[name] for name in location})
    check_float_dtypes(plan.values(), dtypes, location)
    tower = tower.to(dtype=dtype).to_empty(device=device)
    params = dict(tower.named_parameters())
    handles = {file: safe_open(str(file), framework="pt", device="cpu") for file in set(location.values())}
    with torch.no_grad():
        for name, source in plan.items():
            params[name].copy_(handles[location[source]].get_tensor(source))
    return tower
