"""`tierlane replay FILE`: replay a JSON-lines workload against a gateway and report what it did."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from gateway.replay.workload import WorkloadError, read_workload


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _replay(args: argparse.Namespace) -> int:
    from gateway.replay.chart import write_chart
    from gateway.replay.report import format_report, write_json
    from gateway.replay.run import replay

    try:
        items = read_workload(args.file)
    except WorkloadError as exc:
        print(f"tierlane replay: {exc}", file=sys.stderr)
        return 2
    if not args.url.startswith(("http://", "https://")):
        print(f"tierlane replay: --url must start with http:// or https://, got {args.url!r}", file=sys.stderr)
        return 2
    if args.time_scale < 0 or args.timeout <= 0:
        print("tierlane replay: --time-scale must be >= 0 and --timeout > 0", file=sys.stderr)
        return 2
    if args.limit is not None:
        items = items[: args.limit]
    report = asyncio.run(
        replay(
            items,
            args.url,
            concurrency=args.concurrency,
            api_key=args.api_key,
            stream=not args.no_stream,
            timeout_s=args.timeout,
            time_scale=args.time_scale,
            meta={"workload": str(args.file)},
        )
    )
    if report["totals"]["ok"] == 0:
        print(format_report(report), end="")
        print(f"tierlane replay: no request succeeded against {args.url}; is the gateway running?", file=sys.stderr)
        return 1
    out = Path(args.out)
    json_path = write_json(report, out)
    png_path = write_chart(report, out)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report), end="")
    if png_path is None:
        print(f"wrote {json_path} (no chart: matplotlib comes with `pip install tierlane[train]`)", file=sys.stderr)
    else:
        print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "replay",
        help="replay a workload against a gateway and report lanes, cache, cost and latency",
        description="Send each request of a JSON-lines workload ({at, body} per line; see "
        "bench/make_workload.py) to a running gateway, then report per lane requests, tokens, "
        "p50/p95/p99 latency and TTFT, the cache hit rate, and cost and savings from GET /v1/usage.",
    )
    parser.add_argument("file", type=Path, help="workload, JSON lines")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="gateway base URL (default: %(default)s)")
    parser.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight at most (default: %(default)s)")
    parser.add_argument("--out", default="replay-out", help="directory for replay.json and replay.png (default: %(default)s)")
    parser.add_argument("--api-key", help="key sent as Bearer; an admin key also yields cost from /v1/usage")
    parser.add_argument("--no-stream", action="store_true", help="send whole (non-streaming) requests; no TTFT")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply each `at` offset (0 sends as fast as concurrency allows)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default: %(default)s)")
    parser.add_argument("--limit", type=_positive_int, help="replay only the first N requests")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the summary")
    parser.set_defaults(func=_replay)
