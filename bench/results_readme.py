"""Render the benchmark results pages of the docs, docs/results/, from bench/results/*.json.

The folder is generated whole: an index of every result file with its verdict counts, one page
per group of benches (PAGES below; mkdocs.yml lists the same pages), and copies of the charts
beside the result files. Files there that the render no longer makes are removed.

    .venv/bin/python bench/results_readme.py            # rewrite docs/results/
    .venv/bin/python bench/results_readme.py --check    # exit 1 when docs/results/ is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._verdicts import count_from_rate, wilson

REPO = Path(__file__).resolve().parents[1]
SKIP_KEYS = {"machine", "generated_at", "what", "benchmark", "rounds", "results", "note", "verdicts"}


def _num(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    if value is None:
        return "–"
    return str(value)


def _interval(interval: list[float] | None) -> str:
    return f"{_num(interval[0])} to {_num(interval[1])}" if interval else "–"


def _rate(k: int | None, n: int | None, value: float | None = None) -> str:
    """A rate with its count and Wilson 95 % interval: `0.9778 (44/45, 0.88 to 0.996)`."""
    if not n or k is None:
        return f"{_num(value)} (n={n})" if n is not None else _num(value)
    return f"{_num(round(k / n, 4))} ({k}/{n}, {_interval(wilson(k, n))})"


def _verdict(record: dict[str, Any]) -> str:
    if record.get("met") is None:
        return str(record.get("status") or "not measured")
    text = "yes" if record["met"] else "no"
    if record.get("conclusive") is False:
        text += " (the interval spans the target)"
    if record.get("note"):
        text += f"; {record['note']}"
    return text


def render_verdicts(data: dict[str, Any]) -> list[str]:
    """Every target the file names: measured value, sample size, 95 % interval (rates), target, verdict."""
    rows = [
        [
            r["figure"],
            r["value"],
            "not recorded" if r.get("n") is None else f"{r['n']} ({r['n_of']})" if r.get("n_of") else r["n"],
            _interval(r.get("interval_95")),
            r["target"],
            _verdict(r),
        ]
        for r in data["verdicts"]
    ]
    met = sum(r["met"] is True for r in data["verdicts"])
    missed = sum(r["met"] is False for r in data["verdicts"])
    other = len(rows) - met - missed
    head = f"Against the targets: {met} met, {missed} not met" + (f", {other} without a verdict" if other else "") + "."
    return [head, "", *_table(["figure", "value", "n", "95 % interval", "target", "met"], rows)]


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_num(c) for c in row) + " |" for row in rows]
    return lines


def _stamp(data: dict[str, Any]) -> str:
    machine = data.get("machine") or {}
    parts = [f"generated {data['generated_at']}"] if data.get("generated_at") else []
    if machine.get("cpus"):
        parts.append(f"{machine['cpus']} CPUs")
    load = data.get("load_average")
    if isinstance(load, dict) and load.get("before"):
        parts.append(f"load average {load['before'][0]} before, {load['after'][0]} after")
    return ", ".join(parts)


def _with_spread(t: dict[str, Any], name: str, default: Any = None) -> str:
    """A figure, followed by its spread over the rounds where the file has one: `3.6 (2.1 to 5)`."""
    value = t.get(name, default)
    spread = (t.get("spread") or {}).get(name)
    return f"{_num(value)} ({_interval(spread)})" if spread else _num(value)


def render_peers(data: dict[str, Any]) -> list[str]:
    rows, ratio_rows = [], []
    for level, r in data.get("results", {}).items():
        c = level.removeprefix("concurrency_")
        for name in ("direct", "tierlane_passthrough", "tierlane_full", "tierlane_full_fp32", "litellm"):
            if name in r:
                t = r[name]
                rows.append(
                    [
                        c,
                        name,
                        _with_spread(t, "added_p50_ms", 0.0),
                        _with_spread(t, "added_p99_ms", 0.0),
                        _with_spread(t, "p50_ms"),
                        _with_spread(t, "p99_ms"),
                        _with_spread(t, "rps"),
                        t["errors"],
                    ]
                )
        ratios = r.get("ratios")
        if ratios:
            cells = [f"{_num(x['median'])} ({_interval(x['spread'])})" if x else "–" for x in (
                ratios.get("passthrough_added_p99_vs_litellm"), ratios.get("passthrough_rps_vs_litellm"),
                ratios.get("full_pipeline_rps_vs_litellm"), ratios.get("full_pipeline_added_p50_vs_litellm"),
                ratios.get("full_pipeline_fp32_rps_vs_litellm"))]
            loop = r.get("tierlane_full_loop") or {}
            ratio_rows.append([c, r.get("rounds"), *cells, r.get("load_average_1m_at_start", "–"),
                               f"{_num(loop.get('max_lag_ms'))} / {_num(loop.get('stalls'))}" if loop else "–"])
    spread_note = any(isinstance(r, dict) and r.get("ratios") for r in data.get("results", {}).values())
    lines = []
    if spread_note:
        lines += ["Each figure is the median over the rounds, with the spread (min to max) of the rounds.", ""]
    lines += _table(["concurrency", "target", "added p50 ms", "added p99 ms", "p50 ms", "p99 ms", "req/s", "errors"], rows)
    if ratio_rows:
        lines += ["", *_table(["concurrency", "rounds", "pass-through added p99 ÷ LiteLLM's", "pass-through req/s ÷ LiteLLM's",
                               "full pipeline req/s ÷ LiteLLM's", "full pipeline added p50 ÷ LiteLLM's",
                               "full pipeline, fp32 embedder: req/s ÷ LiteLLM's", "load average (1 min)",
                               "full pipeline loop: largest lag ms / stalls"], ratio_rows)]  # fmt: skip
    rss = data.get("peak_rss_mb") or {}
    if rss:
        lines += ["", "Peak RSS (VmHWM, MiB): " + ", ".join(f"{k} {_num(v)}" for k, v in rss.items())]
    if data.get("note"):
        lines += ["", f"Note: {data['note']}."]
    return lines


def render_proxy_overhead(data: dict[str, Any]) -> list[str]:
    rows = []
    for level, r in data.get("results", {}).items():
        rows.append(
            [
                level.removeprefix("concurrency_"),
                r["direct"]["p50_ms"],
                r["tierlane"]["p50_ms"],
                r["added_p50_ms"],
                r["added_p99_ms"],
                r["direct"]["rps"],
                r["tierlane"]["rps"],
                r["throughput_ratio"],
            ]
        )
    return _table(
        [
            "concurrency",
            "direct p50 ms",
            "tierlane p50 ms",
            "added p50 ms",
            "added p99 ms",
            "direct req/s",
            "tierlane req/s",
            "ratio",
        ],
        rows,
    )


def render_front_doors(data: dict[str, Any]) -> list[str]:
    rows = []
    verdict = data.get("verdict") or {}
    for level, r in data.get("results", {}).items():
        if level == "edge_stream_ttfb":
            continue
        for name in ("chat", "messages", "responses", "responses_stored"):
            t = r[name]
            met = (verdict.get(level) or {}).get(name, {}).get("met")
            rows.append([level.removeprefix("concurrency_"), name, t["p50_ms"], t["p99_ms"], t.get("added_p50_ms", 0.0),
                         t.get("added_p99_ms", 0.0), t.get("added_self_p50_ms", 0.0), "–" if met is None else met])
    lines = _table(["concurrency", "API", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "gateway's own added p50 ms",
                    "target met"], rows)
    ttfb = data.get("results", {}).get("edge_stream_ttfb")
    if ttfb:
        lines += ["", "Time to first byte of a streamed edge answer (bundled model, max_tokens 8, one at a time):", ""]
        lines += _table(["API", "p50 ms", "p99 ms", "p50 ÷ chat's", "target met"],
                        [[name, t["p50_ms"], t["p99_ms"], t.get("p50_ratio_to_chat", 1.0),
                          (verdict.get("edge_stream_ttfb") or {}).get(name, {}).get("met", "–")]
                         for name, t in ttfb.items()])
    lines += ["", "Targets: " + "; ".join(f"{k} {v}" for k, v in data.get("targets", {}).items()) + ". "
              "`responses_stored` is the Responses API's default `store: true`."]
    return lines


def render_agents(data: dict[str, Any]) -> list[str]:
    rows = []
    for name, r in data.get("results", {}).items():
        for path in ("gateway", "native"):
            t = r[path]
            rows.append([f"{name} ({r['package']})", path, f"{t['sessions_completed']}/{t['sessions']}", t["requests_per_session"],
                         t["4xx_per_session"], t["turn_p50_ms"], t["turn_p99_ms"],
                         f"{t['self_p50_ms']} / {t['self_p99_ms']}" if path == "gateway" else "–"])
    lines = _table(["agent", "path", "loops finished", "requests / session", "4xx / session", "turn p50 ms", "turn p99 ms",
                    "gateway's own p50 / p99 ms"], rows)
    lines += [""]
    for name, r in data.get("results", {}).items():
        dropped = r["gateway"].get("dropped_per_request") or {}
        lines.append(f"- {name}: added per turn p50 {r['added_p50_ms']} ms, p99 {r['added_p99_ms']} ms; dropped per request: "
                     + (", ".join(f"`{k}` {v}" for k, v in dropped.items()) or "none"))
    llama = data.get("llama_server")
    if llama:
        runs = "; ".join(f"{name} exit {llama[name]['exit_code']} in {llama[name]['seconds']} s"
                         + (f" ({llama[name]['api_errors'][0]})" if llama[name]["api_errors"] else "")
                         for name in data.get("results", {}) if name in llama)
        lines += ["", f"Against {llama['server']} (max_output_tokens {llama['max_output_tokens']}): {runs}; gateway statuses "
                  f"{llama['gateway_statuses']}, server tasks finished {llama['server_tasks_finished']}, server errors "
                  f"{len(llama['server_errors'])}."]
    return lines


def render_agent_sessions(data: dict[str, Any]) -> list[str]:
    calls = data.get("model_calls", {})
    rows = []
    for config, r in data.get("results", {}).items():
        for agent, t in r.items():
            if not isinstance(t, dict) or "billed_usd" not in t:
                continue
            tiers = ", ".join(f"{k} {v}" for k, v in (t.get("upstream_requests_per_tier") or {}).items() if v)
            rows.append([config, f"{agent} ({calls.get(agent, '?')} calls)", _num(t["billed_usd"]), _num(t["billed_vs_pass_through"]),
                         _num(t["cached_read_share"]), _num(t["cache_write_tokens"]), _num(t.get("masked_tokens", 0)),
                         f"{t['tool_results_whole_first']}/{t['tool_results']}", t["broken_tool_pairs"], tiers or "–",
                         f"{_num(t['added_ms_p50'])} / {_num(t['added_ms_p99'])}"])
    work = ("read, searched and edited" if data.get("script") == "mixed" else "read")
    steps = "; ".join(f"{agent}: {r.get('reads')} reads, {r.get('searches')} searches, {r.get('edits_in_files')}/{r.get('edits')} "
                      f"edits found in the files, {r.get('tool_results_marked_error')} tool results an error"
                      for agent, r in (data.get("recording") or {}).items())
    lines = [f"Recorded sessions of the real CLIs ({data.get('files_read')} files of this repository {work}, one call each; "
             f"the long session takes more), replayed through the gateway to a provider that reads what it cached within "
             f"{_num(data.get('ttl_s'))} s and writes the rest. {data.get('note', '')}." + (f" Recording: {steps}." if steps else ""), ""]
    lines += _table(["configuration", "session", "billed USD", "/ pass-through", "cached-read share", "cache writes",
                     "tokens masked", "tool results whole first", "broken pairs", "upstream calls by tier",
                     "added p50 / p99 ms"], rows)
    anthropic = data.get("anthropic_upstream") or {}
    if anthropic.get("results"):
        base = anthropic.get("base", "anthropic_chat_compat")
        rows = []
        for config, r in anthropic["results"].items():
            for agent, t in r.items():
                if not isinstance(t, dict) or ("billed_usd" not in t and "error" not in t):
                    continue
                if "error" in t:
                    rows.append([config, agent, "failed: " + str(t["error"]).replace("|", "/")[:160], "–", "–", "–", "–", "–"])
                    continue
                apis = ", ".join(f"{k} {v}" for k, v in (t.get("upstream_requests_per_api") or {}).items() if v)
                rows.append([config, agent, _num(t["billed_usd"]), _num(t.get(f"billed_vs_{base}")), _num(t["cached_read_share"]),
                             _num(t.get("uncached_share")), apis or "–", f"{t['tool_results_whole_first']}/{t['tool_results']}"])
        lines += ["", "To a provider billing the way Anthropic does (cache entries only at `cache_control` marks; its "
                  "OpenAI-compatible chat endpoint caches nothing), through the shipped policy:", ""]
        lines += _table(["configuration", "session", "billed USD", f"/ {base}", "cached-read share", "uncached share",
                         "upstream calls by API", "tool results whole first"], rows)
    floor = data.get("masking_floor") or {}
    if floor:
        rows = [[agent, f["model_calls"], _num(f["pass_through"]["usd"]), _num(f["oracle_mask"]["usd"]),
                 _num(f["oracle_mask"]["vs_pass_through"]), _num(f["write_once"]["usd"]), _num(f["write_once"]["vs_pass_through"])]
                for agent, f in floor.items()]
        keep = next(iter(floor.values())).get("keep_last_calls")
        lines += ["", f"The masking floor, from each recorded session itself (no gateway): the bill as sent; if every tool "
                  f"result older than the last {keep} model calls cost nothing and dropping it wrote nothing (an oracle); "
                  f"and if nothing already sent were read again (each new part written once):", ""]
        lines += _table(["session", "model calls", "as sent USD", "oracle masking USD", "/ as sent", "written once USD",
                         "/ as sent"], rows)
    return lines


def render_prefix_affinity(data: dict[str, Any]) -> list[str]:
    rows = []
    for name, r in data.get("runs", {}).items():
        rows.append([name.replace("@", " @ "), r["ttft_p50_ms"], r["ttft_p90_ms"], r.get("first_turns_ttft_p90_ms"),
                     r.get("later_turns_ttft_p90_ms"), r["requests_per_s"],
                     r["server_cached_prompt_share"], " / ".join(str(c) for c in r["requests_per_member"]), r["errors"],
                     r["reconciliation"]["relative_error"]])
    lines = _table(["balance @ sessions in flight", "TTFT p50 ms", "TTFT p90 ms", "first turns' TTFT p90 ms",
                    "later turns' TTFT p90 ms", "req/s", "servers' cached-prompt share",
                    "requests per member", "errors", "billed vs server counters"], rows)
    pooled = data.get("pooled") or {}
    if pooled:  # what the verdicts compare: each balancer's repeats as one sample
        lines += ["", "Pooled over each balancer's runs (`#2`: the second run, on its own sessions), as the targets compare them:", ""]
        lines += _table(["balance @ sessions in flight", "runs", "first turns", "first turns' TTFT p50 / p90 ms",
                         "later turns' TTFT p50 / p90 ms", "req/s", "servers' cached-prompt share"],
                        [[f"{policy} @ {level}", r["runs"], r["first_turns"],
                          f"{r['first_turns_ttft_p50_ms']} / {r['first_turns_ttft_p90_ms']}",
                          f"{r['later_turns_ttft_p50_ms']} / {r['later_turns_ttft_p90_ms']}", r["requests_per_s"],
                          r["server_cached_prompt_share"]] for level, by in pooled.items() for policy, r in by.items()])
    w, shared, two = data.get("workload", {}), data.get("no_shared_prefix", {}), data.get("two_replicas", {})
    writes = data.get("reconciliation", {}).get("cache_writes", {})
    lines += ["", f"Workload: {w.get('sessions')} sessions ({w.get('turns_per_session')} turns), {w.get('requests')} "
              f"streamed requests per run, first-turn prompts {w.get('first_turn_prompt_tokens')}; fleet: "
              f"{data.get('fleet', {}).get('servers')} × {data.get('fleet', {}).get('server')}, `{' '.join(data.get('fleet', {}).get('args', []))}`.",
              f"- No shared prefix ({shared.get('requests_per_run')} unique prompts, {shared.get('runs_per_policy')} runs each): "
              f"TTFT p50 {shared.get('ttft_p50_ms', {}).get('prefix_affinity')} ms with prefix affinity vs "
              f"{shared.get('ttft_p50_ms', {}).get('least_outstanding')} ms least-outstanding (ratio {shared.get('p50_ratio')}).",
              f"- Two gateway replicas ({two.get('how')}): cached-prompt share {two.get('cached_share_two')} vs "
              f"{two.get('cached_share_one')} with one (ratio {two.get('ratio')}).",
              f"- Cache writes billed ({writes.get('requests')} Messages requests, Anthropic-shaped usage replayed): "
              f"{writes.get('billed_usd')} USD billed vs {writes.get('from_reported_usage_usd')} USD from the reported "
              f"usage (relative error {writes.get('relative_error')}); writes {writes.get('ledger_cache_write_tokens')} / "
              f"{writes.get('reported_cache_write_tokens')} tokens, reads {writes.get('ledger_cache_read_tokens')} / "
              f"{writes.get('reported_cache_read_tokens')}."]
    return lines


def render_shared_state(data: dict[str, Any]) -> list[str]:
    results = data.get("results", {})
    rows = []
    for path in ("budgets_path", "budgets_and_cache_hit_path"):
        for level, r in results.get(path, {}).items():
            rows.append([path.replace("_", " "), level.removeprefix("concurrency_").replace("_", " "), r["embedded"]["p50_ms"], r["redis"]["p50_ms"],
                         r["added_p50_ms"], r["embedded"]["p99_ms"], r["redis"]["p99_ms"], r["embedded"]["rps"], r["redis"]["rps"]])  # fmt: skip
    limit, cache = results.get("two_replicas_one_limit"), results.get("cache_across_replicas")
    lines = _table(["path", "concurrency", "embedded p50 ms", "redis p50 ms", "added p50 ms", "embedded p99 ms", "redis p99 ms",
                    "embedded req/s", "redis req/s"], rows)  # fmt: skip
    if limit:
        lines += [
            "",
            *_table(
                ["two replicas, one limit", "limit/min", "admitted", "admitted / limit"],
                [
                    [name, limit["limit_requests_per_minute"], limit[name]["admitted"], limit[name]["admitted_over_limit"]]
                    for name in ("embedded", "redis")
                    if name in limit
                ],
            ),
        ]
    if cache:
        lines += [
            "",
            *_table(
                ["cache, same workload", "replicas", "requests", "hits", "hit rate"],
                [
                    [
                        name.replace("_", " "),
                        cache[name]["replicas"],
                        cache[name]["requests"],
                        cache[name]["hits"],
                        _rate(cache[name]["hits"], cache[name]["requests"]),
                    ]
                    for name in ("one_replica", "two_replicas_embedded", "two_replicas_redis")
                    if name in cache
                ],
            ),
        ]
    return lines


def render_replay(data: dict[str, Any]) -> list[str]:
    totals = data["totals"]
    lines = [
        f"{totals['requests']} requests, {totals['errors']} errors, cache hit rate "
        f"{_rate(count_from_rate(totals['cache_hit_rate'], totals['requests']), totals['requests'], totals['cache_hit_rate'])}, "
        "upstream tokens avoided " + ", ".join(f"{k} {v}" for k, v in totals["upstream_tokens_avoided"].items()) + ".",
        "",
    ]
    rows = [
        [
            lane,
            b["requests"],
            b["input_tokens"],
            b["output_tokens"],
            b["latency_ms"]["p50"],
            b["latency_ms"]["p95"],
            b["latency_ms"]["p99"],
            b["ttft_ms"]["p50"],
            b["ttft_ms"]["p95"],
        ]
        for lane, b in data["lanes"].items()
    ]
    lines += _table(["lane", "requests", "in tokens", "out tokens", "p50 ms", "p95 ms", "p99 ms", "TTFT p50", "TTFT p95"], rows)
    cost = data.get("cost") or {}
    if cost.get("source"):
        saved = cost["saved_by_reason_usd"]
        lines += [
            "",
            f"Cost ${cost['cost_usd']:.6f}, saved ${cost['saved_usd']:.6f} "
            f"(cache ${saved['cache']:.6f}, edge ${saved['edge']:.6f}, trim ${saved['trim']:.6f}).",
        ]
    shadow = data.get("shadow")
    if isinstance(shadow, list) and shadow:
        lines += [
            "",
            "Shadow agreement with the upstream: "
            + "; ".join(f"{r['lane']} n={r['count']} mean {r['mean']} p10 {r['p10']} >0.8 {r['share_above_0_8']}" for r in shadow)
            + ".",
        ]
    return lines


def render_demo(data: dict[str, Any]) -> list[str]:
    """The shipped replay, the edge runs side by side, then the tiers workload at the shipped target."""
    lines = render_replay(data)
    runs = data.get("edge_runs") or {}
    if runs:
        after = next(iter(runs.values()))["edge"]["after"]
        ratios = data.get("edge_comparison") or {}
        rows = []
        for name, run in runs.items():
            edge = run["edge"]
            kept = edge["all"]["kept_accuracy"]
            rows.append([name, run["edge_net_saving_usd"], edge["all"]["attempts"], edge["all"]["escalated"],
                         f"{edge['after_first']['escalated']}/{edge['after_first']['attempts']}",
                         f"{kept['correct']}/{kept['checked']}" if kept["checked"] else "-",
                         (run.get("upstream_ttft_ms") or {}).get("p50"),
                         (ratios.get(name) or {}).get("upstream_ttft_p50_vs_edge_off", "-" if name == "edge_off" else None),
                         " / ".join(_num(((edge.get("upstream_ttft_ms") or {}).get(k) or {}).get("p50")) for k in ("escalated", "not_escalated")),
                         ", ".join(f"{k} {v}" for k, v in run["route_reasons"].items())])
        lines += ["", f"The edge, run by run on the same workload (escalated after the first {after} requests; "
                      "upstream TTFB: upstream-served streams):", ""]
        lines += _table(["run", "edge saving USD", "edge attempts", "escalated", f"escalated after {after}",
                         "kept and checked right", "upstream TTFB p50 ms", "vs edge off",
                         "TTFB p50 escalated / not", "route reasons"], rows)
    tiers = data.get("tiers") or {}
    if tiers:
        sample = (tiers.get("setup") or {}).get("sample") or {}
        rows = []
        for source in ("mmlu", "alpaca"):
            d = tiers.get(source) or {}
            at = d.get("at_shipped_target") or {}
            cost = (at.get("cost_vs_all_strong") or {}).get("per_token_cost_1_10") or {}
            rows.append([source, d.get("rows"), at.get("strong_share"), at.get("served_quality_vs_all_strong"),
                         at.get("random_quality_vs_all_strong"), cost.get("router"), cost.get("random")])
        lines += ["", f"Tiers workload ({(tiers.get('setup') or {}).get('router_target')}; MMLU: {sample.get('mmlu_rows')} held-out "
                      f"rows sampled with seed {sample.get('seed')}, AlpacaEval: all held-out rows; cost per token, cost tier 1/10):", ""]
        lines += _table(["source", "rows", "strong share", "quality vs all-strong", "random, same share", "cost vs all-strong",
                         "random cost"], rows)
    return lines


def render_edge_engine(data: dict[str, Any]) -> list[str]:
    rows = []
    for workload, body in data["workloads"].items():
        for level, r in body["throughput"].items():
            server = r.get("llama_server") or {}
            rows.append(
                [
                    workload,
                    level.removeprefix("concurrency_"),
                    r["engine"]["tokens_per_s"],
                    r["sequential"]["tokens_per_s"],
                    r["naive"]["tokens_per_s"],
                    server.get("tokens_per_s"),
                    r["engine_vs_sequential"],
                    r["engine"].get("ttft_p99_ms"),
                    r["naive"].get("ttft_p99_ms"),
                    server.get("ttft_p99_ms"),
                ]
            )
    lines = _table(
        [
            "workload",
            "concurrency",
            "engine tok/s",
            "sequential tok/s",
            "naive tok/s",
            "llama-server tok/s",
            "engine ÷ sequential",
            "engine TTFT p99 ms",
            "naive TTFT p99 ms",
            "llama-server TTFT p99 ms",
        ],
        rows,
    )
    inter = data["long_prompt_interference"]
    lines += [
        "",
        f"Short-request TTFT while a ~1,500-token prompt is ingested: p99 {_num(inter['during_long_prefill']['p99_ms'])} ms "
        f"(n={inter['during_long_prefill']['n']}) vs {_num(inter['alone']['p99_ms'])} ms alone. Peak RSS (MiB): "
        + ", ".join(f"{k} {_num(v['peak_rss_mb'])}" for k, v in data["memory"].items())
        + ".",
    ]
    return lines


def render_edge_kv_quality(data: dict[str, Any]) -> list[str]:
    positions = data["setup"]["positions_compared"]
    prompts = sum((data["setup"].get("prompts") or {}).values())
    rows = [
        [
            name,
            _rate(count_from_rate(r["top1_agreement"], positions), positions, r["top1_agreement"]),
            r["kl_mean"],
            r["kl_p99"],
            _rate(count_from_rate(r["greedy_text_identical"], prompts, 3), prompts, r["greedy_text_identical"]),
            r["greedy_tokens_before_first_difference"],
        ]
        for name, r in data["candidates"].items()
    ]
    lines = [f"Against {data['reference']}, {data['setup']['positions_compared']} completion positions:", ""]
    return lines + _table(
        ["set-up", "top-1 agreement", "KL mean", "KL p99", "greedy text identical", "greedy tokens before first difference"], rows
    )


def render_edge_speculative(data: dict[str, Any]) -> list[str]:
    summary = data["summary"]
    names = {
        "a_grounded_c1": "input-grounded, concurrency 1",
        "b_everyday_c1": "everyday, concurrency 1",
        "b_everyday_c8": "everyday, concurrency 8",
        "c_grounded_c8": "input-grounded, concurrency 8",
    }
    rows = []
    for key, label in names.items():
        if key not in summary:
            continue
        s = summary[key]
        drafted, accepted = s.get("drafted"), s.get("accepted")
        ratio = s["speedup"] if s["speedup"] is not None else "not exercised (no token drafted)"
        rows.append([label, ratio, drafted, _rate(accepted, drafted, s["acceptance_rate"]), s.get("completion_tokens"), s["target"]])
    identical = ", ".join(f"{k} {v}" for k, v in summary.get("d_identical", {}).items())
    lines = [
        f"Speculation on vs off, tokens/s ratio, only where drafts were made; greedy output identical: {identical}.",
        "",
    ]
    return lines + _table(["workload", "on / off", "drafted", "accepted of drafted", "completion tokens", "target"], rows)


def render_cache_quality(data: dict[str, Any]) -> list[str]:
    policy = data["policy"]
    lines = [
        f"Threshold chosen on the selection split; figures on the test split (never tuned on). Policy: cosine "
        f">= {policy['threshold']}, verifier {policy['verifier']}, min_probability {policy['min_probability']}.",
        "",
    ]
    rows = []
    for source in ("qqp", "stsb", "gptcache"):
        shipped = data["at_policy_default"]["test"][source]
        rules = data["baselines"]["rules_only_cosine_0.82"]["test"][source]
        cosine = data["baselines"]["cosine_0.90"]["test"][source]
        rows.append(
            [
                source,
                _rate(shipped["true_hits"], shipped["served"], shipped["precision"]),
                _rate(shipped["true_hits"], shipped["positives"], shipped["recall"]),
                _rate(rules["true_hits"], rules["served"], rules["precision"]),
                _rate(rules["true_hits"], rules["positives"], rules["recall"]),
                _rate(cosine["true_hits"], cosine["served"], cosine["precision"]),
                _rate(cosine["true_hits"], cosine["positives"], cosine["recall"]),
            ]
        )
    lines += ["Precision = right hits / served pairs, recall = right hits / positive pairs; (count, Wilson 95 % interval).", ""]
    return lines + _table(
        ["test source", "precision", "recall", "rules only: precision", "recall", "cosine 0.90: precision", "recall"],
        rows,
    )


def render_edge_quality(data: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    gateway = data.get("gateway")
    if gateway:
        tasks = ", ".join(f"{k} {v}" for k, v in gateway.get("tasks", {}).items())
        lines += [
            f"Through running gateways, model `auto`, an upstream that answers every task right ({tasks}); "
            "pinned to the edge the model is right on "
            f"{_rate(count_from_rate(gateway['pinned_edge_accuracy'], sum(gateway.get('tasks', {}).values())), sum(gateway.get('tasks', {}).values()), gateway['pinned_edge_accuracy'])} of them:",
            "",
        ]
        right_pinned = count_from_rate(gateway["pinned_edge_accuracy"], sum(gateway.get("tasks", {}).values()))
        rows = [
            [
                name,
                _rate(g.get("kept_local_right", count_from_rate(g["local_precision"], g["upstream_calls_saved"])),
                      g.get("kept_local", g["upstream_calls_saved"]), g["local_precision"]),  # fmt: skip
                _rate(count_from_rate(g["local_recall"], g.get("right_when_pinned", right_pinned) or 0),
                      g.get("right_when_pinned", right_pinned), g["local_recall"]),  # fmt: skip
                _rate(count_from_rate(g["overall_accuracy"], g["tasks"]), g["tasks"], g["overall_accuracy"]),
                g["edge_share"],
                g["cache_share"],
                g["escalated"],
                g["upstream_calls_saved"],
            ]
            for name, g in (
                ("shipped (prior + cascade)", gateway["shipped"]),
                ("router only (cascade off)", gateway["router_only"]),
            )
        ]
        lines += _table(
            [
                "policy",
                "local precision",
                "local recall",
                "overall accuracy (upstream-only 1.0)",
                "edge share",
                "cache share",
                "escalated",
                "upstream calls saved",
            ],
            rows,
        )
        ttft = gateway["stream_ttft"]
        lines += [
            "",
            f"Edge-served streams, time to first token: hold-back p50 {_num(ttft['hold_back']['p50_ms'])} / "
            f"p99 {_num(ttft['hold_back']['p99_ms'])} ms vs none p50 {_num(ttft['no_hold_back']['p50_ms'])} / "
            f"p99 {_num(ttft['no_hold_back']['p99_ms'])} ms. Edge tokens spent on escalated requests: "
            f"{_num(gateway['escalated_edge_tokens_share'])} of all edge tokens.",
            "",
        ]
    lines += ["Offline, from the engine's answers and the shipped thresholds (prior, confidence):", ""]
    rows = []
    for name, body in data["sets"].items():
        items = body["items"]
        right = count_from_rate(body.get("edge_accuracy"), items)
        for policy, r in body["policies"].items():
            kept = round(r["kept"])
            kept_right = count_from_rate(r["local_precision"], kept) if kept else None
            rows.append([name, policy, _rate(kept_right, kept, r["local_precision"]),
                         _rate(count_from_rate(r["local_recall"], right or 0), right, r["local_recall"]),
                         r["edge_share"], r["overall_accuracy"], items])  # fmt: skip
    lines += _table(["tasks", "decision", "local precision", "local recall", "edge share", "overall accuracy", "items"], rows)
    held = data["sets"].get("held_out_probes")
    if held:
        lines += [
            "",
            "AUROC for edge correctness on the held-out probes: "
            + ", ".join(f"{k} {_num(v)}" for k, v in held["auroc"].items())
            + ".",
        ]
    return lines


def render_edge_models(data: dict[str, Any]) -> list[str]:
    """GGUF models side by side on the held-out edge tasks (bench/edge_models.py)."""
    models = data.get("models", [])
    families = sorted({f for m in models for f in (m.get("accuracy_by_family") or {})})
    rows = []
    for m in models:
        if m.get("error"):
            rows.append([m["file"], m.get("size_label"), m["error"], *[None] * (len(families) + 5)])
            continue
        t = m["timing"]
        share = m.get("local_share_at_precision_0.95") or {}
        at = share.get("at_0.95") or {}
        kept_right = count_from_rate(at.get("local_precision"), at["kept"]) if at.get("kept") else None
        local = (f"{_num(at.get('edge_share'))} (precision {_rate(kept_right, at.get('kept'), at.get('local_precision'))})"
                 if share.get("measured") else "not measured: no calibration artifact for this GGUF")
        rows.append([m["file"], m.get("size_label"), _rate(m["correct"], m["items"], m["accuracy"]),
                     *[(m["accuracy_by_family"].get(f) or {}).get("accuracy") for f in families],
                     t["single"]["ms_per_token"], t["in_flight"]["ms_per_token"], m["correct_per_cpu_s"], local,
                     m.get("chat_template")])
    lines = [f"{data.get('items_per_model')} held-out tasks per model ({data.get('machine_note')}).", ""]
    lines += _table(["model", "size", "accuracy", *families, "ms/token, 1 request, 2 threads", "ms/token, 8 in flight",
                     "correct per CPU-s", "local share at calibrated precision >= 0.95", "chat template"], rows)
    for key, text in (data.get("notes") or {}).items():
        lines += ["", f"{key.replace('_', ' ').capitalize()}: {text}"]
    return lines


def render_cache_latency(data: dict[str, Any]) -> list[str]:
    names = {
        "miss_c1": "miss (embed + search + verify), concurrency 1",
        "miss_c32": "miss, concurrency 32",
        "miss_search_verify_only_c1": "miss, search + verify only",
        "hit_embed_and_lookup_c1": "hit, embed + lookup",
        "hit_e2e_exact_c1": "hit through the gateway, exact repeat",
        "hit_e2e_paraphrase_c1": "hit through the gateway, paraphrase",
    }
    rows = []
    for key, label in names.items():
        r = data.get(key)
        if not r:
            continue
        hits = None
        if "hit_rate" in r:
            asked = round(r["n"] / r["hit_rate"]) if r["hit_rate"] else None
            hits = _rate(r["n"], asked, r["hit_rate"]) if asked else _num(r["hit_rate"])
        rows.append([label, r.get("n"), r.get("p50_ms"), r.get("p99_ms"), hits])
    verify = data.get("verify_per_lookup") or {}
    lines = [f"{data.get('entries')} cache entries, embedder backend {data.get('embed_backend')}; latencies over n samples "
             "(through the gateway: n = the hits; hit rate = hits / lookups).", ""]  # fmt: skip
    lines += _table(["figure", "n", "p50 ms", "p99 ms", "hit rate"], rows)
    if verify:
        lines += [
            "",
            f"Learned verifier per lookup ({verify['n']} lookups, {_num(verify['candidates_mean'])} candidates on average): "
            f"adds p50 {_num(verify['added_by_learned_p50_ms'])} / p99 {_num(verify['added_by_learned_p99_ms'])} ms over the "
            f"rules alone; serves {_num(verify['served_rate_learned'])} of the lookups.",
        ]
    return lines


def render_edge_invalid_output(data: dict[str, Any]) -> list[str]:
    crit = data["criterion"]
    lines = [
        f"{data['prompts']} everyday prompts, each sent to both gateways, greedy, max_tokens {data['max_tokens']}; the "
        "upstream is llama.cpp's server with the same model. Invalid = more than "
        f"{_num(crit['rep4_max'])} of the served text's word 4-grams repeat an earlier one, or its raw / zlib bytes exceed "
        f"{_num(crit['compression_max'])} (answers of {crit['compression_min_bytes']} bytes or more).",
        "",
    ]

    def cell(share: dict[str, Any]) -> str:
        return _rate(share["count"], share["n"], share["share"])

    rows = []
    for name in ("before", "after"):
        r = data[name]
        lanes = ", ".join(f"{lane} {_rate(v['invalid']['count'], v['served'])}" for lane, v in r["by_lane"].items())
        rows.append([name, cell(r["invalid"]), cell(r["invalid_rep4"]), cell(r["invalid_compression"]),
                     cell(r["finish_length"]), r["escalated"], r["errors"], lanes])  # fmt: skip
    lines += _table(
        ["gateway", "invalid served", "by rep-4", "by compression", "ended at max_tokens", "escalated", "errors",
         "invalid by serving lane"],
        rows,
    )  # fmt: skip
    paired = data.get("paired")
    if paired:
        lines += [
            "",
            f"Same prompts, paired ({paired['prompts']}): invalid before only {paired['invalid_before_only']}, after only "
            f"{paired['invalid_after_only']}, both {paired['invalid_both']}.",
        ]
    return lines


def render_hostile_inputs(data: dict[str, Any]) -> list[str]:
    schemas, outage = data["schemas"], data["outage"]
    plain = schemas["plain_edge_other_tenant"]
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(schemas["statuses"].items()))
    slowest = schemas["slowest_hostile_request"]
    lines = [
        f"{schemas['cases']} hostile schemas ({', '.join(schemas['families'])}; sizes {', '.join(_num(n) for n in schemas['sizes'])}), "
        f"on `auto` and pinned to the edge: {statuses}; process deaths {schemas['process_deaths']}, 5xx "
        f"{schemas['responses_5xx']}; slowest {slowest['seconds']} s ({slowest['case']}).",
        "",
        *_table(["another tenant's plain edge request", "n", "p50 ms", "p99 ms"],
                [[name.replace("_", " "), plain[key]["n"], plain[key]["p50_ms"], plain[key]["p99_ms"]]
                 for key, name in (("quiet", "no hostile traffic"), ("during_hostile", "during the hostile run"))]),
        "",
        f"Store outage: {outage['setup']}.",
        "",
        *_table(["on_outage", "left at the pause", "asked during it", "admitted during it", "beyond the limit", "per replica"],
                [[mode, r["left_at_pause"], r["asked_during_pause"], r["admitted_during_pause"], r["beyond_limit"],
                  r["beyond_limit_per_replica"]] for mode, r in outage["modes"].items()]),
    ]
    return lines


def render_image(data: dict[str, Any]) -> list[str]:
    lines = [
        f"`{data['image']}` built with {data['engine']} over `{data.get('base_image')}`: `make image` "
        f"{_num(data.get('build_wall_s'))} s wall (wheelhouse {_num(data.get('wheelhouse_s'))} s, base image "
        f"{_num(data.get('base_image_s'))} s (0: reused), Dockerfile build {_num(data.get('dockerfile_build_s'))} s).",
        "",
    ]
    lines += [f"Checks ({data['checks_passed']} passed):", ""]
    lines += _table(["check", "passed"], [[name, ok] for name, ok in data["checks"].items()])
    space = data.get("space_mb") or {}
    if space:
        lines += ["", "What takes the space (MB): " + ", ".join(f"{k} {_num(v)}" for k, v in space.items())]
    return lines


def render_tiers(data: dict[str, Any]) -> list[str]:
    """Upstream tiers through the gateway: the shipped target per source, then the cost-quality curve."""
    pricing = list((data.get("setup") or {}).get("pricing") or {})
    rows = []
    for source in ("mmlu", "alpaca"):
        d = data.get(source) or {}
        at = d.get("at_shipped_target") or {}
        costs = at.get("cost_vs_all_strong") or {}
        rows.append([source, d.get("rows"), at.get("strong_share"), at.get("quality_vs_all_strong"),
                     at.get("random_quality_vs_all_strong"),
                     *(f"{_num(costs.get(m, {}).get('router'))} (random {_num(costs.get(m, {}).get('random'))})" for m in pricing)])
    lines = [f"At the shipped target ({(data.get('setup') or {}).get('router_target')}); cost as a fraction of all-strong, "
             "prices in the file's `setup.pricing`:", ""]
    lines += _table(["source", "rows", "strong share", "quality vs all-strong", "random, same share", *pricing], rows)
    for source in ("mmlu", "alpaca"):
        curve = (data.get(source) or {}).get("curve") or []
        lines += ["", f"Cost-quality curve, {source} (cost: per token, cost tier 1/10):", ""]
        lines += _table(["target share", "strong share", "quality", "random quality", "cost", "random cost"],
                        [[p["target_max_strong_share"], p["strong_share"], p["quality_vs_all_strong"],
                          p["random_quality_vs_all_strong"], p["cost_vs_all_strong"]["per_token_cost_1_10"]["router"],
                          p["cost_vs_all_strong"]["per_token_cost_1_10"]["random"]] for p in curve])
    return lines


def render_edge_escalation_ttfb(data: dict[str, Any]) -> list[str]:
    """Time to first byte with the edge never tried vs tried and always escalated."""
    runs = data.get("runs") or {}
    rows = [[name, kind, r.get("requests"), r.get("escalated"), r.get("past_deadline", "–"), (r.get("ttfb_ms") or {}).get("p50"),
             (r.get("ttfb_ms") or {}).get("p90")]
            for name, run in runs.items() for kind, r in run.items()]  # fmt: skip
    cost = data.get("escalation_ttfb_cost_ms") or {}
    rows += [["cost of a failed attempt", kind.replace("_", " "), "", "", "", c.get("p50"), c.get("p90")] for kind, c in cost.items()]
    setup = data.get("setup") or {}
    lines = [f"{setup.get('prompts')} prompts, {setup.get('concurrency')} at a time.", ""]
    return lines + _table(["run", "answer", "requests", "escalated", "past the deadline", "ttfb p50 ms", "ttfb p90 ms"], rows)


def render_cache_error_bound(data: dict[str, Any]) -> list[str]:
    w, policy = data.get("workload") or {}, data.get("policy") or {}
    rows = []
    for name, r in (data.get("runs") or {}).items():
        state = r.get("bound_state") or {}
        threshold = r.get("threshold") if name != "bound" else f"{policy.get('shipped_threshold')} -> {state.get('threshold')}"
        rows.append([name if name != "bound" else f"bound (max_error_rate {policy.get('max_error_rate')})", threshold,
                     _rate(r.get("wrong"), r.get("semantic_hits"), r.get("served_error")), r.get("served_error_upper_one_sided"),
                     r.get("semantic_hit_rate"),
                     r.get("hit_rate"), r.get("unjudged_semantic_hits")])  # fmt: skip
    lines = [
        f"Replay of {w.get('queries')} test-split queries ({', '.join(w.get('sources') or [])}; {w.get('same_question_pairs')} of "
        f"{w.get('pairs')} pairs the same question) over {w.get('stored_first')} stored questions, through the embedded cache "
        f"with the shipped verifier ({policy.get('kind')} threshold {policy.get('shipped_threshold')}); the upstream's "
        f"judgement simulated by the labels; share of hits and refused candidates judged: {_num(policy.get('sample_rate'))}. "
        "Served error = wrong / judged semantic hits (Wilson 95 %); hit rates over all lookups.",
        "",
    ]  # fmt: skip
    lines += _table(["run", "threshold", "served error", "one-sided 95 % upper", "semantic hit rate", "hit rate (with exact)",
                     "unjudged hits"], rows)  # fmt: skip
    return lines


def render_mixed(data: dict[str, Any]) -> list[str]:
    """Mixed traffic: one row per run (the router alone, the bound at each sample rate), then quality per family."""
    setup = data.get("setup") or {}
    rates = setup.get("quality_sample_rate") or {}
    runs = data.get("runs") or {}
    rows = []
    for name, r in runs.items():
        late = r.get("after_warmup") or {}
        label = name if name not in rates else f"{name} (max_quality_loss {setup.get('max_quality_loss')}, sample {rates[name]})"
        rows.append([label, r.get("saved_share"), r.get("saved_share_after_judging"), r.get("quality_vs_all_strong"),
                     r.get("random_at_same_strong_share_quality_vs_all_strong"), r.get("strong_share_of_tiered"),
                     f"{_num(late.get('disagreement_share'))} (worst region {_num(late.get('worst_region_share'))})"])
    lines = [f"{setup.get('requests')} requests ({', '.join(f'{k} {v}' for k, v in (setup.get('families') or {}).items())}); "
             f"tiers priced {setup.get('prices_usd_per_million')} USD per million input/output tokens; the edge off.", ""]
    lines += _table(["run", "saved vs all-strong", "after judging spend", "quality vs all-strong", "random, same strong share",
                     "strong share (tiered)", f"disagreement served after request {setup.get('warmup')}"], rows)
    families = sorted({f for r in runs.values() for f in (r.get("per_family") or {})})
    lines += ["", "Quality vs all-strong per family:", ""]
    lines += _table(["run", *families], [[name, *((r.get("per_family") or {}).get(f, {}).get("quality_vs_all_strong") for f in families)]
                                          for name, r in runs.items()])
    return lines


def render_generic(data: dict[str, Any]) -> list[str]:
    rows = []
    for key, value in data.items():
        if key in SKIP_KEYS:
            continue
        if isinstance(value, dict):
            scalars = {k: v for k, v in value.items() if not isinstance(v, dict | list)}
            if scalars and len(scalars) <= 8:
                rows.append([key, ", ".join(f"{k} {_num(v)}" for k, v in scalars.items())])
        elif not isinstance(value, list):
            rows.append([key, value])
    return _table(["figure", "value"], rows[:16])


def render_static_embedding(data: dict[str, Any]) -> list[str]:
    """Each reader's held-out figure with MiniLM and with the static embedding, and which one it reads."""
    decision = {k: f"{v.get('reads')} (static within tolerance: {_num(v.get('static_within_tolerance'))})"
                for k, v in (data.get("decision") or {}).items()}
    rows: list[list[Any]] = []
    cost = data.get("cost")
    if cost:
        t, s = cost["transformer_ms_per_text"], cost["static_ms_per_text"]
        rows.append(["cost", f"ms per text at batch 1, p50 ({t.get('backend')} / static)", t["p50"], s["p50"], "", ""])
    for src, c in ((data.get("cache") or {}).get("sources") or {}).items():
        reads = decision.get("cache_candidate_search", "")
        rows.append(["cache search", f"{src}: recall of true partners, top-4 past the gate", c["minilm"]["recall_top4_past_gate"],
                     c["static"]["recall_top4_past_gate"], round(c["static"]["recall_top4_past_gate"] - c["minilm"]["recall_top4_past_gate"], 4), reads])
        rows.append(["cache search", f"{src}: AP of raw cosine", c["minilm"]["ap_cosine"], c["static"]["ap_cosine"],
                     round(c["static"]["ap_cosine"] - c["minilm"]["ap_cosine"], 4), reads])
    router = data.get("router") or {}
    for run, label in (("static", "whole selection"), ("static_same_candidate", "shipped candidate")):
        for src in ("mmlu", "alpaca") if run in router else ():
            t, s = router["transformer"][src]["apgr"], router[run][src]["apgr"]
            rows.append(["router", f"held-out APGR, {src}; static: {label} ({router[run]['model']})", t, s, round(s - t, 4),
                         decision.get("router", "")])
    edge = data.get("edge")
    if edge:
        t, s = edge["transformer"]["held_out_prior_auroc"], edge["static"]["held_out_prior_auroc"]
        rows.append(["edge prior", f"held-out prior AUROC (refitted on {edge.get('probes')} probes, {edge.get('held_out')} held out)", t, s, round(s - t, 4), decision.get("edge_prior", "")])
    artifact = data.get("artifact") or {}
    lines = [f"Static table: {artifact.get('vocabulary')} word pieces x {artifact.get('dimension')} dims, "
             f"{_num(round((artifact.get('bytes') or 0) / 1e6, 2))} MB; a reader switches to it where its figure is within "
             f"{_num(data.get('tolerance'))} of MiniLM's or better and its artifact is refitted on static features.", ""]
    return lines + _table(["reader", "figure", "MiniLM", "static", "static - MiniLM", "reads"], rows)


