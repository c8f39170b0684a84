"""Pipeline stage: a learned template's request answered by its adapter, once the template's gate serves.

After routing (so lane policy and permissions are enforced first) and before trimming (the
adapter was trained on the request as the app sends it). For a chat request of an enabled
template (policies/learn/templates.py) with an artifact for its current definition:

- the template's gate is `shadow` or `suspended`: nothing here; the request goes on, and the
  completion hooks give the upstream's answer to the shadow judge (gateway/pipeline/learn_collect.py);
- it is `serving`: the adapter answers at interactive priority; an answer at or above the
  artifact's confidence threshold is the client's (lane `edge`, route reason `learned_template`),
  and a sampled share of them is re-asked upstream by the shadow hook to hold the bound online;
  an answer below it, or a request the adapter cannot answer as asked, goes on upstream.

What is never answered locally: a request forcing a lane (x-tierlane-route), tools, several
choices, log-probabilities, a response_format, an output bound shorter than the answer.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edge_engine.errors import EngineBusy
from edge_engine.sampling import Priority
from gateway.context import Answer, RequestContext, Usage
from gateway.lanes import FORCEABLE
from gateway.pipeline.learn_collect import TEMPLATE_HEADER, request_messages
from policies.cache.replay import replay_chunks
from policies.domain import RouteDecision
from policies.learn.service import Learning
from policies.learn.serving import Choice, LearnedServing, Local

if TYPE_CHECKING:
    from gateway.services import Services

log = logging.getLogger(__name__)
REASON = "learned_template"
_UNSERVABLE = ("tools", "functions", "tool_choice", "function_call", "logprobs", "top_logprobs", "response_format")


@dataclass(slots=True)
class LearnedRequest:
    """A request of a template with an artifact: what the hooks judge it by."""

    choice: Choice
    served: str | None = None  # the local answer the client got
    recheck: bool = False  # re-ask the upstream and judge the served answer (shadow hook)


def unservable(body: dict[str, Any], output_limit: int | None) -> str | None:
    """Why the adapter cannot answer this request as asked (None: it can)."""
    for key in _UNSERVABLE:
        if body.get(key) not in (None, False, [], {}):
            return key
    n = body.get("n")
    if n not in (None, 1):
        return "n"
    if output_limit is not None and output_limit < 1:
        return "max_tokens"
    return None


def chat_body(text: str, model: str, local: Local) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-learned-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": local.prompt_tokens,
            "completion_tokens": local.completion_tokens,
            "total_tokens": local.prompt_tokens + local.completion_tokens,
        },  # fmt: skip
    }


class LearnedStage:
    """Answers a serving template's confident requests with its adapter."""

    name = "learned"
    operations = frozenset({"chat"})

    def __init__(self, learning: Learning, serving: LearnedServing) -> None:
        self.learning = learning
        self.serving = serving
        self.counts: dict[str, int] = {}  # decisions on serving templates' requests, by outcome

    def _count(self, ctx: RequestContext, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        ctx.attributes["tierlane.learn.decision"] = outcome

    async def run(self, ctx: RequestContext) -> Answer | None:
        if ctx.operation != "chat" or ctx.requested_route in FORCEABLE:
            return None
        tenant, app = ctx.principal.tenant, ctx.principal.app
        templates = self.learning.policy.for_app(tenant, app).templates
        if not templates:
            return None
        messages = request_messages(ctx.body)
        match = templates.match(messages, ctx.header(TEMPLATE_HEADER))
        if match is None:
            return None
        choice = self.serving.choice(tenant, app, match.template.name, match.template.version)
        if choice is None:
            return None
        learned = ctx.learned = LearnedRequest(choice)
        ctx.attributes["tierlane.learn.template"] = match.template.name
        ctx.attributes["tierlane.learn.state"] = choice.gate.state
        if not choice.gate.serves:
            return None
        limit = ctx.request.output_limit if ctx.request is not None else None
        why = unservable(ctx.body, limit)
        if why is not None:
            self._count(ctx, f"unservable_{why}")
            return None
        started = time.perf_counter()
        try:
            local = await self.serving.answer(choice, messages, Priority.INTERACTIVE)
        except EngineBusy:
            self._count(ctx, "busy")
            return None
        except Exception as exc:  # noqa: BLE001 - an adapter that fails (a damaged file, a failed decode): the upstream answers
            self._count(ctx, "failed")
            log.warning("learned template %s: the adapter failed, the upstream answers request %s: %s",
                        match.template.name, ctx.request_id, exc)  # fmt: skip
            return None
        if local is None or not local.confident or (limit is not None and local.completion_tokens > limit):
            choice.gate.count("declined")
            self._count(ctx, "declined" if local is not None else "too_long")
            return None
        choice.gate.count("served")
        self._count(ctx, "served")
        learned.served = local.text
        learned.recheck = self.serving.wants_recheck(tenant, app)
        ctx.lane = "edge"
        ctx.lane_seconds = time.perf_counter() - started
        ctx.route = RouteDecision("edge", local.confidence, REASON, choice.threshold)
        model = f"learned:{match.template.name}@{choice.artifact.name}"
        ctx.target_model = model
        ctx.usage = Usage(input_tokens=local.prompt_tokens, output_tokens=local.completion_tokens)
        ctx.attributes["tierlane.learn.confidence"] = local.confidence
        body = chat_body(local.text, model, local)
        headers = {"x-tierlane-learned": match.template.name}
        if ctx.stream:
            include_usage = ctx.request is not None and ctx.request.include_usage
            return Answer(lane="edge", chunks=replay_chunks(body, include_usage=include_usage), headers=headers)
        return Answer(lane="edge", body=body, headers=headers)

    async def close(self) -> None:
        return None  # the learning component closes the adapters, after the pipeline


def build(services: Services) -> LearnedStage | None:
    learn = services.learn
    if learn is None or learn.serving is None:
        return None
    return LearnedStage(learn, learn.serving)
