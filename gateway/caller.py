"""Who asks and with what: the part of an HTTP request a front door builds a RequestContext from.

A front door's handler takes it from the request (`Caller.of`); the Batch API's runner makes one
for each line of a job, so a line becomes the same context its endpoint's handler would build,
without an HTTP request to itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

from gateway.keys import PRINCIPAL, RECEIVED_AT, REQUEST_ID, SETTINGS
from gateway.settings import Settings
from policies.domain import Principal


@dataclass(frozen=True, slots=True)
class Caller:
    """The request's id, principal, headers and arrival, and the settings it is checked against."""

    request_id: str
    principal: Principal
    headers: Mapping[str, str]
    received_at: float
    settings: Settings

    @classmethod
    def of(cls, request: web.Request) -> Caller:
        return cls(request_id=request[REQUEST_ID], principal=request[PRINCIPAL], headers=request.headers,
                   received_at=request[RECEIVED_AT], settings=request.app[SETTINGS])
