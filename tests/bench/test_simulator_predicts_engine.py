"""The simulator predicts the engine: `hybridcache-2pool` (the simulator's model of what the engine runs) reports
the cached tokens a real `LLMEngine` reports, request by request, on a workload that evicts."""

import random

import pytest

from hybridcache import LLM, SamplingParams
from hybridcache.bench.cost_model import ModelCost
from hybridcache.bench.simulator import SimConfig, cache_sizing, make_replay, parse_policies
from hybridcache.bench.workloads import SimRequest
from hybridcache.engine.memory import plan_memory
from hybridcache.models.config import ModelConfig

from ..engine.model_folders import write_tiny_model

BLOCK = 16
CHUNK = 128
MAX_MODEL_LEN = 512
TOKENS_PER_CHECKPOINT = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_5_text"), "qwen3_5_text")


def _calls(rng: random.Random) -> list[tuple[int, tuple[int, ...]]]:
    """(session, new tokens) in call order: 6 sessions over 2 system prompts of 60-90 tokens, 3-4 turns each
    (the first brings the system prompt), 20-110 new user tokens per turn; the next call is a random session's
    next turn, so sessions interleave."""
    systems = [tuple(rng.randrange(256) for _ in range(rng.randint(60, 90))) for _ in range(2)]
    turns_left = {session: rng.randint(3, 4) for session in range(6)}
    calls = []
    while turns_left:
        session = rng.choice(sorted(turns_left))
        first = not any(s == session for s, _ in calls)
        calls.append((session, (systems[session % 2] if first else ()) + tuple(
            rng.randrange(256) for _ in range(rng.randint(20, 110)))))
        turns_left[session] -= 1
        if not turns_left[session]:
            del turns_left[session]
    return calls


def test_hybridcache_2pool_predicts_the_engines_cached_tokens(model_dir):
    """One request at a time (the simulator's order) through an engine of one running sequence, chunks of 128
    tokens, pools from the engine's memory plan of a small budget; the simulator replays the same prompts and
    replies with the same pools and reports the same cached tokens for every request, the same saves and the
    same evictions (measured here: 23 calls, 12 of them hits, 52 checkpoint and 43 dead-block evictions)."""
    cost = ModelCost.from_config(ModelConfig.from_model_dir(model_dir), "tiny")
    # a budget that buys small pools, split by the engine's rule (one slot per 256 KV tokens; one runtime slot)
    budget = 72 * cost.block_bytes(BLOCK) + 6 * cost.state_bytes
    plan = plan_memory(budget, kv_bytes_per_block=cost.block_bytes(BLOCK), state_bytes_per_slot=cost.state_bytes,
                       max_num_seqs=1, block_size=BLOCK, min_blocks=MAX_MODEL_LEN // BLOCK,
                       tokens_per_checkpoint=TOKENS_PER_CHECKPOINT)
    llm = LLM(model_dir, block_size=BLOCK, kernel_block_size=8, max_num_batched_tokens=CHUNK, max_num_seqs=1,
              max_model_len=MAX_MODEL_LEN, num_blocks=plan.num_blocks, num_checkpoint_slots=plan.num_checkpoint_slots)
    engine = llm.engine
    assert (engine.memory_plan.kv_bytes, engine.memory_plan.state_bytes) == (plan.kv_bytes, plan.state_bytes)

    config = SimConfig(budget - plan.num_runtime_slots * cost.state_bytes, BLOCK, CHUNK,
                       kv_tokens_per_slot=TOKENS_PER_CHECKPOINT, check_integrity=True)
    two_pools, one_budget = parse_policies("hybridcache-2pool,hybridcache", BLOCK)
    replay = make_replay(two_pools, cost, config, max_running=1)
    bytes_replay = make_replay(one_budget, cost, config, max_running=1)
    assert (replay.num_blocks, replay.num_slots) == (plan.num_blocks, plan.num_slots)

    rng = random.Random(7)
    history: dict[int, tuple[int, ...]] = {}
    engine_cached, simulated_cached, one_budget_cached = [], [], []
    for i, (session, new) in enumerate(_calls(rng)):
        prompt = history.get(session, ()) + new
        params = SamplingParams(temperature=0, max_tokens=rng.randint(3, 9), ignore_eos=True)
        out = llm.generate([list(prompt)], params, use_tqdm=False)[0]
        reply = tuple(out.outputs[0].token_ids)
        engine.check_integrity()
        request = SimRequest(f"c{i}", prompt, reply, session_id=str(session))
        for sim, cached in ((replay, simulated_cached), (bytes_replay, one_budget_cached)):
            before = sim.counters.hit_tokens
            sim.run(request)
            cached.append(sim.counters.hit_tokens - before)
        engine_cached.append(out.cached_tokens)
        history[session] = prompt + reply
    assert simulated_cached == engine_cached
    # the one-budget policy (KV and states trading bytes) is not what the engine runs, and here it shows
    assert one_budget_cached != engine_cached
    engine_stats, sim_stats = engine.scheduler.cache.stats, replay.cache.stats
    assert sum(engine_stats.evictions_by_kind.values()) > 0, "the workload must evict"
    assert sim_stats.evictions_by_kind == engine_stats.evictions_by_kind
    assert sim_stats.saves_by_reason == engine_stats.saves_by_reason
    assert sum(engine_cached) > 0 and 0 in engine_cached


@pytest.mark.parametrize("gib", [1 / 32, 0.25, 1, 16])
@pytest.mark.parametrize("tokens_per_checkpoint", [512, 2048])
def test_two_pool_sizing_is_the_engines_memory_plan(gib, tokens_per_checkpoint):
    """The simulator's two pools for M bytes are the engine's plan for a budget of M + its runtime slots."""
    from hybridcache.bench.cost_model import load_model_cost

    cost = load_model_cost()
    memory = int(gib * (1 << 30))
    plan = plan_memory(memory + 8 * cost.state_bytes, kv_bytes_per_block=cost.block_bytes(64),
                       state_bytes_per_slot=cost.state_bytes, max_num_seqs=8, block_size=64, min_blocks=1,
                       tokens_per_checkpoint=tokens_per_checkpoint)
    assert cache_sizing(memory, cost, 64, tokens_per_checkpoint) == (plan.num_blocks, plan.num_checkpoint_slots)
