"""Output processing: what the engine does with each sampled token once it is on the host, and the outputs.

`OutputProcessor` keeps, per request, what its completions have produced beyond their token ids
(`RequestState`: detokenizers, logprobs, grammar matchers, prompt logprobs) and turns it into `RequestOutput`s.
The engine's step loop (`engine.py`) owns the requests and the sequences; it calls, per step:

- `allowed_bitmask(states, logits)` before sampling: the grammar mask of the rows (None when no row is
  constrained);
- `record_prompt_logprobs(...)` after a forward whose chunks asked for prompt logprobs;
- `accept(state, seq, token, logprob)` for each sampled token, in row order, once the token is in place in
  `seq.token_ids`: it records the logprob, advances the grammar, detokenizes and checks the stops; it returns
  the finish reason ("stop": an EOS or stop token, decoded into the text only with `include_stop_str_in_output`,
  or a stop string; "length": `max_tokens` or `max_model_len` reached) or None, and keeps vLLM's `stop_reason`
  (the stop string, also when a stop token decoded with `include_stop_str_in_output` completes one; else the
  stop token id; None for the tokenizer's EOS). It never touches the scheduler: the engine finishes the
  sequence when a reason comes back;
- `output(state)` for the output of a request (also after an abort): everything so far, or with
  `RequestOutputKind.DELTA` what is new since its last output.

Logprob entries name their tokens as vLLM's `LogprobsProcessor` does (`detokenizer.token_text`): a token whose
own text ends in part of a character is read with the tokens before its position (sampled tokens for a sample,
prompt tokens for the prompt), so their texts add up to the text.

Nothing here reads the device beyond the prompt-logprob rows it is handed, and nothing here changes a sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from hybridcache.detokenizer import (
    PROMPT_CONTEXT,
    DeferredDetokenizer,
    IncrementalDetokenizer,
    detokenizer_for,
    token_text,
)
from hybridcache.guided import GrammarCache, fill_bitmask
from hybridcache.outputs import CompletionOutput, RequestOutput
from hybridcache.sampling import (
    Logprob,
    PromptLogprobs,
    RequestOutputKind,
    SampleLogprobs,
    SamplingParams,
    TokenLogprob,
    prompt_logprobs,
    to_device,
)
from hybridcache.scheduler.output import ScheduledChunk
from hybridcache.scheduler.sequence import Seq
from hybridcache.tokenizer import Tokenizer


@dataclass
class RequestState:
    """One request: `seqs[i]` is completion i (each holds the prompt ids at the head of its `token_ids`),
    `texts[i]` its detokenizer (deferred for FINAL_ONLY requests without stop strings), `logprobs[i]` its
    tokens' logprobs (vLLM's entries, when asked for) and `cumulative_logprobs[i]` their sum, `stop_reasons[i]`
    the stop string or stop token that ended it (vLLM's `stop_reason`), `matchers[i]` its own grammar state
    (structured output; None when unconstrained), `prompt_logprobs` the prompt's logprobs when asked for (entry p
    for prompt token p, None for p = 0 and until computed); `sent[i]`: completion i's (output tokens, characters)
    that earlier DELTA outputs held (`params.output_kind`; empty before the first)."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    seqs: list[Seq] = field(default_factory=list)
    texts: list[IncrementalDetokenizer | DeferredDetokenizer] = field(default_factory=list)
    logprobs: list[SampleLogprobs] = field(default_factory=list)
    cumulative_logprobs: list[float] = field(default_factory=list)
    stop_reasons: list[str | int | None] = field(default_factory=list)
    matchers: list = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    last_shown: tuple[tuple[int, bool], ...] = ()  # each completion's (tokens, ended) at its last streamed output
    sent: list[tuple[int, int]] = field(default_factory=list)

    def shown(self) -> tuple[tuple[int, bool], ...]:
        """Each completion's output tokens so far and whether it has ended (what an output of it now would show)."""
        return tuple((seq.num_tokens - seq.prompt_len, seq.finish_reason is not None) for seq in self.seqs)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def final_only(self) -> bool:
        """`step` returns its output only once it has finished (`RequestOutputKind.FINAL_ONLY`)."""
        return self.params.output_kind is RequestOutputKind.FINAL_ONLY


