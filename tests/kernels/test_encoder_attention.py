"""Encoder attention (bidirectional within each segment of a packed batch; the vision tower's): the registry and
the choice per device, the reference against a dense block-diagonal attention, and "flash_varlen" against the
reference.

- On the CPU: the reference backend equals softmax(q k^T / sqrt(D) + block-diagonal mask) v computed densely in
  fp64; "flash_varlen" is refused off CUDA and for dtypes / head dims FlashAttention cannot run; its glue (segment
  offsets, longest segment, the call) runs with `varlen_attn` replaced by the dense fp64 oracle, which checks the
  arguments it is given.
- On CUDA (skipped without one): "flash_varlen" against the fp32 reference on the same bf16 inputs (segments of 1
  to 1,764 rows, 9B-tower head dim 72), and a 9B-shaped 2-block tower with several images in one call against
  each image alone and against the fp32 tower. Tolerances: bf16 output rounded once and FlashAttention's bf16
  probabilities, as for the paged attention kernels (tests/kernels/test_cuda_kernels.py): norm_rel 1e-2, max_rel
  2e-2; a tower of 2 blocks rounds its activations to bf16 at every op: 3e-2 / 6e-2 against fp32.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridcache.kernels.encoder_attention import default_encoder_attention
from hybridcache.kernels.encoder_attention.flash_varlen import VarlenMetadata
from hybridcache.kernels.registry import ENCODER_ATTENTION
from hybridcache.models.vision import VisionTower
from hybridcache.models.vision_config import VisionConfig
from hybridcache.models.vl_folders import TINY_VISION

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LENGTHS = [1, 7, 64, 33, 130]


def dense_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v in fp64 over all N rows at once, the mask -inf across segments."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = torch.where(segment[:, None] == segment[None, :], 0.0, -math.inf).double()
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k.double()) / math.sqrt(q.shape[-1]) + mask
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v.double())


def qkv(lengths: list[int], heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return [torch.randn(n, heads, head_dim, generator=generator).to(device, dtype) for _ in range(3)]


def rel_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(norm_rel, max_rel) of out against ref."""
    diff = (out.double() - ref.double())
    return (diff.norm() / ref.double().norm()).item(), (diff.abs().max() / ref.double().abs().max()).item()


def vision_config(**overrides) -> VisionConfig:
    raw = {**TINY_VISION, "out_hidden_size": 48, **overrides}
    return VisionConfig.from_dict({"vision_config": raw})


def random_tower(config: VisionConfig, dtype: torch.dtype = torch.float32, device: str = "cpu") -> VisionTower:
    from hybridcache.models.random_weights import randomize_

    tower = VisionTower(config)
    randomize_(tower, seed=5)
    return tower.to(device, dtype)


def test_registry_names_and_device_choice():
    assert {"reference", "flash_varlen"} <= set(ENCODER_ATTENTION.names)
    assert default_encoder_attention("cpu", torch.bfloat16, 72) == "reference"
    assert default_encoder_attention("cuda", torch.float32, 72) == "reference"  # FlashAttention: fp16 / bf16
    assert default_encoder_attention("cuda", torch.bfloat16, 12) == "reference"  # head dim not a multiple of 8
    has_varlen = not ENCODER_ATTENTION.create("flash_varlen", "cuda").problems(72, torch.bfloat16)
    assert default_encoder_attention("cuda", torch.bfloat16, 72) == ("flash_varlen" if has_varlen else "reference")
    with pytest.raises(ValueError, match="runs on cuda"):
        ENCODER_ATTENTION.create("flash_varlen", "cpu")


@pytest.mark.parametrize(("head_dim", "dtype", "problem"), [
    (72, torch.float32, "float16 or bfloat16"), (12, torch.bfloat16, "multiple of 8"), (264, torch.float16, "256"),
])
def test_flash_varlen_names_what_it_cannot_run(head_dim, dtype, problem):
    problems = ENCODER_ATTENTION.create("flash_varlen", "cuda").problems(head_dim, dtype)
    assert any(problem in p for p in problems), problems


def test_reference_equals_dense_block_diagonal_attention():
    backend = ENCODER_ATTENTION.create("reference", "cpu")
    q, k, v = qkv(LENGTHS, heads=3, head_dim=16, dtype=torch.float32)
    out = backend.attention(q, k, v, backend.prepare(LENGTHS, torch.device("cpu")))
    assert out.shape == q.shape
    norm_rel, max_rel = rel_errors(out, dense_oracle(q, k, v, LENGTHS))
    assert max_rel <= 1e-5, (norm_rel, max_rel)


