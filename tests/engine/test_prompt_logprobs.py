"""Prompt logprobs (`SamplingParams.prompt_logprobs`): equal to log_softmax of transformers' logits over the prompt,
through chunked prefill, for a request that would otherwise hit the prefix cache, and next to other requests."""

import math

import pytest
import torch

from hybridcache import LLM, SamplingParams
from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.sampling import Logprob, prompt_logprobs
from hybridcache.scheduler import scheduler as scheduler_module

from .model_folders import load_hf_model, prompts_of, write_tiny_model


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def hf_log_softmax(hf, prompt):
    tokens = torch.tensor([prompt])
    with torch.inference_mode():
        logits = hf(tokens, position_ids=torch.arange(len(prompt))[None]).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against(expected: torch.Tensor, prompt: list[int], got, k: int) -> None:
    """`got` (RequestOutput.prompt_logprobs) equals `expected` [len(prompt), vocab] log_softmax, position by
    position: the prompt token first, then the k likeliest tokens, each with its logprob and rank."""
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        row = expected[p - 1]
        entry = got[p]
        assert list(entry)[0] == prompt[p]
        assert set(entry) == set(row.topk(k).indices.tolist()) | {prompt[p]}
        for token, logprob in entry.items():
            assert logprob.logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert logprob.rank == int((row > row[token]).sum()) + 1
            assert logprob.decoded_token is not None


def test_prompt_logprobs_equal_transformers_through_chunked_prefill(model_dir):
    prompts = prompts_of([157, 203, 40])
    llm = LLM(model_dir, block_size=16, kernel_block_size=8, max_num_batched_tokens=48, max_num_seqs=4)
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k) for k in (2, 5)]
    params.append(SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))  # batched next to one without
    outputs = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf_model(model_dir)
    for prompt, output, k in zip(prompts[:2], outputs[:2], (2, 5)):
        check_against(hf_log_softmax(hf, prompt), prompt, output.prompt_logprobs, k)
    assert outputs[2].prompt_logprobs is None
    llm.engine.check_integrity()


def test_a_request_with_prompt_logprobs_computes_its_whole_prompt(model_dir):
    """The second send of a prompt would hit the cache; with prompt_logprobs it computes every position (and
    reports 0 cached tokens), and its tokens and logprobs equal the first send's."""
    prompt = prompts_of([170], seed=3)[0]
    llm = LLM(model_dir, block_size=16, kernel_block_size=8, max_num_batched_tokens=64, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0  # the cache holds the prompt
    before = llm.engine.num_prefill_tokens
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert llm.engine.num_prefill_tokens - before == len(prompt)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == plain.outputs[0].token_ids
    for a, b in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
    check_against(hf_log_softmax(load_hf_model(model_dir), prompt), prompt, again.prompt_logprobs, 1)
    llm.engine.check_integrity()


def test_n_completions_and_a_one_token_prompt(model_dir):
    llm = LLM(model_dir, block_size=16, kernel_block_size=8, max_num_batched_tokens=64, max_num_seqs=4)
    prompt = prompts_of([60], seed=5)[0]
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([prompt, prompt[:1]], params, use_tqdm=False)
    expected = hf_log_softmax(load_hf_model(model_dir), prompt)
    check_against(expected, prompt, out[0].prompt_logprobs, 0)
    assert out[1].prompt_logprobs == [None]
    assert len(out[0].outputs) == 3


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_prompt_logprobs_worked_example(device):
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])).to(device)
    got = prompt_logprobs(logits, torch.tensor([2, 2], device=device), 1, decode=str)
    assert list(got[0]) == [2, 0]
    assert got[0][2] == Logprob(pytest.approx(math.log(0.1)), 3, "2")
    assert got[0][0] == Logprob(pytest.approx(math.log(0.7)), 1, "0")
    assert list(got[1]) == [2] and got[1][2].rank == 1  # the prompt token is the likeliest: not repeated


