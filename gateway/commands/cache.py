"""`tierlane cache purge|match|stats`: operate the semantic cache from a shell.

`purge` and `stats` open the cache the gateway's settings name: the embedded one under the state
directory, or with `state.backend: redis` the cache every replica shares (a purge deletes the
entries in the store and tells every replica through the stream). A shared store that does not
answer is exit status 1: a purge never claims what it could not confirm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from policies.cache.backend import CacheUnavailable
from policies.cache.config import CacheConfig
from policies.cache.matcher import decide
from policies.policy import Policy

if TYPE_CHECKING:
    from gateway.settings import Settings


class StoreUnavailable(Exception):
    """state.backend: redis and the shared store did not answer: the command did not happen (or is not confirmed)."""


# How long the shared cache may take to read the stream up to its end (what a purge by key, a
# purge of a tenant's shared-scope entries and the entry counts need to know).
CATCH_UP_S = 30.0


def _settings(args: argparse.Namespace) -> tuple[Settings, Policy]:
    from gateway.settings import Settings

    settings = Settings.load(args.config)
    if args.state_dir:
        settings = settings.model_copy(update={"state_dir": Path(args.state_dir)})
    policy_file = args.policy or settings.policy_file
    return settings, Policy.load(policy_file, extra=settings.policy or None)


async def _open(settings: Settings, policy: Policy) -> Any:
    """The cache the gateway opens with these settings: the component builder's (embedded, or shared with redis)."""
    from gateway.components import COMPONENTS

    build = next(c.build for c in COMPONENTS if c.attribute == "cache")
    return await build(settings, policy)


async def _catch_up(cache: Any) -> None:
    """The shared cache as every replica knows it (SharedCache.catch_up), or StoreUnavailable."""
    try:
        await cache.catch_up(CATCH_UP_S)
    except CacheUnavailable as exc:
        raise StoreUnavailable(f"it did not answer ({exc.__cause__!r})") from exc
    except TimeoutError as exc:
        raise StoreUnavailable(f"the cache entries were not read up to the stream's end within {CATCH_UP_S:.0f} s") from exc


def _with_cache(args: argparse.Namespace, action: str) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        cache = await _open(settings, policy)
        try:
            if settings.state.backend == "redis":
                await _catch_up(cache)
            if action == "stats":
                return dict(await cache.stats())
            try:
                if args.tenant:
                    return {"tenant": args.tenant, "deleted": await cache.purge_tenant(args.tenant)}
                return {"key": args.key, "deleted": await cache.purge_key(args.key)}
            except CacheUnavailable as exc:
                ms = settings.state.op_timeout_ms
                raise StoreUnavailable(f"it failed or did not answer within state.op_timeout_ms ({ms:g} ms): "
                                       f"{exc.__cause__ or exc!r}") from exc  # fmt: skip
        finally:
            await cache.close()

    settings, policy = _settings(args)
    try:
        return asyncio.run(run())
    except StoreUnavailable as exc:
        from policies.shared_state.redis_client import store_address

        outcome = "nothing was purged, or the purge was not confirmed: run it again" if action == "purge" else "no stats"
        raise StoreUnavailable(f"tierlane cache {action}: the shared cache store {store_address(settings.state.url)} "
                               f"is unavailable: {exc}; {outcome}") from exc  # fmt: skip


def _unavailable(exc: StoreUnavailable) -> int:
    print(exc, file=sys.stderr)
    return 1


def _purge(args: argparse.Namespace) -> int:
    if bool(args.tenant) == bool(args.key):
        print("tierlane cache purge: give exactly one of --tenant NAME or --key KEY", file=sys.stderr)
        return 2
    try:
        result = _with_cache(args, "purge")
    except StoreUnavailable as exc:
        return _unavailable(exc)
    print(json.dumps(result))
    return 0


def _stats(args: argparse.Namespace) -> int:
    try:
        result = _with_cache(args, "stats")
    except StoreUnavailable as exc:
        return _unavailable(exc)
    print(json.dumps(result, indent=2))
    return 0


def match_lines(lines: TextIO, out: TextIO, config: CacheConfig, batch: int = 64) -> int:
    """Read {"a", "b"} JSON lines, write {"hit", "similarity", "probability", "reason"} lines; returns the error count.

    The gateway's own path: both texts normalised as a request's last turn is, embedded with the
    default backend, then `decide` with their cosine (gate, rule vetoes, cross-encoder), as a lookup decides.
    """
    from policies.cache.scope import normalise
    from policies.embedding.embedder import SERVING_PRECISION, load_encoder, vector_space

    # the backend and precision the gateway runs by default, read with the verifier fitted for them
    encoder = load_encoder(precision=SERVING_PRECISION)
    space = vector_space(SERVING_PRECISION)
    errors = 0
    pending: list[tuple[str, str]] = []

    def flush() -> None:
        if not pending:
            return
        texts = [(normalise(a), normalise(b)) for a, b in pending]
        va = encoder.encode([a for a, _ in texts])
        vb = encoder.encode([b for _, b in texts])
        for (a, b), x, y in zip(texts, va, vb):
            d = decide(float(x @ y), a, b, threshold=config.threshold, checks=config.verify, query_vector=x, candidate_vector=y,
                       space=space)  # fmt: skip
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
    cache = subparsers.add_parser(
        "cache",
        help="inspect, test and purge the semantic cache",
        description="purge and stats act on the cache the settings name: the embedded one, or with state.backend: "
        "redis the one every replica shares (exit status 1 when its store does not answer).",
    )
    sub = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="gateway settings YAML (default: $TIERLANE_CONFIG or built-in)")
        p.add_argument("--state-dir", help="state directory of the embedded cache (default: settings.state_dir)")
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
    match.add_argument("--threshold", type=float, help="override the policy's cosine gate (cache.threshold)")
    match.add_argument("--min-probability", type=float, help="override the policy's cache.verify.min_probability")
    match.set_defaults(func=_match)
