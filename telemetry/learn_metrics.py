"""The learned templates' counters on /metrics: pairs kept, skipped (by reason) and held, per template.

Labels are bounded: tenant and app through the telemetry's LabelBounds, template names are the
operator's (policy `learn`), skip reasons a fixed set (policies.learn.admission.SKIP_REASONS).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from policies.learn.service import TemplateStats

_LABELS = ["tenant", "app", "template"]


class LearnCollector:
    """Read at scrape time from the learning component's counters."""

    def __init__(self, read: Callable[[], list[TemplateStats]], tenant: Callable[[str], str], app: Callable[[str], str]) -> None:
        self._read = read
        self._tenant = tenant
        self._app = app

    def _families(self) -> tuple[CounterMetricFamily, CounterMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily("tierlane_learn_pairs_collected", "Upstream answers kept as pairs of a learned template",
                                labels=_LABELS),
            CounterMetricFamily("tierlane_learn_pairs_skipped", "Requests matching a learned template whose answer "
                                "was not kept, by reason", labels=[*_LABELS, "reason"]),
            GaugeMetricFamily("tierlane_learn_pairs", "Pairs a learned template holds in the store", labels=_LABELS),
        )  # fmt: skip

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        return list(self._families())

    def collect(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        collected: dict[tuple[str, ...], float] = {}
        skipped: dict[tuple[str, ...], float] = {}
        stored: dict[tuple[str, ...], float] = {}
        for st in self._read():  # unlisted tenants/apps are summed under `other`
            labels: tuple[str, ...] = (self._tenant(st.tenant), self._app(st.app), st.template)
            collected[labels] = collected.get(labels, 0.0) + st.collected
            stored[labels] = stored.get(labels, 0.0) + st.stored
            for reason, n in st.skipped.items():
                skipped[(*labels, reason)] = skipped.get((*labels, reason), 0.0) + n
        kept, dropped, held = self._families()
        for family, values in ((kept, collected), (dropped, skipped), (held, stored)):
            for names, value in sorted(values.items()):
                family.add_metric(list(names), value)
        return [kept, dropped, held]
