"""Anthropic's Message Batches endpoints (`/v1/messages/batches`): wire ⇄ the job store, nothing more.

Errors keep Anthropic's shape (`{"type": "error", "error": {...}}`: the Messages front door's
error format covers every path under /v1/messages). Every call is scoped to the caller's tenant.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web

from gateway.batches import jsonl, results
from gateway.batches.jobs import ENDED, Job, NewJob
from gateway.batches.lines import KEPT_HEADERS
from gateway.batches.service import Batches, batches_of
from gateway.errors import InvalidRequest, NotFound, PayloadTooLarge
from gateway.keys import PRINCIPAL, SETTINGS

_PAGE = 1000  # result lines read from the store at a time


def _time(value: float | None) -> str | None:
    """RFC 3339, as Anthropic writes its times."""
    if value is None:
        return None
    return datetime.fromtimestamp(value, UTC).isoformat().replace("+00:00", "Z")


def processing_status(job: Job) -> str:
    if job.status in ENDED:
        return "ended"
    return "canceling" if job.status == "cancelling" else "in_progress"


def batch_object(job: Job, origin: str) -> dict[str, Any]:
    ended = job.status in ENDED
    return {
        "id": job.id, "type": "message_batch", "processing_status": processing_status(job),
        "request_counts": {"processing": job.pending, "succeeded": job.n_succeeded, "errored": job.n_errored,
                           "canceled": job.n_canceled, "expired": job.n_expired},
        "ended_at": _time(job.ended_at), "created_at": _time(job.created_at), "expires_at": _time(job.expires_at),
        "archived_at": None, "cancel_initiated_at": _time(job.cancelling_at),
        "results_url": f"{origin}/v1/messages/batches/{job.id}/results" if ended else None,
    }


def _origin(request: web.Request) -> str:
    return str(request.url.origin())


async def _read_body(request: web.Request, limit: int) -> dict[str, Any]:
    """The JSON body, up to `limit` bytes: a batch may be far larger than one request (server.max_body_bytes)."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"the batch is larger than {limit} bytes (batches.max_file_bytes)")
    data = bytearray()
    while chunk := await request.content.read(256 * 1024):
        data += chunk
        if len(data) > limit:
            raise PayloadTooLarge(f"the batch is larger than {limit} bytes (batches.max_file_bytes)")
    try:
        body = orjson.loads(bytes(data))
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    return body


async def create_batch(request: web.Request) -> web.Response:
    batches = batches_of(request.app)
    body = await _read_body(request, batches.settings.max_file_bytes)
    server = request.app[SETTINGS].server
    # checked off the event loop: 100,000 requests validated as Messages requests take seconds
    lines = await asyncio.to_thread(jsonl.anthropic_lines, body, max_lines=batches.settings.max_file_lines,
                                    max_body_bytes=server.max_body_bytes, max_items=server.max_items)
    principal = request[PRINCIPAL]
    headers = {name: request.headers[name] for name in KEPT_HEADERS if name in request.headers}
    new = NewJob(tenant=principal.tenant, app=principal.app, key_id=principal.key_id, api="anthropic",
                 endpoint=jsonl.MESSAGES_URL, completion_window="24h", window_s=batches.settings.window_s, headers=headers)
    job = await batches.jobs.create(new, lines, deduplicate=batches.settings.deduplicate, limits=batches.limits)
    batches.runner.wake()
    return web.json_response(batch_object(job, _origin(request)))


async def _job(request: web.Request, batches: Batches) -> Job:
    batch_id = request.match_info["batch_id"]
    job = await batches.jobs.get(request[PRINCIPAL].tenant, batch_id)
    if job is None or job.api != "anthropic":
        raise NotFound(f"no message batch with id '{batch_id}' was found", param="message_batch_id")
    return job


async def get_batch(request: web.Request) -> web.Response:
    return web.json_response(batch_object(await _job(request, batches_of(request.app)), _origin(request)))


async def list_batches(request: web.Request) -> web.Response:
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 1000:
        raise InvalidRequest("limit must be an integer from 1 to 1000", param="limit")
    after, before = request.query.get("after_id"), request.query.get("before_id")
    page = await batches_of(request.app).jobs.listing(request[PRINCIPAL].tenant, "anthropic", after=after, before=before,
                                                      limit=limit)
    if page is None:
        raise NotFound(f"no message batch with id '{after or before}' was found", param="after_id" if after else "before_id")
    jobs, has_more = page
    data = [batch_object(job, _origin(request)) for job in jobs]
    return web.json_response({"data": data, "has_more": has_more, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None})


async def batch_results(request: web.Request) -> web.StreamResponse:
    """The results as JSONL, one line per request in the order they were sent, once processing has ended."""
    batches = batches_of(request.app)
    job = await _job(request, batches)
    if job.status not in ENDED:
        raise InvalidRequest(f"message batch {job.id} is still {processing_status(job)}; its results are ready once "
                             "processing_status is ended", param="message_batch_id")
    response = web.StreamResponse(headers={"Content-Type": "application/x-jsonl"})
    await response.prepare(request)
    after = -1
    while page := await batches.jobs.rows(job.tenant, job.id, after, _PAGE):
        lines = [orjson.dumps(results.anthropic_line(custom_id, state, result)) + b"\n"
                 for _, (custom_id, _, state, result) in page]
        await response.write(b"".join(lines))
        after = page[-1][0]
    await response.write_eof()
    return response


async def cancel_batch(request: web.Request) -> web.Response:
    batches = batches_of(request.app)
    job = await _job(request, batches)
    cancelled = await batches.jobs.cancel(job.tenant, job.id)
    batches.runner.wake()
    return web.json_response(batch_object(cancelled or job, _origin(request)))


async def delete_batch(request: web.Request) -> web.Response:
    batches = batches_of(request.app)
    job = await _job(request, batches)
    if not await batches.jobs.delete(job.tenant, job.id):
        raise InvalidRequest(f"message batch {job.id} is still {processing_status(job)}; cancel it and delete it once "
                             "processing_status is ended", param="message_batch_id")
    return web.json_response({"id": job.id, "type": "message_batch_deleted"})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages/batches", create_batch)
    app.router.add_get("/v1/messages/batches", list_batches)
    app.router.add_get("/v1/messages/batches/{batch_id}", get_batch)
    app.router.add_delete("/v1/messages/batches/{batch_id}", delete_batch)
    app.router.add_get("/v1/messages/batches/{batch_id}/results", batch_results)
    app.router.add_post("/v1/messages/batches/{batch_id}/cancel", cancel_batch)

