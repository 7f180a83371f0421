"""What the router predicts a request by (router/prompts.py): the prompt the replica runs, as it runs it. A prompt
text the replicas would refuse by its size is not tokenized (it took a 16 MiB prompt 12 s and 4 GiB); prompts are
tokenized on the router's own threads; prompt_logprobs predicts no hit, truncate_prompt_tokens the ids kept."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import httpx
import pytest

from hybridcache.router.app import RouterConfig, build_router_app
from hybridcache.router.policy import RoutingConfig
from hybridcache.router.prompts import PromptLimits, routed_prompt_ids
from tests.router.serving import serving_app
from tests.router.test_faults import PROMPT, _fake_replica, _metric

MAX_MODEL_LEN = 64


class _SpyTokenizer:
    """A tokenizer whose longest vocabulary entry is 4 bytes (`limits.max_token_bytes`), one id per character,
    recording what it encodes, and on which thread."""

    backend = SimpleNamespace(get_vocab=lambda with_added_tokens=True: {"abcd": 0, "e": 1})

    def __init__(self) -> None:
        self.encoded: list[tuple[int, str]] = []

    def encode(self, text: str) -> list[int]:
        self.encoded.append((len(text), threading.current_thread().name))
        return [1 + ord(c) % 50 for c in text]


def _replica_with_models(hit_step: int = 0):
    app = _fake_replica("ok", hit_step=hit_step)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": MAX_MODEL_LEN}]}

    return app


def test_a_prompt_over_the_replicas_size_limit_is_not_tokenized_by_the_router():
    """64 tokens x 4 bytes: a 1 MB text is routed by load and reaches the replica (whose 400 the client gets),
    untokenized; a short one is tokenized on the router's own threads, not asyncio's default pool."""
    replica, tokenizer = _replica_with_models(), _SpyTokenizer()
    with serving_app(replica) as url:
        router_app = build_router_app(RouterConfig((url,), poll_interval_s=30.0), tokenizer=tokenizer)
        with serving_app(router_app) as router:
            response = httpx.post(f"{router}/v1/completions", json={"prompt": "x" * 1_000_000}, timeout=30)
            assert response.status_code == 200 and replica.state.calls == 1
            assert tokenizer.encoded == []
            response = httpx.post(f"{router}/v1/completions", json={"prompt": "hello"}, timeout=30)
            assert response.status_code == 200 and replica.state.calls == 2
            [(length, thread)] = tokenizer.encoded
            assert length == 5 and thread.startswith("router-tokenize")


def test_routed_prompt_ids_follow_the_replicas_rules():
    tokenizer, limits = _SpyTokenizer(), PromptLimits(MAX_MODEL_LEN, 4)
    ids = tokenizer.encode("a" * 300)
    assert routed_prompt_ids("/v1/completions", {"prompt": "a" * 300}, tokenizer, limits=limits) == []  # > 256 B
    assert routed_prompt_ids("/v1/completions", {"prompt": "a" * 300}, tokenizer) == [ids]  # no limit known
    tokenizer.encoded.clear()
    kept = routed_prompt_ids("/v1/completions", {"prompt": "a" * 300, "truncate_prompt_tokens": 5}, tokenizer,
                             limits=limits)
    assert kept == [ids[-5:]] and tokenizer.encoded[0][0] < 300  # the window that holds them only
    right = {"prompt": PROMPT, "truncate_prompt_tokens": 5, "truncation_side": "right"}
    assert routed_prompt_ids("/v1/completions", right, None, limits=limits) == [PROMPT[:5]]
    # -1: max_model_len - max_tokens (completions' default 16)
    assert routed_prompt_ids("/v1/completions", {"prompt": list(range(100)), "truncate_prompt_tokens": -1}, None,
                             limits=limits) == [list(range(100))[-(MAX_MODEL_LEN - 16):]]
    assert routed_prompt_ids("/v1/completions", {"prompt": list(range(100)), "truncate_prompt_tokens": -1,
                                                 "max_tokens": 4}, None, limits=limits) == [list(range(100))[-60:]]
    for body in ({"prompt": PROMPT, "prompt_logprobs": 0}, {"prompt": PROMPT, "echo": True, "logprobs": 1}):
        assert routed_prompt_ids("/v1/completions", body, None, limits=limits) == []


@pytest.mark.parametrize("extra, predicted", [({"prompt_logprobs": 0}, 0),
                                              ({"truncate_prompt_tokens": 10}, 0),
                                              ({"truncate_prompt_tokens": 15, "truncation_side": "right"}, 12),
                                              ({}, 12)],
                         ids=["prompt_logprobs", "truncate-left", "truncate-right", "plain"])
def test_predictions_of_prompt_logprobs_and_truncated_prompts(extra, predicted):
    """A prompt_logprobs request takes nothing from the prefix cache, a truncated prompt matches by the ids it
    keeps (both were predicted by the whole prompt: 12 hit tokens where the replica reported 0)."""
    with serving_app(_replica_with_models(hit_step=12)) as url:
        config = RouterConfig((url,), RoutingConfig("checkpoint"), poll_interval_s=30.0)
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, **extra}, timeout=30)
            assert response.status_code == 200
            metrics = httpx.get(f"{router}/metrics").text
            assert _metric(metrics, "hybridcache_router_predicted_hit_tokens_total", url) == predicted
