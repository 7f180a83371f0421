"""The simulator predicts the engine: `hybridcache` (checkpoint states in KV blocks, one pool, as the engine keeps
them) reports the cached tokens a real `LLMEngine` reports, request by request, on a workload that evicts."""

import random

import pytest

from hybridcache import LLM, SamplingParams
from hybridcache.bench.simulator import SimConfig, make_replay, parse_policies
from hybridcache.bench.workloads import SimRequest
from hybridcache.engine.cost_model import ModelCost, load_model_cost
from hybridcache.engine.memory import plan_memory
from hybridcache.models.config import ModelConfig

from ..engine.model_folders import write_tiny_model

BLOCK = 16
CHUNK = 128
MAX_MODEL_LEN = 512


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


def test_hybridcache_predicts_the_engines_cached_tokens(model_dir):
    """One request at a time (the simulator's order) through an engine of one running sequence, chunks of 128
    tokens, a pool of 96 blocks for KV and checkpoint states; the simulator replays the same prompts and replies
    with the same pool and reports the same cached tokens for every request, the same saves and the same
    evictions."""
    cost = ModelCost.from_config(ModelConfig.from_model_dir(model_dir), "tiny")
    num_blocks = 96
    llm = LLM(model_dir, block_size=BLOCK, kernel_block_size=8, max_num_batched_tokens=CHUNK, max_num_seqs=1,
              max_model_len=MAX_MODEL_LEN, num_blocks=num_blocks)
    engine = llm.engine
    plan = engine.memory_plan
    assert plan.num_blocks == num_blocks and plan.num_runtime_slots == 1

    config = SimConfig(num_blocks * cost.block_bytes(BLOCK), BLOCK, CHUNK, check_integrity=True)
    (spec,) = parse_policies("hybridcache", BLOCK)
    replay = make_replay(spec, cost, config, max_running=1)
    assert (replay.num_blocks, replay.num_slots, replay.state_pages) == (num_blocks, 1, plan.state_pages)

    rng = random.Random(7)
    history: dict[int, tuple[int, ...]] = {}
    engine_cached, simulated_cached = [], []
    for i, (session, new) in enumerate(_calls(rng)):
        prompt = history.get(session, ()) + new
        params = SamplingParams(temperature=0, max_tokens=rng.randint(3, 9), ignore_eos=True)
        out = llm.generate([list(prompt)], params, use_tqdm=False)[0]
        reply = tuple(out.outputs[0].token_ids)
        engine.check_integrity()
        before = replay.counters.hit_tokens
        replay.run(SimRequest(f"c{i}", prompt, reply, session_id=str(session)))
        simulated_cached.append(replay.counters.hit_tokens - before)
        engine_cached.append(out.num_cached_tokens)
        history[session] = prompt + reply
    assert simulated_cached == engine_cached
    engine_stats, sim_stats = engine.scheduler.cache.stats, replay.cache.stats
    assert sum(engine_stats.evictions_by_kind.values()) > 0, "the workload must evict"
    assert sim_stats.evictions_by_kind == engine_stats.evictions_by_kind
    assert sim_stats.saves_by_reason == engine_stats.saves_by_reason
    assert sum(engine_cached) > 0 and 0 in engine_cached


