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


def reference(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...], include: bool = False
              ) -> tuple[str, bool]:
    text = tokenizer.decode(ids)
    found = [(text.find(s), s) for s in stop if s in text]
    if not found:
        return text, False
    position = min(p for p, _ in found)
    first = next(s for p, s in found if p == position)  # of those found there, the first in the stop list
    return text[: position + len(first) if include else position], True


@pytest.mark.parametrize("skip_special", [True, False], ids=["skip-special", "keep-special"])
@pytest.mark.parametrize("deferred", [False, True], ids=["incremental", "deferred"])
@pytest.mark.parametrize("seed", range(4))
def test_text_equals_a_full_decode_at_every_token(tokenizer, seed, deferred, skip_special):
    rng = random.Random(seed)
    # random ids: many partial characters, and the tokenizer's special tokens among them
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    specials = set(tokenizer.hf.all_special_ids)
    assert specials & set(ids)
    text = tokenizer.detokenizer(deferred=deferred, skip_special_tokens=skip_special)
    for i, token in enumerate(ids):
        assert not text.add(token)
        assert text.text == tokenizer.decode(ids[: i + 1], skip_special_tokens=skip_special), i


@pytest.mark.parametrize("include", [False, True], ids=["cut-before", "include-stop"])
def test_stop_strings_cut_where_a_full_decode_finds_them_first(tokenizer, include):
    """Cut before the first stop string found, or after it with `include_stop` (include_stop_str_in_output)."""
    rng = random.Random(7)
    words = ["alpha ", "beta ", "gamma ", "END", "EN", "D ", "ünï ", "€ "]
    checked = 0
    for _ in range(30):
        ids = tokenizer.encode("".join(rng.choice(words) for _ in range(12)))
        stop = ("END", "ta g", "€", "EN")
        text = tokenizer.detokenizer(stop, include_stop=include)
        for i, token in enumerate(ids):
            stopped = text.add(token)
            want, want_stopped = reference(tokenizer, ids[: i + 1], stop, include)
            assert (text.text, stopped) == (want, want_stopped), (ids[: i + 1], stop)
            checked += 1
            if stopped:
                break
    assert checked > 30
