"""Loading a Hugging Face model folder (config.json + *.safetensors) into our model classes.

Tensor name rules, applied to every checkpoint tensor in this order:

1. ignored: names starting with `mtp.` (the multi-token-prediction head: `models/mtp.py` loads it, on demand) or
   `model.visual.` (vision tower of the multimodal wrappers, loaded apart: `vision_loader.py`); and
   `lm_head.weight` when `tie_word_embeddings` is set (the embedding is used instead). As transformers does, a
   tied config whose checkpoint holds an `lm_head.weight` that differs from the embedding is not tied (a warning
   says so: both are loaded), and one whose checkpoint holds `lm_head.weight` without the embedding ties the
   embedding to it; and the tensors a model does without (`HybridCausalLM.drops_checkpoint_tensor`: Kimi Linear's
   zero-width shared expert, which transformers' `save_pretrained` writes for num_shared_experts 0);
2. renamed: `model.language_model.X` -> `model.X` (multimodal wrappers store the language model there);
   Nemotron-H's `backbone.X` -> `model.X`, and its `model.embeddings.weight` -> `model.embed_tokens.weight`,
   `model.norm_f.weight` -> `model.norm.weight` (`RENAMED_NAMES`, in either prefix), Bamba's, Falcon-H1's and Jamba's
   `model.final_layernorm.weight` -> `model.norm.weight`; Granite's
   MoE tensors as transformers renames them (`RENAMED_SUFFIXES`): `block_sparse_moe.input_linear.weight` ->
   `block_sparse_moe.experts.gate_up_proj`, `output_linear.weight` -> `experts.down_proj`, `router.layer.weight`
   -> `router.weight`; OLMo Hybrid's `attention_layer_norm.weight` -> `input_layernorm.weight`,
   `feedforward_layer_norm.weight` -> `post_attention_layernorm.weight` (as transformers' conversion mapping reads
   them; its `save_pretrained` writes them); LFM2's names onto the shared decoder layer's: `operator_norm` ->
   `input_layernorm`, `ffn_norm` -> `post_attention_layernorm`, `feed_forward.w1 / w3 / w2` ->
   `feed_forward.gate_proj / up_proj / down_proj`, `self_attn.out_proj` -> `self_attn.o_proj`,
   `self_attn.q_layernorm / k_layernorm` -> `self_attn.q_norm / k_norm`, and `model.embedding_norm.weight` (its final
   norm) -> `model.norm.weight`; LFM2-MoE's `feed_forward.expert_bias` -> `feed_forward.gate.e_score_correction_bias`
   and its experts `feed_forward.experts.{e}.w1 / w3 / w2` -> `feed_forward.experts.{e}.gate_proj / up_proj /
   down_proj` (`RENAMED_EXPERTS`; its router `feed_forward.gate.weight` and stacked experts keep their names);
   Kimi Linear's KDA gate under transformers' in-memory names, `self_attn.forget_gate.f_a_proj / f_b_proj / dt_bias
   / A_log` -> `self_attn.f_a_proj / ...` (the released checkpoints hold the latter), and its dense layers' MLP as
   transformers' `save_pretrained` writes it, `block_sparse_moe.gate_proj / up_proj / down_proj` -> `mlp.gate_proj /
   up_proj / down_proj`;
3. MoE experts are accepted in either form, mapped onto our per-expert modules:
   - per expert, as hub checkpoints and transformers 5.24 `save_pretrained` write them:
     `...mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj.weight` [I, H], `down_proj.weight` [H, I];
   - stacked, as transformers' in-memory modules hold them: `...mlp.experts.gate_up_proj` [E, 2I, H]
     (gate rows first, then up rows) and `...mlp.experts.down_proj` [E, H, I] (`block_sparse_moe.experts` and
     Jamba's and LFM2-MoE's `feed_forward.experts` too);
     Nemotron-H's ungated experts `...mixer.experts.up_proj` [E, I, H] and `...mixer.experts.down_proj` [E, H, I]
     (its checkpoints write them per expert, `mixer.experts.{e}.up_proj.weight`); a stacked FP8 weight's
     per-channel scale `<stacked>.weight_scale` [E, rows, 1] (Granite's `input_linear.weight_scale`) is split
     with it, each expert's part its linear's `weight_scale`;
4. row blocks of one parameter (`CONCATENATED_SUFFIXES`): OLMo Hybrid's `linear_attn.q_conv1d.weight`,
   `k_conv1d.weight` and `v_conv1d.weight` (as its checkpoints write them) are the rows of our
   `linear_attn.conv1d.weight`, in that order (transformers concatenates them the same way); the one tensor
   `linear_attn.conv1d.weight` (transformers' in-memory name) loads too; Kimi Linear's KDA layers' `self_attn.q_conv1d`
   / `k_conv1d` / `v_conv1d` alike, into `self_attn.conv1d.weight` (under tensor parallelism the blocks are read
   whole and the rank's rows taken from their concatenation: they are small convolution weights);
5. every other name must equal one of our parameter names exactly.

A missing tensor, an unexpected tensor, a shape mismatch, a parameter given twice (one name in two shards, `model.X`
beside `model.language_model.X`, per-expert beside stacked experts) or an integer / bool tensor where a float weight
is expected raises `ValueError` naming the tensor (and its file, its shapes or dtype); so does a shard or index that
cannot be read (naming the file). All checks read only safetensors headers, before any weight memory is allocated.

FP8 checkpoints (`hybridcache.models.quant`): the linears whose checkpoint weight has a scale beside it become
`Fp8Linear`s on the meta model before the checks (each expert's, for a stacked one), so their `weight`
(float8_e4m3fn) and scale are planned and copied like any parameter (UE8M0 block scales, float8_e8m0fnu, as their
fp32 values: exact; a per-tensor scale as that number on every row, a [N] one as [N, 1]:
`quant.channel_scale_shapes`); their static activation scales (`input_scale`) are not read
(`quant.pop_input_scales`); `quantization="fp8"`
quantises a dense checkpoint's linears after they are read (under tensor parallelism each rank its own shard).
`load_format="dummy"` reads no weights: random ones are drawn on the device (`randomize_`), FP8 linears quantised
from their draws (a benchmark model that no disk could hold). With tensor parallelism each rank draws every full
tensor of the one-rank model in `randomize_`'s order (an FP8 weight quantised whole, as `randomize_` does) and
reads its shard of it as of a checkpoint tensor, so the ranks hold exactly the one-rank dummy model's shards.

Tensor parallel (`tp`): the checks run against the full model's shapes (`one_rank_twin`); then each of our
parameters named in `checkpoint_shards` is read as the rank's ranges of its checkpoint tensor only (safetensors
`get_slice`), the others whole, and a shard's padding rows are zeroed. `checkpoint_shards` is `model.shards()` plus
each FP8 scale's part, which follows its weight's (`quant.scale_shard`: a block-scaled weight must be split on
whole blocks, else ValueError naming the linear). Unsharded, it names only the parameters a layer keeps in another
row order than the checkpoint's (Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, ungrouped, and their scales), read
through the same ranges. A tied lm_head is the rank's rows of the embedding tensor. `check_split` runs the same
checks from config.json and the headers alone (a tensor-parallel engine, before any worker starts).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

import hybridcache.kernels.backend as kernel_backend
from hybridcache.layers.parallel import UNSHARDED, Shard, TensorParallel
from hybridcache.models import quant
from hybridcache.models.config import ModelConfig
from hybridcache.models.config.fields import read_json_object
from hybridcache.models.hybrid_lm import HybridCausalLM
from hybridcache.models.registry import get_model_class

LOAD_FORMATS = ("auto", "dummy")
IGNORED_PREFIXES = ("mtp.", "model.visual.")
RENAMED_PREFIXES = (("model.language_model.", "model."), ("backbone.", "model."))
# Whole names, after the prefixes (Nemotron-H's embedding and final norm; Bamba's, Falcon-H1's, Jamba's and LFM2's
# final norm)
RENAMED_NAMES = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight",
                 "model.final_layernorm.weight": "model.norm.weight",
                 "model.embedding_norm.weight": "model.norm.weight"}
RENAMED_SUFFIXES = (  # Granite's MoE block (and its FP8 scales) and OLMo Hybrid's norms, as transformers' conversion
    # mapping renames them; LFM2's and Kimi Linear's names onto ours
    (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
    (".block_sparse_moe.input_linear.weight_scale", ".block_sparse_moe.experts.gate_up_proj.weight_scale"),
    (".block_sparse_moe.output_linear.weight_scale", ".block_sparse_moe.experts.down_proj.weight_scale"),
    (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight"),
    (".attention_layer_norm.weight", ".input_layernorm.weight"),
    (".feedforward_layer_norm.weight", ".post_attention_layernorm.weight"),
    # LFM2's layers (`models/lfm2.py`; its feed-forward block is `feed_forward`, as Jamba's and Bamba's)
    (".operator_norm.weight", ".input_layernorm.weight"),
    (".ffn_norm.weight", ".post_attention_layernorm.weight"),
    (".feed_forward.w1.weight", ".feed_forward.gate_proj.weight"),
    (".feed_forward.w3.weight", ".feed_forward.up_proj.weight"),
    (".feed_forward.w2.weight", ".feed_forward.down_proj.weight"),
    (".self_attn.out_proj.weight", ".self_attn.o_proj.weight"),
    (".self_attn.q_layernorm.weight", ".self_attn.q_norm.weight"),
    (".self_attn.k_layernorm.weight", ".self_attn.k_norm.weight"),
    (".feed_forward.expert_bias", ".feed_forward.gate.e_score_correction_bias"),  # (LFM2-MoE's router's bias)
    # Kimi Linear's KDA gate under transformers' in-memory names (the released checkpoints hold them directly)
    (".self_attn.forget_gate.f_a_proj.weight", ".self_attn.f_a_proj.weight"),
    (".self_attn.forget_gate.f_b_proj.weight", ".self_attn.f_b_proj.weight"),
    (".self_attn.forget_gate.dt_bias", ".self_attn.dt_bias"),
    (".self_attn.forget_gate.A_log", ".self_attn.A_log"),
    # (and its dense layers' MLP as transformers' `save_pretrained` writes it, block_sparse_moe for mlp)
    (".block_sparse_moe.gate_proj.weight", ".mlp.gate_proj.weight"),
    (".block_sparse_moe.up_proj.weight", ".mlp.up_proj.weight"),
    (".block_sparse_moe.down_proj.weight", ".mlp.down_proj.weight"),
)
# LFM2-MoE's experts one by one: feed_forward.experts.{e}.w1 / w3 / w2 -> feed_forward.experts.{e}.gate_proj /
# up_proj / down_proj
RENAMED_EXPERTS = (re.compile(r"\.feed_forward\.experts\.(?P<e>\d+)\.(?P<w>w[123])\.weight$"),
                   {"w1": ".feed_forward.experts.{}.gate_proj.weight", "w3": ".feed_forward.experts.{}.up_proj.weight",
                    "w2": ".feed_forward.experts.{}.down_proj.weight"})
# Our parameter -> the checkpoint tensors that are its row blocks, in order (OLMo Hybrid's and Kimi Linear's short
# convolutions)
CONCATENATED_SUFFIXES = {
    ".linear_attn.conv1d.weight": (".linear_attn.q_conv1d.weight", ".linear_attn.k_conv1d.weight",
                                   ".linear_attn.v_conv1d.weight"),
    # Kimi Linear's KDA layers (`models/kimi_linear.py`)
    ".self_attn.conv1d.weight": (".self_attn.q_conv1d.weight", ".self_attn.k_conv1d.weight",
                                 ".self_attn.v_conv1d.weight"),
}
# Stacked experts [E, ...] and their stacked FP8 scales (`<kind>.weight_scale` [E, rows, 1]: per channel)
_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.(?:mlp|block_sparse_moe|mixer|feed_forward)\.experts)\."
                              r"(?P<kind>gate_up_proj|up_proj|down_proj)(?:\.(?P<scale>weight_scale))?$")
_EMBEDDING = "model.embed_tokens.weight"
_logger = logging.getLogger(__name__)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)  # UE8M0 block scales' dtype (torch >= 2.7)


@dataclass(frozen=True)
class _Source:
    """Where one of our parameters comes from: a checkpoint tensor, optionally one expert's slice of it; or, with
    `more`, that tensor's rows followed by those of each tensor of `more` (each read whole, the rank's part taken
    from their concatenation: rule 4)."""

    checkpoint_name: str
    expert: int | None = None
    rows: tuple[int, int] | None = None  # row range inside the expert's matrix (gate / up halves)
    more: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every checkpoint tensor read."""
        return (self.checkpoint_name, *self.more)

    def indices(self, shard: Shard | None) -> list[tuple[int | slice, ...]]:
        """Index tuples into the checkpoint tensor whose results, concatenated along `shard.dim`, are our
        parameter (one tuple, the whole parameter, without a shard)."""
        lead: tuple[int | slice, ...] = () if self.expert is None else (self.expert,)
        first, last = self.rows if self.rows is not None else (0, None)
        if shard is None:
            return [lead + (slice(first, last),)]
        if shard.dim == 0:
            return [lead + (slice(first + start, first + stop),) for start, stop in shard.ranges]
        between = (slice(None),) * (shard.dim - 1)  # (Kimi's A_log [1, 1, H, 1] splits on dim 2)
        return [lead + (slice(first, last), *between, slice(start, stop)) for start, stop in shard.ranges]


