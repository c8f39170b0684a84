"""A real gateway in front of a small local upstream, for driving replays."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import GatewayFactory
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app


@pytest.fixture
def upstream(bg: BackgroundLoop) -> Any:
    rec = Recorder()
    app = RunningApp(bg, fault_app("ok", rec, text="forty two is the answer"))
    yield app, rec
    app.stop()


@pytest.fixture
def gateway(make_gateway: GatewayFactory, upstream: Any) -> RunningApp:
    app, _ = upstream
    return make_gateway(upstreams=[upstream_cfg("up", app.url + "/v1")])
