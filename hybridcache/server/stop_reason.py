"""vLLM's `stop_reason` of a finished choice: the stop string or stop token id that ended it, else None (the
tokenizer's EOS token, `length`, `abort`, a completed grammar). The engine reports only `finish_reason`; which stop
matched is recovered here from the choice's text and tokens:

    EOS          the last token id is the tokenizer's EOS id (and the request does not ignore EOS): None, even
                 when the client lists that id in `stop_token_ids` (vLLM's scheduler checks EOS first)
    stop token   the last token id is one of `stop_token_ids`, which holds, as vLLM's
                 `SamplingParams.update_from_generation_config` makes it, the model's other EOS ids too
                 (generation_config.json's, unless the request ignores EOS): a stop on one of them names it
    stop string  with `include_stop_str_in_output` the text ends with it; without, the text was cut just before
                 it, so the decode of all the choice's tokens goes on from the text with it (of several stop
                 strings that start there, the first in `stop`'s order, as the detokenizer picks)

Worked examples: stop ("xx",), tokens decoding to "abxxc" -> text "ab", stop_reason "xx". A Qwen3 folder (the
tokenizer's EOS <|im_end|>, generation_config.json's EOS ids <|im_end|> and <|endoftext|>): a choice that ends on
<|im_end|> -> null, with `stop_token_ids` listing it or not; one that ends on <|endoftext|> -> its id.
"""

from __future__ import annotations

from collections.abc import Iterable
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
    eos_token_id: int | None = None  # a stop on it has no stop_reason; None: none is special

    @classmethod
    def of(cls, params: SamplingParams, eos_token_ids: Iterable[int] = (),
           primary_eos_token_id: int | None = None) -> StopRule:
        """The rule of a request with `params` on a model that stops on `eos_token_ids`, of which
        `primary_eos_token_id` is the tokenizer's (see the module docstring)."""
        stop_token_ids = tuple(params.stop_token_ids)
        eos_token_id = None if params.ignore_eos else primary_eos_token_id
        if not params.ignore_eos:
            stop_token_ids += tuple(sorted(set(eos_token_ids) - {primary_eos_token_id} - set(stop_token_ids)))
        return cls(tuple(params.stop), stop_token_ids, params.include_stop_str_in_output,
                   params.skip_special_tokens, eos_token_id)

    def reason(self, c: CompletionOutput, tokenizer: Any) -> str | int | None:
        """`c`'s stop_reason (None while it runs or when no stop string or stop token ended it); `tokenizer`
        decodes its tokens when a stop string may have."""
        if c.finish_reason != "stop" or not c.token_ids or c.token_ids[-1] == self.eos_token_id:
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
