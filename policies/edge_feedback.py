"""What the cascade's verdicts teach the edge gate, per tenant/app, while the gateway runs.

Every `auto` request the edge tried ends with a verdict the gateway gets for free: the answer was
kept or escalated. Two things are learnt from them:

- *neighbours*: the embeddings of recent tried prompts and their verdicts. A prompt whose nearest
  recent neighbours (cosine >= `similarity`) were mostly escalated does not try the edge again;
- *net saving*: the edge's saving over the last `window` requests that reached this gate (kept
  answers save the counterfactual upstream price less the edge's; escalated ones cost the edge's
  tokens; a request held off the edge saves and costs nothing). While that sum is negative, each
  new verdict raises a margin on the calibration's prior threshold by `step` (an escalation: to
  above the prior of the prompt that escalated, at least) and nothing is tried beyond what the
  margin lets through; once held-off requests have pushed the losses out of the
  window (the sum is no longer negative), each request and verdict lowers the margin by `step / 4`,
  so the most likely prompts try again first. While the sum is not negative, one in `explore_every`
  requests that the margin alone keeps off the edge still tries it.

State is in memory, bounded (`memory` prompts per tenant/app, MAX_KEYS tenant/apps), and lost on
restart; a replica learns from its own traffic only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

MAX_KEYS = 256  # tenant/apps remembered; the least recently used is forgotten first


@dataclass(slots=True, frozen=True)
class FeedbackSettings:
    """The `cascade.learn` policy values."""

    enabled: bool = True
    memory: int = 512
    neighbours: int = 5
    min_neighbours: int = 3
    similarity: float = 0.85
    escalated_share: float = 0.6
    window: int = 50
    step: float = 0.05
    explore_every: int = 20


@dataclass(slots=True)
class _Memory:
    dimension: int
    capacity: int
    vectors: np.ndarray = field(init=False)
    escalated: np.ndarray = field(init=False)
    size: int = 0
    next: int = 0
    savings: deque[float] = field(default_factory=deque)
    margin: float = 0.0
    held_off: int = 0  # requests the margin alone kept off the edge (for exploration)

    def __post_init__(self) -> None:
        self.vectors = np.zeros((self.capacity, self.dimension), dtype=np.float32)
        self.escalated = np.zeros(self.capacity, dtype=bool)


@dataclass(slots=True, frozen=True)
class Gate:
    """The learnt part of one edge decision."""

    try_edge: bool
    reason: str  # "" | "calibration_history" (neighbours escalated) | "calibration_net_saving" (the margin)
    margin: float
    neighbours: int
    escalated_share: float | None


class EdgeFeedback:
    """Per tenant/app memory of verdicts; thread-safe (the route stage and the meter hook share it)."""

    def __init__(self) -> None:
        self._keys: OrderedDict[tuple[str, str], _Memory] = OrderedDict()
        self._lock = threading.Lock()

    def _memory(self, key: tuple[str, str], dimension: int, settings: FeedbackSettings) -> _Memory:
        found = self._keys.get(key)
        if found is None or found.dimension != dimension or found.capacity != settings.memory:
            found = self._keys[key] = _Memory(dimension, max(1, settings.memory))
            while len(self._keys) > MAX_KEYS:
                self._keys.popitem(last=False)
        self._keys.move_to_end(key)
        return found

    def gate(self, key: tuple[str, str], embedding: np.ndarray, prior: float, threshold: float,
             settings: FeedbackSettings) -> Gate:
        """Whether a prompt the calibration lets onto the edge (prior >= threshold) should try it."""
        vec = _unit(embedding)
        with self._lock:
            mem = self._memory(key, vec.shape[0], settings)
            count, share = _vote(mem, vec, settings)
            if count >= settings.min_neighbours and share is not None and share >= settings.escalated_share:
                _settle(mem, 0.0, settings, verdict=False)
                return Gate(False, "calibration_history", mem.margin, count, share)
            if prior < min(1.0, threshold + mem.margin):
                mem.held_off += 1
                explore = settings.explore_every > 0 and mem.held_off % settings.explore_every == 0
                if explore and sum(mem.savings) >= 0.0:
                    return Gate(True, "", mem.margin, count, share)  # its verdict enters the window
                _settle(mem, 0.0, settings, verdict=False)
                return Gate(False, "calibration_net_saving", mem.margin, count, share)
            return Gate(True, "", mem.margin, count, share)

    def record(self, key: tuple[str, str], embedding: np.ndarray, escalated: bool, saving: float,
               settings: FeedbackSettings, *, prior: float | None = None, threshold: float | None = None) -> None:
        """One verdict of an edge attempt and what it saved (negative: what it cost).

        With the attempt's `prior` and the prior `threshold` it was gated at, an escalation while the
        window is losing lifts the margin at once above that prior: prompts no likelier than one that
        just failed stop trying, rather than `step` by `step` while more attempts are lost.
        """
        vec = _unit(embedding)
        with self._lock:
            mem = self._memory(key, vec.shape[0], settings)
            mem.vectors[mem.next] = vec
            mem.escalated[mem.next] = escalated
            mem.next = (mem.next + 1) % mem.capacity
            mem.size = min(mem.size + 1, mem.capacity)
            floor = 0.0  # step 0: no net-saving margin at all
            if escalated and settings.step > 0 and prior is not None and threshold is not None:
                floor = prior - threshold + settings.step
            _settle(mem, float(saving), settings, verdict=True, floor=floor)

    def state(self, key: tuple[str, str]) -> dict[str, float] | None:
        """The margin, remembered prompts and windowed net saving of one tenant/app (None: nothing yet)."""
        with self._lock:
            mem = self._keys.get(key)
            if mem is None:
                return None
            return {"margin": mem.margin, "remembered": float(mem.size), "net_saving": float(sum(mem.savings)),
                    "window": float(len(mem.savings))}


def _settle(mem: _Memory, saving: float, settings: FeedbackSettings, *, verdict: bool, floor: float = 0.0) -> None:
    """One request into the net-saving window, and the margin moved.

    A verdict while the window's sum is negative tightens the gate (by `step`, and to at least
    `floor`); a held-off request never does (it only ages the losses out). Any request while the
    sum is not negative loosens it.
    """
    mem.savings.append(saving)
    while len(mem.savings) > max(1, settings.window):
        mem.savings.popleft()
    if sum(mem.savings) < 0.0:
        if verdict:
            mem.margin = min(1.0, max(mem.margin + settings.step, floor))
    else:
        mem.margin = max(0.0, mem.margin - settings.step / 4)


def _unit(embedding: np.ndarray) -> np.ndarray:
    vec = np.asarray(embedding, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(vec))
    return vec / norm if norm > 0 else vec


def _vote(mem: _Memory, vec: np.ndarray, settings: FeedbackSettings) -> tuple[int, float | None]:
    """(neighbours at or above the similarity among the k nearest, their escalated share)."""
    if mem.size == 0 or settings.neighbours <= 0:
        return 0, None
    sims = mem.vectors[: mem.size] @ vec
    k = min(settings.neighbours, mem.size)
    top = np.argpartition(-sims, k - 1)[:k]
    close = top[sims[top] >= settings.similarity]
    if close.size == 0:
        return 0, None
    return int(close.size), float(mem.escalated[: mem.size][close].mean())
