"""MTP drafting on image prompts (CPU, the tiny Qwen3.5 VL folder with a random MTP head): the head rotates each
row as the target rotates that position (its M-RoPE positions: 3-D on an image, the index moved by the images
before it on text; vLLM's MTP proposer passes the target's M-RoPE positions to its draft model), in the catch-up
of a prompt, after a cache hit and at every further draft; the greedy outputs equal those without MTP, and a runner
with drafting graphs (their work on the static buffers: uniform plans and drafting before the verdicts) proposes
the drafts of the eager runner at every step."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.images import MediaLimits
from hybridcache.layers.rotary import mrope_cos_sin
from hybridcache.mm_processor import image_prompt
from hybridcache.models.mtp import write_random_mtp
from hybridcache.models.vl_folders import write_tiny_vl_model
from hybridcache.multimodal import rope_positions
from hybridcache.sampling import SamplingParams

from .spec_helpers import cpu_drafting_graphs, spec

PIL = pytest.importorskip("PIL.Image")
K = 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_mtp(write_tiny_vl_model(tmp_path_factory.mktemp("vl_mtp")))


def _engine(folder, k: int | None) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(block_size=16, kernel_block_size=8, max_num_batched_tokens=96,
                                          max_num_seqs=4, max_model_len=300,
                                          speculative_config=spec(k) if k else None))


def _image(height: int, width: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _workload(engine: LLMEngine, sampled: bool) -> list[tuple[str, list[int], tuple, SamplingParams]]:
    """Image prompts with text after their images (one image; two images of other grids), a text prompt, and,
    when `sampled`, a seeded sampled image request that ends first (its steps' drafting is not all greedy)."""
    vc = engine.vision.tower.config
    start, pad, end = vc.vision_start_token_id, vc.image_token_id, vc.vision_end_token_id

    def prompt(ids: list[int], images: list) -> tuple[list[int], tuple]:
        return image_prompt(engine.image_processor, ids, images, MediaLimits())

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    one = prompt([5, 6, 7, start, pad, end, *range(40, 52)], [_image(32, 64, 0)])
    two = prompt([20, start, pad, end, 21, 22, start, pad, end, *range(60, 70)], [_image(24, 40, 1), _image(40, 24, 2)])
    requests = [("one", *one, greedy(12)), ("two", *two, greedy(10)), ("text", list(range(80, 110)), (), greedy(9))]
    if sampled:
        three = prompt([start, pad, end, *range(90, 97)], [_image(28, 28, 3)])
        requests.append(("sampled", *three, SamplingParams(temperature=0.8, seed=1, max_tokens=5, ignore_eos=True)))
    return requests


def _run(engine: LLMEngine, sampled: bool = False) -> tuple[dict, list]:
    """The workload to its end, then the first prompt again (a cache hit); (outputs, the drafts at each step)."""
    drafts, outputs = [], {}
    if engine.drafter is not None:
        propose = engine.drafter.propose

        def recorded(chunks, drafting, *args):
            propose(chunks, drafting, *args)
            drafts.append({seq.request_id: list(seq.drafts) for seq in drafting})

        engine.drafter.propose = recorded
    requests = _workload(engine, sampled)
    for round_requests in (requests, [("again", *requests[0][1:])]):
        for request_id, ids, spans, params in round_requests:
            engine.add_request(request_id, ids, params, mm_inputs=spans)
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
            engine.check_integrity()
    return outputs, drafts


class RotaryCheck:
    """Checks every row the MTP head runs (a pre-hook on its layers) against the target's M-RoPE positions: each
    row's position recovered from its KV row and its sequence's block table (the drafting graphs' static buffers
    hold rotary positions in `positions`), its sequence's spans from its state slot (recorded when the drafter
    plans the step or checks it for drafting before the verdicts); rows of other slots (a graph's padding)
    are skipped. `counts`: rows checked (image / text sequences) and rows the images shift."""

    def __init__(self, engine: LLMEngine) -> None:
        self.attention = engine.runner.model.config.attention
        self.kernel_block_size = engine.runner.kernel_block_size
        self.spans_of: dict[int, tuple] = {}
        self.counts = Counter()
        drafter = engine.drafter
        plan, greedy_verify = drafter.plan, drafter.greedy_verify

        def record(chunks):
            self.spans_of.clear()
            self.spans_of.update((c.slot, tuple(c.seq.mm_inputs)) for c in chunks)

        drafter.plan = lambda chunks, wanted: record(chunks) or plan(chunks, wanted)
        drafter.greedy_verify = lambda chunks: record(chunks) or greedy_verify(chunks)
        self.handles = [layer.register_forward_pre_hook(self.check) for layer in engine.runner.mtp_head.layers]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def check(self, layer, args) -> None:
        step = args[1]
        batch, (cos, sin) = step.batch, step.rope
        kbs, tables = self.kernel_block_size, batch.block_tables.tolist()
        kv_rows, cu_seqlens = batch.kv_rows.tolist(), batch.cu_seqlens.tolist()
        rows, want = [], []
        for i, slot in enumerate(batch.state_slots.tolist()):
            if slot not in self.spans_of:
                continue
            spans = self.spans_of[slot]
            positions = [tables[i].index(kv // kbs) * kbs + kv % kbs
                         for kv in kv_rows[cu_seqlens[i]: cu_seqlens[i + 1]]]
            # the target's positions (the scheduler's chunks: `ScheduledChunk.rope_positions` / `rope_shift`)
            target = rope_positions(spans, 0, max(positions) + 1) if spans else None
            want.append(target[:, positions] if target is not None else torch.tensor(positions).repeat(3, 1))
            rows += range(cu_seqlens[i], cu_seqlens[i + 1])
            self.counts["image rows" if spans else "text rows"] += len(positions)
            self.counts["shifted rows"] += 0 if target is None else int((want[-1][0] != torch.tensor(positions)).sum())
        if not rows:
            return
        attention = self.attention
        want_cos, want_sin = mrope_cos_sin(torch.cat(want, dim=1), attention.rotary_dim, attention.rope_theta,
                                           attention.mrope_section, cos.dtype, attention.rope_scaling,
                                           attention.max_position_embeddings)
        torch.testing.assert_close(cos[rows], want_cos, msg=lambda m: f"rows of slots {list(self.spans_of)}: {m}")
        torch.testing.assert_close(sin[rows], want_sin)


def test_the_mtp_head_rotates_image_prompts_as_the_target(folder):
    engine = _engine(folder, K)
    check = RotaryCheck(engine)
    try:
        outputs, drafts = _run(engine)
    finally:
        check.remove()
    print(f"head rows checked: {dict(check.counts)}")
    assert check.counts["shifted rows"] > 0 and check.counts["text rows"] > 0
    assert any(drafts)
    reference, _ = _run(_engine(folder, None))
    assert outputs == reference


def test_drafting_graphs_rotate_image_prompts_as_the_target(folder):
    """Uniform plans (`DraftGraphs.run`) and greedy verify steps (`run_after_verify`) of sequences after images put
    their rows' M-RoPE positions (the index moved by the images) in the static buffers: the head's rows rotate as
    the target's, and the drafts at every step equal the eager runner's."""
    reference = _run(_engine(folder, K), sampled=True)
    engine = _engine(folder, K)
    cpu_drafting_graphs(engine)
    graphs, calls = engine.runner._draft_graphs, Counter()

    def counting(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name in ("run", "run_after_verify"):
        setattr(graphs, name, counting(name, getattr(graphs, name)))
    check = RotaryCheck(engine)
    try:
        got = _run(engine, sampled=True)
    finally:
        check.remove()
    print(f"drafting graph calls: {dict(calls)}; head rows checked: {dict(check.counts)}")
    assert calls["run"] and calls["run_after_verify"] and check.counts["shifted rows"] > 0
    assert got == reference
