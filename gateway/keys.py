"""Typed keys for what the application holds (aiohttp's AppKey instead of string keys)."""

from __future__ import annotations

from aiohttp import web

from gateway.context import Principal, RequestContext
from gateway.pipeline.resolve import ModelCatalog
from gateway.pipeline.runner import Pipeline
from gateway.services import Services
from gateway.settings import Settings

SETTINGS = web.AppKey("settings", Settings)
SERVICES = web.AppKey("services", Services)
PIPELINE = web.AppKey("pipeline", Pipeline)
MODELS = web.AppKey("models", ModelCatalog)

REQUEST_ID = web.RequestKey("request_id", str)
RECEIVED_AT = web.RequestKey("received_at", float)
PRINCIPAL = web.RequestKey("principal", Principal)
CONTEXT = web.RequestKey("ctx", RequestContext)
