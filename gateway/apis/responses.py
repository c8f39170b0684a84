"""The OpenAI Responses API (`/v1/responses`) as a front door, with stored responses.

`POST /v1/responses` translates into the chat body an equivalent chat request would send and
renders the answer as a Response (or its stream of events). With `store` (the API's default)
the response, its input items and the conversation before them are kept in the state backend,
per tenant, so `previous_response_id`, GET, DELETE and `input_items` work across replicas.
Errors keep OpenAI's shape (the gateway's own).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from gateway import protocol
from gateway.apis.common import (
    answer_usage,
    chat_context,
    field_record,
    first_choice,
    new_id,
    read_json,
    sse,
)
from gateway.apis.response_store import Limits, Reservation, ResponseStore, StoreFailed
from gateway.apis.responses_tools import ToolSet
from gateway.apis.responses_wire import (
    ResponsesRequest,
    call_item,
    envelope,
    input_items,
    message_item,
    message_item_id,
    output_items,
    output_text,
    status_of,
    translate,
    usage_block,
)
from gateway.caller import Caller
from gateway.context import RequestContext
from gateway.errors import GatewayError, InvalidRequest, NotFound, PayloadTooLarge
from gateway.keys import BODY_BYTES, PRINCIPAL, SERVICES, SETTINGS
from gateway.respond import StreamEncoder, serve
from gateway.session import SESSION_HEADER, session_key

log = logging.getLogger(__name__)
# Set to `failed` on an answer whose response could not be stored (its `store` then reads false).
STORE_HEADER = "x-tierlane-store"


@dataclass(slots=True)
class Turn:
    """One Responses request: what it asked, the response it continues, where it is kept."""

    req: ResponsesRequest
    id: str
    created_at: int
    tenant: str
    inputs: list[dict[str, Any]]  # this request's input items (the turns before are read from the chain)
    store: ResponseStore | None  # None: store false, nothing is kept
    model: str = ""  # the model name the client asked for: what the Response carries
    tools: ToolSet = field(default_factory=ToolSet)  # chat tool name -> the client's tool (custom, namespaced, ...)
    session: str | None = None
    reservation: Reservation | None = None  # the room admission reserved; settled once the record is stored

    def response(self, ctx: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
        """The whole Response for a chat answer."""
        _, reason = first_choice(body)
        status, details = status_of(reason)
        out = envelope(self.req, self.id, self.created_at, self.model or ctx.client_model or ctx.model)
        out.update(status=status, incomplete_details=details, output=output_items(self.id, body, self.tools),
                   usage=usage_block(answer_usage(ctx, body)))
        return out

    async def keep(self, ctx: RequestContext, response: dict[str, Any]) -> None:
        """Store the answered response. The answer is already made (and billed): a store that fails
        now loses the record, never the answer. The failure is logged, counted on the span, and
        stated: `store` false in the Response and the `x-tierlane-store: failed` header (where the
        headers are not yet sent)."""
        if self.store is None:
            return
        # a link to the turn before, not a copy of the conversation: a chain stores each turn once
        record = {"response": response, "input": self.inputs, "previous": self.req.previous_response_id,
                  "session": self.session}
        try:
            await self.store.put(self.tenant, self.id, record)
        except (StoreFailed, OSError, ConnectionError, TimeoutError) as exc:
            log.warning("response %s answered but not stored: %s", self.id, exc)
            response["store"] = False
            ctx.attributes["tierlane.responses.store_failed"] = True
            ctx.response_headers[STORE_HEADER] = "failed"
        finally:
            # settled: the stored record is counted now (at its real size), not the reservation
            if self.reservation is not None:
                self.store.release(self.reservation)


@dataclass(slots=True)
class _Item:
    kind: str  # message | function_call | custom_tool_call | tool_search_call
    index: int  # output_index
    id: str
    text: list[str] = field(default_factory=list)  # the message's text, or the call's arguments
    call_id: str = ""
    name: str = ""


class ResponsesEncoder:
    """Chat chunks as Responses events, each with its sequence_number; no [DONE]."""

    def __init__(self, ctx: RequestContext, turn: Turn) -> None:
        self.ctx = ctx
        self.turn = turn
        self.seq = 0
        self.started = False
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return sse(kind, data)

    def _start(self, model: Any) -> bytes:
        self.started = True
        self.turn.model = self.turn.model or str(self.ctx.client_model or model or self.ctx.model)
        response = envelope(self.turn.req, self.turn.id, self.turn.created_at, self.turn.model)
        return self._event("response.created", response=response) + self._event("response.in_progress", response=response)

    def _close(self) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        text = "".join(item.text)
        if item.kind == "message":
            part = output_text(text)
            done = message_item(self.turn.id, text, "completed")
            return (self._event("response.output_text.done", item_id=item.id, output_index=item.index, content_index=0,
                                text=text, logprobs=[])
                    + self._event("response.content_part.done", item_id=item.id, output_index=item.index,
                                  content_index=0, part=part)
                    + self._event("response.output_item.done", output_index=item.index, item=done))
        position = int(item.id.rsplit("_", 1)[1])
        done = call_item(self.turn.id, position, item.call_id, item.name, text, "completed", self.turn.tools)
        if item.kind == "custom_tool_call":  # its text is known once the chat arguments are whole
            return (self._event("response.custom_tool_call_input.delta", item_id=item.id, output_index=item.index,
                                delta=done["input"])
                    + self._event("response.custom_tool_call_input.done", item_id=item.id, output_index=item.index,
                                  input=done["input"])
                    + self._event("response.output_item.done", output_index=item.index, item=done))
        if item.kind in ("tool_search_call", "local_shell_call"):  # no argument events: the item carries them
            return self._event("response.output_item.done", output_index=item.index, item=done)
        return (self._event("response.function_call_arguments.done", item_id=item.id, output_index=item.index,
                            arguments=text, name=done.get("name", item.name))
                + self._event("response.output_item.done", output_index=item.index, item=done))

    def _add(self, item: _Item, shown: dict[str, Any]) -> bytes:
        closed = self._close()
        self.items.append(item)
        self.open = item
        return closed + self._event("response.output_item.added", output_index=item.index, item=shown)

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        out = [] if self.started else [self._start(chunk.get("model"))]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                item = self.open
                if item is None or item.kind != "message":
                    item = _Item("message", len(self.items), message_item_id(self.turn.id))
                    shown = {"id": item.id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
                    out.append(self._add(item, shown))
                    out.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                           content_index=0, part=output_text("")))
                item.text.append(text)
                out.append(self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                                       content_index=0, delta=text, logprobs=[]))
            for call in delta.get("tool_calls") or ():
                position = call.get("index", 0)
                function = call.get("function") or {}
                item = self.calls.get(position)
                if item is None:
                    name = function.get("name") or ""
                    shown = call_item(self.turn.id, position, call.get("id") or new_id("call_"), name, "", "in_progress",
                                      self.turn.tools)
                    item = self.calls[position] = _Item(str(shown["type"]), len(self.items), str(shown["id"]),
                                                        call_id=str(shown["call_id"]), name=name)
                    out.append(self._add(item, shown))
                if function.get("arguments"):
                    item.text.append(function["arguments"])
                    if item.kind == "function_call":  # a custom tool's text goes out whole, when it is whole
                        out.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                               output_index=item.index, delta=function["arguments"]))
        return b"".join(out)

    async def end(self, response: dict[str, Any]) -> bytes:
        out = [] if self.started else [self._start(response.get("model"))]
        out.append(self._close())
        whole = self.turn.response(self.ctx, response)
        await self.turn.keep(self.ctx, whole)
        kind = "response.completed" if whole["status"] == "completed" else "response.incomplete"
        out.append(self._event(kind, response=whole))
        return b"".join(out)

    def error(self, err: GatewayError) -> bytes:
        return self._event("error", code=err.code or err.type, message=err.message, param=err.param)


class ResponsesWire:
    def __init__(self, turn: Turn) -> None:
        self.turn = turn

    async def body(self, ctx: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
        response = self.turn.response(ctx, body)
        await self.turn.keep(ctx, response)
        return response

    def encoder(self, ctx: RequestContext) -> StreamEncoder:
        return ResponsesEncoder(ctx, self.turn)


# Handlers ------------------------------------------------------------------------------------


def _store(request: web.Request) -> ResponseStore:
    services = request.app.get(SERVICES)
    store = services.responses if services is not None else None
    if store is None:
        raise StoreFailed("the response store is not running")
    return store


def _not_found(response_id: str, param: str = "response_id") -> NotFound:
    return NotFound(f"no response with id '{response_id}' was found", param=param)


def _session(headers: Mapping[str, str], req: ResponsesRequest, previous: dict[str, Any] | None) -> str | None:
    """One conversation's key: the client's session or thread id (Codex sends both), its prompt
    cache key, the chain it continues (previous_response_id), else the session header."""
    meta = req.client_metadata or {}
    chain = None
    if previous is not None:
        chain = previous.get("session") or previous["response"].get("id")
    return session_key(meta.get("session_id"), meta.get("thread_id"), req.prompt_cache_key, chain,
                       headers.get("session_id"), headers.get("session-id"), headers.get(SESSION_HEADER))


# The most turns a previous_response_id chain is read back through (one store read each).
MAX_CHAIN = 512


async def read_chain(store: ResponseStore, tenant: str, response_id: str, max_bytes: int,
                     max_items: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The items of the conversation up to and including `response_id` (its input and output), and
    its record. Bounded: at most MAX_CHAIN links, `max_bytes` of records and `max_items` items are
    read; a turn whose record expired or was deleted ends the conversation there."""
    records: list[dict[str, Any]] = []
    size = items = 0
    link: str | None = response_id
    while link is not None:
        record = await store.get(tenant, link)
        if record is None:
            if not records:
                raise _not_found(response_id, "previous_response_id")
            break  # an earlier turn expired or was deleted: the conversation starts after it
        records.append(record)
        size += len(orjson.dumps(record))
        items += len(record.get("context") or ()) + len(record["input"]) + len(record["response"].get("output") or ())
        if size > max_bytes or items > max_items or len(records) > MAX_CHAIN:
            raise PayloadTooLarge(
                f"the conversation of previous_response_id is longer than the gateway reads back ({MAX_CHAIN} turns, "
                f"server.max_body_bytes {max_bytes}, server.max_items {max_items}); start a new conversation",
                param="previous_response_id")
        link = record.get("previous") if not record.get("context") else None  # older records carry a copy
    conversation: list[dict[str, Any]] = []
    for record in reversed(records):
        conversation += [*(record.get("context") or ()), *record["input"], *(record["response"].get("output") or ())]
    return conversation, records[0]


