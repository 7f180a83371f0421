"""`echo` with `logprobs` on /v1/completions, as OpenAI's legacy API and vLLM answer it (what lm-eval's
`local-completions` model reads): the prompt's tokens lead `tokens` / `token_logprobs` / `top_logprobs`, the first
with `null`, each later one the logprob of the prompt token given the tokens before it. Checked against
`log_softmax` of transformers' fp32 logits over a 225-token prompt prefilled in chunks of 64, for text and
token-id prompts, batched, streamed, and with `max_tokens: 0`."""

import openai
import pytest
from openai import OpenAI

from hybridcache.config import EngineConfig
from hybridcache.detokenizer import token_text
from hybridcache.models.builtin import BUILTIN_NAME

from .inprocess_server import serving
from .test_prompt_logprobs import expected_log_softmax

MODEL = BUILTIN_NAME
PROMPT = "The quick brown fox jumps over the lazy dog; " * 5  # 225 byte tokens
OTHER = "Pack my box with five dozen liquor jugs! " * 4


@pytest.fixture(scope="module")
def client():
    config = EngineConfig(block_size=16, max_model_len=4096, num_blocks=2048, max_num_batched_tokens=64)
    with serving(config) as base_url:
        yield OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def check_prompt_part(logprobs, prompt_ids, expected, k, tokenizer):
    """The first len(prompt_ids) entries of a choice's logprobs are the echoed prompt's."""
    count = len(prompt_ids)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731

    def text_of(p, t):  # vLLM's text of token t at prompt position p (detokenizer.token_text)
        return decode([t]) if p == 0 else token_text(decode, t, prompt_ids[max(1, p - 4):p])

    assert logprobs.tokens[:count] == [text_of(p, t) for p, t in enumerate(prompt_ids)]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    offsets = [0]
    for token in logprobs.tokens[:count - 1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset[:count] == offsets
    for p in range(1, count):
        row, token = expected[p - 1], prompt_ids[p]
        assert logprobs.token_logprobs[p] == pytest.approx(row[token].item(), abs=1e-4)
        wanted = {text_of(p, t): row[t].item() for t in [token, *row.topk(k).indices.tolist()]}
        top = logprobs.top_logprobs[p]
        assert set(top) == set(wanted)
        for text, value in top.items():
            assert value == pytest.approx(wanted[text], abs=1e-4)


def test_echo_logprobs_of_a_text_prompt_then_the_generated_token(client, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    assert len(prompt_ids) >= 150
    expected = expected_log_softmax(prompt_ids)
    # what lm-eval's local-completions sends for a loglikelihood request
    response = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1,
                                         temperature=0)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 1
    check_prompt_part(logprobs, prompt_ids, expected, 1, tokenizer)
    generated = expected[-1].argmax().item()  # greedy
    assert logprobs.tokens[-1] == tokenizer.decode([generated], skip_special_tokens=False)
    assert logprobs.token_logprobs[-1] == pytest.approx(expected[-1][generated].item(), abs=1e-4)
    assert logprobs.text_offset[-1] == len(PROMPT)
    assert choice.text.startswith(PROMPT)  # then the generated token's text (a random model's may be empty)
    assert response.usage.completion_tokens == 1
    assert "prompt_logprobs" not in (choice.model_extra or {})  # not asked for


def test_echo_with_max_tokens_0_batched_token_ids(client, tokenizer):
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode(OTHER)]
    response = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=2, max_tokens=0,
                                         temperature=0)
    assert len(response.choices) == 2
    for choice, prompt_ids in zip(response.choices, prompts):
        assert choice.text == tokenizer.decode(prompt_ids)
        assert len(choice.logprobs.tokens) == len(prompt_ids)
        check_prompt_part(choice.logprobs, prompt_ids, expected_log_softmax(prompt_ids), 2, tokenizer)
        assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == sum(map(len, prompts))


def test_streamed_echo_logprobs_equal_the_whole_response(client, tokenizer):
    kwargs = dict(model=MODEL, prompt=OTHER, echo=True, logprobs=1, max_tokens=4, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    tokens, token_logprobs, offsets, text = [], [], [], ""
    for event in client.completions.create(stream=True, **kwargs):
        for choice in event.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                token_logprobs += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert token_logprobs == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset


def test_echo_offsets_of_split_characters_run_on_and_streamed_equals_whole(client):
    """A prompt whose characters the byte tokenizer splits (each piece decodes to one U+FFFD): the generated
    tokens' offsets restarted at len(echo), below the prompt tokens' (offsets went back), and the stream's n = 2
    second choice, whose first chunk held the echo alone, ran on from the prompt tokens' instead. Now, as vLLM's,
    every offset is the one before plus its token's text, streamed or not."""
    kwargs = dict(model=MODEL, prompt="naïve café ✓ " * 3, echo=True, logprobs=0, max_tokens=4, temperature=1.0,
                  seed=5, n=2)
    whole = {c.index: c.logprobs for c in client.completions.create(**kwargs).choices}
    streamed = {0: [], 1: []}
    for event in client.completions.create(stream=True, **kwargs):
        for choice in event.choices:
            if choice.logprobs is not None:
                streamed[choice.index] += choice.logprobs.text_offset
    for index, logprobs in whole.items():
        offsets = [0]
        for token in logprobs.tokens[:-1]:
            offsets.append(offsets[-1] + len(token))
        assert logprobs.text_offset == offsets == streamed[index], index


def test_prompt_logprobs_field_keeps_its_own_k_next_to_echo(client, tokenizer):
    prompt_ids = tokenizer.encode(OTHER)
    response = client.completions.create(model=MODEL, prompt=OTHER, echo=True, logprobs=3, max_tokens=1,
                                         temperature=0, extra_body={"prompt_logprobs": 1})
    choice = response.choices[0]
    check_prompt_part(choice.logprobs, prompt_ids, expected_log_softmax(prompt_ids), 3, tokenizer)
    entries = choice.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for p, entry in enumerate(entries[1:], start=1):
        assert list(entry)[0] == str(prompt_ids[p])
        assert all(value["rank"] <= 1 for token, value in entry.items() if token != str(prompt_ids[p]))
        assert 1 <= len(entry) <= 2


def test_max_tokens_0_without_echo_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert error.value.body["param"] == "max_tokens"
    assert "echo" in error.value.body["message"]
