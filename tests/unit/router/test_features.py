"""Text features: shape, and that each cue moves the feature it names."""

from __future__ import annotations

import math

import numpy as np

from policies.router.features import FEATURE_NAMES, last_user_text, text_feature_matrix, text_features


def feat(prompt, name: str) -> float:
    return float(text_features(prompt)[FEATURE_NAMES.index(name)])


def test_vector_matches_names_and_is_finite() -> None:
    for prompt in ["", "hi", "x" * 10000, "日本語の質問ですか？", [{"role": "user", "content": "a"}]]:
        vec = text_features(prompt)
        assert vec.shape == (len(FEATURE_NAMES),)
        assert np.isfinite(vec).all()


def test_length_counts_tokens() -> None:
    assert feat("one two three", "log_tokens") == math.log1p(3)
    assert feat("one two three four five six seven", "log_tokens") > feat("one two", "log_tokens")


def test_turns_and_system_come_from_messages() -> None:
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    assert feat(chat, "turns") == math.log1p(1)
    assert feat(chat, "has_system") == 1.0
    assert feat("second", "turns") == 0.0
    assert last_user_text(chat) == "second"


def test_content_parts_use_their_text() -> None:
    chat = [{"role": "user", "content": [{"type": "text", "text": "why is the sky blue?"}, {"type": "image_url"}]}]
    assert last_user_text(chat) == "why is the sky blue?"
    assert feat(chat, "q_why") == 1.0


def test_code_math_numbers_and_steps() -> None:
    code = "Fix this:\n```python\ndef f(x):\n    return x\n```"
    assert feat(code, "code_fences") == 1.0
    assert feat(code, "code_lines") > 0
    assert feat("Solve $x^2 + 3x = 10$", "math_density") > feat("Tell me a story", "math_density")
    assert feat("Add 12 and 3.5 then 7", "log_numbers") == math.log1p(3)
    assert feat("First derive it, then prove it step by step", "multi_step_cues") > 0
    assert feat("tell me a joke", "multi_step_cues") == 0.0


def test_question_type_and_language() -> None:
    assert feat("What is love?", "q_what") == 1.0
    assert feat("What is love?", "q_how") == 0.0
    assert feat("Calculate the area", "q_solve") == 1.0
    assert feat("Write a poem", "q_imperative") == 1.0
    assert feat("Ist das gut?", "non_ascii_ratio") == 0.0
    assert feat("Что это такое?", "non_ascii_ratio") > 0.5
    assert feat("the cat is on the mat", "stopword_ratio") > feat("quantum chromodynamics lattice", "stopword_ratio")


def test_matrix_stacks_rows() -> None:
    m = text_feature_matrix(["a", "b c"])
    assert m.shape == (2, len(FEATURE_NAMES))
    assert np.array_equal(m[1], text_features("b c"))
    assert text_feature_matrix([]).shape == (0, len(FEATURE_NAMES))


def test_cross_task_cues() -> None:
    word_problem = ("A baker sells 48 muffins on Monday and half as many on Tuesday at $2.50 each. "
                    "How much does he earn in total?")
    assert feat(word_problem, "log_quantity_cues") > feat("Tell me about muffins", "log_quantity_cues")
    assert feat(word_problem, "log_money_units") > 0
    assert feat(word_problem, "log_max_number") == math.log1p(48)
    assert feat("Compute 3 * (4 + 5) / 2", "log_operators") > 0
    assert feat("Write a Python function that parses JSON", "log_code_words") >= math.log1p(3)
    assert feat("Answer in exactly three bullet points, no more than 50 words", "log_constraints") > 0
    assert feat("Write a detailed essay on trade", "long_answer_cues") > 0
    assert feat("Give a brief, one sentence answer", "short_answer_cues") > 0
    assert feat("Why does ice float? Explain.", "log_reasoning_cues") > 0
    assert feat("Which of these is NOT a mammal?", "negation_ratio") > 0
    assert feat("Write a haiku about rain", "creative_cues") > 0
    assert feat("Pretend you are a pirate", "roleplay_cues") > 0


def test_closed_question_needs_lettered_options() -> None:
    mcq = "Which planet is largest?\nA. Mars\nB. Jupiter\nC. Venus\nD. Earth\nAnswer:"
    assert feat(mcq, "closed_question") == 1.0
    assert feat("Which planet is largest?", "closed_question") == 0.0
    assert feat("Plan A. go home\nthen eat", "closed_question") == 0.0


def test_task_cues_read_every_user_turn() -> None:
    chat = [
        {"role": "user", "content": "Solve 12 * 7 + 3 = ? and show each step"},
        {"role": "assistant", "content": "87"},
        {"role": "user", "content": "Now do the same."},
    ]
    assert feat(chat, "log_operators") == feat("Solve 12 * 7 + 3 = ? and show each step", "log_operators") > 0
    assert feat(chat, "log_tokens") == feat("Now do the same.", "log_tokens")  # shape: the last turn
    assert feat(chat, "log_prior_chars") == math.log1p(len("Solve 12 * 7 + 3 = ? and show each step") + 2)
    assert feat("Now do the same.", "log_operators") == 0.0
