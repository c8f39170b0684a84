"""Target records for the result files: measured value, target, verdict, sample size, interval.

Every `bench/results/<name>.json` whose benchmark names a target carries a `verdicts` list built
here from the figures the file itself records, so a verdict can always be recomputed from the
file (tests/unit/replay/test_results_readme.py does) and none is written by hand:

    {"figure": "throughput_ratio_at_64", "value": 0.425, "target": ">= 0.6", "met": false,
     "n": 3000, "n_of": "requests"}

A rate (precision, recall, a share) also carries `k` (successes), `interval_95` (Wilson score
interval) and `conclusive` (whether the whole interval lies on one side of the target: a
precision of 1.0 from one served pair meets ">= 0.97" but says almost nothing). A figure whose
mechanism did not act in the run (no drafted token, nothing kept) has `met: null` and a
`status` saying why, never a verdict.

    .venv/bin/python bench/_verdicts.py            # rewrite the verdicts of bench/results/*.json
    .venv/bin/python bench/_verdicts.py --check    # exit 1 when a file's verdicts are out of date
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
Record = dict[str, Any]


def wilson(k: int, n: int, z: float = 1.96) -> list[float] | None:
    """Wilson score 95 % interval of a rate k/n (None when n is 0)."""
    if n <= 0:
        return None
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def holds(value: float, op: str, threshold: float) -> bool:
    if op == ">=":
        return value >= threshold
    if op == "<=":
        return value <= threshold
    if op == "==":
        return value == threshold
    if op == "within +-":
        return abs(value) <= threshold
    raise ValueError(f"unknown comparison {op!r}")


def _conclusive(interval: list[float], op: str, threshold: float) -> bool:
    """Whether the whole interval lies on one side of the target (same verdict at both ends)."""
    lo, hi = interval
    if op == "within +-":
        return (-threshold <= lo and hi <= threshold) or hi < -threshold or lo > threshold
    return holds(lo, op, threshold) == holds(hi, op, threshold)


def target(
    figure: str,
    value: float | None,
    op: str,
    threshold: float,
    *,
    n: int | None = None,
    n_of: str | None = None,
    interval: list[float] | None = None,
    note: str | None = None,
) -> Record:
    """One target record; `value` None (the file does not have the figure) gives `met: null`."""
    record: Record = {"figure": figure, "value": value, "target": f"{op} {threshold:g}", "op": op, "threshold": threshold,
                      "met": None if value is None else holds(value, op, threshold), "n": n}  # fmt: skip
    if n_of:
        record["n_of"] = n_of
    if interval is not None and value is not None:
        record["interval_95"] = interval
        record["conclusive"] = _conclusive(interval, op, threshold)
    if value is None:
        record["status"] = "not measured"
    if note:
        record["note"] = note
    return record


def rate(figure: str, k: int, n: int, op: str, threshold: float, *, n_of: str | None = None, note: str | None = None) -> Record:
    """A target on a rate k/n, with its Wilson interval; n == 0 gives `met: null` ("nothing counted")."""
    if n <= 0:
        record = target(figure, None, op, threshold, n=0, n_of=n_of, note=note)
        record["status"] = f"not exercised (no {n_of or 'samples'})"
        return record
    record = target(figure, round(k / n, 4), op, threshold, n=n, n_of=n_of, interval=wilson(k, n), note=note)
    record["k"] = k
    return record


def not_exercised(figure: str, op: str, threshold: float, why: str, *, n: int | None = None, n_of: str | None = None) -> Record:
    record = target(figure, None, op, threshold, n=n, n_of=n_of)
    record["status"] = f"not exercised ({why})"
    return record


def count_from_rate(share: float | None, n: int, decimals: int = 4) -> int | None:
    """The count k behind a rate k/n recorded rounded to `decimals`, when exactly one k rounds to it."""
    if share is None or n <= 0:
        return None
    k = round(share * n)
    fits = [c for c in (k - 1, k, k + 1) if 0 <= c <= n and round(c / n, decimals) == round(share, decimals)]
    return fits[0] if len(fits) == 1 else None


# ---------------------------------------------------------------------------------------------
# Per benchmark: the targets it names, evaluated on the figures its result file records.


def _proxy_overhead(d: dict[str, Any]) -> list[Record]:
    r = d.get("results", {})
    one, many = r.get("concurrency_1", {}), r.get("concurrency_64", {})
    n1 = one.get("tierlane", {}).get("n")
    n64 = many.get("tierlane", {}).get("n")
    return [
        target("added_p50_ms_at_1", one.get("added_p50_ms"), "<=", 1, n=n1, n_of="requests"),
        target("added_p99_ms_at_1", one.get("added_p99_ms"), "<=", 5, n=n1, n_of="requests"),
        target("throughput_ratio_at_64", many.get("throughput_ratio"), ">=", 0.6, n=n64, n_of="requests"),
    ]


def _peers(d: dict[str, Any]) -> list[Record]:
    """Each ratio's median over the rounds; where the file has rounds, their spread and count too."""
    out = []
    n = d.get("requests_per_target")
    for level, v in d.get("verdict", {}).items():
        c = level.removeprefix("concurrency_")
        measured = d.get("results", {}).get(level, {})
        ratios, rounds = measured.get("ratios") or {}, measured.get("rounds")
        for name, op, threshold in (("passthrough_added_p99_vs_litellm", "<=", 0.1), ("passthrough_rps_vs_litellm", ">=", 10),
                                    ("full_pipeline_rps_vs_litellm", ">=", 3)):  # fmt: skip
            spread = (ratios.get(name) or {}).get("spread")
            note = f"median of {rounds} rounds; rounds ranged {spread[0]:g} to {spread[1]:g}" if spread else None
            record = target(f"{name}_at_{c}", v[name], op, threshold, n=n, n_of="requests", note=note)
            if spread:
                record["spread"] = spread
                record["rounds"] = rounds
            out.append(record)
    return out


def _cache_latency(d: dict[str, Any]) -> list[Record]:
    t = d.get("targets", {})
    miss, verify = d.get("miss_c1", {}), d.get("verify_per_lookup", {})
    out = [target("miss_c1_p50_ms", miss.get("p50_ms"), "<=", t.get("miss_c1_p50_ms", 5.0), n=miss.get("n"), n_of="lookups")]
    for name in ("exact", "paraphrase"):
        hit = d.get(f"hit_e2e_{name}_c1", {})
        out.append(target(f"hit_e2e_{name}_p50_ms", hit.get("p50_ms"), "<=", t.get("hit_e2e_p50_ms", 10.0), n=hit.get("n"), n_of="hits"))
    out.append(target("verify_added_by_learned_p50_ms", verify.get("added_by_learned_p50_ms"), "<=",
                      t.get("verify_added_by_learned_p50_ms", 0.5), n=verify.get("n"), n_of="lookups"))  # fmt: skip
    return out


