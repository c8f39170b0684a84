"""OpenTelemetry tracer and meter providers, configured by the standard OTEL_* variables.

OTLP over HTTP/protobuf is used when OTEL_EXPORTER_OTLP_ENDPOINT (or the per-signal
OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT) is set; tests hand in in-memory exporters.
A signal with nowhere to go gets no provider at all, so it costs nothing per request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)

log = logging.getLogger(__name__)

DEFAULT_EXPORT_INTERVAL_MS = 60_000


@dataclass(slots=True)
class Providers:
    """The SDK providers one Telemetry owns; None where that signal is off."""

    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None

    def force_flush(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush()
        if self.meter_provider is not None:
            self.meter_provider.force_flush()

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


def parse_pairs(text: str | None) -> dict[str, str]:
    """`k1=v1,k2=v2` (percent-encoded values), the format of OTEL_RESOURCE_ATTRIBUTES and *_HEADERS."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[unquote(key.strip())] = unquote(value.strip())
    return out


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _endpoint(env: Mapping[str, str], signal: str) -> str | None:
    specific = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    if specific:
        return specific
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not base:
        return None
    return base.rstrip("/") + f"/v1/{signal}"


def _headers(env: Mapping[str, str], signal: str) -> dict[str, str]:
    headers = parse_pairs(env.get("OTEL_EXPORTER_OTLP_HEADERS"))
    headers.update(parse_pairs(env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_HEADERS")))
    return headers


def _protocol_check(env: Mapping[str, str], signal: str) -> None:
    protocol = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "http/protobuf":
        log.warning("OTLP protocol %r is not available here; exporting %s over http/protobuf", protocol, signal)


def sampler_from_env(env: Mapping[str, str]) -> Sampler:
    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
    arg = env.get("OTEL_TRACES_SAMPLER_ARG")
    try:
        ratio = float(arg) if arg else 1.0
    except ValueError:
        log.warning("OTEL_TRACES_SAMPLER_ARG %r is not a number; sampling everything", arg)
        ratio = 1.0
    samplers: dict[str, Sampler] = {
        "always_on": ALWAYS_ON,
        "always_off": ALWAYS_OFF,
        "traceidratio": TraceIdRatioBased(ratio),
        "parentbased_always_on": ParentBased(ALWAYS_ON),
        "parentbased_always_off": ParentBased(ALWAYS_OFF),
        "parentbased_traceidratio": ParentBased(TraceIdRatioBased(ratio)),
    }
    if name not in samplers:
        log.warning("unknown OTEL_TRACES_SAMPLER %r; using parentbased_always_on", name)
    return samplers.get(name, samplers["parentbased_always_on"])


def build_resource(service_name: str, env: Mapping[str, str]) -> Resource:
    attributes: dict[str, str] = {"service.name": service_name}
    attributes.update(parse_pairs(env.get("OTEL_RESOURCE_ATTRIBUTES")))
    if env.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = env["OTEL_SERVICE_NAME"]
    return Resource.create(attributes)


def _span_exporter(env: Mapping[str, str]) -> SpanExporter | None:
    kind = (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    if kind == "console":
        return ConsoleSpanExporter()
    if kind != "otlp":
        return None
    endpoint = _endpoint(env, "traces")
    if endpoint is None:
        return None
    _protocol_check(env, "traces")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint, headers=_headers(env, "traces"))


def _metric_reader(env: Mapping[str, str]) -> MetricReader | None:
    kind = (env.get("OTEL_METRICS_EXPORTER") or "otlp").strip().lower()
    endpoint = _endpoint(env, "metrics")
    if kind != "otlp" or endpoint is None:
        return None
    _protocol_check(env, "metrics")
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    try:
        interval = float(env.get("OTEL_METRIC_EXPORT_INTERVAL") or DEFAULT_EXPORT_INTERVAL_MS)
    except ValueError:
        interval = DEFAULT_EXPORT_INTERVAL_MS
    return PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=endpoint, headers=_headers(env, "metrics")),
        export_interval_millis=interval,
    )


def build_providers(
    service_name: str,
    *,
    tracing: bool,
    metrics: bool,
    env: Mapping[str, str],
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> Providers:
    """Providers for the signals that are on and have an exporter; the caller owns their shutdown."""
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return Providers(None, None)
    resource = build_resource(service_name, env)
    tracer_provider = None
    if tracing:
        processor: SpanProcessor | None
        if span_exporter is not None:
            processor = SimpleSpanProcessor(span_exporter)
        else:
            exporter = _span_exporter(env)
            processor = None if exporter is None else BatchSpanProcessor(exporter)
        if processor is not None:
            tracer_provider = TracerProvider(
                sampler=sampler_from_env(env), resource=resource, shutdown_on_exit=False
            )
            tracer_provider.add_span_processor(processor)
    meter_provider = None
    if metrics:
        reader = metric_reader if metric_reader is not None else _metric_reader(env)
        if reader is not None:
            meter_provider = MeterProvider(metric_readers=[reader], resource=resource, shutdown_on_exit=False)
    return Providers(tracer_provider, meter_provider)
