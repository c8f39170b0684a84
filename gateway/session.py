"""A conversation's key, whichever API it came in on: what the ledger groups by and the pool pins to a member."""

from __future__ import annotations

from typing import Any

SESSION_ATTRIBUTE = "tierlane.session"
# A client may name its conversation itself (any API); the front doors also read their own fields.
SESSION_HEADER = "x-tierlane-session"
# The longest session key kept (a client's id may be anything; the ledger keeps this much).
MAX_SESSION_CHARS = 200


def session_key(*candidates: Any) -> str | None:
    """The first non-empty string of `candidates`, cut to MAX_SESSION_CHARS."""
    for value in candidates:
        if isinstance(value, str) and value.strip():
            return value.strip()[:MAX_SESSION_CHARS]
    return None
