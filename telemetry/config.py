"""What the telemetry is configured with, taken from the gateway settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telemetry.ledger import DEFAULT_COMMIT_WINDOW_S
from telemetry.loop_monitor import DEFAULT_INTERVAL_S, DEFAULT_STALL_S
from telemetry.retention import Retention


@dataclass(slots=True, frozen=True, kw_only=True)
class TelemetryConfig:
    """Switches and label lists for tracing, metrics and metering (the ledger and budgets)."""

    state_dir: Path
    service_name: str = "tierlane"
    tenants: tuple[str, ...] = ()  # tenant label values allowed on metrics; others are "other"
    apps: tuple[str, ...] = ()
    models: tuple[str, ...] = ()  # model label values allowed besides the priced models
    tracing: bool = True
    metrics: bool = True
    metering: bool = True  # ledger rows, cost, budgets
    record_content: bool = False  # prompt and answer text on spans: only when the operator opts in
    commit_window_s: float = DEFAULT_COMMIT_WINDOW_S
    upstream_provider: str = "openai"  # gen_ai.provider.name of the upstream lane
    loop_interval_s: float = DEFAULT_INTERVAL_S  # the event-loop stall timer's period; 0: no loop monitor
    loop_stall_s: float = DEFAULT_STALL_S  # a tick this late counts as a stall
    # NOTE: None (keep everything) here, so a Telemetry built by hand never drops rows it is given;
    # the gateway's settings default to a week of rows and 400 days of hourly totals.
    ledger_retention: Retention = Retention()

    @classmethod
    def from_settings(cls, settings: Any) -> TelemetryConfig:
        """From `gateway.settings.Settings`."""
        t = settings.telemetry
        edge = getattr(settings, "edge", None)
        models = (edge.model_name, *edge.aliases) if edge is not None else ()
        return cls(
            state_dir=Path(settings.state_dir),
            service_name=t.service_name,
            tenants=tuple(t.tenants),
            apps=tuple(t.apps),
            models=tuple(models),
            tracing=t.tracing,
            metrics=t.metrics,
            metering=getattr(t, "metering", True),
            record_content=t.record_content,
            loop_interval_s=getattr(t, "loop_interval_ms", DEFAULT_INTERVAL_S * 1000.0) / 1000.0,
            loop_stall_s=getattr(t, "loop_stall_ms", DEFAULT_STALL_S * 1000.0) / 1000.0,
            ledger_retention=Retention(rows_s=_seconds(getattr(t, "ledger_retention_hours", None), 3600.0),
                                       hours_s=_seconds(getattr(t, "ledger_hourly_retention_days", None), 86400.0)),
        )


def _seconds(value: float | None, unit: float) -> float | None:
    return None if value is None else value * unit
