"""Judging (the shadow stage's re-asks) is shared fairly, bounded in prompt size, billed and pruned.

The stage is driven directly, with a fake upstream pool, a fake clock and no embedder where the
answers carry final numbers (the agreement judge decides those): no wall-time assumptions.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from gateway.context import Outcome, Principal, RequestContext
from gateway.pipeline import shadow
from gateway.services import Services
from policies.policy import Policy
from telemetry import Telemetry, TelemetryConfig
from telemetry.tokens import heuristic_count
from telemetry.usage import UsageQuery, run_query
from tests.unit.shadow.conftest import chat_answer

PRICES = {"small-8b": {"input_per_1k": 1.0, "output_per_1k": 2.0}, "big-70b": {"input_per_1k": 10.0, "output_per_1k": 20.0}}
TARGETS = {"cost": ("standard", "small-8b"), "strong": ("critical", "big-70b")}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakePool:
    """Answers every re-ask with a fixed text and usage; `hold` keeps them waiting until set."""

    def __init__(self, text: str = "The answer is 42.") -> None:
        self.text = text
        self.sent: list[dict[str, Any]] = []
        self.hold: asyncio.Event | None = None

    def has_upstreams(self) -> bool:
        return True

    def pool_names(self) -> list[str]:
        return ["standard", "critical"]

    def pool_for_model(self, model: str) -> str | None:
        return {"small-8b": "standard", "big-70b": "critical"}.get(model)

    def default_model(self, pool: str) -> str:
        return "small-8b"

    async def send(self, pool: str, path: str, body: dict[str, Any], **_: Any) -> Any:
        self.sent.append(body)
        if self.hold is not None:
            await self.hold.wait()
        answer = {**chat_answer(self.text), "usage": {"prompt_tokens": 1000, "completion_tokens": 500}}
        return SimpleNamespace(status=200, body=answer, api="chat", native=False)


class MessagesPool(FakePool):
    """A pool whose members serve only Anthropic's Messages API: the answer comes in its shape."""

    async def send(self, pool: str, path: str, body: dict[str, Any], **_: Any) -> Any:
        self.sent.append(body)
        answer = {"id": "msg_1", "type": "message", "role": "assistant", "model": "big-70b",
                  "content": [{"type": "text", "text": self.text}], "stop_reason": "end_turn",
                  "usage": {"input_tokens": 1000, "output_tokens": 500, "cache_read_input_tokens": 0}}
        return SimpleNamespace(status=200, body=answer, api="messages", native=False)


class FakeQuality:
    def __init__(self) -> None:
        self.recorded = 0
        self.bounds = SimpleNamespace(judge_spend=lambda *a, **k: None)

    async def record(self, probe: Any, *, disagree: bool) -> None:
        self.recorded += 1


class UnitEmbedder:
    async def embed(self, text: str) -> np.ndarray:
        return np.full(8, 1 / np.sqrt(8), dtype=np.float32)


def policy(**section: Any) -> Policy:
    return Policy.load(extra={"shadow": {"seed": 0, **section},
                              "pricing": {"default_upstream_model": "small-8b", "models": PRICES}})  # fmt: skip


def hook_for(tmp_path: Path, pool: FakePool, clock: FakeClock, *, telemetry: Telemetry | None = None,
             embedder: Any = None, cache: Any = None, **section: Any) -> shadow.ShadowHook:  # fmt: skip
    pol = policy(**section)
    services = Services(settings=SimpleNamespace(state_dir=tmp_path), policy=pol, pool=pool,  # type: ignore[arg-type]
                        route_quality=FakeQuality(), telemetry=telemetry, embedder=embedder, cache=cache)  # fmt: skip
    config = shadow.ShadowConfig.from_section(pol.section("shadow"))
    return shadow.ShadowHook(services, config, shadow.ShadowStore(tmp_path / shadow.FILENAME), clock=clock)


