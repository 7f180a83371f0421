"""Kimi Linear (KDA, MLA and MoE layers) through the engine: its KDA layers' state is a conv and an ssm tensor like
gated DeltaNet's, its MLA layers' paged KV the latent rows (one kv head), so the pools, the checkpoints and the prefix
cache need no change; cached and uncached runs compute the same thing, the cache hits at non-block-aligned steps;
options that do not apply to it (MTP, images, FP8) are clear errors (tensor parallelism runs:
tests/distributed/test_kimi_tensor_parallel.py); on CUDA, decode graphs replay what eager runs, and serving compiles
nothing after start-up."""

from __future__ import annotations

from tests.models.kimi_helpers import kimi_model

from .graph_checks import replay_and_eager_tokens
from .hybrid_family_checks import (  # noqa: F401 - collected here, on this file's `model_dir`
    compile_recorder,
    test_cached_run_equals_uncached_run,
    test_cuda_backend_takes_the_folder,
    test_cuda_fp32_cached_run_equals_uncached_run,
    test_llm_generate_with_and_without_the_prefix_cache,
    test_options_that_do_not_apply_are_clear_errors,
    test_serving_compiles_no_kernel_after_start_up,
    test_shared_prefixes_of_unaligned_lengths_hit_at_the_divergence_step,
    test_split_forward_equals_unsplit_on_cpu,
    tiny_model_dir_fixture,
)
from .markers import needs_cuda_engine

# FP8 weights and KV: refused (the shared refusal test checks the model class's `supports_fp8` against it)
SERVES_FP8 = False
model_dir = tiny_model_dir_fixture(kimi_model, ["moe-groups", "qlora-dense2"])


@needs_cuda_engine
def test_cuda_graph_decode_equals_eager(model_dir):
    """bf16 decode in CUDA graphs (the MLA layers' latent attention: partial sums in splits sized at capture for
    max_model_len, cut from the device lengths, then merged) gives exactly the tokens of the same captured batches
    run eagerly (`graph_checks.replay_and_eager_tokens`: 32 prompts decoding 400 tokens in lockstep)."""
    from hybridcache import LLM

    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_num_seqs=32, max_model_len=1024,
              gpu_memory_utilization=0.2)
    assert llm.engine.runner.graph_batch_sizes == (1, 2, 4, 8, 16, 32)
    graph, eager = replay_and_eager_tokens(llm)
    assert graph == eager
