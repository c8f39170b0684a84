"""Turning sampled tokens into text: incremental UTF-8 decoding and stop-sequence matching."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field


@dataclass(slots=True)
class StopMatcher:
    """Holds back text that may be the start of a stop sequence until it is decided."""

    stops: list[str]
    held: str = ""
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    def feed(self, piece: bytes) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop sequence was hit)."""
        self.held += self._decoder.decode(piece)
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
        out = self.held + self._decoder.decode(b"", final=True)
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