def tiered(tenant: str, n: int, content: str = "A train leaves at 3 pm at 60 km/h. When does the second catch up?") -> RequestContext:
    probe = SimpleNamespace(scope=f"{tenant}/web", region=0, params=SimpleNamespace(sample_rate=1.0), targets=TARGETS)
    return RequestContext(
        request_id=f"{tenant}-{n}", operation="chat", headers={}, principal=Principal(tenant, "web"), model="auto",
        body={"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 8},
        lane="upstream", tier="cost", quality_probe=probe,
    )


def answered(text: str = "The answer is 41.") -> Outcome:
    return Outcome(status=200, response=chat_answer(text), complete=True, finish_reasons=["stop"])


def interleaved() -> list[str]:
    """400 requests of a flooding tenant and 20 of a light one, one light request every 21."""
    return ["light" if i % 21 == 20 else "flood" for i in range(420)]


async def test_a_flooding_tenant_leaves_the_light_one_its_share_of_the_per_minute_cap(tmp_path: Path) -> None:
    pool, clock = FakePool(), FakeClock()
    hook = hook_for(tmp_path, pool, clock)  # max_per_minute 120, tenant_share 0.5 (the defaults)
    judged = {"flood": 0, "light": 0}
    for i, tenant in enumerate(interleaved()):
        before = len(pool.sent)
        await hook.on_complete(tiered(tenant, i), answered())
        await hook.drain()  # every re-ask finishes at once: only the per-minute cap limits them
        judged[tenant] += len(pool.sent) - before
        clock.now += 0.1  # all 420 within one minute
    await hook.close()
    equal_share = 120 / 2
    assert judged["light"] >= 0.4 * min(20, equal_share)  # the bench target: 40 % of an equal share
    assert judged["light"] == 20 and judged["flood"] == 60  # the flood takes its share, not the light one's
    assert sum(judged.values()) <= 120  # the gateway-wide cap is kept
    assert hook.skipped.get("tenant_per_minute") == 340 and hook.tier_skipped == 340


async def test_a_flooding_tenant_leaves_the_light_one_its_share_of_the_queue(tmp_path: Path) -> None:
    pool, clock = FakePool(), FakeClock()
    pool.hold = asyncio.Event()  # no re-ask finishes: the queue (max_pending 32) is what limits them
    hook = hook_for(tmp_path, pool, clock)
    queued = {"flood": 0, "light": 0}
    for i, tenant in enumerate(interleaved()):
        before = len(hook._tasks)
        await hook.on_complete(tiered(tenant, i), answered())
        queued[tenant] += len(hook._tasks) - before
        clock.now += 0.1
    assert queued["light"] >= 0.4 * min(20, 32 / 2)
    # alone for its first 20 requests, the flood queued them all; once the light tenant came, none more
    assert queued == {"flood": 20, "light": 12} and hook.dropped == 388
    pool.hold.set()
    await hook.close()


async def test_a_lone_tenant_may_use_the_whole_cap_and_the_cap_opens_again_a_minute_later(tmp_path: Path) -> None:
    pool, clock = FakePool(), FakeClock()
    hook = hook_for(tmp_path, pool, clock, max_per_minute=10)
    for i in range(30):
        await hook.on_complete(tiered("solo", i), answered())
        await hook.drain()
        clock.now += 0.1
    assert len(pool.sent) == 10 and hook.skipped == {"per_minute": 20}
    clock.now += 60.0
    await hook.on_complete(tiered("solo", 99), answered())
    await hook.drain()
    await hook.close()
    assert len(pool.sent) == 11


async def test_the_cache_error_bounds_re_asks_are_under_the_same_cap(tmp_path: Path) -> None:
    pool, clock = FakePool(text="Paris."), FakeClock()
    observed: list[bool] = []

    async def observe(scope: str, params: Any, entry_id: int, score: float, *, wrong: bool) -> None:
        observed.append(wrong)

    bound = SimpleNamespace(sample_rate=1.0)
    cache = SimpleNamespace(config_for=lambda **_: SimpleNamespace(bound=bound), observe=observe)
    hook = hook_for(tmp_path, pool, clock, embedder=UnitEmbedder(), cache=cache, max_per_minute=5)
    for i in range(12):
        ctx = RequestContext(
            request_id=f"hit-{i}", operation="chat", headers={}, principal=Principal("acme", "web"), model="small-8b",
            body={"model": "small-8b", "messages": [{"role": "user", "content": "Capital of France?"}]}, lane="cache",
            attributes={"tierlane.cache.exact": False, "tierlane.cache.entry_id": i, "tierlane.cache.score": 0.9},
        )  # fmt: skip
        await hook.on_complete(ctx, answered("Paris."))
        await hook.drain()
        clock.now += 1.0
    await hook.close()
    assert len(pool.sent) == 5 and len(observed) == 5 and hook.skipped == {"per_minute": 7}


async def test_a_prompt_over_max_prompt_tokens_is_skipped_never_truncated(tmp_path: Path) -> None:
    pool, clock = FakePool(), FakeClock()
    hook = hook_for(tmp_path, pool, clock, max_prompt_tokens=100)
    long_prompt = "word " * 2000  # about 2,500 tokens
    await hook.on_complete(tiered("acme", 1, content=long_prompt), answered())
    await hook.on_complete(tiered("acme", 2, content="Short question 1+1?"), answered())
    await hook.drain()
    await hook.close()
    assert hook.skipped == {"prompt_tokens": 1}
    (sent,) = pool.sent
    assert sent["messages"] == [{"role": "user", "content": "Short question 1+1?"}]


def test_settings_have_defaults_and_are_checked() -> None:
    config = shadow.ShadowConfig.from_section(policy().section("shadow"))
    assert (config.tenant_share, config.max_prompt_tokens, config.bill_judging_to, config.operator_account) == (
        0.5, 8192, "operator", "_operator")
    assert (config.max_rows, config.max_age_days) == (200_000, 30.0)
    with pytest.raises(ValueError, match="bill_judging_to"):
        shadow.ShadowConfig.from_section({"bill_judging_to": "nobody"})
    with pytest.raises(ValueError, match="tenant_share"):
        shadow.ShadowConfig.from_section({"tenant_share": 0})


async def telemetry_at(state: Path, **budgets: Any) -> Telemetry:
    pol = Policy.load(extra={"pricing": {"default_upstream_model": "small-8b", "models": PRICES},
                             **({"budgets": budgets} if budgets else {})})  # fmt: skip
    telemetry = Telemetry(TelemetryConfig(state_dir=state, tracing=False, metrics=False), pol, token_count=heuristic_count)
    await telemetry.start()
    return telemetry


def usage(telemetry: Telemetry, **filters: str) -> dict[str, Any]:
    telemetry.ledger.flush()
    rows = run_query(telemetry.ledger, UsageQuery.parse({"group_by": "tenant,app", **filters}))
    return {f"{r['tenant']}/{r['app']}": r for r in rows}


async def test_judging_spend_is_in_the_ledger_usage_and_budgets_of_the_operator_and_kept_across_restart(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    telemetry = await telemetry_at(state)
    pool, clock = FakePool(), FakeClock()
    hook = hook_for(tmp_path, pool, clock, telemetry=telemetry)
    await hook.on_complete(tiered("acme", 1), answered())
    await hook.drain()
    await hook.close()
    cost = 1000 / 1000 * 10.0 + 500 / 1000 * 20.0  # the strong tier (big-70b) was asked
    by_line = usage(telemetry)
    # the operator's own line, its app naming the judged tenant; no request counted for anyone
    assert list(by_line) == ["_operator/acme"]
    line = by_line["_operator/acme"]
    assert line["requests"] == 0 and line["cost_usd"] == 0.0
    assert (line["judge_requests"], line["judge_input_tokens"], line["judge_output_tokens"]) == (1, 1000, 500)
    assert line["judge_cost_usd"] == pytest.approx(cost)
    (row,) = telemetry.ledger.read("SELECT * FROM requests")
    assert (row["operation"], row["lane"], row["model"], row["judged_tenant"], row["judged_app"]) == (
        "judge", "judge", "big-70b", "acme", "web")
    assert row["request_id"] == "judge:acme-1"
    await telemetry.close()
    again = await telemetry_at(state, app={"daily_spend_usd": 1000.0})
    try:
        assert usage(again)["_operator/acme"]["judge_cost_usd"] == pytest.approx(cost)  # the ledger is SQLite
        assert again.budgets.spend("_operator", "acme")[0] == pytest.approx(cost)  # restored into the budgets
    finally:
        await again.close()


async def test_judging_billed_to_the_tenant_counts_in_its_budget_and_stops_at_its_limit(tmp_path: Path) -> None:
    telemetry = await telemetry_at(tmp_path / "state", tenant={"daily_spend_usd": 25.0})
    pool, clock = FakePool(), FakeClock()
    hook = hook_for(tmp_path, pool, clock, telemetry=telemetry, bill_judging_to="tenant")
    for i in range(3):  # each re-ask costs 20 USD: the second crosses the 25 USD a day, the third is refused
        await hook.on_complete(tiered("acme", i), answered())
        await hook.drain()
    await hook.close()
    try:
        line = usage(telemetry)["acme/web"]
        assert line["requests"] == 0 and line["judge_requests"] == 2
        assert hook.skipped == {"budget": 1} and len(pool.sent) == 2
        assert telemetry.budgets.spend("acme")[0] == pytest.approx(40.0)
    finally:
        await telemetry.close()


async def test_the_shadow_table_is_pruned_by_age_and_row_count(tmp_path: Path) -> None:
    now = [1_000_000.0]
    store = shadow.ShadowStore(tmp_path / shadow.FILENAME, max_rows=10, max_age_s=3600.0, prune_every=5, wall=lambda: now[0])

    def row(ts: float, i: int) -> shadow.ShadowRow:
        return shadow.ShadowRow(ts=ts, request_id=f"r{i}", tenant="acme", app="web", lane="edge", model="m", similarity=0.9)

    for i in range(5):  # written two hours ago
        await store.add(row(now[0] - 7200 - i, i))
    for i in range(5, 40):
        await store.add(row(now[0] + i, i))
    await store.close()
    conn = sqlite3.connect(tmp_path / shadow.FILENAME)
    try:
        ids = [r[0] for r in conn.execute("SELECT request_id FROM shadow ORDER BY ts")]
    finally:
        conn.close()
    assert not {f"r{i}" for i in range(5)} & set(ids)  # too old
    assert len(ids) < 10 + 5 and ids[-1] == "r39"  # the newest kept, at most max_rows + prune_every - 1
    assert store.pruned == 40 - len(ids)


def test_the_fleet_totals_count_a_judge_row_as_judging_not_as_a_request() -> None:
    from telemetry.fleet_usage import _amounts
    from telemetry.ledger import LedgerRow

    row = LedgerRow(request_id="judge:r1", ts=1.0, tenant="_operator", app="acme", lane="judge", model="big-70b",
                    requested_model="big-70b", operation="judge", stream=False, input_tokens=10, output_tokens=5,
                    cached_input_tokens=0, estimated=False, trimmed_tokens=0, cost=0.5, saved_cache=0.0, saved_edge=0.0,
                    saved_trim=0.0, status=200, complete=True, error_code=None, latency_ms=1.0, ttft_ms=None,
                    cache_status="off", route_score=None, judged_tenant="acme", judged_app="web")  # fmt: skip
    assert _amounts(row) == {"judge_requests": 1.0, "judge_input_tokens": 10.0, "judge_output_tokens": 5.0,
                             "judge_cost_usd": 0.5}  # fmt: skip


def _tool_answer(name: str, arguments: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]}
    return {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": message,
                                                                 "finish_reason": "tool_calls"}]}


