"""The benchmark results pages (docs/results/): rendered whole from the result files, left-over files
removed; the committed pages are the ones the committed result files render, and every target they
name has a verdict recomputed from their own figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench._verdicts import builder_for, holds, rate, speculative_record, target, wilson
from bench.results_readme import PAGES, differences, main, page_of, render_pages

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


def test_pages_are_written_then_rewritten_and_left_over_files_removed(tmp_path: Path) -> None:
    results = _results(tmp_path)
    (results / "other_chart.png").write_bytes(b"\x89PNG chart")
    out = tmp_path / "docs" / "results"
    assert main(["--out", str(out), "--results", str(results), "--check"]) == 1  # nothing there yet
    assert main(["--out", str(out), "--results", str(results)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([*(f"{page}.md" for page in PAGES), "index.md", "other_chart.png"])
    gateway = (out / "gateway.md").read_text()
    assert gateway.startswith(f"# {PAGES['gateway'][0]}\n")
    assert "## proxy_overhead" in gateway and "| 1 | 0.5 | 1.5 | 1 | 3 | 900 | 500 | 0.55 |" in gateway
    assert "| score | 0.91 |" in gateway and "## broken" not in gateway
    assert "![other_chart.png](other_chart.png)" in gateway.split("## other")[1]
    assert (out / "other_chart.png").read_bytes() == b"\x89PNG chart"
    assert "[proxy_overhead](gateway.md#proxy_overhead)" in (out / "index.md").read_text()
    assert "No result file renders on this page yet." in (out / "fleet.md").read_text()
    (out / "stale.md").write_text("left over")
    (results / "other.json").write_text(json.dumps({"benchmark": "other", "score": 0.5}))
    assert main(["--out", str(out), "--results", str(results), "--check"]) == 1
    assert differences(out, render_pages(results)) == ["gateway.md", "stale.md"]
    assert main(["--out", str(out), "--results", str(results)]) == 0
    assert "| score | 0.5 |" in (out / "gateway.md").read_text() and not (out / "stale.md").exists()
    assert main(["--out", str(out), "--results", str(results), "--check"]) == 0


def test_each_bench_goes_to_the_page_of_its_group() -> None:
    assert page_of("prefix_affinity") == "fleet" and page_of("shared_state") == "fleet"
    assert page_of("edge_models") == "edge" and page_of("edge_escalation_ttfb_c16") == "edge"
    assert page_of("agreement_judge") == "routing" and page_of("router_lofo") == "routing"
    assert page_of("agent_sessions") == "agents" and page_of("cache_error_bound") == "cache"
    assert page_of("metering_overhead_sampled_0.1") == "gateway" and page_of("a_new_bench") == "gateway"


def test_the_navigation_lists_every_results_page() -> None:
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    for page in ["index", *PAGES]:
        assert f"results/{page}.md" in nav, f"mkdocs.yml's nav does not list results/{page}.md"


def test_committed_results_pages_are_the_ones_the_result_files_render() -> None:
    stale = differences(REPO / "docs" / "results", render_pages(RESULTS))
    assert not stale, f"docs/results/ is out of date ({', '.join(stale)}): run bench/results_readme.py"


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
    block = render_pages(results)["gateway.md"]
    assert isinstance(block, str)
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
