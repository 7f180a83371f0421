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
