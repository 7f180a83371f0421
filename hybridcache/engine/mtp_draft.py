"""The MTP head's device work after a step: one `DraftPlan`, built on the host by `speculative.MtpDrafter`, run by
every rank's runner (`ModelRunner.draft`; under tensor parallelism the executor sends the plan to every worker and
the ranks run it in lock step, as they run a forward).

A plan is a catch-up pass and then the further draft positions::

    catch-up   the head over positions the step computed for each running sequence (its KV there; row p reads
               the token at p + 1 and the target's hidden state at p, `hidden_rows` of `step_hidden`); the rows
               in `first` (each sequence's last accepted position) propose the first drafts
    steps[i]   one row per sequence still drafting (`keep`: its index among the rows that proposed before; None:
               every one), at the next position, fed the draft just proposed and the head's own output hidden
               state; proposes draft i + 2

A *uniform* plan (`tokens_per_seq` q, `MtpDrafter.plan`) has q catch-up rows for every sequence (q = 1 after a
plain decode step, 1 + k after a verify step of k drafts per row: rows past the last accepted position are fed
a placeholder and write head KV only at positions the next step's catch-up rewrites before anything reads them),
every sequence drafts k tokens, and no step drops a row: its shapes are a function of the sequence count, so the
runner replays it from a CUDA graph per batch bucket (`engine/draft_graphs.py`). Other plans (a step with prompt
chunks, rows of different widths or a row on an image) list only the positions that hold tokens and drop sequences
as their budgets run out, and run eagerly.

Every row rotates as the target's row at its position: rows of a sequence with images carry its M-RoPE positions
(`SeqChunk.rope_positions` / `rope_shift`, the batch's `rope_positions`), which the head's rotary takes. A catch-up
row whose p + 1 is an image position reads the image's embedding there, as the target did (the batch's `embeds`
at `embed_rows`, written over the embedded tokens in `draft_chain`; vLLM's MTP model embeds its inputs so too).

Every id and position in a plan follows from host counts (budgets, `num_computed`), so the whole plan is built
before the head runs and travels as one message. The proposals are argmaxes of the all-gathered logits; a proposal
that a further step embeds is agreed on every rank by `agree` (under tensor parallelism a broadcast from rank 0,
which decides, as it decides sampled tokens; the identity on one device). Only rank 0's returned tokens are read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.backend import KernelBackend
from hybridcache.state_spec import DevicePools, LayerState


@dataclass(frozen=True)
class DraftStep:
    """One further draft position: `batch` one row per sequence still drafting (its token a placeholder: the draft
    is embedded on the device), `keep` [rows] its index among the previous proposals (int64), None when every
    sequence that proposed before drafts on."""

    batch: ForwardBatch
    keep: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftPlan:
    """The head's work after one step (module docstring). `batch`: the catch-up rows (not prepared: a plan travels
    to other ranks); `hidden_rows` [rows] int64: the row of the target's `step_hidden` each catch-up row reads;
    `first` int64: the rows of `batch` whose outputs propose the first drafts, one per proposing sequence;
    `steps`: the further positions, in order; `tokens_per_seq`: q of a uniform plan (module docstring), 0 for
    any other. `reads_prior`: some `hidden_rows` are past the step's rows: row (step rows + i) is the hidden
    state sequence i of the step had before it (its slot's `last_hidden`: the position before its chunk), for a
    catch-up row at that position (`MtpDrafter` after a hit; `ModelRunner.step_prior`)."""

    batch: ForwardBatch
    hidden_rows: torch.Tensor
    first: torch.Tensor
    steps: tuple[DraftStep, ...] = ()
    tokens_per_seq: int = 0
    reads_prior: bool = False


def identity(tokens: torch.Tensor) -> torch.Tensor:
    return tokens


@torch.inference_mode()
def run_draft_plan(plan: DraftPlan, *, head: torch.nn.Module, model: torch.nn.Module, pools: DevicePools,
                   backend: KernelBackend, hidden: torch.Tensor, prior: torch.Tensor | None = None,
                   agree: Callable[[torch.Tensor], torch.Tensor] = identity) -> torch.Tensor:
    """Run `plan` eagerly with the MTP `head` of `model` on `pools` (the head's KV: the layers after the target's)
    from the target forward's final-norm hidden rows `hidden` (and, for a plan that `reads_prior`, the step's
    sequences' hidden states before it, `prior`); returns the proposed tokens, int64 on the device: the first
    proposal of each row of `plan.first`, then each step's (empty when `first` is). `agree`: see the module
    docstring (it is called, on every rank alike, on each proposal a further step embeds)."""
    if plan.reads_prior:
        if prior is None:
            raise ValueError("the draft plan reads the step's prior hidden states, which the step did not keep")
        hidden = torch.cat([hidden, prior.to(hidden.dtype)])
    steps = [(backend.prepare(step.batch), step.keep) for step in plan.steps]
    return draft_chain(backend.prepare(plan.batch), hidden.index_select(0, plan.hidden_rows), plan.first, steps,
                       head=head, model=model, kv=head_kv(model, pools), backend=backend, agree=agree)


def head_kv(model: torch.nn.Module, pools: DevicePools) -> tuple[LayerState, ...]:
    """The MTP head's KV layers of `pools` (the layers after the target's)."""
    return tuple(pools.layers[model.num_state_layers:])


def draft_chain(batch: ForwardBatch, hidden: torch.Tensor, first: torch.Tensor,
                steps: Sequence[tuple[ForwardBatch, torch.Tensor | None]], *, head: torch.nn.Module,
                model: torch.nn.Module, kv: tuple[LayerState, ...], backend: KernelBackend,
                agree: Callable[[torch.Tensor], torch.Tensor] = identity) -> torch.Tensor:
    """The device work of a plan, on prepared batches: the head over the catch-up rows `batch` (fed `hidden`, one
    row per row of it), the proposals of rows `first`, then per further step (its prepared batch, its `keep`)
    argmax -> embed -> head, all on the device with no host read (what a draft graph captures). Returns the
    proposals in `run_draft_plan`'s order."""
    embeds = model.model.embed_tokens(batch.input_ids)
    if batch.embeds is not None:  # rows reading an image position: the image's embedding, as the target read it
        embeds[batch.embed_rows] = batch.embeds.to(embeds.dtype)
    out = head(embeds, hidden, batch, kv, backend)
    if not first.numel():
        return torch.empty(0, dtype=torch.int64, device=out.device)
    last = out.index_select(0, first)
    proposals = []
    for index, (step_batch, keep) in enumerate(steps, start=1):
        tokens = agree(model._logits(last, raw=True).argmax(dim=-1))
        proposals.append(tokens)
        if keep is not None:
            tokens, last = tokens.index_select(0, keep), last.index_select(0, keep)
        last = head(model.model.embed_tokens(tokens), last, step_batch, kv, backend, step=index)
    proposals.append(model._logits(last, raw=True).argmax(dim=-1))
    return torch.cat(proposals)
