"""A live server with MTP speculative decoding (`--speculative-config`, the built-in model's random head): requests
work (structured output, a required tool call and penalties too: they were a 400 before), the engine stays intact,
and /metrics carries the spec_decode counters."""

from __future__ import annotations

import json
import re

import httpx

from tests.server.conftest import MODEL
from tests.server.server_process import running_server


def test_speculative_server(tmp_path):
    spec = '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}'
    with running_server("--block-size", "16", "--max-model-len", "1024", "--speculative-config", spec,
                        "--enable-debug-endpoints", tmp_dir=tmp_path) as server:
        url = f"{server.base_url}/v1/completions"
        body = {"model": MODEL, "prompt": "The cache keeps", "max_tokens": 12, "temperature": 0}
        ok = httpx.post(url, json=body, timeout=120)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 12
        with_logprobs = httpx.post(url, json={**body, "logprobs": 2}, timeout=120)
        assert with_logprobs.status_code == 200, with_logprobs.text
        assert with_logprobs.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
        penalized = httpx.post(url, json={**body, "repetition_penalty": 1.3, "presence_penalty": 0.5}, timeout=120)
        assert penalized.status_code == 200, penalized.text
        guided = httpx.post(url, json={**body, "guided_regex": "[a-z]{3,20}!", "max_tokens": 30}, timeout=120)
        assert guided.status_code == 200, guided.text
        assert re.fullmatch("[a-z]{3,20}!", guided.json()["choices"][0]["text"]), guided.json()
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
            "additionalProperties": False}}}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [weather],
                "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0.8,
                "seed": 1}
        called = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=120)
        assert called.status_code == 200, called.text
        choice = called.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]).keys() == {
            "city"}
        assert httpx.get(f"{server.base_url}/debug/engine", timeout=60).json()["integrity"] == "ok"
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        drafts = [line for line in metrics.splitlines() if line.startswith("hybridcache_spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0, metrics
        assert "hybridcache_spec_decode_num_accepted_tokens_per_pos_total{model_name=" in metrics
        assert "hybridcache_spec_decode_request_acceptance_rate_count{model_name=" in metrics
