"""The answer-agreement judge: final results compared as values, free text left to the caller."""

from __future__ import annotations

from fractions import Fraction

import pytest

from policies.router.agreement import Final, final_answer, judge


@pytest.mark.parametrize(("text", "want"), [
    ("Adding them gives \\boxed{\\frac{3}{4}}.", Final("number", Fraction(3, 4))),
    ("She pays 5 + 7 = 12 dollars.\n#### 12", Final("number", Fraction(12))),
    ("1,250", Final("number", Fraction(1250))),
    ("The answer is 0.75.", Final("number", Fraction(3, 4))),
    ("So the final answer is: **42**", Final("number", Fraction(42))),
    ("Answer: 12.5%", Final("number", Fraction(1, 8))),
    ("The answer is (b) because water boils.", Final("choice", "B")),
    ("Answer: C", Final("choice", "C")),
    ("D", Final("choice", "D")),
    ('{"city": "Paris", "population": 2100000}', Final("json", {"city": "Paris", "population": 2100000})),
    ('Here it is:\n```json\n{"ok": true}\n```', Final("json", {"ok": True})),
])
def test_final_results_are_extracted(text, want):
    assert final_answer(text) == want


@pytest.mark.parametrize("text", [
    "", "Paris is the capital of France.", "The answer is a matter of taste.", "I think the answer is complicated.",
    "There were 3 cats and 4 dogs in the story, which ends happily.", "{not json", "\\boxed{x + 1}",
])
def test_free_text_has_no_final_result(text):
    assert final_answer(text) is None


def test_answers_agree_on_equal_values_and_disagree_on_different_ones():
    assert judge("The answer is 42.", "After the steps above we get\n#### 42") == "agree"
    assert judge("The answer is 42.", "The answer is 43.") == "disagree"  # cosine 0.84 > the 0.8 line: similarity cannot tell
    assert judge("\\boxed{0.5}", "The answer is 1/2") == "agree"
    assert judge("Answer: B", "(B)") == "agree"
    assert judge("Answer: B", "Answer: C") == "disagree"
    assert judge('{"a": 1, "b": [1, 2]}', '{"b": [1, 2], "a": 1}') == "agree"
    assert judge('{"a": 1}', '{"a": 2}') == "disagree"


def test_free_text_or_different_kinds_are_left_to_the_caller():
    assert judge("Paris is the capital.", "It is Paris.") is None
    assert judge("The answer is 42.", "Forty-two, as the book says.") is None
    assert judge("Answer: B", "The answer is 2.") is None


def test_the_shadow_hook_judges_checkable_answers_by_their_results_before_similarity():
    from gateway.pipeline.shadow import AGREE, disagree

    assert disagree("The answer is 42.", "The answer is 43.", similarity=0.84)  # similar, but wrong
    assert not disagree("#### 42", "So she has 42 apples left. The answer is 42.", similarity=0.4)  # unlike, but right
    assert disagree("Paris is the capital.", "Lyon, I think.", similarity=AGREE - 0.01)  # free text: similarity
    assert not disagree("Paris is the capital.", "It is Paris.", similarity=AGREE + 0.05)


@pytest.mark.parametrize("text", [
    "answer is" + " " * 19_990 + "x",  # 455 s to fail with adjacent \s* repeats before
    "answer" + " \t" * 9_990 + "x", "\n" * 20_000, "#### " + " " * 19_990 + "x", "1" * 20_000 + "x",
])
def test_whitespace_runs_are_read_in_one_pass(text):
    """Judgements run on the event loop (the shadow hook): no pattern may backtrack over a long run."""
    assert final_answer(text) is None


def _call(name: str, arguments: str, ident: str = "call_1") -> dict:
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_calls_agree_by_name_and_argument_values() -> None:
    from policies.router.agreement import judge_calls

    ours = [_call("Read", '{"file_path": "a.py", "limit": 20}')]
    assert judge_calls(ours, [_call("Read", '{"limit":20,  "file_path":"a.py"}', "call_9")]) == "agree"
    assert judge_calls(ours, [_call("Read", '{"file_path": "b.py", "limit": 20}')]) == "disagree"
    assert judge_calls(ours, [_call("Grep", '{"file_path": "a.py", "limit": 20}')]) == "disagree"
    assert judge_calls(ours, [_call("Read", '{"file_path": "a.py", "limit": 20.0}')]) == "agree"  # one value
    assert judge_calls(ours, []) == "disagree"  # one calls a tool, the other answers
    assert judge_calls([], None) is None  # neither calls one: the text decides
    both = [_call("Read", '{"file_path": "a.py"}'), _call("Bash", '{"command": "ls"}', "call_2")]
    assert judge_calls(both, list(reversed(both))) == "agree"  # parallel calls in either order
    assert judge_calls([_call("apply_patch", "*** Begin Patch")], [_call("apply_patch", "*** Begin Patch ")]) == "agree"
    assert judge_calls([{"function": {}}], ours) == "disagree"