class ToolPool(FakePool):
    """The other tier answers with a tool call."""

    def __init__(self, name: str, arguments: str) -> None:
        super().__init__()
        self.answer = _tool_answer(name, arguments)

    async def send(self, pool: str, path: str, body: dict[str, Any], **_: Any) -> Any:
        self.sent.append(body)
        return SimpleNamespace(status=200, body={**self.answer, "usage": {"prompt_tokens": 10, "completion_tokens": 5}},
                               api="chat", native=False)


class RecordingQuality(FakeQuality):
    def __init__(self) -> None:
        super().__init__()
        self.verdicts: list[bool] = []

    async def record(self, probe: Any, *, disagree: bool) -> None:
        self.verdicts.append(disagree)


@pytest.mark.parametrize(("theirs", "disagree"), [('{"limit": 20, "file_path": "a.py"}', False),
                                                   ('{"file_path": "b.py", "limit": 20}', True)])
async def test_a_tool_call_answer_is_judged_by_its_calls(tmp_path: Path, theirs: str, disagree: bool) -> None:
    """An agent's turn is a tool call with no text: judged by tool and arguments, never a failed judgement."""
    pool, clock = ToolPool("Read", theirs), FakeClock()
    hook = hook_for(tmp_path, pool, clock)
    quality = hook.services.route_quality = RecordingQuality()  # type: ignore[assignment]
    ours = Outcome(status=200, response=_tool_answer("Read", '{"file_path": "a.py", "limit": 20}'), complete=True,
                   finish_reasons=["tool_calls"])
    await hook.on_complete(tiered("acme", 1), ours)
    await hook.drain()
    assert len(pool.sent) == 1 and quality.verdicts == [disagree] and hook.failed == 0


async def test_a_re_ask_answered_in_messages_shape_is_judged_and_billed_like_a_chat_one(tmp_path: Path) -> None:
    telemetry = await telemetry_at(tmp_path / "state")
    try:
        hook = hook_for(tmp_path, MessagesPool(), FakeClock(), telemetry=telemetry)
        await hook.on_complete(tiered("acme", 1), answered())
        await hook.drain()
        await hook.close()
        assert (hook.tier_judged, hook.failed) == (1, 0)  # 41 against 42: judged by its text, not failed
        line = usage(telemetry)["_operator/acme"]
        assert (line["judge_requests"], line["judge_input_tokens"], line["judge_output_tokens"]) == (1, 1000, 500)
        assert line["judge_cost_usd"] == pytest.approx(1000 / 1000 * 10.0 + 500 / 1000 * 20.0)
    finally:
        await telemetry.close()
