"""End-to-end engine tests on tiny random models: batching, chunking, preemption, sampling, errors."""

import dataclasses
import json

import pytest
import torch

from hybridcache import LLM, RequestOutputKind, SamplingParams
from hybridcache.engine.engine import LLMEngine

from .model_folders import load_hf_model, prompts_of, write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def small_llm(model_dir, **options):
    defaults = dict(block_size=16, kernel_block_size=8, max_num_batched_tokens=64, max_num_seqs=4)
    return LLM(model_dir, **{**defaults, **options})


def test_greedy_tokens_are_transformers_argmax(model_dir):
    """Every greedy token equals the argmax of transformers' full forward over prompt + earlier tokens.

    (transformers' own `generate` is not the oracle here: its incremental path for these hybrid classes
    does not pass cache-offset positions, so it drifts from its own full forward after the first token.)
    """
    prompts = prompts_of([157, 203])
    outputs = small_llm(model_dir).generate(prompts, GREEDY, use_tqdm=False)
    hf = load_hf_model(model_dir)
    for prompt, output in zip(prompts, outputs):
        generated = output.outputs[0].token_ids
        tokens = torch.tensor([prompt + generated])
        with torch.inference_mode():
            logits = hf(tokens, position_ids=torch.arange(tokens.shape[1])[None]).logits[0]
        assert generated == logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_batch_equals_one_at_a_time(model_dir):
    prompts = prompts_of([3, 40, 150, 64, 17, 190])
    llm = small_llm(model_dir)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
    llm.engine.check_integrity()


def test_preemption_under_a_tiny_pool_gives_the_same_tokens(model_dir):
    # Each sequence ends at 150 + 20 = 170 tokens = 11 blocks of 16; two of them cannot run in 20 blocks.
    prompts = prompts_of([150, 150, 150, 150], seed=1)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    roomy = small_llm(model_dir).generate(prompts, params, use_tqdm=False)
    tight_llm = small_llm(model_dir, num_blocks=20, max_model_len=300, max_num_batched_tokens=128)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    assert tight_llm.engine.scheduler.num_preemptions > 0
    engine = tight_llm.engine
    engine.check_integrity()
    # idle: no runtime slot is held; the cached checkpoints hold k blocks of the pool each
    stats, k = engine.stats(), engine.memory_plan.state_pages
    assert stats["num_slots_used"] == 0 and stats["cache"].num_checkpoints > 0
    assert stats["num_blocks_used"] >= k * stats["cache"].num_checkpoints
    engine.clear_cache()
    assert engine.stats()["num_blocks_used"] == 0 and engine.stats()["num_slots_used"] == 0


def test_seeded_sampling_with_n(model_dir):
    llm = small_llm(model_dir)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=11, n=3, ignore_eos=True)
    first = llm.generate(prompts_of([30]), params, use_tqdm=False)[0]
    again = llm.generate(prompts_of([30]), params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


@pytest.mark.parametrize("off", [{"enable_prefix_caching": False}, {"cache_mode": "none"}])
def test_with_caching_off_nothing_is_kept_matched_or_reported(model_dir, off):
    """With prefix caching off, a finished request's full blocks stayed in the trie: an idle engine counted them
    used, announced them as stored (a router sent conversations there) and /v1/cache/match reported KV tokens
    that no request could hit. Now its blocks are private and freed when it ends; the outputs are unchanged."""
    from hybridcache.cache import CacheRequest

    prompt = prompts_of([200], seed=8)[0]
    outputs = []
    for options in (off, {"enable_prefix_caching": True}):
        llm = small_llm(model_dir, max_model_len=300, **options)
        cache = llm.engine.scheduler.cache
        log = cache.enable_events(1000)
        outputs.append(llm.generate([prompt, prompt], GREEDY, use_tqdm=False))
        if options is off:
            assert llm.engine.stats()["num_blocks_used"] == 0 and not log.since(0).events
            assert cache.probe(CacheRequest("probe", tuple(prompt))).kv_len == 0
            llm.engine.check_integrity()
    assert [o.outputs[0].token_ids for o in outputs[0]] == [o.outputs[0].token_ids for o in outputs[1]]


def test_stop_token_and_length(model_dir):
    llm = small_llm(model_dir)
    prompt = prompts_of([20])[0]
    free = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    stop_at = free.token_ids[2]
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at], ignore_eos=True)
    stopped = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    first_hit = free.token_ids.index(stop_at)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first_hit + 1]


def test_stop_string_cuts_the_text(model_dir):
    llm = small_llm(model_dir)
    prompt = prompts_of([25])[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    needle = text[3:5]
    if not needle or needle.isspace():
        pytest.skip("the random model produced no usable text to stop on")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[needle])
    stopped = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.find(needle)]
    kept = llm.generate([prompt], dataclasses.replace(params, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert (kept.text, kept.token_ids) == (text[: text.find(needle) + len(needle)], stopped.token_ids)


def test_min_tokens_holds_back_stop_strings(model_dir):
    """vLLM's rule: a stop string ends a completion only after `min_tokens` tokens, and never one that starts in
    their text. Every token is "a" (a logit bias) and "a" is a stop string: the completion is min_tokens of them."""
    llm = small_llm(model_dir)
    a = llm.tokenizer.encode("a")
    assert len(a) == 1
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=5, stop=["a"], logit_bias={a[0]: 100.0})
    out = llm.generate(prompts_of([20]), params, use_tqdm=False)[0].outputs[0]
    assert (out.text, len(out.token_ids), out.finish_reason) == ("aaaaa", 6, "stop")


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(model_dir):
    """vLLM decodes the token that stopped a completion into its text when include_stop_str_in_output is set (a
    special EOS only with skip_special_tokens off); without it, never."""
    llm = small_llm(model_dir)
    x = llm.tokenizer.encode("x")[0]
    eos = min(llm.engine.eos_token_ids)
    prompt = prompts_of([20])
    by_id = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[x], logit_bias={x: 100.0}, ignore_eos=True)
    texts = [llm.generate(prompt, dataclasses.replace(by_id, include_stop_str_in_output=keep),
                          use_tqdm=False)[0].outputs[0].text for keep in (False, True)]
    assert texts == ["", "x"]
    by_eos = SamplingParams(temperature=0, max_tokens=6, logit_bias={eos: 100.0}, skip_special_tokens=False)
    texts = [llm.generate(prompt, dataclasses.replace(by_eos, include_stop_str_in_output=keep),
                          use_tqdm=False)[0].outputs[0].text for keep in (False, True)]
    assert texts == ["", llm.tokenizer.decode([eos], skip_special_tokens=False)]
    assert texts[1]


