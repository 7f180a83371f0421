"""Images through the engine: vision-tower time per image, TTFT of an image chat cold and as a second turn, and
the throughput of concurrent image chats.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/vision_bench.py [--shape 9b|tiny] [--model-dir DIR]
        [--device cuda] [--dtype bfloat16] [--sizes 448,1344] [--concurrent 64] [--max-tokens 64] [--out DIR]
        [--tower-only]

Model (`--shape`): `9b`, a random Qwen3.5-9B-shaped image-text folder (transformers' default `Qwen3_5Config`:
text hidden 4,096, 32 layers 3:1; vision tower of 27 blocks, width 1,152, patch 16, merge 2, projecting to 4,096;
Qwen3.5's preprocessor: 65,536 to 16,777,216 pixels per image): config, tokenizer and preprocessor only, written
in `--model-dir` when that holds no config.json yet, and served with `load_format="dummy"` (random weights drawn
on the device, tower included: nothing of 9B parameters is written or read); `tiny`, the tests' folder (a CPU
smoke test of this script, weights read from it). Image tokens: a 448 x 448 image is 28 x 28 patches, 196
tokens; 1,344 x 1,344 is 84 x 84, 1,764.

Measured (each printed and written to DIR/vision_bench.json after each phase; DIR: $OUT, else .), after the
engine's start-up (its time, memory plan and the vision encoder's reserve are recorded first):
1. `vit[size]`: the engine's tower alone on one processed image of size x size random pixels, and on 16 images of
   the first size in one call (median of 5 after a warm-up; CUDA synchronised), with the token count; last of all
   (`vit_reference`), the same with the "reference" encoder attention, when the engine's is another.
2. `ttft_cold_ms` / `ttft_second_turn_ms`: one image chat (448 x 448) with `max_tokens=1`, then its second turn
   (the first prompt, the reply, a new question, the same image); the second turn's `cached_tokens` and how many
   images the tower encoded for it (0: the encoder cache served it).
3. `concurrent`: `--concurrent` image chats at once (each its own 448 x 448 image), `--max-tokens` each (ignore
   EOS): wall time, output tokens per second, images encoded.

`--tower-only` (no language model, no folder: a random tower of the `--shape` drawn on the device; written to
DIR/vision_tower.json): for each encoder attention backend the device runs ("reference": SDPA per frame;
"flash_varlen": one varlen FlashAttention call per block), the tower's time per image at each size alone and for
16 images of the first size in one call; the largest error of each backend's output against the fp32 reference tower;
and the activation peak of one call (CUDA: bytes above what was allocated before) at each size and at the largest
image Qwen3.5's processor allows (16,777,216 pixels: 256 x 256 patches).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hybridcache.llm import LLM
from hybridcache.models.vl_folders import PREPROCESSOR, byte_token_ids, write_tiny_vl_model, write_vl_files
from hybridcache.sampling import SamplingParams

QWEN35_PREPROCESSOR = {**PREPROCESSOR, "patch_size": 16, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}


def build_9b(path: Path) -> Path:
    """The 9B-shaped folder without weights (served with load_format="dummy")."""
    import transformers

    from hybridcache.models.builtin import build_byte_tokenizer
    from hybridcache.models.vl_folders import VL_SPECIAL_TOKENS

    eos = build_byte_tokenizer(VL_SPECIAL_TOKENS).token_to_id("<|im_end|>")
    text = transformers.Qwen3_5TextConfig(eos_token_id=eos).to_dict()
    config = transformers.Qwen3_5Config(text_config=text, vision_config={"out_hidden_size": text["hidden_size"]},
                                        **byte_token_ids())
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return write_vl_files(path, config, QWEN35_PREPROCESSOR)


def model_folder(shape: str, model_dir: str | None) -> Path:
    if model_dir is not None and (Path(model_dir) / "config.json").is_file():
        return Path(model_dir)
    path = Path(model_dir) if model_dir is not None else Path(tempfile.mkdtemp())
    return build_9b(path) if shape == "9b" else write_tiny_vl_model(path)


def picture(size: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vit_times(llm: LLM, sizes: list[int]) -> dict:
    """The engine's tower (its own attention backend) on one processed image of each size, and on 16 images of the
    first size in one call (as `encode` groups concurrent requests): median ms of 5 after a warm-up, per call and
    per image. Pixels start on the host, as the processor's do."""
    engine = llm.engine
    tower = engine.vision.tower
    out = {"attention": tower.attention_name}
    cases = {str(size): [picture(size, seed=size)] for size in sizes}
    cases[f"16x{sizes[0]}"] = [picture(sizes[0], seed=1000 + i) for i in range(16)]
    for name, pictures in cases.items():
        images = engine.image_processor.process(pictures)
        pixels, grids = torch.cat([i.pixel_values for i in images]), [i.grid for i in images]
        seconds = timed(engine.device, lambda p=pixels, g=grids: tower(p, g), repeats=5)
        tokens = engine.image_processor.num_tokens(images[0].grid)
        out[name] = {"ms_per_call": 1000 * seconds, "ms_per_image": 1000 * seconds / len(images), "tokens": tokens,
                     "grid": list(images[0].grid)}
        print(f"vit ({tower.attention_name}) {name}: {1000 * seconds / len(images):.2f} ms per image, {tokens} tokens "
              f"per image", flush=True)
    return out


