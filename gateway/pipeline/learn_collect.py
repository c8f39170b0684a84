"""Completion hook: keep the upstream's answers to the learned templates an operator enabled (policy `learn`).

A request of a tenant/app without templates costs one dict lookup here. A matched one is kept
when an upstream answered it whole (status 200, complete) and the answer passes
policies.learn.admission; the pair is queued for the store's writer thread, never written here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.context import Outcome, RequestContext
from policies.learn.admission import answer_text
from policies.learn.service import Answered, Learning

if TYPE_CHECKING:
    from gateway.services import Services

log = logging.getLogger(__name__)

# Names the template of a request; honoured only for a template enabled for the caller's
# tenant/app, any other value is ignored (the request is matched as if it had none).
TEMPLATE_HEADER = "x-tierlane-template"


def request_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages, or a completions prompt as one user message."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return [m for m in messages if isinstance(m, dict)]
    prompt = body.get("prompt")
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else []


class LearnCollectHook:
    """Runs after the client has its answer; never raises."""

    name = "learn_collect"

    def __init__(self, learning: Learning) -> None:
        self._learning = learning

    async def on_complete(self, ctx: RequestContext, outcome: Outcome) -> None:
        try:
            self._collect(ctx, outcome)
        except Exception:  # collection is best effort: the client already has its answer
            log.exception("learning from request %s failed", ctx.request_id)

    def _collect(self, ctx: RequestContext, outcome: Outcome) -> None:
        if ctx.operation not in ("chat", "completions"):
            return
        tenant, app = ctx.principal.tenant, ctx.principal.app
        templates = self._learning.policy.for_app(tenant, app).templates
        if not templates:
            return
        messages = request_messages(ctx.body)
        match = templates.match(messages, ctx.header(TEMPLATE_HEADER))
        if match is None:
            return
        if ctx.lane != "upstream":  # a cache hit or an edge answer teaches the edge nothing new
            self._learning.skip(match, tenant, app, "lane")
            return
        if outcome.status != 200 or not outcome.complete or outcome.response is None:
            self._learning.skip(match, tenant, app, "status")
            return
        response = outcome.response
        learned = ctx.learned
        serving = self._learning.serving
        if learned is not None and serving is not None:  # a template not serving: its adapter is judged beside the upstream
            text, reason = answer_text(response, outcome.finish_reasons, ctx.body.get("response_format"))
            if reason is None and text is not None:
                serving.shadow_soon(learned.choice, messages, text, tenant, app)
        usage = ctx.usage
        model = response.get("model")
        self._learning.keep(match, Answered(
            pair_id=ctx.uid, tenant=tenant, app=app, body=ctx.body, messages=messages, response=response,
            finish_reasons=outcome.finish_reasons,
            model=model if isinstance(model, str) and model else ctx.target_model or ctx.model,
            input_tokens=usage.input_tokens if usage is not None and not usage.estimated else None,
            output_tokens=usage.output_tokens if usage is not None and not usage.estimated else None,
        ))  # fmt: skip

    async def close(self) -> None:
        return None  # the learning component closes its store itself, after the pipeline


def build(services: Services) -> LearnCollectHook | None:
    return LearnCollectHook(services.learn) if services.learn is not None else None
