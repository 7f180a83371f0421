import pytest

from hybridcache.scheduler.save_plan import checkpoint_policy, plan_chunk


def run(mode, *, start=20, prompt_len=100, budget=64, branch_step=37, block_size=16):
    """Plan chunks until the prompt is fed; returns [(start, end, reason)]."""
    policy = checkpoint_policy(mode)
    spans = []
    while start < prompt_len:
        plan = plan_chunk(policy, start=start, num_tokens=prompt_len, budget=budget, prompt_len=prompt_len,
                          block_size=block_size, branch_step=branch_step)
        spans.append((start, plan.end, plan.reason))
        start = plan.end
    return spans


def test_worked_example_of_the_docstring():
    assert run("hybridcache") == [(20, 37, "branch_point"), (37, 100, "prefill_end")]
    assert run("seed") == [(20, 84, "chunk_end"), (84, 100, "prefill_end")]
    assert run("block-aligned") == [(20, 80, "chunk_end"), (80, 96, "chunk_end"), (96, 100, None)]
    assert run("none") == [(20, 84, None), (84, 100, None)]


def test_branch_step_outside_the_chunk_is_ignored():
    assert run("hybridcache", branch_step=20) == [(20, 84, "chunk_end"), (84, 100, "prefill_end")]
    assert run("hybridcache", branch_step=100) == [(20, 84, "chunk_end"), (84, 100, "prefill_end")]


def test_block_aligned_prompt_end_on_a_boundary_is_a_prefill_end():
    assert run("block-aligned", start=0, prompt_len=32, budget=100) == [(0, 32, "prefill_end")]


def test_decode_saves_only_at_the_interval():
    policy = checkpoint_policy("hybridcache")
    kwargs = dict(num_tokens=0, budget=10, prompt_len=50, block_size=16, decode_interval=64)
    assert plan_chunk(policy, start=60, **{**kwargs, "num_tokens": 61}).reason is None
    assert plan_chunk(policy, start=63, **{**kwargs, "num_tokens": 64}).reason == "decode_interval"
    assert plan_chunk(policy, start=63, **{**kwargs, "num_tokens": 64, "decode_interval": None}).reason is None


def test_unknown_mode_lists_the_known_ones():
    with pytest.raises(ValueError, match="hybridcache") as info:
        checkpoint_policy("lru-ish")
    assert "block-aligned" in str(info.value)


def test_chunks_never_end_inside_a_multimodal_span():
    policy = checkpoint_policy("hybridcache")
    kwargs = dict(num_tokens=100, prompt_len=100, block_size=16, spans=[(30, 50)])
    # The budget would end the chunk at 40, inside the span: it ends at the span's start instead.
    assert plan_chunk(policy, start=0, budget=40, **kwargs) == plan_chunk(policy, start=0, budget=30, **kwargs)
    assert plan_chunk(policy, start=0, budget=40, **kwargs).end == 30
    # Starting at the span, a small budget still feeds the whole span.
    assert plan_chunk(policy, start=30, budget=5, **kwargs).end == 50
    # Block-aligned: a chunk cut back to 30 saves at the boundary 16; a boundary inside a span is no save.
    aligned = plan_chunk(checkpoint_policy("block-aligned"), start=0, budget=36, **kwargs)
    assert (aligned.end, aligned.reason) == (16, "chunk_end")
    aligned = plan_chunk(checkpoint_policy("block-aligned"), start=0, budget=45, **{**kwargs, "spans": [(10, 40)]})
    assert (aligned.end, aligned.reason) == (45, None)
    assert plan_chunk(None, start=0, budget=40, **kwargs).end == 30
