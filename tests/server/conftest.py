import threading

import pytest

from hybridcache.models.builtin import BUILTIN_NAME, builtin_model_dir, ensure_builtin_model
from hybridcache.tokenizer import Tokenizer

MODEL = BUILTIN_NAME


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The built-in model's tokenizer (the folder is created once, before any server starts)."""
    ensure_builtin_model()
    return Tokenizer(builtin_model_dir())


class ThreadRecordingTokenizer:
    """Wraps a tokenizer; `threads` lists the name of the thread of every `encode` call."""

    backend = None

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self.tokenizer.encode(text)
