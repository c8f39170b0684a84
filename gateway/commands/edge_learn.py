"""`tierlane edge learn-list | learn-forget`: the learned templates' pairs in the state directory.

    tierlane edge learn-list [--tenant T]
    tierlane edge learn-forget --template NAME [--tenant T [--app A]]

Both open the pair file the gateway's settings point at (state_dir/learn_pairs.sqlite3); the file
is local to one gateway, so run it on each replica. A gateway that runs meanwhile may still write
pairs it collected before the command: DELETE /v1/edge/templates/{name} on that gateway also
forgets those. Exit status: 0 done; 2 wrong arguments or settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # NOTE: `tierlane edge` is registered by policies.edge_quality.cli; these join it.
    edge = subparsers.choices.get("edge") or subparsers.add_parser("edge", help="the local edge model")
    actions = [a for a in edge._actions if isinstance(a, argparse._SubParsersAction)]
    sub = actions[0] if actions else edge.add_subparsers(dest="edge_command", metavar="ACTION", required=True)
    listing = sub.add_parser("learn-list", help="the learned templates' pairs kept in the state directory, per template")
    forget = sub.add_parser("learn-forget", help="delete the pairs kept for a learned template (of one tenant, or all)")
    for parser in (listing, forget):
        parser.add_argument("--config", help="YAML settings file (default: $TIERLANE_CONFIG or the embedded defaults)")
        parser.add_argument("--state-dir", help="the state directory (default: the settings' state_dir)")
        parser.add_argument("--tenant", help="only this tenant's")
    forget.add_argument("--template", required=True, help="the template's name, as the policy's learn.templates names it")
    forget.add_argument("--app", help="only this app's (with --tenant)")
    listing.set_defaults(func=_list)
    forget.set_defaults(func=_forget)


def _path(args: argparse.Namespace) -> Path:
    from gateway.settings import Settings
    from policies.learn.pairs import FILENAME

    state_dir = Path(args.state_dir) if args.state_dir else Settings.load(args.config).state_dir
    return state_dir / FILENAME


def _fail(message: str) -> int:
    print(f"tierlane edge: {message}", file=sys.stderr, flush=True)
    return 2


def _list(args: argparse.Namespace) -> int:
    from policies.learn.pairs import summarize_in

    try:
        path = _path(args)
    except (OSError, ValueError) as exc:
        return _fail(f"the settings do not load: {exc}")
    rows = [{"tenant": p.tenant, "app": p.app, "template": p.template, "pairs": p.pairs, "bytes": p.bytes}
            for p in summarize_in(path, args.tenant)]  # fmt: skip
    print(json.dumps({"path": str(path), "templates": rows}, indent=1))
    return 0


def _forget(args: argparse.Namespace) -> int:
    from policies.learn.config import NAME
    from policies.learn.pairs import forget_in

    if not NAME.match(args.template):
        return _fail(f"learn-forget: {args.template!r} is no template name")
    if args.app and not args.tenant:
        return _fail("learn-forget: --app needs --tenant (an app's name is its tenant's)")
    try:
        path = _path(args)
    except (OSError, ValueError) as exc:
        return _fail(f"the settings do not load: {exc}")
    deleted = forget_in(path, args.template, args.tenant, args.app)
    print(json.dumps({"path": str(path), "template": args.template, "tenant": args.tenant, "app": args.app,
                      "deleted": deleted}, indent=1))  # fmt: skip
    return 0
