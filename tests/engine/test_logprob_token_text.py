"""The texts of logprob entries' tokens (`Logprob.decoded_token`), as vLLM's `LogprobsProcessor._verify_tokens`
names them: a token whose own text ends in part of a character is read with the tokens before its position, so a
completion's token texts add up to its text (completions' `text_offset`, chat's `bytes`)."""

from __future__ import annotations

import random

import pytest
import torch

from hybridcache.detokenizer import token_text
from hybridcache.engine.output_processor import OutputProcessor
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.sampling import SamplingParams, TokenLogprob
from hybridcache.scheduler.output import ScheduledChunk
from hybridcache.scheduler.sequence import Seq
from hybridcache.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(ensure_builtin_model())  # byte-level: "€" is 3 tokens, "😀" 4


def decoder(tokenizer: Tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def test_the_worked_example(tokenizer):
    ids = tokenizer.encode("a€b😀c")
    assert len(ids) == 10
    texts = [token_text(decoder(tokenizer), t, ids[:i]) for i, t in enumerate(ids)]
    assert texts == ["a", "", "", "€", "b", "", "", "", "😀", "c"]


@pytest.mark.parametrize("seed", range(4))
def test_token_texts_add_up_to_the_text(tokenizer, seed):
    """Random text of 1- to 4-byte characters: each token's text (after the tokens before it) joins to the text,
    so an offset summed from them lands on the token's character."""
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", " b", "é", "€", "中", "😀", "\n"]) for _ in range(60))
    ids = tokenizer.encode(text)
    assert "".join(token_text(decoder(tokenizer), t, ids[max(0, i - 4): i]) for i, t in enumerate(ids)) == text


def test_a_token_without_the_bytes_before_it_is_empty(tokenizer):
    """The last byte of "€" with no context (a completion's first token), or with only the byte before it: the
    character is incomplete, "" (vLLM's), not U+FFFD."""
    first, second, last = tokenizer.encode("€")
    decode = decoder(tokenizer)
    assert token_text(decode, last, []) == token_text(decode, last, [second]) == ""
    assert token_text(decode, last, [first, second]) == "€"
    assert token_text(decode, tokenizer.encode("x")[0], []) == "x"  # a whole character: its own decode


def test_only_tokens_that_end_in_part_of_a_character_cost_more_than_one_decode(tokenizer):
    calls = []

    def decode(ids):
        calls.append(list(ids))
        return tokenizer.decode(ids, skip_special_tokens=False)

    ids = tokenizer.encode("ab€")
    assert token_text(decode, ids[1], ids[:1]) == "b" and calls == [[ids[1]]]


def _processor_and_seq(tokenizer: Tokenizer, prompt: str, params: SamplingParams):
    processor = OutputProcessor(tokenizer, None, frozenset({tokenizer.eos_token_id}), 10**6)
    prompt_ids = tokenizer.encode(prompt)
    seq = Seq(0, "r", 0, list(prompt_ids), len(prompt_ids), params.up_to(10**6 - len(prompt_ids)), None, 0)
    state = processor.new_request("r", None, len(prompt_ids), seq.params, [seq])
    return processor, seq, state


def test_sampled_logprob_entries_name_their_tokens_with_the_sampled_tokens_before(tokenizer):
    """"a€b😀c" sampled with logprobs: the entries' texts were U+FFFD for each byte of "€" and "😀" (so the
    completions' text_offsets ran to 10 in a 5-character text); now "a", "", "", "€", .. as vLLM's. An
    alternative at a position takes the same sampled context: the byte 0xA9 where 0xAC ("€" = E2 82 AC) was
    sampled completes E2 82 A9, "\u20a9" (as vLLM reads it)."""
    processor, seq, state = _processor_and_seq(tokenizer, "x€", SamplingParams(logprobs=1, max_tokens=20))
    ids = tokenizer.encode("a€b😀c")
    alternative = tokenizer.encode("é")[1]  # the byte 0xA9
    for i, token in enumerate(ids):
        seq.token_ids.append(token)
        top = ((alternative, -2.0),) if i == 3 else ()
        assert processor.accept(state, seq, token, TokenLogprob(token, -1.0, 1, top)) is None
    entries = state.logprobs[0]
    assert [entry[t].decoded_token for t, entry in zip(ids, entries)] == ["a", "", "", "€", "b", "", "", "", "😀", "c"]
    assert entries[3][alternative].decoded_token == "\u20a9"
    assert entries[0][ids[0]].decoded_token == "a"  # the first sampled token: no context (the prompt is not)


def test_prompt_logprob_entries_name_their_tokens_with_the_prompt_tokens_before(tokenizer):
    """Prompt "x€y" in two chunks: entry p's texts take prompt tokens max(1, p - 4) .. p - 1 as context (vLLM's:
    the tokens of the entries before, across chunks); "x", "", "", "€", "y" where each byte of "€" read U+FFFD.
    Prompt "€y": its first token has no entry and is never context, so "€" is not completed ("", "", "y")."""
    for prompt, want in (("x€y", [None, "", "", "€", "y"]), ("€y", [None, "", "", "y"])):
        processor, seq, state = _processor_and_seq(tokenizer, prompt, SamplingParams(prompt_logprobs=0))
        n = seq.prompt_len
        split = 2
        chunks = [ScheduledChunk(seq, 0, split, False, tuple(seq.token_ids[:split]), (), 0),
                  ScheduledChunk(seq, split, n - split, True, tuple(seq.token_ids[split:]), (), 0)]
        for chunk in chunks:  # logits: row 0 at the chunk's last token, then its other rows
            logits = torch.zeros(chunk.num_tokens, tokenizer.vocab_size)
            processor.record_prompt_logprobs({"r": state}, [chunk], [True], logits)
        got = [None if entry is None else entry[t].decoded_token
               for t, entry in zip(seq.token_ids, state.prompt_logprobs)]
        assert got == want, prompt
