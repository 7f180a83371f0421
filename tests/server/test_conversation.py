"""A three-turn chat through the prefix cache: turns 2 and 3 skip the whole previous conversation, and the
answers equal those of a server started with --no-prefix-cache.

The built-in model emits random bytes, so an answer often is not valid UTF-8 and its text cannot be turned
back into the same tokens; then no client could send the conversation back exactly. The conversation is
therefore built on the uncached server, choosing at each turn the first candidate question whose answer
round-trips, and then replayed on the cached server, where each turn is the first request that extends it.
"""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.server_process import SMALL_ENGINE, common_prefix_len, running_servers

BLOCK_SIZE = 16
MAX_TOKENS = 3
NUM_CANDIDATES = 80


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conversation")
    with running_servers(SMALL_ENGINE, (*SMALL_ENGINE, "--no-prefix-cache"), tmp_dir=tmp) as (cached, uncached):
        yield cached, uncached


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def _fed_ids(tokenizer, messages, response) -> list[int]:
    """Every token whose state the finished request computed: its prompt and its output except the last
    sampled token (an EOS, or the token that hit max_tokens), which is never fed."""
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    answer_ids = tokenizer.encode(response.choices[0].message.content)
    if response.choices[0].finish_reason == "length":
        answer_ids = answer_ids[:-1]
    return prompt_ids + answer_ids


def _round_trips(tokenizer, response) -> bool:
    choice = response.choices[0]
    answer = choice.message.content
    answer_ids = tokenizer.encode(answer)
    num_eos = 1 if choice.finish_reason == "stop" else 0
    return "\ufffd" not in answer and response.usage.completion_tokens == len(answer_ids) + num_eos


def _chat(client, messages):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)


def test_three_turns_reuse_the_whole_previous_conversation(servers, tokenizer):
    cached_server, uncached_server = servers
    uncached, cached = _client(uncached_server), _client(cached_server)

    # Build the conversation on the uncached server (nothing there is ever cached).
    turns: list[tuple[str, str]] = []  # (question, answer)
    history: list[dict] = []
    for turn in range(3):
        for candidate in range(NUM_CANDIDATES):
            question = f"Turn {turn + 1}, question {candidate}: go on?"
            messages = [*history, {"role": "user", "content": question}]
            response = _chat(uncached, messages)
            assert response.usage.prompt_tokens_details.cached_tokens == 0
            fed = _fed_ids(tokenizer, messages, response)
            if (_round_trips(tokenizer, response) and response.usage.prompt_tokens % BLOCK_SIZE
                    and len(fed) % BLOCK_SIZE):
                break
        else:
            pytest.fail(f"no candidate answer of turn {turn + 1} round-trips through text")
        answer = response.choices[0].message.content
        turns.append((question, answer))
        history = [*messages, {"role": "assistant", "content": answer}]

    # Replay it on the cached server: each turn is the first request that extends the conversation.
    history, previous_fed = [], None
    for turn, (question, answer) in enumerate(turns):
        messages = [*history, {"role": "user", "content": question}]
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        response = _chat(cached, messages)
        assert response.choices[0].message.content == answer  # identical to --no-prefix-cache
        assert response.usage.prompt_tokens == len(prompt_ids)
        cached_tokens = response.usage.prompt_tokens_details.cached_tokens
        if previous_fed is None:
            assert cached_tokens == 0
        else:
            # the template reproduces the whole previous conversation, and all of it is skipped
            assert common_prefix_len(prompt_ids, previous_fed) == len(previous_fed)
            assert cached_tokens == len(previous_fed), f"turn {turn + 1}"
            assert cached_tokens % BLOCK_SIZE != 0
        previous_fed = _fed_ids(tokenizer, messages, response)
        history = [*messages, {"role": "assistant", "content": answer}]
