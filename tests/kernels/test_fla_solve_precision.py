"""`gated_delta/fla.fla_chunk_forward` sets fla's fused triangular solve to IEEE fp32 before handing out fla's
forward (fla 0.6 names tf32 there on NVIDIA GPUs; docs/kernels.md), on a fake fla (`fake_fla.py`): the CUDA
effect, fp32 cached == uncached within 1e-4, is `tests/engine/test_cache_equivalence.py`'s CUDA test."""

from __future__ import annotations

import pytest

from hybridcache.kernels.gated_delta.fla import fla_chunk_forward
from tests.kernels.fake_fla import Constexpr, install_fake_fla


def forward(*args, **kwargs):
    raise AssertionError("not called here")


def test_the_solve_is_set_to_ieee_in_the_class_of_the_value_it_replaces_before_the_forward_is_handed_out(monkeypatch):
    chunk_fwd = install_fake_fla(monkeypatch, forward, precision="tf32")
    assert fla_chunk_forward() is forward
    setting = chunk_fwd.SOLVE_TRIL_DOT_PRECISION
    assert type(setting) is Constexpr and setting.value == "ieee"
    assert fla_chunk_forward() is forward and chunk_fwd.SOLVE_TRIL_DOT_PRECISION is setting  # set once, kept


def test_an_fla_without_the_setting_is_refused_rather_than_silently_left_in_tf32(monkeypatch):
    install_fake_fla(monkeypatch, forward, precision=None)
    with pytest.raises(ImportError, match="fla-core 0.6"):
        fla_chunk_forward()
