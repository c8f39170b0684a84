"""The agent model of agent_model.py speaking the agents' own APIs natively: Messages and Responses.

`bench/agents.py` points each agent straight at this server (no gateway) to measure what the
gateway adds per turn. The script (which tool on which file, the final answer) is
`AgentModel.reply`'s; the wire is written here from the APIs' references, independently of the
gateway's translation, so the baseline does not share the code it is compared with.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from tests.support.agent_model import AgentModel


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return ""


# Messages --------------------------------------------------------------------------------------


def messages_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """What AgentModel.reply reads of a Messages request: roles, tool results, tool names."""
    chat: list[dict[str, Any]] = []
    for message in body.get("messages") or ():
        content = message.get("content")
        results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"] if isinstance(content, list) else []
        for block in results:
            chat.append({"role": "tool", "content": _text(block.get("content"))})
        if not results:
            chat.append({"role": message.get("role"), "content": _text(content)})
    tools = [{"type": "function", "function": {"name": t.get("name")}} for t in body.get("tools") or () if isinstance(t, dict)]
    return {"messages": chat, "tools": tools}


async def _messages(model: AgentModel, request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = orjson.loads(raw)
    model.requests.append(body)
    model.raw.append(raw)
    message, finish = model.reply(messages_as_chat(body))
    if model.delay_s:
        await asyncio.sleep(model.delay_s)
    ident = "msg_" + uuid.uuid4().hex[:20]
    usage = {"input_tokens": len(orjson.dumps(body)) // 4, "output_tokens": len(orjson.dumps(message)) // 4 + 1,
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    blocks: list[dict[str, Any]] = []
    for call in message.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:20], "name": call["function"]["name"],
                       "input": orjson.loads(call["function"]["arguments"])})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    stop = "tool_use" if finish == "tool_calls" else "end_turn"
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    start = {"id": ident, "type": "message", "role": "assistant", "model": body.get("model"), "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
    out = [_sse("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(blocks):
        if block["type"] == "tool_use":
            out.append(_sse("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": {**block, "input": {}}}))
            out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}}))
        else:
            out.append(_sse("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": {"type": "text", "text": ""}}))
            out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                    "delta": {"type": "text_delta", "text": block["text"]}}))
        out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    out.append(_sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                      "usage": {"output_tokens": usage["output_tokens"]}}))
    out.append(_sse("message_stop", {"type": "message_stop"}))
    for frame in out:
        await response.write(frame)
    return response


# Responses -------------------------------------------------------------------------------------


def _flatten(tools: Any, namespace: str | None, into: dict[str, tuple[str, str | None]]) -> None:
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "namespace":
            _flatten(tool.get("tools"), str(tool.get("name")), into)
        elif tool.get("type") in ("function", "custom"):
            into[str(tool.get("name"))] = (str(tool["type"]), namespace)


def responses_as_chat(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str, str | None]]]:
    """What AgentModel.reply reads of a Responses request, and each tool's kind and namespace."""
    kinds: dict[str, tuple[str, str | None]] = {}
    _flatten(body.get("tools"), None, kinds)
    items = body.get("input")
    items = [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else items or []
    chat: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "additional_tools":
            _flatten(item.get("tools"), None, kinds)
        elif kind == "message":
            chat.append({"role": item.get("role"), "content": _text(item.get("content"))})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            chat.append({"role": "tool", "content": _text(item.get("output"))})
    tools = [{"type": "function", "function": {"name": name}} for name in kinds]
    return {"messages": chat, "tools": tools}, kinds


async def _responses(model: AgentModel, request: web.Request) -> web.StreamResponse:
    body = await request.json()
    model.requests.append(body)
    chat, kinds = responses_as_chat(body)
    message, _ = model.reply(chat)
    if model.delay_s:
        await asyncio.sleep(model.delay_s)
    ident = "resp_" + uuid.uuid4().hex[:20]
    output: list[dict[str, Any]] = []
    for call in message.get("tool_calls") or ():
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        kind, namespace = kinds.get(name, ("function", None))
        item: dict[str, Any] = {"id": "fc_" + uuid.uuid4().hex[:16], "status": "completed", "call_id": call["id"], "name": name}
        if kind == "custom":
            item.update(type="custom_tool_call", input=orjson.loads(arguments)["input"])
        else:
            item.update(type="function_call", arguments=arguments)
        if namespace is not None:
            item["namespace"] = namespace
        output.append(item)
    if message.get("content"):
        output.append({"id": "msg_" + uuid.uuid4().hex[:16], "type": "message", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    usage = {"input_tokens": len(orjson.dumps(body)) // 4, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": len(orjson.dumps(output)) // 4 + 1, "output_tokens_details": {"reasoning_tokens": 0}}
    usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
    envelope = {"id": ident, "object": "response", "created_at": int(time.time()), "model": body.get("model"),
                "status": "in_progress", "output": [], "usage": None, "error": None, "incomplete_details": None}
    seq = 0

    def event(kind: str, **data: Any) -> bytes:
        nonlocal seq
        frame = _sse(kind, {"type": kind, **data, "sequence_number": seq})
        seq += 1
        return frame

    out = [event("response.created", response=envelope), event("response.in_progress", response=envelope)]
    for index, item in enumerate(output):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out.append(event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}))
            out.append(event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []}))
            out.append(event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0, delta=text))
            out.append(event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text))
            out.append(event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=item["content"][0]))
        elif item["type"] == "custom_tool_call":
            out.append(event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "input": ""}))
            out.append(event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index, delta=item["input"]))
            out.append(event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index, input=item["input"]))
        else:
            out.append(event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""}))
            out.append(event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=item["arguments"]))
            out.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=item["arguments"]))
        out.append(event("response.output_item.done", output_index=index, item=item))
    out.append(event("response.completed", response={**envelope, "status": "completed", "output": output, "usage": usage}))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for frame in out:
        await response.write(frame)
    return response


def native_app(model: AgentModel) -> web.Application:
    """POST /v1/messages and /v1/responses, both streamed, playing `model`'s script."""
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def messages(request: web.Request) -> web.StreamResponse:
        return await _messages(model, request)

    async def responses(request: web.Request) -> web.StreamResponse:
        return await _responses(model, request)

    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    return app
