"""Incremental detokenization: at every token, the text equals a full decode, cut before the first stop
string (what the engine computed before it decoded incrementally)."""

from __future__ import annotations

import random

import pytest

from hybridcache.detokenizer import detokenizer_for
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.sampling import SamplingParams
from hybridcache.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(ensure_builtin_model())


def reference(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...], include: bool = False
              ) -> tuple[str, bool]:
    """The text of `ids` cut at the stop string the last of them completed (none completed before: the caller
    stops there): of those found, the one that ends first, ties by the stop list's order (vLLM's
    `check_stop_strings`; it was the one that starts first)."""
    text = tokenizer.decode(ids)
    found = [(text.find(s) + len(s), i, s) for i, s in enumerate(stop) if s in text]
    if not found:
        return text, False
    end, _, first = min(found)
    return text[: end if include else end - len(first)], True


@pytest.mark.parametrize("skip_special", [True, False], ids=["skip-special", "keep-special"])
@pytest.mark.parametrize("deferred", [False, True], ids=["incremental", "deferred"])
@pytest.mark.parametrize("seed", range(4))
def test_text_equals_a_full_decode_at_every_token(tokenizer, seed, deferred, skip_special):
    rng = random.Random(seed)
    # random ids: many partial characters, and the tokenizer's special tokens among them
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    specials = set(tokenizer.hf.all_special_ids)
    assert specials & set(ids)
    text = detokenizer_for(tokenizer, SamplingParams(skip_special_tokens=skip_special), deferred=deferred)
    for i, token in enumerate(ids):
        assert not text.add(token)
        assert text.text == tokenizer.decode(ids[: i + 1], skip_special_tokens=skip_special), i


@pytest.mark.parametrize("include", [False, True], ids=["cut-before", "include-stop"])
def test_stop_strings_cut_where_a_full_decode_finds_them_first(tokenizer, include):
    """Cut before the first stop string found, or after it with `include_stop` (include_stop_str_in_output)."""
    rng = random.Random(7)
    words = ["alpha ", "beta ", "gamma ", "END", "EN", "D ", "ünï ", "€ "]
    checked = 0
    for _ in range(30):
        ids = tokenizer.encode("".join(rng.choice(words) for _ in range(12)))
        stop = ("END", "ta g", "€", "EN")
        text = detokenizer_for(tokenizer, SamplingParams(stop=stop, include_stop_str_in_output=include))
        for i, token in enumerate(ids):
            stopped = text.add(token)
            want, want_stopped = reference(tokenizer, ids[: i + 1], stop, include)
            assert (text.text, stopped) == (want, want_stopped), (ids[: i + 1], stop)
            checked += 1
            if stopped:
                break
    assert checked > 30


def test_stop_strings_wait_for_min_tokens_and_may_start_in_their_text(tokenizer):
    """vLLM's rule: no stop string is looked for until the completion has more than `min_tokens` tokens; then one
    that starts in the text of those tokens and ends after it counts (vLLM's `update` only moves its search
    start; this test asserted before that none may start there: "abab" stopped at its second "ab")."""
    a = tokenizer.encode("a")
    assert len(a) == 1
    text = detokenizer_for(tokenizer, SamplingParams(stop=("a", "aa"), min_tokens=2))
    assert [text.add(a[0]) for _ in range(3)] == [False, False, True]
    assert (text.text, text.stop_reason) == ("aa", "a")  # both end at the third "a": "a" is listed first
    text = detokenizer_for(tokenizer, SamplingParams(stop=("ab",), min_tokens=1))  # "a" is min_tokens' text
    assert [text.add(t) for t in tokenizer.encode("ab")] == [False, True]
    assert text.text == ""


