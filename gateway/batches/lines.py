"""One line of a job through the pipeline: the context its endpoint's handler would build, at batch priority.

The line's body becomes a RequestContext by the very function its front door uses (OpenAI's
endpoints, Messages, Responses), with the job's principal; the pipeline answers it (cache,
routing, lanes, budgets) and its answer is rendered as that API shows it. Nothing goes over HTTP.

The line is not completed here: the runner records the result first, then completes the
context (the hooks: cache admission, metering), so a line metered is a line recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from gateway import protocol
from gateway.apis import messages
from gateway.apis.response_store import StoreFailed
from gateway.apis.responses import response_context
from gateway.apis.responses_wire import ResponsesRequest
from gateway.assemble import StreamAssembler
from gateway.batches.jobs import Job, PendingLine
from gateway.batches.jsonl import MESSAGES_URL
from gateway.caller import Caller
from gateway.context import Answer, Outcome, RequestContext, WireOperation
from gateway.errors import GatewayError, Overloaded, RateLimited, as_gateway_error, render_unexpected
from gateway.pipeline.runner import Pipeline
from gateway.respond import OPENAI, WireFormat, whole
from gateway.routes.openai import openai_context
from gateway.settings import Settings
from policies.domain import Principal
from policies.errors import LimitExceeded, PolicyError, StoreUnavailable
from policies.priority import HEADER as PRIORITY_HEADER

log = logging.getLogger(__name__)

# Headers of the request that created an Anthropic job that its lines carry (the API version an
# upstream serving Messages natively is asked for).
KEPT_HEADERS = ("anthropic-version", "anthropic-beta")
_OPERATIONS: dict[str, WireOperation] = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                                          "/v1/embeddings": "embeddings"}


class Deferred(Exception):
    """The line was refused admission (a rate limit or budget of its tenant): nothing was held or
    metered, and it runs again after `retry_after` seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(retry_after)
        self.retry_after = retry_after


@dataclass(slots=True)
class Done:
    """A line's answer: its state, the result to record, and what completes its context afterwards."""

    state: str  # succeeded | errored
    result: bytes  # {status_code, request_id, body}
    ctx: RequestContext | None = None  # None: refused before it entered the pipeline
    outcome: Outcome | None = None


class LineRunner:
    """Answers lines through one gateway's pipeline."""

    def __init__(self, pipeline: Pipeline, settings: Settings) -> None:
        self.pipeline = pipeline
        self.settings = settings

    def caller(self, job: Job, line: PendingLine) -> Caller:
        headers = CIMultiDict(job.headers)
        headers[PRIORITY_HEADER] = "batch"
        return Caller(request_id=line.line_id, principal=Principal(tenant=job.tenant, app=job.app, key_id=job.key_id),
                      headers=CIMultiDictProxy(headers), received_at=time.perf_counter(), settings=self.settings)

    async def _context(self, caller: Caller, line: PendingLine) -> tuple[RequestContext, WireFormat]:
        body = protocol.parse_body(line.body, self.settings.server.max_items)
        if line.url == MESSAGES_URL:
            return messages.message_context(caller, body), messages.WIRE
        if line.url == "/v1/responses":
            store = self.pipeline.services.responses
            if store is None:
                raise StoreFailed("the response store is not running")
            body["store"] = False  # a batch line's response is in the output file, not kept for GET
            req = protocol.check(ResponsesRequest, body)
            return await response_context(caller, req, body, store)
        return openai_context(caller, _OPERATIONS[line.url], body), OPENAI

    async def run(self, job: Job, line: PendingLine) -> Done:
        """Answer one line; raises Deferred when its tenant's limits refuse it for now."""
        anthropic = job.api == "anthropic"
        caller = self.caller(job, line)
        try:
            ctx, wire = await self._context(caller, line)
        except (GatewayError, PolicyError) as exc:
            return _errored(caller.request_id, as_gateway_error(exc) or render_unexpected(exc), anthropic)
        ctx.priority = "batch"
        try:
            answer = await self.pipeline.answer(ctx)
            if answer.chunks is not None:
                answer = await _whole(answer)
            shown, outcome = await whole(ctx, answer, wire)
        except (LimitExceeded, StoreUnavailable) as exc:
            # admission refused it (the budget stage): nothing is reserved, so nothing to complete
            raise Deferred(exc.retry_after or 1.0) from None
        except (RateLimited, Overloaded) as exc:
            # a busy upstream (flow control's upstream_busy, a provider's 429) or a full edge queue: the
            # line waits and runs again; what admission reserved is given back, and nothing is metered
            self._release(ctx)
            raise Deferred(exc.retry_after or 1.0) from None
        except (GatewayError, PolicyError) as exc:
            err = as_gateway_error(exc) or render_unexpected(exc)
            done = _errored(ctx.request_id, err, anthropic)
            done.ctx, done.outcome = ctx, Outcome(status=err.status, response=None, complete=False,
                                                  error_code=err.code or err.type)
            return done
        except asyncio.CancelledError:
            self._release(ctx)  # shutting down: the line stays pending and runs again (not completed, not metered)
            raise
        except Exception as exc:
            log.exception("batch line %s of %s failed", line.custom_id, job.id)
            err = render_unexpected(exc)
            done = _errored(ctx.request_id, err, anthropic)
            done.ctx, done.outcome = ctx, Outcome(status=err.status, response=None, complete=False,
                                                  error_code=err.code or err.type)
            return done
        if answer.status == 200:
            state, body = "succeeded", shown
        else:
            state, body = "errored", _error_body(shown, answer.status, anthropic)
        result = orjson.dumps({"status_code": answer.status, "request_id": ctx.request_id, "body": body})
        return Done(state, result, ctx, outcome)


    def _release(self, ctx: RequestContext) -> None:
        telemetry = self.pipeline.services.telemetry
        if telemetry is not None:
            telemetry.release(ctx)


async def _whole(answer: Answer) -> Answer:
    """A streamed answer gathered whole (a lane that streams though the line did not ask to)."""
    assert answer.chunks is not None
    assembler = StreamAssembler()
    async for chunk in answer.chunks:
        assembler.add(chunk)
    return Answer(lane=answer.lane, body=assembler.response(), status=answer.status, headers=answer.headers)


def _errored(request_id: str, err: GatewayError, anthropic: bool) -> Done:
    body = messages.error_payload(err) if anthropic else err.payload()
    return Done("errored", orjson.dumps({"status_code": err.status, "request_id": request_id, "body": body}))


def _error_body(shown: dict[str, Any], status: int, anthropic: bool) -> dict[str, Any]:
    """An upstream's error answer, in Anthropic's error shape for a Messages line."""
    if not anthropic or shown.get("type") == "error":
        return shown
    error = shown.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    err = GatewayError(str(message or f"the upstream answered with status {status}"), status=status)
    return messages.error_payload(err)
