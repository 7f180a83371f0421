"""Train gpu_engine.py's Qwen3-Next shape briefly as a byte LM on this repository's prose: a model with peaked logits.

    PYTHONPATH=. python benchmarks/train_byte_lm.py --out DIR [--steps 300] [--mtp-steps 0] [--device cpu|cuda]
                                                    [--num-layers N] [--mtp-unroll 1|2]

Why: a random model's logits are nearly flat, so bf16 rounding differences between two chunkings of the same
text flip its greedy choice often (docs/design.md, "Engine, cached vs uncached greedy"). A trained model's top
logit stands clear of the rest at most steps; `benchmarks/gpu_engine.py --model-dir DIR` measures cached vs
uncached agreement on it.

Model: transformers' `Qwen3NextForCausalLM` (the oracle implementation: its torch path on the CPU; on CUDA it uses
flash-linear-attention when fla is importable, whose 0.6 release refuses its gated chunk backward under Triton <
3.7.1 on Hopper: train with fla off the path there, as docs/bench.md does) with `gpu_engine.MODEL`'s shape over the
byte tokenizer's 320 ids, transformers' own initialisation. Corpus: README.md and docs/*.md of the checkout,
concatenated in that order (its size and sha256 are printed and recorded). It is cut into 4,096-byte pieces; every
10th piece is held out. A step is `--batch` windows of `--seq-len` + 1 bytes at seeded random offsets in the
training pieces; AdamW (lr 3e-3, 5% warm-up, cosine decay to 10%, weight decay 0.1, gradient norm clipped at 1),
bf16 autocast on CUDA, fp32 on the CPU. The held-out loss is the mean next-byte cross entropy (nats per byte) over
consecutive windows of the held-out pieces.

MTP head (`--mtp-steps N`, N > 0): after the model, its multi-token-prediction head (`hybridcache.models.mtp`: the
pre-fc norms, fc, one full-attention decoder layer of the model's kind built by transformers, the final norm;
embedding and lm_head the model's, frozen with the rest of it) is trained for N steps on the same windows to
predict the byte after next: row t reads byte t + 1 and the model's final hidden state at t, and its loss is the
cross entropy against byte t + 2 (same optimiser settings). The frozen model needs no backward: its hidden states
are computed without autograd ahead of the steps that read them, FROZEN_WINDOWS windows per forward (an eager
forward's kernel launches and host syncs, which set its time on a GPU at this size, do not grow with the windows
it batches), so a step runs only the head; the windows and their order are those the steps draw. Recorded: its
held-out loss before and after, and the held-out fraction of positions where its argmax is the byte after next
(what greedy speculative decoding accepts at draft position 1, given the model's own next byte) and, of those
positions, the fraction where its second draft is right too (`MtpTrainer.unrolled`: the head run again on its own
output, as the engine drafts position 2). `--mtp-unroll 2` trains on both positions' losses (their sum), not on
position 1's alone: a further draft reads the head's own output, which position 1's loss never trains for. Without
`--mtp-steps` the folder gets a random head, like every random folder.

Writes DIR: the transformers folder (config.json, model.safetensors with transformers' tensor names, fp32;
tokenizer.json, tokenizer_config.json) that `hybridcache.LLM` loads unchanged, plus `training_corpus.txt`
(the corpus bytes, so prompts can be drawn from them later) and `training.json` (corpus size and hash, the
options, the loss curve, the held-out loss before and after, seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu_engine import MODEL
from tests.engine.model_folders import HF_CLASSES, byte_config, save_model_folder

REPO = Path(__file__).resolve().parents[1]
FROZEN_WINDOWS = 256  # windows per forward of the frozen model when the MTP head trains (its hidden states cached)
PIECE = 4096  # bytes; every HOLD_OUT-th piece of the corpus is held out
HOLD_OUT = 10
CORPUS_FILE = "training_corpus.txt"
RECORD_FILE = "training.json"


@dataclass(frozen=True)
class TrainOptions:
    """What one training run does. `steps` optimiser steps of `batch` windows of `seq_len` + 1 bytes."""

    steps: int = 300
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0
    device: str = "cpu"
    log_every: int = 25
    mtp_steps: int = 0
    mtp_unroll: int = 1


def corpus_bytes(root: Path = REPO) -> bytes:
    """README.md then docs/*.md (sorted) of the checkout at `root`, concatenated."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or len(files) < 2:
        raise FileNotFoundError(f"the training corpus needs README.md and docs/*.md under {root}; missing {missing}")
    return b"".join(f.read_bytes() for f in files)


def split(corpus: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, held-out bytes) as int64 tensors: every HOLD_OUT-th PIECE-byte piece is held out.

    Example: a 45,000-byte corpus has 11 pieces (the last one short); piece 9 (bytes 36,864-40,959) is held out,
    the other 10 are concatenated for training.
    """
    pieces = [corpus[i:i + PIECE] for i in range(0, len(corpus), PIECE)]
    held = b"".join(p for i, p in enumerate(pieces) if i % HOLD_OUT == HOLD_OUT - 1)
    train = b"".join(p for i, p in enumerate(pieces) if i % HOLD_OUT != HOLD_OUT - 1)
    return torch.tensor(list(train), dtype=torch.long), torch.tensor(list(held), dtype=torch.long)


def next_byte_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of predicting windows[:, 1:] from windows[:, :-1] (nats per byte)."""
    inputs = windows[:, :-1]
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, held: torch.Tensor, options: TrainOptions) -> float:
    """next_byte_loss over consecutive, non-overlapping windows of the held-out bytes, in batches."""
    model.eval()
    width = options.seq_len + 1
    count = len(held) // width
    if count == 0:
        raise ValueError(f"{len(held)} held-out bytes make no window of {width}: the corpus is too small")
    windows = held[:count * width].view(count, width).to(options.device)
    total = 0.0
    for start in range(0, count, options.batch):
        part = windows[start:start + options.batch]
        with autocast(options.device):
            total += next_byte_loss(model, part).item() * len(part)
    model.train()
    return total / count


def autocast(device: str):
    """bf16 autocast on CUDA; the CPU trains in fp32."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


def learning_rate(step: int, options: TrainOptions) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to 10% of `lr`."""
    warmup = max(1, options.steps // 20)
    if step < warmup:
        return options.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, options.steps - warmup)
    return options.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(out: Path, options: TrainOptions, corpus: bytes | None = None, shape: dict | None = None) -> dict:
    """Train and write the folder `out` (see the module docstring); returns the record written to training.json.

    `corpus`: the text (default `corpus_bytes()`); `shape`: config fields (default `gpu_engine.MODEL`).
    """
    import transformers

    start = time.perf_counter()
    corpus = corpus_bytes() if corpus is None else corpus
    train_bytes, held = split(corpus)
    if len(train_bytes) <= options.seq_len + 1:
        raise ValueError(f"{len(train_bytes)} training bytes are too few for windows of {options.seq_len + 1}")
    torch.manual_seed(options.seed)
    config = byte_config("qwen3_next", **(MODEL if shape is None else shape))
    model = getattr(transformers, HF_CLASSES["qwen3_next"])(config).to(options.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, betas=(0.9, 0.95),
                                  weight_decay=options.weight_decay)
    generator = torch.Generator().manual_seed(options.seed)
    train_bytes = train_bytes.to(options.device)
    offsets_range = torch.arange(options.seq_len + 1, device=options.device)
    record = {"corpus": {"files": "README.md + docs/*.md", "bytes": len(corpus),
                         "sha256": hashlib.sha256(corpus).hexdigest(), "train_bytes": len(train_bytes),
                         "held_out_bytes": len(held)},
              "options": asdict(options), "parameters": sum(p.numel() for p in model.parameters()),
              "held_out_loss_before": held_out_loss(model, held, options), "losses": []}
    print(f"corpus {record['corpus']}; {record['parameters']:,} parameters; held-out loss before training "
          f"{record['held_out_loss_before']:.3f} nats/byte (uniform over 256 bytes: {math.log(256):.3f})", flush=True)
    for step in range(options.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, options)
        starts = torch.randint(0, len(train_bytes) - options.seq_len - 1, (options.batch,), generator=generator)
        windows = train_bytes[starts.to(options.device)[:, None] + offsets_range]
        with autocast(options.device):
            loss = next_byte_loss(model, windows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % options.log_every == 0 or step + 1 == options.steps:
            value = loss.item()
            record["losses"].append([step + 1, value])
            print(f"step {step + 1}/{options.steps}: training loss {value:.3f} nats/byte "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    record["held_out_loss"] = held_out_loss(model, held, options)
    print(f"held-out loss {record['held_out_loss']:.3f} nats/byte ({record['held_out_loss'] / math.log(2):.2f} "
          f"bits/byte) after {options.steps} steps, {time.perf_counter() - start:.1f} s", flush=True)
    # the model folder first (with a random head), so that a run cut short while the head trains leaves a model
    record["seconds"] = record["model_seconds"] = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    save_model_folder(model.float().cpu().eval(), out)
    model.to(options.device)
    (out / CORPUS_FILE).write_bytes(corpus)
    (out / RECORD_FILE).write_text(json.dumps(record, indent=1))
    print(f"wrote {out} ({time.perf_counter() - start:.1f} s)", flush=True)
    if options.mtp_steps:
        save_mtp(train_mtp(model, train_bytes, held, options, record), out)
        record["seconds"] = time.perf_counter() - start
        (out / RECORD_FILE).write_text(json.dumps(record, indent=1))
    return record


class MtpTrainer(torch.nn.Module):
    """The MTP head as a trainable module over a frozen transformers model (see the module docstring), built from
    that model's own classes (its decoder layer, as full attention with the MoE rule of layer 0, and its RMSNorm):
    an implementation of the head independent of `hybridcache.models.mtp`. Parameter names are the checkpoint's
    without the `mtp.` prefix (the decoder layer keeps transformers' names, stacked experts included, which the
    MTP loader accepts)."""

    def __init__(self, model: torch.nn.Module) -> None:
        import copy

        import transformers

        super().__init__()
        config = copy.deepcopy(model.config)
        config.layer_types = ["full_attention"]  # layer 0 of a one-layer config: full attention, MoE as index 0
        config.num_hidden_layers = 1
        hidden = config.hidden_size
        norm = type(model.model.norm)
        self.pre_fc_norm_embedding = norm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=config.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = torch.nn.ModuleList([type(model.model.layers[0])(config, layer_idx=0)])
        self.norm = norm(hidden, eps=config.rms_norm_eps)
        for module in self.modules():  # modules built outside from_pretrained keep torch.empty's bytes (experts)
            model._init_weights(module)
        self.mask_config = config
        self._create_causal_mask = transformers.masking_utils.create_causal_mask

    def logits(self, model: torch.nn.Module, windows: torch.Tensor,
               target_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [B, L - 2, vocab] of the head over windows [B, L]: row t reads byte t + 1 and the model's
        final hidden state at t (positions 0 .. L - 3). `target_hidden`: those hidden states [B, L - 2, hidden]
        when already computed (`frozen_hidden`), else the model runs here."""
        positions = torch.arange(windows.shape[1] - 2, device=windows.device).expand(len(windows), -1)
        with torch.no_grad():
            if target_hidden is None:
                target_hidden = frozen_hidden(model, windows, len(windows))
            embeds = model.model.embed_tokens(windows[:, 1:-1])
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(target_hidden)], dim=-1))
        mask = self._create_causal_mask(**self._mask_arguments(x, positions))
        x = self.layers[0](x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=mask,
                           position_ids=positions)
        return model.lm_head(self.norm(x)).float()

    def unrolled_logits(self, model: torch.nn.Module, windows: torch.Tensor,
                        target_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits of the head at draft positions 1 [B, L - 2, vocab] and 2 [B, L - 3, vocab] over windows
        [B, L], as the engine drafts (`mtp_draft.draft_chain`): pass 1 is `logits` (row t at position t reads byte
        t + 1 and the model's hidden state at t, for byte t + 2); pass 2 feeds row t byte t + 2 (the first draft,
        when it is right) and pass 1's final-norm output at t, at position t + 1, for byte t + 3, attending to pass
        1's rows at positions <= t and to itself (the head's KV the engine holds then). `target_hidden` as in
        `logits`."""
        batch, length = windows.shape
        rows = length - 2
        positions = torch.arange(rows, device=windows.device).expand(batch, -1)
        with torch.no_grad():
            if target_hidden is None:
                target_hidden = frozen_hidden(model, windows, len(windows))
            embeds = model.model.embed_tokens(windows[:, 1:-1])
            following = model.model.embed_tokens(windows[:, 2:])
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(target_hidden)], dim=-1))
        mask = self._create_causal_mask(**self._mask_arguments(x, positions))
        first = self.norm(self.layers[0](x, position_embeddings=model.model.rotary_emb(x, positions),
                                         attention_mask=mask, position_ids=positions))
        second = self.fc(torch.cat([self.pre_fc_norm_embedding(following), self.pre_fc_norm_hidden(first)], dim=-1))
        joint, at = torch.cat([x, second], dim=1), torch.cat([positions, positions + 1], dim=1)
        index = torch.arange(rows, device=windows.device)
        allowed = torch.zeros(2 * rows, 2 * rows, dtype=torch.bool, device=windows.device)
        allowed[:rows, :rows] = index[None, :] <= index[:, None]  # pass 1: causal
        allowed[rows:, :rows] = index[None, :] <= index[:, None]  # pass 2 row t: pass 1 at positions <= t
        allowed[rows + index, rows + index] = True  # and itself
        joint_mask = torch.zeros(allowed.shape, dtype=joint.dtype, device=windows.device).masked_fill(
            ~allowed, torch.finfo(joint.dtype).min)[None, None].expand(batch, 1, -1, -1)
        out = self.layers[0](joint, position_embeddings=model.model.rotary_emb(joint, at), attention_mask=joint_mask,
                             position_ids=at)
        return model.lm_head(first).float(), model.lm_head(self.norm(out[:, rows: 2 * rows - 1])).float()

    def unrolled(self, model: torch.nn.Module, windows: torch.Tensor, target_hidden: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cross entropy at draft position 1, at position 2, the fraction of rows right at position 1, the fraction
        of those also right at position 2: what greedy verification accepts there) of `unrolled_logits`."""
        logits1, logits2 = self.unrolled_logits(model, windows, target_hidden)
        want1, want2 = windows[:, 2:], windows[:, 3:]
        vocab = logits1.shape[-1]
        loss1 = F.cross_entropy(logits1.reshape(-1, vocab), want1.reshape(-1))
        loss2 = F.cross_entropy(logits2.reshape(-1, vocab), want2.reshape(-1))
        right1 = logits1.argmax(dim=-1) == want1
        right2 = (logits2.argmax(dim=-1) == want2) & right1[:, :-1]
        return loss1, loss2, right1.float().mean(), right2.float().sum() / right1[:, :-1].sum().clamp(min=1)

    def _mask_arguments(self, x: torch.Tensor, positions: torch.Tensor) -> dict:
        """`create_causal_mask`'s arguments for a causal mask without a cache, named as this transformers names them
        (5.24: inputs_embeds, cache; 5.17 and earlier: input_embeds or inputs_embeds, past_key_values,
        cache_position)."""
        import inspect

        names = inspect.signature(self._create_causal_mask).parameters
        arguments = {"config": self.mask_config, "attention_mask": None}
        arguments["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = x
        for name in ("cache", "past_key_values"):
            if name in names:
                arguments[name] = None
        if "cache_position" in names:
            arguments["cache_position"] = torch.arange(x.shape[1], device=x.device)
        if "position_ids" in names:
            arguments["position_ids"] = positions
        return arguments

    def loss(self, model: torch.nn.Module, windows: torch.Tensor,
             target_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross entropy of byte t + 2 from row t, the fraction of rows whose argmax is it) over windows [B, L];
        `target_hidden` as in `logits`."""
        logits = self.logits(model, windows, target_hidden)
        want = windows[:, 2:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), want.reshape(-1))
        return loss, (logits.argmax(dim=-1) == want).float().mean()


@torch.no_grad()
def frozen_hidden(model: torch.nn.Module, windows: torch.Tensor, batch: int = FROZEN_WINDOWS) -> torch.Tensor:
    """The model's final hidden states [N, L - 2, hidden] over windows [N, L]: its inputs are windows[:, :-2] at
    positions 0 .. L - 3 (what the MTP head reads at row t), run without autograd, `batch` windows per forward.
    The model is causal, so a window's states do not depend on the windows batched with it (up to the rounding of
    a different batch shape)."""
    positions = torch.arange(windows.shape[1] - 2, device=windows.device)
    parts = []
    for start in range(0, len(windows), batch):
        inputs = windows[start:start + batch, :-2]
        parts.append(model.model(input_ids=inputs, position_ids=positions.expand_as(inputs),
                                 use_cache=False).last_hidden_state)
    return torch.cat(parts)


def train_mtp(model: torch.nn.Module, train_bytes: torch.Tensor, held: torch.Tensor, options: TrainOptions,
              record: dict) -> MtpTrainer:
    """Train the MTP head over the frozen `model` for `options.mtp_steps` steps; fills record["mtp"].

    The frozen model needs no backward, so its hidden states are computed ahead of the steps that read them,
    FROZEN_WINDOWS windows per forward (`training_windows`), and the held-out windows' once for both held-out
    measurements: a step runs only the head. The windows, their order and the steps are those of running the
    model inside every step."""
    model.eval().requires_grad_(False)
    torch.manual_seed(options.seed + 1)
    head = MtpTrainer(model).to(options.device).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=options.lr, betas=(0.9, 0.95),
                                  weight_decay=options.weight_decay)
    width = options.seq_len + 1
    count = len(held) // width
    held_windows = held[:count * width].view(count, width).to(options.device)
    began = time.perf_counter()
    with autocast(options.device):
        held_hidden = frozen_hidden(model, held_windows)

    @torch.no_grad()
    def held_out() -> tuple[float, float, float]:
        losses, hits, seconds = [], [], []
        for start in range(0, count, options.batch):
            part = slice(start, start + options.batch)
            with autocast(options.device):
                loss, _, hit, second = head.unrolled(model, held_windows[part], held_hidden[part])
            losses.append(loss.item())
            hits.append(hit.item())
            seconds.append(second.item())
        return sum(losses) / len(losses), sum(hits) / len(hits), sum(seconds) / len(seconds)

    mtp = {"steps": options.mtp_steps, "unroll": options.mtp_unroll, "losses": []}
    (mtp["held_out_loss_before"], mtp["held_out_next_next_accuracy_before"],
     mtp["held_out_second_draft_accuracy_before"]) = held_out()
    mtp_options = dataclasses.replace(options, steps=options.mtp_steps)
    for step, (windows, target_hidden) in enumerate(training_windows(model, train_bytes, options)):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, mtp_options)
        with autocast(options.device):
            if options.mtp_unroll == 2:
                first, second, _, _ = head.unrolled(model, windows, target_hidden)
                loss = first + second
            else:
                loss, _ = head.loss(model, windows, target_hidden)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % options.log_every == 0 or step + 1 == options.mtp_steps:
            mtp["losses"].append([step + 1, loss.item()])
            print(f"mtp step {step + 1}/{options.mtp_steps}: loss {loss.item():.3f} nats/byte "
                  f"({time.perf_counter() - began:.1f} s)", flush=True)
    mtp["held_out_loss"], mtp["held_out_next_next_accuracy"], mtp["held_out_second_draft_accuracy"] = held_out()
    mtp["seconds"] = time.perf_counter() - began
    print(f"mtp held-out loss {mtp['held_out_loss']:.3f} nats/byte, argmax = the byte after next at "
          f"{mtp['held_out_next_next_accuracy']:.1%} of positions, its second draft right at "
          f"{mtp['held_out_second_draft_accuracy']:.1%} of those ({mtp['seconds']:.1f} s)", flush=True)
    record["mtp"] = mtp
    return head


def training_windows(model: torch.nn.Module, train_bytes: torch.Tensor,
                     options: TrainOptions) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(windows [batch, seq_len + 1], the frozen model's hidden states over them) for each of the `mtp_steps` steps:
    windows at random offsets of a generator seeded with seed + 1, drawn in step order; the hidden states of
    FROZEN_WINDOWS // batch steps' windows come from one forward (`frozen_hidden`), so at most that many steps'
    states are held at once."""
    generator = torch.Generator().manual_seed(options.seed + 1)
    offsets_range = torch.arange(options.seq_len + 1, device=options.device)
    per_forward = max(1, FROZEN_WINDOWS // options.batch)
    for first in range(0, options.mtp_steps, per_forward):
        steps = min(per_forward, options.mtp_steps - first)
        starts = torch.cat([torch.randint(0, len(train_bytes) - options.seq_len - 1, (options.batch,),
                                          generator=generator) for _ in range(steps)])
        windows = train_bytes[starts.to(options.device)[:, None] + offsets_range]
        with autocast(options.device):
            hidden = frozen_hidden(model, windows)
        for i in range(steps):
            part = slice(i * options.batch, (i + 1) * options.batch)
            yield windows[part], hidden[part]


def save_mtp(head: MtpTrainer, out: Path) -> None:
    """Write the trained head as the folder's `mtp.*` tensors (replacing the random one `save_model_folder` wrote)."""
    from safetensors.torch import save_file

    from hybridcache.models.mtp import MTP_FILE

    tensors = {f"mtp.{name}": p.detach().float().cpu().contiguous() for name, p in head.named_parameters()}
    save_file(tensors, str(out / MTP_FILE))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the model folder to write")
    parser.add_argument("--steps", type=int, default=TrainOptions.steps)
    parser.add_argument("--batch", type=int, default=TrainOptions.batch)
    parser.add_argument("--seq-len", type=int, default=TrainOptions.seq_len)
    parser.add_argument("--lr", type=float, default=TrainOptions.lr)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=TrainOptions.seed)
    parser.add_argument("--log-every", type=int, default=TrainOptions.log_every)
    parser.add_argument("--num-layers", type=int, default=None,
                        help="layers of the model (default: gpu_engine.MODEL's 5); full attention every 4th, "
                             "DeltaNet elsewhere, as Qwen3-Next's 3:1")
    parser.add_argument("--mtp-steps", type=int, default=TrainOptions.mtp_steps,
                        help="then train the MTP head for this many steps (0: the folder gets a random head)")
    parser.add_argument("--mtp-unroll", type=int, choices=(1, 2), default=TrainOptions.mtp_unroll,
                        help="2: the head's loss at draft positions 1 and 2 (`MtpTrainer.unrolled`), else 1 only")
    args = parser.parse_args()
    if args.seq_len < 256:
        parser.error(f"--seq-len {args.seq_len}: train on windows of at least 256 bytes")
    options = TrainOptions(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                           device=args.device, log_every=args.log_every, mtp_steps=args.mtp_steps,
                           mtp_unroll=args.mtp_unroll)
    train(args.out, options, shape=None if args.num_layers is None else layered_shape(args.num_layers))


def layered_shape(num_layers: int) -> dict:
    """`gpu_engine.MODEL` with `num_layers` layers, every 4th full attention (Qwen3-Next's pattern: 48 layers of
    which 12 attention), the rest gated DeltaNet; layer 1 keeps the tiny Qwen3-Next config's dense MLP."""
    if num_layers < 4:
        raise ValueError(f"--num-layers {num_layers}: at least 4 (one full-attention layer)")
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    return {**MODEL, "num_hidden_layers": num_layers, "layer_types": types}


if __name__ == "__main__":
    main()
