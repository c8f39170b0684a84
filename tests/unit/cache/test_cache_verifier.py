"""The cache verifiers (cross-encoder and embedding features): artifacts, scorer, gating, policy keys, shared decision."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from gateway.commands.cache import match_lines
from policies.cache import matcher
from policies.cache.config import CacheConfig
from policies.cache.cross_encoder import ARTIFACTS, BUNDLED_CROSS_ENCODER, CrossEncoder, load_cross_encoder
from policies.cache.faiss_index import FaissIndex
from policies.cache.matcher import decide, decide_many
from policies.cache.verifier import BUNDLED as PREVIOUS
from policies.cache.verifier import LEXICAL_NAMES, PairText, load_verifier, pair_vector
from policies.cache.verify import BUNDLED_VERIFIER, Features, VerifyConfig, features
from policies.policy import Policy

PARAPHRASE = ("How do I reset my password?", "How can I reset my password?")
NEGATION = ("Why is the sky blue?", "Why isn't the sky blue?")
ANTONYM = ("What is the best programming language for beginners?", "What is the worst programming language for beginners?")


def _unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=384).astype(np.float32)
    return v / np.linalg.norm(v)


def _unloadable(cfg: VerifyConfig, tmp_path: Path) -> VerifyConfig:
    """The config with a cross-encoder that fails if anything tries to load it."""
    return dataclasses.replace(cfg, verifier=str(tmp_path / "absent.onnx"))


def test_the_artifacts_are_small_and_the_policy_names_them() -> None:
    assert BUNDLED_CROSS_ENCODER.is_file() and BUNDLED_CROSS_ENCODER.with_suffix(".json").is_file()
    assert sum(p.stat().st_size for p in ARTIFACTS.iterdir()) <= 25 * 1024 * 1024
    meta = json.loads(BUNDLED_CROSS_ENCODER.with_suffix(".json").read_text())
    assert meta["format"] == 1 and "training" in meta and meta["selection"]["chosen"]["min_probability"] > 0
    assert CacheConfig.from_section({}).verify.verifier == str(BUNDLED_CROSS_ENCODER)
    assert VerifyConfig.from_policy({"verifier": "bundled"}).verifier == str(BUNDLED_VERIFIER)
    assert VerifyConfig.from_policy({"verifier": "cross_encoder"}).verifier == str(BUNDLED_CROSS_ENCODER)


@pytest.fixture
def encode(sentence_encoder: Any) -> Any:
    """The gateway's sentence encoder: the vectors a lookup has for the query and its candidates."""
    return lambda *texts: np.asarray(sentence_encoder.encode(list(texts)))


@pytest.mark.slow
def test_the_cross_encoder_reads_a_paraphrase_above_a_negation_and_an_antonym() -> None:
    encoder = load_cross_encoder(str(BUNDLED_CROSS_ENCODER))
    paraphrase, negation, antonym = encoder.logits([PARAPHRASE, NEGATION, ANTONYM]).tolist()
    assert paraphrase > negation and paraphrase > antonym
    # Scored alone (no padding) close to the batch: int8 dynamic quantisation scales activations
    # per call, so a batch's range moves the figure a little.
    alone = encoder.logits([PARAPHRASE])[0]
    assert alone == pytest.approx(paraphrase, abs=0.3)


@pytest.mark.slow
def test_a_pair_too_long_to_read_whole_is_not_scored() -> None:
    encoder = CrossEncoder(BUNDLED_CROSS_ENCODER)
    long_text = "tell me about the history of the city " * 20
    probabilities = encoder.probabilities([(long_text, long_text), PARAPHRASE], [1.0, 0.9], [0.99, 0.9])
    assert probabilities[0] == 0.0 and probabilities[1] > 0.0
    assert encoder.pairs == 1  # only the pair that fits went to the graph


@pytest.mark.slow
def test_the_blend_reads_the_cross_encoder_and_the_embedding_feature_verifier() -> None:
    encoder = CrossEncoder(BUNDLED_CROSS_ENCODER)
    blend = encoder.meta["blend"]
    # Fitted on the selection split: both readers carry weight.
    assert blend["logit"] > 0 and blend["previous"] > 0 and encoder.previous_verifier == PREVIOUS
    low, high = encoder.probabilities([PARAPHRASE, PARAPHRASE], [0.9, 0.9], [0.2, 0.99]).tolist()
    assert low < high
    with pytest.raises(ValueError, match="cosine"):
        encoder.probabilities([PARAPHRASE])
    with pytest.raises(ValueError, match="previous"):
        encoder.probabilities([PARAPHRASE], [0.9])