class OutputProcessor:
    """See the module docstring. `eos_token_ids`: the model's; `max_model_len`: the engine's."""

    def __init__(self, tokenizer: Tokenizer, grammars: GrammarCache, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def new_request(self, request_id: str, prompt: str | None, prompt_len: int, params: SamplingParams,
                    seqs: Sequence[Seq]) -> RequestState:
        """The state of a new request whose completions are `seqs`: a detokenizer (primed with the prompt's last
        tokens, as vLLM's: a character begun in the prompt is completed by the completion's first token; deferred
        for FINAL_ONLY), an empty logprob list and a grammar matcher (when guided) per completion, room for the
        prompt logprobs when asked for."""
        state = RequestState(request_id, prompt, params, seqs=list(seqs),
                             prompt_token_ids=seqs[0].token_ids[: seqs[0].prompt_len])
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * prompt_len
        first = state.seqs[0]
        prompt_tail = first.token_ids[max(0, first.prompt_len - PROMPT_CONTEXT): first.prompt_len]
        for _ in state.seqs:
            state.texts.append(detokenizer_for(self.tokenizer, params, deferred=state.final_only,
                                               prompt_ids=prompt_tail))
            state.logprobs.append([])
            state.cumulative_logprobs.append(0.0)
            state.stop_reasons.append(None)
            state.matchers.append(None if params.guided is None else self.grammars.matcher(params.guided))
        return state

    def _decode_ids(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _logprob_texts(self, context_ids: Sequence[int]) -> Callable[[int], str]:
        """The text of a logprob entry's token at a position whose tokens before it end with `context_ids`."""
        return partial(token_text, self._decode_ids, context_ids=context_ids)

    def _named(self, entry: dict[int, Logprob], context_ids: Sequence[int]) -> dict[int, Logprob]:
        """`entry` with its tokens' texts, at a position whose tokens before it end with `context_ids`."""
        text = self._logprob_texts(context_ids)
        return {token: Logprob(lp.logprob, lp.rank, text(token)) for token, lp in entry.items()}

    def allowed_bitmask(self, rows: Sequence[tuple[RequestState | None, Seq]],
                        vocab_size: int) -> torch.Tensor | None:
        """The grammar bitmask of the rows to sample (row i: `rows[i]`'s completion; a row without a state is
        unconstrained); None when none is guided. A row whose grammar dead-ends allows the EOS ids instead (the
        choice ends rather than emit token 0 on)."""
        return fill_bitmask([None if state is None else state.matchers[seq.index] for state, seq in rows],
                            vocab_size, dead_end_tokens=sorted(self.eos_token_ids))

    def draft_bitmask(self, state: RequestState | None, seq: Seq, drafts: Sequence[int],
                      vocab_size: int) -> torch.Tensor | None:
        """The grammar bitmask [len(drafts) + 1, ceil(vocab/32)] of a verify row of `seq` (speculative decoding):
        row j is the grammar's state after drafts d1..dj, as `allowed_bitmask` would give it had they been emitted;
        None when `seq` is unconstrained. The drafts are accepted one by one in the matcher, then rolled back (vLLM's
        structured-output manager does the same). A draft the grammar refuses ends the walk: the positions after it
        are never reached (its own position's mask cannot choose it), and they repeat that position's mask.

            drafts ["{", "x", "}"], schema {"a": int}: row 0 = the state at the start (allows "{"), row 1 after
            "{" (allows '"'), "x" refused at row 1 -> rows 2 and 3 copy row 1"""
        matcher = None if state is None else state.matchers[seq.index]
        if matcher is None:
            return None
        rows, taken = [], 0
        for draft in (*drafts, None):
            rows.append(self.allowed_bitmask([(state, seq)], vocab_size))
            allowed = draft is not None and int(rows[-1][0, draft // 32]) >> draft % 32 & 1
            if not allowed or matcher.is_terminated() or not matcher.accept_token(draft):
                break  # (the mask asked first: xgrammar logs a warning for every token it refuses)
            taken += 1
        if taken:
            matcher.rollback(taken)
        rows += rows[-1:] * (len(drafts) + 1 - len(rows))
        return torch.cat(rows)

    def accept(self, state: RequestState, seq: Seq, token: int, logprob: TokenLogprob | None,
               num_tokens: int | None = None) -> str | None:
        """Process `seq`'s sampled `token`; its finish reason, or None. `num_tokens`: the sequence's length with
        `token` (default: its length now, `token` already in `seq.token_ids`; speculative steps pass the length
        each accepted token brings, before they are appended)."""
        if logprob is not None:
            entries = state.logprobs[seq.index]
            context = [next(iter(entry)) for entry in entries[-4:]]  # the sampled tokens before (each entry's first)
            entries.append(logprob.entry(self._logprob_texts(context)))
            state.cumulative_logprobs[seq.index] += logprob.logprob
        matcher = state.matchers[seq.index]
        if matcher is not None and not matcher.is_terminated():
            matcher.accept_token(token)
        text = state.texts[seq.index]
        reason = self._finish_reason(seq, token, text, seq.num_tokens if num_tokens is None else num_tokens)
        if reason == "stop":  # the stop string, also one a stop token's decoded text completed
            state.stop_reasons[seq.index] = (text.stop_reason if text.stop_reason is not None
                                             else self._stop_token_reason(seq, token))
        if reason is None and matcher is not None and matcher.is_terminated():
            return "stop"  # the grammar is complete (its stop token taken under ignore_eos): no token may follow
        return reason

    def _finish_reason(self, seq: Seq, token: int, text: IncrementalDetokenizer | DeferredDetokenizer,
                       num_tokens: int) -> str | None:
        """Why `seq` stops after sampling `token` (which makes it `num_tokens` long), or None. A stop token is
        decoded into the text only with `include_stop_str_in_output`, and its text is then searched for stop
        strings like any token's (vLLM's rule: one it completes cuts the text and is the `stop_reason`)."""
        if self._is_stop_token(seq, token):
            if seq.params.include_stop_str_in_output:
                text.add(token)
            return "stop"
        if text.add(token):
            return "stop"
        if num_tokens - seq.prompt_len >= seq.params.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def _is_stop_token(self, seq: Seq, token: int) -> bool:
        return (not seq.params.ignore_eos and token in self.eos_token_ids) or token in seq.params.stop_token_ids

    def _stop_token_reason(self, seq: Seq, token: int) -> int | None:
        """vLLM's `stop_reason` of a stop on stop token `token`: None for the tokenizer's EOS (vLLM checks
        it before `stop_token_ids`, so even when the request lists it) unless the request ignores EOS; else the id:
        a listed stop token, or one of the model's other EOS ids (vLLM's `update_from_generation_config` makes them
        stop tokens)."""
        return None if not seq.params.ignore_eos and token == self.tokenizer.eos_token_id else token

    def record_prompt_logprobs(self, states: dict[str, RequestState], chunks: Sequence[ScheduledChunk],
                               flags: Sequence[bool], logits: torch.Tensor) -> None:
        """Store the prompt logprobs of the flagged chunks (in `states[chunk.seq.request_id]`). `logits` is what
        the runner returned: row i at chunk i's last token, then each flagged chunk's other rows in chunk order.
        The logits at position p give the logprob of prompt token p + 1. Entry p's token texts take prompt tokens
        max(1, p - 4) .. p - 1 as context (vLLM's: the prompt tokens of the entries before; `token_text`).

        Worked example: 2 chunks, chunk 1 flagged, start 10, 4 tokens: rows [2, 3, 4, 1] hold positions
        10..13, i.e. prompt tokens 11..14 (a position at or past prompt_len - 1 predicts no prompt token)."""
        next_row = len(chunks)
        for i, (chunk, flag) in enumerate(zip(chunks, flags)):
            if not flag:
                continue
            rows = [*range(next_row, next_row + chunk.num_tokens - 1), i]
            next_row += chunk.num_tokens - 1
            seq = chunk.seq
            count = min(chunk.end, seq.prompt_len - 1) - chunk.start
            targets = to_device(seq.token_ids[chunk.start + 1: chunk.start + 1 + count], logits.device)
            entries = prompt_logprobs(logits[rows[:count]], targets, seq.params.prompt_logprobs)
            first = chunk.start + 1
            states[seq.request_id].prompt_logprobs[first: first + count] = [
                self._named(entry, seq.token_ids[max(1, p - 4): p]) for p, entry in enumerate(entries, start=first)]

    def output(self, state: RequestState) -> RequestOutput:
        """The request's output: each completion's text (until it finishes, without what may begin a stop
        string: `IncrementalDetokenizer.shown`), token ids, finish and stop reasons, cached tokens, logprobs and
        their sum (when asked for) and speculative draft counts, and the prompt logprobs. With
        `RequestOutputKind.DELTA` the text, token ids and logprobs are what earlier outputs did not hold (the
        shown text only grows: each is a prefix of the next, and of the final text), and the prompt logprobs come
        in the first output only."""
        asked = state.params.logprobs is not None
        delta = state.params.output_kind is RequestOutputKind.DELTA
        prompt_logprobs = state.prompt_logprobs
        if delta:
            if state.sent:
                prompt_logprobs = None
            else:
                state.sent = [(0, 0)] * len(state.seqs)
        completions = []
        for i, (seq, text) in enumerate(zip(state.seqs, state.texts)):
            num_tokens, num_chars = state.sent[i] if delta else (0, 0)
            shown = text.shown_since(num_chars, seq.is_finished)  # (only the new part is copied)
            if delta:
                state.sent[i] = (seq.num_tokens - seq.prompt_len, num_chars + len(shown))
            completions.append(CompletionOutput(
                seq.index, shown, seq.token_ids[seq.prompt_len + num_tokens:], seq.finish_reason, seq.num_cached or 0,
                logprobs=state.logprobs[i][num_tokens:] if asked else None,
                cumulative_logprob=state.cumulative_logprobs[i] if asked else None,
                stop_reason=state.stop_reasons[i] if seq.finish_reason == "stop" else None,
                num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens))
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            num_cached_tokens=min(c.num_cached_tokens for c in completions),
            finished=state.finished,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
        )
