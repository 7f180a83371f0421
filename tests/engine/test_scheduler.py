"""The scheduler over a real PrefixCache, without a model: chunking, batching, admission, preemption."""

from hybridcache.cache import CacheConfig, PrefixCache
from hybridcache.sampling import SamplingParams
from hybridcache.scheduler.save_plan import checkpoint_policy
from hybridcache.scheduler.scheduler import Scheduler
from hybridcache.scheduler.sequence import Seq, SeqStatus


def make_seq(seq_id: int, prompt_len: int, offset: int = 0) -> Seq:
    return Seq(
        seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=[offset + i for i in range(prompt_len)],
        prompt_len=prompt_len, params=SamplingParams(temperature=0), generator=None, arrival=seq_id,
    )


def make_scheduler(*, num_blocks=64, num_slots=4, mode="none", **kwargs) -> Scheduler:
    cache = PrefixCache(CacheConfig(block_size=16, num_blocks=num_blocks, num_slots=num_slots))
    defaults = dict(max_num_seqs=4, max_num_batched_tokens=50)
    return Scheduler(cache, checkpoint_policy(mode), **{**defaults, **kwargs})


def run_step(scheduler: Scheduler):
    """Schedule (which commits the step to the cache), pretend the forward ran: advance num_computed and
    append a token where sampled."""
    chunks = scheduler.schedule().chunks
    for chunk in chunks:
        chunk.seq.num_computed = chunk.end
        if chunk.samples:
            chunk.seq.token_ids.append(1000 + chunk.seq.num_tokens)
    scheduler.cache.check_integrity()
    return chunks


def test_long_prompt_is_chunked_by_the_token_budget():
    scheduler = make_scheduler()
    seq = make_seq(0, 130)
    scheduler.add(seq)
    spans = [(c.start, c.num_tokens, c.samples) for _ in range(3) for c in run_step(scheduler)]
    assert spans == [(0, 50, False), (50, 50, False), (100, 30, True)]
    assert len(scheduler.cache.block_ids(seq.seq_id)) == -(-130 // 16)


def test_decodes_and_new_prefills_share_a_step():
    scheduler = make_scheduler(max_num_batched_tokens=40)
    a, b = make_seq(0, 20), make_seq(1, 100, offset=500)
    scheduler.add(a)
    run_step(scheduler)
    scheduler.add(b)
    chunks = run_step(scheduler)
    assert [(c.seq.seq_id, c.num_tokens) for c in chunks] == [(0, 1), (1, 39)]


def test_decode_rows_lead_every_step_of_a_younger_prompts_chunked_prefill():
    # The CUDA backend runs a mixed step's leading decode rows in the decode kernels (docs/kernels.md, "A mixed
    # step"): while a long prompt is prefilled chunk by chunk, the sequences already decoding come first each step.
    scheduler = make_scheduler(max_num_batched_tokens=40, num_blocks=128)
    decoding = [make_seq(0, 20), make_seq(1, 15, offset=300)]
    for seq in decoding:
        scheduler.add(seq)
    run_step(scheduler)
    long = make_seq(2, 150, offset=600)
    scheduler.add(long)
    layouts = []
    while long.num_computed < long.prompt_len:
        layouts.append([(c.seq.seq_id, c.num_tokens) for c in run_step(scheduler)])
    assert layouts == [[(0, 1), (1, 1), (2, 38)]] * 3 + [[(0, 1), (1, 1), (2, 36)]]


def test_max_num_seqs_limits_admission():
    scheduler = make_scheduler(num_slots=8, max_num_seqs=2, max_num_batched_tokens=1000)
    for i in range(3):
        scheduler.add(make_seq(i, 10, offset=100 * i))
    chunks = run_step(scheduler)
    assert [c.seq.seq_id for c in chunks] == [0, 1]
    assert len(scheduler.waiting) == 1


def test_preemption_frees_the_newest_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=1000)
    a, b = make_seq(0, 31), make_seq(1, 31, offset=100)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)  # each holds 2 blocks; both sampled a token -> 32 tokens
    run_step(scheduler)  # decode at position 31 fits; now 33 tokens, the next decode needs a 3rd block
    chunks = run_step(scheduler)
    assert [c.seq.seq_id for c in chunks] == [0]
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and b.seq_id not in scheduler.cache.running_ids()
    assert scheduler.waiting[0] is b and scheduler.num_preemptions == 1
    b.finish_reason = "stop"
    a.finish_reason = "stop"
    scheduler.finish(a)
    chunks = run_step(scheduler)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in chunks] == [(1, 0, 33)]
    scheduler.finish(b)
    stats = scheduler.cache.stats
    assert stats.num_running == 0 and stats.num_slots_used == 0


