"""Incremental detokenization: at every token, the text equals a full decode, cut before the first stop
string (what the engine computed before it decoded incrementally)."""

from __future__ import annotations

import random

import pytest

from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(ensure_builtin_model())


def reference(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[str, bool]:
    text = tokenizer.decode(ids)
    positions = [text.find(s) for s in stop if s in text]
    return (text[: min(positions)], True) if positions else (text, False)


@pytest.mark.parametrize("deferred", [False, True], ids=["incremental", "deferred"])
@pytest.mark.parametrize("seed", range(4))
def test_text_equals_a_full_decode_at_every_token(tokenizer, seed, deferred):
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]  # random bytes: many partial characters
    text = tokenizer.detokenizer(deferred=deferred)
    for i, token in enumerate(ids):
        assert not text.add(token)
        assert text.text == tokenizer.decode(ids[: i + 1]), i


def test_stop_strings_cut_where_a_full_decode_finds_them_first(tokenizer):
    rng = random.Random(7)
    words = ["alpha ", "beta ", "gamma ", "END", "EN", "D ", "ünï ", "€ "]
    checked = 0
    for _ in range(30):
        ids = tokenizer.encode("".join(rng.choice(words) for _ in range(12)))
        stop = ("END", "ta g", "€")
        text = tokenizer.detokenizer(stop)
        for i, token in enumerate(ids):
            stopped = text.add(token)
            want, want_stopped = reference(tokenizer, ids[: i + 1], stop)
            assert (text.text, stopped) == (want, want_stopped), (ids[: i + 1], stop)
            checked += 1
            if stopped:
                break
    assert checked > 30
