"""Can the static embedding (policies/embedding/static) stand in for all-MiniLM-L6-v2, reader by reader?

-> bench/results/static_embedding.json, each figure side by side with the transformer's:

- cost: ms per text at batch 1 on this machine, the static table against the gateway's ONNX MiniLM.
- cache: the test split of the cache pairs (policies/cache/verifier_data.py). Per source, every
  test text is a stored entry; each positive pair's first text searches them. Recall of the true
  partner among the top-4 candidates; "past the gate": also past the cosine gate, today's being
  MiniLM >= cache.threshold, the two-stage one being static top-4 past a loose static gate (the
  1st percentile of the static cosine of selection-split positives that MiniLM admits) *and*
  MiniLM >= cache.threshold, the transformer then running only for the candidates that got
  through. Average precision of the raw cosine on the labelled test pairs for both.
- router: copies of the router retrained on static features (policies/router/train.py, the same
  folds and held-out subjects/sources): the shipped candidate alone, and the whole selection over
  every candidate as the shipped artifact was chosen; held-out APGR beside the shipped artifact's.
  The shipped artifact is not touched.
- edge prior: the edge model's answers to the probe set (policies/edge_quality/runner.py, cached),
  the calibration refitted (calibrate.fit_and_report, nothing written) on MiniLM and on static
  vectors; held-out prior AUROC side by side.

Per reader: whether static is within 0.01 of the transformer's figures or better, and what the
gateway reads as shipped (a reader moves only with its artifact refitted on static features).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/static_embedding.py [--parts cost,cache,router,edge]

Parts run separately update their own keys of an existing result file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._harness import machine  # noqa: E402
from bench._verdicts import verdicts  # noqa: E402
from policies.embedding.static import ARTIFACT_DIR, StaticEmbedding  # noqa: E402

RESULTS = REPO / "bench" / "results"
SOURCES = ("qqp", "stsb", "gptcache")
TOLERANCE = 0.01
TOP_K = 4
GATE_QUANTILE = 0.01
PARTS = ("cost", "cache", "router", "edge")


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered) * 1e3, 4), "p90": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 4),
            "mean": round(statistics.fmean(ordered) * 1e3, 4), "n": len(ordered)}  # fmt: skip


def _per_text(encode: Any, texts: list[str], label: str) -> dict[str, float]:
    encode(texts[:5])  # warm-up
    times = []
    for text in tqdm(texts, desc=f"cost {label}", unit="text", mininterval=2.0):
        t0 = time.perf_counter()
        encode([text])
        times.append(time.perf_counter() - t0)
    return _ms(times)


def part_cost(static: StaticEmbedding, texts: list[str]) -> dict[str, Any]:
    from policies.embedding.embedder import load_encoder

    onnx = load_encoder("onnx", threads=1)
    return {
        "texts": len(texts),
        "mean_chars": round(statistics.fmean(len(t) for t in texts), 1),
        "static_ms_per_text": _per_text(static.encode, texts, "static"),
        "transformer_ms_per_text": _per_text(onnx.encode, texts, onnx.backend) | {"backend": onnx.backend},
    }


def _ap(y: np.ndarray, score: np.ndarray) -> float:
    from sklearn.metrics import average_precision_score

    return round(float(average_precision_score(y, score)), 4)


def _top_k(queries: np.ndarray, corpus: np.ndarray, exclude: np.ndarray, k: int) -> np.ndarray:
    """Indices of each query's k most similar corpus rows, its own text (`exclude`) left out."""
    out = np.empty((len(queries), k), dtype=np.int64)
    for start in range(0, len(queries), 512):
        sims = queries[start : start + 512] @ corpus.T
        sims[np.arange(len(sims)), exclude[start : start + 512]] = -np.inf
        part = np.argpartition(-sims, k, axis=1)[:, :k]
        order = np.take_along_axis(sims, part, axis=1).argsort(axis=1)[:, ::-1]
        out[start : start + 512] = np.take_along_axis(part, order, axis=1)
    return out


