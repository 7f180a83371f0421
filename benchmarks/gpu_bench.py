"""The GPU benchmark of issue 11: phases A-D through `LLM` on random model folders it builds itself.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/gpu_bench.py [--model next-1b] [--phases C,D,A,B]
        [--check-graphs] [--mamba-ssm-cache-dtype auto|float32|bfloat16|float16] [--out DIR]
        [--num-blocks N] [--cache-mode hybridcache|seed|block-aligned|none]   # a fixed pool: memory pressure
        [--host-cache-gib G] [--max-model-len N]                              # a host tier behind the pool
        [--quantization fp8] [--kv-cache-dtype fp8]   # FP8 weights (quantised at load) / FP8 KV
        [--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}']  # MTP, random head: all rejected
        [--load-format dummy]   # config.json and the tokenizer only, the weights drawn at load

Models (random weights, seed 0, `hybridcache.models.random_weights.randomize_`, drawn on the GPU when there is
one; bf16; byte tokenizer):

| name       | config                                                                                          |
| ---------- | ----------------------------------------------------------------------------------------------- |
| `next-1b`  | Qwen3-Next, hidden 2048, 16 layers 3:1, 16 experts top-4, vocab 4096: 1.39B parameters             |
| `next-16b` | Qwen3-Next, hidden 4096, 32 layers 3:1, 32 experts top-8, expert width 1024, vocab 151,936: 16.6B  |
| `dense-9b` | transformers' default `Qwen3_5TextConfig` (hidden 4096, 32 layers 3:1, vocab 248,320): 9.0B        |
| `next-80b-12l` | Qwen3-Next-80B-A3B's layers (hidden 2048, 512 experts of 512, top-10), 12 of its 48: 20.4B |

One preset per other family hybridcache serves, at the shape of a released model (`PRESETS`: the model and the
parameter count, counted on the meta device; GiB: the bf16 weights). Vocabularies are the released ones: the byte
workloads sample only the first 259 ids. Only Qwen3-Next and Qwen3.5 folders get a random MTP head.

| name                     | mirrors                    | params | GiB  | shape                                       |
| ------------------------ | -------------------------- | ------ | ---- | ------------------------------------------- |
| `granite-4h-tiny`        | Granite-4.0-H-Tiny         | 6.94B  | 12.9 | hidden 1536, 40 layers: attention (NoPE) at |
|                          | (7B-A1B)                   |        |      | 5, 15, 25, 35, the rest Mamba2 48 x 64      |
|                          |                            |        |      | state 128; 64 experts of 512 top-6 + shared |
|                          |                            |        |      | 1024; vocab 100,352, tied                   |
| `nemotron-h-9b`          | NVIDIA-Nemotron-Nano-9B-v2 | 8.89B  | 16.6 | hidden 4480, 56 layers "M-M-M-MM-...": 27   |
|                          |                            |        |      | Mamba2 128 x 80 (8 groups), 4 attention 40  |
|                          |                            |        |      | / 8 heads of 128, 25 relu^2 MLPs of 15,680; |
|                          |                            |        |      | vocab 131,072                               |
| `nemotron3-nano`         | Nemotron 3 Nano 30B-A3B    | 31.58B | 58.8 | hidden 2688, 52 layers "MEMEM*E...": 23     |
|                          |                            |        |      | Mamba2 64 x 64, 6 attention 32 / 2 heads of |
|                          |                            |        |      | 128, 23 MoE of 128 relu^2 experts of 1856   |
|                          |                            |        |      | top-6 + shared 3712; vocab 131,072          |
| `bamba-9b`               | Bamba-9B (v1, v2)          | 9.78B  | 18.2 | hidden 4096, 32 layers: attention at 9, 18, |
|                          |                            |        |      | 27, Mamba2 128 x 64 state 128; MLP 14,336;  |
|                          |                            |        |      | vocab 128,256                               |
| `falcon-h1-1.5b-deep`    | Falcon-H1-1.5B-Deep        | 1.56B  | 2.9  | hidden 1280, 66 layers of attention (6 / 2  |
|                          |                            |        |      | heads of 128) beside Mamba2 (24 x 64, state |
|                          |                            |        |      | 256); MLP 3072; vocab 65,537                |
| `jamba-3b-scaled`        | Jamba's layout at ~3B      | 3.18B  | 5.9  | hidden 2560, 28 layers: attention 1 in 8    |
|                          |                            |        |      | from layer 4 (20 / 4 heads), Mamba1 expand  |
|                          |                            |        |      | 2 state 16; dense MLPs of 8192; vocab       |
|                          |                            |        |      | 65,536                                      |
| `olmo-hybrid-7b`         | Olmo-Hybrid-7B             | 7.43B  | 13.8 | hidden 3840, 32 layers 3:1: DeltaNet 30     |
|                          |                            |        |      | heads Dk 96 / Dv 192, attention 30 heads    |
|                          |                            |        |      | without RoPE; MLP 11,008; vocab 100,352     |
| `lfm2-2.6b`              | LFM2-2.6B                  | 2.57B  | 4.8  | hidden 2048, 30 layers: 22 short conv, 8    |
|                          |                            |        |      | attention 32 / 8 heads; MLP 10,752; vocab   |
|                          |                            |        |      | 65,536, tied                                |
| `lfm2-8b-a1b`            | LFM2-8B-A1B                | 8.34B  | 15.5 | hidden 2048, 24 layers: 18 short conv, 6    |
|                          |                            |        |      | attention; 2 dense MLPs of 7168, then 32    |
|                          |                            |        |      | experts of 1792 top-4; vocab 65,536, tied   |
| `kimi-linear-scaled-14b` | Kimi-Linear-48B-A3B scaled | 13.78B | 25.7 | its layout (hidden 2304, 27 layers: 20 KDA  |
|                          | down: 64 of its 256        |        |      | 32 x 128, 7 MLA, layer 0 dense) with 64     |
|                          | experts                    |        |      | experts of 1024, top-8 + 1 shared: ~3.5B    |
|                          |                            |        |      | active; vocab 163,840                       |

Shapes not in this repository's tests or transformers' defaults are as recalled from the releases (docs/bench.md).
`jamba-3b-scaled`: Jamba Reasoning 3B's config is not in this repository; Jamba-v0.1's layer layout at ~3B, dense.
`falcon-h1-1.5b-deep`: depth, width, heads and head dims as transformers' Falcon-H1 table; the MLP width and vocab as
recalled from the release (1.55B published); no Mamba2 norm and muP multipliers away from 1, as in the releases: the
0.5B's (tests/models/test_falcon_h1.py) where it states them, stand-ins for the ssm ones (their values change no
launch). `lfm2-*`: the attention layers' positions are spread evenly (the counts
are the release's; LFM2-2.6B's 2,569,272,320 parameters match exactly). `nemotron3-nano` needs most of an 80 GB H100
(58.8 GiB of weights): run it with `--gpu-memory-utilization 0.95`, or on the H200.

Workload (prompts are random lowercase letters under the byte tokenizer: one token per character; greedy,
`ignore_eos`; one engine per process, after a warm-up that is then cleared from the cache):

- A: 4 system prompts of 2,000 tokens; 16 sessions (session i uses system prompt i mod 4); 4 turns each. Turn t's
  prompt = the session history + a new user message of 200-600 tokens; after each turn a fixed reply of 100-300
  tokens joins the history. Sent turn 0 of every session, then turn 1, ..., one request at a time, 1 new token.
- B: one 6,000-token prompt sent three times (1 new token).
- C: a cold 16,000-token prompt, then it + 200 tokens (1 new token each).
- CH: phase C with an unrelated 16,000-token prompt between the two: with a pool too small for both (e.g.
  `--num-blocks 400 --max-model-len 16384`: a pool must hold one sequence of max_model_len), the prefix is
  evicted before the + 200 request, which then hits from the host tier (`--host-cache-gib`) or recomputes it
  (without one). Reports the + 200 request's latency and cached tokens.
- D: 64 distinct 1,024-token prompts, 128 new tokens each, all submitted together.
- DSYNC: phase D on the same engine with async scheduling off (each step postprocessed before the next is
  planned), to measure what async scheduling gives within one process.
- SWE: the shipped SWE-agent slice replayed call by call from an empty cache (100 model calls of up to 16,000
  tokens, each call's prompt every message before it, 1 new token each; `phase_swe`).

Every Triton kernel compiled (or loaded from the disk cache) after the engine's start-up is logged by phase,
the benchmark's own warm-up included (label `warm-up`): the engine is meant to compile everything it can launch
while it starts, so every count should be 0.

`--check-graphs` then runs a long greedy decode (32 prompts x 512 tokens) with CUDA graphs, the captured batches
eagerly and the plain eager path, and prefix hits whose prefill steps replay the piecewise prefill graphs
(`check_prefill_graphs`) in the same three modes, and reports how many completions are identical. Prints one
table and writes DIR/gpu_bench_<model>.json (DIR: --out, else $OUT, else .), or
DIR/gpu_bench_<model>_ssm-<dtype>.json with a `--mamba-ssm-cache-dtype` other than auto (the recurrent state's
dtype; auto is float32 for these models).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import random
import statistics
import string
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

from hybridcache import LLM
from hybridcache.config import DTYPES
from hybridcache.models.builtin import build_byte_tokenizer
from hybridcache.models.mtp import MTP_MODEL_TYPES, write_random_mtp
from hybridcache.models.random_weights import randomize_
from hybridcache.sampling import RequestOutputKind, SamplingParams

MODELS = {
    "next-1b": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=4096, hidden_size=2048, num_hidden_layers=16, num_experts=16, num_experts_per_tok=4)),
    "next-16b": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=151936, hidden_size=4096, num_hidden_layers=32, num_experts=32, num_experts_per_tok=8,
        moe_intermediate_size=1024, shared_expert_intermediate_size=1024)),
    "dense-9b": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "next-80b-12l": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(  # the flagship's MoE shape, on one 80 GB GPU
        vocab_size=151936, hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, intermediate_size=5120)),
    # one preset per other served family, at a released model's shape (`PRESETS` below: which, and its size)
    "granite-4h-tiny": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=100352, hidden_size=1536, num_hidden_layers=40, num_attention_heads=12, num_key_value_heads=4,
        layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
        position_embedding_type="nope", num_local_experts=64, num_experts_per_tok=6, intermediate_size=512,
        shared_intermediate_size=1024, mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
        mamba_d_conv=4, mamba_expand=2, tie_word_embeddings=True,
        residual_multiplier=0.22, embedding_multiplier=12.0)),  # (the Granite family's muP multipliers)
    "nemotron-h-9b": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=131072, hidden_size=4480, num_hidden_layers=56,
        hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, intermediate_size=15680, mamba_num_heads=128,
        mamba_head_dim=80, n_groups=8, ssm_state_size=128, conv_kernel=4, tie_word_embeddings=False)),
    "nemotron3-nano": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=131072, hidden_size=2688, num_hidden_layers=52,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64,
        n_groups=8, ssm_state_size=128, conv_kernel=4, n_routed_experts=128, num_experts_per_tok=6,
        moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False)),
    "bamba-9b": ("BambaConfig", "BambaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, num_hidden_layers=32, attn_layer_indices=[9, 18, 27],
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, mamba_n_heads=128, mamba_d_head=64,
        mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, tie_word_embeddings=False)),
    "falcon-h1-1.5b-deep": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=65537, hidden_size=1280, num_hidden_layers=66, num_attention_heads=6, num_key_value_heads=2,
        head_dim=128, intermediate_size=3072, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=256, mamba_d_conv=4, tie_word_embeddings=False, mamba_rms_norm=False,
        attention_out_multiplier=0.9375, key_multiplier=0.390625, mlp_multipliers=[0.8838834764831844, 0.5859375],
        embedding_multiplier=5.656854249492381, lm_head_multiplier=0.0390625, ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.25, ssm_multipliers=[0.35, 0.25, 0.5, 0.35, 0.175])),
    "jamba-3b-scaled": ("JambaConfig", "JambaForCausalLM", dict(
        vocab_size=65536, hidden_size=2560, num_hidden_layers=28, num_attention_heads=20, num_key_value_heads=4,
        intermediate_size=8192, num_experts=1, attn_layer_period=8, attn_layer_offset=4, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=160, tie_word_embeddings=False)),
    "olmo-hybrid-7b": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        vocab_size=100352, hidden_size=3840, num_hidden_layers=32, num_attention_heads=30, num_key_value_heads=30,
        intermediate_size=11008,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(32)],
        linear_num_key_heads=30, linear_num_value_heads=30, linear_key_head_dim=96, linear_value_head_dim=192,
        rope_parameters={"rope_theta": None}, tie_word_embeddings=False)),
    "lfm2-2.6b": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        vocab_size=65536, hidden_size=2048, num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=10752, block_auto_adjust_ff_dim=False,
        layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21, 24, 27) else "conv" for i in range(30)],
        tie_word_embeddings=True)),
    "lfm2-8b-a1b": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        vocab_size=65536, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=7168, moe_intermediate_size=1792, num_experts=32, num_experts_per_tok=4,
        num_dense_layers=2,
        layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)],
        tie_word_embeddings=True)),
    "kimi-linear-scaled-14b": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(  # 64 of the 48B's 256 experts
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32,
        layer_types=["full_attention" if i in (3, 7, 11, 15, 19, 23, 26) else "linear_attention" for i in range(27)],
        mlp_layer_types=["dense"] + ["sparse"] * 26, intermediate_size=9216, moe_intermediate_size=1024,
        num_experts=64, num_experts_per_token=8, num_shared_experts=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, linear_num_heads=32, linear_head_dim=128,
        tie_word_embeddings=False)),
    "tiny": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(  # a smoke test of this script (--device cpu)
        vocab_size=320, hidden_size=64, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16)),
}
# The Qwen presets: the GEMM and MoE sweeps read Qwen3-Next / Qwen3.5 config fields, so they offer only these
QWEN_MODELS = tuple(name for name, (config_class, _, _) in MODELS.items() if config_class.startswith("Qwen3"))
# The released model each preset mirrors and its parameter count in billions (on the meta device; the docstring's
# table and docs/bench.md quote it; tests/bench/test_gpu_bench_models.py holds each preset to it within 10%)
PRESETS: dict[str, tuple[str, float]] = {
    "next-1b": ("Qwen3-Next, shrunk", 1.39),
    "next-16b": ("Qwen3-Next, shrunk", 16.6),
    "dense-9b": ("transformers' default Qwen3.5 text config", 9.0),
    "next-80b-12l": ("Qwen3-Next-80B-A3B, 12 of its 48 layers", 20.4),
    "granite-4h-tiny": ("Granite-4.0-H-Tiny (7B-A1B)", 6.94),
    "nemotron-h-9b": ("NVIDIA-Nemotron-Nano-9B-v2", 8.89),
    "nemotron3-nano": ("NVIDIA-Nemotron-3-Nano-30B-A3B", 31.58),
    "bamba-9b": ("Bamba-9B", 9.78),
    "falcon-h1-1.5b-deep": ("Falcon-H1-1.5B-Deep", 1.56),
    "jamba-3b-scaled": ("Jamba's layout scaled to ~3B, dense", 3.18),
    "olmo-hybrid-7b": ("Olmo-Hybrid-7B", 7.43),
    "lfm2-2.6b": ("LFM2-2.6B", 2.57),
    "lfm2-8b-a1b": ("LFM2-8B-A1B", 8.34),
    "kimi-linear-scaled-14b": ("Kimi-Linear-48B-A3B with 64 of its 256 experts", 13.78),
}
PHASES = ("A", "B", "C", "CH", "D", "DSYNC", "SWE")


def model_folder(name: str, model_dir: str | None) -> Path:
    """The folder of model `name`: `model_dir` as is when it already holds a config.json (a folder an earlier
    run built, so several scripts of one device session build a multi-GB model once), else built there (or in
    a fresh temporary folder when `model_dir` is None)."""
    if model_dir is not None and (Path(model_dir) / "config.json").is_file():
        return Path(model_dir)
    path = Path(model_dir) if model_dir is not None else Path(tempfile.mkdtemp())
    path.mkdir(parents=True, exist_ok=True)
    return build_model(name, path)


def build_model(name: str, path: Path, seed: int = 0) -> Path:
    """Write the random bf16 model folder `name` (see MODELS) with the byte tokenizer to `path`."""
    import transformers

    config_class, model_class, fields = MODELS[name]
    config = getattr(transformers, config_class)(**fields, eos_token_id=258, dtype="bfloat16")
    config.architectures = [model_class]
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # drawing 9-17B values on the CPU takes minutes
    model = model.to_empty(device=device).to(torch.bfloat16)
    randomize_(model, seed=seed, draw_device=device)
    zero_saved_buffers_(model)
    model.save_pretrained(path)
    del model
    if config.model_type in MTP_MODEL_TYPES:  # Qwen3-Next / Qwen3.5: a head that drafts at random
        write_random_mtp(path, seed=seed, dtype=torch.bfloat16, draw_device=device)
    if device == "cuda":
        torch.cuda.empty_cache()
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


def zero_saved_buffers_(model: torch.nn.Module) -> None:
    """Zero every buffer the folder will hold (`to_empty` leaves them unset and `randomize_` draws parameters
    only): the MoE routers' score-correction / expert biases of Nemotron 3, LFM2-MoE and Kimi Linear, so that the
    random router alone picks the experts, as in a model whose biases were never trained."""
    saved = model.state_dict()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in saved:
                buffer.zero_()


SCALE = {"value": 1.0}  # --scale: every length of the workload is multiplied by it (smoke tests)


def letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=max(1, int(n * SCALE["value"]))))


def timed(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def summary(latencies: list[float], outputs: list, prompt_lens: list[int]) -> dict:
    """Hit rate, cached tokens, latency percentiles (ms), total (s) of a phase's requests."""
    cached = [o.num_cached_tokens for o in outputs]
    ordered = sorted(latencies)
    pct = lambda q: 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "requests": len(outputs), "prompt_tokens": sum(prompt_lens), "cached_tokens": sum(cached),
        "hit_rate": sum(cached) / sum(prompt_lens), "cached_per_request": cached,
        "p50_ms": 1000 * statistics.median(latencies), "p90_ms": pct(0.9), "p95_ms": pct(0.95),
        "max_ms": 1000 * ordered[-1], "total_s": sum(latencies),
        "latencies_ms": [1000 * t for t in latencies],
    }


