"""The engine: requests in, tokens out. One `step()` = schedule -> build inputs -> execute -> postprocess.
The step loop lives here; what becomes of each sampled token on the host (detokenizing, stop checks, finish
reasons, logprobs, the grammar's mask and state) and the outputs are `output_processor.OutputProcessor`'s.

The engine never calls the prefix cache: the scheduler drives it (admission, growth, saves and the step's
commit) and hands back the step's chunks with their block ids, slots and copy plan; the engine only asks the
scheduler for its integrity check and counters.

Async scheduling (`EngineConfig.async_scheduling`; on by default on one CUDA device): the host plans and
queues step t+1 while the device runs step t, and postprocesses t while the device runs t+1. A `step()` call
then launches one step and returns the outputs of the one before::

    step() call k:   prepare(t)  schedule(t+1)  build + launch(t+1)  wait for t's tokens  postprocess(t)
    device:          ....... runs t .......  |  ........... runs t+1 ...........

`prepare(t)` advances each sequence of t past its chunk and appends `PENDING_TOKEN` for each token t samples;
t+1 feeds those rows from t's sampled tokens on the device (`input_ids` is patched there). The cache gets
`PENDING_TOKEN` in t+1's commit and the real token through `Scheduler.accept`, right after the launch. A
sequence that t finishes (EOS, a stop string, an abort) already has a row in t+1: the row is ignored, and its
finish checkpoint holds one token more than with synchronous steps (the device has fed its last sampled
token: still a true prefix of prompt + output). Sequences that t brings to `max_tokens` or `max_model_len` are
retired in `prepare`, before t+1 is planned. A step runs synchronously (postprocess before the next plan) with
`decode_checkpoint_interval` saves (the saved tail) and speculative decoding's steps (judging and drafting read
the logits on the host; `_speculating`), but for uniform greedy verify steps: those are judged on the device, and
the next one is queued from the device's verdicts before the host settles the step (`_step_chained`,
`engine/spec_chain.py`). Under tensor parallelism the fed rows reach the workers as a
`TokenFeed`: rank 0 broadcasts the sampled tokens on the device (`hybridcache.distributed`).

A sequence whose next sample needs its tokens on the host (structured output: the grammar's next mask;
penalties: the output so far) keeps the steps async, as in vLLM: t+1's forward is launched, then t is
postprocessed while the device runs it (each grammar accepts its token), and only then are t+1's mask filled
and its sampling queued (`_Launched.logits`, `_sample_deferred`)::

    step() call k:   prepare(t)  schedule(t+1)  build + launch forward(t+1)  postprocess(t)  mask + sample(t+1)
    device:          ....... runs t .......  |  ........ runs forward(t+1) ........  |  sample(t+1)
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import itertools
import logging
import os
import random
import sys
import weakref
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridcache.cache import PENDING_TOKEN, CacheConfig, CostModel, PrefixCache
from hybridcache.cache.host_tier import TierBehind
from hybridcache.cache.plan import CopyPlan
from hybridcache.cache.request import check_cache_salt
from hybridcache.config import EVICTION_POLICIES, EngineConfig, is_integer
from hybridcache.copy_kinds import CopyKind
from hybridcache.engine.cost_model import engine_cost_model
from hybridcache.engine.disk_keeper import DiskKeeper
from hybridcache.engine.disk_tier import DiskTier, model_key
from hybridcache.engine.executor import make_executor
from hybridcache.engine.host_pool import measure_copy_rates
from hybridcache.engine.input_builder import PageRows, build_forward_batch, device_copies
from hybridcache.engine.memory import MemoryPlan
from hybridcache.engine.output_processor import OutputProcessor, RequestState
from hybridcache.engine.rank_runner import DTYPES, RunnerSpec, device_free_bytes, engine_device
from hybridcache.engine.spec_chain import STOP_WIDTH, DeviceVerdicts
from hybridcache.engine.speculative import MtpDrafter, Verdict, judge
from hybridcache.engine.token_feed import TokenFeed
from hybridcache.engine.vision_encoder import VisionEncoder
from hybridcache.forward_batch import ForwardBatch
from hybridcache.guided import GrammarCache
from hybridcache.kernels.sampling import greedy_tokens
from hybridcache.mm_processor import ImageProcessor
from hybridcache.models import ModelConfig, get_model_class
from hybridcache.models.builtin import ensure_builtin_model, model_display_name
from hybridcache.models.quant import describe_weights
from hybridcache.models.vision_loader import has_vision_tower
from hybridcache.multimodal import MultimodalInput, resolve_inputs
from hybridcache.outputs import RequestOutput, RequestProgress
from hybridcache.sampling import PendingSample, SamplingParams, make_generator, sample_async, stop_tokens, to_device
from hybridcache.scheduler.output import ScheduledChunk, SchedulerOutput
from hybridcache.scheduler.save_plan import checkpoint_policy
from hybridcache.scheduler.scheduler import Accepted, Scheduler, blocks_per_sequence
from hybridcache.scheduler.sequence import Seq, SeqStatus
from hybridcache.tokenizer import Tokenizer

_MAX_CPU_DEFAULT_MODEL_LEN = 8192  # CPU pools are sized per sequence (2 x max_num_seqs x max_model_len of KV)
_logger = logging.getLogger("hybridcache.engine")


def freeze_gc_heap() -> None:
    """Collect what is garbage now, then move every object still alive (the model, the kernels and their caches,
    the libraries: hundreds of thousands of objects) out of the cycle collector's reach (`gc.freeze`), as vLLM
    does after its start-up. A full collection walks every tracked object (tenths of a second in an engine's
    process, docs/bench.md), and Python runs one whenever enough objects have survived since the last: without
    this, a request in which that happens stalls for it. Frozen objects are still freed by reference counting;
    cycles among them are collected at the next call, which unfreezes first. A CUDA engine calls it at the end
    of its start-up (a host-bound step is a GPU engine's concern; the CPU tests start many engines and would each
    pay the collection), and the server once it is up, on any device (a collection holds the GIL on the event
    loop or a tokenizer thread)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class EngineDeadError(RuntimeError):
    """A step failed after the scheduler had begun to change the prefix cache for it (a device error or a dead
    tensor-parallel worker in the forward, an interrupt anywhere in the step, the plan included: it admits, pins,
    promotes and commits in turn): the cache may now index KV blocks and states the device never wrote, and the
    sequences did not advance. The engine then refuses every later step, request and integrity check with this
    error (aborting requests still works); make a new engine. (`LLM.generate` holds a Ctrl-C until the step in
    progress has ended: its interrupt then leaves the engine usable.)"""


