"""Scaled RoPE (rope_type "yarn", "linear", "llama3" in config.json): the parse of both layouts, the refusals, the
inverse frequencies against transformers' models, and our logits against transformers' (tiny random models, fp32,
positions past original_max_position_embeddings, as tests/models/test_equivalence.py)."""

from __future__ import annotations

import pytest
import torch

from hybridcache.layers.rotary import mrope_cos_sin, rotary_cos_sin, scaled_inv_freq
from hybridcache.models import ModelConfig
from hybridcache.models.config import AttentionConfig

from .helpers import TOLERANCE, PagedRunner, make_pair, random_tokens, rel_err
from .test_config import base_dict

# original_max_position_embeddings 64: the 157-token sequences below run past it (max_position_embeddings 256)
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}
MAX_POSITIONS = 256


def attention_of(hf_config) -> AttentionConfig:
    """Our attention group of a transformers config."""
    return ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["X"], "vocab_size": 10}).attention


def rope_parameters(kind: str, **more) -> dict:
    return {**SCALINGS[kind], "rope_theta": 10000.0, "partial_rotary_factor": 0.25, **more}


@pytest.fixture(scope="module", params=[(m, k) for m in ("qwen3_next", "qwen3_5_text") for k in SCALINGS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request):
    model_type, kind = request.param
    return make_pair(model_type, rope_parameters=rope_parameters(kind), max_position_embeddings=MAX_POSITIONS)


def test_prefill_in_chunks_then_decode_match_transformers(pair):
    tokens = random_tokens(157, seed=1)
    ref = pair.hf_logits(tokens)
    runner = PagedRunner(pair.ours, 16, 8)
    start = 0
    for length in (50, 100, 1, 1, 1, 1, 1, 1, 1):  # the second chunk crosses position 64; then decodes
        (ours,) = runner.step([(0, tokens[start : start + length])])
        assert rel_err(ours, ref[start : start + length]) <= TOLERANCE, f"tokens {start}..{start + length}"
        start += length


def test_the_comparison_notices_plain_rope(pair):
    """Sanity check: transformers' logits of the same weights with plain RoPE part far beyond the tolerance, so
    a scaling dropped on our side would not go unnoticed."""
    import transformers

    tokens = random_tokens(157, seed=1)
    plain_config = type(pair.hf_config)(**{**pair.hf_config.to_dict(),
                                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.25}})
    plain = getattr(transformers, pair.hf_config.architectures[0])(plain_config).eval()
    plain.load_state_dict(pair.hf.state_dict())
    with torch.no_grad():
        plain_logits = plain(input_ids=torch.tensor([tokens]), position_ids=torch.arange(len(tokens))[None],
                             use_cache=False).logits[0]
    assert rel_err(plain_logits, pair.hf_logits(tokens)) > 100 * TOLERANCE


@pytest.mark.parametrize("kind", SCALINGS)
@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_inverse_frequencies_and_scaling_are_transformers_models(model_type, kind):
    """Ours (a plain PretrainedConfig of the rotated width) equal the real config class's rotary embedding."""
    import transformers

    cls = {"qwen3_next": transformers.Qwen3NextConfig, "qwen3_5_text": transformers.Qwen3_5TextConfig}[model_type]
    hf_config = cls(head_dim=32, hidden_size=64, num_attention_heads=4, max_position_embeddings=MAX_POSITIONS,
                    rope_parameters=rope_parameters(kind))
    rotary_cls = {"qwen3_next": transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRotaryEmbedding,
                  "qwen3_5_text": transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding}
    hf_rotary = rotary_cls[model_type](hf_config)
    attention = attention_of(hf_config)
    inv_freq, attention_scaling = scaled_inv_freq(attention.rotary_dim, attention.rope_theta, attention.rope_scaling,
                                                  attention.max_position_embeddings)
    assert torch.equal(inv_freq, hf_rotary.inv_freq) and attention_scaling == hf_rotary.attention_scaling
    assert (attention_scaling > 1.0) == (kind == "yarn")


def test_mrope_with_yarn_matches_transformers_qwen3_5_rotary_embedding():
    """Image tokens' 3-D positions: M-RoPE mixes the YaRN frequencies per axis, and cos/sin carry its factor."""
    import transformers

    rope = rope_parameters("yarn", mrope_section=[2, 1, 1], mrope_interleaved=True)
    hf_config = transformers.Qwen3_5TextConfig(head_dim=32, hidden_size=64, num_attention_heads=4,
                                               max_position_embeddings=MAX_POSITIONS, rope_parameters=rope)
    hf_rotary = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(hf_config)
    attention = attention_of(hf_config)
    positions = torch.randint(0, 200, (3, 40), generator=torch.Generator().manual_seed(0))
    want_cos, want_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[:, None])
    got = mrope_cos_sin(positions, attention.rotary_dim, attention.rope_theta, attention.mrope_section,
                        torch.float32, attention.rope_scaling, attention.max_position_embeddings)
    assert torch.equal(got[0], want_cos[0]) and torch.equal(got[1], want_sin[0])
    text = positions[:1].expand(3, -1)  # equal axes: plain (scaled) RoPE
    assert all(torch.equal(a, b) for a, b in zip(
        mrope_cos_sin(text, attention.rotary_dim, attention.rope_theta, attention.mrope_section, torch.float32,
                      attention.rope_scaling, attention.max_position_embeddings),
        rotary_cos_sin(text[0], attention.rotary_dim, attention.rope_theta, torch.float32, attention.rope_scaling,
                       attention.max_position_embeddings), strict=True))


