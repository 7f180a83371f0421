"""Cache salts end to end (vLLM's `cache_salt`: `LLM.generate` dict prompts, `LLM.chat(cache_salt=...)`,
`LLMEngine.add_request(cache_salt=...)`, the server's `EngineLoop.add`): a request shares prefix-cache content only
with requests of the same salt. Another salt, or none, hits nothing (0 cached tokens, its whole prompt prefilled,
the tokens of an uncached run), does not wait for another salt's prefill in flight, and a salted request's states
are never written to disk."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridcache import LLM, SamplingParams
from hybridcache.server.engine_loop import EngineLoop

from .model_folders import write_tiny_model
from .test_cache_equivalence import make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_5_text"), "qwen3_5_text")


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, block_size=16, kernel_block_size=8, max_num_batched_tokens=1024, max_num_seqs=8,
             max_model_len=1024) as llm:
        yield llm


@pytest.fixture(scope="module")
def uncached(model_dir):
    with LLM(model_dir, block_size=16, kernel_block_size=8, max_num_batched_tokens=1024, max_num_seqs=8,
             max_model_len=1024, enable_prefix_caching=False) as llm:
        yield llm


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def salted(prompt: list[int], salt: str | None) -> dict:
    return {"prompt_token_ids": prompt, **({} if salt is None else {"cache_salt": salt})}


def prefill_tokens(llm: LLM) -> int:
    return llm.engine.stats()["num_prefill_tokens"]


def test_only_the_same_salt_hits(llm, uncached):
    llm.reset_prefix_cache()
    prompt = prompt_of(460, seed=1)
    want = uncached.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    first = llm.generate([salted(prompt, "tenant-a")], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    for salt in ("tenant-b", None, "tenant-a-"):  # another salt, none, a salt that extends it: nothing shared
        before = prefill_tokens(llm)
        out = llm.generate([salted(prompt, salt)], GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0, salt
        assert prefill_tokens(llm) - before == len(prompt), salt
        assert out.outputs[0].token_ids == want, salt
    before = prefill_tokens(llm)
    again = llm.generate([salted(prompt, "tenant-a")], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(prompt) - 1  # the same salt: a zero-prefill (or last-token) hit
    assert prefill_tokens(llm) - before <= 1
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
    llm.engine.check_integrity()


def test_salted_prompts_of_one_batch_share_a_prefill_only_within_a_salt(llm, uncached):
    """Prefix-sharing prompts queued together: the follower waits for the leader's prefill and forks from it
    (in-flight sharing) when both have the same salt, never across salts."""
    shared = prompt_of(320, seed=2)
    prompts = [shared + prompt_of(40, seed=3), shared + prompt_of(50, seed=4)]
    want = [o.outputs[0].token_ids for o in uncached.generate(prompts, GREEDY, use_tqdm=False)]
    for salts, computed in ((("x", "y"), sum(map(len, prompts))), (("z", "z"), len(shared) + 40 + 50)):
        llm.reset_prefix_cache()
        before = prefill_tokens(llm)
        outs = llm.generate([salted(p, s) for p, s in zip(prompts, salts)], GREEDY, use_tqdm=False)
        assert prefill_tokens(llm) - before == computed, salts
        assert [o.outputs[0].token_ids for o in outs] == want
        assert [o.num_cached_tokens for o in outs] == ([0, 0] if salts[0] != salts[1] else [0, len(shared)])
    llm.engine.check_integrity()


def test_chat_takes_a_salt_for_every_conversation(llm):
    llm.reset_prefix_cache()
    conversation = [{"role": "user", "content": "tell me about the prefix cache " * 12}]

    def chat(**salt):
        return llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=TEMPLATE, **salt)[0]

    first = chat(cache_salt="tenant-a")
    assert first.num_cached_tokens == 0
    assert chat(cache_salt="tenant-b").num_cached_tokens == 0
    assert chat().num_cached_tokens == 0
    again = chat(cache_salt="tenant-a")
    assert again.num_cached_tokens >= len(first.prompt_token_ids) - 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("salt", ["", 3, b"x"], ids=["empty", "int", "bytes"])
def test_a_bad_salt_is_refused_before_anything_is_queued(llm, salt):
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([salted(prompt_of(20), "ok"), salted(prompt_of(20), salt)], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.engine.add_request("bad", prompt_of(20), GREEDY, cache_salt=salt)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="'cache_salt', not \\['salt'\\]"):
        llm.generate([{"prompt_token_ids": prompt_of(20), "salt": "x"}], GREEDY, use_tqdm=False)


def test_the_engine_loop_hands_the_salt_to_every_prompt(llm):
    """`EngineLoop.add` / `add_many(..., cache_salt=...)`, what the server calls with a request body's field: every
    prompt of the call is salted; a bad salt is the engine's ValueError, raised to the caller."""
    llm.reset_prefix_cache()
    prompt = prompt_of(200, seed=7)
    loop = EngineLoop(llm.engine)

    async def finished(sink: asyncio.Queue):
        while not (output := await sink.get()).finished:
            pass
        return output

    async def main() -> list[int]:
        loop.start()
        try:
            cached = [(await finished(await loop.add("s1", prompt, GREEDY, cache_salt="a"))).num_cached_tokens]
            sinks = await loop.add_many(["s2", "s3"], [prompt, prompt], GREEDY, cache_salt="b")
            cached += [(await finished(sink)).num_cached_tokens for sink in sinks]
            cached.append((await finished(await loop.add("s4", prompt, GREEDY))).num_cached_tokens)
            cached.append((await finished(await loop.add("s5", prompt, GREEDY, cache_salt="a"))).num_cached_tokens)
            with pytest.raises(ValueError, match="cache_salt"):
                await loop.add("s6", prompt, GREEDY, cache_salt="")
            return cached
        finally:
            loop.stop()

    cached = asyncio.run(main())
    # b's two prompts join one step: the second shares the first's prefill (in flight, the same salt)
    assert cached[:2] == [0, 0] and cached[2] >= len(prompt) - 16 and cached[3] == 0
    assert cached[4] >= len(prompt) - 1
    llm.engine.check_integrity()


