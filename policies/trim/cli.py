"""`tierlane trim`: trim a chat request read from stdin and report what each pass removed."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from policies.errors import PolicyError
from policies.policy import Policy
from policies.trim.config import TrimPolicy, TrimPolicyError
from policies.trim.core import trim_request


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "trim",
        help="trim a chat request (JSON on stdin) and print it with a per-pass report",
        description="Reads an OpenAI chat request on stdin, prints the trimmed request on stdout "
        "and a per-pass report on stderr, using the default trim policy.",
    )
    p.add_argument("--policy", help="an operator policy YAML merged over the defaults")
    p.add_argument("--budget", type=int, help="history budget in tokens (overrides the policy)")
    p.add_argument(
        "--tokenizer",
        choices=["edge", "estimate"],
        default="edge",
        help="count with the bundled edge model's tokenizer (default) or a tokenizer-free estimate",
    )
    p.add_argument("--json-report", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raw = sys.stdin.buffer.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        print(f"tierlane trim: stdin is not valid JSON ({exc}); pipe in a chat request like "
              '{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', file=sys.stderr)
        return 2
    try:
        extra = {"trim": {"history": {"max_tokens": args.budget}}} if args.budget is not None else None
        section = Policy.load(args.policy, extra=extra).resolve("trim")
        policy = TrimPolicy.from_dict(section)
    except (OSError, TrimPolicyError) as exc:
        print(f"tierlane trim: {exc}", file=sys.stderr)
        return 2
    count = None
    if args.tokenizer == "edge":
        from policies.trim.tokenizer import edge_token_counter

        count = edge_token_counter()
    try:
        result = trim_request(body, policy, count)
    except PolicyError as exc:
        where = f" (at {exc.param})" if exc.param else ""
        print(f"tierlane trim: {exc.message}{where}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(orjson.dumps(result.body, option=orjson.OPT_INDENT_2) + b"\n")
    sys.stdout.flush()
    if args.json_report:
        print(orjson.dumps(result.summary(), option=orjson.OPT_INDENT_2).decode(), file=sys.stderr)
    else:
        print(result.render(), file=sys.stderr)
    return 0