def _shape(values: torch.Size | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def pop_kv_scales(shapes: dict[str, tuple[int, ...]], location: dict[str, Path], read: bool,
                  rename: Callable[[str], str]) -> dict[str, float]:
    """Take the per-layer FP8 KV scale tensors (`quant.is_kv_scale`) out of `shapes` (they are no weights), and
    the query scales (`quant.is_query_scale`, never read); with `read`, their values by `rename(checkpoint name)`
    (ModelOpt's `X.k_proj.k_scale` as `X.k_scale`: `quant.kv_scale_name`), else {}.

    A scale holds one number, or one per KV head (llm-compressor's `kv_cache_scheme.strategy: "attn_head"`,
    shape [num_kv_heads]); our attention layers scale a whole layer's K (V) by one number, so per-head scales
    are merged into their max, as vLLM does where its backend holds one scale per layer (compressed-tensors
    `process_weights_after_loading`), with one warning per call saying so. ValueError naming the tensor for an
    empty scale or one with a value that is not positive and finite."""
    from safetensors import safe_open

    for name in [name for name in shapes if quant.is_query_scale(name)]:
        del shapes[name]
    scales = {}
    per_head = []
    for name in [name for name in shapes if quant.is_kv_scale(name)]:
        shape = shapes.pop(name)
        if not read:
            continue
        with safe_open(str(location[name]), framework="pt") as handle:
            values = handle.get_tensor(name).float().reshape(-1)
        if values.numel() == 0:
            raise ValueError(f"checkpoint FP8 KV scale {name!r} in {location[name]} is empty (shape {list(shape)}); "
                             "it must hold one scale, or one per KV head")
        if not bool(torch.isfinite(values).all() and (values > 0).all()):
            raise ValueError(f"checkpoint FP8 KV scale {name!r} in {location[name]} (shape {list(shape)}) holds "
                             f"{values.tolist()[:8]}: an FP8 KV scale must be positive and finite")
        if values.numel() > 1:
            per_head.append((name, shape))
        scales[rename(quant.kv_scale_name(name))] = float(values.max())
    if per_head:
        _logger.warning("%d FP8 KV scale tensors in %s hold one scale per KV head (e.g. %r, shape %s); each layer "
                        "stores its K and V with one scale, so they are merged into their max (as vLLM does)",
                        len(per_head), location[per_head[0][0]].parent, per_head[0][0], list(per_head[0][1]))
    return scales


def is_stacked_experts(checkpoint_name: str) -> bool:
    """A checkpoint tensor holding every expert of a MoE block, stacked (rule 3 above)."""
    return _STACKED_EXPERTS.match(model_name(checkpoint_name)) is not None


def model_name(checkpoint_name: str) -> str:
    """Our name of a checkpoint tensor (the `RENAMED_PREFIXES`, `RENAMED_NAMES`, `RENAMED_SUFFIXES` and
    `RENAMED_EXPERTS` applied)."""
    for old, new in RENAMED_PREFIXES:
        if checkpoint_name.startswith(old):
            checkpoint_name = new + checkpoint_name[len(old) :]
            break
    checkpoint_name = RENAMED_NAMES.get(checkpoint_name, checkpoint_name)
    for old, new in RENAMED_SUFFIXES:
        if checkpoint_name.endswith(old):
            return checkpoint_name[: -len(old)] + new
    return RENAMED_EXPERTS[0].sub(lambda m: RENAMED_EXPERTS[1][m["w"]].format(m["e"]), checkpoint_name)


def plan_weights(
    model: HybridCausalLM, checkpoint_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, _Source]:
    """Match checkpoint tensors (name -> shape) to the model's parameters; raise `ValueError` on any
    missing, unexpected or mis-shaped tensor. Returns our parameter name -> its source."""
    tied = model.config.tie_word_embeddings
    # transformers ties a missing embedding to the checkpoint's lm_head.weight
    from_head = tied and "lm_head.weight" in checkpoint_shapes and _embedding_name(checkpoint_shapes) is None
    shapes = {_EMBEDDING if from_head and name == "lm_head.weight" else name: _shape(shape)
              for name, shape in checkpoint_shapes.items()}
    plan = plan_weights_for(
        model, shapes, owner=type(model).__name__,
        ignored=lambda name: (name.startswith(IGNORED_PREFIXES) or (tied and name == "lm_head.weight")
                              or model.drops_checkpoint_tensor(name, shapes[name])),
        not_in_checkpoint=("lm_head.weight",) if tied else (),
    )
    if from_head:
        plan[_EMBEDDING] = _Source("lm_head.weight")
    return plan


def _embedding_name(checkpoint_names: Iterable[str]) -> str | None:
    """The checkpoint's name of the input embedding (either layout), None when it has none."""
    return next((name for name in checkpoint_names if model_name(name) == _EMBEDDING), None)


def plan_weights_for(
    module: torch.nn.Module,
    checkpoint_shapes: Mapping[str, tuple[int, ...]],
    *,
    owner: str,
    ignored: Callable[[str], bool] = lambda name: False,
    not_in_checkpoint: tuple[str, ...] = (),
    name_prefix: str = "",
) -> dict[str, _Source]:
    """Rules 2-4 above for any module (the model, or the MTP head with its `mtp.` prefix taken off): checkpoint
    names for which `ignored` holds are skipped, parameters in `not_in_checkpoint` are not expected. Raises
    `ValueError` naming `owner` on any missing, unexpected or mis-shaped tensor, each named as the checkpoint
    names it (`name_prefix`, e.g. "mtp.", put back in front)."""

    def quoted(name: str) -> str:
        return repr(name_prefix + name)

    expected = {name: _shape(p.shape) for name, p in module.named_parameters(remove_duplicate=True)}
    for name in not_in_checkpoint:
        expected.pop(name, None)
    plan: dict[str, _Source] = {}
    problems: list[str] = []
    mismatched = set()  # (reported as mis-shaped, not again as missing)
    blocks: dict[str, dict[int, tuple[str, tuple[int, ...]]]] = {}  # rule 4: parameter -> part -> (tensor, shape)
    for raw_name, raw_shape in checkpoint_shapes.items():
        shape = _shape(raw_shape)
        if ignored(raw_name):
            continue
        name = model_name(raw_name)
        stacked = _STACKED_EXPERTS.match(name)
        block = _row_block(name)
        if block is not None and block[0] in expected:
            blocks.setdefault(block[0], {})[block[1]] = (raw_name, shape)
        elif stacked:
            problems += _plan_stacked(stacked["prefix"], stacked["kind"], raw_name, shape, expected, plan,
                                      name_prefix, suffix=stacked["scale"] or "weight")
        elif name not in expected:
            problems.append(f"unexpected tensor {quoted(raw_name)} with shape {list(shape)}")
        elif shape != expected[name]:
            mismatched.add(name)
            problems.append(
                f"shape mismatch for tensor {quoted(raw_name)}: "
                f"checkpoint {list(shape)}, model {list(expected[name])}"
            )
        elif name in plan:
            problems.append(f"tensor {quoted(name)} given twice: as {quoted(plan[name].checkpoint_name)} and "
                            f"{quoted(raw_name)}")
        else:
            plan[name] = _Source(raw_name)
    for name, parts in blocks.items():
        problem = _plan_row_blocks(name, parts, expected[name], plan, quoted)
        if problem:
            mismatched.add(name)
            problems.append(problem)
    problems += [
        f"missing tensor {quoted(name)} (model shape {list(shape)})"
        for name, shape in expected.items()
        if name not in plan and name not in mismatched
    ]
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(f"checkpoint does not match {owner}:\n  {shown}{more}")
    return plan


def _row_block(name: str) -> tuple[str, int] | None:
    """(our parameter, the part's index) of a checkpoint name that is a row block of one (rule 4), else None."""
    for target, parts in CONCATENATED_SUFFIXES.items():
        for index, suffix in enumerate(parts):
            if name.endswith(suffix):
                return name[: -len(suffix)] + target, index
    return None


def _plan_row_blocks(name: str, parts: Mapping[int, tuple[str, tuple[int, ...]]], want: tuple[int, ...],
                     plan: dict[str, _Source], quoted: Callable[[str], str]) -> str | None:
    """Plan parameter `name` (shape `want`) from its row blocks `parts` (part index -> checkpoint tensor, shape);
    the problem, or None."""
    target = next(target for target in CONCATENATED_SUFFIXES if name.endswith(target))
    prefix, suffixes = name[: -len(target)], CONCATENATED_SUFFIXES[target]
    given = [parts[index][0] for index in sorted(parts)]
    if name in plan:
        return f"tensor {quoted(name)} given twice: as {quoted(plan[name].checkpoint_name)} and {quoted(given[0])}"
    missing = [prefix + suffix for index, suffix in enumerate(suffixes) if index not in parts]
    if missing:
        return f"missing tensor {quoted(missing[0])} (with {quoted(given[0])}: the rows of {quoted(name)})"
    shapes = [parts[index][1] for index in range(len(suffixes))]
    if any(shape[1:] != want[1:] for shape in shapes) or sum(shape[0] for shape in shapes) != want[0]:
        return (f"shape mismatch for tensors {', '.join(quoted(n) for n in given)}: checkpoint "
                f"{[list(shape) for shape in shapes]}, concatenated the model's {quoted(name)} {list(want)}")
    plan[name] = _Source(given[0], more=tuple(given[1:]))
    return None


def _plan_stacked(
    prefix: str,
    kind: str,
    raw_name: str,
    shape: tuple[int, ...],
    expected: Mapping[str, tuple[int, ...]],
    plan: dict[str, _Source],
    name_prefix: str = "",
    suffix: str = "weight",
) -> list[str]:
    """Plan the per-expert slices of a stacked `gate_up_proj` [E, 2I, H], `up_proj` [E, I, H] (ungated experts) or
    `down_proj` [E, H, I] (`suffix` "weight"), or of the stacked per-channel scales of FP8 ones ("weight_scale":
    [E, 2I, 1], [E, I, 1], [E, H, 1]); problems name tensors with `name_prefix` in front."""

    def quoted(name: str) -> str:
        return repr(name_prefix + name)

    num_experts = sum(1 for n in expected if n.startswith(prefix + ".") and n.endswith(".down_proj.weight"))
    parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else (kind,)
    held = [expected.get(f"{prefix}.0.{part}.{suffix}") for part in parts]  # one expert's, per part
    if num_experts == 0 or None in held or len({part[1:] for part in held}) != 1:
        return [f"unexpected tensor {quoted(raw_name)} with shape {list(shape)}"]
    starts = [sum(part[0] for part in held[:i]) for i in range(len(held) + 1)]  # each part's first row
    want = (num_experts, starts[-1], *held[0][1:])
    if shape != want:
        return [f"shape mismatch for tensor {quoted(raw_name)}: checkpoint {list(shape)}, model {list(want)}"]
    given = [plan[target].checkpoint_name for e in range(num_experts) for part in parts
             if (target := f"{prefix}.{e}.{part}.{suffix}") in plan]
    if given:
        return [f"tensor {name_prefix}{prefix}.*.{'/'.join(parts)}.{suffix} given twice: as {quoted(given[0])} "
                f"(and {len(given) - 1} more) and {quoted(raw_name)}"]
    for e in range(num_experts):
        for i, part in enumerate(parts):
            rows = (starts[i], starts[i + 1]) if len(parts) > 1 else None
            plan[f"{prefix}.{e}.{part}.{suffix}"] = _Source(raw_name, e, rows)
    return []


@torch.no_grad()
def _copy_planned(
    model: HybridCausalLM,
    plan: Mapping[str, _Source],
    shards: Mapping[str, Shard],
    read: Callable[[str, tuple[int | slice, ...]], torch.Tensor],
) -> None:
    """Copy every planned parameter, reading only its part (`shards`) of its checkpoint tensor; then the model's
    `after_loading_`."""
    params = dict(model.named_parameters())
    for target, source in plan.items():
        _copy_one(params[target], shards.get(target), source, read)
    model.after_loading_()


def _copy_one(
    param: torch.Tensor,
    shard: Shard | None,
    source: _Source,
    read: Callable[[str, tuple[int | slice, ...]], torch.Tensor],
) -> None:
    """Copy one planned parameter: its `shard`'s ranges of `source` (the whole tensor without a shard)."""
    if source.more:  # row blocks (rule 4): read whole and concatenated, then the rank's rows taken (small convs)
        whole = torch.cat([read(name, (slice(None),)) for name in source.names])
        param.copy_(whole if shard is None else shard.take(whole))
        return
    parts = [read(source.checkpoint_name, index) for index in source.indices(shard)]
    # UE8M0 block scales (powers of two) are read as fp32, exactly (`quant.check_fp8_dtypes`)
    parts = [part.float() if part.dtype == _E8M0 else part for part in parts]
    if shard is not None and shard.padding:  # rows past the checkpoint's: zeros
        param.narrow(shard.dim, shard.data_length, shard.padding).zero_()
        param = param.narrow(shard.dim, 0, shard.data_length)
    param.copy_(parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim))


