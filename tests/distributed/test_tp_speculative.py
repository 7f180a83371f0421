"""MTP speculative decoding under tensor parallelism (CPU, gloo, 2 ranks, fp32).

Without processes: each rank loads exactly its part of the MTP head (the MoE head of Qwen3-Next, the dense one of
Qwen3.5), and a draft plan survives the trip to a worker. On two ranks (a tiny Qwen3-Next, MoE head): greedy
tokens, finish reasons and logprobs with MTP on equal those of one rank with MTP off on 150+-token prompts over one long
prefix (the later ones hit the cache), `n = 2`, a stop string and an identical resend, with `check_integrity` after
every step; the head's own drafts equal one rank's head's, draft for draft, and with partly right oracle drafts (so
verify rows accept 0..k drafts and roll back on every rank) the acceptance counts equal one rank's; the same after
the cache-equivalence workload (multi-turn conversations, shared system prompts). Seeded sampling (temperature >
0, n = 2) with MTP on two ranks equals one rank with MTP: tokens, logprobs and acceptance counts. Slow: speculation
turned off above a batch size with async steps between (their fed tokens broadcast); the long prompts on a fresh
engine (by default they run after the workload). A folder without an MTP head is refused before any worker
starts.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import random

import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.distributed.messages import Op, encode, receive
from hybridcache.engine.engine import LLMEngine
from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.engine.mtp_draft import DraftPlan, DraftStep
from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import ModelConfig, get_model_class
from hybridcache.models.mtp import MTP_FILE, load_mtp_head
from hybridcache.sampling import SamplingParams
from tests.engine.spec_helpers import oracle, spec
from tests.engine.test_async_scheduling import run_all
from tests.engine.test_cache_equivalence import run_workload

from .folders import write_folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("tp-mtp"), "qwen3_next")


def make_engine(model_dir, k: int | None = None, tp: int = 1, caching: bool = True) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(
        block_size=16, kernel_block_size=8, max_num_batched_tokens=96, max_num_seqs=6, enable_prefix_caching=caching,
        tensor_parallel_size=tp, speculative_config=spec(k) if k else None))


# ----------------------------------------------------------------------------------------- without processes
@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])  # an MoE head, a dense head
def test_each_rank_loads_exactly_its_part_of_the_mtp_head(model_type, tmp_path):
    folder = write_folder(tmp_path, model_type)
    config = ModelConfig.from_model_dir(folder)
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        targets = [cls(config, TensorParallel(rank, size)) for rank, size in ((0, 1), (0, 2), (1, 2))]
    whole = dict(load_mtp_head(folder, targets[0], dtype=torch.float32, device="cpu").named_parameters())
    split = set()
    for target in targets[1:]:
        head = load_mtp_head(folder, target, dtype=torch.float32, device="cpu")
        shards = head.shards()
        split |= set(shards)
        assert "fc.weight" not in shards and "norm.weight" not in shards  # replicated
        for name, param in head.named_parameters():
            shard = shards.get(name)
            assert torch.equal(param, whole[name] if shard is None else shard.take(whole[name])), name
    assert "layers.0.self_attn.q_proj.weight" in split and "layers.0.self_attn.o_proj.weight" in split
    assert any(name.startswith("layers.0.mlp.") for name in split)
    assert any(".experts." in name for name in split) == (model_type == "qwen3_next")


def test_a_draft_plan_travels_to_a_worker_unchanged():
    def batch(chunks):
        return build_forward_batch(chunks, block_size=16, kernel_block_size=8)

    plan = DraftPlan(batch([SeqChunk(token_ids=[5, 6, 7], start=4, block_ids=[3], slot=1)]), torch.tensor([0, 1, 2]),
                     torch.tensor([0]), (DraftStep(batch([SeqChunk([0], 7, [3], 1)]), torch.tensor([0])),))
    sender, receiver = multiprocessing.Pipe()
    sender.send_bytes(encode(Op.DRAFT, plan))
    op, got = receive(receiver)
    assert op is Op.DRAFT and isinstance(got, DraftPlan) and isinstance(got.steps[0], DraftStep)
    for want, have in ((plan, got), (plan.steps[0], got.steps[0]), (plan.batch, got.batch),
                       (plan.steps[0].batch, got.steps[0].batch)):
        for field in dataclasses.fields(want):
            a, b = getattr(want, field.name), getattr(have, field.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), field.name
            elif field.name not in ("batch", "steps"):  # (those compared in turn)
                assert a == b, field.name


# ----------------------------------------------------------------------------------------- two ranks
def long_requests(engine: LLMEngine, stop: list[str], check_every_step: bool = False) -> dict:
    """Three 150+-token prompts over one 120-token prefix, one after another (the later ones hit the cache): `a`
    (with the `stop` strings), `b` (n = 2, logprobs), then `a` again (an identical resend). {id: RequestOutput}."""
    rng = random.Random(11)
    prefix = [rng.randrange(256) for _ in range(120)]
    prompts = {name: prefix + [rng.randrange(256) for _ in range(n)] for name, n in (("a", 40), ("b", 35))}
    requests = [("long-a", prompts["a"], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=stop)),
                ("long-b", prompts["b"], SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, n=2,
                                                         logprobs=3)),
                ("long-a-again", prompts["a"], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True,
                                                               stop=stop))]
    results = {}
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
        results.update(run_all(engine, check=check_every_step))
    return results


def run(engine: LLMEngine, workload: bool, check_every_step: bool = False) -> dict:
    """`long_requests` (stop string `STOP`), after the cache-equivalence workload when `workload`: {id: ([token
    ids], [finish reasons]) per completion}; `engine.logprobs`: `long-b`'s logprobs per completion."""
    outputs = run_workload(engine, check_every_step=check_every_step) if workload else {}
    outputs.update(long_requests(engine, [STOP], check_every_step))
    engine.check_integrity()
    engine.logprobs = [c.logprobs for c in outputs["long-b"].outputs]
    return {rid: ([c.token_ids for c in out.outputs], [c.finish_reason for c in out.outputs])
            for rid, out in outputs.items()}


