"""Times in query parameters and reports: unix seconds, ISO dates and datetimes, UTC."""

from __future__ import annotations

import datetime as dt
from typing import Any

from gateway.errors import InvalidRequest


def parse_time(raw: Any, param: str, *, end_of_day: bool = False) -> float:
    """Unix seconds, an ISO date (a `to` date includes that whole day) or an ISO datetime (UTC if naive)."""
    text = str(raw).strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        if len(text) == 10:
            day = dt.date.fromisoformat(text)
            moment = dt.datetime.combine(day, dt.time(), dt.UTC)
            return (moment + dt.timedelta(days=1 if end_of_day else 0)).timestamp()
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(
            f"`{param}` must be unix seconds, YYYY-MM-DD or an ISO 8601 datetime, got {text!r}", param=param
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def iso_time(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")
