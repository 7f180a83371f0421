"""The tokenizer is loaded by `transformers.AutoTokenizer`: tokenizer_config.json's special tokens and chat template
(or chat_template.jinja) are honoured, and a folder without usable tokenizer files is a clear error."""

import json
import shutil

import pytest

from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.tokenizer import Tokenizer

TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture
def folder(tmp_path):
    """A copy of the built-in model's tokenizer files."""
    source = ensure_builtin_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, tmp_path / name)
    return tmp_path


def test_the_config_gives_special_tokens_and_the_template(folder):
    tokenizer = Tokenizer(folder)
    assert tokenizer.hf.eos_token == "<|im_end|>" and tokenizer.eos_token_id == tokenizer.encode("<|im_end|>")[0]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(folder)
    assert tokenizer.hf.eos_token == "<|endoftext|>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n>"


def test_a_chat_template_jinja_file_is_used(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(folder).chat_template is None
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    assert Tokenizer(folder).apply_chat_template([{"role": "user", "content": "a"}], False) == "[user] a\n"


def test_missing_tokenizer_files_are_a_clear_error(folder):
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer: it needs tokenizer.json"):
        Tokenizer(folder)


def test_a_broken_tokenizer_json_names_the_folder(folder):
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"could not load the tokenizer of {folder}"):
        Tokenizer(folder)


def test_a_config_without_vocabulary_files_names_the_folder(folder):
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=f"could not load the tokenizer of {folder}"):
        Tokenizer(folder)


