"""Rewrite the "Results" block of README.md from bench/results/*.json.

Only the text between `<!-- results:start -->` and `<!-- results:end -->` changes; the markers
are appended at the end of README.md when they are not there yet.

    .venv/bin/python bench/results_readme.py            # rewrite README.md
    .venv/bin/python bench/results_readme.py --check    # exit 1 when README.md is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"
SKIP_KEYS = {"machine", "generated_at", "what", "benchmark", "rounds", "results", "note"}


def _num(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    if value is None:
        return "–"
    return str(value)


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


def render_peers(data: dict[str, Any]) -> list[str]:
    rows = []
    for level, r in data.get("results", {}).items():
        c = level.removeprefix("concurrency_")
        for name in ("direct", "tierlane_passthrough", "tierlane_full", "litellm"):
            if name in r:
                t = r[name]
                rows.append(
                    [
                        c,
                        name,
                        t.get("added_p50_ms", 0.0),
                        t.get("added_p99_ms", 0.0),
                        t["p50_ms"],
                        t["p99_ms"],
                        t["rps"],
                        t["errors"],
                    ]
                )
    lines = _table(["concurrency", "target", "added p50 ms", "added p99 ms", "p50 ms", "p99 ms", "req/s", "errors"], rows)
    rss = data.get("peak_rss_mb") or {}
    if rss:
        lines += ["", "Peak RSS (VmHWM, MiB): " + ", ".join(f"{k} {_num(v)}" for k, v in rss.items())]
    verdict = data.get("verdict") or {}
    if verdict:
        lines += ["", "Against the targets (" + "; ".join(f"{k} {v}" for k, v in data.get("targets", {}).items()) + "):", ""]
        vrows = [
            [
                lvl.removeprefix("concurrency_"),
                v["passthrough_added_p99_vs_litellm"],
                v["passthrough_rps_vs_litellm"],
                v["full_pipeline_rps_vs_litellm"],
                ", ".join(k for k, ok in v["met"].items() if ok) or "none",
            ]
            for lvl, v in verdict.items()
        ]
        lines += _table(
            [
                "concurrency",
                "pass-through added p99 / LiteLLM's",
                "pass-through req/s ÷ LiteLLM",
                "full pipeline req/s ÷ LiteLLM",
                "met",
            ],
            vrows,
        )
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
                        cache[name]["hit_rate"],
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
        f"{totals['requests']} requests, {totals['errors']} errors, cache hit rate {_num(totals['cache_hit_rate'])}, "
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
    lines += ["", "Against the targets:", ""]
    lines += _table(
        ["figure", "value", "target", "met"], [[name, r["value"], r["target"], r["met"]] for name, r in data["ratios"].items()]
    )
    return lines


def render_edge_kv_quality(data: dict[str, Any]) -> list[str]:
    rows = [
        [
            name,
            r["top1_agreement"],
            r["kl_mean"],
            r["kl_p99"],
            r["greedy_text_identical"],
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
    rows = [
        [label, summary[key]["speedup"], summary[key]["acceptance_rate"], summary[key]["target"]]
        for key, label in names.items()
        if key in summary
    ]
    identical = ", ".join(f"{k} {v}" for k, v in summary.get("d_identical", {}).items())
    lines = [f"Speculation on vs off, tokens/s ratio; greedy output identical: {identical}.", ""]
    return lines + _table(["workload", "on / off", "acceptance", "target"], rows)


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
                shipped["precision"],
                shipped["recall"],
                shipped["served"],
                rules["precision"],
                rules["recall"],
                cosine["precision"],
                cosine["recall"],
            ]
        )
    return lines + _table(
        ["test source", "precision", "recall", "served", "rules only: precision", "recall", "cosine 0.90: precision", "recall"],
        rows,
    )


def render_edge_quality(data: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    gateway = data.get("gateway")
    if gateway:
        tasks = ", ".join(f"{k} {v}" for k, v in gateway.get("tasks", {}).items())
        lines += [
            f"Through running gateways, model `auto`, an upstream that answers every task right ({tasks}); "
            f"pinned to the edge the model is right on {_num(gateway['pinned_edge_accuracy'])} of them:",
            "",
        ]
        rows = [
            [
                name,
                g["local_precision"],
                g["local_recall"],
                g["overall_accuracy"],
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
        for policy, r in body["policies"].items():
            rows.append([name, policy, r["local_precision"], r["local_recall"], r["edge_share"], r["overall_accuracy"]])
    lines += _table(["tasks", "decision", "local precision", "local recall", "edge share", "overall accuracy"], rows)
    held = data["sets"].get("held_out_probes")
    if held:
        lines += [
            "",
            "AUROC for edge correctness on the held-out probes: "
            + ", ".join(f"{k} {_num(v)}" for k, v in held["auroc"].items())
            + ".",
        ]
    return lines


def render_edge_invalid_output(data: dict[str, Any]) -> list[str]:
    inv, js = data["invalid"], data["json_mode"]
    rows = [[k.replace("_", " "), v["count"], v["share"]] for k, v in inv.items()]
    lines = [
        f"{data['prompts']} everyday prompts, greedy, max_tokens {data['max_tokens']}; invalid = a loop, or "
        f"max_tokens reached while repeating. Reduction for `auto` traffic: {_num(data['invalid_reduction_auto'])}.",
        "",
    ]
    lines += _table(["edge answers", "invalid", "share"], rows)
    lines += [
        "",
        f"JSON mode ({js['prompts']} prompts): parse without grammar {_num(js['parse_share_without_grammar'])}, "
        f"with grammar {_num(js['parse_share_with_grammar'])} ({_num(js['parse_share_with_grammar_of_finished'])} of "
        f"the answers that ended on their own; {js['with_grammar_ended_by_max_tokens']} ended at max_tokens or in a "
        "loop, which `auto` traffic escalates).",
    ]
    return lines


def render_image(data: dict[str, Any]) -> list[str]:
    lines = [
        f"`{data['image']}` built with {data['engine']} over `{data.get('base_image')}`: `make image` "
        f"{_num(data.get('build_wall_s'))} s wall (wheelhouse {_num(data.get('wheelhouse_s'))} s, base image "
        f"{_num(data.get('base_image_s'))} s (0: reused), Dockerfile build {_num(data.get('dockerfile_build_s'))} s).",
        "",
    ]
    lines += _table(
        ["figure", "value", "target", "met"],
        [[name, v["value"], v["target"], v["met"]] for name, v in data["verdict"].items()],
    )
    lines += ["", f"Checks ({data['checks_passed']} passed):", ""]
    lines += _table(["check", "passed"], [[name, ok] for name, ok in data["checks"].items()])
    space = data.get("space_mb") or {}
    if space:
        lines += ["", "What takes the space (MB): " + ", ".join(f"{k} {_num(v)}" for k, v in space.items())]
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


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "peers": render_peers,
    "proxy_overhead": render_proxy_overhead,
    "shared_state": render_shared_state,
    "demo": render_replay,
    "edge_engine": render_edge_engine,
    "edge_kv_quality": render_edge_kv_quality,
    "edge_speculative": render_edge_speculative,
    "cache_quality": render_cache_quality,
    "edge_quality": render_edge_quality,
    "edge_invalid_output": render_edge_invalid_output,
    "image": render_image,
}


def render(results_dir: Path) -> str:
    parts = [
        START,
        "## Results",
        "",
        "Generated by `bench/results_readme.py` from `bench/results/*.json`; rerun the scripts in `bench/` to refresh.",
        "",
    ]
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            print(f"results_readme: skipping {path.name}: {exc}", file=sys.stderr)
            continue
        if not isinstance(data, dict):
            continue
        render_one = RENDERERS.get(path.stem) or (render_replay if data.get("object") == "replay.report" else render_generic)
        parts.append(f"### {path.stem}")
        parts.append("")
        what = data.get("what") or data.get("benchmark")
        what = None if what == path.stem else what
        head = " ".join(x for x in (f"{what.rstrip('.')}." if what else "", f"({_stamp(data)})" if _stamp(data) else "") if x)
        if head:
            parts += [head, ""]
        try:
            parts += render_one(data)
        except (KeyError, TypeError) as exc:
            parts += render_generic(data)
            print(f"results_readme: {path.name} has an unexpected shape ({exc!r}); listed generically", file=sys.stderr)
        parts.append("")
    parts.append(END)
    return "\n".join(parts)


def rewrite(readme: str, block: str) -> str:
    """README text with the block between the markers replaced (markers appended when absent)."""
    start, end = readme.find(START), readme.find(END)
    if start == -1 and end == -1:
        return readme.rstrip("\n") + "\n\n" + block + "\n"
    if start == -1 or end == -1 or end < start:
        raise ValueError(f"README.md has one results marker without the other ({START} ... {END})")
    return readme[:start] + block + readme[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if README.md would change")
    args = parser.parse_args(argv)
    if not args.readme.is_file():
        print(f"results_readme: {args.readme} not found", file=sys.stderr)
        return 2
    old = args.readme.read_text(encoding="utf-8")
    try:
        new = rewrite(old, render(args.results))
    except ValueError as exc:
        print(f"results_readme: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if new != old:
            print("README.md results are out of date: run bench/results_readme.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        args.readme.write_text(new, encoding="utf-8")
    print(f"{'updated' if new != old else 'unchanged'}: {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
