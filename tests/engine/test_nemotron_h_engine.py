"""Nemotron-H (Mamba2, attention and stateless MLP layers) through the engine: its MLP layers hold no state (an
empty spec), so the pools, the checkpoints and the prefix cache need no change; cached and uncached runs compute
the same thing, the cache hits at non-block-aligned steps; options that do not apply to it (MTP, FP8, images, TP)
are clear errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.llm import LLM
from hybridcache.models.builtin import build_byte_tokenizer
from hybridcache.sampling import SamplingParams
from tests.models.nemotron_helpers import nemotron_model

from .markers import needs_cuda_engine
from .test_cache_equivalence import CUDA_FP32, assert_same, finish_one, make_engine, run_workload, tokens
from .test_prefill_graphs import make_runner, split_and_unsplit, steps


def write_tiny_nemotron(path: Path, variant: str, seed: int = 0) -> Path:
    """A tiny random Nemotron-H folder over the byte tokenizer's 320 ids (transformers `save_pretrained`, which
    writes the hub checkpoints' `backbone.` names)."""
    model = nemotron_model(variant, seed, vocab_size=320, eos_token_id=258)
    model.save_pretrained(path)
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


@pytest.fixture(scope="module", params=["groups2", "pattern-bias", "moe-groups", "moe-latent"])
def model_dir(request, tmp_path_factory):
    return write_tiny_nemotron(tmp_path_factory.mktemp(request.param), request.param)


def test_cached_run_equals_uncached_run(model_dir):
    uncached = make_engine(model_dir, caching=False)
    cached = make_engine(model_dir)
    out_uncached = run_workload(uncached)
    out_cached = run_workload(cached, check_every_step=True)
    assert_same(cached, uncached, out_cached, out_uncached)
    assert sum(o.num_cached_tokens for o in out_cached.values()) > 0
    assert cached.num_prefill_tokens < uncached.num_prefill_tokens
    stats = cached.stats()["cache"]
    assert stats.saves_by_reason["finish"] > 0 and stats.hits_by_reason["finish"] > 0


def test_shared_prefixes_of_unaligned_lengths_hit_at_the_divergence_step(model_dir):
    """Prompts sharing a 133-token prefix (16-token blocks): the third hits exactly at 133, a partial block past its
    anchor, saved when the second diverged there; a multi-turn follow-up hits at the previous turn's last fed
    token. Greedy tokens equal an uncached engine's."""
    engine, reference = make_engine(model_dir), make_engine(model_dir, caching=False)
    rng = random.Random(4)
    system = tokens(rng, 133)
    suffixes = [[200 + i] + tokens(rng, 20) for i in range(3)]
    outs = [finish_one(engine, f"r{i}", system + s, 4) for i, s in enumerate(suffixes)]
    refs = [finish_one(reference, f"r{i}", system + s, 4) for i, s in enumerate(suffixes)]
    hits = [o.num_cached_tokens for o in outs]
    assert hits[0] == 0 and hits[1] < 133 and hits[2] == 133  # (the second: at most the first's chunk ends)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in refs]
    history = system + suffixes[0] + outs[0].outputs[0].token_ids + tokens(rng, 9)
    follow, follow_ref = finish_one(engine, "turn2", history, 5), finish_one(reference, "turn2", history, 5)
    assert follow.num_cached_tokens == 133 + 21 + 4 - 1
    assert follow.outputs[0].token_ids == follow_ref.outputs[0].token_ids
    engine.check_integrity()


