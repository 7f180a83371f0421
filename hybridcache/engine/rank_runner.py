"""One rank's model, memory plan and `ModelRunner` (with tensor_parallel_size 1: the engine's only one).

Every rank runs `build_runner` with the same `RunnerSpec`: it loads the rank's shard of the weights, measures its
memory budget (CUDA), lets `agree` turn that into the budget every rank uses (the minimum over the ranks, so
every rank's pools have the same block and slot counts: the scheduler's ids are valid on all of them), plans the
pools and allocates them, and the host tier's pool of its shard when there is one (`host_tier_blocks`: the same
block count on every rank). The CPU has no budget: the pool sizes follow from the config alone.

Each rank plans from its own shard's bytes: P (a KV block of its kv heads) and S (a runtime slot of its
DeltaNet heads, plus the unsharded `last_hidden`). Heads are split evenly (`TensorParallel.split_heads`), so
every rank's P, S, and plan are the driver's; each rank still checks that its checkpoint state fits the plan's
k pages (S_rank <= k x P_rank), since the cache's page ids are the same on all ranks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.memory import MemoryPlan, engine_share, plan_memory, pool_bytes, state_pages
from hybridcache.engine.runner import ModelRunner, measure_activation_bytes
from hybridcache.kernels.backend import KernelBackend, get_backend
from hybridcache.kernels.parallel_compile import parallel_compiles
from hybridcache.kernels.shapes import MLAShapes, ModelShapes
from hybridcache.layers.parallel import UNSHARDED, TensorParallel
from hybridcache.models import ModelConfig, load_model
from hybridcache.models.mtp import check_mtp_head, load_mtp_head
from hybridcache.scheduler.scheduler import blocks_per_sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_CHECKPOINT_STATES = 32


# CUDA graphs under tensor parallelism (captured NCCL collectives) are built but have not run on a GPU yet: True
# once tests/distributed/test_tp_cuda_graphs.py has passed on 2 GPUs; until then TP decodes eagerly. Read when a
# `RunnerSpec` is made, in the engine's process, so every rank gets the driver's value (the GPU check sets it there).
TP_CUDA_GRAPHS = False


def _tp_cuda_graphs() -> bool:
    return TP_CUDA_GRAPHS


@dataclass(frozen=True)
class RunnerSpec:
    """What every rank builds its runner from (picklable: it is sent to the worker processes). `tp_cuda_graphs`:
    ranks of a tensor-parallel group capture decode graphs (on CUDA, unless `enforce_eager`); one value for every
    rank, since a graph replays the collectives it captured and every rank must replay the same one.
    `encoder_bytes`: the vision encoder's reserve on CUDA, kept out of every rank's pools
    (`hybridcache.engine.memory`). `free_at_start`: rank 0's free device memory when the engine started, before
    it loaded anything, for a model whose vision tower the engine loads before the runner; None: measured when
    the runner's build starts, as every other rank does. `max_step_tokens`: the most tokens one forward feeds,
    whose activation peak is kept out of the pools on CUDA (None: `max_num_batched_tokens`; with images more,
    `Engine.max_step_tokens`)."""

    model_path: Path
    config: EngineConfig
    max_model_len: int
    tp_cuda_graphs: bool = field(default_factory=_tp_cuda_graphs)
    encoder_bytes: int = 0
    free_at_start: int | None = None
    max_step_tokens: int | None = None


def engine_device(name: str) -> torch.device:
    """`name` as the engine's device: "cuda" without an index is the current CUDA device (torch's meaning), made
    explicit so that tensor parallelism's ranks (which count from the index), the vision tower and the memory
    measured at start all name one device. Anything else, and "cuda" on a machine without CUDA (refused later,
    by `build_runner`), is `torch.device(name)`; a name torch does not know is a ValueError naming it."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {name!r} is not a device: give cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported: give cpu, cuda or cuda:N")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_free_bytes(device: torch.device) -> int:
    """Free memory on a CUDA `device`, after this process's allocator gave back its unused cached blocks."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def model_shapes(config: ModelConfig, tp: TensorParallel = UNSHARDED) -> ModelShapes:
    """The dims of `config` that kernel backends specialise on (what `KernelBackend.check_model` judges), as rank
    `tp` holds them. MLA layers (Kimi Linear) run `mla_attention`, whose latent kernel takes rows of any width (its
    expanded prefill: 192): no attention head dim is judged for them; their heads are the rank's."""
    attention = bool(config.attention_layer_ids) and config.mla is None
    delta = bool(config.linear_layer_ids)
    mla = config.mla
    return ModelShapes(
        attention_head_dim=config.attention.head_dim if attention else None,
        rotary_dim=config.attention.rotary_dim if attention else None,
        delta_key_head_dim=config.gated_delta.k_head_dim if delta else None,
        delta_value_head_dim=config.gated_delta.v_head_dim if delta else None,
        num_experts=config.mlp.num_experts,
        mla=None if mla is None else MLAShapes(config.attention.num_heads // tp.size, mla.qk_nope_head_dim,
                                               mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank),
    )