def render_scheduling(data: dict[str, Any]) -> list[str]:
    """The measured runs side by side, then the simulated GPU fleet's."""
    runs, c = data.get("runs") or {}, data.get("comparison") or {}
    money = c.get("money_per_line_usd") or {}
    rows = []
    for name in ("interactive_alone", "naive", "batch_api", "batch_alone"):
        r = runs.get(name)
        if not r:
            continue
        fleet, people, batch = r.get("fleet") or {}, r.get("interactive") or {}, r.get("batch") or {}
        lines = (data.get("workload") or {}).get("lines")
        done = batch.get("completion_s")
        rows.append([name, fleet.get("utilisation"), fleet.get("window_s"), people.get("measured"), people.get("ttft_p50_ms"),
                     people.get("ttft_p99_ms"), done, round(lines / done, 3) if lines and done else None, money.get(name)])
    out = _table(["run", "utilisation", "window s", "interactive turns", "TTFT p50 ms", "TTFT p99 ms", "batch done s",
                  "lines/s", "USD per line"], rows)
    w = data.get("workload") or {}
    if w:
        out += ["", f"Fleet: {w.get('fleet')}; {w.get('lines')} lines of `max_tokens` {w.get('max_tokens')}; "
                f"{w.get('sessions')} sessions of {w.get('turns_per_session')} streamed turns over {w.get('arrivals_span_s')} s "
                f"(30 % of the {w.get('fleet_capacity_requests_per_s')} requests/s the fleet answered with every slot busy); "
                f"member budget {w.get('member_budget')}, `batches.concurrency` {w.get('batches_concurrency')}. TTFT: turns "
                "that arrived while the batch had work (all of them alone); utilisation over the batch's window."]
    sim = data.get("simulation") or {}
    if sim.get("runs"):
        f = sim.get("fleet") or {}
        out += ["", f"Simulated GPU fleet ({f.get('members')} members x {f.get('slots_per_member')} slots, a full step "
                f"{f.get('step_at_full_batch_x')}x a lone one; the gateway's flow-control classes in virtual time):", ""]
        out += _table(["run", "utilisation", "interactive TTFT p50 ms", "TTFT p99 ms (while the batch runs)", "batch done s",
                       "lines/s"],
                      [[name, r.get("utilisation"), r.get("interactive_ttft_p50_ms"),
                        r.get("interactive_during_batch_ttft_p99_ms", r.get("interactive_ttft_p99_ms")),
                        r.get("batch_completion_s"), r.get("batch_lines_per_s")] for name, r in sim["runs"].items()])
    return out


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "cache_error_bound": render_cache_error_bound,
    "cache_latency": render_cache_latency,
    "peers": render_peers,
    "prefix_affinity": render_prefix_affinity,
    "scheduling": render_scheduling,
    "mixed": render_mixed,
    "proxy_overhead": render_proxy_overhead,
    "front_doors": render_front_doors,
    "agents": render_agents,
    "agent_sessions": render_agent_sessions,
    "shared_state": render_shared_state,
    "demo": render_demo,
    "edge_engine": render_edge_engine,
    "edge_kv_quality": render_edge_kv_quality,
    "edge_speculative": render_edge_speculative,
    "cache_quality": render_cache_quality,
    "edge_quality": render_edge_quality,
    "edge_models": render_edge_models,
    "edge_invalid_output": render_edge_invalid_output,
    "hostile_inputs": render_hostile_inputs,
    "image": render_image,
    "tiers": render_tiers,
    "edge_escalation_ttfb": render_edge_escalation_ttfb,
    "static_embedding": render_static_embedding,
}