def run_phase(llm: LLM, runner, rng: random.Random, result: dict, key: str) -> bool:
    """Run one phase into `result["phases"][key]`, with the cache counters it moved; an error goes to
    `result["errors"][key]` instead (one broken phase must not cost the others' figures). True if it ran."""
    before = cache_counts(llm)
    try:
        result["phases"][key] = runner(llm, rng)
    except Exception as error:
        traceback.print_exc()
        result.setdefault("errors", {})[key] = repr(error)
        return False
    result["phases"][key]["cache"] = {name: dict(counts - before[name]) for name, counts in cache_counts(llm).items()}
    return True


def phase_a(llm: LLM, rng: random.Random) -> dict:
    systems = [letters(rng, 2000) for _ in range(4)]
    history = [systems[i % 4] for i in range(16)]
    latencies, outputs, lens = [], [], []
    for _turn in range(4):
        for session in range(16):
            prompt = history[session] + letters(rng, rng.randint(200, 600))
            seconds, out = timed(llm, [prompt], 1)
            latencies.append(seconds)
            outputs += out
            lens.append(len(out[0].prompt_token_ids))
            history[session] = prompt + letters(rng, rng.randint(100, 300))
    return summary(latencies, outputs, lens)


def phase_b(llm: LLM, rng: random.Random) -> dict:
    prompt = letters(rng, 6000)
    runs = [timed(llm, [prompt], 1) for _ in range(3)]
    return summary([t for t, _ in runs], [o[0] for _, o in runs], [len(prompt)] * 3)