def chat(image, question: str, history: list[dict] | None = None) -> list[dict]:
    first = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}
    return [first, *(history or [])]


def ttft(llm: LLM) -> dict:
    engine = llm.engine
    image = picture(448, seed=1)
    one = SamplingParams(temperature=0, max_tokens=1)
    start = time.perf_counter()
    first = llm.chat(chat(image, "What is in this picture?"), one, use_tqdm=False)[0]
    cold = time.perf_counter() - start
    encoded = engine.vision.num_encoded_images
    follow = chat(image, "What is in this picture?", [{"role": "assistant", "content": first.outputs[0].text},
                                                     {"role": "user", "content": "And what colour is it?"}])
    start = time.perf_counter()
    second = llm.chat(follow, one, use_tqdm=False)[0]
    warm = time.perf_counter() - start
    out = {"ttft_cold_ms": 1000 * cold, "ttft_second_turn_ms": 1000 * warm,
           "prompt_tokens_second_turn": len(second.prompt_token_ids),
           "cached_tokens_second_turn": second.num_cached_tokens,
           "images_encoded_second_turn": engine.vision.num_encoded_images - encoded}
    print(f"ttft cold {out['ttft_cold_ms']:.1f} ms, second turn {out['ttft_second_turn_ms']:.1f} ms "
          f"(cached {second.num_cached_tokens} of {len(second.prompt_token_ids)}, "
          f"{out['images_encoded_second_turn']} images encoded)", flush=True)
    return out


