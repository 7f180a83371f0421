"""What a streaming completion may send: never a partial UTF-8 character, never part of a stop string."""

from hybridcache.server.text_stream import TextStream


def test_holds_back_trailing_replacement_characters():
    stream = TextStream()
    assert stream.update("ab\ufffd", finished=False) == "ab"
    assert stream.update("ab\ufffd\ufffd", finished=False) == ""
    assert stream.update("abé", finished=False) == "é"
    assert stream.sent == "abé"


def test_invalid_bytes_followed_by_text_are_sent():
    stream = TextStream()
    assert stream.update("a\ufffd", finished=False) == "a"
    assert stream.update("a\ufffdb", finished=False) == "\ufffdb"


def test_holds_back_partial_stop_string_worked_example():
    stream = TextStream(("END",))
    sent = [stream.update(t, finished=False) for t in ("ab", "abE", "abEN", "abENx", "abENxE\ufffd")]
    assert sent == ["ab", "", "", "ENx", ""]
    assert stream.update("abENx", finished=True) == ""  # the engine cut the final text at "END"
    assert stream.sent == "abENx"


def test_final_text_flushes_everything_held():
    stream = TextStream(("xyz",))
    assert stream.update("hello x", finished=False) == "hello "
    assert stream.update("hello xy\ufffd", finished=True) == "xy\ufffd"


def test_longest_held_suffix_over_several_stop_strings():
    stream = TextStream(("xy", "cabd"))
    assert stream.update("zzca", finished=False) == "zz"  # "ca" starts "cabd"
    assert stream.update("zzcab", finished=False) == ""  # "cab" starts "cabd"
    assert stream.update("zzcabq", finished=False) == "cabq"
