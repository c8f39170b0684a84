"""The Batch API's job store and input checks, without the app: lines recorded once, duplicates, bounds."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import pytest

from gateway.batches import jsonl
from gateway.batches.database import Database
from gateway.batches.files import FileStore, QuotaExceeded
from gateway.batches.jobs import JobStore, Limits, NewJob
from gateway.batches.results import anthropic_line, openai_files

LIMITS = Limits(jobs=2, lines=10)


def line(custom_id: str, text: str) -> jsonl.Line:
    return jsonl.Line(custom_id, "/v1/chat/completions", orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}))


def new_job(tenant: str = "t") -> NewJob:
    return NewJob(tenant=tenant, app="a", key_id="k", api="openai", endpoint="/v1/chat/completions",
                  completion_window="24h", window_s=60.0)


def answer(status: int = 200) -> bytes:
    return orjson.dumps({"status_code": status, "request_id": "r", "body": {"ok": status == 200}})


def run(tmp_path: Path, test: Callable[[JobStore, FileStore], Awaitable[None]]) -> None:
    async def go() -> None:
        database = Database(tmp_path / "batches.sqlite3")
        await database.open()
        try:
            await test(JobStore(database, 3600.0), FileStore(database, 3600.0))
        finally:
            await database.close()

    asyncio.run(go())


def test_a_line_and_its_duplicates_are_recorded_once_in_one_transaction(tmp_path: Path) -> None:
    async def test(jobs: JobStore, files: FileStore) -> None:
        job = await jobs.create(new_job(), [line("a", "tea"), line("b", "coffee"), line("c", "tea")], deduplicate=True,
                                limits=LIMITS)
        await jobs.start(job.id)
        pending = await jobs.pending(job.id, -1, 10)
        assert [p.custom_id for p in pending] == ["a", "b"]  # c is a's duplicate: never run
        assert await jobs.record(job.id, 0, "succeeded", answer()) == 2  # a, and c with it
        assert await jobs.record(job.id, 0, "succeeded", answer()) == 0  # recorded once
        assert [p.custom_id for p in await jobs.pending(job.id, -1, 10)] == ["b"]
        assert await jobs.end_pending(job.id, "canceled", []) == 1
        await jobs.finish(job.id, "cancelled")
        done = await jobs.get("t", job.id)
        assert done is not None and (done.n_succeeded, done.n_canceled, done.pending) == (2, 1, 0)
        assert done.status == "cancelled" and done.output_file_id and done.error_file_id
        output = await files.content("t", done.output_file_id)
        assert sorted(orjson.loads(x)["custom_id"] for x in output.splitlines()) == ["a", "c"]
        assert await jobs.get("other", job.id) is None  # another tenant's id is not found

    run(tmp_path, test)


def test_lines_in_flight_and_their_duplicates_are_kept_when_a_job_ends(tmp_path: Path) -> None:
    async def test(jobs: JobStore, files: FileStore) -> None:
        job = await jobs.create(new_job(), [line("a", "x"), line("b", "y"), line("c", "x")], deduplicate=True,
                                limits=LIMITS)
        assert await jobs.end_pending(job.id, "expired", [0]) == 1  # b; a runs, c follows a
        assert await jobs.record(job.id, 0, "errored", answer(500)) == 2
        done = await jobs.get("t", job.id)
        assert done is not None and (done.n_errored, done.n_expired, done.pending) == (2, 1, 0)

    run(tmp_path, test)


def test_tenants_are_held_to_their_jobs_lines_and_bytes(tmp_path: Path) -> None:
    async def test(jobs: JobStore, files: FileStore) -> None:
        await jobs.create(new_job(), [line("a", "x")], deduplicate=True, limits=LIMITS)
        with pytest.raises(QuotaExceeded, match="max_queued_lines_per_tenant"):
            await jobs.create(new_job(), [line(str(i), str(i)) for i in range(10)], deduplicate=True, limits=LIMITS)
        await jobs.create(new_job(), [line("a", "x")], deduplicate=True, limits=LIMITS)
        with pytest.raises(QuotaExceeded, match="max_active_jobs_per_tenant"):
            await jobs.create(new_job(), [line("a", "x")], deduplicate=True, limits=LIMITS)
        await jobs.create(new_job("u"), [line("a", "x")], deduplicate=True, limits=LIMITS)  # another tenant's own
        await files.put("t", "batch", "f", b"x" * 600, 1, 1000)
        with pytest.raises(QuotaExceeded, match="max_bytes_per_tenant"):
            await files.put("t", "batch", "g", b"x" * 600, 1, 1000)

    run(tmp_path, test)


def test_a_job_whose_lines_name_another_endpoint_fails_naming_them(tmp_path: Path) -> None:
    async def test(jobs: JobStore, files: FileStore) -> None:
        wrong = jsonl.Line("e", "/v1/embeddings", b'{"model": "m", "input": "x"}')
        job = await jobs.create(new_job(), [line("a", "x"), wrong], deduplicate=True, limits=LIMITS)
        await jobs.start(job.id)
        failed = await jobs.get("t", job.id)
        assert failed is not None and failed.status == "failed" and failed.pending == 0
        assert failed.errors == [{"code": "invalid_url", "line": 2, "param": "url",
                                  "message": "request 'e' is for /v1/embeddings, but the batch's endpoint is /v1/chat/completions"}]

    run(tmp_path, test)


def test_result_lines_follow_each_apis_format() -> None:
    ok = orjson.dumps({"status_code": 200, "request_id": "r1", "body": {"id": "x"}})
    output, errors = openai_files([("a", "batch_req_1", "succeeded", ok), ("b", "batch_req_2", "expired", None)])
    assert orjson.loads(output) == {"id": "batch_req_1", "custom_id": "a", "error": None,
                                    "response": {"status_code": 200, "request_id": "r1", "body": {"id": "x"}}}
    assert orjson.loads(errors)["error"]["code"] == "batch_expired" and orjson.loads(errors)["response"] is None
    failed = orjson.dumps({"status_code": 404, "request_id": "r2",
                           "body": {"type": "error", "error": {"type": "not_found_error", "message": "no"}}})
    assert anthropic_line("c", "errored", failed) == {"custom_id": "c", "result": {"type": "errored", "error": {
        "type": "error", "error": {"type": "not_found_error", "message": "no"}, "request_id": "r2"}}}
    assert anthropic_line("d", "canceled", None) == {"custom_id": "d", "result": {"type": "canceled"}}


@pytest.mark.parametrize(("content", "says"), [
    (b"", "no requests"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"stream": true}}', "stream"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": []}', "`body` must be a JSON object"),
    (b'[1]', "line 1 is not a JSON object"),
    (b'{"custom_id": "", "method": "POST", "url": "/v1/chat/completions", "body": {}}', "`custom_id`"),
])
def test_bad_input_files_name_what_is_wrong(content: bytes, says: str) -> None:
    with pytest.raises(jsonl.BadFile, match=says.replace("[", r"\[")):
        jsonl.openai_lines(content, max_lines=10, max_body_bytes=1024)


def test_a_file_of_too_many_lines_is_refused() -> None:
    one = b'{"custom_id": "%d", "method": "POST", "url": "/v1/embeddings", "body": {}}\n'
    with pytest.raises(jsonl.BadFile, match="max_file_lines"):
        jsonl.openai_lines(b"".join(one % i for i in range(4)), max_lines=3, max_body_bytes=1024)
