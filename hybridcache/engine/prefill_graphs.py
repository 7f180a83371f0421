"""Piecewise CUDA graphs for prefill and mixed steps: everything token-wise is replayed, the cores run eagerly.

A step that is not decode-only (a prefill chunk, a mixed prefill + decode batch) has a geometry the decode graphs
cannot fix in advance: how many sequences, where each starts, how long its context is. But only a few ops of the
forward read that geometry: each layer's *core* (`layers.step.StepContext.core`), the paged attention (KV write +
attention) and the gated DeltaNet's conv + gates + chunked delta rule, which read cu_seqlens, context lengths,
block tables and state slots. Everything else (the embedding, the rotary table, the norms and residual adds, the
projections, the attention's output gate, the DeltaNet's gated norm, the MoE router, sort, experts and combine, the
shared expert) is token-wise: row t of its output depends on row t of its input only, whatever the step's
sequences. So a forward of T tokens is cut at its cores into pieces, and each piece is captured once per token
bucket (`prefill_graph_sizes`) on static buffers; a step of T <= the biggest bucket runs the smallest bucket
B >= T: its pieces replay on B rows, rows T..B-1 padding, and its cores run eagerly on the step's real T rows
(vLLM and SGLang split the same way, their attention and mamba/GDN ops being the splitting ops).

Worked example: next-1b (16 layers, every 4th attention, the others DeltaNet; every layer MoE), a step of one
sequence extending a cached prefix by 200 tokens (T = 200, bucket 256)::

    load       input_ids[:200], positions[:200] <- the step's          (rows 200..255 keep an earlier step's values)
    piece 0    embed, rotary table, layer 0's input norm and projections, the core's inputs (mixed_qkv, a, b)
               copied into static buffers                                          (replay, 256 rows)
    core 0     layer 0's conv + gates + delta rule on rows 0..199 of those buffers, the step's cu_seqlens and
               state slot (eager); its output copied into rows 0..199 of a static buffer piece 1 reads
    piece 1    layer 0's gated norm, out_proj, residual + norm, MoE, layer 1's norm and projections      (replay)
    ...        (one core per layer: 16 cores, 17 pieces)
    core 3     layer 3's KV write + paged attention on rows 0..199 (eager; writes only the step's KV rows)
    ...
    piece 16   layer 15's tail: (hidden, pending) [256, hidden]                                         (replay)
    tail       hidden[:200] + pending[:200], the final norm of each sequence's last row, `last_hidden`, logits
               (eager: `HybridCausalLM.forward_tail`, the same code as the unsplit forward)

Padding rows flow through the pieces only (token-wise ops, so they never reach a real row) and never reach a core,
so they touch no KV page, state slot or sequence: they are computed and discarded. A core's input and output
buffers are shared by every core of their shape, sized for the biggest bucket (a core's output is read before the
next core runs: `StepContext.core`'s contract), so what a bucket's graphs keep of their memory pool is only the
last piece's output: the pool (shared with the decode graphs) holds one bucket's live activations at a time, and
`ModelRunner` logs what the graphs took at start-up.

The cores see exactly the step an eager forward sees (the backend's `prepare` of the real batch), so the KV and
recurrent states they write are an eager step's. The pieces run at B rows instead of T: a GEMM may pick another
kernel for another row count, so in bf16 (and even fp32) a row can round differently from the eager forward of
the same step; the same captured pieces run without replay (`run(..., replay=False)`, `ModelRunner.without_replay`)
give bit-identical results, and on the CPU, which has no graphs, that split forward is what the tests compare
with the unsplit one.

Only text steps (no input embeddings given, no M-RoPE positions) of 1 to `max(sizes)` tokens that the decode or
verify graphs did not take run here; anything else, and everything under `enforce_eager`, runs eagerly. Of these, a
step of one sequence (no drafts) replays a whole-step graph instead, cores included (`SequenceGraphs`, below).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import torch

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.attention import mla_prefill
from hybridcache.kernels.backend import KernelBackend
from hybridcache.layers.step import Core, StepContext
from hybridcache.state_spec import DevicePools

# The token buckets captured: a step of T tokens runs the smallest one >= T. Up to 4,096: phase A-like requests
# (a cached prefix plus a few hundred new tokens) and their cold first turns (prompts of 2,200-2,600 tokens, which
# next-1b's device runs in ~15 ms against ~20 ms of eager launches) replay; longer steps are device-bound.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096)


def prefill_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """The buckets of at most `max_tokens` tokens (a step's token budget, or what the pools can hold for the
    start-up capture). Example: 600 -> (16, 32, 64, 128, 256, 512)."""
    return tuple(size for size in PREFILL_BUCKETS if size <= max_tokens)


def prefill_bucket(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket >= num_tokens, or None when num_tokens is 0 or exceeds them all."""
    return next((size for size in sizes if size >= num_tokens), None) if num_tokens > 0 else None