def test_llm_generate_with_and_without_the_prefix_cache(model_dir):
    """The public API: `LLM(...).generate` gives the same greedy text with the prefix cache on and off."""
    rng = random.Random(9)
    shared = bytes(rng.randrange(97, 123) for _ in range(45)).decode()
    prompts = [shared + tail for tail in ("one", "a second prompt", shared[:13])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs, hits = {}, {}
    for caching in (True, False):
        llm = LLM(str(model_dir), enable_prefix_caching=caching, block_size=16, max_num_seqs=4)
        done = llm.generate(prompts[:1], params)  # the others then find its checkpoints
        done += llm.generate(prompts[1:], params)
        outputs[caching] = [o.outputs[0].token_ids for o in done]
        hits[caching] = [o.num_cached_tokens for o in done]
        llm.engine.check_integrity()
        llm.close()
    assert outputs[True] == outputs[False]
    assert hits[True][0] == 0 and sum(hits[True]) > 0 and hits[False] == [0, 0, 0]


def test_split_forward_equals_unsplit_on_cpu(model_dir):
    """Piecewise prefill graphs cut Nemotron-H's forward at its cores (the Mamba2 conv + scan, the attention; an MLP
    layer has none): the split forward equals the unsplit one, logits and every pool, bit for bit where no row is
    padding (as `test_prefill_graphs`)."""
    from hybridcache.engine.prefill_graphs import PrefillGraphs

    device = torch.device("cpu")
    runner = make_runner(model_dir, device)
    sizes = (41, 190, 256)
    runner._prefill = PrefillGraphs(runner.model, runner.backend, runner.pools, sizes, device)
    for index, (want, got, unsplit_pools, split_pools) in enumerate(split_and_unsplit(runner, sizes, replay=False)):
        assert got.shape == want.shape == (len(steps(device)[index].query_lens_cpu), 320)
        if index < 2:
            assert torch.equal(got, want), index
            assert all(torch.equal(a, b) for a, b in zip(unsplit_pools, split_pools, strict=True)), index
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for a, b in zip(unsplit_pools, split_pools, strict=True):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@needs_cuda_engine
def test_cuda_fp32_cached_run_equals_uncached_run(model_dir):
    uncached, cached = make_engine(model_dir, caching=False, **CUDA_FP32), make_engine(model_dir, **CUDA_FP32)
    assert_same(cached, uncached, run_workload(cached, check_every_step=True), run_workload(uncached))


def test_auto_ssm_cache_dtype_reads_mamba_ssm_cache_dtype(model_dir, tmp_path):
    """`--mamba-ssm-cache-dtype auto` takes the config's `mamba_ssm_cache_dtype` (Nemotron-H's name for it; the
    published configs say float32, as transformers' default) and the Mamba2 state pools follow it."""
    import shutil

    from hybridcache.engine_args import resolve_engine_config

    auto = {"mamba_ssm_cache_dtype": "auto", "device": "cpu"}
    assert resolve_engine_config(model_dir, auto).mamba_ssm_cache_dtype == "float32"
    folder = Path(shutil.copytree(model_dir, tmp_path / "bf16-state"))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "mamba_ssm_cache_dtype": "bfloat16"}))
    config = resolve_engine_config(folder, {**auto, "num_blocks": 64})
    assert config.mamba_ssm_cache_dtype == "bfloat16"
    engine = LLMEngine(folder, config)
    ssm = [state["ssm"] for state in engine.runner.pools.layers if isinstance(state, dict) and state]
    assert ssm and all(t.dtype == torch.bfloat16 for t in ssm)


def test_mtp_is_refused_where_the_folder_has_nemotron_mtp_layers(model_dir, tmp_path):
    """Nemotron 3's MTP layers (`num_nextn_predict_layers`, `mtp.*` tensors) are not the Qwen MTP head the engine
    drafts with: speculative 'mtp' is refused naming the architecture (it was a list of missing Qwen head tensors);
    without speculation the folder serves, its `mtp.*` tensors unread."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(model_dir, tmp_path / "with-mtp"))
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "mtp.layers.0.norm.weight": torch.ones(64)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match="'mtp' is not supported for NemotronHForCausalLM"):
        LLMEngine(folder, EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 1}))
    assert len(finish_one(make_engine(folder), "plain", [5, 6, 7], 2).outputs[0].token_ids) == 2


def test_options_that_do_not_apply_are_clear_errors(model_dir):
    for options, message in (
        ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}, "mtp|MTP"),
        ({"quantization": "fp8"}, "does not support FP8 weights"),
        ({"kv_cache_dtype": "fp8"}, "does not support an FP8 KV cache"),
    ):
        with pytest.raises(ValueError, match=message):
            LLMEngine(model_dir, EngineConfig(**options))
    from PIL import Image

    llm = LLM(str(model_dir))
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": Image.new("RGB", (32, 32))}})
    llm.close()
