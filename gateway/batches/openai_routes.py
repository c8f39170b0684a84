"""OpenAI's Files and Batch endpoints (`/v1/files`, `/v1/batches`): wire ⇄ the batch stores, nothing more.

Errors keep OpenAI's shape (the gateway's own). Every call is scoped to the caller's tenant.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import BodyPartReader, web

from gateway.apis.common import read_json
from gateway.batches import jsonl
from gateway.batches.files import StoredFile
from gateway.batches.jobs import Job, NewJob
from gateway.batches.service import Batches, batches_of
from gateway.errors import InvalidRequest, NotFound
from gateway.keys import PRINCIPAL, SETTINGS

_CHUNK = 256 * 1024


def file_object(stored: StoredFile) -> dict[str, Any]:
    return {"id": stored.id, "object": "file", "bytes": stored.bytes, "created_at": stored.created_at,
            "filename": stored.filename, "purpose": stored.purpose, "status": "processed",
            "expires_at": stored.expires_at, "status_details": None}


def _stamp(value: float | None) -> int | None:
    return None if value is None else int(value)


def batch_object(job: Job) -> dict[str, Any]:
    return {
        "id": job.id, "object": "batch", "endpoint": job.endpoint,
        "errors": None if job.errors is None else {"object": "list", "data": job.errors},
        "input_file_id": job.input_file_id, "completion_window": job.completion_window, "status": job.status,
        "output_file_id": job.output_file_id, "error_file_id": job.error_file_id, "created_at": int(job.created_at),
        "in_progress_at": _stamp(job.in_progress_at), "expires_at": _stamp(job.expires_at),
        "finalizing_at": _stamp(job.finalizing_at), "completed_at": _stamp(job.completed_at),
        "failed_at": _stamp(job.failed_at), "expired_at": _stamp(job.expired_at),
        "cancelling_at": _stamp(job.cancelling_at), "cancelled_at": _stamp(job.cancelled_at),
        # lines canceled or expired did not run: they count as failed (and are in the error file)
        "request_counts": {"total": job.n_total, "completed": job.n_succeeded,
                           "failed": job.n_errored + job.n_canceled + job.n_expired},
        "metadata": job.metadata,
    }


def _limit(request: web.Request, default: int, most: int) -> int:
    try:
        limit = int(request.query.get("limit", str(default)))
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise InvalidRequest(f"limit must be an integer from 1 to {most}", param="limit")
    return limit


def _page(data: list[dict[str, Any]], has_more: bool) -> web.Response:
    return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": has_more})


# Files -----------------------------------------------------------------------------------------


async def _read_part(part: BodyPartReader, limit: int, what: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(_CHUNK):
        data += chunk
        if len(data) > limit:
            raise jsonl.BadFile(f"the {what} is larger than {limit} bytes (batches.max_file_bytes)", param=what)
    return bytes(data)


async def _lines(request: web.Request, batches: Batches, content: bytes) -> list[jsonl.Line]:
    """The file's lines, checked off the event loop (a file of 50,000 lines takes a while)."""
    server = request.app[SETTINGS].server
    return await asyncio.to_thread(jsonl.openai_lines, content, max_lines=batches.settings.max_file_lines,
                                   max_body_bytes=server.max_body_bytes)


async def upload_file(request: web.Request) -> web.Response:
    batches = batches_of(request.app)
    limit = batches.settings.max_file_bytes
    try:
        reader = await request.multipart()
    except (AssertionError, ValueError, KeyError, RuntimeError):
        raise InvalidRequest("send the file as multipart/form-data with the fields `file` and `purpose`") from None
    purpose: str | None = None
    content: bytes | None = None
    filename = "file.jsonl"
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise InvalidRequest("nested multipart bodies are not accepted", param="file")
        if part.name == "purpose":
            purpose = (await _read_part(part, 1024, "purpose")).decode("utf-8", "replace").strip()
        elif part.name == "file":
            filename = part.filename or filename
            content = await _read_part(part, limit, "file")
        else:
            await part.release()
    if purpose != "batch":
        raise InvalidRequest(f"purpose {purpose!r} is not served here: this gateway keeps files for the Batch API "
                             "(purpose: batch)", param="purpose")
    if content is None:
        raise InvalidRequest("the `file` field is missing", param="file", code="missing_required_parameter")
    lines = await _lines(request, batches, content)
    stored = await batches.files.put(request[PRINCIPAL].tenant, "batch", filename, content, len(lines),
                                     batches.settings.max_bytes_per_tenant)
    return web.json_response(file_object(stored))


