"""Engine configuration: one frozen dataclass, validated before any memory is taken.

A leaf module: it imports nothing from the project, so every layer may read it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

# The cache modes (the `cache_mode` option); `scheduler.save_plan.POLICIES` maps each to its policy.
CACHE_MODES: tuple[str, ...] = ("none", "block-aligned", "seed", "hybridcache")
# The eviction policies (the `eviction` option), each mapped to the prefix cache's name for it.
EVICTION_POLICIES: dict[str, str] = {"lru": "lru", "flop-aware": "flop_aware"}
# Older spellings still accepted (and stored as the current one).
EVICTION_ALIASES: dict[str, str] = {"flop_aware": "flop-aware"}
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# vLLM's other spellings of `dtype`, stored as the name they stand for.
DTYPE_ALIASES: dict[str, str] = {"half": "float16", "float": "float32"}
# `device`: "cpu", "cuda" (the current CUDA device) or "cuda:N"; "auto" is resolved by LLM and the command line.
DEVICES: tuple[str, ...] = ("cpu", "cuda", "cuda:N")
# `quantization`: quantise a dense checkpoint's linears at load (vLLM's --quantization); FP8 checkpoints need none.
QUANTIZATIONS: tuple[str, ...] = ("fp8",)
# `kv_cache_dtype`: auto = the model dtype; fp8 (= fp8_e4m3, vLLM's spellings) stores KV as float8_e4m3fn.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3")
# `load_format`: auto reads the safetensors; dummy draws random weights on the device (vLLM's --load-format dummy).
LOAD_FORMATS: tuple[str, ...] = ("auto", "dummy")
# The option that sets the recurrent state's dtype, as vLLM spells it (`EngineConfig.mamba_ssm_cache_dtype`).
SSM_DTYPE_FLAG = "--mamba-ssm-cache-dtype"
# EngineConfig's sizes: positive integers; None (vLLM's "let the engine choose") is the default
_SIZES = ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
# Speculative methods (vLLM's `--speculative-config` "method"): all name the model's own MTP head.
SPECULATIVE_METHODS: tuple[str, ...] = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")


def _is_device(name: object) -> bool:
    """One of `DEVICES`: "cpu", "cuda" or "cuda:N" with N a non-negative integer."""
    if name in ("cpu", "cuda"):
        return True
    index = name.removeprefix("cuda:") if isinstance(name, str) and name.startswith("cuda:") else ""
    return index.isascii() and index.isdigit()


def is_integer(value: object) -> bool:
    """An int that is not a bool (a float such as 100.5 is no size, True is no count or token id; Python counts bools
    as ints). Shared by every check of user input that wants an integer."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with the model's multi-token-prediction head, configured as vLLM's
    `--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'`: each decode step of a sequence feeds
    its last token and up to k drafts the head proposed, and keeps the prefix the target model accepts.
    `disable_by_batch_size` (vLLM's key): with more unfinished sequences than this, steps neither draft nor verify
    (plain decode steps, which async scheduling may overlap); None: always speculate."""

    method: str = "mtp"
    num_speculative_tokens: int = 1
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)} (the model's MTP head)")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 8], got {k!r}")
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"disable_by_batch_size must be a positive integer or null, got {limit!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping | str | None) -> SpeculativeConfig | None:
        """A config from what users pass: None, a `SpeculativeConfig`, a dict, or its JSON text (the command
        line's). Unknown keys are a ValueError naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative config is not valid JSON: {error}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - {"method", "num_speculative_tokens", "disable_by_batch_size"})
        if unknown:
            raise ValueError(f"speculative config keys {unknown} are not supported (method, num_speculative_tokens, "
                             f"disable_by_batch_size)")
        if "method" not in value:
            raise ValueError("speculative config needs a 'method' (e.g. \"mtp\")")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    block_size: tokens per scheduler block (the unit of KV sharing). kernel_block_size: tokens per kernel page
    (a power of two dividing block_size; None at construction = the largest such power of two up to 64, e.g.
    64 for block_size 128, 16 for 48, resolved in `__post_init__`, so it is always an int afterwards).
    num_blocks: blocks in the one pool of the device, which holds KV and the prefix cache's checkpoint states (a
    state takes k blocks, `hybridcache.engine.memory.state_pages`; the cache decides what the pool holds). None =
    on the CPU enough for 2 x max_num_seqs sequences of max_model_len tokens plus 32 checkpoint states; on CUDA
    the rest of the memory budget, see `hybridcache.engine.memory`.
    host_cache_gib: a host-memory tier behind the pool, in GiB (0: none; pinned memory on CUDA): device eviction
    demotes blocks and checkpoint states there and a hit promotes them back (docs/cache.md, "The host tier"). Needs
    the prefix cache (`prefix_caching`): refused with enable_prefix_caching False or cache_mode "none".
    disk_cache_dir: a disk tier behind the host tier (None: none): what the host tier's own eviction drops is
    written there, per model, and found again by a later engine on the same model and directory; at most
    disk_cache_gib GiB of files (its least recently used states go first). Needs a host tier; one rank only
    (docs/cache.md, "The disk tier").
    max_num_seqs: running sequences at once (one runtime state slot each, the only state slots outside the pool).
    max_num_batched_tokens: the token budget of one forward step, at least max_num_seqs; long prompts are prefilled
    in chunks of at most this many tokens. max_model_len: prompt + output limit (None = the model's length,
    `ModelConfig.max_model_len`; capped at 8192 on the CPU, where the pool is sized per sequence, not from a memory
    budget).
    stream_interval: a request that is not FINAL_ONLY (a streamed one) gets its output at its first token, then
    once any of its completions has this many tokens more than its last output showed, and when one ends (vLLM's
    `--stream-interval`): a larger value builds and sends fewer outputs, less host work a step with many streams;
    its tokens are still timed every step (`LLMEngine.step_progress`). 1: every step.
    gpu_memory_utilization: on CUDA, the fraction of the device's memory the engine may use in all (weights,
    activations, KV blocks and state slots; None = 0.9), its own share whatever other processes hold (as vLLM's);
    unused on the CPU. enforce_eager: never capture CUDA
    graphs (decode steps are captured per batch-size bucket by default when the kernel backend supports it).
    async_scheduling: plan and queue step t+1 while the device runs step t (None = on for CUDA without tensor
    parallelism, off on the CPU, where it gains nothing, and under tensor parallelism, where it is asked for
    explicitly; `step()` then returns the outputs of the step before the one it launches; see
    `hybridcache.engine.engine`).
    tensor_parallel_size: ranks the model is split over (one process and one device each; CPU: gloo, CUDA:
    NCCL on N devices from the device's index on; "cuda" is the current device); the scheduler and the prefix
    cache run once, in the engine's process. See `hybridcache.distributed`.
    attention_backend: the attention kernels, by registered name (`hybridcache.kernels.registry.ATTENTION`:
    "reference", "triton"; None = per device: "triton" with the CUDA backend, else "reference"); an unknown name,
    or one not for the device, is refused when the engine is built, before the weights load.
    dtype: weights and activations (and the KV pool and the DeltaNet conv state). mamba_ssm_cache_dtype: the
    gated DeltaNet recurrent state `S` in the state slots (runtime and checkpoint ones), vLLM's option name;
    the kernels compute in fp32 and round to this dtype once per stored state (after each chunk of a prefill,
    after each decoded token). float32 (the default) keeps cached and uncached runs equal to float rounding;
    bfloat16 halves the state slot's dominant tensor (about 2x the checkpoint states per GiB) but makes results
    depend on where the state was rounded, i.e. on the chunking (docs/design.md, "Memory"). Both dtypes here are
    resolved names; "auto" is resolved by `LLM` and the command line (`engine_args.resolve_engine_config`).
    speculative_config: MTP speculative decoding (`SpeculativeConfig`, or a dict / JSON text of one, as vLLM's
    `speculative_config`); None = off. Steps that speculate run synchronously whatever `async_scheduling` says
    (only steps over `disable_by_batch_size` overlap); under tensor parallelism every rank holds its shard of the
    head and drafts in lock step. Not (yet) with decode-interval checkpoints; refused here. A kernel backend
    without verify kernels is refused at start-up.
    quantization: "fp8" quantises a dense checkpoint's linears to 128 x 128 block-scaled FP8 as they load (an FP8
    checkpoint is read in its own format without it). kv_cache_dtype: "auto" (the model dtype) or "fp8" / "fp8_e4m3"
    (the attention KV pool in float8_e4m3fn with a per-layer k/v scale from the checkpoint, else 1.0: half the
    bytes per block). load_format: "auto" (the safetensors) or "dummy" (random weights drawn on the device, for
    benchmarks; the folder needs only config.json and the tokenizer).
    seed: the engine's seed (vLLM's; None = 0, vLLM V1's default): every completion of a request without its own
    `SamplingParams.seed` samples from a generator seeded by the engine's next draw from this seed, so a run
    that adds the same requests in the same order samples the same tokens.
    tokenizer: a folder with the tokenizer (tokenizer.json, tokenizer_config.json) to use instead of the model
    folder's (vLLM's `tokenizer`; None = the model folder's).
    A bool option (enable_prefix_caching, enforce_eager, async_scheduling) given None takes its default; any
    other value that is not a bool is a ValueError (a string such as "no" is true in Python).
    """

    block_size: int = 64
    kernel_block_size: int | None = None
    num_blocks: int | None = None
    host_cache_gib: float = 0.0
    disk_cache_dir: str | None = None
    disk_cache_gib: float = 64.0
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    cache_mode: str = "hybridcache"
    decode_checkpoint_interval: int | None = None
    stream_interval: int = 1
    eviction: str = "lru"
    dtype: str = "float32"
    mamba_ssm_cache_dtype: str = "float32"
    device: str = "cpu"
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    attention_backend: str | None = None
    speculative_config: SpeculativeConfig | None = None
    seed: int = 0
    tokenizer: str | None = None

    @property
    def prefix_caching(self) -> bool:
        """The prefix cache keeps anything: enable_prefix_caching and a cache mode other than "none" (the scheduler,
        the host tier and the disk tier all read this one property)."""
        return self.enable_prefix_caching and self.cache_mode != "none"

    def _check_bools(self) -> None:
        """None takes the default (vLLM's `enable_prefix_caching=None` is on); anything else must be a bool."""
        for name, default in (("enable_prefix_caching", True), ("enforce_eager", False), ("async_scheduling", None)):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, default)
            elif not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None (the default), got {value!r}")

    def _check_host_tier(self) -> None:
        if not isinstance(self.host_cache_gib, (int, float)) or not 0 <= self.host_cache_gib < float("inf"):
            raise ValueError(f"host_cache_gib must be a finite number >= 0, got {self.host_cache_gib!r}")
        if self.host_cache_gib and not self.prefix_caching:
            without = ("enable_prefix_caching=False (--no-enable-prefix-caching)" if not self.enable_prefix_caching
                       else 'cache_mode "none" (--cache-mode none)')
            raise ValueError(f"host_cache_gib {self.host_cache_gib} (--host-cache-gib / --kv-offloading-size / "
                             f"--hicache-size): a host tier keeps what the prefix cache evicts, and {without} keeps "
                             "nothing; drop the host tier or turn the prefix cache on")

    def _check_disk_tier(self) -> None:
        if self.disk_cache_dir is None:
            return
        if not isinstance(self.disk_cache_gib, (int, float)) or not 0 < self.disk_cache_gib < float("inf"):
            raise ValueError(f"disk_cache_gib must be a finite number > 0, got {self.disk_cache_gib!r}")
        refused = [what for what, on in (
            ("without a host tier (host_cache_gib 0): the disk tier keeps what falls out of it",
             not self.host_cache_gib),
            ("without the prefix cache (enable_prefix_caching False or cache_mode none)", not self.prefix_caching),
            ("with tensor parallelism", self.tensor_parallel_size != 1)) if on]
        if refused:
            raise ValueError(f"disk_cache_dir (a disk tier) is not supported {'; nor '.join(refused)}")

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.speculative_config is not None and self.decode_checkpoint_interval is not None:
            raise ValueError("speculative decoding is not supported with decode_checkpoint_interval")
        for name in _SIZES:
            if getattr(self, name) is None:  # vLLM's None for these: let the engine choose (the default)
                object.__setattr__(self, name, type(self).__dataclass_fields__[name].default)
        if self.kernel_block_size is None and isinstance(self.block_size, int) and self.block_size > 0:
            largest_power_of_two_divisor = self.block_size & -self.block_size
            object.__setattr__(self, "kernel_block_size", min(largest_power_of_two_divisor, 64))
        object.__setattr__(self, "eviction", EVICTION_ALIASES.get(self.eviction, self.eviction))
        if type(self.dtype).__name__ == "dtype":  # a torch.dtype, as vLLM takes it (this module imports no torch)
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        self._check_bools()
        if self.seed is None:
            object.__setattr__(self, "seed", 0)
        if not is_integer(self.seed):
            raise ValueError(f"seed must be an integer or None (0), got {self.seed!r}")
        if not _is_device(self.device):
            raise ValueError(f"device must be one of {', '.join(DEVICES)} ('auto' is resolved by LLM and the command "
                             f"line), got {self.device!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError(f"tokenizer must be a folder name (str) or None, got {self.tokenizer!r}")
        for name in _SIZES:
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:  # vLLM's rule: a step must fit one token of each
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or equal "
                             f"to max_num_seqs ({self.max_num_seqs})")
        kbs = self.kernel_block_size
        if not is_integer(kbs) or kbs < 1 or kbs & (kbs - 1) or self.block_size % kbs:
            raise ValueError(
                f"kernel_block_size must be a power of two that divides block_size {self.block_size}, got {kbs}"
            )
        utilization = self.gpu_memory_utilization
        if utilization is not None and not (isinstance(utilization, (int, float)) and 0 < utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        if self.num_blocks is not None and not (is_integer(self.num_blocks) and self.num_blocks >= 1):
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"unknown cache mode {self.cache_mode!r}; choose one of {', '.join(CACHE_MODES)}")
        self._check_host_tier()
        self._check_disk_tier()
        if self.max_model_len is not None and not (is_integer(self.max_model_len) and self.max_model_len >= 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction!r}")
        if not is_integer(self.stream_interval) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be a positive integer, got {self.stream_interval!r}")
        interval = self.decode_checkpoint_interval
        if interval is not None and (not is_integer(interval) or interval < 1 or interval % self.block_size):
            raise ValueError(f"decode_checkpoint_interval must be a multiple of block_size, got {interval}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16 (or half, float), got {self.dtype!r} "
                             "('auto' is resolved by LLM and the command line, see engine_args.resolve_engine_config)")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.mamba_ssm_cache_dtype not in DTYPES:
            raise ValueError(
                f"mamba_ssm_cache_dtype ({SSM_DTYPE_FLAG}) must be float32, bfloat16 or float16, got "
                f"{self.mamba_ssm_cache_dtype!r} ('auto' is resolved by LLM and the command line, see "
                "engine_args.resolve_engine_config)"
            )

    @property
    def kv_fp8(self) -> bool:
        """The KV pool stores float8_e4m3fn."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def pages_per_block(self) -> int:
        """Kernel pages per scheduler block: block_size // kernel_block_size."""
        return self.block_size // self.kernel_block_size
