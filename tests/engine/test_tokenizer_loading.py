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