def phase_c(llm: LLM, rng: random.Random) -> dict:
    prompt = letters(rng, 16000)
    longer = prompt + letters(rng, 200)
    cold = timed(llm, [prompt], 1)
    warm = timed(llm, [longer], 1)
    return summary([cold[0], warm[0]], cold[1] + warm[1], [len(prompt), len(longer)])


def phase_c_host(llm: LLM, rng: random.Random) -> dict:
    """Phase CH (module docstring): the + 200 request after a filler that pushes the prefix off the device."""
    prompt = letters(rng, 16000)
    cold = timed(llm, [prompt], 1)
    filler = timed(llm, [letters(rng, 16000)], 1)
    warm = timed(llm, [prompt + letters(rng, 200)], 1)
    result = summary([warm[0]], warm[1], [len(warm[1][0].prompt_token_ids)])
    result["cold_ms"], result["filler_ms"] = 1000 * cold[0], 1000 * filler[0]
    return result


SWE_MAX_PROMPT = 16000


def phase_swe(llm: LLM, rng: random.Random) -> dict:
    """The shipped SWE-agent slice replayed call by call, one request at a time in arrival order, from an empty
    cache: each call's prompt is every message before it as recorded (the built-in byte tokenizer and ChatML
    template, whose ids the byte tokenizer of these models shares), sessions cut at SWE_MAX_PROMPT tokens
    (smoke runs with --scale < 1: shorter), 1 new token each. Real agent prompt lengths: a prefill shape that
    start-up did not compile shows here."""
    from hybridcache.bench.workloads import ChatOptions, load_workload

    cut = ChatOptions(max_prompt_len=SWE_MAX_PROMPT)
    if SCALE["value"] < 1:  # smoke runs: messages cut to 200 characters, the first calls only
        cut = ChatOptions(max_prompt_len=max(1024, int(SWE_MAX_PROMPT * SCALE["value"])), max_message_chars=200)
    requests = list(load_workload("swe-agent", chat=cut))
    if SCALE["value"] < 1:
        requests = requests[: max(2, int(len(requests) * SCALE["value"]))]
    llm.engine.clear_cache()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    latencies, outputs, start = [], [], time.perf_counter()
    for request in requests:
        call_start = time.perf_counter()
        outputs += llm.generate([list(request.prompt_ids)], params, use_tqdm=False)
        latencies.append(time.perf_counter() - call_start)
    result = summary(latencies, outputs, [r.prompt_len for r in requests])
    result.update(wall_s=time.perf_counter() - start, max_prompt_tokens=max(r.prompt_len for r in requests))
    return result


