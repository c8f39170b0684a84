"""The confidence cascade: an edge answer to an `auto` request is kept only when it is likely right.

Before generation the calibration's prior for the prompt decides whether the edge is tried at
all (route stage); after generation (or after the first `hold_tokens` of a stream) the answer's
token confidence decides whether it is served or escalated upstream. Both thresholds come from
the calibration of the configured edge model and the tenant's `cascade` policy.

Every decision about one edge answer is made here, by its `EdgeAttempt`: the edge lane only runs
the engine and applies what the attempt says, once before decoding (`plan`), once per engine
event (`on_event`, or `on_deadline` when the attempt ran out of time) and once at the end
(`on_end`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from edge_engine import TokenInfo
from gateway.context import RequestContext, request_prompt
from policies.cascade import CascadePolicy, CascadeSection, CascadeTarget
from policies.domain import EdgeCheck
from policies.edge_feedback import EdgeFeedback, FeedbackSettings, Gate
from policies.edge_quality.model import EdgeCalibration
from policies.policy import Policy
from policies.router.features import last_user_text

if TYPE_CHECKING:
    from edge_engine import EdgeEngine, GenerationEvent, SamplingParams
    from gateway.edge_calibration import BackgroundCalibration, EdgeCalibrationStatus

log = logging.getLogger(__name__)

CALIBRATED_TOKENS = 48  # when a calibration does not say how long the answers it scored were
DEGENERATE = frozenset({"loop", "low_confidence"})  # engine finish reasons of a degeneration stop


class _Running(Protocol):
    """What `after_start` needs of the started services."""

    @property
    def engine(self) -> EdgeEngine | None: ...


class Escalate(Exception):
    """The edge answer failed its check before anything was sent: the request goes upstream."""

    def __init__(self, check: EdgeCheck) -> None:
        super().__init__(check.reason)
        self.check = check


@dataclass(slots=True, frozen=True)
class EdgeJudge:
    """The check of one request's edge answer."""

    calibration: EdgeCalibration
    prior: float
    threshold: float
    escalate: bool  # False: the answer is served whatever it scores (pinned requests)
    hold_tokens: int  # streams: judged after this many tokens, before the first byte
    # whole answers: judged after this many tokens if still running (the calibration's own
    # max_tokens: it scored nothing longer, so a longer answer is judged on that much)
    early_check_tokens: int
    low_confidence_run: int
    low_confidence_logprob: float
    deadline_slack: float = 0.0  # 0: no deadline for the attempt
    deadline_min_s: float = 0.0

    def check(self, tokens: Sequence[TokenInfo], finish_reason: str | None, *, final: bool,
              served: bool = False, structured: bool = False) -> EdgeCheck:
        """`structured`: the answer was constrained to JSON; cut short by max_tokens it does not parse."""
        if finish_reason in DEGENERATE:
            confidence, reason = 0.0, str(finish_reason)
        elif structured and finish_reason == "length":
            confidence, reason = 0.0, "invalid_json"
        else:
            # a stream's held-back tokens are judged as an answer so far (no finish reason yet)
            confidence = float(self.calibration.confidence(self.prior, tokens, finish_reason or "stop"))
            reason = "low_confidence"
        passed = confidence >= self.threshold
        return EdgeCheck(
            confidence=round(confidence, 4),
            threshold=round(self.threshold, 4),
            passed=passed,
            escalated=self.escalate and not passed and not served,
            reason="" if passed else reason,
        )


@dataclass(slots=True, frozen=True)
class Decision:
    """What the lane does after one event of an edge attempt.

    `continue`: keep decoding, sending nothing yet (a stream already released keeps sending);
    `release`: a stream sends what it held and the rest as it comes; `escalate`: stop decoding,
    the request goes upstream with `check`. A decision with a `check` is recorded on the request
    (ctx.edge_check), and it ends the attempt's deadline: the deadline bounds the wait for the check.
    """

    action: Literal["continue", "release", "escalate"] = "continue"
    check: EdgeCheck | None = None


CONTINUE = Decision()
RELEASE = Decision("release")


@dataclass(slots=True, frozen=True)
class AttemptPlan:
    """What an attempt asks of the engine before it starts: its sampling and its deadline."""

    params: SamplingParams
    # the tokens the deadline covers (the check's, or the whole answer's); 0: no deadline
    deadline_tokens: int = 0
    deadline_slack: float = 0.0
    deadline_min_s: float = 0.0

    def deadline_s(self, expected_s: float | None) -> float | None:
        """Seconds the attempt may take before its check, given what `deadline_tokens` take on the engine alone."""
        if not self.deadline_tokens or self.deadline_slack <= 0 or expected_s is None:
            return None
        return self.deadline_min_s + self.deadline_slack * expected_s


