"""Shared helpers for the model tests: a transformers model and ours with the same random weights, and a
paged runner that feeds our model ForwardBatches the way the engine does.

Relative error throughout: rel_err(a, ref) = max|a - ref| / max|ref| (over all compared logits).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.backend import KernelBackend, ReferenceBackend
from hybridcache.models import ModelConfig, get_model_class, load_weights
from hybridcache.models.hybrid_lm import HybridCausalLM
from hybridcache.models.random_weights import randomize_, tiny_hf_config
from hybridcache.state_spec import DevicePools

MODEL_TYPES = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")
TOLERANCE = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@dataclass
class ModelPair:
    """A tiny transformers model and our model holding the same weights (fp32, eval)."""

    hf_config: object
    hf: torch.nn.Module
    ours: HybridCausalLM

    @torch.no_grad()
    def hf_logits(self, token_ids: list[int]) -> torch.Tensor:
        """transformers' full forward over one sequence: logits [len(token_ids), vocab]."""
        ids = torch.tensor([token_ids])
        positions = torch.arange(len(token_ids))[None]
        return self.hf(input_ids=ids, position_ids=positions, use_cache=False).logits[0].float()


def make_pair(model_type: str, seed: int = 0, **overrides) -> ModelPair:
    import transformers

    hf_config = tiny_hf_config(model_type, **overrides)
    torch.manual_seed(seed)
    hf = getattr(transformers, hf_config.architectures[0])(hf_config).eval()
    randomize_(hf, seed)
    raw = hf_config.to_dict()
    ours = get_model_class(hf_config.architectures[0])(ModelConfig.from_dict(raw))
    load_weights(ours, hf.state_dict())
    return ModelPair(hf_config, hf, ours)


def random_tokens(length: int, seed: int, vocab: int = 256) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


@dataclass
class PagedRunner:
    """Runs our model step by step over several sequences, each with its own (shuffled, distinct) blocks
    and its own state slot, through `build_forward_batch` exactly as the engine does."""

    model: HybridCausalLM
    block_size: int
    kernel_block_size: int
    max_len: int = 512
    max_seqs: int = 4
    seed: int = 0
    pools: DevicePools = field(init=False)
    backend: KernelBackend = field(init=False, default_factory=ReferenceBackend)
    blocks: dict[int, list[int]] = field(init=False, default_factory=dict)
    slots: dict[int, int] = field(init=False, default_factory=dict)
    fed: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        blocks_per_seq = -(-self.max_len // self.block_size)
        num_blocks = blocks_per_seq * self.max_seqs + 1
        rng = random.Random(self.seed)
        free = list(range(1, num_blocks))  # block 0 is never used: padding in block tables reads it
        rng.shuffle(free)
        slot_ids = list(range(self.max_seqs + 1))
        rng.shuffle(slot_ids)
        for seq in range(self.max_seqs):
            self.blocks[seq] = free[seq * blocks_per_seq : (seq + 1) * blocks_per_seq]
            self.slots[seq] = slot_ids[seq]
            self.fed[seq] = 0
        self.pools = DevicePools.allocate(
            self.model.state_specs(torch.float32, torch.float32),
            num_pages=num_blocks * (self.block_size // self.kernel_block_size),
            kernel_block_size=self.kernel_block_size,
            num_slots=self.max_seqs + 1,
        )
        # garbage everywhere: a fresh sequence must not read its slot, attention must not read stale KV
        generator = torch.Generator().manual_seed(self.seed + 1)
        for pool in (*self.pools.kv_groups, *self.pools.state_groups):
            pool.copy_(torch.randn(pool.shape, generator=generator))

    def batch_for(self, feeds: list[tuple[int, list[int]]]) -> ForwardBatch:
        """The ForwardBatch feeding `(seq, new tokens)` pairs, prepared by the backend; marks the tokens as fed."""
        chunks = []
        for seq, tokens in feeds:
            end = self.fed[seq] + len(tokens)
            needed = -(-end // self.block_size)
            chunks.append(SeqChunk(tokens, self.fed[seq], self.blocks[seq][:needed], self.slots[seq]))
            self.fed[seq] = end
        batch = build_forward_batch(chunks, block_size=self.block_size, kernel_block_size=self.kernel_block_size)
        return self.backend.prepare(batch)

    def step(self, feeds: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Feed `(seq, new tokens)` pairs in one ForwardBatch; returns each feed's logits [len(tokens), vocab]
        (logits are requested at every row, not only at each sequence's last token)."""
        batch = self.batch_for(feeds)
        every_row = torch.arange(batch.input_ids.shape[0])
        logits = self.model(dataclasses.replace(batch, logits_indices=every_row), self.pools, self.backend)
        bounds = batch.cu_seqlens.tolist()
        return [logits[bounds[i] : bounds[i + 1]] for i in range(len(feeds))]