def _bpe_folder(path):
    """A BPE tokenizer with merges, a normaliser, a BOS-adding post-processor and added special tokens, trained
    here (deterministic) and saved with a tokenizer_config.json."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers, processors, trainers

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog " * 3, "hybrid models keep a recurrent state " * 3,
              "ﬁne unicode: ça, naïve, 東京, emoji 🙂"]
    backend.train_from_iterator(corpus, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>"}))
    return path


TEXTS = ["", "hello", "the quick brown fox", "  leading and trailing  ", "ﬁne ça naïve 東京 🙂\n\ttabs",
         "a<|im_end|>b <s> c", "x" * 3000, "the lazy dog jumps " * 200]


@pytest.mark.parametrize("kind", ["byte-level", "bpe"])
def test_encode_gives_what_transformers_encode_gives(folder, tmp_path, kind):
    """`Tokenizer.encode` goes to the backend directly: its ids must be AutoTokenizer's, also after a call that
    set truncation and padding on the shared backend."""
    tokenizer = Tokenizer(folder if kind == "byte-level" else _bpe_folder(tmp_path / "bpe"))
    hf = tokenizer.hf
    for text in TEXTS:
        assert tokenizer.encode(text) == hf.encode(text, add_special_tokens=False), text
    if hf.pad_token is None:
        hf.pad_token = hf.eos_token
    hf(["short", "a longer text"], truncation=True, max_length=3, padding="max_length")  # leaves them set
    assert tokenizer.backend.truncation is not None
    assert tokenizer.encode(TEXTS[-1]) == hf.encode(TEXTS[-1], add_special_tokens=False)
    assert len(tokenizer.encode(TEXTS[-1])) > 3


def test_a_tokenizer_with_ids_past_the_vocab_size_is_refused(tmp_path):
    """A prompt holding such an id would index past the embedding (and kill the engine): the engine refuses the
    model at start-up, before its weights load."""
    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine

    from .model_folders import write_tiny_model

    folder = write_tiny_model(tmp_path, "qwen3_5_text")  # 320 embedding rows over the byte tokenizer's ids
    num_ids = Tokenizer(folder).num_ids
    assert num_ids < 320
    LLMEngine(folder, EngineConfig()).close()
    config = json.loads((folder / "config.json").read_text())
    # the weights stay 320 rows: the refusal must come before they load
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": num_ids - 3}))
    with pytest.raises(ValueError, match=rf"has token ids up to {num_ids - 1} \({num_ids} ids\), more than the "
                                         rf"model's vocab_size {num_ids - 3}"):
        LLMEngine(folder, EngineConfig())


def test_the_tokenizers_eos_token_stops_generation_as_in_vllm(tmp_path):
    """vLLM stops on the tokenizer's eos_token_id whatever config.json and generation_config.json say (and on
    their ids): a folder naming no eos id elsewhere still stops on the tokenizer's EOS."""
    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine

    folder = tmp_path / "model"
    shutil.copytree(ensure_builtin_model(), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    eos = Tokenizer(folder).eos_token_id
    assert eos is not None and eos != 7
    engine = LLMEngine(folder, EngineConfig())
    assert engine.eos_token_ids == {7, eos}
    engine.close()


DEFAULT = "DEFAULT:{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
TOOL_USE = ("TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}:"
            "{% for m in messages %}{{ m.content }}{% endfor %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
HI = [{"role": "user", "content": "hi"}]


def _named_templates(folder, layout, templates):
    """`folder` with the named `templates` ({name: template}) as transformers reads them: tokenizer_config.json's
    list, or chat_template.jinja (the default one) + additional_chat_templates/<name>.jinja."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    if layout == "config-list":
        config["chat_template"] = [{"name": name, "template": text} for name, text in templates.items()]
    else:
        (folder / "additional_chat_templates").mkdir()
        for name, text in templates.items():
            path = folder / "chat_template.jinja" if name == "default" else folder / "additional_chat_templates"
            (path if name == "default" else path / f"{name}.jinja").write_text(text)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(folder)


@pytest.mark.parametrize("layout", ["config-list", "template-files"])
def test_a_call_with_tools_renders_the_folders_tool_use_template(folder, layout):
    """Named templates were collapsed to "default" at load: a request with tools never saw its tools. Each call now
    picks as transformers' `get_chat_template(tools=...)` (vLLM's choice): tool_use with tools, else default."""
    tokenizer = _named_templates(folder, layout, {"default": DEFAULT, "tool_use": TOOL_USE})
    assert tokenizer.apply_chat_template(HI, tools=TOOLS) == "TOOLS get_weather :hi"
    assert tokenizer.apply_chat_template(HI) == tokenizer.apply_chat_template(HI, tools=[]) == "DEFAULT:[user] hi\n"
    assert tokenizer.chat_template == DEFAULT


def test_named_templates_without_a_default_serve_the_calls_they_can(folder):
    tokenizer = _named_templates(folder, "config-list", {"tool_use": TOOL_USE, "rag": "RAG"})
    assert tokenizer.chat_template is None
    assert tokenizer.apply_chat_template(HI, tools=TOOLS) == "TOOLS get_weather :hi"
    with pytest.raises(ValueError, match="no chat template for this request .*no default specified"):
        tokenizer.apply_chat_template(HI)
    assert tokenizer.apply_chat_template(HI, chat_template=TEMPLATE) == "[user] hi\n>"


def test_a_set_or_passed_template_wins_over_the_named_ones(folder):
    """`--chat-template` (the setter) and `chat_template=` (LLM.chat's) are used with or without tools."""
    tokenizer = _named_templates(folder, "template-files", {"default": DEFAULT, "tool_use": TOOL_USE})
    assert tokenizer.apply_chat_template(HI, tools=TOOLS, chat_template=TEMPLATE) == "[user] hi\n>"
    tokenizer.chat_template = TEMPLATE
    assert tokenizer.chat_template == TEMPLATE
    assert tokenizer.apply_chat_template(HI, tools=TOOLS) == tokenizer.apply_chat_template(HI) == "[user] hi\n>"
    tokenizer.chat_template = None  # the folder's again
    assert tokenizer.apply_chat_template(HI, tools=TOOLS) == "TOOLS get_weather :hi"


# A message's content parts iterated over (vLLM's "openai" content format), and the forms vLLM's detector follows.
_PARTS_LOOP = "{% for p in CONTENT %}{{ p.text }}{% endfor %}"
_OPENAI_TEMPLATES = {
    "direct": "{% for m in messages %}" + _PARTS_LOOP.replace("CONTENT", "m.content") + "{% endfor %}",
    "item-filtered": "{% for m in messages|reverse %}"
                     + _PARTS_LOOP.replace("CONTENT", "m['content']|selectattr('type')") + "{% endfor %}",
    "messages-alias": "{% set rest = messages[1:] %}{% for m in rest %}"
                      + _PARTS_LOOP.replace("CONTENT", "m.content") + "{% endfor %}",
    "named-content": "{% for m in messages %}{% set content = m.content %}{% if content is string %}{{ content }}"
                     "{% else %}" + _PARTS_LOOP.replace("CONTENT", "content") + "{% endif %}{% endfor %}",
    "macro-positional": "{% macro show(c, n) %}" + _PARTS_LOOP.replace("CONTENT", "c") + "{% endmacro %}"
                        "{% for m in messages %}{% set x = show(m.content, 1)|trim %}{{ x }}{% endfor %}",
    "macro-keyword": "{% macro show(n, c) %}" + _PARTS_LOOP.replace("CONTENT", "c") + "{% endmacro %}"
                     "{% for m in messages %}{{ show(1, c=m.content) }}{% endfor %}",
}
_STRING_TEMPLATES = {
    "content-read": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "other-macro-argument": "{% macro show(c) %}" + _PARTS_LOOP.replace("CONTENT", "c") + "{% endmacro %}"
                            "{% for m in messages %}{{ show(m.tool_calls) }}{{ m.content }}{% endfor %}",
    "loop-outside-messages": "{% for d in documents %}" + _PARTS_LOOP.replace("CONTENT", "d.content")
                             + "{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}",
    "unparsable": "{% for m in messages %}",
}


@pytest.mark.parametrize("name", [*_OPENAI_TEMPLATES, *_STRING_TEMPLATES])
def test_the_content_format_is_found_as_vllm_finds_it(name):
    from hybridcache.tokenizer import chat_content_format

    assert chat_content_format({**_OPENAI_TEMPLATES, **_STRING_TEMPLATES}[name]) == (
        "openai" if name in _OPENAI_TEMPLATES else "string")


def test_the_builtin_and_vision_templates_content_formats():
    from hybridcache.models.builtin import CHAT_TEMPLATE
    from hybridcache.models.vl_folders import VL_CHAT_TEMPLATE
    from hybridcache.tokenizer import chat_content_format

    assert chat_content_format(CHAT_TEMPLATE) == "string"  # Qwen3's shape: content read as a string
    assert chat_content_format(VL_CHAT_TEMPLATE) == "openai"  # it renders image parts itself


def test_per_call_templates_are_not_kept_without_bound(folder):
    """A client may send a new `chat_template` with every request: their content formats were kept per template
    for the server's life. Only the recent ones are kept now, and every call still renders with its own."""
    from hybridcache.tokenizer import chat_content_format

    tokenizer = Tokenizer(folder)
    for i in range(200):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], False,
                                                 chat_template=f"{{{{ messages[0].content }}}}#{i}")
        assert rendered == f"hi#{i}"
    assert chat_content_format.cache_info().currsize <= chat_content_format.cache_info().maxsize == 32
    assert all(len(value) < 200 for value in vars(tokenizer).values() if isinstance(value, dict))


