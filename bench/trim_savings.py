"""Figures for prompt trimming over every root-to-leaf OpenAssistant conversation, and, apart, agent sessions.

Chat: tokens saved per pass (median, p90, total) at history budgets of 512, 1024 and 2048 tokens,
counted with the SmolLM2 tokenizer; the lossless share; and the cost of one trim.

Agent sessions (`--agent-sessions FILE`, the recording `bench/agent_sessions.py --sessions FILE`
keeps: the pinned CLIs' own requests): every request as the front door translates it, trimmed by
the shipped policy and by the shipped policy with observation masking on. Per session: tokens
saved per pass, tool results changed on their first appearance (the shipped policy must change
none), the tokens masking takes out, and the trim's cost per request. Agent traffic is reported
apart because it is nothing like chat: its input is tool output the lossless passes must leave
whole, so what saves tokens in chat saves almost nothing there (and must not).

Writes bench/results/trim_savings.json.

    .venv/bin/python bench/trim_savings.py [--agent-sessions /tmp/sessions.json]
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
from policies.trim.messages import TOOL_ROLES, texts  # noqa: E402
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


def agent_bodies(session: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A recorded CLI session's model calls as the chat bodies its front door hands the pipeline."""
    from gateway.apis import messages_wire, responses_wire

    bodies = []
    for request in session:
        raw = request["body"]
        if request["path"] == "/v1/messages":
            bodies.append(messages_wire.to_chat(messages_wire.MessagesRequest.model_validate(raw), raw)[0])
        elif request["path"] == "/v1/responses":
            req = responses_wire.ResponsesRequest.model_validate(raw)
            bodies.append(responses_wire.to_chat(req, raw, responses_wire.input_items(req))[0])
    return bodies


def _tool_texts(body: dict[str, Any]) -> dict[str, str]:
    return {str(m.get("tool_call_id")): "".join(texts(m)) for m in body["messages"] if m.get("role") in TOOL_ROLES}


def agent_sessions(path: Path) -> dict[str, Any]:
    """The shipped policy, and the shipped policy with masking on, over each recorded agent session."""
    import orjson

    sessions = orjson.loads(path.read_bytes())
    base = Policy.load().resolve("trim")
    shipped = TrimPolicy.from_dict(base)
    masking = TrimPolicy.from_dict({**base, "agent_context": {**base.get("agent_context", {}), "mode": "on"}})
    out: dict[str, Any] = {}
    for name, session in sessions.items():
        bodies = agent_bodies(session)
        per_pass = dict.fromkeys(PASSES, 0)
        inputs = outputs = masked = changed_first = results = 0
        seen: set[str] = set()
        times: list[float] = []
        for body in tqdm(bodies, desc=f"agent session {name}", unit="request"):
            t0 = time.perf_counter()
            r = trim_request(body, shipped, None)
            times.append((time.perf_counter() - t0) * 1e3)
            inputs += r.input_tokens
            outputs += r.output_tokens
            for p in PASSES:
                per_pass[p] += r.saved[p]
            before, after = _tool_texts(body), _tool_texts(r.body)
            for call_id, text in before.items():
                if call_id not in seen:
                    seen.add(call_id)
                    results += 1
                    changed_first += after.get(call_id) != text
            masked += trim_request(body, masking, None).mask.masked_tokens
        out[name] = {
            "requests": len(bodies), "input_tokens": inputs, "tokens_saved": inputs - outputs,
            "saved_share": round((inputs - outputs) / inputs, 4) if inputs else 0.0,
            "by_pass": per_pass, "tool_results": results, "tool_results_changed_on_first_appearance": changed_first,
            "masking_on_masked_tokens": masked,
            "masking_on_masked_share": round(masked / inputs, 4) if inputs else 0.0,
            "trim_ms_median": round(statistics.median(times), 3) if times else 0.0,
            "trim_ms_p90": round(_pct(times, 0.9), 3),  # type: ignore[arg-type]
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "trim_savings.json"))
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--agent-sessions", type=Path,
                        help="recorded agent sessions (bench/agent_sessions.py --sessions FILE); reported apart from chat")
    args = parser.parse_args()
    path = shared_data() / "conversations" / "oasst_en_100_tree.jsonl"
    if not path.exists():
        print(f"../shared/data absent: {path} not found (set TIERLANE_SHARED_DATA)", file=sys.stderr)
        return 2
    count = edge_token_counter()
    convs = conversations(path)
    budgets = savings(convs, count)
    result: dict[str, Any] = {
        "data": str(path.relative_to(shared_data())),
        "tokenizer": "SmolLM2-135M-Instruct (llama.cpp, vocab only)",
        "policy": "shipped defaults, history.max_tokens per budget (null = lossless + tool_output only)",
        "lossless_passes": list(LOSSLESS_PASSES),
        "budgets": budgets,
        "stage_cost": stage_cost(convs, count, args.repeats),
        "agent_sessions": (agent_sessions(args.agent_sessions) if args.agent_sessions else
                           {"not_measured": "no recorded sessions given (--agent-sessions FILE)"}),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({b: {k: v[k] for k in ("changed", "saved_share", "lossless_share")}
                      for b, v in budgets.items()}, indent=2))
    print(json.dumps(result["stage_cost"], indent=2))
    print(json.dumps(result["agent_sessions"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
