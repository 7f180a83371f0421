"""Helpers of the speculative-decoding engine tests (test_speculative.py on the CPU, test_speculative_cuda.py): an
engine with or without MTP, the token ids of a workload's outputs, and an oracle drafter."""

from __future__ import annotations

import random

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine


def spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def make_engine(model_dir, k: int | None, **options) -> LLMEngine:
    config = {"block_size": 16, "kernel_block_size": 8, "max_num_batched_tokens": 96, "max_num_seqs": 6, **options}
    return LLMEngine(model_dir, EngineConfig(**config, speculative_config=spec(k) if k else None))


def send_twice(engine: LLMEngine, prompt: list[int], params) -> list:
    """The finished outputs of `prompt` sent as request "first", run to the end, then again as "again" (a resend
    that hits the first's cache)."""
    finished = []
    for request_id in ("first", "again"):
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
    return finished


def tokens_of(outputs: dict) -> dict:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in outputs.items()}


def oracle(engine: LLMEngine, reference: dict, seed: int, right: float = 0.7) -> None:
    """Replace the engine's drafts by the reference run's next tokens, each kept with probability `right` (else
    a wrong token), so that verify rows accept every number of drafts from 0 to k."""
    rng = random.Random(seed)
    drafter = engine.drafter
    propose = drafter.propose

    def propose_from_reference(chunks, drafting, *args):
        propose(chunks, drafting, *args)  # the real head still runs (its KV, its drafts' count)
        for seq in drafting:
            want = reference.get(seq.request_id, [[]] * (seq.index + 1))[seq.index]
            done = seq.num_tokens - seq.prompt_len
            wrong = ((want[0] if want else 0) + 1) % 256  # (a reference cut by a stop string may be empty)
            seq.drafts = [want[done + j] if done + j < len(want) and rng.random() < right else wrong
                          for j in range(len(seq.drafts))]

    drafter.propose = propose_from_reference


def cpu_drafting_graphs(engine: LLMEngine) -> None:
    """Give the engine's CPU runner drafting graphs (nothing captured: their work runs on the static buffers, as
    `test_draft_graphs` does), padded on the runner's scratch slot and page: uniform greedy verify steps then
    draft before their verdicts (`draft_after_verify`), and with async scheduling they chain
    (`engine/spec_chain.py`)."""
    import torch

    from hybridcache.engine.draft_graphs import DraftGraphs

    runner = engine.runner
    runner._draft_graphs = DraftGraphs(
        head=runner.mtp_head, model=runner.model, pools=runner.pools, backend=runner.backend,
        num_drafts=engine.drafter.k, sizes=(1, 2, 4, 8), max_model_len=engine.max_model_len,
        scratch_slot=runner.scratch_slot, scratch_page=runner.scratch_page,
        kernel_block_size=runner.kernel_block_size, hidden_size=runner.model.config.hidden_size,
        dtype=torch.float32, device=runner.device)


def device_oracle(engine: LLMEngine, reference: dict, seed: int, right: float = 0.7) -> None:
    """`oracle` for drafts queued on the device (`draft_after_verify`, CPU): each row's drafts become the
    reference's next tokens after the row's last accepted one (read from the device values: free on the CPU),
    each kept with probability `right` (else a wrong token). `reference`: request id -> its token ids, or its
    completions' token ids (a list of lists, by completion index)."""
    rng = random.Random(seed)
    runner = engine.runner
    queue = runner.draft_after_verify

    def oracle_after_verify(batch, logits, near_pages):
        values = queue(batch, logits, near_pages)
        if values is None:
            return values
        k, n = engine.drafter.k, batch.num_seqs
        by_slot = {engine.scheduler.cache.slot(s.seq_id): s for s in engine.scheduler.running}
        accepted = values[:n].tolist()
        firsts = batch.positions.view(n, 1 + k)[:, 0].tolist()
        values = values.clone()  # (an inference tensor: not written in place outside inference mode)
        for i, slot in enumerate(batch.state_slots.tolist()):
            seq = by_slot.get(slot)
            if seq is None:
                continue  # a padding row: a sequence that ended in the step before
            want = reference.get(seq.request_id, [])
            if want and isinstance(want[0], (list, tuple)):
                want = want[seq.index] if seq.index < len(want) else []
            done = firsts[i] + accepted[i] + 1 - seq.prompt_len  # the output index of the row's final token
            for j in range(k):
                at = done + 1 + j
                token = want[at] if at < len(want) and rng.random() < right else (want[0] + 1) % 256 if want else 0
                values[n + j * n + i] = token
        return values

    runner.draft_after_verify = oracle_after_verify


def random_requests(rng: random.Random, count: int, *, stop_p: float, stop_token_p: float,
                    max_tokens: int) -> list:
    """`count` random greedy requests as (rid, prompt, params, arrival step, abort) tuples: most share a system
    prompt, some are identical resends, some have a stop string (probability stop_p) or a stop token
    (stop_token_p), some n = 2; up to max_tokens - 1 tokens each."""
    from hybridcache.sampling import SamplingParams

    system = [rng.randrange(256) for _ in range(rng.randrange(5, 40))]
    requests = []
    for i in range(count):
        prompt = (system if rng.random() < 0.6 else []) + [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
        if requests and rng.random() < 0.2:
            prompt = list(requests[-1][1])  # an identical resend
        stop = [bytes([rng.randrange(97, 123)]).decode()] if rng.random() < stop_p else []
        stop_tokens = [rng.randrange(256)] if stop_token_p and rng.random() < stop_token_p else []
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, max_tokens), ignore_eos=True, stop=stop,
                                stop_token_ids=stop_tokens, n=2 if rng.random() < 0.25 else 1)
        requests.append((f"r{i}", prompt, params, rng.randrange(0, 6), rng.random() < 0.15))
    return requests


def alone_references(make, requests) -> dict:
    """The completions' token ids of each of `requests` ((rid, prompt, params, arrival, abort) tuples) run alone on
    an engine of its own, `make()`."""
    reference = {}
    for rid, prompt, params, _, _ in requests:
        alone = make()
        alone.add_request(rid, prompt, params)
        while alone.has_unfinished_requests():
            for out in alone.step():
                reference[rid] = [c.token_ids for c in out.outputs]
    return reference


def drive_traffic(engine: LLMEngine, requests, max_steps: int = 400) -> tuple[dict, set]:
    """Step `engine` through `requests` ((rid, prompt, params, arrival step, abort) tuples; an abort comes two steps
    after its arrival), `check_integrity` after every step; the finished requests' token ids, and the aborted
    request ids."""
    got, aborted, step = {}, set(), 0
    while step < max_steps:
        for rid, prompt, params, arrival, abort in requests:
            if arrival == step:
                engine.add_request(rid, prompt, params)
            if abort and step == arrival + 2 and engine.abort(rid) is not None:
                aborted.add(rid)
        if step > 6 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                got[out.request_id] = [c.token_ids for c in out.outputs]
        engine.check_integrity()
        step += 1
    return got, aborted