def _cache_quality(d: dict[str, Any]) -> list[Record]:
    test = d.get("at_policy_default", {}).get("test", {})
    targets = d.get("targets")
    if not targets:  # older files: one precision target on every source
        threshold = d.get("target", {}).get("precision_on_every_source", 0.97)
        targets = {source: {"precision": threshold} for source in test}
    out = []
    for source, want in targets.items():
        f = test.get(source)
        if f is None:
            continue
        if "precision" in want:
            out.append(rate(f"precision_{source}_test", int(f["true_hits"]), int(f["served"]), ">=", want["precision"],
                            n_of="served pairs"))  # fmt: skip
        if "recall" in want:
            out.append(rate(f"recall_{source}_test", int(f["true_hits"]), int(f["positives"]), ">=", want["recall"],
                            n_of="positive pairs"))  # fmt: skip
    return out


def _cache_error_bound(d: dict[str, Any]) -> list[Record]:
    # The one target the replay names; the hit rate is reported beside the static thresholds' (the file's runs).
    bound = float(d.get("policy", {}).get("max_error_rate", 0.02))
    run = d.get("runs", {}).get("bound", {})
    return [rate("served_error_with_bound", int(run.get("wrong", 0)), int(run.get("semantic_hits", 0)), "<=", bound,
                 n_of="served semantic hits")]  # fmt: skip


def _dashboard(d: dict[str, Any]) -> list[Record]:
    threshold = d.get("target_page_load_p50_ms", 300.0)
    unrecorded = "this run did not record its loads per view (bench/dashboard.py --repeat, default 30, now does)"
    return [
        target(f"page_load_p50_ms ({name})", v.get("page_load_p50_ms"), "<=", threshold, n=v.get("loads"), n_of="page loads",
               note=None if "loads" in v else unrecorded)  # fmt: skip
        for name, v in d.get("views", {}).items()
    ]


def _edge_decode(d: dict[str, Any]) -> list[Record]:
    runs = d.get("setup", {}).get("rounds")
    return [
        target(f"engine_vs_sequential_at_8 ({mode})", ratio, ">=", 1.4, n=runs, n_of="rounds, best of")
        for mode, ratio in d.get("engine_vs_sequential", {}).items()
    ]


def _edge_engine(d: dict[str, Any]) -> list[Record]:
    out = []
    for name, r in d.get("ratios", {}).items():
        op, threshold = r["target"].split()
        workload = name.split(".")[0]
        if workload in d.get("workloads", {}):
            n = d["workloads"][workload]["throughput"].get("concurrency_8", {}).get("engine", {}).get("requests")
            n_of = "requests per run"
        else:
            n = d.get("long_prompt_interference", {}).get("during_long_prefill", {}).get("n")
            n_of = "short requests during prefill"
        out.append(target(name, r["value"], op, float(threshold), n=n, n_of=n_of))
    return out


SPECULATIVE = {
    "a_grounded_c1": ("grounded@1", ">=", 1.5),
    "b_everyday_c1": ("everyday@1", ">=", 0.97),
    "b_everyday_c8": ("everyday@8", ">=", 0.97),
    "c_grounded_c8": ("grounded@8", ">=", 1.0),
}


def speculative_record(key: str, runs: dict[str, Any], speedup: float | None) -> Record:
    """A speed-up only where drafts were made; the note says when the accepted drafts cannot explain it."""
    run, op, threshold = SPECULATIVE[key]
    on = runs.get(f"{run}/on", {})
    drafted, accepted, tokens = on.get("drafted", 0), on.get("accepted", 0), on.get("completion_tokens", 0)
    figure = f"on/off tokens/s, {run.replace('@', ' at ')}"
    if not drafted or speedup is None:
        return not_exercised(figure, op, threshold, "no token drafted", n=tokens, n_of="completion tokens")
    record = target(figure, speedup, op, threshold, n=tokens, n_of="completion tokens")
    record["drafted"], record["accepted"] = drafted, accepted
    # Most a speed-up can be if every accepted draft token cost nothing: tokens / (tokens - accepted).
    bound = round(tokens / max(1, tokens - accepted), 3) if tokens else None
    if bound is not None and speedup > 1 and speedup > bound:
        record["note"] = f"above the {bound} that {accepted} accepted of {tokens} tokens can explain: run-to-run noise"
    return record


def _edge_speculative(d: dict[str, Any]) -> list[Record]:
    summary, runs = d.get("summary", {}), d.get("runs", {})
    return [speculative_record(key, runs, summary.get(key, {}).get("speedup")) for key in SPECULATIVE if key in summary]


def _metering_overhead(d: dict[str, Any]) -> list[Record]:
    setup = d.get("setup", {})
    return [target("throughput_ratio_on_over_off", round(d["throughput_ratio_on_over_off"], 4), ">=", d.get("target_ratio", 0.9),
                   n=setup.get("rounds"), n_of=f"rounds of {setup.get('requests_per_round')} requests, median")]  # fmt: skip


def _router(d: dict[str, Any]) -> list[Record]:
    mmlu, alpaca = d.get("held_out_mmlu", {}), d.get("held_out_alpaca", {})
    rows = {"mmlu": mmlu.get("rows", 0), "alpaca": alpaca.get("rows", 0)}
    rows["pooled"] = rows["mmlu"] + rows["alpaca"]
    out = [
        target("apgr_mmlu", mmlu.get("apgr"), ">=", 0.65, n=rows["mmlu"], n_of="held-out rows"),
        target("apgr_alpaca", alpaca.get("apgr"), ">=", 0.62, n=rows["alpaca"], n_of="held-out rows"),
    ]
    errors = d.get("strong_share_error", {})
    for case, error in errors.items():
        source, aimed = case.rsplit("_", 1)
        share = round(float(aimed) + error, 4)
        figure = f"strong_share_error_{case} (share {share} aimed at {aimed})"
        if source == "pooled":  # the mean of the two sources' shares, each weighing half
            parts = [(round(float(aimed) + errors[f"{s}_{aimed}"], 4), rows[s]) for s in ("mmlu", "alpaca") if f"{s}_{aimed}" in errors]
            se = 0.5 * math.sqrt(sum(p * (1 - p) / n for p, n in parts if n)) if len(parts) == 2 else None
            interval = [round(error - 1.96 * se, 4), round(error + 1.96 * se, 4)] if se else None
            out.append(target(figure, error, "within +-", 0.05, n=rows["pooled"], interval=interval,
                              n_of="held-out rows, the two sources weighing half each (normal interval)"))  # fmt: skip
            continue
        n = rows.get(source, 0)
        k = count_from_rate(share, n)
        wide = wilson(k, n) if k is not None else None
        interval = [round(x - float(aimed), 4) for x in wide] if wide else None
        out.append(target(figure, error, "within +-", 0.05, n=n, n_of="held-out rows (Wilson interval of the share)", interval=interval))
    return out


