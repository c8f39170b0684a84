"""What a generation yields to its caller, and the state the scheduler keeps per sequence."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_engine.degeneration import LoopDetector, LowConfidenceRun
from edge_engine.sampling import Priority, Sampler, SamplingParams
from edge_engine.text import TokenText


@dataclass(slots=True, frozen=True)
class TokenInfo:
    """How sure the model was of one sampled token, from its raw logits (before penalties,
    temperature or grammar): log-probability of the token, entropy of the distribution (nats),
    and the `top_logprobs` most likely tokens with theirs when the request asked for them."""

    token: int
    piece: bytes
    logprob: float
    entropy: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass(slots=True, frozen=True)
class GenerationEvent:
    """New text as tokens are sampled; the last event has `finish_reason` and the exact usage."""

    text: str
    completion_tokens: int  # tokens sampled so far
    # on the last event: "stop" | "length" | "loop" (the output repeated itself; the repeats
    # still held back are dropped) | "low_confidence" (SamplingParams.low_confidence_run)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from a shared prefix
    # the tokens whose text this event releases (none for a matched stop string, an
    # end-of-generation token or dropped repeats), in order
    tokens: tuple[TokenInfo, ...] = ()


@dataclass(slots=True, eq=False)
class PrefixEntry:
    """A finished prompt kept in the KV cache under its own sequence id, for prefix reuse."""

    seq_id: int
    tokens: list[int]
    scope: str = ""  # whose prompt it was: only sequences of the same scope reuse it
    refs: int = 0
    last_used: float = 0.0


@dataclass(slots=True, eq=False)
class Sequence:
    """One request inside the scheduler; only the scheduler thread touches it once submitted."""

    prompt: list[int]
    params: SamplingParams
    max_new: int
    priority: Priority
    deliver: Callable[[Any], None]  # thread-safe: hands an event or exception to the caller
    enqueued_at: float
    # NOTE: KV reuse is scoped (by tenant, in the gateway): a shared prefix shows in cached
    # tokens and in time to first token, so reuse across scopes would let one tenant confirm
    # another's prompt token by token.
    scope: str = ""
    order: int = 0
    seq_id: int = -1
    n_past: int = 0  # positions already in the KV cache
    cached: int = 0  # of those, copied from a prefix instead of computed
    reserved: int = 0  # KV cells this sequence may still need, counted at admission
    prefix: PrefixEntry | None = None
    sampler: Sampler | None = None
    generated: int = 0
    last_token: int | None = None
    tokens: list[int] = field(default_factory=list)  # prompt + fed generated tokens, by position
    text: TokenText[TokenInfo] | None = None  # stop strings, and text released with its tokens
    loops: LoopDetector | None = None  # None: stop_on_loop off
    low_confidence: LowConfidenceRun | None = None
    first_token_at: float | None = None
    admitted_at: float = 0.0  # when it took a slot (edge.max_request_s counts from here)
    sampling_s: float = 0.0  # time its grammar sampler took in all (edge.grammar.max_sampling_ms)
    # speculative decoding (scheduler.py): whether this sequence may draft, its recent record
    # (draft tokens kept, drafts cut short; both decay) per kind of match, decode steps to wait,
    # times paused
    # per kind of match (0: short, 1: long, see speculative.py), and the kind of the draft in flight
    spec: bool = False
    hits: list[float] = field(default_factory=lambda: [0.0, 0.0])
    misses: list[float] = field(default_factory=lambda: [0.0, 0.0])
    draft_kind: int = 0
    spec_pause: int = 0
    spec_pauses: int = 0

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.prompt)
