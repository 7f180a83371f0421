"""Sampling parameters (validated at construction) and the batched sampler that turns logits into tokens."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridcache.config import is_integer

_SEED_LIMIT = 1 << 63  # seeds are 64-bit signed integers (torch's generator takes seed + completion index)
_INT_LIMIT = 1 << 31  # top_k goes into an int64 tensor; anything this large is "off" anyway


def _real(value: object) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_NUMBER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "seed", "n", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs")


def _plain(value: object) -> object:
    """A numpy (or other `numbers`-registered) integer or real as Python's int or float, as vLLM takes them; any
    other value (bools included) as it is, for the checks to judge."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _bias_pairs(bias: object) -> tuple:
    """`logit_bias` (a mapping of token id to bias, or (id, bias) pairs) as a tuple of pairs; a TypeError naming
    the field for anything else."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    try:
        return tuple((_plain(token), _plain(value)) for token, value in pairs)
    except (TypeError, ValueError):
        raise TypeError(f"logit_bias must map token ids to biases (a dict), got {type(bias).__name__} "
                        f"{bias!r}") from None


def _as_tuple(name: str, value: object, expected: str) -> tuple:
    """`value` (a list, tuple or other iterable) as a tuple; a TypeError naming the field for anything else."""
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}") from None


MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
GREEDY_TEMPERATURE = 1e-5  # below it, sampling is greedy (as in vLLM)


class RequestOutputKind(enum.Enum):
    """What a streamed request's outputs hold (vLLM's `RequestOutputKind`, its values). CUMULATIVE: everything so
    far, at every step that gave it tokens. DELTA: what is new since its last output: each completion's new text,
    token ids and logprobs (the other fields as CUMULATIVE's: finish and stop reasons, cached tokens, the summed
    logprob, draft counts; the prompt logprobs in the first output only), so a long completion costs the same at
    every step; `hybridcache.outputs.add_delta` adds one to the outputs before it. FINAL_ONLY: one output, when the
    request ends (what `LLM.generate` uses).

        tokens "ab", "c", "d" over three steps:  CUMULATIVE "ab", "abc", "abcd";  DELTA "ab", "c", "d";
                                                 FINAL_ONLY "abcd" at the end"""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completions, in the shape vLLM users know.

    temperature 0 means greedy (deterministic). `top_k` 0 or -1 disables top-k; `top_p` 1.0 disables
    nucleus sampling; `min_p` 0 disables min-p (drop tokens less likely than min_p x the likeliest one).
    `seed` makes random sampling reproducible (completion i of n uses seed + i).
    `stop` holds strings that end a completion (the text is cut before the stop string). `max_tokens` None: up to
    the model length (vLLM's meaning; `up_to` makes it a count once the prompt's length is known).

    Penalties, as vLLM defines them (applied to the raw logits, before temperature):
    `repetition_penalty` r (1 = off) divides a positive logit by r and multiplies a negative one by r, for every
    token that occurs in the prompt or the output; `frequency_penalty` f subtracts f x (times the token occurs
    in the output); `presence_penalty` p subtracts p once if it occurs in the output at all.
    `logit_bias` adds a fixed value to the logit of a token id. `min_tokens`: the EOS and stop tokens cannot be
    sampled before the completion has that many tokens, and stop strings are looked for only after them (none may
    start in their text: vLLM's rule).
    `logprobs`: None (off) or k in [0, 20]: each sampled token carries its log-probability and the k most
    likely tokens with theirs (log_softmax of the model's fp32 logits, before any penalty or temperature).
    `prompt_logprobs`: None (off) or k in [0, 20]: the request's output carries, for every prompt token after the
    first, its log-probability given the tokens before it, its rank, and the k most likely tokens there
    (`RequestOutput.prompt_logprobs`). Such a request computes its whole prompt: it takes nothing from the
    prefix cache (it still saves checkpoints for later requests).
    `guided`: a structured-output constraint (see `hybridcache.guided`), or None. A completion ends when its
    grammar is complete, even under `ignore_eos` or before `min_tokens` (the grammar allows nothing else).
    `include_stop_str_in_output`: the text keeps the stop string or the decoded stop token (EOS or one of
    `stop_token_ids`; a special token only with `skip_special_tokens` off) that ended it; without it neither
    appears in the text. `skip_special_tokens`: special tokens are left out of the text (as vLLM; their ids stay
    in `token_ids`). `output_kind`: what the engine's outputs of a streamed request hold (`RequestOutputKind`;
    `LLM.generate` runs its requests as FINAL_ONLY whatever this says).
    Integer fields refuse bools and numeric ones non-finite values; numbers are stored as floats. numpy scalars
    (`np.int64`, `np.float32`, ...) are taken as the Python numbers they hold.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided: object | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        for name in _NUMBER_FIELDS:
            object.__setattr__(self, name, _plain(getattr(self, name)))
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM's "no seed" (clients send -1 for random)
            object.__setattr__(self, "seed", None)
        # Accept lists and dicts from callers but store tuples, so the object stays hashable and immutable.
        # (None is the empty default, as vLLM's Optional fields)
        stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids or (), "a list of integers")
        stop_token_ids = tuple(map(_plain, stop_token_ids))
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple("stop", self.stop or (), "a list of strings")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias or ()))
        checks = [
            (_real(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature!r}"),
            (_real(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (is_integer(self.top_k) and (0 <= self.top_k < _INT_LIMIT or self.top_k == -1),
             f"top_k must be -1, 0 (off) or a positive integer below 2**31, got {self.top_k!r}"),
            (_real(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (self.max_tokens is None or (is_integer(self.max_tokens) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1 or None (up to the model length), got {self.max_tokens!r}"),
            (is_integer(self.min_tokens) and self.min_tokens >= 0,
             f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"),
            (not is_integer(self.min_tokens) or not is_integer(self.max_tokens) or self.min_tokens <= self.max_tokens,
             f"min_tokens must be at most max_tokens, got min_tokens {self.min_tokens!r} and max_tokens "
             f"{self.max_tokens!r}"),
            (is_integer(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (self.seed is None or (is_integer(self.seed) and -_SEED_LIMIT <= self.seed < _SEED_LIMIT),
             f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}"),
            (all(is_integer(t) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            (all(isinstance(s, str) and s for s in stop), f"stop must hold non-empty strings, got {stop!r}"),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}"),
            (isinstance(self.include_stop_str_in_output, bool),
             f"include_stop_str_in_output must be true or false, got {self.include_stop_str_in_output!r}"),
            (isinstance(self.skip_special_tokens, bool),
             f"skip_special_tokens must be true or false, got {self.skip_special_tokens!r}"),
            (isinstance(self.output_kind, RequestOutputKind),
             f"output_kind must be a RequestOutputKind, got {self.output_kind!r}"),
            (_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (_real(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"),
            (all(is_integer(t) and t >= 0 and _real(v) and -100 <= v <= 100 for t, v in self.logit_bias),
             "logit_bias maps non-negative token ids to values in [-100, 100]"),
            (self.logprobs is None or (is_integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"),
            (self.prompt_logprobs is None
             or (is_integer(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.guided is not None:
            from hybridcache.guided import GuidedKind, GuidedSpec

            if not (isinstance(self.guided, GuidedSpec) and isinstance(self.guided.kind, GuidedKind)
                    and isinstance(self.guided.spec, str) and isinstance(self.guided.starts_after, str)):
                raise TypeError(f"guided must be a hybridcache.guided.GuidedSpec (a GuidedKind, its spec text and "
                                f"the text it starts after) or None, got {self.guided!r}")
        # the sampler builds fp32 tensors of these: an int such as 10**19 would not fit the int64 torch infers
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "logit_bias", tuple((t, float(v)) for t, v in self.logit_bias))

    def up_to(self, room: int) -> SamplingParams:
        """These parameters with `max_tokens=None` made `room` (the model length less the prompt's, as vLLM's input
        processor does); themselves when `max_tokens` is set."""
        if self.max_tokens is not None:
            return self
        # (not below min_tokens: such a request runs to the model length, "length", as vLLM's does)
        return dataclasses.replace(self, max_tokens=max(room, self.min_tokens))

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError, naming the field, when `stop_token_ids` or a `logit_bias` key is not a token id of a
        vocabulary of `vocab_size` tokens (the engine checks every request it queues)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias])):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(f"{name} holds {outside[0]}, which is not a token id: the vocabulary has "
                                 f"{vocab_size} tokens (ids 0 to {vocab_size - 1})")

    @property
    def greedy(self) -> bool:
        """Temperatures below `GREEDY_TEMPERATURE` sample greedily: dividing fp32 logits by them overflows."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def make_generator(params: SamplingParams, index: int, device: torch.device | str) -> torch.Generator | None:
    """The random generator of completion `index` of a request, or None for greedy sampling."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed + index)
    return generator


class SamplingRow(Protocol):
    """What the sampler reads of one sequence (the scheduler's `Seq` is one): its parameters and generator,
    `token_ids` = prompt + output so far, and `prompt_len`."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]
    prompt_len: int


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at a position and its rank there among the vocabulary, as vLLM's `Logprob`:
    the number of tokens whose logprob is at least its own (1 = the likeliest; a token tied with another for the
    best takes rank 2, as in vLLM). `decoded_token`: the token's text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]  # vLLM's: None for the first prompt token
SampleLogprobs = list[dict[int, Logprob]]  # vLLM's: one entry per sampled token


@dataclass(frozen=True)
class TokenLogprob:
    """What the sampler copies to the host for a sampled token of a request that asked for logprobs: its
    log-probability, its rank (as `Logprob.rank`) and the `logprobs` most likely tokens (id, logprob), best first.
    `entry` turns it into vLLM's shape once its texts can be decoded."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()

    def entry(self, decode: Callable[[int], str]) -> dict[int, Logprob]:
        """vLLM's entry of this position: {sampled token: its Logprob, then the top tokens: theirs (rank 1..k)},
        the sampled token first and not repeated, as `prompt_logprobs` builds a prompt position's."""
        entry = {self.token_id: Logprob(self.logprob, self.rank, decode(self.token_id))}
        for rank, (token, value) in enumerate(self.top, start=1):
            if token not in entry:
                entry[token] = Logprob(value, rank, decode(token))
        return entry


def top_logprobs(entry: dict[int, Logprob], token_id: int, k: int) -> list[tuple[int, Logprob]]:
    """The k likeliest tokens of a `SampleLogprobs` entry whose sampled token is `token_id` (requested with
    `logprobs=k`), best first: the entry holds k + 1 tokens when the sampled one is not among them, else k."""
    items = [(token, lp) for token, lp in entry.items() if token != token_id or len(entry) <= k]
    return sorted(items, key=lambda item: item[1].rank)


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int,
                    decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
    """For each row i of `logits` [R, vocab] (the model's logits at a prompt position), the entry of the prompt
    token that follows it, `targets[i]`: {targets[i]: its Logprob, then the k likeliest tokens: theirs}, the
    prompt token first (a top-k token that is the prompt token is not repeated). One host copy. `decode`: a
    token id's text, for `Logprob.decoded_token` (left None without it).

    Worked example, k = 1, one row with log_softmax [-0.1, -2.5, -3.0] and target 2:
    {2: Logprob(-3.0, rank 3), 0: Logprob(-0.1, rank 1)}.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    ranks = logprob_ranks(logprobs, chosen)
    top_values, top_ids = logprobs.topk(k, dim=-1)
    targets_list, chosen_list, ranks_list, values, ids = (
        t.tolist() for t in (targets, chosen.squeeze(1), ranks, top_values, top_ids))
    out = []
    for i, target in enumerate(targets_list):
        entry = {target: Logprob(chosen_list[i], ranks_list[i], decode(target) if decode else None)}
        for rank, (token, value) in enumerate(zip(ids[i], values[i]), start=1):
            if token not in entry:
                entry[token] = Logprob(value, rank, decode(token) if decode else None)
        out.append(entry)
    return out


@dataclass(frozen=True)
class SamplerOutput:
    """One token per row; `logprobs[i]` is None where row i did not ask for logprobs."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]


def to_device(values: Sequence, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on `device` without waiting for the device: on CUDA through pinned memory,
    non-blocking (a plain `torch.tensor(values, device=cuda)` synchronises the stream, which would stall async
    scheduling; torch's caching host allocator keeps the pinned buffer until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _host_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device (through pinned memory on CUDA, as `to_device`)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class PendingSample:
    """One step's sampled tokens: `tokens` [rows] int64 on the device at once (the next step may read them
    there), and on their way to the host: `result()` waits for them (on CUDA a non-blocking copy into pinned
    memory and an event, so the host can queue more work first) and returns the `SamplerOutput`."""

    def __init__(self, tokens: torch.Tensor, params: Sequence[SamplingParams], want: list[int],
                 logprobs: tuple[torch.Tensor, ...] = ()) -> None:
        self.tokens = tokens
        self._params = params
        self._want = want
        parts = (tokens, *logprobs)
        self._event = None
        if tokens.device.type == "cuda":
            parts = tuple(part.to("cpu", non_blocking=True) for part in parts)
            self._event = torch.cuda.Event()
            self._event.record()
        self._host = parts

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        tokens, *logprobs = (part.tolist() for part in self._host)
        if not self._want:
            return SamplerOutput(tokens, [None] * len(tokens))
        chosen, ranks, values, ids = logprobs
        out: list[TokenLogprob | None] = [None] * len(tokens)
        for j, i in enumerate(self._want):
            count = self._params[i].logprobs
            out[i] = TokenLogprob(tokens[i], chosen[j], ranks[j], tuple(zip(ids[j][:count], values[j][:count])))
        return SamplerOutput(tokens, out)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], **options: object) -> SamplerOutput:
    """`sample_async(logits, rows, **options).result()`: the tokens (and logprobs) on the host."""
    return sample_async(logits, rows, **options).result()


def sample_async(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    *,
    stop_token_ids: frozenset[int] | Sequence[int] = (),
    allowed_bitmask: torch.Tensor | None = None,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> PendingSample:
    """Sample one token per row of `logits` [num_rows, vocab], the whole batch at once, without waiting for
    the device (see `PendingSample`).

    Order (vLLM's): the structured-output mask (`allowed_bitmask` [num_rows, ceil(vocab/32)] int32, bit v of a
    row set = token v allowed; rows that are unconstrained have every bit set: the logprobs see it), logit_bias
    and min_tokens (EOS/stop tokens masked), penalties, then temperature, min_p, top-k and top-p (keeping at
    least the likeliest token). Greedy rows take the argmax of the processed logits. Random rows draw by the
    exponential race (argmax of probs / E with E ~ Exp(1) drawn from the row's own generator), so a row's draw
    does not depend on the other rows. Only the tokens (and the logprobs asked for) are copied to the host,
    once. `stop_token_ids`: the model's EOS ids (`min_tokens` masks them and the row's own stop_token_ids).
    What the rows' `token_ids` say is read now: penalties read the output tokens, `min_tokens` only their count.
    A batch of greedy rows with nothing to process (`_plain_greedy`) takes `argmax` (logits [rows, vocab] fp32 ->
    [rows] int64, torch.argmax's result; default torch's) of the logits as they are, with no fp32 copy: the engine
    passes the device's (`kernels.sampling.greedy_tokens`).
    """
    num_rows = logits.shape[0]
    if num_rows != len(rows):
        raise ValueError(f"{num_rows} rows of logits but {len(rows)} sampling rows")
    device = logits.device
    params = [row.params for row in rows]
    raw = logits.float()
    if allowed_bitmask is None and all(_plain_greedy(row, stop_token_ids) for row in rows):
        tokens = argmax(raw) if argmax is not None else raw.argmax(dim=-1)
        return _pending(raw, tokens, params)  # the common decode step: no fp32 copy processed
    if allowed_bitmask is not None:  # logprobs, as vLLM's, see the grammar's mask (not the bias or penalties)
        raw = masked(raw, allowed_bitmask)
    scores = process_logits(raw, rows, stop_token_ids=stop_token_ids, guided=allowed_bitmask is not None)
    tokens = scores.argmax(dim=-1)
    if not all(p.greedy for p in params):  # (an all-greedy batch copies nothing over)
        greedy = to_device([p.greedy for p in params], device)
        probs = filtered_probs(scores, params)
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            if row.generator is None:
                noise[i].exponential_()
            else:
                noise[i].exponential_(generator=row.generator)
        drawn = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, drawn)
    return _pending(raw, tokens, params)


def _pending(raw: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> PendingSample:
    """The step's `PendingSample`: `tokens`, and the logprobs of `raw` (the unprocessed fp32 logits) the rows ask
    for."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return PendingSample(tokens, params, want)
    return PendingSample(tokens, params, want, _logprob_tensors(raw, tokens, params, want))


def _plain_greedy(row: SamplingRow, stop_token_ids: frozenset[int] | Sequence[int]) -> bool:
    """Row `row` takes the argmax of the raw logits: greedy, and nothing of `process_logits` changes its scores (no
    logit_bias, no penalties, no stop token masked by min_tokens)."""
    p = row.params
    return p.greedy and not p.logit_bias and not p.penalized and not _min_tokens_bans(row, stop_token_ids)


def _min_tokens_bans(row: SamplingRow, stop_token_ids: frozenset[int] | Sequence[int]) -> set[int]:
    """The tokens that `min_tokens` masks in `row` now: its stop tokens and EOS while the row is short of
    min_tokens output tokens (EOS with `ignore_eos` too, as vLLM's `all_stop_token_ids`), else none."""
    p = row.params
    if not p.min_tokens or len(row.token_ids) - row.prompt_len >= p.min_tokens:
        return set()
    return set(p.stop_token_ids) | set(stop_token_ids)


def stop_tokens(params: SamplingParams, eos_token_ids: Iterable[int]) -> set[int]:
    """The tokens that end a sequence sampled with `params` when emitted: its `stop_token_ids`, and the model's EOS
    ids unless `ignore_eos`."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def process_logits(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    *,
    stop_token_ids: frozenset[int] | Sequence[int] = (),
    guided: bool = False,
) -> torch.Tensor:
    """fp32 copy of `logits` after logit_bias, min_tokens and the penalties (what temperature and the filters of
    `sample` then act on). `guided`: `logits` are already masked by the rows' grammars (-inf where a grammar
    forbids a token); where min_tokens would then ban every token the grammar allows (a finished grammar allows
    only its stop tokens), the grammar wins: the row keeps its mask without the ban, so a guided completion can
    end before min_tokens rather than emit a token of all -inf logits."""
    scores = logits.float().clone()
    _apply_bias(scores, rows)
    _apply_min_tokens(scores, rows, stop_token_ids, guided=guided)
    if any(row.params.penalized for row in rows):
        _apply_penalties(scores, rows)
    return scores


def _apply_bias(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's logit_bias (in place)."""
    bias_rows, bias_cols, bias_values = [], [], []
    vocab = scores.shape[1]
    for i, row in enumerate(rows):
        for token, value in row.params.logit_bias:
            if token < vocab:
                bias_rows.append(i)
                bias_cols.append(token)
                bias_values.append(value)
    if bias_rows:
        device = scores.device
        index = (to_device(bias_rows, device), to_device(bias_cols, device))
        scores.index_put_(index, to_device(bias_values, device, scores.dtype), accumulate=True)


def _apply_min_tokens(scores: torch.Tensor, rows: Sequence[SamplingRow],
                      stop_token_ids: frozenset[int] | Sequence[int], *, guided: bool) -> None:
    """Mask EOS/stop tokens of rows still short of min_tokens (in place); with `guided`, a row the ban would leave
    all -inf keeps its scores from before it (no host synchronisation: a `where` on the device)."""
    ban_rows, ban_cols = [], []
    vocab = scores.shape[1]
    for i, row in enumerate(rows):
        for token in _min_tokens_bans(row, stop_token_ids):
            if token < vocab:
                ban_rows.append(i)
                ban_cols.append(token)
    if not ban_rows:
        return
    device = scores.device
    before = scores.clone() if guided else None
    scores[to_device(ban_rows, device), to_device(ban_cols, device)] = float("-inf")
    if before is not None:
        dead = torch.isneginf(scores).all(dim=1, keepdim=True)
        scores.copy_(torch.where(dead, before, scores))


def masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, vocab] with -inf where the rows' grammar bitmask [rows, ceil(vocab/32)] int32 (bit v set =
    token v allowed; host or device) forbids a token."""
    allowed = _unpack_bitmask(_host_to(bitmask, logits.device), logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))


def _unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool: bit (v % 32) of word v // 32."""
    positions = torch.arange(vocab, device=bitmask.device)
    words = bitmask[:, positions // 32]
    return ((words >> (positions % 32)) & 1).bool()


def _apply_penalties(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition, frequency and presence penalties (vLLM's formulas; see SamplingParams), in place.

    Worked example, logits [2.0, -1.0, 0.5], prompt [0], output [1, 1], repetition 2, frequency 0.5,
    presence 0.25: repetition -> [1.0, -2.0, 0.5] (tokens 0 and 1 seen); frequency -> token 1: -2.0 - 2 x 0.5;
    presence -> token 1: -3.0 - 0.25 = -3.25. Result [1.0, -3.25, 0.5].
    """
    num_rows, vocab = scores.shape
    device = scores.device
    output_counts = torch.zeros(num_rows, vocab, device=device)
    seen_in_prompt = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        if not row.params.penalized:
            continue
        output = row.token_ids[row.prompt_len:]
        if output:
            ids = to_device(output, device)
            output_counts[i].index_add_(0, ids, torch.ones(len(output), device=device))
        if row.params.repetition_penalty != 1:
            seen_in_prompt[i, to_device(row.token_ids[:row.prompt_len], device)] = True
    params = [row.params for row in rows]
    repetition = to_device([p.repetition_penalty for p in params], device).unsqueeze(1)
    frequency = to_device([p.frequency_penalty for p in params], device).unsqueeze(1)
    presence = to_device([p.presence_penalty for p in params], device).unsqueeze(1)
    seen = seen_in_prompt | (output_counts > 0)
    penalized = torch.where(scores > 0, scores / repetition, scores * repetition)
    scores.copy_(torch.where(seen, penalized, scores))
    scores -= frequency * output_counts + presence * (output_counts > 0).float()


def filtered_probs(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Per-row probabilities after temperature, min_p, top-k and top-p, each row summing to 1 (greedy rows get
    temperature 1; their probabilities are not used). Top-k keeps every token whose score is at least the k-th
    largest (ties with it included, as vLLM's and transformers'): scores [3, 2, 2, 1] with top_k 2 keep three."""
    device = scores.device
    vocab = scores.shape[1]
    temperature = to_device([p.temperature if not p.greedy else 1.0 for p in params], device)
    scores = scores / temperature.unsqueeze(1)
    if not any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
        return torch.softmax(scores, dim=-1)
    top_k = to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device).unsqueeze(1)
    top_p = to_device([float(p.top_p) for p in params], device).unsqueeze(1)
    min_p = to_device([float(p.min_p) for p in params], device).unsqueeze(1)
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    drop = sorted_probs < min_p * sorted_probs[:, :1]
    # top-k by value, as vLLM's and transformers': a token tied with the k-th largest score stays
    drop |= sorted_scores < sorted_scores.gather(1, top_k - 1)
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    drop |= sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)  # speculative acceptance reads p[draft]
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def logprob_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each row's rank of its chosen value `chosen` [R, 1] among `logprobs` [R, vocab]: how many values are at
    least it (vLLM's `batched_count_greater_than`; ties take the worse rank)."""
    return (logprobs >= chosen).sum(dim=1)


def _logprob_tensors(raw: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams],
                     want: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows in `want`, on the device: log_softmax(raw)[token] [W] and its rank [W] (`Logprob.rank`), and the
    top-k values and ids [W, k] (k: the largest `logprobs` asked for)."""
    index = to_device(want, raw.device)
    logprobs = torch.log_softmax(raw[index], dim=-1)
    chosen = logprobs.gather(1, tokens[index].unsqueeze(1))
    ranks = logprob_ranks(logprobs, chosen)
    k = max(params[i].logprobs for i in want)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], index.new_zeros(len(want), 0))
    return chosen.squeeze(1), ranks, top_values, top_ids
