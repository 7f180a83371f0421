"""FP8 quality on the trained byte LM (issue 29): FP8 weights (block-wise and per-channel) and FP8 KV against the
model's bf16 self, teacher-forced on held-out text.

    PYTHONPATH=. python benchmarks/fp8_quality.py --model-dir DIR [--device cuda] [--windows 32] [--window-len 512]
        [--out DIR]

DIR is a folder `benchmarks/train_byte_lm.py --out DIR` wrote (a trained model: its logits are peaked, unlike a
random model's, so agreement measures the format, not ties; train it on the GPU, the CPU's 300 steps give a
weaker model). The windows are consecutive `--window-len`-byte pieces of the held-out tenth of its
`training_corpus.txt` (every 10th 4,096-byte piece, train_byte_lm's split). Variants, each loaded by
`load_model` in `--dtype` (bf16 on CUDA):

| variant | weights | KV |
| --- | --- | --- |
| `bf16` (the baseline) | the folder's, in bf16 | bf16 |
| `fp8-block` | `quantization="fp8"` (128 x 128) | bf16 |
| `fp8-channel` | the folder written per-channel by `write_fp8_folder` | bf16 |
| `fp8-block-rowexp` | 128 x 128, routed (and shared) experts re-quantised per channel (CUDA prefill: row-wise) | bf16 |
| `fp8-block-rowexp-fast` | the same, the row-wise GEMMs with fast accumulation (then at every prefill size) | bf16 |
| `kv-fp8` | bf16 | float8_e4m3fn, scales 1.0 |
| `fp8-block+kv-fp8` | 128 x 128 | float8_e4m3fn |

Each window is one prefill with logits at every position (its KV written to the pool and read back, so FP8 KV is
exercised), on the device's kernel backend. Per variant: greedy agreement = the fraction of positions where its
argmax equals the baseline's (target >= 99%), and the mean KL(baseline || variant) of the next-byte distributions
(nats), plus the held-out loss of each; variants other than `fp8-block` the same against `fp8-block` too (what a
change of format costs beside the block format's own error). `fp8-block-rowexp` is
`models.quant.requantize_experts_per_channel_` after loading (the shared expert's too with
`fp8_tiles.SHARED_AS_EXPERT`, which stacks it with them): what `fp8_tiles.EXPERTS_PER_CHANNEL` does on CUDA
(which this script turns off, so that `fp8-block` is the checkpoint format's arithmetic).
Prints a table and writes DIR/fp8_quality.json (after each variant).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.engine.rank_runner import DTYPES
from hybridcache.kernels.backend import get_backend
from hybridcache.kernels.gemm import fp8_tiles
from hybridcache.models import load_model
from hybridcache.models.fp8_folders import write_fp8_folder
from hybridcache.models.quant import requantize_experts_per_channel_
from hybridcache.state_spec import DevicePools

VARIANTS = {  # name: (weights, kv_fp8)
    "bf16": ("dense", False),
    "fp8-block": ("block", False),
    "fp8-channel": ("channel", False),
    "fp8-block-rowexp": ("block-rowexp", False),
    "fp8-block-rowexp-fast": ("block-rowexp", False),
    "kv-fp8": ("dense", True),
    "fp8-block+kv-fp8": ("block", True),
}
FAST_ACCUM = ("fp8-block-rowexp-fast",)  # variants run with `fp8_tiles.ROWWISE_FAST_ACCUM` (on CUDA)
PIECE = 4096  # train_byte_lm's piece size; every 10th piece is held out


def held_out_windows(model_dir: Path, window_len: int, count: int) -> list[list[int]]:
    corpus = (model_dir / "training_corpus.txt").read_bytes()
    pieces = [corpus[i : i + PIECE] for i in range(0, len(corpus), PIECE)]
    held = b"".join(p for i, p in enumerate(pieces) if i % 10 == 9)
    windows = [list(held[i : i + window_len + 1]) for i in range(0, len(held) - window_len - 1, window_len)]
    return windows[:count]


@torch.no_grad()
def window_logits(model, backend, tokens: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """fp32 logits [len(tokens), vocab] of one prefill over `tokens` (pages 1.., slot 1)."""
    page = 16
    pages = -(-len(tokens) // page)
    pools = DevicePools.allocate(model.state_specs(dtype, torch.float32), num_pages=pages + 1, kernel_block_size=page,
                                 num_slots=2, device=device)  # no last_hidden slot: logits at every row
    batch = build_forward_batch([SeqChunk(tokens, 0, list(range(1, pages + 1)), 1)], block_size=page,
                                kernel_block_size=page, device=device)
    batch = backend.prepare(dataclasses.replace(batch, logits_indices=torch.arange(len(tokens), device=device)))
    return model(batch, pools, backend).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = Path(args.model_dir)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    windows = held_out_windows(model_dir, args.window_len, args.windows)
    # the block variants measure the checkpoint format's own arithmetic: no re-quantisation when the CUDA backend
    # stacks the experts (fp8-block-rowexp re-quantises them itself, on any device)
    fp8_tiles.EXPERTS_PER_CHANNEL = False
    library_fast_accum = fp8_tiles.ROWWISE_FAST_ACCUM
    channel_dir = Path(tempfile.mkdtemp()) / "fp8-channel"
    backend = get_backend(device)
    logits: dict[str, list[torch.Tensor]] = {}
    result: dict = {"model_dir": str(model_dir), "device": str(device), "dtype": str(dtype), "windows": len(windows),
                    "window_len": args.window_len, "date": time.strftime("%Y-%m-%d"), "variants": {}}
    out = Path(args.out or os.environ.get("OUT") or ".") / "fp8_quality.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.variants.split(","):
        weights, kv_fp8 = VARIANTS[name]
        folder = model_dir
        if weights == "channel":
            folder = channel_dir if (channel_dir / "config.json").is_file() else write_fp8_folder(
                model_dir, channel_dir, "channel")
        model = load_model(folder, dtype=dtype, device=device,
                           quantization="fp8" if weights.startswith("block") else None, kv_fp8=kv_fp8)
        requantized = requantize_experts_per_channel_(model, shared=fp8_tiles.SHARED_AS_EXPERT) if (
            weights == "block-rowexp") else 0
        fp8_tiles.ROWWISE_FAST_ACCUM = name in FAST_ACCUM or library_fast_accum
        logits[name] = [window_logits(model, backend, w[:-1], dtype, device).cpu() for w in windows]
        fp8_tiles.ROWWISE_FAST_ACCUM = library_fast_accum
        del model
        targets = torch.cat([torch.tensor(w[1:]) for w in windows])
        loss = F.cross_entropy(torch.cat(logits[name]), targets).item()
        row = {"held_out_loss": loss} | ({"experts_requantized": requantized} if requantized else {})
        mine = torch.cat(logits[name])
        if name != "bf16" and "bf16" in logits:
            base = torch.cat(logits["bf16"])
            row["greedy_agreement"] = (base.argmax(-1) == mine.argmax(-1)).float().mean().item()
            row["mean_kl"] = F.kl_div(mine.log_softmax(-1), base.log_softmax(-1), log_target=True,
                                      reduction="batchmean").item()
        if name not in ("bf16", "fp8-block") and "fp8-block" in logits:  # the change against the block format
            block = torch.cat(logits["fp8-block"])
            row["greedy_agreement_vs_fp8_block"] = (block.argmax(-1) == mine.argmax(-1)).float().mean().item()
            row["mean_kl_vs_fp8_block"] = F.kl_div(mine.log_softmax(-1), block.log_softmax(-1), log_target=True,
                                                   reduction="batchmean").item()
        result["variants"][name] = row
        print(name, row, flush=True)
        out.write_text(json.dumps(result, indent=1))  # after each variant: a run cut short keeps the ones done
    print("| variant | held-out loss | greedy agreement | mean KL (nats) |")
    print("| --- | --- | --- | --- |")
    for name, row in result["variants"].items():
        agree = f"{100 * row['greedy_agreement']:.2f}%" if "greedy_agreement" in row else "-"
        kl = f"{row['mean_kl']:.2e}" if "mean_kl" in row else "-"
        print(f"| {name} | {row['held_out_loss']:.4f} | {agree} | {kl} |")


if __name__ == "__main__":
    main()
