"""Loop and low-confidence detection: the pure detectors here, the engine in test_confidence.py."""

from __future__ import annotations

from edge_engine.degeneration import MIN_SPAN, LoopDetector, LowConfidenceRun


def _first_loop(tokens: list[int], detector: LoopDetector | None = None) -> tuple[int, int]:
    """(index of the token that completed a loop, its period), or (-1, 0)."""
    d = detector or LoopDetector()
    for i, t in enumerate(tokens):
        if p := d.push(t):
            return i, p
    return -1, 0


def test_a_sentence_repeated_three_times_is_a_loop_of_its_length() -> None:
    sentence = list(range(100, 113))  # 13 tokens
    at, period = _first_loop([1, 2, 3] + sentence * 5)
    assert period == 13
    assert at == 3 + 3 * 13 - 1  # the last token of the third copy
    refrain = list(range(200, 208))  # 8 tokens: three times is not yet a loop, four is
    assert _first_loop(list(range(50)) + refrain * 3 + list(range(300, 340))) == (-1, 0)
    assert _first_loop(list(range(50)) + refrain * 4)[1] == 8


def test_short_periods_need_min_span_tokens() -> None:
    at, period = _first_loop([7, 8] * 40)
    assert period == 2 and at == MIN_SPAN - 1
    at, period = _first_loop([5] * 40)
    assert period == 1 and at == MIN_SPAN - 1


def test_two_copies_and_ordinary_text_are_not_loops() -> None:
    sentence = list(range(100, 112))
    assert _first_loop([1] + sentence * 2 + list(range(200, 240))) == (-1, 0)
    assert _first_loop(list(range(500))) == (-1, 0)
    # a common token recurring at varying distances
    assert _first_loop([x for i in range(60) for x in (0, 1000 + i)]) == (-1, 0)


def test_periods_beyond_the_maximum_are_not_seen() -> None:
    long_sentence = list(range(100, 140))  # 40 tokens
    assert _first_loop(long_sentence * 4, LoopDetector(max_period=32)) == (-1, 0)
    assert _first_loop(long_sentence * 4, LoopDetector(max_period=40))[1] == 40


def test_repeating_counts_the_tokens_to_hold_and_repeats_what_to_drop() -> None:
    d = LoopDetector()
    for t in [9, 1, 2, 3, 1, 2]:
        d.push(t)
    assert d.repeating == 2  # "1 2" repeats the "1 2" three places before
    for t in [3, 1, 2] * 20:
        period = d.push(t)
        if period:
            break
    assert period == 3
    assert d.repeats(3) == d.repeating == MIN_SPAN - 3  # all but the first copy
    d.push(42)
    assert d.repeating == 0


def test_low_confidence_run_needs_consecutive_low_tokens() -> None:
    run = LowConfidenceRun(length=3, threshold=-4.0)
    assert [run.push(x) for x in (-5.0, -6.0, -0.1, -5.0, -4.5, -9.0)] == [False, False, False, False, False, True]
    off = LowConfidenceRun(length=0, threshold=-4.0)
    assert not any(off.push(-10.0) for _ in range(50))
