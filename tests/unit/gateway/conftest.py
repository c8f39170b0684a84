"""A pass-through gateway in front of a well-behaved fake upstream, for input-validation tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app


@pytest.fixture
def ok_gateway(bg: Any, make_gateway: Any) -> RunningApp:
    """The gateway serves model `fake-model`; `gateway.rec` counts what reached the upstream."""
    rec = Recorder()
    up = RunningApp(bg, fault_app("ok", rec))
    gateway = make_gateway(upstreams=[upstream_cfg("a", up.url + "/v1", models=["fake-model"])])
    gateway.rec = rec  # type: ignore[attr-defined]
    return gateway
