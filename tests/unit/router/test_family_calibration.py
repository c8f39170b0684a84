"""Strong-share calibration per task family: rank maps over held-out-group scores, and the target they ship."""

from __future__ import annotations

import numpy as np
import pytest

from policies.router.calibration import RankMap, gap_curve, rank_map, threshold_for_target
from policies.router.data import MMLUData
from policies.router.features import FEATURE_NAMES
from policies.router.model import Router
from policies.router.train import (
    COST_TIER_PRICE,
    TARGET_GRID,
    TIER_COST_CEILING,
    TIER_QUALITY_FLOOR,
    choose_target,
    family_rank_maps,
)

FAMILY = FEATURE_NAMES.index("closed_question")


def test_rank_map_reads_a_score_as_the_share_that_scores_lower() -> None:
    scores = np.arange(101, dtype=np.float64)  # 0..100
    ranks = rank_map(scores)
    assert ranks(0.0) == 0.0 and ranks(100.0) == pytest.approx(1.0, abs=0.01)
    assert ranks(-5.0) == 0.0 and ranks(1e9) == ranks(100.0)  # clamped outside the calibration range
    assert ranks(30.0) == pytest.approx(0.30, abs=0.011)
    # "score >= 1 - t" sends a share t of the calibration rows
    for t in (0.1, 0.3, 0.44):
        assert (ranks.batch(scores) >= 1 - t).mean() == pytest.approx(t, abs=0.011)
    assert (np.diff(ranks.batch(np.linspace(-10, 110, 500))) >= 0).all()
    assert ranks(1e9) < 1.0  # nothing scores above all of the calibration: threshold 1 sends nothing


def test_rank_map_weights_let_every_group_count_once() -> None:
    # 900 rows of a large group score low, 100 of a small group high: by rows the small group is
    # the top 10 %; with each group weighing the same it is the top half.
    scores = np.r_[np.linspace(0.0, 1.0, 900), np.linspace(2.0, 3.0, 100)]
    groups = np.r_[np.zeros(900, int), np.ones(100, int)]
    by_rows = rank_map(scores)
    by_group = rank_map(scores, weights=1.0 / np.bincount(groups)[groups])
    assert by_rows(1.5) == pytest.approx(0.9, abs=0.01)
    assert by_group(1.5) == pytest.approx(0.5, abs=0.01)


def test_rank_map_ties_and_bad_input() -> None:
    ranks = rank_map(np.r_[np.zeros(80), np.linspace(1.0, 2.0, 20)])
    # a block of ties ranks at the share that scores below it (none here), so a 30 % share
    # target never takes the 80 % block: it sends the 20 distinct rows above it
    assert ranks(0.0) == 0.0 and ranks(1.0) == pytest.approx(0.8, abs=0.01)
    assert (ranks.batch(np.r_[np.zeros(80), np.linspace(1.0, 2.0, 20)]) >= 0.7).mean() == pytest.approx(0.2)
    back = RankMap.from_table(ranks.to_table())
    np.testing.assert_allclose(back.batch(np.linspace(-1, 3, 50)), ranks.batch(np.linspace(-1, 3, 50)), atol=1e-6)
    with pytest.raises(ValueError, match="two distinct"):
        rank_map(np.ones(10))
    with pytest.raises(ValueError, match="finite"):
        rank_map(np.array([0.0, np.nan, 1.0]))
    with pytest.raises(ValueError, match="increase"):
        RankMap(np.array([0.0, 0.0, 1.0]), np.array([0.0, 0.5, 1.0]))


def test_family_maps_give_each_family_the_share_target() -> None:
    # Open prompts score around -2, multiple choice around +3 (different base rates and scales):
    # on raw scores a pooled share threshold sends nearly all multiple choice and no open prompt;
    # through the family maps it sends the target share of each.
    rng = np.random.default_rng(5)
    z = np.r_[rng.normal(-2.0, 0.5, 600), rng.normal(3.0, 2.0, 1400)]
    closed = np.r_[np.zeros(600, bool), np.ones(1400, bool)]
    open_map, closed_map = family_rank_maps(z, closed)
    score = np.where(closed, closed_map.batch(z), open_map.batch(z))
    weak, strong = rng.integers(0, 2, z.size), np.ones(z.size)
    raw_t = threshold_for_target(gap_curve(z, weak, strong), "max_strong_share", 0.3)
    assert (z[~closed] >= raw_t).mean() < 0.05
    t = threshold_for_target(gap_curve(score, weak, strong), "max_strong_share", 0.3)
    for family in (closed, ~closed):
        assert (score[family] >= t).mean() == pytest.approx(0.3, abs=0.02)
    with pytest.raises(ValueError, match="multiple-choice"):
        family_rank_maps(z[:600], closed[:600])


def _mmlu(weak: np.ndarray, strong: np.ndarray) -> MMLUData:
    return MMLUData([f"q{i}" for i in range(weak.size)], np.full(weak.size, "s"), weak, strong)