# The pages of docs/results/, each a group of benches: a stem goes to the first group one of
# whose prefixes it starts with (longest prefix first), else to `gateway`. The navigation in
# mkdocs.yml lists exactly these pages, so the set is fixed here, never derived from the files.
PAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "cache": ("Semantic cache and embeddings", ("cache_", "embedding_precision", "static_embedding")),
    "routing": ("Router, tiers and the quality bound", ("router", "tiers", "mixed", "agreement_judge")),
    "edge": ("Edge lane and cascade", ("edge_",)),
    "agents": ("Front doors and coding agents", ("agent", "front_doors")),
    "fleet": ("Upstream fleets and shared state", ("prefix_affinity", "shared_state", "scheduling")),
    "gateway": ("Gateway overhead, limits, image, dashboard and demo", ()),
}
INDEX_TITLE = "Benchmark results"
GENERATED = "Generated by `bench/results_readme.py` from `bench/results/*.json`; rerun the scripts in `bench/` to refresh."


def page_of(stem: str) -> str:
    """The results page a bench's file renders on (e.g. `prefix_affinity` -> `fleet`)."""
    prefixes = sorted(((p, page) for page, (_, ps) in PAGES.items() for p in ps), key=lambda x: len(x[0]), reverse=True)
    return next((page for prefix, page in prefixes if stem.startswith(prefix)), "gateway")


