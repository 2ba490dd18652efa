"""StopStringMatcher: text that could still become a stop string is held back, never emitted."""
from __future__ import annotations

from imp_jax.runtime.replies.stop import StopStringMatcher


def feed_all(m: StopStringMatcher, deltas: list[str]) -> tuple[list[str], str | None]:
    """Feed deltas until one matches; returns what was emitted per delta and the matched stop."""
    out = []
    for d in deltas:
        text, stop = m.feed(d)
        out.append(text)
        if stop is not None:
            return out, stop
    return out, None


def test_no_stops_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("Hello") == ("Hello", None)
    assert m.flush() == ""


def test_empty_stop_strings_are_ignored():
    m = StopStringMatcher(["", ""])
    assert m.feed("abc") == ("abc", None)


def test_partial_stop_is_held_back_until_it_matches():
    m = StopStringMatcher(["world!"])
    out, stop = feed_all(m, ["Hello wor", "ld", "!", " ignored"])
    assert out == ["Hello ", "", ""]
    assert stop == "world!"


def test_held_text_is_released_once_it_cannot_match():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", None)
    assert m.feed("O") == ("", None)
    assert m.feed("x") == ("STOx", None)
    assert m.flush() == ""


def test_stop_split_into_single_characters():
    m = StopStringMatcher(["</end>"])
    out, stop = feed_all(m, list("abc</en") + list("d>tail"))
    assert "".join(out) == "abc"
    assert stop == "</end>"


def test_text_after_the_stop_in_the_same_delta_is_dropped():
    m = StopStringMatcher(["\n\n"])
    assert m.feed("one\n\ntwo") == ("one", "\n\n")


def test_longest_partial_suffix_is_held():
    m = StopStringMatcher(["abcd"])
    assert m.feed("xabcab") == ("xabc", None)
    assert m.feed("cd") == ("", "abcd")


def test_overlapping_prefix_of_the_stop():
    m = StopStringMatcher(["aab"])
    out, stop = feed_all(m, list("aaab"))
    assert "".join(out) == "a"
    assert stop == "aab"


def test_multiple_stops_earliest_occurrence_wins():
    m = StopStringMatcher(["dog", "quick"])
    assert m.feed("the quick brown dog") == ("the ", "quick")


def test_multiple_stops_hold_back_for_any_of_them():
    m = StopStringMatcher(["Observation:", "###"])
    assert m.feed("answer #") == ("answer ", None)
    assert m.feed("# no") == ("## no", None)
    assert m.feed(" Obs") == (" ", None)
    assert m.feed("ervation: x") == ("", "Observation:")


def test_include_stop_emits_the_stop_string():
    m = StopStringMatcher(["END"], include_stop=True)
    out, stop = feed_all(m, ["done E", "N", "D and more"])
    assert "".join(out) == "done END"
    assert stop == "END"


def test_flush_returns_held_text_when_the_sequence_ends_otherwise():
    m = StopStringMatcher(["<|im_end|>"])
    assert m.feed("Paris.<|im") == ("Paris.", None)
    assert m.flush() == "<|im"
    assert m.flush() == ""
    assert m.feed("next") == ("next", None)  # nothing carried over after a flush