def test_both_layouts_parse_to_the_same_scaling():
    """transformers-5 `rope_parameters` and the older top-level `rope_scaling` with "type" (rope_theta and
    partial_rotary_factor beside it) give one AttentionConfig; keys are kept as written, sorted."""
    newer = ModelConfig.from_dict(base_dict(max_position_embeddings=1024, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 5000.0,
        "partial_rotary_factor": 0.5, "beta_fast": 16}))
    older = ModelConfig.from_dict(base_dict(max_position_embeddings=1024, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16}))
    assert newer.attention == older.attention
    assert newer.attention.rope_scaling == (("beta_fast", 16), ("factor", 4.0),
                                            ("original_max_position_embeddings", 256), ("rope_type", "yarn"))
    assert (newer.attention.rope_theta, newer.attention.rotary_dim, newer.attention.max_position_embeddings) == (
        5000.0, 16, 1024)
    assert hash(newer.attention) == hash(older.attention)  # frozen values only
    assert ModelConfig.from_dict(base_dict()).attention.rope_scaling == ()  # plain RoPE
    assert ModelConfig.from_dict(base_dict(rope_scaling={"rope_type": "default"})).attention.rope_scaling == ()


def test_older_layout_gives_transformers_frequencies():
    """The older layout read by transformers' own config class and by us: the same frequencies and factor."""
    import transformers

    raw = base_dict(max_position_embeddings=1024, rope_scaling={"type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 256})
    hf_rotary = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRotaryEmbedding(
        transformers.Qwen3NextConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    attention = ModelConfig.from_dict(raw).attention
    inv_freq, attention_scaling = scaled_inv_freq(attention.rotary_dim, attention.rope_theta, attention.rope_scaling,
                                                  attention.max_position_embeddings)
    assert torch.equal(inv_freq, hf_rotary.inv_freq) and attention_scaling == hf_rotary.attention_scaling


def test_original_max_position_embeddings_defaults_as_in_transformers():
    """Left out: max_position_embeddings (transformers' standardize_rope_params); at the top level: that value."""
    rope = {"rope_type": "yarn", "factor": 2.0}
    left_out = ModelConfig.from_dict(base_dict(max_position_embeddings=512, rope_scaling=rope)).attention
    assert dict(left_out.rope_scaling)["original_max_position_embeddings"] == 512
    top = ModelConfig.from_dict(base_dict(max_position_embeddings=512, original_max_position_embeddings=128,
                                          rope_scaling={**rope, "original_max_position_embeddings": 64})).attention
    assert dict(top.rope_scaling)["original_max_position_embeddings"] == 128
    linear = ModelConfig.from_dict(base_dict(rope_scaling={"rope_type": "linear", "factor": 2.0})).attention
    assert linear.rope_scaling == (("factor", 2.0), ("rope_type", "linear"))


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "config.json rope_type 'dynamic' rescales with the sequence length"),
    ({"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
     "config.json rope_type 'longrope' rescales with the sequence length"),
    ({"rope_type": "proportional"}, "config.json rope_type 'proportional' rotates the whole head"),
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, "config.json rope_type 'ntk-by-parts' is unknown"),
    ({"rope_type": "linear"}, "config.json rope_parameters factor None"),
    ({"rope_type": "yarn", "factor": 0}, "config.json rope_parameters factor 0"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "config.json rope_parameters low_freq_factor"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": "64"},
     "original_max_position_embeddings '64'"),
    ({"rope_type": "yarn", "factor": 2.0, "beta_fast": {"a": 1}}, "config.json rope_parameters beta_fast"),
])
@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_unsupported_or_malformed_scaling_is_a_value_error_naming_config_json(field, rope, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ModelConfig.from_dict(base_dict(**{field: rope}))


def test_the_scaled_table_is_kept_and_never_copied_inside_a_cuda_graph_capture(monkeypatch):
    """The table is built once per device and kept (a step only multiplies); a capture that would have to copy it
    from the host (the engine's eager warm-up runs always build it first) is a RuntimeError, not a broken graph."""
    from hybridcache.layers import rotary

    scaling = (("factor", 3.0), ("original_max_position_embeddings", 48), ("rope_type", "yarn"))
    first = rotary.rope_table(8, 1000.0, torch.device("cpu"), scaling, MAX_POSITIONS)
    assert rotary.rope_table(8, 1000.0, torch.device("cpu"), scaling, MAX_POSITIONS)[0] is first[0]
    inv_freq, attention_scaling = scaled_inv_freq(8, 1000.0, scaling, MAX_POSITIONS)
    assert torch.equal(first[0], torch.cat((inv_freq, inv_freq))) and first[1] == attention_scaling > 1.0
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before a CUDA graph capture"):
        rotary.rope_table(8, 1000.0, torch.device("cuda", 0), scaling, MAX_POSITIONS)
