"""Telemetry: OpenTelemetry traces and metrics, the usage ledger, budgets and Prometheus export."""

from telemetry.config import TelemetryConfig
from telemetry.core import Telemetry

__all__ = ["Telemetry", "TelemetryConfig"]
