"""`tierlane router train | eval | score`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from policies.errors import InvalidInput
from policies.router.artifact import RouterArtifactError
from policies.router.features import Prompt, last_user_text


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    router = subparsers.add_parser("router", help="train, evaluate and run the complexity router")
    sub = router.add_subparsers(dest="router_command", metavar="ACTION", required=True)

    train = sub.add_parser("train", help="compare candidate models on held-out subjects and write an artifact")
    train.add_argument("--data", type=Path, default=None, help="shared data dir (default: ../shared/data)")
    train.add_argument("--cache", type=Path, default=None, help="embedding cache dir (default: .tierlane/cache/router)")
    train.add_argument("--out", type=Path, default=None, help="artifact directory to write (default: write nothing)")
    train.add_argument("--seed", type=int, default=13)
    train.add_argument("--folds", type=int, default=8)
    train.add_argument("--only", nargs="*", default=[], help="candidate names to try (default: all)")
    train.add_argument("--report", type=Path, default=None, help="also write the manifest body to this JSON file")
    train.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="AUC, APGR and CPT of an artifact on its held-out subjects, plus a PNG")
    ev.add_argument("--artifact", type=Path, default=None, help="artifact dir (default: the shipped model)")
    ev.add_argument("--data", type=Path, default=None)
    ev.add_argument("--cache", type=Path, default=None)
    ev.add_argument("--json", type=Path, default=None, help="write the report here too")
    ev.add_argument("--plot", type=Path, default=None, help="PNG of quality vs strong share")
    ev.set_defaults(func=_eval)

    score = sub.add_parser("score", help='read {"prompt": ...} or {"messages": [...]} lines, write {"score": p} '
                                         "as the gateway computes it (same text, embedding backend and Router.score)")
    score.add_argument("--artifact", type=Path, default=None, help="artifact dir (default: the shipped model)")
    score.set_defaults(func=_score)


def _fail(message: str, code: int = 2) -> int:
    print(f"tierlane router: {message}", file=sys.stderr)
    return code


def _data_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    from policies.router.data import default_cache_dir, shared_data_dir

    data = shared_data_dir(args.data)
    if not (data / "router").is_dir():
        raise FileNotFoundError(f"no router data under {data}; pass --data or set TIERLANE_SHARED_DATA")
    return data, args.cache or default_cache_dir()


def _train(args: argparse.Namespace) -> int:
    from policies.router.train import TrainConfig, train

    try:
        data, cache = _data_paths(args)
        manifest = train(TrainConfig(data_dir=data, cache_dir=cache, out=args.out, seed=args.seed,
                                     folds=args.folds, only=list(args.only)))
    except (FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    test = manifest["metrics"]["held_out_test"]
    summary = {src: {k: test[src].get(k) for k in ("auc", "apgr", "cpt50", "mean_within_subject_auc") if k in test[src]}
               for src in test}
    print(json.dumps({"model": manifest["model"]["name"], "held_out": summary, "out": str(args.out) if args.out else None}))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from policies.router.evaluate import evaluate_router
    from policies.router.model import Router

    try:
        router = Router.load(args.artifact)
        data, cache = _data_paths(args)
        report = evaluate_router(router, data, cache, plot=args.plot)
    except (RouterArtifactError, FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    text = json.dumps(report, indent=1)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


def parse_score_line(line: str, number: int) -> Prompt:
    """One stdin line as a prompt string or a message list; ValueError names the line on bad input."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"line {number}: not JSON ({exc})") from None
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if isinstance(prompt, str):
        return prompt
    messages = row.get("messages") if isinstance(row, dict) else None
    if isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        return messages
    raise ValueError(f'line {number}: expected {{"prompt": "..."}} or {{"messages": [{{"role": ..., "content": ...}}]}}')


def served_text(prompt: Prompt) -> str:
    """The text the gateway embeds for this prompt: embedding_text of the request body (the last
    user turn, normalised, cut at 4000 chars), or the raw last user text when that is empty."""
    from policies.cache.scope import embedding_text

    body: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"messages": list(prompt)}
    try:
        text = embedding_text(body)
    except InvalidInput as exc:
        raise ValueError(str(exc)) from None
    return text or last_user_text(prompt)


def score_stream(lines: Iterable[str], out: TextIO, router: Any, embed: Any, batch: int = 64) -> int:
    """Score JSON lines in batches; returns how many were written.

    Each score is `router.score(prompt, embedding)`, the call the gateway's route stage makes,
    on the embedding of the text the gateway embeds (`served_text`).
    """
    prompts: list[Prompt] = []
    written = 0

    def flush() -> None:
        nonlocal written
        if not prompts:
            return
        vectors = embed([served_text(p) for p in prompts])
        for prompt, vector in zip(prompts, vectors):
            out.write(json.dumps({"score": round(router.score(prompt, vector), 6)}) + "\n")
        written += len(prompts)
        prompts.clear()

    for number, line in enumerate(lines, start=1):
        if line.strip():
            prompts.append(parse_score_line(line, number))
            if len(prompts) >= batch:
                flush()
    flush()
    return written


def _score(args: argparse.Namespace) -> int:
    from policies.embedding.embedder import load_encoder
    from policies.router.model import Router

    try:
        router = Router.load(args.artifact)
    except RouterArtifactError as exc:
        return _fail(str(exc))
    encoder = load_encoder()  # the backend the gateway runs by default
    try:
        score_stream(sys.stdin, sys.stdout, router, encoder.encode)
    except ValueError as exc:
        return _fail(str(exc))
    return 0
