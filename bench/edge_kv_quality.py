"""What the edge engine's attention settings do to its answers: KV cache cell type and flash attention.

The reference is llama.cpp's plain path: f16 KV cache, attention as three ops (KQ, softmax,
KQV). Each candidate (the engine's default q8_0 KV + flash attention, and others) reads the
same token sequences: a chat prompt (everyday questions, essays of ~40-400 tokens and one of
~1,500 tokens) followed by the reference's own greedy continuation. Per completion position
it reports whether the candidate's top token equals the reference's, and the KL divergence
of its next-token distribution from the reference's; then each candidate generates greedily
on its own and the share of continuations identical to the reference's is counted. The noise
floor is the reference itself reading one token per step: llama.cpp's results move that much
with the step's shape alone.

Writes bench/results/edge_kv_quality.json. Run: .venv/bin/python bench/edge_kv_quality.py
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llama_cpp

from bench._harness import write
from bench.edge_engine import WORKLOADS, long_chat
from edge_engine import bundled_model_path
from edge_engine.chat_template import ChatTemplate
from edge_engine.llama_model import BatchEntry, LlamaContext, LlamaModel

REFERENCE = ("f16 KV, no flash attention", {"flash_attn": False, "kv_cache_type": "f16"})
# The noise floor: the reference's own settings reading one token per llama_decode call instead
# of 64 (what an unbatched server does). Differences of this size come with any change of step shape.
PIECE = 64  # tokens per llama_decode call while reading a sequence
# name -> (context settings, tokens per llama_decode call)
CANDIDATES: dict[str, tuple[dict[str, Any], int]] = {
    "reference settings, one token per step (noise floor)": ({"flash_attn": False, "kv_cache_type": "f16"}, 1),
    "q8_0 KV + flash attention (default)": ({"flash_attn": True, "kv_cache_type": "q8_0"}, PIECE),
    "f16 KV + flash attention": ({"flash_attn": True, "kv_cache_type": "f16"}, PIECE),
    "q4_0 KV + flash attention": ({"flash_attn": True, "kv_cache_type": "q4_0"}, PIECE),
}


def row_logits(ctx: LlamaContext, index: int) -> np.ndarray:
    """The logits of batch row `index` of the last llama_decode (a view into llama.cpp's buffer)."""
    ptr = llama_cpp.llama_get_logits_ith(ctx.ptr, index)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (ctx.model.n_vocab,))


def logits_rows(ctx: LlamaContext, tokens: list[int], start: int, step: int = PIECE) -> np.ndarray:
    """Next-token logits after each position >= start - 1, reading `tokens` from an empty cache."""
    ctx.clear()
    rows: list[np.ndarray] = []
    for lo in range(0, len(tokens), step):
        piece = tokens[lo : lo + step]
        want = [lo + i >= start - 1 for i in range(len(piece))]
        entries = [BatchEntry(t, lo + i, 0, w) for i, (t, w) in enumerate(zip(piece, want))]
        if ctx.decode(entries) != 0:
            raise RuntimeError("llama_decode failed")
        for i, w in enumerate(want):
            if w:
                rows.append(row_logits(ctx, i).copy())
    return np.stack(rows)[:-1]  # the last row predicts past the sequence


