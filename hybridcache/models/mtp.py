"""The multi-token-prediction (MTP) head of Qwen3-Next and Qwen3.5 (dense and MoE), and its loading.

Checkpoint tensors (vLLM's `qwen3_next_mtp.py` / `qwen3_5_mtp.py` read the same names; transformers has no MTP)::

    mtp.pre_fc_norm_embedding.weight   [H]        zero-centred RMSNorm of the next token's embedding
    mtp.pre_fc_norm_hidden.weight      [H]        zero-centred RMSNorm of the target model's final hidden state
    mtp.fc.weight                      [H, 2H]    over cat(normed embedding, normed hidden)
    mtp.layers.{i}.*                              a full-attention decoder layer with its own KV (MoE where the
                                                  model's layer i would be: `ModelConfig.is_moe_layer(i)`)
    mtp.norm.weight                    [H]        the final norm; logits through the target's lm_head

The embedding and the lm_head are the target model's (under tensor parallelism the rank's own: its replicated
embedding and its vocabulary rows of the lm_head, whose logits `HybridCausalLM._logits` all-gathers). Config:
`mtp_num_hidden_layers` (Qwen3.5) or `num_nextn_predict_layers` (Qwen3-Next); the loader takes the layer count from
the tensors and checks it.

`load_format="dummy"` (the engine's load format applies to the head, as vLLM's drafter takes the engine's load
config): no tensor is read, the layer count is config.json's and the weights are drawn on the device as the target's
dummy weights are (`randomize_`, seed `DUMMY_SEED`: the head `write_random_mtp(seed=0)` writes; FP8 linears as the
target's dummy ones). Under tensor parallelism each rank draws every full tensor of the one-rank head in
`randomize_`'s order and keeps its shard (as `models/loader.py` does for the target), so the ranks hold exactly
the one-rank dummy head's shards.

A row of the head at position p reads the token at p + 1 and the target's hidden state at p and proposes the
token at p + 2; its layer's KV at p lives in the KV pool like any attention layer's (one more layer of the
pool, after the target's). A further draft step feeds the head's own output hidden state back with the draft it
proposed, one position on (`draft_step`).

Tensor parallel (`MtpHead(config, num_layers, tp)`): the decoder layer is split as the target's layers are (its
attention's q heads and the kv heads they read, its MLP's or experts' intermediate dim; outputs all-reduced, so the
hidden state is whole and equal on every rank), `fc` and the norms are replicated; `shards()` names the split
parameters and `load_mtp_head`, given a target loaded with `tp`, reads only the rank's part of each, as the
target's loader does.

FP8 checkpoints: the head's linears with a scale beside their weight load as `Fp8Linear`s in the folder's format,
split under tensor parallelism as the target's are (`load_mtp_head`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridcache.forward_batch import ForwardBatch
from hybridcache.fp8_format import Fp8Format
from hybridcache.kernels.backend import KernelBackend
from hybridcache.layers.attention import GatedAttention
from hybridcache.layers.mlp import MLP, SparseMoeBlock
from hybridcache.layers.norm import ZeroCenteredRMSNorm
from hybridcache.layers.parallel import UNSHARDED, Shard, TensorParallel
from hybridcache.layers.rotary import batch_cos_sin
from hybridcache.layers.step import StepContext
from hybridcache.models.config import ModelConfig
from hybridcache.models.config.fields import read_json_object
from hybridcache.models.hybrid_lm import DecoderLayer, HybridCausalLM
from hybridcache.state_spec import AttentionSpec, LayerState

MTP_PREFIX = "mtp."
MTP_FILE = "mtp.safetensors"
_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
# config.json keys that count the MTP layers (Qwen3.5, Qwen3-Next)
MTP_LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
# The text model types whose MTP heads this module builds
MTP_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# The model types with MTP layers of another design, refused as such (Nemotron 3's, `num_nextn_predict_layers`); the
# other model types have no MTP layers at all (Granite-4.0-H, Bamba, Falcon-H1, Jamba)
OTHER_MTP_MODEL_TYPES = ("nemotron_h",)
# the seed of a random head (`write_random_mtp` adds it to its seed; `load_format="dummy"` draws with it)
DUMMY_SEED = 7919


def check_mtp_model_type(config: ModelConfig) -> None:
    """ValueError naming the architecture unless this module builds its MTP head (a model type of `MTP_MODEL_TYPES`):
    for a model type whose MTP layers are another design (`OTHER_MTP_MODEL_TYPES`) it says so, for any other that the
    model has none."""
    if config.model_type in MTP_MODEL_TYPES:
        return
    if config.model_type in OTHER_MTP_MODEL_TYPES:
        raise ValueError(f"speculative method 'mtp' is not supported for {config.architecture}: this head is "
                         f"Qwen3.5's / Qwen3-Next's (model_type {', '.join(MTP_MODEL_TYPES)}), not the MTP "
                         f"layers of model_type {config.model_type!r}")
    raise ValueError(f"speculative method 'mtp' needs a model with MTP layers; {config.architecture} has none "
                     f"(model_type {config.model_type!r})")


class MtpHead(nn.Module):
    """`num_layers` MTP layers (the head uses layer `step % num_layers` at draft step `step`, as vLLM does).
    Parameter names are the checkpoint's without the `mtp.` prefix. `tp`: this rank's shard (module docstring)."""

    def __init__(self, config: ModelConfig, num_layers: int = 1, tp: TensorParallel = UNSHARDED) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"an MTP head has at least one layer, got {num_layers}")
        check_mtp_model_type(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.tp = tp
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(_mtp_layer(config, i, tp) for i in range(num_layers))
        self.norm = ZeroCenteredRMSNorm(hidden, eps=eps)
        self.eval()
        self.requires_grad_(False)

    def shards(self) -> dict[str, Shard]:
        """Parameter name -> the part of the full checkpoint tensor (`mtp.` + name) this rank holds, in the order
        held ({} unsharded); parameters not named are read whole (fc, the norms)."""
        out = {}
        for prefix, module in self.named_modules():
            if module is not self and hasattr(module, "shards"):
                out.update({f"{prefix}.{name}": shard for name, shard in module.shards().items()})
        return out

    def state_specs(self, dtype: torch.dtype) -> tuple[AttentionSpec, ...]:
        """One attention KV spec per MTP layer (appended to the target's layer specs in the pools; under tensor
        parallelism the rank's kv heads)."""
        return tuple(layer.mixer.state_spec(dtype, dtype) for layer in self.layers)

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, target_hidden: torch.Tensor, batch: ForwardBatch,
                kv: tuple[LayerState, ...], backend: KernelBackend, step: int = 0) -> torch.Tensor:
        """embeds [T, H] (the embedding of the token after each row's position), target_hidden [T, H] (the
        final-norm hidden state at each row's position), `batch` the rows (prepared by `backend.prepare`; its
        KV writes go to the MTP layers' pools `kv`) -> the head's final-norm hidden state [T, H]. A row at position
        p rotates as the target's row at p does: by `batch.rope_positions` (M-RoPE) where the batch has them (a
        sequence with images), else by `batch.positions`."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds, backend), self.pre_fc_norm_hidden(target_hidden, backend)],
                      dim=-1)
        hidden = self.fc(x)
        rope = batch_cos_sin(batch, self.config.attention, hidden.dtype)  # the target's rotation of these rows
        index = step % len(self.layers)
        hidden = self.layers[index](hidden, StepContext(batch=batch, backend=backend, rope=rope), kv[index])
        return self.norm(hidden, backend)


def _mtp_layer(config: ModelConfig, layer_id: int, tp: TensorParallel) -> DecoderLayer:
    attention, mlp = config.attention, config.mlp
    mixer = GatedAttention(config.hidden_size, num_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads,
                           head_dim=attention.head_dim, bias=attention.bias, eps=config.rms_norm_eps, tp=tp)
    if config.is_moe_layer(layer_id):
        ffn: nn.Module = SparseMoeBlock(
            config.hidden_size, num_experts=mlp.num_experts, top_k=mlp.num_experts_per_tok,
            moe_intermediate_size=mlp.moe_intermediate_size,
            shared_expert_intermediate_size=mlp.shared_expert_intermediate_size, norm_topk_prob=mlp.norm_topk_prob,
            tp=tp,
        )
    else:
        ffn = MLP(config.hidden_size, mlp.intermediate_size, tp)
    return DecoderLayer("self_attn", mixer, ffn, config.hidden_size, config.rms_norm_eps)


def mtp_tensor_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every `mtp.*` tensor of a model folder (safetensors headers only)."""
    from hybridcache.models.loader import _read_headers, safetensors_files

    shapes = _read_headers(safetensors_files(model_dir))[1]
    return {name: shape for name, shape in shapes.items() if name.startswith(MTP_PREFIX)}


