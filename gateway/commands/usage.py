"""`tierlane usage`: the same totals as GET /v1/usage, read straight from the ledger file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from policies.errors import PolicyError
from telemetry.ledger import FILENAME, Ledger
from telemetry.usage import GROUP_KEYS, UsageQuery, report, run_query, to_csv, to_table


def _usage(args: argparse.Namespace) -> int:
    state_dir = args.state_dir
    if state_dir is None:
        from gateway.settings import Settings

        state_dir = Settings.load(args.config).state_dir
    path = Path(state_dir) / FILENAME
    if not path.exists():
        print(f"no ledger at {path}: has this gateway served any request yet?", file=sys.stderr)
        return 1
    params = {
        "group_by": args.group_by,
        "from": args.since,
        "to": args.until,
        "tenant": args.tenant,
        "app": args.app,
        "model": args.model,
        "lane": args.lane,
    }
    try:
        query = UsageQuery.parse({k: v for k, v in params.items() if v})
    except PolicyError as exc:
        flag = {"from": "--from", "to": "--to", "group_by": "--group-by"}.get(exc.param or "", exc.param)
        print(f"tierlane usage: {flag}: {exc.message}", file=sys.stderr)
        return 2
    rows = run_query(Ledger(path), query)
    if args.format == "json":
        print(json.dumps(report(query, rows), indent=2))
    elif args.format == "csv":
        sys.stdout.write(to_csv(query, rows))
    else:
        sys.stdout.write(to_table(query, rows))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "usage",
        help="print tokens, cost and savings from the ledger",
        description="Totals of tokens, cost and savings (cache, edge, trim) over a time range, "
        "grouped by any of " + ", ".join(GROUP_KEYS) + ".",
    )
    parser.add_argument("--config", help="gateway settings YAML (for its state_dir)")
    parser.add_argument("--state-dir", type=Path, help="directory holding ledger.sqlite3 (overrides --config)")
    parser.add_argument("--group-by", default="", help="comma-separated: " + ",".join(GROUP_KEYS))
    parser.add_argument("--from", dest="since", help="start: YYYY-MM-DD, ISO datetime or unix seconds (default: 30 days ago)")
    parser.add_argument("--to", dest="until", help="end: same formats; a date includes that whole day (default: now)")
    for key in ("tenant", "app", "model", "lane"):
        parser.add_argument(f"--{key}", help=f"only this {key}")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")
    parser.set_defaults(func=_usage)
