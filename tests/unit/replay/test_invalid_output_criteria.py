"""The criteria bench/edge_invalid_output.py judges served text by: repeated 4-grams and compressibility."""

from __future__ import annotations

from bench.edge_invalid_output import judge

SOUND = (
    "Boiling water for one minute kills most germs. At altitudes above about two thousand metres, "
    "boil it for three minutes instead, because water boils at a lower temperature there. Let it cool "
    "in a clean, covered container before you drink it, and store it somewhere cool and dark."
)
LOOP = "He was a pirate who had a penchant for getting into trouble. " * 8


def test_a_sound_answer_is_valid() -> None:
    verdict = judge(SOUND)
    assert verdict["rep4"] == 0.0 and verdict["compression"] is not None and verdict["compression"] < 2.4
    assert verdict["invalid"] is False


def test_a_looping_answer_is_invalid_by_both_criteria() -> None:
    verdict = judge(LOOP)
    assert verdict["rep4"] > 0.5 and verdict["compression"] > 2.4
    assert verdict["invalid_rep4"] and verdict["invalid_compression"] and verdict["invalid"]


def test_a_short_answer_is_not_judged_by_compression() -> None:
    verdict = judge("Paris.")
    assert verdict["compression"] is None and verdict["invalid"] is False
