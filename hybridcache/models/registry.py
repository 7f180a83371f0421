"""Maps the `architectures` entry of config.json to our model class."""

from __future__ import annotations

from hybridcache.models.bamba import BambaForCausalLM
from hybridcache.models.falcon_h1 import FalconH1ForCausalLM
from hybridcache.models.granite import GraniteMoeHybridForCausalLM
from hybridcache.models.hybrid_lm import HybridCausalLM
from hybridcache.models.jamba import JambaForCausalLM
from hybridcache.models.kimi_linear import KimiLinearForCausalLM
from hybridcache.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from hybridcache.models.nemotron_h import NemotronHForCausalLM
from hybridcache.models.olmo_hybrid import OlmoHybridForCausalLM
from hybridcache.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from hybridcache.models.qwen3_next import Qwen3NextForCausalLM


def _model_classes() -> dict[str, type[HybridCausalLM]]:
    return {
        "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
        # the multimodal checkpoints: their language model (the vision tower: models/vision_loader.py)
        "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
        "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
        "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
        "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
        "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,  # Granite-4.0-H, dense and MoE
        "NemotronHForCausalLM": NemotronHForCausalLM,  # Nemotron-H (Mamba2, attention and MLP layers)
        "KimiLinearForCausalLM": KimiLinearForCausalLM,  # Kimi Linear (KDA, MLA and MoE layers)
        "OlmoHybridForCausalLM": OlmoHybridForCausalLM,  # OLMo Hybrid (gated DeltaNet and attention layers)
        "Lfm2ForCausalLM": Lfm2ForCausalLM,  # LFM2 (gated short-convolution and attention layers)
        "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,  # LFM2-MoE (LFM2's layers, MoE blocks past the first dense ones)
        "BambaForCausalLM": BambaForCausalLM,  # Bamba (Mamba2 and attention layers)
        "FalconH1ForCausalLM": FalconH1ForCausalLM,  # Falcon-H1 (attention and Mamba2 side by side in every layer)
        "JambaForCausalLM": JambaForCausalLM,  # Jamba (Mamba1 and attention layers, dense and MoE)
    }


SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_model_classes())


def get_model_class(architecture: str) -> type[HybridCausalLM]:
    """Our class for a config.json `architectures` entry; `ValueError` listing the supported ones if none."""
    classes = _model_classes()
    if architecture not in classes:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return classes[architecture]
