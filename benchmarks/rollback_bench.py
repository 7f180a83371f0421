"""Speculative decoding's recurrent-state rollback on CUDA: what keeping per-position states and copying the
accepted one back cost, at Qwen3-Next-80B's gated DeltaNet shape (36 DeltaNet layers: 16 key / 32 value heads of
128, conv 8,192 channels x 3 in bf16, fp32 recurrent state: 72 MiB of ssm + 1.7 MiB of conv per slot).

    PYTHONPATH=. python benchmarks/rollback_bench.py [--k 2] [--batch 1 8 64] [--json OUT]

Per batch size b (b verify rows of 1 + k tokens), CUDA-event medians of 20 runs after warm-up:
- `verify`: the verify kernel (`gated_delta/triton_verify.py`, full mode) over all 36 layers, writing the k draft
  states of every row; `no drafts`: the same kernel with 0 drafts (the state traffic of plain recurrent steps);
  their difference is what keeping per-position states costs;
- `copy`: the rollback as the engine runs it (`runner._rollback_state`: one state slot of every state group, b rows,
  i.e. the worst case where every row rejects a draft);
- `select` (vLLM's way: the next step reads its initial state from the accepted position's row through a 2-D state
  index) moves no bytes: its cost is the copy's time saved, paid for by an indirection in every state reader (the
  conv and recurrent kernels, fla's initial-state gather, checkpoint saves).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from hybridcache.copy_kinds import CopyKind
from hybridcache.engine.runner import _rollback_state
from hybridcache.forward_batch import DeviceCopyOp
from hybridcache.kernels.gated_delta.triton_verify import gated_delta_rule_verify

LAYERS, KEY_HEADS, VALUE_HEADS, DIM, CONV_CHANNELS, CONV_WIDTH = 36, 16, 32, 128, 8192, 3


def median_ms(fn, runs: int = 20) -> float:
    """Median CUDA-event time of `fn()` in ms, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(batch: int, k: int, device: torch.device) -> dict:
    rows = batch * (1 + k)  # b runtime slots, then k draft rows per slot
    ssm = torch.zeros(LAYERS, rows, VALUE_HEADS, DIM, DIM, device=device)
    conv = torch.zeros(LAYERS, rows, CONV_CHANNELS, CONV_WIDTH, dtype=torch.bfloat16, device=device)
    tokens = batch * (1 + k)
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(tokens, KEY_HEADS, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    key = torch.randn(tokens, KEY_HEADS, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(tokens, VALUE_HEADS, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    g = -torch.rand(tokens, VALUE_HEADS, device=device, generator=gen)
    beta = torch.rand(tokens, VALUE_HEADS, device=device, generator=gen).to(torch.bfloat16)
    slots = torch.arange(batch, device=device)
    cu = torch.arange(batch + 1, device=device, dtype=torch.int32) * (1 + k)
    context = torch.full((batch,), 1000, device=device, dtype=torch.int32)
    table = (batch + torch.arange(batch * k, device=device)).view(batch, k)

    def verify(num_drafts: int):
        drafts = torch.full((batch,), num_drafts, device=device, dtype=torch.int32)

        def run() -> None:
            for layer in range(LAYERS):
                gated_delta_rule_verify(q, key, v, g, beta, ssm[layer], slots, cu, context, table, drafts,
                                        states_only=False)
        return run

    runner = SimpleNamespace(pools=SimpleNamespace(state_groups=(conv, ssm)), draft_base=batch)
    op = DeviceCopyOp(CopyKind.STATE_ROLLBACK, torch.arange(batch, device=device) * k, slots)
    result = {"batch": batch, "k": k, "verify_ms": median_ms(verify(k)), "no_drafts_ms": median_ms(verify(0)),
              "copy_ms": median_ms(lambda: _rollback_state(runner, op))}
    slot_bytes = LAYERS * (VALUE_HEADS * DIM * DIM * 4 + CONV_CHANNELS * CONV_WIDTH * 2)
    result["copy_tb_per_s"] = 2 * batch * slot_bytes / (result["copy_ms"] * 1e-3) / 1e12
    result["keep_states_ms"] = result["verify_ms"] - result["no_drafts_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = [measure(batch, args.k, device) for batch in args.batch]
    print(f"rollback at Qwen3-Next-80B's DeltaNet shape, k = {args.k} (36 layers; ms)")
    print(f"{'batch':>5} {'verify':>8} {'no drafts':>9} {'keep states':>11} {'copy (all rows)':>15} {'copy TB/s':>9}")
    for r in results:
        print(f"{r['batch']:>5} {r['verify_ms']:>8.3f} {r['no_drafts_ms']:>9.3f} {r['keep_states_ms']:>11.3f} "
              f"{r['copy_ms']:>15.3f} {r['copy_tb_per_s']:>9.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