def _load(results_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    loaded = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            print(f"results_readme: skipping {path.name}: {exc}", file=sys.stderr)
            continue
        if isinstance(data, dict):
            loaded.append((path.stem, data))
    return loaded


def _charts(results_dir: Path, stems: list[str]) -> dict[str, list[str]]:
    """The PNGs beside the result files, each under the bench whose name is its longest prefix
    (`demo_tiers.png` -> demo, `router_quality.png` -> router)."""
    charts: dict[str, list[str]] = {}
    for png in sorted(results_dir.glob("*.png")):
        owner = next((s for s in sorted(stems, key=len, reverse=True) if png.stem == s or png.stem.startswith(s + "_")), None)
        if owner is not None:
            charts.setdefault(owner, []).append(png.name)
    return charts


def render_section(stem: str, data: dict[str, Any], charts: list[str] | None = None) -> list[str]:
    """One bench's section: `## stem`, what it measured, its figures, its charts and its verdicts."""
    # a variant of a bench (edge_escalation_ttfb_c16) renders like the bench
    family = next((RENDERERS[n] for n in sorted(RENDERERS, key=len, reverse=True) if stem.startswith(n)), None)
    render_one = family or (render_replay if data.get("object") == "replay.report" else render_generic)
    parts = [f"## {stem}", ""]
    what = data.get("what") or data.get("benchmark")
    what = None if what == stem else what
    head = " ".join(x for x in (f"{what.rstrip('.')}." if what else "", f"({_stamp(data)})" if _stamp(data) else "") if x)
    if head:
        parts += [head, ""]
    try:
        parts += render_one(data)
    except (KeyError, TypeError) as exc:
        parts += render_generic(data)
        print(f"results_readme: {stem}.json has an unexpected shape ({exc!r}); listed generically", file=sys.stderr)
    if charts:
        parts += ["", *(f"![{name}]({name})" for name in charts)]
    if data.get("verdicts"):
        parts += ["", *render_verdicts(data)]
    parts.append("")
    return parts


def _summary(data: dict[str, Any]) -> str:
    verdicts = data.get("verdicts") or []
    if not verdicts:
        return "–"
    met = sum(r.get("met") is True for r in verdicts)
    missed = sum(r.get("met") is False for r in verdicts)
    other = len(verdicts) - met - missed
    return f"{met} met, {missed} not met" + (f", {other} without a verdict" if other else "")


def render_pages(results_dir: Path) -> dict[str, str | bytes]:
    """Every file of docs/results/: an index, one page per group of PAGES, and the charts (PNG
    copies, so the pages show them on the site and on GitHub alike). Keys are file names."""
    loaded = _load(results_dir)
    charts = _charts(results_dir, [stem for stem, _ in loaded])
    pages: dict[str, list[str]] = {page: [f"# {title}", "", GENERATED, ""] for page, (title, _) in PAGES.items()}
    index = [f"# {INDEX_TITLE}", "", GENERATED, "",
             "How they are measured, and on what machine, is in [Tests, benchmarks and docs](../development.md#benchmarks). "
             "Every target a benchmark names is listed on its page with the measured value, its sample size, a Wilson 95 % "
             "interval for rates and a verdict.", ""]  # fmt: skip
    for page, (title, _) in PAGES.items():
        index.append(f"- [{title}]({page}.md)")
    index += ["", *_table(["benchmark", "page", "targets"], [
        [f"[{stem}]({page_of(stem)}.md#{_anchor(stem)})", PAGES[page_of(stem)][0], _summary(data)] for stem, data in loaded
    ])]  # fmt: skip
    for stem, data in loaded:
        pages[page_of(stem)] += render_section(stem, data, charts.get(stem))
    for lines in pages.values():
        if len(lines) == 4:
            lines.append("No result file renders on this page yet.")
    out: dict[str, str | bytes] = {"index.md": "\n".join(index) + "\n"}
    out.update({f"{page}.md": "\n".join(lines).rstrip("\n") + "\n" for page, lines in pages.items()})
    for names in charts.values():
        out.update({name: (results_dir / name).read_bytes() for name in names})
    return out


def _anchor(stem: str) -> str:
    """The id MkDocs (and GitHub) give the heading `## stem`: lower case, dots dropped."""
    return "".join(c for c in stem.lower() if c.isalnum() or c in "_-")


def differences(out_dir: Path, pages: dict[str, str | bytes]) -> list[str]:
    """File names under out_dir that differ from a fresh render: changed, missing or left over."""
    present = {p.name for p in out_dir.iterdir() if p.is_file()} if out_dir.is_dir() else set()
    changed = []
    for name, content in pages.items():
        path = out_dir / name
        if name not in present:
            changed.append(name)
        elif (path.read_bytes() if isinstance(content, bytes) else path.read_text(encoding="utf-8")) != content:
            changed.append(name)
    return sorted(changed + sorted(present - set(pages)))


def write_pages(out_dir: Path, pages: dict[str, str | bytes]) -> list[str]:
    """Writes what changed and removes files the render no longer makes; returns their names."""
    changed = differences(out_dir, pages)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in changed:
        path = out_dir / name
        if name not in pages:
            path.unlink()
        elif isinstance(content := pages[name], bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results", help="the folder the pages are written to")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if a page would change")
    args = parser.parse_args(argv)
    pages = render_pages(args.results)
    if args.check:
        stale = differences(args.out, pages)
        if stale:
            print(f"{args.out} is out of date ({', '.join(stale)}): run bench/results_readme.py", file=sys.stderr)
            return 1
        return 0
    changed = write_pages(args.out, pages)
    print(f"{'updated ' + ', '.join(changed) if changed else 'unchanged'}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
