"""`embedding(num_embeddings, embedding_dim)`: an `nn.Embedding` that draws no initial weights on the meta device.

The loader builds every model (and vision tower) under `torch.device("meta")`, then allocates it and loads its
weights, so a meta module's initial values are never read. `nn.Embedding` still draws them (`normal_`), and on a
meta tensor torch runs its Python reference of `normal_`, whose first call imports `torch._dynamo`: ~1.3 s of every
process that builds a model (a server's start-up, each tensor-parallel worker's), nothing else in them imports it.
Built on another device (tests build towers and models on the CPU and run them), it is `nn.Embedding` as torch
initialises it."""

from __future__ import annotations

import torch
from torch import nn


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An `nn.Embedding` [num_embeddings, embedding_dim] on the default device; uninitialised there when that is
    the meta device (module docstring), initialised as torch does elsewhere."""
    if torch.get_default_device().type == "meta":
        weight = torch.empty(num_embeddings, embedding_dim)
        return nn.Embedding(num_embeddings, embedding_dim, _weight=weight)
    return nn.Embedding(num_embeddings, embedding_dim)