def phase_d(llm: LLM, rng: random.Random, trace_step: int = 0) -> dict:
    """Driven step by step through the engine, so prefill and decode steps are timed apart (each `step()` call
    ends on the host with sampled tokens: with async scheduling it launches one step and postprocesses the one
    before, so in steady state a call's wall time is a step's real time; a call counts as a prefill step when
    the step it postprocessed fed prompt tokens). `trace_step` > 0: that step (1-based) runs under
    torch.profiler (`traced_step`)."""
    prompts = [letters(rng, 1024) for _ in range(64)]
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)  # FINAL_ONLY, as LLM.generate runs them
    finished, prefill_steps, decode_steps, steps = {}, [], [], []
    while engine.has_unfinished_requests():
        step_start, prefilled = time.perf_counter(), engine.num_prefill_tokens
        outputs = traced_step(engine) if len(steps) + 1 == trace_step else engine.step()
        elapsed = time.perf_counter() - step_start
        (prefill_steps if engine.num_prefill_tokens != prefilled else decode_steps).append(elapsed)
        steps.append((engine.num_prefill_tokens - prefilled, round(1000 * elapsed, 2)))
        finished.update((o.request_id, o) for o in outputs if o.finished)
    seconds = time.perf_counter() - start
    outputs = [finished[f"d{i}"] for i in range(len(prompts))]
    result = summary([seconds], outputs, [len(p) for p in prompts])
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result.update(output_tokens=out_tokens, output_tok_per_s=out_tokens / seconds,
                  prefill_steps=len(prefill_steps), prefill_s=sum(prefill_steps), decode_steps=len(decode_steps),
                  decode_step_ms_p50=1000 * statistics.median(decode_steps) if decode_steps else None,
                  steps_prefill_tokens_ms=steps)
    return result