def declared_mtp_layers(model_dir: str | Path) -> int | None:
    """The MTP layer count config.json declares (`MTP_LAYER_KEYS`, in its `text_config` where it has one); None
    when it names none."""
    raw = read_json_object(Path(model_dir) / "config.json")
    text = raw.get("text_config") or raw
    declared = next((text[key] for key in MTP_LAYER_KEYS if text.get(key) is not None), None)
    return None if declared is None else int(declared)


def mtp_num_layers(model_dir: str | Path, shapes: dict[str, tuple[int, ...]] | None = None, *,
                   load_format: str = "auto") -> int:
    """The MTP layer count of a model folder (from its `mtp.*` tensors, `shapes` when already read); ValueError
    when it has none or when config.json declares another count (headers and config.json only). With
    `load_format="dummy"` (no tensors read) config.json's count; ValueError when it declares none."""
    model_dir = Path(model_dir)
    if load_format == "dummy":
        declared = declared_mtp_layers(model_dir)
        if declared is None or declared < 1:
            keys = " or ".join(MTP_LAYER_KEYS)
            raise ValueError(f"{model_dir / 'config.json'} declares {'no' if declared is None else declared} MTP "
                             f"layers ({keys}): speculative method 'mtp' with load_format 'dummy' draws the head "
                             "config.json describes")
        return declared
    shapes = mtp_tensor_shapes(model_dir) if shapes is None else shapes
    if not shapes:
        raise ValueError(f"{model_dir} has no mtp.* tensors: speculative method 'mtp' needs the model's MTP head")
    num_layers = 1 + max((int(m[1]) for m in map(_LAYER.match, shapes) if m), default=-1)
    declared = declared_mtp_layers(model_dir)
    if declared is not None and declared != num_layers:
        raise ValueError(f"config.json declares {declared} MTP layers, the checkpoint holds {num_layers}")
    return num_layers


