"""Settings the tests start gateways with."""

from __future__ import annotations

from typing import Any

# Every saving switched off: the gateway is a plain proxy (what the fault tests exercise).
PASS_THROUGH: dict[str, Any] = {
    "edge": {"enabled": False},
    "embedder": {"enabled": False},
    "telemetry": {"tracing": False, "metrics": False},
    "policy": {
        "cache": {"enabled": False},
        "router": {"enabled": False},
        "trim": {"enabled": False},
        "budgets": {"enabled": False},
        "cascade": {"enabled": False},
    },
}


def upstream_cfg(name: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "base_url": url, "retries": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.05, **extra}
