"""The engine checks every hybrid family's test file runs on its own `model_dir` fixture (a tiny random folder from
`write_tiny_folder`): cached == uncached on the randomized workload, hits at non-block-aligned divergence steps,
`LLM.generate` with and without the prefix cache, the piecewise prefill split, cached == uncached on CUDA, no Triton
compile after start-up on CUDA (`compile_recorder`: a test file imports that fixture too), and the
refusal of the options that do not apply to the family (MTP, images; FP8 where the test file's `SERVES_FP8` is
False, tensor parallelism where it runs on one rank). A test file imports them by name (pytest collects them there,
with that file's `model_dir`, made by `tiny_model_dir_fixture`, and its module-level `SERVES_FP8`):
test_granite_engine.py, test_nemotron_h_engine.py,
test_bamba_engine.py, test_falcon_h1_engine.py (Mamba2), test_jamba_engine.py (Mamba1), test_olmo_hybrid_engine.py
(gated DeltaNet), test_lfm2_engine.py (short convolution), test_kimi_linear_engine.py (KDA). A new recurrent family
needs no change of the cache for them to pass. (test_fp8_mamba2_hybrids_engine.py imports
`test_cached_run_equals_uncached_run` and `write_tiny_folder` for its FP8 folders.)"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.llm import LLM
from hybridcache.models import ModelConfig, get_model_class
from hybridcache.models.builtin import build_byte_tokenizer
from hybridcache.models.mtp import OTHER_MTP_MODEL_TYPES
from hybridcache.sampling import SamplingParams

from .markers import needs_cuda_engine
from .test_cache_equivalence import CUDA_FP32, assert_same, finish_one, make_engine, run_workload, tokens
from .test_no_compile_after_start_up import compile_recorder, serve_mixed_shapes  # noqa: F401 - the fixture
from .test_prefill_graphs import make_runner, split_and_unsplit, steps


def write_tiny_folder(hf_model: torch.nn.Module, path: Path) -> Path:
    """`hf_model` (a transformers model over the byte tokenizer's 320 ids) saved as a model folder with that tokenizer
    (transformers `save_pretrained`: the checkpoints' own tensor names)."""
    hf_model.save_pretrained(path)
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def tiny_model_dir_fixture(hf_model: Callable[..., torch.nn.Module], variants: Sequence[str]):
    """A family's module-scoped `model_dir` fixture, one param per variant: `hf_model(variant, 0, vocab_size=320,
    eos_token_id=258)` (its tests/models helper, over the byte tokenizer's 320 ids) saved by `write_tiny_folder`.
    Assign it to `model_dir` in the test file: `model_dir = tiny_model_dir_fixture(granite_model, ["moe-nope"])`."""

    @pytest.fixture(scope="module", params=list(variants))
    def model_dir(request, tmp_path_factory):
        folder = tmp_path_factory.mktemp(request.param)
        return write_tiny_folder(hf_model(request.param, 0, vocab_size=320, eos_token_id=258), folder)

    return model_dir


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
    """Prompts sharing a 133-token prefix (16-token blocks; past the step where a branch point is worth its state,
    `CacheConfig.min_branch_point_step`, which the recurrent state sets here): the third hits exactly at 133, a
    partial block past its anchor, saved when the second diverged there; a multi-turn follow-up hits at the
    previous turn's last fed token. Greedy tokens equal an uncached engine's."""
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
    """Piecewise prefill graphs cut the forward at its cores (the Mamba2 conv + scan, Mamba1's conv and its scan, the
    attention; a Nemotron-H MLP layer has none) like Qwen's: the split forward (pieces on a bucket's padded rows,
    cores eagerly) equals the unsplit one, logits and every pool, bit for bit where no row is padding (as
    `test_prefill_graphs`)."""
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

def test_cuda_backend_takes_the_folder(model_dir):
    """On any machine: the CUDA backend's load-time checks (its own kernels' and the Triton attention backend's,
    `kernels.shapes.check_cuda_model`) accept this tiny folder, so the CUDA test below runs the engine instead of
    stopping at a refusal (an H100 run found the families' head dim 24 refused; `make_engine` caps max_model_len at
    the CUDA options' pool, which Kimi's 1,048,576 tokens overran)."""
    from hybridcache.engine.rank_runner import model_shapes
    from hybridcache.kernels.attention.triton_backend import TritonAttention
    from hybridcache.kernels.shapes import check_cuda_model

    config = ModelConfig.from_model_dir(model_dir)
    check_cuda_model(model_shapes(config), TritonAttention)  # raises UnsupportedModelError naming each reason


@needs_cuda_engine
def test_cuda_fp32_cached_run_equals_uncached_run(model_dir):
    """On CUDA (the Mamba2 scan on fla's kernels, Mamba1's on the torch reference, the conv and attention on theirs)
    the cached run still equals the uncached one."""
    uncached, cached = make_engine(model_dir, caching=False, **CUDA_FP32), make_engine(model_dir, **CUDA_FP32)
    assert_same(cached, uncached, run_workload(cached, check_every_step=True), run_workload(uncached))


def test_options_that_do_not_apply_are_clear_errors(model_dir, request):
    """Refused naming the architecture, before any worker starts: speculative 'mtp' (these families have no Qwen MTP
    head: `mtp.check_mtp_model_type`), FP8 weights and KV where the family's test file says it serves no FP8 (its
    module-level `SERVES_FP8`, which the model class's `supports_fp8` must equal), tensor parallelism where it runs on
    one rank (`single_rank_reason`); an image is refused by the running engine."""
    config = ModelConfig.from_model_dir(model_dir)
    arch, model_cls = config.architecture, get_model_class(config.architecture)
    serves_fp8 = request.module.SERVES_FP8
    assert model_cls.supports_fp8 is serves_fp8, f"{model_cls.__name__}.supports_fp8 should be {serves_fp8}"
    mtp = (f"'mtp' is not supported for {arch}" if config.model_type in OTHER_MTP_MODEL_TYPES
           else f"'mtp' needs a model with MTP layers; {arch} has none")
    refused = [({"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}, mtp)]
    if not serves_fp8:
        refused += [({"quantization": "fp8"}, f"{arch} does not support FP8 weights"),
                    ({"kv_cache_dtype": "fp8"}, f"{arch} does not support an FP8 KV cache")]
    if model_cls.single_rank_reason is not None:
        refused.append(({"tensor_parallel_size": 2}, f"{arch} does not run under tensor parallelism"))
    for options, message in refused:
        with pytest.raises(ValueError, match=message):
            LLMEngine(model_dir, EngineConfig(**options))
    from PIL import Image

    llm = LLM(str(model_dir))
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": Image.new("RGB", (32, 32))}})
    llm.close()


@needs_cuda_engine
def test_serving_compiles_no_kernel_after_start_up(model_dir, compile_recorder):  # noqa: F811
    """The mixed shapes of tests/engine/test_no_compile_after_start_up.py on this family's folder in bf16 (fresh
    prompts of 1-1,500 tokens, prefix hits and extensions, mixed steps in the piecewise graphs): once `LLM(...)` has
    returned, nothing compiles; each compile seen is named with the key part that differs from start-up's and the
    engine frames that launched it."""
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_num_seqs=32, gpu_memory_utilization=0.2)
    compile_recorder.start_serving()  # what start-up compiled is start-up's
    assert serve_mixed_shapes(llm) > 100
    assert compile_recorder.seen == [], f"kernels compiled while serving:\n{compile_recorder.explain()}"
