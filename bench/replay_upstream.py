"""A replay upstream: answers each labelled question the way a recorded model did.

An OpenAI-compatible aiohttp server (chat completions, JSON and SSE; GET /v1/models) that looks
the last user message up in a table of recorded outcomes:

- MMLU prompts (`routellm_mmlu_responses`): a letter, right where the recorded model was right
  and wrong where it was wrong. The data records correctness, not the answer key, so the key is a
  fixed letter per prompt (`mmlu_key`: A-D from a hash of the prompt) that the grader shares; a
  wrong answer is the next letter.
- AlpacaEval instructions: `quality=<q>`, the recorded judge preference as a quality score
  (the weak model: P(its answer beats gpt4_1106_preview's) = pref - 1; the reference: 0.5).

Usage is reported as ~4 characters a prompt token and a stated number of completion tokens
(MMLU 1, AlpacaEval 300), so a gateway in front meters it like any upstream. Unknown prompts get
`unknown` and the same usage. Used by bench/tiers.py and tests/integration/test_replay_tiers.py.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

LETTERS = "ABCD"
HITS = web.AppKey("hits", int)  # answers given
MMLU_COMPLETION_TOKENS = 1
ALPACA_COMPLETION_TOKENS = 300


def mmlu_key(prompt: str) -> str:
    """The letter graded as right for a prompt (the same for every replayed model)."""
    return LETTERS[hashlib.sha256(prompt.encode("utf-8")).digest()[0] % 4]


def mmlu_answer(prompt: str, right: bool) -> str:
    key = mmlu_key(prompt)
    return key if right else LETTERS[(LETTERS.index(key) + 1) % 4]


def alpaca_answer(quality: float) -> str:
    return f"quality={quality:.4f}"


def grade(kind: str, prompt: str, answer: str) -> float:
    """The quality of a replayed answer: MMLU 1/0, AlpacaEval the recorded score."""
    if kind == "mmlu":
        return 1.0 if answer.strip() == mmlu_key(prompt) else 0.0
    if answer.startswith("quality="):
        return float(answer.split("=", 1)[1])
    return 0.0


@dataclass(slots=True)
class Recorded:
    text: str
    completion_tokens: int


def replay_app(table: dict[str, Recorded], model: str) -> web.Application:
    """The server for one recorded model; `app[HITS]` counts the answers it gave."""

    async def chat(request: web.Request) -> web.StreamResponse:
        request.app[HITS] += 1
        body = await request.json()
        prompt = next((m.get("content") for m in reversed(body.get("messages") or []) if m.get("role") == "user"), "")
        prompt = prompt if isinstance(prompt, str) else ""
        found = table.get(prompt, Recorded("unknown", 1))
        usage = {"prompt_tokens": max(1, len(prompt) // 4), "completion_tokens": found.completion_tokens}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        base = {"id": "chatcmpl-replay", "created": int(time.time()), "model": model}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": found.text}, "finish_reason": "stop", "logprobs": None}
            return web.json_response({**base, "object": "chat.completion", "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delta, finish in (({"role": "assistant", "content": ""}, None), ({"content": found.text}, None), ({}, "stop")):
            chunk = {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(f"data: {json.dumps({**base, 'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app[HITS] = 0
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


def tables(mmlu: Any, alpaca: Any) -> tuple[dict[str, Recorded], dict[str, Recorded]]:
    """(weak, strong) tables from policies.router.data's MMLUData and AlpacaData."""
    weak: dict[str, Recorded] = {}
    strong: dict[str, Recorded] = {}
    for prompt, w, s in zip(mmlu.prompts, mmlu.weak, mmlu.strong):
        weak[prompt] = Recorded(mmlu_answer(prompt, bool(w)), MMLU_COMPLETION_TOKENS)
        strong[prompt] = Recorded(mmlu_answer(prompt, bool(s)), MMLU_COMPLETION_TOKENS)
    for prompt, w, s in zip(alpaca.prompts, alpaca.weak, alpaca.strong):
        weak[prompt] = Recorded(alpaca_answer(float(w)), ALPACA_COMPLETION_TOKENS)
        strong[prompt] = Recorded(alpaca_answer(float(s)), ALPACA_COMPLETION_TOKENS)
    return weak, strong
