"""cache.max_error_rate through a real gateway: a semantic hit is re-asked upstream by the shadow
stage, judged, and the judgement is on the tenant/app's error bound and on /metrics.

Real embedder, cache and verifier; the upstream is the fixed-answer stub (tests/support/faults.py),
so the re-asked answer agrees with the cached one and the hit is judged right.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from gateway.keys import SERVICES
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app

pytestmark = pytest.mark.slow  # the embedder loads a real model

QUESTION = "How long should I boil water to make it safe to drink?"
PARAPHRASE = "how long do i need to boil water so that it is safe to drink"
ANSWER = "Boil the water for ten minutes"


def chat(gw: Any, text: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Cache-Control": "no-store"}, timeout=60)


def test_a_semantic_hit_is_judged_for_the_bound_and_shown_on_metrics(bg, make_gateway):
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec, text=ANSWER))
    cache = {"enabled": True, "verify": {"min_probability": 0.5}, "max_error_rate": 0.02, "error_sample_rate": 1.0}
    gw = make_gateway(
        base={**PASS_THROUGH, "embedder": {"enabled": True}, "telemetry": {"tracing": False, "metrics": True, "metrics_auth": "none"},
              "policy": {**PASS_THROUGH["policy"], "cache": cache, "shadow": {"seed": 0}}},
        upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"], retries=0)],
    )  # fmt: skip
    try:
        first = httpx.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": QUESTION}]},
                           timeout=60)  # fmt: skip
        assert first.status_code == 200 and first.headers["x-tierlane-cache"] == "miss"
        deadline = time.monotonic() + 60  # polled: a bound only an answer never stored reaches
        while chat(gw, QUESTION).headers["x-tierlane-cache"] != "hit":  # stored after the answer was sent
            assert time.monotonic() < deadline
            time.sleep(0.02)
        para = chat(gw, PARAPHRASE)
        assert para.headers["x-tierlane-cache"] == "hit" and float(para.headers["x-tierlane-cache-similarity"]) < 1.0
        bounds = gw.app[SERVICES].cache.bounds
        deadline = time.monotonic() + 60
        while not (stats := bounds.stats()) or stats[0].observed < 1:  # the shadow call runs after the answer
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        (st,) = stats
        # judged right (the stub gives the cached answer again); only the semantic hit was re-asked
        assert (st.scope, st.observed, st.observed_wrong) == ("default/default", 1, 0), st
        assert rec.hits == 2 and st.lookups == 3 and st.hits == 2 and st.semantic_hits == 1
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        assert "tierlane_cache_judged_hits{" in metrics and "tierlane_cache_serve_threshold{" in metrics
    finally:
        up.stop()
