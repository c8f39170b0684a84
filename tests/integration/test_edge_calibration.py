"""An edge model without its own calibration takes no `auto` traffic through the gateway, and one
calibrated in the background after start takes it up without a restart.

The edge runs the bundled model; "no calibration of its own" is what the gateway sees when the
artifact it is pointed at (edge.calibration) was measured on another file (its manifest's
gguf.sha256 edited) and the per-digest cache (a fresh directory) holds nothing. The prior and
confidence thresholds are pinned at 0 (`mode: threshold`), so a calibrated edge takes every `auto`
request: what keeps a request off it is the missing calibration alone.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from policies.edge_quality.artifact import MANIFEST_FILE, default_artifact_dir
from tests.support.config import PASS_THROUGH
from tests.support.llama_server import UPSTREAM_MODEL

pytestmark = pytest.mark.slow  # the edge engine and the embedder load real models

ALWAYS = {"mode": "threshold", "value": 0.0}
WAIT_S = 600.0  # a bound on a hang, not a timing assertion


def foreign_artifact(directory: Path) -> Path:
    """The shipped artifact, its manifest saying it was measured on another GGUF file."""
    shutil.copytree(default_artifact_dir(), directory)
    manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    manifest["gguf"] = {**manifest["gguf"], "file": "another-model.gguf", "sha256": "0" * 64}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return directory


def bundled_digest() -> str:
    from edge_engine import bundled_model_path
    from policies.edge_quality.lookup import model_digest

    return model_digest(bundled_model_path())


def start(make_gateway: Any, llama_upstream: Any, tmp_path: Path, **edge: Any) -> Any:
    policy = {
        **PASS_THROUGH["policy"],
        # the router alone would send every request to the edge at this threshold (as where the cascade
        # has no calibration to decide with): only the missing calibration keeps `auto` off it
        "router": {"enabled": True, "target": {"mode": "threshold", "value": 1.0}},
        "cascade": {"enabled": True, "prior": ALWAYS, "target": ALWAYS, "learn": {"enabled": False}},
    }
    base = {**PASS_THROUGH, "embedder": {"enabled": True}, "telemetry": {"tracing": False, "metrics": False},
            "edge": {"enabled": True, "n_ctx": 1024, "slots": 4, "n_threads": 1,
                     "calibration": str(foreign_artifact(tmp_path / "foreign")),
                     "calibration_cache": str(tmp_path / "calibration"), **edge}}
    return make_gateway(
        base=base,
        upstreams=[{"name": "llama", "base_url": llama_upstream.base_url, "models": [UPSTREAM_MODEL], "read_timeout_s": 120}],
        policy=policy,
    )


def ask(gw: Any, model: str = "auto", content: str = "What is 7 + 5?") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r


def ready(gw: Any) -> dict[str, Any]:
    r = httpx.get(gw.url + "/readyz", timeout=30)
    assert r.status_code == 200, r.text  # an uncalibrated edge never makes the gateway unready
    body: dict[str, Any] = r.json()
    assert body["status"] == "ready"
    return dict(body["checks"]["edge_calibration"])


def settle(gw: Any) -> list[str]:
    """The calibration states /readyz reports until the background run ends (consecutive repeats merged)."""
    seen: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        state = ready(gw)["calibration"]
        if not seen or seen[-1] != state:
            seen.append(state)
        if state != "calibrating":
            return seen
        time.sleep(0.5)
    raise AssertionError(f"the background calibration did not end: {seen}")


def test_an_uncalibrated_edge_takes_no_auto_traffic_but_answers_requests_naming_it(
        make_gateway: Any, llama_upstream: Any, tmp_path: Path) -> None:
    gw = start(make_gateway, llama_upstream, tmp_path)
    status = ready(gw)
    assert status["calibration"] == "missing" and status["auto_traffic"] is False
    assert status["model_sha256"] == bundled_digest()
    for content in ("What is 7 + 5?", "Name a colour of the sky.", "Spell cat backwards."):
        r = ask(gw, content=content)
        assert r.json()["model"] == UPSTREAM_MODEL
        assert r.headers["x-tierlane-lane"].startswith("upstream") and "reason=edge_uncalibrated" in r.headers[
            "x-tierlane-lane"], r.headers["x-tierlane-lane"]
    named = ask(gw, model="edge")
    assert named.headers["x-tierlane-lane"].startswith("edge"), named.headers["x-tierlane-lane"]
    assert named.json()["model"] != UPSTREAM_MODEL and named.json()["choices"][0]["message"]["content"]
    assert not (tmp_path / "calibration" / bundled_digest()).exists()  # nothing calibrates unless asked to


def test_a_background_calibration_opens_the_edge_to_auto_without_a_restart(
        make_gateway: Any, llama_upstream: Any, tmp_path: Path) -> None:
    gw = start(make_gateway, llama_upstream, tmp_path, calibrate_on_start="background", calibrate_limit=2,
               calibrate_min_probes=2)
    early = ask(gw)
    seen = settle(gw)
    assert seen[-1] == "ready" and set(seen) <= {"calibrating", "ready"}, seen
    if seen[0] == "calibrating":  # still calibrating after the early request ended: it went upstream
        assert "reason=edge_uncalibrated" in early.headers["x-tierlane-lane"], early.headers["x-tierlane-lane"]
    status = ready(gw)
    digest = bundled_digest()
    assert status["source"] == "calibrated" and status["artifact"] == str(tmp_path / "calibration" / digest)
    manifest = json.loads((tmp_path / "calibration" / digest / MANIFEST_FILE).read_text(encoding="utf-8"))
    assert manifest["gguf"]["sha256"] == digest and manifest["run"]["probes_used"] == 4
    later = ask(gw)
    lane = later.headers["x-tierlane-lane"]
    assert lane.startswith("edge") and lane.endswith("reason=calibration_edge"), lane
    assert later.json()["model"] != UPSTREAM_MODEL


def test_a_failed_background_calibration_is_reported_and_keeps_the_edge_off_auto(
        make_gateway: Any, llama_upstream: Any, tmp_path: Path) -> None:
    # a budget no probe fits in: the run ends with too few answers, and writes nothing
    gw = start(make_gateway, llama_upstream, tmp_path, calibrate_on_start=True, calibrate_limit=2,
               calibrate_min_probes=2, calibrate_budget_s=1e-9)
    assert settle(gw)[-1] == "failed"
    status = ready(gw)
    assert "budget" in status["error"] and status["auto_traffic"] is False
    assert "reason=edge_uncalibrated" in ask(gw).headers["x-tierlane-lane"]
    assert not (tmp_path / "calibration" / bundled_digest()).exists()
