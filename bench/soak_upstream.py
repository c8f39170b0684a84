"""An OpenAI-compatible chat upstream for the soak: answers in 5-50 ms, 0.5 % 503s, 0.5 % cut connections.

Each answer depends on the prompt (a digest of it), so distinct questions make distinct cache
entries; usage counts follow the prompt's length. Streams send the answer in a few chunks.
Run: python bench/soak_upstream.py --port P [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import time

import orjson
from aiohttp import web


def _answer(body: dict) -> tuple[str, int]:
    text = orjson.dumps(body.get("messages") or [])
    digest = hashlib.blake2b(text, digest_size=6).hexdigest()
    return f"Answer {digest}: the short reply to that question.", max(1, len(text) // 4)


def make_app(seed: int, delay_ms: tuple[float, float], p_503: float, p_cut: float) -> web.Application:
    rng = random.Random(seed)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        await asyncio.sleep(rng.uniform(*delay_ms) / 1000)
        roll = rng.random()
        if roll < p_503:
            return web.json_response({"error": {"message": "overloaded", "type": "server_error"}}, status=503)
        cut = roll < p_503 + p_cut
        text, prompt_tokens = _answer(body)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 9, "total_tokens": prompt_tokens + 9}
        created = int(time.time())
        if not body.get("stream"):
            if cut:
                assert request.transport is not None
                request.transport.abort()
                return web.Response()
            return web.json_response({
                "id": "chatcmpl-soak", "object": "chat.completion", "created": created, "model": body.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def frame(delta: dict, finish: str | None = None, with_usage: bool = False) -> bytes:
            chunk = {"id": "chatcmpl-soak", "object": "chat.completion.chunk", "created": created, "model": body.get("model"),
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if with_usage:
                chunk["usage"] = usage
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        await resp.write(frame({"role": "assistant", "content": ""}))
        words = text.split(" ")
        for i, word in enumerate(words):
            await resp.write(frame({"content": word + (" " if i < len(words) - 1 else "")}))
            if cut and i == 2:
                assert request.transport is not None
                request.transport.abort()
                return resp
        await resp.write(frame({}, "stop", with_usage=True))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "soak-model", "object": "model"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--min-ms", type=float, default=5.0)
    parser.add_argument("--max-ms", type=float, default=50.0)
    parser.add_argument("--p-503", type=float, default=0.005)
    parser.add_argument("--p-cut", type=float, default=0.005)
    args = parser.parse_args()
    app = make_app(args.seed, (args.min_ms, args.max_ms), args.p_503, args.p_cut)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
