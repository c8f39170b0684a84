"""`tierlane cache purge|match|stats`: operate the semantic cache from a shell."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from policies.cache.config import CacheConfig
from policies.cache.matcher import decide
from policies.policy import Policy


def _settings(args: argparse.Namespace) -> tuple[Path, Policy]:
    from gateway.settings import Settings

    settings = Settings.load(args.config)
    state_dir = Path(args.state_dir) if args.state_dir else settings.state_dir
    policy_file = args.policy or settings.policy_file
    return state_dir, Policy.load(policy_file, extra=settings.policy or None)


def _with_cache(args: argparse.Namespace, action: str) -> dict[str, Any]:
    from policies.cache.service import open_cache

    async def run() -> dict[str, Any]:
        state_dir, policy = _settings(args)
        cache = await open_cache(state_dir, policy)
        try:
            if action == "stats":
                return await cache.stats()
            if args.tenant:
                return {"tenant": args.tenant, "deleted": await cache.purge_tenant(args.tenant)}
            return {"key": args.key, "deleted": await cache.purge_key(args.key)}
        finally:
            await cache.close()

    return asyncio.run(run())


def _purge(args: argparse.Namespace) -> int:
    if bool(args.tenant) == bool(args.key):
        print("tierlane cache purge: give exactly one of --tenant NAME or --key KEY", file=sys.stderr)
        return 2
    print(json.dumps(_with_cache(args, "purge")))
    return 0


def _stats(args: argparse.Namespace) -> int:
    print(json.dumps(_with_cache(args, "stats"), indent=2))
    return 0


def match_lines(lines: TextIO, out: TextIO, config: CacheConfig, batch: int = 64) -> int:
    """Read {"a", "b"} JSON lines, write {"hit", "similarity", "probability", "reason"} lines; returns the error count.

    The gateway's own path: both texts normalised as a request's last turn is, embedded with the
    default backend, then `decide` with both vectors (threshold, rule vetoes, learned verifier).
    """
    from policies.cache.scope import normalise
    from policies.embedder import load_encoder

    encoder = load_encoder()  # the backend the gateway runs by default
    errors = 0
    pending: list[tuple[str, str]] = []

    def flush() -> None:
        if not pending:
            return
        texts = [(normalise(a), normalise(b)) for a, b in pending]
        va = encoder.encode([a for a, _ in texts])
        vb = encoder.encode([b for _, b in texts])
        for (a, b), x, y in zip(texts, va, vb):
            d = decide(float(x @ y), a, b, threshold=config.threshold, checks=config.verify, query_vector=x, candidate_vector=y)
            probability = None if d.probability is None else round(d.probability, 4)
            out.write(json.dumps({"hit": d.hit, "similarity": round(d.similarity, 4), "probability": probability,
                                  "reason": d.reason}) + "\n")  # fmt: skip
        out.flush()
        pending.clear()

    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            a, b = item["a"], item["b"]
            if not isinstance(a, str) or not isinstance(b, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            flush()
            errors += 1
            out.write(json.dumps({"error": f'line {number}: expected {{"a": "...", "b": "..."}}'}) + "\n")
            continue
        pending.append((a, b))
        if len(pending) >= batch:
            flush()
    flush()
    return errors


def _match(args: argparse.Namespace) -> int:
    policy = Policy.load(args.policy)
    section = dict(policy.resolve("cache"))
    if args.threshold is not None:
        section["threshold"] = args.threshold
    if args.min_probability is not None:
        section["verify"] = {**section.get("verify", {}), "min_probability": args.min_probability}
    config = CacheConfig.from_section(section)
    return 1 if match_lines(sys.stdin, sys.stdout, config) else 0


def register(subparsers: Any) -> None:
    """Add `tierlane cache ...`."""
    cache = subparsers.add_parser("cache", help="inspect, test and purge the semantic cache")
    sub = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="gateway settings YAML (default: $TIERLANE_CONFIG or built-in)")
        p.add_argument("--state-dir", help="state directory (default: settings.state_dir)")
        p.add_argument("--policy", help="operator policy YAML merged over the defaults")

    purge = sub.add_parser("purge", help="delete entries by tenant or by key")
    common(purge)
    purge.add_argument("--tenant", help="delete every entry this tenant stored")
    purge.add_argument("--key", help="delete one entry: the x-tierlane-cache-key of a hit, or an entry id")
    purge.set_defaults(func=_purge)

    stats = sub.add_parser("stats", help="entry, vector and hit counts")
    common(stats)
    stats.set_defaults(func=_stats)

    match = sub.add_parser("match", help='read {"a","b"} JSON lines on stdin; write whether b would be served for a')
    match.add_argument("--policy", help="operator policy YAML merged over the defaults")
    match.add_argument("--threshold", type=float, help="override the policy's similarity threshold")
    match.add_argument("--min-probability", type=float, help="override the policy's cache.verify.min_probability")
    match.set_defaults(func=_match)
