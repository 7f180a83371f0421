"""A ShareGPT-format file written by the tests (ShareGPT itself is not shipped: its terms are unclear)."""

import json

import numpy as np
import pytest

_WORDS = ("cache", "prefix", "state", "token", "layer", "block", "model", "reply", "question", "answer", "why",
          "how", "the", "a", "of", "in", "is", "every", "recurrent", "attention", "checkpoint", "step", "batch")


def _sentence(rng: np.random.Generator, min_words: int, max_words: int) -> str:
    words = rng.choice(_WORDS, size=int(rng.integers(min_words, max_words + 1)))
    return " ".join(words).capitalize() + "."


def write_sharegpt(path, num_conversations: int = 24, seed: int = 0) -> None:
    """`num_conversations` ShareGPT V3 lines, 2-5 exchanges each, messages of 5-60 words; every fifth
    conversation begins with an assistant message (the loader drops it)."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(num_conversations):
        turns = []
        if i % 5 == 0:
            turns.append({"from": "gpt", "value": _sentence(rng, 3, 8)})
        for _ in range(int(rng.integers(2, 6))):
            turns.append({"from": "human", "value": " ".join(_sentence(rng, 5, 20) for _ in range(2))})
            turns.append({"from": "gpt", "value": " ".join(_sentence(rng, 5, 20) for _ in range(3))})
        lines.append(json.dumps({"id": f"conv{i}", "conversations": turns}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="session")
def sharegpt_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.jsonl"
    write_sharegpt(path)
    return path
