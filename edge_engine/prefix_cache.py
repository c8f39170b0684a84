"""Prefix reuse: finished prompts kept in the KV cache under sequence ids of their own.

A new request whose prompt starts like a kept prompt (or like a running sequence) of the same
scope copies those cells instead of computing them. Entries are evicted least recently used
first, and never while a running sequence still borrows from one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

from edge_engine.events import PrefixEntry, Sequence


class KVCells(Protocol):
    """What the prefix cache needs of the context (a LlamaContext)."""

    n_ctx: int  # cells one sequence may use; with one unified pool, the pool
    per_sequence_streams: bool

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None: ...

    def copy_prefix(self, src: int, dst: int, n: int) -> None: ...


class PrefixCache:
    """The prefix entries, the sequence ids they may use and the KV cells they hold.

    Used only by the scheduler thread (it calls llama.cpp through `ctx`). Cells the entries
    hold count against the same `n_ctx` as the cells promised to running sequences, which
    the scheduler passes in as `reserved` wherever room is decided.
    """

    def __init__(self, ctx: KVCells, seq_ids: Iterable[int], *, enabled: bool, min_tokens: int) -> None:
        self.ctx = ctx
        self.enabled = enabled  # prefix_reuse
        self.min_tokens = min_tokens  # shorter common prefixes are recomputed
        self._free_ids = list(seq_ids)
        self.capacity = len(self._free_ids)  # prefix_slots
        self._entries: list[PrefixEntry] = []
        self.cells = 0  # KV cells held by the entries: len(tokens) of each

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> tuple[PrefixEntry, ...]:
        return tuple(self._entries)

    def best(
        self, prompt: list[int], scope: str, active: Iterable[Sequence]
    ) -> tuple[PrefixEntry | Sequence | None, int]:
        """The entry or running sequence to copy `prompt`'s first cells from, and how many (else None, 0)."""
        best: PrefixEntry | Sequence | None = None
        best_len = 0
        if not self.enabled:
            return None, 0
        # NOTE: candidates are filtered by scope: KV reuse must never cross tenants (a shared
        # prefix shows in cached tokens and in TTFT; see Sequence.scope).
        candidates: list[tuple[PrefixEntry | Sequence, list[int], int]] = [
            (p, p.tokens, len(p.tokens)) for p in self._entries if p.scope == scope
        ] + [(s, s.tokens, s.n_past) for s in active if s.scope == scope]
        best_cells = 0
        for source, tokens, limit in candidates:
            n = common_prefix(tokens, prompt, limit)
            # NOTE: the state API copies every cell of the source, so of equal prefixes take the
            # smallest source (a 1,500-cell prompt costs 6-50 ms to copy, a short one ~2 ms).
            if n > best_len or (n and n == best_len and limit < best_cells):
                best, best_len, best_cells = source, n, limit
        # at least one prompt token must be decoded to get logits for the first sample
        best_len = min(best_len, len(prompt) - 1)
        if best_len < self.min_tokens:
            return None, 0
        return best, best_len

    def make_room(self, need: int, reserved: int, keep: PrefixEntry | None = None) -> bool:
        """Evicts idle entries (least recently used first, never `keep`) until `need` more cells fit.

        `reserved`: cells already promised to running sequences. False: they do not fit even
        with every idle entry but `keep` evicted (and those have been evicted).
        """
        if self.ctx.per_sequence_streams:
            return True  # each sequence owns n_ctx cells; submit() caps prompt + completion at that
        while reserved + self.cells + need > self.ctx.n_ctx:
            idle = [p for p in self._entries if p.refs == 0 and p is not keep]
            if not idle:
                return False
            self._evict(min(idle, key=lambda p: p.last_used))
        return True

    def borrow(self, entry: PrefixEntry) -> None:
        """A sequence was admitted with `entry`'s cells: the entry is in use until give_back()."""
        entry.refs += 1
        entry.last_used = time.perf_counter()

    def give_back(self, entry: PrefixEntry) -> None:
        entry.refs -= 1

    def keep(self, seq: Sequence, reserved: int) -> PrefixEntry | None:
        """Copies a finished prompt's cells to a prefix entry so later requests can share them.

        `reserved`: cells promised to the other running sequences (not `seq`). Call it before
        `seq`'s cells are removed and before it gives back any entry it borrowed.
        """
        n = len(seq.prompt)
        if not self.enabled or self.capacity == 0 or n < self.min_tokens:
            return None
        if any(p.scope == seq.scope and common_prefix(p.tokens, seq.prompt, n) == n for p in self._entries):
            return None
        if not self._free_ids:
            idle = [p for p in self._entries if p.refs == 0]
            if not idle:
                return None
            self._evict(min(idle, key=lambda p: p.last_used))
        if not self.ctx.per_sequence_streams and reserved + self.cells + n > self.ctx.n_ctx:
            return None
        entry = PrefixEntry(
            seq_id=self._free_ids.pop(), tokens=list(seq.prompt), scope=seq.scope, last_used=time.perf_counter()
        )
        self.ctx.copy_prefix(seq.seq_id, entry.seq_id, n)
        self._entries.append(entry)
        self.cells += n
        return entry

    def _evict(self, entry: PrefixEntry) -> None:
        self.ctx.seq_rm(entry.seq_id)
        self._entries.remove(entry)
        self._free_ids.append(entry.seq_id)
        self.cells -= len(entry.tokens)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
