from hybridcache.engine.sequence import SeqStatus, Sequence
from hybridcache.sampling import SamplingParams
from hybridcache.scheduler.plain_memory import PlainMemory
from hybridcache.scheduler.scheduler import Scheduler


def make_seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(
        seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=list(range(prompt_len)), prompt_len=prompt_len,
        params=SamplingParams(temperature=0), generator=None, arrival=seq_id,
    )


def run_step(scheduler: Scheduler):
    """Schedule, then pretend the forward ran: advance num_computed and append a token where sampled."""
    chunks = scheduler.schedule()
    for chunk in chunks:
        chunk.seq.num_computed = chunk.end
        if chunk.samples:
            chunk.seq.token_ids.append(0)
    return chunks


def test_long_prompt_is_chunked_by_the_token_budget():
    memory = PlainMemory(num_blocks=64, num_slots=4, block_size=16)
    scheduler = Scheduler(memory, max_num_seqs=4, max_num_batched_tokens=50)
    seq = make_seq(0, 130)
    scheduler.add(seq)
    spans = [(c.start, c.num_tokens, c.samples) for c in run_step(scheduler)]
    spans += [(c.start, c.num_tokens, c.samples) for c in run_step(scheduler)]
    spans += [(c.start, c.num_tokens, c.samples) for c in run_step(scheduler)]
    assert spans == [(0, 50, False), (50, 50, False), (100, 30, True)]
    assert len(seq.block_ids) == -(-130 // 16)


def test_decodes_and_new_prefills_share_a_step():
    memory = PlainMemory(num_blocks=64, num_slots=4, block_size=16)
    scheduler = Scheduler(memory, max_num_seqs=4, max_num_batched_tokens=40)
    a, b = make_seq(0, 20), make_seq(1, 100)
    scheduler.add(a)
    run_step(scheduler)
    scheduler.add(b)
    chunks = run_step(scheduler)
    assert [(c.seq.seq_id, c.num_tokens) for c in chunks] == [(0, 1), (1, 39)]


def test_max_num_seqs_limits_admission():
    memory = PlainMemory(num_blocks=64, num_slots=8, block_size=16)
    scheduler = Scheduler(memory, max_num_seqs=2, max_num_batched_tokens=1000)
    for i in range(3):
        scheduler.add(make_seq(i, 10))
    chunks = run_step(scheduler)
    assert [c.seq.seq_id for c in chunks] == [0, 1]
    assert len(scheduler.waiting) == 1


def test_preemption_frees_the_newest_and_requeues_it_first():
    memory = PlainMemory(num_blocks=4, num_slots=4, block_size=16)
    scheduler = Scheduler(memory, max_num_seqs=4, max_num_batched_tokens=1000)
    a, b = make_seq(0, 31), make_seq(1, 31)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)  # each holds 2 blocks; both sampled a token -> 32 tokens
    run_step(scheduler)  # decode at position 31 fits; now 33 tokens, the next decode needs a 3rd block
    chunks = run_step(scheduler)
    assert [c.seq.seq_id for c in chunks] == [0]
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and b.block_ids == [] and b.slot is None
    assert scheduler.waiting[0] is b and scheduler.num_preemptions == 1
    assert memory.num_free_blocks == 1
    scheduler.finish(a)
    chunks = run_step(scheduler)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in chunks] == [(1, 0, 33)]
    scheduler.finish(b)
    assert memory.num_free_blocks == 4 and memory.num_free_slots == 4