def test_a_salted_state_is_never_written_to_disk(model_dir, tmp_path):
    """Everything the device pool holds at shutdown is handed to the disk tier, which keeps the unsalted request's
    checkpoints and none of the salted one's (`num_not_kept`); a restarted engine hits the unsalted prompt and
    finds nothing for the salted one, under its salt or unsalted."""
    def engine_on_disk():
        engine = make_engine(model_dir, num_blocks=400, max_model_len=300, max_num_seqs=4, max_num_batched_tokens=256)
        block_bytes = engine.memory_plan.block_bytes
        engine.close()
        return make_engine(model_dir, num_blocks=400, max_model_len=300, max_num_seqs=4, max_num_batched_tokens=256,
                           host_cache_gib=400 * block_bytes / (1 << 30), disk_cache_dir=str(tmp_path / "disk"))

    plain, secret = prompt_of(100, seed=5), prompt_of(100, seed=6)
    first = engine_on_disk()
    run(first, {"plain": (plain, None), "secret": (secret, "tenant-a")})
    first.close()
    disk = first.disk.stats()
    assert disk["num_state_files"] > 0 and disk["num_not_kept"] > 0, disk
    engine = engine_on_disk()
    out = run(engine, {"plain2": (plain + [1], None), "secret2": (secret + [1], "tenant-a"),
                       "unsalted2": (secret + [2], None)})
    assert out["plain2"].num_cached_tokens > 0
    assert out["secret2"].num_cached_tokens == 0 and out["unsalted2"].num_cached_tokens == 0
    engine.check_integrity()
    engine.close()


def run(engine, requests: dict[str, tuple[list[int], str | None]]) -> dict:
    """Greedy 3-token completions (request id -> (prompt, salt)), queued together; the finished outputs."""
    for rid, (prompt, salt) in requests.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), cache_salt=salt)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done
