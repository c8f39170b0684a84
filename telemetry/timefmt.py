"""Times in query parameters and reports: unix seconds, ISO dates and datetimes, UTC."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from policies.errors import InvalidInput

# The times a parameter may name: 1970-01-01T00:00:00Z up to the last second `iso_time` can
# render (9999-12-31T23:59:59Z). Outside it, NaN and the infinities would reach SQLite, date
# arithmetic or `datetime.fromtimestamp` and fail there, as a 500 instead of a 400.
MIN_TS = 0.0
MAX_TS = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC).timestamp()
TIME_BOUNDS = "1970-01-01T00:00:00Z and 9999-12-31T23:59:59Z (UTC)"


def parse_time(raw: Any, param: str, *, end_of_day: bool = False) -> float:
    """Unix seconds, an ISO date (a `to` date includes that whole day) or an ISO datetime (UTC if naive).

    Raises InvalidInput naming `param` for garbage, NaN, infinities and times outside
    1970-01-01 .. 9999-12-31 (MIN_TS .. MAX_TS); the end of the day 9999-12-31 is MAX_TS.
    """
    text = str(raw).strip()
    try:
        number: float | None = float(text)  # also "nan", "inf" and "1e300": checked below
    except ValueError:
        number = None
    if number is not None:
        return _in_range(number, text, param)
    try:
        if len(text) == 10:
            day = dt.date.fromisoformat(text)
            ts = _in_range(dt.datetime.combine(day, dt.time(), dt.UTC).timestamp(), text, param)
            # NOTE: seconds rather than `+ timedelta(days=1)`, which overflows on 9999-12-31.
            return min(ts + 86400.0, MAX_TS) if end_of_day else ts
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=dt.UTC)
        ts = moment.timestamp()
    except (ValueError, OverflowError):
        raise InvalidInput(
            f"`{param}` must be unix seconds, YYYY-MM-DD or an ISO 8601 datetime, got {text!r}", param=param
        ) from None
    return _in_range(ts, text, param)


def _in_range(ts: float, text: str, param: str) -> float:
    if not math.isfinite(ts) or not MIN_TS <= ts <= MAX_TS:
        raise InvalidInput(
            f"`{param}` must lie between {TIME_BOUNDS}, got {text!r}", param=param
        )
    return ts


def iso_time(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")
