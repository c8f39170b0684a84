"""A client that leaves while its answer is written is a 499 everywhere: no ERROR log, no 500 span."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway.auth import KeyTable
from gateway.keys import SETTINGS
from gateway.middleware import build_middleware
from gateway.settings import Settings
from telemetry.spans import _error_type
from tests.support.config import PASS_THROUGH


def test_a_client_gone_mid_write_is_re_raised_quietly(caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings.load(env={}, overrides=PASS_THROUGH)
    app = web.Application()
    app[SETTINGS] = settings

    async def handler(request: web.Request) -> web.StreamResponse:
        raise ConnectionResetError("Cannot write to closing transport")

    middleware = build_middleware(KeyTable(settings.auth))
    request = make_mocked_request("POST", "/v1/messages", app=app)
    with caplog.at_level(logging.DEBUG, logger="gateway.middleware"), pytest.raises(ConnectionResetError):
        asyncio.run(middleware(request, handler))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # before: "unhandled error" with a traceback
    assert _error_type(ConnectionResetError()) == ("client_closed_request", 499)
    assert _error_type(asyncio.CancelledError()) == ("client_closed_request", 499)
