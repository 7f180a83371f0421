"""Attention backends are registered by name and chosen by name (`EngineConfig.attention_backend`,
`--attention-backend`): a trivial backend registered here runs an engine's forwards, and bad names are refused
before the weights load."""

from __future__ import annotations

import argparse
import random

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.engine_args import add_engine_args, engine_options
from hybridcache.kernels.attention import reference
from hybridcache.kernels.backend import ReferenceBackend, get_backend
from hybridcache.kernels.registry import ATTENTION
from hybridcache.sampling import SamplingParams
from tests.engine.model_folders import write_tiny_model


class RecordingAttention:
    """The trivial backend: the reference kernels, counting its calls and the steps it prepared."""

    graph_safe = False
    calls: dict[str, int] = {}

    def prepare(self, batch):
        RecordingAttention.calls["prepare"] = RecordingAttention.calls.get("prepare", 0) + 1
        return batch.num_seqs

    def write_kv(self, kv_layer, key, value, batch):
        reference.write_kv(kv_layer, key, value, batch.slot_mapping)

    def attention(self, query, kv_layer, batch, metadata, *, scale, kv_scales=(1.0, 1.0)):
        assert metadata == batch.num_seqs  # what prepare returned comes back with the prepared batch
        RecordingAttention.calls["attention"] = RecordingAttention.calls.get("attention", 0) + 1
        return reference.paged_attention(query, kv_layer, batch.block_tables, batch.cu_seqlens, batch.query_lens_cpu,
                                         batch.context_lens_cpu, scale=scale, kv_scales=kv_scales)


@pytest.fixture
def recording():
    ATTENTION.register("recording")(RecordingAttention)
    RecordingAttention.calls = {}
    yield RecordingAttention
    ATTENTION.unregister("recording")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(prompts))]


def test_a_registered_attention_backend_runs_the_engine_by_name(model_dir, recording):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (170, 153)]
    config = dict(block_size=16, max_num_seqs=2, max_num_batched_tokens=128)
    engine = LLMEngine(model_dir, EngineConfig(**config, attention_backend="recording"))
    assert isinstance(engine.runner.backend, ReferenceBackend)
    assert isinstance(engine.runner.backend.attention_backend, RecordingAttention)
    ours = generate(engine, prompts)
    assert recording.calls["prepare"] > 0 and recording.calls["attention"] > 0
    assert ours == generate(LLMEngine(model_dir, EngineConfig(**config)), prompts)


def test_the_default_attention_backend_is_chosen_per_device():
    assert ATTENTION.names[:2] == ("reference", "triton")  # "triton" registers without importing Triton
    assert type(get_backend("cpu").attention_backend).__name__ == "ReferenceAttention"


@pytest.mark.parametrize(("name", "message"), [
    ("flashinfer", r"unknown attention backend 'flashinfer'; registered: reference, triton"),
    ("triton", r"attention backend 'triton' runs on cuda devices, not cpu"),
])
def test_a_bad_attention_backend_name_is_refused_before_loading(model_dir, name, message, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the backend was checked")

    monkeypatch.setattr("hybridcache.engine.rank_runner.load_model", no_load)
    with pytest.raises(ValueError, match=message):
        LLMEngine(model_dir, EngineConfig(attention_backend=name))


def test_the_attention_backend_option_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_options(parser.parse_args(["--attention-backend", "reference"]))["attention_backend"] == "reference"
    assert engine_options(parser.parse_args([]))["attention_backend"] is None


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="already registered"):
        ATTENTION.register("reference")(RecordingAttention)
