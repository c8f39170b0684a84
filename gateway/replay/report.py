"""The replay report: per-lane requests, tokens, latency and TTFT, cache hit rate, cost and savings."""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.replay.driver import RequestResult

SAVED_REASONS = ("cache", "edge", "trim")
AVOIDING_LANES = ("cache", "edge")  # answers that never reached an upstream


def pct(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 1]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(math.floor(k)), min(int(math.floor(k)) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def distribution_ms(seconds: Sequence[float]) -> dict[str, float | int | None]:
    ms = [s * 1000.0 for s in seconds]

    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 3)

    return {
        "n": len(ms),
        "p50": r(pct(ms, 0.50)),
        "p95": r(pct(ms, 0.95)),
        "p99": r(pct(ms, 0.99)),
        "mean": r(statistics.fmean(ms)) if ms else None,
    }


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def accuracy(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Checked answers among `results`: how many carried an expected answer, and the share right."""
    checked = [r for r in results if r.correct is not None]
    right = sum(1 for r in checked if r.correct)
    return {"checked": len(checked), "correct": right, "accuracy": round(right / len(checked), 4) if checked else None}


def _lane_block(results: Sequence[RequestResult], total: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    return {
        "requests": len(results),
        "share": round(len(results) / total, 4) if total else None,
        **accuracy(results),
        "escalated": sum(1 for r in results if r.escalated),
        "errors": len(results) - len(ok),
        "input_tokens": sum(r.input_tokens or 0 for r in ok),
        "output_tokens": sum(r.output_tokens or 0 for r in ok),
        "usage_missing": sum(1 for r in ok if r.input_tokens is None),
        "latency_ms": distribution_ms([r.latency_s for r in ok]),
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "gateway_overhead_ms": distribution_ms([r.overhead_ms / 1000.0 for r in ok if r.overhead_ms is not None]),
    }


def edge_attempts(results: Sequence[RequestResult], after: int = 50) -> dict[str, Any]:
    """What the edge tried: answers it kept and answers the cascade escalated, in all and after the
    first `after` requests of the workload (once the gate has had verdicts to learn from)."""

    def block(group: Sequence[RequestResult]) -> dict[str, Any]:
        kept = [r for r in group if r.ok and r.lane == "edge"]
        escalated = sum(1 for r in group if r.escalated)
        attempts = len(kept) + escalated
        return {"attempts": attempts, "kept": len(kept), "escalated": escalated,
                "escalated_share": round(escalated / attempts, 4) if attempts else None,
                "kept_accuracy": accuracy(kept)}

    upstream = [(r.ttft_s, r.escalated) for r in results if r.ok and r.lane == "upstream" and r.ttft_s is not None]
    return {"all": block(results), "after": after, "after_first": block([r for r in results if r.index >= after]),
            # what a failed attempt costs in time to first byte, beside the upstream's answers that tried nothing
            "upstream_ttft_ms": {"escalated": distribution_ms([t for t, e in upstream if e]),
                                 "not_escalated": distribution_ms([t for t, e in upstream if not e])}}


def cache_hit_rate(results: Sequence[RequestResult]) -> float | None:
    """Hits over lookups, from `x-tierlane-cache` (or the cache lane); None when no lookup was reported."""
    hits = misses = 0
    for r in results:
        if not r.ok:
            continue
        if r.cache == "hit" or r.lane == "cache":
            hits += 1
        elif r.cache == "miss":
            misses += 1
    return round(hits / (hits + misses), 4) if hits + misses else None


def _cost(usage: dict[str, Any] | None, why_missing: str | None) -> dict[str, Any]:
    if usage is None:
        return {"source": None, "note": why_missing or "no usage report"}
    by_lane = {row.get("lane", "all"): {k: v for k, v in row.items() if k != "lane"} for row in usage.get("data") or ()}
    total = usage.get("total") or {}
    return {
        "source": "GET /v1/usage",
        "from": usage.get("from"),
        "to": usage.get("to"),
        "by_lane": by_lane,
        "total": total,
        "cost_usd": total.get("cost_usd", 0.0),
        "saved_usd": total.get("saved_usd", 0.0),
        "saved_by_reason_usd": {reason: total.get(f"saved_{reason}_usd", 0.0) for reason in SAVED_REASONS},
        "trimmed_tokens": total.get("trimmed_tokens", 0),
    }


def build_report(
    results: Sequence[RequestResult],
    *,
    start: float,
    end: float,
    meta: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
    usage_missing: str | None = None,
) -> dict[str, Any]:
    """The JSON report of one replay; `usage` is the gateway's GET /v1/usage for [start, end)."""
    by_lane: dict[str, list[RequestResult]] = defaultdict(list)
    for r in results:
        by_lane[r.lane if r.ok else (r.lane if r.lane not in ("none", "unknown") else "error")].append(r)
    ok = [r for r in results if r.ok]
    avoided = {lane: sum((r.input_tokens or 0) + (r.output_tokens or 0) for r in ok if r.lane == lane) for lane in AVOIDING_LANES}
    cost = _cost(usage, usage_missing)
    if cost["source"] is not None:
        avoided["trim"] = int(cost.get("trimmed_tokens") or 0)
    kinds: dict[str, dict[str, Any]] = {}
    for kind in sorted({r.kind or "unlabelled" for r in results}):
        group = [r for r in results if (r.kind or "unlabelled") == kind]
        kinds[kind] = {
            "requests": len(group),
            **accuracy(group),
            "errors": sum(1 for r in group if not r.ok),
            "lanes": dict(Counter(r.lane for r in group if r.ok)),
            "cache_hit_rate": cache_hit_rate(group),
        }
    failures = [r for r in results if not r.ok]
    wall = max(end - start, 1e-9)
    return {
        "object": "replay.report",
        **(meta or {}),
        "window": {"from": iso(start), "to": iso(end), "start": start, "end": end, "wall_s": round(wall, 3)},
        "totals": {
            "requests": len(results),
            "ok": len(ok),
            "errors": len(failures),
            "requests_per_s": round(len(results) / wall, 3),
            "cache_hit_rate": cache_hit_rate(results),
            "upstream_tokens_avoided": {**avoided, "total": sum(avoided.values())},
            "latency_ms": distribution_ms([r.latency_s for r in ok]),
            "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        },
        # every saving beside its checked accuracy: what stayed local (cache, edge) and overall
        "quality": {
            "overall": accuracy(results),
            "local": accuracy([r for r in ok if r.lane in AVOIDING_LANES]),
            "upstream": accuracy([r for r in ok if r.lane == "upstream"]),
            "local_share": round(sum(1 for r in ok if r.lane in AVOIDING_LANES) / len(results), 4) if results else None,
            "escalated": sum(1 for r in results if r.escalated),
        },
        "edge": edge_attempts(results),
        "route_reasons": dict(sorted(Counter(r.route_reason or "-" for r in ok).items())),
        "lanes": {lane: _lane_block(group, len(results)) for lane, group in sorted(by_lane.items())},
        "kinds": kinds,
        "cost": cost,
        "errors": {
            "count": len(failures),
            "by_status": {str(k): v for k, v in sorted(Counter(r.status for r in failures).items())},
            "examples": list(dict.fromkeys(r.error or f"HTTP {r.status}" for r in failures))[:5],
        },
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_report(report: dict[str, Any]) -> str:
    """A short text summary for the terminal."""
    totals = report["totals"]
    lines = [
        f"replay {report['window']['from']} .. {report['window']['to']} ({report['window']['wall_s']} s): "
        f"{totals['requests']} requests, {totals['errors']} errors, {totals['requests_per_s']} req/s",
        f"cache hit rate: {_fmt(totals['cache_hit_rate'], 3)}   upstream tokens avoided: "
        + ", ".join(f"{k} {v}" for k, v in totals["upstream_tokens_avoided"].items()),
        "",
        f"{'lane':<10}{'reqs':>6}{'share':>7}{'err':>5}{'in tok':>9}{'out tok':>9}"
        f"{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'ttft p50':>10}{'ttft p95':>10}{'checked':>9}{'accuracy':>10}",
    ]
    for lane, block in report["lanes"].items():
        lat, ttft = block["latency_ms"], block["ttft_ms"]
        lines.append(
            f"{lane:<10}{block['requests']:>6}{_fmt(block['share'], 3):>7}{block['errors']:>5}{block['input_tokens']:>9}"
            f"{block['output_tokens']:>9}{_fmt(lat['p50']):>9}{_fmt(lat['p95']):>9}{_fmt(lat['p99']):>9}"
            f"{_fmt(ttft['p50']):>10}{_fmt(ttft['p95']):>10}{block['checked']:>9}{_fmt(block['accuracy'], 3):>10}"
        )
    quality = report["quality"]
    if quality["overall"]["checked"]:
        lines.append(
            f"checked accuracy: overall {_fmt(quality['overall']['accuracy'], 3)} "
            f"({quality['overall']['checked']} checked), local {_fmt(quality['local']['accuracy'], 3)} "
            f"({quality['local']['checked']}), upstream {_fmt(quality['upstream']['accuracy'], 3)}; "
            f"local share {_fmt(quality['local_share'], 3)}, escalated {quality['escalated']}"
        )
    cost = report["cost"]
    lines.append("")
    if cost["source"] is None:
        lines.append(f"cost: not available ({cost['note']})")
    else:
        saved = cost["saved_by_reason_usd"]
        lines.append(
            f"cost ${cost['cost_usd']:.6f}   saved ${cost['saved_usd']:.6f} "
            f"(cache ${saved['cache']:.6f}, edge ${saved['edge']:.6f}, trim ${saved['trim']:.6f})"
        )
        for lane, row in cost["by_lane"].items():
            lines.append(f"  {lane:<10} cost ${row.get('cost_usd', 0.0):.6f}  saved ${row.get('saved_usd', 0.0):.6f}")
    if report["errors"]["count"]:
        lines.append(f"errors by status: {report['errors']['by_status']}")
        lines.extend(f"  {example}" for example in report["errors"]["examples"])
    return "\n".join(lines) + "\n"


def write_json(report: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "replay.json"
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return path
