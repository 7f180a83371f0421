"""Tiny random model folders (transformers `save_pretrained` + the byte tokenizer) for engine tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridcache.models.builtin import build_byte_tokenizer
from hybridcache.models.mtp import write_random_mtp
from hybridcache.models.random_weights import randomize_, tiny_hf_config

HF_CLASSES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def byte_config(model_type: str, **overrides):
    """The transformers config of `model_type` (tiny_hf_config + `overrides`) over the byte tokenizer's 320 ids."""
    config = tiny_hf_config(model_type, vocab_size=320, eos_token_id=258, **overrides)
    config.architectures = [HF_CLASSES[model_type]]
    return config


def write_tiny_model(path: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random transformers model of `model_type` with a byte-level tokenizer to `path`."""
    import transformers

    config = byte_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, HF_CLASSES[model_type])(config).eval()
    randomize_(model, seed=seed)
    return save_model_folder(model, path)


def save_model_folder(model: torch.nn.Module, path: Path) -> Path:
    """Write a transformers causal LM over the byte vocabulary to `path`: `save_pretrained`, a random MTP head
    (`mtp.safetensors`: every test model has one) and the byte tokenizer."""
    model.save_pretrained(path)
    write_random_mtp(path)
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    # The generic fast class keeps tokenizer.json's own pipeline (without a tokenizer_config.json, AutoTokenizer
    # would pick the model type's class, which rebuilds its own normalizer and pre-tokenizer around the vocabulary).
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def load_hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts_of(lengths, seed=0) -> list[list[int]]:
    """Random token-id prompts of the given lengths (byte vocabulary), reproducible from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
