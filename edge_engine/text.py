"""Turning sampled tokens into text: incremental UTF-8 decoding, stop-sequence matching, and
releasing each token's record together with its text."""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class StopMatcher:
    """Holds back text that may be the start of a stop sequence until it is decided."""

    stops: list[str]
    held: str = ""
    decoded: int = 0  # characters decoded so far (emitted or held)
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    @property
    def partial(self) -> bool:
        """Whether the decoder holds the first bytes of a character still to come."""
        return bool(self._decoder.getstate()[0])

    def feed(self, piece: bytes) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop sequence was hit)."""
        new = self._decoder.decode(piece)
        self.decoded += len(new)
        self.held += new
        if not self.stops:
            out, self.held = self.held, ""
            return out, False
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.held = self.held[:cut], ""
            return out, True
        keep = self._partial_suffix()
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        return out, False

    def flush(self) -> str:
        """Whatever is still held once generation ends without a stop."""
        tail = self._decoder.decode(b"", final=True)
        self.decoded += len(tail)
        out = self.held + tail
        self.held = ""
        return out

    def _partial_suffix(self) -> int:
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.held)), longest, -1):
                if self.held.endswith(stop[:n]):
                    longest = n
                    break
        return longest


@dataclass(slots=True, eq=False)
class _Pending(Generic[T]):
    index: int  # the token's place in the output
    info: T
    start: int  # where its text starts, in decoded characters
    end: int | None  # where it ends; None while its last character is incomplete


class TokenText(Generic[T]):
    """Releases text and the records of the tokens that made it, together.

    A token's record goes out with the event that carries the last of its text: the stop
    matcher may hold text back, and the caller may hold back the latest tokens (`hold`: a
    repeat in progress, dropped if it turns out to be a loop). Records of tokens that only
    make up a matched stop string, or that are dropped at the end, never go out.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stop = StopMatcher(stops)
        self._safe = ""  # past the stop matcher, not yet released
        self._released = 0  # characters released
        self._pending: deque[_Pending[T]] = deque()
        self._count = 0  # tokens pushed

    def push(self, piece: bytes, info: T, hold: int = 0) -> tuple[str, list[T], bool]:
        """Adds a token; returns (text released, records released, whether a stop sequence was hit).

        `hold`: keep the text and records of the latest `hold` tokens (this one included).
        """
        entry = _Pending(self._count, info, self._stop.decoded, None)
        self._count += 1
        self._pending.append(entry)
        out, hit = self._stop.feed(piece)
        if not self._stop.partial:
            for e in reversed(self._pending):
                if e.end is not None:
                    break
                e.end = self._stop.decoded
        self._safe += out
        if hit:
            # the text ends where the stop string starts: the records of tokens with text before it
            boundary = self._released + len(self._safe)
            return self._take(boundary), self._drain(lambda e: e.start < boundary), True
        first_held = self._count - hold
        boundary = self._released + len(self._safe)
        if hold:
            boundary = min(boundary, max(self._released, self._start_of(first_held)))
        return (
            self._take(boundary),
            self._drain(lambda e: e.index < first_held and e.end is not None and e.end <= boundary),
            False,
        )

    def finish(self, drop: int = 0) -> tuple[str, list[T]]:
        """All that is left, less the text and records of the latest `drop` tokens (as far as still held)."""
        self._safe += self._stop.flush()
        for e in self._pending:
            if e.end is None:
                e.end = self._stop.decoded
        first_dropped = self._count - drop
        boundary = self._released + len(self._safe)
        if drop:
            boundary = min(boundary, max(self._released, self._start_of(first_dropped)))
        text = self._take(boundary)
        records = self._drain(lambda e: e.index < first_dropped)
        self._safe, self._pending = "", deque()
        return text, records

    def _start_of(self, index: int) -> int:
        if not self._pending or index < self._pending[0].index:
            return self._released
        if index >= self._count:
            return self._released + len(self._safe)
        return self._pending[index - self._pending[0].index].start

    def _take(self, boundary: int) -> str:
        n = boundary - self._released
        text, self._safe = self._safe[:n], self._safe[n:]
        self._released = boundary
        return text

    def _drain(self, ready: Callable[[_Pending[T]], bool]) -> list[T]:
        out: list[T] = []
        while self._pending and ready(self._pending[0]):
            out.append(self._pending.popleft().info)
        return out