def test_prompt_logits_rows_in_the_forward_batch():
    chunks = [SeqChunk([1, 2, 3], 0, [0], 0), SeqChunk([4], 9, [1], 1), SeqChunk([5, 6, 7, 8], 2, [2], 2)]
    batch = build_forward_batch(chunks, block_size=16, kernel_block_size=16, prompt_logits=(True, True, True))
    assert batch.logits_indices.tolist() == [2, 3, 7]
    assert batch.prompt_logits_rows.tolist() == [0, 1, 4, 5, 6]
    assert build_forward_batch(chunks, block_size=16, kernel_block_size=16).prompt_logits_rows is None
    with pytest.raises(ValueError, match="2 prompt_logits flags for 3 chunks"):
        build_forward_batch(chunks, block_size=16, kernel_block_size=16, prompt_logits=(True, False))


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2"])
def test_bad_prompt_logprobs_is_a_value_error(value):
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_chunks_are_capped(model_dir, monkeypatch):
    """A prompt chunk of a request with prompt logprobs holds at most PROMPT_LOGPROBS_CHUNK tokens (its logits
    are [rows, vocab] fp32), whatever max_num_batched_tokens allows; the logprobs are unchanged by the cut."""
    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROBS_CHUNK", 40)
    prompt = prompts_of([157], seed=4)[0]
    llm = LLM(model_dir, block_size=16, kernel_block_size=8, max_num_batched_tokens=512, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))
    engine.add_request("q", prompts_of([150], seed=5)[0], SamplingParams(temperature=0, max_tokens=2))
    seqs = {rid: request.seqs[0] for rid, request in engine._requests.items()}
    fed, outputs = [], {}
    while engine.has_unfinished_requests():
        before = {rid: seq.num_computed for rid, seq in seqs.items()}
        outputs.update((output.request_id, output) for output in engine.step())
        fed.append({rid: seq.num_computed - before[rid] for rid, seq in seqs.items()})
    prompt_steps = [step["p"] for step in fed if step.get("p", 0) > 1]
    assert prompt_steps and max(prompt_steps) <= 40 and len(prompt_steps) >= len(prompt) // 40
    assert max(step.get("q", 0) for step in fed) == 150  # the other request's prompt is not cut
    check_against(hf_log_softmax(load_hf_model(model_dir), prompt), prompt, outputs["p"].prompt_logprobs, 1)
    engine.check_integrity()


def test_a_steps_prompt_logits_are_capped_over_all_its_requests(model_dir, monkeypatch):
    """PROMPT_LOGPROBS_CHUNK bounds the rows of prompt logits of a whole step (none of them in the memory plan):
    three concurrent prompt_logprobs requests under a budget of 512 put 40 rows each in one step (lm-eval sends such
    requests together; at a 248k vocabulary 8,192 rows are 8 GB of fp32). Their logprobs are unchanged."""
    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROBS_CHUNK", 40)
    llm = LLM(model_dir, block_size=16, kernel_block_size=8, max_num_batched_tokens=512, max_num_seqs=4)
    engine = llm.engine
    prompts = prompts_of([157, 150, 161], seed=6)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                          prompt_logprobs=1))
    seqs = [request.seqs[0] for request in engine._requests.values()]
    rows, outputs = [], {}
    while engine.has_unfinished_requests():
        before = [min(seq.num_computed, seq.prompt_len) for seq in seqs]
        outputs.update((output.request_id, output) for output in engine.step())
        rows.append(sum(min(seq.num_computed, seq.prompt_len) - b for seq, b in zip(seqs, before, strict=True)))
    assert max(rows) == 40 and sum(rows) == sum(map(len, prompts))
    model = load_hf_model(model_dir)
    for i, prompt in enumerate(prompts):
        check_against(hf_log_softmax(model, prompt), prompt, outputs[str(i)].prompt_logprobs, 1)
    engine.check_integrity()


@pytest.mark.parametrize("caching", [True, False])
def test_a_span_longer_than_the_rows_left_does_not_stall_the_step(model_dir, monkeypatch, caching):
    """A multimodal span is fed whole: a prompt-logprobs chunk that starts at a 60-token span took 60 rows of a
    step that had 40, the count went to -20, and the next prompt-logprobs request was planned with a chunk ending
    before it started: every step raised from then on. Both requests now finish, their logprobs unchanged."""
    from hybridcache.multimodal import MultimodalInput

    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROBS_CHUNK", 40)
    llm = LLM(model_dir, block_size=16, kernel_block_size=8, max_num_batched_tokens=256, max_num_seqs=4,
              enable_prefix_caching=caching)
    engine = llm.engine
    first, second = prompts_of([150, 160], seed=7)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("span", first, params, [MultimodalInput(start=0, end=60, content_hash="span-a")])
    engine.add_request("text", second, params)
    outputs = {}
    for _ in range(40):
        if not engine.has_unfinished_requests():
            break
        outputs.update((output.request_id, output) for output in engine.step() if output.finished)
    assert set(outputs) == {"span", "text"}
    engine.check_integrity()
    check_against(hf_log_softmax(load_hf_model(model_dir), second), second, outputs["text"].prompt_logprobs, 1)
    # the span's embeddings are the placeholder encoder's (multimodal.py), so its reference is the request alone
    alone = LLM(model_dir, block_size=16, kernel_block_size=8, enable_prefix_caching=caching).engine
    alone.add_request("span", first, params, [MultimodalInput(start=0, end=60, content_hash="span-a")])
    finished = []
    while alone.has_unfinished_requests():
        finished += [output for output in alone.step() if output.finished]
    for got, want in zip(outputs["span"].prompt_logprobs[1:], finished[0].prompt_logprobs[1:], strict=True):
        assert list(got) == list(want)
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-4)
