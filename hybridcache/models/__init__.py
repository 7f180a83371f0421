"""Hybrid model definitions and weight loading.

Public API: `ModelConfig`, `load_model`, `load_weights`, `SUPPORTED_ARCHITECTURES`, `get_model_class`,
the model classes; `randomize_` and `tiny_hf_config` (for tests) live in
`hybridcache.models.random_weights`.

Only `ModelConfig` is imported eagerly: everything else is loaded on first access, so that
`from hybridcache.models.config import ModelConfig` (the cache simulator) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridcache.models.config import ModelConfig

_LAZY = {
    "HybridCausalLM": "hybridcache.models.hybrid_lm",
    "load_model": "hybridcache.models.loader",
    "load_weights": "hybridcache.models.loader",
    "Qwen3_5ForCausalLM": "hybridcache.models.qwen3_5",
    "Qwen3_5MoeForCausalLM": "hybridcache.models.qwen3_5",
    "Qwen3NextForCausalLM": "hybridcache.models.qwen3_next",
    "GraniteMoeHybridForCausalLM": "hybridcache.models.granite",
    "NemotronHForCausalLM": "hybridcache.models.nemotron_h",
    "OlmoHybridForCausalLM": "hybridcache.models.olmo_hybrid",
    "KimiLinearForCausalLM": "hybridcache.models.kimi_linear",
    "Lfm2ForCausalLM": "hybridcache.models.lfm2",
    "Lfm2MoeForCausalLM": "hybridcache.models.lfm2",
    "BambaForCausalLM": "hybridcache.models.bamba",
    "FalconH1ForCausalLM": "hybridcache.models.falcon_h1",
    "JambaForCausalLM": "hybridcache.models.jamba",
    "SUPPORTED_ARCHITECTURES": "hybridcache.models.registry",
    "get_model_class": "hybridcache.models.registry",
}

__all__ = ["ModelConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
