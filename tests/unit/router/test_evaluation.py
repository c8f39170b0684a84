"""The shipped router beats a random split on MMLU subjects it never saw (needs ../shared/data)."""

from __future__ import annotations

import numpy as np
import pytest

from policies.embedder import encode
from policies.router import Router
from policies.router.data import load_mmlu, shared_data_dir
from policies.router.evaluate import routing_metrics

pytestmark = pytest.mark.evaluation


def test_held_out_subjects_beat_random(shipped_router: Router, router_sentence_model) -> None:
    data_dir = shared_data_dir()
    if not (data_dir / "router").is_dir():
        pytest.skip("../shared/data absent: the router evaluation reads ../shared/data/router")
    subjects = shipped_router.manifest["split"]["test_subjects"]
    mmlu = load_mmlu(data_dir)
    held_out = np.flatnonzero(np.isin(mmlu.subjects, subjects))
    sample = mmlu.take(np.sort(np.random.default_rng(0).choice(held_out, size=300, replace=False)))
    # Embedded as the gateway does at run time (full 256 word pieces), not as in training.
    scores = shipped_router.score_batch(sample.prompts, encode(router_sentence_model, sample.prompts))
    report = routing_metrics(scores, sample)
    assert report["auc"] > 0.55
    assert report["apgr"] > report["random"]["apgr"]
    assert report["cpt50"] < report["random"]["cpt50"]