def _router_latency(d: dict[str, Any]) -> list[Record]:
    return [target("score_and_decide_p99_us", d.get("score_and_decide_us", {}).get("p99"), "<=", 1000, n=d.get("calls"), n_of="calls")]


def _shared_state(d: dict[str, Any]) -> list[Record]:
    r, out = d.get("results", {}), []
    n = d.get("requests_per_backend")
    for path in ("budgets_path", "budgets_and_cache_hit_path"):
        for level, v in r.get(path, {}).items():
            out.append(target(f"added_p50_ms, {path.replace('_', ' ')}, {level.removeprefix('concurrency_').replace('_', ' ')}",
                              v.get("added_p50_ms"), "<=", 1, n=v.get("redis", {}).get("n", n), n_of="requests"))  # fmt: skip
    limit = r.get("two_replicas_one_limit", {})
    for backend, expected in (("embedded", 2.0), ("redis", 1.0)):
        if backend in limit:
            out.append(target(f"admitted_over_limit, two replicas, {backend}", limit[backend]["admitted_over_limit"], "==", expected,
                              n=limit[backend].get("sent"), n_of="requests sent"))  # fmt: skip
    cache = r.get("cache_across_replicas", {})
    if "redis_minus_one_points" in cache:
        out.append(target("cache hit rate, two redis replicas minus one replica (points)", cache["redis_minus_one_points"],
                          "within +-", 2, n=cache.get("one_replica", {}).get("requests"), n_of="requests per set-up"))  # fmt: skip
    return out


def _edge_quality(d: dict[str, Any]) -> list[Record]:
    threshold = d.get("thresholds", {}).get("target_local_accuracy", 0.9)
    out = []
    gateway = d.get("gateway") or {}
    for name in ("shipped", "router_only"):
        g = gateway.get(name)
        if not g:
            continue
        kept = g.get("kept_local", g.get("upstream_calls_saved"))
        right = g.get("kept_local_right", count_from_rate(g["local_precision"], kept) if kept else None)
        figure = f"local precision through the gateway, {name.replace('_', ' ')}"
        if kept == 0:
            out.append(not_exercised(figure, ">=", threshold, "nothing kept local", n=0, n_of="answers kept local"))
        elif kept is not None and right is not None:
            out.append(rate(figure, right, kept, ">=", threshold, n_of="answers kept local"))
    for set_name, body in d.get("sets", {}).items():
        p = body.get("policies", {}).get("prior_cascade")
        if not p:
            continue
        kept = int(p["kept"])
        figure = f"local precision offline, {set_name}, prior + cascade"
        right = count_from_rate(p["local_precision"], kept) if kept else None
        if kept == 0:
            out.append(not_exercised(figure, ">=", threshold, "nothing kept local", n=0, n_of="answers kept local"))
        elif right is not None:
            out.append(rate(figure, right, kept, ">=", threshold, n_of="answers kept local"))
    return out


def _edge_models(d: dict[str, Any]) -> list[Record]:
    """The best model's held-out local share at its calibrated thresholds for local precision >= 0.95.

    Best: the largest share among models whose held-out local precision there is >= 0.95; where
    none reaches that precision, the largest share (its precision in the note).
    """
    figure = "best model: held-out local share at calibrated precision >= 0.95"
    rows = [(m["file"], m["local_share_at_precision_0.95"]) for m in d.get("models", [])
            if (m.get("local_share_at_precision_0.95") or {}).get("measured")]
    if not rows:
        return [not_exercised(figure, ">=", 0.40, "no model with its own calibration artifact", n=0, n_of="models")]

    def key(row: tuple[str, dict[str, Any]]) -> tuple[bool, float]:
        f = row[1]["at_0.95"]
        return ((f.get("local_precision") or 0.0) >= 0.95, f.get("edge_share") or 0.0)

    name, best = max(rows, key=key)
    f = best["at_0.95"]
    unmeasured = sum(1 for m in d.get("models", []) if not (m.get("local_share_at_precision_0.95") or {}).get("measured"))
    kept = (f"local precision {f.get('local_precision')} on {f.get('kept')} answers kept local" if f.get("kept")
            else "no threshold of its calibration curve reaches 0.95, nothing is kept local")
    note = f"{name}: {kept}; models without their own calibration: {unmeasured}"
    record = rate(figure, int(f["kept"]), int(f["items"]), ">=", 0.40, n_of="held-out tasks", note=note)
    if not key((name, best))[0]:
        record["met"] = False
    return [record]


def _agents(d: dict[str, Any]) -> list[Record]:
    out: list[Record] = []
    n = d.get("sessions_per_path")
    for name, r in d.get("results", {}).items():
        gateway = r.get("gateway", {})
        out.append(target(f"{name}: 4xx per session through the gateway", gateway.get("4xx_per_session"), "<=", 0,
                          n=gateway.get("sessions"), n_of="sessions"))
        out.append(rate(f"{name}: sessions that finished the tool loop through the gateway",
                        int(gateway.get("sessions_completed", 0)), int(gateway.get("sessions", 0)), ">=", 1.0, n_of="sessions"))
        out.append(target(f"{name}: gateway added time per turn, p50 ms", r.get("added_p50_ms"), "<=", 2,
                          n=gateway.get("turns"), n_of="turns"))
    if not out:
        out.append(not_exercised("agents", "<=", 0, "no agent ran", n=n))
    return out


