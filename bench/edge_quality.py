"""Held-out quality of the edge lane's calibration -> bench/results/edge_quality.json.

Offline part: the edge engine answers the shipped probe set's *held-out* split (never used to fit
or to choose thresholds) and ARC validation questions from ../shared/data/quality (skipped, with
a message, when that directory is absent). For each item the shipped calibration gives a prior
(before generation) and a confidence (after); `policies.edge_quality.evaluate.full_report`
turns the per-item records into: edge accuracy per family, AUROC per signal, and local
precision / local recall / edge share / overall accuracy (upstream assumed right on what it
gets) at the shipped default thresholds for "prior only", "cascade only", "prior + cascade" and
"random at the same edge share". A through-the-gateway run can feed its own records to the
same function.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._harness import write  # noqa: E402
from bench._verdicts import verdicts  # noqa: E402
from policies.edge_quality.calibrate import embed, embedding_texts, resolve_model  # noqa: E402
from policies.edge_quality.evaluate import ItemOutcome, full_report, token_signals  # noqa: E402
from policies.edge_quality.model import EdgeCalibration  # noqa: E402
from policies.edge_quality.probes import _MC_TEMPLATES, Probe, load_probes  # noqa: E402
from policies.edge_quality.runner import EdgeRecord, run_probes  # noqa: E402

ARC_FILES = (("arc_easy", "arc_easy_validation.jsonl"), ("arc_challenge", "arc_challenge_validation.jsonl"))


def arc_validation_probes(data_dir: Path, per_file: int | None, seed: int = 7) -> list[Probe]:
    """ARC validation questions as multiple-choice probes (any phrasing of the probe set, seeded)."""
    rng = random.Random(seed)
    out: list[Probe] = []
    for family, name in ARC_FILES:
        path = data_dir / "quality" / name
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        rows = [r for r in rows if list(r["choices"]["label"]) == ["A", "B", "C", "D"]]
        rows.sort(key=lambda r: str(r["id"]))
        rng.shuffle(rows)
        for r in rows[:per_file] if per_file else rows:
            opts = "\n".join(f"{lab}. {text}" for lab, text in zip("ABCD", r["choices"]["text"]))
            prompt = rng.choice(_MC_TEMPLATES).format(q=r["question"], opts=opts)
            out.append(Probe(f"{family}/{r['id']}", family, family, 1, "arc_validation", prompt, "choice", r["answerKey"],
                             choices=tuple(r["choices"]["text"])))
    return out


def outcomes(calibration: EdgeCalibration, records: list[EdgeRecord], texts: list[str], vectors: np.ndarray) -> list[ItemOutcome]:
    """Per-item records scored with the calibration's own code path."""
    priors = calibration.prior_batch(texts, vectors)
    items = []
    for rec, prior in zip(records, priors):
        conf = calibration.confidence_from_arrays(float(prior), rec.logprobs, rec.entropies, rec.finish_reason)
        items.append(ItemOutcome(rec.family, rec.correct, float(prior), conf, token_signals(rec.logprobs, rec.entropies, rec.finish_reason)))
    return items


def figures(items: list[ItemOutcome], calibration: EdgeCalibration) -> dict[str, Any]:
    d = calibration.defaults
    return full_report(items, {"gate": d.gate, "confidence": d.confidence, "prior_only": d.prior_only})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=None, help="calibration dir (default: the shipped one)")
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the bundled model)")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--arc-per-file", type=int, default=150, help="ARC validation questions per file (0: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=REPO / ".tierlane" / "cache" / "edge_quality" / "records.jsonl")
    parser.add_argument("--out", default="edge_quality")
    parser.add_argument("--gateway-tasks", type=int, default=450,
                        help="of these tasks, how many also go through running gateways (0: skip that part)")
    args = parser.parse_args()

    calibration = EdgeCalibration.load(args.artifact)
    model = resolve_model(args.model)
    if not calibration.matches(model):
        print(f"edge_quality: the calibration was measured on {calibration.gguf_name}, not {model.name}", file=sys.stderr)
        return 2
    sets: dict[str, list[Probe]] = {"held_out_probes": load_probes(split="held_out")}
    if (args.data / "quality").is_dir():
        sets["arc_validation"] = arc_validation_probes(args.data, args.arc_per_file or None)
    else:
        print(f"edge_quality: {args.data / 'quality'} absent; ARC validation skipped", file=sys.stderr)
    probes = [p for group in sets.values() for p in group]
    bar = tqdm(total=len(probes), desc="edge answers", unit="probe")
    started = time.perf_counter()
    records = asyncio.run(run_probes(probes, model_path=model, model_sha256=calibration.gguf_sha256, threads=args.threads,
                                     cache=args.cache, progress=bar.update))
    bar.close()
    texts = embedding_texts(probes)
    vectors = embed(texts, args.cache.parent)
    items = outcomes(calibration, records, texts, vectors)
    by_id = dict(zip([p.id for p in probes], items))
    report: dict[str, Any] = {
        "artifact": {"gguf": calibration.gguf_name, "model_sha256": calibration.manifest.get("model_sha256"),
                     "probe_set": calibration.manifest.get("probe_set")},
        # null: no threshold meets the target (nothing is kept local by that stage)
        "thresholds": {k: (None if math.isinf(v) else v) for k, v in asdict(calibration.defaults).items()},
        "seconds": round(time.perf_counter() - started, 1),
        "sets": {name: figures([by_id[p.id] for p in group], calibration) for name, group in sets.items()},
    }
    if len(sets) > 1:
        report["sets"]["all"] = figures(items, calibration)
    if args.gateway_tasks:
        # Through running gateways (model `auto`, an upstream that answers right), the held-out
        # probes first, then ARC validation questions, up to --gateway-tasks.
        from bench.edge_quality_gateway import evaluate

        tasks = probes[: args.gateway_tasks]
        run = asyncio.run(evaluate(tasks, concurrency=8))
        report["gateway"] = {k: v for k, v in run.items() if k != "records"}
        report["gateway"]["tasks"] = {name: sum(p.id in {q.id for q in group} for p in tasks) for name, group in sets.items()}
    report["verdicts"] = verdicts("edge_quality", report)
    path = write(args.out, report)
    summary = {name: {"edge_accuracy": r["edge_accuracy"], "prior_cascade": r["policies"]["prior_cascade"]}
               for name, r in report["sets"].items()}
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
