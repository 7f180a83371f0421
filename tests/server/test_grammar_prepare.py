"""Structured output's libraries are prepared at start-up: `GrammarCache.prepare` builds xgrammar's compiler and
llguidance's tokenizer (and imports them), so the first constrained request does not wait seconds for them; the
server runs it on a thread of its own, which neither /health nor the engine waits for, and a request that needs the
build meanwhile waits for it (one build) and gets its own grammar."""

from __future__ import annotations

import importlib.util
import json
import threading
import time

import httpx
import jsonschema
import pytest

from hybridcache import guided, guided_llguidance
from hybridcache.guided import GrammarCache, GuidedKind, GuidedSpec
from hybridcache.guided_llguidance import LLGuidanceCompiler, LLGuidanceMissing
from hybridcache.models.builtin import BUILTIN_NAME, ensure_builtin_model
from hybridcache.tokenizer import Tokenizer

from .inprocess_server import serving

needs_guided = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None
                                  or importlib.util.find_spec("xgrammar") is None,
                                  reason="needs xgrammar and llguidance (guided)")

# xgrammar would not enforce `multipleOf` (schema_checks): this schema compiles with llguidance
MULTIPLES = {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 20}


def _counting(monkeypatch, owner, name: str, gate: threading.Event | None = None) -> list[str]:
    """Replace `owner.name` with a wrapper that records the calling thread's name (and waits for `gate`)."""
    calls: list[str] = []
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls.append(threading.current_thread().name)
        if gate is not None:
            assert gate.wait(120), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


@needs_guided
def test_prepare_builds_what_the_first_compile_would(monkeypatch):
    import llguidance.hf
    import xgrammar

    infos = _counting(monkeypatch, xgrammar.TokenizerInfo, "from_huggingface")
    built = _counting(monkeypatch, llguidance.hf, "from_tokenizer")
    tokenizer = Tokenizer(ensure_builtin_model())
    cache = GrammarCache(tokenizer.hf, tokenizer.vocab_size, [0])
    cache.prepare()
    assert (len(infos), len(built)) == (1, 1)
    cache.check(GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps({"type": "integer"})))
    cache.check(GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(MULTIPLES)))
    assert (len(infos), len(built)) == (1, 1)  # (the compiles used what prepare built)


def test_prepare_skips_a_library_that_does_not_import(monkeypatch):
    def missing_xgrammar():
        raise guided.GuidedUnavailable("structured output needs the xgrammar package")

    def missing_llguidance():
        raise LLGuidanceMissing("llguidance does not import")

    monkeypatch.setattr(guided, "_xgrammar", missing_xgrammar)
    monkeypatch.setattr(guided_llguidance, "_llguidance", missing_llguidance)
    tokenizer = Tokenizer(ensure_builtin_model())
    cache = GrammarCache(tokenizer.hf, tokenizer.vocab_size, [0])
    cache.prepare()  # (nothing raised)
    with pytest.raises(guided.GuidedUnavailable, match="xgrammar"):
        cache.check(GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps({"type": "integer"})))


@needs_guided
def test_start_up_does_not_wait_for_the_build_and_a_request_meanwhile_gets_its_grammar(monkeypatch):
    """llguidance's tokenizer build is held until the test opens a gate: /health answers, an unconstrained and an
    xgrammar request are served meanwhile; a request that needs llguidance waits for that build (no second one) and
    then keeps to its schema, although logit_bias pushes the digits 1, 3 and 7 (only 10 or 15 may follow a 1)."""
    import llguidance.hf

    gate = threading.Event()
    built = _counting(monkeypatch, llguidance.hf, "from_tokenizer", gate)
    entered = _counting(monkeypatch, LLGuidanceCompiler, "_llg_tokenizer")
    tokenizer = Tokenizer(ensure_builtin_model())
    bias = {str(tokenizer.encode(digit)[0]): 30 for digit in "137"}
    body = {"model": BUILTIN_NAME, "prompt": "a number:", "max_tokens": 8, "temperature": 0, "logit_bias": bias}
    try:
        with serving() as base_url:
            url = f"{base_url}/v1/completions"
            deadline = time.monotonic() + 120
            while not built and time.monotonic() < deadline:  # the start-up build is under way, held at the gate
                time.sleep(0.05)
            assert built == ["hybridcache-grammar-prepare"], built
            assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
            assert httpx.post(url, json={**body, "max_tokens": 2}, timeout=60).status_code == 200
            regex = httpx.post(url, json={**body, "guided_regex": "[0-9]{3}"}, timeout=60).raise_for_status().json()
            assert len(regex["choices"][0]["text"]) == 3
            answer: dict = {}
            waiting = threading.Thread(target=lambda: answer.update(
                response=httpx.post(url, json={**body, "guided_json": MULTIPLES}, timeout=120)))
            waiting.start()
            while len(entered) < 2 and time.monotonic() < deadline:  # the request reached the build's lock
                time.sleep(0.05)
            assert len(entered) >= 2 and waiting.is_alive() and len(built) == 1, (entered, built)
            gate.set()
            waiting.join(120)
            assert not waiting.is_alive()
    finally:
        gate.set()
    response = answer["response"]
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    value = json.loads(choice["text"])
    jsonschema.validate(value, MULTIPLES)
    assert choice["finish_reason"] == "stop" and value in (10, 15), choice
    assert built == ["hybridcache-grammar-prepare"]  # (one build: the request used the start-up one)


@needs_guided
def test_prepare_and_an_llguidance_mask_leave_torch_compile_unimported():
    """The server prepares the grammar libraries on a thread while it serves: an import of torch._dynamo there
    (llguidance.torch compiles a function with torch.compile at import) is seconds of a core holding the GIL. A fresh
    process prepares, then fills an llguidance bitmask (a schema xgrammar would not enforce), and the mask allows
    exactly the first digits of the multiples of 5 in 0-20 (0, 5, 10, 15, 20). The built-in model is written here
    first (writing it imports transformers' model code, which imports torch._dynamo; a server loads a written one)."""
    import subprocess
    import sys

    ensure_builtin_model()

    script = f"""
import json, sys
import torch
from hybridcache.guided import GrammarCache, GuidedKind, GuidedSpec
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.tokenizer import Tokenizer
tokenizer = Tokenizer(ensure_builtin_model())
cache = GrammarCache(tokenizer.hf, tokenizer.vocab_size, [0])
cache.prepare()
spec = GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps({MULTIPLES!r}))
cache.check(spec)
matcher = cache.matcher(spec)
bitmask = torch.zeros((2, (tokenizer.vocab_size + 31) // 32), dtype=torch.int32)
matcher.fill_next_token_bitmask(bitmask, 1)
allowed = [t for t in range(tokenizer.vocab_size) if bitmask[1, t // 32] >> (t % 32) & 1]
print(json.dumps({{"dynamo": "torch._dynamo" in sys.modules, "kind": type(matcher).__name__,
                  "allowed": [tokenizer.decode([t]) for t in allowed], "row0": int(bitmask[0].abs().sum())}}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["kind"] == "LLGuidanceMatcher"
    assert not seen["dynamo"]
    assert seen["row0"] == 0  # only the row asked for is written
    assert sorted(seen["allowed"]) == ["0", "1", "2", "5"]
