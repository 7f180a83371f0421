"""The sparse MoE block with its shared expert on the side CUDA stream or not (`layers/mlp.py`, `kernels/streams.py`),
per layer, by tokens per step.

    PYTHONPATH=. python benchmarks/moe_side_stream.py [--models next-16b,next-1b] [--tokens 1,16,64] [--out DIR]

For each benchmark model's MoE shapes (`gpu_bench.MODELS`: next-16b hidden 4,096, 32 experts of 1,024, top-8, a
shared expert of 1,024; next-1b hidden 2,048, 16 experts of 512, top-4, shared 512) builds `--layers` distinct
bf16 blocks with random weights (distinct so that no layer's shared expert stays in L2 for the next one: 25 MB of
weights each on next-16b) chained as x = x + block(x), and for each variant ("one": the CUDA backend with no side
stream, every fork inline; "side": the shared expert's SwiGLU + down on the side stream) and T tokens times:
- `graph`: the chain captured in one CUDA graph (as a decode graph holds it), the median of `--reps` replays timed
  by CUDA events, per layer (us): what the decode step pays;
- `eager`: the chain run eagerly, the same way, per layer (us; host launch costs included).
Each variant is warmed up eagerly before its capture. The side stream's graph output is checked against the one
stream's: the same kernels, so equal bits. Prints one table; writes DIR/moe_side_stream.json (DIR: --out, else
$OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import MODELS, QWEN_MODELS  # noqa: E402

import hybridcache.kernels.backend as kernel_backend  # noqa: E402
from hybridcache.layers.mlp import SparseMoeBlock  # noqa: E402

VARIANTS = ("one", "side")


class _Step:
    def __init__(self, backend: object) -> None:
        self.backend = backend


class _OneStream:
    """A backend as given, without a side stream: every fork runs inline, on the current stream."""

    def __init__(self, backend: object) -> None:
        self._backend = backend

    def side_stream(self, device: torch.device) -> None:
        return None

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)


def shapes(model: str) -> dict[str, int]:
    """The MoE block's sizes of a gpu_bench model (Qwen3NextConfig's defaults where the model leaves them)."""
    config = dict(moe_intermediate_size=512, shared_expert_intermediate_size=512) | MODELS[model][2]
    return dict(hidden=config["hidden_size"], experts=config["num_experts"], top_k=config["num_experts_per_tok"],
                width=config["moe_intermediate_size"], shared=config["shared_expert_intermediate_size"])


@torch.no_grad()
def make_blocks(size: dict[str, int], layers: int) -> list[SparseMoeBlock]:
    blocks = []
    for _ in range(layers):
        with torch.device("cuda"):
            block = SparseMoeBlock(size["hidden"], num_experts=size["experts"], top_k=size["top_k"],
                                   moe_intermediate_size=size["width"],
                                   shared_expert_intermediate_size=size["shared"], norm_topk_prob=True)
        for param in block.parameters():
            param.normal_(0, param.shape[-1] ** -0.5)
        blocks.append(block.to(torch.bfloat16))
    return blocks


def chain(blocks: list[SparseMoeBlock], x: torch.Tensor, step: _Step) -> torch.Tensor:
    for block in blocks:
        x = x + block(x, step)
    return x


def median_ms(run, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


@torch.inference_mode()
def measure(blocks: list[SparseMoeBlock], step: _Step, tokens: int, variant: str, reps: int
            ) -> tuple[float, float, torch.Tensor]:
    """(graph us per layer, eager us per layer, the graph's output) of `variant` at `tokens` rows."""
    step = _Step(_OneStream(step.backend)) if variant == "one" else step
    hidden = blocks[0].gate.in_features
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    static = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(2):
            chain(blocks, static, step)
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(blocks, static, step)
    graph.replay()
    torch.cuda.synchronize()
    result = out.clone()
    graph_ms = median_ms(graph.replay, reps)
    eager_ms = median_ms(lambda: chain(blocks, static, step), reps)
    del graph
    return 1000 * graph_ms / len(blocks), 1000 * eager_ms / len(blocks), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="next-16b,next-1b")
    parser.add_argument("--tokens", default="1,16,64")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    moe_models = [m for m in QWEN_MODELS if "num_experts" in MODELS[m][2]]
    if unknown := [m for m in args.models.split(",") if m not in moe_models]:
        parser.error(f"--models takes the Qwen MoE presets {moe_models}, not {unknown}")
    step = _Step(kernel_backend.get_backend("cuda"))
    rows = []
    print(f"{'model':9} {'T':>3} {'variant':7} {'graph us/layer':>15} {'eager us/layer':>15}  vs one stream")
    for model in args.models.split(","):
        size = shapes(model)
        blocks = make_blocks(size, args.layers)
        for tokens in (int(t) for t in args.tokens.split(",")):
            base = None
            for variant in VARIANTS:
                graph_us, eager_us, out = measure(blocks, step, tokens, variant, args.reps)
                if base is None:
                    base, check = out, "-"
                else:
                    check = "equal" if torch.equal(out, base) else "DIFFERENT BITS"
                print(f"{model:9} {tokens:>3} {variant:7} {graph_us:15.2f} {eager_us:15.2f}  {check}")
                rows.append(dict(model=model, tokens=tokens, variant=variant, graph_us_per_layer=graph_us,
                                 eager_us_per_layer=eager_us, check=check, **size))
        del blocks
        torch.cuda.empty_cache()
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "moe_side_stream.json").write_text(json.dumps(dict(layers=args.layers, rows=rows), indent=1))


if __name__ == "__main__":
    main()
