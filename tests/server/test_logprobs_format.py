"""The OpenAI logprobs shapes built from engine entries, against vLLM's conventions."""

from hybridcache.sampling import Logprob
from hybridcache.server.logprobs_format import completion_logprobs


def test_completion_top_logprobs_keep_the_later_of_two_tokens_that_decode_alike():
    # Tokens 5 and 9 both decode to " a" (e.g. two byte-fallback tokens that show as U+FFFD alike): vLLM builds the
    # dict with a comprehension over the entry (sampled token first, then best first), so the later one's value
    # stays under the shared key.
    entry = {5: Logprob(-0.5, 1, " a"), 9: Logprob(-1.5, 2, " a"), 7: Logprob(-2.0, 3, " b")}
    out = completion_logprobs([5], [entry])
    assert out["tokens"] == [" a"]
    assert out["token_logprobs"] == [-0.5]
    assert out["top_logprobs"] == [{" a": -1.5, " b": -2.0}]
    assert list(out["top_logprobs"][0]) == [" a", " b"]


def test_completion_top_logprobs_name_tokens_by_id_when_asked():
    entry = {5: Logprob(-0.5, 1, " a"), 9: Logprob(-1.5, 2, " a")}
    out = completion_logprobs([5], [entry], as_ids=True)
    assert out["top_logprobs"] == [{"token_id:5": -0.5, "token_id:9": -1.5}]
    assert out["text_offset"] == [0]