def build_runner(
    spec: RunnerSpec,
    tp: TensorParallel,
    device: torch.device,
    agree: Callable[[int], int] = lambda budget: budget,
) -> tuple[ModelRunner, MemoryPlan]:
    """This rank's runner and the memory plan its pools follow. `agree(value)`: the least of the ranks' values,
    given this rank's (each rank must call its `agree` at the same points): the CUDA budget in bytes all ranks use,
    and the host memory available before any rank allocates pools there.
    CUDA decode graphs (unless `enforce_eager`; under tensor parallelism only with `spec.tp_cuda_graphs`) are
    captured by every rank in the same order (the bucket sizes follow from the spec alone), so the collectives
    inside them pair up at capture and at every replay."""
    config = spec.config
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device}: this machine has {torch.cuda.device_count()} CUDA devices"
                         + ("" if torch.cuda.is_available() else " (torch sees none: no GPU, or a CPU-only torch)"))
    dtype = DTYPES[config.dtype]
    if device.type == "cuda" and dtype == torch.float32:
        # fp32 means IEEE fp32: Triton's dots (ours and flash-linear-attention's) default to tf32, whose 10-bit
        # mantissa makes cached and uncached runs (different chunkings) differ like bf16 does. Read by Triton
        # when a kernel compiles; a value the user set wins. (fla's fused triangular solve names tf32 itself:
        # `gated_delta/fla.fla_chunk_forward` sets it to IEEE for every dtype.)
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    share = free_at_start = 0
    if device.type == "cuda":  # an engine that cannot have its share fails before the weights load
        free_at_start = spec.free_at_start if tp.rank == 0 and spec.free_at_start is not None else (
            device_free_bytes(device))
        utilization = 0.9 if config.gpu_memory_utilization is None else config.gpu_memory_utilization
        share = engine_share(utilization, torch.cuda.mem_get_info(device)[1], free_at_start)
    backend = get_backend(device, attention=config.attention_backend)  # a bad name fails before the weights load
    shapes = model_shapes(ModelConfig.from_model_dir(spec.model_path), tp)
    backend.check_model(shapes)  # so does a shape it cannot run
    speculative = config.speculative_config
    if speculative is not None:  # and a backend or a folder MTP cannot run with (no head, a broken one)
        if not getattr(backend, "supports_verify_states", False):
            raise ValueError(f"speculative decoding needs a kernel backend that keeps per-position recurrent "
                             f"states of verify rows; {type(backend).__name__} does not")
        check_mtp_head(spec.model_path, tp, load_format=config.load_format, kv_fp8=config.kv_fp8)
    # on CUDA, autotuned kernels compile their candidates on a thread pool from here to the end of the start-up
    with parallel_compiles() if device.type == "cuda" else contextlib.nullcontext():
        return _build_on(spec, tp, device, agree, backend, shapes, share, free_at_start)


