from __future__ import annotations

from mlxcel_plugin.text import StopStringMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = []
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_no_stops_passes_everything() -> None:
    assert StopStringMatcher([]).feed("abc") == ("abc", False)


def test_cut_before_stop_in_one_piece() -> None:
    assert run(["END"], ["hello END world"]) == ("hello ", True)


def test_stop_split_across_pieces() -> None:
    assert run(["###"], ["a#", "#", "#b"]) == ("a", True)


def test_partial_match_is_held_then_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ab ST") == ("ab ", False)
    assert matcher.feed("AY") == ("STAY", False)


def test_held_partial_released_at_end() -> None:
    assert run(["STOP"], ["x", "ST"]) == ("xST", False)


def test_earliest_of_several_stops_wins() -> None:
    assert run(["world", "lo w"], ["hello world"]) == ("hel", True)


def test_stop_at_very_start() -> None:
    assert run(["\n"], ["\nabc"]) == ("", True)


def test_empty_stop_strings_ignored() -> None:
    assert run([""], ["abc"]) == ("abc", False)


def test_the_matched_stop_string_is_named() -> None:
    matcher = StopStringMatcher(["world", "lo w", "xyz"])
    assert matcher.matched is None
    assert matcher.feed("he") == ("he", False)
    assert matcher.matched is None
    assert matcher.feed("llo world") == ("l", True)
    assert matcher.matched == "lo w"  # the earliest in the text, not the first listed


def test_a_stop_split_across_pieces_is_named() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("a#") == ("a", False)
    assert matcher.feed("##b") == ("", True) and matcher.matched == "###"
