"""Figures for prompt trimming over every root-to-leaf OpenAssistant conversation.

Tokens saved per pass (median, p90, total) at history budgets of 512, 1024 and 2048 tokens,
counted with the SmolLM2 tokenizer; the lossless share; and the cost of one trim.
Writes bench/results/trim_savings.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from policies.policy import Policy  # noqa: E402
from policies.trim import LOSSLESS_PASSES, PASSES, TrimPolicy, trim_request  # noqa: E402
from policies.trim.tokenizer import edge_token_counter  # noqa: E402

BUDGETS = (None, 512, 1024, 2048)
ROLES = {"prompter": "user", "assistant": "assistant"}


def shared_data() -> Path:
    return Path(os.environ.get("TIERLANE_SHARED_DATA", REPO.parent / "shared" / "data"))


def conversations(path: Path) -> list[list[dict[str, str]]]:
    """Every root-to-leaf path of every message tree, as chat messages."""
    out: list[list[dict[str, str]]] = []

    def walk(node: dict[str, Any], prefix: list[dict[str, str]]) -> None:
        path = prefix + [{"role": ROLES[node["role"]], "content": node["text"]}]
        replies = node.get("replies") or []
        if not replies:
            out.append(path)
        for reply in replies:
            walk(reply, path)

    with open(path, encoding="utf-8") as fh:
        for line in fh:
            walk(json.loads(line)["prompt"], [])
    return out


def _pct(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _request(conv: list[dict[str, str]]) -> dict[str, Any]:
    # A chat request ends on the user turn the model is asked to answer.
    while conv and conv[-1]["role"] != "user":
        conv = conv[:-1]
    return {"model": "m", "messages": conv}


def savings(convs: list[list[dict[str, str]]], count: Any) -> dict[str, Any]:
    base = Policy.load().resolve("trim")
    results: dict[str, Any] = {}
    requests = [_request(c) for c in convs]
    requests = [r for r in requests if r["messages"]]
    for budget in BUDGETS:
        section = {**base, "history": {**base.get("history", {}), "max_tokens": budget}}
        policy = TrimPolicy.from_dict(section)
        per_pass: dict[str, list[int]] = {p: [] for p in PASSES}
        inputs, outputs, changed, lossless = 0, 0, 0, 0
        for req in tqdm(requests, desc=f"budget={budget}", unit="conv"):
            r = trim_request(req, policy, count)
            inputs += r.input_tokens
            outputs += r.output_tokens
            lossless += r.lossless_saved
            changed += r.changed
            for p in PASSES:
                per_pass[p].append(r.saved[p])
        results[str(budget)] = {
            "conversations": len(requests),
            "changed": changed,
            "input_tokens": inputs,
            "output_tokens": outputs,
            "tokens_saved": inputs - outputs,
            "saved_share": round((inputs - outputs) / inputs, 4) if inputs else 0.0,
            "lossless_saved": lossless,
            "lossless_share": round(lossless / inputs, 4) if inputs else 0.0,
            "by_pass": {
                p: {"median": statistics.median(v), "p90": _pct(v, 0.9), "total": sum(v),
                    "conversations_changed": sum(1 for x in v if x)}
                for p, v in per_pass.items()
            },
        }
    return results


def stage_cost(convs: list[list[dict[str, str]]], count: Any, repeats: int) -> dict[str, Any]:
    """Wall time of one trim of a ~2k-token conversation (default policy), to decide loop vs thread."""
    policy = TrimPolicy.from_dict(Policy.load().resolve("trim"))
    pool = [m for c in convs for m in c]
    messages: list[dict[str, str]] = []
    for m in pool:
        messages.append(m)
        if sum(count(x["content"]) + 4 for x in messages) >= 2000:
            break
    messages.append({"role": "user", "content": "Thanks, and one more question?"})
    body = {"model": "m", "messages": messages}
    tokens = trim_request(body, policy, count).input_tokens
    out: dict[str, Any] = {"conversation_tokens": tokens, "messages": len(messages), "repeats": repeats}
    for name, counter in (("edge_tokenizer", count), ("estimate", None)):
        times = []
        for _ in tqdm(range(repeats), desc=f"cost {name}", unit="trim"):
            t0 = time.perf_counter()
            trim_request(body, policy, counter)
            times.append((time.perf_counter() - t0) * 1e6)
        out[name] = {"median_us": round(statistics.median(times), 1), "p90_us": round(_pct(times, 0.9), 1)}  # type: ignore[arg-type]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "trim_savings.json"))
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    path = shared_data() / "conversations" / "oasst_en_100_tree.jsonl"
    if not path.exists():
        print(f"../shared/data absent: {path} not found (set TIERLANE_SHARED_DATA)", file=sys.stderr)
        return 2
    count = edge_token_counter()
    convs = conversations(path)
    result = {
        "data": str(path.relative_to(shared_data())),
        "tokenizer": "SmolLM2-135M-Instruct (llama.cpp, vocab only)",
        "policy": "shipped defaults, history.max_tokens per budget (null = lossless + tool_output only)",
        "lossless_passes": list(LOSSLESS_PASSES),
        "budgets": savings(convs, count),
        "stage_cost": stage_cost(convs, count, args.repeats),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({b: {k: v[k] for k in ("changed", "saved_share", "lossless_share")}
                      for b, v in result["budgets"].items()}, indent=2))
    print(json.dumps(result["stage_cost"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
