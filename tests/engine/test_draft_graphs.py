"""The MTP head's drafting graphs (`engine/draft_graphs.py`) and the uniform plans they replay.

CPU (fp32, reference kernels, which capture nothing): in a real engine run, every uniform plan's work run on the
draft graphs' static buffers (padding rows included) gives the tokens of the plan run eagerly, and those equal the
drafts of the ragged plan (only the positions that hold tokens, rows dropped as budgets run out) cut at each
sequence's budget. CUDA (skipped without a device): bf16 drafting graphs replayed give the tokens of the same
static batches run eagerly (`without_replay`), and the engine's outputs are unchanged.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.draft_graphs import DraftGraphs
from hybridcache.engine.engine import LLMEngine
from hybridcache.engine.mtp_draft import identity, run_draft_plan
from hybridcache.engine.speculative import assign_drafts
from hybridcache.sampling import SamplingParams

from .model_folders import write_tiny_model
from .spec_helpers import oracle, spec

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _requests(engine, count: int, sampled: int = 0) -> None:
    """`count` requests, greedy but for the first `sampled` (temperature 0.8, seeded); the first ends first."""
    for i in range(count):
        prompt = [(11 * i + 5 * j) % 256 for j in range(150 + 9 * i)]
        temperature = 0.8 if i < sampled else 0.0
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=temperature, seed=i, max_tokens=12 + 7 * i,
                                                           ignore_eos=True))


@pytest.mark.parametrize("model_type", ["qwen3_next"])
def test_uniform_drafting_on_static_buffers_equals_the_eager_plans(tmp_path, model_type):
    folder = write_tiny_model(tmp_path, model_type)
    k = 2
    # speculation off above 3 sequences: the first speculative step after the switch has decode rows (q = 1)
    engine = LLMEngine(folder, EngineConfig(
        block_size=16, kernel_block_size=8, max_num_batched_tokens=96, max_num_seqs=6,
        speculative_config={**spec(k), "disable_by_batch_size": 3}))
    runner, drafter = engine.runner, engine.drafter
    plan_of, seen = drafter.plan, Counter()

    def checked_plan(chunks, wanted):
        planned = plan_of(chunks, wanted)
        if planned is None or not planned[0].tokens_per_seq:
            return planned
        plan, proposers = planned
        n = plan.batch.num_seqs
        assert plan.tokens_per_seq in (1, 1 + k) and len(plan.steps) == k - 1 and proposers == [proposers[0]] * k
        eager = run_draft_plan(plan, head=runner.mtp_head, model=runner.model, pools=runner.pools,
                               backend=runner.backend, hidden=runner.step_hidden)
        free = engine.scheduler.cache._life.blocks.free_ids()[-1]  # a block no one holds: the padding's page
        graphs = DraftGraphs(head=runner.mtp_head, model=runner.model, pools=runner.pools, backend=runner.backend,
                             num_drafts=k, sizes=(1, 2, 4, 8), max_model_len=engine.max_model_len, scratch_slot=0,
                             scratch_page=free * runner.pages_per_block, kernel_block_size=8,
                             hidden_size=runner.model.config.hidden_size, dtype=torch.float32, device=runner.device)
        size = graphs.bucket(plan)
        static = graphs.run(plan, runner.step_hidden, size, replay=False)
        assert torch.equal(static, eager), (static, eager)
        ragged, ragged_proposers = drafter._ragged_plan(chunks, proposers[0], wanted)
        assert ragged.tokens_per_seq == 0
        ragged_tokens = run_draft_plan(ragged, head=runner.mtp_head, model=runner.model, pools=runner.pools,
                                       backend=runner.backend, hidden=runner.step_hidden, agree=identity)
        want = assign_drafts(ragged_tokens.tolist(), ragged_proposers, wanted)
        got = assign_drafts(eager.tolist(), proposers, wanted)
        assert got == want
        seen[(plan.tokens_per_seq, size > n)] += 1
        return planned

    drafter.plan = checked_plan
    _requests(engine, 5)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    print(f"uniform plans checked (q, padded): {dict(seen)}")
    assert {q for q, _ in seen} == {1, 1 + k} and {padded for _, padded in seen} == {True, False}


@needs_cuda
def test_cuda_drafting_graphs_replay_equals_eager(tmp_path_factory):
    """bf16, CUDA graphs: uniform plans and the drafting queued before a greedy verify step's verdicts replay the
    drafting graphs; the same static batches run eagerly (`without_replay`) give the same greedy tokens and the
    same drafts."""
    from hybridcache import LLM

    folder = write_tiny_model(tmp_path_factory.mktemp("next"), "qwen3_next")
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_num_seqs=8, gpu_memory_utilization=0.2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    runner = llm.engine.runner
    graphs = runner._draft_graphs
    assert graphs is not None and set(graphs.graphs) == {(q, s) for q in (1, 3) for s in (1, 2, 4, 8)}
    replays, drafts = [], []
    run, after, propose = graphs.run, graphs.run_after_verify, llm.engine.drafter.propose

    def counted(plan, hidden, size, *, replay=True):
        replays.append((plan.tokens_per_seq, size, replay))
        return run(plan, hidden, size, replay=replay)

    def counted_after(batch, logits, hidden, near_pages, size, *, replay=True):
        replays.append(("before verdicts", size, replay))
        return after(batch, logits, hidden, near_pages, size, replay=replay)

    def recorded(chunks, drafting, *args):  # (keyed by the tokens: the second run's sequences have new ids)
        propose(chunks, drafting, *args)
        drafts.append(sorted((tuple(seq.token_ids), tuple(seq.drafts)) for seq in drafting))

    graphs.run, graphs.run_after_verify, llm.engine.drafter.propose = counted, counted_after, recorded
    prompts = torch.randint(0, 256, (8, 40), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs, proposed = [], []
    try:
        for mode in (contextlib.nullcontext, runner.without_replay):
            with mode():
                llm.engine.clear_cache()
                drafts.clear()
                runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
                proposed.append(list(drafts))
        llm.engine.check_integrity()
    finally:  # the wrappers hold the engine in reference cycles: its device memory would outlive the test
        del graphs.run, graphs.run_after_verify, llm.engine.drafter.propose
        llm.engine.close()
    print(f"drafting graphs: {Counter((q, s) for q, s, replay in replays if replay)} replays (q, bucket)")
    assert any(replay for *_, replay in replays) and any(not replay for *_, replay in replays)
    assert any(q == "before verdicts" for q, *_ in replays)
    assert runs[0] == runs[1] and proposed[0] == proposed[1]


def _cpu_graphs(engine, k: int) -> DraftGraphs:
    """Drafting graphs on the CPU runner (nothing captured: `run` works on the static buffers), the padding on a
    block no one holds now."""
    runner = engine.runner
    free = engine.scheduler.cache._life.blocks.free_ids()[-1]
    return DraftGraphs(head=runner.mtp_head, model=runner.model, pools=runner.pools, backend=runner.backend,
                       num_drafts=k, sizes=(1, 2, 4, 8), max_model_len=engine.max_model_len, scratch_slot=0,
                       scratch_page=free * runner.pages_per_block, kernel_block_size=8,
                       hidden_size=runner.model.config.hidden_size, dtype=torch.float32, device=runner.device)


def _run(engine, reference: dict | None = None, sampled: int = 0) -> tuple[dict, list]:
    """Every request to its end (integrity checked after each step); (outputs, the head's drafts at each step).
    With `reference` (outputs), the drafts fed are the oracle's (`spec_helpers.oracle`): partly right, so verify
    rows accept every count. `sampled`: see `_requests`."""
    drafts, propose, outputs = [], engine.drafter.propose, {}

    def recorded(chunks, drafting, *args):
        propose(chunks, drafting, *args)
        drafts.append({seq.seq_id: list(seq.drafts) for seq in drafting})

    engine.drafter.propose = recorded
    if reference is not None:
        oracle(engine, {rid: [tokens] for rid, tokens in reference.items()}, seed=3)
    _requests(engine, 4, sampled)
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        engine.check_integrity()
    return outputs, drafts


@pytest.mark.parametrize("k", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_drafting_before_the_verdicts_equals_drafting_after_them(tmp_path, k):
    """A uniform greedy verify step's drafting queued before its verdicts (`draft_after_verify`, from the target's
    argmaxes and the device's accepted counts; here the drafting graphs' work on the CPU) proposes, at every
    step, the drafts the head proposes after the verdicts (`draft`); the outputs are unchanged. Oracle drafts
    are fed, so rows accept 0..k of them."""
    folder = write_tiny_model(tmp_path, "qwen3_next")
    config = {"block_size": 16, "kernel_block_size": 8, "max_num_batched_tokens": 96, "max_num_seqs": 6}
    reference, _ = _run(LLMEngine(folder, EngineConfig(**config, speculative_config=spec(k))))  # (== MTP off)
    after = _run(LLMEngine(folder, EngineConfig(**config, speculative_config=spec(k))), reference)
    engine = LLMEngine(folder, EngineConfig(**config, speculative_config=spec(k)))
    runner, used = engine.runner, []

    def draft_after_verify(batch, logits, near_pages):
        graphs = _cpu_graphs(engine, k)
        used.append(batch.num_seqs)
        return graphs.run_after_verify(batch, logits, runner.step_hidden, near_pages,
                                       next(s for s in graphs.sizes if s >= batch.num_seqs), replay=False)

    runner.draft_after_verify = draft_after_verify
    plan, propose, rerun = engine.drafter.plan, engine.drafter.propose, []

    def propose_checked(chunks, drafting, predrafted=None):
        engine.drafter.plan = (lambda *a: rerun.append(len(chunks)) or plan(*a)) if predrafted is not None else plan
        propose(chunks, drafting, predrafted)

    engine.drafter.propose = propose_checked
    before = _run(engine, reference)
    print(f"k={k}: {len(used)} steps drafted before their verdicts, of {len(before[1])} that drafted")
    assert used and not rerun  # (the device's accepted counts always equal the verdicts')
    assert before == after and before[0] == reference
    assert engine.drafter.stats.accepted_per_position[-1] > 0, engine.drafter.stats  # every count accepted


def test_the_runner_routes_uniform_drafting_through_its_drafting_graphs(tmp_path):
    """A CPU runner given drafting graphs (nothing captured: their work runs on the static buffers) routes uniform
    plans (`draft`: while a sampled request runs, the steps are not all greedy) and greedy verify steps
    (`draft_after_verify`: after it ends) through them, the rest eagerly; the drafts at every step and the outputs
    equal those of the runner without them."""
    folder = write_tiny_model(tmp_path, "qwen3_next")
    config = {"block_size": 16, "kernel_block_size": 8, "max_num_batched_tokens": 96, "max_num_seqs": 6,
              "num_blocks": 400}
    reference = _run(LLMEngine(folder, EngineConfig(**config, speculative_config=spec(2))), sampled=1)
    engine = LLMEngine(folder, EngineConfig(**config, speculative_config=spec(2)))
    blocks = engine.scheduler.cache._life.blocks
    graphs = engine.runner._draft_graphs = _cpu_graphs(engine, 2)  # the padding's block: the last free one
    scratch = graphs.catch[1].scratch_page // engine.runner.pages_per_block
    calls = Counter()

    def counting(name, fn):
        def counted(*args, **kwargs):
            assert blocks.ref_counts[scratch] == 0  # (the padding's block stays free: the test holds)
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name in ("run", "run_after_verify"):
        setattr(graphs, name, counting(name, getattr(graphs, name)))
    assert _run(engine, sampled=1) == reference
    print(f"drafting graph calls: {dict(calls)}")
    assert calls["run"] and calls["run_after_verify"]
