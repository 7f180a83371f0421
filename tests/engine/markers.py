"""Markers of the engine tests."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# the engine on CUDA runs flash-linear-attention (the cuda extra) for its prefill chunks
needs_cuda_engine = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                                       reason="needs CUDA and the cuda extra")
