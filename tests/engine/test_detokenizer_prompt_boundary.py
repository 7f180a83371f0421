"""A completion is decoded after its prompt, as vLLM's `FastIncrementalDetokenizer` primes its `DecodeStream` with
the prompt's last tokens: a character whose first bytes end the prompt and whose last byte is the completion's
first token shows as that character (it was U+FFFD: the completion was decoded from a fresh stream; hunt 153)."""

from __future__ import annotations

import random

import pytest
from tokenizers.decoders import DecodeStream

from hybridcache.detokenizer import IncrementalDetokenizer, detokenizer_for
from hybridcache.engine.output_processor import OutputProcessor
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.sampling import SamplingParams, TokenLogprob
from hybridcache.scheduler.sequence import Seq
from hybridcache.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(ensure_builtin_model())  # byte-level: "€" is the 3 tokens E2 82 AC


def split_euro(tokenizer: Tokenizer) -> tuple[list[int], int]:
    """A prompt that ends with the first 2 bytes of "€", and the token of its last byte."""
    first, second, last = tokenizer.encode("€")
    return [*tokenizer.encode("price: "), first, second], last


def vllm_text(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int], skip_special_tokens: bool = True) -> str:
    """What vLLM's fast detokenizer makes of `ids` after `prompt_ids` (a reference written from its description):
    a stream stepped over the prompt's shortest clean suffix of 4 to 23 tokens (else the whole prompt), its text
    dropped, then over `ids`, the pieces it returns joined."""
    suffix = prompt_ids
    for num_ids in range(4, min(len(prompt_ids), 23) + 1) if len(prompt_ids) > 4 else ():
        if "\ufffd" not in tokenizer.backend.decode(prompt_ids[-num_ids:]):
            suffix = prompt_ids[-num_ids:]
            break
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    for token in suffix:
        stream.step(tokenizer.backend, token)
    return "".join(stream.step(tokenizer.backend, token) or "" for token in ids)


@pytest.mark.parametrize("deferred", [False, True], ids=["incremental", "deferred"])
def test_a_character_begun_in_the_prompt_is_the_completions_first(tokenizer, deferred):
    prompt, last = split_euro(tokenizer)
    five = tokenizer.encode("5")[0]
    text = detokenizer_for(tokenizer, SamplingParams(), deferred=deferred, prompt_ids=prompt)
    text.add(last)
    assert (text.text, text.shown(finished=False)) == ("€", "€")
    text.add(five)
    assert text.text == text.shown(finished=True) == "€5" == vllm_text(tokenizer, prompt, [last, five])
    fresh = detokenizer_for(tokenizer, SamplingParams(), deferred=deferred)  # no prompt: decoded on its own
    fresh.add(last)
    assert fresh.text == "\ufffd"


@pytest.mark.parametrize("deferred", [False, True], ids=["incremental", "deferred"])
def test_the_prompts_dangling_bytes_that_the_completion_does_not_complete_are_not_its_text(tokenizer, deferred):
    """The prompt's E2 82 followed by "a": vLLM's text is U+FFFD "a" (the prompt's bytes, decoded with the
    completion's); here "a", so a regex-guided completion's text matches its regex. Followed by a byte that starts
    another character, the completion shows only its own U+FFFD."""
    prompt, _ = split_euro(tokenizer)
    a = tokenizer.encode("a")[0]
    text = detokenizer_for(tokenizer, SamplingParams(), deferred=deferred, prompt_ids=prompt)
    text.add(a)
    assert vllm_text(tokenizer, prompt, [a]).endswith("\ufffda")
    assert text.text == text.shown(finished=False) == "a"  # settled: a later token does not change it
    first = tokenizer.encode("€")[0]
    started = detokenizer_for(tokenizer, SamplingParams(), deferred=deferred, prompt_ids=prompt)
    started.add(first)
    assert started.text == "\ufffd"  # its own incomplete character, not the prompt's too
    started.add(a)
    assert started.text == "\ufffda"


@pytest.mark.parametrize("deferred", [False, True], ids=["incremental", "deferred"])
@pytest.mark.parametrize("seed", range(3))
def test_texts_after_a_prompt_are_vllms(tokenizer, seed, deferred):
    """A text of 1- to 4-byte characters cut anywhere (in a character too), with prompts short and long (past the
    23 tokens searched and the 64 read): the completion's text, and while it runs what it shows, are those of
    vLLM's primed stream, for completions that end on a whole character."""
    rng = random.Random(seed)
    pieces = ["a", " b", "é", "€", "中文", "😀", "\n", " the", "ünï"]
    ids = tokenizer.encode("".join(rng.choice(pieces) for _ in range(120)))
    ends = [i for i in range(1, len(ids) + 1) if not tokenizer.decode(ids[:i]).endswith("\ufffd")]
    checked = 0
    for _ in range(40):
        end = rng.choice(ends[1:])
        start = rng.randrange(1, end)
        prompt, completion = ids[:start], ids[start:end]
        text = detokenizer_for(tokenizer, SamplingParams(), deferred=deferred, prompt_ids=prompt)
        for i, token in enumerate(completion):
            text.add(token)
            if not deferred:  # what a running output shows: the pieces the stream returned so far
                assert text.shown(finished=False) == vllm_text(tokenizer, prompt, completion[: i + 1])
        assert text.text == vllm_text(tokenizer, prompt, completion), (prompt, completion)
        checked += tokenizer.decode(prompt).endswith("\ufffd")
    assert checked > 5  # prompts that end inside a character were among them


