"""Decision latency of the router, excluding the shared embedding -> bench/results/router_latency.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._verdicts import verdicts
from policies.policy import Policy
from policies.router import RoutePolicy, Router
from policies.router.data import load_mmlu, shared_data_dir
from policies.router.features import Prompt

RESULTS = Path(__file__).resolve().parent / "results"
BUILTIN = [
    "hi",
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Prove that $\\sqrt{2}$ is irrational, step by step.",
    "```python\ndef f(xs):\n    return sorted(xs)[::-1]\n```\nWhy is this slow for large inputs and how do I fix it?",
    "Summarize the following text:\n" + "The quick brown fox jumps over the lazy dog. " * 200,
    "A baker sells 48 muffins on Monday and half as many on Tuesday at $2.50 each. How much does he earn in total?",
]
# Multi-turn requests: text features read every user turn, so these cost more than one turn.
CONVERSATIONS: list[Prompt] = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."},
     {"role": "assistant", "content": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"},
     {"role": "user", "content": "Now make it O(log n) and explain why it is correct."}],
    [{"role": "user", "content": "Draft a short email inviting the team to lunch on Friday."},
     {"role": "assistant", "content": "Hi team, ..."},
     {"role": "user", "content": "Make it more formal. " + "Keep the tone warm. " * 150}],
]


def _chars(prompt: Prompt) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(str(m.get("content", ""))) for m in prompt)


def percentiles(samples_s: list[float]) -> dict[str, float]:
    us = np.asarray(samples_s) * 1e6
    return {f"p{q}": round(float(np.percentile(us, q)), 2) for q in (50, 90, 99)} | {"max": round(float(us.max()), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--out", type=Path, default=RESULTS / "router_latency.json")
    args = parser.parse_args()
    router = Router.load()
    data = shared_data_dir()
    prompts: list[Prompt] = [*BUILTIN, *CONVERSATIONS]
    source = "builtin prompts and conversations"
    if (data / "router").is_dir():
        prompts += load_mmlu(data).prompts[:: 14]
        source = "builtin prompts and conversations + every 14th MMLU prompt"
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(len(prompts), router.dimension)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    policy = RoutePolicy(Policy.load(), router)
    reference: Router | LogisticRegression | None = None
    if router.kind == "sklearn":
        reference = router  # its sklearn path, called on one row, for comparison with the numpy walk
    elif router.kind == "linear":
        # The same linear model through sklearn's predict_proba, to show what the numpy path saves.
        linear = LogisticRegression()
        linear.classes_ = np.array([0, 1])
        linear.coef_ = np.concatenate([router.w_emb, router.w_text])[None, :]
        linear.intercept_ = np.array([router.bias])
        reference = linear
    from policies.router.features import text_features

    score_s, decide_s, sk_s, cpu_s = [], [], [], []
    for i in tqdm(range(args.calls), desc="router decisions", unit="call"):
        j = i % len(prompts)
        c0 = time.thread_time()
        t0 = time.perf_counter()
        p = router.score(prompts[j], emb[j])
        t1 = time.perf_counter()
        cpu_s.append(time.thread_time() - c0)
        policy.decide(p, "tenant", "app")
        t2 = time.perf_counter()
        score_s.append(t1 - t0)
        decide_s.append(t2 - t0)
        if reference is not None:
            t3 = time.perf_counter()
            feats = text_features(prompts[j])
            if isinstance(reference, Router):
                reference._sklearn(emb[j][None, :], feats[None, :])
            else:
                reference.predict_proba(np.concatenate([emb[j].astype(np.float64), feats])[None, :])
            sk_s.append(time.perf_counter() - t3)
    result = {
        "what": "router.score (text features + model) and score + policy decision; embedding excluded",
        "model": router.manifest.get("model", {}).get("name"), "kind": router.kind,
        "hot_path": {"FlatForest": "numpy tree walk", "FlatMLP": "numpy MLP"}.get(type(router.fast).__name__)
        if router.fast is not None else ("numpy dot" if router.kind == "linear" else "sklearn"),
        "target": "p99 <= 1000 us",
        "calls": args.calls, "prompts": len(prompts), "source": source,
        "prompt_chars_p50": int(np.median([_chars(p) for p in prompts])),
        "prompt_chars_max": int(max(_chars(p) for p in prompts)),
        "score_us": percentiles(score_s),
        "score_cpu_us": percentiles(cpu_s),
        "load_average_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
        "note": "wall-clock tails include time the process waits for a CPU on a shared machine; "
                "score_cpu_us is thread CPU time (coarse clock) for the same calls",
        "score_and_decide_us": percentiles(decide_s),
        "p99_met": bool(np.percentile(np.asarray(decide_s) * 1e6, 99) <= 1000),
        "sklearn_path_same_model_us": percentiles(sk_s) if sk_s else None,
    }
    result["verdicts"] = verdicts("router_latency", result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: result[k] for k in ("score_us", "score_cpu_us", "score_and_decide_us", "sklearn_path_same_model_us", "load_average_1m")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
