"""A live server with MTP speculative decoding (`--speculative-config`, the built-in model's random head): requests
work, what is not supported yet is a 400 naming it, the engine stays intact, and /metrics carries the spec_decode
counters."""

from __future__ import annotations

import httpx

from tests.server.conftest import MODEL
from tests.server.server_process import running_server


def test_speculative_server(tmp_path):
    spec = '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}'
    with running_server("--block-size", "16", "--max-model-len", "512", "--speculative-config", spec,
                        "--enable-debug-endpoints", tmp_dir=tmp_path) as server:
        url = f"{server.base_url}/v1/completions"
        body = {"model": MODEL, "prompt": "The cache keeps", "max_tokens": 12, "temperature": 0}
        ok = httpx.post(url, json=body, timeout=120)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 12
        with_logprobs = httpx.post(url, json={**body, "logprobs": 2}, timeout=120)
        assert with_logprobs.status_code == 200, with_logprobs.text
        assert with_logprobs.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
        for extra, word in (({"repetition_penalty": 1.3}, "penalties"), ({"guided_regex": "[a-z]+"}, "structured")):
            refused = httpx.post(url, json={**body, **extra}, timeout=60)
            assert refused.status_code == 400, refused.text
            assert word in refused.json()["error"]["message"] and "speculative" in refused.json()["error"]["message"]
        assert httpx.get(f"{server.base_url}/debug/engine", timeout=60).json()["integrity"] == "ok"
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        drafts = [line for line in metrics.splitlines() if line.startswith("hybridcache_spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0, metrics
        assert "hybridcache_spec_decode_num_accepted_tokens_per_pos_total{model_name=" in metrics
        assert "hybridcache_spec_decode_request_acceptance_rate_count{model_name=" in metrics
