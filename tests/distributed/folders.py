"""Tiny random model folders of the three supported families (transformers `save_pretrained` + the byte
tokenizer), and transformers' full-forward logits over one sequence of such a folder."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridcache.models.builtin import build_byte_tokenizer
from hybridcache.models.mtp import write_random_mtp
from hybridcache.models.random_weights import randomize_, tiny_hf_config

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
VOCAB = 320  # the byte tokenizer's


def write_folder(path: Path, model_type: str, seed: int = 0, vocab_size: int = VOCAB, **overrides) -> Path:
    """A tiny random model of `model_type` (see `tiny_hf_config`), vocabulary `vocab_size` (320, the byte
    tokenizer's, unless given: a larger one has ids the tokenizer never produces), eos 258."""
    import transformers

    config = tiny_hf_config(model_type, vocab_size=vocab_size, eos_token_id=258, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).eval()
    randomize_(model, seed=seed)
    model.save_pretrained(path)
    write_random_mtp(path, seed=seed)
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


def write_config_folder(path: Path, model_type: str, vocab_size: int = VOCAB, **overrides) -> Path:
    """`write_folder`'s config.json and tokenizer without any weights (served with `load_format="dummy"`)."""
    config = tiny_hf_config(model_type, vocab_size=vocab_size, eos_token_id=258, **overrides)
    path.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(path / "config.json"))
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


@torch.no_grad()
def transformers_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(token_ids), vocab] of one full forward (explicit position ids)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([token_ids])
    return model(input_ids=ids, position_ids=torch.arange(len(token_ids))[None], use_cache=False).logits[0].float()
