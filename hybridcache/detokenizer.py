"""The text of one completion, decoded as its tokens arrive, and where a stop string ends it.

`detokenizer_for(tokenizer, params)` picks the decoder of a completion: an `IncrementalDetokenizer`, or for a text
read only at the end with no stop strings to watch a `DeferredDetokenizer` (one decode when read). Stop strings
follow vLLM: none is looked for before the completion has more than `min_tokens` tokens, and none may start in
the text of its first `min_tokens` tokens.
"""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from hybridcache.sampling import SamplingParams
from hybridcache.tokenizer import Tokenizer

_logger = logging.getLogger("hybridcache.detokenizer")
_INVALID_PREFIX = "Invalid prefix"  # tokenizers' DecodeStream, when a decoder rewrote text it already returned


def detokenizer_for(tokenizer: Tokenizer, params: SamplingParams, *, deferred: bool = False
                    ) -> IncrementalDetokenizer | DeferredDetokenizer:
    """A fresh decoder of one completion of a request with `params` (its stop strings, `min_tokens`,
    `skip_special_tokens`, `include_stop_str_in_output`). `deferred`: the text is read only at the end."""
    if deferred and not params.stop:
        return DeferredDetokenizer(tokenizer, params.skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens,
                                  include_stop=params.include_stop_str_in_output, min_tokens=params.min_tokens)


class DeferredDetokenizer:
    """`IncrementalDetokenizer`'s contract with no stop strings, at no cost per token: `add` only keeps the id and
    `text` decodes all of them once (the engine uses it for `final_only` requests, whose text is read when they
    finish: one decode of n tokens instead of n incremental steps in every decode step's host time)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
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
            self._text = self._tokenizer.decode(self._ids, self._skip)
        return self._text

    def shown(self, finished: bool) -> str:
        """`text` (no stop strings: nothing is held back)."""
        return self.text


class IncrementalDetokenizer:
    """The text of one growing completion, decoded a token at a time with tokenizers' `DecodeStream`.

    Contract: after `add(t)` for each token of `ids`, `text` equals `Tokenizer.decode(ids, skip_special_tokens)`
    cut before the first occurrence of any `stop` string (after it with `include_stop`; of the stop strings
    found at that position, the first in `stop`'s order), and `stop_reason` is that stop string (None before).
    Stop strings are looked for only once more than `min_tokens` tokens were added, and only from the end of the
    text the first `min_tokens` tokens completed (vLLM's rule). A token costs a decode of the few tokens since the
    last complete character, and the stop search looks only at the characters that can complete a stop string, so
    n tokens cost O(n), not O(n^2).

    Tokens whose bytes do not yet form a complete character are `pending`: `DecodeStream` returns nothing for
    them, and `text` appends their own decode (U+FFFD replacement characters), as a full decode would. Worked
    example (byte-level tokens, stop = ("END",))::

        add("a")   text "a"
        add(0xE2)  text "a\\ufffd"      (pending: the first byte of a 3-byte character)
        add(0x82)  text "a\\ufffd\\ufffd"
        add(0xAC)  text "a€"           (complete: the stream emits "€")
        add("E"), add("N"), add("D") -> the last returns True; text "a€" from then on

    With min_tokens = 2 and stop = ("a",), tokens "a", "a", "a": the first two are never searched (and an "a"
    in their text never matches), the third returns True; text "aa".

    Decoders that rewrite text they already returned (byte fallback, Metaspace) can make `DecodeStream` fail with
    "Invalid prefix"; the stream then starts afresh at the token (as vLLM does), and `text` may differ from a full
    decode from there on (the pending tokens' replacement characters are kept).
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), *, skip_special_tokens: bool = True,
                 include_stop: bool = False, min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._search_from = 0  # no stop string starts before: the end of the first min_tokens tokens' text
        self._emitted = ""
        self._pending: list[int] = []
        self._stop_at: int | None = None
        self.stop_reason: str | None = None  # the stop string found, once one is

    def add(self, token_id: int) -> bool:
        """Decode one more token; True when the text now contains a stop string (it is then cut there)."""
        self._num_tokens += 1
        piece = self._step(token_id)
        if piece is None:
            self._pending.append(token_id)
        else:
            self._pending.clear()
        searched_to = len(self._emitted)
        self._emitted += piece or ""
        if self._num_tokens <= self._min_tokens:
            self._search_from = len(self._emitted)
            return False
        if piece:
            cuts = []
            for stop in self._stop:  # an occurrence not found before must end inside the new piece
                position = self._emitted.find(stop, max(self._search_from, searched_to - len(stop) + 1))
                if position >= 0:
                    cuts.append((position, position + len(stop) if self._include_stop else position, stop))
            if cuts and self._stop_at is None:
                _, self._stop_at, self.stop_reason = min(cuts, key=lambda cut: cut[0])
        return self._stop_at is not None

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer.backend, token_id)
        except Exception as error:
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            _logger.warning("hybridcache: the incremental decoder lost its prefix at token %d; it starts afresh "
                            "(the text may differ from a full decode from here on)", token_id)
            if self._pending:
                self._emitted += self._tokenizer.decode(self._pending, self._skip)
                self._pending.clear()
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            return self._stream.step(self._tokenizer.backend, token_id)

    def shown(self, finished: bool) -> str:
        """`text` as an output shows it: until the completion is `finished` (or a stop string is found), without
        the bytes of a character not yet complete (no U+FFFD that a later token replaces, as vLLM's detokenizer)
        and without its last max(len(stop)) - 1 characters, so that the start of a stop string is never shown
        before the text is cut there (vLLM's stop buffer; none with `include_stop`). Stop ("END",): texts "ab E",
        "ab EN" show as "ab", "ab "; the final text "ab " follows each."""
        if finished or self._stop_at is not None:
            return self.text
        text = self._emitted
        if self._include_stop or not self._stop:
            return text
        return text[: max(0, len(text) - (max(map(len, self._stop)) - 1))]

    @property
    def text(self) -> str:
        if self._stop_at is not None:
            return self._emitted[: self._stop_at]
        if self._pending:
            return self._emitted + self._tokenizer.decode(self._pending, self._skip)
        return self._emitted
