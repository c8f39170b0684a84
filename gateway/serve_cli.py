"""`tierlane serve` and `tierlane hash-key`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from typing import TYPE_CHECKING

from aiohttp import web

from gateway.auth import hash_key, new_key

if TYPE_CHECKING:
    from gateway.settings import Settings

log = logging.getLogger(__name__)


def _serve(args: argparse.Namespace) -> int:
    from gateway.app import create_app
    from gateway.settings import Settings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides: dict[str, dict[str, object]] = {}
    if args.host:
        overrides.setdefault("server", {})["host"] = args.host
    if args.port is not None:
        overrides.setdefault("server", {})["port"] = args.port
    try:
        settings = Settings.load(args.config, overrides=overrides)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError too
        print(f"tierlane: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    problem = model_problem(settings, args.config)
    if problem:
        print(f"tierlane: refusing to start: {problem}", file=sys.stderr, flush=True)
        return 2
    if settings.server.uvloop:
        _use_uvloop()
    app = create_app(settings)
    if settings.server.gc_freeze:
        # After the components' start-up (the cleanup context runs first among the start-up signals).
        app.on_startup.append(freeze_heap)
    log_exposure(settings)
    print(f"tierlane listening on http://{settings.server.host}:{settings.server.port}/v1", flush=True)
    print(start_hint(settings), flush=True)
    web.run_app(
        app,
        host=settings.server.host,
        port=settings.server.port,
        shutdown_timeout=settings.server.shutdown_timeout_s,
        handler_cancellation=True,
        access_log=None,
        print=None,
    )
    return 0


def model_problem(settings: Settings, config: str | None = None) -> str | None:
    """Why the edge model cannot be loaded as configured (missing, or unlike its pinned digest), or None.

    Checked before anything starts: the gateway never downloads, so a hub file not yet pulled is
    an error that names the command to run with this very settings file.
    """
    from edge_engine.model_source import ModelUnavailable
    from gateway.settings import Settings

    if not settings.edge.enabled:
        return None
    try:
        settings.edge.resolved_model_path(pull_command=Settings.pull_command(config))
    except ModelUnavailable as exc:
        return str(exc)
    return None


def start_hint(settings: Settings) -> str:
    """What a first run serves, and what to set for clients that send their own model names."""
    served = ["auto"] if settings.edge.enabled or settings.upstreams else []
    if settings.edge.enabled:
        served += [settings.edge.model_name, *settings.edge.aliases]
    for upstream in settings.upstreams:
        served += [f"{m} (upstream {upstream.name})" for m in upstream.models]
    lines = [f"tierlane models: {', '.join(served) or 'none (no edge lane, no upstreams)'}"]
    if settings.model_aliases:
        lines.append("tierlane model_aliases: " + ", ".join(f"{k} -> {v}" for k, v in settings.model_aliases.items()))
    else:
        lines.append("tierlane: coding agents send their own model names (claude-*, gpt-*); map them with "
                     "TIERLANE_MODEL_ALIASES='claude-*=auto,gpt-*=auto' (or model_aliases in the config file)")
    if not settings.upstreams:
        lines.append("tierlane: no upstreams: the edge lane answers everything; add one with TIERLANE_UPSTREAM_URL")
    return "\n".join(lines)


async def freeze_heap(app: web.Application) -> None:
    """Collect once, then freeze what is alive: modules, settings, models, indexes, pools.

    NOTE: a full (generation 2) collection walks every tracked object; with the libraries the
    gateway imports that is about 150,000 of them, some 120 ms of CPU on a shared 2-core machine,
    which every request in flight waits out (at 16 in flight, the pass-through's p99 tail). Frozen objects are never walked again (nor collected:
    what start-up built lives as long as the process), so a full collection costs what the
    requests of the moment allocated. One process per gateway, so it runs here and not in
    `create_app`, which tests call many times in one process.
    """
    gc.collect()
    gc.freeze()
    log.debug("froze %d objects out of the cyclic GC after start-up", gc.get_freeze_count())


def log_exposure(settings: Settings) -> None:
    """One line at start naming the auth mode and the listen address; a warning when it is risky."""
    from gateway.settings import is_loopback

    auth, host, port = settings.auth, settings.server.host, settings.server.port
    where = f"{host}:{port}" + (" (loopback only)" if is_loopback(host) else " (reachable from the network)")
    metrics = "public" if settings.telemetry.metrics_auth == "none" else "global admin key"
    if auth.mode == "open":
        # Settings refuse open mode off loopback unless allow_open_on_network says otherwise.
        log.warning(
            "auth mode open on %s: every caller is a global admin of tenant 'default' "
            "(usage, cache purge, /metrics)%s",
            where,
            "; allow_open_on_network is set" if not is_loopback(host) else "",
        )
        return
    admins = sum(1 for k in auth.keys if k.admin and k.admin_scope == "global")
    tenant_admins = sum(1 for k in auth.keys if k.admin and k.admin_scope == "tenant")
    level = logging.INFO if auth.keys else logging.WARNING
    log.log(
        level,
        "auth mode keys on %s: %d keys (%d global admin, %d tenant admin)%s; /metrics: %s",
        where, len(auth.keys), admins, tenant_admins,
        "" if auth.keys else " - every request will get 401", metrics,
    )


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        logging.getLogger(__name__).info("uvloop is not installed; using asyncio's own loop")
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _hash_key(args: argparse.Namespace) -> int:
    key = args.key or new_key()
    if not args.key:
        print(f"key:    {key}")
    print(f"sha256: {hash_key(key)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", help="YAML settings file (default: $TIERLANE_CONFIG or the embedded defaults)")
    serve.add_argument("--host", help="listen address (overrides the settings)")
    serve.add_argument("--port", type=int, help="listen port (overrides the settings)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=_serve)
    hk = sub.add_parser("hash-key", help="make an API key (or hash a given one) for auth.keys in the settings")
    hk.add_argument("key", nargs="?", help="an existing key to hash; omit to generate a new one")
    hk.set_defaults(func=_hash_key)
