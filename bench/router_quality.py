"""Held-out quality of the shipped router: AUC, APGR, CPT(50%/80%) vs random and oracle -> bench/results/router.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from policies.router import Router
from policies.router.data import default_cache_dir, shared_data_dir
from policies.router.evaluate import evaluate_router

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--artifact", type=Path, default=None)
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "router.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "router_quality.png")
    args = parser.parse_args()
    data = shared_data_dir(args.data)
    if not (data / "router").is_dir():
        print(f"router_quality: no router data under {data}; pass --data or set TIERLANE_SHARED_DATA", file=sys.stderr)
        return 2
    router = Router.load(args.artifact)
    report = evaluate_router(router, data, default_cache_dir(), plot=args.plot)
    manifest = router.manifest
    result = {
        "what": "shipped router on MMLU subjects held out from training (label: weak wrong and strong right)",
        "targets": {"apgr": ">= 0.65", "cpt50": "<= 0.35"},
        "held_out": report,
        "random_baseline": {"apgr": 0.5, "cpt50": 0.5, "cpt80": 0.8},
        "all_subjects_cv": manifest.get("metrics", {}).get("all_subjects_cv"),
        "candidates_held_out": {c["name"]: {k: c["test"][k] for k in ("auc", "apgr", "cpt50", "cpt80")}
                                for c in manifest.get("candidates", [])},
        "candidates_dev_oof": {c["name"]: {k: c["dev_oof"][k] for k in ("auc", "apgr", "cpt50", "cpt80")}
                               for c in manifest.get("candidates", [])},
        "math_levels": manifest.get("metrics", {}).get("math_levels"),
        "everyday": manifest.get("metrics", {}).get("everyday"),
        "plot": str(args.plot.relative_to(RESULTS.parent.parent)) if args.plot.is_relative_to(RESULTS.parent.parent) else str(args.plot),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: report.get(k) for k in ("auc", "apgr", "cpt50", "cpt80", "mean_within_subject_auc",
                                                 "without_largest_subject")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