def _agent_sessions(d: dict[str, Any]) -> list[Record]:
    """Recorded agent sessions replayed through the gateway to a pricing upstream (bench/agent_sessions.py)."""
    out: list[Record] = []
    results = d.get("results", {})
    calls = d.get("model_calls", {})
    for config, role in ((d.get("shipped"), "shipped defaults"), (d.get("everything_on"), "everything on")):
        r = results.get(config) or {}
        for agent, figures in r.items():
            if not isinstance(figures, dict) or "billed_vs_pass_through" not in figures:
                continue
            n = calls.get(agent)
            bound = 1.0 if role == "shipped defaults" else 0.6
            out.append(target(f"{role} ({config}), {agent}: billed / pass-through", figures["billed_vs_pass_through"], "<=",
                              bound, n=n, n_of="model calls"))
            out.append(rate(f"{role} ({config}), {agent}: tool results whole on their first appearance",
                            int(figures["tool_results_whole_first"]), int(figures["tool_results"]), ">=", 1.0,
                            n_of="tool results"))
            if role == "everything on":
                out.append(target(f"{role} ({config}), {agent}: cached-read share - pass-through's",
                                  figures["cached_share_minus_pass_through"], ">=", -0.05, n=n, n_of="model calls"))
                out.append(target(f"{role} ({config}), {agent}: broken tool pairs", figures["broken_tool_pairs"], "<=", 0,
                                  n=n, n_of="model calls"))
                out.append(target(f"{role} ({config}), {agent}: gateway added time per turn, p50 ms",
                                  figures["added_ms_p50"], "<=", 2, n=figures["requests"], n_of="requests"))
    if not out:
        out.append(not_exercised("agent_sessions", "<=", 1.0, "no session was replayed"))
    return out


def _front_doors(d: dict[str, Any]) -> list[Record]:
    out: list[Record] = []
    verdict, n = d.get("verdict", {}), d.get("requests_per_api")
    for level, by_api in verdict.items():
        if not level.startswith("concurrency_"):
            continue
        for api, r in by_api.items():
            c = level.removeprefix("concurrency_")
            out.append(target(f"{api} added p50 ms over chat at {c} in flight (client side)", r.get("added_p50_ms"), "<=", 0.3,
                              n=n, n_of="requests per API"))
            out.append(target(f"{api} added p50 ms over chat at {c} in flight (the gateway's own time)",
                              r.get("added_self_p50_ms"), "<=", 0.3, n=n, n_of="requests per API"))
    ttfb = d.get("results", {}).get("edge_stream_ttfb", {})
    for api, r in verdict.get("edge_stream_ttfb", {}).items():
        out.append(target(f"{api} edge stream time to first byte p50 / chat's", r.get("p50_ratio_to_chat"), "<=", 1.05,
                          n=ttfb.get(api, {}).get("n"), n_of="streams per API"))
    return out


def _image(d: dict[str, Any]) -> list[Record]:
    checks = d.get("checks") or {}
    return [
        target("image size MB", d.get("size_mb"), "<=", 1000, n=1, n_of="image built"),
        target("start to /readyz s, median", d.get("startup_s"), "<=", 10, n=len(d.get("startup_runs_s") or [1]), n_of="starts"),
        target("SIGTERM to exit s", d.get("stop_s"), "<=", 10, n=1, n_of="stop"),
        target("checks failed", sum(1 for ok in checks.values() if not ok) if checks else None, "==", 0, n=len(checks),
               n_of="checks"),
    ]


def _hostile_inputs(d: dict[str, Any]) -> list[Record]:
    schemas, outage = d.get("schemas", {}), d.get("outage", {})
    cases = schemas.get("cases")
    during = schemas.get("plain_edge_other_tenant", {}).get("during_hostile", {})
    default = outage.get("modes", {}).get("local_share", {})
    return [
        target("process deaths over the hostile-schema run", schemas.get("process_deaths"), "==", 0, n=cases, n_of="hostile requests"),
        target("5xx answers over the hostile-schema run", schemas.get("responses_5xx"), "==", 0, n=cases, n_of="hostile requests"),
        target("another tenant's plain edge request p99 ms, during the hostile run", during.get("p99_ms"), "<=", 2000,
               n=during.get("n"), n_of="plain requests"),
        target("over-admission per replica through a 3 s store pause (on_outage: local_share)",
               default.get("beyond_limit_per_replica"), "<=", 1, n=default.get("asked_during_pause"), n_of="requests asked"),
        *_hostile_bodies(d.get("bodies", {})),
        *([target("admitted after an idle spell through a store pause, over one window's allowance (limit + rate x time asked)",
                  round(idle["admitted"] / idle["window_bound"], 4), "<=", 1, n=idle["asked"], n_of="requests asked")]
          if (idle := d.get("outage_idle")) and "window_bound" in idle else []),
        *_hostile_state(d),
    ]


def _soak(d: dict[str, Any]) -> list[Record]:
    n = d.get("requests")
    base, tail = d.get("baseline_minutes"), d.get("tail_minutes")
    window = f"minutes {tail[0]}-{tail[1]} against {base[0]}-{base[1]}" if base and tail else "tail against baseline"
    mismatched = d.get("ledger_mismatched_tenants")
    last = max((m["minute"] for m in d.get("per_minute") or []), default=0)
    minutes = sum(1 for m in d.get("per_minute") or [] if m["minute"] >= max(1, last - 19)) or None
    return [
        target(f"p50 of the last 10 minutes / minutes 2-11 ({window})", (d.get("p50_ms") or {}).get("ratio"), "<=", 1.2,
               n=n, n_of="requests"),
        target(f"p99 of the last 10 minutes / minutes 2-11 ({window})", (d.get("p99_ms") or {}).get("ratio"), "<=", 1.2,
               n=n, n_of="requests"),
        target("RSS growth over the last 20 minutes (end / start)", d.get("rss_growth_last_20_min"), "<=", 1.05,
               n=minutes, n_of="minutes"),
        target("state directory growth over the last 20 minutes (end / start)", d.get("state_growth_last_20_min"), "<=", 1.05,
               n=minutes, n_of="minutes"),
        target("5xx answers", d.get("responses_5xx"), "==", 0, n=n, n_of="requests"),
        target("answers neither a success nor a clear error (or no answer)", d.get("unclear"), "==", 0, n=n, n_of="requests"),
        target("tenants whose ledger total differs from what they sent", None if mismatched is None else len(mismatched),
               "==", 0, n=d.get("sent_metered"), n_of="metered requests"),
    ]


# The share of its later requests a learned template must serve locally, by workload (the targets:
# classification 0.5, extraction 0.3), at served disagreement <= 0.02.
_LEARN_SHARE = {"sentiment": 0.5, "intent": 0.5, "extraction": 0.3}