def checkpoint_shards(model: HybridCausalLM, full: HybridCausalLM) -> dict[str, Shard]:
    """`model.shards()` with the scales of its FP8 linears: each scale's part follows its weight's
    (`quant.scale_shard`, which refuses a split of a scale block). `full` is the one-rank model of the same config
    and FP8 linears (`model` itself when unsharded, else a meta twin): the weights' full shapes."""
    shards = model.shards()
    full_params = dict(full.named_parameters())
    for name, fmt in quant.fp8_linears(model).items():
        weight = shards.get(f"{name}.weight")
        if weight is not None:
            scale = quant.scale_shard(weight, fmt, _shape(full_params[f"{name}.weight"].shape), name)
            if scale is not None:
                shards[f"{name}.{fmt.scale_name}"] = scale
    return shards


def one_rank_twin(model: HybridCausalLM) -> HybridCausalLM:
    """`model` itself when unsharded, else the one-rank model of its config on the meta device, with FP8 linears
    where `model` has them (the full shapes the checkpoint holds)."""
    if model.tp.size == 1:
        return model
    with torch.device("meta"):
        full = type(model)(model.config)
    quant.convert_linears(full, quant.fp8_linears(model))
    return full


def _sharded_plan(
    model: HybridCausalLM, checkpoint_shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, _Source], dict[str, Shard]]:
    """`plan_weights` against the full model (`one_rank_twin`), a tied lm_head planned from the embedding when the
    rank holds its own lm_head slice; and the part of its checkpoint tensor each parameter reads
    (`checkpoint_shards`)."""
    full = one_rank_twin(model)
    plan = plan_weights(full, checkpoint_shapes)
    if model.tp.size > 1 and model.config.tie_word_embeddings:
        plan["lm_head.weight"] = plan["model.embed_tokens.weight"]
    return plan, checkpoint_shards(model, full)


