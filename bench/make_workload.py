"""Write a replay workload (JSON lines) with stated shares of request kinds, from ../shared/data.

Kinds: `repeat` (a question asked earlier in the workload, byte for byte), `paraphrase`
(GPTCache mock pairs: the origin appears first as a `seed`, the similar wording later),
`simple` (everyday OpenAssistant prompts), `hard` (MMLU questions and MATH Level 5
problems) and `checkable` (held-out edge probes, policies/edge_quality: each line carries its
`expected` answer and `check`, so the replay reports accuracy beside each lane's savings). Arrivals are a Poisson process at `--rate` requests per second. The same seed
always writes the same file. `max_tokens` is small: the demo upstream is a 135M CPU model.

    .venv/bin/python bench/make_workload.py --out workload.jsonl --requests 200
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"
KINDS = ("repeat", "paraphrase", "simple", "hard", "checkable")
DEFAULT_SHARES = {"repeat": 0.2, "paraphrase": 0.15, "simple": 0.3, "hard": 0.2, "checkable": 0.15}


class DataMissing(RuntimeError):
    """The shared data directory or one of its files is not there."""


def _need(path: Path) -> Path:
    if not path.exists():
        raise DataMissing(f"{path} is missing (expected the shared data sets; see ../shared/data/README.md)")
    return path


def simple_prompts(data: Path) -> list[str]:
    prompts: list[str] = []
    for name in ("oasst_en_100_text.jsonl", "oasst_prompt_lottery_en_250_text.jsonl"):
        with _need(data / "router" / name).open(encoding="utf-8") as fh:
            prompts += [json.loads(line) for line in fh if line.strip()]
    return [p for p in prompts if isinstance(p, str) and 0 < len(p) <= 600]


def hard_prompts(data: Path) -> list[str]:
    prompts: list[str] = []
    mmlu = _need(data / "router" / "routellm_mmlu_responses")
    for path in sorted(mmlu.glob("mmlu_*.csv")):
        with path.open(encoding="utf-8", newline="") as fh:
            prompts += [row["prompt"] for row in csv.DictReader(fh) if row.get("prompt")]
    with _need(data / "router" / "math_levels.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("level") == "Level 5":
                prompts.append(row["problem"])
    return [p for p in prompts if len(p) <= 1500]


def checkable_tasks() -> list[dict[str, Any]]:
    """Held-out edge probes (never used in calibration) as workload fields: messages, expected, check."""
    from policies.edge_quality.probes import load_probes

    return [
        {"messages": p.messages, "check": p.check,
         "expected": {"answer": p.answer, "aliases": list(p.aliases), "distractors": list(p.distractors),
                      "choices": list(p.choices)}}
        for p in load_probes(split="held_out")
    ]


def paraphrase_pairs(data: Path) -> list[tuple[str, str]]:
    pairs = json.loads(_need(data / "cache" / "gptcache_mock_pairs.json").read_text(encoding="utf-8"))
    return [(p["origin"], p["similar"]) for p in pairs if p.get("origin") and p.get("similar")]


def counts(total: int, shares: dict[str, float]) -> dict[str, int]:
    """Whole numbers per kind that add up to `total` (largest remainders get the leftovers)."""
    norm = sum(shares.values())
    if norm <= 0:
        raise ValueError("at least one share must be positive")
    exact = {k: total * shares.get(k, 0.0) / norm for k in KINDS}
    out = {k: int(v) for k, v in exact.items()}
    for k in sorted(KINDS, key=lambda k: exact[k] - out[k], reverse=True)[: total - sum(out.values())]:
        out[k] += 1
    return out


# Production apps bound answer length in the system prompt; it also lets a small model finish
# (finish_reason "stop"), which is what the cache admits.
SYSTEM = "You are a concise assistant. Answer in one short sentence."


def _body(text: str, model: str, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def generate(
    data: Path,
    *,
    requests: int = 200,
    shares: dict[str, float] | None = None,
    seed: int = 0,
    rate: float = 4.0,
    model: str = "auto",
    max_tokens: int = 48,
) -> Iterator[dict[str, Any]]:
    """The workload records, in arrival order."""
    if requests < 1:
        raise ValueError("--requests must be at least 1")
    if rate <= 0:
        raise ValueError("--rate must be positive")
    rng = random.Random(seed)
    want = counts(requests, shares or DEFAULT_SHARES)
    simple_pool = simple_prompts(data)
    simple = rng.sample(simple_pool, min(want["simple"], len(simple_pool)))
    hard_pool = hard_prompts(data)
    hard = rng.sample(hard_pool, min(want["hard"], len(hard_pool)))
    # A paraphrase needs its origin asked first: each pair costs one `seed` request (counted
    # under `simple`'s share when there is room) and one `paraphrase` request.
    pairs = rng.sample(paraphrase_pairs(data), want["paraphrase"])
    seeds_from_simple = min(len(pairs), len(simple))
    simple = simple[: len(simple) - seeds_from_simple]
    tasks = checkable_tasks()
    checkable = rng.sample(range(len(tasks)), min(want["checkable"], len(tasks)))
    plan: list[tuple[str, Any]] = [("simple", t) for t in simple] + [("hard", t) for t in hard]
    plan += [("checkable", tasks[i]) for i in checkable]
    plan += [("seed", origin) for origin, _ in pairs]
    rng.shuffle(plan)
    # Each paraphrase goes after its origin, at a random later position.
    for origin, similar in pairs:
        first = next(i for i, (kind, text) in enumerate(plan) if kind == "seed" and text == origin)
        plan.insert(rng.randint(first + 1, len(plan)), ("paraphrase", similar))
    # Repeats copy a request already made, at a random later position.
    for _ in range(want["repeat"]):
        if not plan:
            break
        source = rng.randrange(len(plan))
        plan.insert(rng.randint(source + 1, len(plan)), ("repeat", plan[source][1]))
    at = 0.0
    for i, (kind, item) in enumerate(plan[:requests]):
        record: dict[str, Any] = {"id": f"w{i:05d}", "at": round(at, 3), "kind": kind}
        if isinstance(item, dict):  # a checkable task: asked as calibrated (one user turn, greedy)
            body = {"model": model, "messages": item["messages"], "max_tokens": max_tokens, "temperature": 0}
            record.update(body=body, check=item["check"], expected=item["expected"])
        else:
            record["body"] = _body(item, model, max_tokens)
        yield record
        at += rng.expovariate(rate)


def _shares(text: str) -> dict[str, float]:
    out = dict.fromkeys(KINDS, 0.0)
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in KINDS:
            raise argparse.ArgumentTypeError(f"expected kind=share with kinds {', '.join(KINDS)}, got {part!r}")
        try:
            out[key] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"share of {key} must be a number, got {value!r}") from None
        if out[key] < 0:
            raise argparse.ArgumentTypeError(f"share of {key} must not be negative")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("workload.jsonl"))
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--shares", type=_shares, default=DEFAULT_SHARES,
                        help="e.g. repeat=0.2,paraphrase=0.15,simple=0.3,hard=0.2,checkable=0.15 (normalised)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second")
    parser.add_argument("--model", default="auto")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared data directory")
    args = parser.parse_args(argv)
    from gateway.replay.workload import write_workload

    try:
        records = list(generate(args.data, requests=args.requests, shares=args.shares, seed=args.seed,
                                rate=args.rate, model=args.model, max_tokens=args.max_tokens))
    except (DataMissing, ValueError) as exc:
        print(f"make_workload: {exc}", file=sys.stderr)
        return 2
    n = write_workload(args.out, records)
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(f"wrote {n} requests to {args.out}: {kinds}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
