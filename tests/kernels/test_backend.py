"""The reference backend's batch-level ops against the per-sequence reference kernels, and the state pools
allocated from per-layer specs."""

from __future__ import annotations

import pytest
import torch

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.kernels.conv import reference as conv_ref
from hybridcache.kernels.gated_delta import reference as delta_ref
from hybridcache.state_spec import AttentionSpec, DevicePools, RecurrentSpec, StateTensorSpec

NUM_SLOTS = 6


def mixed_batch():
    """seq 0: fresh prefill of 7; seq 1: 1 token continuing 20; seq 2: 5 tokens continuing 9;
    seq 3: fresh single token; seq 4: 1 token continuing 3."""
    lengths = [(0, 7), (20, 1), (9, 5), (0, 1), (3, 1)]
    slots = [4, 0, 2, 5, 1]
    chunks = [
        SeqChunk(token_ids=[1] * n, start=start, block_ids=list(range(1, 4)), slot=slot)
        for (start, n), slot in zip(lengths, slots, strict=True)
    ]
    return build_forward_batch(chunks, block_size=16, kernel_block_size=16), lengths, slots


def test_ops_need_a_prepared_batch():
    batch, _, _ = mixed_batch()
    with pytest.raises(ValueError, match="prepare"):
        ReferenceBackend().causal_conv1d(torch.zeros(15, 4), torch.zeros(4, 4), None, torch.zeros(6, 4, 3), batch)


def test_recurrent_ops_equal_the_per_sequence_kernels():
    backend = ReferenceBackend()
    batch, lengths, slots = mixed_batch()
    batch = backend.prepare(batch)
    gen = torch.Generator().manual_seed(0)
    num_tokens, channels = batch.input_ids.shape[0], 6
    x = torch.randn(num_tokens, channels, generator=gen)
    weight, bias = torch.randn(channels, 4, generator=gen), torch.randn(channels, generator=gen)
    conv = torch.randn(NUM_SLOTS, channels, 3, generator=gen)
    q, k = torch.randn(2, num_tokens, 2, 8, generator=gen)
    v = torch.randn(num_tokens, 4, 8, generator=gen)
    g, beta = -torch.rand(num_tokens, 4, generator=gen), torch.rand(num_tokens, 4, generator=gen)
    ssm = torch.randn(NUM_SLOTS, 4, 8, 8, generator=gen)
    conv_before, ssm_before = conv.clone(), ssm.clone()

    conv_out = backend.causal_conv1d(x, weight, bias, conv, batch)
    delta_out = backend.gated_delta_rule(q, k, v, g, beta, ssm, batch)

    row = 0
    for (start, n), slot in zip(lengths, slots, strict=True):
        rows = slice(row, row + n)
        fresh = start == 0
        want, want_conv = conv_ref.causal_conv1d(x[rows], weight, bias, None if fresh else conv_before[slot])
        torch.testing.assert_close(conv_out[rows], want)
        torch.testing.assert_close(conv[slot], want_conv)
        want, want_ssm = delta_ref.recurrent_gated_delta_rule(
            q[rows], k[rows], v[rows], g[rows], beta[rows], None if fresh else ssm_before[slot]
        )
        torch.testing.assert_close(delta_out[rows], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ssm[slot], want_ssm, rtol=1e-4, atol=1e-5)
        row += n
    unused = 3  # the one slot no sequence uses is untouched
    assert torch.equal(conv[unused], conv_before[unused]) and torch.equal(ssm[unused], ssm_before[unused])


def test_pools_group_equal_specs_and_hand_each_layer_its_views():
    recurrent = RecurrentSpec(
        tensors=(
            StateTensorSpec(name="conv", shape=(12, 3), dtype=torch.bfloat16),
            StateTensorSpec(name="ssm", shape=(2, 4, 4), dtype=torch.float32),
        )
    )
    attention = AttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    pools = DevicePools.allocate(
        [recurrent, recurrent, attention, recurrent, attention], num_pages=10, kernel_block_size=4, num_slots=5
    )
    (kv,) = pools.kv_groups
    conv, ssm = pools.state_groups
    assert kv.shape == (2, 2, 10, 4, 2, 8) and kv.dtype == torch.bfloat16
    assert conv.shape == (3, 5, 12, 3) and conv.dtype == torch.bfloat16
    assert ssm.shape == (3, 5, 2, 4, 4) and ssm.dtype == torch.float32
    pools.layers[3]["ssm"][4].fill_(7.0)
    pools.layers[4][1, 9].fill_(3.0)
    assert bool((ssm[2, 4] == 7.0).all()) and int((ssm != 0).sum()) == 2 * 4 * 4
    assert bool((kv[1, 1, 9] == 3.0).all()) and int((kv != 0).sum()) == 4 * 2 * 8
    assert set(pools.layers[0]) == {"conv", "ssm"} and pools.kernel_block_size == 4
