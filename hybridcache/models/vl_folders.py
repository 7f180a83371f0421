"""Tiny random image-text model folders (Qwen3.5 dense and MoE with their vision tower), for tests and demos.

`write_tiny_vl_model(path, moe=False)` writes what a real Qwen3.5 checkpoint folder holds, at toy size:
config.json (`Qwen3_5ForConditionalGeneration` or `Qwen3_5MoeForConditionalGeneration`, a `vision_config`, the
image token ids), model.safetensors with `model.visual.*` and `model.language_model.*`, preprocessor_config.json
(transformers' Qwen2-VL image processor: patch 4, merge 2, 256 to 4,096 pixels per image) and a byte-level
tokenizer whose special tokens include `<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`, with a ChatML
template that renders an image content part as `<|vision_start|><|image_pad|><|vision_end|>`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridcache.models.random_weights import _TINY_COMMON, _TINY_MOE

VL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                     "<|image_pad|>", "<|video_pad|>")
# ChatML; a message's content is a string or a list of parts: {"type": "text", "text"} or an image part
# ({"type": "image"} or any part naming "image" / "image_url"), rendered as one placeholder the processor expands.
VL_CHAT_TEMPLATE = """\
{%- for message in messages -%}
<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content -%}
{%- if part.type == 'text' %}{{ part.text }}
{%- elif part.type in ('image', 'image_url') or 'image' in part or 'image_url' in part -%}
<|vision_start|><|image_pad|><|vision_end|>
{%- endif %}{% endfor %}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""
TINY_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 64,
    "in_channels": 3,
}
PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 256, "longest_edge": 4096},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
}


def tiny_vl_hf_config(moe: bool = False, **text_overrides: Any) -> Any:
    """The transformers config of a tiny Qwen3.5 (or Qwen3.5-MoE) image-text model over the byte vocabulary:
    the 5-layer text model of `tiny_hf_config` with M-RoPE sections (2, 1, 1) over its 4 rotary frequencies, and a
    2-block vision tower of width 32 (patch 4, merge 2) projecting to the text width."""
    import transformers

    from hybridcache.models.builtin import build_byte_tokenizer

    eos = build_byte_tokenizer(VL_SPECIAL_TOKENS).token_to_id("<|im_end|>")
    rope = {**_TINY_COMMON["rope_parameters"], "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = {**_TINY_COMMON, "vocab_size": 320, "eos_token_id": eos, "rope_parameters": rope,
            **(_TINY_MOE if moe else {"intermediate_size": 128}), **text_overrides}
    text.pop("dtype")
    config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    config = config_cls(text_config=text, vision_config={**TINY_VISION, "out_hidden_size": text["hidden_size"]},
                        **byte_token_ids())
    config.architectures = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    return config


def byte_token_ids() -> dict[str, int]:
    """The ids of the image tokens in the byte tokenizer with `VL_SPECIAL_TOKENS`, as config.json names them."""
    from hybridcache.models.builtin import build_byte_tokenizer

    tokenizer = build_byte_tokenizer(VL_SPECIAL_TOKENS)
    return {"image_token_id": tokenizer.token_to_id("<|image_pad|>"),
            "video_token_id": tokenizer.token_to_id("<|video_pad|>"),
            "vision_start_token_id": tokenizer.token_to_id("<|vision_start|>"),
            "vision_end_token_id": tokenizer.token_to_id("<|vision_end|>")}


def write_tiny_vl_model(path: str | Path, moe: bool = False, seed: int = 0) -> Path:
    """Write a tiny random image-text model folder to `path` (see the module docstring); returns `path`."""
    return write_vl_model(path, tiny_vl_hf_config(moe), PREPROCESSOR, seed=seed)


def write_vl_model(path: str | Path, config: Any, preprocessor: dict[str, Any], *, seed: int = 0,
                   dtype: Any = None, draw_device: str = "cpu") -> Path:
    """Write a random image-text folder of transformers config `config` (its image token ids those of
    `byte_token_ids`), with `preprocessor` as preprocessor_config.json, the byte tokenizer and the image chat
    template. `dtype`: the weights' (default fp32); `draw_device`: where the random values are drawn (a GPU for
    multi-GB models)."""
    import torch
    import transformers

    from hybridcache.models.random_weights import randomize_

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device=draw_device)
    if dtype is not None:
        model = model.to(dtype)
    randomize_(model, seed=seed, draw_device=draw_device)
    model.eval().save_pretrained(path)
    del model
    return write_vl_files(path, config, preprocessor)


def write_vl_files(path: str | Path, config: Any, preprocessor: dict[str, Any]) -> Path:
    """The folder of `write_vl_model` without weights (config.json, tokenizer, template, preprocessor_config.json):
    what an engine with `load_format="dummy"` reads."""
    from hybridcache.models.builtin import build_byte_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "config.json").is_file():
        config.save_pretrained(path)
    build_byte_tokenizer(VL_SPECIAL_TOKENS).save(str(path / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                        "pad_token": "<|endoftext|>", "chat_template": VL_CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return path
