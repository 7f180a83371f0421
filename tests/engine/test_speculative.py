"""MTP speculative decoding end to end (CPU, fp32, reference kernels): greedy outputs equal those without it, token
for token, with the model's own (random) head and with an oracle drafter whose drafts are partly right (so verify
rows accept 0..k drafts and the recurrent state is rolled back at every position); cached runs equal uncached ones;
random traffic keeps the cache's integrity after every step; sampling keeps its distribution (chi-square)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache.config import EngineConfig, SpeculativeConfig
from hybridcache.engine import speculative
from hybridcache.engine.engine import LLMEngine
from hybridcache.engine.mtp_draft import head_kv
from hybridcache.sampling import SamplingParams
from hybridcache.scheduler.output import ScheduledChunk

from .model_folders import save_model_folder, write_tiny_model
from .spec_helpers import (
    alone_references,
    drive_traffic,
    make_engine,
    oracle,
    random_requests,
    send_twice,
    spec,
    tokens_of,
)
from .test_cache_equivalence import run_workload


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("k", [2, pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_mtp_equals_no_mtp_on_the_cache_equivalence_workload(model_dir, k):
    """MTP on, prefix caching on (the workload's resends, turns and shared prompts hit) against MTP and caching off
    (test_cache_equivalence shows cached == uncached without MTP)."""
    off = tokens_of(run_workload(make_engine(model_dir, None, enable_prefix_caching=False)))
    engine = make_engine(model_dir, k)
    assert tokens_of(run_workload(engine, check_every_step=True)) == off  # the random head: drafts rejected
    assert engine.stats()["cache"].num_hits > 0
    engine = make_engine(model_dir, k)
    oracle(engine, off, seed=k)
    assert tokens_of(run_workload(engine, check_every_step=True)) == off
    stats = engine.drafter.stats
    assert stats.num_accepted_tokens > 0 and all(n > 0 for n in stats.accepted_per_position), stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and some rejected: rollbacks ran
    assert engine.stats()["num_blocks_used"] == engine.stats()["cache"].num_blocks_used


@pytest.mark.slow
def test_mtp_cached_run_equals_uncached_run_under_pressure(model_dir):
    """The cache-equivalence pressure workload (30 blocks of 16 tokens for 6 sequences: evictions and preemptions)
    with MTP and oracle drafts: cached == uncached == MTP off."""
    workload = {"seed": 1, "reply_lens": (20, 40)}
    off = tokens_of(run_workload(make_engine(model_dir, None, enable_prefix_caching=False), **workload))
    runs = []
    for caching, blocks in ((False, None), (True, 30)):
        engine = make_engine(model_dir, 2, enable_prefix_caching=caching, num_blocks=blocks, max_model_len=300,
                             max_num_batched_tokens=256)
        oracle(engine, off, seed=7)
        runs.append(tokens_of(run_workload(engine, check_every_step=True, **workload)))
        assert engine.drafter.stats.num_accepted_tokens > 0
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["cache"].num_hits > 0
    assert sum(stats["cache"].evictions_by_kind.values()) > 0
    assert runs == [off, off]
    engine.clear_cache()
    engine.check_integrity()
    assert engine.stats()["num_blocks_used"] == 0


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("traffic"), "qwen3_5_text", seed=1)


def test_speculation_turns_off_above_a_batch_size_with_async_steps_between(small_dir):
    """`disable_by_batch_size` 2 on the cache-equivalence workload (up to 6 sequences at once), async scheduling on:
    steps over the limit are plain decode steps (overlapped), steps at or under it draft and verify (synchronous,
    oracle drafts so that some are accepted); greedy tokens equal MTP off's, the cache intact after every step."""
    off = tokens_of(run_workload(make_engine(small_dir, None, enable_prefix_caching=False)))
    engine = LLMEngine(small_dir, EngineConfig(
        block_size=16, kernel_block_size=8, max_num_batched_tokens=96, max_num_seqs=6, async_scheduling=True,
        speculative_config={**spec(2), "disable_by_batch_size": 2}))
    oracle(engine, off, seed=5)
    decided = []
    speculating = engine._speculating
    engine._speculating = lambda: decided.append(speculating()) or decided[-1]
    assert tokens_of(run_workload(engine, check_every_step=True)) == off
    assert True in decided and False in decided
    assert engine.drafter.stats.num_accepted_tokens > 0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_traffic_keeps_integrity_and_greedy_tokens(small_dir, data):
    """Shared prefixes, identical resends, n > 1, stop strings, aborts and a pool small enough to preempt, with
    MTP (oracle drafts) on; check_integrity after every step; the greedy tokens of every request not aborted equal
    those of the same request alone without MTP."""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    k = data.draw(st.integers(1, 3))
    requests = random_requests(rng, data.draw(st.integers(3, 7)), stop_p=0.3, stop_token_p=0.0, max_tokens=14)
    reference = alone_references(lambda: make_engine(small_dir, None, max_model_len=160), requests)  # without MTP
    engine = make_engine(small_dir, k, max_model_len=160, num_blocks=data.draw(st.sampled_from([14, 20, 64])),
                         max_num_seqs=4)
    oracle(engine, reference, seed=rng.randrange(100))
    got, aborted = drive_traffic(engine, requests)
    for rid, *_ in requests:
        if rid not in aborted:
            assert got[rid] == reference[rid], rid
    engine.clear_cache()
    assert engine.stats()["cache"].num_blocks_used == 0


# ------------------------------------------------------------------------------------------------- sampling
CHI2_CRITICAL_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # chi-square, p = 0.001


def chi_square(observed: Counter, expected: dict) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed counts against expected counts (cells with expected > 0)."""
    cells = [c for c in expected if expected[c] > 0]
    return sum((observed[c] - expected[c]) ** 2 / expected[c] for c in cells), len(cells) - 1


def two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Chi-square statistic of the 2 x V contingency table of two samples, and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    cells = sorted(set(a) | set(b))
    stat = 0.0
    for c in cells:
        total = a[c] + b[c]
        for count, n in ((a[c], na), (b[c], nb)):
            want = total * n / (na + nb)
            stat += (count - want) ** 2 / want
    return stat, len(cells) - 1


def verify_chunk(seq, drafts: list[int]) -> ScheduledChunk:
    return ScheduledChunk(seq=seq, start=seq.num_tokens - 1, num_tokens=1 + len(drafts), samples=True,
                          token_ids=(seq.token_ids[-1], *drafts), block_ids=(0,), slot=0, num_drafts=len(drafts))


def filtered_target(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's sampling distribution of each row: softmax at the temperature, the top_k likeliest kept, then the
    smallest set of likeliest tokens whose mass reaches top_p, renormalised."""
    probs = torch.softmax(logits / temperature, dim=-1)
    out = torch.zeros_like(probs)
    for i, row in enumerate(probs):
        order = row.argsort(descending=True)[: top_k or None]
        kept = row[order] / row[order].sum()
        mass_before = kept.cumsum(0) - kept
        order, kept = order[mass_before < top_p], kept[mass_before < top_p]
        out[i, order] = kept / kept.sum()
    return out


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 0, 1.0), (1.0, 0, 0.6), (0.8, 4, 0.9)])
def test_rejection_sampling_keeps_the_target_distribution_exactly(temperature, top_k, top_p):
    """`judge` on fixed logits over 6 tokens, drafts [d1, d2]: the first emitted token is distributed as p0, the
    second (after an accepted d1) as p1, against the exact target distributions (softmax at the temperature, then
    top-k and top-p). Before the filtered probabilities were renormalised, a draft was accepted with its share of
    the unfiltered mass (top_p 0.6: too rarely) and the outputs were biased against it."""
    from hybridcache.scheduler.sequence import Seq

    vocab = 6
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 2  # rows: d1's position, d2's position, after d2
    target = filtered_target(logits, temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1, max_tokens=8)
    num = 5000
    generator = torch.Generator().manual_seed(11)
    seqs = [Seq(seq_id=i, request_id="r", index=i, token_ids=[1, 2], prompt_len=2, params=params,
                generator=generator, arrival=i) for i in range(num)]
    drafts = [int(target[0].argmax()), int(target[1].argsort()[-2])]  # any draft in the support must do
    # the runner's rows: each chunk's last row first, then every chunk's draft rows (d1's and d2's judgement)
    rows = torch.cat([logits[2].expand(num, vocab), logits[:2].repeat(num, 1)])
    verdicts = speculative.judge([verify_chunk(seq, drafts) for seq in seqs], rows, [], None, stop_token_ids=())
    firsts = Counter(v.tokens[0] for v in verdicts)
    seconds = Counter(v.tokens[1] for v in verdicts if v.tokens[0] == drafts[0])
    for counts, p in ((firsts, target[0]), (seconds, target[1])):
        n = sum(counts.values())
        stat, df = chi_square(counts, {v: float(p[v]) * n for v in range(vocab)})
        assert df == 0 or stat < CHI2_CRITICAL_999[df], (stat, counts)
        assert all(p[v] > 0 for v in counts), counts  # nothing drawn from outside the filtered support
    assert 0 < firsts[drafts[0]] < num  # both branches ran