def phase_d_sync(llm: LLM, rng: random.Random) -> dict:
    """Phase D with async scheduling off on the same engine (then restored)."""
    engine = llm.engine
    saved, engine.async_scheduling = engine.async_scheduling, False
    try:
        return phase_d(llm, rng)
    finally:
        engine.async_scheduling = saved


def traced_step(engine) -> list:
    """One engine step under torch.profiler; prints the top operators by host and by device time (the profiler's
    own cost is in this step's time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        outputs = engine.step()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15))
    if torch.cuda.is_available():
        print(averages.table(sort_by="self_cuda_time_total", row_limit=15))
    return outputs


def warm_up(llm: LLM, rng: random.Random) -> None:
    """Compile every kernel shape family once (long prefill, a prefix hit with its restore and a short chunk after
    it, batched decode), then forget it."""
    prompt = letters(rng, 3000)
    timed(llm, [prompt], 1)
    timed(llm, [prompt + letters(rng, 200)], 1)  # the cached-prefix path of phases A-C
    timed(llm, [letters(rng, 300) for _ in range(8)], 16)
    timed(llm, [letters(rng, 1024) for _ in range(32)], 2)
    llm.engine.clear_cache()


class CompileLog:
    """Names the Triton kernels compiled (or loaded from the disk cache) after warm-up, by phase: a kernel first
    compiled inside a measured phase puts its compile time into that phase's latencies."""

    def __init__(self) -> None:
        self.label = ""
        self.by_label: dict[str, list[str]] = {}
        try:
            import triton
        except ImportError:
            return
        knobs = getattr(triton, "knobs", None)
        if knobs is not None:
            knobs.runtime.jit_cache_hook = self

    def __call__(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        name = repr[:120] if repr else fn.name  # the key names the specialisation (dtypes, alignments, constants)
        self.by_label.setdefault(self.label, []).append(f"{name} key={str(key)[:800]}")
        return None


def check_graphs(llm: LLM, max_tokens: int) -> dict:
    """Greedy tokens of a long decode (32 prompts in lockstep, so every decode step is a 32-row bucket) with
    CUDA graphs, then the same captured batches run eagerly (`runner.without_replay()`), then on the plain eager
    path (each step's own split-KV split count), the cache cleared before each run."""
    rng = random.Random(1)
    prompts = [letters(rng, rng.randint(50, 400)) for _ in range(32)]
    runner = llm.engine.runner
    modes = {"graph": contextlib.nullcontext, "without_replay": runner.without_replay, "eager": runner.eager}
    tokens, result = {}, {"completions": len(prompts)}
    for name, mode in modes.items():
        llm.engine.clear_cache()
        with mode():
            result[f"{name}_s"], outputs = timed(llm, prompts, max_tokens)
        tokens[name] = [list(o.outputs[0].token_ids) for o in outputs]
    for name in ("without_replay", "eager"):
        pairs = list(zip(tokens["graph"], tokens[name]))
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in pairs]
        result[f"identical_{name}"] = sum(a == b for a, b in pairs)
        result[f"first_divergence_{name}"] = [i for i in first if i is not None]
    result["tokens"] = sum(map(len, tokens["graph"]))
    result["prefill"] = check_prefill_graphs(llm)
    return result


