"""Which part of a completion's growing text is safe to send while it streams.

The engine hands back the whole decoded text so far at every step. Two things at its end may still change:

- an incomplete UTF-8 sequence decodes to U+FFFD replacement characters that turn into one real character
  once the rest of its bytes arrive (the built-in byte-level model makes that common);
- a partial stop string: if the completion goes on to spell out a stop string, the engine cuts the final
  text before it, so its first characters must never have been sent.

So a streaming completion holds back its trailing U+FFFD characters and then the longest suffix that is a
proper prefix of a stop string. Worked example, stop = ("END",)::

    step text        stable        held back  sent so far
    "ab"             "ab"          ""         "ab"
    "abE"            "abE"         "E"        "ab"
    "abEN"           "abEN"        "EN"       "ab"
    "abENx"          "abENx"       ""         "abENx"      (not a stop string after all)
    "abENxE\ufffd"   "abENxE"      "E"        "abENx"
    final "abENx"    (the engine found "END" and cut there)  "abENx": nothing more to send

Claim: the sent text is always a prefix of the final text. The final text is cut at the first occurrence of
a stop string, which was not complete in the previous step's text; so it starts inside that text's held-back
suffix or after it.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class TextStream:
    """Tracks what has been sent of one completion; `update` returns the next safe piece (maybe "")."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self.sent = ""

    def update(self, text: str, finished: bool) -> str:
        """`text`: the whole text so far; `finished`: it is final (then everything not sent yet goes)."""
        stable = text if finished else self._stable_prefix(text)
        if len(stable) <= len(self.sent) or not stable.startswith(self.sent):
            return ""
        delta = stable[len(self.sent):]
        self.sent = stable
        return delta

    def _stable_prefix(self, text: str) -> str:
        text = text.rstrip(_REPLACEMENT)
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return text[: len(text) - held]
