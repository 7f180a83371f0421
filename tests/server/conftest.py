import pytest

from hybridcache.models.builtin import BUILTIN_NAME, builtin_model_dir, ensure_builtin_model
from hybridcache.tokenizer import Tokenizer

MODEL = BUILTIN_NAME


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The built-in model's tokenizer (the folder is created once, before any server starts)."""
    ensure_builtin_model()
    return Tokenizer(builtin_model_dir())
