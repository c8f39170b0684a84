"""bench/peers.py: figures per round, reported as the median and spread; ratios within each round."""

from __future__ import annotations

from typing import Any

from bench._verdicts import builder_for
from bench.peers import median_and_spread, round_ratios, verdict
from bench.results_readme import render_peers


def _round(direct_p99: float, pt_p99: float, ll_p99: float, pt_rps: float, ll_rps: float, full_rps: float) -> dict[str, Any]:
    def fig(p50: float, p99: float, rps: float) -> dict[str, Any]:
        return {"p50_ms": p50, "p99_ms": p99, "rps": rps, "errors": 0, "n": 100}

    r = {"direct": fig(1.0, direct_p99, 3000.0), "tierlane_passthrough": fig(2.0, pt_p99, pt_rps),
         "tierlane_full": fig(10.0, 20.0, full_rps), "litellm": fig(8.0, ll_p99, ll_rps)}
    for name in ("tierlane_passthrough", "tierlane_full", "litellm"):
        r[name]["added_p50_ms"] = r[name]["p50_ms"] - 1.0
        r[name]["added_p99_ms"] = r[name]["p99_ms"] - direct_p99
    return r


ROUNDS = [
    _round(5.0, 6.0, 105.0, 2000.0, 100.0, 300.0),  # pass-through +1 vs LiteLLM +100: 0.01
    _round(5.0, 25.0, 105.0, 1500.0, 150.0, 450.0),  # a slow round: +20 vs +100: 0.2
    _round(4.0, 7.0, 54.0, 1800.0, 120.0, 240.0),  # +3 vs +50: 0.06
]


def test_each_figure_is_the_median_over_the_rounds_with_its_spread() -> None:
    pt = median_and_spread([r["tierlane_passthrough"] for r in ROUNDS])
    assert pt["added_p99_ms"] == 3.0 and pt["spread"]["added_p99_ms"] == [1.0, 20.0]
    assert pt["rps"] == 1800.0 and pt["spread"]["rps"] == [1500.0, 2000.0]
    assert (pt["n"], pt["errors"]) == (300, 0)


def test_ratios_are_taken_within_each_round_then_their_median() -> None:
    ratios = round_ratios(ROUNDS)
    # per round 0.01, 0.2, 0.06: the median of the ratios, not the ratio of the medians (3 / 100 = 0.03)
    assert ratios["passthrough_added_p99_vs_litellm"] == {"median": 0.06, "spread": [0.01, 0.2]}
    assert ratios["passthrough_rps_vs_litellm"] == {"median": 15.0, "spread": [10.0, 20.0]}
    assert ratios["full_pipeline_rps_vs_litellm"]["median"] == 3.0

    results = {"concurrency_16": {"rounds": 3, **{n: median_and_spread([r[n] for r in ROUNDS]) for n in ROUNDS[0]},
                                  "ratios": ratios}}
    v = verdict(results)["concurrency_16"]
    assert v["passthrough_added_p99_vs_litellm"] == 0.06 and v["met"]["passthrough_added_p99"] is True
    assert v["met"]["passthrough_rps"] is True and v["met"]["full_pipeline_rps"] is True

    records = builder_for("peers")({"requests_per_target": 300, "results": results, "verdict": verdict(results)})
    first = records[0]
    assert first["figure"] == "passthrough_added_p99_vs_litellm_at_16" and first["met"] is True
    assert first["spread"] == [0.01, 0.2] and first["rounds"] == 3 and "median of 3 rounds" in first["note"]

    table = "\n".join(render_peers({"results": results}))
    assert "| 16 | tierlane_passthrough | 1 (1 to 1) | 3 (1 to 20) |" in table
    assert "| 16 | 3 | 0.06 (0.01 to 0.2) | 15 (10 to 20) |" in table