def _edge_learn(d: dict[str, Any]) -> list[Record]:
    out: list[Record] = []
    for w in d.get("workloads") or []:
        name = w["workload"]
        serving, drift, training = w.get("serving") or {}, w.get("drift") or {}, w.get("training") or {}
        after, local = serving.get("requests_after_serving") or 0, serving.get("local_after_serving") or 0
        kept = (w.get("collection") or {}).get("pairs")
        out.append(target(f"{name}: upstream answers collected before the adapter", w.get("collect"), "<=", 2000, n=kept,
                          n_of="pairs kept"))  # fmt: skip
        out.append(target(f"{name}: training seconds (tierlane edge learn, 2 cores)", training.get("command_seconds"), "<=", 1800,
                          n=(training.get("pairs") or {}).get("train"), n_of="training pairs"))  # fmt: skip
        figure = f"{name}: local share of the requests after the template began serving"
        if after:
            out.append(rate(figure, local, after, ">=", _LEARN_SHARE.get(name, 0.5), n_of="requests after serving began"))
        else:  # never served: none of its later requests was answered locally
            gate = serving.get("gate") or {}
            out.append(target(figure, 0.0, ">=", _LEARN_SHARE.get(name, 0.5), n=w.get("later"), n_of="later requests",
                              note=f"never passed its shadow check: disagreement {gate.get('disagreement')} (upper bound "
                              f"{gate.get('disagreement_upper')}) over {gate.get('judged')} judged answers"))  # fmt: skip
        out.append(rate(f"{name}: served disagreement with the upstream", serving.get("served_wrong") or 0, local, "<=", 0.02,
                        n_of="answers served locally"))  # fmt: skip
        judged, first = serving.get("shadow_judged_before_serving"), serving.get("requests_before_serving")
        if first is None:  # never served: nothing was served before the check either
            early, before = (0, w.get("later")) if serving.get("state") is not None else (None, None)
        else:
            early, before = (None if judged is None else int(first < judged)), first
        out.append(target(f"{name}: answers served before the shadow check passed", early, "==", 0, n=before,
                          n_of="requests before serving"))  # fmt: skip
        if drift.get("was_serving"):
            out.append(target(f"{name}: requests after the upstream changed its answers until the template stopped serving",
                              drift.get("requests_until_fallback"), "<=", 100, n=drift.get("sent"), n_of="requests sent"))  # fmt: skip
        else:
            out.append(not_exercised(f"{name}: requests after the upstream changed its answers until the template stopped "
                                     "serving", "<=", 100, "the template was not serving"))  # fmt: skip
    return out


def _hostile_state(d: dict[str, Any]) -> list[Record]:
    out: list[Record] = []
    stall = d.get("route_bound_stall") or {}
    for way in ("local_compaction", "shared_offer"):
        if way in stall:
            out.append(target(f"route bound snapshot at {stall.get('states')} states ({way}): worst event-loop gap ms",
                              stall[way]["worst_loop_gap_ms"], "<=", 50, n=stall.get("states"), n_of="states",
                              note=f"the previous whole snapshot: {stall.get('previous_whole_snapshot', {}).get('worst_loop_gap_ms')} "
                                   f"ms; an idle loop here: {stall.get('idle_loop_gap_ms')} ms"))
    flood = d.get("placement_flood") or {}
    if "bystander_p50_ratio" in flood:
        costs = flood.get("placement_cost_us_by_live_sessions") or {}
        out.append(target("placement flood: the bystander's p50 beside a flat run (one session)", flood["bystander_p50_ratio"],
                          "<=", 1.2, n=flood.get("new_session_per_request", {}).get("bystander_late", {}).get("n"),
                          n_of="bystander requests", note=f"placement cost per request by live sessions (us): {costs}"))
        if len(costs) == 2:
            low, high = (costs[k] for k in sorted(costs, key=int))
            out.append(target(f"placement cost at {flood.get('sessions')} live sessions / at 100", round(high / low, 3),
                              "<=", 2, n=flood.get("sessions"), n_of="live sessions"))
    over = d.get("store_overshoot") or {}
    if "overshoot_requests" in over:
        out.append(target("stored responses over the quota under 64 concurrent requests, in requests",
                          over["overshoot_requests"], "<=", 1, n=sum(over.get("statuses", {}).values()), n_of="requests"))
    for case, r in ((d.get("edge_pull") or {}).get("cases") or {}).items():
        if "bound_s" in r:
            stopped = r["error"] is not None  # a drip that ended on its own would not be this case
            out.append(target(f"edge pull ({case}): seconds until it stopped, over its bound",
                              round(r["stopped_s"] / r["bound_s"], 4) if stopped else None, "<=", 1, n=1, n_of="pull",
                              note=f"stopped after {r['stopped_s']} s, bound {r['bound_s']:g} s"))
        else:
            out.append(target(f"edge pull ({case}): bytes written at most, over the size bound",
                              round(r["bytes_written_max"] / r["bound_bytes"], 4), "<=", 1, n=1, n_of="pull",
                              note=f"{r['bytes_written_max']} of {r['bound_bytes']} bytes; partial file removed: "
                                   f"{r['part_file_bytes'] is None}"))
            out.append(target(f"edge pull ({case}): partial file left, bytes", r["part_file_bytes"] or 0, "==", 0,
                              n=1, n_of="pull"))
    for run, r in (d.get("judging_shares") or {}).items():
        out.append(target(f"judging ({run}): the light tenant's judged, as a share of an equal share",
                          r["light_share_of_equal"], ">=", 0.4, n=r["flood"] + r["light"], n_of="judged or queued",
                          note=f"flood {r['flood']}, light {r['light']} of {r['light_wanted']}"))
    return out


def _hostile_bodies(b: dict[str, Any]) -> list[Record]:
    if not b:
        return []
    out = [target("5xx answers over the hostile-body run", b.get("responses_5xx"), "==", 0,
                  n=sum(f["sent"] for f in b.get("families", {}).values()), n_of="hostile requests")]
    for family, f in b.get("families", {}).items():
        other = f.get("other_tenant", {})
        out.append(target(f"{family}: another tenant's worst request ms while it ran", other.get("max_ms"), "<=", 250,
                          n=other.get("n"), n_of="plain requests"))
        out.append(target(f"{family}: peak RSS growth MB", f.get("peak_rss_growth_mb"), "<=", 64, n=f.get("sent"),
                          n_of="hostile requests"))
    quota = b.get("store_quota_bytes_per_tenant")
    mallory = (b.get("stored_by_tenant") or {}).get("mallory", {}).get("bytes", 0)
    if quota:
        # a tenant's last admitted record may pass the quota by at most one record (checked before the answer)
        out.append(target("the hostile tenant's stored bytes, over its quota plus one request",
                          round(mallory / (quota + 1_100_000), 4), "<=", 1, n=1, n_of="store"))
    return out


