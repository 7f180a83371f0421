"""A kernel backend refuses at load a model its kernels cannot run (`KernelBackend.check_model`), naming the
reason, instead of failing inside the first step. The CUDA backend's checks (`kernels.shapes.check_cuda_model`,
what `CudaBackend.check_model` runs, with the "triton" attention backend's `problems`) import no Triton, so they
are checked here without a GPU: through an engine whose backend runs them, and directly."""

from __future__ import annotations

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine import rank_runner
from hybridcache.engine.engine import LLMEngine
from hybridcache.kernels.attention.triton_backend import TritonAttention
from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.kernels.shapes import ModelShapes, UnsupportedModelError, check_cuda_model
from hybridcache.models import ModelConfig
from tests.engine.model_folders import write_tiny_model

CPU = EngineConfig(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64)


class CudaCheckedBackend(ReferenceBackend):
    """The reference kernels behind the CUDA backend's load-time check."""

    def check_model(self, shapes: ModelShapes) -> None:
        check_cuda_model(shapes, TritonAttention)


@pytest.fixture(scope="module")
def narrow_value_heads(tmp_path_factory):
    """A Qwen3-Next folder whose DeltaNet value heads are 24 wide (not a power of two)."""
    return write_tiny_model(tmp_path_factory.mktemp("dv24"), "qwen3_next", linear_value_head_dim=24)


@pytest.fixture(scope="module")
def wide_key_heads(tmp_path_factory):
    """A Qwen3-Next folder whose DeltaNet key heads are 320 wide: past fla's chunked prefill (at most 256)."""
    return write_tiny_model(tmp_path_factory.mktemp("dk320"), "qwen3_next", linear_key_head_dim=320)


def no_weights(*args, **kwargs):
    raise AssertionError("the weights were loaded before the shapes were checked")


def test_cuda_checks_refuse_a_320_wide_key_head_at_load(wide_key_heads, monkeypatch):
    assert ModelConfig.from_model_dir(wide_key_heads).gated_delta.k_head_dim == 320
    monkeypatch.setattr(rank_runner, "get_backend", lambda device, attention=None: CudaCheckedBackend())
    monkeypatch.setattr(rank_runner, "load_model", no_weights)
    with pytest.raises(UnsupportedModelError, match="the CUDA kernel backend cannot run this model: the DeltaNet "
                                                    "key head dim is 320, and fla's chunked prefill kernel takes at "
                                                    "most 256"):
        LLMEngine(wide_key_heads, CPU)


def test_cuda_checks_pass_a_24_wide_value_head(narrow_value_heads, monkeypatch):
    """The Triton decode step and verify kernels take any head dim (tiles padded to a power of two, the lanes past
    the dim masked): the model loads and serves behind the CUDA checks."""
    assert ModelConfig.from_model_dir(narrow_value_heads).gated_delta.v_head_dim == 24
    monkeypatch.setattr(rank_runner, "get_backend", lambda device, attention=None: CudaCheckedBackend())
    engine = LLMEngine(narrow_value_heads, CPU)
    engine.add_request("r", list(range(1, 40)))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].finished and outputs[0].outputs[0].token_ids
    engine.check_integrity()


def test_the_checks_name_every_reason():
    shapes = ModelShapes(attention_head_dim=320, rotary_dim=25, delta_key_head_dim=320, delta_value_head_dim=24,
                         num_experts=40_000)
    with pytest.raises(UnsupportedModelError) as refused:
        check_cuda_model(shapes, TritonAttention)
    message = str(refused.value)
    for reason in ("the DeltaNet key head dim is 320", "the rotary dim 25 must be even",
                   "40000 experts", "the attention head dim is 320, over 256: the Triton attention kernels' tiles"):
        assert reason in message
    assert "value head dim" not in message  # 24 is fine


def test_olmo_hybrid_7b_passes_the_cuda_checks():
    """Olmo-Hybrid-7B's shapes (transformers' `OlmoHybridConfig` defaults, which are the 7B's: hidden 3,840, 30
    heads, DeltaNet key / value head dims 96 / 192; no RoPE as released), through `model_shapes`."""
    import transformers

    raw = transformers.OlmoHybridConfig(rope_parameters={"rope_theta": None},
                                        architectures=["OlmoHybridForCausalLM"]).to_dict()
    shapes = rank_runner.model_shapes(ModelConfig.from_dict(raw))
    assert (shapes.attention_head_dim, shapes.delta_key_head_dim, shapes.delta_value_head_dim) == (128, 96, 192)
    check_cuda_model(shapes, TritonAttention)


def test_kimi_linear_48b_passes_the_cuda_checks():
    """Kimi-Linear-48B's MLA layers cache latent rows of 512 + 64 lanes (a kv head of 288, over the GQA kernels'
    256): they run `mla_attention`, so no attention head dim is judged; its KDA head dim 128 is."""
    from tests.models.kimi_helpers import released_kimi_config

    shapes = rank_runner.model_shapes(released_kimi_config())
    assert (shapes.attention_head_dim, shapes.rotary_dim, shapes.delta_key_head_dim) == (None, None, 128)
    check_cuda_model(shapes, TritonAttention)


def test_shapes_that_pass():
    check_cuda_model(ModelShapes(256, 64, 128, 128, num_experts=512), TritonAttention)
    for dim in (24, 80, 96, 192):  # any attention head dim up to 256 (tiles padded to a power of two)
        check_cuda_model(ModelShapes(dim, dim, None, None), TritonAttention)
    check_cuda_model(ModelShapes(None, None, 128, 128), TritonAttention)  # no attention layers
    check_cuda_model(ModelShapes(None, None, 20, 36), TritonAttention)  # any DeltaNet head dims ...
    check_cuda_model(ModelShapes(None, None, 256, 1000), TritonAttention)  # ... keys up to 256
    ReferenceBackend().check_model(ModelShapes(96, 25, 320, 24))  # the reference kernels run any shape


def test_model_shapes_from_config(narrow_value_heads):
    config = ModelConfig.from_model_dir(narrow_value_heads)
    shapes = rank_runner.model_shapes(config)
    assert shapes == ModelShapes(config.attention.head_dim, config.attention.rotary_dim,
                                 config.gated_delta.k_head_dim, 24, config.mlp.num_experts)
