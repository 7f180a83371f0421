"""Stop strings as vLLM's v1 engine applies them (`vllm/v1/engine/detokenizer.py`: `update`, `check_stop_strings`;
`vllm/v1/engine/output_processor.py`): `min_tokens`, several stop strings completed by one token, a stop token
decoded with `include_stop_str_in_output`, and the hold-back of a streamed text (`server/text_stream.py`)."""

from __future__ import annotations

import random
import sys
import time

import pytest

from hybridcache.detokenizer import detokenizer_for
from hybridcache.engine.output_processor import OutputProcessor
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.sampling import SamplingParams
from hybridcache.scheduler.sequence import Seq
from hybridcache.server.text_stream import TextStream
from hybridcache.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(ensure_builtin_model())


def vllm_check_stop_strings(output_text: str, new_char_count: int, stop: tuple[str, ...],
                            include: bool) -> tuple[str, int] | None:
    """vLLM's `check_stop_strings` (current main): of the stop strings found from `new_char_count + len(stop) - 1`
    characters before the end, the one that ends first, ties by list order; (stop, cut length or -1)."""
    if not new_char_count or not stop:
        return None
    best, best_index, best_end = None, 0, sys.maxsize
    for stop_str in stop:
        index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if index != -1 and index + len(stop_str) < best_end:
            best, best_index, best_end = stop_str, index, index + len(stop_str)
    if best is None:
        return None
    if include:
        return best, (-1 if best_end >= len(output_text) else best_end)
    return best, best_index


def vllm_texts(tokenizer: Tokenizer, ids: list[int], params: SamplingParams) -> list[tuple[str, str | None]]:
    """vLLM's detokenizer `update` one token at a time: (output_text, stop string) after each token, until a stop."""
    text, out = "", []
    for n in range(1, len(ids) + 1):
        before = tokenizer.decode(ids[: n - 1])
        new = tokenizer.decode(ids[:n])
        # (a full decode stands in for the stream: the texts here have no character split over tokens)
        check_offset = len(text)
        text += new[len(before):]
        if params.min_tokens and n <= params.min_tokens:
            check_offset = len(text)
        found = None
        if n > params.min_tokens:
            found = vllm_check_stop_strings(text, len(text) - check_offset, params.stop,
                                            params.include_stop_str_in_output)
        if found is not None:
            if found[1] != -1:
                text = text[: found[1]]
            out.append((text, found[0]))
            return out
        out.append((text, None))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_detokenizer_stops_where_vllm_does(tokenizer, seed):
    """Random texts over a small alphabet, random stop strings (some overlapping, some prefixes of others),
    `min_tokens` and `include_stop_str_in_output`: the text and stop string after every token equal vLLM's."""
    rng = random.Random(seed)
    checked = stopped = 0
    for _ in range(60):
        ids = tokenizer.encode("".join(rng.choice("ab\n:U ") for _ in range(24)))
        assert tokenizer.decode(ids) == "".join(tokenizer.decode([t]) for t in ids)  # no split character
        stop = tuple(dict.fromkeys("".join(rng.choice("ab\n:") for _ in range(rng.randint(1, 4)))
                                   for _ in range(rng.randint(1, 4))))
        params = SamplingParams(stop=stop, min_tokens=rng.choice([0, 0, 1, 2, 5]),
                                include_stop_str_in_output=rng.random() < 0.5)
        detokenizer = detokenizer_for(tokenizer, params)
        want = vllm_texts(tokenizer, ids, params)
        for i, (text, reason) in enumerate(want):
            assert detokenizer.add(ids[i]) == (reason is not None), (ids[: i + 1], params)
            assert (detokenizer.text, detokenizer.stop_reason) == (text, reason), (ids[: i + 1], params)
            checked += 1
        stopped += want[-1][1] is not None
    assert checked > 300 and stopped > 20