def _tiers(d: dict[str, Any]) -> list[Record]:
    out: list[Record] = []
    mmlu = d.get("mmlu", {})
    shipped = {**mmlu.get("at_shipped_target", {}), "target_max_strong_share": "shipped, through the gateway"}
    points = [p for p in [*mmlu.get("curve", []), shipped] if "quality_vs_all_strong" in p]
    fit = [p for p in points if p["quality_vs_all_strong"] >= 0.95]
    best = min(fit, key=lambda p: p["cost_vs_all_strong"]["per_token_cost_1_10"]["router"]) if fit else None
    note = (f"cheapest point with quality >= 0.95: target {best['target_max_strong_share']}, share "
            f"{best['strong_share']}, quality {best['quality_vs_all_strong']}") if best else "no point reaches 0.95 quality"
    out.append(target("mmlu_cost_vs_all_strong_at_0.95_quality", best["cost_vs_all_strong"]["per_token_cost_1_10"]["router"] if best else None,
                      "<=", 0.50, n=mmlu.get("rows"), n_of="held-out rows", note=note))  # fmt: skip
    for source in ("mmlu", "alpaca"):
        at = d.get(source, {}).get("at_shipped_target", {})
        n = d.get(source, {}).get("rows")
        out.append(target(f"{source}_quality_gain_over_random_at_shipped_target", at.get("quality_gain_over_random"), ">=", 0.03,
                          n=n, n_of="held-out rows", note="quality as a fraction of all-strong, random at the same strong share"))
        out.append(target(f"{source}_strong_share_error_at_shipped_target", at.get("strong_share_error"), "within +-", 0.05,
                          n=n, n_of="held-out rows"))
    return out


def _agreement_judge(d: dict[str, Any]) -> list[Record]:
    out: list[Record] = []
    for name, f in d.get("families", {}).items():
        out.append(rate(f"{name}: the judge's accuracy where it decides", int(f["right"]), int(f["decided"]), ">=", 0.98,
                        n_of="decided pairs", note=f"answer similarity alone: {f.get('similarity_accuracy')}"))
        out.append(rate(f"{name}: pairs the judge decides", int(f["decided"]), int(f["pairs"]), ">=", 0.95, n_of="pairs"))
    return out


def _mixed(d: dict[str, Any]) -> list[Record]:
    bound = d.get("runs", {}).get("bound", {})
    n = bound.get("requests")
    late = bound.get("after_warmup", {})
    out = [
        target("bound: quality vs all-strong", bound.get("quality_vs_all_strong"), ">=", 0.97, n=n, n_of="requests"),
        target("bound: saved share of the all-strong bill (judging spend included)", bound.get("saved_share_after_judging"),
               ">=", 0.40, n=n, n_of="requests", note=f"before judging spend: {bound.get('saved_share')}"),
        rate("bound: disagreement the cost tier served after warm-up", int(late.get("served_disagreement", 0)),
             int(late.get("tiered", 0)), "<=", float(d.get("setup", {}).get("max_quality_loss", 0.03)),
             n_of="tiered requests after warm-up", note=f"worst region {late.get('worst_region_share')}"),
    ]
    for family in ("math", "mmlu"):
        view = bound.get("held_out_families", {}).get(family, {})
        out.append(target(f"bound: {family} (held out) quality gain over random at the same strong share",
                          view.get("gain_over_random"), ">=", 0.03, n=view.get("tiered"), n_of="tiered requests"))
    return out


def _router_lofo(d: dict[str, Any]) -> list[Record]:
    summary = d.get("summary", {})
    shipped, math = summary.get("without_math", {}), summary.get("with_math", {})

    def gain(key: str) -> float | None:
        a, b = math.get(key), shipped.get(key)
        return None if a is None or b is None else round(a - b, 4)

    return [
        target("MATH difficulty rows: MATH types held out, level AUC gain", gain("math_mean_level_auc"), ">=", 0.03,
               note=f"without {shipped.get('math_mean_level_auc')}, with MATH rows {math.get('math_mean_level_auc')}"),
        target("MATH difficulty rows: MMLU groups held out, APGR change", gain("mmlu_mean_apgr"), ">=", -0.01,
               note=f"without {shipped.get('mmlu_mean_apgr')}, with MATH rows {math.get('mmlu_mean_apgr')}"),
        target("MATH difficulty rows: AlpacaEval sources held out, APGR change", gain("alpaca_mean_apgr"), ">=", -0.01,
               note=f"without {shipped.get('alpaca_mean_apgr')}, with MATH rows {math.get('alpaca_mean_apgr')}"),
    ]


def _prefix_affinity(d: dict[str, Any]) -> list[Record]:
    out: list[Record] = []
    requests = d.get("workload", {}).get("requests")
    for level, c in d.get("comparison", {}).items():
        # pooled over `runs_per_policy` runs of each balancer where the file has them (older files: one run)
        pooled, n_of = c.get("requests", requests), f"requests over {c.get('runs_per_policy', 1)} run(s) per balancer"
        first_n = c.get("first_turns", d.get("workload", {}).get("sessions"))
        # NOTE: the tail where affinity can act: later turns (what a session keeps warm); a first turn's
        # member choice must only not make it slower than least-outstanding's
        later, first = c.get("later_turns_ttft_p90_ratio_vs_least_outstanding"), c.get("first_turns_ttft_p90_ratio_vs_least_outstanding")
        out.append(target(f"later turns' TTFT p90, prefix affinity / least-outstanding, {level} sessions in flight",
                          later, "<=", 0.33, n=pooled, n_of=n_of,
                          note=f"all turns: {c.get('ttft_p90_ratio_vs_least_outstanding')}"))
        out.append(target(f"first turns' TTFT p90, prefix affinity / least-outstanding, {level} sessions in flight",
                          first, "<=", 1.05, n=first_n, n_of="first turns pooled"))
        out.append(target(f"requests per second, prefix affinity / least-outstanding, {level} sessions in flight",
                          c.get("throughput_ratio_vs_least_outstanding"), ">=", 1.5, n=pooled, n_of=n_of))
        out.append(target(f"requests per member max / min under skewed sessions, {level} in flight",
                          c.get("member_max_min_ratio"), "<=", 2, n=pooled, n_of=n_of))
    shared = d.get("no_shared_prefix", {})
    out.append(target("no shared prefix: TTFT p50, prefix affinity / least-outstanding", shared.get("p50_ratio"), "<=", 1.05,
                      n=shared.get("requests_per_run"), n_of="requests per run"))
    two = d.get("two_replicas", {})
    out.append(target("two gateway replicas: servers' cached-prompt share / one replica's", two.get("ratio"), ">=", 0.95,
                      n=requests, n_of="requests"))
    recon = d.get("reconciliation", {})
    out.append(target("billed vs the servers' token counters, largest relative error over the runs",
                      recon.get("fleet_max_relative_error"), "<=", 0.01, n=recon.get("fleet_runs"), n_of="runs"))
    writes = recon.get("cache_writes", {})
    out.append(target("billed vs Anthropic-shaped reported usage (cache reads and writes), relative error",
                      writes.get("relative_error"), "<=", 0.01, n=writes.get("requests"), n_of="requests"))
    return out