def _build_on(
    spec: RunnerSpec,
    tp: TensorParallel,
    device: torch.device,
    agree: Callable[[int], int],
    backend: KernelBackend,
    shapes: ModelShapes,
    share: int,
    free_at_start: int,
) -> tuple[ModelRunner, MemoryPlan]:
    """`build_runner` once the device, the backend and the folder's shapes are checked: the weights, the memory
    plan and the runner."""
    config = spec.config
    dtype, state_dtype = DTYPES[config.dtype], DTYPES[config.mamba_ssm_cache_dtype]
    speculative = config.speculative_config
    model = load_model(spec.model_path, dtype=dtype, device=device, tp=tp, quantization=config.quantization,
                       load_format=config.load_format, kv_fp8=config.kv_fp8)
    head = None
    if speculative is not None:
        head = load_mtp_head(spec.model_path, model, dtype=dtype, device=device, quantization=config.quantization,
                             kv_fp8=config.kv_fp8, load_format=config.load_format)
    head_specs = head.state_specs(dtype) if head is not None else ()
    num_speculative = speculative.num_speculative_tokens if speculative is not None else 0
    kv_per_block, state_per_slot = pool_bytes(
        (*model.state_specs(dtype, state_dtype), *head_specs), config.block_size, model.slot_specs(dtype)
    )
    blocks_per_seq = blocks_per_sequence(spec.max_model_len, config.block_size, num_speculative)
    if device.type == "cuda":
        step_tokens = spec.max_step_tokens or config.max_num_batched_tokens
        budget = agree(_cuda_budget(model, backend, config, step_tokens, dtype, state_dtype, device, share,
                                    free_at_start, shapes))
        plan = plan_memory(
            budget, kv_bytes_per_block=kv_per_block, state_bytes_per_slot=state_per_slot,
            max_num_seqs=config.max_num_seqs, block_size=config.block_size, min_blocks=blocks_per_seq,
            num_blocks=config.num_blocks, num_speculative_tokens=num_speculative, encoder_bytes=spec.encoder_bytes,
        )
    else:
        num_blocks = config.num_blocks or (
            2 * config.max_num_seqs * blocks_per_seq + CPU_CHECKPOINT_STATES * state_pages(state_per_slot, kv_per_block)
        )
        plan = MemoryPlan.fixed(
            num_blocks=num_blocks, num_runtime_slots=config.max_num_seqs,
            kv_bytes_per_block=kv_per_block, state_bytes_per_slot=state_per_slot,
            num_speculative_tokens=num_speculative,
        )
    host_bytes = host_tier_blocks(config, plan) * plan.block_bytes
    cpu_pool_bytes = plan.budget_bytes if device.type == "cpu" else 0
    if cpu_pool_bytes or host_bytes:  # the ranks share one host: the pools of all of them against its memory, as
        # every rank saw it before any allocates (`agree` is a barrier: the least any rank saw; 0 = unknown)
        available = agree(available_host_bytes() or 0)
        check_host_memory(tp.size * cpu_pool_bytes, tp.size * host_bytes, config, available or None)
    if kv_per_block and state_per_slot > plan.state_pages * kv_per_block:
        raise AssertionError(
            f"rank {tp.rank}: a state slot of {state_per_slot} bytes does not fit the plan's {plan.state_pages} "
            f"pages of {kv_per_block} bytes (ranks must shard KV and states alike)"
        )
    runner = ModelRunner(
        model,
        backend=backend,
        num_blocks=plan.num_blocks,
        block_size=config.block_size,
        kernel_block_size=config.kernel_block_size,
        num_slots=plan.num_runtime_slots,
        state_pages=plan.state_pages,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        dtype=dtype,
        state_dtype=state_dtype,
        device=device,
        cuda_graphs=device.type == "cuda" and not config.enforce_eager and (tp.size == 1 or spec.tp_cuda_graphs),
        num_speculative_tokens=num_speculative,
        mtp_head=head,
        memory_plan=plan,
    )
    num_host_blocks = host_tier_blocks(config, plan)
    if num_host_blocks:
        runner.attach_host_pool(num_host_blocks)
    return runner, plan


def available_host_bytes(proc: str = "/proc", cgroup_fs: str = "/sys/fs/cgroup") -> int | None:
    """The host memory available now: /proc/meminfo's MemAvailable, and no more than what this process's memory
    cgroup leaves (its limit less its usage: a container's `resources.limits.memory`, which MemAvailable, the
    machine's, does not show; a pool past it was killed by the OOM killer without a word instead of refused).
    None where neither can be read."""
    found = [value for value in (_mem_available(proc), _cgroup_memory_left(proc, cgroup_fs)) if value is not None]
    return min(found) if found else None