@dataclass(frozen=True)
class ValidPrompt:
    """A prompt as `LLMEngine.validate_prompt` returns it: its text (None when given as token ids) and its
    token ids, checked against the vocabulary and `max_model_len`. `add_request` takes it as is."""

    text: str | None
    token_ids: tuple[int, ...]


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device: its chunks, the sequences it samples (row i
    of `sample` is `sampled[i]`) and, once `LLMEngine._prepare` has run (`prepared`), `pending`: the ids of the
    sequences whose `token_ids` end with the `PENDING_TOKEN` of its sample, and `retired`: sequences retired there
    by length."""

    chunks: tuple[ScheduledChunk, ...]
    sampled: list[Seq]
    sample: PendingSample | None
    prepared: bool = False
    pending: set[int] = field(default_factory=set)
    retired: set[int] = field(default_factory=set)
    verdicts: list[Verdict] | None = None  # speculative decoding: the sampled sequences' tokens, judged
    logits: torch.Tensor | None = None  # rows to sample once the step before is postprocessed (`sample` None)
    predrafted: torch.Tensor | None = None  # speculative decoding: drafts queued before the verdicts (`propose`)
    deferred: DeviceVerdicts | None = None  # an async speculative step: its verdicts still on the device


# the copies a step planned after an async speculative step may hold: they read only finished sequences and
# checkpoints, which the step queued before its plan did not write (`LLMEngine._adopt_chained`)
_CHAIN_COPIES = frozenset({CopyKind.STATE_FINISH, CopyKind.HOST_FINISH, CopyKind.HOST_SAVE, CopyKind.KV_SAVE})


def _without_slots(plan: CopyPlan, slots: set[int]) -> CopyPlan:
    """`plan` without its copies into the runtime slots `slots`."""
    ops = []
    for op in plan.ops:
        pairs = [(src, dst) for src, dst in zip(op.src_ids, op.dst_ids, strict=True) if dst not in slots]
        if pairs:
            ops.append(dataclasses.replace(op, src_ids=tuple(p[0] for p in pairs), dst_ids=tuple(p[1] for p in pairs)))
    return CopyPlan(tuple(ops))


def _needs_host_tokens(seq: Seq) -> bool:
    """Its next sample reads its tokens on the host: a grammar's state, or the output for penalties."""
    return seq.params.guided is not None or seq.params.penalized


def _prompt_logits_flags(chunks: SequenceOf[ScheduledChunk]) -> tuple[bool, ...]:
    """Per chunk: it feeds prompt positions whose logits give prompt logprobs (the first completion of a request
    that asked for them; the others compute the same prompt). () when no chunk does."""
    flags = tuple(c.seq.index == 0 and c.seq.params.prompt_logprobs is not None and c.start < c.seq.prompt_len - 1
                  for c in chunks)
    return flags if any(flags) else ()


def _make_scheduler(
    config: EngineConfig, *, num_blocks: int, num_slots: int, state_pages: int, cost: CostModel, host_blocks: int = 0,
    tier_behind: TierBehind | None = None,
) -> Scheduler:
    """The scheduler over a fresh prefix cache (which only the scheduler keeps and calls): `num_blocks` blocks
    hold KV and checkpoint states (`state_pages` blocks each), `num_slots` runtime slots the running sequences'
    states, `host_blocks` the host tier's blocks behind them; `cost`: the model's cost model (`engine_cost_model`),
    which FLOP-aware eviction ranks by, promotions from the host tier are weighed with, and which sets the shortest
    branch point worth its state (`CacheConfig.min_branch_point_step`); `tier_behind`: the disk tier behind the
    host tier (`DiskKeeper`), or None."""
    policy = checkpoint_policy(config.cache_mode if config.prefix_caching else "none")
    cache_config = CacheConfig(
        block_size=config.block_size,
        full_prompt_hits=policy.full_prompt_hits if policy else False,
        admission=policy.admission if policy else "all",
        num_blocks=num_blocks,
        num_slots=num_slots,
        state_pages=state_pages,
        host_blocks=host_blocks if policy else 0,
        max_checkpoints_per_anchor=policy.max_checkpoints_per_anchor if policy else 1,
        decode_checkpoint_interval=config.decode_checkpoint_interval,
        eviction=EVICTION_POLICIES[config.eviction],
        min_branch_point_step=cost.state_tokens,
        num_speculative_tokens=_speculative_tokens(config),
        keeps_blocks=policy is not None,
    )
    return Scheduler(
        PrefixCache(cache_config, cost, tier_behind=tier_behind),
        policy,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        decode_checkpoint_interval=config.decode_checkpoint_interval,
        num_speculative_tokens=_speculative_tokens(config),
        debug=os.environ.get("HYBRIDCACHE_DEBUG", "") not in ("", "0"),
    )


def _speculative_tokens(config: EngineConfig) -> int:
    """k of the speculative config, 0 when speculative decoding is off."""
    return config.speculative_config.num_speculative_tokens if config.speculative_config is not None else 0


def close_at_exit(engine: LLMEngine) -> None:
    """Close `engine` at the interpreter's exit if it is still open then (an atexit handler, holding a weak
    reference: it keeps nothing alive), before the interpreter finalizes, while the disk writer thread and torch
    still run; once per engine. Every engine with a disk tier registers itself (so that one never closed still
    hands its cache to the disk tier), and `LLM` its engine."""
    if getattr(engine, "_closes_at_exit", False):
        return
    engine._closes_at_exit = True
    atexit.register(_close_if_alive, weakref.ref(engine))


def _close_if_alive(engine: weakref.ref[LLMEngine]) -> None:
    alive = engine()
    if alive is not None:
        alive.close()