def test_text_parts_reach_a_string_template_joined_with_newlines(folder):
    """Two text parts fused ("French:Good") under every template; vLLM joins them with "\\n" for a template that
    takes content as a string, and passes the parts to one that iterates over them (their join: as before)."""
    from hybridcache.mm_processor import split_chat_images

    parts = [{"type": "text", "text": "Translate to French:"}, {"type": "text", "text": "Good morning"}]
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    messages, _ = split_chat_images([{"role": "user", "content": parts}])
    tokenizer = Tokenizer(folder)
    string_template = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    assert tokenizer.apply_chat_template(messages, chat_template=string_template) == (
        "<Translate to French:\nGood morning>")
    assert tokenizer.apply_chat_template([{"role": "user", "content": parts}], chat_template=string_template) == (
        "<Translate to French:\nGood morning>")  # the parts as sent (Tokenizer users), as vLLM joins them
    builtin = tokenizer.apply_chat_template(messages)
    assert "Translate to French:\nGood morning<|im_end|>" in builtin
    iterating = "{% for m in messages %}<{% if m.content is string %}{{ m.content }}{% else %}" + _PARTS_LOOP.replace(
        "CONTENT", "m.content") + "{% endif %}>{% endfor %}"
    assert tokenizer.apply_chat_template(messages, chat_template=iterating) == "<Translate to French:Good morning>"
    with_image, sources = split_chat_images([{"role": "user", "content": [parts[0], image, parts[1]]}])
    assert sources == ["data:,"] and with_image[0]["content"][1] == {"type": "image"}  # images still split out
    assert tokenizer.apply_chat_template(with_image, chat_template=iterating) == "<Translate to French:Good morning>"


def test_a_template_passed_by_name_is_the_named_one_and_its_content_format(folder):
    """`chat_template="tool_use"` is the folder's tool_use template (transformers' reading): its content format,
    not the name's, decides how text parts are joined."""
    iterating = "{% for m in messages %}" + _PARTS_LOOP.replace("CONTENT", "m.content") + "|{% endfor %}"
    tokenizer = _named_templates(folder, "config-list", {"default": DEFAULT, "tool_use": iterating})
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.apply_chat_template(parts, chat_template="tool_use") == "ab|"
    assert tokenizer.apply_chat_template(parts, tools=TOOLS) == "ab|"
    assert tokenizer.apply_chat_template(parts) == "DEFAULT:[user] a\nb\n"