def test_max_model_len_ends_with_length(model_dir):
    llm = small_llm(model_dir, max_model_len=40)
    out = llm.generate(prompts_of([35]), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_an_engine_request_with_max_tokens_none_runs_to_the_model_length(model_dir):
    """vLLM's max_tokens=None, sent to the engine directly (not through LLM.generate): up to max_model_len."""
    llm = small_llm(model_dir, max_model_len=40)
    engine = llm.engine
    engine.add_request("r", prompts_of([35])[0], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert (len(outputs[0].outputs[0].token_ids), outputs[0].outputs[0].finish_reason) == (5, "length")

@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "empty"),
        ([1, 2, 320], "token ids must be integers in \\[0, 320\\)"),
        ([1, -1], "token ids must be integers"),
        ([1, "a"], "token ids must be integers"),
        ("", "empty"),
        (list(range(100)), "max_model_len is 64"),
        ("a\udcffb", "not valid Unicode text"),  # a lone surrogate (the tokenizer's own error named no field)
    ],
)
def test_bad_prompts_raise_and_leave_the_engine_intact(model_dir, prompt, message):
    llm = small_llm(model_dir, max_model_len=64)
    good = prompts_of([20])
    expected = llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        llm.generate([good[0], prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_pool_too_small_for_one_sequence_is_refused_before_loading(model_dir):
    with pytest.raises(ValueError, match="too small for one sequence"):
        small_llm(model_dir, num_blocks=3, max_model_len=64)


def test_unknown_architecture_lists_the_supported_ones(model_dir, tmp_path):
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["MysteryForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MysteryForCausalLM") as info:
        LLMEngine(tmp_path)
    assert "Qwen3_5ForCausalLM" in str(info.value) and "Qwen3NextForCausalLM" in str(info.value)


def test_duplicate_request_id_is_refused(model_dir):
    engine = small_llm(model_dir).engine
    engine.add_request("a", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [4, 5], GREEDY)
    engine.abort("a")
    engine.check_integrity()


def test_abort_mid_prefill_and_mid_decode_releases_everything(model_dir):
    engine = small_llm(model_dir).engine
    engine.add_request("long", prompts_of([200])[0], GREEDY)
    engine.add_request("short", prompts_of([10], seed=5)[0], GREEDY)
    engine.step()  # "long" is mid-prefill (budget 64), "short" waits
    engine.step()
    assert engine.abort("long").outputs[0].finish_reason == "abort"
    while not engine.step():  # until "short" has sampled a token
        pass
    aborted = engine.abort("short")
    assert aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].token_ids
    engine.check_integrity()
    assert engine.stats()["num_running"] == 0 and engine.scheduler.cache.running_ids() == []
    engine.clear_cache()
    assert engine.stats()["num_blocks_used"] == 0 and engine.stats()["num_slots_used"] == 0
    assert not engine.has_unfinished_requests()


def test_final_only_requests_come_out_once_finished_with_the_same_tokens(model_dir):
    """FINAL_ONLY requests (what LLM.generate uses): `step` returns nothing for the request until it finishes,
    then its full output, equal to what a streamed request ends with."""
    engine = small_llm(model_dir).engine
    prompt = prompts_of([30], seed=3)[0]
    engine.add_request("streamed", prompt, GREEDY)
    engine.add_request("final", prompt, dataclasses.replace(GREEDY, output_kind=RequestOutputKind.FINAL_ONLY))
    seen: dict[str, list] = {"streamed": [], "final": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert len(seen["streamed"]) == GREEDY.max_tokens and not any(o.finished for o in seen["streamed"][:-1])
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert seen["final"][0].outputs[0].token_ids == seen["streamed"][-1].outputs[0].token_ids
    assert seen["final"][0].outputs[0].text == seen["streamed"][-1].outputs[0].text  # decoded once, at the end
    engine.check_integrity()


def test_a_failed_forward_leaves_the_engine_dead_not_inconsistent(model_dir, monkeypatch):
    """A forward that raises after the scheduler committed its step (a device error, a dead worker) leaves a
    cache that may index blocks the device never wrote: that step raises the error, and every later step, request
    and integrity check raises EngineDeadError naming it; aborting still works."""
    from hybridcache.engine.engine import EngineDeadError

    engine = small_llm(model_dir).engine
    engine.add_request("a", prompts_of([40], seed=6)[0], GREEDY)
    engine.step()

    def broken(batch, feed=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.step()
    for call in (engine.step, lambda: engine.add_request("b", [1, 2, 3], GREEDY), engine.check_integrity):
        with pytest.raises(EngineDeadError, match="failed earlier.*illegal memory access"):
            call()
    assert engine.abort("a").outputs[0].finish_reason == "abort"
