"""vLLM's `stop_reason` of a finished choice: the stop string or stop token id that ended it, else None (an EOS
token, `length`, `abort`, a completed grammar). The engine reports only `finish_reason`; which stop matched is
recovered here from the choice's text and tokens:

    stop token   the last token id is one of `stop_token_ids`
    stop string  with `include_stop_str_in_output` the text ends with it; without, the text was cut just before
                 it, so the decode of all the choice's tokens goes on from the text with it (of several stop
                 strings that start there, the first in `stop`'s order, as the detokenizer picks)

Worked example: stop ("xx",), tokens decoding to "abxxc" -> text "ab", stop_reason "xx".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridcache.outputs import CompletionOutput
from hybridcache.sampling import SamplingParams


@dataclass(frozen=True)
class StopRule:
    """The stop conditions of a request's choices (from its `SamplingParams`)."""

    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @classmethod
    def of(cls, params: SamplingParams) -> StopRule:
        return cls(tuple(params.stop), tuple(params.stop_token_ids), params.include_stop_str_in_output,
                   params.skip_special_tokens)

    def reason(self, c: CompletionOutput, tokenizer: Any) -> str | int | None:
        """`c`'s stop_reason (None while it runs or when no stop string or stop token ended it); `tokenizer`
        decodes its tokens when a stop string may have."""
        if c.finish_reason != "stop" or not c.token_ids:
            return None
        if c.token_ids[-1] in self.stop_token_ids:
            return c.token_ids[-1]
        if not self.stop:
            return None
        if self.include_stop_str_in_output:
            # the stop found first starts earliest: the longest one the text ends with
            return max((s for s in self.stop if c.text.endswith(s)), key=len, default=None)
        full = tokenizer.decode(c.token_ids, skip_special_tokens=self.skip_special_tokens)
        if not full.startswith(c.text):
            return None
        rest = full[len(c.text):]
        return next((s for s in self.stop if rest.startswith(s)), None)