def check_prefill_graphs(llm: LLM) -> dict:
    """Greedy tokens of prefix hits whose new tokens fit the piecewise prefill graphs' buckets, in the same three
    modes as `check_graphs`: 4 system prompts of 2,000 letters, then 24 requests one at a time, each a system
    prompt + 20-900 new letters, 8 tokens each (every request's prefill step a one-sequence step: its whole-step
    graph, or piecewise without them; its decode steps the 1-row decode graph), the cache cleared before each
    mode. Graph replay must equal `without_replay` (the same work eagerly) token for token. With whole-step
    graphs a fourth mode, "pieces", runs the prefill steps piecewise (`sequence_graphs_off`)."""
    rng = random.Random(2)
    systems = [letters(rng, 2000) for _ in range(4)]
    prompts = [systems[i % 4] + letters(rng, rng.randint(20, 900)) for i in range(24)]
    runner = llm.engine.runner
    modes = {"graph": contextlib.nullcontext, "without_replay": runner.without_replay, "eager": runner.eager}
    if getattr(getattr(runner, "_prefill", None), "sequence", None) is not None:  # whole-step graphs: also pieces
        modes["pieces"] = functools.partial(sequence_graphs_off, runner)
    tokens, result = {}, {"requests": len(prompts), "buckets": list(getattr(runner, "prefill_graph_sizes", ()))}
    for name, mode in modes.items():
        llm.engine.clear_cache()
        with mode():
            timed(llm, systems, 1)
            runs = [timed(llm, [prompt], 8) for prompt in prompts]
        result[f"{name}_s"] = sum(seconds for seconds, _ in runs)
        tokens[name] = [list(out[0].outputs[0].token_ids) for _, out in runs]
    for name in modes:
        if name != "graph":
            result[f"identical_{name}"] = sum(a == b for a, b in zip(tokens["graph"], tokens[name]))
    return result