def load_mtp_head(model_dir: str | Path, target: HybridCausalLM, *, dtype: torch.dtype,
                  device: torch.device | str, quantization: str | None = None, kv_fp8: bool = False,
                  load_format: str = "auto") -> MtpHead:
    """The MTP head of a model folder, in `dtype` on `device`, for the loaded `target` (whose config it takes, and
    its `tp`: under tensor parallelism the rank's shard of the head, reading only the rank's part of each split
    tensor, checked against the full head's shapes).

    FP8 heads load as the target's FP8 linears do (`models/loader.py`): the format is config.json's
    `quantization_config` (block `weight_scale_inv` or per-channel `weight_scale`), and the head's FP8 linears are
    exactly those `mtp.*` weights with a scale beside them (`quant.fp8_modules`: checkpoints keep some of the head
    dense, e.g. its router gates), which become `Fp8Linear`s (FP8 weight, fp32 scale, whatever `dtype` is); under
    tensor parallelism each scale's part follows its weight's (`loader.checkpoint_shards`). `quantization="fp8"`
    on a checkpoint without a quantization_config quantises the head's linears after they are read, as
    `load_model` does the target's (all but `quant.keeps_dtype`: the router gates; each rank its own shard).
    `kv_fp8`: the head's attention stores FP8 KV as the target's does (`quant.set_kv_fp8`, with the folder's
    `mtp.*.k_scale` / `v_scale` where it has them), so that its KV shares the target's pool tensor.

    `load_format="dummy"` (the target's): no tensor is read; config.json's layer count, random weights drawn on
    `device` (module docstring; FP8 linears where the target's dummy model has them: config.json's format, else the
    block format under `quantization`), KV scales 1.

    Raises `ValueError` when the folder has no `mtp.*` tensors, when config.json's layer count disagrees with
    them, on float8 `mtp.*` tensors without their scale (or without a quantization_config), on a scale beside a
    dense weight, on a block split that cuts a scale block, or (through the loader's rules: names, shapes,
    per-expert or stacked experts) on any missing, unexpected or mis-shaped tensor. Only `mtp.*` tensors are
    read; the target's loading ignores them (with `load_format="dummy"`: ValueError when config.json declares no
    MTP layers)."""
    from safetensors import safe_open

    from hybridcache.models import quant
    from hybridcache.models.loader import LOAD_FORMATS, _dummy_format, checkpoint_shards
    from hybridcache.models.loader import _copy_one as copy_parameter

    model_dir = Path(model_dir)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; choose one of {LOAD_FORMATS}")
    if load_format == "dummy":
        fmt = _dummy_format(quant.checkpoint_format(quant.read_quantization_config(model_dir)), quantization)
        head = _dummy_head(target, mtp_num_layers(model_dir, load_format="dummy"), fmt, dtype, device)
        return quant.set_kv_fp8(head, kv_fp8, {}).eval()
    planned = _plan_head(model_dir, target.config, target.tp, dtype=dtype, kv_fp8=kv_fp8)
    location, plan, fmt, kv_scales = planned.location, planned.plan, planned.fmt, planned.kv_scales
    shards = checkpoint_shards(planned.head, planned.full)
    head = planned.head.to_empty(device=device)
    handles = {file: safe_open(str(file), framework="pt", device="cpu") for file in set(location.values())}
    params = dict(head.named_parameters())

    def read(checkpoint_name: str, index: tuple) -> torch.Tensor:
        name = MTP_PREFIX + checkpoint_name
        return handles[location[name]].get_slice(name)[index]

    with torch.no_grad():
        for target_name, source in plan.items():
            copy_parameter(params[target_name], shards.get(target_name), source, read)
    if quantization == "fp8" and fmt is None:
        quant.quantize_linears_(head, quant.quantizable_linears(head))
    return quant.set_kv_fp8(head, kv_fp8, kv_scales).eval()


