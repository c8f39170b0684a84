"""The answer-agreement judge (policies/router/agreement.py) against ground truth, beside answer similarity.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/agreement_judge.py [--math 600] [--arc 300]

Pairs with a known truth, made from the reference answers of ../shared/data (read there, never
copied): for a MATH problem (`math_levels.jsonl`), its reference solution (ending in `\\boxed{}`)
beside a short answer that states the same value in another form (3/4 as 0.75, 1250 as 1,250,
`#### 12`, "The answer is ...") and beside one that states a plausible wrong value (off by one,
doubled, halved, the sign flipped) in the same forms; for an ARC-Easy validation question, "Answer:
<key>" beside "The answer is (<key>)." and beside another letter. Reported per family: the judge's
accuracy where it decides, the share it leaves undecided (free text: the caller falls back to
similarity), and the accuracy of the shadow hook's old rule alone (int8 MiniLM answer cosine >= 0.8
means agree) on the same pairs. Needs ../shared/data; skipped (exit 0, a message) without it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import REPO, write
from bench._verdicts import verdicts
from policies.router.agreement import final_answer, judge

DATA = REPO.parent / "shared" / "data"
AGREE = 0.8  # gateway.pipeline.shadow.AGREE


def show(value: Fraction, rng: random.Random) -> str:
    """`value` written one of the ways a model writes it."""
    if value.denominator == 1:
        n = int(value)
        return f"{n:,}" if abs(n) >= 1000 and rng.random() < 0.5 else str(n)
    as_float = float(value)
    if rng.random() < 0.5 and abs(as_float * 10_000 - round(as_float * 10_000)) < 1e-9:
        return f"{as_float:g}"
    return f"{value.numerator}/{value.denominator}" if rng.random() < 0.5 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def phrase(value: str, rng: random.Random) -> str:
    return rng.choice([f"The answer is {value}.", f"Working it through, we get {value}.\n#### {value}",
                       f"So the final answer is \\boxed{{{value}}}.", f"Answer: {value}"])


def wrong(value: Fraction, rng: random.Random) -> Fraction:
    options = [value + 1, value - 1, value * 2, -value if value else Fraction(1), value / 2 if value else Fraction(2)]
    return rng.choice([o for o in options if o != value])


def math_pairs(n: int, rng: random.Random) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (DATA / "router" / "math_levels.jsonl").read_text().splitlines() if line.strip()]
    rng.shuffle(rows)
    pairs = []
    for row in rows:
        final = final_answer(row["solution"])
        if final is None or final.kind != "number" or not isinstance(final.value, Fraction):
            continue  # expressions (x + 1, intervals, matrices) are free text to the judge
        value = final.value
        pairs.append({"family": "math", "a": row["solution"], "b": phrase(show(value, rng), rng), "same": True})
        pairs.append({"family": "math", "a": row["solution"], "b": phrase(show(wrong(value, rng), rng), rng), "same": False})
        if len(pairs) >= 2 * n:
            break
    return pairs


def arc_pairs(n: int, rng: random.Random) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (DATA / "quality" / "arc_easy_validation.jsonl").read_text().splitlines() if line.strip()]
    rng.shuffle(rows)
    pairs = []
    for row in rows[:n]:
        key, labels = row["answerKey"], row["choices"]["label"]
        other = rng.choice([label for label in labels if label != key])
        ref = f"Answer: {key}"
        pairs.append({"family": "arc", "a": ref, "b": rng.choice([f"The answer is ({key}).", key, f"Answer: {key}"]), "same": True})
        pairs.append({"family": "arc", "a": ref, "b": rng.choice([f"The answer is ({other}).", other, f"Answer: {other}"]), "same": False})
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--math", type=int, default=600, help="MATH problems (two pairs each)")
    parser.add_argument("--arc", type=int, default=300, help="ARC-Easy questions (two pairs each)")
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    if not DATA.is_dir():
        print(f"skipped: {DATA} is not here (the evaluation data stays outside the project)")
        return 0
    from policies.embedding.embedder import load_encoder

    rng = random.Random(args.seed)
    pairs = math_pairs(args.math, rng) + arc_pairs(args.arc, rng)
    encoder = load_encoder("onnx", precision="int8")
    families: dict[str, dict[str, int]] = {}
    for pair in tqdm(pairs, desc="judging pairs", unit="pair"):
        verdict = judge(pair["a"], pair["b"])
        va, vb = encoder.encode([pair["a"], pair["b"]])
        by_similarity = float(va @ vb) >= AGREE
        f = families.setdefault(pair["family"], {"pairs": 0, "decided": 0, "right": 0, "similarity_right": 0,
                                                 "false_agree": 0, "false_disagree": 0})
        f["pairs"] += 1
        f["similarity_right"] += by_similarity == pair["same"]
        if verdict is not None:
            f["decided"] += 1
            f["right"] += (verdict == "agree") == pair["same"]
            f["false_agree"] += verdict == "agree" and not pair["same"]
            f["false_disagree"] += verdict == "disagree" and pair["same"]
    summary = {}
    for name, f in families.items():
        summary[name] = {**f, "accuracy_decided": round(f["right"] / f["decided"], 4) if f["decided"] else None,
                         "undecided_share": round(1 - f["decided"] / f["pairs"], 4),
                         "similarity_accuracy": round(f["similarity_right"] / f["pairs"], 4)}
    data = {"what": "the answer-agreement judge against ground truth (pairs from MATH reference solutions and "
                    "ARC-Easy answer keys), beside the answer-similarity rule it goes before",
            "similarity_rule": f"int8 MiniLM cosine >= {AGREE}", "seed": args.seed, "families": summary}
    data["verdicts"] = verdicts("agreement_judge", data)
    path = write("agreement_judge", data)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