def _demo(d: dict[str, Any]) -> list[Record]:
    """The edge on the demo's workload as shipped, beside the same workload with its learnt gate off and
    with the edge off; then the tiers workload's figures (a sample of bench/tiers.py's held-out rows)."""
    runs = d.get("edge_runs") or {}
    shipped, before = runs.get("shipped") or {}, runs.get("learning_off")
    out: list[Record] = []
    if shipped and len(runs) > 1:
        def counts(run: dict[str, Any] | None, part: str) -> str:
            if run is None:
                return "no learning-off run in this file"
            e = run["edge"][part]
            return f"learning off: {e['escalated']}/{e['attempts']} escalated"

        attempts = shipped["edge"]["all"]["attempts"]
        note = counts(before, "all").replace("learning off: ", f"learning off: {before['edge_net_saving_usd']} USD, ") if before else counts(None, "all")
        out.append(target("edge_net_saving_usd", shipped["edge_net_saving_usd"], ">=", 0, n=attempts, n_of="edge attempts",
                          note=note))
        after = shipped["edge"]["after_first"]
        out.append(rate(f"escalated_share_after_first_{shipped['edge']['after']}", after["escalated"], after["attempts"], "<=", 0.25,
                        n_of="edge attempts", note=counts(before, "after_first")))
        ratios = d.get("edge_comparison") or {}
        ttft = min(int((run.get("upstream_ttft_ms") or {}).get("n") or 0) for run in runs.values())
        if ttft < 10:  # a stream's first byte is its first text: empty answers give none
            out.append(not_exercised("upstream_ttft_p50_vs_edge_off", "<=", 1.10,
                                     f"{ttft} upstream-served stream(s) with text in a run", n=ttft, n_of="upstream-served streams"))
        else:
            out.append(target("upstream_ttft_p50_vs_edge_off", (ratios.get("shipped") or {}).get("upstream_ttft_p50_vs_edge_off"),
                              "<=", 1.10, n=ttft, n_of="upstream-served streams",
                              note=f"learning off: {(ratios.get('learning_off') or {}).get('upstream_ttft_p50_vs_edge_off')}"))
        kept = shipped["edge"]["all"]["kept_accuracy"]
        kept_before = before["edge"]["all"]["kept_accuracy"] if before else {"checked": 0, "correct": 0, "accuracy": None}
        if kept["accuracy"] is None or kept_before["accuracy"] is None:
            out.append(not_exercised("edge_kept_accuracy_minus_learning_off", ">=", 0,
                                     f"checked answers kept on the edge: {kept['checked']} shipped, "
                                     + (f"{kept_before['checked']} learning off" if before else "no learning-off run")))
        else:
            out.append(target("edge_kept_accuracy_minus_learning_off", round(kept["accuracy"] - kept_before["accuracy"], 4), ">=", 0,
                              n=kept["checked"], n_of="checked answers kept on the edge",
                              note=f"{kept['correct']}/{kept['checked']} shipped, {kept_before['correct']}/{kept_before['checked']} learning off"))
    else:
        why = "no edge runs side by side in this file (bench/demo.py --runs)"
        out += [not_exercised("edge_net_saving_usd", ">=", 0, why),
                not_exercised("escalated_share_after_first_50", "<=", 0.25, why),
                not_exercised("upstream_ttft_p50_vs_edge_off", "<=", 1.10, why)]
    if d.get("tiers"):
        out += [{**r, "figure": f"tiers_sample_{r['figure']}"} for r in _tiers(d["tiers"])]
    return out


def _static_embedding(d: dict[str, Any]) -> list[Record]:
    """Each reader's figure with the static embedding minus the transformer's: within the tolerance or better."""
    tol = d.get("tolerance", 0.01)
    out: list[Record] = []
    for src, s in (d.get("cache") or {}).get("sources", {}).items():
        n = s.get("test_positives")
        for key in ("recall_top4_past_gate", "ap_cosine"):
            out.append(target(f"cache {src} {key.replace('_', ' ')}, static - MiniLM", round(s["static"][key] - s["minilm"][key], 4),
                              ">=", -tol, n=n if key.startswith("recall") else s.get("test_pairs"),
                              n_of="test positives" if key.startswith("recall") else "test pairs",
                              note=f"MiniLM {s['minilm'][key]}, static {s['static'][key]}"))
    router = d.get("router") or {}
    for run, label in (("static", "whole selection"), ("static_same_candidate", "shipped candidate")):
        for src in ("mmlu", "alpaca") if run in router else ():
            t, s = router["transformer"][src], router[run][src]
            out.append(target(f"router held-out APGR {src}, static ({label}) - MiniLM", round(s["apgr"] - t["apgr"], 4), ">=", -tol,
                              n=s.get("rows"), n_of="held-out rows", note=f"MiniLM {t['apgr']}, static {s['apgr']} ({router[run]['model']})"))
    edge = d.get("edge")
    if edge:
        t, s = edge["transformer"]["held_out_prior_auroc"], edge["static"]["held_out_prior_auroc"]
        out.append(target("edge prior held-out AUROC, static - MiniLM", round(s - t, 4), ">=", -tol, n=edge.get("held_out"),
                          n_of="held-out probes", note=f"MiniLM {t}, static {s}"))
    return out


def _embedding_precision(d: dict[str, Any]) -> list[Record]:
    """Each shipped reader's held-out figure on int8 vectors minus float32's: within the tolerance or better."""
    tol = d.get("tolerance", 0.01)
    out: list[Record] = []
    router = d.get("router") or {}
    for src in ("mmlu", "alpaca") if router else ():
        r = router[src]
        out.append(target(f"router held-out APGR {src}, int8 - fp32", r["apgr_delta"], ">=", -tol, n=r["int8"]["rows"],
                          n_of="held-out rows", note=f"fp32 {r['fp32']['apgr']}, int8 {r['int8']['apgr']}"))
    edge = d.get("edge")
    if edge:
        out.append(target("edge prior held-out AUROC, int8 - fp32", edge["prior_auroc_delta"], ">=", -tol, n=edge["held_out_probes"],
                          n_of="held-out probes", note=f"fp32 {edge['fp32']['prior_auroc']}, int8 {edge['int8']['prior_auroc']}"))
    cache = d.get("cache")
    if cache and "pairs_at_shipped" in cache:
        pf = cache["pairs_at_shipped"]
        f, q = pf["fp32"], pf["int8"]
        out.append(target("cache test pairs: true hits at the shipped min_probability, int8 / fp32",
                          round(q["true_hits"] / max(1, f["true_hits"]), 4), ">=", 1 - tol, n=pf["positives"], n_of="test positives",
                          note=f"true/false hits: int8 {q['true_hits']}/{q['false_hits']}, fp32 {f['true_hits']}/{f['false_hits']}"))
        out.append(target("cache test pairs: false hits at the shipped min_probability, int8 - fp32",
                          q["false_hits"] - f["false_hits"], "<=", max(1, round(tol * f["true_hits"])), n=pf["test_pairs"] - pf["positives"],
                          n_of="test negatives", note="a false hit serves a wrong answer"))
        for run in ("shipped", "bound"):
            fr, qr = cache["fp32"][run], cache["int8"][run]
            out.append(target(f"cache replay ({run}): semantic hits, int8 / fp32", cache[f"{run}_semantic_hits_int8_vs_fp32"], ">=", 1 - tol,
                              n=fr["semantic_hits"], n_of="fp32 semantic hits",
                              note=f"served error int8 {qr['served_error']}, fp32 {fr['served_error']}"))
    return out


