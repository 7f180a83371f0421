"""The simulator's accounting: a hand-computed trace gives exact hit tokens for every policy."""

import pytest

from hybridcache.bench.oracles import OracleIndex
from hybridcache.bench.simulator import GIB, SimConfig, parse_policies, simulate
from hybridcache.bench.specs import cache_sizing
from hybridcache.bench.workloads import SimRequest, Workload
from hybridcache.engine.cost_model import ModelCost, load_model_cost

COST = ModelCost("toy", kv_bytes_per_token=16, state_bytes=256, flops_per_token=10.0, attn_flops_per_token_pair=1.0)
# a state of one page (B = 4): branch points from 4 tokens on are worth a checkpoint (COST's from 16 on)
SMALL_STATE = ModelCost("toy1", kv_bytes_per_token=16, state_bytes=64, flops_per_token=10.0,
                        attn_flops_per_token_pair=1.0)


def _workload(requests):
    requests = tuple(requests)
    return Workload("toy", len(requests), lambda: iter(requests))


def _run(requests, policies, block_size=4, memory=1 << 20, chunk_budget=100, cost=COST):
    specs = parse_policies(policies, block_size)
    config = SimConfig(memory, block_size, chunk_budget, kv_tokens_per_slot=16, check_integrity=True)
    return simulate(_workload(requests), specs, cost, config).policies


# B = 4. r1 feeds [1..10] + output 50 (51 is sampled, never fed): 11 tokens.
# r2 = r1's fed tokens + [60, 61, 62]; r3 shares [1..6] with r1, then diverges.
R1 = SimRequest("r1", tuple(range(1, 11)), (50, 51))
R2 = SimRequest("r2", tuple(range(1, 11)) + (50, 60, 61, 62), (70,))
R3 = SimRequest("r3", (1, 2, 3, 4, 5, 6, 80, 81, 82), (90,))


def test_hand_computed_trace_gives_exact_hits_for_every_policy():
    results = _run([R1, R2, R3], "none,block-aligned,seed,hybridcache,hybridcache+flop,oracle", cost=SMALL_STATE)
    hits = {name: r.hit_tokens for name, r in results.items()}
    assert hits == {
        "none": 0,
        # r1 saves at 8 (its chunk [0, 10) cut back to the block boundary); r2 restores it; r3's path
        # stops at block 1, which holds no checkpoint.
        "block-aligned": 8,
        # r1 saves its prefill end (10); r2 restores it (tail [9, 10] matches); r3 misses.
        "seed": 10,
        # r1's finish checkpoint at 11 serves r2; r3 misses but saves a branch point at 6.
        "hybridcache": 11,
        "hybridcache+flop": 11,
        # r2: 11 tokens of r1's fed tokens; r3: 6.
        "oracle": 17,
    }
    for r in results.values():
        assert r.prompt_tokens == 10 + 14 + 9
        assert r.prefill_tokens_computed == 33 - r.hit_tokens
        assert r.token_hit_rate == pytest.approx(r.hit_tokens / 33)
    assert results["hybridcache"].flops_saved == COST.prefill_flops(11)
    assert results["oracle"].flops_saved == COST.prefill_flops(11) + COST.prefill_flops(6)
    assert results["hybridcache"].hits_by_reason == {"finish": 1}
    assert results["seed"].hits_by_reason == {"prefill_end": 1}
    # block-aligned saves at 8 (r1), 12 (r2) and 8 (r3, on its own block [5, 6, 80, 81]); hybridcache saves
    # r1's prefill end (10) and finish (11), r2's prefill end (14; its finish at 14 is a duplicate: one
    # output token is never fed), r3's branch point (6) and prefill end (9)
    assert results["block-aligned"].checkpoints_saved == 3
    assert results["hybridcache"].checkpoints_saved == 5


def test_a_fourth_request_hits_the_branch_point_only_under_hybridcache():
    r4 = SimRequest("r4", (1, 2, 3, 4, 5, 6, 99, 98), (1,))
    results = _run([R1, R2, R3, r4], "seed,hybridcache,oracle", cost=SMALL_STATE)
    assert results["hybridcache"].hit_tokens == 11 + 6
    assert results["seed"].hit_tokens == 10
    assert results["oracle"].hit_tokens == 17 + 6