@pytest.mark.slow
def test_each_vector_space_reads_its_own_blend_and_verifier(sentence_encoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from policies.embedding.embedder import vector_space

    encoder = CrossEncoder(BUNDLED_CROSS_ENCODER)
    int8, fp32 = vector_space("int8"), vector_space("fp32")
    assert encoder.blend_for(None) is encoder.blend_for(fp32) is encoder.blend  # float32: the blend fitted with the artifact
    blend = encoder.blend_for(int8)
    assert blend is not None and blend is not encoder.blend and blend["vectors"] == int8
    assert encoder.previous_verifier_for(fp32) == PREVIOUS
    assert encoder.previous_verifier_for(int8) == ARTIFACTS / "verifier-int8.npz" and (ARTIFACTS / "verifier-int8.npz").is_file()
    assert encoder.previous_verifiers() == sorted([PREVIOUS, ARTIFACTS / "verifier-int8.npz"])
    cosine, previous = [0.87], [0.9]
    assert encoder.probabilities([PARAPHRASE], cosine, previous, int8)[0] != encoder.probabilities([PARAPHRASE], cosine, previous)[0]
    # decide_many hands the space on: the int8 lookup scores with the int8 verifier
    seen: list[str] = []
    real = matcher._previous_verifier

    def spy(query: str, candidates: Any, checks: VerifyConfig, query_vector: Any, path: str | None = None) -> Any:
        seen.append(Path(path or "").name)
        return real(query, candidates, checks, query_vector, path)

    monkeypatch.setattr(matcher, "_previous_verifier", spy)
    vectors = sentence_encoder.encode(list(PARAPHRASE))
    cfg = VerifyConfig.from_policy({})
    for space in (int8, None):
        decide_many(PARAPHRASE[0], [(0.95, PARAPHRASE[1], vectors[1])], threshold=0.8, checks=cfg, query_vector=vectors[0],
                    space=space)  # fmt: skip
    assert seen == ["verifier-int8.npz", "verifier.npz"]


def test_no_cross_encoder_call_below_the_gate_or_after_a_veto(tmp_path: Path) -> None:
    cfg = _unloadable(VerifyConfig.from_policy({}), tmp_path)
    decisions = decide_many(
        "What is 5 percent of 200?",
        [(0.5, "What is 5 percent of 300?", None), (0.99, "What is 6 percent of 200?", None)],
        threshold=0.8,
        checks=cfg,
    )
    assert [(d.hit, d.reason, d.probability) for d in decisions] == [(False, "threshold", None), (False, "numbers", None)]
    assert decide_many("anything", [], threshold=0.8, checks=cfg) == []


def test_a_texts_veto_features_are_extracted_once_and_decide_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _unloadable(VerifyConfig.from_policy({}), tmp_path)
    extracted: list[str] = []

    def counted(text: str, checks: VerifyConfig) -> Features:
        extracted.append(text)
        return features(text, checks)

    monkeypatch.setattr(matcher, "features", counted)
    matcher._memo_features.cache_clear()
    long = "What is 7 percent of 200? " + "Say it plainly. " * (matcher._MEMO_CHARS // 16)
    stored = [(0.99, "What is 6 percent of 200?", None), (0.99, "What is 5 percent of 300?", None), (0.99, long, None)]
    first = decide_many("What is 5 percent of 200?", stored, threshold=0.8, checks=cfg)
    again = decide_many("What is 5 percent of 200?", stored, threshold=0.8, checks=dataclasses.replace(cfg))
    assert first == again
    assert [(d.hit, d.reason) for d in first] == [(False, "numbers")] * 3
    # the short texts once each, whichever equal checks ask; a long one every time
    assert sorted(extracted) == sorted(["What is 5 percent of 200?", *(t for _, t, _ in stored), long])
    # other checks, other features: kept apart
    other = dataclasses.replace(cfg, numbers=False, verifier=None)
    assert [d.hit for d in decide_many("What is 5 percent of 200?", stored[:1], threshold=0.8, checks=other)] == [True]
    assert len(extracted) == 7


@pytest.mark.slow
def test_the_candidates_left_are_scored_in_one_call(encode: Any) -> None:
    cfg = VerifyConfig.from_policy({"verifier": "cross_encoder", "min_probability": 0.0})
    encoder = load_cross_encoder(str(BUNDLED_CROSS_ENCODER))
    texts = [PARAPHRASE[1], "What is the capital of France?", "How do I reset my pass word?"]
    q, *vectors = encode(PARAPHRASE[0], *texts)
    before = (encoder.calls, encoder.pairs)
    decisions = decide_many(
        PARAPHRASE[0],
        [(0.95, texts[0], vectors[0]), (0.3, texts[1], vectors[1]), (0.9, texts[2], vectors[2])],
        threshold=0.8,
        checks=cfg,
        query_vector=q,
    )
    assert (encoder.calls, encoder.pairs) == (before[0] + 1, before[1] + 2)
    assert [d.hit for d in decisions] == [True, False, True]
    assert decisions[1].reason == "threshold" and decisions[0].probability is not None
    # Without the vectors the blend's embedding-feature part cannot run: a miss, and no call.
    d = decide_many(PARAPHRASE[0], [(0.95, texts[0], None)], threshold=0.8, checks=cfg, query_vector=q)[0]
    assert (d.hit, d.reason) == (False, "no_vector") and encoder.calls == before[0] + 1


@pytest.mark.slow
def test_min_probability_decides(encode: Any) -> None:
    never = VerifyConfig.from_policy({"verifier": "cross_encoder", "min_probability": 1.0})
    always = VerifyConfig.from_policy({"verifier": "cross_encoder", "min_probability": 0.0})
    u, v = encode(*PARAPHRASE)
    assert decide(1.0, *PARAPHRASE, threshold=0.8, checks=always, query_vector=u, candidate_vector=v).hit
    d = decide(1.0, *PARAPHRASE, threshold=0.8, checks=never, query_vector=u, candidate_vector=v)
    assert not d.hit and d.reason == "verifier" and d.probability is not None


@pytest.mark.slow
def test_the_shipped_setting_serves_a_rewrite_and_not_a_negation(encode: Any) -> None:
    shipped = CacheConfig.from_section(Policy.load().resolve("cache"))
    for (a, b), served in ((PARAPHRASE, True), (("How do I enable dark mode?", "How do I not enable dark mode?"), False),
                           (ANTONYM, False)):  # fmt: skip
        u, v = encode(a, b)
        d = decide(float(u @ v), a, b, threshold=shipped.threshold, checks=shipped.verify, query_vector=u, candidate_vector=v)
        assert d.hit is served, (a, b, d)


def test_with_the_verifier_off_the_vetoes_decide() -> None:
    off = VerifyConfig.from_policy({"verifier": "off"})
    d = decide(0.95, *PARAPHRASE, threshold=0.82, checks=off)
    assert d.hit and d.probability is None
    assert decide(0.95, "How do I enable it?", "How do I not enable it?", threshold=0.82, checks=off).reason == "negation"


@pytest.mark.parametrize(
    ("section", "message"),
    [({"verifier": "/no/such/file.onnx"}, "verifier"), ({"min_probability": 1.5}, "min_probability")],
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


def test_the_embedding_feature_verifier_needs_both_vectors() -> None:
    cfg = VerifyConfig.from_policy({})
    d = decide(0.95, *PARAPHRASE, threshold=0.82, checks=cfg)
    assert not d.hit and d.reason == "no_vector"
    u = _unit(9)
    d = decide(0.95, *PARAPHRASE, threshold=0.82, checks=cfg, query_vector=u, candidate_vector=u)
    assert d.probability is not None and d.reason in (None, "verifier")


def test_the_embedding_feature_verifier_is_symmetric() -> None:
    cfg = VerifyConfig.from_policy({})
    model = load_verifier(str(PREVIOUS))
    assert model.inputs == 2 * 384 + len(LEXICAL_NAMES)
    u, v = _unit(1), _unit(2)
    a, b = PairText(PARAPHRASE[0], cfg), PairText(PARAPHRASE[1], cfg)
    p_ab = model.probability(pair_vector(u, v, a, b, cfg))
    assert 0.0 <= p_ab <= 1.0
    assert p_ab == pytest.approx(model.probability(pair_vector(v, u, b, a, cfg)), abs=1e-6)


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
    # the gateway's default precision, read with the verifier and blend fitted for it
    from policies.cache.scope import normalise
    from policies.embedding.embedder import SERVING_PRECISION, load_encoder, vector_space

    x, y = load_encoder(precision=SERVING_PRECISION).encode([normalise("How do I convert Celsius to Fahrenheit?"),
                                                             normalise("How do I convert Celsius to Fahrenheit")])  # fmt: skip
    assert rows[0]["similarity"] == round(float(x @ y), 4)
    want = decide(float(x @ y), normalise("How do I convert Celsius to Fahrenheit?"), normalise("How do I convert Celsius to Fahrenheit"),
                  threshold=config.threshold, checks=config.verify, query_vector=x, candidate_vector=y, space=vector_space(SERVING_PRECISION))  # fmt: skip
    assert want.probability is not None and rows[0]["probability"] == round(want.probability, 4)
    assert rows[0]["probability"] is not None
    assert rows[0]["hit"] is (rows[0]["probability"] >= round(config.verify.min_probability, 4))
    assert rows[1]["hit"] is False and rows[1]["reason"] == "threshold"
    assert "error" in rows[2]


def test_the_shipped_policy_runs_the_setting_chosen_with_the_artifact() -> None:
    """Gate, vetoes and threshold were chosen together on the selection split; a retrained
    artifact whose choice moved must move the shipped policy with it."""
    chosen = json.loads(BUNDLED_CROSS_ENCODER.with_suffix(".json").read_text())["selection"]["chosen"]
    shipped = CacheConfig.from_section(Policy.load().resolve("cache"))
    assert shipped.verify.verifier == str(BUNDLED_CROSS_ENCODER)
    assert shipped.threshold == pytest.approx(chosen["gate"]) and shipped.verify.min_probability == pytest.approx(chosen["min_probability"])
    assert chosen["vetoes"] and shipped.verify.numbers and shipped.verify.negation and shipped.verify.entities
