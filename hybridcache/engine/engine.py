"""The engine: requests in, tokens out. One `step()` = schedule -> build inputs -> forward -> postprocess."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridcache.cache import CacheConfig, PrefixCache
from hybridcache.config import EngineConfig
from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.engine.multimodal import MultimodalInput, chunk_embeds, resolve_inputs
from hybridcache.engine.runner import ModelRunner
from hybridcache.engine.sequence import Sequence
from hybridcache.models import ModelConfig, get_model_class, load_model
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.outputs import CompletionOutput, RequestOutput
from hybridcache.sampling import SamplingParams, make_generator, sample
from hybridcache.scheduler.save_plan import checkpoint_policy
from hybridcache.scheduler.scheduler import ScheduledChunk, Scheduler
from hybridcache.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_DEFAULT_MODEL_LEN = 8192


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class LLMEngine:
    """Continuously batched engine over one model folder (`model_path=None`: the built-in model)."""

    def __init__(self, model_path: str | Path | None = None, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model_path = Path(model_path) if model_path is not None else ensure_builtin_model()
        self.model_config = ModelConfig.from_model_dir(self.model_path)
        get_model_class(self.model_config.architecture)  # an unknown architecture fails here, first
        model_len_limit = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or min(model_len_limit, _MAX_DEFAULT_MODEL_LEN)
        if self.max_model_len > model_len_limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {model_len_limit}"
            )
        blocks_per_seq = -(-self.max_model_len // config.block_size)
        self.num_blocks = config.num_blocks or 2 * config.max_num_seqs * blocks_per_seq
        if self.num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV pool is too small for one sequence: {self.num_blocks} blocks of {config.block_size} "
                f"tokens hold {self.num_blocks * config.block_size} tokens, max_model_len is {self.max_model_len}"
            )
        self.tokenizer = Tokenizer(self.model_path)
        self.device = torch.device(config.device)
        model = load_model(self.model_path, dtype=_DTYPES[config.dtype], device=self.device)
        self.policy = checkpoint_policy(config.cache_mode if config.enable_prefix_caching else "none")
        num_slots = config.max_num_seqs + config.num_checkpoint_slots
        self.runner = ModelRunner(
            model,
            num_blocks=self.num_blocks,
            block_size=config.block_size,
            kernel_block_size=config.page_size,
            num_slots=num_slots,
            dtype=_DTYPES[config.dtype],
            state_dtype=_DTYPES[config.state_dtype],
            device=self.device,
        )
        self.cache = PrefixCache(
            CacheConfig(
                block_size=config.block_size,
                num_blocks=self.num_blocks,
                num_slots=num_slots,
                max_checkpoints_per_anchor=self.policy.max_checkpoints_per_anchor if self.policy else 1,
                decode_checkpoint_interval=config.decode_checkpoint_interval,
                eviction=config.eviction,
            )
        )
        self.scheduler = Scheduler(
            self.cache,
            self.policy,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            decode_checkpoint_interval=config.decode_checkpoint_interval,
        )
        self.debug = os.environ.get("HYBRIDCACHE_DEBUG", "") not in ("", "0")
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._seq_counter = itertools.count()
        self._arrivals = itertools.count()
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    # ----------------------------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        mm_inputs: SequenceOf[MultimodalInput] = (),
    ) -> None:
        """Queue a request. Raises ValueError (and changes nothing) on a bad prompt, bad multimodal spans or
        a duplicate id. `mm_inputs`: multimodal spans of the prompt (see `engine.multimodal`)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.validate_prompt(prompt)
        mm = resolve_inputs(mm_inputs, len(prompt_ids), self.model_config.hidden_size)
        request = _Request(request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params)
        for index in range(params.n):
            request.seqs.append(
                Sequence(
                    seq_id=next(self._seq_counter),
                    request_id=request_id,
                    index=index,
                    token_ids=list(prompt_ids),
                    prompt_len=len(prompt_ids),
                    params=params,
                    generator=make_generator(params, index, self.device),
                    arrival=next(self._arrivals),
                    mm_inputs=mm,
                )
            )
        self._requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, or a ValueError naming what is wrong with it."""
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            prompt_ids = list(prompt)
            vocab = self.model_config.vocab_size
            for i, token in enumerate(prompt_ids):
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                    raise ValueError(f"prompt token {i} is {token!r}: token ids must be integers in [0, {vocab})")
        else:
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}, which leaves "
                "no room for a completion"
            )
        return prompt_ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and release everything it holds."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ----------------------------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one forward; returns the output so far of every request that sampled a token in it
        (`finished` tells which are done; their memory is already released)."""
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.has_work:
                raise RuntimeError("no sequence could be scheduled: the KV pool or slot count is too small")
            return []
        # The forward writes the blocks the step was planned with: read them before commit_step, which may
        # swap a sequence onto a shared copy of a block that became full in this step.
        seq_chunks = [self._seq_chunk(c) for c in chunks]
        copies = self.cache.commit_step({c.seq.seq_id: c.seq.token_ids[c.start : c.end] for c in chunks})
        batch = build_forward_batch(
            seq_chunks,
            block_size=self.config.block_size,
            kernel_block_size=self.config.page_size,
            device=self.device,
            copies=copies,
        )
        logits = self.runner.execute(batch)
        outputs = self._postprocess(chunks, logits)
        if self.debug and not self.scheduler.running:
            self.check_integrity()
        return outputs

    def _seq_chunk(self, chunk: ScheduledChunk) -> SeqChunk:
        seq = chunk.seq
        return SeqChunk(
            seq.token_ids[chunk.start : chunk.end],
            chunk.start,
            self.cache.block_ids(seq.seq_id),
            self.cache.slot(seq.seq_id),
            chunk_embeds(seq.mm_inputs, chunk.start, chunk.end),
        )

    def _postprocess(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[RequestOutput]:
        rows = [i for i, c in enumerate(chunks) if c.samples]
        sampled = [c.seq for c in chunks if c.samples]
        for chunk in chunks:
            chunk.seq.num_computed = chunk.end
            if chunk.start < chunk.seq.prompt_len or chunk.num_tokens > 1:  # prompt, or recompute
                self.num_prefill_tokens += chunk.num_tokens
            else:
                self.num_decode_tokens += chunk.num_tokens
        tokens = sample(logits[rows], [s.params for s in sampled], [s.generator for s in sampled]) if rows else []
        touched: dict[str, _Request] = {}
        for seq, token in zip(sampled, tokens):
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
            touched[seq.request_id] = self._requests[seq.request_id]
        outputs = []
        for request_id, request in touched.items():
            outputs.append(self._output(request))
            if request.finished:
                del self._requests[request_id]
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if self._is_stop_token(seq, token):
            return "stop"
        if params.stop and self._cut_at_stop_string(seq):
            return "stop"
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _cut_at_stop_string(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids)
        positions = [text.find(s) for s in seq.params.stop if s in text]
        if not positions:
            return False
        seq.stop_text_len = min(positions)
        return True

    # ----------------------------------------------------------------------------------- outputs
    def _output(self, request: _Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            output_ids = seq.output_ids
            if seq.finish_reason == "stop" and output_ids and self._is_stop_token(seq, output_ids[-1]):
                output_ids = output_ids[:-1]
            text = self.tokenizer.decode(output_ids)
            if seq.stop_text_len is not None:
                text = text[: seq.stop_text_len]
            completions.append(
                CompletionOutput(seq.index, text, list(seq.output_ids), seq.finish_reason, seq.num_cached or 0)
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_ids),
            outputs=completions,
            cached_tokens=min(c.cached_tokens for c in completions),
            finished=request.finished,
        )

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return (not seq.params.ignore_eos and token in self.eos_token_ids) or token in seq.params.stop_token_ids

    def check_integrity(self) -> None:
        """Recompute the cache's counts from scratch and check that it runs exactly the running sequences;
        raises on any mismatch."""
        self.cache.check_integrity()
        running = sorted(seq.seq_id for seq in self.scheduler.running)
        if sorted(self.cache.running_ids()) != running:
            raise AssertionError(f"cache runs {sorted(self.cache.running_ids())}, scheduler runs {running}")

    def stats(self) -> dict:
        """Counters for metrics: the cache's stats plus block, slot and token counts."""
        cache = self.cache.stats
        return {
            "cache": cache,
            "num_blocks": self.num_blocks,
            "num_blocks_used": cache.num_blocks_used,
            "num_slots": self.cache.config.num_slots,
            "num_slots_used": cache.num_slots_used,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
        }
