"""`tierlane edge learn | learn-list | learn-forget`: the learned templates' pairs in the state directory.

    tierlane edge learn [--template NAME] [--tenant T [--app A]] [--budget-s S] [--seed N] ...
    tierlane edge learn-list [--tenant T]
    tierlane edge learn-forget --template NAME [--tenant T [--app A]]

All open the pair file the gateway's settings point at (state_dir/learn_pairs.sqlite3); the file
is local to one gateway, so run it on each replica. A gateway that runs meanwhile may still write
pairs it collected before the command: DELETE /v1/edge/templates/{name} on that gateway also
forgets those.

`learn` trains a LoRA adapter of the edge model (edge.model) per template on CPU and writes
`<out>/<tenant>/<app>/<template>/<sha256>.gguf` with `<sha256>.json` beside it
(policies.learn.job); it needs the `learn` extra (pip install 'tierlane[learn]'), imported here
only. Exit status: 0 done; 1 a template was refused (fewer pairs than the learn section's
min_pairs) or failed, the others still trained; 2 wrong arguments or settings, or the extra missing.
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
    _register_learn(sub)


def _register_learn(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    learn = sub.add_parser("learn", help="train a LoRA adapter of the edge model per learned template (CPU), and "
                           "write it as GGUF with a manifest")  # fmt: skip
    learn.add_argument("--config", help="YAML settings file (default: $TIERLANE_CONFIG or the embedded defaults)")
    learn.add_argument("--state-dir", help="the state directory (default: the settings' state_dir)")
    learn.add_argument("--out", help="where adapters go (default: STATE_DIR/learn)")
    learn.add_argument("--template", help="only this template (default: every template with pairs)")
    learn.add_argument("--tenant", help="only this tenant's")
    learn.add_argument("--app", help="only this app's (with --tenant)")
    learn.add_argument("--budget-s", type=float, default=3600.0,
                       help="longest a template's training may take, in seconds; it stops after the step that passes it "
                            "(default 3600; 0: no bound)")  # fmt: skip
    learn.add_argument("--seed", type=int, default=0, help="the adapter's initial values and the order of examples (default 0)")
    learn.add_argument("--epochs", type=float, default=2.0, help="passes over the training pairs (default 2)")
    learn.add_argument("--max-steps", type=int, help="at most this many optimizer steps (default: the epochs')")
    learn.add_argument("--batch-size", type=int, default=16, help="examples per step (default 16)")
    learn.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16; alpha is twice it)")
    learn.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW's peak learning rate (default 1e-3)")
    learn.add_argument("--max-tokens", type=int, default=512, help="a pair longer than this in tokens is left out (default 512)")
    learn.add_argument("--max-batch-tokens", type=int, default=1024,
                       help="a step's examples go through in slices of at most this many padded tokens, gradients "
                            "summed: bounds memory, about 2.2 MB a token (default 1024)")  # fmt: skip
    learn.add_argument("--max-eval", type=int, default=500, help="held-out pairs answered for the figures (default 500)")
    learn.add_argument("--threads", type=int, help="CPU threads for training and evaluation (default: torch's, one per "
                       "core; fewer go faster where the cores are busy with other work)")  # fmt: skip
    learn.add_argument("--quiet", action="store_true", help="no progress bar")
    learn.set_defaults(func=_learn)


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


def _learn(args: argparse.Namespace) -> int:
    from policies.learn.config import NAME

    if args.template is not None and not NAME.match(args.template):
        return _fail(f"learn: {args.template!r} is no template name")
    if args.app and not args.tenant:
        return _fail("learn: --app needs --tenant (an app's name is its tenant's)")
    numbers = (
        args.batch_size,
        args.rank,
        args.max_tokens,
        args.max_eval,
        args.max_batch_tokens,
        *(n for n in (args.max_steps, args.threads) if n is not None),
    )
    if min(numbers) < 1 or args.epochs <= 0 or args.learning_rate <= 0 or args.budget_s < 0:
        return _fail("learn: --batch-size, --rank, --max-tokens, --max-batch-tokens, --max-eval, --max-steps, --threads, "
                     "--epochs and --learning-rate must be above 0, --budget-s 0 or above")  # fmt: skip
    try:
        import gguf  # noqa: F401
        import peft  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        return _fail(f"learn needs the learn extra (pip install 'tierlane[learn]'): {exc}")
    from gateway.settings import Settings
    from policies.learn.config import LearnPolicy
    from policies.learn.job import Learner, NotEnoughPairs, plan
    from policies.learn.pairs import FILENAME, PairReader
    from policies.learn.service import ARTIFACTS
    from policies.learn.trainer import Hyper
    from policies.policy import Policy

    try:
        settings = Settings.load(args.config)
        learn_policy = LearnPolicy(Policy.load(settings.policy_file, extra=settings.policy))
        base = settings.edge.resolved_model_path()
    except (OSError, ValueError, RuntimeError) as exc:
        return _fail(f"the settings do not load: {exc}")
    state_dir = Path(args.state_dir) if args.state_dir else settings.state_dir
    path = state_dir / FILENAME
    if not path.exists():
        return _fail(f"learn: no pair file at {path}: no template has collected pairs there")
    out_dir = Path(args.out) if args.out else state_dir / ARTIFACTS
    hyper = Hyper(rank=args.rank, alpha=2 * args.rank, learning_rate=args.learning_rate, batch_size=args.batch_size,
                  epochs=args.epochs, max_steps=args.max_steps, max_tokens=args.max_tokens,
                  max_batch_tokens=args.max_batch_tokens, seed=args.seed)  # fmt: skip
    refused: list[str] = []
    written: list[dict[str, object]] = []
    with PairReader(path) as reader:
        keys = [(t.tenant, t.app, t.template) for t in reader.templates(args.tenant)
                if (args.template is None or t.template == args.template) and (args.app is None or t.app == args.app)]  # fmt: skip
        if not keys:
            return _fail(f"learn: no pairs kept for {args.template or 'any template'} in {path}")
        plans = []
        for tenant, app, template in keys:
            try:
                plans.append(plan(reader, tenant, app, template, learn_policy.section_for(tenant, app)))
            except NotEnoughPairs as exc:
                refused.append(str(exc))
                print(f"tierlane edge learn: refused: {exc}", file=sys.stderr, flush=True)
    if plans:
        learner = Learner(base, progress=not args.quiet, threads=args.threads)
        try:
            for job in plans:
                print(f"tierlane edge learn: {job.template} of {job.tenant}/{job.app}: {len(job.train)} training and "
                      f"{len(job.held_out)} held-out pairs", file=sys.stderr, flush=True)  # fmt: skip
                try:
                    result = learner.learn(job, hyper, out_dir, budget_s=args.budget_s or None, max_eval=args.max_eval)
                except (NotEnoughPairs, OSError, ValueError) as exc:
                    refused.append(str(exc))
                    print(f"tierlane edge learn: {job.template} of {job.tenant}/{job.app} failed: {exc}", file=sys.stderr)
                    continue
                written.append(result.summary | {"manifest": str(result.manifest)})
        finally:
            learner.close()
    print(json.dumps({"path": str(path), "written": written, "refused": refused}, indent=1))
    return 1 if refused else 0
