"""`tierlane edge calibrate | probe`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    edge = subparsers.add_parser("edge", help="measure what the local edge model answers correctly")
    sub = edge.add_subparsers(dest="edge_command", metavar="ACTION", required=True)

    cal = sub.add_parser("calibrate", help="run the edge model over the probe set and write a calibration artifact")
    cal.add_argument("--model", default=None,
                     help="the model as edge.model names it: `bundled` (the default, SmolLM2-135M-Instruct), a GGUF "
                     "path, or the hf://org/repo/file.gguf that `tierlane edge pull` put in the model cache")
    cal.add_argument("--model-cache", default=None, help="the model cache (default: edge.model_cache_dir's default)")
    cal.add_argument("--out", type=Path, default=None,
                     help="artifact directory to write (default: the calibration cache, keyed by the model's sha256)")
    cal.add_argument("--calibration-cache", type=Path, default=None,
                     help="where artifacts keyed by model sha256 are kept (default: ~/.cache/tierlane/calibration; "
                     "the gateway's edge.calibration_cache)")
    cal.add_argument("--no-save", action="store_true", help="write no artifact (report only)")
    cal.add_argument("--budget-s", type=float, default=None,
                     help="stop starting probes after this many seconds and fit on the answered ones (default: no limit)")
    cal.add_argument("--min-probes", type=int, default=None,
                     help="fewest answered calibration probes to write an artifact from (default: 50, or all asked for "
                     "if fewer)")
    cal.add_argument("--limit", type=int, default=None, help="at most N probes per split, spread over families")
    cal.add_argument("--seed", type=int, default=13, help="seed of the cross-validation folds")
    cal.add_argument("--threads", type=int, default=1, help="llama.cpp threads (1 is fastest on a busy 2-core box)")
    cal.add_argument("--concurrency", type=int, default=8, help="probes in flight (the engine batches them)")
    cal.add_argument("--target", type=float, default=0.90, help="default min_local_accuracy of the shipped thresholds")
    cal.add_argument("--cache", type=Path, default=Path(".tierlane/cache/edge_quality/records.jsonl"),
                     help="answers kept per model and prompt, so a rerun only runs new probes")
    cal.add_argument("--no-cache", action="store_true", help="run every probe afresh")
    cal.add_argument("--probes", type=Path, default=None, help="probe set JSONL (default: the shipped one)")
    cal.add_argument("--report", type=Path, default=None, help="also write the manifest to this JSON file")
    cal.set_defaults(func=_calibrate)

    probe = sub.add_parser("probe", help="ask the edge model one question; print prior, answer and confidence")
    probe.add_argument("question")
    probe.add_argument("--model", type=Path, default=None, help="GGUF file (default: the bundled model)")
    probe.add_argument("--artifact", type=Path, default=None, help="calibration directory (default: the shipped one)")
    probe.add_argument("--max-tokens", type=int, default=None)
    probe.set_defaults(func=_probe)


def _fail(message: str, code: int = 2) -> int:
    print(f"tierlane edge: {message}", file=sys.stderr)
    return code


def _calibrate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from edge_engine.model_source import BUNDLED, DEFAULT_CACHE_DIR, ModelSourceError, resolve_model
    from policies.edge_quality.calibrate import MIN_PROBES, CalibrationConfig, CalibrationTooShort, calibrate
    from policies.edge_quality.lookup import publish_artifact, staging_dir

    if args.budget_s is not None and args.budget_s < 0:
        return _fail("--budget-s must be 0 or more")
    try:
        # never downloads: a hub file must have been pulled (the error names the command)
        resolved = resolve_model(args.model or BUNDLED, None, args.model_cache or DEFAULT_CACHE_DIR)
    except (OSError, ModelSourceError) as exc:
        return _fail(str(exc))
    model, digest = resolved.path, resolved.sha256
    # NOTE: the cache entry is written beside its final place and moved there whole, so a
    # gateway looking it up never reads half an artifact.
    staged = None if args.out is not None or args.no_save else staging_dir(digest, args.calibration_cache)
    config = CalibrationConfig(
        model_path=model, out=args.out if args.out is not None else staged, seed=args.seed, limit=args.limit,
        threads=args.threads, concurrency=args.concurrency, target=args.target,
        cache=None if args.no_cache else args.cache, probes_path=args.probes, budget_s=args.budget_s,
        min_probes=MIN_PROBES if args.min_probes is None else args.min_probes,
    )
    bar = tqdm(total=0, desc="edge probes", unit="probe", file=sys.stderr)

    def set_total(n: int) -> None:
        bar.total = n
        bar.refresh()

    try:
        manifest = calibrate(config, progress=bar.update, total=set_total, model_sha256=digest)
    except CalibrationTooShort as exc:
        return _fail(str(exc), code=3)
    except (FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    finally:
        bar.close()
        if staged is not None and not (staged / "manifest.json").is_file():
            import shutil

            shutil.rmtree(staged, ignore_errors=True)
    out = args.out
    if staged is not None:
        out = publish_artifact(staged, digest, args.calibration_cache)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    held = manifest["metrics"]["held_out"]
    print(json.dumps({
        "held_out_edge_accuracy": held["edge_accuracy"],
        "held_out_auroc": {k: held["auroc"][k] for k in ("prior", "confidence")},
        "held_out_prior_cascade": held["policies"]["prior_cascade"],
        "defaults": manifest["defaults"],
        "run": manifest["run"],
        "model_sha256": digest,
        "out": str(out) if out else None,
    }, indent=1))
    return 0


def _probe(args: argparse.Namespace) -> int:
    import asyncio

    from policies.edge_quality.artifact import EdgeCalibrationError
    from policies.edge_quality.calibrate import resolve_model
    from policies.edge_quality.model import EdgeCalibration

    try:
        calibration = EdgeCalibration.load(args.artifact)
    except EdgeCalibrationError as exc:
        return _fail(str(exc))
    model = resolve_model(args.model)
    result = asyncio.run(_ask(calibration, model, args.question, args.max_tokens))
    print(json.dumps(result, indent=1, ensure_ascii=False))
    return 0


async def _ask(calibration: Any, model: Path, question: str, max_tokens: int | None) -> dict[str, Any]:
    from edge_engine import EdgeEngine
    from policies.cache.scope import embedding_text
    from policies.edge_quality.runner import MAX_TOKENS, engine_settings, sampling
    from policies.embedding.embedder import SERVING_PRECISION, load_encoder

    messages = [{"role": "user", "content": question}]
    text = embedding_text({"messages": messages}) or ""
    vector = load_encoder(precision=SERVING_PRECISION).encode([text])[0]  # the vector the gateway computes
    prior = calibration.prior(text, vector)
    engine = EdgeEngine(engine_settings(model, threads=1, slots=1))
    await engine.start()
    try:
        generation = await engine.submit(messages=messages, params=sampling(max_tokens or MAX_TOKENS))
        parts: list[str] = []
        tokens: list[Any] = []
        finish = "stop"
        async for event in generation:
            parts.append(event.text)
            tokens.extend(event.tokens)
            finish = event.finish_reason or finish
    finally:
        await engine.close()
    confidence = calibration.confidence(prior, tokens, finish)
    d = calibration.defaults
    return {
        "prior": round(prior, 4),
        "routed_to_edge": prior >= d.gate,
        "answer": "".join(parts),
        "finish_reason": finish,
        "confidence": round(confidence, 4),
        "kept_local": prior >= d.gate and confidence >= d.confidence,
        "calibration_matches_model": calibration.matches(model),
    }