def test_a_decoder_that_loses_its_prefix_starts_afresh(tmp_path):
    """A byte-fallback decoder rewrites "r" into two replacement characters when an invalid byte follows it, which
    tokenizers' DecodeStream reports as an invalid prefix: the detokenizer starts a fresh stream (vLLM's remedy)
    instead of raising out of the engine's step."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "p": 257}
    backend = Backend(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    ids = [1 + 0x72, 1 + 0x9B, 257]  # "r", an invalid continuation byte, "p"
    text = detokenizer_for(Tokenizer(tmp_path), SamplingParams(stop=("zz",)))
    assert [text.add(t) for t in ids] == [False, False, False]
    assert text.text.endswith("p") and len(text.text) >= 2


@pytest.mark.parametrize("stop, include, text, wanted", [
    (("b", "ab"), True, "zab", "b"),  # both end at "b": the first listed (vLLM's; was "ab", which starts first)
    (("xx",), False, "ab", "xx"),
    (("yy",), False, "abxxc", None),
])
def test_stop_reason_is_the_stop_string_that_cut_the_text(tokenizer, stop, include, text, wanted):
    """vLLM's `stop_reason` comes from the detokenizer, which knows which stop string it cut at (the server
    recovered it from the finished text before)."""
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    detokenizer = detokenizer_for(tokenizer, params)
    for char in "zabxxc" if include else "abxxc":
        if detokenizer.add(tokenizer.encode(char)[0]):
            break
    assert (detokenizer.text, detokenizer.stop_reason) == (text, wanted)



@pytest.mark.parametrize("include", [False, True], ids=["cut-before", "include-stop"])
def test_a_streaming_text_holds_back_what_may_begin_a_stop_string(tokenizer, include):
    """`shown(finished=False)`: the text without its last max(len(stop)) - 1 characters (vLLM's stop buffer; none
    with include_stop_str_in_output), so every text shown while the completion runs is a prefix of its final
    text. Before, "ab E" and "ab EN" showed and the final text was "ab "."""
    shown = _shown_while_running(tokenizer, "ab ENDxyz", SamplingParams(stop=("END", "Q"),
                                                                     include_stop_str_in_output=include))
    final = shown[-1]
    assert final == ("ab END" if include else "ab ")
    assert all(final.startswith(s) for s in shown), shown
    if not include:
        assert shown[:-1] == ["", "", "a", "ab", "ab "][: len(shown) - 1]


@pytest.mark.parametrize("stop", [(), ("\u00e9",)], ids=["no-stop", "stop-at-the-split-character"])
def test_a_streaming_text_never_shows_the_bytes_of_a_character_not_yet_complete(tokenizer, stop):
    """"ab\u00e9cd" with a byte tokenizer: the first byte of "\u00e9" decodes to U+FFFD until the second comes.
    Shown while running, that U+FFFD was later replaced ("ab\ufffd", then "ab\u00e9"), or with the stop string
    "\u00e9" cut away ("ab\ufffd", then "ab"): a consumer of deltas kept U+FFFD and lost the character."""
    shown = _shown_while_running(tokenizer, "ab\u00e9cd", SamplingParams(stop=stop))
    final = shown[-1]
    assert final == ("ab" if stop else "ab\u00e9cd")
    assert all(final.startswith(s) and "\ufffd" not in s for s in shown), shown


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(stop=("END", "\u00e9", "ta g")),
                                    SamplingParams(stop=("END",), include_stop_str_in_output=True)],
                         ids=["no-stop", "stops", "include-stop"])
def test_shown_since_gives_the_pieces_that_add_up_to_each_shown_text(tokenizer, params):
    """A DELTA output's text (`shown_since(start, finished)`: only the part after `start`) is `shown(finished)`
    from `start`, and the pieces add up to every shown text and to the final one: random bytes (characters left
    incomplete) and words that spell stop strings."""
    rng = random.Random(3)
    words = ["alpha ", "beta ", "gamma ", "END", "EN", "D ", "\u00fcn\u00ef ", "\u20ac ", "caf\u00e9 "]
    for trial in range(24):
        ids = (tokenizer.encode("".join(rng.choice(words) for _ in range(14))) if trial % 2
               else [rng.randrange(3, 259) for _ in range(60)])
        detokenizer = detokenizer_for(tokenizer, params)
        pieces = []
        for i, token in enumerate(ids):
            finished = detokenizer.add(token) or i == len(ids) - 1
            sent = "".join(pieces)
            pieces.append(detokenizer.shown_since(len(sent), finished))
            assert sent + pieces[-1] == detokenizer.shown(finished), (trial, i)
            if finished:
                break
        assert "".join(pieces) == detokenizer.text


def _shown_while_running(tokenizer: Tokenizer, text: str, params: SamplingParams) -> list[str]:
    """What an output shows after each token of `text` (the last one: the final text, where a stop cut it or at
    the end)."""
    detokenizer = detokenizer_for(tokenizer, params)
    ids = tokenizer.encode(text)
    shown = []
    for i, token in enumerate(ids):
        stopped = detokenizer.add(token)
        shown.append(detokenizer.shown(finished=stopped or i == len(ids) - 1))
        if stopped:
            break
    return shown


def test_engine_outputs_while_running_are_prefixes_of_the_final_text():
    """`LLMEngine.step`'s outputs (the offline streaming API): a greedy completion on the built-in model, with a
    stop string taken from its own text, shows at every step a prefix of the text it ends with."""
    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine

    engine = LLMEngine(None, EngineConfig(block_size=16, max_model_len=256, max_num_seqs=2))
    engine.add_request("free", "hello there", SamplingParams(temperature=0, max_tokens=40))
    free = _texts(engine)[-1]
    # the first 3 whole characters (no replacement character of a byte not yet complete) not seen before them
    at = next(i for i in range(4, len(free) - 3) if "\ufffd" not in free[i: i + 3] and free.find(free[i: i + 3]) == i)
    stop = free[at: at + 3]
    engine.add_request("r", "hello there", SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    texts = _texts(engine)
    assert texts[-1] == free[:at] and len(texts) > 4
    assert all(texts[-1].startswith(t) for t in texts), texts


def _texts(engine) -> list[str]:
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    return texts
