"""Typed keys for what the application holds (aiohttp's AppKey instead of string keys)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from gateway.context import Principal, RequestContext
from gateway.errors import GatewayError
from gateway.pipeline.resolve import ModelCatalog
from gateway.pipeline.runner import Pipeline
from gateway.services import Services
from gateway.settings import Settings

# An API's error body for a failure (the error and the request id): see gateway.middleware.
ErrorFormat = Callable[[GatewayError, str], bytes]

SETTINGS = web.AppKey("settings", Settings)
SERVICES = web.AppKey("services", Services)
PIPELINE = web.AppKey("pipeline", Pipeline)
MODELS = web.AppKey("models", ModelCatalog)
# Path prefix -> error shape, for the front doors whose API is not OpenAI's (filled by their routes).
ERROR_FORMATS = web.AppKey("error_formats", dict[str, ErrorFormat])

REQUEST_ID = web.RequestKey("request_id", str)
RECEIVED_AT = web.RequestKey("received_at", float)
PRINCIPAL = web.RequestKey("principal", Principal)
CONTEXT = web.RequestKey("ctx", RequestContext)
BODY_BYTES = web.RequestKey("body_bytes", int)  # the size of the body as read (inflated), where it was read
