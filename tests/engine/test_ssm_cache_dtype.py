"""`mamba_ssm_cache_dtype` (`--mamba-ssm-cache-dtype`): the gated DeltaNet recurrent state stored in bfloat16.

What a bf16 state is, exactly: the kernels compute in fp32 and round the state to bf16 (round to nearest even)
each time they store it, once per step a sequence takes part in (after each prefill chunk, after each decoded
token); checkpoints copy those bf16 bytes. So a bf16-state engine must equal, bit for bit, an fp32-state engine
whose `ssm` pool is rounded to bf16 after every step (`test_bf16_state_is_the_fp32_state_rounded_once_per_step`),
and cached and uncached runs are bit-identical when their rounding points coincide
(`test_cached_equals_uncached_exactly_where_the_chunkings_agree`). Where they do not, results move by bf16
rounding; measured on the tiny random models here (relative error = max |logit difference| / max |logit|):

- against transformers (fp32, never rounded), 24 greedy tokens after a 157- and a 203-token prompt prefilled in
  chunks of 64: the first token's logits within 3.1e-4, the median position within 3.4e-3 (1.7 x 2^-9; fp32
  state: ~1e-6), single positions up to 2.5e-2; 95 of 96 tokens equal transformers' argmax, the other one (the
  12th token of a qwen3_next completion) where transformers' own top-2 gap is 3.9e-4 of max |logit|;
- cached vs uncached on the cache-equivalence workload (14 requests, 87 greedy tokens, 876 prompt tokens hit),
  block sizes 16 and 64: no token differs on either model; logits differ by up to 6.3e-3 (qwen3_5_text) and
  4.8e-2 (qwen3_next), median 1.5e-3 / 2.8e-3 (fp32 state: 3.9e-6 / 1.2e-5).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
from collections.abc import Mapping

import pytest
import torch

from hybridcache import LLM, llm
from hybridcache.cli import build_parser
from hybridcache.config import EngineConfig
from hybridcache.engine.memory import plan_memory, pool_bytes
from hybridcache.engine_args import add_engine_args, engine_options, resolve_engine_config
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.models.config import ModelConfig
from hybridcache.models.registry import get_model_class
from hybridcache.sampling import SamplingParams

from .markers import needs_cuda_engine
from .model_folders import load_hf_model, prompts_of, write_tiny_model
from .test_cache_equivalence import finish_one, make_engine, run_workload, tokens

BF16_UNIT = 2.0**-9  # the relative rounding error of one bf16 store (8 significant bits, round to nearest)
GIB = 1 << 30


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def ssm_pools(engine) -> list[torch.Tensor]:
    """Every DeltaNet layer's `ssm` pool [num_slots, Hv, Dk, Dv]."""
    return [layer["ssm"] for layer in engine.runner.pools.layers if isinstance(layer, Mapping)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """max |got - want| / max |want| over the last dim."""
    return (got - want).abs().amax(-1) / want.abs().amax(-1)


# ---------------------------------------------------------------------------------------------- the option


def parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_options(parser.parse_args(argv))


def folder_with_config(tmp_path, **fields):
    """A copy of the built-in model folder's config.json (all `resolve_engine_config` reads) with `fields` set."""
    config = json.loads((ensure_builtin_model() / "config.json").read_text())
    assert "mamba_ssm_dtype" not in config
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    return tmp_path


def test_the_option_on_the_command_line_and_in_llm(tmp_path):
    builtin = ensure_builtin_model()
    assert parse()["mamba_ssm_cache_dtype"] == "auto"
    for value in ("float32", "bfloat16", "float16"):
        config = resolve_engine_config(builtin, parse("--mamba-ssm-cache-dtype", value, "--device", "cpu"))
        assert config.mamba_ssm_cache_dtype == value
    # auto: the config's mamba_ssm_dtype when it names one, else float32 (the built-in model names none)
    assert resolve_engine_config(builtin, parse("--device", "cpu")).mamba_ssm_cache_dtype == "float32"
    named = folder_with_config(tmp_path, mamba_ssm_dtype="bfloat16")
    assert resolve_engine_config(named, parse("--device", "cpu")).mamba_ssm_cache_dtype == "bfloat16"
    assert resolve_engine_config(named, {"mamba_ssm_cache_dtype": "auto"}).mamba_ssm_cache_dtype == "bfloat16"
    # LLM's own default is EngineConfig's float32, whatever the config names
    assert resolve_engine_config(named, {}).mamba_ssm_cache_dtype == "float32"
    # a multimodal wrapper's config names it in text_config (as Qwen3.5's checkpoints do)
    text = json.loads((builtin / "config.json").read_text())
    wrapper = {"architectures": text["architectures"], "text_config": {**text, "mamba_ssm_dtype": "float16"}}
    assert ModelConfig.from_dict(wrapper).mamba_ssm_dtype == "float16"
    assert ModelConfig.from_dict(text).mamba_ssm_dtype is None
    for command in ("generate", "serve"):
        args = build_parser().parse_args([command, "--mamba-ssm-cache-dtype", "bfloat16"])
        assert engine_options(args)["mamba_ssm_cache_dtype"] == "bfloat16"


def test_bad_values_are_refused_naming_the_option_before_any_weights_load(tmp_path, monkeypatch, capsys):
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--mamba-ssm-cache-dtype", "fp8"])
        error = capsys.readouterr().err
        assert "argument --mamba-ssm-cache-dtype: invalid choice: 'fp8'" in error
        choices = error.split("choose from", 1)[1]
        assert all(value in choices for value in ("auto", "float32", "bfloat16", "float16")), error

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine (and its weights) must not be built")

    monkeypatch.setattr(llm, "LLMEngine", no_engine)
    for bad in ("fp8", "bf16", None):
        with pytest.raises(ValueError, match=r"mamba_ssm_cache_dtype \(--mamba-ssm-cache-dtype\) must be one of "
                                             r"auto, float32, bfloat16, float16, got"):
            LLM(None, mamba_ssm_cache_dtype=bad)
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype .* must be float32, bfloat16 or float16, got 'auto'"):
        EngineConfig(mamba_ssm_cache_dtype="auto")
    odd = folder_with_config(tmp_path, mamba_ssm_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="config.json sets mamba_ssm_dtype 'float8_e4m3fn'.*--mamba-ssm-cache-dtype"):
        resolve_engine_config(odd, {"mamba_ssm_cache_dtype": "auto"})
    assert resolve_engine_config(odd, {"mamba_ssm_cache_dtype": "float32"}).mamba_ssm_cache_dtype == "float32"


def test_overriding_the_configs_dtype_warns(tmp_path, caplog):
    named = folder_with_config(tmp_path, mamba_ssm_dtype="float32")
    with caplog.at_level(logging.WARNING, logger="hybridcache.engine_args"):
        assert resolve_engine_config(named, {"mamba_ssm_cache_dtype": "float32"}).mamba_ssm_cache_dtype == "float32"
        assert not caplog.records
        assert resolve_engine_config(named, {"mamba_ssm_cache_dtype": "bfloat16"}).mamba_ssm_cache_dtype == "bfloat16"
    assert [r.getMessage() for r in caplog.records] == [
        "the model's config.json sets mamba_ssm_dtype float32; --mamba-ssm-cache-dtype bfloat16 overrides it"
    ]


# ------------------------------------------------------------------------------------------- the memory plan


def test_the_same_budget_buys_about_twice_the_checkpoint_states():
    """transformers' default Qwen3_5TextConfig (the 9B shape of benchmarks/gpu_bench.py's dense-9b: 24 DeltaNet
    layers, 32 value heads of 128 x 128) in bf16 on a 60 GiB budget, 64 running sequences. A slot is 24 x (a
    2 MiB fp32 ssm + a 48 KiB bf16 conv state) = 49.1 MiB, 25.1 MiB with a bf16 ssm (1.95x smaller), plus an 8 KiB
    last_hidden. A checkpoint state takes k = 25 blocks of 2 MiB of the shared pool, then 13; the pool grows from
    29,147 to 29,915 blocks (the runtime slots shrink), so it holds 1,165 -> 2,301 checkpoint states (1.98x), or
    any mix of states and KV."""
    import transformers

    raw = {**transformers.Qwen3_5TextConfig().to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}
    config = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    (kv, fp32_slot), (kv_again, bf16_slot) = (
        pool_bytes(model.state_specs(torch.bfloat16, ssm_dtype), 64) for ssm_dtype in (torch.float32, torch.bfloat16)
    )
    ssm, conv = 32 * 128 * 128, 8192 * 3
    assert kv == kv_again == 2 << 20
    assert (fp32_slot, bf16_slot) == (24 * (4 * ssm + 2 * conv), 24 * (2 * ssm + 2 * conv))
    last_hidden = pool_bytes((), 64, model.slot_specs(torch.bfloat16))[1]
    assert last_hidden == 8 << 10

    plans = [plan_memory(60 * GIB, kv_bytes_per_block=kv, state_bytes_per_slot=slot + last_hidden, max_num_seqs=64,
                         block_size=64, min_blocks=64) for slot in (fp32_slot, bf16_slot)]
    assert [(p.state_pages, p.num_blocks) for p in plans] == [(25, 29147), (13, 29915)]
    assert [p.num_blocks // p.state_pages for p in plans] == [1165, 2301]


# ---------------------------------------------------------------------------------- the CPU reference path


CUDA = pytest.param("cuda", marks=needs_cuda_engine)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_bf16_state_is_the_fp32_state_rounded_once_per_step(model_dir, device):
    """The kernels read the bf16 state as fp32 and round once when they store it, and checkpoints copy the bf16
    bytes: on the whole cache-equivalence workload (prefix hits, checkpoint saves and restores, a batched
    decode), a bf16-state engine gives bit-identical logits to an fp32-state engine whose ssm pools are rounded
    to bf16 after every step. On CUDA (bf16 model, decode graphs) the same holds for the Triton decode step and
    fla's chunked rule, which gather the state as fp32 and cast it back when they scatter it."""
    # one pool size for both engines, ample: a bf16 state takes fewer pages, and the two caches must save, hit and
    # evict alike for the comparison to be exact
    options = dict(num_blocks=512) if device == "cpu" else dict(
        device="cuda", dtype="bfloat16", num_blocks=512, gpu_memory_utilization=0.5)
    bf16 = make_engine(model_dir, mamba_ssm_cache_dtype="bfloat16", **options)
    emulated = make_engine(model_dir, **options)
    assert {p.dtype for p in ssm_pools(bf16)} == {torch.bfloat16}
    assert {p.dtype for p in ssm_pools(emulated)} == {torch.float32}
    # and one shortest branch point: the engine derives it from the state's bytes, which the bf16 state halves
    cache = bf16.scheduler.cache
    cache.config = dataclasses.replace(cache.config,
                                       min_branch_point_step=emulated.scheduler.cache.config.min_branch_point_step)
    conv_dtypes = {layer["conv"].dtype for engine in (bf16, emulated) for layer in engine.runner.pools.layers
                   if isinstance(layer, Mapping)}
    assert conv_dtypes == {torch.float32 if device == "cpu" else torch.bfloat16}  # the model dtype
    forward, pools = emulated.runner._forward, ssm_pools(emulated)

    def forward_then_round(batch):  # before the step's saves copy the state into checkpoint pages
        logits = forward(batch)
        for pool in pools:
            pool.copy_(pool.to(torch.bfloat16))
        return logits

    emulated.runner._forward = forward_then_round
    out_bf16 = run_workload(bf16, check_every_step=True)
    out_emulated = run_workload(emulated)
    assert sum(o.num_cached_tokens for o in out_bf16.values()) > 0
    assert bf16.logits.keys() == emulated.logits.keys()
    for key, logits in bf16.logits.items():
        assert torch.equal(logits, emulated.logits[key]), key
    for request_id, output in out_bf16.items():
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in out_emulated[request_id].outputs]


def test_bf16_state_greedy_output_against_transformers(model_dir, caplog):
    """Two prompts of 157 and 203 tokens prefilled in chunks of 64, 24 greedy tokens each, against transformers'
    fp32 forward over prompt + generated tokens (explicit position_ids). A bf16 store changes the state by at
    most 2^-9 of its size; the criterion, with its measured margins (module docstring):
    - the first token's logits (after 2-3 rounded stores of the prefill) within 2^-9 relative (6x margin);
    - over each completion the median position within 4 x 2^-9 (2.3x margin);
    - the first 8 tokens equal transformers' argmax, and a later token may differ only where transformers' own
      top-2 gap is below 16 x 2^-9 of max |logit| (above the largest single-position error seen, 2.5e-2)."""
    with caplog.at_level(logging.INFO, logger="hybridcache.engine"):
        engine = make_engine(model_dir, caching=False, max_num_batched_tokens=64, mamba_ssm_cache_dtype="bfloat16")
    assert "dtype float32, state dtype bfloat16," in caplog.records[-1].getMessage()
    prompts = prompts_of([157, 203])
    outputs = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    hf = load_hf_model(model_dir)
    for i, prompt in enumerate(prompts):
        generated = outputs[f"r{i}"].outputs[0].token_ids
        ids = torch.tensor([prompt + generated])
        with torch.inference_mode():
            want = hf(ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0, len(prompt) - 1 : -1]
        got = torch.stack([engine.logits[(f"r{i}", 0, len(prompt) + k)] for k in range(len(generated))])
        error = relative_error(got, want)
        assert error[0] <= BF16_UNIT, float(error[0])
        assert error.median() <= 4 * BF16_UNIT, float(error.median())
        best = want.argmax(-1)
        assert generated[:8] == best[:8].tolist()
        rows = torch.arange(len(generated))
        gap = (want[rows, best] - want[rows, torch.tensor(generated)]) / want.abs().amax(-1)
        assert bool((gap <= 16 * BF16_UNIT).all()), gap.max()


# ------------------------------------------------------------------------------------- cached vs uncached


def test_cached_equals_uncached_exactly_where_the_chunkings_agree(model_dir):
    """A 64-token prompt, then it + 40 tokens, one request at a time, chunks of at most `budget` tokens. The
    second request hits the first one's checkpoint at 64. With budget 16 or 32 the uncached run rounds its
    state at 64 too (a chunk ends there) and every later chunk ends where the cached run's does: the restored
    bf16 state is the very one the uncached run holds at 64, and all logits are bit-identical. With budget 24
    (uncached chunks end at 48 and 72, not 64) they differ by bf16 rounding, while an fp32 state keeps them
    within float rounding (4e-6 measured)."""
    rng = random.Random(7)
    prompt, suffix = tokens(rng, 64), tokens(rng, 40)

    def max_difference(budget: int, state_dtype: str) -> float:
        options = dict(max_num_batched_tokens=budget, max_num_seqs=1, mamba_ssm_cache_dtype=state_dtype)
        cached, uncached = make_engine(model_dir, **options), make_engine(model_dir, caching=False, **options)
        finish_one(cached, "first", prompt, 1)
        hit = finish_one(cached, "second", prompt + suffix, 8)
        finish_one(uncached, "second", prompt + suffix, 8)
        assert hit.num_cached_tokens == 64
        keys = [key for key in uncached.logits if key[0] == "second"]
        assert len(keys) == 8 and set(keys) <= cached.logits.keys()
        return max(float((cached.logits[k] - uncached.logits[k]).abs().max()) for k in keys)

    assert max_difference(16, "bfloat16") == 0.0
    assert max_difference(32, "bfloat16") == 0.0
    assert max_difference(24, "bfloat16") > 1e-3
    assert max_difference(24, "float32") < 1e-4


@pytest.mark.parametrize("block_size, kernel_block_size", [(16, 8), (64, 64)])
def test_cached_and_uncached_agree_on_the_workload(model_dir, block_size, kernel_block_size):
    """The cache-equivalence workload with a bf16 state: both runs finish, the cache stays consistent after every
    step, prefixes hit, and at least 95% of the greedy tokens agree (all 87 do, measured; see the module
    docstring for how far the logits move)."""
    options = dict(block_size=block_size, kernel_block_size=kernel_block_size, mamba_ssm_cache_dtype="bfloat16")
    uncached, cached = make_engine(model_dir, caching=False, **options), make_engine(model_dir, **options)
    out_uncached = run_workload(uncached)
    out_cached = run_workload(cached, check_every_step=True)
    assert sum(o.num_cached_tokens for o in out_cached.values()) > 0
    assert out_cached.keys() == out_uncached.keys()
    same = total = 0
    for request_id, output in out_uncached.items():
        for want, got in zip(output.outputs, out_cached[request_id].outputs, strict=True):
            assert len(got.token_ids) == len(want.token_ids)
            total += len(want.token_ids)
            same += sum(a == b for a, b in zip(got.token_ids, want.token_ids))
    assert same >= 0.95 * total, (same, total)
    cached.clear_cache()
    cached.check_integrity()
