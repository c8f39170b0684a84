"""The event-loop stall metric: a blocking call on the loop shows up on /metrics and in OTel."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.loop_monitor import LoopMonitor
from tests.unit.telemetry.conftest import TelemetryFactory

BLOCK_S = 0.3  # the deliberate stall; every assertion below is a lower bound it guarantees


def prometheus_values(text: str) -> dict[str, float]:
    """Sample name (with `le` for buckets) -> value, from a Prometheus exposition."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            le = sample.labels.get("le")
            out[sample.name if le is None else f"{sample.name}{{le={le}}}"] = sample.value
    return out


async def ticks_after(monitor: LoopMonitor, count: int) -> None:
    """Yield to the loop until the monitor has ticked `count` more times (bounded)."""
    target = monitor.ticks + count
    for _ in range(500):
        if monitor.ticks >= target:
            return
        await asyncio.sleep(monitor.interval_s)
    raise AssertionError("the loop monitor did not tick")


async def test_a_blocking_call_is_counted_as_a_stall_on_metrics_and_otel(make_telemetry: TelemetryFactory) -> None:
    h = await make_telemetry(loop_interval_s=0.01, loop_stall_s=0.1)
    monitor = h.telemetry.loop
    assert monitor is not None and monitor.running
    await ticks_after(monitor, 2)

    before = monitor.stalls
    time.sleep(BLOCK_S)  # noqa: ASYNC251 - the deliberate stall: every tick due meanwhile fires late
    await ticks_after(monitor, 2)

    assert monitor.stalls >= before + 1
    assert monitor.max_lag_s >= BLOCK_S - monitor.interval_s
    prom = prometheus_values(h.telemetry.render_metrics().decode())
    assert prom["tierlane_event_loop_stalls_total"] >= before + 1
    assert prom["tierlane_event_loop_lag_max_seconds"] >= BLOCK_S - monitor.interval_s
    assert prom["tierlane_event_loop_lag_seconds_count"] >= 3
    assert prom["tierlane_event_loop_lag_seconds_sum"] >= BLOCK_S - monitor.interval_s
    # the stalled tick is above the 250 ms bucket
    assert prom["tierlane_event_loop_lag_seconds_bucket{le=+Inf}"] > prom["tierlane_event_loop_lag_seconds_bucket{le=0.25}"]

    points = h.metric_points()
    assert points["tierlane.event_loop.stalls"][0].value >= before + 1
    assert points["tierlane.event_loop.lag.max"][0].value >= BLOCK_S - monitor.interval_s
    assert points["tierlane.event_loop.lag"][0].max >= BLOCK_S - monitor.interval_s

    await h.telemetry.close()
    assert not monitor.running


def test_each_reader_gets_the_largest_lateness_since_its_own_previous_read() -> None:
    monitor = LoopMonitor(interval_s=0.025, stall_s=0.1)
    scrape, export = monitor.window(), monitor.window()
    for lag in (0.002, 0.2, 0.05):
        monitor.observe(lag)
    assert scrape() == 0.2
    assert scrape() == 0.0  # read resets it
    monitor.observe(0.01)
    assert scrape() == 0.01
    assert export() == 0.2  # the other reader was not emptied by the first
    assert (monitor.ticks, monitor.stalls, monitor.max_lag_s) == (4, 1, 0.2)
    monitor.observe(0.1)  # the threshold itself is a stall
    assert monitor.stalls == 2


@pytest.mark.parametrize("config", [{"metrics": False}, {"loop_interval_s": 0}])
async def test_no_monitor_without_metrics_or_with_interval_zero(make_telemetry: TelemetryFactory, config: dict[str, Any]) -> None:
    h = await make_telemetry(**config)
    assert h.telemetry.loop is None


def test_bad_monitor_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        LoopMonitor(interval_s=0)
    with pytest.raises(ValueError, match="positive"):
        LoopMonitor(stall_s=-1)


def test_the_gateways_metrics_show_a_stall_of_its_loop(make_gateway: Any, bg: Any) -> None:
    gw = make_gateway(telemetry={"tracing": False, "metrics": True, "metrics_auth": "none", "loop_stall_ms": 100})
    before = prometheus_values(httpx.get(gw.url + "/metrics").text)
    assert "tierlane_event_loop_stalls_total" in before and "tierlane_event_loop_lag_max_seconds" in before

    async def block() -> None:
        time.sleep(BLOCK_S)  # noqa: ASYNC251 - the deliberate stall, on the gateway's own loop
        await asyncio.sleep(0.1)  # the late tick fires before this timer

    bg.call(block())
    after = prometheus_values(httpx.get(gw.url + "/metrics").text)
    assert after["tierlane_event_loop_stalls_total"] >= before["tierlane_event_loop_stalls_total"] + 1
    assert after["tierlane_event_loop_lag_max_seconds"] >= BLOCK_S - 0.025
