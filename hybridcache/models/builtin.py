"""The built-in model: a small Qwen3.5-architecture model with seeded random weights, written as a real
model folder (config.json, model.safetensors, a byte-level tokenizer.json with a ChatML chat template), so
every command works with no download. Its text is gibberish; its compute shape is a real hybrid model's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

BUILTIN_NAME = "hybridcache-builtin-qwen3.5-tiny"
BUILTIN_VERSION = 3  # 2: the chat template renders tools and thinking; 3: a random MTP head
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML with tools and thinking in the shapes Qwen3's template renders (<tools>, <tool_call>, <tool_response>,
# <think>), so tool-calling and reasoning tests exercise the real formats. Unlike Qwen3's, every earlier turn keeps
# its reasoning: history renders the same on every turn, so the prefix cache hits across an agent's turns.
CHAT_TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{%- if messages and messages[0].role in ('system', 'developer') -%}
{%- set ns.system = messages[0].content -%}
{%- endif -%}
{%- if tools -%}
<|im_start|>system
{% if ns.system %}{{ ns.system }}

{% endif %}# Tools

Function signatures, one JSON object a line:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

To call a function, answer with one block per call:
<tool_call>
{"name": <function-name>, "arguments": <arguments-json-object>}
</tool_call><|im_end|>
{% elif ns.system -%}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if loop.first and message.role in ('system', 'developer') -%}
{%- elif message.role == 'assistant' -%}
<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function or call -%}
{%- if message.content or not loop.first %}{{ '\n' }}{% endif -%}
<tool_call>
{"name": "{{ fn.name }}", "arguments": {% if fn.arguments is string %}{{ fn.arguments }}
{%- else %}{{ fn.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor -%}
<|im_end|>
{% elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}{{ '\n<tool_response>\n' }}
{{- message.content }}{{ '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>
{% endif -%}
{%- else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}
"""
# 3 gated-DeltaNet layers : 1 gated-attention layer, as in Qwen3.5.
BUILTIN_CONFIG = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)


def cache_home() -> Path:
    """hybridcache's own cache folder: $HYBRIDCACHE_HOME, else $XDG_CACHE_HOME/hybridcache, else
    ~/.cache/hybridcache (as huggingface_hub places its cache)."""
    home = os.environ.get("HYBRIDCACHE_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                      "hybridcache")
    return Path(home)


def builtin_model_dir() -> Path:
    """Where the built-in model lives: `cache_home()` / name-vVERSION."""
    return cache_home() / f"{BUILTIN_NAME}-v{BUILTIN_VERSION}"


def model_display_name(model_dir: Path) -> str:
    """How logs name a model folder: the built-in model by its served name (its folder adds a version), any
    other by the folder's name."""
    return BUILTIN_NAME if Path(model_dir) == builtin_model_dir() else Path(model_dir).name


def ensure_builtin_model(seed: int = 0) -> Path:
    """Create the built-in model folder if it does not exist yet (atomically) and return its path."""
    target = builtin_model_dir()
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".builtin-", dir=target.parent))
    except OSError as error:  # a read-only HOME in a container
        raise OSError(f"cannot write the built-in model under {target.parent}: {error.strerror or error} (set "
                      "HYBRIDCACHE_HOME or XDG_CACHE_HOME to a writable folder)") from error
    try:
        write_builtin_model(tmp, seed=seed)
        try:
            tmp.rename(target)
        except OSError:  # another process created it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_builtin_model(path: Path, seed: int = 0) -> None:
    """Write the built-in model folder to `path` (which must exist)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from hybridcache.models.mtp import write_random_mtp
    from hybridcache.models.random_weights import randomize_

    tokenizer = build_byte_tokenizer()
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = Qwen3_5TextConfig(
        **BUILTIN_CONFIG,
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        bos_token_id=None,
        pad_token_id=ids["<|endoftext|>"],
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    randomize_(model, seed=seed)
    model.save_pretrained(path)
    write_random_mtp(path, seed=seed)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": BUILTIN_CONFIG["max_position_embeddings"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def build_byte_tokenizer(special_tokens: tuple[str, ...] = SPECIAL_TOKENS):
    """A byte-level tokenizer: one token per byte (ids 0-255) and `special_tokens` (default: ChatML's) after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(special_tokens))
    return tokenizer