def _mem_available(proc: str) -> int | None:
    try:
        with open(f"{proc}/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_memory_left(proc: str, cgroup_fs: str) -> int | None:
    """The memory cgroup's limit less its usage, from /proc/self/cgroup's path: cgroup v2 (`0::/path`:
    memory.max, memory.current) or v1 (`N:memory:/path`: memory.limit_in_bytes, memory.usage_in_bytes). None
    without a limit ("max", or v1's huge "unlimited") or where the files cannot be read."""
    try:
        with open(f"{proc}/self/cgroup", encoding="ascii") as cgroups:
            lines = [line.rstrip("\n").split(":", 2) for line in cgroups]
    except OSError:
        return None
    for _, controllers, path in (line for line in lines if len(line) == 3):
        if controllers == "":
            files = (f"{cgroup_fs}{path.rstrip('/')}/memory.max", f"{cgroup_fs}{path.rstrip('/')}/memory.current")
        elif "memory" in controllers.split(","):
            root = f"{cgroup_fs}/memory{path.rstrip('/')}"
            files = (f"{root}/memory.limit_in_bytes", f"{root}/memory.usage_in_bytes")
        else:
            continue
        try:
            limit, usage = (int(Path(name).read_text(encoding="ascii")) for name in files)
        except (OSError, ValueError):
            continue  # "max", or a path not mounted here
        if limit < 1 << 60:  # (v1 writes "unlimited" as about 2**63)
            return max(0, limit - usage)
    return None


def check_host_memory(pool_bytes: int, host_bytes: int, config: EngineConfig, available: int | None) -> None:
    """Refuse pools in host memory (the CPU's device pools, `pool_bytes`; the host tier, `host_bytes`; of every
    rank together) that need more than the memory `available` (`available_host_bytes`; None: unknown, nothing
    refused), before they are allocated: a pool of far more than the RAM took minutes of swapping or an allocation
    error out of torch (`--max-num-seqs 1000000` on the CPU). The CPU pools follow from max_num_seqs x
    max_model_len (or num_blocks); vLLM's CPU backend sizes its KV cache from a setting of its own
    (VLLM_CPU_KVCACHE_SPACE), here --num-blocks."""
    needed = pool_bytes + host_bytes
    if available is None or needed <= available:
        return
    parts = [f"{what} {needed_part / (1 << 30):.3g} GiB" for what, needed_part in
             (("the CPU pools (KV blocks, checkpoint states and runtime state slots)", pool_bytes),
              ("the host tier", host_bytes)) if needed_part]
    raise ValueError(f"{' + '.join(parts)} need {needed:,} bytes but {available:,} bytes of memory are available: "
                     f"lower max_num_seqs (--max-num-seqs, {config.max_num_seqs}), max_model_len (--max-model-len), "
                     f"num_blocks (--num-blocks) or host_cache_gib (--host-cache-gib)")


def host_tier_blocks(config: EngineConfig, plan: MemoryPlan) -> int:
    """The host tier's blocks of every rank: `host_cache_gib` is the host memory of all ranks together (vLLM's
    `kv_offloading_size` under tensor parallelism), and each rank keeps its shard of every host block, so the count
    is host_cache_gib over (this rank's block bytes x ranks), the same on every rank (the cache's host ids are
    valid on all of them) and, with heads split evenly, the same as with one rank. 0 without a prefix cache
    (`EngineConfig.prefix_caching`, which refuses a host tier without one)."""
    if not config.prefix_caching or not plan.block_bytes:
        return 0
    return int(config.host_cache_gib * (1 << 30) // (plan.block_bytes * config.tensor_parallel_size))


def _cuda_budget(
    model: torch.nn.Module,
    backend: KernelBackend,
    config: EngineConfig,
    step_tokens: int,
    dtype: torch.dtype,
    state_dtype: torch.dtype,
    device: torch.device,
    share: int,
    free_at_start: int,
    shapes: ModelShapes,
) -> int:
    """Bytes left for the pools on a CUDA device: the engine's `share` (`memory.engine_share`), less what it took
    since it started (`free_at_start` - free now), the activation peak of one forward of `step_tokens` tokens
    (measured) and the backend's workspace beyond it for this model (`KernelBackend.workspace_bytes`: Kimi's
    expanded MLA prefill over a long context; `shapes`: the model's, `model_shapes`)."""
    activation = measure_activation_bytes(
        model, backend, num_tokens=step_tokens, block_size=config.block_size,
        kernel_block_size=config.kernel_block_size, dtype=dtype, state_dtype=state_dtype, device=device,
    )
    workspace = backend.workspace_bytes(shapes, step_tokens, dtype)
    return share - (free_at_start - torch.cuda.mem_get_info(device)[0]) - activation - workspace
