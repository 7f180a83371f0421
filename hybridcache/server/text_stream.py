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

Cost: a Knuth-Morris-Pratt matcher per stop string finds the held-back suffix. It reads only the characters a
text adds to the last one (at most max(len(stop)) - 1 of them), so an update costs O(min(new characters,
len(stop))); slicing and comparing every prefix of every stop string cost O(len(stop)^2) per update before (76 ms
for a 60,000-character stop string).
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class _SuffixMatcher:
    """The longest suffix of a text read a character at a time that is a proper prefix of `stop`
    (Knuth-Morris-Pratt: `_border[q]` is the length of the longest proper prefix of stop[:q + 1] that is also its
    suffix). `feed` costs O(1) amortized per character."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self._border = [0] * len(stop)
        k = 0
        for q in range(1, len(stop)):
            while k and stop[q] != stop[k]:
                k = self._border[k - 1]
            if stop[q] == stop[k]:
                k += 1
            self._border[q] = k
        self.matched = 0  # the longest suffix of the text read that is a prefix of stop (all of it: a match)

    def feed(self, text: str) -> None:
        stop, border, q = self.stop, self._border, self.matched
        for char in text:
            if q == len(stop):
                q = border[q - 1]
            while q and stop[q] != char:
                q = border[q - 1]
            if stop[q] == char:
                q += 1
        self.matched = q

    @property
    def held(self) -> int:
        """The length of the longest suffix of the text read that is a proper prefix of stop."""
        return self._border[-1] if self.matched == len(self.stop) else self.matched


class TextStream:
    """Tracks what has been sent of one completion; `update` returns the next safe piece (maybe "")."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self.sent = ""
        self._matchers = [_SuffixMatcher(s) for s in self.stop]
        self._longest = max(map(len, self.stop), default=0)
        self._read = ""  # the text the matchers have read (the last update's, without its trailing U+FFFD)

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
        if not self._matchers:
            return text
        start = len(self._read) if text.startswith(self._read) else 0  # usually the text grew: read what is new
        if start == 0 or len(text) - start >= self._longest:  # read afresh only what can hold a stop's prefix
            start = max(0, len(text) - self._longest + 1)
            for matcher in self._matchers:
                matcher.matched = 0
        for matcher in self._matchers:
            matcher.feed(text[start:])
        self._read = text
        return text[: len(text) - max(matcher.held for matcher in self._matchers)]
