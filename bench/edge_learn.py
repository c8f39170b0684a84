"""The edge learns an app's repeated task: collect, train, shadow, serve, fall back -> bench/results/edge_learn.json.

Per workload (public labelled data prepared by bench/learn_data.py into ../shared/data/learn/):

- sentiment: SST-2 movie-review sentences, "positive" / "negative" (a label set: constrained decoding);
- intent: Banking77 customer messages, 77 intent names (free text: too many labels for a set);
- extraction: ATIS flight requests, the destination city as written in the request (a span of the input).

One real gateway (`tierlane serve`, the shipped defaults but the cache, router and trim off, the
template named in the learn policy by its system prompt) in front of a replay upstream that answers
each request with the data's label, as a strong model would (optionally after `--upstream-ms`).

1. Collection: `--collect` training rows through the gateway; the gateway keeps the pairs.
2. Training: `tierlane edge learn --template NAME` (the real command, CPU, `--threads`), timed.
3. Later traffic: unseen rows through the same gateway, which takes the new adapter from disk
   without a restart. It is in shadow first (the upstream answers, the adapter is judged beside
   it), then serves what its gate allows. Per request: who answered, the time, the answer.
4. Drift: the upstream starts answering in another language (another label set); counted: requests
   until the template stops serving, and the answers served wrongly meanwhile.
5. The bundled model without learning: the same held-out pairs answered by the base GGUF alone
   (same decoding, same threshold rule), its agreement and the share its threshold would serve.

Served disagreement is with the upstream's answer; the replay upstream answers with the data's
label, so disagreement with the labels is the same figure (both are reported). The replay upstream
answers after `--upstream-ms` (250), so later requests come no faster than a real upstream would
let a sequential client send them, and the shadow judge keeps up. Skipped, with a message, without
../shared/data/learn.

    .venv/bin/python bench/edge_learn.py                       # all three, 2,000 pairs each
    .venv/bin/python bench/edge_learn.py --workloads sentiment --collect 600 --later 400 --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._harness import free_port, gateway_cmd, pct, start, stop, write  # noqa: E402
from bench._verdicts import verdicts, wilson  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "learn"
MODEL = "gpt-4o-mini"  # what the app asks for: the replay upstream answers as it, priced by the shipped tier prices


@dataclass(frozen=True)
class Workload:
    name: str
    system: str
    drift: dict[str, str] = field(default_factory=dict)  # label -> the upstream's answer after the change

    def drifted(self, label: str) -> str:
        return self.drift.get(label, f"Réponse : {label}")


WORKLOADS = {
    "sentiment": Workload("sentiment", "Classify the sentiment of this movie review as positive or negative. "
                          "Answer with one word.", {"positive": "positif", "negative": "négatif"}),  # fmt: skip
    "intent": Workload("intent", "Classify this banking customer's message into one of the bank's intent categories. "
                       "Answer with the category name only."),  # fmt: skip
    "extraction": Workload("extraction", "Extract the destination city of this flight request. Answer with the city "
                           "name only, as written in the request."),  # fmt: skip
}


def rows(name: str) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    train, test = [], []
    with (DATA / f"{name}.jsonl").open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            (train if row["split"] == "train" else test).append(row)
    return train, test


def log(text: str) -> None:
    print(f"[edge_learn {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class Replay:
    """The upstream: the label of the request's input (the last user message), or the drifted answer."""

    def __init__(self, table: dict[str, str], workload: Workload, delay_s: float) -> None:
        self.table, self.workload, self.delay_s = table, workload, delay_s
        self.drifting = False
        self.asked = 0

    def app(self) -> web.Application:
        async def chat(request: web.Request) -> web.Response:
            body = await request.json()
            self.asked += 1
            text = body["messages"][-1]["content"]
            label = self.table.get(text, "unknown")
            answer = self.workload.drifted(label) if self.drifting else label
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            prompt = sum(len(str(m.get("content", ""))) for m in body["messages"]) // 4 + 1
            return web.json_response({
                "id": f"chatcmpl-replay-{self.asked}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", MODEL),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": max(1, len(answer) // 4),
                          "total_tokens": prompt + max(1, len(answer) // 4)},
            })  # fmt: skip

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        return app