class EdgeAttempt:
    """The decisions of one request's edge answer, made as its engine events come.

    Without a judge (no cascade for the request) nothing is checked: a stream is released at its
    first event and a whole answer is served when it ends. A judge that may escalate (the request
    has a fallback) sets the engine's degeneration stop and a deadline, and checks the answer
    after its first tokens (a stream's `hold_tokens`, before its first byte; a whole answer's
    `early_check_tokens`, if still running) and at its end; a pinned request's answer is checked
    at its end only, for the record and the cache.
    """

    __slots__ = ("_checked", "_released_at", "_structured", "judge", "stream", "hold")

    def __init__(self, judge: EdgeJudge | None, *, stream: bool) -> None:
        self.judge = judge
        self.stream = stream
        self.hold = 0  # tokens held before the early check (0: none)
        if judge is not None and judge.escalate:
            self.hold = judge.hold_tokens if stream else judge.early_check_tokens
        self._checked = False  # the early check ran (and passed)
        self._released_at: int | None = None  # a stream's tokens when it was released
        self._structured = False

    def plan(self, params: SamplingParams, default_max_tokens: int) -> AttemptPlan:
        """The engine's parameters (`params` with the degeneration stop where the answer may be escalated) and the deadline."""
        judge = self.judge
        self._structured = params.grammar is not None
        if judge is None or not judge.escalate:
            return AttemptPlan(params=params)
        params = replace(params, low_confidence_run=judge.low_confidence_run,
                         low_confidence_logprob=judge.low_confidence_logprob)
        # until the check: `hold` tokens, or the whole answer where nothing is checked early
        until = self.hold or params.max_tokens or default_max_tokens
        return AttemptPlan(params=params, deadline_tokens=until, deadline_slack=judge.deadline_slack,
                           deadline_min_s=judge.deadline_min_s)

    def on_event(self, event: GenerationEvent, tokens: Sequence[TokenInfo]) -> Decision:
        """The decision after one engine event; `tokens`: the answer's tokens so far, this event's included."""
        if self._released_at is not None:
            return CONTINUE  # sent already: judged at its end, for the record and the cache
        if event.finish_reason is not None:
            return CONTINUE  # judged by on_end
        if self.hold and not self._checked and event.completion_tokens >= self.hold:
            assert self.judge is not None
            self._checked = True
            check = self.judge.check(tokens, None, final=False, structured=self._structured)
            if check.escalated:
                return Decision("escalate", check)
            if self.stream:
                self._released_at = len(tokens)
                return Decision("release", check)
            return Decision("continue", check)
        if self.stream and not self.hold:
            self._released_at = len(tokens)
            return RELEASE  # no hold-back: the answer is judged when it ends, for the record and the cache
        return CONTINUE

    def on_deadline(self) -> Decision:
        """The attempt is past its deadline before its check: a queue or a slow engine must not make
        the request wait for an answer that may still fail its check."""
        assert self.judge is not None
        return Decision("escalate", EdgeCheck(confidence=None, threshold=self.judge.threshold, passed=False,
                                              escalated=True, reason="deadline"))

    def on_end(self, tokens: Sequence[TokenInfo], finish_reason: str | None) -> Decision:
        """The decision on the whole answer once its last event came; `tokens`: all of its tokens."""
        judge = self.judge
        if judge is None:
            return CONTINUE
        if self._released_at is None:
            check = judge.check(tokens, finish_reason, final=True, structured=self._structured)
            return Decision("escalate" if check.escalated else "continue", check)
        if len(tokens) > self._released_at:
            # the whole answer's confidence decides what the cache may keep (it was served already)
            return Decision(check=judge.check(tokens, finish_reason, final=True, served=True,
                                              structured=self._structured))
        return CONTINUE