def greedy(ctx: LlamaContext, prompt: list[int], n: int, step: int = PIECE) -> list[int]:
    ctx.clear()
    out: list[int] = []
    pos = 0
    feed = prompt
    while len(out) < n:
        for lo in range(0, len(feed), step):
            piece = feed[lo : lo + step]
            last = lo + len(piece) == len(feed)
            entries = [BatchEntry(t, pos + i, 0, last and i == len(piece) - 1) for i, t in enumerate(piece)]
            if ctx.decode(entries) != 0:
                raise RuntimeError("llama_decode failed")
            pos += len(piece)
        token = int(np.argmax(row_logits(ctx, -1)))
        out.append(token)
        if ctx.model.is_eog(token):
            break
        feed = [token]
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kl_rows(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x -= x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(cand)
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-workload", type=int, default=8, help="prompts from each workload")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    started = time.time()
    model = LlamaModel(bundled_model_path())
    template = ChatTemplate(model)

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return model.tokenize(template.render(messages), add_special=False)

    chats = [(name, make(i)) for name, make in WORKLOADS.items() for i in range(args.per_workload)]
    chats.append(("long", long_chat(0, 1500, lambda m: len(encode(m)))))
    prompts = [(name, encode(m)) for name, m in chats]

    def context(flash_attn: bool, kv_cache_type: str) -> LlamaContext:
        return LlamaContext(model, n_ctx=2048, n_batch=PIECE, n_seq_max=1, n_threads=args.threads, flash_attn=flash_attn, kv_cache_type=kv_cache_type)

    ref_ctx = context(**REFERENCE[1])
    cands = {name: (context(**cfg), step) for name, (cfg, step) in CANDIDATES.items()}
    stats: dict[str, dict[str, list[Any]]] = {name: {"top1": [], "kl": [], "same_text": [], "agree": [], "kind": []} for name in cands}
    with tqdm(total=len(prompts) * (1 + 2 * len(cands)), desc="kv quality", unit="pass") as bar:
        for kind, prompt in prompts:
            completion = greedy(ref_ctx, prompt, args.max_tokens)
            bar.update()
            seq = prompt + completion
            ref = logits_rows(ref_ctx, seq, len(prompt))
            for name, (ctx, step) in cands.items():
                cand = logits_rows(ctx, seq, len(prompt), step)
                s = stats[name]
                s["top1"].extend((ref.argmax(axis=1) == cand.argmax(axis=1)).tolist())
                s["kl"].extend(kl_rows(ref, cand).tolist())
                bar.update()
                own = greedy(ctx, prompt, args.max_tokens, step)
                s["same_text"].append(own == completion)
                s["agree"].append(_common_prefix(own, completion) / len(completion))
                s["kind"].append(kind)
                bar.update()

    out: dict[str, Any] = {}
    for name, s in stats.items():
        kl = np.array(s["kl"])
        same = np.array(s["same_text"])
        kinds = np.array(s["kind"])
        out[name] = {
            "top1_agreement": round(float(np.mean(s["top1"])), 4),
            "kl_mean": float(f"{kl.mean():.3g}"),
            "kl_p99": float(f"{np.percentile(kl, 99):.3g}"),
            "kl_max": float(f"{kl.max():.3g}"),
            "greedy_text_identical": round(float(same.mean()), 3),
            "greedy_tokens_before_first_difference": round(float(np.mean(s["agree"])), 3),
            "greedy_text_identical_by_workload": {k: round(float(same[kinds == k].mean()), 3) for k in dict.fromkeys(s["kind"])},
        }
        print(f"{name}: top-1 {out[name]['top1_agreement']:.4f}, KL mean {out[name]['kl_mean']:.2g} "
              f"p99 {out[name]['kl_p99']:.2g}, identical greedy text {out[name]['greedy_text_identical']:.0%}, "
              f"tokens before the first difference {out[name]['greedy_tokens_before_first_difference']:.0%}")
    for ctx in [ref_ctx, *(c for c, _ in cands.values())]:
        ctx.close()
    model.close()
    write(
        "edge_kv_quality",
        {
            "what": __doc__.splitlines()[0],
            "reference": REFERENCE[0],
            "setup": {
                "prompts": {"everyday": args.per_workload, "essay": args.per_workload, "long (~1,500 tokens)": 1},
                "positions_compared": len(next(iter(stats.values()))["kl"]),
                "completion": f"the reference's greedy continuation, up to {args.max_tokens} tokens",
                "n_threads": args.threads,
            },
            "candidates": out,
            "elapsed_s": round(time.time() - started, 1),
        },
    )


if __name__ == "__main__":
    main()