def test_tower_refuses_a_backend_its_device_cannot_run():
    tower = random_tower(vision_config())
    with pytest.raises(ValueError, match="runs on cuda"):
        tower.use_attention("flash_varlen")
    with pytest.raises(ValueError, match="unknown encoder attention backend 'nope'"):
        tower.use_attention("nope")
    assert tower.attention_name == "reference"


def test_flash_varlen_glue_with_the_oracle_in_place_of_flash_attention(monkeypatch):
    """prepare's offsets and longest segment, and what attention passes to varlen_attn, run on the CPU: the oracle
    stands in for the CUDA kernel, checks its arguments, and the tower's output equals the reference tower's."""
    import torch.nn.attention.varlen as varlen

    calls = []

    def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k):
        assert cu_q is cu_k and cu_q.dtype == torch.int32
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        assert cu_q[0] == 0 and cu_q[-1] == q.shape[0] and max_q == max_k == max(lengths)
        assert all(t.is_contiguous() and t.shape == q.shape for t in (q, k, v))
        calls.append(lengths)
        return dense_oracle(q, k, v, lengths).to(q.dtype)

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen_attn)
    config = vision_config()
    reference = random_tower(config)
    flash = random_tower(config)
    flash.attention = ENCODER_ATTENTION.create("flash_varlen", "cuda")  # (its kernel is the oracle here)
    grids = [(1, 6, 10), (2, 4, 6), (1, 2, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), config.patch_dim)
    want, got = reference(pixels, grids), flash(pixels, grids)
    assert calls == [[60, 24, 24, 4]] * config.depth  # one call per block over every frame of every image
    for g, w in zip(got, want, strict=True):
        assert rel_errors(g, w)[1] <= 1e-5
    meta = ENCODER_ATTENTION.create("flash_varlen", "cuda").prepare([3, 1, 5], torch.device("cpu"))
    assert isinstance(meta, VarlenMetadata) and meta.cu_seqlens.tolist() == [0, 3, 4, 9] and meta.max_len == 5


@needs_cuda
@pytest.mark.parametrize("lengths", [[1764], [196] * 8, [1, 17, 64, 65, 196, 1764, 3]], ids=["1x1764", "8x196", "mix"])
def test_cuda_flash_varlen_matches_reference(lengths):
    device = torch.device("cuda")
    flash = ENCODER_ATTENTION.create("flash_varlen", "cuda")
    reference = ENCODER_ATTENTION.create("reference", "cuda")
    q, k, v = qkv(lengths, heads=16, head_dim=72, dtype=torch.bfloat16, device="cuda")
    out = flash.attention(q, k, v, flash.prepare(lengths, device))
    ref = reference.attention(q.float(), k.float(), v.float(), reference.prepare(lengths, device))
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    norm_rel, max_rel = rel_errors(out, ref)
    assert norm_rel <= 1e-2 and max_rel <= 2e-2, (norm_rel, max_rel)


@needs_cuda
def test_cuda_tower_with_flash_varlen():
    """A 9B-width tower of 2 blocks: images batched in one call equal each image alone (nothing crosses images),
    and the bf16 flash tower is within bf16 tolerance of the fp32 reference tower."""
    config = vision_config(hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16,
                           num_position_embeddings=2304, out_hidden_size=4096)
    fp32 = random_tower(config, torch.float32, "cuda")
    bf16 = random_tower(config, torch.bfloat16, "cuda")
    bf16.use_attention(None)  # the device's default
    assert bf16.attention_name == "flash_varlen"
    grids = [(1, 28, 28), (1, 84, 84), (1, 14, 40), (2, 28, 28)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), config.patch_dim, device="cuda")
    together = bf16(pixels, grids)
    alone = [bf16(p, [g]) for p, g in zip(pixels.split([t * h * w for t, h, w in grids]), grids, strict=True)]
    want = fp32(pixels, grids)
    for got, single, ref in zip(together, alone, want, strict=True):
        assert rel_errors(got, single[0])[1] <= 2e-2
        norm_rel, max_rel = rel_errors(got, ref)
        assert norm_rel <= 3e-2 and max_rel <= 6e-2, (norm_rel, max_rel)
