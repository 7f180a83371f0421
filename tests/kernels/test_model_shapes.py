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


def test_cuda_checks_refuse_a_24_wide_value_head_at_load(narrow_value_heads, monkeypatch):
    assert ModelConfig.from_model_dir(narrow_value_heads).gated_delta.v_head_dim == 24
    monkeypatch.setattr(rank_runner, "get_backend", lambda device, attention=None: CudaCheckedBackend())

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the shapes were checked")

    monkeypatch.setattr(rank_runner, "load_model", no_weights)
    with pytest.raises(UnsupportedModelError, match="the CUDA kernel backend cannot run this model: the DeltaNet "
                                                    "value head dim is 24, and the Triton decode step needs a power "
                                                    "of two"):
        LLMEngine(narrow_value_heads, CPU)


def test_reference_backend_runs_the_same_model(narrow_value_heads):
    engine = LLMEngine(narrow_value_heads, CPU)
    engine.add_request("r", list(range(1, 40)))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].finished and outputs[0].outputs[0].token_ids
    engine.check_integrity()


def test_the_checks_name_every_reason():
    shapes = ModelShapes(attention_head_dim=96, rotary_dim=25, delta_key_head_dim=128, delta_value_head_dim=24,
                         num_experts=40_000)
    with pytest.raises(UnsupportedModelError) as refused:
        check_cuda_model(shapes, TritonAttention)
    message = str(refused.value)
    for reason in ("the DeltaNet value head dim is 24", "the rotary dim 25 must be even",
                   "40000 experts", "the attention head dim is 96"):
        assert reason in message
    assert "key head dim" not in message  # 128 is fine


def test_power_of_two_shapes_pass():
    check_cuda_model(ModelShapes(256, 64, 128, 128, num_experts=512), TritonAttention)
    check_cuda_model(ModelShapes(None, None, 128, 128), TritonAttention)  # no attention layers
    ReferenceBackend().check_model(ModelShapes(96, 25, 24, 24))  # the reference kernels run any shape


def test_model_shapes_from_config(narrow_value_heads):
    config = ModelConfig.from_model_dir(narrow_value_heads)
    shapes = rank_runner.model_shapes(config)
    assert shapes == ModelShapes(config.attention.head_dim, config.attention.rotary_dim,
                                 config.gated_delta.k_head_dim, 24, config.mlp.num_experts)
