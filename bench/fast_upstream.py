"""A minimal OpenAI-compatible upstream answering one fixed completion: the floor for proxy benchmarks."""

from __future__ import annotations

import argparse
import time

import orjson
from aiohttp import web

ANSWER = {
    "id": "chatcmpl-fixed",
    "object": "chat.completion",
    "created": int(time.time()),
    "model": "fast-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "The answer is 42."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18},
}
BODY = orjson.dumps(ANSWER)


async def chat(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=BODY, content_type="application/json")


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fast-model", "object": "model"}]})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)  # takes what the gateway passes on
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
