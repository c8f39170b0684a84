"""The router by leave-one-family-out, with and without the MATH difficulty signal -> bench/results/router_lofo.json.

Every family in turn is left out of training and scored by a router fitted on the rest: the four
MMLU subject groups (STEM, humanities, social sciences, other; APGR on the weak/strong labels),
the five AlpacaEval sources (APGR on the judge's preferences), and the seven MATH types (no
weak/strong label there: how well the score ranks level 4-5 problems above level 1-2, AUC).
Two recipes side by side, fitted the same way (policies/router/train.py, `fit_candidate`):

- `without_math`: the shipped router's candidate with no MATH rows (`math_weight` 0);
- `with_math`: the same with MATH level 4-5 rows as positives and 1-2 as negatives at weight 0.3
  (the trainer's `math_weight`), from every MATH type but the held-out one.

Selection-fold APGR cannot see what MATH rows do (no MATH row has a weak/strong label); this asks
what they do on families never trained on.

    HF_HUB_OFFLINE=1 python bench/router_lofo.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import write
from bench._verdicts import verdicts
from policies.router.artifact import default_artifact_dir
from policies.router.calibration import random_apgr
from policies.router.candidates import decision, default_candidates, fit_candidate
from policies.router.data import default_cache_dir, shared_data_dir
from policies.router.evaluate import routing_metrics
from policies.router.train import MATH_SAMPLE, MATH_SEED, Corpus, assemble, load_corpus, math_level_auc

SEED = 13
MATH_WEIGHT = 0.3
MMLU_GROUPS = {
    "stem": "abstract_algebra anatomy astronomy college_biology college_chemistry college_computer_science college_mathematics "
            "college_physics computer_security conceptual_physics electrical_engineering elementary_mathematics "
            "high_school_biology high_school_chemistry high_school_computer_science high_school_mathematics "
            "high_school_physics high_school_statistics machine_learning",
    "humanities": "formal_logic high_school_european_history high_school_us_history high_school_world_history "
                  "international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy prehistory "
                  "professional_law world_religions",
    "social_sciences": "econometrics high_school_geography high_school_government_and_politics high_school_macroeconomics "
                       "high_school_microeconomics high_school_psychology human_sexuality professional_psychology "
                       "public_relations security_studies sociology us_foreign_policy",
    "other": "business_ethics clinical_knowledge college_medicine global_facts human_aging management marketing "
             "medical_genetics miscellaneous nutrition professional_accounting professional_medicine virology",
}


def math_types(data: Path) -> np.ndarray:
    """The MATH type of each row of the trainer's MATH sample (same filter and order as load_math / math_sample)."""
    rows = [json.loads(line) for line in (data / "router" / "math_levels.jsonl").read_text().splitlines() if line.strip()]
    types = [r["type"] for r in rows if str(r.get("level", "")).removeprefix("Level ").strip().isdigit()]
    keep = np.sort(np.random.RandomState(MATH_SEED).permutation(len(types))[:MATH_SAMPLE])
    return np.asarray([types[i] for i in keep])


def recipes() -> dict[str, Any]:
    manifest = json.loads((default_artifact_dir() / "manifest.json").read_text())
    shipped = next(c for c in default_candidates() if c.name == manifest["model"]["name"])
    return {"without_math": dataclasses.replace(shipped, name=f"{shipped.name} without MATH rows", math_weight=0.0),
            "with_math": dataclasses.replace(shipped, name=f"{shipped.name} with MATH rows", math_weight=MATH_WEIGHT)}


def without_math_type(c: Corpus, types: np.ndarray, held: str | None) -> Corpus:
    keep = types != held
    return dataclasses.replace(c, math_emb=c.math_emb[keep], math_txt=c.math_txt[keep], math_level=c.math_level[keep])


def _mean(rows: dict[str, dict[str, Any]], prefix: str, key: str) -> float:
    """The mean of `key` over the held-out families named `prefix...` (each family weighs one)."""
    values = [r[key] for k, r in rows.items() if k.startswith(prefix) and r.get(key) is not None]
    return round(float(np.mean(values)), 4)