@dataclass(frozen=True)
class _HeadPlan:
    """What `load_mtp_head` reads, planned from the safetensors headers and config.json alone: the `mtp.*` tensors'
    files (`location`), the meta one-rank head (`full`) and this rank's (`head`, `full` itself unsharded), the
    parameter name -> checkpoint source `plan`, the folder's FP8 format and the KV scales (read only with kv_fp8)."""

    location: dict[str, Path]
    full: MtpHead
    head: MtpHead
    plan: dict[str, Any]
    fmt: Fp8Format | None
    kv_scales: dict[str, float]


def _plan_head(model_dir: Path, config: ModelConfig, tp: TensorParallel, *, dtype: torch.dtype,
               kv_fp8: bool) -> _HeadPlan:
    """The header-only part of `load_mtp_head` (its ValueErrors, every tensor named as the checkpoint names it:
    `mtp.fc.weight`), on meta-device heads."""
    from hybridcache.models import quant
    from hybridcache.models.loader import (
        _read_headers,
        check_float_dtypes,
        plan_weights_for,
        pop_kv_scales,
        safetensors_files,
    )

    location, shapes, dtypes = _read_headers(safetensors_files(model_dir))
    location = {name: file for name, file in location.items() if name.startswith(MTP_PREFIX)}
    shapes = {name: shape for name, shape in shapes.items() if name in location}
    kv_scales = pop_kv_scales(shapes, location, kv_fp8, lambda name: name[len(MTP_PREFIX):])
    num_layers = mtp_num_layers(model_dir, shapes)
    fmt = quant.checkpoint_format(quant.read_quantization_config(model_dir))
    fp8 = _fp8_head_linears(fmt, {name: dtypes[name] for name in location})
    with torch.device("meta"):
        full = MtpHead(config, num_layers).to(dtype=dtype)
        head = full if tp.size == 1 else MtpHead(config, num_layers, tp).to(dtype=dtype)
    for module in {id(full): full, id(head): head}.values():
        quant.convert_linears(module, fp8)
    plan = plan_weights_for(full, {name[len(MTP_PREFIX):]: shape for name, shape in shapes.items()},
                            owner="the MTP head", name_prefix=MTP_PREFIX)
    check_float_dtypes({MTP_PREFIX + source.checkpoint_name for source in plan.values()}, dtypes, location)
    return _HeadPlan(location, full, head, plan, fmt, kv_scales)


def check_mtp_head(model_dir: str | Path, tp: TensorParallel = UNSHARDED, *, load_format: str = "auto",
                   kv_fp8: bool = False) -> None:
    """Raise the ValueError `load_mtp_head` would (no MTP tensors, a layer count config.json disagrees with, a
    missing, unexpected or mis-shaped `mtp.*` tensor, an FP8 head without scales, a head `tp` cannot split) from
    config.json and the safetensors headers alone: the engine calls it before the target model's weights load
    (minutes for a large checkpoint), on one rank as under tensor parallelism. With `load_format="dummy"`: only
    that config.json declares a head `tp` can split."""
    from hybridcache.models.loader import checkpoint_shards

    model_dir = Path(model_dir)
    config = ModelConfig.from_model_dir(model_dir)
    check_mtp_model_type(config)  # (before the tensors: a model type without this head needs none)
    if load_format == "dummy":
        with torch.device("meta"):
            MtpHead(config, mtp_num_layers(model_dir, load_format="dummy"), tp)
        return
    planned = _plan_head(model_dir, config, tp, dtype=torch.float32, kv_fp8=kv_fp8)
    if tp.size > 1:
        checkpoint_shards(planned.head, planned.full)