def assert_same_logprobs(ours: list, want: list) -> None:
    """Per completion and token: the same token and top ids, logprobs within 1e-4."""
    assert len(ours) == len(want)
    for mine, theirs in zip(ours, want, strict=True):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):  # vLLM's entries: the sampled token first, then the top ids
            token = next(iter(a))
            assert list(a) == list(b) and abs(a[token].logprob - b[token].logprob) < 1e-4


def record_head_drafts(engine: LLMEngine) -> dict:
    """Record the head's drafts for every sequence at every step (before `oracle`, installed after, replaces them):
    (request id, completion, tokens so far) -> drafts."""
    drafts = {}
    propose = engine.drafter.propose

    def recording(chunks, drafting, *args):
        propose(chunks, drafting, *args)
        for seq in drafting:
            drafts[(seq.request_id, seq.index, seq.num_tokens)] = list(seq.drafts)

    engine.drafter.propose = recording
    return drafts


# a character of `long-a`'s greedy output on the module's model (first at its 7th character), so that the stop
# string cuts it short; the reference run checks that it does
STOP = "3"


# slow: long-prompts (default: with-cache-workload, which runs the same long requests and assertions after the
# cache-equivalence workload)
@pytest.mark.parametrize("workload", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["long-prompts", "with-cache-workload"])
def test_greedy_mtp_on_two_ranks_equals_one_rank_without_it(model_dir, workload):
    """Greedy tokens and finish reasons of two ranks with MTP (k = 2) equal one rank's without it; the head's drafts
    equal one rank's head's, and with oracle drafts the acceptance counts too (module docstring)."""
    reference_engine = make_engine(model_dir, caching=False)
    off = run(reference_engine, workload)
    assert off["long-a"][1] == ["stop"] and 5 <= len(off["long-a"][0][0]) < 14
    reference = {rid: tokens for rid, (tokens, _) in off.items()}
    runs = []
    for tp in (1, 2):
        engine = make_engine(model_dir, k=2, tp=tp)
        try:
            head_drafts = record_head_drafts(engine)
            oracle(engine, reference, seed=4)
            got = run(engine, workload, check_every_step=tp == 2)
            assert got == off
            assert_same_logprobs(engine.logprobs, reference_engine.logprobs)
            stats = engine.stats()
            assert stats["cache"].num_hits > 0 and stats["num_blocks_used"] == stats["cache"].num_blocks_used
            runs.append((head_drafts, engine.drafter.stats))
        finally:
            engine.close()
    (drafts_one, stats_one), (drafts_two, stats_two) = runs
    assert drafts_two == drafts_one and sum(len(d) for d in drafts_one.values()) > 20
    assert any(len(d) == 2 for d in drafts_one.values())  # a further head step ran (its draft broadcast)
    assert stats_two == stats_one
    assert 0 < stats_one.num_accepted_tokens < stats_one.num_draft_tokens  # accepted and rolled back
    assert all(n > 0 for n in stats_one.accepted_per_position), stats_one


