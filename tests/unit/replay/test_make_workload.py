"""The workload generator over ../shared/data: shares, order of repeats and paraphrases, determinism."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.make_workload import DataMissing, counts, generate
from gateway.replay.workload import read_workload, write_workload
from tests.conftest import SHARED_DATA

pytestmark = pytest.mark.evaluation


@pytest.fixture(scope="module")
def data() -> Path:
    if not (SHARED_DATA / "router").is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (evaluation-only test)")
    return SHARED_DATA


def test_counts_add_up_and_follow_the_shares() -> None:
    assert counts(200, {"repeat": 0.2, "paraphrase": 0.2, "simple": 0.35, "hard": 0.25}) == {
        "repeat": 40, "paraphrase": 40, "simple": 70, "hard": 50, "checkable": 0}
    assert sum(counts(7, {"repeat": 1, "paraphrase": 1, "simple": 1, "hard": 0}).values()) == 7
    with pytest.raises(ValueError):
        counts(10, {"repeat": 0, "paraphrase": 0, "simple": 0, "hard": 0})


def test_missing_data_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataMissing, match="missing"):
        list(generate(tmp_path))


def test_shares_order_and_determinism(data: Path, tmp_path: Path) -> None:
    records = list(generate(data, requests=200, seed=3, max_tokens=16))
    assert records == list(generate(data, requests=200, seed=3, max_tokens=16))
    assert records != list(generate(data, requests=200, seed=4, max_tokens=16))
    kinds = [r["kind"] for r in records]
    assert len(records) == 200
    assert kinds.count("repeat") == 40 and kinds.count("paraphrase") == 30 and kinds.count("hard") == 40
    assert kinds.count("simple") + kinds.count("seed") == 60 and kinds.count("checkable") == 30
    checkable = [r for r in records if r["kind"] == "checkable"]
    assert all(r["check"] and r["expected"]["answer"] for r in checkable)  # the replay can score them
    texts = [r["body"]["messages"][0]["content"] for r in records]
    for i, kind in enumerate(kinds):
        if kind == "repeat":
            assert texts[i] in texts[:i]  # a repeat always follows the request it repeats
    assert all(r["body"]["max_tokens"] == 16 and r["body"]["model"] == "auto" for r in records)
    ats = [r["at"] for r in records]
    assert ats == sorted(ats) and ats[0] == 0.0
    path = tmp_path / "w.jsonl"
    write_workload(path, records)
    assert [i.kind for i in read_workload(path)] == kinds