class _Done(Exception):
    """The workload's remaining phases do not apply."""


@dataclass
class Answered:
    local: bool
    seconds: float
    answer: str
    label: str
    state: str | None = None


async def ask(session: aiohttp.ClientSession, url: str, workload: Workload, text: str, label: str) -> Answered:
    body = {"model": MODEL, "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "system", "content": workload.system}, {"role": "user", "content": text}]}  # fmt: skip
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        data = await response.json()
        seconds = time.perf_counter() - started
        if response.status != 200:
            raise RuntimeError(f"the gateway answered {response.status}: {data}")
        local = "x-tierlane-learned" in response.headers
    return Answered(local, seconds, data["choices"][0]["message"]["content"], label)


async def templates(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    async with session.get(url + "/v1/edge/templates") as response:
        data = await response.json()
    return next((row for row in data["data"] if row["template"] == name), {})


async def usage(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url + "/v1/usage", params={"group_by": "lane"}) as response:
        return await response.json()


def normalise(text: str) -> str:
    from policies.learn.examples import normalise as norm

    return norm(text)


def latency(values: list[float]) -> dict[str, float | int | None]:
    ms = [v * 1000 for v in values]
    return {"n": len(ms), "p50_ms": round(pct(ms, 0.5), 2) if ms else None, "p99_ms": round(pct(ms, 0.99), 2) if ms else None}


def baseline(state_dir: Path, workload: Workload, manifest: dict[str, Any], threads: int) -> dict[str, Any]:
    """The bundled model alone on the adapter's held-out pairs: agreement and the share its threshold would serve."""
    from policies.learn.calibration import threshold
    from policies.learn.evaluate import Scorer, score_labels, score_text
    from policies.learn.examples import Tokenizer
    from policies.learn.pairs import FILENAME, PairReader
    from policies.trim.tokenizer import bundled_edge_model

    base = bundled_edge_model()
    tokenizer = Tokenizer(base)
    with PairReader(state_dir / FILENAME) as reader:
        held = list(reader.pairs("default", "default", workload.name, split="held_out"))
    examples, _ = tokenizer.examples(held[: manifest["pairs"]["held_out_evaluated"]], 512)
    labels = manifest["confidence"]["labels"]
    longest = manifest["confidence"].get("answer_tokens_max") or 32
    started = time.perf_counter()
    scorer = Scorer(base, None, n_ctx=max(e.tokens for e in examples) + longest + 16, threads=threads)
    try:
        scored = (score_labels(scorer, tokenizer, examples, labels) if labels
                  else score_text(scorer, tokenizer, examples, max_new=longest + 8))  # fmt: skip
    finally:
        scorer.close()
        tokenizer.close()
    bound = threshold(scored, manifest["confidence"]["threshold_disagreement"])
    agree = sum(s.agrees for s in scored)
    return {"held_out": len(scored), "agreement": round(agree / len(scored), 4), "agreeing": agree,
            "threshold": bound.threshold, "coverage_at_threshold": round(bound.coverage, 4),
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip


async def run_workload(workload: Workload, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    train, test = rows(workload.name)
    rng = random.Random(args.seed)
    rng.shuffle(train)
    collect = train[: args.collect]
    later = (test + train[args.collect :])[: args.later]
    table = {r["input"]: r["label"] for r in train + test}
    replay = Replay(table, workload, args.upstream_ms / 1000)
    runner = web.AppRunner(replay.app())
    await runner.setup()
    upstream_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", upstream_port).start()
    state_dir = tmp / workload.name / "state"
    config = {
        "state_dir": str(state_dir),
        "upstreams": [{"name": "replay", "base_url": f"http://127.0.0.1:{upstream_port}/v1", "models": [MODEL]}],
        "edge": {"n_threads": args.threads},
        "embedder": {"enabled": False},
        "policy": {
            "cache": {"enabled": False}, "router": {"enabled": False}, "trim": {"enabled": False},
            "cascade": {"enabled": False},
            "learn": {"templates": {workload.name: {"prefix": workload.system}}},
        },
    }  # fmt: skip
    config_path = tmp / workload.name / "tierlane.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = await asyncio.to_thread(start, gateway_cmd(config, config_path, port), url + "/readyz",
                                      tmp / workload.name / "gateway.log")  # fmt: skip
    out: dict[str, Any] = {"workload": workload.name, "collect": len(collect), "later": len(later)}
    try:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # 1. collection
            log(f"{workload.name}: collecting {len(collect)} upstream answers")
            started = time.perf_counter()
            gate = asyncio.Semaphore(8)

            async def one(row: dict[str, str]) -> Answered:
                async with gate:
                    return await ask(session, url, workload, row["input"], row["label"])

            done = await asyncio.gather(*(one(r) for r in collect))
            assert not any(a.local for a in done)
            deadline = time.monotonic() + 120
            while (await templates(session, url, workload.name)).get("pairs", 0) < len(collect):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            row = await templates(session, url, workload.name)
            out["collection"] = {"pairs": row.get("pairs"), "seconds": round(time.perf_counter() - started, 1)}
            # 2. training, the real command, the gateway idle
            log(f"{workload.name}: training (tierlane edge learn, {args.threads} thread(s))")
            started = time.perf_counter()
            command = [sys.executable, "-m", "gateway.cli", "edge", "learn", "--config", str(config_path), "--template",
                       workload.name, "--epochs", str(args.epochs), "--threads", str(args.threads), "--max-eval",
                       str(args.max_eval), "--budget-s", str(args.budget_s)]  # fmt: skip
            if args.quick:
                command += ["--max-steps", "20"]
            learned = await asyncio.to_thread(subprocess.run, command, cwd=REPO, stdout=subprocess.PIPE, text=True)
            if learned.returncode != 0:
                raise RuntimeError(f"tierlane edge learn failed ({learned.returncode}): {learned.stdout[-2000:]}")
            wall = time.perf_counter() - started
            manifest_path = next((state_dir / "learn").glob(f"*/*/{workload.name}/*.json"))
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            out["training"] = {
                "command_seconds": round(wall, 1), "train_seconds": manifest["training"]["seconds"],
                "base_load_seconds": manifest["training"]["base_load_seconds"], "steps": manifest["training"]["steps"],
                "tokens_per_s": manifest["training"]["tokens_per_s"], "threads": manifest["training"]["threads"],
                "pairs": manifest["pairs"], "loss_first": round(manifest["training"]["loss_first"], 4),
                "loss_last": round(manifest["training"]["loss_last"], 4), "adapter_bytes": manifest["bytes"],
                "kind": manifest["confidence"]["kind"], "labels": len(manifest["confidence"]["labels"] or []) or None,
            }  # fmt: skip
            evaluated = len(manifest["confidence"]["held_out"])
            agreeing = sum(h["agrees"] for h in manifest["confidence"]["held_out"])
            out["held_out"] = {
                "n": evaluated, "agreement": round(agreeing / evaluated, 4), "agreeing": agreeing,
                "threshold": manifest["confidence"]["threshold"], "coverage_at_threshold": manifest["confidence"]["coverage"],
                "agreement_at_threshold": manifest["confidence"]["agreement_at_threshold"],
                "threshold_disagreement": manifest["confidence"]["threshold_disagreement"],
            }  # fmt: skip
            # 3. later traffic: the gateway takes the adapter from disk
            deadline = time.monotonic() + 60
            while not (await templates(session, url, workload.name)).get("learned"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not take the new adapter")
                await asyncio.sleep(0.5)
            log(f"{workload.name}: {len(later)} later requests (shadow, then serving)")
            answers: list[Answered] = []
            first_serving: int | None = None
            for i, r in enumerate(later):
                answers.append(await ask(session, url, workload, r["input"], r["label"]))
                if first_serving is None and answers[-1].local:
                    first_serving = i
                if i % 100 == 99:
                    figures = (await templates(session, url, workload.name)).get("learned") or {}
                    log(f"{workload.name}: {i + 1}/{len(later)} state {figures.get('state')}, "
                        f"local {sum(a.local for a in answers)}")  # fmt: skip
            row = await templates(session, url, workload.name)
            figures = row.get("learned") or {}
            after = answers[first_serving:] if first_serving is not None else []
            served = [a for a in after if a.local]
            wrong = sum(normalise(a.answer) != normalise(a.label) for a in served)
            money = await usage(session, url)
            out["serving"] = {
                "state": figures.get("state"), "requests_before_serving": first_serving,
                "shadow_judged_before_serving": (figures.get("transitions") or [{}])[0].get("after_judged"),
                "local_share_after_serving": round(len(served) / len(after), 4) if after else 0.0,
                "local_after_serving": len(served), "requests_after_serving": len(after),
                "local_share_all_later": round(sum(a.local for a in answers) / len(answers), 4),
                "served_disagreement": round(wrong / len(served), 4) if served else None, "served_wrong": wrong,
                "served_disagreement_interval": wilson(wrong, len(served)) if served else None,
                "served_disagreement_with_labels": round(wrong / len(served), 4) if served else None,
                "upstream_answers_wrong": sum(normalise(a.answer) != normalise(a.label) for a in answers if not a.local),
                "gate": {k: figures.get(k) for k in ("judged", "disagreement", "disagreement_upper", "rechecked", "served",
                                                      "declined", "transitions")},
                "local_latency": latency([a.seconds for a in served]),
                "upstream_latency": latency([a.seconds for a in after if not a.local]),
                "usage": money,
            }  # fmt: skip
            # 4. drift: the upstream answers in another language
            if out["serving"]["state"] != "serving":
                out["drift"] = {"requests_until_fallback": None, "served_before_fallback": 0, "sent": 0, "was_serving": False}
                raise _Done
            log(f"{workload.name}: drift ({args.drift} requests, the upstream answers in French)")
            replay.drifting = True
            drift_rows = (test + train[args.collect :])[args.later : args.later + args.drift] or later[: args.drift]
            until: int | None = None
            wrongly = 0
            for i, r in enumerate(drift_rows):
                a = await ask(session, url, workload, r["input"], r["label"])
                wrongly += a.local
                state = ((await templates(session, url, workload.name)).get("learned") or {}).get("state")
                if state != "serving":
                    until = i + 1
                    break
            out["drift"] = {"requests_until_fallback": until, "served_before_fallback": wrongly, "sent": len(drift_rows),
                            "was_serving": out["serving"]["state"] == "serving"}  # fmt: skip
            replay.drifting = False
    except _Done:
        pass
    finally:
        await asyncio.to_thread(stop, gateway)
        await runner.cleanup()
    log(f"{workload.name}: the bundled model without learning, on the same held-out pairs")
    out["base_model"] = await asyncio.to_thread(baseline, state_dir, workload, manifest, args.threads)
    log(f"{workload.name}: done: {json.dumps(out['serving'], default=str)[:400]}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="sentiment,intent,extraction")
    parser.add_argument("--collect", type=int, default=2000, help="upstream answers collected before training")
    parser.add_argument("--later", type=int, default=1500, help="later requests through the gateway")
    parser.add_argument("--drift", type=int, default=400, help="requests after the upstream changes its answers (at most)")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-eval", type=int, default=500)
    parser.add_argument("--budget-s", type=float, default=1800.0, help="training bound per template (30 minutes)")
    parser.add_argument("--upstream-ms", type=float, default=250.0,
                        help="the replay upstream's time per answer (default 250: a fast hosted model on a short answer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 training steps: a smoke run, not figures")
    parser.add_argument("--name", default="edge_learn")
    args = parser.parse_args()
    if not DATA.exists():
        print(f"edge_learn: {DATA} is absent (bench/learn_data.py prepares it); skipped", file=sys.stderr)
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            results.append(asyncio.run(run_workload(WORKLOADS[name], args, Path(tmp))))
            data: dict[str, Any] = {"what": "the edge learns an app's repeated task: collection, training, shadow, serving, "
                                    "drift", "settings": {k: v for k, v in vars(args).items() if k != "name"},
                                    "workloads": results}  # fmt: skip
            data["verdicts"] = verdicts("edge_learn", data)
            write(args.name, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