def concurrent(llm: LLM, num: int, max_tokens: int) -> dict:
    engine = llm.engine
    encoded = engine.vision.num_encoded_images
    conversations = [chat(picture(448, seed=100 + i), f"Describe picture {i}.") for i in range(num)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    out = {"requests": num, "wall_s": wall, "output_tokens": tokens, "out_tok_per_s": tokens / wall,
           "images_encoded": engine.vision.num_encoded_images - encoded}
    print(f"{num} concurrent image chats: {wall:.2f} s, {out['out_tok_per_s']:.1f} out tok/s", flush=True)
    return out


def tower_config(shape: str):
    from hybridcache.models.vision_config import VisionConfig
    from hybridcache.models.vl_folders import TINY_VISION

    vision = {"out_hidden_size": 4096} if shape == "9b" else {**TINY_VISION, "out_hidden_size": 32}
    return VisionConfig.from_dict({"vision_config": vision})


def timed(device: torch.device, fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up (synchronised)."""
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def peak_bytes(device: torch.device, fn) -> int | None:
    """Bytes allocated at fn()'s peak above what was allocated before (CUDA; None elsewhere)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def tower_only(args: argparse.Namespace, save) -> dict:
    """The `--tower-only` measurements (module docstring); `save(result)` after each row (a kill keeps them)."""
    from hybridcache.kernels.encoder_attention import default_encoder_attention
    from hybridcache.models.random_weights import randomize_
    from hybridcache.models.vision import VisionTower

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    config = tower_config(args.shape)
    with torch.device(device):
        reference_fp32 = VisionTower(config)
    randomize_(reference_fp32, seed=0, draw_device=device)
    tower = copy.deepcopy(reference_fp32).to(dtype)
    backends = ["reference"]
    if default_encoder_attention(device.type, dtype, config.head_dim) != "reference":
        backends.append(default_encoder_attention(device.type, dtype, config.head_dim))
    patch, merge = config.patch_size, config.spatial_merge_size
    generator = torch.Generator(device).manual_seed(0)

    def pixels(grids):
        return torch.randn(sum(t * h * w for t, h, w in grids), config.patch_dim, device=device, generator=generator)

    sizes = [int(s) for s in args.sizes.split(",")]
    cases = {f"{size}": [(1, size // patch, size // patch)] for size in sizes}
    batched = f"16x{sizes[0]}"
    cases[batched] = [(1, sizes[0] // patch, sizes[0] // patch)] * 16
    out: dict = {"shape": args.shape, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                 "backends": backends, "cases": {}}
    inputs = {name: pixels(grids) for name, grids in cases.items()}
    want = {name: torch.cat(reference_fp32(inputs[name], grids)) for name, grids in cases.items() if name != batched}
    del reference_fp32
    print(f"{'case':>8} {'backend':>13} {'ms/call':>9} {'ms/image':>9} {'tokens/img':>10} {'max_rel':>8} "
          f"{'peak MiB':>9}")
    for name, grids in cases.items():
        row = out["cases"][name] = {"grids": [list(g) for g in grids]}
        for backend in backends:
            tower.use_attention(backend)
            seconds = timed(device, lambda g=grids, n=name: tower(inputs[n], g), repeats=5)
            peak = peak_bytes(device, lambda g=grids, n=name: tower(inputs[n], g))
            err = None
            if name in want:
                got = torch.cat(tower(inputs[name], grids)).float()
                err = ((got - want[name]).abs().max() / want[name].abs().max()).item()
            tokens = sum(t * h * w for t, h, w in grids) // config.merge_unit // len(grids)
            row[backend] = {"ms_per_call": 1000 * seconds, "ms_per_image": 1000 * seconds / len(grids),
                            "tokens_per_image": tokens, "max_rel_vs_fp32": err, "peak_bytes": peak}
            err_text = "-" if err is None else f"{err:.1e}"
            peak_text = "-" if peak is None else f"{peak / 2**20:.0f}"
            print(f"{name:>8} {backend:>13} {1000 * seconds:9.2f} {1000 * seconds / len(grids):9.2f} {tokens:10d} "
                  f"{err_text:>8} {peak_text:>9}", flush=True)
            save(out)
    if device.type == "cuda" and args.shape == "9b":
        side = 4096 // patch // merge * merge  # Qwen3.5's longest_edge: 16,777,216 pixels = 4,096 x 4,096
        grid = [(1, side, side)]
        big = pixels(grid)
        tower.use_attention(backends[-1])
        start = time.perf_counter()
        peak = peak_bytes(device, lambda: tower(big, grid))
        seconds = time.perf_counter() - start
        out["largest_image"] = {"grid": list(grid[0]), "backend": backends[-1], "peak_bytes": peak, "s": seconds}
        save(out)
        print(f"largest image {side} x {side} patches ({backends[-1]}): peak {peak / 2**30:.2f} GiB above the "
              f"weights, {seconds:.2f} s (first call)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["9b", "tiny"], default="9b")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--sizes", default="448,1344")
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tower-only", action="store_true", help="the vision tower alone (see the docstring)")
    args = parser.parse_args()
    if args.tower_only:
        out = Path(args.out) / "vision_tower.json"
        tower_only(args, lambda result: out.write_text(json.dumps(result, indent=2)))
        print(f"wrote {out}")
        return
    folder = model_folder(args.shape, args.model_dir)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    out = Path(args.out) / "vision_bench.json"
    result: dict = {"shape": args.shape, "device": args.device, "dtype": dtype}

    def save() -> None:
        out.write_text(json.dumps(result, indent=2))

    start = time.perf_counter()
    llm = LLM(folder, device=args.device, dtype=dtype, max_num_seqs=max(16, args.concurrent),
              max_num_batched_tokens=8192 if args.device.startswith("cuda") else 512,
              max_model_len=16384 if args.shape == "9b" else None,
              load_format="dummy" if args.shape == "9b" else "auto")
    plan = llm.engine.memory_plan
    result["start_up_s"] = time.perf_counter() - start
    result["memory_plan"] = plan.describe()
    result["encoder_reserve_bytes"] = plan.encoder_bytes
    print(f"start-up {result['start_up_s']:.1f} s; {plan.describe()}", flush=True)
    save()
    result["vit"] = vit_times(llm, [int(s) for s in args.sizes.split(",")])
    save()
    result.update(ttft(llm))
    save()
    result["concurrent"] = concurrent(llm, args.concurrent, args.max_tokens)
    save()
    if llm.engine.vision.tower.attention_name != "reference":  # last: the old attention, for comparison
        llm.engine.vision.tower.use_attention("reference")
        result["vit_reference"] = vit_times(llm, [int(s) for s in args.sizes.split(",")])
        save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