async def create_response(request: web.Request) -> web.StreamResponse:
    raw = await read_json(request)
    req = protocol.check(ResponsesRequest, raw)
    tenant = request[PRINCIPAL].tenant
    store = _store(request)
    settings = request.app[SETTINGS]
    reservation = None
    if req.store:
        # room reserved before any work: the body's size and a bound for the answer, released below
        # whatever happens (refused, failed, cancelled as the client goes away) unless stored first
        quota = settings.responses
        reservation = await store.reserve(
            tenant, request[BODY_BYTES] + quota.reserve_output_bytes,  # the body as read: not serialised again
            Limits(quota.max_records_per_tenant, quota.max_bytes_per_tenant, quota.max_bytes_total))
    try:
        ctx, wire = await response_context(Caller.of(request), req, raw, store, reservation)
        return await serve(request, ctx, wire)
    finally:
        if reservation is not None:
            store.release(reservation)


async def response_context(caller: Caller, req: ResponsesRequest, raw: dict[str, Any], store: ResponseStore,
                           reservation: Reservation | None = None) -> tuple[RequestContext, ResponsesWire]:
    """The context of a Responses request translated into chat (the conversation of its
    previous_response_id read from `store`), and the wire that renders (and, with `store`, keeps) its answer."""
    server = caller.settings.server
    tenant = caller.principal.tenant
    context: list[dict[str, Any]] = []
    previous = None
    if req.previous_response_id is not None:
        context, previous = await read_chain(store, tenant, req.previous_response_id, server.max_body_bytes,
                                             server.max_items)
    inputs = input_items(req)
    if context:
        # the conversation a chain assembles is bounded like one request's body
        protocol.check_items({"input": [*context, *inputs]}, server.max_items)
    body, dropped, tools = translate(req, raw, [*context, *inputs], field_record(caller))
    if context and len(orjson.dumps(body["messages"])) > server.max_body_bytes:
        raise PayloadTooLarge(
            f"the conversation assembled from previous_response_id is larger than {server.max_body_bytes} bytes "
            "(server.max_body_bytes); start a new conversation or send a shorter one", param="previous_response_id")
    session = _session(caller.headers, req, previous)
    turn = Turn(req=req, id=new_id("resp_"), created_at=int(time.time()), tenant=tenant, inputs=inputs,
                store=store if req.store else None, model=req.model, tools=tools, session=session,
                reservation=reservation)
    ctx = chat_context(caller, body, "responses", dropped, session=session)
    return ctx, ResponsesWire(turn)


async def _record(request: web.Request) -> dict[str, Any]:
    response_id = request.match_info["response_id"]
    record = await _store(request).get(request[PRINCIPAL].tenant, response_id)
    if record is None:
        raise _not_found(response_id)
    return record


async def get_response(request: web.Request) -> web.Response:
    return web.json_response((await _record(request))["response"])


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not await _store(request).delete(request[PRINCIPAL].tenant, response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    """The response's input items, newest first by default (`order`, `after`, `limit` as OpenAI's)."""
    items: list[dict[str, Any]] = list((await _record(request))["input"])
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise InvalidRequest("limit must be an integer from 1 to 100", param="limit") from None
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be an integer from 1 to 100", param="limit")
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequest(f"no input item with id '{after}' in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return web.json_response({
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    })


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
