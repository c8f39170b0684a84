"""Held-out quality of the shipped router, per source -> bench/results/router.json (+ PNG).

Sources: MMLU subjects and AlpacaEval sources that training and selection never saw (listed in
the artifact manifest). Reports APGR/AUC/CPT per source, mean within-subject AUC, whether a
target strong share picked on the selection curve is met on held-out data, and what the
shipped default policy (policies/defaults/router.yaml) delivers.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._verdicts import verdicts
from policies.policy import Policy
from policies.router import RoutePolicy, Router
from policies.router.data import default_cache_dir, shared_data_dir
from policies.router.evaluate import evaluate_router

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent


def _share(checks: list[dict[str, Any]], value: float) -> float | None:
    for row in checks:
        if row["mode"] == "max_strong_share" and row["value"] == value:
            return float(row["test_strong_share"])
    return None


def _source_row(r: dict[str, Any]) -> dict[str, Any]:
    checks = r.get("target_checks", [])
    return {
        "rows": r["rows"], "apgr": r["apgr"], "auc": r["auc"], "cpt50": r["cpt50"],
        "mean_within_group_auc": r["mean_within_group_auc"],
        "share_at_target_0.3": _share(checks, 0.3), "share_at_target_0.5": _share(checks, 0.5),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=None)
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--cache", type=Path, default=None, help="embedding cache dir (default: .tierlane/cache/router)")
    parser.add_argument("--out", type=Path, default=RESULTS / "router.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "router_quality.png")
    args = parser.parse_args()
    data = shared_data_dir(args.data)
    if not (data / "router").is_dir():
        print(f"router_quality: no router data under {data}; pass --data or set TIERLANE_SHARED_DATA", file=sys.stderr)
        return 2
    router = Router.load(args.artifact)
    # The threshold the shipped default policy resolves to for a tenant without overrides.
    policy = Policy.load()
    rules = RoutePolicy(policy, router).rules(None, None)
    report = evaluate_router(router, data, args.cache or default_cache_dir(), plot=args.plot, threshold=rules.threshold)
    manifest = router.manifest
    mmlu, alpaca = report["mmlu"], report["alpaca"]
    pooled = report.get("pooled_target_checks", [])
    errors = {f"{src}_{v}": round(s - v, 4)
              for src, checks in (("mmlu", mmlu.get("target_checks", [])), ("alpaca", alpaca.get("target_checks", [])),
                                  ("pooled", pooled))
              for v in (0.3, 0.5) if (s := _share(checks, v)) is not None}
    split = manifest.get("split", {})
    at_default = {"target": rules.target, "threshold": round(rules.threshold, 6),
                  "mmlu_share": mmlu["at_default_policy"]["strong_share"], "mmlu_pgr": mmlu["at_default_policy"]["pgr"],
                  "alpaca_share": alpaca["at_default_policy"]["strong_share"],
                  "alpaca_pgr": alpaca["at_default_policy"]["pgr"]}
    plot = str(args.plot.relative_to(REPO)) if args.plot.is_relative_to(REPO) else str(args.plot)
    result: dict[str, Any] = {
        "what": "shipped router on held-out MMLU subjects and held-out AlpacaEval sources (never used for "
                "training, selection or calibration)",
        "generated_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": report["model"],
        "targets": {"apgr_mmlu": ">= 0.65", "apgr_alpaca": ">= 0.62", "strong_share_error": "within +-0.05"},
        "split": {"mmlu_test_subjects": len(split.get("test_subjects", [])),
                  "alpaca_test_sources": "+".join(split.get("alpaca_test_sources", [])),
                  "selection": "GroupKFold out-of-fold on dev subjects/sources"},
        "held_out_mmlu": _source_row(mmlu),
        "held_out_alpaca": _source_row(alpaca),
        "strong_share_error": errors,
        "at_default_policy": at_default,
        "labels": {"mmlu": f"weak {manifest['data']['weak_model']} wrong, strong {manifest['data']['strong_model']} right",
                   "alpaca": f"weak {manifest['data']['alpaca_weak_model']} vs reference "
                             f"{manifest['data']['alpaca_strong_model']} (judge win probability)"},
        "random_baseline": {"apgr": 0.5, "cpt50": 0.5, "cpt80": 0.8},
        "math_levels": {k: v for k, v in (manifest.get("metrics", {}).get("math_levels") or {}).items()
                        if not isinstance(v, dict)},
        "everyday": manifest.get("metrics", {}).get("everyday"),
        "plot": plot,
        "detail": {"held_out": report,
                   "selection_candidates": {c["name"]: c["selection"] for c in manifest.get("candidates", [])}},
    }
    result["verdicts"] = verdicts("router", result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: result[k] for k in ("held_out_mmlu", "held_out_alpaca", "strong_share_error", "at_default_policy")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
