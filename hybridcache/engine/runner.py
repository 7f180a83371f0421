"""The model runner: owns the model, its kernel backend and its device pools, and runs one `ForwardBatch` at a
time, with the step's checkpoint copies around it: finishing saves and restores, then the forward, then saves,
all on one stream with no host synchronisation (one batched copy per pool group and kind; the host tier's copies
across PCIe on two side streams ordered by events, `engine/host_pool.py`). KV ops copy blocks
(`copy_blocks`); state ops are paged (`hybridcache.engine.paged_state`): a checkpoint's state lives in k blocks
of the KV pool, a running sequence's in its runtime slot.

Decode-only steps (every sequence feeds one token) replay a CUDA graph when the backend supports graphs
(its `supports_cuda_graphs(dtype)`; the CUDA backend in bf16), the device is CUDA and graphs are not turned
off (`enforce_eager`). One graph is captured per batch-size bucket (1, 2, 4, 8, ... up to the first power
of two >= max_num_seqs, see `graph_batch_sizes`); a step of n sequences runs the smallest bucket b >= n,
its rows n..b-1 padded::

    n = 3, bucket 4: input_ids [t0 t1 t2 0]   positions [p0 p1 p2 0]   context_lens [c0 c1 c2 1]
                     state_slots [s0 s1 s2 SCRATCH_SLOT]   kv_rows [r0 r1 r2 SCRATCH_PAGE * page]
                     block_tables row 3 = [SCRATCH_PAGE, ...]        logits rows 0..2 are returned

A padding row is a fresh one-token sequence that writes only the scratch slot and the scratch page (one
extra runtime slot and one extra scheduler block the runner allocates beyond the plan's counts), so it can
never touch a real sequence's state. The graphs read static device buffers; each step copies its batch into
them (device-to-device, on the forward's stream) and replays.

With speculative decoding (k drafts), verify steps whose rows all carry exactly k drafts replay graphs of their own,
per bucket (rows of 1 + k tokens; `is_uniform_verify`)::

    n = 1, k = 2, bucket 2: input_ids [t d1 d2 | 0 0 0]   positions [p p+1 p+2 | 0 1 2]   context_lens [c 3]
                            state_slots [s SCRATCH_SLOT]   draft_slots [s*k.. (2 rows) | the scratch slot's 2 rows]
                            returned logits: d2's row (the row's last), then t's and d1's (its draft rows)

the padding row a fresh 3-token sequence on the scratch slot, its draft rows and the scratch page. Graphs of either
kind keep the final-norm hidden rows for the MTP head (`step_hidden`), whose drafting after a uniform step replays
graphs of its own (`engine/draft_graphs.py`; one device only).

Every other text step of up to 4,096 tokens (prefills, mixed prefill + decode batches) replays piecewise graphs:
the forward cut at its layers' cores (paged attention, the DeltaNet recurrence), the pieces between them replayed
per token bucket and the cores run eagerly on the step's real rows (`engine/prefill_graphs.py`); a step of one
sequence replays all of it, cores included, as one graph per bucket (`prefill_graphs.SequenceGraphs`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from hybridcache.copy_kinds import CopyKind, Phase
from hybridcache.engine.draft_graphs import DraftGraphs, write_rows
from hybridcache.engine.host_pool import CopyStreams, HostPool
from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.engine.memory import MemoryPlan
from hybridcache.engine.mtp_draft import DraftPlan, identity, run_draft_plan
from hybridcache.engine.paged_state import PagedStates
from hybridcache.engine.prefill_graphs import PrefillGraphs, SequenceGraphs, prefill_graph_sizes
from hybridcache.engine.spec_chain import ChainGraphs, ChainTables, copy_state_rows, next_verify_batch, select_rows
from hybridcache.engine.token_feed import TokenFeed
from hybridcache.forward_batch import DeviceCopyOp, ForwardBatch, table_width
from hybridcache.kernels.backend import KernelBackend, get_backend
from hybridcache.kernels.copy.block_copy import copy_blocks
from hybridcache.kernels.sampling import greedy_tokens
from hybridcache.models.hybrid_lm import LAST_HIDDEN
from hybridcache.scheduler.output import ScheduledChunk
from hybridcache.scheduler.sequence import Seq
from hybridcache.state_spec import DevicePools

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes captured: powers of two from 1 up to the first one >= max_num_seqs.
    Example: max_num_seqs 48 -> (1, 2, 4, 8, 16, 32, 64)."""
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def graph_bucket(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= num_seqs, or None when num_seqs exceeds them all."""
    return next((size for size in sizes if size >= num_seqs), None)


def is_decode_only(batch: ForwardBatch) -> bool:
    """Every sequence feeds one token, the input embeddings are all looked up (no multimodal rows)."""
    return batch.embeds is None and all(length == 1 for length in batch.query_lens_cpu)


def is_uniform_verify(batch: ForwardBatch, num_drafts: int) -> bool:
    """Every sequence is a verify row of exactly `num_drafts` drafts (speculative decoding), the input embeddings
    are all looked up and no prompt logits are wanted: the steps the verify graphs replay."""
    return (num_drafts > 0 and batch.embeds is None and batch.prompt_logits_rows is None
            and len(batch.draft_slots_cpu) == batch.num_seqs
            and all(len(drafts) == num_drafts for drafts in batch.draft_slots_cpu)
            and all(length == 1 + num_drafts for length in batch.query_lens_cpu))


class _DecodeGraphs:
    """Static input buffers and one captured graph per batch-size bucket (see the module docstring), for decode
    steps (`num_drafts` 0: one token per row) or for speculative decoding's verify steps (every row its last token
    and exactly `num_drafts` drafts: q = 1 + num_drafts tokens, whose draft states go to `draft_slots`). A padding
    row is a fresh q-token sequence at positions 0 .. q-1 of the scratch page, on the scratch slot and its draft
    rows (`scratch_drafts`)."""

    def __init__(self, sizes: tuple[int, ...], *, width: int, max_model_len: int, scratch_slot: int,
                 scratch_page: int, kernel_block_size: int, device: torch.device, num_drafts: int = 0,
                 scratch_drafts: tuple[int, ...] = ()) -> None:
        biggest = sizes[-1]
        q = self.tokens_per_row = 1 + num_drafts
        if q > kernel_block_size or len(scratch_drafts) != num_drafts:
            raise ValueError(f"verify graphs of {q} tokens per row need a page of >= {q} tokens (got "
                             f"{kernel_block_size}) and {num_drafts} scratch draft rows (got {len(scratch_drafts)})")
        self.num_drafts = d = num_drafts
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.scratch_slot = scratch_slot
        self.scratch_page = scratch_page
        self.scratch_drafts = scratch_drafts
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor | None] = {}  # with an MTP head: each graph's hidden rows
        self.prepared: dict[int, ForwardBatch] = {}  # each graph's prepared batch (its metadata's tensors)
        self.pool = None

        def full(shape: tuple[int, ...], value: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        rows = biggest * q
        within = torch.arange(rows, device=device) % q  # each row's token index within its sequence
        # what padding rows hold (written over real rows' values by `load`)
        self.pad_positions = within
        self.pad_kv_rows = scratch_page * kernel_block_size + within
        self.pad_drafts = torch.tensor(scratch_drafts * biggest, dtype=torch.int64, device=device)
        self.input_ids = full((rows,), 0, torch.int64)
        self.positions = self.pad_positions.clone()
        self.kv_rows = self.pad_kv_rows.clone()
        self.state_slots = full((biggest,), scratch_slot, torch.int64)
        self.context_lens = full((biggest,), q, torch.int32)
        # as wide as any step's table: `table_width` of the pages of max_model_len
        self.block_tables = full((biggest, table_width(width)), scratch_page, torch.int32)
        self.cu_seqlens = torch.arange(biggest + 1, dtype=torch.int32, device=device) * q
        self.logits_indices = torch.arange(1, biggest + 1, dtype=torch.int64, device=device) * q - 1
        self.draft_rows = (torch.arange(biggest, device=device)[:, None] * q
                           + torch.arange(d, device=device)[None, :]).reshape(-1)
        self.draft_slots = self.pad_drafts.clone()

    def static_batch(self, size: int, draft_slots_cpu: Sequence[tuple[int, ...]] = ()) -> ForwardBatch:
        """The batch a graph of `size` rows is captured on. Its host context lengths claim max_model_len for the
        first row, so backends that size work from the longest context (split-KV decode) cover every replay.
        `draft_slots_cpu`: the real rows' draft slots on the host (read only by the reference backend, which loops
        on the host: an eager run of the static batch on the CPU); the padding rows' and, when not given, all rows'
        are the scratch ones."""
        q, d = self.tokens_per_row, self.num_drafts
        drafts = tuple(draft_slots_cpu) + (self.scratch_drafts,) * (size - len(draft_slots_cpu)) if d else ()
        return ForwardBatch(
            input_ids=self.input_ids[: size * q],
            positions=self.positions[: size * q],
            cu_seqlens=self.cu_seqlens[: size + 1],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            kv_rows=self.kv_rows[: size * q],
            state_slots=self.state_slots[:size],
            logits_indices=self.logits_indices[:size],
            query_lens_cpu=(q,) * size,
            context_lens_cpu=(self.max_model_len,) + (q,) * (size - 1),
            draft_rows=self.draft_rows[: size * d] if d else None,
            draft_slots=self.draft_slots[: size * d] if d else None,
            draft_slots_cpu=drafts,
        )

    def load(self, batch: ForwardBatch, size: int) -> None:
        """Copy `batch` (n <= size rows of this graph's kind) into the static buffers; rows n..size-1 become
        padding."""
        if batch.input_ids.data_ptr() == self.input_ids.data_ptr():
            return  # a view of these buffers, already written (`spec_chain.ChainGraphs.prepare`)
        n, q, d = batch.num_seqs, self.tokens_per_row, self.num_drafts
        # decode rows are text: their M-RoPE rows are equal, and the rotary of one row is the rotary of all three
        rope = batch.positions if batch.rope_positions is None else batch.rope_positions[0]
        write_rows(self, q, batch.input_ids, rope, batch.kv_rows, batch.state_slots, batch.context_lens,
                   batch.block_tables, size)
        if d:
            self.draft_slots[: n * d].copy_(batch.draft_slots, non_blocking=True)
            if n < size:
                self.draft_slots[n * d: size * d] = self.pad_drafts[n * d: size * d]

    def rows(self, output: torch.Tensor, n: int, size: int) -> torch.Tensor:
        """The rows of a replay's output (logits [size + size * d, ...]) that belong to its n real sequences: each
        sequence's last row, then their draft rows (the order of an eager forward of the real batch)."""
        if not self.num_drafts:
            return output[:n]
        return torch.cat([output[:n], output[size: size + n * self.num_drafts]])


class ModelRunner:
    """Runs forwards on the device pools. The backend is chosen and the pools (from the model's state
    specs) are allocated once, at construction; with `cuda_graphs`, decode graphs are captured there too.
    `num_blocks`: the pool of blocks (KV and checkpoint pages); `num_slots`: the runtime state slots;
    `state_pages`: k, the blocks of one checkpoint state (`hybridcache.engine.memory.MemoryPlan`); `memory_plan`:
    the plan those counts come from (`build_runner` passes it). The engine's `Executor` on one device."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        kernel_block_size: int,
        num_slots: int,
        state_pages: int,
        dtype: torch.dtype,
        state_dtype: torch.dtype,
        device: torch.device,
        backend: KernelBackend | None = None,
        max_num_seqs: int = 1,
        max_model_len: int = 1,
        max_num_batched_tokens: int = 1024,
        cuda_graphs: bool = False,
        memory_plan: MemoryPlan | None = None,
        num_speculative_tokens: int = 0,
        mtp_head: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.memory_plan = memory_plan
        self.mtp_head = mtp_head
        self.step_hidden: torch.Tensor | None = None  # with a head: the last forward's final-norm hidden rows
        # with a head, after a step no graph replayed: each sequence's last_hidden before it (`DraftPlan.reads_prior`)
        self.step_prior: torch.Tensor | None = None
        self._held_saves: list[DeviceCopyOp] = []  # with a head: the last step's KV_SAVEs (see `execute`)
        self.num_speculative_tokens = k = num_speculative_tokens
        self.device = device
        self.backend = backend if backend is not None else get_backend(device)
        self.pages_per_block = block_size // kernel_block_size
        self.kernel_block_size = kernel_block_size
        supports = getattr(self.backend, "supports_cuda_graphs", None)  # a backend without it never captures
        use_graphs = cuda_graphs and supports is not None and supports(dtype)
        # the scratch block and slot that graph padding rows write (and, with speculative decoding, the rows of
        # an async verify step whose sequence ended in the step before: `chain_verify`)
        extra = 1 if use_graphs or k else 0
        self.scratch_slot, self.scratch_page = num_slots, num_blocks * self.pages_per_block  # (when `extra`)
        # speculative decoding: k draft state rows per runtime slot after the runtime slots (and the scratch one),
        # and the MTP head's KV as more attention layers after the target's
        self.draft_base = num_slots + extra  # (the scratch slot, when there is one, has draft rows too)
        head_specs = mtp_head.state_specs(dtype) if mtp_head is not None else ()
        self.pools = DevicePools.allocate(
            (*model.state_specs(dtype, state_dtype), *head_specs),
            num_pages=(num_blocks + extra) * self.pages_per_block,
            kernel_block_size=kernel_block_size,
            num_slots=(num_slots + extra) * (1 + k),
            device=device,
            slot_specs=model.slot_specs(dtype),
        )
        self.paged_states = PagedStates(self.pools, pages_per_block=self.pages_per_block,
                                        num_blocks=num_blocks + extra, k=state_pages)
        self.host_pool: HostPool | None = None  # the host tier's blocks (`attach_host_pool`)
        if device.type == "cuda":
            self._compile_copies(num_blocks=num_blocks + extra)
            self._compile_on_pools(block_size=block_size, kernel_block_size=kernel_block_size, num_blocks=num_blocks)
        self._graphs: _DecodeGraphs | None = None
        self._verify_graphs: _DecodeGraphs | None = None  # speculative decoding: verify steps of k drafts per row
        self._draft_graphs: DraftGraphs | None = None  # speculative decoding: the head's drafting (uniform plans)
        self._prefill: PrefillGraphs | None = None  # piecewise graphs of prefill and mixed steps
        self.prefill_graph_bytes = 0  # device memory the piecewise graphs keep (their pool and buffers)
        self.prefill_graph_failures: dict[int, str] = {}  # buckets whose capture raised: the error
        self._replay = True
        self._scratch_drafts: torch.Tensor | None = None  # `chain_verify`'s padding draft rows, on the device
        self._chain_graphs: ChainGraphs | None = None  # async speculative steps' glue in graphs (`chain_verify`)
        # async speculative steps: each row's pages and stop tokens on the device, as wide as a verify graph's tables
        self.chain_tables = ChainTables(
            max(graph_batch_sizes(max_num_seqs)), table_width(-(-(max_model_len + 2 * k) // kernel_block_size)),
            pages_per_block=self.pages_per_block, scratch_page=self.scratch_page, device=device) if k else None
        if use_graphs:
            def graphs(num_drafts: int) -> _DecodeGraphs:
                return _DecodeGraphs(
                    graph_batch_sizes(max_num_seqs), width=-(-(max_model_len + 2 * k) // kernel_block_size),
                    max_model_len=max_model_len, scratch_slot=num_slots,
                    scratch_page=num_blocks * self.pages_per_block, kernel_block_size=kernel_block_size,
                    device=device, num_drafts=num_drafts, scratch_drafts=self.draft_slots(num_slots, num_drafts),
                )

            self._graphs = graphs(0)
            self._capture(self._graphs)
            if k and 1 + k <= kernel_block_size:
                self._verify_graphs = graphs(k)
                self._capture(self._verify_graphs)
            if mtp_head is not None and model.tp.size == 1:  # (tensor parallelism agrees drafts eagerly)
                self._capture_drafting(max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_slots=num_slots,
                                       num_blocks=num_blocks, kernel_block_size=kernel_block_size, dtype=dtype)
                self._capture_chain()
            self._prefill = self._capture_prefill(
                min(max_model_len, num_blocks * block_size, max_num_batched_tokens), block_size=block_size,
                kernel_block_size=kernel_block_size, max_model_len=max_model_len)

    def _capture_drafting(self, *, max_num_seqs: int, max_model_len: int, num_slots: int, num_blocks: int,
                          kernel_block_size: int, dtype: torch.dtype) -> None:
        """Capture the MTP head's drafting graphs (`engine/draft_graphs.py`) per decode bucket, padding rows on the
        scratch slot and page, in the decode graphs' memory pool."""
        self._draft_graphs = DraftGraphs(
            head=self.mtp_head, model=self.model, pools=self.pools, backend=self.backend,
            num_drafts=self.num_speculative_tokens, sizes=graph_batch_sizes(max_num_seqs),
            max_model_len=max_model_len, scratch_slot=num_slots, scratch_page=num_blocks * self.pages_per_block,
            kernel_block_size=kernel_block_size, hidden_size=self.model.config.hidden_size, dtype=dtype,
            device=self.device,
        )
        self._draft_graphs.capture(pool=(self._verify_graphs or self._graphs).pool)

    def _capture_chain(self) -> None:
        """Capture the async speculative steps' glue graphs (`spec_chain.ChainGraphs`) per verify bucket, when
        verify and drafting graphs of k drafts exist. A capture that raises is logged and left out: chained steps
        then build their inputs eagerly (`without_chain_graphs` does the same for an A/B)."""
        drafting, verify, k = self._draft_graphs, self._verify_graphs, self.num_speculative_tokens
        if drafting is None or verify is None or 1 + k not in drafting.catch:
            return
        chain = ChainGraphs(verify, drafting, self.chain_tables, self.pools.state_groups, k=k,
                            kernel_block_size=self.kernel_block_size, draft_base=self.draft_base,
                            scratch_slot=self.scratch_slot, scratch_page=self.scratch_page,
                            scratch_drafts=self._scratch_draft_rows(verify.draft_slots.dtype))
        try:
            chain.capture(pool=verify.pool)
        except Exception as error:  # (any: the eager glue serves every chained step the graphs would)
            logger.warning("async speculative steps' graphs not captured (their inputs are built eagerly): %r", error)
            torch.cuda.synchronize(self.device)
            return
        logger.info("async speculative steps' graphs captured: buckets %s", chain.sizes)
        self._chain_graphs = chain

    def _scratch_draft_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """The scratch slot's k draft rows on the device (made once: a tensor made on CUDA from a host list waits
        for the device)."""
        if self._scratch_drafts is None:
            self._scratch_drafts = torch.tensor(self.draft_slots(self.scratch_slot, self.num_speculative_tokens),
                                                dtype=dtype, device=self.device)
        return self._scratch_drafts

    def draft_slots(self, slot: int, num_drafts: int) -> tuple[int, ...]:
        """The state pool rows of runtime slot `slot`'s first `num_drafts` draft states (the state after verify
        position j is draft state `slot * k + j`, `hybridcache.cache.plan`)."""
        first = self.draft_base + slot * self.num_speculative_tokens
        return tuple(range(first, first + num_drafts))

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The captured decode batch sizes; () when steps run eagerly."""
        return self._graphs.sizes if self._graphs is not None else ()

    @property
    def prefill_graph_sizes(self) -> tuple[int, ...]:
        """The token buckets of the piecewise prefill graphs; () when such steps run eagerly."""
        return self._prefill.sizes if self._prefill is not None else ()

    @property
    def input_device(self) -> torch.device:
        """Where the engine builds a step's inputs (the `Executor` protocol): this runner's device."""
        return self.device

    def release_graphs(self) -> None:
        """Destroy the captured decode and verify graphs now (later steps run eagerly). A tensor-parallel rank must
        do this before it leaves its process group: NCCL's communicator teardown (destroy or abort) waits until
        every graph that captured one of its collectives has been destroyed."""
        for graphs in (self._graphs, self._verify_graphs):
            if graphs is not None:
                for graph in graphs.graphs.values():
                    graph.reset()
                graphs.graphs.clear()
        if self._draft_graphs is not None:
            self._draft_graphs.reset()
        if self._chain_graphs is not None:
            self._chain_graphs.reset()
        if self._prefill is not None:
            self._prefill.reset()
        self._graphs = self._verify_graphs = self._draft_graphs = self._chain_graphs = self._prefill = None

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Within the block every step runs on the plain eager path, as with `enforce_eager`."""
        graphs, self._graphs, verify, self._verify_graphs = self._graphs, None, self._verify_graphs, None
        drafting, self._draft_graphs = self._draft_graphs, None
        prefill, self._prefill = self._prefill, None
        chain, self._chain_graphs = self._chain_graphs, None
        try:
            yield
        finally:
            self._graphs, self._verify_graphs, self._draft_graphs, self._prefill = graphs, verify, drafting, prefill
            self._chain_graphs = chain

    @contextlib.contextmanager
    def without_chain_graphs(self) -> Iterator[None]:
        """Within the block, async speculative steps build their inputs with eager ops (`chain_verify`), as before
        `spec_chain.ChainGraphs` (an A/B switch for `benchmarks/spec_bench.py`)."""
        chain, self._chain_graphs = self._chain_graphs, None
        try:
            yield
        finally:
            self._chain_graphs = chain

    @contextlib.contextmanager
    def without_replay(self) -> Iterator[None]:
        """Within the block, decode steps run the very batch a graph replays (the padded static buffers, the
        kernel choices made at capture, e.g. split-KV splits sized for max_model_len) eagerly, without the
        graph, and piecewise steps their pieces and cores eagerly on the bucket's rows: graph replay must give
        bit-identical logits. (An `enforce_eager` engine sizes its split-KV
        splits from the step's own longest context, so its bf16 rounding, and on a random model with nearly
        flat logits its greedy tokens, differ.)"""
        self._replay = False
        try:
            yield
        finally:
            self._replay = True

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch, feed: TokenFeed | None = None) -> torch.Tensor:
        """Run the BEFORE_FORWARD copy ops, the forward, then the AFTER_FORWARD ones, each phase in the plan's
        order (a `CopyPlan` lists its kinds in declaration order: STATE_FINISH first); returns fp32 logits
        [num_seqs + R, vocab]: row i at sequence i's last token, then one row per `batch.prompt_logits_rows`
        entry (R of them; none when it is None). `feed`: rows of `batch.input_ids` written first from the step
        before's sampled tokens, on the device (async scheduling).

        With an MTP head the step's KV_SAVEs (a checkpoint's frozen tail: a copy of a partial block, every layer's
        rows) are held until the next `execute` or `execute_copies` runs them, first of all: the head writes its KV
        at the step's positions after the forward (`draft`, `draft_after_verify`), and the copy must carry it. Safe:
        until the next step's copies and forward nothing but the head writes the source blocks, and nothing reads a
        frozen block before a later step restores it (BEFORE_FORWARD, after the held copies)."""
        self._run_held_saves()
        if feed is not None:
            feed.write(batch.input_ids)
        for op in batch.copies:
            if op.kind.phase is Phase.BEFORE_FORWARD:
                self._copy(op)
        logits = self._forward(batch)
        for op in batch.copies:
            if op.kind.phase is Phase.AFTER_FORWARD:
                if op.kind is CopyKind.KV_SAVE and self.mtp_head is not None:
                    self._held_saves.append(op)
                else:
                    self._copy(op)
        return logits

    def _run_held_saves(self) -> None:
        held, self._held_saves = self._held_saves, []
        for op in held:
            self._copy(op)

    @torch.inference_mode()
    def execute_copies(self, copies: tuple[DeviceCopyOp, ...]) -> None:
        """Copies without a forward, by phase (a step of only zero-prefill samples: BEFORE_FORWARD ones first;
        a verify step's rollbacks: AFTER_VERIFY), after the KV_SAVEs `execute` held, but for a verify step's
        rollbacks alone (they touch state slots only, and come before the head's catch-up, which the held copies
        wait for). `()` runs the held copies alone (before the pools are read outside a step: the disk tier at
        close)."""
        if not copies or any(op.kind is not CopyKind.STATE_ROLLBACK for op in copies):
            self._run_held_saves()
        for phase in Phase:
            for op in copies:
                if op.kind.phase is phase:
                    self._copy(op)

    def draft(self, plan: DraftPlan, agree: Callable[[torch.Tensor], torch.Tensor] = identity) -> torch.Tensor:
        """Run the MTP head's `plan` (`engine/mtp_draft.py`) on these pools from the hidden rows the last forward
        kept; the proposed tokens, int64 on the device. `agree`: how a rank agrees on each draft a further step
        embeds (tensor parallelism: rank 0's broadcast). A uniform plan within the captured buckets replays a
        drafting graph (one device: `agree` the identity); any other runs eagerly."""
        if self.mtp_head is None or self.step_hidden is None:
            raise RuntimeError("draft needs a runner with an MTP head after a forward (speculative decoding)")
        graphs = self._draft_graphs
        size = graphs.bucket(plan) if graphs is not None and agree is identity else None
        if size is not None:
            return graphs.run(plan, self.step_hidden, size, replay=self._replay)
        return run_draft_plan(plan, head=self.mtp_head, model=self.model, pools=self.pools, backend=self.backend,
                              hidden=self.step_hidden, prior=self.step_prior, agree=agree)

    def draft_after_verify(self, batch: ForwardBatch, logits: torch.Tensor,
                           near_pages: torch.Tensor) -> torch.Tensor | None:
        """Speculative decoding: queue the drafting after the uniform, all-greedy verify step `batch` that just
        ran (`logits`: what `execute` returned) without waiting for the host's verdicts
        (`DraftGraphs.run_after_verify`: each row's accepted count, then the drafts); None when there are no
        drafting graphs (an eager runner) or the step is beyond them."""
        graphs = self._draft_graphs
        if graphs is None or 1 + self.num_speculative_tokens not in graphs.catch:
            return None
        size = graph_bucket(batch.num_seqs, graphs.sizes)
        if size is None:
            return None
        chain = self._chain_graphs
        if chain is not None and chain.owns(batch):  # a chained step (`chain_verify`): its inputs are in the buffers
            return chain.draft(batch.num_seqs, graph_bucket(batch.num_seqs, chain.sizes), replay=self._replay)
        return graphs.run_after_verify(batch, logits, self.step_hidden, near_pages, size, replay=self._replay)

    def can_chain(self, num_seqs: int) -> bool:
        """Whether a uniform greedy verify step of `num_seqs` rows can be followed by one built on the device
        (`chain_verify`, then `draft_after_verify`): drafting graphs hold its bucket and, on CUDA, verify graphs
        replay it (an eager CUDA forward would need the host lengths: a wait)."""
        drafting = self._draft_graphs
        if (drafting is None or 1 + self.num_speculative_tokens not in drafting.catch
                or graph_bucket(num_seqs, drafting.sizes) is None):
            return False
        if self.device.type != "cuda":
            return True
        verify = self._verify_graphs
        return self._replay and verify is not None and graph_bucket(num_seqs, verify.sizes) is not None

    @torch.inference_mode()
    def chain_verify(self, prev: ForwardBatch, values: torch.Tensor, chunks: Sequence[ScheduledChunk],
                     stop_tokens: Callable[[Seq], Iterable[int]]) -> tuple[ForwardBatch, torch.Tensor]:
        """Queue the rollback of the verify step `prev` (its rows: `chunks`) from its device verdicts `values`
        (each row's slot gets the state after its last accepted position: `spec_chain.select_rows`) and return the
        next verify step's batch and near pages, built on the device (`spec_chain.next_verify_batch`; each row's
        pages from its chunk's blocks and its `stop_tokens(seq)`, kept in `chain_tables`), for `execute` and
        `draft_after_verify`. In a captured bucket (`spec_chain.ChainGraphs`) all of it is one graph replay that
        writes the verify graph's buffers. No wait for the device."""
        k = self.num_speculative_tokens
        n = prev.num_seqs
        self.chain_tables.update(chunks, stop_tokens)
        chain = self._chain_graphs
        size = graph_bucket(n, chain.sizes) if chain is not None else None
        if size is not None:
            return chain.prepare(prev, values, size, replay=self._replay)
        source = select_rows(prev.state_slots, values[:n], k=k, draft_base=self.draft_base)
        copy_state_rows(self.pools.state_groups, source, prev.state_slots)
        return next_verify_batch(prev, values, self.chain_tables.tables[:n], self.chain_tables.stops[:n], k=k,
                                 kernel_block_size=self.kernel_block_size, scratch_slot=self.scratch_slot,
                                 scratch_page=self.scratch_page,
                                 scratch_drafts=self._scratch_draft_rows(prev.draft_slots.dtype),
                                 host_lengths=self.device.type != "cuda")

    def logits_from_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 logits [len(slots), vocab] from each slot's kept last hidden state, after the step's copies
        (a zero-prefill hit: the restored checkpoint's hidden state; no layer runs)."""
        return self.model.logits_from_slots(self.pools, slots)

    def check_results(self) -> None:
        """Nothing to check: one device's results are whatever its stream computed (the `Executor` protocol's
        method)."""

    def shutdown(self) -> None:
        """Nothing to stop: the runner started no process or thread (the `Executor` protocol's method)."""

    def _graphs_for(self, batch: ForwardBatch) -> _DecodeGraphs | None:
        """The graphs that can replay `batch` (decode-only, or uniform verify rows), or None."""
        if self._graphs is not None and is_decode_only(batch) and batch.prompt_logits_rows is None:
            return self._graphs
        if self._verify_graphs is not None and is_uniform_verify(batch, self.num_speculative_tokens):
            return self._verify_graphs
        return None

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        graphs = self._graphs_for(batch)
        size = graph_bucket(batch.num_seqs, graphs.sizes) if graphs is not None else None
        # each sequence's last_hidden before the step (restored by its copies), for a ragged draft plan's catch-up
        # from a hit (`DraftPlan.reads_prior`); a step a decode or verify graph replays is one whose plan is uniform
        # and reads none: no copy on that per-step path
        self.step_prior = None
        if size is None:
            if self.mtp_head is not None:
                self.step_prior = self.pools.slot_state[LAST_HIDDEN].index_select(0, batch.state_slots)
            tokens = self._prefill.bucket(batch) if self._prefill is not None else None
            if tokens is not None:
                return self._run_pieces(batch, tokens)
            return self._run_model(self.backend.prepare(batch))
        graphs.load(batch, size)
        n = batch.num_seqs
        if not self._replay:
            static = self.backend.prepare(graphs.static_batch(size, batch.draft_slots_cpu))
            return graphs.rows(self._run_model(static), n, size)
        graphs.graphs[size].replay()
        if self.mtp_head is not None:
            self.step_hidden = graphs.hidden[size]
        # the graph's output is the lm_head's (`HybridCausalLM.forward(raw=True)`): widened into a new fp32 tensor,
        # which the next replay cannot overwrite
        return graphs.rows(graphs.outputs[size], n, size).to(torch.float32, copy=True)

    def _run_pieces(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        """A step in piecewise graphs of `size` tokens (`engine/prefill_graphs.py`): the layers replayed (or, within
        `without_replay`, run split and eagerly), then the model's tail eagerly on the step's rows."""
        prefill = self._prefill
        whole = prefill.sequence
        if whole is not None and whole.bucket(batch) == size:  # one sequence, one graph (`SequenceGraphs`)
            whole.load(batch)
            hidden, pending = whole.run(batch.query_lens_cpu[0], size, replay=self._replay)
            prepared = batch  # (the tail reads the step's rows and slot, no backend metadata)
        else:
            prepared = self.backend.prepare(batch)
            prefill.load(batch)
            hidden, pending = prefill.run(prepared, size, replay=self._replay)
        keep = self.mtp_head is not None
        logits, normed = self.model.forward_tail(hidden, pending, prepared, self.pools, self.backend,
                                                 keep_hidden=keep)
        if keep:
            self.step_hidden = normed
        return logits

    def _capture_prefill(self, max_tokens: int, *, block_size: int, kernel_block_size: int,
                         max_model_len: int | None = None) -> PrefillGraphs | None:
        """Capture the piecewise prefill graphs of every bucket up to `max_tokens` (the step budget, and what the
        pools hold of one sequence), largest first, in the decode graphs' memory pool; each bucket is warmed on
        a fresh sequence of its size on slot 0 and blocks 0.. (nothing holds them at start-up). Logs the device
        memory the graphs took (`prefill_graph_bytes`). A bucket whose capture raises is logged (a warning with
        the error, kept in `prefill_graph_failures`) and left out: its steps run eagerly. None for a model
        without a split forward or when no bucket was captured."""
        sizes = prefill_graph_sizes(max_tokens)
        if not sizes or not hasattr(self.model, "forward_layers"):
            return None
        torch.cuda.empty_cache()  # so that the reserved bytes after, emptied again, count what the graphs keep
        before = torch.cuda.memory_reserved(self.device)
        prefill = PrefillGraphs(self.model, self.backend, self.pools, sizes, self.device)
        prefill.pool = self._graphs.pool if self._graphs is not None else None
        with torch.inference_mode():
            for size in reversed(sizes):
                chunk = SeqChunk(token_ids=[0] * size, start=0, block_ids=list(range(-(-size // block_size))), slot=0)
                batch = build_forward_batch([chunk], block_size=block_size, kernel_block_size=kernel_block_size,
                                            device=self.device)
                try:
                    prefill.capture(size, self.backend.prepare(batch))
                except RuntimeError as error:
                    logger.warning("piecewise prefill graph of %d tokens not captured (such steps run eagerly): %r",
                                   size, error)
                    self.prefill_graph_failures[size] = repr(error)
                    torch.cuda.synchronize(self.device)
        prefill.keep_captured()
        if not prefill.sizes:
            return None
        if max_model_len is not None and getattr(self.backend, "masks_padding_rows", False):
            self._capture_sequence(prefill, max_model_len=max_model_len, kernel_block_size=kernel_block_size)
        torch.cuda.empty_cache()
        self.prefill_graph_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("piecewise prefill graphs: token buckets %s, %.1f MiB of device memory", prefill.sizes,
                    self.prefill_graph_bytes / 2**20)
        return prefill

    def _capture_sequence(self, prefill: PrefillGraphs, *, max_model_len: int, kernel_block_size: int) -> None:
        """The whole-step graphs of one-sequence steps (`prefill_graphs.SequenceGraphs`) for the piecewise
        buckets, largest first, on the scratch slot and page; a bucket whose capture raises is logged and left
        to the pieces."""
        whole = SequenceGraphs(self.model, self.backend, self.pools, prefill,
                               table_width=table_width(-(-max_model_len // kernel_block_size)),
                               max_model_len=max_model_len, scratch_slot=self.scratch_slot,
                               scratch_page=self.scratch_page, kernel_block_size=kernel_block_size)
        with torch.inference_mode():
            for size in reversed(prefill.sizes):
                try:
                    whole.capture(size)
                except Exception as error:  # noqa: BLE001 (any failure leaves the bucket to the pieces)
                    logger.warning("whole-step graph of %d tokens not captured (such steps run piecewise): %r",
                                   size, error)
                    torch.cuda.synchronize(self.device)
        if whole.graphs:
            prefill.sequence = whole
            logger.info("whole-step graphs of one-sequence steps: token buckets %s", tuple(sorted(whole.graphs)))

    def _run_model(self, batch: ForwardBatch, raw: bool = False) -> torch.Tensor:
        """The model's forward on a prepared batch (`raw`: the lm_head's output, as `HybridCausalLM.forward`);
        with an MTP head it also keeps the final-norm hidden state of every row in `step_hidden` (what the head
        reads, `engine.speculative`)."""
        if self.mtp_head is None:
            return self.model(batch, self.pools, self.backend, raw=raw)
        logits, self.step_hidden = self.model.forward_with_hidden(batch, self.pools, self.backend, raw=raw)
        return logits

    def _capture(self, graphs: _DecodeGraphs) -> None:
        """Capture one graph per bucket, largest first (smaller ones reuse its memory pool, and the verify graphs
        the decode graphs'); each is run once eagerly first (kernel compilation, lazily built weights) on the
        all-padding static batch."""
        if self._graphs is not None and graphs is not self._graphs:
            graphs.pool = self._graphs.pool
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for size in reversed(graphs.sizes):
                self._run_model(self.backend.prepare(graphs.static_batch(size)))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        with torch.inference_mode():
            for size in reversed(graphs.sizes):
                # kept: the graph reads what `prepare` allocated outside it (a verify step's chunk tables, cu_seqlens,
                # draft counts), which must outlive every replay
                batch = graphs.prepared[size] = self.backend.prepare(graphs.static_batch(size))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=graphs.pool):
                    graphs.outputs[size] = self._run_model(batch, raw=True)
                    graphs.hidden[size] = self.step_hidden
                graphs.pool = graph.pool()
                graphs.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def _compile_copies(self, *, num_blocks: int) -> None:
        """One KV save (block 0 onto block 1: both hold nothing yet), so that the copy kernel's variant for each
        KV group (its geometry is a compile-time specialisation) compiles at start-up
        rather than inside the first step that saves or restores a checkpoint (what that costs: docs/bench.md,
        "Start-up compiles"). The ids here are fresh tensors, 16-byte
        aligned like every id field of a step (`input_builder._to_device`), so the pointer specialisation matches.
        With speculative decoding, the same for the rollback's whole-row copy of each state group (the scratch
        slot onto itself: a no-op). The paged state copies' kernel is compiled without running
        (`PagedStates.compile`)."""
        first, second = (torch.tensor([i], dtype=torch.int64, device=self.device) for i in (0, 1))
        if num_blocks >= 2:
            self._copy(DeviceCopyOp(CopyKind.KV_SAVE, first, second))
        self.paged_states.compile()
        if self.num_speculative_tokens:
            scratch = torch.tensor([self.scratch_slot], dtype=torch.int64, device=self.device)
            copy_state_rows(self.pools.state_groups, scratch, scratch)

    @property
    def num_host_blocks(self) -> int:
        """The host tier's blocks this runner holds its shard of (0 without a host tier)."""
        return 0 if self.host_pool is None else self.host_pool.num_blocks

    def attach_host_pool(self, num_blocks: int) -> None:
        """Give the runner `num_blocks` host blocks for the host tier's copies (`engine/host_pool.py`; on CUDA
        pinned, and copied on two side streams that overlap the forward)."""
        cuda = self.device.type == "cuda"
        self.host_pool = HostPool(self.paged_states, num_blocks, pin=cuda,
                                  streams=CopyStreams(self.device) if cuda else None)

    @torch.inference_mode()
    def _compile_on_pools(self, *, block_size: int, kernel_block_size: int, num_blocks: int = 0) -> None:
        """Two eager forwards on these pools, a 2-token prefill then a 1-token decode of the same sequence (slot 0
        and block 0, which nothing holds yet), so that the kernels that take pool strides compile for these pools
        at start-up: the profiling forward ran on pools just big enough for it, whose KV stride fits in int32
        where a full pool's does not (another specialisation of the attention prefill kernel, which otherwise
        compiled inside the first request), and decode graphs are not captured when steps run eagerly.
        With the MoE block's tiles and sort buckets (`moe/grouped.compile_tiles`), the copy kernels
        (`_compile_copies`) and the run-time counts left unspecialised (`do_not_specialize`), nothing compiles
        while serving (tests/engine/test_no_compile_after_start_up.py). The last forward's logits go through the
        sampler's greedy argmax (its one variant per vocabulary). Then, when `num_blocks` hold them, 16 and 128
        tokens over a context of 2,048 (the attention prefill's key splits start there: `triton_paged.prefill_splits`),
        for engines whose one-sequence steps run eagerly or piecewise: Kimi's MLA runs the first absorbed (fewer
        than `mla_prefill.EXPAND_MIN_QUERIES` queries a key: the latent kernel's prefill in splits) and the second
        expanded (the paged prefill's split kernel, which its windows of keys also run)."""
        steps: list[tuple[list[SeqChunk], list[tuple[int, ...]]]] = [
            ([SeqChunk(token_ids=[0, 0], start=0, block_ids=[0], slot=0)], []),
            ([SeqChunk(token_ids=[0], start=2, block_ids=[0], slot=0)], []),
        ]
        long_start = 2048
        for new in (16, 128):
            if num_blocks * block_size >= long_start + new:
                blocks = list(range(-(-(long_start + new) // block_size)))
                steps.append(([SeqChunk(token_ids=[0] * new, start=long_start, block_ids=blocks, slot=0)], []))
        k = self.num_speculative_tokens
        if k and k + 4 <= block_size:  # verify rows: alone (the full verify kernel), beside a prefill (states only)
            verify = SeqChunk(token_ids=[0] * (k + 1), start=3, block_ids=[0], slot=0)
            steps.append(([verify], [self.draft_slots(0, k)]))
            if self.draft_base > 1:
                steps.append(([verify, SeqChunk(token_ids=[0, 0], start=0, block_ids=[0], slot=1)],
                              [self.draft_slots(0, k), ()]))
        for chunks, drafts in steps:
            batch = build_forward_batch(chunks, block_size=block_size, kernel_block_size=kernel_block_size,
                                        device=self.device, draft_slots=drafts)
            logits = self.model(self.backend.prepare(batch), self.pools, self.backend)
        greedy_tokens(logits)  # the sampler's argmax kernel (`sampling.sample_async`, all-greedy steps)
        torch.cuda.synchronize(self.device)

    def _copy(self, op: DeviceCopyOp) -> None:
        """Run one copy op by its kind's entry of `COPY_HANDLERS`; ValueError for a kind that has none (a new kind
        is never routed to another kind's copy)."""
        handler = COPY_HANDLERS.get(op.kind)
        if handler is None:
            raise ValueError(f"the runner has no copy handler for {op.kind!r}: add one to COPY_HANDLERS")
        handler(self, op)


def _copy_kv(runner: ModelRunner, op: DeviceCopyOp) -> None:
    """KV blocks src -> dst: one batched copy per KV group (every attention layer's pages of each block)."""
    for kv in runner.pools.kv_groups:
        copy_blocks(kv, op.src_ids, op.dst_ids, pages_per_block=runner.pages_per_block, page_dim=2)


def _save_state(runner: ModelRunner, op: DeviceCopyOp) -> None:
    """Runtime chunks (`slot * k + j`) -> pages (see `hybridcache.cache.plan`)."""
    runner.paged_states.save(op.src_ids, op.dst_ids)


def _restore_state(runner: ModelRunner, op: DeviceCopyOp) -> None:
    """Pages -> runtime chunks."""
    runner.paged_states.restore(op.src_ids, op.dst_ids)


def _host_pool(runner: ModelRunner, op: DeviceCopyOp) -> HostPool:
    if runner.host_pool is None:
        raise ValueError(f"{op.kind!r} needs the host tier's pool, and this runner has none (attach_host_pool)")
    return runner.host_pool


def _host_save(runner: ModelRunner, op: DeviceCopyOp) -> None:
    """Device blocks -> host blocks (a demotion)."""
    _host_pool(runner, op).save(op.src_ids, op.host_ids)


def _host_finish(runner: ModelRunner, op: DeviceCopyOp) -> None:
    """Runtime chunks -> host blocks (a finish checkpoint demoted before its STATE_FINISH ran)."""
    _host_pool(runner, op).finish(op.src_ids, op.host_ids)


def _host_load(runner: ModelRunner, op: DeviceCopyOp) -> None:
    """Host blocks -> device blocks (a promotion)."""
    _host_pool(runner, op).load(op.host_ids, op.dst_ids)


def _rollback_state(runner: ModelRunner, op: DeviceCopyOp) -> None:
    """Draft states (`slot * k + j`, rows `draft_base + id` of every state group) -> runtime slots, whole rows
    (speculative decoding: the state after a verify row's last accepted position)."""
    copy_state_rows(runner.pools.state_groups, op.src_ids + runner.draft_base, op.dst_ids)


# How the runner executes each copy kind (a kind's value is its (pool, phase, what)). A new kind (a host tier's
# device <-> pinned host copies) is a `CopyKind` member in `hybridcache.copy_kinds` and one entry here.
COPY_HANDLERS: dict[CopyKind, Callable[[ModelRunner, DeviceCopyOp], None]] = {
    CopyKind.HOST_FINISH: _host_finish,
    CopyKind.HOST_SAVE: _host_save,
    CopyKind.HOST_LOAD: _host_load,
    CopyKind.STATE_FINISH: _save_state,
    CopyKind.KV_RESTORE: _copy_kv,
    CopyKind.STATE_RESTORE: _restore_state,
    CopyKind.KV_SAVE: _copy_kv,
    CopyKind.STATE_SAVE: _save_state,
    CopyKind.STATE_ROLLBACK: _rollback_state,
}


def measure_activation_bytes(
    model: torch.nn.Module,
    backend: KernelBackend,
    *,
    num_tokens: int,
    block_size: int,
    kernel_block_size: int,
    dtype: torch.dtype,
    state_dtype: torch.dtype,
    device: torch.device,
) -> int:
    """The activation peak (bytes above what was allocated before) of one prefill forward of `num_tokens`
    tokens as one fresh sequence, on pools just big enough for it (freed after). Run twice: the first run
    compiles kernels and lets backends build their lazy weight layouts (which briefly hold two copies)."""
    num_blocks = -(-num_tokens // block_size)
    pools = DevicePools.allocate(
        model.state_specs(dtype, state_dtype), num_pages=num_blocks * (block_size // kernel_block_size),
        kernel_block_size=kernel_block_size, num_slots=1, device=device,
    )
    chunk = SeqChunk(token_ids=[0] * num_tokens, start=0, block_ids=list(range(num_blocks)), slot=0)
    batch = build_forward_batch([chunk], block_size=block_size, kernel_block_size=kernel_block_size, device=device)
    peak = 0
    for _ in range(2):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        model(backend.prepare(batch), pools, backend)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    del pools, batch
    torch.cuda.empty_cache()
    return peak
