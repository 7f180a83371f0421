"""`prompt_logprobs` through the `openai` client against a real server (built-in model, chunked prefill): equal to
log_softmax of transformers' logits over the prompt, in vLLM's shapes (per choice for completions, on the response
for chat), and a 400 with streaming."""

import openai
import pytest
import torch
import transformers
from openai import OpenAI

from hybridcache.config import EngineConfig
from hybridcache.models.builtin import BUILTIN_NAME, builtin_model_dir

from .inprocess_server import serving

MODEL = BUILTIN_NAME
PROMPT = "The quick brown fox jumps over the lazy dog; " * 5  # 225 byte tokens


@pytest.fixture(scope="module")
def client():
    config = EngineConfig(block_size=16, max_model_len=4096, num_blocks=2048, max_num_batched_tokens=64)
    with serving(config) as base_url:
        yield OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def expected_log_softmax(prompt_ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(builtin_model_dir(), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt_ids]), position_ids=torch.arange(len(prompt_ids))[None]).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check(entries, prompt_ids, expected, k):
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for p in range(1, len(prompt_ids)):
        row, entry, token = expected[p - 1], entries[p], prompt_ids[p]
        assert list(entry)[0] == str(token)
        assert {int(t) for t in entry} == set(row.topk(k).indices.tolist()) | {token}
        for t, value in entry.items():
            assert value["logprob"] == pytest.approx(row[int(t)].item(), abs=1e-4)
            assert value["rank"] == int((row >= row[int(t)]).sum())
            assert isinstance(value["decoded_token"], str)


def test_completion_and_chat_prompt_logprobs(client, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    assert len(prompt_ids) >= 150
    expected = expected_log_softmax(prompt_ids)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, n=2,
                                         extra_body={"prompt_logprobs": 3})
    for choice in response.choices:  # vLLM's shape: on every completion choice
        check(choice.model_extra["prompt_logprobs"], prompt_ids, expected, 3)
    assert response.usage.prompt_tokens_details.cached_tokens == 0

    messages = [{"role": "user", "content": PROMPT}]
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    check(chat.model_extra["prompt_logprobs"], chat_ids, expected_log_softmax(chat_ids), 0)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in (plain.model_extra or {})
    assert plain.choices[0].message.content == chat.choices[0].message.content


@pytest.mark.parametrize("body, message", [
    ({"prompt_logprobs": 2, "stream": True}, "not available with stream"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be an integer in"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be an integer in"),
])
def test_bad_prompt_logprobs_is_a_400_naming_it(client, body, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=body)
    assert message in error.value.body["message"]
    assert error.value.body["param"] == "prompt_logprobs"