def test_a_branch_point_shorter_than_a_state_is_not_saved_as_the_engine_decides():
    """The engine's tiny-branch-point rule (`CacheConfig.min_branch_point_step` = k x B tokens): with COST's state
    of 4 pages (16 tokens of KV), r3's divergence at 6 is not saved, so r4 misses where it hit above."""
    r4 = SimRequest("r4", (1, 2, 3, 4, 5, 6, 99, 98), (1,))
    results = _run([R1, R2, R3, r4], "hybridcache,bounded-oracle")
    for name in ("hybridcache", "bounded-oracle"):
        assert results[name].hit_tokens == 11, name
        assert "branch_point" not in results[name].hits_by_reason, name


def test_identical_resend_is_a_zero_prefill_hit_from_the_first_resend_on():
    prompt = tuple(range(100, 130))
    requests = [SimRequest(f"x{i}", prompt, (7, 8)) for i in range(3)]
    results = _run(requests, "seed,hybridcache,oracle,bounded-oracle")
    assert results["oracle"].hit_tokens == 2 * 30
    # hybridcache: the prefill-end checkpoint at 30 keeps the last hidden state: each resend only samples.
    assert results["hybridcache"].hit_tokens == 2 * 30
    assert results["bounded-oracle"].hit_tokens == 2 * 30
    # seed (LMDeploy 0.18): its checkpoint at 30 is out of reach (at most prompt_len - 1), no chunk end below.
    assert results["seed"].hit_tokens == 0


def test_seed_chains_stop_growing_after_a_partial_hit():
    """LMDeploy 0.18: a sequence that started from a partial hit (21 is not a multiple of B = 4) saves
    nothing, so turn 2 of a chat hits only what turn 0 saved, while hybridcache hits turn 1's finish."""
    t0 = SimRequest("t0", tuple(range(1, 22)), (50, 51))
    t1 = SimRequest("t1", t0.prompt_ids + (50, 60, 61, 62), (70, 71))
    t2 = SimRequest("t2", t1.prompt_ids + (70, 80, 81), (90,))
    results = _run([t0, t1, t2], "seed,hybridcache")
    assert results["seed"].hit_tokens == 21 + 21
    assert results["hybridcache"].hit_tokens == 22 + 26


def test_seed_reproduces_lmdeploy_per_turn_figures_on_the_gpu_chat_workload():
    """Issue 11's phase A (4 system prompts of 2,000 tokens, 16 sessions, 4 turns, 200-600-token user
    messages, fixed 100-300-token replies, one new token per call; 209,144 prompt tokens), as its benchmark
    draws it. LMDeploy 0.18 on the H200 reported 0 / 37,872 / 38,575 / 38,575 cached tokens by turn (115,022),
    hybridcache 159,072 (before zero-prefill hits and learned admission)."""
    import random

    rng = random.Random(0)

    def letters(n):
        return tuple(rng.randrange(97, 123) for _ in range(n))

    systems = [letters(2000) for _ in range(4)]
    history = [systems[i % 4] for i in range(16)]
    requests = []
    for turn in range(4):
        for i in range(16):
            prompt = history[i] + letters(rng.randint(200, 600))
            reply = letters(rng.randint(100, 300))
            requests.append(SimRequest(f"s{i}t{turn}", prompt, reply[:1], session_id=str(i), turn=turn))
            history[i] = prompt + reply
    assert sum(r.prompt_len for r in requests) == 209_144
    specs = parse_policies("seed,hybridcache", 64)
    results = simulate(_workload(requests), specs, load_model_cost(None), SimConfig(8 * GIB)).policies
    by_turn = {t: sum(r.prompt_len for r in requests if r.turn == t) for t in range(4)}
    seed = results["seed"]
    assert [round(seed.hit_rate_by_turn[t] * by_turn[t]) for t in range(4)] == [0, 37_872, 38_575, 38_575]
    assert seed.hit_tokens == 115_022
    assert results["hybridcache"].hit_tokens >= 159_000


