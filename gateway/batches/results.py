"""A line's result as each API writes it: OpenAI's output and error file lines, Anthropic's result lines.

A line's answer is kept as the runner recorded it (`{status_code, request_id, body}`, the body as
the line's API shows it); lines never run keep only their state (canceled, expired).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

# (custom_id, line id, state, recorded result) of one line, as the job store reads it
Row = tuple[str, str, str, bytes | None]

_NOT_RUN = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "canceled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}


def openai_line(custom_id: str, line_id: str, state: str, result: bytes | None) -> dict[str, Any]:
    """`{id, custom_id, response: {status_code, request_id, body}, error}`: an answer (a 4xx/5xx one
    too) under `response`; a line never run has `error` {code, message} and no response."""
    if result is None:
        code, message = _NOT_RUN.get(state, ("batch_failed", "This request was not executed."))
        return {"id": line_id, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}
    answer = orjson.loads(result)
    response = {"status_code": answer["status_code"], "request_id": answer["request_id"], "body": answer["body"]}
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": None}


def openai_files(rows: Iterable[Row]) -> tuple[bytes, bytes]:
    """The output file (answers with status 200) and the error file (every other line) of a job."""
    output: list[bytes] = []
    errors: list[bytes] = []
    for custom_id, line_id, state, result in rows:
        (output if state == "succeeded" else errors).append(orjson.dumps(openai_line(custom_id, line_id, state, result)))
    return b"".join(line + b"\n" for line in output), b"".join(line + b"\n" for line in errors)


def anthropic_line(custom_id: str, state: str, result: bytes | None) -> dict[str, Any]:
    """`{custom_id, result: {type: succeeded|errored|canceled|expired, message|error}}`."""
    if result is None:
        return {"custom_id": custom_id, "result": {"type": state}}
    answer = orjson.loads(result)
    if state == "succeeded":
        return {"custom_id": custom_id, "result": {"type": "succeeded", "message": answer["body"]}}
    error = {**answer["body"], "request_id": answer["request_id"]}
    return {"custom_id": custom_id, "result": {"type": "errored", "error": error}}
