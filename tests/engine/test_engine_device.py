"""`engine_device`: "cuda" without an index becomes the current CUDA device, so that the engine (its vision tower,
the memory it measures at start) and tensor parallelism's rank 0, which counts from the index, name one device.
Before, "cuda" with a current device other than 0 put the vision tower there and rank 0 on cuda:0."""

from __future__ import annotations

import torch

from hybridcache.distributed.process_group import rank_device
from hybridcache.engine.rank_runner import engine_device


def test_cuda_without_an_index_is_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert engine_device("cuda") == torch.device("cuda", 3)
    assert [rank_device(engine_device("cuda"), r) for r in range(2)] == [torch.device("cuda", 3),
                                                                          torch.device("cuda", 4)]
    assert engine_device("cuda:1") == torch.device("cuda", 1)  # an explicit index is kept
    assert engine_device("cpu") == torch.device("cpu")


def test_without_cuda_the_name_is_kept_for_build_runner_to_refuse(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_device("cuda") == torch.device("cuda")
    assert engine_device("cpu") == torch.device("cpu")

