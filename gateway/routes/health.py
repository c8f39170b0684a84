"""Liveness and readiness."""

from __future__ import annotations

from aiohttp import web

from gateway.keys import SERVICES


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    services = request.app.get(SERVICES)
    checks: dict[str, object] = {}
    ready = services is not None
    if services is not None:
        if services.pool.has_upstreams():
            checks["upstreams"] = services.pool.status()
            ready = ready and services.pool.healthy()
        if services.engine is not None:
            edge_up = bool(services.engine.available)
            checks["edge"] = "loaded" if edge_up else "restarting"
            # a restarting edge is routed around; with no upstream to take over, the gateway is not ready
            ready = ready and (edge_up or services.pool.healthy())
            calibration = services.cascade.status if services.cascade is not None else None
            if calibration is not None:
                # NOTE: never a reason to be unready: an uncalibrated edge only takes no `auto` traffic
                checks["edge_calibration"] = calibration.to_json()
        if services.embedder is not None:
            # "torch" here means the ONNX export could not run; the log says why.
            checks["embedder"] = services.embedder.backend_name
            checks["embedder_precision"] = services.embedder.precision_name
        checks["startup_s"] = services.startup_s  # where the start's seconds went, part by part
    status = 200 if ready else 503
    return web.json_response({"status": "ready" if ready else "not ready", "checks": checks}, status=status)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
