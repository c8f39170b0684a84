"""The replay chart: cost and savings by lane next to latency and TTFT percentiles by lane."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PERCENTILES = ("p50", "p95", "p99")


def write_chart(report: dict[str, Any], out_dir: Path) -> Path | None:
    """Render `replay.png` from a report made by `build_report`; None without matplotlib (the train extra)."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [lane for lane in report["lanes"] if lane != "error"] or list(report["lanes"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)

    cost = report["cost"]
    if cost["source"] is not None and cost["by_lane"]:
        names = list(cost["by_lane"])
        spent = [cost["by_lane"][n].get("cost_usd", 0.0) for n in names]
        saved = [cost["by_lane"][n].get("saved_usd", 0.0) for n in names]
        xs = range(len(names))
        left.bar([x - 0.2 for x in xs], spent, width=0.4, label="cost")
        left.bar([x + 0.2 for x in xs], saved, width=0.4, label="saved vs upstream")
        left.set_xticks(list(xs), names)
        left.set_ylabel("USD")
        left.set_title("cost and savings by lane")
        left.legend()
    else:
        tokens = [report["lanes"][n]["input_tokens"] + report["lanes"][n]["output_tokens"] for n in lanes]
        left.bar(lanes, tokens)
        left.set_ylabel("tokens")
        left.set_title("tokens by lane (no cost report from the gateway)")

    width = 0.8 / (2 * len(PERCENTILES))
    for i, p in enumerate(PERCENTILES):
        for j, (metric, hatch) in enumerate((("latency_ms", None), ("ttft_ms", "//"))):
            values = [report["lanes"][n][metric][p] or 0.0 for n in lanes]
            offset = (2 * i + j) * width - 0.4 + width / 2
            label = f"{'latency' if j == 0 else 'TTFT'} {p}"
            right.bar([x + offset for x in range(len(lanes))], values, width=width, label=label, hatch=hatch,
                      color=f"C{i}", alpha=1.0 if j == 0 else 0.6)
    right.set_xticks(list(range(len(lanes))), lanes)
    right.set_ylabel("ms")
    if any((report["lanes"][n]["latency_ms"]["p50"] or 0) > 0 for n in lanes):
        right.set_yscale("log")  # cache hits and upstream answers differ by orders of magnitude
    right.set_title("latency and time to first token by lane")
    right.legend(fontsize=7, ncol=2)

    totals = report["totals"]
    hit = totals["cache_hit_rate"]
    fig.suptitle(
        f"{totals['requests']} requests, {totals['errors']} errors, "
        f"cache hit rate {'-' if hit is None else f'{hit:.0%}'}"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "replay.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
