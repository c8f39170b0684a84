"""The `pools.<name>.flow` settings: how long and how many requests of each class wait for a busy member."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_WAIT = ("a request of this class waiting longer than this for a member is answered 429 (code upstream_busy) with "
         "Retry-After")
_QUEUED = "requests of this class waiting in the pool at most; one more is answered 429 at once (0: never waits)"
_RETRY = "the Retry-After a refusal of this class states"


class ClassFlow(_Strict):
    """One priority class's queue in a pool: the interactive one's defaults."""

    max_wait_s: float = Field(30.0, gt=0, description=_WAIT)
    max_queued: int = Field(256, ge=0, description=_QUEUED)
    retry_after_s: float = Field(2.0, ge=0, description=_RETRY)


class StandardFlow(ClassFlow):
    """The standard class's queue."""

    max_wait_s: float = Field(120.0, gt=0, description=_WAIT)
    max_queued: int = Field(512, ge=0, description=_QUEUED)
    retry_after_s: float = Field(10.0, ge=0, description=_RETRY)


class BatchFlow(ClassFlow):
    """The batch class's queue."""

    max_wait_s: float = Field(600.0, gt=0, description=_WAIT)
    max_queued: int = Field(1024, ge=0, description=_QUEUED)
    retry_after_s: float = Field(30.0, ge=0, description=_RETRY)


class FlowSettings(_Strict):
    """Flow control of a pool's members: requests past a member's concurrency budget wait here, by class.

    A member has a budget where `upstreams[].max_concurrency` sets one, or where its scraped
    metrics (`metrics_url`) have shown it saturated; elsewhere nothing waits."""

    from_metrics: bool = Field(
        True, description="a member whose scraped metrics show it queueing requests (vLLM waiting, llama.cpp deferred) "
        "or its KV cache at kv_saturated gets a budget of the requests it was running then, raised by one each reading "
        "that shows it keeping up; the gateway then holds the rest in its queues, by class, instead of the server")
    kv_saturated: float = Field(0.95, gt=0, le=1.0, description="scraped KV-cache use (0..1) at which a member counts "
                                "as saturated")
    interactive_headroom: int = Field(
        1, ge=0, description="the fewest free slots of a member batch requests leave while interactive or standard "
        "traffic is present there (see headroom_idle_s); the adaptive reserve (headroom_miss) may keep more; at most the "
        "member's budget less one, so a member of budget 1 still serves batch when idle")
    headroom_miss: float = Field(
        0.01, gt=0, lt=1, description="the adaptive reserve while interactive or standard traffic is present: the free "
        "slots batch leaves are the fewest that the interactive and standard requests expected to arrive at the member "
        "before its next slot frees exceed with at most this probability (a Poisson tail; their rate over "
        "headroom_window_s, the horizon the member's mean slot time over its budget)")
    headroom_window_s: float = Field(
        30.0, gt=0, description="the span over which a member's interactive and standard arrival rate is counted for "
        "the adaptive reserve")
    headroom_idle_s: float | None = Field(
        2.0, ge=0, description="a member with no interactive or standard request in flight or waiting, and none "
        "arrived or ended there for this long, keeps no reserve: batch may take all its slots (the next interactive "
        "arrival waits at most for one of them to end); null keeps the reserve always")
    standard_promote_after_s: float = Field(
        10.0, ge=0, description="a standard request waiting this long is served as an interactive one that came when it "
        "did: a steady interactive stream never starves it")
    max_queued: int = Field(1024, ge=0, description="requests waiting in the pool at most, all classes together; when "
                            "full, an arrival sheds the newest waiting batch request, then standard, before it is refused")
    max_queued_per_tenant: int = Field(256, ge=0, description="requests one tenant may have waiting in the pool")
    interactive: ClassFlow = Field(default_factory=ClassFlow, description="interactive requests' queue")
    standard: StandardFlow = Field(default_factory=StandardFlow, description="standard requests' queue")
    batch: BatchFlow = Field(default_factory=BatchFlow, description="batch requests' queue")

    def of(self, priority: str) -> ClassFlow:
        """The queue settings of a class."""
        return self.standard if priority == "standard" else self.batch if priority == "batch" else self.interactive
