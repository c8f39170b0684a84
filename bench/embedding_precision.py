"""Can the int8 embedding graph serve in place of float32, reader by reader, with the shipped artifacts?

-> bench/results/embedding_precision.json. The router, the edge prior and the cache's
calibration were fitted on float32 all-MiniLM-L6-v2 vectors; here each reads int8 vectors
(policies/embedding/onnx_encoder.py `quantize`) instead, artifacts unchanged, on data none of them was
tuned on, each figure beside its float32 value on the same rows:

- cost: ms per text at batch 1 (median, the two graphs alternating) and CPU ms per text in
  batches of 16, on STS-B sentences; and whether an int8 vector moves with the texts batched
  beside it (it should not: activations are quantised per token): cosine alone vs in a batch.
- gateway: the full pipeline (bench/peers.py's config: cache miss + router, edge off) with each
  precision, req/s at 16 in flight on unique prompts, the two gateways alternating over rounds.
- agreement: cosine of int8 to float32 vectors of the same texts (held-out router prompts).
- router: held-out APGR and AUC of the shipped router (policies/router/artifacts), whole held-out
  MMLU subjects and AlpacaEval sources.
- edge prior: held-out AUROC of the shipped calibration's prior (the probe set's held-out split;
  the edge model's answers come from the calibration's record cache, run when missing).
- cache: the labelled test pairs, each as one lookup (past the gate, no rule veto, the verifier
  at the shipped min_probability): true and false hits; and bench/cache_error_bound.py's replay
  (test split, real SemanticCache, shipped verifier) with the shipped policy and with
  `max_error_rate` 0.02: served error and semantic hits. The workload is built once (float32);
  only the cache's own vectors change, and with them the verifier and blend fitted for them
  (policies/cache/blend_refit.py).

The verdict per reader: int8 within 0.01 of float32 or better (served error: not above the bound).
The cache's semantic hit rate is also compared relative to float32's: its base rate is small
(~5 % of queries), so 0.01 absolute would let a fifth of the semantic hits go.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/embedding_precision.py [--parts cost,router,edge,cache]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._harness import machine  # noqa: E402
from bench._verdicts import verdicts  # noqa: E402
from policies.embedding.embedder import PRECISIONS, load_encoder  # noqa: E402

RESULTS = REPO / "bench" / "results"
TOLERANCE = 0.01
PARTS = ("cost", "router", "edge", "cache", "gateway")


def encoders(threads: int | None = 1) -> dict[str, Any]:
    return {p: load_encoder("onnx", threads=threads, precision=p) for p in PRECISIONS}


def _encode(encoder: Any, texts: list[str], desc: str) -> np.ndarray:
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = np.empty((len(texts), 384), dtype=np.float32)
    for start in tqdm(range(0, len(order), 64), desc=desc, unit="batch", leave=False):
        rows = order[start : start + 64]
        out[rows] = encoder.encode([texts[i] for i in rows])
    return out


def part_cost(n: int) -> dict[str, Any]:
    from policies.cache.verifier_data import load_stsb

    texts = random.Random(7).sample(sorted({t for p in load_stsb() for t in (p.a, p.b)}), n)
    encs = encoders()
    for e in encs.values():
        e.encode(texts[:4])
    single: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for text in tqdm(texts, desc="cost: batch 1", unit="text"):
        for p, e in encs.items():
            t0 = time.perf_counter()
            e.encode([text])
            single[p].append((time.perf_counter() - t0) * 1000)
    batched = {}
    for p, e in encs.items():
        t0 = time.process_time()
        for start in range(0, len(texts), 16):
            e.encode(texts[start : start + 16])
        batched[p] = round((time.process_time() - t0) * 1000 / len(texts), 3)
    out = {p: {"batch1_ms_p50": round(statistics.median(single[p]), 3), "batch16_cpu_ms_per_text": batched[p]} for p in PRECISIONS}
    out["int8_vs_fp32"] = {"batch1_ms_p50": round(out["int8"]["batch1_ms_p50"] / out["fp32"]["batch1_ms_p50"], 3),
                           "batch16_cpu_ms_per_text": round(batched["int8"] / batched["fp32"], 3)}  # fmt: skip
    out["texts"] = len(texts)
    int8 = encs["int8"]
    alone = np.stack([int8.encode([t])[0] for t in tqdm(texts, desc="cost: int8 alone", unit="text")])
    shuffled = random.Random(5).sample(texts, len(texts))
    batched = dict(zip(shuffled, int8.encode(shuffled)))
    cos = (alone * np.stack([batched[t] for t in texts])).sum(1)
    out["int8_alone_vs_batched_cosine"] = {"min": round(float(cos.min()), 4), "p01": round(float(np.quantile(cos, 0.01)), 4),
                                           "median": round(float(np.median(cos)), 4)}  # fmt: skip
    return out


def part_router(data: Path) -> dict[str, Any]:
    from policies.router import Router
    from policies.router.data import default_cache_dir, runtime_text
    from policies.router.evaluate import held_out_alpaca, held_out_data, routing_metrics

    router = Router.load()
    int8 = encoders()["int8"]
    out: dict[str, Any] = {"artifact": router.manifest["model"]["name"]}
    cosines = []
    for name, (test, fp32) in (("mmlu", held_out_data(router, data, default_cache_dir())),
                               ("alpaca", held_out_alpaca(router, data, default_cache_dir()))):  # fmt: skip
        q = _encode(int8, [runtime_text(p) for p in test.prompts], f"router {name}: int8")
        cosines.append((q * fp32).sum(1))
        figures = {}
        for p, vectors in (("fp32", fp32), ("int8", q)):
            m = routing_metrics(router.score_batch(test.prompts, vectors), test)
            figures[p] = {k: m[k] for k in ("rows", "apgr", "auc")}
        figures["apgr_delta"] = round(figures["int8"]["apgr"] - figures["fp32"]["apgr"], 4)
        figures["auc_delta"] = round(figures["int8"]["auc"] - figures["fp32"]["auc"], 4)
        out[name] = figures
    cos = np.concatenate(cosines)
    out["cosine_int8_vs_fp32"] = {"texts": int(len(cos)), "min": round(float(cos.min()), 4),
                                  "p01": round(float(np.quantile(cos, 0.01)), 4), "median": round(float(np.median(cos)), 4)}  # fmt: skip
    return out


def part_edge(records_cache: Path, threads: int) -> dict[str, Any]:
    from policies.artifact_dir import sha256_file
    from policies.edge_quality.calibrate import embedding_texts, resolve_model
    from policies.edge_quality.evaluate import auroc
    from policies.edge_quality.model import EdgeCalibration
    from policies.edge_quality.probes import load_probes
    from policies.edge_quality.runner import run_probes

    calibration = EdgeCalibration.load()
    model = resolve_model(None)
    probes = [p for p in load_probes() if p.split == "held_out"]
    bar = tqdm(total=len(probes), desc="edge answers (held-out probes)", unit="probe")
    records = asyncio.run(run_probes(probes, model_path=model, model_sha256=sha256_file(model), threads=threads,
                                     cache=records_cache, progress=bar.update))  # fmt: skip
    bar.close()
    texts = embedding_texts(probes)
    y = np.asarray([r.correct for r in records], dtype=bool)
    out: dict[str, Any] = {"held_out_probes": len(probes), "edge_correct": int(y.sum())}
    for p, e in encoders().items():
        vectors = _encode(e, texts, f"edge {p}")
        out[p] = {"prior_auroc": round(float(auroc(y, calibration.prior_batch(texts, vectors))), 4)}
    out["prior_auroc_delta"] = round(out["int8"]["prior_auroc"] - out["fp32"]["prior_auroc"], 4)
    return out


def _pair_figures(embeddings: Path, min_probability: float) -> dict[str, Any]:
    """Every labelled test pair as one lookup: past the gate, no rule veto, the blend >= min_probability."""
    from policies.cache.config import CacheConfig
    from policies.cache.cross_encoder import BUNDLED_CROSS_ENCODER, CrossEncoder
    from policies.cache.cross_encoder_train import previous_probabilities, score
    from policies.cache.verifier import PairText
    from policies.cache.verifier_data import EmbeddingCache, load_all
    from policies.cache.verify import VerifyConfig, mismatch
    from policies.embedding.embedder import vector_space
    from policies.policy import Policy

    cfg = VerifyConfig.from_policy({})
    fp32 = EmbeddingCache(embeddings)
    pairs = [p for p in load_all(fp32) if p.split == "test"]
    gate = CacheConfig.from_section(Policy.load().resolve("cache")).threshold
    encoder = CrossEncoder(BUNDLED_CROSS_ENCODER)
    vetoed = np.asarray([mismatch(PairText(p.a, cfg).features, PairText(p.b, cfg).features, cfg) is not None for p in pairs])
    y = np.asarray([p.label for p in pairs])
    logits = score(encoder, pairs)
    out: dict[str, Any] = {"test_pairs": len(pairs), "positives": int(y.sum()), "gate": gate, "min_probability": min_probability}
    for precision in PRECISIONS:
        space = vector_space(precision)
        embed = fp32 if precision == "fp32" else EmbeddingCache.for_precision(embeddings, precision)
        cos = np.einsum("ij,ij->i", embed([p.a for p in pairs]), embed([p.b for p in pairs]))
        previous = previous_probabilities(pairs, embed, cfg, encoder.previous_verifier_for(space))
        hit = (cos >= gate) & ~vetoed & (encoder.calibrate(logits, cos, previous, space) >= min_probability)
        out[precision] = {"true_hits": int((hit & (y == 1)).sum()), "false_hits": int((hit & (y == 0)).sum())}
    return out


def part_cache(embeddings: Path, max_error_rate: float) -> dict[str, Any]:
    from bench.cache_error_bound import replay, workload
    from policies.cache.config import CacheConfig
    from policies.cache.verifier_data import EmbeddingCache, load_gptcache, load_qqp
    from policies.embedding.embedder import vector_space
    from policies.policy import Policy

    fp32 = EmbeddingCache(embeddings)
    pairs = [p for p in load_qqp() + load_gptcache(fp32) if p.split == "test"]
    seeds, queries, same = workload(pairs, None)
    texts = list(dict.fromkeys([t for _, t in seeds] + [t for _, t in queries]))
    shipped = CacheConfig.from_section(Policy.load().resolve("cache")).verify.min_probability
    out: dict[str, Any] = {"pairs": len(pairs), "stored_first": len(seeds), "queries": len(queries), "max_error_rate": max_error_rate,
                           "shipped_min_probability": shipped, "pairs_at_shipped": _pair_figures(embeddings, shipped)}  # fmt: skip
    keep = ("served_error", "served_error_interval_95", "semantic_hits", "semantic_hit_rate", "hit_rate")
    runs = {"bound": Policy.load(extra={"cache": {"max_error_rate": max_error_rate}}), "shipped": Policy.load()}
    for p in PRECISIONS:
        rows = fp32(texts) if p == "fp32" else _encode(encoders()["int8"], texts, "cache texts: int8")
        vectors = dict(zip(texts, rows))
        out[p] = {}
        for run, policy in runs.items():
            got = asyncio.run(replay(f"{run} ({p})", policy, seeds, queries, same, vectors, 1.0 if run == "bound" else 0.0,
                                     vector_space=vector_space(p)))  # fmt: skip
            out[p][run] = {k: got.get(k) for k in keep}
    for run in runs:
        out[f"{run}_semantic_hits_int8_vs_fp32"] = round(out["int8"][run]["semantic_hits"] / max(1, out["fp32"][run]["semantic_hits"]), 4)
    return out


def part_gateway(rounds: int, requests: int, concurrency: int) -> dict[str, Any]:
    import tempfile

    from bench._harness import free_port, gateway_cmd, start, stop
    from bench.peers import full_pipeline_config, load

    tmp = Path(tempfile.mkdtemp(prefix="tierlane-precision-"))
    up = free_port()
    up_url = f"http://127.0.0.1:{up}/v1"
    procs: dict[str, Any] = {}
    rps: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    try:
        procs["upstream"] = start([sys.executable, str(REPO / "bench" / "fast_upstream.py"), "--port", str(up)],
                                  f"{up_url}/models", tmp / "upstream.log")  # fmt: skip
        urls = {}
        for p in PRECISIONS:
            port = free_port()
            config = full_pipeline_config(up_url, str(tmp / f"state-{p}")) | {"embedder": {"precision": p}}
            procs[p] = start(gateway_cmd(config, tmp / f"{p}.yaml", port), f"http://127.0.0.1:{port}/healthz",
                             tmp / f"{p}.log", env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
            urls[p] = f"http://127.0.0.1:{port}/v1/chat/completions"
            asyncio.run(load(urls[p], "auto", concurrency=concurrency, requests=100))
        with tqdm(total=rounds * len(PRECISIONS), desc="gateway rounds", unit="run") as bar:
            for r in range(rounds):
                for p in PRECISIONS if r % 2 == 0 else PRECISIONS[::-1]:
                    _, wall, errors = asyncio.run(load(urls[p], "auto", concurrency=concurrency, requests=requests))
                    if errors:
                        raise SystemExit(f"{errors} errors from the {p} gateway; see {tmp}")
                    rps[p].append(requests / wall)
                    bar.update(1)
    finally:
        for proc in procs.values():
            stop(proc)
    out: dict[str, Any] = {"concurrency": concurrency, "rounds": rounds, "requests_per_round": requests}
    for p in PRECISIONS:
        out[p] = {"rps_median": round(statistics.median(rps[p]), 1), "rps_spread": [round(min(rps[p]), 1), round(max(rps[p]), 1)]}
    out["int8_vs_fp32_rps"] = round(statistics.median(q / f for q, f in zip(rps["int8"], rps["fp32"])), 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--data", type=Path, default=None, help="shared data dir (default: ../shared/data)")
    parser.add_argument("--embeddings", type=Path, default=Path("/tmp/tierlane_verifier/emb.npz"),
                        help="float32 vectors of the cache pairs (bench/cache_quality.py's cache; filled when missing)")
    parser.add_argument("--edge-cache", type=Path, default=REPO / ".tierlane" / "cache" / "edge_quality" / "records.jsonl")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads for edge answers not in the cache")
    parser.add_argument("--cost-texts", type=int, default=300)
    parser.add_argument("--max-error-rate", type=float, default=0.02)
    parser.add_argument("--rounds", type=int, default=4, help="gateway part: alternating rounds")
    parser.add_argument("--requests", type=int, default=600, help="gateway part: requests per round and precision")
    parser.add_argument("--concurrency", type=int, default=16, help="gateway part: requests in flight")
    parser.add_argument("--out", type=Path, default=RESULTS / "embedding_precision.json")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    from policies.router.data import shared_data_dir

    result: dict[str, Any] = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    result.update({"what": "int8 against float32 all-MiniLM-L6-v2 vectors, read by the shipped router, edge prior and cache, on held-out data",
                   "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), "tolerance": TOLERANCE})  # fmt: skip
    for part in tqdm(parts, desc="parts", unit="part"):
        if part == "cost":
            result["cost"] = part_cost(args.cost_texts)
        elif part == "router":
            result["router"] = part_router(shared_data_dir(args.data))
        elif part == "edge":
            result["edge"] = part_edge(args.edge_cache, args.threads)
        elif part == "cache":
            result["cache"] = part_cache(args.embeddings, args.max_error_rate)
        elif part == "gateway":
            result["gateway"] = part_gateway(args.rounds, args.requests, args.concurrency)
        result["verdicts"] = verdicts("embedding_precision", result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: result.get(k) for k in PARTS}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