def is_piecewise(batch: ForwardBatch) -> bool:
    """A text step: no given input embeddings (multimodal rows) and no M-RoPE positions, whose pieces read only
    input_ids and positions."""
    return batch.embeds is None and batch.rope_positions is None


@dataclasses.dataclass
class _Capture:
    """One bucket's graphs: pieces[i] runs before cores[i] (fn, its input buffers, its output buffer) and the last
    piece after the last core; outputs: the last piece's (hidden, pending)."""

    pieces: list[torch.cuda.CUDAGraph]
    cores: list[tuple[Core, tuple[torch.Tensor, ...], torch.Tensor]]
    outputs: tuple[torch.Tensor, torch.Tensor | None]
    rope: tuple[torch.Tensor, torch.Tensor]


class PrefillGraphs:
    """Static inputs, the cores' input and output buffers and, on CUDA once `capture` has run, each bucket's piece
    graphs (see the module docstring). `model`: a `HybridCausalLM` (its `forward_layers` / `forward_tail`)."""

    def __init__(self, model: torch.nn.Module, backend: KernelBackend, pools: DevicePools, sizes: tuple[int, ...],
                 device: torch.device) -> None:
        if not sizes:
            raise ValueError("piecewise graphs need at least one token bucket")
        self.model = model
        self.backend = backend
        self.pools = pools
        self.sizes = sizes
        self.device = device
        biggest = sizes[-1]
        self.input_ids = torch.zeros(biggest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(biggest, dtype=torch.int64, device=device)
        self.buffers: dict[tuple, torch.Tensor] = {}  # the cores' inputs and outputs, by role, shape and dtype
        self.core_keys: dict[int, list[tuple]] = {}  # per bucket, each core's output key
        self.captures: dict[int, _Capture] = {}
        self.pool = None  # the graphs' memory pool (shared with the decode graphs when given one)
        self.stream: torch.cuda.Stream | None = None  # the stream the buckets are captured on
        self.sequence: SequenceGraphs | None = None  # whole-step graphs of one-sequence steps, when captured

    def bucket(self, batch: ForwardBatch) -> int | None:
        """The bucket that runs `batch`, or None when it runs eagerly (`is_piecewise`, `prefill_bucket`)."""
        return prefill_bucket(len(batch.input_ids), self.sizes) if is_piecewise(batch) else None

    def load(self, batch: ForwardBatch) -> None:
        """Copy the step's token ids and positions into the static inputs (rows T.. keep earlier values: valid
        ids and positions whose rows are computed and discarded)."""
        num_tokens = len(batch.input_ids)
        self.input_ids[:num_tokens].copy_(batch.input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(batch.positions, non_blocking=True)

    def static_batch(self, prepared: ForwardBatch, size: int) -> ForwardBatch:
        """What the pieces read: `prepared` with the static inputs' first `size` rows as input_ids and positions
        (the pieces read nothing else of a batch; the cores read `prepared` itself)."""
        return dataclasses.replace(prepared, input_ids=self.input_ids[:size], positions=self.positions[:size])

    def run(self, prepared: ForwardBatch, size: int, *, replay: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_layers` of the loaded step (`load`; `prepared`: its batch after `backend.prepare`) in bucket
        `size`: (hidden, pending), the step's T rows. `replay`: the captured graphs; else the very same pieces
        and cores run eagerly (bit-identical; what the CPU runs)."""
        num_tokens = len(prepared.input_ids)
        if not replay or size not in self.captures:
            if replay:
                raise ValueError(f"no piecewise graph of {size} tokens was captured (buckets {self.sizes})")
            hidden, pending = self.model.forward_layers(self.static_batch(prepared, size), self.pools, self.backend,
                                                        splitter=_EagerCores(self, prepared, num_tokens, None))
            return hidden[:num_tokens], None if pending is None else pending[:num_tokens]
        capture = self.captures[size]
        step = StepContext(batch=prepared, backend=self.backend, rope=capture.rope)
        for index, piece in enumerate(capture.pieces):
            piece.replay()
            if index < len(capture.cores):
                fn, tokens, out = capture.cores[index]
                out[:num_tokens].copy_(fn(step, *(t[:num_tokens] for t in tokens)))
        hidden, pending = capture.outputs
        return hidden[:num_tokens], None if pending is None else pending[:num_tokens]

    def capture(self, size: int, prepared: ForwardBatch) -> None:
        """Capture bucket `size` (CUDA): `prepared` (a prepared batch of exactly `size` tokens, on rows nothing
        holds) is loaded and run once eagerly first (kernel compiles, the cores' buffers), then the pieces are
        captured one graph each, the cores not run, into `self.pool`."""
        if len(prepared.input_ids) != size:
            raise ValueError(f"bucket {size} is captured on a batch of {size} tokens, got {len(prepared.input_ids)}")
        self.load(prepared)
        keys: list[tuple] = []
        self.model.forward_layers(self.static_batch(prepared, size), self.pools, self.backend,
                                  splitter=_EagerCores(self, prepared, size, keys))
        self.core_keys[size] = keys
        torch.cuda.synchronize(self.device)
        splitter = _CaptureCores(self, size)
        if self.stream is None:  # one capture stream for every bucket: cuBLAS keeps a workspace per stream
            self.stream = torch.cuda.Stream(self.device)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            splitter.begin()
            try:
                hidden, pending = self.model.forward_layers(self.static_batch(prepared, size), self.pools,
                                                            self.backend, splitter=splitter)
            except BaseException:
                splitter.abort()
                raise
            splitter.end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        if len(splitter.cores) != len(keys):
            raise RuntimeError(f"the captured forward ran {len(splitter.cores)} cores, the eager one {len(keys)}")
        self.captures[size] = _Capture(splitter.pieces, splitter.cores, (hidden, pending), splitter.rope)

    def buffer(self, key: tuple, *, create: bool = True) -> torch.Tensor:
        """The buffer [max(sizes), *shape] (zeroed when made) of `key` = (role, ..., shape, dtype): a core
        output's ("out", shape, dtype), or core input j's ("in", j, its layout, (row stride,), dtype), which
        `stage` views with the input's strides. Made by eager runs only (`create`): a capture finds the ones its
        bucket's eager run made."""
        out = self.buffers.get(key)
        if out is None:
            if not create:
                raise RuntimeError(f"no buffer {key} was made before the capture")
            *_, shape, dtype = key
            out = self.buffers[key] = torch.zeros((self.sizes[-1], *shape), dtype=dtype, device=self.device)
        return out

    def stage(self, tokens: tuple[torch.Tensor, ...], *, create: bool = True) -> tuple[torch.Tensor, ...]:
        """Copy a core's inputs (each [B, ...], B the bucket's rows) into their buffers; returns the buffers'
        first B rows, laid out with the inputs' strides where their rows do not overlap (a column view of a
        projection's output stays a column view: the core computes exactly what it computes on the unsplit
        forward's tensors), else contiguous."""
        staged = []
        for index, token in enumerate(tokens):
            rows, inner_shape = token.shape[0], tuple(token.shape[1:])
            row_stride, *inner = token.stride()
            span = 1 + sum((size - 1) * stride for size, stride in zip(inner_shape, inner, strict=True))
            if row_stride < span or min(inner, default=1) < 1:
                inner = list(torch.empty(inner_shape, device="meta").stride())
                row_stride = math.prod(inner_shape)
            layout = (inner_shape, tuple(inner))
            flat = self.buffer(("in", index, layout, (row_stride,), token.dtype), create=create)
            buffer = flat.as_strided((rows, *inner_shape), (row_stride, *inner))
            buffer.copy_(token)
            staged.append(buffer)
        return tuple(staged)

    def keep_captured(self) -> None:
        """Serve only the buckets captured (after a bucket's capture failed: its steps and bigger ones run
        eagerly)."""
        self.sizes = tuple(sorted(self.captures))

    def reset(self) -> None:
        """Destroy the captured graphs (later piecewise steps raise: the runner stops routing steps here)."""
        for capture in self.captures.values():
            for piece in capture.pieces:
                piece.reset()
        self.captures.clear()
        if self.sequence is not None:
            self.sequence.reset()
            self.sequence = None


class _EagerCores:
    """Splitter of an eager split forward, what a replay does: each core's inputs are copied into their buffers,
    the core runs on the buffers' first `num_tokens` rows with the real step, and its output goes into those rows
    of the shared buffer the next piece reads; `keys`, when given, records each core's output key."""

    def __init__(self, graphs: PrefillGraphs, prepared: ForwardBatch, num_tokens: int,
                 keys: list[tuple] | None) -> None:
        self.graphs, self.prepared, self.num_tokens, self.keys = graphs, prepared, num_tokens, keys

    def __call__(self, fn: Core, step: StepContext, tokens: tuple[torch.Tensor, ...]) -> torch.Tensor:
        n = self.num_tokens
        real = dataclasses.replace(step, batch=self.prepared, splitter=None)
        out = fn(real, *(t[:n] for t in self.graphs.stage(tokens)))
        key = ("out", tuple(out.shape[1:]), out.dtype)
        if self.keys is not None:
            self.keys.append(key)
        buffer = self.graphs.buffer(key)
        buffer[:n].copy_(out)
        return buffer[: len(step.batch.input_ids)]


class _CaptureCores:
    """Splitter of a capture: at each core, copies its inputs into their buffers and ends the piece being
    captured, records the core (with its input buffers) and begins the next piece, which reads the core's output
    buffer."""

    def __init__(self, graphs: PrefillGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.cores: list[tuple[Core, tuple[torch.Tensor, ...], torch.Tensor]] = []
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.graphs.pool)
        self.pieces.append(graph)

    def end(self) -> None:
        graph = self.pieces[-1]
        graph.capture_end()
        self.graphs.pool = graph.pool()

    def abort(self) -> None:
        """End a capture that failed (its error is the one raised), so that the device can go on eagerly."""
        with contextlib.suppress(RuntimeError):
            self.pieces[-1].capture_end()
        self.pieces.clear()

    def __call__(self, fn: Core, step: StepContext, tokens: tuple[torch.Tensor, ...]) -> torch.Tensor:
        staged = self.graphs.stage(tokens, create=False)
        self.end()
        self.rope = step.rope
        keys = self.graphs.core_keys[self.size]
        if len(self.cores) >= len(keys):
            raise RuntimeError("the captured forward ran more cores than the eager one")
        out = self.graphs.buffer(keys[len(self.cores)], create=False)
        self.cores.append((fn, staged, out))
        self.begin()
        return out[: self.size]


# A whole-step graph runs MLA absorbed (its lengths live on the device; `mla_prefill.plan`), which costs about this
# much a (query, key) pair and head (Kimi's widths on an H100, the absorbed prefill tile: docs/bench.md, session
# 68); a one-sequence step that the eager cores would run expanded leaves its graph for the pieces when its
# absorbed MLA would cost more than the budget, an upper figure of the host time the whole graph saves (the pieces'
# eager cores: about 1 ms a recurrent layer)
ABSORBED_MLA_S_PER_PAIR_HEAD = 2.3e-11
WHOLE_STEP_MLA_BUDGET_S = 0.04


def absorbed_mla_s_per_pair(model: torch.nn.Module) -> float:
    """The seconds a step's (query, key) pair costs in the model's MLA layers run absorbed, on this rank (its MLA
    layers x its heads x `ABSORBED_MLA_S_PER_PAIR_HEAD`); 0 for a model without MLA."""
    config = model.config
    if config.mla is None:
        return 0.0
    heads = config.attention.num_heads // model.tp.size
    return config.num_attention_layers * heads * ABSORBED_MLA_S_PER_PAIR_HEAD


def leaves_whole_graph(s_per_pair: float, queries: int, context: int, page: int) -> bool:
    """Whether a one-sequence step of `queries` tokens over `context` keys runs in the pieces rather than its
    whole-step graph: its absorbed MLA (`s_per_pair`: `absorbed_mla_s_per_pair`) would cost more than
    `WHOLE_STEP_MLA_BUDGET_S` and the eager cores would run it expanded (`mla_prefill.plan`)."""
    return (s_per_pair * queries * context > WHOLE_STEP_MLA_BUDGET_S
            and mla_prefill.plan((queries,), (context,), page) is not None)


def is_sequence_step(batch: ForwardBatch) -> bool:
    """One text sequence (`is_piecewise`) with no verify rows, fresh or extending a context it holds: the steps
    `SequenceGraphs` replay whole."""
    return is_piecewise(batch) and batch.num_seqs == 1 and batch.draft_rows is None


class _MaskPadding:
    """Splitter of a whole-step graph: each core runs on all of the bucket's rows (its kernels read the sequence's
    length from the device and leave rows past it unwritten), and its output's padding rows are zeroed, so that
    the token-wise ops after it see finite values there (a padding row's output is discarded; what matters is
    that it cannot reach the MoE routing as NaN)."""

    def __init__(self, padding: torch.Tensor) -> None:
        self.padding = padding  # [B] bool: rows past the sequence's query length

    def __call__(self, fn: Core, step: StepContext, tokens: tuple[torch.Tensor, ...]) -> torch.Tensor:
        out = fn(step, *tokens)
        return out.masked_fill(self.padding.view(-1, *(1,) * (out.dim() - 1)), 0)


class SequenceGraphs:
    """Whole-step graphs of one-sequence steps (`is_sequence_step`), one per token bucket: the embedding and every
    layer, cores included, in one graph, so that such a step (phase C's + 200 request, phase A's prefix hits)
    costs the host a few copies and one graph launch instead of the pieces' and cores' hundreds of launches.

    A step of T tokens runs bucket B >= T on static buffers whose geometry is read on the device only:
    cu_seqlens = [0, T], the context length, the state slot, the block table. The cores' kernels take their grids
    from B alone (the chunk tables of one sequence of B rows, built once at capture) and mask every row past
    cu_seqlens[1] (the conv and fla through the sequence's bounds, the attention prefill kernel through its
    query length), so rows T..B-1 are padding: their KV rows are -1, which `write_kv` skips (chosen on the device,
    in the graph), their core outputs are zeroed (`_MaskPadding`), and they never reach the state slot.
    The graph's batch claims a context of `max_model_len` on the host (the attention prefill's key splits are
    sized for it; the kernels cut them from the device lengths) and a fresh sequence to the DeltaNet layers, whose
    fresh mask is a buffer the graph fills from the device lengths (context_len == query_len: the slot's old
    state is read as zeros), so one graph serves fresh sequences and prefix hits alike.

    Needs a backend whose cores mask by the device lengths (`CudaBackend`, `masks_padding_rows`); the reference
    kernels loop over the host lengths. `run(..., replay=False)` runs the very same work eagerly on the static
    buffers (bit-identical to the replay)."""

    def __init__(self, model: torch.nn.Module, backend: KernelBackend, pools: DevicePools, inputs: PrefillGraphs,
                 *, table_width: int, max_model_len: int, scratch_slot: int, scratch_page: int,
                 kernel_block_size: int) -> None:
        self.model, self.backend, self.pools = model, backend, pools
        self.sizes = inputs.sizes
        self.max_model_len = max_model_len
        self.kernel_block_size = kernel_block_size
        self.mla_s_per_pair = absorbed_mla_s_per_pair(model)
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        self.device = device = inputs.device
        biggest = self.sizes[-1]
        self.input_ids, self.positions = inputs.input_ids, inputs.positions  # shared with the pieces
        self.cu_seqlens = torch.tensor([0, biggest], dtype=torch.int32, device=device)
        self.cu_seqlens64: dict[int, torch.Tensor] = {}  # per bucket, fla's int64 copy, made in the graph
        self.fresh = torch.zeros(1, dtype=torch.bool, device=device)  # the DeltaNet layers' mask, made in the graph
        self.context_lens = torch.full((1,), biggest, dtype=torch.int32, device=device)
        self.state_slots = torch.full((1,), scratch_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.full((1, table_width), scratch_page, dtype=torch.int32, device=device)
        # padding rows write no KV (a negative row; all to one scratch row, which row won would be a race)
        self.pad_kv_rows = torch.full((biggest,), -1, dtype=torch.int64, device=device)
        self.kv_rows = self.pad_kv_rows.clone()  # the step's rows, as loaded
        self.write_rows = self.pad_kv_rows.clone()  # what the cores write: kv_rows, nothing past T
        self.rows = torch.arange(biggest, device=device)
        self.logits_indices = torch.zeros(1, dtype=torch.int64, device=device)  # (the tail reads the real batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.prepared: dict[int, ForwardBatch] = {}  # kept: the chunk tables the graphs read
        self.pool = inputs.pool
        self.stream = inputs.stream

    def bucket(self, batch: ForwardBatch) -> int | None:
        """The bucket whose whole-step graph runs `batch`, or None: also for a step of a model with MLA layers
        that the eager cores would run expanded (`mla_prefill.plan`) and whose absorbed MLA would cost more than
        `WHOLE_STEP_MLA_BUDGET_S` (Kimi-Linear-48B, 7 MLA layers of 32 heads: 512 tokens over 15,000 keys or
        more, 2,048 over 4,000; the + 200 request over 16,000, ~17 ms, stays in its graph)."""
        if not is_sequence_step(batch) or batch.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        queries, context = batch.query_lens_cpu[0], batch.context_lens_cpu[0]
        if leaves_whole_graph(self.mla_s_per_pair, queries, context, self.kernel_block_size):
            return None
        size = prefill_bucket(queries, self.sizes)
        return size if size in self.graphs else None

    def load(self, batch: ForwardBatch) -> None:
        """Copy the step (one sequence of T tokens) into the static buffers; rows T.. keep earlier values (valid
        ids and positions whose rows are computed and discarded)."""
        num_tokens = batch.query_lens_cpu[0]
        self.input_ids[:num_tokens].copy_(batch.input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(batch.positions, non_blocking=True)
        self.kv_rows[:num_tokens].copy_(batch.kv_rows, non_blocking=True)
        self.cu_seqlens.copy_(batch.cu_seqlens, non_blocking=True)
        self.context_lens.copy_(batch.context_lens, non_blocking=True)
        self.state_slots.copy_(batch.state_slots, non_blocking=True)
        self.block_tables[:, : batch.block_tables.shape[1]].copy_(batch.block_tables, non_blocking=True)

    def _static_batch(self, size: int, cu_seqlens64: torch.Tensor) -> ForwardBatch:
        """The prepared batch of bucket `size`: one sequence of `size` rows (the grids depend on `size` alone)
        prepared as a context of max_model_len (the attention's metadata), then claiming to the layers a fresh
        sequence (its host context length `size`), with fla's int64 cu_seqlens (`cu_seqlens64`) and the fresh
        mask swapped for the buffers `_forward` fills."""
        batch = ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], cu_seqlens=self.cu_seqlens,
            context_lens=self.context_lens, block_tables=self.block_tables, kv_rows=self.write_rows[:size],
            state_slots=self.state_slots, logits_indices=self.logits_indices, query_lens_cpu=(size,),
            context_lens_cpu=(max(self.max_model_len, size + 1),),
        )
        prepared = self.backend.prepare(batch)
        metadata = prepared.metadata
        if not hasattr(metadata, "cu_seqlens") or not hasattr(metadata, "fresh"):
            raise RuntimeError(f"whole-step graphs need the CUDA backend's metadata, got {type(metadata).__name__}")
        metadata = dataclasses.replace(metadata, cu_seqlens=cu_seqlens64, fresh=self.fresh, host_lengths=False)
        return dataclasses.replace(prepared, context_lens_cpu=(size,), metadata=metadata)

    def _forward(self, prepared: ForwardBatch, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a graph holds: the device-side geometry (fla's cu_seqlens, the fresh mask, the rows the cores
        write), then the layers on the static batch `prepared` (`_static_batch`)."""
        prepared.metadata.cu_seqlens.copy_(self.cu_seqlens)
        torch.eq(self.context_lens, self.cu_seqlens[1], out=self.fresh)
        padding = self.rows[:size] >= self.cu_seqlens[1]
        torch.where(padding, self.pad_kv_rows[:size], self.kv_rows[:size], out=self.write_rows[:size])
        return self.model.forward_layers(prepared, self.pools, self.backend, splitter=_MaskPadding(padding))

    def _fresh_batch(self, size: int) -> ForwardBatch:
        """`_static_batch` on an int64 cu_seqlens fla has never seen. fla memoises what it derives from cu_seqlens
        (its chunk offsets) by the tensor's identity: a capture that met a tensor an earlier call had used would
        record no kernel for them and read that call's result, which nothing keeps up to date (or alive)."""
        return self._static_batch(size, torch.zeros(2, dtype=torch.int64, device=self.device))

    def run(self, num_tokens: int, size: int, *, replay: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loaded step's (hidden, pending), its `num_tokens` rows; `replay`: the graph, else the same work
        eagerly (on a batch of its own: `_fresh_batch`)."""
        if replay:
            self.graphs[size].replay()
            hidden, pending = self.outputs[size]
        else:
            hidden, pending = self._forward(self._fresh_batch(size), size)
        return hidden[:num_tokens], None if pending is None else pending[:num_tokens]

    def capture(self, size: int) -> None:
        """Capture bucket `size` (CUDA): the static buffers are set to a `size`-token step on the scratch slot and
        page (all the warm-up run and the first replay write), run once eagerly (compiles, autotuning), captured,
        and replayed once."""
        self.cu_seqlens[1] = size
        self.context_lens.fill_(size)
        self.kv_rows.copy_(self.pad_kv_rows)
        self.state_slots.fill_(self.scratch_slot)
        self.block_tables.fill_(self.scratch_page)
        self._forward(self._fresh_batch(size), size)
        torch.cuda.synchronize(self.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        prepared = self.prepared[size] = self._fresh_batch(size)
        self.cu_seqlens64[size] = prepared.metadata.cu_seqlens
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            self.outputs[size] = self._forward(prepared, size)
        self.pool = graph.pool()
        self.graphs[size] = graph
        graph.replay()  # the first launch uploads the graph to the device: at start-up, not in a request
        torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
