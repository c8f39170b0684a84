"""The learned verifier: artifact, features, policy keys, and the decision the gateway and the CLI share."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from gateway.commands.cache import match_lines
from policies.cache.config import CacheConfig
from policies.cache.faiss_index import FaissIndex
from policies.cache.matcher import decide
from policies.cache.verifier import BUNDLED, LEXICAL_NAMES, PairText, load_verifier, pair_vector
from policies.cache.verify import VerifyConfig


def _unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=384).astype(np.float32)
    return v / np.linalg.norm(v)


def test_the_bundled_artifact_is_small_and_matches_the_feature_layout() -> None:
    assert BUNDLED.is_file() and BUNDLED.stat().st_size < 2_000_000
    model = load_verifier(str(BUNDLED))
    assert model.inputs == 2 * 384 + len(LEXICAL_NAMES)
    assert model.meta["format"] == 1 and "trained_on" in model.meta


def test_the_shipped_policy_uses_the_bundled_verifier() -> None:
    config = CacheConfig.from_section({})
    assert config.verify.verifier == str(BUNDLED)
    assert 0.0 < config.verify.min_probability < 1.0


def test_probability_is_symmetric_and_in_range() -> None:
    cfg = VerifyConfig.from_policy({})
    model = load_verifier(str(BUNDLED))
    u, v = _unit(1), _unit(2)
    a = PairText("How do I learn Python quickly?", cfg)
    b = PairText("What is the fastest way to learn Python?", cfg)
    p_ab = model.probability(pair_vector(u, v, a, b, cfg))
    p_ba = model.probability(pair_vector(v, u, b, a, cfg))
    assert 0.0 <= p_ab <= 1.0
    assert p_ab == pytest.approx(p_ba, abs=1e-6)


def test_question_word_number_and_negation_features() -> None:
    cfg = VerifyConfig.from_policy({})
    names = list(LEXICAL_NAMES)
    x = pair_vector(_unit(3), _unit(3), PairText("When did Rome fall?", cfg), PairText("Where did Rome fall?", cfg), cfg)
    lexical = dict(zip(names, x[768:].tolist()))
    assert lexical["question_word_mismatch"] == 1.0 and lexical["cosine"] == pytest.approx(1.0, abs=1e-5)
    x = pair_vector(_unit(3), _unit(4), PairText("Is 5 km far?", cfg), PairText("Is 50 km not far?", cfg), cfg)
    lexical = dict(zip(names, x[768:].tolist()))
    assert lexical["numbers_mismatch"] == 1.0 and lexical["negation_diff"] == 1.0


def test_decide_needs_both_vectors_when_a_verifier_is_on() -> None:
    cfg = VerifyConfig.from_policy({})
    d = decide(0.95, "How do I reset my password?", "How can I reset my password?", threshold=0.82, checks=cfg)
    assert not d.hit and d.reason == "no_vector"
    off = VerifyConfig.from_policy({"verifier": "off"})
    d = decide(0.95, "How do I reset my password?", "How can I reset my password?", threshold=0.82, checks=off)
    assert d.hit and d.probability is None


def test_decide_below_threshold_and_vetoes_come_first() -> None:
    cfg = VerifyConfig.from_policy({})
    u = _unit(5)
    d = decide(0.5, "a", "b", threshold=0.82, checks=cfg, query_vector=u, candidate_vector=u)
    assert (d.hit, d.reason) == (False, "threshold")
    d = decide(0.99, "What is 5 percent of 200?", "What is 6 percent of 200?", threshold=0.82, checks=cfg,
               query_vector=u, candidate_vector=u)  # fmt: skip
    assert (d.hit, d.reason) == (False, "numbers")


def test_min_probability_decides() -> None:
    u = _unit(6)
    texts = ("How do I reset my password?", "How do I reset my password")
    never = VerifyConfig.from_policy({"min_probability": 1.0})
    always = VerifyConfig.from_policy({"min_probability": 0.0})
    assert decide(1.0, *texts, threshold=0.82, checks=always, query_vector=u, candidate_vector=u).hit
    d = decide(1.0, *texts, threshold=0.82, checks=never, query_vector=u, candidate_vector=u)
    assert not d.hit and d.reason == "verifier" and d.probability is not None


@pytest.mark.parametrize(
    ("section", "message"),
    [({"verifier": "/no/such/file.npz"}, "verifier"), ({"min_probability": 1.5}, "min_probability")],
)
def test_bad_verifier_keys_fail_at_start_up(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        VerifyConfig.from_policy(section)


def test_the_index_returns_each_candidate_vector() -> None:
    index = FaissIndex(384)
    vectors = np.stack([_unit(7), _unit(8)])
    index.add_many([11, 12], ["s", "s"], vectors)
    found = {n.id: n for n in index.search("s", vectors[1], 2)}
    assert set(found) == {11, 12}
    vector = found[12].vector
    assert vector is not None and np.allclose(vector, vectors[1])


@pytest.mark.slow
def test_cache_match_reports_the_gateway_decision(sentence_encoder: Any) -> None:
    del sentence_encoder  # loaded once per session; match_lines loads the same default backend
    lines = io.StringIO(
        json.dumps({"a": "How do I convert Celsius to Fahrenheit?", "b": "How do I convert Celsius to Fahrenheit"}) + "\n"
        + json.dumps({"a": "What is the capital of France?", "b": "What is the best pizza topping?"}) + "\n"
        + "not json\n"
    )  # fmt: skip
    out = io.StringIO()
    assert match_lines(lines, out, CacheConfig.from_section({})) == 1
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    config = CacheConfig.from_section({})
    assert rows[0]["probability"] is not None
    assert rows[0]["hit"] is (rows[0]["probability"] >= round(config.verify.min_probability, 4))
    assert rows[1]["hit"] is False and rows[1]["reason"] == "threshold"
    assert "error" in rows[2]