def test_n_completions_of_one_request_share_the_first_ones_prefill():
    prompt = tuple(range(200, 220))
    request = SimRequest("g", prompt, (1, 2), n=3, sibling_output_ids=((3, 4), (5, 6)))
    again = SimRequest("h", prompt + (9, 9, 9), (1,))
    results = _run([request, again], "seed,hybridcache,oracle,bounded-oracle")
    assert results["oracle"].hit_tokens == 2 * 20 + 20  # the siblings and the later request: the whole prompt
    assert results["oracle"].prompt_tokens == 3 * 20 + 23
    # the siblings wait for the first prefill and only sample (zero-prefill hits on its prefill end at 20);
    # the finish checkpoints (at 21) do not match the later prompt, the prefill end at 20 does
    assert results["hybridcache"].hit_tokens == 3 * 20
    assert results["hybridcache"].hits_by_reason == {"prefill_end": 3}
    assert results["bounded-oracle"].hit_tokens == 3 * 20
    assert results["seed"].hit_tokens == 20  # run together, the siblings miss; the later request hits 20


def test_a_prompt_larger_than_the_cache_is_uncacheable():
    big = SimRequest("big", tuple(range(300, 400)), (1,))
    results = _run([big, big], "hybridcache", memory=64 * 16 + 2 * 256)
    r = results["hybridcache"]
    assert r.num_uncacheable == 2 and r.hit_tokens == 0


def test_oracle_index_token_granularity():
    index = OracleIndex(block_size=4)
    index.insert((1, 2, 3, 4, 5, 6, 7, 8, 9, 10))
    assert index.longest_prefix((1, 2, 3, 4, 5, 6, 0)) == 6
    assert index.longest_prefix((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)) == 10
    assert index.longest_prefix((1, 2, 3, 4, 5, 6, 7, 8, 9, 0)) == 9
    assert index.longest_prefix((2,)) == 0


def test_cache_sizing_and_policy_parsing():
    cost = load_model_cost()
    assert (cost.kv_bytes_per_token, cost.state_bytes) == (1024, 117248)
    num_blocks, num_slots = cache_sizing(GIB, cost, 64, 2048)
    assert (num_blocks, num_slots) == (15518, 484)
    assert num_blocks * 64 * 1024 + num_slots * 117248 <= GIB
    specs = parse_policies("none,block-aligned:528,hybridcache+flop", 64)
    assert [(s.name, s.mode, s.block_size, s.eviction) for s in specs] == [
        ("none", "none", 64, "lru"), ("block-aligned:528", "block-aligned", 528, "lru"),
        ("hybridcache+flop", "hybridcache", 64, "flop_aware")]
    with pytest.raises(ValueError, match="oracle"):
        parse_policies("lru", 64)


def _shared_stem_requests(num: int) -> list[SimRequest]:
    """Prompts that share stems and grow turn by turn, so that a small cache evicts."""
    import random

    rng = random.Random(3)
    stems = [tuple(rng.randrange(100) for _ in range(rng.randint(5, 30))) for _ in range(4)]
    return [
        SimRequest(f"q{i}", rng.choice(stems) + tuple(rng.randrange(100) for _ in range(rng.randint(1, 25))),
                   tuple(rng.randrange(100) for _ in range(rng.randint(1, 6))))
        for i in range(num)
    ]


def test_grouped_parallel_jobs_give_the_results_of_separate_runs():
    from hybridcache.bench.simulator import _split_jobs, simulate_many

    requests = _shared_stem_requests(40)
    specs = parse_policies("none,block-aligned,seed,hybridcache,hybridcache+flop,oracle", 4)
    small = SimConfig(4096, 4, 100, kv_tokens_per_slot=16, check_integrity=True)
    large = SimConfig(1 << 20, 4, 100, kv_tokens_per_slot=16, check_integrity=True)
    jobs = [(s, small) for s in specs] + [(s, large) for s in specs if s.mode not in ("none", "oracle")]
    groups = _split_jobs(jobs, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(jobs))) and len(groups) == 3
    ticks = []
    grouped = simulate_many(_workload(requests), jobs, COST, num_workers=3, on_request=lambda: ticks.append(1))
    alone = [simulate(_workload(requests), [spec], COST, config).policies[spec.name] for spec, config in jobs]
    assert grouped == alone
    assert len(ticks) == len(jobs) * len(requests)
    assert sum(r.evictions for r in alone) > 0  # the small budget evicts
    serial = simulate_many(_workload(requests), jobs, COST, num_workers=1)
    assert serial == alone


