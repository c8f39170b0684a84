"""An OpenAI-compatible chat server that plays a coding agent's model, turn by turn.

The real agents (Claude Code, Codex) need a model that calls their tools; the bundled SmolLM2
does not do that reliably, so this server plays the model: on each turn it asks for the agent's
own tool for the next step of its script (read a file, search a tree for a pattern, or replace one
line of a file), and once every tool result has come back it answers with what the tools returned. It speaks the chat-completions wire exactly (JSON
and SSE chunks with usage; the tests check it with the `openai` SDK), so the gateway in front of
it is exercised as in front of any chat upstream. The agent itself runs the tools.
"""

from __future__ import annotations

import asyncio
import shlex
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web

MODEL = "agent-model"
ANSWER_PREFIX = "The files say:"


@dataclass(slots=True)
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a script: read `path`; search `path` (a file or a tree) for `pattern`; or edit
    `path`, replacing `old` (one line of it, found once) with `new`."""

    path: str
    kind: Literal["read", "search", "edit"] = "read"
    pattern: str = ""
    old: str = ""
    new: str = ""


def _patch(step: Step) -> str:
    """Codex's apply_patch format: one line of `step.path` replaced."""
    return f"*** Begin Patch\n*** Update File: {step.path}\n@@\n-{step.old}\n+{step.new}\n*** End Patch\n"


def _replace_command(step: Step) -> str:
    """A shell command that replaces `step.old` with `step.new` in `step.path` once."""
    script = ("import pathlib,sys; p=pathlib.Path(sys.argv[1]); t=p.read_text(); "
              "assert t.count(sys.argv[2])==1, 'not found once'; p.write_text(t.replace(sys.argv[2], sys.argv[3]))")
    return shlex.join(["python3", "-c", script, step.path, step.old, step.new])


def _shell_command(step: Step) -> str:
    if step.kind == "search":
        return shlex.join(["grep", "-rn", "--", step.pattern, step.path])
    if step.kind == "edit":
        return _replace_command(step)
    return f"cat {step.path}"


def tool_call_for(tools: Sequence[dict[str, Any]], step: str | Step) -> Call | None:
    """The call that does `step` (a path: read it) with a tool the agent offers (its own names and arguments)."""
    if isinstance(step, str):
        step = Step(step)
    names = {str((t.get("function") or {}).get("name")) for t in tools if isinstance(t, dict)}
    if step.kind == "search" and "Grep" in names:  # Claude Code, where it offers its search tool
        return Call("Grep", {"pattern": step.pattern, "path": step.path, "output_mode": "content", "-n": True})
    if step.kind == "edit" and "Edit" in names:  # Claude Code: the file must have been Read before
        return Call("Edit", {"file_path": step.path, "old_string": step.old, "new_string": step.new})
    if step.kind == "read" and "Read" in names:  # Claude Code
        return Call("Read", {"file_path": step.path})
    if "exec_command" in names:  # Codex
        return Call("exec_command", {"cmd": _shell_command(step)})
    if "exec" in names:  # Codex's default model: one freeform tool that runs JavaScript over its nested tools
        if step.kind == "edit":
            return Call("exec", {"input": f"const out = await tools.apply_patch({orjson.dumps(_patch(step)).decode()});\n"
                                          "text(out);"})
        command = orjson.dumps({"cmd": _shell_command(step)}).decode()
        return Call("exec", {"input": f"const out = await tools.exec_command({command});\ntext(out);"})
    if "Bash" in names:
        return Call("Bash", {"command": _shell_command(step), "description": f"{step.kind.capitalize()} the file"})
    if "shell" in names:
        return Call("shell", {"command": ["bash", "-c", _shell_command(step)]} if step.kind != "read"
                    else {"command": ["cat", step.path]})
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""


@dataclass
class AgentModel:
    """The script: read each of `files` in turn (or do each of `steps`), then answer with every tool output."""

    files: Sequence[str]
    delay_s: float = 0.0  # a model's thinking time per turn (the bench's fixed cost)
    quote_chars: int | None = None  # the final answer quotes this much of each tool output (None: all)
    requests: list[dict[str, Any]] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)  # the `content` types seen, by role
    raw: list[bytes] = field(default_factory=list)  # each request body as it came over the wire
    steps: Sequence[Step] = ()  # the script, when it does more than read `files`

    @property
    def script(self) -> list[Step]:
        return list(self.steps) or [Step(path) for path in self.files]

    def reply(self, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The assistant message and finish reason for one chat request."""
        messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
        for message in messages:
            self.content_types.append(f"{message.get('role')}:{type(message.get('content')).__name__}")
        results = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
        # the script restarts at each user turn: results after the last real user message count
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        done = sum(1 for m in messages[last_user + 1:] if m.get("role") == "tool")
        tools = body.get("tools") or []
        script = self.script
        if done < len(script) and tools:
            call = tool_call_for(tools, script[done])
            if call is not None:
                tool_call = {"id": "call_" + uuid.uuid4().hex[:12], "type": "function",
                             "function": {"name": call.name, "arguments": orjson.dumps(call.arguments).decode()}}
                return {"role": "assistant", "content": "", "tool_calls": [tool_call]}, "tool_calls"
        if results:
            quoted = [r.strip()[:self.quote_chars] for r in results[-len(script):]]
            return {"role": "assistant", "content": f"{ANSWER_PREFIX} " + " | ".join(quoted)}, "stop"
        return {"role": "assistant", "content": "OK."}, "stop"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                              "owned_by": "tests"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        self.requests.append(body)
        self.raw.append(raw)
        message, finish = self.reply(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        prompt = sum(len(_text(m.get("content"))) for m in body.get("messages") or ()) // 4 + 1
        completion = len(orjson.dumps(message)) // 4 + 1
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        created = int(time.time())
        ident = "chatcmpl-" + uuid.uuid4().hex[:16]
        if not body.get("stream"):
            return web.json_response({"id": ident, "object": "chat.completion", "created": created, "model": MODEL,
                                      "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                   "logprobs": None}],
                                      "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        def chunk(delta: dict[str, Any], reason: str | None = None) -> bytes:
            data = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}
            return b"data: " + orjson.dumps(data) + b"\n\n"

        await response.write(chunk({"role": "assistant", "content": ""}))
        for call in message.get("tool_calls") or ():
            arguments = call["function"]["arguments"]
            head = {"index": 0, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"],
                                                                                    "arguments": ""}}
            await response.write(chunk({"tool_calls": [head]}))
            middle = len(arguments) // 2
            for piece in (arguments[:middle], arguments[middle:]):  # arguments arrive in pieces, as from a model
                await response.write(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
        text = message.get("content") or ""
        for start in range(0, len(text), 16):
            await response.write(chunk({"content": text[start:start + 16]}))
        await response.write(chunk({}, finish))
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(b"data: " + orjson.dumps({"id": ident, "object": "chat.completion.chunk",
                                                            "created": created, "model": MODEL, "choices": [],
                                                            "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response
