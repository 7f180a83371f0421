"""The text of one completion, decoded as its tokens arrive, and where a stop string ends it.

`detokenizer_for(tokenizer, params)` picks the decoder of a completion: an `IncrementalDetokenizer`, or for a text
read only at the end with no stop strings to watch a `DeferredDetokenizer` (one decode when read). Stop strings
follow vLLM's v1 detokenizer: none is looked for before the completion has more than `min_tokens` tokens (one may
start in the text of those tokens, as long as it ends after it), and of those a token completes, the one that ends
first wins (ties: the first in `stop`'s order). `token_text` is the text of a logprob entry's token (vLLM's
`LogprobsProcessor`: a token that ends in part of a character is read with the tokens before it).

Both decoders read a completion after its prompt, as vLLM's `FastIncrementalDetokenizer` primes its `DecodeStream`
(`prompt_suffix`): a character whose first bytes end the prompt and whose last byte is the completion's first token
is the completion's first character, and a SentencePiece word token keeps its leading space. The prompt's own text
is never part of the completion's (nor searched for stop strings). Worked example (byte-level tokens, "€" is the
3 bytes E2 82 AC)::

    prompt  "price: " E2 82     completion  AC "5"      text "€5"   (a fresh decode of AC: "\ufffd5")
    prompt  "price: " E2 82     completion  "a"         text "a"   (vLLM's: "\ufffda", the prompt's bytes)

A prompt's dangling bytes that the completion does not complete are the prompt's: they stand for nothing in the
completion's text (`without_prompt_residue`), where vLLM's text starts with their U+FFFD (so a regex-guided
completion's text would not match its regex).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from tokenizers.decoders import DecodeStream

from hybridcache.sampling import SamplingParams
from hybridcache.tokenizer import Tokenizer

_logger = logging.getLogger("hybridcache.detokenizer")
_INVALID_PREFIX = "Invalid prefix"  # tokenizers' DecodeStream, when a decoder rewrote text it already returned
_REPLACEMENT = "\ufffd"  # what a decode gives for the bytes of a character not complete
_MAX_CONTEXT = 4  # a UTF-8 character has at most 4 bytes, so at most 3 tokens before its last one
PROMPT_CONTEXT = 64  # the most prompt tokens a decoder reads (`prompt_suffix`)


def prompt_suffix(tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> list[int]:
    """The prompt tokens a completion's decoder is primed with (vLLM's `FastIncrementalDetokenizer`): the shortest
    of the prompt's last 4, 5, .. 23 tokens whose decode holds no U+FFFD, else all of it. One decode of 4 tokens
    in the common case; the search runs on only when the prompt's last tokens hold a character not complete (its
    end split from the completion, or invalid bytes). Unlike vLLM, "all of it" is at most its last
    `PROMPT_CONTEXT` tokens: a whole prompt costs host time per request in its length (19 s for 32k
    random ids), and gives another text only when those last 64 tokens complete no character."""
    prompt_ids = list(prompt_ids[-PROMPT_CONTEXT:])
    for num_ids in range(4, min(len(prompt_ids), 23) + 1) if len(prompt_ids) > 4 else ():
        suffix = prompt_ids[-num_ids:]
        if _REPLACEMENT not in tokenizer.backend.decode(suffix):  # (vLLM's decode: special tokens skipped)
            return suffix
    return prompt_ids


def without_prompt_residue(text: str, own: str) -> str:
    """A completion's text decoded after its prompt's dangling bytes (`text`), or its own decode (`own`) when
    those bytes only made replacement characters in front of it: "\ufffd\ufffda" and "a" give "a"; "€" and
    "\ufffd" (the prompt's E2 82, then AC) give "€"."""
    lead = len(text) - len(own)
    return own if lead > 0 and text.endswith(own) and text[:lead] == _REPLACEMENT * lead else text


def token_text(decode: Callable[[list[int]], str], token_id: int, context_ids: Sequence[int]) -> str:
    """The text of `token_id` in a logprob entry (vLLM's `LogprobsProcessor._verify_tokens`), where the tokens
    before its position end with `context_ids`. `decode`: ids -> text, special tokens kept.

    A token's own decode, unless it ends in U+FFFD (the token holds bytes of a character that its decode alone
    cannot complete): then it is read with the last 1, 2, .. 4 tokens of `context_ids` before it, and the first
    such decode that no longer ends in U+FFFD, less the text of its leading context tokens that decode whole on
    their own, is its text; "" while the character is still incomplete. So the texts of a completion's tokens add
    up to its text, and a completion's `text_offset`s and a chat token's `bytes` are right. Only a token whose own
    text ends in U+FFFD costs more than one decode. Worked example (byte-level tokens)::

        tokens  "a"  0xE2  0x82  0xAC  "b"      (the 3 bytes of "€")
        texts   "a"  ""    ""    "€"     "b"

    vLLM's context: for a sampled token, the completion's sampled tokens before it (none for its first); for a
    prompt token p >= 1, prompt tokens max(1, p - 4) .. p - 1 (its first prompt token has no entry, so it is never
    context); every alternative at a position takes the same context."""
    text = decode([token_id])
    if not text.endswith(_REPLACEMENT):
        return text
    context_ids = list(context_ids[-_MAX_CONTEXT:])
    for num_context in range(1, len(context_ids) + 1):
        context = context_ids[-num_context:]
        full = decode([*context, token_id])
        if full.endswith(_REPLACEMENT):
            continue
        clean_end = len(context)  # the context tokens from here on hold bytes of the character this one completes
        while clean_end > 0 and decode([context[clean_end - 1]]).endswith(_REPLACEMENT):
            clean_end -= 1
        prefix = decode(context[:clean_end]) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        return full[len(os.path.commonprefix([prefix, full])):]  # (a decoder that normalizes across tokens)
    return ""


def detokenizer_for(tokenizer: Tokenizer, params: SamplingParams, *, deferred: bool = False,
                    prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer | DeferredDetokenizer:
    """A fresh decoder of one completion of a request with `params` (its stop strings, `min_tokens`,
    `skip_special_tokens`, `include_stop_str_in_output`) after `prompt_ids` (the prompt's ids, or its last
    `PROMPT_CONTEXT` or more). `deferred`: the text is read only at the end."""
    if deferred and not params.stop:
        return DeferredDetokenizer(tokenizer, params.skip_special_tokens, prompt_ids=prompt_ids)
    return IncrementalDetokenizer(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens,
                                  include_stop=params.include_stop_str_in_output, min_tokens=params.min_tokens,
                                  prompt_ids=prompt_ids)


class DeferredDetokenizer:
    """`IncrementalDetokenizer`'s contract with no stop strings, at no cost per token: `add` only keeps the id and
    `text` decodes all of them once (the engine uses it for FINAL_ONLY requests, whose text is read when they
    finish: one decode of n tokens instead of n incremental steps in every decode step's host time). After a
    prompt, that decode starts at its `prompt_suffix` and drops the text a stream primed with it returned."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, *,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._prime = prompt_suffix(tokenizer, prompt_ids) if prompt_ids else []
        self._ids: list[int] = []
        self._text: str | None = ""
        self.stop_reason: str | None = None  # (no stop strings: never one)

    def add(self, token_id: int) -> bool:
        """Keep one more token; never a stop (there are no stop strings)."""
        self._ids.append(token_id)
        self._text = None
        return False

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._decode()
        return self._text

    def _decode(self) -> str:
        if not self._prime:
            return self._tokenizer.decode(self._ids, self._skip)
        primed = IncrementalDetokenizer(self._tokenizer, skip_special_tokens=self._skip).primed(self._prime)
        text = self._tokenizer.decode([*self._prime, *self._ids], self._skip)
        if not text.startswith(primed):  # (a decoder that rewrites text across tokens)
            return self._tokenizer.decode(self._ids, self._skip)
        text = text[len(primed):]
        if not text.startswith(_REPLACEMENT):  # no prompt residue possible: one decode, not two
            return text
        return without_prompt_residue(text, self._tokenizer.decode(self._ids, self._skip))

    def shown(self, finished: bool) -> str:
        """`text` (no stop strings: nothing is held back)."""
        return self.text

    def shown_since(self, start: int, finished: bool) -> str:
        """`shown(finished)[start:]` (`text` from `start`)."""
        return self.text[start:]


class IncrementalDetokenizer:
    """The text of one growing completion, decoded a token at a time with tokenizers' `DecodeStream`.

    Contract (vLLM's v1 detokenizer, `update` and `check_stop_strings`): after `add(t)` for each token of `ids`,
    `text` equals `Tokenizer.decode(ids, skip_special_tokens)` (after a prompt: the decode of its `prompt_suffix`
    and `ids`, less the text the stream returned for the suffix) cut at the first stop string a token completed:
    before it (after it with `include_stop`), and `stop_reason` is that stop string (None before). Of the stop
    strings one token completes, the one that ends first wins (ties: the first in `stop`'s order). Stop strings
    are looked for only once more than `min_tokens` tokens were added; the first search after them finds a stop
    string that starts in their text and ends in the new token's. A token costs a decode of the few tokens since
    the last complete character, and the stop search looks only at the characters that can complete a stop
    string, so n tokens cost O(n), not O(n^2).

    Tokens whose bytes do not yet form a complete character are `pending`: `DecodeStream` returns nothing for
    them, and `text` appends their own decode (U+FFFD replacement characters), as a full decode would (with the
    prompt's last tokens that the stream holds with them; none while the completion has no pending token). Worked
    example (byte-level tokens, stop = ("END",))::

        add("a")   text "a"
        add(0xE2)  text "a\\ufffd"      (pending: the first byte of a 3-byte character)
        add(0x82)  text "a\\ufffd\\ufffd"
        add(0xAC)  text "a€"           (complete: the stream emits "€")
        add("E"), add("N"), add("D") -> the last returns True; text "a€" from then on

    With min_tokens = 2 and stop = ("a",), tokens "a", "a", "a": the first two are never searched, the third
    returns True; text "aa". With min_tokens = 1 and stop = ("aa",), tokens "a", "a": the second returns True
    (the stop string started in the first token's text); text "". With stop = ("User:", "\\nUser:") and the
    piece "\\nUser:" in one token, both end at its end: "User:" (first in `stop`) wins; text "...\\n".

    Decoders that rewrite text they already returned (byte fallback, Metaspace) can make `DecodeStream` fail with
    "Invalid prefix"; the stream then starts afresh at the token (as vLLM does), and `text` may differ from a full
    decode from there on (the pending tokens' replacement characters are kept).
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), *, skip_special_tokens: bool = True,
                 include_stop: bool = False, min_tokens: int = 0, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._emitted = ""
        self._pending: list[int] = []  # the ids the stream took since it last returned text (prompt ids too)
        self._pending_output = False  # whether the completion's ids are among them
        self._held_prompt = 0  # how many of them are the prompt's (before the stream first returns output text)
        self._stop_at: int | None = None
        self.stop_reason: str | None = None  # the stop string found, once one is
        if prompt_ids:
            self.primed(prompt_suffix(tokenizer, prompt_ids))

    def primed(self, prompt_ids: Sequence[int]) -> str:
        """Step the stream over `prompt_ids` (before any `add`); the text it returned for them, which is no part of
        the completion's (vLLM's priming)."""
        primed = ""
        for token_id in prompt_ids:
            piece = self._step(token_id)
            if piece is None:
                self._pending.append(token_id)
            else:
                self._pending.clear()
                primed += piece
        self._held_prompt = len(self._pending)
        return primed

    def add(self, token_id: int) -> bool:
        """Decode one more token; True when the text now contains a stop string (it is then cut there)."""
        self._num_tokens += 1
        piece = self._step(token_id)
        if piece is None:
            self._pending.append(token_id)
        else:
            if self._held_prompt:  # the first output text: the prompt's dangling bytes in it, if they stand alone
                own = self._tokenizer.decode([*self._pending[self._held_prompt:], token_id], self._skip)
                piece = without_prompt_residue(piece, own)
                self._held_prompt = 0
            self._pending.clear()
        self._pending_output = piece is None
        searched_to = len(self._emitted)
        if piece:
            self._append(piece)
            if self._stop_at is None and self._num_tokens > self._min_tokens:
                self._find_stop(searched_to)
        return self._stop_at is not None

    def _append(self, piece: str) -> None:
        """`_emitted += piece` in O(len(piece)) amortized: with the attribute's reference dropped, the local is the
        text's only one and CPython grows it in place (`self._emitted += piece` copies the whole text every token).
        An output that holds `_emitted` itself (`shown` without stop strings) makes the next append copy it once."""
        emitted, self._emitted = self._emitted, ""
        emitted += piece
        self._emitted = emitted

    def _find_stop(self, searched_to: int) -> None:
        """Look for a stop string that ends after `searched_to` (an occurrence that ends before it was there
        before, or lay in the text of the first `min_tokens` tokens); of those found, the one that ends first
        (ties: the first in `stop`'s order) cuts the text."""
        best_end, best = None, None
        for stop in self._stop:
            position = self._emitted.find(stop, max(0, searched_to - len(stop) + 1))
            if position >= 0 and (best_end is None or position + len(stop) < best_end):
                best_end, best = position + len(stop), (position, stop)
        if best is not None:
            position, self.stop_reason = best
            self._stop_at = best_end if self._include_stop else position

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer.backend, token_id)
        except Exception as error:
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            _logger.warning("hybridcache: the incremental decoder lost its prefix at token %d; it starts afresh "
                            "(the text may differ from a full decode from here on)", token_id)
            if self._pending_output:
                self._append(self._pending_text())
            self._pending.clear()
            self._pending_output = False
            self._held_prompt = 0
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            return self._stream.step(self._tokenizer.backend, token_id)

    def shown(self, finished: bool) -> str:
        """`text` as an output shows it: until the completion is `finished` (or a stop string is found), without
        the bytes of a character not yet complete (no U+FFFD that a later token replaces, as vLLM's detokenizer)
        and without its last max(len(stop)) - 1 characters, so that the start of a stop string is never shown
        before the text is cut there (vLLM's stop buffer; none with `include_stop`). Stop ("END",): texts "ab E",
        "ab EN" show as "ab", "ab "; the final text "ab " follows each."""
        return self.shown_since(0, finished)

    def shown_since(self, start: int, finished: bool) -> str:
        """`shown(finished)[start:]`, copying only that part while the completion runs (a DELTA output's text;
        from 0, the text itself, not a copy, when nothing is held back)."""
        if finished or self._stop_at is not None:
            return self.text[start:]
        end = len(self._emitted)
        if self._stop and not self._include_stop:
            end = max(0, end - (max(map(len, self._stop)) - 1))
        return self._emitted[start:end]

    @property
    def text(self) -> str:
        if self._stop_at is not None:
            return self._emitted[: self._stop_at]
        if self._pending_output:
            return self._emitted + self._pending_text()
        return self._emitted

    def _pending_text(self) -> str:
        """The decode of the pending ids (the prompt's dangling bytes among them only where they combine)."""
        text = self._tokenizer.decode(self._pending, self._skip)
        if not self._held_prompt:
            return text
        return without_prompt_residue(text, self._tokenizer.decode(self._pending[self._held_prompt:], self._skip))