def test_hybridcache_policies_hold_kv_and_states_in_one_budget():
    memory = 40 * 4 * 16 + 2 * 256  # 40 blocks of B = 4 (64 B each) and 2 slots' worth (256 B each): 3,072 B
    results = _run(_shared_stem_requests(60), "block-aligned,hybridcache,bounded-oracle", memory=memory)
    num_blocks, num_slots = cache_sizing(memory, COST, 4, 16)  # two pools: one slot per 16 KV tokens
    assert (results["block-aligned"].num_blocks, results["block-aligned"].num_slots) == (num_blocks, num_slots + 1)
    for name in ("hybridcache", "bounded-oracle"):
        r = results[name]
        # paged: the budget in blocks (a state is 256 // 64 = 4 of them), one runtime slot; integrity checked
        # every count after every request
        assert (r.num_blocks, r.num_slots) == (memory // 64, 1)
        assert 0 < r.bytes_peak <= memory, (name, r.bytes_peak)
        assert r.evictions > 0 and r.hit_tokens > 0


def _chain(name: str, start: int, length: int) -> tuple[SimRequest, SimRequest]:
    """A conversation of two calls: a `length`-token prompt, then the same with its reply (start + 50) and
    two more tokens. The second call restores the first's finish checkpoint, at `length` + 1."""
    prompt = tuple(range(start, start + length))
    return (SimRequest(f"{name}1", prompt, (start + 50, start + 51)),
            SimRequest(f"{name}2", prompt + (start + 50, start + 60, start + 61), (start + 70,)))


def test_reuse_oracle_knows_which_chains_return_but_not_when():
    # Three conversations; 28 blocks of B = 4 hold two finished chains besides the running sequence. When c1
    # finishes, a (used next, at request 3) or b (request 4) must go. The bounded oracle evicts b, the one
    # needed furthest ahead: a2 hits 13 tokens and c2 9. The reuse oracle knows both return but not when
    # and evicts the least recently used, a: b2 hits 9, c2 9. Both save only what is used again.
    a1, a2 = _chain("a", 100, 12)
    b1, b2 = _chain("b", 200, 8)
    c1, c2 = _chain("c", 300, 8)
    results = _run([a1, b1, c1, a2, b2, c2], "bounded-oracle,reuse-oracle", memory=28 * 4 * 16)
    assert results["bounded-oracle"].hit_tokens == 13 + 9
    assert results["reuse-oracle"].hit_tokens == 9 + 9
    for r in results.values():
        assert r.hits_by_reason == {"finish": 2}
    # with room for all three chains the two oracles agree: every second call hits
    roomy = _run([a1, b1, c1, a2, b2, c2], "bounded-oracle,reuse-oracle", memory=40 * 4 * 16)
    assert roomy["bounded-oracle"].hit_tokens == roomy["reuse-oracle"].hit_tokens == 13 + 9 + 9


def test_a_host_tier_keeps_what_a_tiny_device_pool_evicts():
    # B = 4, a block of 64 bytes: 10 device blocks (a state takes 4 of them) cannot keep r1's finish checkpoint
    # (2 nodes, 4 pages, a frozen tail) while `other` runs and saves; a host tier of 4x the budget takes it and
    # r2 promotes it back (the oracles ignore the host tier)
    other = SimRequest("other", tuple(range(100, 110)), (101,))
    workload = [R1, other, R2]
    specs = parse_policies("hybridcache,bounded-oracle", 4)

    def run(host: int):
        config = SimConfig(10 * 64, 4, 100, kv_tokens_per_slot=16, check_integrity=True, host_memory_bytes=host)
        return simulate(_workload(workload), specs, COST, config).policies

    alone, with_host = run(0), run(4 * 10 * 64)
    assert alone["hybridcache"].hit_tokens == 0 and alone["hybridcache"].host_blocks is None
    hybrid = with_host["hybridcache"]
    assert hybrid.host_blocks == 40 and hybrid.hit_tokens == hybrid.host_hit_tokens == 11
    assert hybrid.host_save_bytes > 0 and hybrid.host_load_bytes > 0
    assert with_host["bounded-oracle"] == alone["bounded-oracle"]


def test_host_memory_option_takes_gib_or_a_multiple_of_the_budget():
    from hybridcache.bench.cli import host_memory_bytes

    assert host_memory_bytes("4x", 1000) == 4000
    assert host_memory_bytes("0.5", 1000) == GIB // 2
    assert host_memory_bytes("0", 1000) == 0
    with pytest.raises(ValueError):
        host_memory_bytes("-1x", 1000)


def test_hit_counts_leave_out_a_sequence_dropped_after_its_hit(monkeypatch):
    """A sequence admitted with a hit that then finds no room for its blocks runs without the cache: its hit
    counts nowhere. SWE-agent at 0.01 GiB with a 4x host tier drops 7 such sequences (10,825 hit tokens); the
    host hit tokens had counted them (47,454 against 46,867 hit tokens). Now host hit tokens and hits by reason
    count the sequences the hit tokens count."""
    from hybridcache.bench.results import Counters
    from hybridcache.bench.workloads import load_workload

    added: list[tuple[int, str | None]] = []
    add = Counters.add

    def recording_add(self, request, hit_tokens, cost, *args):
        added.append((hit_tokens, args[0] if args else None))  # (hit tokens, the reason of its checkpoint)
        add(self, request, hit_tokens, cost, *args)

    monkeypatch.setattr(Counters, "add", recording_add)
    memory = int(0.01 * GIB)
    workload = load_workload("swe-agent", num_requests=40)
    (spec,) = parse_policies("hybridcache", 64)
    config = SimConfig(memory, 64, host_memory_bytes=4 * memory)
    result = simulate(workload, [spec], load_model_cost(None, "auto"), config).policies["hybridcache"]
    assert result.num_uncacheable > 0 and result.host_hit_tokens > 0
    assert result.host_hit_tokens <= result.hit_tokens == sum(hit for hit, _ in added)
    assert sum(result.hits_by_reason.values()) == sum(reason is not None for _, reason in added)
    assert all(hit > 0 for hit, reason in added if reason is not None)


@pytest.mark.parametrize("fate", ["no-result", "killed"])
def test_a_worker_that_ends_without_its_result_is_an_error_not_a_hang(monkeypatch, fate):
    """`simulate_many` waited forever for a worker that exited without sending its result (a multiprocessing queue
    drops what it cannot pickle, and the worker then exits 0); one killed while holding the progress counter's lock
    blocked the parent's read of it. Both now raise, naming the worker's policies, and leave no worker behind."""
    import multiprocessing
    import os
    import signal

    from hybridcache.bench import simulator

    def lost(workload, jobs, cost, counter, queue, index) -> None:  # noqa: ANN001
        if index == 0:
            if fate == "killed":
                counter.get_lock().acquire()
                os.kill(os.getpid(), signal.SIGKILL)
            return  # no result
        queue.put((index, simulator._simulate_jobs(workload, jobs, cost, lambda _: None)[0]))

    monkeypatch.setattr(simulator, "_job", lost)  # (the workers are forked: they run the patched function)
    requests = _shared_stem_requests(12)
    specs = parse_policies("block-aligned,seed,hybridcache", 4)
    jobs = [(s, SimConfig(4096, 4, 100, kv_tokens_per_slot=16)) for s in specs]
    message = "ended without sending its result" if fate == "no-result" else r"died \(exit code -9\)"
    with pytest.raises(RuntimeError, match=message):
        simulator.simulate_many(_workload(requests), jobs, COST, num_workers=3, on_request=lambda: None)
    assert not multiprocessing.active_children()