def test_a_seeded_request_draws_the_same_tokens_with_mtp_and_after_a_zero_prefill_hit(small_dir):
    """Each emitted token costs its sequence's generator one draw whatever was drafted (`speculative._draw`, the
    sampler's own exponential race): seeded sampling with MTP equals MTP off, and a resend that hits its whole
    prompt (it samples without a forward, then drafts one step later than its first send) draws the same tokens.
    Before, a verify row drew a uniform per draft and one more on a rejection: the resend's tokens differed."""
    prompt = [random.Random(0).randrange(256) for _ in range(170)]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, n=2)

    off = send_twice(make_engine(small_dir, None), prompt, params)
    wanted = [c.token_ids for c in off[0].outputs]
    assert [c.token_ids for c in off[1].outputs] == wanted and wanted[0] != wanted[1]
    engine = make_engine(small_dir, 2)
    oracle(engine, {o.request_id: [c.token_ids for c in o.outputs] for o in off}, seed=5)  # drafts partly right
    on = send_twice(engine, prompt, params)
    assert on[1].num_cached_tokens == len(prompt)  # the resend: a zero-prefill hit
    assert [[c.token_ids for c in o.outputs] for o in on] == [wanted, wanted]
    stats = engine.drafter.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts kept and drafts rejected
    engine.check_integrity()