class LLMEngine:
    """Continuously batched engine over one model folder (`model_path=None`: the built-in model). One that is
    never closed is closed at the interpreter's exit when it has a disk tier (`close_at_exit`), or as it is
    collected before then (`__del__`)."""

    def __init__(self, model_path: str | Path | None = None, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.device = engine_device(config.device)
        # the config names the device every rank resolves the same way (a TP worker has its own current device)
        self.config = config = dataclasses.replace(config, device=str(self.device))
        self.model_path = Path(model_path) if model_path is not None else ensure_builtin_model()
        self.model_config = ModelConfig.from_model_dir(self.model_path)
        get_model_class(self.model_config.architecture)  # an unknown architecture fails here, first
        on_cuda = self.device.type == "cuda"
        model_len_limit = self.model_config.max_model_len
        default_len = model_len_limit if on_cuda else min(model_len_limit, _MAX_CPU_DEFAULT_MODEL_LEN)
        self.max_model_len = config.max_model_len or default_len
        if self.max_model_len > model_len_limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's length {model_len_limit} "
                f"(max_position_embeddings {self.model_config.max_position_embeddings}, stretched by a YaRN or "
                f"linear rope scaling's factor)")
        blocks_per_seq = blocks_per_sequence(self.max_model_len, config.block_size, _speculative_tokens(config))
        if config.num_blocks is not None and config.num_blocks < blocks_per_seq:  # checked before loading
            raise ValueError(
                f"the KV pool is too small for one sequence: {config.num_blocks} blocks of {config.block_size} "
                f"tokens hold {config.num_blocks * config.block_size} tokens, max_model_len is {self.max_model_len}"
            )
        self.tokenizer = Tokenizer(config.tokenizer or self.model_path)
        if self.tokenizer.num_ids > self.model_config.vocab_size:  # a prompt holding such an id would index past
            raise ValueError(  # the embedding (real checkpoints pad vocab_size past the tokenizer's ids)
                f"the tokenizer of {config.tokenizer or self.model_path} has token ids up to "
                f"{self.tokenizer.num_ids - 1} ({self.tokenizer.num_ids} ids), more than the model's vocab_size "
                f"{self.model_config.vocab_size}: the model has no embedding for ids >= {self.model_config.vocab_size}")
        # on CUDA the engine's share is of what was free before it loaded anything (memory.engine_share): the
        # vision tower loads before the runner, so its start is measured here; else the runner measures it
        free_at_start = device_free_bytes(self.device) if on_cuda and has_vision_tower(self.model_path) else None
        # before the runner: on CUDA the pools are sized from the memory left after the vision weights
        self.vision = VisionEncoder.from_model_dir(self.model_path, dtype=DTYPES[config.dtype], device=self.device,
                                                   load_format=config.load_format)
        self.image_processor = (ImageProcessor(self.model_path, self.vision.tower.config)
                                if self.vision is not None else None)
        # a chunk never ends inside an image: a step may feed a whole image past the token budget
        self.max_step_tokens = config.max_num_batched_tokens + (
            self.image_processor.max_image_tokens - 1 if self.image_processor is not None else 0)
        spec = RunnerSpec(self.model_path, config, self.max_model_len, encoder_bytes=self._encoder_reserve(),
                          free_at_start=free_at_start, max_step_tokens=self.max_step_tokens)
        self.runner = make_executor(spec, self.device)
        self._page_rows = PageRows(config.pages_per_block)  # the sequences' kernel pages, kept across steps
        plan = self.runner.memory_plan
        backend = self.runner.backend
        self.memory_plan = plan
        # (under tensor parallelism async scheduling is asked for explicitly until it has run on two GPUs)
        async_default = self.device.type == "cuda" and config.tensor_parallel_size == 1
        self.async_scheduling = async_default if config.async_scheduling is None else config.async_scheduling
        self.drafter = None if config.speculative_config is None else MtpDrafter(
            self.runner, num_speculative_tokens=_speculative_tokens(config), block_size=config.block_size,
            kernel_block_size=config.kernel_block_size, max_model_len=self.max_model_len, page_rows=self._page_rows)
        self.num_blocks = plan.num_blocks
        self.weight_format = describe_weights(self.model_path, config)
        self.kv_cache_dtype = "fp8_e4m3" if config.kv_fp8 else config.dtype
        _logger.info(
            "hybridcache: model %s (%s), dtype %s, state dtype %s, weights %s, kv cache %s, device %s, "
            "max_model_len %d, cache mode %s, %s, kernels %s, cuda graphs %s, async scheduling %s",
            model_display_name(self.model_path), self.model_config.architecture, config.dtype,
            config.mamba_ssm_cache_dtype, self.weight_format, self.kv_cache_dtype, self.device, self.max_model_len,
            config.cache_mode if config.prefix_caching else "off", plan.describe(),
            type(backend).__name__, self.runner.graph_batch_sizes or "off", "on" if self.async_scheduling else "off",
        )
        cost = engine_cost_model(self.model_config, plan, block_size=config.block_size,
                                 ssm_dtype=config.mamba_ssm_cache_dtype)
        self.num_host_blocks = self._host_tier(plan)
        if self.num_host_blocks:
            bandwidth, flops = measure_copy_rates(self.device, DTYPES[config.dtype])
            cost = dataclasses.replace(cost, host_bandwidth=bandwidth, device_flops=flops)
        self.disk = self._disk_tier() if config.disk_cache_dir is not None else None
        self.scheduler = _make_scheduler(
            config, num_blocks=self.num_blocks, num_slots=plan.num_runtime_slots, state_pages=plan.state_pages,
            cost=cost, host_blocks=self.num_host_blocks, tier_behind=self.disk,
        )
        # vLLM stops on the tokenizer's EOS token and on config.json's and generation_config.json's eos ids
        tokenizer_eos = () if self.tokenizer.eos_token_id is None else (self.tokenizer.eos_token_id,)
        self.eos_token_ids = frozenset((*self.model_config.eos_token_ids, *tokenizer_eos))
        self._requests: dict[str, RequestState] = {}
        self._progress: list[RequestState] = []  # the last step's FINAL_ONLY requests with tokens (`step_progress`)
        self._seq_counter = itertools.count()
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)  # the seeds of completions without their own (vLLM's engine seed)
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self._failure: BaseException | None = None  # what broke a committed step (see EngineDeadError)
        self._plan_error: Exception | None = None  # a plan's error held for the next step() (see step)
        self._closed = False  # close() was called
        self._launched: _Launched | None = None  # async scheduling: the step on the device, not postprocessed
        self.num_chained_steps = 0  # speculative steps queued before the step before was judged (`_step_chained`)
        self.grammars = GrammarCache(self.tokenizer.hf, self.model_config.vocab_size, sorted(self.eos_token_ids))
        self.output_processor = OutputProcessor(self.tokenizer, self.grammars, self.eos_token_ids, self.max_model_len)
        if on_cuda:
            freeze_gc_heap()
        if self.disk is not None:  # (a never-closed engine's cache still reaches the disk tier: `close_at_exit`)
            close_at_exit(self)

    # ----------------------------------------------------------------------------------- requests
    def _encoder_reserve(self) -> int:
        """Device memory kept out of the pools for the vision encoder (`VisionEncoder.reserve_bytes` at the
        processor's largest image; measured on CUDA, 0 elsewhere and without a vision tower)."""
        if self.vision is None:
            return 0
        return self.vision.reserve_bytes(self.image_processor.max_patches)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | ValidPrompt,
        params: SamplingParams | None = None,
        mm_inputs: SequenceOf[MultimodalInput] = (),
        *,
        checkpoints_at: SequenceOf[int] = (),
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (and changes nothing) on a bad prompt, bad multimodal spans or
        a duplicate id. `prompt`: text, token ids, or what `validate_prompt` returned (not checked again).
        `mm_inputs`: multimodal spans of the prompt (see `hybridcache.multimodal`); image spans that carry
        `pixel_values` (`mm_processor.ImageProcessor.expand`) are encoded here by the vision tower, or served by
        its encoder cache (a model without a vision tower refuses them). `params.output_kind` says what `step`
        returns of it (`RequestOutputKind`: everything so far, what is new, or one output when it finishes, which
        `LLM.generate` uses: building the cumulative output of every request at every step costs host time, and
        grows with the output). `checkpoints_at`: prompt
        steps where later prompts are expected to part from this one (a chat's end before its generation prompt,
        where the next turn's prompt, with this turn's reply in it, parts from this one): a prefill chunk ends at
        each, and the prefix cache saves a checkpoint there as at a branch point (in the `hybridcache` cache mode;
        none below `min_branch_point_step`; the other modes ignore them). Each must lie in [1, prompt length).
        `cache_salt` (vLLM's): a non-empty string, or None; the request shares prefix-cache content (blocks,
        checkpoints, in-flight prefills) only with requests of the same salt, and a salted request's content is
        never kept on disk (docs/cache.md, "Cache salts")."""
        self._raise_if_dead()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_cache_salt(cache_salt)
        params.check_token_ids(self.model_config.vocab_size)
        prompt = prompt if isinstance(prompt, ValidPrompt) else self.validate_prompt(prompt)
        prompt_ids = prompt.token_ids
        params = params.up_to(self.max_model_len - len(prompt_ids))  # max_tokens=None: up to the model length
        hints = tuple(checkpoints_at)
        if not all(is_integer(h) and 0 < h < len(prompt_ids) for h in hints):
            raise ValueError(f"checkpoints_at must hold prompt steps in [1, {len(prompt_ids)}), got {hints}")
        if any(item.pixel_values is not None and item.embeds is None for item in mm_inputs):
            if self.vision is None:
                raise ValueError(f"the model {self.model_path.name} has no vision tower: it takes no images")
            mm_inputs = self.vision.encode(mm_inputs)
        mm = resolve_inputs(mm_inputs, len(prompt_ids), self.model_config.hidden_size)
        hints = tuple(h for h in hints if not any(m.start < h < m.end for m in mm))  # a chunk never ends in an image
        seqs: list[Seq] = []
        for index in range(params.n):
            seqs.append(
                Seq(
                    seq_id=next(self._seq_counter),
                    request_id=request_id,
                    index=index,
                    token_ids=list(prompt_ids),
                    prompt_len=len(prompt_ids),
                    params=params,
                    generator=self._generator(params, index),
                    arrival=next(self._arrivals),
                    mm_inputs=mm,
                    hint_steps=hints,
                    cache_salt=cache_salt,
                )
            )
        request = self.output_processor.new_request(request_id, prompt.text, len(prompt_ids), params, seqs)
        self._requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def validate_prompt(self, prompt: str | list[int]) -> ValidPrompt:
        """The prompt tokenized and checked, or a ValueError naming what is wrong with it."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as error:  # a lone surrogate, e.g. from bytes decoded with surrogateescape
                raise ValueError(f"the prompt is not valid Unicode text: {error.reason} at character "
                                 f"{error.start}") from None
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
        return ValidPrompt(prompt if isinstance(prompt, str) else None, tuple(prompt_ids))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and release everything it holds."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if not self._requests:
            self._plan_error = None  # (a plan's error held for the next call concerned the requests now gone)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return self.output_processor.output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_started(self, request_id: str) -> bool:
        """Whether the scheduler has given any completion of the request a step (its prompt began computing);
        False for an unknown or finished request."""
        request = self._requests.get(request_id)
        return request is not None and any(seq.status is not SeqStatus.WAITING or seq.num_computed
                                           for seq in request.seqs)

    # ----------------------------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one forward; returns the output so far of every request that sampled a token in it, except
        FINAL_ONLY requests still running (`finished` tells which are done; their memory is already released).
        With async scheduling a call launches one step and returns the outputs of the step before (the module
        docstring); keep calling it while `has_unfinished_requests()`.

        Failures: an Exception from the scheduler's plan (raised before it changed anything) leaves the engine
        usable; it is raised at once, or, when this call postprocessed the step before and has outputs to return,
        at the next call (and dropped if every request is aborted before it). Anything else raised in a step (a
        device error, a dead worker; an interrupt anywhere, the plan included) leaves the engine failed
        (`EngineDeadError`)."""
        self._raise_if_dead()
        held, self._plan_error = self._plan_error, None
        if held is not None:
            raise held
        self._progress = []
        try:
            outputs, plan_error = self._step()
        except BaseException as error:  # the step's bookkeeping was cut short: see EngineDeadError
            self._failure = error
            raise
        if plan_error is not None:
            if not outputs:
                raise plan_error  # nothing changed, nothing lost: the engine stays usable
            self._plan_error = plan_error  # the outputs of the step before go out first
        return outputs

    def _step(self) -> tuple[list[RequestOutput], Exception | None]:
        """`step()`'s work: its outputs, and the Exception the scheduler's plan raised (None: it planned)."""
        previous, self._launched = self._launched, None
        outputs: list[RequestOutput] = []
        speculate = self._speculating()  # (decided once: it picks how this step is launched and completed)
        if previous is not None and previous.deferred is not None and speculate and self._chainable(previous):
            return self._step_chained(previous), None
        if previous is not None and (speculate or previous.deferred is not None or not self._can_overlap(previous)):
            outputs, previous = self._complete(previous), None
        if previous is not None:
            self._prepare(previous)
        plan_error = None
        try:
            scheduled = self.scheduler.schedule()  # raises an Exception before changing anything, or commits the step
        except Exception as error:  # noqa: BLE001 - handed to step(); `previous` is finished first
            scheduled, plan_error = SchedulerOutput(), error
        launched = self._launch(scheduled, previous, speculate) if not scheduled.is_empty else None
        if previous is not None:
            outputs = self._complete(previous)
        if launched is not None and launched.logits is not None:
            self._sample_deferred(launched)
        if launched is not None:
            if self.async_scheduling and launched.verdicts is None:
                self._launched = launched
            else:
                outputs += self._complete(launched)
        return outputs, plan_error

    def close(self) -> None:
        """Abort every request, shut the executor down (a tensor-parallel one stops its workers and leaves its
        process group, so that another tensor-parallel engine can start in this process) and let go of the
        model, the vision tower and the pools. Idempotent; afterwards every step, request and check raises
        `EngineDeadError`. When the hand-off to the disk tier fails or is interrupted (Ctrl-C on its progress bar),
        the executor is shut down and the disk writer stopped all the same, and the error is raised."""
        if self._closed:
            return
        self._closed = True
        try:
            for request_id in list(self._requests):
                self.abort(request_id)
            self._launched = None
            if self.disk is not None:
                self._close_disk_tier()
        finally:  # (a failed or interrupted hand-off to disk still shuts the executor down: close() runs once)
            runner, self.runner, self.vision = self.runner, None, None
            runner.shutdown()
            del runner
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def __del__(self) -> None:
        """An engine with a disk tier dropped without `close()` (an `LLM` made inside a script's `main()`, which
        vLLM's API never closes) is closed as it is collected, so its cache reaches the disk tier: the close at
        the interpreter's exit (`close_at_exit`) finds only engines still alive then. Never while the interpreter
        finalizes (an engine still alive at exit was closed before, by `close_at_exit`): the disk writer is a
        daemon thread that no longer runs then and torch's objects are being torn down, and the hand-off hung or
        aborted the process (rc 134, an internal assertion of PyTorch's)."""
        if sys.is_finalizing():
            return
        if getattr(self, "disk", None) is not None and not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - (nothing to raise to: the collector ignores it)
                _logger.exception("hybridcache: closing a dropped engine's disk tier failed")

    def _close_disk_tier(self) -> None:
        """Hand every checkpoint the cache holds, in the host tier and in the device pool, to the disk tier (so
        that a restarted engine hits all of it; `DiskKeeper.keep_at_shutdown`), write what is queued and stop the
        writer; logged. The state copies of the sequences retired in the last step run first (their finish
        checkpoints are written by the next step's plan, and there is none). Nothing is handed after a failed step
        (its bytes are not trusted)."""
        handed = 0
        try:
            if self._failure is None:
                copies = ()
                if not self.scheduler.has_work:  # (close aborted every request)
                    retired = self.scheduler.flush_retired_copies()
                    if not retired.is_empty:
                        copies = device_copies(retired, self.runner.input_device)
                self.runner.execute_copies(copies)  # (with an MTP head also the frozen tails it still holds)
                handed = self.disk.keep_at_shutdown(self.scheduler.keep_cache_behind)
        finally:  # (a failed or interrupted hand-off still writes what it queued and stops the writer)
            self.disk.close()
        stats = self.disk.stats()
        _logger.info("hybridcache: disk tier closed: %d checkpoints handed at shutdown, %d state files; not kept: "
                     "%d checkpoints", handed, stats["num_state_files"], stats["num_not_kept"])

    def _raise_if_dead(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine is closed (close() was called): make a new one")
        if self._failure is not None:
            raise EngineDeadError(
                f"the engine failed earlier and cannot continue: {type(self._failure).__name__}: {self._failure}"
            ) from self._failure

    def _can_overlap(self, launched: _Launched) -> bool:
        """The next step may be planned before `launched` is postprocessed: always, except with
        `decode_checkpoint_interval` saves (see the module docstring), whatever `launched` samples."""
        del launched
        return self.config.decode_checkpoint_interval is None

    def _prepare(self, launched: _Launched) -> None:
        """Before the next step is planned while `launched` runs: its sequences advance past their chunks, each
        token it samples is `PENDING_TOKEN` for now, and a sequence that its token brings to `max_tokens` or
        `max_model_len` is retired (it must not be planned again; its finish reason is set at `_complete`).
        Synchronous steps go through it too, right before `_complete`: one way in for every sampled token."""
        launched.prepared = True
        for chunk in launched.chunks:
            if not chunk.seq.is_finished:
                chunk.seq.num_computed = chunk.end - chunk.num_drafts
        for seq in launched.sampled:
            if seq.is_finished:
                continue
            launched.pending.add(seq.seq_id)
            seq.token_ids.append(PENDING_TOKEN)
            if seq.num_tokens - seq.prompt_len >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.scheduler.finish(seq)
                launched.retired.add(seq.seq_id)

    def _speculating(self) -> bool:
        """Whether the next step drafts and verifies (speculative decoding, synchronous): an MTP drafter, and at
        most `disable_by_batch_size` unfinished sequences. Over it, steps are plain decode steps (no head pass, no
        verify rows; async scheduling may overlap them), and the head's KV misses their positions, which only
        lowers the acceptance of later drafts."""
        if self.drafter is None:
            return False
        limit = self.config.speculative_config.disable_by_batch_size
        return limit is None or len(self.scheduler.running) + len(self.scheduler.waiting) <= limit

    def _launch(self, scheduled: SchedulerOutput, previous: _Launched | None, speculate: bool = False) -> _Launched:
        """Queue the device work of a step the scheduler has committed: copies, the forward (rows that feed a
        token `previous` sampled take it from `previous.sample.tokens` on the device) and the sampling; a step that
        `speculate`s or verifies drafts is judged at once (`_launched_verdicts`)."""
        chunks = scheduled.chunks
        if chunks:
            wants_prompt = _prompt_logits_flags(chunks)
            drafts = self.drafter.draft_slots(chunks) if self.drafter is not None else ()
            batch = build_forward_batch(chunks, block_size=self.config.block_size,
                                        kernel_block_size=self.config.kernel_block_size,
                                        device=self.runner.input_device, copies=scheduled.copies,
                                        prompt_logits=wants_prompt, draft_slots=drafts, page_rows=self._page_rows)
            feed = self._feed_sampled(chunks, previous) if previous is not None and previous.pending else None
            logits = self.runner.execute(batch, feed)
            if wants_prompt:
                self.output_processor.record_prompt_logprobs(self._requests, chunks, wants_prompt, logits)
        else:  # only zero-prefill samples: the step's restores, no forward
            self.runner.execute_copies(device_copies(scheduled.copies, self.runner.input_device))
        if self.drafter is not None and (speculate or any(c.num_drafts for c in chunks)):
            return self._launched_verdicts(scheduled, logits if chunks else None, batch if chunks else None)
        rows = [i for i, c in enumerate(chunks) if c.samples]
        sampled = [chunks[i].seq for i in rows]
        parts = []
        if rows:  # logits row i is chunk i's last token (a view when every chunk samples, as in decode steps;
            # else a gather by device ids: indexing by a Python list copies it over synchronously)
            parts.append(logits[: len(chunks)] if len(rows) == len(chunks)
                         else logits.index_select(0, to_device(rows, logits.device)))
        if scheduled.samples:  # zero-prefill hits: logits from the restored last hidden state
            slots = to_device([s.slot for s in scheduled.samples], self.runner.input_device)
            parts.append(self.runner.logits_from_slots(slots))
            sampled += [s.seq for s in scheduled.samples]
        if not parts:
            return _Launched(chunks, sampled, None)
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        if previous is not None and any(_needs_host_tokens(seq) for seq in sampled):
            return _Launched(chunks, sampled, None, logits=logits)  # sampled after `previous` is postprocessed
        return _Launched(chunks, sampled, self._sample(logits, sampled))

    def _launched_verdicts(self, scheduled: SchedulerOutput, logits: torch.Tensor | None,
                           batch: ForwardBatch | None) -> _Launched:
        """Speculative decoding (synchronous steps): judge the step's verify rows and samples now. A uniform
        all-greedy verify step (`MtpDrafter.greedy_verify`) first queues the next step's drafting on the device
        (`draft_after_verify`), so the judging's one wait covers both."""
        predrafted = None
        if batch is not None and self._speculating() and self.drafter.greedy_verify(scheduled.chunks):
            predrafted = self.runner.draft_after_verify(batch, logits, self.drafter.near_pages(scheduled.chunks))
        if predrafted is not None and self._can_defer(scheduled):
            return self._deferred(scheduled.chunks, batch, predrafted)
        only = [s.seq for s in scheduled.samples]
        only_logits = None
        if only:
            only_logits = self.runner.logits_from_slots(to_device([s.slot for s in scheduled.samples],
                                                                  self.runner.input_device))
        chunks = scheduled.chunks
        verdicts = judge(chunks, logits if logits is not None else torch.empty(0), only, only_logits,
                         stop_token_ids=sorted(self.eos_token_ids), grammar_masks=self._grammar_masks)
        return _Launched(chunks, [v.seq for v in verdicts], None, verdicts=verdicts, predrafted=predrafted)

    def _grammar_masks(self, seq: Seq, drafts: SequenceOf[int], vocab_size: int) -> torch.Tensor | None:
        """`judge`'s structured-output masks of `seq`'s verify row (`OutputProcessor.draft_bitmask`; a sequence
        whose request is gone is unconstrained, as in `_sample`)."""
        return self.output_processor.draft_bitmask(self._requests.get(seq.request_id), seq, drafts, vocab_size)

    def _complete_verified(self, launched: _Launched, chained: bool = False) -> list[RequestOutput]:
        """`_complete` of a speculative step: each sampled sequence emits its accepted drafts and the token after
        them, cut at the first that stops it. The kept drafts and the last token go to the scheduler and the cache
        in one call (`Scheduler.accept`), whose rollback copies run at once; then the head drafts for the next
        step. `chained`: the next verify step is already queued (`_step_chained`), with the rollback of every row
        whose sequence goes on: only the rollbacks of the sequences that stop here run."""
        self.runner.check_results()  # the verdicts read the logits: a tensor-parallel peer's failure shows now
        launched.prepared = True
        for chunk in launched.chunks:
            if not chunk.seq.is_finished:
                chunk.seq.num_computed = chunk.end - chunk.num_drafts
        verifying = {c.seq for c in launched.chunks if c.num_drafts}
        accepted: dict[Seq, Accepted] = {seq: Accepted(kept=()) for seq in verifying}
        final: dict[Seq, str | None] = {}
        touched: dict[str, RequestState] = {}
        for verdict in launched.verdicts:
            seq = verdict.seq
            if seq.is_finished or seq.request_id not in self._requests:
                continue
            self.drafter.stats.count(verdict)
            seq.num_draft_tokens += verdict.num_drafts
            seq.num_accepted_tokens += verdict.num_accepted
            request = self._requests[seq.request_id]
            emitted, reason = [], None
            for j, token in enumerate(verdict.tokens):
                emitted.append(token)
                logprob = verdict.logprobs[j] if verdict.logprobs is not None else None
                reason = self.output_processor.accept(request, seq, token, logprob, num_tokens=seq.num_tokens + j + 1)
                if reason is not None:
                    break
            last = emitted[-1] if len(emitted) > verdict.num_accepted else None
            accepted[seq] = Accepted(last, tuple(emitted[: verdict.num_accepted]) if seq in verifying else None)
            final[seq] = reason
            touched[seq.request_id] = request
            self.num_decode_tokens += len(emitted)
        for chunk in launched.chunks:
            if chunk.start < chunk.seq.prompt_len or chunk.num_tokens - chunk.num_drafts > 1:  # prompt, or recompute
                self.num_prefill_tokens += chunk.num_tokens
        rollback = self.scheduler.accept(accepted)
        if chained:
            rollback = _without_slots(rollback, {c.slot for c in launched.chunks if final.get(c.seq) is None})
        if not rollback.is_empty:
            self.runner.execute_copies(device_copies(rollback, self.runner.input_device))
        for seq, reason in final.items():
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
        drafting = [s for s in final if not s.is_finished]
        if launched.chunks and self._speculating():
            self.drafter.propose(launched.chunks, drafting, launched.predrafted)
        return self._outputs(touched)

    # ------------------------------------------------------------- async speculative steps (engine/spec_chain.py)
    def _can_defer(self, scheduled: SchedulerOutput) -> bool:
        """A uniform greedy verify step whose drafting is queued (`predrafted`) is left on the device, its
        verdicts judged there, when steps are async on one device and nothing in it samples otherwise."""
        return (self.async_scheduling and self.config.tensor_parallel_size == 1 and not scheduled.samples
                and self.runner.can_chain(len(scheduled.chunks)))

    def _deferred(self, chunks: SequenceOf[ScheduledChunk], batch: ForwardBatch,
                  values: torch.Tensor) -> _Launched:
        """The `_Launched` of a verify step whose verdicts stay on the device (`spec_chain.DeviceVerdicts`)."""
        deferred = DeviceVerdicts.queue([c.seq for c in chunks], batch, values, self.drafter.k)
        return _Launched(tuple(chunks), [c.seq for c in chunks], None, deferred=deferred)

    def _chainable(self, launched: _Launched) -> bool:
        """Whether the verify step after `launched` (deferred) can be queued before `launched` is judged
        (`_step_chained`): it runs every running sequence and nothing waits (the step after plans exactly its
        rows, none added or preempted), each row is live, plain greedy with no stop strings, cannot reach
        `max_tokens` or `max_model_len` in `launched` and can feed k drafts after it, its blocks reach every
        position the next step and its drafting write (start + 3k: the scheduler's lookahead), and the
        scheduler's growth after it fits the free blocks."""
        chunks, k = launched.chunks, self.drafter.k
        if (len(launched.deferred.rows) != len(chunks) or self.scheduler.waiting
                or len(self.scheduler.running) != len(chunks)
                or len(chunks) * (1 + k) > self.scheduler.max_num_batched_tokens
                or launched.deferred.batch.rope_positions is not None or not self.drafter.greedy_verify(chunks)):
            return False
        block_size = self.config.block_size
        for chunk in chunks:
            seq = chunk.seq
            if (seq.is_finished or seq.request_id not in self._requests or seq.params.stop
                    or seq.num_tokens + k + 1 - seq.prompt_len >= seq.params.max_tokens
                    or seq.num_tokens + 2 * k + 2 > self.max_model_len
                    or len(seq.params.stop_token_ids) + len(self.eos_token_ids) > STOP_WIDTH
                    or len(chunk.block_ids) * block_size < chunk.start + 3 * k + 1):
                return False
        return self.scheduler.growth_fits(chunks, 1 + k)

    def _step_chained(self, previous: _Launched) -> list[RequestOutput]:
        """`step()` after a deferred verify step t that `_chainable` admits: queue t + 1 from t's device verdicts
        (rollback, verify forward, drafting: `_launch_chained`), then judge and settle t from its host copy while
        the device runs t + 1, then let the scheduler plan t + 1 exactly as it ran (`_adopt_chained`)."""
        self.num_chained_steps += 1
        queued = self._launch_chained(previous)
        before = {c.seq.seq_id: c for c in previous.chunks}
        fed = previous.deferred
        outputs, values = self._complete_deferred(previous, chained=True)
        scheduled = self.scheduler.schedule()  # (any error here leaves the engine failed: a step is queued)
        self._launched = self._adopt_chained(queued, scheduled, before, fed.next_inputs(values))
        return outputs

    def _launch_chained(self, previous: _Launched) -> DeviceVerdicts:
        """Queue the verify step after `previous` and its drafting on the device (`spec_chain`); no wait."""
        deferred = previous.deferred
        batch, near = self.runner.chain_verify(deferred.batch, deferred.values, previous.chunks, self._stop_tokens)
        logits = self.runner.execute(batch)
        values = self.runner.draft_after_verify(batch, logits, near)
        return DeviceVerdicts.queue(deferred.rows, batch, values, self.drafter.k)

    def _stop_tokens(self, seq: Seq) -> set[int]:
        """The tokens that end `seq` when emitted (`stop_token_ids`, and EOS unless `ignore_eos`)."""
        return stop_tokens(seq.params, self.eos_token_ids)

    def _complete_deferred(self, launched: _Launched, *, chained: bool) -> tuple[list[RequestOutput], list[int]]:
        """`_complete` of a deferred verify step: its verdicts and drafting from the host copy of its device
        values (a wait for it alone), then as a synchronous verify step (`_complete_verified`); the outputs and
        the values."""
        deferred = launched.deferred
        values = deferred.result()
        verdicts, predrafted = deferred.verdicts(launched.chunks, values)
        launched.deferred, launched.verdicts, launched.predrafted = None, verdicts, predrafted
        return self._complete_verified(launched, chained=chained), values

    def _adopt_chained(self, queued: DeviceVerdicts, scheduled: SchedulerOutput, before: dict[int, ScheduledChunk],
                       fed: dict[int, tuple[int, ...]]) -> _Launched | None:
        """The `_Launched` of the step queued by `_launch_chained`, once the scheduler has planned it
        (`scheduled`; `before`: the chunks of the step before, by sequence id; `fed`: the tokens the device fed,
        by sequence id): its rows must be the queued ones of the sequences still running, in order, with the
        tokens the device fed, on their slots and with the blocks the device wrote (from the
        block of its first position on; a full block before it may have been swapped for its trie twin); its
        copies (finish checkpoints of the sequences that stopped) run now. None when every sequence stopped."""
        if scheduled.is_empty:
            return None
        row_of = {seq.seq_id: i for i, seq in enumerate(queued.rows)}
        rows = [row_of.get(c.seq.seq_id) for c in scheduled.chunks]
        k, size = self.drafter.k, self.config.block_size
        if (scheduled.samples or None in rows or rows != sorted(rows)
                or any(c.num_drafts != k or c.token_ids != fed[c.seq.seq_id] or c.slot != before[c.seq.seq_id].slot
                       or c.block_ids[c.start // size: -(-(c.start + 2 * k) // size)]
                       != before[c.seq.seq_id].block_ids[c.start // size: -(-(c.start + 2 * k) // size)]
                       for c in scheduled.chunks)):
            planned = [(c.seq.seq_id, c.start, c.num_drafts) for c in scheduled.chunks]
            raise RuntimeError(f"the scheduler planned an async speculative step other than the one queued: "
                               f"rows {rows}, chunks {planned}")
        unexpected = [op.kind.name for op in scheduled.copies.ops if op.kind not in _CHAIN_COPIES]
        if unexpected:
            raise RuntimeError(f"an async speculative step was planned with copies {unexpected}")
        if not scheduled.copies.is_empty:
            self.runner.execute_copies(device_copies(scheduled.copies, self.runner.input_device))
        return _Launched(scheduled.chunks, [c.seq for c in scheduled.chunks], None, deferred=queued)

    def _outputs(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """The outputs of the requests a step touched (a streaming request's every step, a FINAL_ONLY one's
        last; the others' progress goes to `step_progress`); finished requests are forgotten."""
        outputs = []
        for request_id, request in touched.items():
            finished = request.finished
            if finished or (not request.final_only and self._output_due(request)):
                outputs.append(self.output_processor.output(request))
            else:
                self._progress.append(request)
            if finished:
                del self._requests[request_id]
        return outputs

    def _output_due(self, request: RequestState) -> bool:
        """Whether a streamed request gets an output at this step (`EngineConfig.stream_interval`): always with an
        interval of 1; else at its first output, once a completion has `stream_interval` tokens more than the last
        output showed, or when one has ended since. Interval 3, tokens after each step 1 2 3 4 5 6 7: outputs at
        1, 4 and 7 (and at the request's end, whatever the count)."""
        interval = self.config.stream_interval
        if interval == 1:
            return True
        shown = request.shown()
        last = request.last_shown
        if last and all(n - m < interval and ended == was for (n, ended), (m, was) in zip(shown, last)):
            return False
        request.last_shown = shown
        return True

    def step_progress(self) -> list[RequestProgress]:
        """The FINAL_ONLY requests still running that the last `step()` gave tokens (their outputs come only
        when they end), in the order their outputs would have come. Read it before the next `step()` (it is
        built from the requests as they are now: the next step moves them on)."""
        progress = []
        for request in self._progress:
            counts, ended = zip(*request.shown())
            progress.append(RequestProgress(request.request_id, len(request.prompt_token_ids),
                                            min(seq.num_cached or 0 for seq in request.seqs), counts, ended))
        return progress

    def _sample_deferred(self, launched: _Launched) -> None:
        """Queue the sampling that `_launch` left for after the step before was postprocessed: every grammar has
        accepted that step's token, and the sampled sequences' `token_ids` hold it."""
        launched.sample, launched.logits = self._sample(launched.logits, launched.sampled), None

    def _sample(self, logits: torch.Tensor, sampled: list[Seq]) -> PendingSample:
        """Queue the sampling of one token per row of `logits` (row i: `sampled[i]`, whose `token_ids` hold
        every token before the one sampled, pending ones included). A row whose request is gone (finished by
        the step before, when sampled deferred: its row is ignored) is unconstrained."""
        rows = [(self._requests.get(s.request_id), s) for s in sampled]
        bitmask = self.output_processor.allowed_bitmask(rows, logits.shape[-1])
        return sample_async(logits, sampled, stop_token_ids=self.eos_token_ids, allowed_bitmask=bitmask,
                            argmax=greedy_tokens)  # (all-greedy steps: the device's argmax, one read of the logits)

    def _feed_sampled(self, chunks: SequenceOf[ScheduledChunk], previous: _Launched) -> TokenFeed | None:
        """The input rows that take a token `previous` sampled (each `PENDING_TOKEN` row; a pending token is the
        last, only, token of its sequence's decode chunk), or None when there are none."""
        source = {seq.seq_id: i for i, seq in enumerate(previous.sampled)}
        rows, sources, end = [], [], 0
        for chunk in chunks:
            end += chunk.num_tokens
            if chunk.token_ids[-1] == PENDING_TOKEN:
                rows.append(end - 1)
                sources.append(source[chunk.seq.seq_id])
        return TokenFeed(tuple(rows), tuple(sources), previous.sample.tokens) if rows else None

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Postprocess a launched step (`_prepare`d first if it was not): wait for its tokens, put each in place of
        its `PENDING_TOKEN` (`Scheduler.accept`, which tells the cache in the same call), count the fed tokens,
        then check whether each sampled sequence stops. Sequences finished or aborted after the step was planned
        are skipped (their rows are ignored)."""
        if launched.deferred is not None:
            return self._complete_deferred(launched, chained=False)[0]
        if launched.verdicts is not None:
            return self._complete_verified(launched)
        if not launched.prepared:
            self._prepare(launched)
        out = launched.sample.result() if launched.sample is not None else None
        self.runner.check_results()  # a tensor-parallel step cut short by a failed peer computed garbage
        live = [(i, seq) for i, seq in enumerate(launched.sampled)
                if (not seq.is_finished or seq.seq_id in launched.retired) and seq.request_id in self._requests]
        self.scheduler.accept({seq: Accepted(out.tokens[i]) for i, seq in live})
        for chunk in launched.chunks:
            seq = chunk.seq
            if seq.is_finished and seq.seq_id not in launched.retired:
                continue
            if chunk.start < seq.prompt_len or chunk.num_tokens > 1:  # prompt, or recompute
                self.num_prefill_tokens += chunk.num_tokens
            else:
                self.num_decode_tokens += chunk.num_tokens
        touched: dict[str, RequestState] = {}
        for i, seq in live:
            request = self._requests[seq.request_id]
            reason = self.output_processor.accept(request, seq, out.tokens[i], out.logprobs[i])
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
            touched[seq.request_id] = request
        return self._outputs(touched)

    # ----------------------------------------------------------------------------------- introspection
    def check_integrity(self) -> None:
        """Recompute the cache's counts from scratch and check that it runs exactly the scheduler's running
        sequences; raises on any mismatch, and `EngineDeadError` once a committed step has failed."""
        self._raise_if_dead()
        self.scheduler.check_integrity()

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Completion `index`'s generator: seeded by the request's seed, else by the engine's next draw from
        `config.seed` (so a run that adds the same requests in the same order samples the same tokens)."""
        generator = make_generator(params, index, self.device)
        if generator is not None and params.seed is None:
            generator.manual_seed(self._seeds.getrandbits(63))
        return generator

    def clear_cache(self) -> None:
        """Drop everything the prefix cache holds that no running sequence uses."""
        self.scheduler.clear_cache()

    def _host_tier(self, plan: MemoryPlan) -> int:
        """The host tier's blocks behind the pool (`rank_runner.host_tier_blocks`; every rank's runner holds its
        shard of each), logged; 0 without one."""
        num_blocks = self.runner.num_host_blocks
        if num_blocks:
            _logger.info("hybridcache: host tier of %d blocks (%.3g GiB over %d rank(s))", num_blocks,
                         num_blocks * plan.block_bytes * self.config.tensor_parallel_size / (1 << 30),
                         self.config.tensor_parallel_size)
        return num_blocks

    def _disk_tier(self) -> DiskKeeper:
        """The disk tier behind the host tier, under `disk_cache_dir`, keyed by the model and its block layout
        (`disk_tier.model_key`), as the prefix cache's tier behind the host tier (`DiskKeeper`)."""
        config, paged = self.config, self.runner.paged_states
        if not self.num_host_blocks:
            raise ValueError(f"disk_cache_dir needs a host tier of at least one block: host_cache_gib "
                             f"{config.host_cache_gib} holds no block of {self.memory_plan.block_bytes} bytes")
        geometry = {
            "block_size": config.block_size, "kernel_block_size": config.kernel_block_size, "dtype": config.dtype,
            "state_dtype": config.mamba_ssm_cache_dtype, "kv_cache_dtype": self.kv_cache_dtype,
            "quantization": config.quantization, "load_format": config.load_format, "cache_mode": config.cache_mode,
            "speculative_tokens": _speculative_tokens(config), "state_pages": self.memory_plan.state_pages,
            "page_words": paged.page_words, "word_dtype": str(paged.word_dtype),
        }
        disk = DiskTier(Path(config.disk_cache_dir), model_key(self.model_path, geometry),
                        page_words=paged.page_words, word_dtype=paged.word_dtype,
                        max_bytes=int(config.disk_cache_gib * (1 << 30)),
                        describe={"model": str(self.model_path), **geometry})
        _logger.info("hybridcache: disk tier at %s (%d files, %.3g GiB, cap %.3g GiB)", disk.dir,
                     disk.stats.num_block_files + disk.stats.num_state_files, disk.stats.num_bytes / (1 << 30),
                     config.disk_cache_gib)
        return DiskKeeper(disk, paged, self.runner.host_pool)

    def stats(self) -> dict:
        """Counters for metrics: the scheduler's (the cache's stats, block, slot and queue counts) plus the
        pool size (device and host blocks, counted once: every rank holds its shard of each; `block_bytes` is a
        block's bytes over all ranks) and token counts, for a model with a vision tower the images it encoded and
        those the encoder cache served (`num_encoded_images`, `num_encoder_cache_hits`), and with speculative
        decoding its `SpecDecodeStats` (else None), and with a disk tier its counters (`DiskStats`, else None)."""
        vision = {} if self.vision is None else {"num_encoded_images": self.vision.num_encoded_images,
                                                 "num_encoder_cache_hits": self.vision.num_cache_hits}
        return {
            "num_blocks": self.num_blocks,
            "block_bytes": self.memory_plan.block_bytes * self.config.tensor_parallel_size,
            "num_host_blocks": self.num_host_blocks,
            "weights": self.weight_format,
            "kv_cache_dtype": self.kv_cache_dtype,
            **self.scheduler.stats(),
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
            **vision,
            "spec_decode": self.drafter.stats if self.drafter is not None else None,
            "disk": None if self.disk is None else self.disk.stats(),
        }