def test_a_stop_string_may_start_in_the_text_of_the_first_min_tokens_tokens(tokenizer):
    """vLLM: with min_tokens = 1 and stop "aa", tokens "a", "a" stop at the second (vLLM's `update` only moves its
    search start to the end of the min_tokens tokens' text; its search reaches len(stop) - 1 characters back
    from there). Before, a stop string could not start in that text: "a" then "aa" was cut only at the third
    "a" (text "a")."""
    a = tokenizer.encode("a")[0]
    detokenizer = detokenizer_for(tokenizer, SamplingParams(stop=("aa",), min_tokens=1))
    assert [detokenizer.add(a), detokenizer.add(a)] == [False, True]
    assert (detokenizer.text, detokenizer.stop_reason) == ("", "aa")


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Tokenizer:
    """Tokens of several characters each ("\\nUser: x" is one token), fused into the text as they are."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    folder = tmp_path_factory.mktemp("words")
    backend = Backend(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return Tokenizer(folder)


WORDS = ["<unk>", "Hi", "\nUser:", "\nUser: x", "x", "ab"]


@pytest.mark.parametrize("words, stop, include, text, reason", [
    (["Hi", "\nUser:"], ("User:", "\nUser:"), False, "Hi\n", "User:"),  # both end there: the first listed
    (["Hi", "\nUser:"], ("User:", "\nUser:"), True, "Hi\nUser:", "User:"),
    (["Hi", "\nUser:"], ("\nUser:", "User:"), False, "Hi", "\nUser:"),
    (["Hi", "\nUser: x"], ("\nUser: x", "User:"), False, "Hi\n", "User:"),  # "User:" ends first
    (["Hi", "\nUser: x"], ("\nUser: x", "User:"), True, "Hi\nUser:", "User:"),
    (["x", "ab"], ("b", "ab"), False, "xa", "b"),
])
def test_of_stop_strings_one_token_completes_the_one_that_ends_first_wins(word_tokenizer, words, stop, include,
                                                                         text, reason):
    """vLLM's `check_stop_strings`: of the stop strings one token completes, the one that ends first, ties by the
    stop list's order. Before, the one that started first won ("Hi\nUser: x" with ("User:", "\nUser:") gave
    "Hi", stop_reason "\nUser:"; vLLM gives "Hi\n", "User:")."""
    detokenizer = detokenizer_for(word_tokenizer, SamplingParams(stop=stop, include_stop_str_in_output=include))
    assert [detokenizer.add(WORDS.index(w)) for w in words] == [False, True]
    assert (detokenizer.text, detokenizer.stop_reason) == (text, reason)


def test_ties_at_one_character_go_to_the_stop_list_order(tokenizer):
    """Byte-level tokens: every stop string a token completes ends at its one character. "xab" with ("ab", "b")
    stops at "ab" (listed first), with ("b", "ab") at "b" (it was "ab", which starts first)."""
    for stop, text in ((("ab", "b"), "x"), (("b", "ab"), "xa")):
        detokenizer = detokenizer_for(tokenizer, SamplingParams(stop=stop))
        assert [detokenizer.add(tokenizer.encode(c)[0]) for c in "xab"] == [False, False, True]
        assert (detokenizer.text, detokenizer.stop_reason) == (text, stop[0])


def _accept_all(tokenizer: Tokenizer, ids: list[int], params: SamplingParams, eos: int):
    processor = OutputProcessor(tokenizer, None, frozenset({eos}), 10**6)
    prompt = tokenizer.encode("hello")
    seq = Seq(0, "r", 0, list(prompt), len(prompt), params.up_to(10**6 - len(prompt)), None, 0)
    state = processor.new_request("r", None, len(prompt), seq.params, [seq])
    reason = None
    for token in ids:
        seq.token_ids.append(token)
        reason = processor.accept(state, seq, token, None)
        if reason is not None:
            break
    return reason, state.texts[0].text, state.stop_reasons[0]


def test_a_stop_token_decoded_into_the_text_can_complete_a_stop_string(tokenizer):
    """vLLM decodes a stop token with include_stop_str_in_output and then checks stop strings: one its text
    completes is the `stop_reason` (it was the token id, or None for the EOS token)."""
    eos = tokenizer.eos_token_id
    eos_text = tokenizer.decode([eos], skip_special_tokens=False)
    params = SamplingParams(stop=[eos_text], include_stop_str_in_output=True, skip_special_tokens=False)
    assert _accept_all(tokenizer, [tokenizer.encode("a")[0], eos], params, eos) == ("stop", "a" + eos_text, eos_text)
    x = tokenizer.encode("x")[0]
    params = SamplingParams(stop=["x"], stop_token_ids=[x], include_stop_str_in_output=True)
    assert _accept_all(tokenizer, [tokenizer.encode("a")[0], x], params, eos) == ("stop", "ax", "x")
    # without include_stop_str_in_output the stop token is not decoded: its id is the reason
    params = SamplingParams(stop=["x"], stop_token_ids=[x])
    assert _accept_all(tokenizer, [tokenizer.encode("a")[0], x], params, eos) == ("stop", "a", x)
    # a stop token whose text completes no stop string keeps its id (None for EOS)
    params = SamplingParams(stop=["zz"], stop_token_ids=[x], include_stop_str_in_output=True)
    assert _accept_all(tokenizer, [tokenizer.encode("a")[0], x], params, eos) == ("stop", "ax", x)
    params = SamplingParams(stop=["zz"], include_stop_str_in_output=True, skip_special_tokens=False)
    assert _accept_all(tokenizer, [eos], params, eos) == ("stop", eos_text, None)


def _old_stable_prefix(stop: tuple[str, ...], text: str) -> str:
    """TextStream's rule, written the slow way: without its trailing U+FFFD and the longest suffix that is a proper
    prefix of a stop string."""
    text = text.rstrip("\ufffd")
    held = max((k for s in stop for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)
    return text[: len(text) - held]


@pytest.mark.parametrize("seed", range(4))
def test_a_text_stream_holds_back_what_it_did_before(seed):
    """Growing texts (sometimes rewritten: a U+FFFD replaced, a text that does not extend the last one): every
    update sends what the longest-suffix rule allows, and the sent text never goes back."""
    rng = random.Random(seed)
    for _ in range(40):
        stop = tuple("".join(rng.choice("aab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 3)))
        stream, text = TextStream(stop), ""
        for _ in range(30):
            roll = rng.random()
            if roll < 0.1 and text:
                text = text[: rng.randrange(len(text))]  # not an extension of the last text
            elif roll < 0.2:
                text += "\ufffd"
            else:
                text = text.rstrip("\ufffd") + "".join(rng.choice("abc") for _ in range(rng.randint(0, 3)))
            sent_before = stream.sent
            stable = _old_stable_prefix(stream.stop, text)
            delta = stream.update(text, finished=False)
            if stable.startswith(sent_before) and len(stable) > len(sent_before):
                assert (delta, stream.sent) == (stable[len(sent_before):], stable), (stop, text)
            else:
                assert (delta, stream.sent) == ("", sent_before), (stop, text)


def test_a_text_stream_update_costs_what_its_new_characters_cost():
    """A 30,000-character stop string and a text growing 30 characters at a time to 30,000 that ends in no prefix
    of it: each update used to slice and compare every prefix of the stop string up to the text's length
    (O(len(text)^2) per update: about 6 s in all); now it reads the 30 new characters."""
    stop = "x" * 30_000
    text = "ab" * 15_000
    stream = TextStream((stop,))
    start = time.perf_counter()
    for end in range(30, 30_001, 30):
        assert stream.update(text[:end], finished=False) == text[end - 30: end]
    assert time.perf_counter() - start < 1.0
    long_prefix = TextStream(("ab" * 20_000,))  # all of the text may begin the stop string: all held back
    assert all(long_prefix.update(text[:end], finished=False) == "" for end in range(30, 30_001, 30))
    assert long_prefix.update(text + "c", finished=False) == text + "c"