def test_seeded_sampling_with_mtp_and_preemptions_equals_without_mtp(small_dir):
    """Four seeded requests in a pool of 16 blocks (preempted and recomputed, the head's drafts rejected) draw
    the same tokens as without MTP in a pool that holds them all."""
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(60)] for _ in range(4)]

    def run(k: int | None, num_blocks: int | None) -> tuple[dict, int]:
        engine = make_engine(small_dir, k, num_blocks=num_blocks, max_num_seqs=4, max_model_len=200)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40,
                                                              ignore_eos=True))
        tokens = {}
        while engine.has_unfinished_requests():
            tokens |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        engine.check_integrity()
        return tokens, engine.stats()["num_preemptions"]

    alone, _ = run(None, None)
    squeezed, preemptions = run(2, 16)
    assert preemptions > 0 and squeezed == alone


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from hybridcache.models.random_weights import randomize_, tiny_hf_config

    config = tiny_hf_config("qwen3_5_text", vocab_size=8, eos_token_id=None)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    randomize_(model, seed=3)
    folder = save_model_folder(model, tmp_path_factory.mktemp("vocab8"))
    # a tokenizer of the model's 8 ids (one with more is refused: its ids past 8 would have no embedding)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:8]
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("temperature", [pytest.param(0.7, marks=pytest.mark.slow), 1.0])
def test_sampling_distribution_with_mtp_equals_without(tiny_vocab_dir, temperature):
    """Many seeds over a vocabulary of 8: the tokens at each output position, MTP (k = 2) on against off, pass a
    two-sample chi-square test; the head's drafts are accepted often enough that both paths of the rejection
    sampler run. (Prefix caching off: every completion prefills, and so drafts, on its own.)"""
    samples = {}
    for k in (None, 2):
        engine = LLMEngine(tiny_vocab_dir, EngineConfig(block_size=16, max_num_seqs=48, max_model_len=64,
                                                        enable_prefix_caching=False,
                                                        speculative_config=spec(k) if k else None))
        for s in range(3):
            params = SamplingParams(temperature=temperature, max_tokens=4, n=48, seed=1000 * s + (500 if k else 0))
            engine.add_request(str(s), [1, 2, 3, 4, 5, 6, 7, 0, 1, 2], params)
        outs = []
        while engine.has_unfinished_requests():
            outs += [tuple(c.token_ids) for o in engine.step() if o.finished for c in o.outputs]
        samples[k] = outs
        if k:
            assert 0 < engine.drafter.stats.num_accepted_tokens < engine.drafter.stats.num_draft_tokens
    for position in range(1, 4):
        stat, df = two_sample(Counter(t[position] for t in samples[None]), Counter(t[position] for t in samples[2]))
        assert stat < CHI2_CRITICAL_999[df], (position, stat)


