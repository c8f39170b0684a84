"""The README results block: rewritten between its markers from the result files, nothing else touched;
the committed block is the one the committed result files render, and every target they name has a
verdict recomputed from their own figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench._verdicts import builder_for, holds, rate, speculative_record, target, wilson
from bench.results_readme import END, START, main, render, rewrite

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "bench" / "results"


def _results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    (results / "proxy_overhead.json").write_text(json.dumps({
        "what": "added latency", "generated_at": "2026-01-01T00:00:00Z", "machine": {"cpus": 2},
        "results": {"concurrency_1": {"direct": {"p50_ms": 0.5, "rps": 900.0}, "tierlane": {"p50_ms": 1.5, "rps": 500.0},
                                      "added_p50_ms": 1.0, "added_p99_ms": 3.0, "throughput_ratio": 0.55}},
    }))
    (results / "other.json").write_text(json.dumps({"benchmark": "other", "score": 0.91, "meets_target": True}))
    (results / "broken.json").write_text("{not json")
    return results


def test_block_is_appended_then_replaced_in_place(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nbody text\n")
    results = _results(tmp_path)
    assert main(["--readme", str(readme), "--results", str(results)]) == 0
    first = readme.read_text()
    assert first.startswith("# title\n\nbody text\n\n" + START)
    assert first.rstrip().endswith(END)
    assert "| 1 | 0.5 | 1.5 | 1 | 3 | 900 | 500 | 0.55 |" in first
    assert "| score | 0.91 |" in first and "### broken" not in first
    readme.write_text(first + "\ntrailing section\n")
    (results / "other.json").write_text(json.dumps({"benchmark": "other", "score": 0.5}))
    assert main(["--readme", str(readme), "--results", str(results), "--check"]) == 1
    assert main(["--readme", str(readme), "--results", str(results)]) == 0
    second = readme.read_text()
    assert "| score | 0.5 |" in second and second.count(START) == 1
    assert second.endswith("\ntrailing section\n") and second.startswith("# title\n\nbody text\n")
    assert main(["--readme", str(readme), "--results", str(results), "--check"]) == 0


def test_a_lone_marker_is_refused() -> None:
    with pytest.raises(ValueError, match="one results marker"):
        rewrite(f"text\n{START}\nno end\n", "block")


def test_committed_readme_block_is_the_one_the_result_files_render() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    start, end = readme.find(START), readme.find(END)
    assert start != -1 and end > start, "README.md has no results block"
    committed = readme[start : end + len(END)]
    assert committed == render(RESULTS), "README.md results are out of date: run bench/results_readme.py"


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_every_named_target_has_a_verdict_recomputed_from_the_files_own_figures(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    build = builder_for(path.stem)
    if any("target" in key for key in _keys(data) - {"verdicts"}):
        assert build is not None, f"{path.name} names a target and bench/_verdicts.py has no builder for it"
    if build is None:
        assert "verdicts" not in data
        return
    assert data.get("verdicts"), f"{path.name} has no verdicts: run bench/_verdicts.py"
    assert data["verdicts"] == build(data), f"{path.name}: verdicts differ from its own figures: run bench/_verdicts.py"
    for record in data["verdicts"]:
        assert record["met"] in (True, False, None) and "n" in record and record["target"]
        if record["met"] is None:
            assert record.get("status"), record
        else:
            assert record["met"] == holds(record["value"], record["op"], record["threshold"])
            assert record["n"] is not None or record.get("note"), f"{record['figure']}: no sample size and no note why"


def test_wilson_interval() -> None:
    assert wilson(9, 10) == [0.5958, 0.9821]
    assert wilson(0, 10) == [0.0, 0.2775]
    assert wilson(1, 1) == [0.2065, 1.0]
    assert wilson(0, 0) is None


def test_a_rate_that_meets_its_target_on_one_sample_is_marked_inconclusive() -> None:
    tiny = rate("precision", 1, 1, ">=", 0.97)
    assert tiny["met"] is True and tiny["conclusive"] is False and tiny["interval_95"] == [0.2065, 1.0]
    large = rate("precision", 9990, 10000, ">=", 0.97)
    assert large["met"] is True and large["conclusive"] is True
    missed = target("throughput_ratio_at_64", 0.425, ">=", 0.6, n=3000, n_of="requests")
    assert missed["met"] is False and missed["target"] == ">= 0.6"
    assert rate("precision", 0, 0, ">=", 0.9)["met"] is None


def test_a_speed_up_without_drafted_tokens_gets_no_verdict() -> None:
    runs = {
        "everyday@8/on": {"drafted": 0, "accepted": 0, "completion_tokens": 1146},
        "grounded@8/on": {"drafted": 9, "accepted": 3, "completion_tokens": 703},
    }
    idle = speculative_record("b_everyday_c8", runs, 0.94)
    assert idle["met"] is None and idle["value"] is None and "not exercised" in idle["status"]
    noisy = speculative_record("c_grounded_c8", runs, 1.13)
    assert noisy["met"] is True and "noise" in noisy["note"]


def test_verdicts_render_with_sample_size_interval_and_a_missed_target(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    data = {"benchmark": "cache_quality-like", "verdicts": [
        target("throughput_ratio_at_64", 0.425, ">=", 0.6, n=3000, n_of="requests"),
        rate("precision_stsb_test", 1, 1, ">=", 0.97, n_of="served pairs"),
    ]}  # fmt: skip
    (results / "other.json").write_text(json.dumps(data))
    block = render(results)
    assert "Against the targets: 1 met, 1 not met." in block
    assert "| throughput_ratio_at_64 | 0.425 | 3000 (requests) | – | >= 0.6 | no |" in block
    assert "| precision_stsb_test | 1 | 1 (served pairs) | 0.2065 to 1 | >= 0.97 | yes (the interval spans the target) |" in block


def test_demo_targets_read_the_shipped_run_beside_learning_off_and_edge_off() -> None:
    def run(saving: float, escalated: int, attempts: int, after: tuple[int, int], kept: tuple[int, int]) -> dict[str, Any]:
        kept_accuracy = {"checked": kept[1], "correct": kept[0], "accuracy": kept[0] / kept[1] if kept[1] else None}
        edge = {"all": {"attempts": attempts, "escalated": escalated, "kept_accuracy": kept_accuracy},
                "after": 50, "after_first": {"escalated": after[0], "attempts": after[1]}}
        return {"edge_net_saving_usd": saving, "edge": edge, "upstream_ttft_ms": {"n": 60, "p50": 1000.0}}

    data = {"edge_runs": {"edge_off": run(0.0, 0, 0, (0, 0), (0, 0)), "learning_off": run(-1e-4, 150, 150, (110, 110), (0, 0)),
                          "shipped": run(2e-6, 9, 12, (1, 4), (2, 3))},
            "edge_comparison": {"learning_off": {"upstream_ttft_p50_vs_edge_off": 1.3}, "shipped": {"upstream_ttft_p50_vs_edge_off": 1.04}}}
    records = {r["figure"]: r for r in builder_for("demo")(data)}
    assert records["edge_net_saving_usd"]["met"] is True and "150/150 escalated" in records["edge_net_saving_usd"]["note"]
    share = records["escalated_share_after_first_50"]
    assert (share["value"], share["k"], share["n"], share["met"]) == (0.25, 1, 4, True)
    assert records["upstream_ttft_p50_vs_edge_off"]["met"] is True
    assert records["edge_kept_accuracy_minus_learning_off"]["met"] is None  # nothing kept without learning
    alone = builder_for("demo")({"totals": {}})  # the shipped run alone: nothing to compare, no verdict
    assert [r["met"] for r in alone] == [None] * 3 and all("not exercised" in r["status"] for r in alone)
