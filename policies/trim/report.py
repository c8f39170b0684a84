"""What a trim did: tokens removed per pass, what was dropped, and a readable report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policies.trim.agent_context import MaskPlan
from policies.trim.config import LOSSLESS_PASSES
from policies.trim.messages import TokenCounter
from policies.trim.passes import Dropped


@dataclass(slots=True)
class TrimResult:
    """The trimmed request and the account of every token removed."""

    body: dict[str, Any]
    saved: dict[str, int]  # pass name -> tokens removed, every pass listed
    estimated: bool  # True when counted without the lane's tokenizer
    dropped: list[Dropped] = field(default_factory=list)
    source: list[dict[str, Any]] = field(default_factory=list, repr=False)
    counter: TokenCounter | None = field(default=None, repr=False)
    # observation masking's plan (applied when its mode is `on`, recorded either way)
    mask: MaskPlan = field(default_factory=MaskPlan.none)

    # Whole-prompt counts are computed on demand: the passes only count the messages they change.
    @property
    def input_tokens(self) -> int:
        return self.counter.messages(self.source) if self.counter else 0

    @property
    def output_tokens(self) -> int:
        return self.counter.messages(self.body["messages"]) if self.counter else 0

    @property
    def tokens_saved(self) -> int:
        return sum(self.saved.values())

    @property
    def lossless_saved(self) -> int:
        return sum(v for k, v in self.saved.items() if k in LOSSLESS_PASSES)

    @property
    def changed(self) -> bool:
        return self.tokens_saved > 0 or bool(self.dropped)

    @property
    def unchanged(self) -> bool:
        """Whether the messages are the input's own, each the same object in its place (none rewritten,
        dropped, inserted or masked): the request goes on as it came."""
        out = self.body["messages"]
        return len(out) == len(self.source) and all(a is b for a, b in zip(out, self.source))

    def nonzero(self) -> dict[str, int]:
        return {k: v for k, v in self.saved.items() if v}

    def summary(self) -> dict[str, Any]:
        """A JSON-able account, for the CLI and logs (no prompt text)."""
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "tokens_saved": self.tokens_saved,
            "lossless_saved": self.lossless_saved,
            "estimated": self.estimated,
            "saved_by_pass": dict(self.saved),
            "dropped": [
                {"index": d.index, "role": d.role, "tokens": d.tokens, "reason": d.reason} for d in self.dropped
            ],
        }

    def render(self) -> str:
        """A short table: one line per pass, then the dropped messages."""
        unit = "tokens (estimated)" if self.estimated else "tokens"
        lines = [f"trim: {self.input_tokens} -> {self.output_tokens} {unit}, saved {self.tokens_saved}"
                 f" ({self.lossless_saved} by lossless passes)"]
        for name, n in self.saved.items():
            tag = "lossless" if name in LOSSLESS_PASSES else "budgeted"
            lines.append(f"  {name:<12} {tag:<9} {n:>8}")
        for d in self.dropped:
            lines.append(f"  dropped messages[{d.index}] ({d.role}, {d.tokens} tokens): {d.reason}")
        return "\n".join(lines)
