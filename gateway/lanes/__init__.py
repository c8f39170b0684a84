"""The lanes a request can take, and the names the client uses to choose one.

Defined once here; the resolve stage reads them from the request, the route stage decides
with them and the lanes only execute.
"""

from __future__ import annotations

from typing import Literal

AUTO = "auto"  # the model name (or route header value) that lets the router pick the lane
ROUTE_HEADER = "x-tierlane-route"  # the client's lane request: auto | edge | upstream
FORCEABLE: tuple[str, ...] = ("edge", "upstream")  # the lanes the route header can force
ROUTE_VALUES: tuple[str, ...] = (AUTO, *FORCEABLE)

RouteRequest = Literal["auto", "edge", "upstream"]