async def get_file(request: web.Request) -> web.Response:
    stored = await batches_of(request.app).files.get(request[PRINCIPAL].tenant, request.match_info["file_id"])
    return web.json_response(file_object(stored))


async def file_content(request: web.Request) -> web.Response:
    content = await batches_of(request.app).files.content(request[PRINCIPAL].tenant, request.match_info["file_id"])
    return web.Response(body=content, content_type="application/octet-stream")


async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    await batches_of(request.app).files.delete(request[PRINCIPAL].tenant, file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


async def list_files(request: web.Request) -> web.Response:
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc", param="order")
    found, has_more = await batches_of(request.app).files.listing(
        request[PRINCIPAL].tenant, purpose=request.query.get("purpose"), after=request.query.get("after"),
        limit=_limit(request, 10_000, 10_000), ascending=order == "asc")
    return _page([file_object(stored) for stored in found], has_more)


# Batches ---------------------------------------------------------------------------------------


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > 16
            or any(not isinstance(k, str) or len(k) > 64 or not isinstance(v, str) or len(v) > 512 for k, v in value.items())):
        raise InvalidRequest("metadata must be at most 16 string keys (64 characters) to string values (512 characters)",
                             param="metadata")
    return value


async def create_batch(request: web.Request) -> web.Response:
    batches = batches_of(request.app)
    body = await read_json(request)
    endpoint = body.get("endpoint")
    if endpoint not in jsonl.OPENAI_URLS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(jsonl.OPENAI_URLS)}", param="endpoint")
    if body.get("completion_window") != "24h":
        raise InvalidRequest("completion_window must be 24h", param="completion_window")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise InvalidRequest("input_file_id is required", param="input_file_id", code="missing_required_parameter")
    principal = request[PRINCIPAL]
    stored = await batches.files.get(principal.tenant, file_id)
    if stored.purpose != "batch":
        raise InvalidRequest(f"file {file_id!r} has purpose {stored.purpose}, not batch", param="input_file_id")
    content = await batches.files.content(principal.tenant, file_id)
    lines = await _lines(request, batches, content)
    new = NewJob(tenant=principal.tenant, app=principal.app, key_id=principal.key_id, api="openai", endpoint=str(endpoint),
                 completion_window="24h", window_s=batches.settings.window_s, input_file_id=file_id,
                 metadata=_metadata(body.get("metadata")))
    job = await batches.jobs.create(new, lines, deduplicate=batches.settings.deduplicate, limits=batches.limits)
    batches.runner.wake()
    return web.json_response(batch_object(job))


async def _job(request: web.Request, batches: Batches) -> Job:
    batch_id = request.match_info["batch_id"]
    job = await batches.jobs.get(request[PRINCIPAL].tenant, batch_id)
    if job is None or job.api != "openai":
        raise NotFound(f"no batch with id '{batch_id}' was found", param="batch_id")
    return job


async def get_batch(request: web.Request) -> web.Response:
    return web.json_response(batch_object(await _job(request, batches_of(request.app))))


async def cancel_batch(request: web.Request) -> web.Response:
    batches = batches_of(request.app)
    job = await _job(request, batches)
    cancelled = await batches.jobs.cancel(job.tenant, job.id)
    batches.runner.wake()
    return web.json_response(batch_object(cancelled or job))


async def list_batches(request: web.Request) -> web.Response:
    after = request.query.get("after")
    page = await batches_of(request.app).jobs.listing(request[PRINCIPAL].tenant, "openai", after=after,
                                                      limit=_limit(request, 20, 100))
    if page is None:
        raise NotFound(f"no batch with id '{after}' was found", param="after")
    jobs, has_more = page
    return _page([batch_object(job) for job in jobs], has_more)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", upload_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)