def test_the_shipped_target_is_the_cheapest_share_that_meets_the_tier_aim() -> None:
    # 1,000 rows: the weak model right on the 620 lowest-scored, the strong one right everywhere.
    # Sending the top k rows to strong gives quality (620 + k) / 1000 at cost 0.1 + 0.9 k / 1000:
    # 0.30 falls short of 0.95 (0.92); 0.35 (0.97 at 0.415) and 0.40 (0.99 at 0.46) meet both
    # aims; the cheaper one ships.
    scores = np.linspace(0.0, 1.0, 1000)
    data = _mmlu((np.arange(1000) < 620).astype(np.int64), np.ones(1000, np.int64))
    assert (TIER_QUALITY_FLOOR, TIER_COST_CEILING, COST_TIER_PRICE) == (0.95, 0.50, 0.1)
    value, figures = choose_target(gap_curve(scores, data.weak, data.strong), scores, data)
    assert value == 0.35
    assert figures == {"mmlu_selection_share": 0.35, "mmlu_selection_quality": 0.97, "mmlu_selection_cost": 0.415,
                       "shortfall": 0.0}


def test_when_no_share_meets_the_aim_the_closest_ships() -> None:
    # Weak right on the lowest 500: 0.95 quality needs 450 rows (cost 0.505, 0.005 over the
    # ceiling); 0.40 keeps the cost (0.46) at quality 0.90; 0.50 reaches 1.0 at cost 0.55.
    scores = np.linspace(0.0, 1.0, 1000)
    data = _mmlu((np.arange(1000) < 500).astype(np.int64), np.ones(1000, np.int64))
    value, figures = choose_target(gap_curve(scores, data.weak, data.strong), scores, data)
    assert value == 0.45
    assert figures["shortfall"] == pytest.approx(0.005)
    # the strong model's wins ranked last: quality stays 0.62 up to a 0.62 share, and the least
    # bad point is 0.70 (quality 0.70, 0.25 short; 0.65 is 0.30 short, 0.75 0.275 over in cost)
    data = _mmlu((np.arange(1000) >= 380).astype(np.int64), np.ones(1000, np.int64))
    value, figures = choose_target(gap_curve(scores, data.weak, data.strong), scores, data)
    assert value == 0.7 and value in TARGET_GRID
    assert figures["shortfall"] == pytest.approx(0.25)


def _params(dimension: int, families: bool) -> dict[str, object]:
    rng = np.random.default_rng(9)
    params: dict[str, object] = {
        "kind": "linear", "dimension": dimension, "estimator": None, "bias": 0.1,
        "w_emb": rng.normal(size=dimension).astype(np.float32), "w_text": rng.normal(size=len(FEATURE_NAMES)) * 0.1,
        "gate": {"feature": FAMILY, "w_emb": rng.normal(size=dimension).astype(np.float32),
                 "w_text": np.zeros(len(FEATURE_NAMES)), "bias": 2.0},
    }
    if families:
        params["families"] = {"feature": FAMILY, "name": "closed_question",
                              "open": {"logit": [-3.0, 0.0, 3.0], "rank": [0.0, 0.5, 1.0]},
                              "closed": {"logit": [-1.0, 2.0, 5.0], "rank": [0.0, 0.5, 1.0]}}
    return params


def test_router_scores_through_its_familys_rank_map() -> None:
    d = 8
    ranked = Router.from_params(_params(d, True), curve=None, default_threshold=0.5, manifest={})
    plain = Router.from_params(_params(d, False), curve=None, default_threshold=0.5, manifest={})
    mcq = "Which gas is most abundant in air?\nA. Oxygen\nB. Nitrogen\nC. Argon\nD. Carbon dioxide\nAnswer:"
    prompts = ["Write a haiku about rain.", mcq, "How many legs do three spiders have?", mcq + " "]
    emb = np.random.default_rng(2).normal(size=(len(prompts), d)).astype(np.float32)
    batch = ranked.score_batch(prompts, emb)
    np.testing.assert_allclose([ranked.score(p, e) for p, e in zip(prompts, emb)], batch, atol=1e-9)
    # the rank map of the prompt's family applied to the log-odds of the plain (unmapped) model
    z = np.log(plain.score_batch(prompts, emb) / (1 - plain.score_batch(prompts, emb)))
    expected = [np.interp(z[i], [-1.0, 2.0, 5.0] if "\nA." in p else [-3.0, 0.0, 3.0], [0.0, 0.5, 1.0])
                for i, p in enumerate(prompts)]
    np.testing.assert_allclose(batch, expected, atol=1e-6)


def test_a_damaged_rank_map_is_refused() -> None:
    from policies.router import RouterArtifactError

    params = _params(4, True)
    params["families"]["closed"] = {"logit": [1.0, 0.0], "rank": [0.0, 1.0]}  # type: ignore[index]
    with pytest.raises(RouterArtifactError, match="rank map"):
        Router.from_params(params, curve=None, default_threshold=0.5, manifest={})


def test_the_shipped_router_is_ranked_per_family(shipped_router: Router) -> None:
    # Scores are ranks within a family's selection-fold scores, so the pooled curve puts the
    # threshold of a share target t at about 1 - t, and the default target is the one chosen.
    assert shipped_router.ranks is not None and shipped_router.family_index == FAMILY
    for t in (0.2, 0.45, 0.7):
        assert shipped_router.threshold_for("max_strong_share", t) == pytest.approx(1 - t, abs=0.01)
    chosen = shipped_router.manifest["default_target"]
    assert chosen["value"] in TARGET_GRID and chosen["mmlu_selection_cost"] == pytest.approx(
        COST_TIER_PRICE + (1 - COST_TIER_PRICE) * chosen["mmlu_selection_share"], abs=1e-3)
    assert shipped_router.default_threshold == pytest.approx(shipped_router.threshold_for(chosen["mode"], chosen["value"]))
