"""What token confidence and JSON grammars add to an edge decode step, and how JSON answers end.

Part 1 (step costs): a plain llama.cpp context like the engine's (a KV stream per sequence,
flash attention, q8_0 cache), 1 or 8 sequences decoding greedily in lockstep. Per step it
times the decode, the greedy sample of each row, `confidence.token_info` on each row (top 0
and top 20) and, in a second pass where each sequence is held to llama.cpp's JSON grammar, the
grammar-constrained sample (with the plain sample of the same rows beside it).

Part 2 (JSON answers): json_object and json_schema requests through the engine at a few
max_tokens; counts finish reasons and answers that parse (and fit the schema).

Prints JSON; `--out FILE` also writes it. Run: .venv/bin/python bench/edge_confidence_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edge_engine import EdgeEngine, EdgeSettings, SamplingParams, bundled_model_path
from edge_engine.chat_template import ChatTemplate
from edge_engine.confidence import token_info
from edge_engine.json_mode import grammar_for
from edge_engine.llama_model import BatchEntry, LlamaContext, LlamaModel
from edge_engine.sampling import Sampler, build_sampler, grammar_sampler

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three fruits.",
    "Describe a cat.",
    "Explain gravity to a child.",
    "Name a famous painter.",
    "Say hello.",
    "Tell a long story.",
]
JSON_ASKS = [
    "Describe a cat as a JSON object.",
    "Give the capital of France as JSON.",
    "Return a JSON object with a person's name and age.",
    "List three fruits as JSON.",
    "Output JSON describing today's weather.",
    "Give me a JSON object for a book: title and year.",
    "Make a JSON record of a car.",
    "Write a JSON object for a user profile.",
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


_QUIET = llama_cpp.llama_log_callback(lambda *_: None)  # kept alive: llama.cpp holds the pointer


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000.0, 4)


def step_costs(model: LlamaModel, batch: int, steps: int, threads: int, grammar: bool) -> dict[str, float]:
    ctx = LlamaContext(
        model, n_ctx=512, n_batch=512, n_seq_max=batch, n_threads=threads, flash_attn=True, kv_cache_type="q8_0"
    )
    template = ChatTemplate(model)
    asks = JSON_ASKS if grammar else QUESTIONS
    params = SamplingParams(temperature=0.0, grammar=grammar_for({"type": "json_object"}) if grammar else None)
    plain = build_sampler(SamplingParams(temperature=0.0), 0, model.n_vocab)
    samplers: list[Sampler] = [build_sampler(params, 0, model.n_vocab, model.vocab) for _ in range(batch)]
    # the grammar inside the chain, as llama.cpp's plain API would have it: every token checked
    in_chain = [_grammar_in_chain(model) for _ in range(batch)] if grammar else []
    names = ("decode", "sample", "plain_sample", "info_top0", "info_top20") + (("in_chain_sample",) if grammar else ())
    t: dict[str, list[float]] = {k: [] for k in names}
    differ = 0
    ended = [False] * batch
    try:
        last, pos = [], []
        for s in range(batch):
            prompt = model.tokenize(template.render([{"role": "user", "content": asks[s % len(asks)]}]), add_special=False)
            if ctx.decode([BatchEntry(tok, i, s, i == len(prompt) - 1) for i, tok in enumerate(prompt)]) != 0:
                raise RuntimeError("prompt decode failed")
            last.append(ctx.sample(samplers[s], -1))
            if grammar:
                llama_cpp.llama_sampler_sample(in_chain[s], ctx.ptr, -1)
            pos.append(len(prompt))
        for _ in range(steps):
            begin = time.perf_counter()
            if ctx.decode([BatchEntry(last[s], pos[s], s, True) for s in range(batch)]) != 0:
                raise RuntimeError("decode failed")
            t["decode"].append((time.perf_counter() - begin) / batch)
            for s in range(batch):
                pos[s] += 1
                if ended[s]:
                    continue  # still decoded (the step keeps its shape), no longer sampled
                begin = time.perf_counter()
                token = ctx.sample(samplers[s], s)
                t["sample"].append(time.perf_counter() - begin)
                begin = time.perf_counter()
                ctx.sample(plain, s)
                t["plain_sample"].append(time.perf_counter() - begin)
                if grammar:
                    begin = time.perf_counter()
                    differ += llama_cpp.llama_sampler_sample(in_chain[s], ctx.ptr, s) != token
                    t["in_chain_sample"].append(time.perf_counter() - begin)
                for k in (0, 20):
                    begin = time.perf_counter()
                    token_info(ctx.logits(s), token, model.piece, k)
                    t[f"info_top{k}"].append(time.perf_counter() - begin)
                if model.is_eog(token):
                    ended[s] = True  # it goes on decoding its last token, unsampled
                else:
                    last[s] = token
    finally:
        for sampler in [plain, *samplers]:
            sampler.close()
        for chain in in_chain:
            llama_cpp.llama_sampler_free(chain)
        ctx.close()
    out: dict[str, float] = {f"{k}_ms_per_token": _ms(v) for k, v in t.items()}
    out.update({f"{k}_ms_per_token_mean": round(statistics.fmean(v) * 1000.0, 4) for k, v in t.items() if v})
    per_token = out["decode_ms_per_token"] + out["plain_sample_ms_per_token"]
    out["info_top0_share"] = round(out["info_top0_ms_per_token"] / per_token, 4)
    out["info_top20_share"] = round(out["info_top20_ms_per_token"] / per_token, 4)
    if grammar:
        extra = out["sample_ms_per_token"] - out["plain_sample_ms_per_token"]
        out["grammar_extra_ms_per_token"] = round(extra, 4)
        out["grammar_share"] = round(extra / per_token, 4)
        mean_extra = out["sample_ms_per_token_mean"] - out["plain_sample_ms_per_token_mean"]
        out["grammar_extra_ms_per_token_mean"] = round(mean_extra, 4)
        out["in_chain_grammar_share"] = round((out["in_chain_sample_ms_per_token"] - out["plain_sample_ms_per_token"]) / per_token, 4)
        out["picks_refused_by_grammar"] = sum(s.rejected for s in samplers)
        out["picks"] = len(t["sample"])
        out["tokens_differing_from_in_chain"] = differ
    return out


def _grammar_in_chain(model: LlamaModel) -> llama_cpp.llama_sampler_p:
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, grammar_sampler(model.vocab, grammar_for({"type": "json_object"}) or ""))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    return chain


def _fits(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("name"), str) and type(value.get("age")) is int


async def json_answers(threads: int, limits: list[int]) -> dict[str, Any]:
    engine = EdgeEngine(EdgeSettings(n_threads=threads, prefix_reuse=False, n_ctx=1024, slots=8))
    await engine.start()
    formats = {
        "json_object": {"type": "json_object"},
        "json_schema": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    }

    async def one(ask: str, fmt: dict[str, Any], limit: int) -> tuple[str, str]:
        params = SamplingParams(temperature=0.0, max_tokens=limit, grammar=grammar_for(fmt))
        text, reason = [], ""
        async for event in engine.generate(messages=[{"role": "user", "content": ask}], params=params):
            text.append(event.text)
            reason = event.finish_reason or reason
        return "".join(text), reason

    out: dict[str, Any] = {}
    try:
        for name, fmt in formats.items():
            for limit in limits:
                answers = await asyncio.gather(*(one(ask, fmt, limit) for ask in JSON_ASKS))
                parsed = 0
                for text, _ in answers:
                    try:
                        value = json.loads(text)
                    except ValueError:
                        continue
                    parsed += name == "json_object" or _fits(value)
                reasons: dict[str, int] = {}
                for _, reason in answers:
                    reasons[reason] = reasons.get(reason, 0) + 1
                out[f"{name}@{limit}"] = {"requests": len(answers), "parsed": parsed, "finish_reasons": reasons}
    finally:
        await engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--limits", type=int, nargs="*", default=[64, 128, 256])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    llama_cpp.llama_log_set(_QUIET, None)
    model = LlamaModel(bundled_model_path())
    results: dict[str, Any] = {"threads": args.threads, "steps": args.steps, "n_vocab": model.n_vocab}
    try:
        for batch in (1, 8):
            results[f"plain_batch{batch}"] = step_costs(model, batch, args.steps, args.threads, grammar=False)
            results[f"json_grammar_batch{batch}"] = step_costs(model, batch, args.steps, args.threads, grammar=True)
    finally:
        model.close()
    results["json_answers"] = asyncio.run(json_answers(args.threads, args.limits))
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
