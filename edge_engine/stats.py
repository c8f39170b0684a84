"""Rolling engine figures for telemetry: throughput over a recent window and TTFT percentiles."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class EngineStats:
    """Written by the scheduler thread, read by anyone; a lock guards the windows."""

    window_s: float = 10.0
    _steps: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=4096))
    _ttft: deque[float] = field(default_factory=lambda: deque(maxlen=512))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    cached_tokens_total: int = 0
    requests_total: int = 0
    rejected_total: int = 0
    step_failures_total: int = 0  # steps that raised; their sequences were failed
    restarts_total: int = 0  # schedulers started again after one failed
    spec_drafted_total: int = 0  # draft tokens decoded for verification
    spec_accepted_total: int = 0  # of those, kept (equal to the model's own greedy token)
    spec_steps_total: int = 0  # drafts verified (one per sequence per step that drafted)
    spec_skipped_steps_total: int = 0  # decode steps with drafts possible that had too many sequences
    loop_stops_total: int = 0  # sequences ended because their output repeated itself (finish_reason "loop")
    grammar_stops_total: int = 0  # sequences failed for using more grammar sampling time than edge.grammar allows
    low_confidence_stops_total: int = 0  # ended on a run of low-confidence tokens ("low_confidence")
    # seconds of a decode step of one sequence alone (no prompt piece, no draft): the lowest of the
    # recent ones, so the figure is the engine's own step cost, not what load adds to it
    _solo_decode: deque[float] = field(default_factory=lambda: deque(maxlen=64))

    def record_step(self, n_prefill: int, n_decode: int) -> None:
        with self._lock:
            self._steps.append((time.perf_counter(), n_prefill, n_decode))
            self.prefill_tokens_total += n_prefill
            self.decode_tokens_total += n_decode

    def record_solo_decode(self, seconds: float) -> None:
        with self._lock:
            self._solo_decode.append(seconds)

    def solo_decode_s(self) -> float | None:
        """The step cost of decoding one token of one sequence (the lowest recent one; None before any)."""
        with self._lock:
            return min(self._solo_decode) if self._solo_decode else None

    def record_draft(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.spec_drafted_total += drafted
            self.spec_accepted_total += accepted
            self.spec_steps_total += 1

    def record_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft.append(seconds)

    def snapshot(self) -> dict[str, float | int | None]:
        now = time.perf_counter()
        with self._lock:
            recent = [s for s in self._steps if now - s[0] <= self.window_s]
            ttft = np.asarray(self._ttft, dtype=np.float64)
            totals = {
                "prefill_tokens_total": self.prefill_tokens_total,
                "decode_tokens_total": self.decode_tokens_total,
                "cached_prompt_tokens_total": self.cached_tokens_total,
                "requests_total": self.requests_total,
                "rejected_total": self.rejected_total,
                "step_failures_total": self.step_failures_total,
                "restarts_total": self.restarts_total,
                "spec_drafted_tokens_total": self.spec_drafted_total,
                "spec_accepted_tokens_total": self.spec_accepted_total,
                "spec_drafts_total": self.spec_steps_total,
                "spec_skipped_steps_total": self.spec_skipped_steps_total,
                "loop_stops_total": self.loop_stops_total,
                "grammar_stops_total": self.grammar_stops_total,
                "low_confidence_stops_total": self.low_confidence_stops_total,
            }
            drafted = self.spec_drafted_total
            acceptance = self.spec_accepted_total / drafted if drafted else None
        span = max(1e-6, min(self.window_s, now - recent[0][0])) if recent else None
        return {
            **totals,
            "prefill_tokens_per_s": sum(s[1] for s in recent) / span if span else 0.0,
            "decode_tokens_per_s": sum(s[2] for s in recent) / span if span else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft.size else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft.size else None,
            "spec_acceptance_rate": acceptance,
        }
