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
            seq.drafts = [want[done + j] if done + j < len(want) and rng.random() < right else (want[0] + 1) % 256
                          for j in range(len(seq.drafts))]

    drafter.propose = propose_from_reference