def test_hybridcache_mode_ends_a_chunk_at_the_branch_point_and_the_next_prompt_hits_there():
    scheduler = make_scheduler(mode="hybridcache", max_num_batched_tokens=1000)
    system = list(range(37))
    first, second, third = (make_seq(i, 0) for i in range(3))
    for seq, suffix in ((first, [900, 901, 902]), (second, [800, 801]), (third, [700, 701, 702, 703])):
        seq.token_ids = system + suffix
        seq.prompt_len = len(seq.token_ids)
    scheduler.add(first)
    run_step(scheduler)
    first.finish_reason = "stop"
    scheduler.finish(first)
    scheduler.add(second)
    chunks = run_step(scheduler)  # diverges from the first prompt at 37: the chunk ends there
    assert second.num_cached == 0 and [(c.start, c.end) for c in chunks] == [(0, 37)]
    run_step(scheduler)
    second.finish_reason = "stop"
    scheduler.finish(second)
    scheduler.add(third)
    run_step(scheduler)
    assert third.num_cached == 37


def test_chunks_carry_the_blocks_read_before_the_commit_and_the_steps_copy_plan():
    # Two identical 20-token prompts in one step: at commit the second one's full first block is deduplicated
    # onto the first one's, but its forward still writes its own block, which the chunk carries. (Seed mode:
    # hybridcache mode makes the second wait for the first one's prefill instead, see in_flight.py.)
    scheduler = make_scheduler(mode="seed", max_num_batched_tokens=1000)
    a, b = make_seq(0, 20), make_seq(1, 20)
    scheduler.add(a)
    scheduler.add(b)
    output = scheduler.schedule()
    chunk_a, chunk_b = output.chunks
    assert chunk_b.token_ids == tuple(b.token_ids) and chunk_b.slot == scheduler.cache.slot(b.seq_id)
    assert chunk_a.block_ids == scheduler.cache.block_ids(a.seq_id)
    assert chunk_b.block_ids[0] != chunk_a.block_ids[0]
    assert scheduler.cache.block_ids(b.seq_id)[0] == chunk_a.block_ids[0]
    assert not output.copies.is_empty  # seed mode saves at the prefill end of both


def test_younger_decodes_lead_an_older_prompts_remaining_chunks():
    """An older prompt whose chunk ended short of the budget (a branch point, a fork step) let younger prompts in;
    once those decode they come first in every step while the older prompt's remaining chunks take what is left.
    Before, the older prompt took the whole budget each step and the younger decodes got no token until its whole
    prefill was done (22-23 steps in a bug hunt; a 100k-token prompt would freeze them for ~50 steps)."""
    scheduler = make_scheduler(max_num_batched_tokens=40, num_blocks=128, num_slots=8, mode="hybridcache")
    long = make_seq(0, 150)
    long.fork_steps.add(8)  # its first chunk ends at step 8: 32 tokens of the budget left
    young = [make_seq(1, 10, offset=300), make_seq(2, 10, offset=600)]
    for seq in (long, *young):
        scheduler.add(seq)
    first = [(c.seq.seq_id, c.num_tokens) for c in run_step(scheduler)]
    assert first == [(0, 8), (1, 10), (2, 10)]
    layouts = []
    while long.num_computed < long.prompt_len:
        layouts.append([(c.seq.seq_id, c.num_tokens) for c in run_step(scheduler)])
    assert all(layout[:2] == [(1, 1), (2, 1)] and layout[2][0] == 0 for layout in layouts), layouts
    assert sum(layout[2][1] for layout in layouts) == 150 - 8


def test_a_decode_planned_ahead_of_an_older_prefill_can_still_be_its_preemption_victim():
    """Decodes are planned before prefills, so the newest running sequence (the preemption victim) may already be
    planned when an older prompt's chunk cannot grow: it is unplanned and its budget given back, as vLLM's scheduler
    does. Before, it was preempted but stayed in the step's plan: `schedule()` raised KeyError ('request 1 is not
    running') out of `step()` (helper 100's hunt)."""
    scheduler = make_scheduler(max_num_batched_tokens=60, num_blocks=10, mode="block-aligned")
    old, young = make_seq(0, 150), make_seq(1, 10, offset=300)
    scheduler.add(old)
    scheduler.add(young)
    wanted = {0: 158, 1: 150}
    for _ in range(400):
        if not scheduler.has_work:
            break
        chunks = run_step(scheduler)
        ids = [c.seq.seq_id for c in chunks]
        assert len(ids) == len(set(ids)) and all(c.seq in scheduler.running for c in chunks)
        for seq in (old, young):
            if seq in scheduler.running and seq.num_tokens >= wanted[seq.seq_id]:
                seq.finish_reason = "length"
                scheduler.finish(seq)
    assert not scheduler.has_work and scheduler.num_preemptions >= 1