# ------------------------------------------------------------------------------------------------- refusals
def test_unsupported_combinations_are_refused_clearly(small_dir):
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        EngineConfig(speculative_config={**spec(2), "disable_by_batch_size": 0})
    with pytest.raises(ValueError, match="decode_checkpoint_interval"):
        EngineConfig(speculative_config=spec(2), decode_checkpoint_interval=64)
    assert EngineConfig(speculative_config=spec(2), tensor_parallel_size=2).tensor_parallel_size == 2
    assert EngineConfig(speculative_config=spec(2), device="cuda").speculative_config.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="not supported"):
        EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    assert EngineConfig(speculative_config='{"method": "qwen3_next_mtp", "num_speculative_tokens": 3}'
                        ).speculative_config == SpeculativeConfig("qwen3_next_mtp", 3)
    # (structured output and penalties, refused here before, are served: test_speculative_guided.py)


def test_a_model_without_an_mtp_head_is_refused(tmp_path):
    folder = write_tiny_model(tmp_path, "qwen3_5_text")
    (folder / "mtp.safetensors").unlink()
    with pytest.raises(ValueError, match="no mtp"):
        make_engine(folder, 1)


def test_llm_takes_a_speculative_config_like_vllm(small_dir):
    """`LLM(speculative_config=...)` as vLLM's; greedy tokens and their logprobs (top 3) equal MTP off's, with the
    random head and with oracle drafts (accepted tokens' logprobs come from the verify rows)."""
    from hybridcache import LLM

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41, 42]]
    off = LLM(small_dir, dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    reference = {str(i): [o.outputs[0].token_ids] for i, o in enumerate(off)}
    for use_oracle in (False, True):
        on = LLM(small_dir, dtype="float32", device="cpu",
                 speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": 2})
        if use_oracle:
            oracle(on.engine, reference, seed=3, right=0.8)
        got = on.generate(prompts, params, use_tqdm=False)
        for mine, want in zip(got, off, strict=True):
            assert mine.outputs[0].token_ids == want.outputs[0].token_ids
            assert mine.outputs[0].num_draft_tokens > 0
            for token, a, b in zip(mine.outputs[0].token_ids, mine.outputs[0].logprobs, want.outputs[0].logprobs,
                                   strict=True):
                assert list(a) == list(b) and next(iter(a)) == token  # the sampled token, then the top ids
                assert abs(a[token].logprob - b[token].logprob) < 1e-4
        if use_oracle:
            assert on.engine.drafter.stats.num_accepted_tokens > 0


@pytest.mark.parametrize(("beside", "max_tokens"), [(False, 4), (True, 4), (False, 1)],
                         ids=["alone", "beside-a-decoding-request", "finishing-in-its-prefill"])
def test_a_restored_tail_block_holds_the_heads_kv(small_dir, beside, max_tokens):
    """A checkpoint's frozen tail block is copied (KV_SAVE) from the saving sequence's partial block; with MTP it must
    hold the head's KV there too, which the head writes after the forward (its catch-up, `MtpDrafter.propose`).
    The copy was taken right after the forward, before the head wrote: a request that hit restored a tail of stale
    head KV (NaN in a recycled page: then every draft of that sequence was token 0). The pool starts as NaN, so
    any slot of a context the head did not write shows. Beside a decoding request, whose rejected drafts' rollback
    runs in the same step before the head's catch-up, the copies still wait for the head. A request that finishes in
    its prefill step (max_tokens 1) drafts nothing, but its blocks and tail go into the cache: the head writes there
    too."""
    engine = make_engine(small_dir, 1)
    for kv in engine.runner.pools.kv_groups:
        kv.fill_(float("nan"))
    head = head_kv(engine.runner.model, engine.runner.pools)
    per_block = engine.config.block_size // engine.config.kernel_block_size
    checked = []
    propose = engine.drafter.propose

    def checking_propose(chunks, drafting, *args):
        propose(chunks, drafting, *args)
        for chunk in chunks:
            seq = chunk.seq
            if seq.request_id.startswith("hit") and chunk.start < seq.prompt_len:
                for layer in head:
                    for p in range(seq.num_computed):
                        page = chunk.block_ids[p // 16] * per_block + p % 16 // 8
                        assert torch.isfinite(layer[:, page, p % 8]).all(), (seq.request_id, p)
                checked.append(seq.request_id)

    engine.drafter.propose = checking_propose
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(40)]  # 40 = 2.5 blocks: the branch checkpoint has a frozen tail
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if beside:  # decodes (drafting, its drafts mostly rejected: rollbacks) through every request below
        engine.add_request("x", [rng.randrange(256) for _ in range(20)],
                           SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
        engine.step()
    for request_id, extra in (("a", 10), ("b", 10), ("hit0", 7), ("hit1", 9)):
        engine.add_request(request_id, shared + [rng.randrange(256) for _ in range(extra)], greedy)
        done = False
        while not done:
            done = any(o.request_id == request_id and o.finished for o in engine.step())
        engine.check_integrity()
    assert not beside or engine.has_unfinished_requests()  # x still decoding
    assert checked[:1] == ["hit0"] and "hit1" in checked
    assert engine.stats()["cache"].num_hit_tokens >= 2 * 40


def test_drafts_after_a_hit_at_a_parting_step_equal_an_uncached_run(small_dir):
    """The head's KV at position s - 1 reads the token at s. A request that hits a checkpoint at s where it parts
    from the request that saved it (a branch point) has another token at s than that request had, so the head's
    KV there, restored with the tail block, was the other request's: its drafts parted from an uncached run's.
    After a hit at a step inside a block (the tail block is the request's own) the head's catch-up starts at s - 1,
    from the hidden state the checkpoint restored. fp32: the drafts are equal."""
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(40)]  # 40 = 2.5 blocks: the branch point's tail block is private
    prompts = [("a", shared + [rng.randrange(256) for _ in range(10)]),
               ("b", shared + [rng.randrange(256) for _ in range(10)])]
    prompts += [(f"hit{i}", shared + [rng.randrange(256) for _ in range(7 + i)]) for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    drafts = []
    for caching in (True, False):
        engine = make_engine(small_dir, 2, enable_prefix_caching=caching)
        seen = {}
        propose = engine.drafter.propose

        def recording(chunks, drafting, *args, seen=seen, propose=propose):
            propose(chunks, drafting, *args)
            for seq in drafting:
                seen[(seq.request_id, seq.num_tokens)] = list(seq.drafts)

        engine.drafter.propose = recording
        for request_id, prompt in prompts:
            engine.add_request(request_id, prompt, greedy)
            while engine.has_unfinished_requests():
                engine.step()
        if caching:
            assert engine.stats()["cache"].num_hit_tokens >= 3 * 40
        drafts.append(seen)
    assert drafts[0] == drafts[1]


def test_a_frozen_tail_held_at_close_reaches_the_disk_tier(small_dir, tmp_path):
    """Closed while a request's last chunk saved a checkpoint with a frozen tail, an MTP engine still held that
    copy (the head writes its KV after the forward): the disk tier was handed a tail never written, and a
    restarted engine that hit it produced garbage (token 0). The held copies run before the hand-over."""
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(40)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    options = {"host_cache_gib": 0.01, "disk_cache_dir": str(tmp_path), "max_num_batched_tokens": 48}
    engine = make_engine(small_dir, 1, **options)
    for kv in engine.runner.pools.kv_groups:
        kv.fill_(float("nan"))
    engine.add_request("a", shared + [rng.randrange(256) for _ in range(10)], greedy)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", shared + [rng.randrange(256) for _ in range(100)], greedy)
    engine.step()  # b's first chunk ends at the branch point 40 (its frozen tail: positions 32..39)
    engine.close()
    prompt = shared + [rng.randrange(256) for _ in range(9)]
    results = []
    for restarted in (make_engine(small_dir, None, enable_prefix_caching=False), make_engine(small_dir, 1, **options)):
        restarted.add_request("c", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        while restarted.has_unfinished_requests():
            outputs = restarted.step()
        results.append((outputs[-1].outputs[0].token_ids, outputs[-1].outputs[0].num_cached_tokens))
        restarted.close()
    (want, _), (got, hit) = results
    assert hit == 40 and got == want


@pytest.mark.parametrize("shape", ["one-token-chunks", "branch-on-a-block-boundary"])
def test_prefill_chunks_that_do_not_sample_get_no_further_draft_rows(small_dir, shape):
    """A step whose rows are all one token wide, some of them prefill chunks that do not sample, is not a uniform
    draft step: such a chunk has no lookahead blocks, so a further draft row past its last computed position fell
    outside its blocks at a block boundary ("3 blocks cannot hold 49 tokens" raised inside step(): the engine was
    dead) and wrote the head's KV ahead of the prefill inside one. Greedy tokens equal those without MTP."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    if shape == "one-token-chunks":  # every prefill chunk is one token: the budget is 1
        options, requests = {"max_num_batched_tokens": 1, "max_num_seqs": 1, "block_size": 8}, [("a", list(range(20)))]
    else:  # b parts from a at 48, one past a's prefill-end checkpoint at 47: b's first chunk is [47, 48)
        options, a_prompt = {"max_num_batched_tokens": 256}, [(7 * i + 3) % 256 for i in range(47)]
        requests = [("a", a_prompt), ("b", None)]
    outputs = []
    for k in (2, None):
        engine = make_engine(small_dir, k, kernel_block_size=8, **options)
        tokens = {}
        for request_id, prompt in requests:
            if prompt is None:
                first = tokens["a"]
                prompt = a_prompt + [first[0], (first[1] + 1) % 256] + [(5 * i) % 256 for i in range(6)]
            engine.add_request(request_id, prompt, greedy)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        tokens[request_id] = out.outputs[0].token_ids
                engine.check_integrity()
        outputs.append(tokens)
    assert outputs[0] == outputs[1] and len(outputs[0]) == len(requests)
