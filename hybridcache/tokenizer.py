"""The model folder's tokenizer, loaded by `transformers.AutoTokenizer` (as vLLM does): `tokenizer_config.json`
picks the class, the special tokens and the chat template (or `chat_template.jinja`); without it, config.json's
model type picks the class. It must be a fast tokenizer (`tokenizer.json`): the incremental detokenizer
(`detokenizer.py`) steps over its `tokenizers` backend.

Chat templates, as vLLM renders them:

- a folder may ship several named templates (tokenizer_config.json's list `[{"name": "default", "template": ...},
  {"name": "tool_use", ...}]`, or `chat_template.jinja` + `additional_chat_templates/tool_use.jinja`): each call
  picks one with transformers' `get_chat_template(None, tools=...)`, "tool_use" for a call with tools (where the
  folder has it), else "default". A template set on the tokenizer (`--chat-template`) or passed to the call wins.
- a template that never iterates over a message's content parts takes content as a string (vLLM's "string"
  content format, `chat_content_format`): a message's text parts (`TextParts`) reach it joined with
  "\\n"; one that iterates over them ("openai") renders the parts itself, and gets them joined with "" (the same).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import jinja2.nodes
import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

# The files a folder needs for AutoTokenizer to build a fast tokenizer: tokenizer.json, or a config naming a class
# that converts its own vocabulary files (vocab.json + merges.txt, tokenizer.model, ...).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_PROBE_REPLY = "PROBE"  # `Tokenizer.parting_step`'s stand-in for a reply and the next message


class TextParts(str):
    """A message's text parts as one string: their texts joined with "" (`[{"type": "text", "text": "a"},
    {"type": "text", "text": "b"}]` -> "ab", what templates that iterate over the parts render, Qwen3.5's), the
    texts kept in `parts`: `Tokenizer.apply_chat_template` joins them with "\\n" instead for a template that takes
    a message's content as a string only (vLLM's "string" content format, the Qwen3 template's), as vLLM does."""

    parts: tuple[str, ...]

    def __new__(cls, parts: Sequence[str]) -> TextParts:
        text = super().__new__(cls, "".join(parts))
        text.parts = tuple(parts)
        return text

    def __getnewargs__(self) -> tuple[tuple[str, ...]]:  # copy and pickle rebuild it from its parts
        return (self.parts,)


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
        self._set_template: str | None = None  # `chat_template`'s setter (--chat-template)

    @property
    def chat_template(self) -> str | None:
        """The template a call without one renders with: the one set here (`--chat-template`; None gives the folder's
        back), else the folder's own, its "default" one where it names several (a call with tools may then render
        with "tool_use": module docstring); None when the folder has none (or names no "default")."""
        if self._set_template is not None:
            return self._set_template
        template = self._tok.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        return template if isinstance(template, str) else None

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._set_template = template

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
        None: the one set on `self.chat_template`, else the folder's own, "tool_use" with tools where it names one:
        module docstring). ValueError when there is none.

        Messages are OpenAI-shaped dicts: assistant turns may carry `tool_calls` and `reasoning_content`, `tool`
        turns `tool_call_id`; content text parts (`TextParts`, or a list of text parts) reach a template that takes
        strings only joined with "\\n". `tools`: the request's tool definitions (the template renders them).
        `template_kwargs`: extra template variables (for example `enable_thinking`); they cannot override the
        arguments above. `continue_final_message`: leave the last (assistant) message open, to be continued.
        """
        tools = tools or None
        template = self._template_for(chat_template, tools)
        extra = dict(template_kwargs or {})
        for name in ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                     "tokenize"):
            if name in extra:
                raise ValueError(f"chat_template_kwargs may not set '{name}'")
        if chat_content_format(template) == "string":
            messages = [_string_content(message) for message in messages]
        return self._tok.apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **extra,
        )

    def _template_for(self, chat_template: str | None, tools: list[dict] | None) -> str:
        """The template a call renders with (`apply_chat_template`): `chat_template`, else the one set, else the
        folder's for these tools; a name of one of the folder's named templates is that template (as transformers
        takes it). ValueError when there is none."""
        template = chat_template if chat_template is not None else self._set_template
        try:
            return self._tok.get_chat_template(template, tools=tools)
        except ValueError as error:  # none at all, or named ones without "default" (nor "tool_use" with tools)
            raise ValueError(f"this model folder has no chat template for this request ({error}); pass one "
                             "(chat_template=, --chat-template)") from None


ContentFormat = Literal["string", "openai"]


@functools.lru_cache(maxsize=32)  # (the templates of recent calls: a client may send a new one with each request)
def chat_content_format(template: str) -> ContentFormat:
    """How `template` takes a message's content, found as vLLM finds it (`_detect_content_format`), by walking the
    template's syntax tree: "openai" when a `for` loop iterates over a message's content (`message.content` or
    `message['content']` of a loop over `messages`, perhaps filtered or sliced), over a variable named `content`,
    or over a macro parameter that a call passes a message's content to (Qwen3.5's `render_content`); "string"
    otherwise (the Qwen3 template), or when the template does not parse::

        {% for message in messages %}{% for part in message.content %}{{ part.text }}{% endfor %}...  openai
        {% for message in messages %}{{ message.content }}...                                         string
    """
    try:  # transformers' own environment (its `generation` tag and loop controls), as vLLM parses (a private
        # function: where a transformers release lacks it, "string", as for a template that does not parse)
        from transformers.utils.chat_template_utils import _compile_jinja_template

        root = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # noqa: BLE001 - jinja2 and transformers raise several types for a bad template
        return "string"
    message_names = {loop.target.name for loop in root.find_all(jinja2.nodes.For)
                     if isinstance(loop.target, jinja2.nodes.Name) and _reads(loop.iter, _aliases(root, "messages"))}
    content_names = {"content", *_content_parameters(root, message_names)}
    for loop in root.find_all(jinja2.nodes.For):
        if _reads(loop.iter, message_names, key="content") or _reads(loop.iter, content_names):
            return "openai"
    return "string"


def _reads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """`node` reads one of the variables `names` (its item `key`: `x.key` or `x['key']`, when given), perhaps
    through filters, tests or a slice (`messages|reverse`, `messages[1:]`)."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        node = node.node
        if node is None:  # a filter block's filter
            return False
    if key is not None:
        attribute = isinstance(node, jinja2.nodes.Getattr) and node.attr == key
        item = (isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
        if not (attribute or item):
            return False
        node = node.node
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


def _aliases(root: jinja2.nodes.Template, name: str) -> set[str]:
    """`name` and the variables set from it (`{% set loop_messages = messages[1:] %}`), transitively."""
    names = {name}
    while True:
        more = {assign.target.name for assign in root.find_all(jinja2.nodes.Assign)
                if isinstance(assign.target, jinja2.nodes.Name) and _reads(assign.node, names)} - names
        if not more:
            return names
        names |= more


def _content_parameters(root: jinja2.nodes.Template, message_names: set[str]) -> Iterator[str]:
    """The parameters of macros that some call passes a message's content to, positionally or by name."""
    macros = {macro.name: [arg.name for arg in macro.args] for macro in root.find_all(jinja2.nodes.Macro)}
    for call in root.find_all(jinja2.nodes.Call):
        params = macros.get(call.node.name) if isinstance(call.node, jinja2.nodes.Name) else None
        if params is None:
            continue
        for param, arg in zip(params, call.args, strict=False):
            if _reads(arg, message_names, key="content"):
                yield param
        for keyword in call.kwargs:
            if keyword.key in params and _reads(keyword.value, message_names, key="content"):
                yield keyword.key


def _string_content(message: dict[str, Any]) -> dict[str, Any]:
    """The message for a template that takes content as a string: its text parts (`TextParts`, or a list of only
    text parts) joined with "\\n", as vLLM joins them; other content as it is."""
    content = message.get("content")
    if isinstance(content, TextParts):
        parts = content.parts
    elif isinstance(content, list) and content and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content):
        parts = [part["text"] for part in content]
    else:
        return message
    return {**message, "content": "\n".join(parts)}