class Cascade:
    """Builds each request's judge from the policy and the calibration artifact."""

    def __init__(self, policy: Policy, calibration: EdgeCalibration | None,
                 status: EdgeCalibrationStatus | None = None) -> None:
        self.policy = CascadePolicy(policy)
        # None: the edge model has no calibration of its own (yet): it takes no `auto` traffic
        self.calibration = calibration
        self.status = status  # what /readyz says of it (None: not looked up, e.g. a cascade built in a test)
        self.background: BackgroundCalibration | None = None  # edge.calibrate_on_start, while there is none
        self.feedback = EdgeFeedback()

    @property
    def calibrated(self) -> bool:
        """Whether the edge model has its own calibration, so `auto` traffic may be sent to it."""
        return self.calibration is not None

    def take_calibration(self, calibration: EdgeCalibration) -> None:
        """A calibration made while running: the edge decision and checks use it from the next request on."""
        self.calibration = calibration

    async def after_start(self, services: _Running) -> None:
        """Once every component runs: the background calibration starts on the serving engine."""
        if self.background is not None and services.engine is not None:
            self.background.start(services.engine)

    async def close(self) -> None:
        if self.background is not None:
            await self.background.close()

    def rules(self, ctx: RequestContext) -> CascadeSection:
        return self.policy.rules(ctx.principal.tenant, ctx.principal.app)

    def decides_edge(self, ctx: RequestContext) -> bool:
        """Whether the calibration (not the router) decides edge vs upstream for this `auto` request."""
        rules = self.rules(ctx)
        return self.calibration is not None and rules.enabled and rules.edge_decision == "calibration"

    @staticmethod
    def _learn(rules: CascadeSection) -> FeedbackSettings | None:
        learn = rules.learn
        if not learn.enabled:
            return None
        return FeedbackSettings(
            enabled=True, memory=learn.memory, neighbours=learn.neighbours, min_neighbours=learn.min_neighbours,
            similarity=learn.similarity, escalated_share=learn.escalated_share, window=learn.window,
            step=learn.step, explore_every=learn.explore_every,
        )

    def learned_gate(self, ctx: RequestContext, embedding: Any, prior: float, threshold: float) -> Gate | None:
        """What the verdicts so far say of a prompt the calibration lets onto the edge (None: learning off)."""
        settings = self._learn(self.rules(ctx))
        if settings is None:
            return None
        key = (ctx.principal.tenant, ctx.principal.app)
        return self.feedback.gate(key, np.asarray(embedding, dtype=np.float32), prior, threshold, settings)

    def observe(self, ctx: RequestContext, saved_edge: float) -> None:
        """Learn from a finished `auto` request that tried the edge: kept or escalated, and its edge saving."""
        check = ctx.edge_check
        if not ctx.auto or ctx.embedding is None or check is None:
            return
        tried = check.escalated or (ctx.lane == "edge" and ctx.route is not None and ctx.route.reason == "calibration_edge")
        settings = self._learn(self.rules(ctx))
        if not tried or settings is None:
            return
        key = (ctx.principal.tenant, ctx.principal.app)
        threshold = self.prior_threshold(ctx) if ctx.edge_prior is not None else None
        self.feedback.record(key, np.asarray(ctx.embedding, dtype=np.float32), check.escalated, saved_edge, settings,
                             prior=ctx.edge_prior, threshold=threshold)

    def prior_threshold(self, ctx: RequestContext) -> float:
        return self._threshold("prior", self.rules(ctx).prior)

    def _calibrated_tokens(self) -> int:
        assert self.calibration is not None
        decoding = self.calibration.manifest.get("decoding") or {}
        value = decoding.get("max_tokens") if isinstance(decoding, dict) else None
        return value if isinstance(value, int) and value > 0 else CALIBRATED_TOKENS

    def _threshold(self, stage: Literal["prior", "confidence"], target: CascadeTarget) -> float:
        assert self.calibration is not None
        if target.mode == "threshold":
            return target.value
        return float(self.calibration.threshold(stage, target.mode, target.value))

    def prior(self, text: str, embedding: Any) -> float:
        assert self.calibration is not None
        return float(self.calibration.prior(text, np.asarray(embedding, dtype=np.float32)))

    def judge_for(self, ctx: RequestContext) -> EdgeJudge | None:
        """The judge of an edge answer; None when the cascade is off for this tenant/app or uncalibrated."""
        if self.calibration is None or ctx.operation not in ("chat", "completions"):
            return None
        rules = self.rules(ctx)
        if not rules.enabled:
            return None
        prior = ctx.edge_prior
        if prior is None:
            if ctx.embedding is None:
                return None  # nothing to judge with (no embedding was computed for this request)
            prior = self.prior(_last_text(ctx), ctx.embedding)
        return EdgeJudge(
            calibration=self.calibration,
            prior=prior,
            threshold=self._threshold("confidence", rules.target),
            escalate=ctx.fallback is not None,
            hold_tokens=rules.hold_tokens,
            early_check_tokens=self._calibrated_tokens(),
            low_confidence_run=rules.low_confidence_run,
            low_confidence_logprob=rules.low_confidence_logprob,
            deadline_slack=rules.deadline_slack,
            deadline_min_s=rules.deadline_min_s,
        )


    def attempt_for(self, ctx: RequestContext) -> EdgeAttempt | None:
        """The decisions of the request's edge answer; None when nothing judges it (see judge_for)."""
        judge = self.judge_for(ctx)
        return None if judge is None else EdgeAttempt(judge, stream=ctx.stream)


def _last_text(ctx: RequestContext) -> str:
    return last_user_text(request_prompt(ctx))