@torch.no_grad()
def _dummy_head(target: HybridCausalLM, num_layers: int, fmt: Fp8Format | None, dtype: torch.dtype,
                device: torch.device | str) -> MtpHead:
    """`load_format="dummy"`: the head of `num_layers` layers for `target` with random weights drawn on `device`
    (`randomize_`, seed `DUMMY_SEED`), its linears FP8 in `fmt` where it is not None (`quant.quantizable_linears`,
    as the target's dummy model). Under tensor parallelism (`target.tp`) the rank's shard of exactly the one-rank
    dummy head: every full tensor drawn in `randomize_`'s order (an FP8 weight quantised whole), one at a time, and
    read as a checkpoint tensor (`loader.dummy_checkpoint`, as for the target), so a block-scaled split refuses
    what an FP8 checkpoint's would."""
    from hybridcache.models import quant
    from hybridcache.models.loader import _copy_one, checkpoint_shards, dummy_checkpoint, plan_weights_for
    from hybridcache.models.random_weights import randomize_

    with torch.device("meta"):
        full = MtpHead(target.config, num_layers).to(dtype=dtype)
        head = full if target.tp.size == 1 else MtpHead(target.config, num_layers, target.tp).to(dtype=dtype)
    if fmt is not None:
        for module in {id(full): full, id(head): head}.values():
            quant.convert_linears(module, dict.fromkeys(quant.quantizable_linears(module), fmt))
    shards = checkpoint_shards(head, full)
    plan = plan_weights_for(full, {name: tuple(p.shape) for name, p in full.named_parameters()},
                            owner="the MTP head")
    head = head.to_empty(device=device)
    if target.tp.size == 1:
        randomize_(head, seed=DUMMY_SEED, draw_device=device)
        return head
    params = dict(head.named_parameters())
    for name, value in dummy_checkpoint(full, seed=DUMMY_SEED, device=device):
        _copy_one(params[name], shards.get(name), plan[name], lambda _, i, v=value: v[i])
    return head


def _fp8_head_linears(fmt: Fp8Format | None, dtypes: dict[str, str]) -> dict[str, Fp8Format]:
    """The head's module name -> `fmt` (the folder's FP8 format) for every linear whose weight is FP8 in the folder
    (`dtypes`: the head's tensors, as the checkpoint names them -> safetensors dtype); ValueError naming them with
    their `mtp.` prefix when its float8 tensors are not exactly those weights (`quant.check_fp8_dtypes`, as for the
    target's tensors)."""
    from hybridcache.models import quant

    names = quant.fp8_modules(dtypes, fmt) if fmt is not None else []
    try:
        quant.check_fp8_dtypes(dtypes, names)
    except ValueError as error:
        raise ValueError(f"the MTP head (mtp.*): {error}") from None
    return dict.fromkeys((name[len(MTP_PREFIX):] for name in names), fmt)


def write_random_mtp(model_dir: str | Path, seed: int = 0, num_layers: int = 1, *,
                     dtype: torch.dtype = torch.float32, draw_device: torch.device | str = "cpu") -> Path:
    """Give a model folder a random MTP head (weights at std 1/sqrt(fan_in), like the random test models; drawn
    on `draw_device`, stored in `dtype`):
    `mtp.safetensors` beside its weights (added to the index of a sharded folder) and the layer count in
    config.json under the family's key. Returns the folder."""
    from safetensors.torch import save_file

    from hybridcache.models.random_weights import randomize_

    model_dir = Path(model_dir)
    config = ModelConfig.from_model_dir(model_dir)
    with torch.device("meta"):
        head = MtpHead(config, num_layers)
    head = head.to_empty(device=draw_device)
    randomize_(head, seed=seed + DUMMY_SEED, draw_device=draw_device)
    tensors = {MTP_PREFIX + name: p.detach().to(dtype).cpu().contiguous() for name, p in head.named_parameters()}
    save_file(tensors, str(model_dir / MTP_FILE))
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: MTP_FILE for name in tensors})
        index.write_text(json.dumps(data, indent=2))
    raw_path = model_dir / "config.json"
    raw = json.loads(raw_path.read_text())
    text = raw.get("text_config") or raw
    text[MTP_LAYER_KEYS[1] if config.model_type == "qwen3_next" else MTP_LAYER_KEYS[0]] = num_layers
    raw_path.write_text(json.dumps(raw, indent=2))
    return model_dir