def run() -> dict[str, Any]:
    data = shared_data_dir(None)
    c = load_corpus(data, default_cache_dir())
    types = math_types(data)
    assert len(types) == len(c.math_level), (len(types), len(c.math_level))
    m_all, a_all = np.arange(len(c.mmlu.prompts)), np.arange(len(c.alpaca.prompts))
    subjects = c.mmlu.subjects.astype(str)
    known = {s for names in MMLU_GROUPS.values() for s in names.split()}
    missing = sorted(set(subjects.tolist()) - known)
    if missing:
        raise SystemExit(f"MMLU subjects in no group: {missing}")
    folds: list[tuple[str, str]] = ([("mmlu", g) for g in MMLU_GROUPS] + [("alpaca", s) for s in sorted(set(c.alpaca.subjects.tolist()))]
                                    + [("math", t) for t in sorted(set(types.tolist()))])  # fmt: skip
    out: dict[str, Any] = {name: {} for name in recipes()}
    with tqdm(total=len(folds) * len(out), desc="leave-one-family-out fits", unit="fit") as bar:
        for name, cand in recipes().items():
            for source, family in folds:
                began = time.perf_counter()
                if source == "mmlu":
                    held = np.isin(subjects, MMLU_GROUPS[family].split())
                    fitted = fit_candidate(cand, assemble(cand, c, m_all[~held], a_all), SEED)
                    scores = decision(fitted, c.emb[held], c.txt[held])
                    metrics = routing_metrics(scores, c.mmlu.take(np.flatnonzero(held)))
                    row = {"rows": int(held.sum()), "apgr": metrics["apgr"], "auc": metrics["auc"]}
                elif source == "alpaca":
                    held = c.alpaca.subjects.astype(str) == family
                    fitted = fit_candidate(cand, assemble(cand, c, m_all, a_all[~held]), SEED)
                    scores = decision(fitted, c.alpaca_emb[held], c.alpaca_txt[held])
                    metrics = routing_metrics(scores, c.alpaca.take(np.flatnonzero(held)))
                    row = {"rows": int(held.sum()), "apgr": metrics["apgr"], "auc": metrics["auc"]}
                else:
                    held = types == family
                    fitted = fit_candidate(cand, assemble(cand, without_math_type(c, types, family), m_all, a_all), SEED)
                    scores = decision(fitted, c.math_emb[held], c.math_txt[held])
                    row = {"rows": int(held.sum()), "level45_vs_12_auc": round(math_level_auc(scores, c.math_level[held]), 4)}
                row["seconds"] = round(time.perf_counter() - began, 1)
                out[name][f"{source}:{family}"] = row
                bar.update(1)
    summary = {name: {"mmlu_mean_apgr": _mean(rows, "mmlu:", "apgr"), "alpaca_mean_apgr": _mean(rows, "alpaca:", "apgr"),
                      "math_mean_level_auc": _mean(rows, "math:", "level45_vs_12_auc")} for name, rows in out.items()}
    return {
        "what": "the router's recipe by leave-one-family-out: MMLU subject groups and AlpacaEval sources (APGR), MATH "
                "types (level 4-5 vs 1-2 AUC), with and without MATH difficulty rows in training",
        "setup": {"recipes": {k: dataclasses.asdict(v) for k, v in recipes().items()}, "seed": SEED,
                  "mmlu_groups": {k: v.split() for k, v in MMLU_GROUPS.items()}, "random_apgr": random_apgr(),
                  "math_rows": int(len(types)), "math_sample_seed": MATH_SEED},
        "families": out,
        "summary": summary,
    }


def main() -> int:
    body = run()
    body["targets"] = {"held_out_gain": "a recipe is kept where it helps on held-out families"}
    body["verdicts"] = verdicts("router_lofo", body)
    print(json.dumps(body["summary"], indent=1))
    print(write("router_lofo", body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