def _scheduling(d: dict[str, Any]) -> list[Record]:
    """The Batch API with flow control beside interactive alone and the same lines sent at once, on the fleet bench's
    servers; then what the simulated GPU fleet (the same scheduler) predicts for the same targets."""
    c = d.get("comparison") or {}
    runs = d.get("runs") or {}
    lines = (d.get("workload") or {}).get("lines")
    during = ((runs.get("batch_api") or {}).get("interactive") or {}).get("measured")
    out = [
        target("fleet utilisation while the batch has work (Batch API, flow control): busy slot-seconds / slot-seconds",
               c.get("utilisation_while_batch_has_work"), ">=", 0.85, n=lines, n_of="batch lines",
               note=f"interactive alone: {c.get('utilisation_interactive_alone')}"),
        target("interactive TTFT p99 while the batch runs (Batch API) / interactive alone", c.get("ttft_p99_ratio_vs_alone"),
               "<=", 1.5, n=during, n_of="interactive turns while the batch had work"),
        target("interactive TTFT p99 while the batch runs, Batch API / its lines sent at once", c.get("ttft_p99_ratio_vs_naive"),
               "<=", 0.3, n=during, n_of="interactive turns while the batch had work"),
        target("batch completion beside interactive traffic / alone on an idle fleet", c.get("batch_completion_ratio_vs_alone"),
               "<=", 1.25, n=lines, n_of="batch lines"),
        target("batch lines lost or answered twice in the output file", c.get("lines_lost_or_doubled"), "==", 0, n=lines,
               n_of="batch lines", note="a restart mid-job: tests/integration/test_batches.py "
               "test_a_gateway_killed_mid_job_and_started_again_loses_and_doubles_no_line"),
    ]
    sim = d.get("simulation") or {}
    predicted, fleet = sim.get("predicted") or {}, sim.get("fleet") or {}
    if predicted:
        runs_sim = sim.get("runs") or {}
        size = f"simulated GPU fleet, {fleet.get('members')} members x {fleet.get('slots_per_member')} slots"
        n_int = (runs_sim.get("flow") or {}).get("interactive_during_batch")
        n_lines = (sim.get("workload") or {}).get("batch_lines")
        out += [
            target(f"{size}: utilisation while the batch has work", predicted.get("utilisation_with_batch"), ">=", 0.85,
                   n=n_lines, n_of="simulated batch lines", note=f"interactive alone: {predicted.get('utilisation_alone')}"),
            target(f"{size}: interactive TTFT p99 with the batch / alone", predicted.get("ttft_p99_ratio_vs_alone"), "<=", 1.5,
                   n=n_int, n_of="simulated interactive requests while the batch had work"),
            target(f"{size}: interactive TTFT p99, Batch API / lines sent at once", predicted.get("ttft_p99_ratio_vs_naive"),
                   "<=", 0.3, n=n_int, n_of="simulated interactive requests while the batch had work"),
            target(f"{size}: batch completion beside interactive / alone", predicted.get("batch_completion_ratio_vs_alone"),
                   "<=", 1.25, n=n_lines, n_of="simulated batch lines"),
        ]
    return out


BUILDERS: dict[str, Callable[[dict[str, Any]], list[Record]]] = {
    "front_doors": _front_doors,
    "agents": _agents,
    "agent_sessions": _agent_sessions,
    "hostile_inputs": _hostile_inputs,
    "soak": _soak,
    "edge_learn": _edge_learn,
    "image": _image,
    "agreement_judge": _agreement_judge,
    "cache_error_bound": _cache_error_bound,
    "cache_latency": _cache_latency,
    "cache_quality": _cache_quality,
    "dashboard": _dashboard,
    "demo": _demo,
    "edge_decode": _edge_decode,
    "embedding_precision": _embedding_precision,
    "edge_engine": _edge_engine,
    "edge_models": _edge_models,
    "edge_quality": _edge_quality,
    "edge_speculative": _edge_speculative,
    "metering_overhead": _metering_overhead,
    "mixed": _mixed,
    "peers": _peers,
    "prefix_affinity": _prefix_affinity,
    "proxy_overhead": _proxy_overhead,
    "router": _router,
    "router_latency": _router_latency,
    "router_lofo": _router_lofo,
    "scheduling": _scheduling,
    "shared_state": _shared_state,
    "static_embedding": _static_embedding,
    "tiers": _tiers,
}


def builder_for(stem: str) -> Callable[[dict[str, Any]], list[Record]] | None:
    """The builder of a result file (`metering_overhead_sampled_0.1` is a metering_overhead run)."""
    for name in sorted(BUILDERS, key=len, reverse=True):
        if stem == name or stem.startswith(name + "_"):
            return BUILDERS[name]
    return None


def verdicts(name: str, data: dict[str, Any]) -> list[Record]:
    build = builder_for(name)
    if build is None:
        raise KeyError(f"no targets known for {name}")
    return build(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if a file's verdicts are out of date")
    args = parser.parse_args(argv)
    stale = []
    for path in sorted(args.results.glob("*.json")):
        build = builder_for(path.stem)
        if build is None:
            continue
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
        fresh = build(data)
        if data.get("verdicts") == fresh:
            continue
        stale.append(path.name)
        if not args.check:
            data["verdicts"] = fresh
            indent = 1 if text.startswith("{\n \"") else 2
            path.write_text(json.dumps(data, indent=indent) + "\n", encoding="utf-8")
    if stale:
        print(("out of date: " if args.check else "rewrote: ") + ", ".join(stale), file=sys.stderr if args.check else sys.stdout)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
