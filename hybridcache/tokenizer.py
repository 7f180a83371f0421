"""The model folder's tokenizer: `tokenizer.json` (+ `tokenizer_config.json` for special tokens and the
chat template), through transformers' fast-tokenizer class."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encodes text, decodes token ids and renders chat messages with the folder's own chat template."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = {}
        for key in _SPECIAL_KEYS:
            value = config.get(key)
            if isinstance(value, dict):  # older format: {"content": ..., ...}
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        self._tok = PreTrainedTokenizerFast(tokenizer_file=str(path), **special)
        template = config.get("chat_template")
        jinja = model_dir / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        self.chat_template: str | None = template

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages to the prompt text (tokenize it with `encode`)."""
        if self.chat_template is None:
            raise ValueError("this model folder has no chat template (tokenizer_config.json 'chat_template')")
        return self._tok.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