@contextlib.contextmanager
def sequence_graphs_off(runner) -> Iterator[None]:
    """Within the block one-sequence steps run on the piecewise graphs, not their whole-step graphs
    (`engine/prefill_graphs.SequenceGraphs`)."""
    prefill = runner._prefill
    whole, prefill.sequence = prefill.sequence, None
    try:
        yield
    finally:
        prefill.sequence = whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="next-1b", choices=list(MODELS))
    parser.add_argument("--phases", default="C,D,A,B", help="comma-separated, run in this order")
    parser.add_argument("--check-graphs", action="store_true")
    parser.add_argument("--check-tokens", type=int, default=512, help="tokens per completion of --check-graphs")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false", default=None,
                        help="postprocess each step before planning the next (default: async on CUDA)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", *DTYPES],
                        help="the DeltaNet recurrent state's dtype (auto: float32 here; the models name none)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="the pool's blocks (KV and checkpoint states; default: the memory budget's rest)")
    parser.add_argument("--cache-mode", default="hybridcache", help="hybridcache, seed, block-aligned or none")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="cap the sequence length (default: the model's): a pool of --num-blocks must hold one")
    parser.add_argument("--host-cache-gib", type=float, default=0.0,
                        help="a host-memory tier behind the pool (pinned), GiB (default: none)")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="quantise the bf16 folder's linears to 128 x 128 FP8 at load")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: e4m3 KV pool")
    parser.add_argument("--speculative-config", default=None,
                        help="JSON: MTP with the folder's random head (every draft rejected: the phases give the "
                             "overhead of drafts that never pay)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model-dir", default=None, help="reuse the model folder there, or build it there")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="dummy: a folder of config.json and the tokenizer, the weights drawn at load (seconds "
                             "instead of minutes for the large shapes; no MTP head)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload length (smoke tests)")
    parser.add_argument("--trace-d-step", type=int, default=0,
                        help="run phase D's step of this number (1-based) under torch.profiler and print its top ops")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    phases = [p.strip().upper() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}")
    SCALE["value"] = args.scale
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    suffix = "" if args.mamba_ssm_cache_dtype == "auto" else f"_ssm-{args.mamba_ssm_cache_dtype}"
    suffix += "" if args.cache_mode == "hybridcache" else f"_{args.cache_mode}"
    suffix += "" if args.num_blocks is None else f"_blocks-{args.num_blocks}"
    suffix += "" if not args.host_cache_gib else f"_host-{args.host_cache_gib:g}"
    suffix += "" if args.quantization is None else f"_{args.quantization}"
    suffix += "" if args.kv_cache_dtype == "auto" else f"_kv-{args.kv_cache_dtype}"
    out_path = out_dir / f"gpu_bench_{args.model}{suffix}.json"
    start = time.perf_counter()
    if args.load_format == "dummy":
        from tp_bench import config_folder

        folder = config_folder(args.model, args.model_dir)
    else:
        folder = model_folder(args.model, args.model_dir)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result: dict = {"model": args.model, "device": device_name, "build_s": time.perf_counter() - start,
                    "date": time.strftime("%Y-%m-%d"), "phases": {}}
    print(f"built {args.model} in {result['build_s']:.1f} s", flush=True)
    options = dict(dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device, block_size=64,
                   max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens,
                   gpu_memory_utilization=args.gpu_memory_utilization, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                   async_scheduling=args.async_scheduling, num_blocks=args.num_blocks, cache_mode=args.cache_mode,
                   host_cache_gib=args.host_cache_gib, max_model_len=args.max_model_len, quantization=args.quantization,
                   kv_cache_dtype=args.kv_cache_dtype, speculative_config=args.speculative_config,
                   load_format=args.load_format)
    result["speculative_config"] = args.speculative_config
    result["load_format"] = args.load_format
    result["triton_cache"] = triton_cache_state()
    start = time.perf_counter()
    llm = None
    try:
        llm = LLM(folder, **options, enforce_eager=args.enforce_eager)
    except Exception as error:  # graph capture failed: measure eagerly (below, once the traceback is gone)
        if args.enforce_eager:
            raise
        traceback.print_exc()
        result.setdefault("errors", {})["engine"] = repr(error)
    if llm is None:
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(folder, **options, enforce_eager=True)
    result["cuda_graphs"] = list(llm.engine.runner.graph_batch_sizes)
    runner = llm.engine.runner
    result["prefill_graphs"] = {"buckets": list(getattr(runner, "prefill_graph_sizes", ())),
                                "mib": getattr(runner, "prefill_graph_bytes", 0) / 2**20,
                                "failures": getattr(runner, "prefill_graph_failures", {})}
    result["engine_init_s"] = time.perf_counter() - start
    result["memory"] = llm.engine.memory_plan.describe()
    result["async_scheduling"] = llm.engine.async_scheduling
    result["mamba_ssm_cache_dtype"] = llm.engine.config.mamba_ssm_cache_dtype
    rng = random.Random(0)
    compiles = CompileLog()  # from here on, every compile is one the engine's start-up did not do
    compiles.label = "warm-up"
    warm_up(llm, random.Random(99))
    result["warm_up_kernels_compiled"] = compiles.by_label.get("warm-up", [])
    print(f"warm-up: Triton compiled {len(result['warm_up_kernels_compiled'])} kernels: "
          f"{result['warm_up_kernels_compiled']}", flush=True)
    runners = {"A": phase_a, "B": phase_b, "C": phase_c, "CH": phase_c_host,
               "D": lambda llm, rng: phase_d(llm, rng, trace_step=args.trace_d_step), "DSYNC": phase_d_sync,
               "SWE": phase_swe}
    for index, phase in enumerate(phases):
        key = phase if phase not in phases[:index] else f"{phase}#{phases[:index + 1].count(phase)}"
        compiles.label = key
        if not run_phase(llm, runners[phase], rng, result, key):
            continue
        result["phases"][key]["kernels_compiled"] = compiles.by_label.get(key, [])
        if key in compiles.by_label:
            print(f"{key}: Triton compiled {len(compiles.by_label[key])} kernels: {compiles.by_label[key]}")
        print_row(key, result["phases"][key])
        out_dir.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))
    print_table(result)
    if args.check_graphs:
        result["graph_check"] = check_graphs(llm, args.check_tokens)
        print(f"graph check: {result['graph_check']}", flush=True)
        out_path.write_text(json.dumps(result, indent=1))