def _search(pairs: list[Any], vec: dict[str, np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """For each pair: is its second text among the first text's top-k, and the top-1 cosine."""
    texts = list(dict.fromkeys(t for p in pairs for t in (p.a, p.b)))
    index = {t: i for i, t in enumerate(texts)}
    corpus = np.stack([vec[t] for t in texts])
    queries = np.stack([vec[p.a] for p in pairs])
    own = np.asarray([index[p.a] for p in pairs])
    top = _top_k(queries, corpus, own, k)
    found = np.asarray([index[p.b] in row for p, row in zip(pairs, top)])
    best = np.einsum("ij,ij->i", queries, corpus[top[:, 0]])
    return found, best


def part_cache(static: StaticEmbedding, embeddings: Path) -> dict[str, Any]:
    from policies.cache.config import CacheConfig
    from policies.cache.verifier_data import EmbeddingCache, load_all
    from policies.policy import Policy

    threshold = CacheConfig.from_section(Policy.load().resolve("cache")).threshold
    minilm = EmbeddingCache(embeddings)
    pairs = [p for p in load_all(minilm) if p.a != p.b]
    texts = list(dict.fromkeys(t for p in pairs for t in (p.a, p.b)))
    fast: dict[str, np.ndarray] = {}
    for start in tqdm(range(0, len(texts), 512), desc="static embed (cache pairs)", unit="batch"):
        chunk = texts[start : start + 512]
        fast.update(zip(chunk, static.encode(chunk)))
    slow = {t: minilm.vectors[t] for t in texts}
    cos = {name: np.asarray([float(v[p.a] @ v[p.b]) for p in pairs]) for name, v in (("minilm", slow), ("static", fast))}
    y = np.asarray([p.label for p in pairs])
    split = np.asarray([p.split for p in pairs])
    source = np.asarray([p.source for p in pairs])
    out: dict[str, Any] = {"minilm_threshold": threshold, "top_k": TOP_K, "gate_quantile": GATE_QUANTILE, "sources": {}}
    for src in tqdm(SOURCES, desc="cache search", unit="source"):
        sel = (split == "selection") & (source == src) & (y == 1) & (cos["minilm"] >= threshold)
        gate = float(np.quantile(cos["static"][sel], GATE_QUANTILE))
        test = np.flatnonzero((split == "test") & (source == src))
        test_pairs = [pairs[i] for i in test]
        pos = y[test] == 1
        found_m, best_m = _search(test_pairs, slow, TOP_K)
        found_s, best_s = _search(test_pairs, fast, TOP_K)
        found_s8, _ = _search(test_pairs, fast, 2 * TOP_K)  # a wider static search, for what it recovers
        cm, cs = cos["minilm"][test], cos["static"][test]
        today = found_m & (cm >= threshold)
        two_stage = found_s & (cs >= gate) & (cm >= threshold)
        two_stage8 = found_s8 & (cs >= gate) & (cm >= threshold)
        n_pos = int(pos.sum())
        queries = {p.a: (bm, bs) for p, bm, bs in zip(test_pairs, best_m, best_s)}
        out["sources"][src] = {
            "test_pairs": len(test), "test_positives": n_pos, "static_gate": round(gate, 4),
            "minilm": {"recall_top4": round(float(found_m[pos].mean()), 4), "recall_top4_past_gate": round(float(today[pos].mean()), 4),
                       "k_past_gate": int(today[pos].sum()), "ap_cosine": _ap(y[test], cm),
                       "queries_past_gate_share": round(float(np.mean([bm >= threshold for bm, _ in queries.values()])), 4)},
            "static": {"recall_top4": round(float(found_s[pos].mean()), 4), "recall_top8": round(float(found_s8[pos].mean()), 4),
                       "recall_top4_past_gate": round(float(two_stage[pos].mean()), 4), "k_past_gate": int(two_stage[pos].sum()),
                       "recall_top8_past_gate": round(float(two_stage8[pos].mean()), 4),
                       "ap_cosine": _ap(y[test], cs),
                       "queries_past_gate_share": round(float(np.mean([bs >= gate for _, bs in queries.values()])), 4)},
        }  # fmt: skip
    return out


class _Encoder:
    """The router's Encoder shape (texts -> rows) over the static table."""

    def __init__(self, static: StaticEmbedding) -> None:
        self.static = static

    def __call__(self, texts: list[str]) -> np.ndarray:
        return self.static.encode(list(texts))


def _router_figures(held_out: dict[str, Any]) -> dict[str, Any]:
    return {src: {k: held_out[src].get(k) for k in ("rows", "apgr", "auc", "cpt50", "cpt80")}
            | {"mean_within_group_auc": held_out[src].get("mean_within_subject_auc", held_out[src].get("mean_within_source_auc"))}
            for src in ("mmlu", "alpaca")}  # fmt: skip


def _train_static(static: StaticEmbedding, data: Path, only: list[str]) -> dict[str, Any]:
    """policies/router/train.py's run (nothing written) with the static table where the transformer was."""
    import policies.router.train as router_train

    # Its embedding cache lives apart: the cache key names the model, not the backend.
    cache = REPO / ".tierlane" / "cache" / f"router-static-{static.manifest['model_sha256'][:12]}"
    cfg = router_train.TrainConfig(data_dir=data, cache_dir=cache, out=None, only=only)
    encoder = _Encoder(static)
    started = time.perf_counter()
    with mock.patch.object(router_train, "RuntimeEncoder", lambda: encoder), \
         mock.patch.object(router_train, "DIMENSION", static.dimension):  # fmt: skip
        manifest = router_train.train(cfg)
    chosen = next(c for c in manifest["candidates"] if c["name"] == manifest["model"]["name"])
    return {"model": manifest["model"]["name"], "candidates": len(manifest["candidates"]), "platt_slope": round(manifest["model"]["platt"]["slope"], 4),
            "selection_mean_apgr": chosen["selection"]["mean_apgr"], "train_seconds": round(time.perf_counter() - started, 1),
            **_router_figures(manifest["metrics"]["held_out_test"]), "_split": manifest["split"]}  # fmt: skip


def part_router(static: StaticEmbedding, data: Path, full: bool) -> dict[str, Any]:
    """The shipped candidate retrained on static features, and (`full`) the whole selection run again."""
    shipped = json.loads((REPO / "policies" / "router" / "artifacts" / "manifest.json").read_text(encoding="utf-8"))
    name = shipped["model"]["name"]
    chosen = next(c for c in shipped["candidates"] if c["name"] == name)
    out: dict[str, Any] = {
        "transformer": {"model": name, "source": "policies/router/artifacts/manifest.json (shipped)",
                        "platt_slope": round(shipped["model"]["platt"]["slope"], 4), "selection_mean_apgr": chosen["selection"]["mean_apgr"],
                        **_router_figures(shipped["metrics"]["held_out_test"])},
        "static_same_candidate": _train_static(static, data, [name]),
    }  # fmt: skip
    if full:
        out["static"] = _train_static(static, data, [])
    split = out["static_same_candidate"].pop("_split")
    out.get("static", {}).pop("_split", None)
    out["split"] = {k: split[k] for k in ("seed", "folds", "test_rows", "alpaca_test_rows", "alpaca_test_sources")}
    return out


def _edge_figures(manifest: dict[str, Any]) -> dict[str, Any]:
    m = manifest["metrics"]
    return {
        "held_out_prior_auroc": m["held_out"]["auroc"]["prior"],
        "held_out_confidence_auroc": m["held_out"]["auroc"]["confidence"],
        "calibration_oof_prior_auroc": m["calibration_out_of_fold"]["auroc"]["prior"],
        "leave_one_family_out_prior_auroc": m["held_out_leave_one_family_out"]["auroc"]["prior"],
        "prior_cascade_at_default": {k: m["held_out"]["policies"]["prior_cascade"].get(k)
                                     for k in ("local_precision", "edge_share", "kept")},
        "fit": {k: manifest["fit"]["prior"][k] for k in ("C", "embedding_scale")},
    }  # fmt: skip


def part_edge(static: StaticEmbedding, records_cache: Path, threads: int, limit: int | None) -> dict[str, Any]:
    from policies.artifact_dir import sha256_file
    from policies.edge_quality.calibrate import (
        CalibrationConfig,
        embed,
        embedding_texts,
        fit_and_report,
        limit_probes,
        resolve_model,
    )
    from policies.edge_quality.probes import load_probes
    from policies.edge_quality.runner import run_probes

    shipped = json.loads((REPO / "policies" / "edge_quality" / "artifacts" / "manifest.json").read_text(encoding="utf-8"))
    model = resolve_model(None)
    sha = sha256_file(model)
    probes = limit_probes(load_probes(), limit)
    bar = tqdm(total=len(probes), desc="edge answers (probe set)", unit="probe")
    records = asyncio.run(run_probes(probes, model_path=model, model_sha256=sha, threads=threads, cache=records_cache,
                                     progress=bar.update))  # fmt: skip
    bar.close()
    texts = embedding_texts(probes)
    gguf = {"file": model.name, "sha256": sha, "size": model.stat().st_size}
    config = CalibrationConfig(out=None)
    out: dict[str, Any] = {"probes": len(probes), "held_out": sum(p.split == "held_out" for p in probes),
                           "shipped_held_out_prior_auroc": shipped["metrics"]["held_out"]["auroc"]["prior"]}
    for name, vectors in tqdm((("transformer", lambda: embed(texts, records_cache.parent)), ("static", lambda: static.encode(texts))),
                              desc="edge refits", unit="fit"):  # fmt: skip
        out[name] = _edge_figures(fit_and_report(probes, records, texts, vectors(), config, gguf))
    return out


# What each reader reads in the gateway as shipped. Moving a reader to the static embedding means
# refitting its artifact on static features; these say where the figures would allow it.
SHIPPED_READS = {"cache_candidate_search": "transformer", "router": "transformer", "edge_prior": "transformer"}


def _decision(reader: str, deltas: dict[str, float], within: bool) -> dict[str, Any]:
    return {"deltas": deltas, "static_within_tolerance": within, "reads": SHIPPED_READS[reader]}


def decisions(result: dict[str, Any]) -> dict[str, Any]:
    """Per reader: whether static is within TOLERANCE of the transformer (or better) on every figure."""
    out: dict[str, Any] = {}
    cache = result.get("cache")
    if cache:
        deltas = {f"{src}_{k}": round(s["static"][k] - s["minilm"][k], 4)
                  for src, s in cache["sources"].items() for k in ("recall_top4_past_gate", "ap_cosine")}  # fmt: skip
        out["cache_candidate_search"] = _decision("cache_candidate_search", deltas, min(deltas.values()) >= -TOLERANCE)
    router = result.get("router")
    if router:
        runs = [run for run in ("static", "static_same_candidate") if run in router]
        deltas = {f"{run}_{src}_apgr": round(router[run][src]["apgr"] - router["transformer"][src]["apgr"], 4)
                  for run in runs for src in ("mmlu", "alpaca")}  # fmt: skip
        within = any(min(deltas[f"{run}_{src}_apgr"] for src in ("mmlu", "alpaca")) >= -TOLERANCE for run in runs)
        out["router"] = _decision("router", deltas, within)
    edge = result.get("edge")
    if edge:
        delta = round(edge["static"]["held_out_prior_auroc"] - edge["transformer"]["held_out_prior_auroc"], 4)
        out["edge_prior"] = _decision("edge_prior", {"held_out_prior_auroc": delta}, delta >= -TOLERANCE)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--artifact", type=Path, default=ARTIFACT_DIR)
    parser.add_argument("--data", type=Path, default=None, help="shared data dir (default: ../shared/data)")
    parser.add_argument("--embeddings", type=Path, default=Path("/tmp/tierlane_verifier/emb.npz"),
                        help="MiniLM vectors of the cache pairs (bench/cache_quality.py's cache; filled when missing)")
    parser.add_argument("--router-same-candidate-only", action="store_true",
                        help="retrain only the shipped candidate (default: that and the whole selection, as shipped)")
    parser.add_argument("--edge-cache", type=Path, default=REPO / ".tierlane" / "cache" / "edge_quality" / "records.jsonl")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads for the edge answers")
    parser.add_argument("--edge-limit", type=int, default=None, help="at most this many probes per split (a smoke run)")
    parser.add_argument("--cost-texts", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS / "static_embedding.json")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    from policies.router.data import shared_data_dir

    data = shared_data_dir(args.data)
    static = StaticEmbedding.load(args.artifact)
    result: dict[str, Any] = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    result.update({
        "what": "the static embedding (policies/embedding/static) against all-MiniLM-L6-v2, reader by reader, on held-out data",
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "artifact": {"dimension": static.dimension, "vocabulary": static.vocabulary,
                     "bytes": sum(f.stat().st_size for f in Path(args.artifact).iterdir() if f.is_file()),
                     "distillation": static.manifest.get("distillation")},
        "tolerance": TOLERANCE,
    })  # fmt: skip
    for part in tqdm(parts, desc="parts", unit="part"):
        if part == "cost":
            import random

            from policies.cache.verifier_data import load_stsb

            texts = sorted({t for p in load_stsb() for t in (p.a, p.b)})
            result["cost"] = part_cost(static, random.Random(7).sample(texts, min(args.cost_texts, len(texts))))
        elif part == "cache":
            result["cache"] = part_cache(static, args.embeddings)
        elif part == "router":
            result["router"] = part_router(static, data, full=not args.router_same_candidate_only)
        elif part == "edge":
            result["edge"] = part_edge(static, args.edge_cache, args.threads, args.edge_limit)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result["decision"] = decisions(result)
        result["verdicts"] = verdicts("static_embedding", result)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result.get("decision"), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
