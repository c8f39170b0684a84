"""Checkers: tolerant of harmless formatting, strict on content, one positive and negative set per kind."""

from __future__ import annotations

import pytest

from policies.edge_quality.checkers import chosen_options, is_correct, numbers
from policies.edge_quality.probes import Probe


def probe(check: str, answer: str, **kw: object) -> Probe:
    return Probe(id="t", family="f", task="t", level=1, split="calibration", prompt="?", check=check, answer=answer, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("12", True),
        ("The answer is 12.", True),
        ("To add 7 and 5: 7 + 5 = 12.", True),
        ("7 + 5 equals twelve", True),
        ("**12**", True),
        ("The answer is 13.", False),
        ("12 + 1 = 13", False),
        ("I don't know.", False),
    ],
)
def test_number_last(text: str, ok: bool) -> None:
    assert is_correct(probe("number_last", "12"), text) is ok


def test_number_last_thousands_separator() -> None:
    p = probe("number_last", "7006652")
    assert is_correct(p, "1234 * 5678 = 7,006,652.")
    assert not is_correct(p, "1234 * 5678 = 7,006,653.")


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("Paris", True),
        ("The capital of France is Paris.", True),
        ("paris!", True),
        ("The capital of France is Lyon.", False),
        ("Parisian cafés are famous.", False),
    ],
)
def test_mention(text: str, ok: bool) -> None:
    assert is_correct(probe("mention", "Paris"), text) is ok


def test_mention_aliases_accents_and_distractors() -> None:
    assert is_correct(probe("mention", "Brasilia"), "Brasília is the capital.")
    assert is_correct(probe("mention", "Kyiv", aliases=("Kiev",)), "It is Kiev.")
    extraction = probe("mention", "Maria Lopez", distractors=("Tom Becker",))
    assert is_correct(extraction, "Maria Lopez bought them.")
    assert not is_correct(extraction, "Maria Lopez and Tom Becker.")
    number = probe("mention", "14", distractors=("23",))
    assert is_correct(number, "She bought 14 apples.")
    assert not is_correct(number, "14 apples for 23 dollars.")
    assert not is_correct(number, "140 apples")


def test_number_in_text() -> None:
    p = Probe(id="t", family="extraction", task="count", level=1, split="calibration",
              prompt="Ravi bought 6 tickets in Oslo on May 11. How many tickets?", check="number_in_text", answer="6")
    assert is_correct(p, "6")
    assert is_correct(p, "Ravi bought 6 tickets in Oslo on May 11, 2022.")
    assert not is_correct(p, "Ravi ordered 6 tickets, which is 6 x 3 = 18 tickets.")
    assert not is_correct(p, "11")


def test_unfinished_answers_are_wrong() -> None:
    p = probe("mention", "Paris")
    assert is_correct(p, "Paris", "stop")
    for reason in ("length", "loop", "low_confidence"):
        assert not is_correct(p, "Paris", reason)


def test_symbol_is_case_sensitive() -> None:
    p = probe("symbol", "Au")
    assert is_correct(p, "The chemical symbol for gold is Au.")
    assert not is_correct(p, "It is AU.")
    assert not is_correct(p, "It is Ag.")


def test_exact_case() -> None:
    p = probe("exact_case", "BANANA")
    assert is_correct(p, "Sure: BANANA")
    assert is_correct(p, '"BANANA".')
    assert not is_correct(p, "Banana")
    assert not is_correct(p, "BANANAS")


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("O", True),
        ("The first letter of the word 'orange' is 'O'.", True),
        ("It starts with the letter O.", True),
        ('The letter "O" is a letter that starts many words.', True),
        ("The first letter is R.", False),
        ("'O' or 'R'", False),
        ("Orange is a fruit.", False),
    ],
)
def test_letter(text: str, ok: bool) -> None:
    assert is_correct(probe("letter", "o"), text) is ok


@pytest.mark.parametrize(
    ("text", "ok"),
    [("No.", True), ("no", True), ("No, 17 is less than 23.", True), ("False.", True),
     ("Yes, 17 is greater than 23.", False), ("17 is smaller.", False)],
)
def test_yesno(text: str, ok: bool) -> None:
    assert is_correct(probe("yesno", "no"), text) is ok


def test_repeat() -> None:
    p = probe("repeat", "The cat sat on the mat.")
    assert is_correct(p, "The cat sat on the mat.")
    assert is_correct(p, '"the cat sat on the mat"')
    assert is_correct(p, "Sure! The cat sat on the mat.")
    assert not is_correct(p, "The cat sat on a mat.")
    assert not is_correct(p, "The cat sat on the mat. " + "It was a sunny day and everyone was happy about it. " * 3)


def test_repeat_case() -> None:
    p = probe("repeat_case", "the cat sat on the mat.")
    assert is_correct(p, "the cat sat on the mat.")
    assert not is_correct(p, "THE CAT SAT ON THE MAT.")
    assert not is_correct(p, "The Cat sat on the rug.")


def test_choice() -> None:
    p = probe("choice", "B", choices=("a leg muscle relaxing", "a bacterial population", "viral particles", "digestion"))
    assert is_correct(p, "B")
    assert is_correct(p, "B. a bacterial population")
    assert is_correct(p, "The answer is B.")
    assert is_correct(p, "(B)")
    assert is_correct(p, "It is a bacterial population in the bloodstream.")
    assert not is_correct(p, "A. a leg muscle relaxing")
    assert not is_correct(p, "A. a leg muscle relaxing\nB. a bacterial population\nC. viral particles")
    assert not is_correct(p, "B. a bacterial population\n\nThe correct answer is C.")
    assert not is_correct(p, "A thermometer would show it.")  # an article, not option A
    assert chosen_options(p, "A thermometer would show a bacterial population.") == {"B"}


def test_date() -> None:
    p = probe("date", "March 3")
    assert is_correct(p, "It happened on March 3.")
    assert is_correct(p, "On the 3rd of March.")
    assert is_correct(p, "march 3rd")
    assert not is_correct(p, "March 13")
    assert not is_correct(p, "On March 3 or April 3.")


def test_numbers_in_order() -> None:
    assert numbers("5 - 2 = three, then 1,000 and 2.5") == [5.0, 2.0, 3.0, 1000.0, 2.5]
