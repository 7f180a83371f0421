"""`ModelConfig`: the hyper-parameters of a supported hybrid model, parsed from a Hugging Face config.json.

This package imports no torch: the cache simulator sizes caches from it. Its modules, one job each:

- `kinds`: `LayerKind` (a decoder layer's token mixer) and each model type's config.json spellings of it;
- `groups`: the frozen hyper-parameter groups (`AttentionConfig`, `GatedDeltaConfig`, `MLAConfig`, `Mamba2Config`,
  `Mamba1Config`, `ShortConvConfig`, `Multipliers`, `GroupedRouting`, `FeedForwardConfig`);
- `model`: `ModelConfig` (`from_dict`, `from_model_dir`, the layer ids derived from the layer kinds);
- `parse`: the layouts of config.json accepted and the dispatch by text model type (Qwen3.5 / Qwen3-Next read there);
- `fields`: readers of config.json values (`read_json_object`, `token_ids`, `boolean`, `Fields`);
- `defaults`: transformers' defaults of each model type; `rope`: the attention group and its rotary settings;
- `common`: the group readers more than one family uses (gated DeltaNet, Granite's Mamba2 fields, the MLPs);
- one module a family, its docstring saying what it reads and refuses: `granite` (Granite-4.0-H), `nemotron_h`,
  `bamba`, `falcon_h1`, `jamba`, `olmo_hybrid`, `lfm2` (LFM2 and LFM2-MoE), `kimi_linear`.

A field config.json leaves out (or sets to null) takes the default of transformers' configuration class of the
model type (`Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig`, `Qwen3NextConfig`, `GraniteMoeHybridConfig`,
`NemotronHConfig`, `BambaConfig`, `FalconH1Config`, `JambaConfig`, `OlmoHybridConfig`, `Lfm2Config`,
`Lfm2MoeConfig`, `KimiLinearConfig`: `defaults.DEFAULTS`),
except the fields that size the model, which must be present: `vocab_size`, `hidden_size`, `num_hidden_layers`,
`num_attention_heads`.

A malformed file (not JSON, not an object, a field of the wrong type, a count of 0 that would divide) is a
`ValueError` naming config.json and the field.
"""

from hybridcache.models.config.groups import (
    AttentionConfig,
    FeedForwardConfig,
    GatedDeltaConfig,
    GroupedRouting,
    Mamba1Config,
    Mamba2Config,
    MLAConfig,
    Multipliers,
    ShortConvConfig,
)
from hybridcache.models.config.kinds import LayerKind
from hybridcache.models.config.model import ModelConfig

__all__ = [
    "AttentionConfig",
    "FeedForwardConfig",
    "GatedDeltaConfig",
    "GroupedRouting",
    "LayerKind",
    "MLAConfig",
    "Mamba1Config",
    "Mamba2Config",
    "ModelConfig",
    "Multipliers",
    "ShortConvConfig",
]
