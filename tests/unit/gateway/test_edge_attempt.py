"""One place per decision: the edge lane streams engine events and the request's EdgeAttempt decides,
once before decoding (`plan`), once per engine event (`on_event`) and once at the end (`on_end`).

A scripted engine stands in for the real one (the integration tests run the real engine); the
attempt is the cascade's own, over a judge whose calibration scores every answer the same.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from edge_engine import GenerationEvent, TokenInfo
from gateway.cascade import EdgeAttempt, EdgeJudge, Escalate
from gateway.context import RequestContext
from gateway.lanes import edge as edge_lane
from gateway.protocol import validate
from policies.domain import Principal

PROMPT_TOKENS = 7


def events(n: int, finish: str = "stop") -> list[GenerationEvent]:
    """`n` events of one token each, the last one finished."""
    return [GenerationEvent(text=f"t{i} ", completion_tokens=i + 1, prompt_tokens=PROMPT_TOKENS,
                            finish_reason=finish if i == n - 1 else None,
                            tokens=(TokenInfo(token=i, piece=f"t{i} ".encode(), logprob=-0.1, entropy=0.1),))
            for i in range(n)]


class Generation:
    def __init__(self, script: list[GenerationEvent], delay_s: float) -> None:
        self.script = list(script)
        self.delay_s = delay_s
        self.prompt_tokens = PROMPT_TOKENS
        self.cancelled = False

    async def __anext__(self) -> GenerationEvent:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if not self.script:
            raise StopAsyncIteration
        return self.script.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    """What the edge lane uses of an EdgeEngine, answering from a script."""

    model_name = "scripted"
    n_ctx = 0

    def __init__(self, script: list[GenerationEvent], *, delay_s: float = 0.0, expected_s: float | None = None) -> None:
        self.settings = SimpleNamespace(default_max_tokens=256)
        self.script, self.delay_s, self.expected_s = script, delay_s, expected_s
        self.params: Any = None
        self.generation: Generation | None = None

    async def submit(self, **kwargs: Any) -> Generation:
        self.params = kwargs["params"]
        self.generation = Generation(self.script, self.delay_s)
        return self.generation

    def expected_seconds(self, prompt_tokens: int, output_tokens: int) -> float | None:
        return self.expected_s


class Spy:
    """The attempt as the lane sees it: every attribute the lane reads is counted."""

    def __init__(self, attempt: EdgeAttempt) -> None:
        self._attempt = attempt
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        self.calls[name] += 1
        return getattr(self._attempt, name)


def judge(confidence: float, *, escalate: bool = True, hold_tokens: int = 4, early_check_tokens: int = 6,
          deadline_slack: float = 0.0) -> EdgeJudge:
    calibration: Any = SimpleNamespace(confidence=lambda prior, tokens, finish: confidence)
    return EdgeJudge(calibration=calibration, prior=0.5, threshold=0.5, escalate=escalate, hold_tokens=hold_tokens,
                     early_check_tokens=early_check_tokens, low_confidence_run=3, low_confidence_logprob=-5.0,
                     deadline_slack=deadline_slack)


def context(stream: bool) -> RequestContext:
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "stream": stream}
    ctx = RequestContext(request_id="r", operation="chat", body=body, headers={}, principal=Principal(tenant="t", app="a"),
                         model="auto", stream=stream, lane="edge", fallback=("pool", "big"))
    ctx.request = validate("chat", body, max_n=1)
    return ctx


async def run(engine: Engine, ctx: RequestContext, spy: Spy) -> Any:
    answer = await edge_lane.answer(engine, ctx, spy)  # type: ignore[arg-type]
    if answer.chunks is not None:
        return [chunk async for chunk in answer.chunks]
    return answer.body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 3, 10])
async def test_each_engine_event_is_judged_once_and_the_answer_once_at_its_end(stream: bool, n: int) -> None:
    engine, ctx = Engine(events(n)), context(stream)
    spy = Spy(EdgeAttempt(judge(0.9), stream=stream))
    await run(engine, ctx, spy)
    assert spy.calls == {"plan": 1, "on_event": n, "on_end": 1}
    assert ctx.edge_check is not None and ctx.edge_check.passed
    # the judge's engine parameters reached the engine: the degeneration stop of an answer that may be escalated
    assert (engine.params.low_confidence_run, engine.params.low_confidence_logprob) == (3, -5.0)


@pytest.mark.parametrize("stream", [False, True])
async def test_without_a_judge_the_lane_still_asks_its_attempt_and_records_no_check(stream: bool) -> None:
    engine, ctx = Engine(events(5)), context(stream)
    spy = Spy(EdgeAttempt(None, stream=stream))
    await run(engine, ctx, spy)
    assert spy.calls == {"plan": 1, "on_event": 5, "on_end": 1}
    assert ctx.edge_check is None and engine.params.low_confidence_run == 0


@pytest.mark.parametrize(("stream", "checked_at"), [(False, 6), (True, 4)])
async def test_a_failed_early_check_escalates_at_its_event_without_decoding_the_rest(stream: bool, checked_at: int) -> None:
    engine, ctx = Engine(events(20)), context(stream)
    spy = Spy(EdgeAttempt(judge(0.1), stream=stream))
    with pytest.raises(Escalate) as raised:
        await run(engine, ctx, spy)
    assert spy.calls == {"plan": 1, "on_event": checked_at}
    check = raised.value.check
    assert check is ctx.edge_check and check.escalated and check.reason == "low_confidence"
    assert (check.edge_input_tokens, check.edge_output_tokens) == (PROMPT_TOKENS, checked_at)
    assert engine.generation is not None and engine.generation.cancelled


async def test_a_stream_sends_nothing_before_its_check_then_everything() -> None:
    engine, ctx = Engine(events(8)), context(True)
    spy = Spy(EdgeAttempt(judge(0.9), stream=True))
    chunks = await run(engine, ctx, spy)
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    assert text == "".join(f"t{i} " for i in range(8))
    assert spy.calls == {"plan": 1, "on_event": 8, "on_end": 1}


async def test_a_pinned_answer_is_judged_at_its_end_only_and_never_escalated() -> None:
    engine, ctx = Engine(events(10)), context(False)
    spy = Spy(EdgeAttempt(judge(0.1, escalate=False), stream=False))
    await run(engine, ctx, spy)
    assert spy.calls == {"plan": 1, "on_event": 10, "on_end": 1}
    check = ctx.edge_check
    assert check is not None and not check.passed and not check.escalated
    assert engine.params.low_confidence_run == 0  # no degeneration stop: the answer is served whatever it scores


async def test_an_attempt_past_its_deadline_is_escalated_by_one_decision() -> None:
    engine, ctx = Engine(events(10), delay_s=0.05, expected_s=0.01), context(False)
    spy = Spy(EdgeAttempt(judge(0.9, deadline_slack=1.0), stream=False))
    with pytest.raises(Escalate) as raised:
        await run(engine, ctx, spy)
    assert spy.calls == {"plan": 1, "on_deadline": 1}
    check = raised.value.check
    assert check.reason == "deadline" and check.confidence is None and check.escalated
    assert (check.edge_input_tokens, check.edge_output_tokens) == (PROMPT_TOKENS, 0)
