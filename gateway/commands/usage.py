"""`tierlane usage`: the same totals as GET /v1/usage.

With `state.backend: embedded` (the default) they are read straight from this replica's ledger
file. With `state.backend: redis` they are the whole fleet's, read from the shared store at
whole-UTC-hour granularity (`source: "fleet"`), as GET /v1/usage answers; `--local` reads this
replica's ledger instead, and when the store does not answer the ledger answers too, with a
warning (`source: "local"`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.errors import PolicyError
from telemetry.ledger import FILENAME, Ledger
from telemetry.usage import GROUP_KEYS, UsageQuery, read_usage, report, to_csv, to_table

if TYPE_CHECKING:
    from gateway.settings import Settings
    from telemetry.fleet_usage import FleetUsage


async def _fleet_rows(fleet: FleetUsage, query: UsageQuery) -> list[dict[str, Any]]:
    try:
        return await fleet.query(query)
    finally:
        await fleet.close()


def _fleet(settings: Settings, query: UsageQuery) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(rows, None) from the shared store; (None, warning) when it did not answer; (None, None) for embedded."""
    from telemetry.core import FLEET_UNAVAILABLE, fleet_usage

    fleet = fleet_usage(settings)
    if fleet is None:
        return None, None
    try:
        return asyncio.run(_fleet_rows(fleet, query)), None
    except Exception as exc:  # noqa: BLE001 - store down or slow: this replica's ledger answers, as GET /v1/usage does
        from policies.shared_state.redis_client import store_address

        print(f"tierlane usage: warning: the shared state store ({store_address(settings.state.url)}) did not answer "
              f"({exc!r}); reading this replica's ledger instead", file=sys.stderr)  # fmt: skip
        return None, FLEET_UNAVAILABLE


def _usage(args: argparse.Namespace) -> int:
    params = {
        "group_by": args.group_by,
        "from": args.since,
        "to": args.until,
        "tenant": args.tenant,
        "app": args.app,
        "model": args.model,
        "lane": args.lane,
        "priority": args.priority,
    }
    try:
        query = UsageQuery.parse({k: v for k, v in params.items() if v})
    except PolicyError as exc:
        flag = {"from": "--from", "to": "--to", "group_by": "--group-by"}.get(exc.param or "", exc.param)
        print(f"tierlane usage: {flag}: {exc.message}", file=sys.stderr)
        return 2
    state_dir: Path | None = args.state_dir
    rows: list[dict[str, Any]] | None = None
    warning: str | None = None
    if state_dir is None or not args.local:  # --state-dir with --local: that ledger alone, no settings needed
        from gateway.settings import Settings

        settings = Settings.load(args.config)
        state_dir = state_dir or settings.state_dir
        if not args.local and not query.rows_only:  # the fleet's totals keep no priority class
            rows, warning = _fleet(settings, query)
    source = "local" if rows is None else "fleet"
    if rows is None:
        path = Path(state_dir) / FILENAME
        if not path.exists():
            print(f"no ledger at {path}: has this gateway served any request yet?", file=sys.stderr)
            return 1
        rows, note = read_usage(Ledger(path), query)
        if note is not None:
            print(f"tierlane usage: warning: {note}", file=sys.stderr)
            warning = note if warning is None else f"{warning}; {note}"
    if args.format == "json":
        print(json.dumps(report(query, rows, source, warning), indent=2))
    elif args.format == "csv":
        sys.stdout.write(to_csv(query, rows))
    else:
        sys.stdout.write(to_table(query, rows))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "usage",
        help="print tokens, cost and savings from the ledger (or the fleet's, with state.backend: redis)",
        description="Totals of tokens, cost and savings (cache, edge, trim) over a time range, "
        "grouped by any of " + ", ".join(GROUP_KEYS) + ". With state.backend: redis the totals are "
        "every replica's, read from the shared store in whole UTC hours (a range is widened to the "
        "hours around it; JSON says source: fleet); --local reads this replica's ledger, to the second. "
        "When the store does not answer, this replica's ledger answers, with a warning on stderr. The priority "
        "class is kept on the ledger's rows only: a report by it reads this replica's rows still kept.",
    )
    parser.add_argument("--config", help="gateway settings YAML (for its state_dir and state backend)")
    parser.add_argument("--state-dir", type=Path, help="directory holding ledger.sqlite3 (overrides --config); "
                        "read with --local, with the embedded backend, or when the store does not answer")  # fmt: skip
    parser.add_argument("--local", action="store_true",
                        help="this replica's ledger, even with state.backend: redis (to the second)")  # fmt: skip
    parser.add_argument("--group-by", default="", help="comma-separated: " + ",".join(GROUP_KEYS))
    parser.add_argument("--from", dest="since", help="start: YYYY-MM-DD, ISO datetime or unix seconds (default: 30 days ago); "
                        "fleet totals count from the start of its UTC hour")  # fmt: skip
    parser.add_argument("--to", dest="until", help="end: same formats; a date includes that whole day (default: now); "
                        "fleet totals count to the end of its UTC hour")  # fmt: skip
    for key in ("tenant", "app", "model", "lane", "priority"):
        parser.add_argument(f"--{key}", help=f"only this {key}")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")
    parser.set_defaults(func=_usage)
