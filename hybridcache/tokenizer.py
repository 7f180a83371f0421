"""The model folder's tokenizer, loaded by `transformers.AutoTokenizer` (as vLLM does): `tokenizer_config.json`
picks the class, the special tokens and the chat template (or `chat_template.jinja`); without it, config.json's
model type picks the class. It must be a fast tokenizer (`tokenizer.json`): the incremental detokenizer
(`detokenizer.py`) steps over its `tokenizers` backend."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

# The files a folder needs for AutoTokenizer to build a fast tokenizer: tokenizer.json, or a config naming a class
# that converts its own vocabulary files (vocab.json + merges.txt, tokenizer.model, ...).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_PROBE_REPLY = "PROBE"  # `Tokenizer.parting_step`'s stand-in for a reply and the next message


class Tokenizer:
    """Encodes text, decodes token ids and renders chat messages with the folder's own chat template.

    A folder with none of tokenizer.json / tokenizer_config.json is a FileNotFoundError; one AutoTokenizer cannot
    load, or that gives no fast tokenizer, a ValueError naming the folder and the cause."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
            raise FileNotFoundError(f"{model_dir} has no tokenizer: it needs tokenizer.json (and usually "
                                    "tokenizer_config.json)")
        try:
            tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except Exception as error:  # noqa: BLE001 - transformers raises many types for one cause: a bad folder
            raise ValueError(f"could not load the tokenizer of {model_dir}: {type(error).__name__}: {error}") from None
        if not isinstance(getattr(tok, "backend_tokenizer", None), tokenizers.Tokenizer):
            raise ValueError(f"the tokenizer of {model_dir} ({type(tok).__name__}) is not a fast tokenizer; "
                             "add its tokenizer.json")
        self._tok = tok
        template = tok.chat_template
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer (what grammar libraries build their token tables from)."""
        return self._tok

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers.Tokenizer` underneath (what `DecodeStream` steps over)."""
        return self._tok.backend_tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def num_ids(self) -> int:
        """1 + the largest token id this tokenizer produces (added tokens included): the engine refuses a model
        whose vocab_size is smaller."""
        return 1 + max(self._tok.get_vocab().values(), default=-1)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, no special tokens added: what `AutoTokenizer.encode(text, add_special_tokens=False)`
        gives, through the backend's `encode_batch_fast` (no offsets, which long prompts pay for: docs/bench.md,
        "Figures behind the code's choices"). As transformers does before each call,
        the backend runs without truncation or padding and with the tokenizer's `split_special_tokens`."""
        backend = self.backend
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        split = bool(self._tok.split_special_tokens)
        if backend.encode_special_tokens != split:
            backend.encode_special_tokens = split
        return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def suffix_tokens(self, token_ids: Sequence[int], suffix: str) -> int:
        """How many of `token_ids`' last tokens encode `suffix` (text that ends the prompt, e.g. a chat template's
        generation prompt): the length of `encode(suffix)` when `token_ids` end with exactly those tokens, else 0
        (the tokenizer merged across the boundary: no token step holds the text before the suffix)."""
        tail = self.encode(suffix) if suffix else []
        return len(tail) if tail and len(tail) < len(token_ids) and list(token_ids[-len(tail):]) == tail else 0

    def parting_step(self, messages: list[dict], prompt_text: str, prompt_ids: Sequence[int], *,
                     tools: list[dict] | None = None, template_kwargs: dict | None = None,
                     chat_template: str | None = None) -> int | None:
        """The step of `prompt_ids` (`prompt_text`: `messages` rendered with the generation prompt, then
        tokenized, images expanded) where the conversation's next turn will part from this prompt, for
        `LLMEngine.add_request`'s `checkpoints_at`; None when the next turn extends the whole prompt (its finish
        checkpoint serves it) or no step can be told.

        The next turn holds `messages`, this reply and a new message, so a probe reply and a probe user message
        are rendered after `messages` (no generation prompt): the two renderings part where the next turn will
        (the user message matters: Qwen3 templates render a reply after the last user message with its think
        block, an earlier one without). Qwen3 / Qwen3.5 templates open `<think>\n` in the generation prompt and
        render earlier replies without it::

            prompt   ...<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n
            probe    ...<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nPROBE<|im_end|>\n<|im_start|>user...
                                                                       ^ the step: before <think>\n's tokens

        Where the tokens do not break there (merged across it), the step before the whole generation prompt;
        None as well when the template refuses the probe or parts before the generation prompt (it rewrites
        earlier turns: no step serves the next turn). The generation prompt holds no image, so the tail's
        tokens end the expanded ids."""
        probe = [*messages, {"role": "assistant", "content": _PROBE_REPLY}, {"role": "user", "content": _PROBE_REPLY}]
        try:
            rendered = self.apply_chat_template(probe, add_generation_prompt=False, tools=tools,
                                                template_kwargs=template_kwargs, chat_template=chat_template)
            bare = self.apply_chat_template(messages, add_generation_prompt=False, tools=tools,
                                            template_kwargs=template_kwargs, chat_template=chat_template)
        except Exception:  # noqa: BLE001 - a template may refuse a conversation that ends in a reply
            return None
        common = len(os.path.commonprefix([prompt_text, rendered]))
        if common == len(prompt_text) or not prompt_text.startswith(bare) or common < len(bare):
            return None
        for tail in (prompt_text[common:], prompt_text[len(bare):]):
            length = self.suffix_tokens(prompt_ids, tail)
            if length:
                return len(prompt_ids) - length
        return None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        chat_template: str | None = None,
    ) -> str:
        """Render messages to the prompt text (tokenize it with `encode`) with `chat_template` (a Jinja template;
        None: the folder's own, or the one set on `self.chat_template`).

        Messages are OpenAI-shaped dicts: assistant turns may carry `tool_calls` and `reasoning_content`, `tool`
        turns `tool_call_id`. `tools`: the request's tool definitions (the template renders them).
        `template_kwargs`: extra template variables (for example `enable_thinking`); they cannot override the
        arguments above. `continue_final_message`: leave the last (assistant) message open, to be continued.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this model folder has no chat template (tokenizer_config.json 'chat_template'); "
                             "pass one (chat_template=)")
        extra = dict(template_kwargs or {})
        for name in ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                     "tokenize"):
            if name in extra:
                raise ValueError(f"chat_template_kwargs may not set '{name}'")
        return self._tok.apply_chat_template(
            messages, tools=tools or None, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **extra,
        )