@pytest.mark.parametrize(("n", "num_blocks", "seed"), [(2, 40, 3), (2, 50, 7), (3, 45, 1), (2, 96, 7)])
def test_hybridcache_predicts_the_engine_with_n_completions(model_dir, n, num_blocks, seed):
    """Requests with n completions through an engine of n running sequences: the followers wait for
    completion 0's prefill, hit its whole prompt and decode beside it, so that completion 1 finishes a step
    after completion 0 (and its blocks that repeat completion 0's are freed as they fill). The simulator
    replays the engine's order and reports the same cached tokens for every request (summed over the
    completions), the same saves and the same evictions, in pools tight enough to evict between them."""
    cost = ModelCost.from_config(ModelConfig.from_model_dir(model_dir), "tiny")
    llm = LLM(model_dir, block_size=BLOCK, kernel_block_size=8, max_num_batched_tokens=CHUNK, max_num_seqs=n,
              max_model_len=MAX_MODEL_LEN, num_blocks=num_blocks)
    engine = llm.engine
    config = SimConfig(num_blocks * cost.block_bytes(BLOCK), BLOCK, CHUNK, check_integrity=True)
    (spec,) = parse_policies("hybridcache", BLOCK)
    replay = make_replay(spec, cost, config, max_running=n)
    assert (replay.num_blocks, replay.state_pages) == (num_blocks, engine.memory_plan.state_pages)

    rng = random.Random(seed)
    history: dict[int, tuple[int, ...]] = {}
    engine_cached, simulated_cached = [], []
    for i, (session, new) in enumerate(_calls(rng)):
        prompt = history.get(session, ()) + new
        params = SamplingParams(temperature=0, max_tokens=rng.randint(3, 9), ignore_eos=True, n=n)
        out = llm.generate([list(prompt)], params, use_tqdm=False)[0]
        outputs = [tuple(c.token_ids) for c in out.outputs]
        engine.check_integrity()
        before = replay.counters.hit_tokens
        replay.run(SimRequest(f"c{i}", prompt, outputs[0], n=n, session_id=str(session),
                              sibling_output_ids=tuple(outputs[1:])))
        simulated_cached.append(replay.counters.hit_tokens - before)
        engine_cached.append(sum(c.num_cached_tokens for c in out.outputs))
        assert [c.num_cached_tokens for c in out.outputs][1:] == [len(prompt)] * (n - 1)  # the followers hit it all
        history[session] = prompt + outputs[0]
    assert simulated_cached == engine_cached
    engine_stats, sim_stats = engine.scheduler.cache.stats, replay.cache.stats
    assert sum(engine_stats.evictions_by_kind.values()) > 0, "the workload must evict"
    assert sim_stats.evictions_by_kind == engine_stats.evictions_by_kind
    assert sim_stats.saves_by_reason == engine_stats.saves_by_reason


@pytest.mark.parametrize("gib", [1 / 32, 0.25, 1, 16])
@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
def test_paged_sizing_is_the_engines_memory_plan(gib, ssm_dtype):
    """The simulator's pool for M bytes is the engine's plan for a budget of M + its runtime slots: the same
    blocks, the same blocks per checkpoint state."""
    cost = load_model_cost(None, ssm_dtype)
    memory = int(gib * (1 << 30))
    plan = plan_memory(memory + 8 * cost.state_bytes, kv_bytes_per_block=cost.block_bytes(64),
                       state_bytes_per_slot=cost.state_bytes, max_num_seqs=8, block_size=64, min_blocks=1)
    (spec,) = parse_policies("hybridcache", 64)
    replay = make_replay(spec, cost, SimConfig(memory, 64), max_running=8)
    assert (replay.num_blocks, replay.state_pages) == (plan.num_blocks, plan.state_pages)


@pytest.mark.parametrize("policy", ["hybridcache", "hybridcache+flop", "bounded-oracle"])
@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
def test_the_cache_costs_a_state_as_the_engine_does(policy, ssm_dtype):
    """The simulator's cache ranks with the engine's cost model (`engine_cost_model`): a state costs the k pages it
    occupies (2 x 65,536 B on the built-in model at B = 64), not its raw bytes (117,248 B in fp32), which
    `hybridcache+flop`'s FLOPs-per-byte ranking reads (hunt 129: other evictions than the engine's)."""
    from hybridcache.engine.cost_model import engine_cost_model
    from hybridcache.models.builtin import ensure_builtin_model

    cost = load_model_cost(None, ssm_dtype)
    memory = 1 << 26
    plan = plan_memory(memory + 8 * cost.state_bytes, kv_bytes_per_block=cost.block_bytes(64),
                       state_bytes_per_slot=cost.state_bytes, max_num_seqs=8, block_size=64, min_blocks=1)
    engine = engine_cost_model(ModelConfig.from_model_dir(ensure_builtin_model()), plan, block_size=64,
                               ssm_dtype=ssm_dtype)
    (spec,) = parse_policies(policy, 64)
    simulated = make_replay(spec, cost, SimConfig(memory, 64), max_running=8).cache.cost_model
    assert simulated.state_bytes == engine.state_bytes == plan.state_pages * plan.block_bytes != cost.state_bytes
    assert simulated.kv_bytes_per_token == engine.kv_bytes_per_token
    assert (simulated.flops_per_token, simulated.attn_flops_per_token_pair) == (
        engine.flops_per_token, engine.attn_flops_per_token_pair)