def triton_cache_state() -> dict:
    """Triton's on-disk kernel cache as this process found it: its folder (TRITON_CACHE_DIR, else Triton's default
    ~/.triton/cache) and how many compiled kernels it held, 0 on a fresh machine. A second process with the same
    folder loads its kernels instead of compiling them: the restart figure of docs/bench.md."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    kernels = sum(not f.name.startswith("__grp__") for f in folder.glob("*/*.json")) if folder.is_dir() else 0
    return {"dir": str(folder), "kernels_at_start": kernels}


def cache_counts(llm: LLM) -> dict[str, Counter]:
    """The prefix cache's running counters that tell what a phase did under memory pressure (and with a host
    tier, what moved between the tiers)."""
    cache = llm.engine.stats()["cache"]
    names = ("saves_by_reason", "declined_saves", "evictions_by_kind")
    counts = {name: Counter(getattr(cache, name)) for name in names}
    counts["host"] = Counter({name: getattr(cache, name) for name in (
        "num_host_hits", "num_host_hit_tokens", "num_promoted_checkpoints", "num_promoted_blocks",
        "num_demoted_checkpoints", "num_demoted_blocks", "num_promotions_skipped")})
    return counts


def print_row(phase: str, r: dict) -> None:
    tok_s = f"{r['output_tok_per_s']:.0f}" if "output_tok_per_s" in r else "-"
    few = len(r["cached_per_request"]) <= 3
    cached = "/".join(str(c) for c in r["cached_per_request"]) if few else r["cached_tokens"]
    lat = "/".join(f"{t:.0f}" for t in r["latencies_ms"]) if len(r["latencies_ms"]) <= 3 else ""
    decode = f"{r['decode_step_ms_p50']:.1f}" if r.get("decode_step_ms_p50") else "-"
    compiled = len(r.get("kernels_compiled", ()))
    print(f"| {phase} | {r['hit_rate']:.3f} | {cached} | {r['p50_ms']:.0f} | {r['p95_ms']:.0f} | "
          f"{r.get('max_ms', 0):.0f} | {lat} | {r['total_s']:.2f} | {tok_s} | {decode} | {compiled} |", flush=True)


def print_table(result: dict) -> None:
    print(f"\n{result['model']} on {result['device']}, state {result['mamba_ssm_cache_dtype']} ({result['memory']})")
    print(f"engine start-up {result['engine_init_s']:.1f} s; kernels compiled in the warm-up "
          f"{len(result.get('warm_up_kernels_compiled', ()))}")
    print("| phase | hit rate | cached tokens | p50 ms | p95 ms | max ms | each ms | total s | out tok/s "
          "| decode step ms | kernels compiled |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for phase, r in result["phases"].items():
        print_row(phase, r)


if __name__ == "__main__":
    main()
