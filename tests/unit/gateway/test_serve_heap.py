"""`tierlane serve` freezes what start-up built out of the cyclic GC's full collections."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from gateway import serve_cli
from gateway.cli import main
from gateway.keys import SERVICES


def _served_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **server: Any) -> web.Application:
    config = {
        "state_dir": str(tmp_path / "state"),
        "server": {"uvloop": False, "port": 18080, **server},
        "edge": {"enabled": False},
        "embedder": {"enabled": False},
        "telemetry": {"tracing": False},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    apps: list[web.Application] = []
    monkeypatch.setattr(serve_cli.web, "run_app", lambda app, **kw: apps.append(app))
    assert main(["serve", "--config", str(path)]) == 0
    return apps[-1]


def _tracked(obj: object) -> bool:
    """Whether the cyclic GC's collections still walk `obj` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_serve_freezes_the_components_after_they_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = _served_app(tmp_path, monkeypatch)
    assert serve_cli.freeze_heap in app.on_startup

    async def start_and_look() -> bool:
        runner = web.AppRunner(app)
        await runner.setup()  # the components start first (cleanup context), then the freeze
        try:
            return _tracked(app[SERVICES]) or _tracked(app[SERVICES].telemetry)
        finally:
            await runner.cleanup()

    gc.unfreeze()
    try:
        assert asyncio.run(start_and_look()) is False
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this process runs many gateways: give their objects back to the collector


def test_gc_freeze_false_leaves_the_heap_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = _served_app(tmp_path, monkeypatch, gc_freeze=False)
    assert serve_cli.freeze_heap not in app.on_startup