def test_random_ids_after_a_random_prompt_decode_as_the_incremental_text(tokenizer):
    """Many partial characters and special tokens: the deferred text (one decode from the prompt's suffix) is the
    incremental one, trailing incomplete character included."""
    rng = random.Random(3)
    for skip in (True, False):
        for _ in range(10):
            prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 80))]
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(30)]
            incremental = detokenizer_for(tokenizer, SamplingParams(skip_special_tokens=skip), prompt_ids=prompt)
            deferred = detokenizer_for(tokenizer, SamplingParams(skip_special_tokens=skip), deferred=True,
                                       prompt_ids=prompt)
            for token in ids:
                incremental.add(token)
                deferred.add(token)
            assert incremental.text == deferred.text, (prompt, ids)


def test_priming_reads_a_few_prompt_tokens(tokenizer, monkeypatch):
    """The common case costs one decode of the prompt's last 4 tokens and 4 stream steps, however long it is."""
    ids = tokenizer.encode("hello there, " * 400)
    steps = []
    original = IncrementalDetokenizer._step
    monkeypatch.setattr(IncrementalDetokenizer, "_step",
                        lambda self, token: steps.append(token) or original(self, token))
    detokenizer_for(tokenizer, SamplingParams(), prompt_ids=ids)
    assert steps == ids[-4:]


def test_a_stop_string_is_looked_for_in_the_completions_text_only(tokenizer):
    """The prompt's "EN" and the completion's "D": "END" is not in the completion (vLLM searches its output text);
    a stop string the completed character is, is found."""
    prompt = [*tokenizer.encode("say "), *[tokenizer.encode(c)[0] for c in "EN"]]
    text = detokenizer_for(tokenizer, SamplingParams(stop=("END",)), prompt_ids=prompt)
    assert not any(text.add(t) for t in [tokenizer.encode(c)[0] for c in "D x"])
    assert (text.text, text.stop_reason) == ("D x", None)
    prompt, last = split_euro(tokenizer)
    text = detokenizer_for(tokenizer, SamplingParams(stop=("€",)), prompt_ids=prompt)
    assert text.add(last)
    assert (text.text, text.stop_reason) == ("", "€")


def test_output_processor_primes_and_the_first_tokens_logprob_text_is_vllms(tokenizer):
    """The engine's decoder is primed with the prompt; the logprob entry of the completion's first token reads it
    with the sampled tokens before it (none: vLLM's `LogprobsProcessor`), so it is "" while the text is "€"."""
    prompt, last = split_euro(tokenizer)
    processor = OutputProcessor(tokenizer, None, frozenset({tokenizer.eos_token_id}), 10**6)
    params = SamplingParams(logprobs=0, max_tokens=5)
    seq = Seq(0, "r", 0, list(prompt), len(prompt), params.up_to(10**6 - len(prompt)), None, 0)
    state = processor.new_request("r", None, len(prompt), seq.params, [seq])
    seq.token_ids.append(last)
    assert processor.accept(state, seq, last, TokenLogprob(last, -1.0, 1, ())) is None
    assert processor.output(state).outputs[0].text == "€"
    assert state.logprobs[0][0][last].decoded_token == ""


def test_llm_generate_and_engine_steps_show_the_character(tokenizer):
    """A prompt of token ids that ends with 2 of the 3 bytes of "€", and a completion whose one token is the third
    (forced with logit_bias): "€" through `LLM.generate` (deferred decoding) and `LLMEngine.step` (incremental,
    n = 2); it was "\ufffd" (hunt 153's reproducers)."""
    from hybridcache.llm import LLM

    prompt, last = split_euro(tokenizer)
    params = SamplingParams(max_tokens=1, temperature=0, logit_bias={last: 100})
    with LLM(None, block_size=16, max_model_len=256, num_blocks=256) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert (out.outputs[0].token_ids, out.outputs[0].text) == ([last], "€")
        engine = llm.engine
        engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0, logit_bias={last: 100}, n=2))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [c.text for c in outputs[-1].outputs] == ["€", "€"]
        assert outputs[-1].prompt_token_ids == prompt
