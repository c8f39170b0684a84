"""Telemetry: OpenTelemetry traces and metrics, the usage ledger and Prometheus export."""