def sampled_requests(engine: LLMEngine, check_every_step: bool, greedy: bool = False) -> dict:
    """`long_requests`' prompts with seeded temperature > 0, one request after another: `hot-a` at 0.05 (near the
    greedy tokens, so oracle drafts are often accepted; logprobs), `hot-b` at 1.0 with n = 2 (drafts rejected, the
    residual drawn), `hot-a` again at 0.1 (a cache hit); `greedy`: every temperature 0. {id: RequestOutput}."""
    rng = random.Random(11)
    prefix = [rng.randrange(256) for _ in range(120)]
    a, b = (prefix + [rng.randrange(256) for _ in range(n)] for n in (40, 35))
    requests = [("hot-a", a, dict(temperature=0.05, seed=7, max_tokens=10, logprobs=2)),
                ("hot-b", b, dict(temperature=1.0, seed=8, n=2, max_tokens=11)),
                ("hot-a-again", a, dict(temperature=0.1, seed=9, max_tokens=8))]
    results = {}
    for request_id, prompt, params in requests:
        params = {**params, "temperature": 0} if greedy else params
        engine.add_request(request_id, prompt, SamplingParams(ignore_eos=True, **params))
        results.update(run_all(engine, check=check_every_step))
    return results


def test_seeded_sampling_with_mtp_on_two_ranks_equals_one_rank(model_dir):
    """Temperature > 0 with seeds: two ranks with MTP (k = 2) give one rank's tokens and logprobs with MTP, same
    seeds, and the same acceptance counts (rank 0 judges, with each request's generator). The drafts are the
    greedy tokens of a run without MTP, each kept with probability 0.7 (`oracle`), so that rows accept drafts,
    reject them and draw from the residual; the cache is checked after every step on two ranks."""
    greedy = {rid: [c.token_ids for c in out.outputs]
              for rid, out in sampled_requests(make_engine(model_dir, caching=False), False, greedy=True).items()}
    runs = []
    for tp in (1, 2):
        engine = make_engine(model_dir, k=2, tp=tp)
        try:
            oracle(engine, greedy, seed=6)
            outputs = sampled_requests(engine, check_every_step=tp == 2)
            engine.check_integrity()
            runs.append(({rid: [c.token_ids for c in out.outputs] for rid, out in outputs.items()},
                         outputs["hot-a"].outputs[0].logprobs, engine.drafter.stats))
        finally:
            engine.close()
    (tokens_one, logprobs_one, stats_one), (tokens_two, logprobs_two, stats_two) = runs
    assert tokens_two == tokens_one
    assert len(tokens_one["hot-b"]) == 2 and tokens_one["hot-b"][0] != tokens_one["hot-b"][1]
    assert tokens_one["hot-b"] != greedy["hot-b"]  # sampled, not the greedy tokens
    assert_same_logprobs([logprobs_two], [logprobs_one])
    assert stats_two == stats_one
    assert 0 < stats_one.num_accepted_tokens < stats_one.num_draft_tokens, stats_one  # accepted and rejected


@pytest.mark.slow
def test_speculation_off_above_a_batch_size_with_async_steps_between_on_two_ranks(model_dir):
    """`disable_by_batch_size` 2 with async scheduling on two ranks (the cache-equivalence workload, up to 6 sequences
    at once): steps over the limit are plain decode steps, overlapped, their fed tokens broadcast from rank 0; steps
    at or under it draft on every rank and verify; greedy tokens equal one rank's without MTP, the cache intact after
    every step."""
    off = run(make_engine(model_dir, caching=False), workload=True)
    engine = LLMEngine(model_dir, EngineConfig(
        block_size=16, kernel_block_size=8, max_num_batched_tokens=96, max_num_seqs=6, tensor_parallel_size=2,
        async_scheduling=True, speculative_config={**spec(2), "disable_by_batch_size": 2}))
    try:
        oracle(engine, {rid: tokens for rid, (tokens, _) in off.items()}, seed=5)
        decided = []
        speculating = engine._speculating
        engine._speculating = lambda: decided.append(speculating()) or decided[-1]
        assert run(engine, workload=True, check_every_step=True) == off
        assert True in decided and False in decided
        assert engine.drafter.stats.num_accepted_tokens > 0
    finally:
        engine.close()


def test_a_folder_without_an_mtp_head_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    folder = write_folder(tmp_path, "qwen3_next")
    (folder / MTP_FILE).unlink()

    def no_process(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(multiprocessing, "get_context", no_process)
    with pytest.raises(ValueError, match="has no mtp.* tensors"):
        make_engine(folder, k=2, tp=2)
    with pytest.raises(ValueError, match="decode_checkpoint_interval"):
        EngineConfig(tensor_parallel_size=2, speculative_config=spec(2), decode_checkpoint_interval=64)
