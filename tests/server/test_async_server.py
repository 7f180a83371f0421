"""The server over an engine with async scheduling (the CUDA default; forced on here on the CPU): streamed and whole
completions, `n`, logprobs, stop strings, a client that hangs up mid-stream, and the second turn's cached tokens,
each equal to what the synchronous engine's server sends."""

import dataclasses
import json
import time

import httpx
from openai import OpenAI

from hybridcache.models.builtin import BUILTIN_NAME

from .inprocess_server import ENGINE, serving

PROMPT = "Tell me about the sea and the sky, " * 6


def exchange(base_url: str) -> dict:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = {}
    whole = client.completions.create(model=BUILTIN_NAME, prompt=PROMPT, max_tokens=24, temperature=0, n=2,
                                      logprobs=2)
    out["whole"] = [(c.text, c.finish_reason, c.logprobs.tokens) for c in whole.choices]
    stream = client.completions.create(model=BUILTIN_NAME, prompt=PROMPT + "again", max_tokens=20, temperature=0,
                                       stop=["e"], stream=True)
    out["stream"] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    with httpx.stream("POST", f"{base_url}/v1/completions", timeout=60,
                      json={"model": BUILTIN_NAME, "prompt": PROMPT + "gone", "max_tokens": 400, "stream": True}) as r:
        next(r.iter_lines())  # one event, then hang up: the server aborts the request
    messages = [{"role": "user", "content": PROMPT}]
    first = client.chat.completions.create(model=BUILTIN_NAME, messages=messages, max_tokens=12, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
    second = client.chat.completions.create(model=BUILTIN_NAME, messages=messages, max_tokens=12, temperature=0)
    out["chat"] = [first.choices[0].message.content, second.choices[0].message.content]
    out["cached"] = second.usage.prompt_tokens_details.cached_tokens
    return out


def test_async_server_sends_what_the_synchronous_one_sends():
    results = []
    for flag in (False, True):
        with serving(dataclasses.replace(ENGINE, async_scheduling=flag), enable_debug_endpoints=True) as base_url:
            results.append(exchange(base_url))
            for _ in range(100):  # the hung-up request is aborted by the time the engine is idle
                check = httpx.get(f"{base_url}/debug/engine", params={"clear_cache": "true"}, timeout=30)
                if check.status_code != 409:
                    break
                time.sleep(0.1)
            assert check.status_code == 200, check.text
            state = check.json()["engine"]
            assert state["num_running"] == 0 and state["num_blocks_used"] == 0 and state["num_slots_used"] == 0
    sync, async_ = results
    assert async_["whole"] == sync["whole"] and async_["stream"] == sync["stream"] and async_["chat"] == sync["chat"]
    assert async_["cached"] >= sync["cached"] > 0


def test_a_stream_interval_sends_fewer_chunks_of_the_same_text_and_times_every_token():
    """`--stream-interval 4`: a streamed completion comes in chunks of up to 4 tokens (its first token alone, as
    vLLM's), with the text, finish reason and usage of the every-step stream, and a streamed chat's content is the
    every-step stream's; the latency metrics still time every token (12 tokens: 11 inter-token gaps, counted
    before the chat runs)."""
    from .server_process import metric_value

    body = {"model": BUILTIN_NAME, "prompt": PROMPT + "in chunks", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    seen = {}
    for interval in (1, 4):
        with serving(dataclasses.replace(ENGINE, stream_interval=interval)) as base_url:
            with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
                events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
            metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
            client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
            chat = client.chat.completions.create(model=BUILTIN_NAME, messages=[{"role": "user", "content": PROMPT}],
                                                  max_tokens=10, temperature=0, stream=True)
            chat_text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        seen[interval] = ("".join(c["text"] for c in choices), choices[-1]["finish_reason"], chunks[-1]["usage"],
                          chat_text, len(choices))
        assert metric_value(metrics, "vllm:inter_token_latency_seconds_count") == 11
        assert metric_value(metrics, "vllm:generation_tokens_total") == 12
    assert seen[4][:4] == seen[1][:4] and seen[1][1] == "length" and seen[1][3]
    assert seen[4][4] <= 4 < seen[1][4]  # outputs at tokens 1, 5, 9, 12 (a chunk only where text is shown)