def load_weights(model: HybridCausalLM, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load in-memory tensors (e.g. a transformers model's `state_dict()`) with the rules above."""
    plan, shards = _sharded_plan(model, {name: _shape(t.shape) for name, t in tensors.items()})
    for name in {name for source in plan.values() for name in source.names}:
        if not tensors[name].is_floating_point():
            raise ValueError(f"tensor {name!r} has dtype {tensors[name].dtype}; a weight must be a float tensor")
    _copy_planned(model, plan, shards, lambda name, index: tensors[name][index])


def safetensors_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder (from its index when sharded); ValueError naming the index when
    it is not JSON or has no `weight_map` of tensor name -> file name."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has no 'weight_map' object of tensor name -> shard file name")
        # one file spelt two ways ("./model-00001-..." and "model-00001-...") is read once
        return sorted({Path(os.path.normpath(model_dir / f)) for f in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp: TensorParallel = UNSHARDED,
    quantization: str | None = None,
    load_format: str = "auto",
    kv_fp8: bool = False,
) -> HybridCausalLM:
    """Build the model described by `<model_dir>/config.json` and load its safetensors weights.

    Single-file and sharded (`model.safetensors.index.json`) folders are read. Every check (architecture,
    config, tensor names and shapes) runs on a meta-device model and the safetensors headers before any
    weight memory is taken. Returns the model in eval mode, parameters in `dtype` on `device`; with `tp`, this
    rank's shard of it (see `hybridcache.layers.parallel`), reading only the rank's part of each tensor.
    FP8 linears keep their FP8 weights and fp32 scales whatever `dtype` is. `quantization` ("fp8" or None) and
    `load_format` ("auto" or "dummy"): see the module docstring. `kv_fp8`: the attention layers store FP8 KV
    with the checkpoint's per-layer `self_attn.k_scale` / `v_scale` (else 1.0; per-head ones merged into their
    max: `pop_kv_scales`); those tensors are read only then.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = ModelConfig.from_model_dir(model_dir)
    model_cls = get_model_class(config.architecture)
    fmt = _check_quantization(model_dir, quantization, load_format)
    _check_fp8_support(model_cls, config, fmt is not None or quantization is not None, kv_fp8)
    if load_format == "dummy":
        target = _dummy_format(fmt, quantization)
        model = (_dummy_model(model_cls, config, target, dtype, device) if tp.size == 1
                 else _dummy_shard(model_cls, config, tp, target, dtype, device))
        return quant.set_kv_fp8(model, kv_fp8, {})
    files = safetensors_files(model_dir)
    location, shapes, dtypes = _read_headers(files)
    kv_scales = pop_kv_scales(shapes, location, kv_fp8, model_name)
    config = _tie_as_transformers(config, location, shapes)
    with torch.device("meta"):
        model = model_cls(config, tp).to(dtype=dtype)
    fp8 = _checkpoint_fp8(fmt, shapes, dtypes)
    quant.convert_linears(model, fp8.linears)
    plan, shards = _sharded_plan(model, shapes)
    check_float_dtypes({name for source in plan.values() for name in source.names}, dtypes, location)

    model = model.to_empty(device=device)
    model.tie_weights()
    handles = {file: safe_open(str(file), framework="pt", device="cpu") for file in files}

    def read(name: str, index: tuple[int | slice, ...]) -> torch.Tensor:
        if name in fp8.reshaped:  # a per-tensor or [N] scale, as the linear's [N, 1]
            return quant.expand_channel_scale(handles[location[name]].get_tensor(name), fp8.reshaped[name])[index]
        return handles[location[name]].get_slice(name)[index]

    _copy_planned(model, plan, shards, read)
    if quantization == "fp8" and fmt is None:
        quant.quantize_linears_(model, quant.quantizable_linears(model))
    return quant.set_kv_fp8(model, kv_fp8, kv_scales).eval()


def check_split(
    model_dir: str | Path, tp: TensorParallel, *, quantization: str | None = None, load_format: str = "auto"
) -> None:
    """Raise the ValueError `load_model` raises for rank `tp.rank`'s split of the folder's model (dims the ranks do
    not divide, a block-scaled FP8 weight whose blocks the split cuts: `checkpoint_shards`) from config.json and
    the safetensors headers alone, on a meta model: what a tensor-parallel engine checks before any worker
    starts."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_model_dir(model_dir)
    fmt = _check_quantization(model_dir, quantization, load_format)
    _check_fp8_support(get_model_class(config.architecture), config, fmt is not None or quantization is not None,
                       kv_fp8=False)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, tp)
    if load_format == "dummy":
        target = _dummy_format(fmt, quantization)
        quant.convert_linears(model, {} if target is None else dict.fromkeys(quant.quantizable_linears(model), target))
    else:
        _, shapes, dtypes = _read_headers(safetensors_files(model_dir))
        quant.convert_linears(model, _checkpoint_fp8(fmt, shapes, dtypes).linears)
    checkpoint_shards(model, one_rank_twin(model))


def _read_headers(files: list[Path]) -> tuple[dict[str, Path], dict[str, tuple[int, ...]], dict[str, str]]:
    """Every tensor of the safetensors `files`: name -> (its file, its shape, its safetensors dtype), from headers.
    ValueError naming the file for one that is missing, not a file or not safetensors (unreadable or truncated),
    and naming both files for a tensor two of them hold."""
    from safetensors import SafetensorError, safe_open

    location: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for file in files:
        if not file.is_file():
            raise ValueError(f"safetensors file {file} {'is not a file' if file.exists() else 'does not exist'}")
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if name in location:
                        raise ValueError(f"tensor {name!r} given twice: in {location[name]} and {file}")
                    location[name] = file
                    shapes[name] = _shape(handle.get_slice(name).get_shape())
                    dtypes[name] = handle.get_slice(name).get_dtype()
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{file} is not a readable safetensors file: {error}") from None
    return location, shapes, dtypes


def check_float_dtypes(names: Iterable[str], dtypes: Mapping[str, str], location: Mapping[str, Path]) -> None:
    """ValueError naming the tensor, its dtype and its file when a checkpoint tensor of `names` (those read into
    weights) is an integer or bool tensor (safetensors dtype not F* / BF16): `copy_` would cast it silently."""
    for name in sorted(names):
        if not dtypes[name].startswith(("F", "BF")):
            raise ValueError(f"checkpoint tensor {name!r} in {location[name]} has dtype {dtypes[name]}; a weight "
                             "must be a float tensor")


def _tie_as_transformers(config: ModelConfig, location: Mapping[str, Path],
                         shapes: Mapping[str, tuple[int, ...]]) -> ModelConfig:
    """`config` untied when it ties the embeddings but the checkpoint holds an `lm_head.weight` that differs from
    the embedding (transformers then warns and keeps both: `PreTrainedModel.tie_weights`), else `config`. Only
    then are the two tensors read (in slices of rows) and compared."""
    from safetensors import safe_open

    embedding = _embedding_name(location)
    if not config.tie_word_embeddings or "lm_head.weight" not in location or embedding is None:
        return config
    if shapes[embedding] == shapes["lm_head.weight"]:
        with (safe_open(str(location[embedding]), framework="pt") as embedding_file,
              safe_open(str(location["lm_head.weight"]), framework="pt") as head_file):
            rows = shapes[embedding][0]
            if all(torch.equal(embedding_file.get_slice(embedding)[start:start + 4096].float(),
                               head_file.get_slice("lm_head.weight")[start:start + 4096].float())
                   for start in range(0, rows, 4096)):
                return config
    _logger.warning("config.json ties the word embeddings, but the checkpoint holds an lm_head.weight that differs "
                    "from %s: it is used, not tied (as transformers does); set tie_word_embeddings (LFM2's: "
                    "tie_embedding, which wins over it) false in config.json to silence this warning", embedding)
    return replace(config, tie_word_embeddings=False)


class _CheckpointFp8(NamedTuple):
    """The FP8 linears of a checkpoint: our module name -> format (`linears`: each expert's, for stacked experts)
    and the scales read in another shape than they are held (`reshaped`: checkpoint name -> held shape)."""

    linears: dict[str, quant.Fp8Format]
    reshaped: dict[str, tuple[int, ...]]


def _checkpoint_fp8(fmt: quant.Fp8Format | None, shapes: dict[str, tuple[int, ...]],
                    dtypes: Mapping[str, str]) -> _CheckpointFp8:
    """Every linear the checkpoint (tensor name -> shape, -> safetensors dtype) holds in FP8 (`quant.fp8_modules`;
    ValueError when its float8 tensors are not exactly those weights). `shapes` loses the linears' static
    activation scales (`quant.pop_input_scales`) and holds their per-channel scales as the linears do
    (`quant.channel_scale_shapes`)."""
    ours = {name: dtype for name, dtype in dtypes.items() if not name.startswith(IGNORED_PREFIXES)}
    fp8 = quant.fp8_modules(ours, fmt) if fmt is not None else []
    quant.check_fp8_dtypes(ours, fp8)
    if fmt is None:
        return _CheckpointFp8({}, {})
    quant.pop_input_scales(shapes, fp8)
    linears = {}
    for module in fp8:
        weight = model_name(f"{module}.weight")
        stacked = _STACKED_EXPERTS.match(weight)
        if stacked is None:
            linears[weight[: -len(".weight")]] = fmt
            continue
        parts = ("gate_proj", "up_proj") if stacked["kind"] == "gate_up_proj" else (stacked["kind"],)
        for e in range(shapes[f"{module}.weight"][0]):
            linears.update({f"{stacked['prefix']}.{e}.{part}": fmt for part in parts})
    return _CheckpointFp8(linears, quant.channel_scale_shapes(shapes, fp8, fmt))


def _dummy_format(fmt: quant.Fp8Format | None, quantization: str | None) -> quant.Fp8Format | None:
    """The FP8 format of a dummy model's linears: the config's, else the block format under `quantization`."""
    return fmt if fmt is not None else (quant.BLOCK if quantization is not None else None)


def _check_fp8_support(model_cls: type[HybridCausalLM], config: ModelConfig, fp8_weights: bool, kv_fp8: bool) -> None:
    """ValueError naming the architecture when FP8 weights (an FP8 checkpoint or `quantization`) or FP8 KV are asked
    of a model class without them (`HybridCausalLM.supports_fp8` false: a model class that does not declare it)."""
    if model_cls.supports_fp8 or not (fp8_weights or kv_fp8):
        return
    asked = "FP8 weights (an FP8 checkpoint or --quantization fp8)" if fp8_weights else "an FP8 KV cache"
    raise ValueError(f"{config.architecture} does not support {asked} in hybridcache yet; serve it in bf16 "
                     f"(no --quantization, --kv-cache-dtype auto)")


def _check_quantization(model_dir: Path, quantization: str | None, load_format: str) -> quant.Fp8Format | None:
    """The checkpoint's FP8 format (None: dense); ValueError for an unknown `quantization` or `load_format` or an
    unsupported quantization_config."""
    if quantization not in (None, *quant.QUANTIZATIONS):
        raise ValueError(f"quantization {quantization!r} is not supported; choose one of {quant.QUANTIZATIONS}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; choose one of {LOAD_FORMATS}")
    return quant.checkpoint_format(quant.read_quantization_config(model_dir))


def _dummy_model(
    model_cls: type[HybridCausalLM],
    config: ModelConfig,
    target: quant.Fp8Format | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> HybridCausalLM:
    """`load_format="dummy"`: the model with random weights drawn on `device` (seed 0); with `target` (the
    checkpoint's FP8 format, or the block format under `quantization`) its linears FP8, as
    `quant.quantizable_linears` selects."""
    from hybridcache.models.random_weights import randomize_

    with torch.device("meta"):
        model = model_cls(config).to(dtype=dtype)
    if target is not None:
        quant.convert_linears(model, dict.fromkeys(quant.quantizable_linears(model), target))
    model = model.to_empty(device=device)
    model.tie_weights()
    randomize_(model, seed=0, draw_device=device)
    return model.eval()


@torch.no_grad()
def _dummy_shard(
    model_cls: type[HybridCausalLM],
    config: ModelConfig,
    tp: TensorParallel,
    target: quant.Fp8Format | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> HybridCausalLM:
    """`load_format="dummy"` under tensor parallelism: rank `tp.rank`'s shard of exactly the model `_dummy_model`
    draws with one rank (seed 0, same device type). Every rank draws every full tensor of the one-rank model in
    `randomize_`'s order (so the generator advances alike), one at a time, and keeps its shard: peak memory is the
    rank's shard plus one full tensor. An FP8 linear's full weight is quantised as `randomize_` does it, in the
    one-rank model's row order. A full tensor (an FP8 scale too) is put back in the checkpoint's row order (the
    inverse of the one-rank model's `checkpoint_shards`: Qwen3-Next's regrouped projections) and then read as a
    checkpoint tensor, so a block-scaled split refuses what an FP8 checkpoint's would."""
    with torch.device("meta"):
        full = model_cls(config).to(dtype=dtype)
        model = model_cls(config, tp).to(dtype=dtype)
    if target is not None:
        for module in (full, model):
            quant.convert_linears(module, dict.fromkeys(quant.quantizable_linears(module), target))
    full.tie_weights()
    plan, shards = _sharded_plan(model, {name: _shape(p.shape) for name, p in full.named_parameters()})
    targets: dict[str, list[str]] = {}
    for name, source in plan.items():
        targets.setdefault(source.checkpoint_name, []).append(name)
    model = model.to_empty(device=device)
    model.tie_weights()
    params = dict(model.named_parameters())
    for drawn_name, value in dummy_checkpoint(full, seed=0, device=device):
        for name_held in targets.get(drawn_name, ()):
            _copy_one(params[name_held], shards.get(name_held), plan[name_held], lambda _, i, v=value: v[i])
    return model.eval()


def dummy_checkpoint(full: torch.nn.Module, *, seed: int,
                     device: torch.device | str) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint of the one-rank module `full` (a meta module) as `randomize_` draws its weights (`seed`, on
    `device`), one tensor at a time, each named and in its checkpoint's row order: every parameter drawn in order
    (an FP8 weight quantised whole, its scale given next to it), for ranks that keep their shard of each."""
    from hybridcache.models.random_weights import centred_on_one, draw_parameter

    full_shards = checkpoint_shards(full, full)
    fp8 = {f"{name}.weight": (name, fmt) for name, fmt in quant.fp8_linears(full).items()}
    scales = {f"{module}.{fmt.scale_name}" for module, fmt in fp8.values()}
    generator = torch.Generator(device).manual_seed(seed)
    on_one = centred_on_one(full)
    for name, param in full.named_parameters():
        if name in scales:  # drawn with their weight
            continue
        drawn = {name: draw_parameter(name, param.shape, generator, name in on_one)}
        if name in fp8:
            module, fmt = fp8[name]
            drawn[name], drawn[f"{module}.{fmt.scale_name}"] = kernel_backend.fp8_quantize(drawn[name], fmt)
        for drawn_name, value in drawn.items():
            yield drawn_name, _checkpoint_order(value, full_shards.get(drawn_name))


def _checkpoint_order(value: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """A one-rank parameter held in another row order than its checkpoint tensor's (`shard`: the checkpoint rows
    it holds, in order) put back in the checkpoint's order; `value` itself without a shard."""
    if shard is None:
        return value
    checkpoint = torch.empty_like(value)
    offset = 0
    for start, stop in shard.ranges:
        checkpoint.narrow(shard.dim, start, stop - start).copy_(value.narrow(shard.dim, offset, stop - start))
        offset += stop - start
    return checkpoint
