"""The MTP head's device work after a step: one `DraftPlan`, built on the host by `speculative.MtpDrafter`, run by
every rank's runner (`ModelRunner.draft`; under tensor parallelism the executor sends the plan to every worker and
the ranks run it in lock step, as they run a forward).

A plan is a catch-up pass and then the further draft positions::

    catch-up   the head over every position the step computed for each running sequence (its KV there; row p
               reads the token at p + 1 and the target's hidden state at p, `hidden_rows` of `step_hidden`); the
               last row of each sequence in `first` proposes its first draft
    steps[i]   one row per sequence still drafting (`keep`: its index among the rows that proposed before), at
               the next position, fed the draft just proposed and the head's own output hidden state; proposes
               draft i + 2

Every id and position in a plan follows from host counts (budgets, `num_computed`), so the whole plan is built
before the head runs and travels as one message. The proposals are argmaxes of the all-gathered logits; a proposal
that a further step embeds is agreed on every rank by `agree` (under tensor parallelism a broadcast from rank 0,
which decides, as it decides sampled tokens; the identity on one device). Only rank 0's returned tokens are read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.backend import KernelBackend
from hybridcache.state_spec import DevicePools


@dataclass(frozen=True)
class DraftStep:
    """One further draft position: `batch` one row per sequence still drafting (its token a placeholder: the draft
    is embedded on the device), `keep` [rows] its index among the previous proposals (int64)."""

    batch: ForwardBatch
    keep: torch.Tensor


@dataclass(frozen=True)
class DraftPlan:
    """The head's work after one step (module docstring). `batch`: the catch-up rows (not prepared: a plan travels
    to other ranks); `hidden_rows` [rows] int64: the row of the target's `step_hidden` each catch-up row reads;
    `first` int64: the sequences of `batch` (indices into its `logits_indices`) that propose drafts; `steps`: the
    further positions, in order."""

    batch: ForwardBatch
    hidden_rows: torch.Tensor
    first: torch.Tensor
    steps: tuple[DraftStep, ...] = ()


def identity(tokens: torch.Tensor) -> torch.Tensor:
    return tokens


@torch.inference_mode()
def run_draft_plan(plan: DraftPlan, *, head: torch.nn.Module, model: torch.nn.Module, pools: DevicePools,
                   backend: KernelBackend, hidden: torch.Tensor,
                   agree: Callable[[torch.Tensor], torch.Tensor] = identity) -> torch.Tensor:
    """Run `plan` with the MTP `head` of `model` on `pools` (the head's KV: the layers after the target's) from the
    target forward's final-norm hidden rows `hidden`; returns the proposed tokens, int64 on the device: the first
    proposal of each sequence of `plan.first`, then each step's (empty when `first` is). `agree`: see the module
    docstring (it is called, on every rank alike, on each proposal a further step embeds)."""
    kv = pools.layers[len(model.model.layers):]
    batch = plan.batch
    out = head(model.model.embed_tokens(batch.input_ids), hidden.index_select(0, plan.hidden_rows),
               backend.prepare(batch), kv, backend)
    if not plan.first.numel():
        return torch.empty(0, dtype=torch.int64, device=out.device)
    last = out.index_select(0, batch.logits_indices.index_select(0, plan.first))
    proposals = []
    for index, step in enumerate(plan.steps, start=1):
        tokens = agree(model._logits(last).argmax(dim=-1))
        proposals.append(tokens)
        last = head(model.model.embed_tokens(tokens.index_select(0, step.keep)), last.index_select(0, step.keep),
                    backend.prepare(step.batch), kv, backend, step=index)
    proposals.append(model._logits(last).argmax(dim=-1))
    return torch.cat(proposals)
