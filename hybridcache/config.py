"""Engine configuration: one frozen dataclass, validated before any memory is taken."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    block_size: tokens per scheduler block (the unit of KV sharing). kernel_block_size: tokens per kernel page
    (divides block_size; None = min(block_size, 64)). num_blocks: KV blocks in the pool (None = enough for
    max_num_seqs sequences of max_model_len tokens, plus as many again for the prefix cache).
    max_num_seqs: running sequences at once (one runtime state slot each). num_checkpoint_slots: extra state
    slots for prefix-cache checkpoints. max_num_batched_tokens: the token budget of one forward step; long
    prompts are prefilled in chunks of at most this many tokens. max_model_len: prompt + output limit
    (None = the model's max_position_embeddings, capped at 8192).
    """

    block_size: int = 64
    kernel_block_size: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 16
    num_checkpoint_slots: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    cache_mode: str = "hybridcache"
    decode_checkpoint_interval: int | None = None
    eviction: str = "lru"
    dtype: str = "float32"
    state_dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_checkpoint_slots < 0:
            raise ValueError(f"num_checkpoint_slots must be >= 0, got {self.num_checkpoint_slots}")
        kbs = self.page_size
        if kbs < 1 or kbs & (kbs - 1) or self.block_size % kbs:
            raise ValueError(
                f"kernel_block_size must be a power of two that divides block_size {self.block_size}, got {kbs}"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        from hybridcache.scheduler.save_plan import checkpoint_policy

        checkpoint_policy(self.cache_mode)  # unknown modes raise, listing the known ones
        if self.eviction not in ("lru", "flop_aware"):
            raise ValueError(f"eviction must be 'lru' or 'flop_aware', got {self.eviction!r}")
        interval = self.decode_checkpoint_interval
        if interval is not None and (interval < 1 or interval % self.block_size):
            raise ValueError(f"decode_checkpoint_interval must be a multiple of block_size, got {interval}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.state_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"state_dtype must be float32, bfloat16 or float16, got {self.state_dtype!r}")

    @property
    def page_size(self) -> int:
        """The kernel block size actually used."""
        return self.kernel_block_size if self.kernel_block_size is not None else min(self.block_size, 64)
